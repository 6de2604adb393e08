//! Multi-node NVLink fabrics: what a GPU's fabric answer means for scheduling (device taints),
//! and the watch that republishes as soon as that answer changes.
//!
//! # What is published
//!
//! `nvlinkClique` (`<clusterUuid>.<cliqueId>`) is published where registration COMPLETED with
//! success and a non-zero cluster UUID ([`gpu_inventory::fabric::FabricInfo::clique`]), whatever
//! the health: an unhealthy fabric keeps its clique and gets a taint, so it is never a silent
//! "no clique" (NVIDIA/dra-driver-nvidia-gpu #626). Before registration completes, or when it
//! failed, no clique is published (never a stale one) and the GPU is tainted.
//!
//! # Taints
//!
//! Every condition is one taint with key `<driver>/fabric` (e.g. `gpu.drust.dev/fabric`) and
//! the condition as its value, on every device published for the GPU (whole GPU, MIG devices,
//! placements, shares). A claim tolerates them all with `{key: gpu.drust.dev/fabric, operator:
//! Exists}`, or one with `operator: Equal, value: <condition>`. `timeAdded` is when this
//! instance first saw the condition.
//!
//! | condition (NVML) | value | effect |
//! |---|---|---|
//! | state NOT_STARTED | `registration-not-started` | NoSchedule |
//! | state IN_PROGRESS | `registration-in-progress` | NoSchedule |
//! | COMPLETED with an error status | `registration-failed` | NoSchedule |
//! | the call fails, or answers a state this version does not know | `query-failed` | NoSchedule |
//! | healthMask DEGRADED_BW true | `degraded-bandwidth` | NoSchedule |
//! | healthMask ROUTE_RECOVERY true | `route-recovery` | NoSchedule |
//! | healthMask ROUTE_UNHEALTHY true | `route-unhealthy` | NoSchedule |
//! | healthMask ACCESS_TIMEOUT_RECOVERY true | `access-timeout-recovery` | NoSchedule |
//! | healthMask INCORRECT_CONFIGURATION other than NONE | `incorrect-configuration-<sysguid, chassis-serial-number, no-partition, insufficient-nvlinks, incompatible-gpu-firmware, invalid-location, gpu-state-invalid, or the number>` | NoSchedule |
//! | healthMask PARTITION_ASSIGNED false | `partition-not-assigned` | NoSchedule |
//! | healthSummary UNHEALTHY | `unhealthy` | NoSchedule |
//! | healthSummary LIMITED_CAPACITY | `limited-capacity` | NoSchedule |
//!
//! No taint: no fabric (NOT_SUPPORTED as an error or as the state, what an H100 VM answers),
//! COMPLETED with a zero cluster UUID (an NVSwitch system that is no multi-node fabric), mask
//! fields that are "false" or not supported, summary HEALTHY or NOT_SUPPORTED, and the global
//! fabric manager's connection state (bits 14-15: it says whether the fabric can be changed,
//! not whether it works).
//!
//! NoSchedule throughout: on an NVSwitch system a GPU whose registration has not completed
//! cannot start CUDA work (CUDA answers "system not yet initialized" until Fabric Manager has
//! registered it), and one with a degraded or unhealthy fabric runs single-GPU work as well as
//! ever, so new claims are kept off unless they tolerate the condition. NoExecute is not used:
//! evicting would also stop work that never touches NVLink, the conditions are often transient
//! (route and access-timeout recovery), and a multi-node job hit by a broken fabric fails by
//! itself (NCCL errors) and is placed elsewhere on its retry, steered by the taint. Compare
//! `crate::health`, whose NoExecute faults lose the GPU's work or its memory.
//!
//! # Watch
//!
//! NVML has no event for fabric changes, so [`watch`] polls `nvmlDeviceGetGpuFabricInfoV` of
//! each GPU that has a fabric ([`crate::config::FabricWatch`]: every 5 s while any registration
//! is pending or a call fails, every 15 s otherwise; GPUs answering NOT_SUPPORTED are not
//! polled), compares with the last discovered inventory, and on any difference wakes the
//! rediscovery, which publishes the new pool (clique and taints) and relabels the Node. A clique
//! that Fabric Manager re-partitions is republished the same way. Flapping between IN_PROGRESS
//! and COMPLETED republishes at most once per poll.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use gpu_inventory::fabric::{
    FabricAnswer, FabricHealthSummary, FabricState, IncorrectConfiguration,
};
use gpu_inventory::{GpuBackend, Inventory, Pool};
use k8s_openapi::api::resource::v1::DeviceTaint;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tokio::sync::{Notify, watch};
use tracing::{debug, info, warn};

use crate::config::FabricWatch;
use crate::health::{Effect, physical_gpu};

/// The taint key's name part; the key is `<driver>/fabric`.
pub const TAINT_NAME: &str = "fabric";

/// What a GPU's fabric answer means for scheduling: one (effect, value) per condition, in the
/// order of the module's table; empty for a GPU without a fabric or with a healthy one.
pub fn conditions(answer: &FabricAnswer) -> Vec<(Effect, String)> {
    let mut out = Vec::new();
    let mut push = |value: &str| out.push((Effect::NoSchedule, value.to_owned()));
    if answer.error.is_some() {
        push("query-failed");
        return out;
    }
    let Some(info) = &answer.info else {
        return out;
    };
    match info.state {
        // No fabric: the rest of the answer is zeros.
        FabricState::NotSupported => return out,
        FabricState::NotStarted => push("registration-not-started"),
        FabricState::InProgress => push("registration-in-progress"),
        FabricState::Completed if info.status != gpu_inventory::fabric::NVML_SUCCESS => {
            push("registration-failed");
        }
        FabricState::Completed => {}
    }
    if let Some(h) = info.health() {
        for (set, value) in [
            (h.degraded_bandwidth, "degraded-bandwidth"),
            (h.route_recovery, "route-recovery"),
            (h.route_unhealthy, "route-unhealthy"),
            (h.access_timeout_recovery, "access-timeout-recovery"),
        ] {
            if set == Some(true) {
                push(value);
            }
        }
        if let Some(c) = h.incorrect_configuration
            && let Some(why) = incorrect_configuration(c)
        {
            push(&format!("incorrect-configuration-{why}"));
        }
        if h.partition_assigned == Some(false) {
            push("partition-not-assigned");
        }
    }
    match info.health_summary {
        Some(FabricHealthSummary::Unhealthy) => push("unhealthy"),
        Some(FabricHealthSummary::LimitedCapacity) => push("limited-capacity"),
        _ => {}
    }
    out
}

/// The sub-reason of an incorrect configuration, as it appears in the taint value; `None` for a
/// correct one.
fn incorrect_configuration(c: IncorrectConfiguration) -> Option<String> {
    Some(
        match c {
            IncorrectConfiguration::None => return None,
            IncorrectConfiguration::SysGuid => "sysguid",
            IncorrectConfiguration::ChassisSerialNumber => "chassis-serial-number",
            IncorrectConfiguration::NoPartition => "no-partition",
            IncorrectConfiguration::InsufficientNvlinks => "insufficient-nvlinks",
            IncorrectConfiguration::IncompatibleGpuFirmware => "incompatible-gpu-firmware",
            IncorrectConfiguration::InvalidLocation => "invalid-location",
            IncorrectConfiguration::GpuStateInvalid => "gpu-state-invalid",
            IncorrectConfiguration::Other(n) => return Some(n.to_string()),
        }
        .to_owned(),
    )
}

/// The fabric taints of each GPU, with the time each condition was first seen, kept from one
/// discovery to the next so that an unchanged condition keeps its `timeAdded` (and an unchanged
/// pool writes nothing). Cheap to clone; clones share the times.
#[derive(Debug, Clone, Default)]
pub struct FabricTaints {
    since: Arc<Mutex<BTreeMap<(String, String), SystemTime>>>,
}

impl FabricTaints {
    /// Adds to `pool` the fabric taints of `inventory`'s GPUs (key `<driver>/fabric`), each on
    /// every device of its GPU, replacing any fabric taint of ours already there; conditions
    /// seen for the first time are stamped `now` and logged, and the ones gone are forgotten and
    /// logged as cleared.
    pub fn apply(&self, driver: &str, inventory: &Inventory, pool: &mut Pool, now: SystemTime) {
        let key = format!("{driver}/{TAINT_NAME}");
        let mut since = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut seen = BTreeSet::new();
        let mut by_gpu: BTreeMap<&str, Vec<DeviceTaint>> = BTreeMap::new();
        for gpu in &inventory.gpus {
            let answer = gpu.raw.fabric_answer();
            for (effect, value) in conditions(&answer) {
                let at = *since
                    .entry((gpu.raw.uuid.clone(), value.clone()))
                    .or_insert_with(|| {
                        warn!(gpu = %gpu.raw.uuid, condition = %value,
                            error = answer.error.as_deref().unwrap_or_default(),
                            status = answer.info.as_ref().map(|i| i.status)
                                .filter(|s| *s != 0)
                                .map(gpu_inventory::fabric::nvml_return_name)
                                .unwrap_or_default(),
                            "NVLink fabric condition: tainting the GPU's devices");
                        now
                    });
                seen.insert((gpu.raw.uuid.clone(), value.clone()));
                by_gpu.entry(&gpu.raw.uuid).or_default().push(DeviceTaint {
                    key: key.clone(),
                    value: Some(value),
                    effect: effect.as_str().to_owned(),
                    time_added: whole_seconds(at),
                });
            }
        }
        since.retain(|k, _| {
            let keep = seen.contains(k);
            if !keep {
                info!(gpu = %k.0, condition = %k.1, "NVLink fabric condition cleared");
            }
            keep
        });
        for device in &mut pool.devices {
            let wanted = physical_gpu(device).and_then(|g| by_gpu.get(g));
            let mut list: Vec<DeviceTaint> = device
                .taints
                .take()
                .unwrap_or_default()
                .into_iter()
                .filter(|t| t.key != key)
                .collect();
            list.extend(wanted.into_iter().flatten().cloned());
            device.taints = (!list.is_empty()).then_some(list);
        }
    }
}

/// `at` as the API's `timeAdded`, in whole seconds (what the API server keeps).
fn whole_seconds(at: SystemTime) -> Option<Time> {
    let secs = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .ok()
        .map(Time)
}

/// The fabric answers of the last discovered inventory, by NVML index: what [`watch`] compares
/// with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Watched {
    /// (NVML index, UUID, answer) of every GPU discovered.
    pub gpus: Vec<(u32, String, FabricAnswer)>,
}

impl Watched {
    /// The answers of `inventory`'s GPUs.
    pub fn of(inventory: &Inventory) -> Self {
        Self {
            gpus: inventory
                .gpus
                .iter()
                .map(|g| (g.raw.index, g.raw.uuid.clone(), g.raw.fabric_answer()))
                .collect(),
        }
    }

    /// Whether a GPU's answer can change: it has a fabric (a state other than NOT_SUPPORTED) or
    /// its call failed.
    fn watched(answer: &FabricAnswer) -> bool {
        answer.error.is_some()
            || answer
                .info
                .as_ref()
                .is_some_and(|i| i.state != FabricState::NotSupported)
    }

    /// How long until the next poll: `config.pending` while any registration is pending or a
    /// call fails, `config.settled` while any GPU has a fabric, `None` when none has.
    pub fn period(&self, config: &FabricWatch) -> Option<Duration> {
        let answers = || self.gpus.iter().map(|(_, _, a)| a);
        if answers().any(|a| a.error.is_some() || a.info.as_ref().is_some_and(|i| i.pending())) {
            Some(config.pending)
        } else if answers().any(Self::watched) {
            Some(config.settled)
        } else {
            None
        }
    }

    /// Tells `sender` the answers of `inventory` when they differ from what it holds (what
    /// follows each rediscovered inventory).
    pub fn follow(sender: &watch::Sender<Self>, inventory: &Inventory) {
        let now = Self::of(inventory);
        sender.send_if_modified(|held| {
            let changed = *held != now;
            if changed {
                *held = now;
            }
            changed
        });
    }
}

/// Polls the fabric answer of every watched GPU of `known` (the last discovered inventory's,
/// [`Watched::follow`]) at the cadence [`Watched::period`] gives, and wakes the rediscovery
/// (`wake`) when any differs. Polls run on a blocking thread; a GPU whose query fails is left to
/// the rediscovery and the health monitor. Returns when `known`'s sender is gone.
pub async fn watch(
    backend: Arc<dyn GpuBackend>,
    mut known: watch::Receiver<Watched>,
    wake: Arc<Notify>,
    config: FabricWatch,
) {
    loop {
        let current = known.borrow_and_update().clone();
        let Some(period) = current.period(&config) else {
            if known.changed().await.is_err() {
                return;
            }
            continue;
        };
        tokio::select! {
            r = known.changed() => {
                if r.is_err() {
                    return;
                }
                continue;
            }
            () = tokio::time::sleep(period) => {}
        }
        let polled = {
            let backend = Arc::clone(&backend);
            let gpus: Vec<u32> = current
                .gpus
                .iter()
                .filter(|(_, _, a)| Watched::watched(a))
                .map(|(i, _, _)| *i)
                .collect();
            tokio::task::spawn_blocking(move || {
                gpus.into_iter()
                    .map(|i| (i, backend.fabric(i)))
                    .collect::<Vec<_>>()
            })
            .await
        };
        let Ok(polled) = polled else {
            warn!("the NVLink fabric poll failed; trying again at the next one");
            continue;
        };
        let mut changed = Vec::new();
        for (index, answer) in polled {
            let Some((_, uuid, before)) = current.gpus.iter().find(|(i, _, _)| *i == index) else {
                continue;
            };
            match answer {
                Ok(now) if now != *before => changed.push((uuid.clone(), now)),
                Ok(_) => {}
                Err(e) => debug!(gpu = %uuid, error = %e, "GPU did not answer the fabric poll"),
            }
        }
        if !changed.is_empty() {
            for (gpu, now) in &changed {
                info!(gpu = %gpu, state = ?now.info.as_ref().map(|i| i.state),
                    clique = ?now.info.as_ref().and_then(|i| i.clique()),
                    health_mask = ?now.info.as_ref().and_then(|i| i.health_mask),
                    summary = ?now.info.as_ref().and_then(|i| i.health_summary),
                    error = ?now.error,
                    "NVLink fabric answer changed; rediscovering to republish");
            }
            wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_inventory::fabric::FabricInfo;

    fn answer(state: FabricState, mask: Option<u32>, summary: Option<u8>) -> FabricAnswer {
        FabricAnswer {
            info: Some(FabricInfo {
                state,
                status: 0,
                cluster_uuid: "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94".into(),
                clique_id: 1,
                health_mask: mask,
                health_summary: summary.and_then(FabricHealthSummary::from_nvml),
            }),
            error: None,
        }
    }

    fn values(a: &FabricAnswer) -> Vec<String> {
        conditions(a)
            .into_iter()
            .map(|(effect, v)| {
                assert_eq!(effect, Effect::NoSchedule, "{v}");
                v
            })
            .collect()
    }

    #[test]
    fn every_fabric_condition_becomes_a_taint_value_naming_it() {
        use FabricState::*;
        // Bits: 0-1 degraded bandwidth, 2-3 route recovery, 4-5 route unhealthy, 6-7 access
        // timeout recovery, 8-11 incorrect configuration, 12-13 partition assigned; 1 true,
        // 2 false.
        let fine = 0xaa | (1 << 8) | (1 << 12);
        let cases: Vec<(FabricAnswer, Vec<&str>)> = vec![
            (FabricAnswer::default(), vec![]),
            // The H100 VM: Success, state NOT_SUPPORTED, zeros.
            (answer(NotSupported, Some(0), Some(0)), vec![]),
            (answer(Completed, Some(fine), Some(1)), vec![]),
            (answer(Completed, None, None), vec![]),
            (
                answer(NotStarted, None, None),
                vec!["registration-not-started"],
            ),
            (
                answer(InProgress, Some(0), Some(0)),
                vec!["registration-in-progress"],
            ),
            (
                answer(Completed, Some(fine & !0x3 | 0x1), Some(3)),
                vec!["degraded-bandwidth", "limited-capacity"],
            ),
            (
                answer(Completed, Some(fine & !0xc | 0x4), Some(1)),
                vec!["route-recovery"],
            ),
            (
                answer(Completed, Some(fine & !0x30 | 0x10), Some(2)),
                vec!["route-unhealthy", "unhealthy"],
            ),
            (
                answer(Completed, Some(fine & !0xc0 | 0x40), None),
                vec!["access-timeout-recovery"],
            ),
            (
                answer(Completed, Some(fine & !0xf00 | (5 << 8)), Some(2)),
                vec!["incorrect-configuration-insufficient-nvlinks", "unhealthy"],
            ),
            (
                answer(Completed, Some(fine & !0xf00 | (15 << 8)), None),
                vec!["incorrect-configuration-15"],
            ),
            (
                answer(InProgress, Some(fine & !0x3000 | (2 << 12)), None),
                vec!["registration-in-progress", "partition-not-assigned"],
            ),
            // Every flag true at once: each is its own taint.
            (
                answer(Completed, Some(0x55 | (2 << 8) | (2 << 12)), Some(2)),
                vec![
                    "degraded-bandwidth",
                    "route-recovery",
                    "route-unhealthy",
                    "access-timeout-recovery",
                    "incorrect-configuration-sysguid",
                    "partition-not-assigned",
                    "unhealthy",
                ],
            ),
            // The global fabric manager disconnected alone taints nothing.
            (answer(Completed, Some(fine | (2 << 14)), Some(1)), vec![]),
            (
                FabricAnswer {
                    info: None,
                    error: Some(
                        "nvmlDeviceGetGpuFabricInfoV (v3) failed: Unknown Error (999)".into(),
                    ),
                },
                vec!["query-failed"],
            ),
        ];
        for (a, want) in cases {
            assert_eq!(values(&a), want, "{a:?}");
        }
        let mut failed = answer(Completed, None, None);
        if let Some(i) = failed.info.as_mut() {
            i.status = 23;
        }
        assert_eq!(values(&failed), ["registration-failed"]);
        // Every value is a valid label value (the API's rule for taint values).
        for v in [
            "incorrect-configuration-incompatible-gpu-firmware",
            "incorrect-configuration-chassis-serial-number",
        ] {
            assert!(crate::node_label::label_value(v), "{v}");
        }
    }

    fn tray(fabric: &str) -> Inventory {
        let topology = gpu_inventory::Topology::parse(
            &format!(
                r#"
system: {{driverVersion: "570.133.20", cudaDriverVersion: 12080}}
gpus:
  - {{index: 0, minor: 0, uuid: GPU-a, name: NVIDIA GB200, brand: Nvidia, architecture: Blackwell,
     cudaComputeCapabilityMajor: 10, cudaComputeCapabilityMinor: 0, memoryTotalBytes: 198674743296,
     multiprocessorCount: 152, pciBusId: "00000008:01:00.0", numaNode: 0, fabric: {fabric}}}
  - {{index: 1, minor: 1, uuid: GPU-b, name: NVIDIA GB200, brand: Nvidia, architecture: Blackwell,
     cudaComputeCapabilityMajor: 10, cudaComputeCapabilityMinor: 0, memoryTotalBytes: 198674743296,
     multiprocessorCount: 152, pciBusId: "00000009:01:00.0", numaNode: 0,
     fabric: {{state: completed, clusterUuid: 5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94, cliqueId: 1}}}}
"#
            ),
            "tray",
        )
        .expect("valid");
        gpu_inventory::discover(&gpu_inventory::FakeBackend::new(topology)).expect("discover")
    }

    fn taints_of(pool: &Pool) -> BTreeMap<String, Vec<(String, i64)>> {
        pool.devices
            .iter()
            .map(|d| {
                (
                    d.name.clone(),
                    d.taints
                        .iter()
                        .flatten()
                        .map(|t| {
                            (
                                format!(
                                    "{}={}:{}",
                                    t.key,
                                    t.value.clone().unwrap_or_default(),
                                    t.effect
                                ),
                                t.time_added.as_ref().map_or(0, |t| t.0.as_second()),
                            )
                        })
                        .collect(),
                )
            })
            .collect()
    }

    #[test]
    fn a_condition_keeps_its_time_until_it_clears_and_others_taints_are_kept() {
        let taints = FabricTaints::default();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let t1 = t0 + Duration::from_secs(30);
        let unhealthy = "{state: completed, clusterUuid: 5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94, \
                         cliqueId: 1, healthMask: 0x119a, healthSummary: unhealthy}";
        let inventory = tray(unhealthy);
        let mut pool = inventory.pool(gpu_inventory::MigStrategy::Existing);
        pool.devices[0].taints = Some(vec![DeviceTaint {
            key: "example.com/maintenance".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }]);
        let untainted = pool.clone();
        taints.apply("gpu.drust.dev", &inventory, &mut pool, t0);
        let want_a = vec![
            ("example.com/maintenance=:NoSchedule".to_owned(), 0),
            (
                "gpu.drust.dev/fabric=route-unhealthy:NoSchedule".to_owned(),
                1_700_000_000,
            ),
            (
                "gpu.drust.dev/fabric=unhealthy:NoSchedule".to_owned(),
                1_700_000_000,
            ),
        ];
        let got = taints_of(&pool);
        assert_eq!(got["gpu-0008-01-00-0"], want_a);
        assert_eq!(got["gpu-0009-01-00-0"], vec![]);
        // The clique stays published beside the taint.
        assert!(
            pool.devices[0]
                .attributes
                .as_ref()
                .is_some_and(|a| a.contains_key("nvlinkClique"))
        );
        // Applied again later (a rediscovery, or the same pool once more): the same times.
        taints.apply("gpu.drust.dev", &inventory, &mut pool, t1);
        assert_eq!(taints_of(&pool)["gpu-0008-01-00-0"], want_a);
        // Healthy again: the fabric taints go, the other one stays; a new condition later is
        // stamped anew.
        let mut healed = untainted.clone();
        taints.apply("gpu.drust.dev", &tray("{state: completed, clusterUuid: 5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94, cliqueId: 1}"), &mut healed, t1);
        assert_eq!(
            taints_of(&healed)["gpu-0008-01-00-0"],
            vec![("example.com/maintenance=:NoSchedule".to_owned(), 0)]
        );
        let mut again = untainted;
        taints.apply("gpu.drust.dev", &inventory, &mut again, t1);
        assert_eq!(taints_of(&again)["gpu-0008-01-00-0"][1].1, 1_700_000_030);
    }

    #[test]
    fn only_gpus_with_a_fabric_are_polled_faster_while_registration_is_pending() {
        let config = FabricWatch {
            pending: Duration::from_secs(5),
            settled: Duration::from_secs(15),
        };
        let done =
            "{state: completed, clusterUuid: 5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94, cliqueId: 1}";
        assert_eq!(
            Watched::of(&tray(done)).period(&config),
            Some(config.settled)
        );
        assert_eq!(
            Watched::of(&tray("{state: inProgress}")).period(&config),
            Some(config.pending)
        );
        let mut failing = Watched::of(&tray(done));
        failing.gpus[0].2 = FabricAnswer {
            info: None,
            error: Some("failed".into()),
        };
        assert_eq!(failing.period(&config), Some(config.pending));
        let mut none = Watched::of(&tray("{state: notSupported}"));
        none.gpus[1].2 = FabricAnswer::default();
        assert_eq!(none.period(&config), None);
    }
}
