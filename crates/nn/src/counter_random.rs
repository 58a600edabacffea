//! Counter-based random values: each element's value is a hash of (its index, a key), drawn by
//! tensor ops on the device where it is used. Reproducible for a key whatever ran before
//! (a recomputed block redraws its dropout masks), the same on every backend, and never
//! drawn from the backend's one generator, which a caller may have seeded for its own model
//! (a probe that measures the device must not move it).

use burn::prelude::*;

use crate::device_cache;

/// SplitMix64's output function: spreads neighbouring keys over all 64 bits.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Values uniform in `[0, 1)` for a tensor of `shape` on `device`: the top 24 bits (exact in
/// f32) of each element's hash (`hashed`) under `key`, spread by SplitMix64 so that
/// neighbouring keys give unrelated values.
pub fn uniform<const D: usize>(shape: Shape, key: u64, device: &Device) -> Tensor<D> {
    hashed::<D>(&shape, splitmix64(key), device)
        .bitwise_right_shift_scalar(7)
        .float()
        .div_scalar((1u64 << 24) as f64)
}

/// A 31-bit hash of (element index, `key`) for each element of a tensor of `shape`.
pub(crate) fn hashed<const D: usize>(shape: &Shape, key: u64, device: &Device) -> Tensor<D, Int> {
    hashed_by(shape, key, device, LOW_31 as usize)
}

/// [`hashed`], indexing at most `most` elements at a time (an index past 31 bits is outside
/// the hash's range, and a GPU's integers are 32 bits): a larger tensor (attention
/// probabilities at a large batch) is drawn as rows of its last dimension, in slabs of
/// whole rows, slab s under `key` mixed with s, and joined. The first slab keeps `key`: its
/// elements take the values they would take drawn whole.
fn hashed_by<const D: usize>(
    shape: &Shape,
    key: u64,
    device: &Device,
    most: usize,
) -> Tensor<D, Int> {
    let n = shape.num_elements();
    if n <= most {
        return hash31(
            hash31(element_index::<D>(shape, device).bitwise_xor_scalar(key & LOW_31))
                .bitwise_xor_scalar((key >> 31) & LOW_31),
        );
    }
    let last = shape.dims::<D>()[D - 1];
    assert!(
        last <= most,
        "a last dimension of {last} elements: more than a 31-bit index can count"
    );
    let (rows, per_slab) = (n / last, most / last);
    let slabs: Vec<Tensor<2, Int>> = (0..rows)
        .step_by(per_slab)
        .enumerate()
        .map(|(s, start)| {
            let key = match s {
                0 => key,
                s => splitmix64(key ^ s as u64),
            };
            let slab = Shape::new([per_slab.min(rows - start), last]);
            hashed_by::<2>(&slab, key, device, most)
        })
        .collect();
    Tensor::cat(slabs, 0).reshape(shape.dims::<D>())
}

const LOW_31: u64 = (1 << 31) - 1;

/// Each element's row-major index, as the sum of one small range per dimension times its
/// stride, broadcast: a range over all `n` elements would be built by Burn's fused `arange`
/// through a cumulative sum that is quadratic in its length on a GPU.
fn element_index<const D: usize>(shape: &Shape, device: &Device) -> Tensor<D, Int> {
    let dims = shape.dims::<D>();
    let mut index: Option<Tensor<D, Int>> = None;
    let mut stride = 1i64;
    for d in (0..D).rev() {
        let mut along = [1; D];
        along[d] = dims[d];
        let term = range(dims[d], device).reshape(along).mul_scalar(stride);
        index = Some(match index {
            Some(index) => index + term,
            None => term,
        });
        stride *= dims[d] as i64;
    }
    index.unwrap_or_else(|| Tensor::zeros([1; D], device))
}

/// `0..n` on `device`, built once per thread and device (a step draws dropout masks of the
/// same shapes again and again; one range per dimension length seen).
fn range(n: usize, device: &Device) -> Tensor<1, Int> {
    device_cache::cached("index range", n, device, || build_range(n, device))
}

/// `0..n` on `device`, built from ranges of at most `CHUNK` (one per chunk, one within).
fn build_range(n: usize, device: &Device) -> Tensor<1, Int> {
    const CHUNK: usize = 1 << 12;
    if n <= CHUNK {
        return Tensor::arange(0..n as i64, device);
    }
    let chunks = n.div_ceil(CHUNK);
    let index = build_range(chunks, device)
        .reshape([chunks, 1])
        .mul_scalar(CHUNK as i64)
        + Tensor::<1, Int>::arange(0..CHUNK as i64, device).reshape([1, CHUNK]);
    index.reshape([chunks * CHUNK]).slice(0..n)
}

/// Thomas Mueller's integer hash (multiplier 0x45d9f3b), kept to 31 bits after each multiply.
/// Every value and scalar stays in [0, 2^31), so the bits are the same whatever the
/// backend's integer width and signedness (i32 on a GPU, i64 on Burn's CPU backend): a
/// product that wraps in 32 bits keeps the same low 31 bits.
fn hash31<const D: usize>(x: Tensor<D, Int>) -> Tensor<D, Int> {
    let shift = |x: Tensor<D, Int>| x.clone().bitwise_right_shift_scalar(16).bitwise_xor(x);
    let mul = |x: Tensor<D, Int>| x.mul_scalar(0x45d9f3b).bitwise_and_scalar(LOW_31);
    shift(mul(shift(mul(shift(x)))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The index the hash draws from is each element's row-major position, also along
    /// dimensions longer than one range chunk.
    #[test]
    fn element_index_counts_every_element_once() {
        let device = Device::default();
        let index = |shape: Shape| -> Vec<i64> {
            element_index::<2>(&shape, &device)
                .into_data()
                .convert::<i64>()
                .try_into_vec()
                .unwrap()
        };
        for shape in [
            Shape::new([3, 5]),
            Shape::new([3, 9000]),
            Shape::new([4097, 2]),
        ] {
            let n = shape.num_elements() as i64;
            assert_eq!(index(shape), (0..n).collect::<Vec<_>>());
        }
    }

    /// Past the most one index counts, a tensor is drawn in slabs of whole rows: the first
    /// slab's values are those drawn whole, the next ones' are others (their own key), and
    /// every value stays a 31-bit one.
    #[test]
    fn a_tensor_past_the_index_range_is_drawn_in_slabs() {
        let device = Device::default();
        let values = |t: Tensor<3, Int>| -> Vec<i64> {
            t.into_data().convert::<i64>().try_into_vec().unwrap()
        };
        let shape = Shape::new([5, 4, 3]);
        let whole = values(hashed_by::<3>(&shape, 77, &device, 60));
        let slabbed = hashed_by::<3>(&shape, 77, &device, 24); // slabs of 8, 8 and 4 rows of 3
        assert_eq!(slabbed.dims(), [5, 4, 3]);
        let slabbed = values(slabbed);
        assert_eq!(slabbed[..24], whole[..24]);
        assert_ne!(slabbed[24..48], whole[24..48]);
        assert_ne!(slabbed[24..48], slabbed[..24]);
        assert_ne!(slabbed[48..], slabbed[24..36]);
        assert!(slabbed.iter().all(|v| (0..1 << 31).contains(v)));
    }

    /// Uniform values fill `[0, 1)` evenly and stay below 1.
    #[test]
    fn uniform_values_are_spread_over_the_unit_interval() {
        let values: Vec<f32> = uniform::<2>(Shape::new([256, 256]), 3, &Device::default())
            .into_data()
            .try_into_vec()
            .unwrap();
        let mut bins = [0usize; 16];
        for v in &values {
            assert!((0.0..1.0).contains(v), "{v}");
            bins[(v * 16.0) as usize] += 1;
        }
        let expected = values.len() / 16;
        for (bin, n) in bins.iter().enumerate() {
            assert!(
                n.abs_diff(expected) < expected / 20,
                "bin {bin}: {n} of {expected}"
            );
        }
    }
}
