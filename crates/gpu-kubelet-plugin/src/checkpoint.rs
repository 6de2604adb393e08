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
//! - IMEX channels (issue 43) added `devices[].imexChannel` ([`RecordedChannel`]) within version
//!   5: an added field, so no new version. A build without it reads a channel as a device it
//!   does not publish; a channel has no hardware step, so nothing is left undone either way.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dra_kubelet::PreparedDevice;
use serde::{Deserialize, Serialize};

use crate::cdi::Spec;
use crate::hardware::CreatedMig;

pub use dra_plugin::checkpoint::{CheckpointError, SLOT_BLOCK, slot_paths};

/// The checkpoint format version this build writes.
pub const VERSION: u32 = 5;
/// The oldest reader version that can read what this build writes: 4, the first that reads
/// both slots (an older one would read `checkpoint.json` alone, possibly a generation behind).
pub const MIN_READER_VERSION: u32 = 4;
/// The oldest reader of a file that records a share ([`RecordedShare`]).
pub const MIN_READER_VERSION_SHARES: u32 = 5;

pub use dra_plugin::record::ClaimState;

/// Everything recorded for one claim ([`dra_plugin::record::ClaimRecord`]).
pub type ClaimRecord = dra_plugin::record::ClaimRecord<RecordedDevice>;

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
    /// The IMEX channel this device is (`imex-channel-<N>`), with what its CDI spec was made
    /// of; absent for GPUs and MIG devices. An added field within version 5: a build that does
    /// not know it reads the device as one it does not publish, which touches no hardware
    /// either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imex_channel: Option<RecordedChannel>,
}

/// A prepared IMEX channel ([`gpu_inventory::imex`]): no hardware is touched; the record keeps
/// what the claim's CDI spec is rebuilt from and what the kubelet is answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedChannel {
    /// The channel number: the device node's minor.
    pub channel: u32,
    /// The device node's major (`/proc/devices` at prepare).
    pub major: u32,
    /// The ComputeDomain's UID, from the claim's `ComputeDomainChannelConfig`.
    pub domain_id: String,
    /// The allocation's `shareID` (the device allows multiple allocations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
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
            share_id: d
                .share
                .as_ref()
                .map(|s| s.id.clone())
                .or_else(|| d.imex_channel.as_ref().and_then(|c| c.share_id.clone())),
        }
    }
}

/// The checkpoint's content ([`dra_plugin::record::Records`]).
pub type Checkpoint = dra_plugin::record::Records<RecordedDevice>;

/// The file of a version without an envelope (version 1): its claims at the top level.
#[derive(Deserialize)]
struct V1File {
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

/// The GPU driver's checkpoint format ([`dra_plugin::checkpoint::Format`]): [`Checkpoint`],
/// versions 1 to [`VERSION`] (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct GpuFormat;

impl dra_plugin::checkpoint::Format for GpuFormat {
    type Data = Checkpoint;
    const VERSION: u32 = VERSION;

    fn min_reader_version(checkpoint: &Checkpoint) -> u32 {
        if checkpoint
            .claims
            .values()
            .any(|r| r.devices.iter().any(|d| d.share.is_some()))
        {
            MIN_READER_VERSION_SHARES
        } else {
            MIN_READER_VERSION
        }
    }

    /// Versions 1 to 3 kept one file.
    fn single_slot(version: u32) -> bool {
        version < 4
    }

    fn unenveloped(version: u32, file: &[u8]) -> Option<Result<Checkpoint, String>> {
        if version != 1 {
            return None;
        }
        Some(
            serde_json::from_slice::<V1File>(file)
                .map_err(|e| e.to_string())
                .and_then(|f| {
                    f.claims
                        .map(upgrade_v1)
                        .ok_or_else(|| "version 1 without field `claims`".to_owned())
                }),
        )
    }
}

/// The checkpoint on a filesystem: two slot files ([`dra_plugin::checkpoint::SlotFile`]).
pub type CheckpointFile = dra_plugin::checkpoint::SlotFile<GpuFormat>;

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
                        imex_channel: None,
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
    use crate::storage::{Fs, RealFs};
    use std::io;
    use std::path::Path;
    use std::sync::{Arc, Mutex};

    /// The checksum of `bytes` as the envelope writes it.
    fn sha256_hex(bytes: &[u8]) -> String {
        use sha2::{Digest, Sha256};
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

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
                    imex_channel: None,
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
