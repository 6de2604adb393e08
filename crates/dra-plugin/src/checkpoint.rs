//! Crash-safe claim state on disk: a checkpoint of two slot files, generic over what a driver
//! records ([`Format`]).
//!
//! Each slot file holds one envelope,
//!
//! ```json
//! {"version":5,"minReaderVersion":4,"checksum":"sha256:<hex>","data":{"generation":7,…}}
//! ```
//!
//! followed by spaces up to the slot's length (a multiple of [`SLOT_BLOCK`]); `data` is the
//! driver's [`Format::Data`] (a JSON object) with `generation` beside its fields.
//!
//! - **One fsync per durable write.** Each store writes the next `generation` into the slot that
//!   does not hold the newest one, in place over its allocated blocks, and makes it durable with
//!   one `fdatasync` ([`Fs::sync_file`]): no temp file, no rename, no directory sync (only the
//!   first write to a slot creates it, and that one also syncs the directory). A load reads both
//!   slots and takes the valid one with the higher generation, so a power cut during a store
//!   leaves the previous generation or the new one, never a mix: the meta-page scheme of LMDB
//!   and etcd's bbolt. A slot damaged after its write was acknowledged cannot be told from a
//!   torn one; the load then falls back to the previous generation and says so in a warning.
//! - `checksum` is SHA-256 over the bytes of `data` exactly as stored.
//! - `version` is the writer's [`Format::VERSION`]; `minReaderVersion` the oldest reader that can
//!   use the file ([`Format::min_reader_version`]). A reader accepts any file whose
//!   `minReaderVersion` it meets and ignores fields it does not know; a file it does not meet is
//!   [`CheckpointError::TooNew`], which a driver must treat as "someone newer knows more": rebuild
//!   from elsewhere, remove nothing.
//! - A format may have versions before the slots ([`Format::single_slot`]: one file replaced by
//!   rename) and before the envelope ([`Format::unenveloped`]); they are read as slot 0 at
//!   generation 0 and replaced the way they were written at the next store.
//!
//! Every write goes through [`Fs`], so tests can cut the power at any operation.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::storage::{Fs, write_atomic};

/// Slot files are written in multiples of this many bytes (a page), padded with spaces.
pub const SLOT_BLOCK: usize = 4096;

/// What a driver keeps in its checkpoint, and the history of that format.
pub trait Format {
    /// The records (serialized as a JSON object; `generation` is added beside its fields, so it
    /// must not have one of its own).
    type Data: Serialize + DeserializeOwned;
    /// The format version this build writes.
    const VERSION: u32;
    /// The oldest reader version that can use `data` as written by this build.
    fn min_reader_version(data: &Self::Data) -> u32;
    /// Whether a file of `version` was written by a build that kept one file (slot 0 alone,
    /// replaced by rename): read at generation 0, replaced atomically at the next store, and
    /// preferred over a slot 1 beside it (the older build wrote it later). None by default.
    fn single_slot(version: u32) -> bool {
        let _ = version;
        false
    }
    /// The data of a file of `version` that has no envelope (no `data` or `checksum`), from its
    /// whole JSON `file`; `None` when `version` always has one. Such a file is single-slot.
    ///
    /// # Errors
    /// What is wrong with the file.
    fn unenveloped(version: u32, file: &[u8]) -> Option<Result<Self::Data, String>> {
        let _ = (version, file);
        None
    }
}

/// Reading or writing the checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file exists but could not be read.
    #[error("reading checkpoint {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The file is damaged or not a checkpoint.
    #[error("checkpoint {path} is corrupt: {problem}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// The file needs a newer reader.
    #[error(
        "checkpoint {path} needs reader version {needed} (written by format version {written}); \
         this build reads up to {reads}"
    )]
    TooNew {
        /// The file.
        path: PathBuf,
        /// Its `minReaderVersion`.
        needed: u32,
        /// Its `version`.
        written: u32,
        /// The newest version this build reads ([`Format::VERSION`]).
        reads: u32,
    },
    /// The file could not be written.
    #[error("writing checkpoint {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope<'a> {
    version: u32,
    #[serde(default)]
    min_reader_version: Option<u32>,
    #[serde(default)]
    checksum: Option<String>,
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The two slot files of the checkpoint at `path`: `path` itself and `<stem>.b.<ext>` beside it
/// (`checkpoint.json`, `checkpoint.b.json`).
pub fn slot_paths(path: &Path) -> [PathBuf; 2] {
    let other = match (path.file_stem(), path.extension()) {
        (Some(stem), Some(ext)) => {
            format!("{}.b.{}", stem.to_string_lossy(), ext.to_string_lossy())
        }
        _ => format!(
            "{}.b",
            path.file_name().unwrap_or_default().to_string_lossy()
        ),
    };
    [path.to_owned(), path.with_file_name(other)]
}

/// What this process knows of the two slots since it last read or wrote them.
#[derive(Debug, Clone, Copy, Default)]
struct Slots {
    /// The slot holding the newest durable generation; `None` when neither holds one.
    newest: Option<usize>,
    /// The highest generation seen in a valid slot (0 when none; a file written before
    /// version 4 counts as 0): the next store writes one more.
    generation: u64,
    /// The newest slot is a file of an older format (slot 0, `checkpoint.json`): the next
    /// store replaces it atomically instead of writing the other slot, so that an older
    /// build never finds a readable `checkpoint.json` a generation behind.
    legacy: bool,
    /// Each slot file's length, where it exists and was written whole: a store overwrites it
    /// in place. `None`: absent or unknown, so a store (re)creates it and syncs the directory.
    len: [Option<usize>; 2],
}

/// A slot as read.
enum SlotRead<F: Format> {
    Absent,
    Valid {
        generation: u64,
        data: F::Data,
        len: usize,
        /// Written by a single-slot version ([`Format::single_slot`]): an older build.
        legacy: bool,
    },
    Invalid {
        error: CheckpointError,
        len: usize,
    },
}

/// `data` as stored: the generation beside the driver's own fields.
#[derive(Serialize)]
struct StoredRef<'a, D> {
    generation: u64,
    #[serde(flatten)]
    data: &'a D,
}

#[derive(Deserialize)]
struct Stored<D> {
    #[serde(default)]
    generation: u64,
    #[serde(flatten)]
    data: D,
}

/// The checkpoint of format `F` on a filesystem: two slot files (see the module docs). Clones
/// share what they know of the slots, and stores through any of them are serialized.
pub struct SlotFile<F> {
    fs: Arc<dyn Fs>,
    paths: [PathBuf; 2],
    slots: Arc<Mutex<Option<Slots>>>,
    format: std::marker::PhantomData<fn() -> F>,
}

impl<F> Clone for SlotFile<F> {
    fn clone(&self) -> Self {
        Self {
            fs: Arc::clone(&self.fs),
            paths: self.paths.clone(),
            slots: Arc::clone(&self.slots),
            format: std::marker::PhantomData,
        }
    }
}

impl<F> std::fmt::Debug for SlotFile<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotFile")
            .field("fs", &self.fs)
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

impl<F: Format> SlotFile<F> {
    /// The checkpoint at `path` (its first slot; the second is beside it, see [`slot_paths`])
    /// on `fs`.
    pub fn new(fs: Arc<dyn Fs>, path: impl Into<PathBuf>) -> Self {
        Self {
            fs,
            paths: slot_paths(&path.into()),
            slots: Arc::default(),
            format: std::marker::PhantomData,
        }
    }

    /// Its path (the first slot).
    pub fn path(&self) -> &Path {
        &self.paths[0]
    }

    /// Both slot files.
    pub fn slot_paths(&self) -> &[PathBuf; 2] {
        &self.paths
    }

    /// `<first slot>.boot`: the boot ID of the last start that recovered this checkpoint. It
    /// outlives a damaged checkpoint, so a rebuild from CDI specs knows whether the specs were
    /// written in this boot (no start of this boot yet: they were not).
    pub fn boot_marker_path(&self) -> PathBuf {
        let mut name = self.paths[0].as_os_str().to_owned();
        name.push(".boot");
        PathBuf::from(name)
    }

    /// The boot ID [`Self::write_boot_marker`] last wrote; `None` when there is none or it
    /// cannot be read (then nothing is known of the specs' boot). Blocking.
    pub fn read_boot_marker(&self) -> Option<String> {
        let bytes = self.fs.read(&self.boot_marker_path()).ok()?;
        let id = String::from_utf8(bytes).ok()?.trim().to_owned();
        (!id.is_empty()).then_some(id)
    }

    /// Records `boot_id` as the boot of the last start, durably. Blocking.
    ///
    /// # Errors
    /// The filesystem's.
    pub fn write_boot_marker(&self, boot_id: &str) -> std::io::Result<()> {
        crate::storage::replace(
            self.fs.as_ref(),
            &self.boot_marker_path(),
            format!("{boot_id}\n").as_bytes(),
        )
    }

    fn read_slot(&self, slot: usize) -> Result<SlotRead<F>, CheckpointError> {
        let path = &self.paths[slot];
        match self.fs.read(path) {
            Ok(bytes) => Ok(match decode::<F>(path, &bytes) {
                Ok((generation, data, legacy)) => SlotRead::Valid {
                    generation,
                    data,
                    len: bytes.len(),
                    legacy,
                },
                Err(error) => SlotRead::Invalid {
                    error,
                    len: bytes.len(),
                },
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(SlotRead::Absent),
            Err(source) => Err(CheckpointError::Read {
                path: path.clone(),
                source,
            }),
        }
    }

    /// Reads the checkpoint: the valid slot with the higher generation; `Ok(None)` when
    /// neither slot exists. A slot that is damaged while the other is valid is reported in a
    /// warning (a store torn by a crash leaves exactly that) and the other is used.
    ///
    /// # Errors
    /// [`CheckpointError::Read`] when a slot exists but cannot be read;
    /// [`CheckpointError::TooNew`] when either slot needs a newer reader;
    /// [`CheckpointError::Corrupt`] (bad JSON, checksum mismatch, missing fields) when no slot
    /// is valid.
    pub fn load(&self) -> Result<Option<F::Data>, CheckpointError> {
        let mut guard = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let (slots, checkpoint) = self.read_slots()?;
        *guard = Some(slots);
        Ok(checkpoint)
    }

    /// Both slots read and decided between (see [`SlotFile::load`]): what the next
    /// store needs to know of them, and the newest data.
    fn read_slots(&self) -> Result<(Slots, Option<F::Data>), CheckpointError> {
        let mut reads = [self.read_slot(0)?, self.read_slot(1)?];
        // This build writes slot 0 first and moves both aside together, so slot 1 alone means
        // an older, single-slot build moved slot 0 aside (it refuses the slotted format) and
        // may have prepared and unprepared claims since: slot 1 may be stale.
        if matches!(reads[0], SlotRead::Absent) && matches!(reads[1], SlotRead::Valid { .. }) {
            return Err(CheckpointError::Corrupt {
                path: self.paths[1].clone(),
                problem: format!(
                    "{} is missing (an older build moves it aside after a downgrade), \
                     so this slot may be stale",
                    self.paths[0].display()
                ),
            });
        }
        // An older-format slot 0 beside a valid slot 1 was written by an older build after
        // slot 1 (this build replaces an older-format file before it writes slot 1 again):
        // slot 0 is the newer one, whatever the generations say.
        let mut stale: Option<(u64, usize)> = None;
        if let (
            SlotRead::Valid { legacy: true, .. },
            SlotRead::Valid {
                generation, len, ..
            },
        ) = (&reads[0], &reads[1])
        {
            stale = Some((*generation, *len));
            tracing::warn!(
                stale = %self.paths[1].display(),
                using = %self.paths[0].display(),
                "an older build wrote the checkpoint after this build's last write; \
                 using what it wrote"
            );
            reads[1] = SlotRead::Absent;
        }
        let mut slots = Slots::default();
        let mut newest: Option<(usize, F::Data)> = None;
        let mut invalid: Option<CheckpointError> = None;
        for (i, read) in reads.into_iter().enumerate() {
            match read {
                SlotRead::Absent => {}
                SlotRead::Valid {
                    generation,
                    data,
                    len,
                    legacy,
                } => {
                    slots.len[i] = Some(len);
                    if newest.is_none() || generation > slots.generation {
                        slots.generation = generation;
                        slots.newest = Some(i);
                        slots.legacy = legacy;
                        newest = Some((i, data));
                    }
                }
                SlotRead::Invalid {
                    error: error @ CheckpointError::TooNew { .. },
                    ..
                } => return Err(error),
                SlotRead::Invalid { error, len } => {
                    // The next store overwrites it in place.
                    slots.len[i] = Some(len);
                    invalid = Some(error);
                }
            }
        }
        if let Some((generation, len)) = stale {
            // The next store overwrites the stale slot, with a generation that beats it.
            slots.len[1] = Some(len);
            slots.generation = slots.generation.max(generation);
        }
        match (newest, invalid) {
            (None, Some(e)) => Err(e),
            (newest, invalid) => {
                if let (Some((i, _)), Some(e)) = (&newest, &invalid) {
                    tracing::warn!(
                        error = %e,
                        using = %self.paths[*i].display(),
                        generation = slots.generation,
                        "one checkpoint slot is damaged (a store torn by a crash, or later \
                         damage); using the other"
                    );
                }
                Ok((slots, newest.map(|(_, c)| c)))
            }
        }
    }

    /// Writes `data` durably as the next generation, into the slot not holding the
    /// newest one: in place and one `fdatasync` where the slot exists, else created, synced
    /// and its directory synced.
    ///
    /// # Errors
    /// [`CheckpointError::Write`]; the newest durable generation is then unchanged and the
    /// next store writes the same slot again. Before any load or quarantine in this process,
    /// the slots are read first, and what [`SlotFile::load`] would return for them is
    /// returned instead of guessing where to write.
    pub fn store(&self, data: &F::Data) -> Result<(), CheckpointError> {
        let mut guard = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let mut slots = match *guard {
            Some(s) => s,
            None => self.read_slots()?.0,
        };
        // An older-format newest slot (slot 0) is replaced where it is, atomically.
        let target = match slots.newest {
            Some(i) if slots.legacy => i,
            Some(i) => 1 - i,
            None => 0,
        };
        let path = &self.paths[target];
        let write_err = |source| CheckpointError::Write {
            path: path.clone(),
            source,
        };
        let generation = slots.generation + 1;
        let bytes = encode::<F>(data, generation).map_err(write_err)?;
        let needed = bytes.len().div_ceil(SLOT_BLOCK) * SLOT_BLOCK;
        // In place when the slot is big enough and not far larger than needed; else the slot is
        // rewritten (created or truncated, then its directory synced too).
        let in_place = slots.len[target].filter(|&len| len >= needed && len <= 4 * needed);
        let mut padded = bytes;
        padded.resize(in_place.unwrap_or(needed), b' ');
        let result = match in_place {
            _ if slots.legacy => write_atomic(self.fs.as_ref(), path, &padded),
            Some(_) => self
                .fs
                .overwrite(path, &padded)
                .and_then(|()| self.fs.sync_file(path)),
            None => {
                let dir = path.parent().unwrap_or(Path::new("."));
                self.fs
                    .create_dir_all(dir)
                    .and_then(|()| self.fs.write(path, &padded))
                    .and_then(|()| self.fs.sync_file(path))
                    .and_then(|()| self.fs.sync_dir(dir))
            }
        };
        match result {
            Ok(()) => {
                slots.newest = Some(target);
                slots.generation = generation;
                slots.legacy = false;
                slots.len[target] = Some(padded.len());
                *guard = Some(slots);
                Ok(())
            }
            Err(e) => {
                // The slot may be torn or half created: recreate it next time.
                slots.len[target] = None;
                *guard = Some(slots);
                Err(write_err(e))
            }
        }
    }

    /// Moves damaged slots aside (`<name>.corrupt`), keeping them for inspection; returns
    /// where each went. The next store starts over at slot 0.
    ///
    /// # Errors
    /// [`CheckpointError::Write`].
    pub fn quarantine(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        let mut guard = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let mut moved = Vec::new();
        for path in &self.paths {
            let mut aside = path.clone().into_os_string();
            aside.push(".corrupt");
            let aside = PathBuf::from(aside);
            match self.fs.rename(path, &aside) {
                Ok(()) => moved.push(aside),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(CheckpointError::Write {
                        path: path.clone(),
                        source,
                    });
                }
            }
        }
        if let Some(dir) = self.paths[0].parent() {
            self.fs
                .sync_dir(dir)
                .map_err(|source| CheckpointError::Write {
                    path: self.paths[0].clone(),
                    source,
                })?;
        }
        *guard = Some(Slots::default());
        Ok(moved)
    }
}

/// The bytes of one slot (before padding): the envelope around `data`.
fn encode<F: Format>(data: &F::Data, generation: u64) -> io::Result<Vec<u8>> {
    let stored = serde_json::to_vec(&StoredRef { generation, data })?;
    let mut bytes = format!(
        "{{\"version\":{},\"minReaderVersion\":{},\"checksum\":\"sha256:{}\",\"data\":",
        F::VERSION,
        F::min_reader_version(data),
        sha256_hex(&stored)
    )
    .into_bytes();
    bytes.extend_from_slice(&stored);
    bytes.extend_from_slice(b"}\n");
    Ok(bytes)
}

/// One slot's content: its generation (0 for a single-slot version), data, and whether it was
/// written by a single-slot version.
fn decode<F: Format>(path: &Path, bytes: &[u8]) -> Result<(u64, F::Data, bool), CheckpointError> {
    let corrupt = |problem: String| CheckpointError::Corrupt {
        path: path.to_owned(),
        problem,
    };
    let env: Envelope<'_> = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
    if env.version == 0 {
        return Err(corrupt("field `version` must be at least 1".into()));
    }
    if let Some(data) = F::unenveloped(env.version, bytes) {
        return Ok((0, data.map_err(corrupt)?, true));
    }
    let written = env.version;
    let needed = env.min_reader_version.unwrap_or(written);
    if needed > F::VERSION {
        return Err(CheckpointError::TooNew {
            path: path.to_owned(),
            needed,
            written,
            reads: F::VERSION,
        });
    }
    let data = env
        .data
        .ok_or_else(|| corrupt("field `data` is missing".into()))?;
    let checksum = env
        .checksum
        .ok_or_else(|| corrupt("field `checksum` is missing".into()))?;
    let actual = format!("sha256:{}", sha256_hex(data.get().as_bytes()));
    if checksum != actual {
        return Err(corrupt(format!(
            "field `checksum` is {checksum} but `data` hashes to {actual}"
        )));
    }
    let stored: Stored<F::Data> =
        serde_json::from_str(data.get()).map_err(|e| corrupt(format!("field `data`: {e}")))?;
    Ok((stored.generation, stored.data, F::single_slot(written)))
}
