//! The record of claims being and having been prepared, so prepare is idempotent across calls,
//! restarts, crashes and upgrades.
//!
//! On disk: two slot files, `<plugin-dir>/checkpoint.json` and `checkpoint.b.json` beside it
//! ([`slot_paths`]), each holding
//!
//! ```json
//! {"version":4,"minReaderVersion":4,"checksum":"sha256:<hex>","data":{"generation":7,"bootId":"…","claims":{…}}}
//! ```
//!
//! followed by spaces up to the slot's length (a multiple of 4 KiB).
//!
//! - **One fsync per durable write.** Each store writes the next `generation` into the slot that
//!   does not hold the newest one, in place over its allocated blocks, and makes it durable with
//!   one `fdatasync`: no temp file, no rename, no directory sync (only the first write to a slot
//!   creates it, and that one also syncs the directory). A load reads both slots and takes the
//!   valid one with the higher generation. A power cut during a store can tear only the slot
//!   being written; the other still holds the previous generation, which was durable before
//!   the store began, so a load sees either the previous or the new checkpoint, never a mix.
//!   This is the meta-page scheme of LMDB and of etcd's bbolt (two meta pages, the valid one
//!   with the higher transaction ID wins). Its one cost: a slot damaged *after* its write was
//!   acknowledged (media corruption, not a torn write) cannot be told from a torn one, so the
//!   load falls back to the previous generation and says so in a warning.
//! - `checksum` is SHA-256 over the bytes of `data` exactly as stored, never over re-serialized
//!   data, so any bit flip or torn write is detected; `generation` is inside `data`, so it is
//!   covered too.
//! - `version` is the writer's format version; `minReaderVersion` the oldest reader that can use
//!   the file. A reader accepts any file whose `minReaderVersion` it meets and ignores fields it
//!   does not know, so a future version that only adds fields stays readable after a downgrade.
//! - Version 4 (the slots) is written with `minReaderVersion` 4: an older build reads only
//!   `checkpoint.json`, which may be one generation behind, so it must refuse the file (as too
//!   new), move it aside and rebuild its claims from the CDI specs and the API server, rather
//!   than act on a stale record.
//! - Versions 1 to 3 were one file, `checkpoint.json`, replaced by rename. They are read as
//!   slot 0 at generation 0, and the first store after an upgrade replaces that file the way
//!   they did (temp file, fsync, rename, directory fsync), so an older build never finds a
//!   readable `checkpoint.json` a generation behind. After a downgrade and an upgrade again, an
//!   older-format `checkpoint.json` beside a valid `checkpoint.b.json` was written by the older
//!   build after this one's last store, and wins; a `checkpoint.b.json` whose `checkpoint.json`
//!   an older build moved aside and never rewrote is refused (the claims are rebuilt from the
//!   CDI specs and the API server, as for a damaged checkpoint).
//! - Version 1 (no envelope: `{"version":1,"claims":{…}}`, written by the first drust builds) is
//!   read and upgraded on the next write. It could not record in-progress claims or the boot,
//!   so its claims read as completed in the current boot.
//! - Version 3 added `devices[].mig` ([`CreatedMig`]): the MIG device prepare created for a
//!   partitionable placement, which unprepare must destroy.
//! - Version 5 added `devices[].share` ([`RecordedShare`]): a share of a device allocated through
//!   consumable capacity. A file recording a share is written with `minReaderVersion` 5, so an
//!   older build does not read it as exclusive records. What a version-4 build then does (seen
//!   by running the last version-4 release's binary, commit ab31ff0, on a real node with a
//!   running share, 2026-11-27): it refuses the file as too new ("needs reader version 5 ...
//!   this build reads up to 4"), moves it aside, rebuilds its claims from the CDI specs and the
//!   API server, and, knowing no shares, stops every MPS daemon not named after a claim, the
//!   GPUs' share daemons included, under the shares' running containers (it reports the GPU's
//!   daemon directory among `orphans_removed`; the pod stays Running without its daemon). So a node running shares must be drained of them
//!   before a downgrade below version 5 (README, "Upgrades and downgrades"). From version 5 on,
//!   a build that finds a file too new for it rebuilds its claims the same way but takes
//!   nothing for an orphan in that start (`claims/recovery.rs`): a reader never stops what it
//!   does not understand. A file without shares keeps `minReaderVersion` 4.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use dra_kubelet::PreparedDevice;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::cdi::Spec;
use crate::hardware::CreatedMig;
use crate::storage::{Fs, write_atomic};

/// The checkpoint format version this build writes.
pub const VERSION: u32 = 5;
/// The oldest reader version that can read what this build writes: 4, the first that reads
/// both slots (an older one would read `checkpoint.json` alone, possibly a generation behind).
pub const MIN_READER_VERSION: u32 = 4;
/// The oldest reader of a file that records a share ([`RecordedShare`]).
pub const MIN_READER_VERSION_SHARES: u32 = 5;
/// Slot files are written in multiples of this many bytes (a page), padded with spaces.
pub const SLOT_BLOCK: usize = 4096;

/// How far prepare got for a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    /// Prepare began: whatever `ClaimRecord` lists may exist and must be rolled back if the
    /// prepare does not complete.
    PrepareStarted,
    /// Prepare completed; the kubelet has (or will get) the devices.
    PrepareCompleted,
    /// Unprepare (or a rollback) began: finish it.
    UnprepareStarted,
}

/// Everything recorded for one claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// Name of the ResourceClaim.
    pub name: String,
    /// Prepare phase.
    pub state: ClaimState,
    /// The devices, as returned to the kubelet.
    pub devices: Vec<RecordedDevice>,
    /// The CDI spec file created for the claim.
    pub cdi_spec_path: PathBuf,
    /// Its content, to regenerate it if it goes missing (e.g. a CDI dir on tmpfs).
    pub cdi_spec: Spec,
}

/// A prepared device as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedDevice {
    /// Request names from the allocation.
    pub request_names: Vec<String>,
    /// Pool.
    pub pool_name: String,
    /// Device.
    pub device_name: String,
    /// CDI device IDs.
    pub cdi_device_ids: Vec<String>,
    /// UUID of the GPU behind the device at prepare time.
    #[serde(default)]
    pub uuid: String,
    /// Whether the allocation grants admin access (shareable with other claims).
    #[serde(default)]
    pub admin_access: bool,
    /// The sharing configured for this device (class then claim config), applied after the
    /// hardware step and undone at unprepare; absent when none. Since version 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<crate::claim_config::Sharing>,
    /// The MIG device prepare created for this device (a partitionable placement), recorded
    /// durably before its CDI spec is written; unprepare destroys exactly this. Since version 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<CreatedMig>,
    /// The claim's share of the device, when it was allocated through consumable capacity
    /// (KEP-5075). Since version 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<RecordedShare>,
}

/// One allocation's share of a device (`shareID` and `consumedCapacity` of its allocation
/// result), and how it was prepared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedShare {
    /// The allocation's `shareID` (returned to the kubelet with the device).
    pub id: String,
    /// `consumedCapacity.memory`, bytes: the share's MPS pinned device memory limit.
    pub memory_bytes: u64,
    /// `consumedCapacity.computePercent`: the share's MPS active thread percentage; 0: none
    /// reserved, uncapped.
    pub compute_percent: u32,
    /// The share holds the whole device ([`gpu_inventory::shares::is_whole`]): prepared as an
    /// exclusive device, without MPS.
    pub whole: bool,
}

impl RecordedShare {
    /// Whether the share runs under its GPU's MPS daemon (every share that is not the whole
    /// device).
    pub fn uses_mps(&self) -> bool {
        !self.whole
    }
}

impl From<&RecordedDevice> for PreparedDevice {
    fn from(d: &RecordedDevice) -> Self {
        PreparedDevice {
            request_names: d.request_names.clone(),
            pool_name: d.pool_name.clone(),
            device_name: d.device_name.clone(),
            cdi_device_ids: d.cdi_device_ids.clone(),
            share_id: d.share.as_ref().map(|s| s.id.clone()),
        }
    }
}

/// The checkpoint's content.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// `/proc/sys/kernel/random/boot_id` when the claims were prepared; empty when unknown.
    #[serde(default)]
    pub boot_id: String,
    /// Claims by UID.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimRecord>,
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
         this build reads up to {VERSION}"
    )]
    TooNew {
        /// The file.
        path: PathBuf,
        /// Its `minReaderVersion`.
        needed: u32,
        /// Its `version`.
        written: u32,
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
    /// Version 1 kept its claims at the top level.
    #[serde(default)]
    claims: Option<BTreeMap<String, V1Claim>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct V1Claim {
    namespace: String,
    name: String,
    devices: Vec<V1Device>,
    cdi_spec: PathBuf,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct V1Device {
    request_names: Vec<String>,
    pool_name: String,
    device_name: String,
    cdi_device_ids: Vec<String>,
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
enum SlotRead {
    Absent,
    Valid {
        generation: u64,
        checkpoint: Checkpoint,
        len: usize,
        /// Written before version 4 (by an older build).
        legacy: bool,
    },
    Invalid {
        error: CheckpointError,
        len: usize,
    },
}

/// `data` as stored: the generation beside the checkpoint's own fields.
#[derive(Serialize)]
struct StoredRef<'a> {
    generation: u64,
    #[serde(flatten)]
    checkpoint: &'a Checkpoint,
}

#[derive(Deserialize)]
struct Stored {
    #[serde(default)]
    generation: u64,
    #[serde(flatten)]
    checkpoint: Checkpoint,
}

/// The checkpoint on a filesystem: two slot files (see the module docs). Clones share what they
/// know of the slots, and stores through any of them are serialized.
#[derive(Debug, Clone)]
pub struct CheckpointFile {
    fs: Arc<dyn Fs>,
    paths: [PathBuf; 2],
    slots: Arc<Mutex<Option<Slots>>>,
}

impl CheckpointFile {
    /// The checkpoint at `path` (its first slot; the second is beside it, see [`slot_paths`])
    /// on `fs`.
    pub fn new(fs: Arc<dyn Fs>, path: impl Into<PathBuf>) -> Self {
        Self {
            fs,
            paths: slot_paths(&path.into()),
            slots: Arc::default(),
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

    fn read_slot(&self, slot: usize) -> Result<SlotRead, CheckpointError> {
        let path = &self.paths[slot];
        match self.fs.read(path) {
            Ok(bytes) => Ok(match decode(path, &bytes) {
                Ok((generation, checkpoint, legacy)) => SlotRead::Valid {
                    generation,
                    checkpoint,
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
    pub fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let mut guard = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let (slots, checkpoint) = self.read_slots()?;
        *guard = Some(slots);
        Ok(checkpoint)
    }

    /// Both slots read and decided between (see [`CheckpointFile::load`]): what the next
    /// store needs to know of them, and the newest checkpoint.
    fn read_slots(&self) -> Result<(Slots, Option<Checkpoint>), CheckpointError> {
        let mut reads = [self.read_slot(0)?, self.read_slot(1)?];
        // This build writes slot 0 first and moves both aside together, so slot 1 alone means
        // an older build moved `checkpoint.json` aside (it refuses version 4) and may have
        // prepared and unprepared claims since: slot 1 may be stale.
        if matches!(reads[0], SlotRead::Absent) && matches!(reads[1], SlotRead::Valid { .. }) {
            return Err(CheckpointError::Corrupt {
                path: self.paths[1].clone(),
                problem: format!(
                    "{} is missing (an older drust build moves it aside after a downgrade), \
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
                "an older drust build wrote the checkpoint after this build's last write; \
                 using what it wrote"
            );
            reads[1] = SlotRead::Absent;
        }
        let mut slots = Slots::default();
        let mut newest: Option<(usize, Checkpoint)> = None;
        let mut invalid: Option<CheckpointError> = None;
        for (i, read) in reads.into_iter().enumerate() {
            match read {
                SlotRead::Absent => {}
                SlotRead::Valid {
                    generation,
                    checkpoint,
                    len,
                    legacy,
                } => {
                    slots.len[i] = Some(len);
                    if newest.is_none() || generation > slots.generation {
                        slots.generation = generation;
                        slots.newest = Some(i);
                        slots.legacy = legacy;
                        newest = Some((i, checkpoint));
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

    /// Writes `checkpoint` durably as the next generation, into the slot not holding the
    /// newest one: in place and one `fdatasync` where the slot exists, else created, synced
    /// and its directory synced.
    ///
    /// # Errors
    /// [`CheckpointError::Write`]; the newest durable generation is then unchanged and the
    /// next store writes the same slot again. Before any load or quarantine in this process,
    /// the slots are read first, and what [`CheckpointFile::load`] would return for them is
    /// returned instead of guessing where to write.
    pub fn store(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
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
        let bytes = encode(checkpoint, generation).map_err(write_err)?;
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
fn encode(checkpoint: &Checkpoint, generation: u64) -> io::Result<Vec<u8>> {
    let data = serde_json::to_vec(&StoredRef {
        generation,
        checkpoint,
    })?;
    let min_reader = if checkpoint
        .claims
        .values()
        .any(|r| r.devices.iter().any(|d| d.share.is_some()))
    {
        MIN_READER_VERSION_SHARES
    } else {
        MIN_READER_VERSION
    };
    let mut bytes = format!(
        "{{\"version\":{VERSION},\"minReaderVersion\":{min_reader},\
         \"checksum\":\"sha256:{}\",\"data\":",
        sha256_hex(&data)
    )
    .into_bytes();
    bytes.extend_from_slice(&data);
    bytes.extend_from_slice(b"}\n");
    Ok(bytes)
}

/// One slot's content: its generation (0 before version 4), checkpoint, and whether it was
/// written before version 4.
fn decode(path: &Path, bytes: &[u8]) -> Result<(u64, Checkpoint, bool), CheckpointError> {
    let corrupt = |problem: String| CheckpointError::Corrupt {
        path: path.to_owned(),
        problem,
    };
    let env: Envelope<'_> = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
    match env.version {
        0 => Err(corrupt("field `version` must be at least 1".into())),
        1 => {
            let claims = env
                .claims
                .ok_or_else(|| corrupt("version 1 without field `claims`".into()))?;
            Ok((0, upgrade_v1(claims), true))
        }
        written => {
            let needed = env.min_reader_version.unwrap_or(written);
            if needed > VERSION {
                return Err(CheckpointError::TooNew {
                    path: path.to_owned(),
                    needed,
                    written,
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
            let stored: Stored = serde_json::from_str(data.get())
                .map_err(|e| corrupt(format!("field `data`: {e}")))?;
            Ok((stored.generation, stored.checkpoint, written < 4))
        }
    }
}

fn upgrade_v1(claims: BTreeMap<String, V1Claim>) -> Checkpoint {
    let claims = claims
        .into_iter()
        .map(|(uid, c)| {
            let record = ClaimRecord {
                namespace: c.namespace,
                name: c.name,
                state: ClaimState::PrepareCompleted,
                devices: c
                    .devices
                    .into_iter()
                    .map(|d| RecordedDevice {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                        uuid: String::new(),
                        admin_access: false,
                        sharing: None,
                        mig: None,
                        share: None,
                    })
                    .collect(),
                cdi_spec_path: c.cdi_spec,
                // Version 1 kept no spec content; start-up reconciliation rebuilds it.
                cdi_spec: Spec::default(),
            };
            (uid, record)
        })
        .collect();
    Checkpoint {
        boot_id: String::new(),
        claims,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::RealFs;

    fn file(dir: &Path) -> CheckpointFile {
        CheckpointFile::new(Arc::new(RealFs), dir.join("state/checkpoint.json"))
    }

    fn sample() -> Checkpoint {
        let mut c = Checkpoint {
            boot_id: "b1".into(),
            ..Default::default()
        };
        c.claims.insert(
            "u".into(),
            ClaimRecord {
                namespace: "ns".into(),
                name: "c".into(),
                state: ClaimState::PrepareCompleted,
                devices: vec![RecordedDevice {
                    request_names: vec!["gpu".into()],
                    pool_name: "node".into(),
                    device_name: "gpu-0".into(),
                    cdi_device_ids: vec!["d/claim=u-gpu-0".into()],
                    uuid: "GPU-1".into(),
                    admin_access: false,
                    sharing: None,
                    mig: None,
                    share: None,
                }],
                cdi_spec_path: "/var/run/cdi/x.json".into(),
                cdi_spec: Spec::default(),
            },
        );
        c
    }

    #[test]
    fn a_missing_file_is_none_and_a_stored_checkpoint_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        assert_eq!(f.load().expect("load"), None);
        f.store(&sample()).expect("store");
        assert_eq!(f.load().expect("load"), Some(sample()));
    }

    #[test]
    fn any_flipped_byte_in_data_is_caught_by_the_checksum() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        f.store(&sample()).expect("store");
        let good = std::fs::read(f.path()).expect("read");
        let data_at = good
            .windows(7)
            .position(|w| w == b"\"data\":")
            .expect("data field")
            + 7;
        let mut detected = 0;
        for i in data_at..good.len() - 2 {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            std::fs::write(f.path(), &bad).expect("write");
            if f.load().is_err() {
                detected += 1;
            }
        }
        assert_eq!(detected, good.len() - 2 - data_at, "every flip detected");
    }

    #[test]
    fn version_1_checkpoints_are_upgraded_with_their_claims_completed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        std::fs::create_dir_all(f.path().parent().expect("parent")).expect("mkdir");
        std::fs::write(
            f.path(),
            br#"{"version":1,"claims":{"u":{"namespace":"ns","name":"c","cdiSpec":"/cdi/x.json",
            "devices":[{"requestNames":["gpu"],"poolName":"n","deviceName":"gpu-3","cdiDeviceIds":["d/claim=u-gpu-3"]}]}}}"#,
        )
        .expect("write");
        let c = f.load().expect("load").expect("present");
        let r = &c.claims["u"];
        assert_eq!(r.state, ClaimState::PrepareCompleted);
        assert_eq!(r.devices[0].device_name, "gpu-3");
        assert_eq!(r.cdi_spec_path, PathBuf::from("/cdi/x.json"));
        // The next write replaces the old file atomically with the current version (an older
        // build must not find it readable and a generation behind), and reads back the same.
        f.store(&c).expect("store");
        assert!(
            std::fs::read_to_string(f.path())
                .expect("read")
                .starts_with("{\"version\":5,\"minReaderVersion\":4,")
        );
        assert!(!f.slot_paths()[1].exists());
        assert_eq!(f.load().expect("load"), Some(c.clone()));
        // A recorded share needs a reader that knows shares (version 5).
        let mut shared = c;
        for r in shared.claims.values_mut() {
            for d in &mut r.devices {
                d.share = Some(RecordedShare {
                    id: "s-1".into(),
                    memory_bytes: 19 << 30,
                    compute_percent: 25,
                    whole: false,
                });
            }
        }
        f.store(&shared).expect("store");
        let slots: Vec<String> = f
            .slot_paths()
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect();
        assert!(
            slots
                .iter()
                .any(|s| s.starts_with("{\"version\":5,\"minReaderVersion\":5,")),
            "{slots:?}"
        );
        assert_eq!(f.load().expect("load"), Some(shared));
    }

    #[test]
    fn a_newer_format_that_only_adds_fields_is_read_and_one_that_needs_a_newer_reader_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        std::fs::create_dir_all(f.path().parent().expect("parent")).expect("mkdir");
        let data = br#"{"bootId":"b","claims":{},"mpsDaemons":[]}"#;
        let with = |version: u32, min: u32| {
            let mut b = format!(
                "{{\"version\":{version},\"minReaderVersion\":{min},\"checksum\":\"sha256:{}\",\"futureField\":1,\"data\":",
                sha256_hex(data)
            )
            .into_bytes();
            b.extend_from_slice(data);
            b.push(b'}');
            b
        };
        std::fs::write(f.path(), with(VERSION + 1, 4)).expect("write");
        assert_eq!(f.load().expect("readable").expect("present").boot_id, "b");
        // Either slot needing a newer reader refuses the whole checkpoint.
        std::fs::write(&f.slot_paths()[1], with(VERSION + 1, VERSION + 1)).expect("write");
        let err = f.load().expect_err("too new").to_string();
        assert!(
            err.contains(&format!("needs reader version {}", VERSION + 1)),
            "{err}"
        );
    }

    #[test]
    fn garbage_is_a_named_corruption_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        std::fs::create_dir_all(f.path().parent().expect("parent")).expect("mkdir");
        for (bytes, needle) in [
            (&b"{not json"[..], "corrupt"),
            (&br#"{"version":0}"#[..], "`version`"),
            (&br#"{"version":2,"checksum":"sha256:00"}"#[..], "`data`"),
            (&b""[..], "corrupt"),
        ] {
            std::fs::write(f.path(), bytes).expect("write");
            let err = f.load().expect_err("must fail").to_string();
            assert!(
                err.contains(needle) && err.contains("checkpoint.json"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_created_mig_device_is_recorded_and_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        let mut c = sample();
        let mig = CreatedMig {
            parent_uuid: "GPU-1".into(),
            uuid: "MIG-1".into(),
            profile_id: 0,
            placement_start: 3,
            placement_size: 1,
            gpu_instance_id: 10,
            compute_instance_id: 0,
        };
        if let Some(r) = c.claims.get_mut("u") {
            r.devices[0].mig = Some(mig);
        }
        f.store(&c).expect("store");
        let text = std::fs::read_to_string(f.path()).expect("read");
        assert!(text.contains("\"gpuInstanceId\":10"), "{text}");
        assert_eq!(f.load().expect("load"), Some(c));
    }

    /// The real filesystem, counting the calls of each kind; its next sync fails (EIO) once
    /// `fail_next_sync` is set.
    #[derive(Debug, Default)]
    struct Counting(
        Mutex<BTreeMap<&'static str, usize>>,
        std::sync::atomic::AtomicBool,
    );

    impl Counting {
        fn count(&self, op: &'static str) {
            *self.0.lock().expect("lock").entry(op).or_default() += 1;
        }
        fn take(&self) -> BTreeMap<&'static str, usize> {
            std::mem::take(&mut *self.0.lock().expect("lock"))
        }
    }

    impl Fs for Counting {
        fn read(&self, p: &Path) -> io::Result<Vec<u8>> {
            RealFs.read(p)
        }
        fn write(&self, p: &Path, b: &[u8]) -> io::Result<()> {
            self.count("write");
            RealFs.write(p, b)
        }
        fn overwrite(&self, p: &Path, b: &[u8]) -> io::Result<()> {
            self.count("overwrite");
            RealFs.overwrite(p, b)
        }
        fn sync_file(&self, p: &Path) -> io::Result<()> {
            self.count("sync_file");
            if self.1.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return Err(io::Error::other("EIO"));
            }
            RealFs.sync_file(p)
        }
        fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
            self.count("rename");
            RealFs.rename(from, to)
        }
        fn sync_dir(&self, d: &Path) -> io::Result<()> {
            self.count("sync_dir");
            RealFs.sync_dir(d)
        }
        fn remove(&self, p: &Path) -> io::Result<()> {
            RealFs.remove(p)
        }
        fn list(&self, d: &Path) -> io::Result<Vec<PathBuf>> {
            RealFs.list(d)
        }
        fn create_dir_all(&self, d: &Path) -> io::Result<()> {
            RealFs.create_dir_all(d)
        }
    }

    /// The point of the slots: after each slot's first write, a durable store is one in-place
    /// write and one sync, with no rename and no directory sync, alternating between slots.
    #[test]
    fn a_store_is_one_write_in_place_and_one_sync_once_both_slots_exist() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs = Arc::new(Counting::default());
        let f = CheckpointFile::new(fs.clone(), dir.path().join("checkpoint.json"));
        assert_eq!(f.load().expect("load"), None);
        let mut c = sample();
        for (i, expected_slot) in [0, 1, 0, 1, 0].into_iter().enumerate() {
            c.boot_id = format!("b{i}");
            f.store(&c).expect("store");
            let ops = fs.take();
            let first = i < 2;
            let expected: BTreeMap<&str, usize> = if first {
                BTreeMap::from([("sync_dir", 1), ("sync_file", 1), ("write", 1)])
            } else {
                BTreeMap::from([("overwrite", 1), ("sync_file", 1)])
            };
            assert_eq!(ops, expected, "store {i}");
            let written = std::fs::read_to_string(&f.slot_paths()[expected_slot]).expect("read");
            assert!(
                written.contains(&format!("\"generation\":{}", i + 1)),
                "{written}"
            );
            assert_eq!(written.len() % SLOT_BLOCK, 0, "padded to whole blocks");
            // A fresh reader (a restart) sees the newest generation.
            let reread = CheckpointFile::new(Arc::new(RealFs), f.path()).load();
            assert_eq!(reread.expect("load"), Some(c.clone()), "store {i}");
        }
    }

    /// A crash during a store tears the slot being written, at any byte: the other slot still
    /// holds the previous generation, and a load returns it (or the new one, when the tear
    /// kept every byte that matters), never an error and never a mix.
    #[test]
    fn a_store_torn_at_any_byte_loads_the_previous_generation_or_the_new_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        let mut old = sample();
        old.boot_id = "gen-1".into();
        f.store(&old).expect("store");
        let mut previous = sample();
        previous.boot_id = "gen-2".into();
        previous.claims.clear();
        f.store(&previous).expect("store");
        // Generation 3 goes to slot 0 over generation 1: build the torn states by hand.
        let before = std::fs::read(f.path()).expect("read");
        let mut next = sample();
        next.boot_id = "gen-3".into();
        f.store(&next).expect("store");
        let after = std::fs::read(f.path()).expect("read");
        assert_eq!(
            before.len(),
            after.len(),
            "same slot length: written in place"
        );
        let (mut saw_previous, mut saw_next) = (0, 0);
        for cut in 0..=after.len() {
            let mut torn = after[..cut].to_vec();
            torn.extend_from_slice(&before[cut..]);
            std::fs::write(f.path(), &torn).expect("write");
            let loaded = CheckpointFile::new(Arc::new(RealFs), f.path())
                .load()
                .unwrap_or_else(|e| panic!("torn at byte {cut}: {e}"))
                .expect("present");
            if loaded == previous {
                saw_previous += 1;
            } else {
                assert_eq!(loaded, next, "torn at byte {cut}: neither generation");
                saw_next += 1;
            }
        }
        assert!(
            saw_previous > 0 && saw_next > 0,
            "{saw_previous} {saw_next}"
        );
        // The tear can also keep the old tail of a longer new content: a torn slot whose new
        // bytes stop anywhere inside the content is invalid.
        let content_end = after.iter().rposition(|&b| b != b' ').expect("content");
        for cut in (0..content_end).step_by(7) {
            let mut torn = after[..cut].to_vec();
            torn.resize(after.len(), 0);
            std::fs::write(f.path(), &torn).expect("write");
            let loaded = CheckpointFile::new(Arc::new(RealFs), f.path()).load();
            assert_eq!(
                loaded.expect("load"),
                Some(previous.clone()),
                "zeroed from {cut}"
            );
        }
    }

    /// A store that failed (the disk refused the sync) leaves the newest durable generation
    /// where it was: the next store goes to the same slot, never over the only durable copy.
    #[test]
    fn a_failed_store_never_makes_the_next_one_overwrite_the_durable_slot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs = Arc::new(Counting::default());
        let f = CheckpointFile::new(fs.clone(), dir.path().join("checkpoint.json"));
        let mut c = sample();
        c.boot_id = "durable".into();
        f.store(&c).expect("store"); // slot 0
        let durable = std::fs::read(f.path()).expect("read");
        fs.1.store(true, std::sync::atomic::Ordering::SeqCst);
        c.boot_id = "failed".into();
        let err = f.store(&c).expect_err("sync fails").to_string();
        assert!(
            err.contains("checkpoint.b.json") && err.contains("EIO"),
            "{err}"
        );
        c.boot_id = "retried".into();
        f.store(&c).expect("store");
        assert_eq!(
            std::fs::read(f.path()).expect("read"),
            durable,
            "slot 0 untouched"
        );
        assert_eq!(f.load().expect("load").expect("present").boot_id, "retried");
    }

    /// A version 3 `checkpoint.json` as an older build writes it.
    fn version_3(c: &Checkpoint) -> Vec<u8> {
        let data = serde_json::to_vec(c).expect("json");
        let mut b = format!(
            "{{\"version\":3,\"minReaderVersion\":2,\"checksum\":\"sha256:{}\",\"data\":",
            sha256_hex(&data)
        )
        .into_bytes();
        b.extend_from_slice(&data);
        b.push(b'}');
        b
    }

    /// After a downgrade the older build refuses the slots, moves `checkpoint.json` aside and
    /// writes its own; after the upgrade again, the slot this build left must not win over
    /// what the older build wrote since (its claims may have been unprepared meanwhile), and a
    /// slot left alone is refused rather than trusted.
    #[test]
    fn a_downgrade_and_upgrade_never_resurrect_the_stale_slot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = file(dir.path());
        let mut ours = sample();
        ours.boot_id = "ours-1".into();
        f.store(&ours).expect("store"); // slot 0
        ours.boot_id = "ours-2".into();
        f.store(&ours).expect("store"); // slot 1, generation 2
        // The older build: moves checkpoint.json aside, rebuilds, writes version 3.
        std::fs::rename(f.path(), dir.path().join("state/checkpoint.json.corrupt")).expect("mv");
        let err = file(dir.path())
            .load()
            .expect_err("slot 1 alone")
            .to_string();
        assert!(
            err.contains("checkpoint.b.json") && err.contains("stale"),
            "{err}"
        );
        let mut theirs = sample();
        theirs.boot_id = "older-build".into();
        theirs.claims.clear();
        std::fs::write(f.path(), version_3(&theirs)).expect("write");
        // Upgraded again: the older build's file wins, and the next stores build on it.
        let upgraded = file(dir.path());
        assert_eq!(upgraded.load().expect("load"), Some(theirs.clone()));
        let mut next = theirs.clone();
        next.boot_id = "upgraded-1".into();
        upgraded.store(&next).expect("store");
        assert_eq!(file(dir.path()).load().expect("load"), Some(next.clone()));
        next.boot_id = "upgraded-2".into();
        upgraded.store(&next).expect("store");
        assert_eq!(file(dir.path()).load().expect("load"), Some(next));
    }

    #[test]
    fn slots_are_named_beside_the_configured_path() {
        assert_eq!(
            slot_paths(Path::new("/p/checkpoint.json")),
            [
                PathBuf::from("/p/checkpoint.json"),
                PathBuf::from("/p/checkpoint.b.json")
            ]
        );
        assert_eq!(
            slot_paths(Path::new("/p/state")),
            [PathBuf::from("/p/state"), PathBuf::from("/p/state.b")]
        );
    }
}
