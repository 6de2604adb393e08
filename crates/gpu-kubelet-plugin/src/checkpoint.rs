//! The record of claims being and having been prepared, so prepare is idempotent across calls,
//! restarts, crashes and upgrades.
//!
//! On disk (`<plugin-dir>/checkpoint.json`, replaced with [`write_atomic`]):
//!
//! ```json
//! {"version":2,"minReaderVersion":2,"checksum":"sha256:<hex>","data":{"bootId":"…","claims":{…}}}
//! ```
//!
//! - `checksum` is SHA-256 over the bytes of `data` exactly as stored, never over re-serialized
//!   data, so any bit flip or torn write is detected.
//! - `version` is the writer's format version; `minReaderVersion` the oldest reader that can use
//!   the file. A reader accepts any file whose `minReaderVersion` it meets and ignores fields it
//!   does not know, so a future version that only adds fields stays readable after a downgrade.
//! - Version 1 (no envelope: `{"version":1,"claims":{…}}`, written by the first drust builds) is
//!   read and upgraded on the next write. It could not record in-progress claims or the boot,
//!   so its claims read as completed in the current boot.
//! - Version 3 adds `devices[].mig` ([`CreatedMig`]): the MIG device prepare created for a
//!   partitionable placement, which unprepare must destroy. A version 2 reader would ignore the
//!   field and leave the MIG device behind, so a file holding any `mig` is written with
//!   `minReaderVersion` 3; without one it stays 2, and a downgrade keeps working where dynamic
//!   MIG is not used. (A downgraded plugin refuses the file as too new, rebuilds its claims from
//!   the CDI specs, and cannot destroy the devices; after the next upgrade they are reclaimed as
//!   orphans at start.)

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dra_kubelet::PreparedDevice;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::cdi::Spec;
use crate::hardware::CreatedMig;
use crate::storage::{Fs, write_atomic};

/// The checkpoint format version this build writes.
pub const VERSION: u32 = 3;
/// The oldest reader version that can read what this build writes when no claim holds a created
/// MIG device.
pub const MIN_READER_VERSION: u32 = 2;
/// The oldest reader version that can read a checkpoint holding a created MIG device
/// (`devices[].mig`, which it must act on at unprepare).
pub const MIN_READER_VERSION_MIG: u32 = 3;

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
}

impl From<&RecordedDevice> for PreparedDevice {
    fn from(d: &RecordedDevice) -> Self {
        PreparedDevice {
            request_names: d.request_names.clone(),
            pool_name: d.pool_name.clone(),
            device_name: d.device_name.clone(),
            cdi_device_ids: d.cdi_device_ids.clone(),
            share_id: None,
        }
    }
}

impl Checkpoint {
    /// The oldest reader that can act on this content correctly.
    pub fn min_reader_version(&self) -> u32 {
        let mig = self
            .claims
            .values()
            .flat_map(|r| &r.devices)
            .any(|d| d.mig.is_some());
        if mig {
            MIN_READER_VERSION_MIG
        } else {
            MIN_READER_VERSION
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

/// The checkpoint file on a filesystem.
#[derive(Debug, Clone)]
pub struct CheckpointFile {
    fs: Arc<dyn Fs>,
    path: PathBuf,
}

impl CheckpointFile {
    /// The checkpoint at `path` on `fs`.
    pub fn new(fs: Arc<dyn Fs>, path: impl Into<PathBuf>) -> Self {
        Self {
            fs,
            path: path.into(),
        }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the checkpoint; `Ok(None)` when there is none.
    ///
    /// # Errors
    /// [`CheckpointError::Read`], [`CheckpointError::Corrupt`] (bad JSON, checksum mismatch,
    /// missing fields) or [`CheckpointError::TooNew`].
    pub fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let bytes = match self.fs.read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        self.decode(&bytes).map(Some)
    }

    fn decode(&self, bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
        let corrupt = |problem: String| CheckpointError::Corrupt {
            path: self.path.clone(),
            problem,
        };
        let env: Envelope<'_> =
            serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        match env.version {
            0 => Err(corrupt("field `version` must be at least 1".into())),
            1 => {
                let claims = env
                    .claims
                    .ok_or_else(|| corrupt("version 1 without field `claims`".into()))?;
                Ok(upgrade_v1(claims))
            }
            written => {
                let needed = env.min_reader_version.unwrap_or(written);
                if needed > VERSION {
                    return Err(CheckpointError::TooNew {
                        path: self.path.clone(),
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
                serde_json::from_str(data.get()).map_err(|e| corrupt(format!("field `data`: {e}")))
            }
        }
    }

    /// Replaces the file with `checkpoint`, durably.
    ///
    /// # Errors
    /// [`CheckpointError::Write`].
    pub fn store(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
        let write_err = |source| CheckpointError::Write {
            path: self.path.clone(),
            source,
        };
        let data = serde_json::to_vec(checkpoint).map_err(|e| write_err(e.into()))?;
        let mut bytes = format!(
            "{{\"version\":{VERSION},\"minReaderVersion\":{},\
             \"checksum\":\"sha256:{}\",\"data\":",
            checkpoint.min_reader_version(),
            sha256_hex(&data)
        )
        .into_bytes();
        bytes.extend_from_slice(&data);
        bytes.extend_from_slice(b"}\n");
        if let Some(dir) = self.path.parent() {
            self.fs.create_dir_all(dir).map_err(write_err)?;
        }
        write_atomic(self.fs.as_ref(), &self.path, &bytes).map_err(write_err)
    }

    /// Moves a damaged checkpoint aside (`<name>.corrupt`), keeping it for inspection.
    ///
    /// # Errors
    /// [`CheckpointError::Write`].
    pub fn quarantine(&self) -> Result<PathBuf, CheckpointError> {
        let mut aside = self.path.clone().into_os_string();
        aside.push(".corrupt");
        let aside = PathBuf::from(aside);
        self.fs
            .rename(&self.path, &aside)
            .and_then(|()| match self.path.parent() {
                Some(dir) => self.fs.sync_dir(dir),
                None => Ok(()),
            })
            .map_err(|source| CheckpointError::Write {
                path: self.path.clone(),
                source,
            })?;
        Ok(aside)
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
        // The next write is the current version, readable by version 2, and reads back the same.
        f.store(&c).expect("store");
        assert!(
            std::fs::read_to_string(f.path())
                .expect("read")
                .starts_with("{\"version\":3,\"minReaderVersion\":2,")
        );
        assert_eq!(f.load().expect("load"), Some(c));
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
        std::fs::write(f.path(), with(3, 2)).expect("write");
        assert_eq!(f.load().expect("readable").expect("present").boot_id, "b");
        std::fs::write(f.path(), with(4, 4)).expect("write");
        let err = f.load().expect_err("too new").to_string();
        assert!(err.contains("needs reader version 4"), "{err}");
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
    fn a_created_mig_device_is_recorded_and_needs_a_reader_that_destroys_it() {
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
            r.devices[0].mig = Some(mig.clone());
        }
        f.store(&c).expect("store");
        let text = std::fs::read_to_string(f.path()).expect("read");
        assert!(
            text.starts_with("{\"version\":3,\"minReaderVersion\":3,"),
            "{text}"
        );
        assert!(text.contains("\"gpuInstanceId\":10"), "{text}");
        assert_eq!(f.load().expect("load"), Some(c.clone()));
        // Once the device is gone from every record, older readers may read the file again.
        if let Some(r) = c.claims.get_mut("u") {
            r.devices[0].mig = None;
        }
        f.store(&c).expect("store");
        let text = std::fs::read_to_string(f.path()).expect("read");
        assert!(
            text.starts_with("{\"version\":3,\"minReaderVersion\":2,"),
            "{text}"
        );
        assert!(!text.contains("\"mig\""), "{text}");
    }
}
