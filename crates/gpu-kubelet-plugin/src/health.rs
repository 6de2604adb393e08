//! GPU health: backend events become device taints in the ResourceSlice and device health for
//! the kubelet's `DRAResourceHealth` stream.
//!
//! # Severity
//!
//! Every event is about one physical GPU; its taint goes on every device published for that GPU
//! (the whole GPU, its MIG devices, its partitionable MIG placements), because the faults below
//! are handled per GPU (a reset resets the whole GPU). One taint per GPU, key
//! `<driver>/unhealthy` (e.g. `gpu.drust.dev/unhealthy`), the value naming the cause:
//!
//! | event | effect | value |
//! |---|---|---|
//! | GPU lost (`NVML_ERROR_GPU_IS_LOST`) | `NoExecute` | `gpu-lost` |
//! | double-bit ECC error | `NoExecute` | `double-bit-ecc` |
//! | XID in [`RESET_XIDS`] | `NoExecute` | `xid-<n>` |
//! | XID in [`APPLICATION_XIDS`] | none (ignored) | |
//! | any other critical XID | `NoSchedule` | `xid-<n>` |
//!
//! `NoExecute` goes to faults after which NVIDIA's Xid catalog
//! (docs.nvidia.com/deploy/xid-errors, "Resolution Bucket (Immediate Action)") asks for a GPU reset
//! or node reboot: work on the GPU is lost or its memory can no longer be trusted, so the
//! kube-controller-manager's device taint eviction should move pods away. Milder critical XIDs
//! (e.g. 94, a contained ECC error: the affected application is stopped, the page is offlined and
//! new work can run without a reset, per NVIDIA's A100/H100 memory error management guide) only
//! keep new claims off the GPU. XIDs NVIDIA's own plugins treat as application errors (the GPU
//! stays healthy) are ignored, as in NVIDIA's k8s-device-plugin and k8s-dra-driver-gpu
//! (`xidsToSkip`: 13, 31, 43, 45, 68, 109). A later, more severe event raises the effect and
//! replaces the value (with a new `timeAdded`); a milder one keeps the taint as it is.
//!
//! # Recovery
//!
//! A taint is removed when its GPU recovers:
//! - an explicit [`HealthEventKind::Recovered`] event (the fake backend), at once;
//! - otherwise, when no event came for the GPU during [`HealthConfig::quiet_period`] and the
//!   backend's [`GpuBackend::probe_recovery`] answers [`RecoveryProbe::Healthy`] (NVML: the GPU
//!   answers by UUID and no page retirement or row remapping is pending: what a reset clears).
//!   Probes run every [`HealthConfig::probe_interval`]. A backend that cannot tell
//!   ([`RecoveryProbe::Unsupported`]) keeps the taint until the plugin restarts.
//!
//! # Outputs
//!
//! [`HealthMonitor`] offers two watch channels: per physical GPU ([`GpuHealthMap`], changes only
//! when a condition changes; what the publisher taints by and what metrics can export) and per
//! published device ([`dra_kubelet::DeviceHealth`], re-sent every [`HealthConfig::heartbeat`] with
//! the time the monitor last checked, so the kubelet's per-device timeout only expires when the
//! monitor has stopped).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use dra_kubelet::{DeviceHealth, HealthStatus};
use gpu_inventory::{GpuBackend, HealthEvent, HealthEventKind, Pool, RecoveryProbe};
use k8s_openapi::api::resource::v1::{Device, DeviceTaint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{info, warn};

/// XIDs after which NVIDIA's Xid catalog calls for a GPU reset or reboot: 48 (double-bit ECC),
/// 64 (row remapping failed), 74 (NVLink error), 79 (GPU fallen off the bus), 95 (uncontained
/// ECC error), 119 and 120 (GSP RPC timeout, GSP error), 140 (unrecovered ECC error).
pub const RESET_XIDS: [u64; 8] = [48, 64, 74, 79, 95, 119, 120, 140];

/// XIDs that are the application's fault, the GPU staying healthy: 13 (graphics engine
/// exception), 31 (GPU memory page fault), 43 (GPU stopped processing), 45 (preemptive cleanup),
/// 68 (video processor exception), 109 (context switch timeout); as NVIDIA's plugins skip them.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// The taint key's name part; the key is `<driver>/unhealthy`.
pub const TAINT_NAME: &str = "unhealthy";

/// A device taint effect (`resource.k8s.io/v1` `DeviceTaint.effect`), mildest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Effect {
    /// New claims that do not tolerate the taint are not allocated the device.
    NoSchedule,
    /// Also evicts pods whose claims use the device (kube-controller-manager's device taint
    /// eviction controller).
    NoExecute,
}

impl Effect {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoSchedule => "NoSchedule",
            Self::NoExecute => "NoExecute",
        }
    }
}

/// What an event means for scheduling: the effect and the taint value; `None` when it is
/// ignored (application XIDs) or is a recovery.
pub fn classify(kind: HealthEventKind) -> Option<(Effect, String)> {
    match kind {
        HealthEventKind::Xid { code } if APPLICATION_XIDS.contains(&code) => None,
        HealthEventKind::Xid { code } if RESET_XIDS.contains(&code) => {
            Some((Effect::NoExecute, format!("xid-{code}")))
        }
        HealthEventKind::Xid { code } => Some((Effect::NoSchedule, format!("xid-{code}"))),
        HealthEventKind::DoubleBitEcc => Some((Effect::NoExecute, "double-bit-ecc".into())),
        HealthEventKind::GpuLost => Some((Effect::NoExecute, "gpu-lost".into())),
        HealthEventKind::Recovered => None,
    }
}

/// Why a GPU is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// The taint effect.
    pub effect: Effect,
    /// The taint value, e.g. `xid-79`.
    pub cause: String,
    /// When the effect was set, in whole seconds (the API keeps `timeAdded` to the second).
    pub since: SystemTime,
}

/// One physical GPU's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuHealth {
    /// No unresolved fault.
    Healthy,
    /// An unresolved fault.
    Unhealthy(Condition),
}

/// Health of every GPU of the node, by GPU UUID.
pub type GpuHealthMap = BTreeMap<String, GpuHealth>;

/// The unhealthy GPUs of `health` (what [`crate::health_record`] keeps).
pub fn unhealthy(health: &GpuHealthMap) -> GpuHealthMap {
    health
        .iter()
        .filter(|(_, h)| matches!(h, GpuHealth::Unhealthy(_)))
        .map(|(u, h)| (u.clone(), h.clone()))
        .collect()
}

/// The physical GPU a published device lives on: its `parentUUID` attribute (MIG devices and
/// placements), else its `uuid` (whole GPUs).
pub fn physical_gpu(device: &Device) -> Option<&str> {
    let attrs = device.attributes.as_ref()?;
    attrs
        .get("parentUUID")
        .or_else(|| attrs.get("uuid"))
        .and_then(|a| a.string.as_deref())
}

/// The taint of every unhealthy GPU, by GPU UUID.
pub fn taints(driver: &str, health: &GpuHealthMap) -> BTreeMap<String, DeviceTaint> {
    health
        .iter()
        .filter_map(|(uuid, h)| match h {
            GpuHealth::Healthy => None,
            GpuHealth::Unhealthy(c) => Some((uuid.clone(), taint(driver, c))),
        })
        .collect()
}

fn taint(driver: &str, c: &Condition) -> DeviceTaint {
    let secs = c
        .since
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    DeviceTaint {
        key: format!("{driver}/{TAINT_NAME}"),
        value: Some(c.cause.clone()),
        effect: c.effect.as_str().to_owned(),
        time_added: k8s_openapi::jiff::Timestamp::from_second(secs)
            .ok()
            .map(Time),
    }
}

/// `pool` with each device carrying the taint of its physical GPU (`taints` by GPU UUID) and no
/// other taint of ours; taints set by others are kept.
pub fn apply_taints(driver: &str, pool: &Pool, taints: &BTreeMap<String, DeviceTaint>) -> Pool {
    let key = format!("{driver}/{TAINT_NAME}");
    let mut pool = pool.clone();
    for device in &mut pool.devices {
        let wanted = physical_gpu(device)
            .and_then(|gpu| taints.get(gpu))
            .cloned();
        let mut list: Vec<DeviceTaint> = device
            .taints
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|t| t.key != key)
            .collect();
        list.extend(wanted);
        device.taints = (!list.is_empty()).then_some(list);
    }
    pool
}

/// Per-device health for the kubelet: each published device gets its physical GPU's health,
/// `Unknown` when the GPU is not watched.
pub fn device_health(
    pool_name: &str,
    pool: &Pool,
    health: &GpuHealthMap,
    checked: SystemTime,
    timeout: Duration,
) -> Vec<DeviceHealth> {
    pool.devices
        .iter()
        .map(|d| {
            let (status, message) = match physical_gpu(d).and_then(|g| health.get(g)) {
                Some(GpuHealth::Healthy) => (HealthStatus::Healthy, String::new()),
                Some(GpuHealth::Unhealthy(c)) => (
                    HealthStatus::Unhealthy,
                    format!("{} ({})", c.cause, c.effect.as_str()),
                ),
                None => (HealthStatus::Unknown, "GPU not watched".to_owned()),
            };
            DeviceHealth {
                pool_name: pool_name.to_owned(),
                device_name: d.name.clone(),
                status,
                message,
                last_updated: checked,
                timeout: Some(timeout),
            }
        })
        .collect()
}

/// Tuning of the [`HealthMonitor`].
#[derive(Debug, Clone)]
pub struct HealthConfig {
    /// The pool's name (the node name), for the kubelet's device identifiers.
    pub pool_name: String,
    /// Longest single wait for a backend event; also how quickly the monitor notices it is
    /// stopped.
    pub wait: Duration,
    /// How often device health is re-sent to the kubelet.
    pub heartbeat: Duration,
    /// How long the kubelet trusts one device health report.
    pub kubelet_timeout: Duration,
    /// How long a GPU must stay free of events before a recovery probe may clear it.
    pub quiet_period: Duration,
    /// How often unhealthy GPUs are probed for recovery.
    pub probe_interval: Duration,
}

impl HealthConfig {
    /// Defaults: 1 s waits, a 10 s heartbeat with a 30 s kubelet timeout, 5 min quiet period,
    /// 30 s probes.
    pub fn new(pool_name: &str) -> Self {
        Self {
            pool_name: pool_name.to_owned(),
            wait: Duration::from_secs(1),
            heartbeat: Duration::from_secs(10),
            kubelet_timeout: Duration::from_secs(30),
            quiet_period: Duration::from_secs(300),
            probe_interval: Duration::from_secs(30),
        }
    }
}

/// The per-GPU state machine (no I/O; see the module docs for the rules).
#[derive(Debug, Clone, Default)]
pub struct HealthState {
    gpus: GpuHealthMap,
    last_event: BTreeMap<String, Instant>,
}

impl HealthState {
    /// Every GPU in `uuids` healthy.
    pub fn new<'a>(uuids: impl IntoIterator<Item = &'a str>) -> Self {
        Self {
            gpus: uuids
                .into_iter()
                .map(|u| (u.to_owned(), GpuHealth::Healthy))
                .collect(),
            last_event: BTreeMap::new(),
        }
    }

    /// Takes over the unhealthy verdicts of `restored` (an earlier instance's, from
    /// [`crate::health_record`]) for the GPUs watched, as if their last event were at `now`:
    /// the quiet period before a recovery probe starts again. Returns whether any was taken.
    pub fn restore(&mut self, restored: &GpuHealthMap, now: Instant) -> bool {
        let mut taken = false;
        for (uuid, h) in restored {
            if let (GpuHealth::Unhealthy(_), Some(current)) = (h, self.gpus.get_mut(uuid)) {
                *current = h.clone();
                self.last_event.insert(uuid.clone(), now);
                taken = true;
            }
        }
        taken
    }

    /// Watches exactly `uuids` from now on: a new GPU starts healthy, a GPU no longer there is
    /// forgotten with its verdict (its devices are no longer published). Returns whether the
    /// set changed.
    pub fn set_gpus<'a>(&mut self, uuids: impl IntoIterator<Item = &'a str>) -> bool {
        let want: std::collections::BTreeSet<&str> = uuids.into_iter().collect();
        let before = self.gpus.len();
        self.gpus.retain(|u, _| want.contains(u.as_str()));
        self.last_event.retain(|u, _| want.contains(u.as_str()));
        let mut changed = self.gpus.len() != before;
        for u in want {
            if !self.gpus.contains_key(u) {
                self.gpus.insert(u.to_owned(), GpuHealth::Healthy);
                changed = true;
            }
        }
        changed
    }

    /// The current health.
    pub fn gpus(&self) -> &GpuHealthMap {
        &self.gpus
    }

    /// Applies one event observed at `now` (`wall` for `timeAdded`); returns whether any GPU's
    /// health changed. Events for GPUs not watched are ignored.
    pub fn apply(&mut self, event: &HealthEvent, now: Instant, wall: SystemTime) -> bool {
        let Some(current) = self.gpus.get_mut(&event.gpu_uuid) else {
            warn!(gpu = %event.gpu_uuid, event = %event.kind, "health event for a GPU we do not publish; ignored");
            return false;
        };
        if event.kind == HealthEventKind::Recovered {
            self.last_event.remove(&event.gpu_uuid);
            return std::mem::replace(current, GpuHealth::Healthy) != GpuHealth::Healthy;
        }
        let Some((effect, cause)) = classify(event.kind) else {
            info!(gpu = %event.gpu_uuid, event = %event.kind, "application error; GPU stays healthy");
            return false;
        };
        self.last_event.insert(event.gpu_uuid.clone(), now);
        let raise = match current {
            GpuHealth::Healthy => true,
            GpuHealth::Unhealthy(c) => effect > c.effect,
        };
        if raise {
            *current = GpuHealth::Unhealthy(Condition {
                effect,
                cause,
                since: whole_seconds(wall),
            });
        }
        raise
    }

    /// GPUs unhealthy and without events since `now - quiet`: the candidates for a probe.
    pub fn quiet_unhealthy(&self, now: Instant, quiet: Duration) -> Vec<String> {
        self.gpus
            .iter()
            .filter(|(_, h)| matches!(h, GpuHealth::Unhealthy(_)))
            .filter(|(u, _)| {
                self.last_event
                    .get(*u)
                    .is_none_or(|t| now.saturating_duration_since(*t) >= quiet)
            })
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// Marks `uuid` healthy after a successful probe; returns whether it changed.
    pub fn recover(&mut self, uuid: &str) -> bool {
        self.last_event.remove(uuid);
        match self.gpus.get_mut(uuid) {
            Some(h) => std::mem::replace(h, GpuHealth::Healthy) != GpuHealth::Healthy,
            None => false,
        }
    }
}

fn whole_seconds(t: SystemTime) -> SystemTime {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

/// Watches GPU health until dropped.
pub struct HealthMonitor {
    gpus: watch::Receiver<GpuHealthMap>,
    watched: WatchedGpus,
    devices: watch::Receiver<Vec<DeviceHealth>>,
    projector: tokio::task::JoinHandle<()>,
    _stop: DropGuard,
}

impl HealthMonitor {
    /// Starts watching the GPUs `gpu_uuids` of `backend` (a blocking thread waits for events)
    /// and projecting their health onto the devices of the published pool `pool` (the
    /// publisher's wanted pool, untainted). `restored` holds an earlier instance's unhealthy
    /// verdicts ([`HealthState::restore`]); pass an empty map to start all healthy.
    pub fn start(
        backend: Arc<dyn GpuBackend>,
        gpu_uuids: Vec<String>,
        restored: &GpuHealthMap,
        pool: watch::Receiver<Pool>,
        config: HealthConfig,
    ) -> Self {
        let stop = CancellationToken::new();
        let mut state = HealthState::new(gpu_uuids.iter().map(String::as_str));
        let (watched_tx, mut watched_rx) = watch::channel(gpu_uuids);
        watched_rx.mark_unchanged();
        state.restore(restored, Instant::now());
        let (gpu_tx, gpu_rx) = watch::channel(state.gpus().clone());
        let (checked_tx, checked_rx) = watch::channel(SystemTime::now());
        let (failing_tx, failing_rx) = watch::channel(None);
        let initial = device_health(
            &config.pool_name,
            &pool.borrow(),
            state.gpus(),
            SystemTime::now(),
            config.kubelet_timeout,
        );
        let (device_tx, device_rx) = watch::channel(initial);
        {
            let (stop, config) = (stop.clone(), config.clone());
            // The blocking thread ends within one `wait` of `stop`, so runtime shutdown does not
            // hang on it.
            tokio::task::spawn_blocking(move || {
                watch_events(
                    backend.as_ref(),
                    state,
                    &config,
                    &stop,
                    Watched {
                        gpus: &gpu_tx,
                        checked: &checked_tx,
                        failing: &failing_tx,
                        uuids: &mut watched_rx,
                    },
                );
            });
        }
        let projector = tokio::spawn(project(
            gpu_rx.clone(),
            pool,
            checked_rx,
            failing_rx,
            device_tx,
            config,
        ));
        Self {
            gpus: gpu_rx,
            watched: WatchedGpus(Arc::new(watched_tx)),
            devices: device_rx,
            projector,
            _stop: stop.drop_guard(),
        }
    }

    /// Health per physical GPU; changes only when a GPU's condition changes (for taints and
    /// metrics).
    pub fn gpu_health(&self) -> watch::Receiver<GpuHealthMap> {
        self.gpus.clone()
    }

    /// The handle that tells the monitor which GPUs there are ([`WatchedGpus::set`]).
    pub fn watched(&self) -> WatchedGpus {
        self.watched.clone()
    }

    /// Health per published device, re-sent every heartbeat (for the kubelet).
    pub fn device_health(&self) -> watch::Receiver<Vec<DeviceHealth>> {
        self.devices.clone()
    }
}

impl Drop for HealthMonitor {
    fn drop(&mut self) {
        self.projector.abort();
    }
}

/// Tells a [`HealthMonitor`] which GPUs there are, as re-discovery finds them. Cheap to clone.
#[derive(Clone)]
pub struct WatchedGpus(Arc<watch::Sender<Vec<String>>>);

impl WatchedGpus {
    /// From now on the monitor watches the GPUs `uuids` (NVML UUIDs): a new one starts healthy
    /// and its events are received (the backend re-registers for events,
    /// [`GpuBackend::rewatch_health_events`]); one no longer there is forgotten. Takes effect
    /// within one event wait. Call it before publishing the inventory.
    pub fn set(&self, mut uuids: Vec<String>) {
        uuids.sort_unstable();
        self.0.send_if_modified(|current| {
            let mut sorted = current.clone();
            sorted.sort_unstable();
            let changed = sorted != uuids;
            if changed {
                *current = uuids;
            }
            changed
        });
    }
}

/// After this many failed waits in a row the monitor cannot vouch for any GPU: devices it
/// would report Healthy are reported Unknown until a wait succeeds again.
pub const FAILED_WAITS_UNTIL_UNKNOWN: u32 = 3;

/// Where the blocking loop reports.
struct Watched<'a> {
    /// Health per GPU, on change.
    gpus: &'a watch::Sender<GpuHealthMap>,
    /// When the GPUs were last checked.
    checked: &'a watch::Sender<SystemTime>,
    /// Why monitoring is failing (`None`: it works).
    failing: &'a watch::Sender<Option<String>>,
    /// The GPUs to watch, from re-discovery.
    uuids: &'a mut watch::Receiver<Vec<String>>,
}

/// The blocking loop: wait for events, apply them, probe quiet unhealthy GPUs. When waiting
/// keeps failing ([`FAILED_WAITS_UNTIL_UNKNOWN`] times in a row) it says so once, and once
/// more when a wait succeeds again.
fn watch_events(
    backend: &dyn GpuBackend,
    mut state: HealthState,
    config: &HealthConfig,
    stop: &CancellationToken,
    out: Watched<'_>,
) {
    let mut failed_waits = 0u32;
    let mut next_probe = Instant::now() + config.probe_interval;
    // Follows re-discovery: called before each wait and again before applying what it returned,
    // since the GPU set may change (and be published) while a wait is under way.
    let follow = |state: &mut HealthState, uuids: &mut watch::Receiver<Vec<String>>| {
        if !uuids.has_changed().unwrap_or(false) {
            return false;
        }
        let now = uuids.borrow_and_update().clone();
        let changed = state.set_gpus(now.iter().map(String::as_str));
        if changed {
            info!(gpus = ?now, "the set of GPUs changed; watching their health events");
            backend.rewatch_health_events();
        }
        changed
    };
    while !stop.is_cancelled() {
        let mut changed = follow(&mut state, out.uuids);
        let waited = backend.wait_health_event(config.wait);
        changed |= follow(&mut state, out.uuids);
        if waited.is_ok() && failed_waits >= FAILED_WAITS_UNTIL_UNKNOWN {
            info!(
                failed_waits,
                "GPU health events are received again; health is known again"
            );
            out.failing.send_replace(None);
        }
        match waited {
            Ok(Some(event)) => {
                info!(gpu = %event.gpu_uuid, event = %event.kind, "GPU health event");
                changed = state.apply(&event, Instant::now(), SystemTime::now());
                failed_waits = 0;
            }
            Ok(None) => failed_waits = 0,
            Err(e) => {
                failed_waits = failed_waits.saturating_add(1);
                if failed_waits == FAILED_WAITS_UNTIL_UNKNOWN {
                    warn!(error = %e, failed_waits,
                        "waiting for GPU health events keeps failing; devices report Unknown \
                         until it works again");
                    out.failing.send_replace(Some(e.to_string()));
                }
                std::thread::sleep(config.wait);
            }
        }
        let now = Instant::now();
        if now >= next_probe {
            next_probe = now + config.probe_interval;
            for uuid in state.quiet_unhealthy(now, config.quiet_period) {
                match backend.probe_recovery(&uuid) {
                    Ok(RecoveryProbe::Healthy) => {
                        info!(gpu = %uuid, "GPU recovered: quiet and answering NVML");
                        changed |= state.recover(&uuid);
                    }
                    Ok(RecoveryProbe::Unhealthy(why)) => {
                        info!(gpu = %uuid, reason = %why, "GPU not recovered yet");
                    }
                    Ok(RecoveryProbe::Unsupported) => {}
                    Err(e) => warn!(gpu = %uuid, error = %e, "recovery probe failed"),
                }
            }
        }
        if changed {
            out.gpus.send_replace(state.gpus().clone());
        }
        if failed_waits == 0 {
            out.checked.send_replace(SystemTime::now());
        }
    }
}

/// Projects GPU health onto the pool's devices on every change and every heartbeat.
async fn project(
    mut gpus: watch::Receiver<GpuHealthMap>,
    mut pool: watch::Receiver<Pool>,
    checked: watch::Receiver<SystemTime>,
    mut failing: watch::Receiver<Option<String>>,
    devices: watch::Sender<Vec<DeviceHealth>>,
    config: HealthConfig,
) {
    let mut heartbeat = tokio::time::interval(config.heartbeat);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            r = gpus.changed() => if r.is_err() { return },
            r = pool.changed() => if r.is_err() { return },
            r = failing.changed() => if r.is_err() { return },
            _ = heartbeat.tick() => {}
        }
        let mut snapshot = device_health(
            &config.pool_name,
            &pool.borrow_and_update(),
            &gpus.borrow_and_update(),
            *checked.borrow(),
            config.kubelet_timeout,
        );
        // A GPU last seen Healthy is not known to be healthy while monitoring fails; one seen
        // Unhealthy stays so.
        if let Some(why) = failing.borrow_and_update().as_deref() {
            for d in &mut snapshot {
                if d.status == HealthStatus::Healthy {
                    d.status = HealthStatus::Unknown;
                    d.message = format!("GPU health monitoring is failing: {why}");
                }
            }
        }
        devices.send_replace(snapshot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::DeviceAttribute;

    fn device(name: &str, attrs: &[(&str, &str)]) -> Device {
        Device {
            name: name.into(),
            attributes: Some(
                attrs
                    .iter()
                    .map(|(k, v)| {
                        (
                            (*k).to_owned(),
                            DeviceAttribute {
                                string: Some((*v).to_owned()),
                                ..Default::default()
                            },
                        )
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn pool() -> Pool {
        Pool::from(vec![
            device("gpu-a", &[("uuid", "GPU-a")]),
            device("gpu-a-mig-1", &[("uuid", "MIG-1"), ("parentUUID", "GPU-a")]),
            device("gpu-a-3g", &[("parentUUID", "GPU-a")]),
            device("gpu-b", &[("uuid", "GPU-b")]),
        ])
    }

    fn event(uuid: &str, kind: HealthEventKind) -> HealthEvent {
        HealthEvent {
            gpu_uuid: uuid.into(),
            kind,
        }
    }

    #[test]
    fn events_are_classified_by_severity() {
        use HealthEventKind::*;
        let cases = [
            (Xid { code: 79 }, Some((Effect::NoExecute, "xid-79"))),
            (Xid { code: 48 }, Some((Effect::NoExecute, "xid-48"))),
            (Xid { code: 95 }, Some((Effect::NoExecute, "xid-95"))),
            (Xid { code: 94 }, Some((Effect::NoSchedule, "xid-94"))),
            (Xid { code: 63 }, Some((Effect::NoSchedule, "xid-63"))),
            (Xid { code: 13 }, None),
            (Xid { code: 31 }, None),
            (Xid { code: 43 }, None),
            (Xid { code: 109 }, None),
            (DoubleBitEcc, Some((Effect::NoExecute, "double-bit-ecc"))),
            (GpuLost, Some((Effect::NoExecute, "gpu-lost"))),
            (Recovered, None),
        ];
        for (kind, want) in cases {
            let got = classify(kind);
            assert_eq!(got.as_ref().map(|(e, v)| (*e, v.as_str())), want, "{kind}");
        }
    }

    #[test]
    fn a_taint_covers_every_device_of_its_gpu_and_no_other() {
        let mut state = HealthState::new(["GPU-a", "GPU-b"]);
        let wall = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_700);
        assert!(state.apply(
            &event("GPU-a", HealthEventKind::Xid { code: 79 }),
            Instant::now(),
            wall
        ));
        let tainted = apply_taints(
            "gpu.drust.dev",
            &pool(),
            &taints("gpu.drust.dev", state.gpus()),
        );
        let by_name: BTreeMap<_, _> = tainted
            .devices
            .iter()
            .map(|d| (d.name.as_str(), d.taints.clone()))
            .collect();
        for name in ["gpu-a", "gpu-a-mig-1", "gpu-a-3g"] {
            let t = by_name[name].as_ref().expect("tainted");
            assert_eq!(t.len(), 1);
            assert_eq!(
                (
                    t[0].key.as_str(),
                    t[0].value.as_deref(),
                    t[0].effect.as_str()
                ),
                ("gpu.drust.dev/unhealthy", Some("xid-79"), "NoExecute")
            );
            assert_eq!(
                t[0].time_added.as_ref().map(|t| t.0.as_second()),
                Some(1_700_000_000)
            );
        }
        assert_eq!(by_name["gpu-b"], None);
    }

    #[test]
    fn removing_a_taint_keeps_taints_set_by_others() {
        let mut p = pool();
        p.devices[0].taints = Some(vec![
            DeviceTaint {
                key: "example.com/maintenance".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            },
            DeviceTaint {
                key: "gpu.drust.dev/unhealthy".into(),
                effect: "NoExecute".into(),
                ..Default::default()
            },
        ]);
        let healthy = apply_taints("gpu.drust.dev", &p, &BTreeMap::new());
        let keys: Vec<_> = healthy.devices[0]
            .taints
            .iter()
            .flatten()
            .map(|t| t.key.as_str())
            .collect();
        assert_eq!(keys, ["example.com/maintenance"]);
        assert_eq!(healthy.devices[1].taints, None);
    }

    #[test]
    fn a_more_severe_event_raises_the_effect_and_a_milder_one_does_not() {
        let mut state = HealthState::new(["GPU-a"]);
        let (now, wall) = (Instant::now(), SystemTime::now());
        assert!(state.apply(
            &event("GPU-a", HealthEventKind::Xid { code: 94 }),
            now,
            wall
        ));
        assert!(state.apply(&event("GPU-a", HealthEventKind::GpuLost), now, wall));
        assert!(!state.apply(
            &event("GPU-a", HealthEventKind::Xid { code: 63 }),
            now,
            wall
        ));
        assert!(!state.apply(
            &event("GPU-a", HealthEventKind::Xid { code: 13 }),
            now,
            wall
        ));
        let GpuHealth::Unhealthy(c) = &state.gpus()["GPU-a"] else {
            panic!("unhealthy expected");
        };
        assert_eq!(
            (c.effect, c.cause.as_str()),
            (Effect::NoExecute, "gpu-lost")
        );
        assert!(state.apply(&event("GPU-a", HealthEventKind::Recovered), now, wall));
        assert_eq!(state.gpus()["GPU-a"], GpuHealth::Healthy);
        assert!(!state.apply(&event("GPU-a", HealthEventKind::Recovered), now, wall));
        assert!(!state.apply(&event("GPU-z", HealthEventKind::GpuLost), now, wall));
    }

    #[test]
    fn only_gpus_quiet_for_the_whole_period_are_probed() {
        let mut state = HealthState::new(["GPU-a", "GPU-b", "GPU-c"]);
        let start = Instant::now();
        let quiet = Duration::from_secs(300);
        state.apply(
            &event("GPU-a", HealthEventKind::GpuLost),
            start,
            SystemTime::now(),
        );
        state.apply(
            &event("GPU-b", HealthEventKind::DoubleBitEcc),
            start + Duration::from_secs(200),
            SystemTime::now(),
        );
        assert!(
            state
                .quiet_unhealthy(start + Duration::from_secs(299), quiet)
                .is_empty()
        );
        assert_eq!(
            state.quiet_unhealthy(start + Duration::from_secs(300), quiet),
            ["GPU-a"]
        );
        assert!(state.recover("GPU-a"));
        assert_eq!(
            state.quiet_unhealthy(start + Duration::from_secs(600), quiet),
            ["GPU-b"]
        );
    }

    #[test]
    fn device_health_follows_the_physical_gpu() {
        let mut state = HealthState::new(["GPU-a"]);
        state.apply(
            &event("GPU-a", HealthEventKind::DoubleBitEcc),
            Instant::now(),
            SystemTime::now(),
        );
        let checked = SystemTime::now();
        let health = device_health(
            "node-a",
            &pool(),
            state.gpus(),
            checked,
            Duration::from_secs(30),
        );
        let by_name: BTreeMap<_, _> = health
            .iter()
            .map(|d| (d.device_name.as_str(), d.status))
            .collect();
        assert_eq!(by_name["gpu-a"], HealthStatus::Unhealthy);
        assert_eq!(by_name["gpu-a-mig-1"], HealthStatus::Unhealthy);
        assert_eq!(by_name["gpu-a-3g"], HealthStatus::Unhealthy);
        assert_eq!(by_name["gpu-b"], HealthStatus::Unknown);
        assert!(
            health
                .iter()
                .all(|d| d.last_updated == checked && d.pool_name == "node-a")
        );
    }

    #[test]
    fn the_watched_gpus_follow_rediscovery_new_ones_healthy_gone_ones_forgotten() {
        let t0 = Instant::now();
        let mut state = HealthState::new(["GPU-a", "GPU-b"]);
        assert!(state.apply(
            &event("GPU-b", HealthEventKind::Xid { code: 79 }),
            t0,
            SystemTime::now()
        ));
        // Before following, an event of a GPU found later is dropped.
        assert!(!state.apply(
            &event("GPU-c", HealthEventKind::Xid { code: 79 }),
            t0,
            SystemTime::now()
        ));
        assert!(state.set_gpus(["GPU-a", "GPU-c"]));
        assert_eq!(
            state.gpus().keys().map(String::as_str).collect::<Vec<_>>(),
            ["GPU-a", "GPU-c"]
        );
        assert_eq!(state.gpus()["GPU-c"], GpuHealth::Healthy);
        assert!(state.apply(
            &event("GPU-c", HealthEventKind::Xid { code: 79 }),
            t0,
            SystemTime::now()
        ));
        assert!(!state.set_gpus(["GPU-c", "GPU-a"]), "same set: no change");
        assert!(matches!(state.gpus()["GPU-c"], GpuHealth::Unhealthy(_)));
    }

    #[tokio::test]
    async fn the_monitor_reports_an_injected_event_and_its_recovery_per_gpu_and_per_device() {
        let topology = gpu_inventory::Topology::parse(
            r#"
system: {driverVersion: "570.124.06", cudaDriverVersion: 12080}
gpus:
  - {index: 0, minor: 0, uuid: GPU-a, name: NVIDIA H100 80GB HBM3, brand: Nvidia,
     architecture: Hopper, cudaComputeCapabilityMajor: 9, cudaComputeCapabilityMinor: 0,
     memoryTotalBytes: 85520809984, multiprocessorCount: 132, pciBusId: "00000000:18:00.0",
     numaNode: 0}
"#,
            "t",
        )
        .expect("valid");
        let fake = Arc::new(gpu_inventory::FakeBackend::new(topology));
        let (_pool_tx, pool_rx) = watch::channel(pool());
        let mut config = HealthConfig::new("node-a");
        config.wait = Duration::from_millis(20);
        let monitor = HealthMonitor::start(
            Arc::clone(&fake) as Arc<dyn GpuBackend>,
            vec!["GPU-a".into()],
            &GpuHealthMap::new(),
            pool_rx,
            config,
        );
        let mut gpus = monitor.gpu_health();
        let mut devices = monitor.device_health();
        fake.inject_event(event("GPU-a", HealthEventKind::Xid { code: 79 }));
        let timeout = Duration::from_secs(10);
        tokio::time::timeout(
            timeout,
            gpus.wait_for(|m| matches!(m.get("GPU-a"), Some(GpuHealth::Unhealthy(_)))),
        )
        .await
        .expect("unhealthy in time")
        .expect("monitor alive");
        tokio::time::timeout(
            timeout,
            devices.wait_for(|d| {
                d.iter()
                    .any(|h| h.device_name == "gpu-a" && h.status == HealthStatus::Unhealthy)
            }),
        )
        .await
        .expect("device unhealthy in time")
        .expect("monitor alive");
        fake.inject_event(event("GPU-a", HealthEventKind::Recovered));
        tokio::time::timeout(
            timeout,
            gpus.wait_for(|m| m.get("GPU-a") == Some(&GpuHealth::Healthy)),
        )
        .await
        .expect("healthy in time")
        .expect("monitor alive");

        // Waiting for events keeps failing: the healthy GPU's devices become Unknown (not a
        // fresh "Healthy"), saying why; when waits work again they are Healthy again.
        fake.fail_health_events(true);
        let unknown = tokio::time::timeout(
            timeout,
            devices.wait_for(|d| {
                d.iter()
                    .filter(|h| h.device_name.starts_with("gpu-a"))
                    .all(|h| h.status == HealthStatus::Unknown)
            }),
        )
        .await
        .expect("unknown in time")
        .expect("monitor alive")
        .clone();
        assert!(
            unknown
                .iter()
                .filter(|h| h.device_name.starts_with("gpu-a"))
                .all(|h| h.message.contains("GPU health monitoring is failing")
                    && h.message.contains("wait_health_event")),
            "{unknown:?}"
        );
        // Said once: fifteen more failed waits neither report the devices again nor (the same
        // branch) log again.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !devices.has_changed().expect("monitor alive"),
            "failing waits were reported again: {:?}",
            *devices.borrow()
        );
        fake.fail_health_events(false);
        tokio::time::timeout(
            timeout,
            devices.wait_for(|d| {
                d.iter()
                    .filter(|h| h.device_name.starts_with("gpu-a"))
                    .all(|h| h.status == HealthStatus::Healthy)
            }),
        )
        .await
        .expect("healthy again in time")
        .expect("monitor alive");
    }
}
