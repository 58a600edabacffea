//! BigBird's block-sparse attention (ITC, as HF's `BigBirdBlockSparseAttention`).
//!
//! With `n` blocks of `block` tokens (the sequence padded to whole blocks), query block
//!
//! | query block    | attends to key blocks                              |
//! |----------------|----------------------------------------------------|
//! | 0 and n-1      | all (global)                                       |
//! | 1              | 0, 1, 2, n-1 and its random blocks                 |
//! | n-2            | 0, n-3, n-2, n-1 and its random blocks             |
//! | i in 2..n-2    | i-1, i, i+1 (window), 0, n-1 (global), its random blocks |
//!
//! Each non-global query block gathers its key blocks, so memory grows with
//! `seq · (5 + r) · block` rather than `seq²`. A key block listed twice counts twice in the
//! softmax, as in HF. Random blocks are drawn per head and per forward in training (from the
//! dropout stream, so a recomputation redraws them identically); in eval they are all block
//! 0, as HF's inference does.

use burn::prelude::*;
use burnscale_nn::autocast::{like, lowest};
use burnscale_nn::{Dropout, DropoutConfig, Mask, attention, dropout};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::index::sample;

/// Block-sparse attention of scaled `q`, `k`, `v` (`[b, heads, t, head_dim]`) under a
/// padding mask (`[b, 1, 1, t]`), for `t >= 5 · block` after padding to whole blocks; padded
/// queries' outputs are zero, as HF's. Like HF, no dropout is applied to the sparse attention
/// probabilities; `dropout` only says whether this is training.
pub fn block_sparse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Mask,
    dropout: &Dropout,
    block: usize,
    random: usize,
) -> Tensor<4> {
    let [b, h, t, hd] = q.dims();
    let device = q.device();
    let n = t.div_ceil(block);
    assert!(
        n >= 5,
        "block-sparse attention needs at least 5 blocks, got {n}"
    );
    let tp = n * block;
    // Padding to whole blocks: zero rows, masked as keys, cut from the output.
    let pad = |x: Tensor<4>| match tp - t {
        0 => x,
        extra => {
            let zeros = like(Tensor::zeros([b, h, extra, hd], &device), &x);
            Tensor::cat(vec![x, zeros], 2)
        }
    };
    let (q, k, v) = (pad(q), pad(k), pad(v));
    let keys_bias = {
        let given = match mask {
            Some(m) => m.clone().reshape([b, t]),
            None => like(Tensor::zeros([b, t], &device), &q),
        };
        match tp - t {
            0 => given,
            extra => {
                let masked = like(Tensor::full([b, extra], lowest(&q), &device), &q);
                Tensor::cat(vec![given, masked], 1)
            }
        }
    }; // [b, tp]

    // Global query blocks: every key.
    let global_q = Tensor::cat(
        vec![
            q.clone().narrow(2, 0, block),
            q.clone().narrow(2, tp - block, block),
        ],
        2,
    );
    let no_dropout = DropoutConfig::new(0.0).init();
    let global = attention(
        global_q,
        k.clone(),
        v.clone(),
        Some(keys_bias.clone().reshape([b, 1, 1, tp])),
        &no_dropout,
    ); // [b, h, 2·block, hd]

    // The other query blocks: their gathered key blocks.
    let training = dropout.is_training(&device);
    let lists = key_blocks(n, random, h, training);
    let width = lists[0][0].len() * block;
    let rows = n - 2;
    let mut index = Vec::with_capacity(h * rows * width);
    let masked_key = lowest(&q);
    let mut extra = Vec::with_capacity(rows * width);
    for (head, per_head) in lists.iter().enumerate() {
        for list in per_head {
            for &(kb, live) in list {
                index.extend((kb * block..(kb + 1) * block).map(|i| i as i64));
                if head == 0 {
                    extra.extend(std::iter::repeat_n(
                        if live { 0.0 } else { masked_key },
                        block,
                    ));
                }
            }
        }
    }
    let index = Tensor::<3, Int>::from_data(TensorData::new(index, [1, h, rows * width]), &device)
        .expand([b, h, rows * width]); // key token per (head, row, slot)
    let gather = |x: Tensor<4>| {
        let idx = index
            .clone()
            .reshape([b, h, rows * width, 1])
            .expand([b, h, rows * width, hd]);
        x.gather(2, idx).reshape([b, h, rows, width, hd])
    };
    let (kg, vg) = (gather(k), gather(v)); // [b, h, rows, width, hd]
    let bias = keys_bias
        .reshape([b, 1, tp])
        .expand([b, h, tp])
        .gather(2, index)
        .reshape([b, h, rows, 1, width])
        + like(
            Tensor::<1>::from_data(TensorData::new(extra, [rows * width]), &device),
            &q,
        )
        .reshape([1, 1, rows, 1, width]);
    // Each (head, row) is one attention of a query block over its gathered keys.
    let middle = attention(
        q.narrow(2, block, rows * block)
            .reshape([b, h * rows, block, hd]),
        kg.reshape([b, h * rows, width, hd]),
        vg.reshape([b, h * rows, width, hd]),
        Some(bias.reshape([b, h * rows, 1, width])),
        &no_dropout,
    )
    .reshape([b, h, rows * block, hd]);

    let out = Tensor::cat(
        vec![
            global.clone().narrow(2, 0, block),
            middle,
            global.narrow(2, block, block),
        ],
        2,
    ); // [b, h, tp, hd]
    let out = out.narrow(2, 0, t);
    // HF zeroes the padded queries' outputs (its `from_mask`); full attention does not.
    match mask {
        Some(bias) => {
            let queries = bias.clone().equal_elem(0.0).float().reshape([b, 1, t, 1]);
            let queries = like(queries, &out);
            out * queries
        }
        None => out,
    }
}

/// For each head and each query block 1..n-1: its key blocks, `(block, live)`; a dead slot
/// pads the shorter lists of blocks 1 and n-2 to a common width and is masked out.
fn key_blocks(
    n: usize,
    random: usize,
    heads: usize,
    training: bool,
) -> Vec<Vec<Vec<(usize, bool)>>> {
    let mut rng = training.then(|| StdRng::seed_from_u64(dropout::next_key()));
    (0..heads)
        .map(|_| {
            (1..n - 1)
                .map(|qb| {
                    let mut list: Vec<(usize, bool)> = if qb == 1 {
                        vec![(0, true), (1, true), (2, true), (n - 1, true), (0, false)]
                    } else if qb == n - 2 {
                        vec![
                            (0, true),
                            (n - 3, true),
                            (n - 2, true),
                            (n - 1, true),
                            (0, false),
                        ]
                    } else {
                        vec![
                            (qb - 1, true),
                            (qb, true),
                            (qb + 1, true),
                            (0, true),
                            (n - 1, true),
                        ]
                    };
                    let window = [qb.saturating_sub(1), qb, qb + 1];
                    let drawn: Vec<usize> = match rng.as_mut() {
                        // Among the middle blocks outside the window.
                        Some(rng) => {
                            let pool: Vec<usize> =
                                (1..n - 1).filter(|c| !window.contains(c)).collect();
                            sample(rng, pool.len(), random.min(pool.len()))
                                .into_iter()
                                .map(|i| pool[i])
                                .collect()
                        }
                        None => vec![0; random],
                    };
                    list.extend(drawn.into_iter().map(|kb| (kb, true)));
                    list.resize(5 + random, (0, false));
                    list
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block-sparse attention equals full attention under the mask its pattern implies, with
    /// a key block listed twice weighted twice (here: eval, random blocks all block 0).
    #[test]
    fn equals_full_attention_under_the_pattern_mask() {
        let device = Device::default();
        let (b, h, block, random, n) = (2, 2, 3, 1, 6);
        let t = n * block - 2; // padded to whole blocks inside
        let q = Tensor::<4>::random([b, h, t, 4], burn::tensor::Distribution::Default, &device);
        let k = Tensor::<4>::random([b, h, t, 4], burn::tensor::Distribution::Default, &device);
        let v = Tensor::<4>::random([b, h, t, 4], burn::tensor::Distribution::Default, &device);
        let eval = DropoutConfig::new(0.0).init();
        let sparse = block_sparse(q.clone(), k.clone(), v.clone(), &None, &eval, block, random);

        // Multiplicity of each key block per query block, as log weights.
        let lists = key_blocks(n, random, 1, false);
        let mut bias = vec![f32::MIN; t * t];
        for i in 0..t {
            let qb = i / block;
            for j in 0..t {
                let kb = j / block;
                let count = if qb == 0 || qb == n - 1 {
                    1
                } else {
                    lists[0][qb - 1]
                        .iter()
                        .filter(|&&(c, live)| live && c == kb)
                        .count()
                };
                if count > 0 {
                    bias[i * t + j] = (count as f32).ln();
                }
            }
        }
        let bias =
            Tensor::<1>::from_data(TensorData::new(bias, [t * t]), &device).reshape([1, 1, t, t]);
        let scores = q.matmul(k.swap_dims(2, 3)) + bias;
        let dense = burn::tensor::activation::softmax(scores, 3).matmul(v);
        let diff = (sparse - dense).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-5, "differs by {diff}");
    }

    /// Training draws random blocks from the dropout stream: a rewound stream (a checkpointed
    /// block's recomputation) redraws the same ones, another position other ones.
    #[test]
    fn random_blocks_follow_the_dropout_stream() {
        let device = Device::default().autodiff();
        let (b, h, block, random, t) = (1, 2, 4, 1, 36);
        let rand =
            || Tensor::<4>::random([b, h, t, 4], burn::tensor::Distribution::Default, &device);
        let (q, k, v) = (rand(), rand(), rand());
        let train = DropoutConfig::new(0.1).init();
        let run = || {
            block_sparse(
                q.clone(),
                k.clone(),
                v.clone(),
                &None,
                &train,
                block,
                random,
            )
        };
        dropout::seed(1);
        let at = dropout::position();
        let first = run();
        let other = run();
        dropout::rewind(at);
        let again = run();
        assert!(first.clone().equal(again).all().into_scalar::<bool>());
        let diff = (first - other).abs().max().into_scalar::<f32>();
        assert!(diff > 1e-3, "another draw changed nothing ({diff})");
    }
}
