//! The conformance suite every engine must pass: each collective, for f32, f16 and bf16,
//! with sizes that do not divide by the world size, against a plain reference that each
//! rank computes locally. Run it on N threads (the tests) or under mpirun
//! (`examples/collective_check.rs`).
//!
//! Contributions are small integers, exact in every dtype, so every engine must match the
//! reference exactly whatever order it reduces in.

use burn::prelude::*;

use crate::{Buffer, CollectiveError, Communicator, DType, ReduceOp, shard_range, tensor_dtype};

/// Rank `rank`'s `i`-th contribution.
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i * 3) % 17) as f32 - 8.0
}

fn contribution(dtype: DType, rank: usize, len: usize) -> Buffer {
    Buffer::from_f32(dtype, (0..len).map(|i| value(rank, i)).collect())
}

/// The reduction of every rank's contribution, as an engine must compute it: in f32, then
/// rounded once to `dtype` (a 16-bit mean is checked within a few roundings of it).
fn reference(dtype: DType, world: usize, len: usize, op: ReduceOp) -> Vec<f32> {
    let reduced = (0..len).map(|i| {
        let values = (0..world).map(|r| value(r, i));
        match op {
            ReduceOp::Sum => values.sum::<f32>(),
            ReduceOp::Mean => values.sum::<f32>() / world as f32,
            ReduceOp::Max => values.fold(f32::NEG_INFINITY, f32::max),
        }
    });
    Buffer::from_f32(dtype, reduced.collect()).to_f32()
}

/// Every item's check, run whatever the earlier ones gave (a rank that stopped at its first
/// failure would leave the others waiting in the next collective); the first failure.
fn all_of<T>(
    items: impl IntoIterator<Item = T>,
    check: impl FnMut(T) -> Result<(), String>,
) -> Result<(), String> {
    let results: Vec<Result<(), String>> = items.into_iter().map(check).collect();
    results.into_iter().collect()
}

/// `got` within `roundings` roundings of `dtype` of `want` (a 16-bit mean that divides each
/// value before the sum, as NCCL's average and the MPI engine do, rounds more than once).
fn expect_close(got: &[f32], want: &[f32], dtype: DType, roundings: usize) -> Result<(), String> {
    let unit = match dtype {
        DType::F32 => return expect_eq(got, want),
        DType::F16 => 2f32.powi(-11),
        DType::Bf16 => 2f32.powi(-8),
    };
    if got.len() != want.len() {
        return Err(format!("{} elements, expected {}", got.len(), want.len()));
    }
    let scale = want.iter().fold(0f32, |m, w| m.max(w.abs())).max(1.0);
    let tolerance = roundings as f32 * unit * scale;
    match got
        .iter()
        .zip(want)
        .position(|(a, b)| (a - b).abs() > tolerance)
    {
        Some(i) => Err(format!(
            "element {i}: {} != expected {} (within {tolerance})",
            got[i], want[i]
        )),
        None => Ok(()),
    }
}

fn expect_eq(got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} elements, expected {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => Err(format!("element {i}: {} != expected {}", got[i], want[i])),
        None => Ok(()),
    }
}

fn err(e: CollectiveError) -> String {
    e.to_string()
}

/// Runs the suite on this rank; every rank of the group must call it. Returns one named
/// result per check, in the same order on every rank.
pub fn run(comm: &dyn Communicator, device: &Device) -> Vec<(String, Result<(), String>)> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut results = Vec::new();
    let mut check = |name: String, result: Result<(), String>| results.push((name, result));
    let sizes = [1, 7, 1000 + world - 1, 4099];
    let ops = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max];

    check("gather_u64s uneven, none on rank 0".to_string(), {
        // Rank r gives r values, the widest u64s among them.
        let values = |r: usize| -> Vec<u64> { (0..r as u64).map(|i| u64::MAX - i).collect() };
        crate::gather_u64s(comm, &values(rank))
            .map_err(err)
            .and_then(
                |all| match all == (0..world).map(values).collect::<Vec<_>>() {
                    true => Ok(()),
                    false => Err(format!("gathered {all:?}")),
                },
            )
    });

    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        for op in ops {
            let roundings = if op == ReduceOp::Mean { world + 1 } else { 0 };
            check(format!("all_reduce {op:?} {dtype:?}"), {
                all_of(sizes, |n| {
                    let mut buf = contribution(dtype, rank, n);
                    comm.all_reduce(&mut buf, op).map_err(err)?;
                    let want = reference(dtype, world, n, op);
                    expect_close(&buf.to_f32(), &want, dtype, roundings)
                        .map_err(|e| format!("n={n}: {e}"))
                })
            });
            check(format!("reduce_scatter {op:?} {dtype:?}"), {
                all_of(sizes.iter().chain(&[world - 1]), |&n| {
                    // Borrowed (into a buffer), then given up: an engine may take either path.
                    let input = contribution(dtype, rank, n);
                    let mut borrowed = Buffer::empty(dtype);
                    comm.reduce_scatter_into(&input, &mut borrowed, op)
                        .map_err(err)?;
                    let given = comm.reduce_scatter(input, op).map_err(err)?;
                    let full = reference(dtype, world, n, op);
                    let want = &full[shard_range(n, world, rank)];
                    for (path, chunk) in [("into", borrowed), ("given", given)] {
                        expect_close(&chunk.to_f32(), want, dtype, roundings)
                            .map_err(|e| format!("n={n}, {path}: {e}"))?;
                    }
                    Ok(())
                })
            });
        }
        check(format!("all_gather uneven {dtype:?}"), {
            // Rank r contributes 5 + r elements.
            let gathered = comm
                .all_gather(&contribution(dtype, rank, 5 + rank))
                .map_err(err);
            gathered.and_then(|g| {
                let want: Vec<f32> = (0..world)
                    .flat_map(|r| contribution(dtype, r, 5 + r).to_f32())
                    .collect();
                expect_eq(&g.to_f32(), &want)
            })
        });
        check(format!("broadcast {dtype:?}"), {
            all_of([0, world - 1], |root| {
                // Non-roots start with a buffer of another length: the root's wins.
                let mut buf = contribution(dtype, rank, if rank == root { 33 } else { 3 });
                comm.broadcast(&mut buf, root).map_err(err)?;
                expect_eq(&buf.to_f32(), &contribution(dtype, root, 33).to_f32())
                    .map_err(|e| format!("root {root}: {e}"))
            })
        });
        check(
            format!("tensor collectives {dtype:?}"),
            tensors(comm, dtype, device),
        );
    }
    check("barrier".into(), comm.barrier().map_err(err));
    check("mismatched lengths are reported".into(), {
        let mut buf = contribution(DType::F32, rank, 10 + rank);
        match comm.all_reduce(&mut buf, ReduceOp::Sum) {
            Err(CollectiveError::Mismatch { .. }) if world > 1 => Ok(()),
            Ok(()) if world == 1 => Ok(()),
            other => Err(format!("expected a mismatch error, got {other:?}")),
        }
    });
    results
}

fn tensors(comm: &dyn Communicator, dtype: DType, device: &Device) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let float_dtype = tensor_dtype(dtype);
    let make = |r: usize, len: usize| {
        let values: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        Tensor::<1>::from_data(TensorData::new(values, [len]), device).cast(float_dtype)
    };
    let read = |t: Tensor<1>| -> Vec<f32> {
        t.cast(burn::tensor::DType::F32)
            .into_data()
            .try_into_vec::<f32>()
            .unwrap_or_default()
    };

    // Every collective runs whatever the earlier ones gave (see `all_of`). Equal lengths
    // and a length that divides by the world size are what NCCL moves in place.
    let results = [
        comm.all_reduce_tensor(make(rank, 15), ReduceOp::Sum)
            .map_err(err)
            .and_then(|summed| {
                if summed.dims() != [15]
                    || summed.dtype() != float_dtype
                    || summed.device() != *device
                {
                    return Err(format!(
                        "all_reduce_tensor gave {:?} {:?} on {:?}",
                        summed.dims(),
                        summed.dtype(),
                        summed.device()
                    ));
                }
                expect_eq(&read(summed), &reference(dtype, world, 15, ReduceOp::Sum))
            }),
        comm.all_reduce_tensor(make(rank, 15), ReduceOp::Mean)
            .map_err(err)
            .and_then(|mean| {
                let want = reference(dtype, world, 15, ReduceOp::Mean);
                expect_close(&read(mean), &want, dtype, world + 1)
            }),
        // Rank r holds 5 (r + 1) elements.
        comm.all_gather_tensor(make(rank, 5 * (rank + 1)))
            .map_err(err)
            .and_then(|gathered| {
                let want: Vec<f32> = (0..world)
                    .flat_map(|r| read(make(r, 5 * (r + 1))))
                    .collect();
                expect_eq(&read(gathered), &want)
            }),
        comm.all_gather_tensor(make(rank, 6))
            .map_err(err)
            .and_then(|gathered| {
                let want: Vec<f32> = (0..world).flat_map(|r| read(make(r, 6))).collect();
                expect_eq(&read(gathered), &want)
            }),
        comm.reduce_scatter_tensor(make(rank, 15), ReduceOp::Max)
            .map_err(err)
            .and_then(|chunk| {
                let full = reference(dtype, world, 15, ReduceOp::Max);
                expect_eq(&read(chunk), &full[shard_range(15, world, rank)])
            }),
        comm.reduce_scatter_tensor(make(rank, 6 * world), ReduceOp::Mean)
            .map_err(err)
            .and_then(|chunk| {
                let full = reference(dtype, world, 6 * world, ReduceOp::Mean);
                let want = &full[shard_range(6 * world, world, rank)];
                expect_close(&read(chunk), want, dtype, world + 1)
            }),
        comm.broadcast_tensor(make(rank, 10), world - 1)
            .map_err(err)
            .and_then(|got| expect_eq(&read(got), &read(make(world - 1, 10)))),
    ];
    results.into_iter().collect()
}
