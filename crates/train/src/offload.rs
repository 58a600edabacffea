//! Optimizer state on disk between steps (`--offload-dir`, the ZeRO-Infinity idea): each
//! parameter's state lives in its own file; the step reads it in through a memory map, steps
//! that one parameter and writes the new state back, so the process holds the state of one
//! parameter at a time instead of all of it (the kernel's page cache keeps recently used
//! file pages, which it reclaims under pressure).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::optim::{DynOptimizer, DynState, StateSink};
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use burn::tensor::DType;
use memmap2::Mmap;
use tempfile::TempDir;

use crate::TrainError;
use crate::accelerator::host_name;

/// This rank's optimizer state files under `--offload-dir`: a fresh `rank{N}-XXXXXX`
/// directory of this run's own, removed when training ends (and `--offload-dir` itself when
/// the run made it and nothing else is left there). The directory's [`LOCK`] file is locked
/// while the run lives, so that the next run can tell the directory of one that was killed.
pub struct DiskStates {
    /// Held, not read: the kernel releases it however the process ends. Closed before `dir`
    /// is removed (declared before it): NFS keeps an open file that is removed as a
    /// `.nfsXXXX` file, which would keep the directory from being removed.
    _lock: File,
    dir: TempDir,
    /// Read only by their drops, which run after `dir`'s (declared after it).
    _live: Live,
    _made_root: MadeRoot,
    entries: HashMap<String, Entry>,
}

/// The file in each run's directory that the run holds an exclusive lock on while it lives.
const LOCK: &str = ".burnscale.lock";

/// The run directories this process has open. On NFS a lock is the whole process's (Linux
/// emulates `flock` with POSIX locks there): one rank would find another in-process rank's
/// directory unlocked, and closing the lock file it opened to look would even unlock it for
/// other processes. These are never judged by their locks.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A run directory, in [`LIVE`] while this lives.
struct Live(PathBuf);

impl Live {
    fn new(dir: &Path) -> Self {
        live_dirs().push(dir.to_path_buf());
        Live(dir.to_path_buf())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        live_dirs().retain(|dir| *dir != self.0);
    }
}

fn live_dirs() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `--offload-dir`, which the rank that finds it missing makes and marks with [`MADE`]: the
/// last rank to leave a marked root with nothing else in it removes it (whichever rank that
/// is, thread or process). Ranks enter under a shared lock on the root directory and remove
/// it under an exclusive one, so that a run starting in a root that another is leaving
/// neither finds the root gone under it nor leaves it unmarked (where the filesystem has no
/// directory locks, NFS, they go unlocked and can still meet so).
struct MadeRoot(PathBuf);

/// The file that says a run made its `--offload-dir`.
const MADE: &str = ".burnscale-made";

impl MadeRoot {
    /// Makes and marks `root` where it is missing, then makes this rank's directory in it
    /// by `enter`, under a shared lock on `root`: a root that a rank leaving it removes
    /// meanwhile is made again.
    fn enter<T>(root: &Path, enter: impl Fn() -> io::Result<T>) -> io::Result<(Self, T)> {
        loop {
            if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent)?;
            }
            match fs::create_dir(root) {
                Ok(()) => fs::write(root.join(MADE), [])?,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            // A root removed since is made again.
            let held = match File::open(root) {
                Ok(held) => held,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let _ = held.lock_shared();
            if is_at(&held, root) {
                return Ok((Self(root.to_path_buf()), enter()?));
            }
        }
    }
}

/// Whether `held` is still the directory at `path` (not one removed since it was opened).
fn is_at(held: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (held.metadata(), fs::metadata(path)) {
        (Ok(held), Ok(now)) => (held.dev(), held.ino()) == (now.dev(), now.ino()),
        _ => false,
    }
}

impl Drop for MadeRoot {
    fn drop(&mut self) {
        let Ok(held) = File::open(&self.0) else {
            return;
        };
        let _ = held.lock();
        let only_marked = is_at(&held, &self.0)
            && fs::read_dir(&self.0).is_ok_and(|entries| {
                let names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
                names.len() == 1 && names[0] == MADE
            });
        if only_marked {
            let _ = fs::remove_file(self.0.join(MADE)).and_then(|()| fs::remove_dir(&self.0));
        }
    }
}

/// Where one parameter's state is: its file, the tensors in it, and the scalars (step
/// counters), which stay in memory.
struct Entry {
    file: PathBuf,
    tensors: Vec<Stored>,
    scalars: Vec<(String, Scalar)>,
}

struct Stored {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    offset: usize,
    len: usize,
}

impl DiskStates {
    /// Creates a directory of this run's own under `root` (and `root` if needed), and
    /// checks that it takes writes.
    pub fn create(root: &Path, rank: usize) -> Result<Self, TrainError> {
        let io = |source| TrainError::Offload {
            path: root.to_path_buf(),
            source,
        };
        let (made_root, dir) = MadeRoot::enter(root, || {
            tempfile::Builder::new()
                .prefix(&format!("rank{rank}-"))
                .tempdir_in(root)
        })
        .map_err(io)?;
        let host = host_name();
        if let Some(host) = &host {
            remove_dead_runs(root, host);
        }
        let live = Live::new(dir.path());
        let in_dir = |source| TrainError::Offload {
            path: dir.path().to_path_buf(),
            source,
        };
        // Locked before it takes its name, so that no other run finds it unlocked; on a
        // filesystem without locks, or a machine without a name to write in it, it keeps
        // no name, and a killed run's files stay.
        let unnamed = dir.path().join(".lock-new");
        let mut lock = File::create_new(&unnamed).map_err(in_dir)?;
        if let Some(host) = host {
            lock.write_all(host.as_bytes()).map_err(in_dir)?;
            if lock.try_lock().is_ok() {
                fs::rename(&unnamed, dir.path().join(LOCK)).map_err(in_dir)?;
            }
        }
        let probe = dir.path().join(".probe");
        fs::write(&probe, [0u8; 4096])
            .and_then(|()| fs::remove_file(&probe))
            .map_err(in_dir)?;
        Ok(Self {
            dir,
            _live: live,
            _made_root: made_root,
            _lock: lock,
            entries: HashMap::new(),
        })
    }

    /// Writes `state` of the parameter at `path`, in place after the first step, by
    /// positional writes synced to the disk: a full disk is an error here rather than a
    /// fault on a mapped page.
    pub fn store(
        &mut self,
        optim: &dyn DynOptimizer,
        path: &str,
        state: &DynState,
    ) -> Result<(), TrainError> {
        let mut sink = StateSink::default();
        optim.state_flatten(path, state, &mut sink);
        let file = self
            .dir
            .path()
            .join(format!("{}.bin", path.replace('/', "_")));
        let mut offset = 0;
        let tensors: Vec<Stored> = sink
            .tensors
            .iter()
            .map(|(name, data)| {
                let len = data.as_bytes().len();
                offset += len;
                Stored {
                    name: name.clone(),
                    shape: data.shape().iter().copied().collect(),
                    dtype: data.dtype(),
                    offset: offset - len,
                    len,
                }
            })
            .collect();
        let io = |source| TrainError::Offload {
            path: file.clone(),
            source,
        };
        // A state of scalars only (SGD without momentum) has no file.
        let written = offset > 0;
        // Written in place, by positional writes rather than a memory map: a write that finds
        // the disk full (btrfs and ZFS take new blocks to overwrite) is an error here rather
        // than a SIGBUS, and `sync_data` reports what write-back met (an NFS quota).
        if written {
            let out = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&file)
                .map_err(io)?;
            out.set_len(offset as u64).map_err(io)?;
            for ((_, data), stored) in sink.tensors.iter().zip(&tensors) {
                out.write_all_at(data.as_bytes(), stored.offset as u64)
                    .map_err(io)?;
            }
            out.sync_data().map_err(io)?;
        }
        self.entries.insert(
            path.to_string(),
            Entry {
                file,
                tensors,
                scalars: sink.scalars,
            },
        );
        Ok(())
    }

    /// The paths of the parameters whose state is on disk.
    pub fn paths(&self) -> impl Iterator<Item = &String> {
        self.entries.keys()
    }

    /// The state of the parameter at `path` as stored (flattened), read from its file.
    pub fn flattened(&self, path: &str) -> Result<StateSink, TrainError> {
        let mut sink = StateSink::default();
        let Some(entry) = self.entries.get(path) else {
            return Ok(sink);
        };
        sink.scalars = entry.scalars.clone();
        if entry.tensors.is_empty() {
            return Ok(sink);
        }
        let io = |source| TrainError::Offload {
            path: entry.file.clone(),
            source,
        };
        // SAFETY: the file is in this run's own directory, written and synced by `store`
        // alone; a truncated file is caught below.
        let map = File::open(&entry.file)
            .and_then(|f| unsafe { Mmap::map(&f) })
            .map_err(io)?;
        for t in &entry.tensors {
            let bytes = map.get(t.offset..t.offset + t.len).ok_or_else(|| {
                io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "truncated: {} bytes, the state needs {}",
                        map.len(),
                        t.offset + t.len
                    ),
                ))
            })?;
            let data = TensorData::from_bytes_vec(bytes.to_vec(), t.shape.clone(), t.dtype);
            sink.tensors.push((t.name.clone(), data));
        }
        Ok(sink)
    }

    /// Bytes of state on disk.
    pub fn bytes(&self) -> usize {
        self.entries
            .values()
            .flat_map(|e| &e.tensors)
            .map(|t| t.len)
            .sum()
    }
}

/// Removes the directories under `root` of the runs on `host` (this machine) that were
/// killed (a SIGKILL, the out-of-memory killer): those whose [`LOCK`] file names `host` and
/// no process holds, each with a note. A live run's directory stays, and so does anything
/// without a lock file, or with another machine's (a filesystem shared by nodes may keep
/// its locks on each node). Housekeeping: what cannot be read is left as it is.
fn remove_dead_runs(root: &Path, host: &str) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for dir in entries.flatten().map(|entry| entry.path()) {
        if live_dirs().contains(&dir) {
            continue;
        }
        // Opened for writing: NFS takes an exclusive lock only on such a file.
        let Ok(mut lock) = OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(LOCK))
        else {
            continue;
        };
        let mut owner = String::new();
        if lock.read_to_string(&mut owner).is_err() || owner != host {
            continue;
        }
        if lock.try_lock().is_err() {
            continue; // its run lives (or another rank is removing it)
        }
        let note = match remove_run(&dir, lock) {
            Ok(()) => format!("removed {}", dir.display()),
            // Removed by another rank that held the lock before this one.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => format!("cannot remove {} ({e})", dir.display()),
        };
        // One write, so that the ranks' notes do not interleave.
        let line = format!("note: {note}: optimizer state files of a run that was killed\n");
        let _ = io::stderr().write_all(line.as_bytes());
    }
}

/// Removes the dead run's directory `dir`, whose [`LOCK`] file this process holds as `lock`:
/// the lock file last, once closed (NFS keeps an open file that is removed as a `.nfsXXXX`
/// file, which would keep the directory).
fn remove_run(dir: &Path, lock: File) -> io::Result<()> {
    for entry in fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        match entry.file_name() == LOCK {
            true => continue,
            false if path.is_dir() => fs::remove_dir_all(&path)?,
            false => fs::remove_file(&path)?,
        }
    }
    drop(lock);
    fs::remove_file(dir.join(LOCK))?;
    fs::remove_dir(dir)
}

#[cfg(test)]
mod tests {
    use burn::optim::AdamWConfig;

    use super::*;

    /// AdamW's state for a 2x3 parameter after two steps.
    fn stepped_state(optim: &dyn DynOptimizer, device: &Device) -> DynState {
        let mut state = None;
        for _ in 0..2 {
            let param = Tensor::<2>::from_floats([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]], device);
            let grad = Tensor::<2>::from_floats([[0.1, 0.2, -0.3], [1.0, -1.0, 0.0]], device);
            state = optim
                .step_dyn(2, 1e-2, param.into_bridge(), grad.into_bridge(), state)
                .1;
        }
        state.expect("AdamW keeps state")
    }

    #[test]
    fn state_round_trips_and_a_truncated_file_is_an_error() {
        let device = Device::flex();
        let optim = AdamWConfig::new().build();
        let root = std::env::temp_dir().join(format!("burnscale-offload-{}", std::process::id()));
        let mut disk = DiskStates::create(&root, 0).unwrap();
        assert!(disk.flattened("w").unwrap().tensors.is_empty());

        let state = stepped_state(&optim, &device);
        disk.store(&optim, "w", &state).unwrap();
        assert_eq!(disk.bytes(), 2 * 6 * 4, "two f32 moments");
        // The second store rewrites the existing file in place.
        disk.store(&optim, "w", &state).unwrap();
        let mut stored = StateSink::default();
        optim.state_flatten("w", &state, &mut stored);
        let loaded = disk.flattened("w").unwrap();
        assert_eq!(
            format!("{:?}", loaded.tensors),
            format!("{:?}", stored.tensors)
        );
        assert_eq!(
            format!("{:?}", loaded.scalars),
            format!("{:?}", stored.scalars)
        );

        let file = disk.dir.path().join("w.bin");
        File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(10)
            .unwrap();
        let err = disk.flattened("w").err().unwrap().to_string();
        assert!(err.contains("truncated") && err.contains("w.bin"), "{err}");
        drop(disk);
        assert!(
            !root.exists(),
            "the rank's directory and the root it made are gone"
        );
    }

    /// A run killed while it trains leaves its directory, whose lock the kernel releases:
    /// the next run removes it, and leaves a live run's directory and others' files.
    #[test]
    fn the_next_run_removes_the_files_of_a_killed_one() {
        let device = Device::flex();
        let optim = AdamWConfig::new().build();
        let root = std::env::temp_dir().join(format!("burnscale-killed-{}", std::process::id()));
        let live = DiskStates::create(&root, 0).unwrap();
        let mut killed = DiskStates::create(&root, 1).unwrap();
        killed
            .store(&optim, "w", &stepped_state(&optim, &device))
            .unwrap();
        // What the kernel does to a killed process: its lock goes, its files stay (and the
        // next run, another process, does not know it).
        let DiskStates {
            dir, _lock, _live, ..
        } = killed;
        drop((_lock, _live));
        let killed = dir.keep();
        let other = root.join("rank1-not-a-run");
        fs::create_dir(&other).unwrap();
        let elsewhere = root.join("rank2-another-node");
        fs::create_dir(&elsewhere).unwrap();
        fs::write(elsewhere.join(LOCK), "not-this-host").unwrap();

        let next = DiskStates::create(&root, 1).unwrap();
        assert!(!killed.exists(), "the killed run's files are gone");
        assert!(live.dir.path().join(LOCK).exists(), "a live run's stay");
        assert!(other.exists(), "a directory without a lock file stays");
        assert!(
            elsewhere.exists(),
            "another machine's run is not judged here"
        );
        drop((live, next));
        fs::remove_dir(&other).unwrap();
        fs::remove_dir_all(&elsewhere).unwrap();
        fs::remove_file(root.join(MADE)).unwrap();
        fs::remove_dir(&root).unwrap();
    }

    /// A directory of a run of this process is not judged by its lock: on NFS, where locks
    /// are the process's, another in-process rank would find it free (here: unlocked).
    #[test]
    fn a_run_of_this_process_is_never_taken_for_a_killed_one() {
        let root = std::env::temp_dir().join(format!("burnscale-inproc-{}", std::process::id()));
        let DiskStates {
            dir, _lock, _live, ..
        } = DiskStates::create(&root, 0).unwrap();
        drop(_lock);
        let other = DiskStates::create(&root, 1).unwrap();
        assert!(dir.path().exists(), "a live rank's directory stays");
        drop((other, _live, dir));
        let _ = fs::remove_file(root.join(MADE));
        fs::remove_dir(&root).unwrap();
    }

    /// Two ranks of a run that made `--offload-dir`: whichever leaves last removes it, the
    /// rank that made it leaving first or not.
    #[test]
    fn the_last_rank_to_leave_removes_the_directory_the_run_made() {
        for first in [0, 1] {
            let root =
                std::env::temp_dir().join(format!("burnscale-made-{}-{first}", std::process::id()));
            let mut ranks = vec![
                Some(DiskStates::create(&root, 0).unwrap()),
                Some(DiskStates::create(&root, 1).unwrap()),
            ];
            drop(ranks[first].take());
            assert!(
                root.exists(),
                "rank {first} left first: the other's files stay"
            );
            ranks.clear();
            assert!(!root.exists(), "rank {first} left first");
        }
    }

    /// Runs starting in a root that others are leaving: none finds the root gone under it,
    /// and the last to leave removes it.
    #[test]
    fn runs_entering_a_root_others_leave_all_start_and_the_last_removes_it() {
        let root = std::env::temp_dir().join(format!("burnscale-busy-{}", std::process::id()));
        std::thread::scope(|s| {
            for rank in 0..4 {
                let root = &root;
                s.spawn(move || {
                    for _ in 0..200 {
                        drop(DiskStates::create(root, rank).expect("the run starts"));
                    }
                });
            }
        });
        assert!(!root.exists(), "the root the runs made is gone");
    }

    /// SGD without momentum keeps no tensor: no file is written (or synced) at each step.
    #[test]
    fn a_state_without_tensors_writes_no_file() {
        let device = Device::flex();
        let optim = burn::optim::SgdConfig::new().build();
        let root = std::env::temp_dir().join(format!("burnscale-sgd-{}", std::process::id()));
        let mut disk = DiskStates::create(&root, 0).unwrap();
        let param = Tensor::<2>::ones([2, 3], &device);
        let (_, state) = optim.step_dyn(
            2,
            0.1,
            param.clone().into_bridge(),
            param.into_bridge(),
            None,
        );
        let state = state.expect("SGD keeps a state, without momentum");
        disk.store(&optim, "w", &state).unwrap();
        assert!(!disk.dir.path().join("w.bin").exists());
        let mut stored = StateSink::default();
        optim.state_flatten("w", &state, &mut stored);
        let loaded = disk.flattened("w").unwrap();
        assert!(loaded.tensors.is_empty() && stored.tensors.is_empty());
        assert_eq!(
            format!("{:?}", loaded.scalars),
            format!("{:?}", stored.scalars)
        );
        drop(disk);
        assert!(!root.exists());
        // A root that was there stays.
        fs::create_dir(&root).unwrap();
        drop(DiskStates::create(&root, 0).unwrap());
        fs::remove_dir(&root).expect("the root stays, empty");
    }
}
