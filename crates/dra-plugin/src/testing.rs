//! Test support for drivers (feature `testing`): a filesystem that loses power.
//!
//! [`PowerCutFs`] models what a power cut keeps: file contents written but not synced are
//! lost, and so are directory entries (creations, renames, removals) made since the
//! directory's last sync; a file overwritten in place since its last sync may be torn (the
//! first half of the new bytes over the old). A driver's crash-safety test runs its calls on
//! one with a budget of `n` operations for every `n`, restarts on
//! [`PowerCutFs::after_power_cut`], and checks that repeating the kubelet's calls ends where an
//! uninterrupted run ends.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::storage::Fs;

#[derive(Debug, Clone, Default)]
struct Inode {
    data: Vec<u8>,
    synced: Vec<u8>,
    /// Overwritten in place since its last sync: a power cut may tear it.
    overwritten: bool,
}

#[derive(Debug, Clone, Default)]
struct Dir {
    live: BTreeMap<OsString, usize>,
    durable: BTreeMap<OsString, usize>,
}

#[derive(Debug, Clone, Default)]
struct State {
    inodes: Vec<Inode>,
    dirs: HashMap<PathBuf, Dir>,
    ops: usize,
    budget: Option<usize>,
}

/// An in-memory filesystem ([`Fs`]) that loses power after a given number of mutating
/// operations: every later one fails, and [`PowerCutFs::after_power_cut`] is what a restart
/// finds (file contents as of their last `fsync`, directory entries as of their directory's).
#[derive(Debug, Default)]
pub struct PowerCutFs(Mutex<State>);

/// A poisoned lock only means a panicking test thread held it.
fn state(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lost() -> io::Error {
    io::Error::other("power lost")
}

fn split(path: &Path) -> io::Result<(PathBuf, OsString)> {
    match (path.parent(), path.file_name()) {
        (Some(d), Some(n)) => Ok((d.to_owned(), n.to_owned())),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "bad path")),
    }
}

impl PowerCutFs {
    /// A filesystem whose power fails after `budget` mutating operations (`None`: never).
    pub fn with_budget(budget: Option<usize>) -> Self {
        Self(Mutex::new(State {
            budget,
            ..Default::default()
        }))
    }

    /// Runs a mutating operation unless the power is (now) out.
    fn mutate<T>(&self, f: impl FnOnce(&mut State) -> io::Result<T>) -> io::Result<T> {
        let mut s = state(&self.0);
        if s.budget.is_some_and(|b| s.ops >= b) {
            return Err(lost());
        }
        s.ops += 1;
        f(&mut s)
    }

    /// Lets the power fail after `budget` more mutating operations (`None`: never).
    pub fn set_budget(&self, budget: Option<usize>) {
        let mut s = state(&self.0);
        s.budget = budget.map(|b| s.ops + b);
    }

    /// How many mutating operations have run.
    pub fn ops(&self) -> usize {
        state(&self.0).ops
    }

    /// Whether a power cut now could tear a file (one was overwritten in place, not synced).
    pub fn could_tear(&self) -> bool {
        state(&self.0).inodes.iter().any(|i| i.overwritten)
    }

    /// What survives the power cut: durable entries pointing at synced contents; with `tear`,
    /// a file overwritten in place since its sync keeps the first half of its new bytes over
    /// the old ones.
    pub fn after_power_cut(&self, tear: bool) -> Self {
        let s = state(&self.0);
        let survivor = |i: &Inode| {
            if tear && i.overwritten {
                let half = i.data.len() / 2;
                let mut torn = i.data[..half].to_vec();
                if i.synced.len() > half {
                    torn.extend_from_slice(&i.synced[half..]);
                }
                torn
            } else {
                i.synced.clone()
            }
        };
        let mut next = State {
            inodes: s
                .inodes
                .iter()
                .map(|i| Inode {
                    data: survivor(i),
                    synced: survivor(i),
                    overwritten: false,
                })
                .collect(),
            ..Default::default()
        };
        for (path, d) in &s.dirs {
            next.dirs.insert(
                path.clone(),
                Dir {
                    live: d.durable.clone(),
                    durable: d.durable.clone(),
                },
            );
        }
        Self(Mutex::new(next))
    }

    /// The names in `dir`, as a reader sees them now.
    pub fn files(&self, dir: &Path) -> Vec<String> {
        let s = state(&self.0);
        s.dirs
            .get(dir)
            .map(|d| {
                d.live
                    .keys()
                    .map(|k| k.to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The inode a live directory entry names.
fn live_inode(s: &State, dir: &Path, name: &OsString) -> io::Result<usize> {
    s.dirs
        .get(dir)
        .and_then(|d| d.live.get(name))
        .copied()
        .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
}

impl Fs for PowerCutFs {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let (dir, name) = split(path)?;
        let s = state(&self.0);
        let ino = s
            .dirs
            .get(&dir)
            .and_then(|d| d.live.get(&name))
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        Ok(s.inodes[*ino].data.clone())
    }

    fn write(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let (dir, name) = split(path)?;
        self.mutate(|s| {
            let existing = s.dirs.get(&dir).and_then(|d| d.live.get(&name)).copied();
            match existing {
                Some(ino) => {
                    s.inodes[ino].data = bytes.to_vec();
                    // Truncated and rewritten: lost whole, as modelled, never torn.
                    s.inodes[ino].overwritten = false;
                }
                None => {
                    s.inodes.push(Inode {
                        data: bytes.to_vec(),
                        synced: Vec::new(),
                        overwritten: false,
                    });
                    let ino = s.inodes.len() - 1;
                    s.dirs.entry(dir).or_default().live.insert(name, ino);
                }
            }
            Ok(())
        })
    }

    fn overwrite(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let (dir, name) = split(path)?;
        self.mutate(|s| {
            let ino = live_inode(s, &dir, &name)?;
            let inode = &mut s.inodes[ino];
            if inode.data.len() < bytes.len() {
                inode.data.resize(bytes.len(), 0);
            }
            inode.data[..bytes.len()].copy_from_slice(bytes);
            inode.overwritten = true;
            Ok(())
        })
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        let (dir, name) = split(path)?;
        self.mutate(|s| {
            let ino = live_inode(s, &dir, &name)?;
            s.inodes[ino].synced = s.inodes[ino].data.clone();
            s.inodes[ino].overwritten = false;
            Ok(())
        })
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (fd, fname) = split(from)?;
        let (td, tname) = split(to)?;
        self.mutate(|s| {
            let ino = s
                .dirs
                .get_mut(&fd)
                .and_then(|d| d.live.remove(&fname))
                .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
            s.dirs.entry(td).or_default().live.insert(tname, ino);
            Ok(())
        })
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.mutate(|s| {
            let d = s.dirs.entry(dir.to_owned()).or_default();
            d.durable = d.live.clone();
            Ok(())
        })
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let (dir, name) = split(path)?;
        self.mutate(|s| {
            s.dirs
                .get_mut(&dir)
                .and_then(|d| d.live.remove(&name))
                .map(|_| ())
                .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
        })
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let s = state(&self.0);
        Ok(s.dirs
            .get(dir)
            .map(|d| d.live.keys().map(|k| dir.join(k)).collect())
            .unwrap_or_default())
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        state(&self.0).dirs.entry(dir.to_owned()).or_default();
        Ok(())
    }
}
