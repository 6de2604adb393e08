//! GPU health events as a backend reports them, and the fake backend's event files.
//!
//! A [`HealthEvent`] names the physical GPU by UUID and says what happened: a critical XID error
//! (with its code), an uncorrectable (double-bit) ECC error, the GPU lost (fallen off the bus or
//! otherwise unreachable through NVML), or (fake backend only) that the GPU has recovered.
//! Deciding what an event means for scheduling is the node plugin's job, not the backend's.
//!
//! # Event files (fake backend)
//!
//! Tests inject events by dropping JSON files into `<state_dir>/events/`. Each `*.json` file
//! holds one event; the fake consumes the files in file-name order (byte order, so
//! zero-padded sequence numbers sort as intended) and deletes each one as it is read:
//!
//! ```json
//! {"gpuUuid": "GPU-4f3c...", "event": "xid", "code": 79}
//! {"gpuUuid": "GPU-4f3c...", "event": "doubleBitEcc"}
//! {"gpuUuid": "GPU-4f3c...", "event": "gpuLost"}
//! {"gpuUuid": "GPU-4f3c...", "event": "recovered"}
//! ```
//!
//! Write a file under another name (e.g. `001.json.tmp`) and rename it into place, so the fake
//! never reads it half-written. A file that is not a valid event is renamed to
//! `<name>.rejected` (so it is read once) and reported as [`crate::BackendError::EventFile`]
//! naming the file and the problem.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One health event of one physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireEvent", into = "WireEvent")]
pub struct HealthEvent {
    /// The physical GPU's UUID (`GPU-...`); MIG events are reported against their parent GPU.
    pub gpu_uuid: String,
    /// What happened.
    pub kind: HealthEventKind,
}

/// What a [`HealthEvent`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEventKind {
    /// `nvmlEventTypeXidCriticalError`: the driver logged XID `code`.
    Xid {
        /// The XID number (NVIDIA's Xid catalog).
        code: u64,
    },
    /// `nvmlEventTypeDoubleBitEccError`: an uncorrectable memory error.
    DoubleBitEcc,
    /// NVML answers `NVML_ERROR_GPU_IS_LOST` for the GPU: it fell off the bus or stopped
    /// answering.
    GpuLost,
    /// The GPU is healthy again. Only the fake backend reports this; for NVML the node plugin
    /// decides recovery with [`crate::GpuBackend::probe_recovery`].
    Recovered,
}

impl std::fmt::Display for HealthEventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Xid { code } => write!(f, "XID {code}"),
            Self::DoubleBitEcc => f.write_str("double-bit ECC error"),
            Self::GpuLost => f.write_str("GPU lost"),
            Self::Recovered => f.write_str("recovered"),
        }
    }
}

/// The event file's shape: flat, so unknown fields can be refused (serde cannot refuse them
/// through a flattened tagged enum).
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WireEvent {
    gpu_uuid: String,
    event: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    code: Option<u64>,
}

impl TryFrom<WireEvent> for HealthEvent {
    type Error = String;
    fn try_from(w: WireEvent) -> Result<Self, String> {
        if w.gpu_uuid.is_empty() {
            return Err("field `gpuUuid` must not be empty".into());
        }
        let kind = match (w.event.as_str(), w.code) {
            ("xid", Some(code)) => HealthEventKind::Xid { code },
            ("xid", None) => return Err("event `xid` needs field `code`".into()),
            ("doubleBitEcc", None) => HealthEventKind::DoubleBitEcc,
            ("gpuLost", None) => HealthEventKind::GpuLost,
            ("recovered", None) => HealthEventKind::Recovered,
            ("doubleBitEcc" | "gpuLost" | "recovered", Some(_)) => {
                return Err(format!("event `{}` takes no field `code`", w.event));
            }
            (other, _) => {
                return Err(format!(
                    "field `event`: unknown event `{other}` (expected xid, doubleBitEcc, gpuLost or recovered)"
                ));
            }
        };
        Ok(Self {
            gpu_uuid: w.gpu_uuid,
            kind,
        })
    }
}

impl From<HealthEvent> for WireEvent {
    fn from(e: HealthEvent) -> Self {
        let (event, code) = match e.kind {
            HealthEventKind::Xid { code } => ("xid", Some(code)),
            HealthEventKind::DoubleBitEcc => ("doubleBitEcc", None),
            HealthEventKind::GpuLost => ("gpuLost", None),
            HealthEventKind::Recovered => ("recovered", None),
        };
        Self {
            gpu_uuid: e.gpu_uuid,
            event: event.to_owned(),
            code,
        }
    }
}

/// What a backend can say about whether a GPU that reported errors is usable again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryProbe {
    /// The backend cannot tell; only an explicit [`HealthEventKind::Recovered`] clears the GPU.
    Unsupported,
    /// NVML answers for the GPU and nothing that only a reset clears is pending.
    Healthy,
    /// Still unhealthy, with the reason (e.g. `row remapping pending`).
    Unhealthy(String),
}

/// How often the fake looks for new event files while waiting.
pub const EVENT_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The fake backend's event directory under `state_dir`.
pub fn events_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("events")
}

/// Reads and consumes the first event file (by name) in `dir`, if any.
///
/// # Errors
/// `(path, problem)` when the file cannot be read or is not a valid event; the file has then been
/// renamed to `<name>.rejected`.
pub fn take_event_file(dir: &Path) -> Result<Option<HealthEvent>, (PathBuf, String)> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err((dir.to_owned(), format!("listing: {e}"))),
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let Some(path) = files.into_iter().next() else {
        return Ok(None);
    };
    let parsed = std::fs::read(&path)
        .map_err(|e| format!("reading: {e}"))
        .and_then(|bytes| {
            serde_json::from_slice::<HealthEvent>(&bytes).map_err(|e| format!("parsing: {e}"))
        });
    match parsed {
        Ok(event) => {
            std::fs::remove_file(&path).map_err(|e| (path.clone(), format!("consuming: {e}")))?;
            Ok(Some(event))
        }
        Err(problem) => {
            let mut rejected = path.clone().into_os_string();
            rejected.push(".rejected");
            // If even the rename fails the file would be read again and again; say so.
            let problem = match std::fs::rename(&path, &rejected) {
                Ok(()) => problem,
                Err(e) => format!("{problem}; setting it aside failed too: {e}"),
            };
            Err((path, problem))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_kind_round_trips_through_the_documented_json() {
        let cases = [
            (
                r#"{"gpuUuid":"GPU-a","event":"xid","code":79}"#,
                HealthEventKind::Xid { code: 79 },
            ),
            (
                r#"{"gpuUuid":"GPU-a","event":"doubleBitEcc"}"#,
                HealthEventKind::DoubleBitEcc,
            ),
            (
                r#"{"gpuUuid":"GPU-a","event":"gpuLost"}"#,
                HealthEventKind::GpuLost,
            ),
            (
                r#"{"gpuUuid":"GPU-a","event":"recovered"}"#,
                HealthEventKind::Recovered,
            ),
        ];
        for (json, kind) in cases {
            let event: HealthEvent = serde_json::from_str(json).expect(json);
            assert_eq!(event.kind, kind);
            assert_eq!(event.gpu_uuid, "GPU-a");
            assert_eq!(serde_json::to_string(&event).expect("serialize"), json);
        }
    }

    #[test]
    fn malformed_events_name_the_field() {
        for (json, needle) in [
            (r#"{"gpuUuid":"GPU-a","event":"xid"}"#, "`code`"),
            (r#"{"gpuUuid":"","event":"gpuLost"}"#, "`gpuUuid`"),
            (
                r#"{"gpuUuid":"GPU-a","event":"gpuLost","code":1}"#,
                "`code`",
            ),
            (
                r#"{"gpuUuid":"GPU-a","event":"gpuLost","colour":1}"#,
                "colour",
            ),
        ] {
            let err = serde_json::from_str::<HealthEvent>(json).expect_err(json);
            assert!(err.to_string().contains(needle), "{json}: {err}");
        }
    }

    #[test]
    fn event_files_are_consumed_in_name_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("002.json"),
            r#"{"gpuUuid":"GPU-b","event":"gpuLost"}"#,
        )
        .expect("write");
        std::fs::write(
            dir.path().join("001.json"),
            r#"{"gpuUuid":"GPU-a","event":"xid","code":48}"#,
        )
        .expect("write");
        std::fs::write(dir.path().join("003.json.tmp"), "half").expect("write");
        let first = take_event_file(dir.path()).expect("ok").expect("event");
        assert_eq!(first.gpu_uuid, "GPU-a");
        let second = take_event_file(dir.path()).expect("ok").expect("event");
        assert_eq!(second.kind, HealthEventKind::GpuLost);
        assert_eq!(take_event_file(dir.path()).expect("ok"), None);
        assert!(dir.path().join("003.json.tmp").exists());
    }

    #[test]
    fn a_bad_event_file_is_named_in_the_error_and_set_aside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("001.json");
        std::fs::write(&path, r#"{"gpuUuid":"GPU-a","event":"meltdown"}"#).expect("write");
        let (at, problem) = take_event_file(dir.path()).expect_err("invalid");
        assert_eq!(at, path);
        assert!(problem.contains("meltdown"), "{problem}");
        assert!(dir.path().join("001.json.rejected").exists());
        assert_eq!(take_event_file(dir.path()).expect("ok"), None);
    }

    #[test]
    fn a_missing_event_directory_means_no_events() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            take_event_file(&dir.path().join("events")).expect("ok"),
            None
        );
    }
}
