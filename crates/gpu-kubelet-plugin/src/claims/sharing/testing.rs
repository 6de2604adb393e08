//! `Recorder`: one fake of both sharing ports ([`Node`], [`Daemons`]) that logs every action in
//! one ordered log, fails the actions it is told to, and keeps the little state the strategies
//! read back (daemon liveness and protocol, the claim records).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dra_kubelet::ClaimRef;
use dra_plugin::lifecycle::Error as LifecycleError;
use gpu_inventory::backend::ComputeMode;
use tokio::sync::OwnedMutexGuard;

use super::{Daemons, Node};
use crate::checkpoint::{Checkpoint, ClaimRecord, ClaimState, RecordedDevice, RecordedShare};
use crate::claim_config::{MpsLimits, Sharing, TimeSlice};
use crate::claims::ClaimError;
use crate::mps::{Ceiling, Liveness, MpsDevice, MpsError, NamespaceLimits, Protocol};

/// The fake; see the module docs. Actions are logged as `"<verb> <arguments>"`.
pub(super) struct Recorder {
    /// Whether the node has the `kernel` level's memory limits.
    kernel: bool,
    log: Mutex<Vec<String>>,
    fail: Mutex<BTreeSet<String>>,
    /// Daemon liveness by key; absent: dead.
    liveness: Mutex<BTreeMap<String, Liveness>>,
    protocols: Mutex<BTreeMap<String, Protocol>>,
    records: Mutex<Checkpoint>,
    locks: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Recorder {
    /// A node with (`kernel`) or without the `kernel` level's memory limits.
    pub(super) fn new(kernel: bool) -> Self {
        Self {
            kernel,
            log: Mutex::default(),
            fail: Mutex::default(),
            liveness: Mutex::default(),
            protocols: Mutex::default(),
            records: Mutex::default(),
            locks: Mutex::default(),
        }
    }

    /// The actions so far, clearing the log.
    pub(super) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }

    /// Makes the action logged as `action` fail (logged all the same).
    pub(super) fn fail(&self, action: &str) {
        self.fail.lock().unwrap().insert(action.to_owned());
    }

    /// Sets daemon `key`'s liveness.
    pub(super) fn set_liveness(&self, key: &str, liveness: Liveness) {
        self.liveness
            .lock()
            .unwrap()
            .insert(key.to_owned(), liveness);
    }

    /// Records claim `uid` (as `ns/<uid>`) in `state` with `devices`.
    pub(super) fn record(&self, uid: &str, state: ClaimState, devices: &[RecordedDevice]) {
        self.records.lock().unwrap().claims.insert(
            uid.to_owned(),
            ClaimRecord {
                namespace: "ns".into(),
                name: uid.into(),
                state,
                devices: devices.to_vec(),
                cdi_spec_path: PathBuf::new(),
                cdi_spec: Default::default(),
            },
        );
    }

    /// Forgets claim `uid`'s record.
    pub(super) fn forget(&self, uid: &str) {
        self.records.lock().unwrap().claims.remove(uid);
    }

    /// Logs `action`; whether it is to fail.
    fn act(&self, action: String) -> bool {
        let fails = self.fail.lock().unwrap().contains(&action);
        self.log.lock().unwrap().push(action);
        fails
    }

    fn node_result(&self, claim: &ClaimRef, action: String) -> Result<(), ClaimError> {
        if self.act(action.clone()) {
            return Err(ClaimError::Lifecycle(LifecycleError::TaskFailed {
                claim: claim.clone(),
                action: "recorded action",
                message: format!("{action}: injected failure"),
            }));
        }
        Ok(())
    }

    fn daemon_result(&self, action: String) -> Result<(), MpsError> {
        if self.act(action.clone()) {
            return Err(MpsError::Failed {
                binary: "nvidia-cuda-mps-control".into(),
                args: action,
                status: "exit status: 1".into(),
                stderr: "injected failure".into(),
            });
        }
        Ok(())
    }
}

impl Node for Recorder {
    async fn lock_gpu(&self, name: &str) -> OwnedMutexGuard<()> {
        self.act(format!("lock {name}"));
        let lock = Arc::clone(
            self.locks
                .lock()
                .unwrap()
                .entry(name.to_owned())
                .or_default(),
        );
        lock.lock_owned().await
    }

    async fn set_compute_mode(
        &self,
        claim: &ClaimRef,
        name: &str,
        mode: ComputeMode,
    ) -> Result<(), ClaimError> {
        self.node_result(claim, format!("mode {name} {mode:?}"))
    }

    async fn set_time_slice(
        &self,
        claim: &ClaimRef,
        name: &str,
        slice: TimeSlice,
    ) -> Result<(), ClaimError> {
        self.node_result(claim, format!("slice {name} {slice:?}"))
    }

    async fn clear_memory_limits(&self, claim: &ClaimRef) -> Result<usize, ClaimError> {
        if !self.kernel {
            return Ok(0);
        }
        self.node_result(claim, format!("clear limits {}", claim.uid))
            .map(|()| 1)
    }

    async fn with_records<T: Send>(&self, read: impl FnOnce(&Checkpoint) -> T + Send) -> T {
        read(&self.records.lock().unwrap())
    }
}

impl Daemons for Recorder {
    async fn liveness(&self, key: &str) -> Liveness {
        self.act(format!("liveness {key}"));
        self.liveness
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or(Liveness::Dead)
    }

    async fn protocol(&self, key: &str) -> Result<Option<Protocol>, MpsError> {
        Ok(self.protocols.lock().unwrap().get(key).copied())
    }

    async fn start(
        &self,
        key: &str,
        served: &[MpsDevice],
        percentage: Option<u32>,
    ) -> Result<(), MpsError> {
        let uuids: Vec<&str> = served.iter().map(|d| d.uuid.as_str()).collect();
        let percentage = percentage.map_or_else(|| "-".to_owned(), |p| format!("{p}%"));
        self.daemon_result(format!("start {key} [{}] {percentage}", uuids.join(" ")))?;
        self.set_liveness(key, Liveness::Answering);
        self.protocols
            .lock()
            .unwrap()
            .insert(key.to_owned(), Protocol::Legacy);
        Ok(())
    }

    async fn start_v3(&self, key: &str, uuid: &str) -> Result<(), MpsError> {
        self.daemon_result(format!("start v3 {key} {uuid}"))?;
        self.set_liveness(key, Liveness::Answering);
        self.protocols
            .lock()
            .unwrap()
            .insert(key.to_owned(), Protocol::V3);
        Ok(())
    }

    async fn start_server(&self, key: &str, server_uid: u32) -> Result<(), MpsError> {
        self.daemon_result(format!("server {key} uid {server_uid}"))
    }

    async fn set_ceiling(&self, key: &str, ceiling: Ceiling) -> Result<(), MpsError> {
        self.daemon_result(format!("ceiling {key} {ceiling}"))
    }

    async fn set_namespace(
        &self,
        key: &str,
        name: &str,
        limits: NamespaceLimits,
    ) -> Result<(), MpsError> {
        let threads = limits
            .active_thread_percentage
            .map_or_else(|| "-".to_owned(), |p| format!("{p}%"));
        self.daemon_result(format!(
            "namespace {key} {name} {}M {threads}",
            limits.pinned_mib
        ))
    }

    async fn delete_namespace(&self, key: &str, name: &str) -> Result<(), MpsError> {
        self.daemon_result(format!("delete namespace {key} {name}"))
    }

    async fn stop(&self, key: &str) -> Result<(), MpsError> {
        self.daemon_result(format!("stop {key}"))?;
        self.liveness.lock().unwrap().remove(key);
        self.protocols.lock().unwrap().remove(key);
        Ok(())
    }

    fn pipe_dir(&self, key: &str) -> PathBuf {
        PathBuf::from(format!("/mps/{key}/pipe"))
    }
}

/// Claim `uid` in namespace `ns`, named as its UID.
pub(super) fn claim(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        name: uid.into(),
        uid: uid.into(),
    }
}

/// Device `name` (UUID `uuid-<name>`) with no sharing.
pub(super) fn device(name: &str) -> RecordedDevice {
    RecordedDevice {
        request_names: vec!["gpu".into()],
        pool_name: "node".into(),
        device_name: name.into(),
        cdi_device_ids: Vec::new(),
        uuid: format!("uuid-{name}"),
        admin_access: false,
        sharing: None,
        mig: None,
        share: None,
        imex_channel: None,
    }
}

/// Device `name` configured for time-slicing with the short slice.
pub(super) fn time_sliced(name: &str) -> RecordedDevice {
    RecordedDevice {
        sharing: Some(Sharing::TimeSlicing {
            interval: TimeSlice::Short,
        }),
        ..device(name)
    }
}

/// Device `name` under the claim's MPS daemon, with thread `percentage`.
pub(super) fn mps_device(name: &str, percentage: Option<u32>) -> RecordedDevice {
    RecordedDevice {
        sharing: Some(Sharing::Mps(MpsLimits {
            active_thread_percentage: percentage,
            pinned_memory_limit_bytes: None,
        })),
        ..device(name)
    }
}

/// A share of device `name`: `mib` of memory and `percent` of compute (0: none reserved).
pub(super) fn share_of(name: &str, mib: u64, percent: u32) -> RecordedDevice {
    RecordedDevice {
        share: Some(RecordedShare {
            id: format!("share-{mib}-{percent}"),
            memory_bytes: mib << 20,
            compute_percent: percent,
            whole: false,
        }),
        ..device(name)
    }
}
