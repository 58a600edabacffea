use std::ops::Range;

use half::{bf16, f16};

use crate::ReduceOp;

/// Element type of a [`Buffer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Bf16,
}

/// A flat, typed buffer: what collectives move.
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Buffer {
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F16(_) => DType::F16,
            Buffer::Bf16(_) => DType::Bf16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::F16(v) => v.len(),
            Buffer::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of payload.
    pub fn num_bytes(&self) -> usize {
        self.len()
            * match self.dtype() {
                DType::F32 => 4,
                DType::F16 | DType::Bf16 => 2,
            }
    }

    /// An empty buffer of `dtype`.
    pub fn empty(dtype: DType) -> Self {
        Self::from_f32(dtype, Vec::new())
    }

    /// `values` rounded to `dtype`.
    pub fn from_f32(dtype: DType, values: Vec<f32>) -> Self {
        match dtype {
            DType::F32 => Buffer::F32(values),
            DType::F16 => Buffer::F16(values.into_iter().map(f16::from_f32).collect()),
            DType::Bf16 => Buffer::Bf16(values.into_iter().map(bf16::from_f32).collect()),
        }
    }

    /// The values widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Buffer::F32(v) => v.clone(),
            Buffer::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Buffer::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Runs `fill` on `len` f32 values that then become this buffer, as `dtype`: for f32 they
    /// are this buffer's own allocation (reused), for 16-bit types a temporary rounded once.
    pub(crate) fn fill_as_f32(
        &mut self,
        dtype: DType,
        len: usize,
        fill: impl FnOnce(&mut Vec<f32>),
    ) {
        if dtype == DType::F32 {
            if !matches!(self, Buffer::F32(_)) {
                *self = Buffer::F32(Vec::new());
            }
            if let Buffer::F32(values) = self {
                values.resize(len, 0.0);
                fill(values);
            }
        } else {
            let mut values = vec![0.0; len];
            fill(&mut values);
            self.assign_f32(dtype, &values);
        }
    }

    /// Sets this buffer to `values` rounded to `dtype`, reusing the allocation where the
    /// dtype allows.
    pub(crate) fn assign_f32(&mut self, dtype: DType, values: &[f32]) {
        match (dtype, &mut *self) {
            (DType::F32, Buffer::F32(v)) => {
                v.clear();
                v.extend_from_slice(values);
            }
            (DType::F16, Buffer::F16(v)) => {
                v.clear();
                v.extend(values.iter().map(|x| f16::from_f32(*x)));
            }
            (DType::Bf16, Buffer::Bf16(v)) => {
                v.clear();
                v.extend(values.iter().map(|x| bf16::from_f32(*x)));
            }
            _ => *self = Buffer::from_f32(dtype, values.to_vec()),
        }
    }

    /// Sets this buffer to the parts joined in order (all of `dtype`), reusing the
    /// allocation where the dtype allows.
    pub(crate) fn assign_concat<'a>(
        &mut self,
        dtype: DType,
        parts: impl IntoIterator<Item = &'a Buffer>,
    ) {
        if self.dtype() != dtype {
            *self = Buffer::empty(dtype);
        }
        match self {
            Buffer::F32(v) => v.clear(),
            Buffer::F16(v) => v.clear(),
            Buffer::Bf16(v) => v.clear(),
        }
        for part in parts {
            match (&mut *self, part) {
                (Buffer::F32(o), Buffer::F32(p)) => o.extend_from_slice(p),
                (Buffer::F16(o), Buffer::F16(p)) => o.extend_from_slice(p),
                (Buffer::Bf16(o), Buffer::Bf16(p)) => o.extend_from_slice(p),
                _ => unreachable!("callers check dtypes before concatenating"),
            }
        }
    }
}

/// Element-wise reduction of `range` of every input into `output`, accumulated in f32 and
/// rounded once to the inputs' dtype (so 16-bit reductions lose no precision to their
/// order).
pub(crate) fn reduce_range_into(
    inputs: &[&Buffer],
    range: Range<usize>,
    op: ReduceOp,
    output: &mut Buffer,
) {
    let dtype = inputs.first().map_or(DType::F32, |b| b.dtype());
    let init = match op {
        ReduceOp::Max => f32::NEG_INFINITY,
        ReduceOp::Sum | ReduceOp::Mean => 0.0,
    };
    output.fill_as_f32(dtype, range.len(), |acc| {
        acc.fill(init);
        for input in inputs {
            match input {
                Buffer::F32(v) => combine(acc, v[range.clone()].iter().copied(), op),
                Buffer::F16(v) => combine(acc, v[range.clone()].iter().map(|x| x.to_f32()), op),
                Buffer::Bf16(v) => combine(acc, v[range.clone()].iter().map(|x| x.to_f32()), op),
            }
        }
        if op == ReduceOp::Mean {
            let n = inputs.len() as f32;
            acc.iter_mut().for_each(|a| *a /= n);
        }
    });
}

fn combine(acc: &mut [f32], values: impl Iterator<Item = f32>, op: ReduceOp) {
    match op {
        // A NaN stays NaN under max, as the MPI engine's keeps it (f32::max drops it).
        ReduceOp::Max => acc.iter_mut().zip(values).for_each(|(a, x)| {
            *a = if a.is_nan() || x.is_nan() {
                f32::NAN
            } else {
                a.max(x)
            }
        }),
        ReduceOp::Sum | ReduceOp::Mean => acc.iter_mut().zip(values).for_each(|(a, x)| *a += x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce(inputs: &[&Buffer], range: Range<usize>, op: ReduceOp) -> Buffer {
        let mut out = Buffer::empty(DType::F32);
        reduce_range_into(inputs, range, op, &mut out);
        out
    }

    #[test]
    fn reduces_in_f32_and_rounds_once() {
        let a = Buffer::from_f32(DType::Bf16, vec![1.0, 256.0, -3.0]);
        let b = Buffer::from_f32(DType::Bf16, vec![2.0, 1.0, 5.0]);
        let sum = reduce(&[&a, &b], 0..3, ReduceOp::Sum);
        assert_eq!(sum.to_f32(), vec![3.0, 256.0, 2.0]); // 257 rounds to 256 in bf16
        let max = reduce(&[&a, &b], 1..3, ReduceOp::Max);
        assert_eq!(max.to_f32(), vec![256.0, 5.0]);
        let mean = reduce(&[&a, &b], 0..1, ReduceOp::Mean);
        assert_eq!(mean, Buffer::from_f32(DType::Bf16, vec![1.5]));
        let f32s = Buffer::from_f32(DType::F32, vec![1.0, 2.0]);
        assert_eq!(
            reduce(&[&f32s, &f32s], 0..2, ReduceOp::Sum).to_f32(),
            vec![2.0, 4.0]
        );
    }

    /// A NaN on any rank is the max's, whichever rank holds it (a norm or an overflow flag
    /// that is NaN must not be taken for the others' value, nor for -inf).
    #[test]
    fn max_keeps_a_nan() {
        let nan = Buffer::from_f32(DType::F32, vec![f32::NAN, 1.0]);
        let one = Buffer::from_f32(DType::F32, vec![1.0, 1.0]);
        for inputs in [[&nan, &one], [&one, &nan]] {
            let max = reduce(&inputs, 0..2, ReduceOp::Max).to_f32();
            assert!(max[0].is_nan() && max[1] == 1.0, "{max:?}");
        }
        assert!(reduce(&[&nan], 0..1, ReduceOp::Max).to_f32()[0].is_nan());
    }
}
