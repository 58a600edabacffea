//! burnscale: train and finetune models too big for plain data parallelism, on Burn.
//!
//! The crates, re-exported: [`train`] (the runner, its CLI and reports) and the models
//! ([`mingpt`]). See README.md for what works today.

pub use burnscale_mingpt as mingpt;
pub use burnscale_train as train;
