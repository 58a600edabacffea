//! Sharded checkpoints (`--checkpoint-dir`), laid out as PyTorch DCP lays them out: every rank
//! writes what it holds of the model states, sliced to the rows it owns in the layout (so the
//! ranks together write each row once, whatever the strategy), to a safetensors file of its
//! own whose tensors are named by parameter path and row range (`param/h.0.mlp.c_fc.weight/
//! 0:96`, `optim/h.0.mlp.c_fc.weight.momentum.moment_1/0:96`); rank 0 then writes `meta.json` (the
//! step, the data, dropout and loss-scaler positions, the run's configuration, the parameter
//! table and every file's size and CRC-32). A checkpoint is written into `.step-NNNNNNNN.partial/`,
//! synced, and renamed to `step-NNNNNNNN/` (the step in 8 digits) once `meta.json` is in it: a reader never sees a
//! half-written checkpoint as complete. Loading re-slices: a rank reads the rows it needs
//! (its shard or whole tensors, as its strategy holds them) from the files that have them, at
//! any world size.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use burn::optim::StateSink;
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use burn::tensor::DType as TensorDType;
use burnscale_collective::{Communicator, gather_u64s};
pub use burnscale_nn::weights::config_path;
use burnscale_nn::weights::{KeyMap, Planned, SafetensorsWriter, Weight};
use burnscale_nn::{BlockModel, dropout};
use burnscale_precision::{LossScaler, Precision};
use burnscale_shard::Sharded;
use burnscale_shard::layout::Slot;
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::cli::{TrainArgs, value_name};
use crate::optim::{LrSchedule, ParamOptimizer};
use crate::runner::{BatchPart, TrainTask};
use crate::{TrainError, fault};

/// The layout version `meta.json` records; another one is refused.
const FORMAT: u32 = 1;
const META: &str = "meta.json";
/// The widest dtype a checkpoint stores (f64; see `parse_dtype`).
const MAX_DTYPE_SIZE: usize = 8;

/// Everything that can go wrong finding, reading or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a complete checkpoint (no {META}: an interrupted save?)")]
    Incomplete { path: PathBuf },
    #[error("{path} holds no complete checkpoint (a step-N directory with {META})")]
    NoCheckpoint { path: PathBuf },
    #[error("checkpoint file {path} is damaged: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("checkpoint {path} does not fit this run: {detail}")]
    Mismatch { path: PathBuf, detail: String },
    #[error(
        "--resume: the ranks found different newest checkpoints in {path} ({found}): every rank must see the same directory (a filesystem the nodes share, its listing up to date)"
    )]
    Disagree { path: PathBuf, found: String },
    #[error("rank {rank} could not read the newest checkpoint (its own error says why)")]
    PeerRead { rank: usize },
    #[error(
        "{source}; the checkpoint before it, {}, is complete: move the damaged one out of the directory to resume from that",
        older.display()
    )]
    DamagedNewest {
        source: Box<CheckpointError>,
        older: PathBuf,
    },
    #[error("--checkpoint-dir {path} cannot be written ({source}): checked before training")]
    NotWritable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "rank {rank} could not write its part of checkpoint step {step} (its own error says why)"
    )]
    PeerWrite { rank: usize, step: usize },
    #[error(
        "--checkpoint-dir {path}: ranks {ranks:?} do not see the file rank 0 wrote there: a checkpoint is one directory its ranks write together, so give one on a file system every node mounts (checked before training)"
    )]
    NotShared { path: PathBuf, ranks: Vec<usize> },
}

/// A checkpoint's `meta.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub format: u32,
    /// Optimizer steps taken.
    pub step: usize,
    /// Micro-batches each rank drew (the data sampler's position).
    pub micro_batches: usize,
    /// Samples per micro-step over all ranks (what the data position counts in).
    pub global_batch: usize,
    pub world_size: usize,
    pub strategy: String,
    pub precision: String,
    pub optimizer: String,
    pub seed: u64,
    /// The model's configuration as the program gave it ([`TrainArgs::model_config`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_config: Option<serde_json::Value>,
    /// The flags that made the learning-rate schedule, with their values.
    #[serde(default)]
    pub schedule: BTreeMap<String, String>,
    /// The settings the optimizer stepped with, as flags with their values (`--weight-decay`,
    /// `--grad-clip`, and those of the optimizer in use).
    #[serde(default)]
    pub optimizer_flags: BTreeMap<String, String>,
    pub loss_scaler: Option<LossScaler>,
    /// Each rank's dropout stream: (seed, calls drawn).
    pub dropout: Vec<(u64, u64)>,
    pub params: Vec<SavedTensor>,
    pub states: Vec<SavedState>,
    pub files: Vec<SavedFile>,
    /// The CRC-32 of this file's JSON without it (every member, in key order, written
    /// compactly): a value damaged into another that still parses (a loss scale, a dropout
    /// count) is found. Older checkpoints have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
}

impl Meta {
    /// The CRC-32 of this meta's JSON without its `crc32` as this build writes it: what
    /// checkpoints written before [`json_crc32`] recorded.
    fn struct_crc32(&self) -> serde_json::Result<u32> {
        let unsealed = Meta {
            crc32: None,
            ..self.clone()
        };
        Ok(crc32fast::hash(&serde_json::to_vec_pretty(&unsealed)?))
    }
}

/// The CRC-32 of a `meta.json`'s text as JSON (every member, its `crc32` left out, written
/// compactly in key order): over what the file holds, so that a field another build adds,
/// which this one's `Meta` drops, is still counted, and one this build adds does not change
/// older files' sums.
fn json_crc32(text: &[u8]) -> serde_json::Result<u32> {
    let mut json: serde_json::Value = serde_json::from_slice(text)?;
    if let Some(members) = json.as_object_mut() {
        members.remove("crc32");
    }
    Ok(crc32fast::hash(&serde_json::to_vec(&json)?))
}

/// `meta`'s JSON with its CRC-32 in it ([`Meta::crc32`]).
fn sealed(meta: &Meta) -> serde_json::Result<Vec<u8>> {
    let unsealed = serde_json::to_vec_pretty(&Meta {
        crc32: None,
        ..meta.clone()
    })?;
    serde_json::to_vec_pretty(&Meta {
        crc32: Some(json_crc32(&unsealed)?),
        ..meta.clone()
    })
}

/// A tensor as the checkpoint holds it whole (its rows spread over the files).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedTensor {
    pub name: String,
    pub dims: Vec<usize>,
    pub dtype: String,
    /// A parameter's file keys in the model's own checkpoint layout (HF's), and whether each
    /// is stored transposed: what consolidation writes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub export: Vec<(String, bool)>,
    /// An optimizer state tensor that is the same on every rank rather than split by rows
    /// (Adafactor's column moment of a matrix): written once, by rank 0, and read whole.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replicated: bool,
}

/// One parameter's optimizer state: tensors shaped as the parameter, and scalars (a step
/// count).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedState {
    pub param: String,
    pub tensors: Vec<SavedTensor>,
    pub scalars: Vec<(String, String)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedFile {
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
}

/// `Ok` if checkpoints can be written under `root`, made if it is missing: a file is written
/// there and removed, so that a directory the run cannot write stops it before its first step,
/// not at its first save with the steps before it lost.
pub fn check_writable(root: &Path) -> Result<(), CheckpointError> {
    let not_writable = |source| CheckpointError::NotWritable {
        path: root.to_path_buf(),
        source,
    };
    fs::create_dir_all(root).map_err(not_writable)?;
    probe_writable(root).map_err(not_writable)
}

/// `Ok` if every rank sees the file rank 0 writes under `root` (each rank's own path to it,
/// as given): a directory local to each node would fail the first save, the steps before it
/// lost. Rank 0 writes a marker named by a number only this run draws; every rank looks for
/// it; all stop alike, naming the ranks that do not see it.
pub(crate) fn check_shared(comm: &dyn Communicator, root: &Path) -> Result<(), TrainError> {
    let marker = |token: u64| root.join(format!(".shared-{token:016x}"));
    let (mine, written) = match comm.rank() {
        0 => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let token = nanos ^ (u64::from(std::process::id()) << 32);
            let written = fs::write(marker(token), b"");
            ([token, written.is_ok() as u64], written)
        }
        _ => ([0, 1], Ok(())),
    };
    let tokens = gather_u64s(comm, &mine)?;
    let token = tokens[0][0];
    if tokens[0][1] == 0 {
        let source = written
            .err()
            .unwrap_or_else(|| std::io::Error::other("rank 0 could not write a file there"));
        return Err(CheckpointError::NotWritable {
            path: root.to_path_buf(),
            source,
        }
        .into());
    }
    let seen = gather_u64s(comm, &[marker(token).is_file() as u64])?;
    if comm.rank() == 0 {
        let _ = fs::remove_file(marker(token));
    }
    let ranks: Vec<usize> = (0..seen.len()).filter(|&r| seen[r][0] == 0).collect();
    match ranks.is_empty() {
        true => Ok(()),
        false => Err(CheckpointError::NotShared {
            path: root.to_path_buf(),
            ranks,
        }
        .into()),
    }
}

/// Writes a file into `dir` and removes it: whether the run can create files there (a
/// directory's permissions or a read-only file system say so only when written).
pub(crate) fn probe_writable(dir: &Path) -> std::io::Result<()> {
    static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    // Named apart for every rank that checks (threads of one process, processes on one
    // file system).
    let probe = dir.join(format!(
        ".writable-{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    fs::write(&probe, b"").and_then(|()| fs::remove_file(&probe))
}

pub(crate) fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a checkpoint of the run after `step` into `root` (every rank calls it; rank 0
/// completes it and prunes all but the newest `--keep-checkpoints`). `keys` name the
/// parameters in the model's own layout, for consolidation. Returns the bytes the ranks
/// wrote.
pub fn save<M: BlockModel>(
    comm: &dyn Communicator,
    root: &Path,
    step: usize,
    engine: &Sharded<'_, M>,
    optim: &ParamOptimizer,
    keys: &dyn KeyMap,
    args: &TrainArgs,
) -> Result<u64, TrainError> {
    let rank = comm.rank();
    let partial = root.join(format!(".step-{step:08}.partial"));
    let prepared = match rank {
        0 => {
            // What failed saves left (a stop-save on a full disk) holds space this one needs.
            if root.exists()
                && let Err(e) = remove_partials(root)
            {
                eprintln!("warning: an interrupted save's files could not be removed ({e})");
            }
            fs::create_dir_all(root)
                .and_then(|()| match partial.exists() {
                    true => fs::remove_dir_all(&partial),
                    false => Ok(()),
                })
                .and_then(|()| fs::create_dir(&partial))
                .map_err(|e| io_error(&partial)(e).into())
        }
        _ => Ok(()),
    };
    agree(comm, step, prepared, &[])?;
    let _unfinished = Unfinished((rank == 0).then_some(&partial));
    let world = comm.world_size();
    let written = write_rank_file(
        &partial.join(rank_file(rank)),
        step,
        rank,
        engine,
        optim,
        args.precision,
    );
    let position = dropout::position();
    let mine = match &written {
        Ok((bytes, crc, _)) => [*bytes, *crc as u64, position.0, position.1],
        Err(_) => [0; 4],
    };
    let ((_, _, states), all) = agree(comm, step, written, &mine)?;
    let done = step_dir(root, step);
    let completed = match rank {
        0 => {
            let held = engine.held_parameters();
            let meta = Meta {
                format: FORMAT,
                step,
                micro_batches: step * args.accumulate,
                global_batch: world * args.batch_size,
                world_size: world,
                strategy: value_name(args.strategy),
                precision: args.precision.to_string(),
                optimizer: value_name(args.optimizer),
                seed: args.seed,
                model_config: args.model_config.clone(),
                schedule: LrSchedule::flags(args),
                optimizer_flags: crate::optim::optimizer_flags(args),
                loss_scaler: engine.scaler().cloned(),
                dropout: all.iter().map(|r| (r[2], r[3])).collect(),
                crc32: None,
                params: engine
                    .slots()
                    .iter()
                    .map(|s| SavedTensor {
                        name: s.path.clone(),
                        dims: s.dims.clone(),
                        dtype: dtype_name(held[&s.id].dtype()),
                        export: keys
                            .saved_as(&s.path, &s.dims)
                            .into_iter()
                            .map(|saved| (saved.key, saved.transposed))
                            .collect(),
                        replicated: false,
                    })
                    .collect(),
                states,
                files: all
                    .iter()
                    .enumerate()
                    .map(|(r, info)| SavedFile {
                        name: rank_file(r),
                        bytes: info[0],
                        crc32: info[1] as u32,
                    })
                    .collect(),
            };
            // Once it is complete, what cannot be removed of older ones (a file a reader
            // holds open on NFS) is said, and training goes on.
            let pruned = |()| {
                if let Err(e) = prune(root, args.keep_checkpoints) {
                    eprintln!(
                        "warning: checkpoint {} is complete, but clearing older ones failed ({e}): training goes on",
                        done.display()
                    );
                }
            };
            complete(&partial, &done, &meta)
                .map(pruned)
                .map_err(TrainError::from)
        }
        _ => Ok(()),
    };
    agree(comm, step, completed, &[])?;
    Ok(all.iter().map(|r| r[0]).sum())
}

/// Rank 0's `partial` directory of a save, removed if it is still there when the save returns
/// (it is renamed once complete): a failed save's files are no checkpoint, and would hold
/// the disk the next save needs. Every rank is past its writes by then (each stage ends in
/// a collective).
struct Unfinished<'a>(Option<&'a PathBuf>);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some(partial) = self.0.filter(|p| p.exists()) {
            let _ = fs::remove_dir_all(partial);
        }
    }
}

/// Every rank's `mine` once each has its `outcome` of a stage of saving `step` (a
/// collective): this rank's error if it failed, else an error naming the first rank that
/// did, so that all ranks stop alike and none waits for another.
fn agree<T>(
    comm: &dyn Communicator,
    step: usize,
    outcome: Result<T, TrainError>,
    mine: &[u64],
) -> Result<(T, Vec<Vec<u64>>), TrainError> {
    agree_with(comm, outcome, mine, |rank| CheckpointError::PeerWrite {
        rank,
        step,
    })
}

/// [`agree`]'s collective: every rank's `mine` once each has its `outcome`, this rank's error
/// if it failed, else `peer` of the first rank that did.
fn agree_with<T>(
    comm: &dyn Communicator,
    outcome: Result<T, TrainError>,
    mine: &[u64],
    peer: impl FnOnce(usize) -> CheckpointError,
) -> Result<(T, Vec<Vec<u64>>), TrainError> {
    let flagged: Vec<u64> = std::iter::once(outcome.is_ok() as u64)
        .chain(mine.iter().copied())
        .collect();
    let all = gather_u64s(comm, &flagged)?;
    let value = outcome?;
    if let Some(rank) = all.iter().position(|r| r[0] == 0) {
        return Err(peer(rank).into());
    }
    Ok((value, all.into_iter().map(|r| r[1..].to_vec()).collect()))
}

/// Writes `meta.json` last into the synced `partial` directory and renames it to `done`.
fn complete(partial: &Path, done: &Path, meta: &Meta) -> Result<(), CheckpointError> {
    let meta_path = partial.join(META);
    let io = io_error(partial);
    let json = sealed(meta).map_err(|e| io(std::io::Error::other(e)))?;
    File::create(&meta_path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &json).and_then(|()| f.sync_all()))
        .and_then(|()| sync_dir(partial))
        .map_err(&io)?;
    if done.exists() {
        fs::remove_dir_all(done).map_err(io_error(done))?;
    }
    fs::rename(partial, done).map_err(io_error(done))?;
    let root = done.parent().unwrap_or(Path::new("."));
    sync_dir(root).map_err(io_error(root))
}

/// Flushes `dir`'s entries (names created, renamed) to disk. A file system that cannot sync a
/// directory says EINVAL (as some network ones do): its entries are as durable as it makes
/// them, which PostgreSQL's `fsync_fname` accepts too.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    match File::open(dir)?.sync_all() {
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
        synced => synced,
    }
}

/// Removes all but the newest `keep` complete checkpoints under `root` (what interrupted
/// saves left went before the save began): all it can, returning the first failure.
fn prune(root: &Path, keep: Option<usize>) -> Result<(), CheckpointError> {
    let mut failed = Ok(());
    let complete = complete_checkpoints(root)?;
    let excess = complete.len().saturating_sub(keep.unwrap_or(usize::MAX));
    for (_, path) in complete.into_iter().take(excess) {
        // `meta.json` first: a checkpoint removed in part is no longer one, and one whose
        // `meta.json` stays is whole.
        let removed = fs::remove_file(path.join(META)).and_then(|()| fs::remove_dir_all(&path));
        failed = failed.and(removed.map_err(io_error(&path)));
    }
    failed
}

/// Removes what interrupted saves left under `root` (`.step-N.partial`): all it can,
/// returning the first failure.
fn remove_partials(root: &Path) -> Result<(), CheckpointError> {
    let mut failed = Ok(());
    for entry in fs::read_dir(root).map_err(io_error(root))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".step-") && name.ends_with(".partial") {
            let path = entry.path();
            let removed = match path.is_dir() {
                true => fs::remove_dir_all(&path),
                false => fs::remove_file(&path),
            };
            failed = failed.and(removed.map_err(io_error(&path)));
        }
    }
    failed
}

/// The step and directory of the newest complete checkpoint under `root`, if any.
pub(crate) fn newest(root: &Path) -> Result<Option<(usize, PathBuf)>, CheckpointError> {
    Ok(complete_checkpoints(root)?.pop())
}

/// The step and directory of every complete checkpoint under `root`, oldest first (none
/// where `root` does not exist).
fn complete_checkpoints(root: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    if !root.exists() {
        return Ok(Vec::new());
    }
    let entries = fs::read_dir(root).map_err(io_error(root))?;
    let mut complete: Vec<(usize, PathBuf)> = entries
        .flatten()
        .filter_map(|e| complete_step(&e.path()).map(|step| (step, e.path())))
        .collect();
    complete.sort();
    Ok(complete)
}

/// This rank's `restored` once every rank has restored its part (a collective): its error
/// if it failed, else an error naming the first rank that did. A rank reads only its own
/// rows, so one can fail alone (its file damaged), and the others would wait for it in the
/// training's first collective, under mpirun told only that it left.
pub(crate) fn agree_restored<T>(
    comm: &dyn Communicator,
    restored: Result<T, TrainError>,
) -> Result<T, TrainError> {
    agree_with(comm, restored, &[], |rank| CheckpointError::PeerRead {
        rank,
    })
    .map(|(v, _)| v)
}

/// `found`, this rank's reading of the newest checkpoint under `root` (`step` gives a
/// checkpoint's step), once every rank has
/// read its own: each reads the directory itself, and one whose view lags (an NFS client's
/// cached listing after a requeue) would resume from another step than the others, or
/// train from step 0 beside them. Every rank stops, naming what each found, when they
/// differ, and when any could not read it (that rank with its own error).
pub(crate) fn agree_on_newest<C>(
    comm: &dyn Communicator,
    root: &Path,
    found: Result<Option<C>, TrainError>,
    step: impl Fn(&C) -> usize,
) -> Result<Option<C>, TrainError> {
    const NONE: u64 = u64::MAX;
    const UNREAD: u64 = u64::MAX - 1;
    let code = match &found {
        Ok(Some(ckpt)) => step(ckpt) as u64,
        Ok(None) => NONE,
        Err(_) => UNREAD,
    };
    let codes: Vec<u64> = gather_u64s(comm, &[code])?.iter().map(|c| c[0]).collect();
    let found = found?;
    if let Some(rank) = codes.iter().position(|&c| c == UNREAD) {
        return Err(CheckpointError::PeerRead { rank }.into());
    }
    if codes.iter().all(|&c| c == codes[0]) {
        return Ok(found);
    }
    let found = codes
        .iter()
        .enumerate()
        .map(|(rank, &code)| match code {
            NONE => format!("rank {rank}: none"),
            step => format!("rank {rank}: step {step}"),
        })
        .collect::<Vec<_>>()
        .join(", ");
    Err(CheckpointError::Disagree {
        path: root.to_path_buf(),
        found,
    }
    .into())
}

/// `error`, met resuming from the newest checkpoint in `root`, naming the complete checkpoint
/// before it when the newest is damaged (a file missing, truncated or altered), which a run
/// can resume from instead. A file that could not be read for another reason (permissions,
/// a stale network handle, EIO) is no damage: moving that checkpoint away would lose steps.
pub(crate) fn naming_older(root: &Path, error: TrainError) -> TrainError {
    use std::io::ErrorKind::{NotFound, UnexpectedEof};
    let damaged = match &error {
        TrainError::Checkpoint(CheckpointError::Corrupt { .. }) => true,
        TrainError::Checkpoint(CheckpointError::Io { source, .. }) => {
            matches!(source.kind(), NotFound | UnexpectedEof)
        }
        _ => false,
    };
    let TrainError::Checkpoint(damage) = error else {
        return error;
    };
    if !damaged {
        return damage.into();
    }
    let complete = complete_checkpoints(root).unwrap_or_default();
    match complete.len() {
        0 | 1 => damage.into(),
        n => CheckpointError::DamagedNewest {
            source: Box::new(damage),
            older: complete[n - 2].1.clone(),
        }
        .into(),
    }
}

/// `bytes`, `count` rows of `row` bytes each of a tensor of `dims`, as `pad_to` rows (or
/// `count`, if more), those past `count` zero (a shard's padding).
fn padded(
    mut bytes: Vec<u8>,
    row: usize,
    count: usize,
    pad_to: usize,
    dims: &[usize],
    dtype: TensorDType,
) -> TensorData {
    let rows = pad_to.max(count);
    bytes.resize(rows * row, 0);
    let mut shape = dims.to_vec();
    shape[0] = rows;
    TensorData::from_bytes_vec(bytes, shape, dtype)
}

/// Where [`Checkpoint::consolidate`] writes the optimizer state of a model consolidated to
/// `weights`: beside it, `NAME.optimizer.safetensors`.
pub fn optimizer_path(weights: &Path) -> PathBuf {
    weights.with_extension("optimizer.safetensors")
}

/// Whether `dir` is a checkpoint (it holds `meta.json`), whatever its name.
pub(crate) fn is_checkpoint(dir: &Path) -> bool {
    dir.join(META).is_file()
}

/// The step of the complete checkpoint at `path` (`step-N` holding `meta.json`).
fn complete_step(path: &Path) -> Option<usize> {
    step_named(path).filter(|_| is_checkpoint(path))
}

/// The step `path`'s name gives (`step-N`), if it is named so.
fn step_named(path: &Path) -> Option<usize> {
    let name = path.file_name()?.to_str()?;
    name.strip_prefix("step-")?.parse().ok()
}

/// This rank's file: the rows it owns of every parameter and optimizer state tensor. Returns
/// its size, its CRC-32 and (for `meta.json`) the optimizer states' table.
fn write_rank_file<M: BlockModel>(
    path: &Path,
    step: usize,
    rank: usize,
    engine: &Sharded<'_, M>,
    optim: &ParamOptimizer,
    precision: Precision,
) -> Result<(u64, u32, Vec<SavedState>), TrainError> {
    let slots: HashMap<&str, &Slot> = engine
        .slots()
        .iter()
        .map(|s| (s.path.as_str(), s))
        .collect();
    let held = engine.held_parameters();
    // The plan first (names, shapes, dtypes), then the values one tensor at a time.
    let mut plan = Vec::new();
    for slot in engine.slots() {
        let (start, real) = slot.owned_rows(rank);
        if real > 0 {
            plan.push(planned(
                &format!("param/{}", slot.path),
                &slot.dims,
                start,
                real,
                held[&slot.id].dtype(),
            )?);
        }
    }
    let mut states = Vec::new();
    optim.for_each_state(|param, sink| {
        let slot = slots.get(param).ok_or_else(|| {
            TrainError::InvalidData(format!("optimizer state for `{param}`, no parameter"))
        })?;
        let (start, real) = slot.owned_rows(rank);
        let mut tensors = Vec::new();
        for (name, data) in &sink.tensors {
            let mut dims: Vec<usize> = data.shape().iter().copied().collect();
            let replicated = replicated(name, &dims, slot)?;
            if replicated && rank == 0 {
                plan.push(Planned {
                    key: whole_key(name),
                    dtype: st_dtype(data.dtype())?,
                    shape: dims.clone(),
                });
            } else if !replicated {
                dims[0] = slot.dims[0];
                if real > 0 {
                    plan.push(planned(
                        &format!("optim/{name}"),
                        &dims,
                        start,
                        real,
                        data.dtype(),
                    )?);
                }
            }
            tensors.push(SavedTensor {
                name: name.clone(),
                dims,
                dtype: dtype_name(data.dtype()),
                export: Vec::new(),
                replicated,
            });
        }
        let scalars = sink
            .scalars
            .iter()
            .map(|(n, s)| (n.clone(), encode(s)))
            .collect();
        states.push(SavedState {
            param: param.to_string(),
            tensors,
            scalars,
        });
        Ok(())
    })?;
    let mut writer = SafetensorsWriter::create_with(path, &plan, HashMap::new())?;
    for slot in engine.slots() {
        let (start, real) = slot.owned_rows(rank);
        if real == 0 {
            continue;
        }
        let value = held[&slot.id].clone();
        let row = slot.numel() / slot.dims[0];
        // A replica holds every row, a shard its own from 0.
        let first = if value.dims()[0] == slot.numel() {
            start
        } else {
            0
        };
        let rows = value.narrow(0, first * row, real * row).into_data();
        TrainError::check_finite_weights(&slot.path, rows.iter::<f32>(), step, precision)?;
        writer.write_bytes(
            &range_key(&format!("param/{}", slot.path), start, real),
            rows.as_bytes(),
        )?;
    }
    fault::kill_if_asked(fault::Point::Save, step, rank);
    optim.for_each_state(|param, sink| {
        let slot = slots[param];
        let (start, real) = slot.owned_rows(rank);
        for (name, data) in &sink.tensors {
            let dims: Vec<usize> = data.shape().iter().copied().collect();
            if replicated(name, &dims, slot)? {
                if rank == 0 {
                    writer.write_bytes(&whole_key(name), data.as_bytes())?;
                }
                continue;
            }
            if real == 0 {
                continue;
            }
            let row_bytes = data.as_bytes().len() / data.shape()[0];
            let first = if data.shape()[0] == slot.dims[0] {
                start
            } else {
                0
            };
            let bytes = &data.as_bytes()[first * row_bytes..(first + real) * row_bytes];
            writer.write_bytes(&range_key(&format!("optim/{name}"), start, real), bytes)?;
        }
        Ok(())
    })?;
    writer.finish()?;
    let (bytes, crc) = checksum(path)?;
    Ok((bytes, crc, states))
}

/// Whether an optimizer state tensor of `dims` is the same on every rank (Adafactor's column
/// moment of a matrix, by its name: its one row is also a shard's when a rank owns one row;
/// a higher tensor's has its parameter's rows, each its own; or any state with one row where
/// its parameter has more) rather than its parameter's rows
/// (or its shard's) along dim 0, sliced by rows; its other dims are its own (8-bit AdamW's
/// absmax has one column per block of a row). Any other shape is an error.
fn replicated(name: &str, dims: &[usize], slot: &Slot) -> Result<bool, TrainError> {
    if name.ends_with(crate::adafactor::COLUMN_MOMENT) && slot.dims.len() == 2 {
        return Ok(true);
    }
    match dims.first() {
        Some(&d0) if d0 == slot.dims[0] || d0 == slot.rows => Ok(false),
        Some(1) => Ok(true),
        _ => Err(TrainError::InvalidData(format!(
            "optimizer state `{name}` has shape {dims:?}, neither its parameter's rows ({:?}) nor one row: it cannot be checkpointed",
            slot.dims
        ))),
    }
}

fn whole_key(name: &str) -> String {
    format!("optim/{name}/whole")
}

/// Rows `start..start + real` of a tensor of `dims`, to be written under `prefix`.
fn planned(
    prefix: &str,
    dims: &[usize],
    start: usize,
    real: usize,
    dtype: TensorDType,
) -> Result<Planned, TrainError> {
    let mut shape = dims.to_vec();
    shape[0] = real;
    Ok(Planned {
        key: range_key(prefix, start, real),
        dtype: st_dtype(dtype)?,
        shape,
    })
}

fn range_key(prefix: &str, start: usize, real: usize) -> String {
    format!("{prefix}/{start}:{}", start + real)
}

/// A file's size and CRC-32, read back from disk (what a later load will check).
fn checksum(path: &Path) -> Result<(u64, u32), CheckpointError> {
    let io = io_error(path);
    let mut reader = BufReader::with_capacity(1 << 20, File::open(path).map_err(&io)?);
    let (mut hasher, mut bytes) = (crc32fast::Hasher::new(), 0u64);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf).map_err(&io)?;
        if n == 0 {
            return Ok((bytes, hasher.finalize()));
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
}

fn dtype_name(dtype: TensorDType) -> String {
    format!("{dtype:?}")
}

fn parse_dtype(name: &str) -> Option<TensorDType> {
    [
        TensorDType::F32,
        TensorDType::F16,
        TensorDType::BF16,
        TensorDType::F64,
        TensorDType::U8,
    ]
    .into_iter()
    .find(|d| dtype_name(*d) == name)
}

fn st_dtype(dtype: TensorDType) -> Result<Dtype, TrainError> {
    Ok(match dtype {
        TensorDType::F32 => Dtype::F32,
        TensorDType::F16 => Dtype::F16,
        TensorDType::BF16 => Dtype::BF16,
        TensorDType::F64 => Dtype::F64,
        TensorDType::U8 => Dtype::U8,
        other => {
            return Err(TrainError::InvalidData(format!(
                "cannot checkpoint a {other:?} tensor"
            )));
        }
    })
}

fn tensor_dtype(dtype: Dtype) -> Option<TensorDType> {
    Some(match dtype {
        Dtype::F32 => TensorDType::F32,
        Dtype::F16 => TensorDType::F16,
        Dtype::BF16 => TensorDType::BF16,
        Dtype::F64 => TensorDType::F64,
        Dtype::U8 => TensorDType::U8,
        _ => return None,
    })
}

/// A scalar as text that parses back to the same value (floats by their bits).
fn encode(scalar: &Scalar) -> String {
    match scalar {
        Scalar::Int(v) => format!("i{v}"),
        Scalar::UInt(v) => format!("u{v}"),
        Scalar::Float(v) => format!("f{:016x}", v.to_bits()),
        Scalar::Bool(v) => format!("b{v}"),
    }
}

fn decode(text: &str) -> Option<Scalar> {
    let (kind, value) = text.split_at_checked(1)?;
    Some(match kind {
        "i" => Scalar::Int(value.parse().ok()?),
        "u" => Scalar::UInt(value.parse().ok()?),
        "f" => Scalar::Float(f64::from_bits(u64::from_str_radix(value, 16).ok()?)),
        "b" => Scalar::Bool(value.parse().ok()?),
        _ => return None,
    })
}

/// A complete checkpoint, opened for reading: its `meta.json`, and each rank file once read
/// (checked against its size and CRC-32 the first time).
pub struct Checkpoint {
    pub dir: PathBuf,
    pub meta: Meta,
    files: Vec<Option<RankFile>>,
    /// The bytes of all ranks' files, each size checked against meta.json's once (a resume
    /// at a world of hundreds reads hundreds of tensors: not a stat of every file for each).
    stored: Option<u64>,
}

struct RankFile {
    map: Mmap,
    data_start: usize,
    header: Metadata,
}

impl RankFile {
    /// The bytes of tensor `key`, which must hold `len` bytes of `dtype`; else the file at
    /// `path` is corrupt, missing `what`.
    fn tensor(
        &self,
        key: &str,
        dtype: TensorDType,
        len: usize,
        path: PathBuf,
        what: String,
    ) -> Result<&[u8], CheckpointError> {
        let info = self.header.info(key).filter(|i| {
            tensor_dtype(i.dtype) == Some(dtype) && i.data_offsets.1 - i.data_offsets.0 == len
        });
        match info {
            Some(info) => Ok(&self.map[self.data_start + info.data_offsets.0..][..len]),
            None => Err(CheckpointError::Corrupt {
                path,
                reason: format!("no {} tensor `{key}` of {what}", dtype_name(dtype)),
            }),
        }
    }
}

impl Checkpoint {
    /// The newest complete checkpoint under `root`, if any.
    pub fn latest(root: &Path) -> Result<Option<Self>, CheckpointError> {
        newest(root)?.map(|(_, path)| Self::open(&path)).transpose()
    }

    /// The checkpoint in `dir`.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(META);
        if !path.is_file() {
            return Err(CheckpointError::Incomplete {
                path: dir.to_path_buf(),
            });
        }
        let text = fs::read(&path).map_err(io_error(&path))?;
        let meta: Meta = serde_json::from_slice(&text).map_err(|e| CheckpointError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        // Another format is not damage: the build that wrote it reads it (and --resume
        // would otherwise point at an older checkpoint, dropping the newer one's steps).
        if meta.format != FORMAT {
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                detail: format!(
                    "written in checkpoint format {}, and this build reads format {FORMAT}: resume with the burnscale that wrote it",
                    meta.format
                ),
            });
        }
        if let Some(saved) = meta.crc32 {
            let corrupt = |e: serde_json::Error| CheckpointError::Corrupt {
                path: path.clone(),
                reason: e.to_string(),
            };
            let computed = json_crc32(&text).map_err(corrupt)?;
            // Sealed before the sum was over the file's JSON: over this build's `Meta`.
            let older = || meta.struct_crc32().map_err(corrupt);
            if computed != saved && older()? != saved {
                return Err(CheckpointError::Corrupt {
                    path,
                    reason: format!("CRC-32 {computed:08x}, its crc32 says {saved:08x}"),
                });
            }
        }
        if meta.world_size == 0 || meta.files.len() != meta.world_size {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!("{} files for {} ranks", meta.files.len(), meta.world_size),
            });
        }
        // Checkpoints are ordered, kept and pruned by their names' steps.
        if let Some(named) = step_named(dir)
            && named != meta.step
        {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!(
                    "it holds step {}, but its directory is named for step {named} (renamed or copied by hand?)",
                    meta.step
                ),
            });
        }
        // Tensors are read by rows (a replicated one's first, when it has one row): each has a
        // first dimension, and a size that can be counted.
        let states = meta.states.iter().flat_map(|s| &s.tensors);
        if let Some(t) = meta.params.iter().chain(states).find(|t| {
            t.dims.is_empty()
                || t.dims
                    .iter()
                    .try_fold(MAX_DTYPE_SIZE, |n, &d| n.checked_mul(d))
                    .is_none()
        }) {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!("`{}` has dimensions {:?}", t.name, t.dims),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files: (0..meta.world_size).map(|_| None).collect(),
            stored: None,
            meta,
        })
    }

    fn mismatch(&self, detail: String) -> CheckpointError {
        CheckpointError::Mismatch {
            path: self.dir.clone(),
            detail,
        }
    }

    /// `Ok` if the checkpoint holds exactly the parameters `slots` lay out, with their shapes;
    /// else an error naming what differs.
    pub fn check_model(&self, slots: &[Slot]) -> Result<(), CheckpointError> {
        let saved: HashMap<&str, &Vec<usize>> = self
            .meta
            .params
            .iter()
            .map(|p| (p.name.as_str(), &p.dims))
            .collect();
        let mut problems = Vec::new();
        for slot in slots {
            match saved.get(slot.path.as_str()) {
                None => problems.push(format!("`{}` is missing", slot.path)),
                Some(dims) if **dims != slot.dims => problems.push(format!(
                    "`{}` has shape {dims:?}, the model {:?}",
                    slot.path, slot.dims
                )),
                Some(_) => {}
            }
        }
        let ours: Vec<&str> = slots.iter().map(|s| s.path.as_str()).collect();
        problems.extend(
            self.meta
                .params
                .iter()
                .filter(|p| !ours.contains(&p.name.as_str()))
                .map(|p| format!("`{}` is not in the model", p.name)),
        );
        match problems.is_empty() {
            true => Ok(()),
            false => Err(self.mismatch(format!(
                "another model or configuration: {}",
                burnscale_nn::weights::listed(&problems, "; ")
            ))),
        }
    }

    /// The size of rank `r`'s file, which meta.json records: a file of another size is damaged.
    fn size_checked(&self, r: usize) -> Result<u64, CheckpointError> {
        let saved = &self.meta.files[r];
        let path = self.dir.join(&saved.name);
        let bytes = fs::metadata(&path).map_err(io_error(&path))?.len();
        match bytes == saved.bytes {
            true => Ok(bytes),
            false => Err(CheckpointError::Corrupt {
                path,
                reason: format!("{bytes} bytes, {META} says {} (truncated?)", saved.bytes),
            }),
        }
    }

    /// Rank `r`'s file, read and checked the first time it is needed.
    fn file(&mut self, r: usize) -> Result<&RankFile, CheckpointError> {
        if self.files[r].is_none() {
            self.size_checked(r)?;
            let saved = &self.meta.files[r];
            let path = self.dir.join(&saved.name);
            let corrupt = |reason: String| CheckpointError::Corrupt {
                path: path.clone(),
                reason,
            };
            let (_, crc) = checksum(&path)?;
            if crc != saved.crc32 {
                return Err(corrupt(format!(
                    "CRC-32 {crc:08x}, {META} says {:08x}",
                    saved.crc32
                )));
            }
            // SAFETY: a complete checkpoint's files are not written again.
            let map = File::open(&path)
                .and_then(|f| unsafe { Mmap::map(&f) })
                .map_err(io_error(&path))?;
            let (n, header) =
                SafeTensors::read_metadata(&map).map_err(|e| corrupt(e.to_string()))?;
            self.files[r] = Some(RankFile {
                data_start: 8 + n,
                map,
                header,
            });
        }
        Ok(self.files[r].as_ref().expect("read above"))
    }

    /// Rows `[from, from + count)` of `tensor` (saved under `prefix`: `param` or `optim`),
    /// read from the files that hold them, with zero rows appended up to `pad_to` rows (a
    /// shard's padding).
    fn rows(
        &mut self,
        prefix: &str,
        tensor: &SavedTensor,
        from: usize,
        count: usize,
        pad_to: usize,
    ) -> Result<TensorData, CheckpointError> {
        let dims = &tensor.dims;
        let dtype = parse_dtype(&tensor.dtype).ok_or_else(|| {
            self.mismatch(format!("`{}` is stored as {}", tensor.name, tensor.dtype))
        })?;
        if tensor.replicated {
            let whole = self.replicated(tensor, dtype)?;
            if dims.first() == Some(&1) {
                return Ok(whole);
            }
            // Only a one-row state is the same on every rank. burnscale before 2026-11-30 wrote
            // Adafactor's column moments of tensors above 2-D (each rank's own rows) as rank
            // 0's alone: its rows are read from it, whole where rank 0 held them all (one
            // rank, ddp), and rows it lacks are refused.
            if from + count > dims[0] {
                return Err(self.mismatch(format!(
                    "`{}` holds rows 0..{} alone (rank 0's: the other ranks' were not saved), where this rank reads rows {from}..{}: resume from a checkpoint written since, or start again",
                    tensor.name,
                    dims[0],
                    from + count
                )));
            }
            let row = whole.as_bytes().len() / dims[0];
            let bytes = whole.as_bytes()[from * row..(from + count) * row].to_vec();
            return Ok(padded(bytes, row, count, pad_to, dims, dtype));
        }
        // Held in memory before its pieces are read: no more than the files hold (a meta.json
        // edited by hand could ask for any size). A file of another size than meta.json's is
        // damaged, and named as such here, not taken for a checkpoint of another model.
        let stored = match self.stored {
            Some(stored) => stored,
            None => {
                let mut stored = 0u64;
                for r in 0..self.meta.files.len() {
                    stored = stored.saturating_add(self.size_checked(r)?);
                }
                *self.stored.insert(stored)
            }
        };
        let row = dims[1..]
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d));
        let Some(row) = row.filter(|&row| {
            (pad_to.max(count) as u64)
                .checked_mul(row as u64)
                .is_some_and(|b| b <= stored)
        }) else {
            return Err(self.mismatch(format!(
                "`{}` of shape {dims:?} is larger than the checkpoint's files",
                tensor.name
            )));
        };
        let name = format!("{prefix}/{}", tensor.name);
        let (world, per_rank) = (self.meta.world_size, dims[0].div_ceil(self.meta.world_size));
        let mut bytes = Vec::with_capacity(pad_to.max(count) * row);
        for r in 0..world {
            let start = (r * per_rank).min(dims[0]);
            let real = ((r + 1) * per_rank).min(dims[0]) - start;
            let (lo, hi) = (from.max(start), (from + count).min(start + real));
            if lo >= hi {
                continue;
            }
            let key = range_key(&name, start, real);
            let (path, what) = (self.dir.join(rank_file(r)), format!("{real} rows"));
            let data = self.file(r)?.tensor(&key, dtype, real * row, path, what)?;
            bytes.extend_from_slice(&data[(lo - start) * row..(hi - start) * row]);
        }
        Ok(padded(bytes, row, count, pad_to, dims, dtype))
    }

    /// A replicated optimizer state tensor, whole, from rank 0's file.
    fn replicated(
        &mut self,
        tensor: &SavedTensor,
        dtype: TensorDType,
    ) -> Result<TensorData, CheckpointError> {
        let key = whole_key(&tensor.name);
        let len = tensor.dims.iter().product::<usize>() * dtype.size();
        let (path, what) = (self.dir.join(rank_file(0)), format!("{len} bytes"));
        let bytes = self.file(0)?.tensor(&key, dtype, len, path, what)?.to_vec();
        Ok(TensorData::from_bytes_vec(
            bytes,
            tensor.dims.clone(),
            dtype,
        ))
    }
}

/// Refuses `weights` that a run saved ([`write_config`]) after training on the dataset `data`
/// names split another way: its `split` (the flags that draw the test set: `seed`,
/// `test_fraction`, ...) differs from this run's in a flag both record, so this run would
/// test on examples the weights trained on. Weights with no record beside them, or trained
/// on other data, pass.
pub fn check_held_out(weights: &Path, data: &serde_json::Value) -> Result<(), TrainError> {
    let path = config_path(weights);
    let text = match fs::read_to_string(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        read => read.map_err(|source| TrainError::Read {
            path: path.clone(),
            source,
        })?,
    };
    let recorded: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| TrainError::InvalidData(format!("{}: {e}", path.display())))?;
    let theirs = &recorded["data"];
    let same_data = theirs.get("data").is_some() && theirs.get("data") == data.get("data");
    let differences = split_differences(theirs, data);
    match same_data && !differences.is_empty() {
        true => Err(TrainError::HeldOut {
            weights: weights.to_path_buf(),
            config: path,
            differences: differences.join("; "),
        }),
        false => Ok(()),
    }
}

/// Where a data record from before its split had a field of its own kept the split's flags:
/// beside `data`.
const SPLIT_BESIDE_DATA: [&str; 2] = ["test_fraction", "max_length"];

/// The flags that draw a data record's test split: its `split`, or in a record from before
/// it had one, those beside `data` ([`SPLIT_BESIDE_DATA`]).
fn split_of(data: &serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match data.get("split").and_then(|s| s.as_object()) {
        Some(split) => split.clone(),
        None => SPLIT_BESIDE_DATA
            .into_iter()
            .filter_map(|key| Some((key.to_string(), data.get(key)?.clone())))
            .collect(),
    }
}

/// A data record without its split: the dataset itself.
fn dataset_of(data: &serde_json::Value) -> serde_json::Value {
    let mut data = data.clone();
    if let Some(fields) = data.as_object_mut() {
        for key in SPLIT_BESIDE_DATA.into_iter().chain(["split"]) {
            fields.remove(key);
        }
    }
    data
}

/// The split flags two data records both give and differ in (`--seed 0, this run 1`): a
/// flag one of them does not record (a record from before the seed was kept) is not
/// compared.
fn split_differences(saved: &serde_json::Value, ours: &serde_json::Value) -> Vec<String> {
    let ours = split_of(ours);
    split_of(saved)
        .iter()
        .filter_map(|(key, saved)| {
            let ours = ours.get(key).filter(|ours| *ours != saved)?;
            Some(format!(
                "--{} {saved}, this run {ours}",
                key.replace('_', "-")
            ))
        })
        .collect()
}

/// Ends the weights file `weights` (`finish` syncs it and gives it its name) with `config`
/// beside it ([`write_config`]): the configuration an earlier save left there is removed
/// first and the new one written after the weights take their name, so that a failure
/// between (a full disk at the last sync) leaves weights without a configuration, never
/// beside another run's.
pub fn finish_with_config(
    weights: &Path,
    config: Option<&serde_json::Value>,
    finish: impl FnOnce() -> Result<(), burnscale_nn::weights::WeightError>,
) -> Result<(), TrainError> {
    write_config(weights, None)?;
    finish()?;
    write_config(weights, config)
}

/// Removes the file at `path` if there is one.
fn remove_beside(path: &Path) -> Result<(), TrainError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(TrainError::Io {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Writes `config` beside `weights` ([`config_path`]) whole or not at all (a file of its own,
/// synced, renamed into place), or without a config removes one an earlier run left there.
pub fn write_config(weights: &Path, config: Option<&serde_json::Value>) -> Result<(), TrainError> {
    let path = config_path(weights);
    let io = |source| TrainError::Io {
        path: path.clone(),
        source,
    };
    let Some(config) = config else {
        return remove_beside(&path);
    };
    let partial = burnscale_nn::weights::partial_path(&path);
    let written = serde_json::to_string_pretty(config)
        .map_err(std::io::Error::other)
        .and_then(|text| {
            let mut file = File::create(&partial)?;
            std::io::Write::write_all(&mut file, text.as_bytes())?;
            file.sync_all()?;
            fs::rename(&partial, &path)
        });
    if written.is_err() {
        let _ = fs::remove_file(&partial);
    }
    written.map_err(io)
}

impl Checkpoint {
    /// The newest complete checkpoint under `path`, or the checkpoint `path` is.
    pub fn find(path: &Path) -> Result<Self, CheckpointError> {
        if path.join(META).is_file() {
            return Self::open(path);
        }
        // A mistyped path is not an interrupted save, nor is a directory of none.
        fs::metadata(path).map_err(io_error(path))?;
        let path = path.to_path_buf();
        Self::latest(&path)?.ok_or(match step_named(&path) {
            Some(_) => CheckpointError::Incomplete { path },
            None => CheckpointError::NoCheckpoint { path },
        })
    }

    /// What the checkpoint holds, one line each.
    pub fn describe(&self) -> String {
        let m = &self.meta;
        let param_bytes: usize = m
            .params
            .iter()
            .map(|p| {
                p.dims.iter().product::<usize>() * parse_dtype(&p.dtype).map_or(0, |d| d.size())
            })
            .sum();
        let state_bytes: usize = m
            .states
            .iter()
            .flat_map(|s| &s.tensors)
            .map(|t| {
                t.dims.iter().product::<usize>() * parse_dtype(&t.dtype).map_or(0, |d| d.size())
            })
            .sum();
        let mut lines = vec![
            format!("checkpoint {} (format {})", self.dir.display(), m.format),
            format!(
                "step {} ({} micro-batches of {} samples drawn), seed {}",
                m.step, m.micro_batches, m.global_batch, m.seed
            ),
            format!(
                "saved by {} ranks under --strategy {} --precision {} --optimizer {}",
                m.world_size, m.strategy, m.precision, m.optimizer
            ),
            match &m.model_config {
                Some(config) => format!("model config {config}"),
                None => "no model config".to_string(),
            },
            format!(
                "{} parameters in {} tensors ({} B), optimizer state {} B in {} tensors",
                m.params
                    .iter()
                    .map(|p| p.dims.iter().product::<usize>())
                    .sum::<usize>(),
                m.params.len(),
                param_bytes,
                state_bytes,
                m.states.iter().map(|s| s.tensors.len()).sum::<usize>()
            ),
        ];
        if let Some(scaler) = &m.loss_scaler {
            lines.push(format!("loss scale {}", scaler.scale()));
        }
        lines.extend(
            m.files
                .iter()
                .map(|f| format!("  {}: {} B, CRC-32 {:08x}", f.name, f.bytes, f.crc32)),
        );
        lines.extend(m.params.iter().map(|p| {
            let keys: Vec<&str> = p.export.iter().map(|(k, _)| k.as_str()).collect();
            format!(
                "  {} {:?} {} -> {}",
                p.name,
                p.dims,
                p.dtype,
                keys.join(", ")
            )
        }));
        lines.join("\n")
    }

    /// Writes the whole model to `out` in its own checkpoint layout (HF names and layouts,
    /// which the loaders' `--weights` read), as f32, one parameter at a time, and the run's
    /// recorded configuration beside it ([`config_path`]); with `with_optimizer`, every
    /// optimizer state tensor to a file of its own beside it ([`optimizer_path`]; as f32,
    /// 8-bit AdamW's codes as their map indices), so that `out` stays one `--weights` loads.
    /// Returns the number of tensors written.
    pub fn consolidate(&mut self, out: &Path, with_optimizer: bool) -> Result<usize, TrainError> {
        let meta = self.meta.clone();
        let transposed = |dims: &[usize], t: bool| {
            let mut dims = dims.to_vec();
            if t {
                dims.reverse();
            }
            dims
        };
        let mut plan = Vec::new();
        for p in &meta.params {
            if p.export.is_empty() {
                return Err(self
                    .mismatch(format!(
                        "`{}` has no file key (saved by an older build?)",
                        p.name
                    ))
                    .into());
            }
            plan.extend(p.export.iter().map(|(key, t)| Planned {
                key: key.clone(),
                dtype: Dtype::F32,
                shape: transposed(&p.dims, *t),
            }));
        }
        let metadata = HashMap::from([
            ("format".to_string(), "pt".to_string()),
            ("step".to_string(), meta.step.to_string()),
        ]);
        let mut writer = SafetensorsWriter::create_with(out, &plan, metadata.clone())?;
        for p in &meta.params {
            let weight = self.whole("param", p)?;
            for (key, t) in &p.export {
                match t {
                    true => writer.write(key, &weight.clone().transposed().values)?,
                    false => writer.write(key, &weight.values)?,
                }
            }
        }
        // An optimizer file an earlier consolidation left there is another step's state.
        remove_beside(&optimizer_path(out))?;
        finish_with_config(out, meta.model_config.as_ref(), || writer.finish())?;
        let mut written = plan.len();
        if with_optimizer {
            let states: Vec<&SavedTensor> = meta.states.iter().flat_map(|s| &s.tensors).collect();
            let plan: Vec<Planned> = states
                .iter()
                .map(|t| Planned {
                    key: t.name.clone(),
                    dtype: Dtype::F32,
                    shape: t.dims.clone(),
                })
                .collect();
            let path = optimizer_path(out);
            let mut writer = SafetensorsWriter::create_with(&path, &plan, metadata)?;
            for t in &states {
                writer.write(&t.name, &self.whole("optim", t)?.values)?;
            }
            writer.finish()?;
            written += plan.len();
        }
        Ok(written)
    }

    /// The whole of `tensor` (saved under `prefix`) as f32.
    fn whole(&mut self, prefix: &str, tensor: &SavedTensor) -> Result<Weight, TrainError> {
        // `open` refused split tensors without rows; a replicated one is read whole.
        let d0 = tensor.dims.first().copied().unwrap_or(1);
        let values = self
            .rows(prefix, tensor, 0, d0, d0)?
            .try_into_vec_as::<f32>()
            .map_err(|e| self.mismatch(format!("`{}`: {e:?}", tensor.name)))?;
        Ok(Weight::new(String::new(), tensor.dims.clone(), values))
    }
}

/// Where a resumed run continues: the checkpoint's step.
pub struct Resumed {
    pub dir: PathBuf,
    pub step: usize,
    /// How this run's learning-rate schedule differs from the one the checkpoint's run
    /// followed (this run's is followed from here), as `--lr 0.01, this run 0.02`.
    pub schedule_changes: Vec<String>,
    /// How this run's optimizer settings differ from those the checkpoint's run stepped with
    /// (its state goes on under this run's).
    pub optimizer_changes: Vec<String>,
}

/// Each field of a model configuration that differs between the checkpoint's and the run's
/// (both JSON objects; nothing when either is absent), as `model config: n_head 4, this run 2`.
/// A field the checkpoint lacks is not compared: the program that saved it did not record it.
fn config_differences(
    saved: Option<&serde_json::Value>,
    ours: Option<&serde_json::Value>,
) -> Vec<String> {
    let (Some(saved), Some(ours)) = (saved, ours) else {
        return Vec::new();
    };
    let (Some(saved), Some(ours)) = (saved.as_object(), ours.as_object()) else {
        return match saved == ours {
            true => Vec::new(),
            false => vec![format!("model config {saved}, this run {ours}")],
        };
    };
    let missing = serde_json::Value::Null;
    let mut keys: Vec<&String> = saved.keys().chain(ours.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .flat_map(|key| {
            let Some(a) = saved.get(key) else {
                return Vec::new();
            };
            let b = ours.get(key).unwrap_or(&missing);
            match key.as_str() {
                // The same data split another way: what differs, by flag.
                "data" if dataset_of(a) == dataset_of(b) => split_differences(a, b)
                    .into_iter()
                    .map(|flags| format!("model config: data split {flags}"))
                    .collect(),
                _ if a != b => vec![format!("model config: {key} {a}, this run {b}")],
                _ => Vec::new(),
            }
        })
        .collect()
}

/// Continues from `ckpt` on this rank: its parameters and optimizer state (the rows this
/// rank's strategy holds), the loss scaler, the schedule, the data position and (at the same
/// world size) the dropout stream. Checks first that the checkpoint fits the run.
#[allow(clippy::too_many_arguments)]
pub fn restore<T: TrainTask>(
    mut ckpt: Checkpoint,
    comm: &dyn Communicator,
    engine: &mut Sharded<'_, T::Model>,
    optim: &mut ParamOptimizer,
    schedule: &mut LrSchedule,
    task: &mut T,
    args: &TrainArgs,
    device: &Device,
) -> Result<Resumed, TrainError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let meta = ckpt.meta.clone();
    let global_batch = world * args.batch_size;
    let differs = |what: &str, saved: String, ours: String| {
        (saved != ours).then(|| format!("{what} {saved}, this run {ours}"))
    };
    let problems: Vec<String> = [
        differs(
            "--optimizer",
            meta.optimizer.clone(),
            value_name(args.optimizer),
        ),
        differs(
            "samples per micro-step (--batch-size times the ranks)",
            meta.global_batch.to_string(),
            global_batch.to_string(),
        ),
        // The weights' dtype is the precision's, and a 16-mixed run's loss scaler is saved
        // for that precision alone.
        differs(
            "--precision",
            meta.precision.clone(),
            args.precision.to_string(),
        ),
        // The data order after the checkpoint is drawn from the seed.
        differs("--seed", meta.seed.to_string(), args.seed.to_string()),
        // The data position is counted in micro-batches, `--accumulate` a step: with
        // another count the next checkpoint would misplace it.
        (meta.step > 0 && Some(meta.micro_batches) != meta.step.checked_mul(args.accumulate)).then(|| {
            format!(
                "micro-batches per optimizer step (--accumulate) {}, this run {}",
                meta.micro_batches / meta.step,
                args.accumulate
            )
        }),
        // The scaler resumes at its saved scale, which another starting scale would not
        // change; the same one (a requeue's own command) is the checkpoint's run's.
        args.initial_loss_scale
            .zip(meta.loss_scaler.as_ref())
            .filter(|(given, saved)| *given != saved.initial_scale())
            .map(|(given, saved)| {
                format!(
                    "--initial-loss-scale {}, this run {given} (the scale resumes where it was saved: drop the flag or give the same)",
                    saved.initial_scale()
                )
            }),
    ]
    .into_iter()
    .flatten()
    .chain(config_differences(
        meta.model_config.as_ref(),
        args.model_config.as_ref(),
    ))
    .collect();
    if !problems.is_empty() {
        return Err(ckpt.mismatch(problems.join("; ")).into());
    }
    // After the settings: another model config (which names the cause) differs in every
    // tensor too.
    ckpt.check_model(engine.slots())?;
    // At --max-steps itself the run takes no step, and evaluates and saves the checkpoint's
    // model: a run stopped after its last checkpoint, requeued as it was, ends.
    if meta.step > args.max_steps {
        return Err(TrainError::InvalidArgs(format!(
            "the checkpoint in {} is at step {}, past --max-steps {} (raise it to continue)",
            ckpt.dir.display(),
            meta.step,
            args.max_steps
        )));
    }
    let sharding = engine.sharding();
    let inner = device.clone().inner();
    // The rows of a tensor shaped as `slot` this rank holds: its shard, or all of them.
    let wanted = |slot: &Slot, sharded: bool| match sharded {
        true => {
            let (start, real) = slot.owned_rows(rank);
            (start, real, slot.rows)
        }
        false => (0, slot.dims[0], slot.dims[0]),
    };
    let mut values = HashMap::new();
    let saved: HashMap<&str, &SavedTensor> =
        meta.params.iter().map(|p| (p.name.as_str(), p)).collect();
    for slot in engine.slots() {
        // check_model made sure every parameter is saved, with its shape.
        let (from, count, pad) = wanted(slot, sharding.parameters);
        let data = ckpt.rows("param", saved[slot.path.as_str()], from, count, pad)?;
        values.insert(slot.id, flat(data, &inner));
    }
    engine.set_held_parameters(values)?;
    let slots: HashMap<String, Slot> = engine
        .slots()
        .iter()
        .map(|s| (s.path.clone(), s.clone()))
        .collect();
    for state in &meta.states {
        let Some(slot) = slots.get(&state.param) else {
            return Err(ckpt
                .mismatch(format!(
                    "optimizer state for `{}`, no parameter",
                    state.param
                ))
                .into());
        };
        let (from, count, pad) = wanted(slot, sharding.optimizer_state);
        let scalars = state
            .scalars
            .iter()
            .map(|(name, text)| {
                decode(text)
                    .map(|s| (name.clone(), s))
                    .ok_or_else(|| ckpt.mismatch(format!("scalar `{name}` = {text:?}")))
            })
            .collect::<Result<_, _>>()?;
        let mut saved = StateSink {
            scalars,
            ..StateSink::default()
        };
        for t in &state.tensors {
            let data = ckpt.rows("optim", t, from, count, pad)?;
            saved.tensors.push((t.name.clone(), data));
        }
        optim.restore_state(slot.dims.len(), &state.param, saved, &inner)?;
    }
    if let Some(saved) = &meta.loss_scaler {
        engine.restore_scaler(saved);
    }
    // The steps the scaler skipped moved the schedule no further.
    let skipped = meta.loss_scaler.as_ref().map_or(0, |s| s.skipped());
    for _ in 0..meta.step.saturating_sub(skipped) {
        schedule.advance();
    }
    task.skip(meta.micro_batches, device, BatchPart { rank, world });
    // A rank's stream is seeded by its rank alone: at any world size rank r goes on with the
    // stream of the checkpoint's rank r, drawing no mask that run drew (at another world
    // size the masks are others than the uninterrupted run's anyway); a rank the
    // checkpoint's run did not have starts its own.
    if let Some(&(seed, calls)) = meta.dropout.get(rank) {
        dropout::rewind(dropout::StreamPosition(seed, calls));
    }
    Ok(Resumed {
        dir: ckpt.dir,
        step: meta.step,
        schedule_changes: changes(&meta.schedule, &LrSchedule::flags(args)),
        optimizer_changes: changes(&meta.optimizer_flags, &crate::optim::optimizer_flags(args)),
    })
}

/// Each flag of `saved` whose value `ours` has otherwise, as `--lr 0.01, this run 0.02`. A
/// flag the checkpoint did not record (an older program's) is not compared, nor one this run
/// does not read (`--schedule` or `--optimizer` itself says a change of kind).
fn changes(saved: &BTreeMap<String, String>, ours: &BTreeMap<String, String>) -> Vec<String> {
    saved
        .iter()
        .filter_map(|(flag, saved)| {
            let now = ours.get(flag)?;
            (saved != now).then(|| format!("{flag} {saved}, this run {now}"))
        })
        .collect()
}

/// `data` (any shape) as a flat tensor on `device`, in its dtype.
fn flat(data: TensorData, device: &Device) -> Tensor<1> {
    let n = data.num_elements();
    let dtype = data.dtype();
    let bytes = data.into_bytes();
    Tensor::from_data(
        TensorData::from_bytes_vec(bytes.to_vec(), vec![n], dtype),
        (device, dtype),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `meta.json`'s CRC is over the file's JSON: a member a newer build adds (which this
    /// build's `Meta` drops) keeps it whole, an altered value does not, and a file sealed
    /// before (the sum over this build's `Meta`) still opens.
    #[test]
    fn a_field_another_build_adds_keeps_meta_json_whole() {
        use serde_json::json;
        let dir = tempfile::tempdir().unwrap();
        let meta: Meta = serde_json::from_value(json!({
            "format": FORMAT, "step": 1, "micro_batches": 1, "global_batch": 2,
            "world_size": 1, "strategy": "single", "precision": "32-true",
            "optimizer": "sgd", "seed": 0, "dropout": [[0, 0]], "params": [], "states": [],
            "files": [{"name": "rank-00000.safetensors", "bytes": 8, "crc32": 0}],
        }))
        .unwrap();
        let open = |text: &[u8]| {
            fs::write(dir.path().join(META), text).unwrap();
            Checkpoint::open(dir.path())
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert_eq!(open(&sealed(&meta).unwrap()), Ok(()));
        let mut newer = serde_json::to_value(&meta).unwrap();
        newer["future"] = json!({"added": 1});
        let crc = json_crc32(&serde_json::to_vec(&newer).unwrap()).unwrap();
        newer["crc32"] = json!(crc);
        assert_eq!(open(&serde_json::to_vec_pretty(&newer).unwrap()), Ok(()));
        newer["seed"] = json!(1);
        let damaged = open(&serde_json::to_vec_pretty(&newer).unwrap()).unwrap_err();
        assert!(damaged.contains("its crc32 says"), "{damaged}");
        let older = Meta {
            crc32: Some(meta.struct_crc32().unwrap()),
            ..meta.clone()
        };
        assert_eq!(open(&serde_json::to_vec_pretty(&older).unwrap()), Ok(()));
    }

    /// The checkpoint before a damaged newest one (a file missing, truncated) is named to
    /// resume from; not before one that could not be read for another reason (permissions),
    /// whose steps moving it away would lose.
    #[test]
    fn only_a_damaged_newest_checkpoint_points_to_the_one_before() {
        let root = tempfile::tempdir().unwrap();
        for step in [1, 2] {
            let dir = step_dir(root.path(), step);
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join(META), "{}").unwrap();
        }
        let newest = step_dir(root.path(), 2).join(rank_file(0));
        let failed = |kind: std::io::ErrorKind| {
            let error = CheckpointError::Io {
                path: newest.clone(),
                source: kind.into(),
            };
            naming_older(root.path(), error.into()).to_string()
        };
        let before = step_dir(root.path(), 1).display().to_string();
        for kind in [
            std::io::ErrorKind::NotFound,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            let message = failed(kind);
            assert!(
                message.contains(&format!("the checkpoint before it, {before}")),
                "{message}"
            );
        }
        let denied = failed(std::io::ErrorKind::PermissionDenied);
        assert!(!denied.contains("checkpoint before it"), "{denied}");
    }

    /// Weights saved after training on a split of some data are refused for a run that
    /// splits the same data another way (in a flag both record), and pass for the same split,
    /// other data, or no record.
    #[test]
    fn weights_are_not_tested_on_another_split_of_their_training_data() {
        use serde_json::json;
        let dir = tempfile::tempdir().unwrap();
        let weights = dir.path().join("model.safetensors");
        let split = |seed: u64, fraction: f64| json!({"data": "digits", "split": {"seed": seed, "test_fraction": fraction}});
        let check =
            |data: &serde_json::Value| check_held_out(&weights, data).map_err(|e| e.to_string());
        assert_eq!(
            check(&split(1, 0.3)),
            Ok(()),
            "no record beside the weights"
        );
        write_config(&weights, Some(&json!({"hidden": 8, "data": split(0, 0.2)}))).unwrap();
        assert_eq!(check(&split(0, 0.2)), Ok(()));
        assert_eq!(
            check(&json!({"data": "cifar10", "train_batches": []})),
            Ok(())
        );
        let err = check(&split(1, 0.3)).unwrap_err();
        assert!(
            err.contains(
                "split another way (--seed 0, this run 1; --test-fraction 0.2, this run 0.3, as "
            ) && err.contains("model.config.json records)"),
            "{err}"
        );
        // A record from before the split had its own field (no seed, the fraction beside the
        // data's name): the fraction is compared, the seed it does not record is not.
        let old = json!({"data": "digits", "test_fraction": 0.2});
        write_config(&weights, Some(&json!({"data": old}))).unwrap();
        assert_eq!(check(&split(1, 0.2)), Ok(()));
        assert!(check(&split(1, 0.3)).is_err());

        // A checkpoint resumes on the same split, whichever record it has, and names the flag
        // of another split; other data is named whole.
        let config = |data: serde_json::Value| json!({"hidden": 8, "data": data});
        let differences = |saved: &serde_json::Value, ours: serde_json::Value| {
            config_differences(Some(&config(saved.clone())), Some(&config(ours)))
        };
        assert!(differences(&old, split(42, 0.2)).is_empty());
        assert_eq!(
            differences(&old, split(42, 0.3)),
            ["model config: data split --test-fraction 0.2, this run 0.3"]
        );
        assert_eq!(
            differences(&split(42, 0.2), split(1, 0.2)),
            ["model config: data split --seed 42, this run 1"]
        );
        let cifar = json!({"data": "cifar10", "train_batches": []});
        assert_eq!(differences(&cifar, split(42, 0.2)).len(), 1);
    }

    /// A checkpoint directory that is not one directory for all ranks (here rank 2's path
    /// is another directory, as a node's local disk would be) stops every rank before
    /// training, naming the ranks that do not see rank 0's file; one directory passes, and
    /// is left as it was.
    #[test]
    fn a_checkpoint_directory_the_ranks_do_not_share_is_refused() {
        use burnscale_collective::threads::{DEFAULT_TIMEOUT, ThreadComm};
        let base = std::env::temp_dir().join(format!("burnscale-shared-{}", std::process::id()));
        let (shared, local) = (base.join("shared"), base.join("local"));
        for dir in [&shared, &local] {
            fs::create_dir_all(dir).unwrap();
        }
        let ranks = ThreadComm::run(3, DEFAULT_TIMEOUT, |comm| {
            let dir = if comm.rank() == 2 { &local } else { &shared };
            check_shared(&comm, dir).map_err(|e| e.to_string())
        });
        for rank in ranks {
            let err = rank.unwrap().unwrap_err();
            assert!(
                err.contains("ranks [2] do not see the file rank 0 wrote there"),
                "{err}"
            );
        }
        let ranks = ThreadComm::run(3, DEFAULT_TIMEOUT, |comm| {
            check_shared(&comm, &shared).is_ok()
        });
        assert!(ranks.into_iter().all(|r| r == Ok(true)));
        assert_eq!(fs::read_dir(&shared).unwrap().count(), 0);
        fs::remove_dir_all(&base).unwrap();
    }

    /// Ranks that see different newest checkpoints (one directory listed differently on
    /// two nodes) all stop, naming what each found; one that could not read it stops with
    /// its own error, the others naming it; alike, they go on.
    #[test]
    fn ranks_that_find_different_checkpoints_stop_naming_them() {
        use burnscale_collective::threads::{DEFAULT_TIMEOUT, ThreadComm};
        let root = Path::new("/ckpt");
        let agree = |comm: &ThreadComm, found| {
            agree_on_newest(comm, root, found, |step: &usize| *step).map_err(|e| e.to_string())
        };
        let ranks = ThreadComm::run(3, DEFAULT_TIMEOUT, |comm| {
            agree(&comm, Ok([Some(4), Some(4), None][comm.rank()]))
        });
        for rank in ranks {
            let err = rank.unwrap().unwrap_err();
            assert!(
                err.contains("/ckpt (rank 0: step 4, rank 1: step 4, rank 2: none)"),
                "{err}"
            );
        }
        let ranks = ThreadComm::run(2, DEFAULT_TIMEOUT, |comm| match comm.rank() {
            1 => agree(&comm, Err(TrainError::InvalidData("torn meta.json".into()))),
            _ => agree(&comm, Ok(Some(4))),
        });
        let errors: Vec<String> = ranks.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
        assert!(errors[0].contains("rank 1 could not read"), "{}", errors[0]);
        assert!(errors[1].contains("torn meta.json"), "{}", errors[1]);
        let ranks = ThreadComm::run(2, DEFAULT_TIMEOUT, |comm| agree(&comm, Ok(Some(6))));
        assert!(ranks.into_iter().all(|r| r == Ok(Ok(Some(6)))));
    }

    #[test]
    fn scalars_round_trip_exactly() {
        for s in [
            Scalar::Int(-3),
            Scalar::UInt(7),
            Scalar::Float(0.1),
            Scalar::Float(f64::NAN),
            Scalar::Bool(true),
        ] {
            let back = decode(&encode(&s)).unwrap();
            assert_eq!(format!("{back:?}"), format!("{s:?}"));
        }
        assert!(decode("x1").is_none() && decode("").is_none());
    }

    /// A `[2, 4]` matrix over 2 ranks: each owns one row, so a state of one row is a shard's
    /// (AdamW's moments) unless it is Adafactor's column moment, the same on every rank.
    #[test]
    fn a_column_moment_is_whole_when_a_rank_owns_one_row() {
        let slot = Slot {
            id: burn::module::ParamId::new(),
            path: "embeddings.token_type_embeddings.weight".into(),
            dims: vec![2, 4],
            rows: 0,
        }
        .over(2);
        let column = format!("p.{}", crate::adafactor::COLUMN_MOMENT);
        assert!(replicated(&column, &[1, 4], &slot).unwrap());
        assert!(!replicated("p.moment_1", &[1, 4], &slot).unwrap());
        assert!(!replicated("p.moment_1", &[2, 4], &slot).unwrap());
        assert!(replicated("p.moment_1", &[3, 4], &slot).is_err());
        assert!(replicated(&column, &[1, 4], &slot.clone().over(1)).unwrap());
        // A convolution's `[out, in, k, k]` kernel: its column moment (`[out, in, 1, k]`, the
        // mean over each of its rows' kernel rows) is each rank's own rows, one each here.
        let kernel = Slot {
            dims: vec![2, 3, 2, 2],
            ..slot
        }
        .over(2);
        assert!(!replicated(&column, &[1, 3, 1, 2], &kernel).unwrap());
        assert!(!replicated(&column, &[2, 3, 1, 2], &kernel.over(1)).unwrap());
    }
}
