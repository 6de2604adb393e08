//! The health monitor's verdicts on disk, `health.json` beside the checkpoint, so that a
//! restarted instance, or the next one of a rolling update, publishes the taints its
//! predecessor had published from its very first publish on, and keeps them until the recovery
//! rule ([`crate::health`]) clears them. Without it a restart republished the slices untainted
//! and the scheduler placed the next pod on the GPU that had just raised, say, XID 94.
//!
//! Shape: `{"version": 1, "unhealthy": {"<GPU UUID>": {"effect": "NoExecute", "cause":
//! "xid-79", "since": <unix seconds>}}}`: only unhealthy GPUs. It is replaced atomically
//! ([`crate::storage::write_atomic`]) on every change of the monitor's verdicts. A missing file
//! means every GPU healthy; an unreadable or damaged one is logged and treated as missing
//! (health is re-learned from events; claims are never affected by it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::health::{Condition, Effect, GpuHealth, GpuHealthMap};
use crate::storage::{RealFs, write_atomic};

const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    unhealthy: BTreeMap<String, Entry>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    effect: String,
    cause: String,
    /// Unix seconds.
    since: u64,
}

/// The record file.
#[derive(Debug, Clone)]
pub struct HealthRecord {
    path: PathBuf,
}

impl HealthRecord {
    /// The record at `path` (`<plugin-dir>/health.json`).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The unhealthy GPUs recorded (blocking file I/O). Never fails: a missing file is an
    /// empty map; a damaged one is logged and gives an empty map.
    pub fn load(&self) -> GpuHealthMap {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return GpuHealthMap::new(),
            Err(e) => {
                warn!(path = %self.path.display(), error = %e,
                    "cannot read the health record; starting with every GPU healthy");
                return GpuHealthMap::new();
            }
        };
        let file = match serde_json::from_slice::<File>(&bytes) {
            Ok(f) if f.version == VERSION => f,
            Ok(f) => {
                warn!(path = %self.path.display(), version = f.version,
                    "health record of an unknown version; starting with every GPU healthy");
                return GpuHealthMap::new();
            }
            Err(e) => {
                warn!(path = %self.path.display(), error = %e,
                    "damaged health record; starting with every GPU healthy");
                return GpuHealthMap::new();
            }
        };
        file.unhealthy
            .into_iter()
            .filter_map(|(uuid, e)| {
                let effect = match e.effect.as_str() {
                    "NoSchedule" => Effect::NoSchedule,
                    "NoExecute" => Effect::NoExecute,
                    other => {
                        warn!(gpu = %uuid, effect = other, "health record: unknown effect; ignored");
                        return None;
                    }
                };
                Some((
                    uuid,
                    GpuHealth::Unhealthy(Condition {
                        effect,
                        cause: e.cause,
                        since: SystemTime::UNIX_EPOCH + Duration::from_secs(e.since),
                    }),
                ))
            })
            .collect()
    }

    /// Records the unhealthy GPUs of `health` (blocking, durable).
    ///
    /// # Errors
    /// The I/O error of the atomic replace.
    pub fn store(&self, health: &GpuHealthMap) -> std::io::Result<()> {
        let unhealthy = health
            .iter()
            .filter_map(|(uuid, h)| match h {
                GpuHealth::Unhealthy(c) => Some((
                    uuid.clone(),
                    Entry {
                        effect: c.effect.as_str().to_owned(),
                        cause: c.cause.clone(),
                        since: c
                            .since
                            .duration_since(SystemTime::UNIX_EPOCH)
                            .map_or(0, |d| d.as_secs()),
                    },
                )),
                GpuHealth::Healthy => None,
            })
            .collect();
        let bytes = serde_json::to_vec(&File {
            version: VERSION,
            unhealthy,
        })
        .map_err(std::io::Error::other)?;
        write_atomic(&RealFs, &self.path, &bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unhealthy_gpus_survive_a_round_trip_and_damage_means_healthy() {
        let dir = tempfile::tempdir().expect("tmp");
        let record = HealthRecord::new(dir.path().join("health.json"));
        assert!(record.load().is_empty(), "no file: all healthy");
        let condition = Condition {
            effect: Effect::NoExecute,
            cause: "xid-79".into(),
            since: SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_000_000),
        };
        let health: GpuHealthMap = [
            ("GPU-a".to_owned(), GpuHealth::Unhealthy(condition.clone())),
            ("GPU-b".to_owned(), GpuHealth::Healthy),
        ]
        .into();
        record.store(&health).expect("store");
        assert_eq!(
            record.load(),
            GpuHealthMap::from([("GPU-a".to_owned(), GpuHealth::Unhealthy(condition))])
        );
        std::fs::write(record.path(), b"{ damaged").expect("damage");
        assert!(record.load().is_empty());
    }
}
