//! 8-bit AdamW (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022), as
//! bitsandbytes' `AdamW8bit`: both moments stored as one byte per element, block-wise
//! dynamic-tree quantized with an f32 absmax per block of 256, dequantized for the update and
//! re-quantized after it.
//!
//! Two departures from bitsandbytes. So that a shard's blocks are the full tensor's, blocks
//! run along rows (the last dims flattened), never across them, because every strategy
//! splits a parameter between rows: a row of `n` elements is cut into `ceil(n / 256)` blocks
//! of `min(n, 256)`. And vectors (biases, layer-norm gains: one row each) keep 32-bit state
//! whatever their size, where bitsandbytes quantizes any tensor of `--min-8bit-size` (4096)
//! elements or more; smaller tensors keep 32-bit state in both ([`AdamW8bit::quantizes`]).
//!
//! A step is written twice: in tensor operations (any device, any dtype), and for f32 in
//! host memory as one pass over each row (`step_host`), the same f32 operations in the same
//! order, so that the two agree bit for bit (a test holds them to it).

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use burn::tensor::{DType as TensorDType, FloatDType, IntDType};
use burnscale_nn::device_cache;
use rayon::prelude::*;
use std::sync::OnceLock;

use crate::fused_adamw::{f32_in_host_memory, f32s, f32s_mut, in_host_memory};

/// Elements per quantization block (bitsandbytes' block size for its 8-bit optimizers).
pub const BLOCK: usize = 256;

/// The most elements a step computes at once (or one row, if longer): a tensor is stepped
/// in chunks of whole rows, so that the update's temporaries (the dequantized moments, the
/// gradient, the update, the encoder's 8-byte keys) stay a few times 8-16 MB for a tensor of
/// many rows, however many (bitsandbytes' kernels bound them the same way, block by block).
/// Rows are independent, so the result is the same.
const CHUNK_ELEMS: usize = 1 << 21;

/// The dynamic map's exponents, as literals (parsed exactly, as the fixture script's are).
const SCALES: [f64; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];

/// The 256 values of bitsandbytes' dynamic tree map (`create_dynamic_map(signed)`): for
/// exponents 10^-6..10^0, a linear fraction between 0.1 and 1 with more steps the larger the
/// exponent, plus 0 and 1, sorted. In f32 throughout, as bitsandbytes builds it with PyTorch
/// on the CPU, so that the values are its own to the bit (checked by the fixture script
/// against bitsandbytes 0.50.2): `torch.linspace` in f32, the means of neighbours, their
/// products with the exponent rounded to f32.
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut data = Vec::with_capacity(256);
    for (i, scale) in SCALES.into_iter().enumerate() {
        let items = if signed {
            (1 << i) + 1
        } else {
            (1 << (i + 1)) + 1
        };
        let boundaries = torch_linspace(0.1, 1.0, items);
        for pair in boundaries.windows(2) {
            let mean = (pair[0] + pair[1]) / 2.0;
            data.push(scale as f32 * mean);
            if signed {
                data.push(-scale as f32 * mean);
            }
        }
    }
    data.extend([0.0, 1.0]);
    data.sort_by(f32::total_cmp);
    let mut map = [0f32; 256];
    map.copy_from_slice(&data);
    map
}

/// `torch.linspace(start, end, items, dtype=torch.float32)` as PyTorch's x86-64 CPU kernel
/// computes it: an f32 step, the first half counted up from `start` and the rest down from
/// `end`, each value one fused multiply-add.
fn torch_linspace(start: f32, end: f32, items: usize) -> Vec<f32> {
    let step = (end - start) / (items - 1) as f32;
    (0..items)
        .map(|k| match k < items / 2 {
            true => step.mul_add(k as f32, start),
            false => (-step).mul_add((items - k - 1) as f32, end),
        })
        .collect()
}

/// Keys of the encoder's lookup (see [`Codebook`]), over the whole of [-1, 1].
const KEYS: usize = 8192;

/// The encoder's key of `x` in [-1, 1], as a real number: `(1 + sign(x) |x|^(1/4)) KEYS / 2`,
/// in [0, KEYS]. The fourth root spreads the map's thresholds (10^-7 to 1 apart by up to five
/// decades) to at least 3 keys apart.
fn key_position(x: f64) -> f64 {
    (1.0 + x.signum() * x.abs().powf(0.25)) * (KEYS / 2) as f64
}

/// A dynamic map on a device, with a lookup that encodes in two gathers instead of a binary
/// search over 256 entries (eight gathers, each the size of the tensor).
///
/// Code `c` of `x` is the number of thresholds `t_j <= x`, where `t_j` is the float just above
/// the midpoint between map values `j` and `j + 1` (so a tie at a midpoint goes to the lower
/// value), except that in the signed map the threshold between the smallest negative value and
/// 0 is 0 itself: as in bitsandbytes, a negative value never rounds to zero, it keeps its
/// sign. On the device, `x`'s key `k` is its [`key_position`] truncated, which is within one key
/// of the exact position; the thresholds are at least 3 keys apart, so at most one of them
/// (`threshold[k]`, else +inf) lies within one key of `k`, and `below[k]` counts those
/// surely under `x`: the code is `below[k] + (x >= threshold[k])`, exactly the binary
/// search's.
#[derive(Clone)]
struct Codebook {
    values: Tensor<2>,    // [256, 1]
    below: Tensor<2>,     // [KEYS + 1, 1], codes as f32
    threshold: Tensor<2>, // [KEYS + 1, 1]
}

/// A [`Codebook`]'s tables on the host, built once per map.
struct Tables {
    values: [f32; 256],
    below: Vec<f32>,
    threshold: Vec<f32>,
}

impl Tables {
    fn of(signed: bool) -> &'static Self {
        static SIGNED: OnceLock<Tables> = OnceLock::new();
        static UNSIGNED: OnceLock<Tables> = OnceLock::new();
        let cell = if signed { &SIGNED } else { &UNSIGNED };
        cell.get_or_init(|| Self::build(signed))
    }

    fn build(signed: bool) -> Self {
        let values = dynamic_map(signed);
        let thresholds: Vec<f32> = values
            .windows(2)
            .map(|pair| match (pair[0] < 0.0, pair[1] == 0.0) {
                (true, true) => 0.0,
                _ => ((pair[0] + pair[1]) / 2.0).next_up(),
            })
            .collect();
        let positions: Vec<f64> = thresholds.iter().map(|&t| key_position(t.into())).collect();
        let (below, threshold) = (0..=KEYS)
            .map(|key| {
                let key = key as f64;
                let below = positions.partition_point(|&p| p <= key - 1.0);
                let threshold = match positions.get(below) {
                    Some(&p) if p < key + 2.0 => thresholds[below],
                    _ => f32::INFINITY,
                };
                (below as f32, threshold)
            })
            .unzip();
        Self {
            values,
            below,
            threshold,
        }
    }

    /// One block's codes written to `codes`, as [`Blocks::quantize`] and [`Codebook::encode`]
    /// compute them, in the same f32 operations (the keys in a loop of their own, which
    /// vectorises, then the lookups); returns the block's absolute maximum.
    fn quantize(&self, block: &[f32], codes: &mut [u8]) -> f32 {
        let absmax = block.iter().fold(0f32, |max, x| max.max(x.abs()));
        let divisor = if absmax == 0.0 { 1.0 } else { absmax };
        let half = (KEYS / 2) as f32;
        let (mut normed, mut keys) = ([0f32; BLOCK], [0i32; BLOCK]);
        for ((normed, key), &x) in normed.iter_mut().zip(&mut keys).zip(block) {
            let x = x / divisor;
            let root_2 = x.abs().sqrt();
            let root_4 = root_2.sqrt();
            let signed_root = x / (root_2 * root_4 + 1e-30);
            (*normed, *key) = (x, (signed_root * half + half) as i32);
        }
        for ((code, &x), &key) in codes.iter_mut().zip(&normed).zip(&keys) {
            let key = key as usize;
            let above = if x >= self.threshold[key] { 1.0 } else { 0.0 };
            *code = (self.below[key] + above) as u8;
        }
        absmax
    }

    /// One block's values from its `codes` and `absmax`, as [`Blocks::dequantize`] gives them.
    fn dequantize(&self, codes: &[u8], absmax: f32, out: &mut [f32]) {
        for (out, &code) in out.iter_mut().zip(codes) {
            *out = self.values[code as usize] * absmax;
        }
    }
}

impl Codebook {
    /// The map's tables on `device`, uploaded once per thread and device.
    fn on(signed: bool, device: &Device) -> Self {
        device_cache::cached("8-bit codebook", signed, device, || {
            let tables = Tables::of(signed);
            let column = |v: &[f32]| {
                Tensor::from_data(
                    TensorData::new(v.to_vec(), [v.len(), 1]),
                    (device, TensorDType::F32),
                )
            };
            Self {
                values: column(&tables.values),
                below: column(&tables.below),
                threshold: column(&tables.threshold),
            }
        })
    }

    /// The code of the nearest map value to each of `x` (in [-1, 1]).
    fn encode(&self, x: Tensor<1>) -> Tensor<1, Int> {
        let n = x.dims()[0];
        let root_2 = x.clone().abs().sqrt();
        let root_4 = root_2.clone().sqrt();
        // sign(x) |x|^(1/4), without a sign pass; 1e-30 keeps 0 at 0.
        let signed_root = x.clone() / (root_2 * root_4 + 1e-30);
        let half = (KEYS / 2) as f64;
        let key = (signed_root * half + half).int().cast(IntDType::I64);
        let gather = |table: &Tensor<2>| table.clone().select(0, key.clone()).reshape([n]);
        let code = gather(&self.below) + x.greater_equal(gather(&self.threshold)).float();
        code.int().cast(IntDType::U8)
    }

    fn decode(&self, codes: Tensor<1, Int>) -> Tensor<1> {
        let n = codes.dims()[0];
        self.values
            .clone()
            .select(0, codes.cast(IntDType::I64))
            .reshape([n])
    }
}

/// One moment, quantized.
#[derive(Clone)]
pub struct Quantized {
    codes: Tensor<2, Int>, // [rows, row_len], u8
    absmax: Tensor<2>,     // [rows, blocks], f32
}

impl Quantized {
    /// Rows `start..start + len`.
    fn rows(&self, start: usize, len: usize) -> Self {
        Self {
            codes: self.codes.clone().narrow(0, start, len),
            absmax: self.absmax.clone().narrow(0, start, len),
        }
    }

    /// `parts` stacked along rows.
    fn cat(parts: Vec<Self>) -> Self {
        let (codes, absmax) = parts.into_iter().map(|q| (q.codes, q.absmax)).unzip();
        Self {
            codes: Tensor::cat(codes, 0),
            absmax: Tensor::cat(absmax, 0),
        }
    }
}

/// How rows of `row_len` elements are cut into blocks.
#[derive(Clone, Copy)]
struct Blocks {
    rows: usize,
    row_len: usize,
    len: usize,
    count: usize,
}

/// The bytes of 8-bit state for a tensor of `dims`: per moment, a one-byte code per element
/// and an f32 absmax per block of each row.
pub(crate) fn state_bytes(dims: &[usize]) -> usize {
    let blocks = Blocks::of(dims);
    2 * (blocks.rows * blocks.row_len + 4 * blocks.rows * blocks.count)
}

impl Blocks {
    /// A tensor of `dims` as rows: the first dim, the rest flattened.
    fn of(dims: &[usize]) -> Self {
        Self::new(dims[0], dims[1..].iter().product())
    }

    fn new(rows: usize, row_len: usize) -> Self {
        let len = row_len.clamp(1, BLOCK);
        Self {
            rows,
            row_len,
            len,
            count: row_len.div_ceil(len),
        }
    }

    /// `[rows, row_len]` as `[rows, count, len]`, the last block zero-padded.
    fn split(&self, x: Tensor<2>) -> Tensor<3> {
        let pad = self.count * self.len - self.row_len;
        let x = match pad {
            0 => x,
            _ => {
                let zeros = Tensor::zeros([self.rows, pad], (&x.device(), x.dtype()));
                Tensor::cat(vec![x, zeros], 1)
            }
        };
        x.reshape([self.rows, self.count, self.len])
    }

    fn join(&self, x: Tensor<3>) -> Tensor<2> {
        x.reshape([self.rows, self.count * self.len])
            .narrow(1, 0, self.row_len)
    }

    fn quantize(&self, book: &Codebook, x: Tensor<2>) -> Quantized {
        let blocks = self.split(x);
        let absmax = blocks.clone().abs().max_dim(2); // [rows, count, 1]
        // An all-zero block (padding rows of a shard) encodes zeros.
        let divisor = absmax
            .clone()
            .mask_fill(absmax.clone().equal_elem(0.0), 1.0);
        let normed = self.join(blocks / divisor);
        let codes = book.encode(normed.reshape([self.rows * self.row_len]));
        Quantized {
            codes: codes.reshape([self.rows, self.row_len]),
            absmax: absmax.reshape([self.rows, self.count]),
        }
    }

    fn dequantize(&self, book: &Codebook, q: Quantized) -> Tensor<2> {
        let values = book
            .decode(q.codes.reshape([self.rows * self.row_len]))
            .reshape([self.rows, self.row_len]);
        self.join(self.split(values) * q.absmax.unsqueeze_dim(2))
    }
}

/// 8-bit AdamW's state of one parameter.
#[derive(Clone)]
pub struct AdamW8bitState<const D: usize> {
    time: usize,
    moment_1: Quantized,
    moment_2: Quantized,
}

/// A step's scalars in f64, as the tensor path hands them to its operations (which round
/// each to the tensors' f32).
struct Scalars {
    beta_1: f64,
    beta_2: f64,
    step_size: f64,
    /// Epsilon with the second moment's bias correction folded in.
    epsilon: f64,
    /// What decoupled weight decay keeps of a parameter (`None`: no decay).
    keep: Option<f64>,
}

/// AdamW with both moments in 8 bits. The update itself is computed in f32, as
/// bitsandbytes' `kOptimizerStatic8bit2StateBlockwise` computes it: bias corrections folded
/// into the step size and epsilon, then decoupled weight decay.
#[derive(Clone)]
pub struct AdamW8bit {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    pub weight_decay: f32,
}

impl AdamW8bit {
    /// Step `time`'s scalars at learning rate `lr`.
    fn scalars(&self, lr: LearningRate, time: usize) -> Scalars {
        let (beta_1, beta_2) = (f64::from(self.beta_1), f64::from(self.beta_2));
        // powf, not powi: the fixture script's `**` is C's pow.
        let correction_1 = 1.0 - beta_1.powf(time as f64);
        let correction_2 = (1.0 - beta_2.powf(time as f64)).sqrt();
        let decay = lr * f64::from(self.weight_decay);
        Scalars {
            beta_1,
            beta_2,
            step_size: lr * correction_2 / correction_1,
            epsilon: correction_2 * f64::from(self.epsilon),
            keep: (decay > 0.0).then_some(1.0 - decay),
        }
    }

    /// One step of `rows` rows of a tensor (`param`, `grad`: `[rows, row_len]`, in the
    /// weights' dtype) with their quantized `moments` (none at the first step): the updated
    /// rows in f32, and the new moments.
    #[allow(clippy::too_many_arguments)]
    fn step_rows(
        &self,
        lr: LearningRate,
        time: usize,
        (signed, unsigned): &(Codebook, Codebook),
        blocks: Blocks,
        param: Tensor<2>,
        grad: Tensor<2>,
        moments: Option<(Quantized, Quantized)>,
    ) -> (Tensor<2>, Quantized, Quantized) {
        let grad = grad.cast(FloatDType::F32);
        let Scalars {
            beta_1,
            beta_2,
            step_size,
            epsilon,
            keep,
        } = self.scalars(lr, time);
        let (m, v) = match moments {
            Some((m, v)) => (
                blocks.dequantize(signed, m) * beta_1 + grad.clone() * (1.0 - beta_1),
                blocks.dequantize(unsigned, v) * beta_2 + grad.square() * (1.0 - beta_2),
            ),
            None => (
                grad.clone() * (1.0 - beta_1),
                grad.square() * (1.0 - beta_2),
            ),
        };
        let update = m.clone() / (v.clone().sqrt() + epsilon);
        let mut updated = param.cast(FloatDType::F32) - update * step_size;
        if let Some(keep) = keep {
            updated = updated * keep;
        }
        (
            updated,
            blocks.quantize(signed, m),
            blocks.quantize(unsigned, v),
        )
    }

    /// [`Optimizer::step`] in tensor operations, on any device and dtype.
    fn step_tensors<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamW8bitState<D>>,
    ) -> (Tensor<D>, Option<AdamW8bitState<D>>) {
        let dims = tensor.dims();
        let Blocks { rows, row_len, .. } = Blocks::of(&dims);
        let device = tensor.device();
        let books = (Codebook::on(true, &device), Codebook::on(false, &device));
        let time = state.as_ref().map_or(1, |s| s.time + 1);
        let dtype = tensor.dtype();
        let param = tensor.reshape([rows, row_len]);
        let grad = grad.reshape([rows, row_len]);
        let chunk = (CHUNK_ELEMS / row_len.max(1)).clamp(1, rows);
        let (mut updated, mut moment_1, mut moment_2) = (Vec::new(), Vec::new(), Vec::new());
        for start in (0..rows).step_by(chunk) {
            let len = chunk.min(rows - start);
            let moments = state
                .as_ref()
                .map(|s| (s.moment_1.rows(start, len), s.moment_2.rows(start, len)));
            let (p, m, v) = self.step_rows(
                lr,
                time,
                &books,
                Blocks::new(len, row_len),
                param.clone().narrow(0, start, len),
                grad.clone().narrow(0, start, len),
                moments,
            );
            updated.push(p.cast(dtype));
            moment_1.push(m);
            moment_2.push(v);
        }
        drop((param, grad, state));
        let state = AdamW8bitState {
            time,
            moment_1: Quantized::cat(moment_1),
            moment_2: Quantized::cat(moment_2),
        };
        (Tensor::cat(updated, 0).reshape(dims), Some(state))
    }

    /// Whether a parameter of these (full, unsharded) dims gets 8-bit state: a matrix (or
    /// higher) of at least `min_size` elements (bitsandbytes' `min_8bit_size`; it quantizes
    /// vectors that large too).
    pub fn quantizes(dims: &[usize], min_size: usize) -> bool {
        dims.len() >= 2 && dims.iter().product::<usize>() >= min_size
    }

    /// [`Optimizer::step`] for f32 tensors in host memory: each row in one pass, rows in
    /// parallel, in place, with the tensor path's f32 operations in its order (its scalars
    /// rounded to f32 as Flex rounds them), so that the values and codes are the same bit for
    /// bit; the tensor path makes a pass over the tensor for each operation, gathers among
    /// them.
    fn step_host<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamW8bitState<D>>,
    ) -> (Tensor<D>, Option<AdamW8bitState<D>>) {
        let device = tensor.device();
        let blocks = Blocks::of(&tensor.dims());
        let row_len = blocks.row_len;
        let time = state.as_ref().map_or(1, |s| s.time + 1);
        let first = state.is_none();
        let (mut p, g) = (tensor.into_data(), grad.into_data());
        let (mut m, mut v) = match state {
            Some(s) => (
                HostQuantized::from(s.moment_1),
                HostQuantized::from(s.moment_2),
            ),
            None => (HostQuantized::zeros(blocks), HostQuantized::zeros(blocks)),
        };
        // The tensor path's scalars, rounded to f32 as its operations round them.
        let scalars = self.scalars(lr, time);
        let (b1, b2) = (scalars.beta_1 as f32, scalars.beta_2 as f32);
        let (f1, f2) = ((1.0 - scalars.beta_1) as f32, (1.0 - scalars.beta_2) as f32);
        let (step_size, eps) = (scalars.step_size as f32, scalars.epsilon as f32);
        let keep = scalars.keep.map(|keep| keep as f32);
        let (signed, unsigned) = (Tables::of(true), Tables::of(false));
        let (m_codes, m_absmax) = m.slices();
        let (v_codes, v_absmax) = v.slices();
        f32s_mut(&mut p)
            .par_chunks_mut(row_len)
            .zip(f32s(&g).par_chunks(row_len))
            .zip(
                m_codes
                    .par_chunks_mut(row_len)
                    .zip(m_absmax.par_chunks_mut(blocks.count)),
            )
            .zip(
                v_codes
                    .par_chunks_mut(row_len)
                    .zip(v_absmax.par_chunks_mut(blocks.count)),
            )
            .for_each(|(((p, g), (mc, ma)), (vc, va))| {
                let (mut m, mut v) = ([0f32; BLOCK], [0f32; BLOCK]);
                for b in 0..blocks.count {
                    let at = b * blocks.len..((b + 1) * blocks.len).min(row_len);
                    let n = at.len();
                    let (m, v) = (&mut m[..n], &mut v[..n]);
                    let (p, g) = (&mut p[at.clone()], &g[at.clone()]);
                    // The lookups apart, so that the arithmetic below vectorises.
                    if !first {
                        signed.dequantize(&mc[at.clone()], ma[b], m);
                        unsigned.dequantize(&vc[at.clone()], va[b], v);
                    }
                    for i in 0..n {
                        let g = g[i];
                        (m[i], v[i]) = match first {
                            true => (g * f1, (g * g) * f2),
                            false => (m[i] * b1 + g * f1, v[i] * b2 + (g * g) * f2),
                        };
                        let update = m[i] / (v[i].sqrt() + eps);
                        let updated = p[i] - update * step_size;
                        p[i] = keep.map_or(updated, |keep| updated * keep);
                    }
                    ma[b] = signed.quantize(m, &mut mc[at.clone()]);
                    va[b] = unsigned.quantize(v, &mut vc[at]);
                }
            });
        let state = AdamW8bitState {
            time,
            moment_1: m.on(&device),
            moment_2: v.on(&device),
        };
        let tensor = Tensor::<D>::from_data(p, (&device, TensorDType::F32));
        (tensor, Some(state))
    }
}

/// Whether [`AdamW8bit::step_host`] steps these: f32 values in host memory (Flex), with
/// their moments there too, all of matching shapes (anything else takes the tensor path,
/// which reports what does not fit).
fn on_host<const D: usize>(
    tensor: &Tensor<D>,
    grad: &Tensor<D>,
    state: Option<&AdamW8bitState<D>>,
) -> bool {
    let blocks = Blocks::of(&tensor.dims());
    let quantized = |q: &Quantized| {
        in_host_memory(&q.codes.device())
            && q.codes.dims() == [blocks.rows, blocks.row_len]
            && q.absmax.dims() == [blocks.rows, blocks.count]
    };
    f32_in_host_memory(tensor)
        && f32_in_host_memory(grad)
        && tensor.shape().num_elements() > 0
        && grad.shape() == tensor.shape()
        && state.is_none_or(|s| quantized(&s.moment_1) && quantized(&s.moment_2))
}

/// One moment's codes and block maxima in host memory.
struct HostQuantized {
    codes: TensorData,
    absmax: TensorData,
}

impl HostQuantized {
    fn zeros(blocks: Blocks) -> Self {
        Self {
            codes: TensorData::zeros::<u8, _>([blocks.rows, blocks.row_len]),
            absmax: TensorData::zeros::<f32, _>([blocks.rows, blocks.count]),
        }
    }

    fn slices(&mut self) -> (&mut [u8], &mut [f32]) {
        let codes = self.codes.as_mut_slice::<u8>().expect("codes are u8");
        let absmax = self
            .absmax
            .as_mut_slice::<f32>()
            .expect("block maxima are f32");
        (codes, absmax)
    }

    fn on(self, device: &Device) -> Quantized {
        Quantized {
            codes: Tensor::from_data(self.codes, (device, TensorDType::U8)),
            absmax: Tensor::from_data(self.absmax, (device, TensorDType::F32)),
        }
    }
}

impl From<Quantized> for HostQuantized {
    fn from(q: Quantized) -> Self {
        Self {
            codes: q.codes.into_data(),
            absmax: q.absmax.into_data(),
        }
    }
}

impl Optimizer for AdamW8bit {
    type State<const D: usize> = AdamW8bitState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        if tensor.dims()[0] == 0 {
            return (tensor, state);
        }
        match on_host(&tensor, &grad, state.as_ref()) {
            true => self.step_host(lr, tensor, grad, state),
            false => self.step_tensors(lr, tensor, grad, state),
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        let moved = |q: Quantized| Quantized {
            codes: q.codes.to_device(device),
            absmax: q.absmax.to_device(device),
        };
        AdamW8bitState {
            time: state.time,
            moment_1: moved(state.moment_1),
            moment_2: moved(state.moment_2),
        }
    }
}

impl<const D: usize> RecordState for AdamW8bitState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "time", Scalar::UInt(self.time as u64));
        for (name, q) in [("moment_1", &self.moment_1), ("moment_2", &self.moment_2)] {
            out.push_tensor(prefix, &format!("{name}.codes"), q.codes.to_data());
            out.push_tensor(prefix, &format!("{name}.absmax"), q.absmax.to_data());
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let time = match src.take_scalar(prefix, "time")? {
            Scalar::UInt(t) => t as usize,
            _ => return None,
        };
        let mut moment = |name: &str| {
            let codes = src.take_tensor(prefix, &format!("{name}.codes"))?;
            let absmax = src.take_tensor(prefix, &format!("{name}.absmax"))?;
            let two_dims = codes.shape().len() == 2 && absmax.shape().len() == 2;
            (two_dims && codes.dtype() == TensorDType::U8).then(|| Quantized {
                codes: Tensor::from_data(codes, (device, TensorDType::U8)),
                absmax: Tensor::from_data(absmax, (device, TensorDType::F32)),
            })
        };
        Some(Self {
            time,
            moment_1: moment("moment_1")?,
            moment_2: moment("moment_2")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_have_256_sorted_values_with_zero_and_one() {
        for signed in [true, false] {
            let map = dynamic_map(signed);
            assert!(map.windows(2).all(|w| w[0] < w[1]), "{map:?}");
            assert_eq!(map[255], 1.0);
            assert!(map.contains(&0.0));
            assert_eq!(map[0], if signed { -0.992_968_75 } else { 0.0 }, "{signed}");
        }
    }

    /// The code by definition: the nearest map value (ties to the lower), a negative value
    /// never rounded to zero.
    fn nearest(map: &[f32; 256], x: f32) -> u8 {
        let code = map
            .windows(2)
            .filter(|pair| (pair[0] + pair[1]) / 2.0 < x)
            .count();
        let code = code - usize::from(x < 0.0 && map[code] >= 0.0);
        code as u8
    }

    #[test]
    fn encoder_thresholds_are_more_than_three_keys_apart() {
        for signed in [true, false] {
            let tables = Tables::of(signed);
            let mut thresholds: Vec<f32> = tables.threshold.clone();
            thresholds.retain(|t| t.is_finite());
            thresholds.dedup();
            assert_eq!(thresholds.len(), 255, "{signed}");
            let positions: Vec<f64> = thresholds.iter().map(|&t| key_position(t.into())).collect();
            let closest = positions
                .windows(2)
                .map(|p| p[1] - p[0])
                .fold(f64::INFINITY, f64::min);
            assert!(closest > 3.0, "{signed}: {closest}");
        }
    }

    #[test]
    fn encoding_gives_the_nearest_map_value_at_every_threshold_and_between() {
        let device = Device::flex();
        for signed in [true, false] {
            let map = dynamic_map(signed);
            let book = Codebook::on(signed, &device);
            let mut xs = vec![0.0, -0.0, 1.0, f32::MIN_POSITIVE, 1e-45, 1e-38, 1e-30];
            for pair in map.windows(2) {
                let mid = (pair[0] + pair[1]) / 2.0;
                xs.extend([
                    mid,
                    mid.next_down(),
                    mid.next_up(),
                    pair[0],
                    pair[0].next_up(),
                ]);
            }
            // Log-spaced and uniform sweeps.
            xs.extend((0..200_000).map(|i| 10f32.powf(-8.0 + 8.0 * i as f32 / 200_000.0)));
            xs.extend((0..200_000).map(|i| i as f32 / 200_000.0));
            if signed {
                let negatives: Vec<f32> = xs.iter().map(|x| -x).collect();
                xs.extend(negatives);
                xs.push(map[0]);
            }
            xs.retain(|x| (-1.0..=1.0).contains(x) && (signed || *x >= 0.0));
            let tensor = Tensor::<1>::from_data(TensorData::new(xs.clone(), [xs.len()]), &device);
            let codes = book.encode(tensor).into_data().try_to_vec::<u8>().unwrap();
            for (x, code) in xs.iter().zip(codes) {
                assert_eq!(code, nearest(&map, *x), "signed {signed}, x {x:e}");
            }
        }
    }

    /// The host path against the tensor path, bit for bit: three steps, with and without
    /// decay, rows shorter than a block, cut into a padded last block, and whole blocks, with an
    /// all-zero row (its blocks' maxima are 0).
    #[test]
    fn the_host_step_is_the_tensor_step_bit_for_bit() {
        let device = Device::flex();
        let bits = |t: &Tensor<2>| -> Vec<u32> {
            let data = t.to_data();
            data.as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let codes = |q: &Quantized| q.codes.to_data().try_to_vec::<u8>().unwrap();
        for (rows, row_len) in [(3, 64), (5, 300), (4, 512)] {
            for weight_decay in [0.0, 0.01] {
                let adam = AdamW8bit {
                    beta_1: 0.9,
                    beta_2: 0.999,
                    epsilon: 1e-8,
                    weight_decay,
                };
                let values = |seed: usize| -> Tensor<2> {
                    let v: Vec<f32> = (0..rows * row_len)
                        .map(|i| match i / row_len {
                            1 => 0.0,
                            _ => ((i * 7919 + seed) % 2003) as f32 / 2003.0 - 0.5,
                        })
                        .collect();
                    Tensor::from_data(TensorData::new(v, [rows, row_len]), &device)
                };
                let (mut host, mut host_state) = (values(0), None);
                let (mut tensors, mut tensors_state) = (values(0), None);
                for step in 1..=3 {
                    let grad = values(step);
                    (host, host_state) = adam.step_host(1e-3, host, grad.clone(), host_state);
                    (tensors, tensors_state) =
                        adam.step_tensors(1e-3, tensors, grad, tensors_state);
                    let (h, t) = (
                        host_state.as_ref().unwrap(),
                        tensors_state.as_ref().unwrap(),
                    );
                    let at = format!("{rows} x {row_len}, decay {weight_decay}, step {step}");
                    assert_eq!(bits(&host), bits(&tensors), "values at {at}");
                    for (a, b) in [(&h.moment_1, &t.moment_1), (&h.moment_2, &t.moment_2)] {
                        assert_eq!(codes(a), codes(b), "codes at {at}");
                        assert_eq!(bits(&a.absmax), bits(&b.absmax), "block maxima at {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_tensor_stepped_in_chunks_of_rows_steps_as_a_whole() {
        let device = Device::flex();
        let (rows, row_len) = (CHUNK_ELEMS / 300 + 5, 300); // two chunks, the second short
        let values = |seed: usize| -> Tensor<2> {
            let v: Vec<f32> = (0..rows * row_len)
                .map(|i| ((i * 7919 + seed) % 2003) as f32 / 2003.0 - 0.5)
                .collect();
            Tensor::from_data(TensorData::new(v, [rows, row_len]), &device)
        };
        let adam = AdamW8bit {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.01,
        };
        let books = (Codebook::on(true, &device), Codebook::on(false, &device));
        let whole = Blocks::new(rows, row_len);
        let (mut chunked, mut state) = (values(0), None);
        let (mut reference, mut moments) = (values(0), None);
        for (time, grad) in [(1, values(1)), (2, values(2))] {
            (chunked, state) = adam.step(1e-3, chunked, grad.clone(), state);
            let (p, m, v) = adam.step_rows(1e-3, time, &books, whole, reference, grad, moments);
            (reference, moments) = (p, Some((m, v)));
        }
        let bits = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        let codes = |q: Quantized| q.codes.into_data().try_to_vec::<u8>().unwrap();
        let (state, (m, v)) = (state.unwrap(), moments.unwrap());
        assert_eq!(codes(state.moment_1), codes(m));
        assert_eq!(codes(state.moment_2), codes(v));
        assert_eq!(bits(chunked), bits(reference));
    }

    #[test]
    fn quantization_round_trip_stays_within_one_step_of_the_map() {
        let device = Device::flex();
        let book = Codebook::on(true, &device);
        let blocks = Blocks::new(3, 300); // two blocks per row: 256 and 44 (zero-padded)
        let values: Vec<f32> = (0..900)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(values.clone(), [3, 300]), &device);
        let q = blocks.quantize(&book, x);
        assert_eq!(q.codes.dtype(), TensorDType::U8);
        assert_eq!(q.absmax.dims(), [3, 2]);
        let back: Vec<f32> = blocks
            .dequantize(&book, q)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        for (x, y) in values.iter().zip(&back) {
            // At most half the map's coarsest step (0.9 / 64, near 1) times the absmax (0.5).
            assert!((x - y).abs() <= 0.5 * 0.9 / 64.0 * 0.5 + 1e-6, "{x} -> {y}");
            assert!(*x >= 0.0 || *y < 0.0, "negative {x} kept its sign: {y}");
        }
    }
}
