//! The record of prepared claims, so prepare is idempotent across calls and restarts.
//!
//! Stored as JSON at `<plugin-dir>/checkpoint.json`, replaced atomically on every change.
//! Shape (version 1): `{"version": 1, "claims": {"<claim-uid>": ClaimRecord}}`. Unknown fields
//! are ignored on read so a newer writer's additions do not break us.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use dra_kubelet::PreparedDevice;
use serde::{Deserialize, Serialize};

use crate::fsutil::write_atomic;

/// The checkpoint format version this build writes.
pub const VERSION: u32 = 1;

/// Everything recorded for one prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// Name of the ResourceClaim.
    pub name: String,
    /// The devices returned to the kubelet.
    pub devices: Vec<RecordedDevice>,
    /// The CDI spec file written for the claim.
    pub cdi_spec: PathBuf,
}

/// A prepared device as recorded (the kubelet's answer, serializable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedDevice {
    /// Request names.
    pub request_names: Vec<String>,
    /// Pool.
    pub pool_name: String,
    /// Device.
    pub device_name: String,
    /// CDI device IDs.
    pub cdi_device_ids: Vec<String>,
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

/// The checkpoint's content.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Format version.
    pub version: u32,
    /// Prepared claims by claim UID.
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
    /// The file is not a checkpoint we understand.
    #[error("checkpoint {path} is corrupt: {problem}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
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

/// The checkpoint file.
#[derive(Debug, Clone)]
pub struct CheckpointFile {
    path: PathBuf,
}

impl CheckpointFile {
    /// The checkpoint at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the checkpoint; a missing file is an empty checkpoint.
    ///
    /// # Errors
    /// [`CheckpointError::Read`] or [`CheckpointError::Corrupt`] (including a version from the
    /// future).
    pub fn load(&self) -> Result<Checkpoint, CheckpointError> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Checkpoint {
                    version: VERSION,
                    ..Default::default()
                });
            }
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let corrupt = |problem: String| CheckpointError::Corrupt {
            path: self.path.clone(),
            problem,
        };
        let checkpoint: Checkpoint =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if checkpoint.version == 0 || checkpoint.version > VERSION {
            return Err(corrupt(format!(
                "version {} is not supported (this build reads 1..={VERSION})",
                checkpoint.version
            )));
        }
        Ok(checkpoint)
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
        let bytes = serde_json::to_vec_pretty(checkpoint).map_err(|e| write_err(e.into()))?;
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(write_err)?;
        }
        write_atomic(&self.path, &bytes).map_err(write_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ClaimRecord {
        ClaimRecord {
            namespace: "ns".into(),
            name: "c".into(),
            devices: vec![RecordedDevice {
                request_names: vec!["gpu".into()],
                pool_name: "node".into(),
                device_name: "gpu-0".into(),
                cdi_device_ids: vec!["d/claim=u-gpu-0".into()],
            }],
            cdi_spec: "/var/run/cdi/x.json".into(),
        }
    }

    #[test]
    fn a_missing_file_is_an_empty_checkpoint_and_a_stored_one_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = CheckpointFile::new(dir.path().join("state/checkpoint.json"));
        assert!(f.load().expect("load").claims.is_empty());
        let mut c = Checkpoint {
            version: VERSION,
            ..Default::default()
        };
        c.claims.insert("u".into(), record());
        f.store(&c).expect("store");
        assert_eq!(f.load().expect("load"), c);
    }

    #[test]
    fn unknown_fields_are_tolerated_but_garbage_and_future_versions_are_named_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = CheckpointFile::new(dir.path().join("checkpoint.json"));
        std::fs::write(f.path(), br#"{"version":1,"claims":{},"futureField":3}"#).expect("write");
        assert!(f.load().is_ok());
        for (bytes, needle) in [
            (&b"{not json"[..], "corrupt"),
            (&br#"{"version":99,"claims":{}}"#[..], "version 99"),
        ] {
            std::fs::write(f.path(), bytes).expect("write");
            let err = f.load().expect_err("must fail").to_string();
            assert!(
                err.contains(needle) && err.contains("checkpoint.json"),
                "{err}"
            );
        }
    }
}
