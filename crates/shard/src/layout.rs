//! Per-parameter dim-0 shards, as FSDP2 lays them out: every rank owns `ceil(d0 / N)` rows of
//! every parameter (the last ranks' rows zero-padded past `d0`), so a shard keeps its
//! parameter's shape and shape-aware optimizers still work on it. The padding lives only in
//! shards and collective buffers; full values never carry it.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::prelude::*;

/// One parameter's place in the layout.
#[derive(Debug, Clone)]
pub struct Slot {
    pub id: ParamId,
    /// The parameter's path in the model, as checkpoints name it (`h.0.attn.c_attn.weight`).
    pub path: String,
    pub dims: Vec<usize>,
    /// Rows of dim 0 each rank owns.
    pub rows: usize,
}

impl Slot {
    fn row_len(&self) -> usize {
        self.dims[1..].iter().product()
    }

    /// This parameter's place when laid out over `world` ranks.
    pub fn over(mut self, world: usize) -> Self {
        self.rows = self.dims[0].div_ceil(world);
        self
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    pub fn shard_numel(&self) -> usize {
        self.rows * self.row_len()
    }

    pub fn shard_dims(&self) -> Vec<usize> {
        let mut dims = self.dims.clone();
        dims[0] = self.rows;
        dims
    }

    /// The rows `rank` owns: their first one and how many of them are real (not padding).
    pub fn owned_rows(&self, rank: usize) -> (usize, usize) {
        let start = (rank * self.rows).min(self.dims[0]);
        (start, ((rank + 1) * self.rows).min(self.dims[0]) - start)
    }

    /// `rank`'s shard of a full value (flat), zero-padded, on the value's device.
    pub fn shard_of(&self, full: &Tensor<1>, rank: usize) -> Tensor<1> {
        let (start, real) = self.owned_rows(rank);
        let row = self.row_len();
        let pad = (self.rows - real) * row;
        let zeros = |n: usize| Tensor::<1>::zeros([n], (&full.device(), full.dtype()));
        match (real, pad) {
            (0, _) => zeros(pad),
            (_, 0) => full.clone().narrow(0, start * row, real * row),
            _ => Tensor::cat(
                vec![full.clone().narrow(0, start * row, real * row), zeros(pad)],
                0,
            ),
        }
    }
}

/// The float parameters of `module`, in visit order, laid out over `world` ranks.
pub fn slots<M: Module>(module: &M, world: usize) -> Vec<Slot> {
    struct Collect {
        path: Vec<String>,
        world: usize,
        slots: Vec<Slot>,
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            // Without running a lazy parameter's initialiser (ZeRO-3 shards before it).
            let dims = param.lazy_shape().dims::<D>().to_vec();
            let slot = Slot {
                id: param.id,
                path: self.path.join("."),
                rows: dims[0],
                dims,
            };
            self.slots.push(slot.over(self.world));
        }
    }
    let mut collect = Collect {
        path: Vec::new(),
        world,
        slots: Vec::new(),
    };
    module.visit(&mut collect);
    collect.slots
}

/// What ranks compare before they share values: the parameter count, the values' count, and a
/// hash of every parameter's path, dims and which earlier place it is tied to, in order
/// (std's fixed-key hasher: alike in every process of a build).
pub fn fingerprint(slots: &[Slot]) -> [u64; 3] {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    for slot in slots {
        let tied = slots.iter().position(|s| s.id == slot.id);
        (&slot.path, &slot.dims, tied).hash(&mut hasher);
    }
    let values: usize = slots.iter().map(Slot::numel).sum();
    [slots.len() as u64, values as u64, hasher.finish()]
}

/// Consecutive groups of slots of at most `cap` elements each (a larger slot alone): one
/// collective per group instead of one per tensor, as DDP's gradient buckets.
pub fn buckets(slots: &[Slot], cap: usize) -> Vec<Range<usize>> {
    let mut buckets = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, slot) in slots.iter().enumerate() {
        if size > 0 && size + slot.numel() > cap {
            buckets.push(start..i);
            (start, size) = (i, 0);
        }
        size += slot.numel();
    }
    if start < slots.len() {
        buckets.push(start..slots.len());
    }
    buckets
}

/// A copy of `view` in storage of its own: a slice shares (and keeps alive) the whole
/// tensor it was cut from.
pub fn owned(view: Tensor<1>) -> Tensor<1> {
    let n = view.dims()[0];
    view.zeros_like().slice_assign(0..n, view)
}

/// Full values (flat, one per slot) laid out so that a reduce-scatter hands each rank its
/// shards: for every rank in turn, that rank's shard of every slot.
pub fn pack_rank_major(slots: &[&Slot], full: &[Tensor<1>], world: usize) -> Tensor<1> {
    let shards = (0..world)
        .flat_map(|rank| {
            slots
                .iter()
                .zip(full)
                .map(move |(slot, value)| slot.shard_of(value, rank))
        })
        .collect();
    Tensor::cat(shards, 0)
}

/// Cuts a flat tensor into consecutive pieces of the given (non-zero) lengths.
pub fn split(flat: Tensor<1>, lens: impl IntoIterator<Item = usize>) -> Vec<Tensor<1>> {
    let mut offset = 0;
    lens.into_iter()
        .map(|len| {
            offset += len;
            flat.clone().narrow(0, offset - len, len)
        })
        .collect()
}

/// Full values (flat) from an all-gather of every rank's shards of `slots` (each rank's
/// packed in slot order), without the padding.
pub fn unpack_gathered(slots: &[&Slot], gathered: Tensor<1>, world: usize) -> Vec<Tensor<1>> {
    let per_rank: usize = slots.iter().map(|s| s.shard_numel()).sum();
    let mut offset = 0;
    slots
        .iter()
        .map(|slot| {
            let n = slot.shard_numel();
            let pieces = (0..world)
                .map(|rank| gathered.clone().narrow(0, rank * per_rank + offset, n))
                .collect();
            let full = Tensor::cat(pieces, 0);
            offset += n;
            if full.dims()[0] == slot.numel() {
                full
            } else {
                full.narrow(0, 0, slot.numel())
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(dims: &[usize], world: usize) -> Slot {
        Slot {
            id: ParamId::new(),
            path: "p".into(),
            dims: dims.to_vec(),
            rows: dims[0].div_ceil(world),
        }
    }

    fn flat(values: &[f32]) -> Tensor<1> {
        Tensor::from_data(
            TensorData::new(values.to_vec(), [values.len()]),
            &Device::flex(),
        )
    }

    fn read(t: Tensor<1>) -> Vec<f32> {
        t.into_data().try_into_vec::<f32>().unwrap()
    }

    #[test]
    fn shards_pad_and_reassemble() {
        // A world larger than dim 0 (a class token [1, 1, d] over 4 ranks) only pads.
        for (dims, world) in [
            (&[5, 2][..], 1),
            (&[5, 2], 2),
            (&[5, 2], 3),
            (&[1, 1, 3], 4),
            (&[7], 4),
        ] {
            let a = slot(dims, world);
            let b = slot(&[3], world);
            let full_a: Vec<f32> = (0..a.numel()).map(|i| i as f32 + 1.0).collect();
            let full_b: Vec<f32> = vec![-1.0, -2.0, -3.0];
            let (ta, tb) = (flat(&full_a), flat(&full_b));
            let shards: Vec<f32> = (0..world)
                .flat_map(|r| [read(a.shard_of(&ta, r)), read(b.shard_of(&tb, r))].concat())
                .collect();
            assert_eq!(shards.len(), world * (a.shard_numel() + b.shard_numel()));
            let slots = [&a, &b];
            assert_eq!(read(pack_rank_major(&slots, &[ta, tb], world)), shards);
            let back: Vec<Vec<f32>> = unpack_gathered(&slots, flat(&shards), world)
                .into_iter()
                .map(read)
                .collect();
            assert_eq!(back, vec![full_a, full_b], "{dims:?} over {world}");
        }
    }

    #[test]
    fn buckets_respect_the_cap() {
        let slots: Vec<Slot> = [4, 4, 10, 1, 1].iter().map(|&n| slot(&[n], 1)).collect();
        assert_eq!(buckets(&slots, 8), vec![0..2, 2..3, 3..5]);
        assert_eq!(buckets(&slots, 100), vec![0..5]);
    }
}
