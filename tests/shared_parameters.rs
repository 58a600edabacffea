//! A parameter that appears in two places of a model (tied weights) is refused with a clear
//! error when the model is wrapped, under every strategy: the engine reduces and steps a
//! parameter once per place it appears, which would lose part of its gradient and untie it.
//! Both shapes of sharing are checked: GPT-2's tied embedding head (inside the root unit) and
//! one block's parameters reused by another (across ZeRO-3 units).

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::prelude::*;
use burnscale::collective::run_ranks;
use burnscale::collective::threads::DEFAULT_TIMEOUT;
use burnscale::mingpt::{Gpt, GptConfig, cross_entropy};
use burnscale::nn::{BlockModel, Mask, RootWeights};
use burnscale::shard::{Sharded, Strategy};
use burnscale::tasks::NextToken;
use burnscale::train::{TrainArgs, train};

mod common;

const VOCAB: usize = 11;
const WIDTH: usize = 8;

/// A language model whose head multiplies by the token embedding's matrix: `head` is
/// `wte.weight` itself (GPT-2's tied head) or, untied, a parameter of its own.
#[derive(Module, Debug)]
struct TiedLm {
    wte: Embedding,
    h: Vec<Linear>,
    head: Param<Tensor<2>>, // [vocab, width]
}

impl TiedLm {
    fn new(tied: bool, device: &Device) -> Self {
        let wte = EmbeddingConfig::new(VOCAB, WIDTH).init(device);
        let head = if tied {
            wte.weight.clone()
        } else {
            EmbeddingConfig::new(VOCAB, WIDTH).init(device).weight
        };
        let h = (0..2)
            .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
            .collect();
        Self { wte, h, head }
    }
}

impl BlockModel for TiedLm {
    type Block = Linear;
    type Input = Tensor<2, Int>;
    type Target = Tensor<2, Int>;
    type Logits = Tensor<3>;

    fn embed(&self, input: Tensor<2, Int>) -> (Tensor<3>, Mask) {
        (self.wte.forward(input), None) // [batch, seq, width]
    }

    fn extent(&self, input: &Tensor<2, Int>) -> [usize; 2] {
        input.dims()
    }

    /// The head runs at every position.
    fn root_weights(&self) -> Vec<RootWeights> {
        RootWeights::of(&self.head, true)
    }

    /// No attention.
    fn attention_width(&self) -> usize {
        0
    }

    fn block_forward(&self, block: &Linear, x: Tensor<3>, _mask: &Mask) -> Tensor<3> {
        block.forward(x)
    }

    fn head_loss(&self, x: Tensor<3>, target: Tensor<2, Int>) -> Tensor<1> {
        cross_entropy(self.logits(x), target)
    }

    fn logits(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let logits = x.reshape([b * t, d]).matmul(self.head.val().transpose()); // [b*t, vocab]
        logits.reshape([b, t, VOCAB])
    }

    burnscale::nn::block_list!(h);
}

/// What wrapping `model` under `strategy` on `world` thread ranks says on each rank.
fn wrap<M: BlockModel + Send + Sync>(model: &M, strategy: Strategy, world: usize) -> Vec<String> {
    let device = Device::default().autodiff();
    run_ranks(world, DEFAULT_TIMEOUT, |comm| {
        Sharded::new(strategy, model.clone(), comm, &device)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

const STRATEGIES: [Strategy; 4] = [
    Strategy::Ddp,
    Strategy::Zero1,
    Strategy::Zero2,
    Strategy::Zero3,
];

#[test]
fn a_tied_embedding_head_is_refused_by_every_strategy() {
    let device = Device::default().autodiff();
    let (tied, untied) = (TiedLm::new(true, &device), TiedLm::new(false, &device));
    for strategy in STRATEGIES {
        for world in [1, 2] {
            for message in wrap(&tied, strategy, world) {
                assert!(
                    message.contains("`head` is the same parameter as `wte.weight`"),
                    "{strategy:?} x{world}: {message:?}"
                );
            }
            assert_eq!(
                wrap(&untied, strategy, world),
                vec![String::new(); world],
                "{strategy:?} x{world}: an untied model wraps"
            );
        }
    }
}

#[test]
fn a_block_shared_across_units_is_refused_by_every_strategy() {
    let mut model = common::seeded_model(1, |device| {
        Gpt::new(&GptConfig::tiny().with_dropout(0.0), device).unwrap()
    });
    let mut blocks = model.take_blocks();
    blocks[1] = blocks[0].clone();
    model.set_blocks(blocks);
    for strategy in STRATEGIES {
        for message in wrap(&model, strategy, 2) {
            assert!(
                message.contains("`h.1.ln_1.gamma` is the same parameter as `h.0.ln_1.gamma`"),
                "{strategy:?}: {message:?}"
            );
        }
    }
    // Through the runner, as a user meets it.
    let tokens = (0..2000).map(|i| (i * 7 % 11) as i64).collect();
    let mut task = NextToken::new(tokens, 8, 4, 1).unwrap();
    let args =
        TrainArgs::from_flags(&["--max-steps", "1", "--strategy", "zero3", "--devices", "2"])
            .unwrap();
    let err = train(model, &mut task, &args, &Device::default().autodiff())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("tied weights"), "{err}");
}
