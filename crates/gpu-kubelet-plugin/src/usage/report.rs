//! The usage report: each device's sample joined with the claims that hold it and the pods
//! whose processes run on it, and each claim's idleness ([`IdleTracker`]). Pure: the sampler
//! ([`super::sampler`]) gathers the inputs.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dra_kubelet::pod_resources::PodDevices;
use gpu_inventory::GpuUsage;
use serde::{Deserialize, Serialize};

use super::IdleThresholds;
use super::cgroup::ContainerRef;
use crate::checkpoint::ClaimRecord;
use crate::hardware::NodeDevice;

/// One GPU's sample: NVML's answer and, by PID, the pod and container of each of its processes
/// that runs in one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuSample {
    /// What NVML said.
    pub usage: GpuUsage,
    /// Pod and container by PID.
    pub containers: BTreeMap<u32, ContainerRef>,
    /// The claim UIDs whose share mark each process's container has, by PID (only processes
    /// with one; [`super::share_mounts`]).
    pub share_claims: BTreeMap<u32, Vec<String>>,
}

impl Report {
    /// The report as one namespace's user sees it (`/usage?namespace=`, `dractl top -n`): the
    /// claims of `namespace`, the devices they hold, and on those only the processes and
    /// containers of `namespace`; nothing of any other namespace's pods, claims or processes.
    #[must_use]
    pub fn only_namespace(&self, namespace: &str) -> Report {
        let claims: Vec<ClaimReport> = self
            .claims
            .iter()
            .filter(|c| c.namespace == namespace)
            .cloned()
            .collect();
        let uids: BTreeSet<&str> = claims.iter().map(|c| c.uid.as_str()).collect();
        let devices = self
            .devices
            .iter()
            .filter(|d| d.claims.iter().any(|c| uids.contains(c.as_str())))
            .map(|d| {
                let mut d = d.clone();
                d.claims.retain(|c| uids.contains(c.as_str()));
                d.containers.retain(|c| c.namespace == namespace);
                d.processes
                    .retain(|p| p.namespace.as_deref() == Some(namespace));
                d
            })
            .collect();
        Report {
            claims,
            devices,
            ..self.clone()
        }
    }
}

/// A pod that uses a claim: from `status.reservedFor` of the claim, or, for a claim reserved
/// for something else (a PodGroup's claim, KEP-5729, reserved for the PodGroup), from the
/// kubelet's PodResources API, which names the pods on this node whose containers hold it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    /// Its name.
    pub name: String,
    /// Its `metadata.uid`; empty where only the PodResources API names the pod (it gives no
    /// UIDs).
    #[serde(default)]
    pub uid: String,
}

/// A container the kubelet says holds a device (its PodResources API).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerUse {
    /// Its pod's namespace.
    pub namespace: String,
    /// Its pod's name.
    pub pod: String,
    /// Its name in the pod spec.
    pub container: String,
}

/// Which containers hold each device of each claim, from the kubelet's PodResources `List`
/// ([`dra_kubelet::pod_resources`]): the only source of container *names* (a process's cgroup
/// gives its container's runtime ID).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Containers {
    /// By (claim namespace, claim name, pool, device).
    by_device: BTreeMap<(String, String, String, String), BTreeSet<ContainerUse>>,
}

impl Containers {
    /// No container known.
    pub fn none() -> &'static Containers {
        static NONE: Containers = Containers {
            by_device: BTreeMap::new(),
        };
        &NONE
    }

    /// The devices of `driver` in the kubelet's answer `pods`.
    pub fn from_kubelet(pods: &[PodDevices], driver: &str) -> Self {
        let mut by_device: BTreeMap<_, BTreeSet<ContainerUse>> = BTreeMap::new();
        for pod in pods {
            for c in &pod.containers {
                for d in c.devices.iter().filter(|d| d.driver == driver) {
                    by_device
                        .entry((
                            d.claim_namespace.clone(),
                            d.claim_name.clone(),
                            d.pool.clone(),
                            d.device.clone(),
                        ))
                        .or_default()
                        .insert(ContainerUse {
                            namespace: pod.namespace.clone(),
                            pod: pod.name.clone(),
                            container: c.name.clone(),
                        });
                }
            }
        }
        Self { by_device }
    }

    /// The containers holding `device` of `pool` through the claim `record`.
    fn of(&self, record: &ClaimRecord, pool: &str, device: &str) -> Vec<&ContainerUse> {
        // One lookup per process and device: the key is built, not borrowed.
        let key = (
            record.namespace.clone(),
            record.name.clone(),
            pool.to_owned(),
            device.to_owned(),
        );
        self.by_device
            .get(&key)
            .map(|s| s.iter().collect())
            .unwrap_or_default()
    }
}

/// Everything the sampler saw at one moment. Served as JSON at `/usage` (camelCase; a field a
/// reader does not find, from an older plugin, reads as its default).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Report {
    /// The node.
    pub node: String,
    /// When it was sampled, seconds since the Unix epoch.
    pub sampled_at_unix: u64,
    /// How idleness is judged: SM percent, memory-activity percent, window seconds.
    pub idle_sm_percent: u32,
    /// See `idle_sm_percent`.
    pub idle_memory_percent: u32,
    /// See `idle_sm_percent`.
    pub idle_window_seconds: u64,
    /// Every published device, and every device a prepared claim holds.
    pub devices: Vec<DeviceReport>,
    /// Every prepared claim.
    pub claims: Vec<ClaimReport>,
    /// GPUs whose sample failed, with the error; their devices are left out.
    pub errors: Vec<String>,
    /// Why the kubelet's PodResources API could not be read this time (container names are
    /// then left out); `None` when it was, or when it is not configured.
    pub pod_resources_error: Option<String>,
}

/// One device in a sample.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DeviceReport {
    /// Its DRA device name.
    pub device: String,
    /// Its own UUID (a MIG device's `MIG-…`).
    pub uuid: String,
    /// Its GPU's NVML index.
    pub gpu_index: u32,
    /// Its GPU's UUID.
    pub gpu_uuid: String,
    /// Its GPU's minor number (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// Its GPU's product name.
    pub model: String,
    /// Its GPU's PCI bus ID.
    pub pci_bus_id: String,
    /// A MIG device's profile, e.g. `1g.10gb`.
    pub mig_profile: Option<String>,
    /// A MIG device's GPU instance.
    pub gpu_instance_id: Option<u32>,
    /// SM utilization, percent; for a MIG device, GPM's SM utilization of its instance (Hopper
    /// and later, from the second sample); `None` where NVML has none.
    pub sm_percent: Option<u32>,
    /// Memory activity, percent; `None` as for `sm_percent`.
    pub memory_percent: Option<u32>,
    /// Device memory in use, bytes (for a MIG device: its processes' memory).
    pub memory_used_bytes: u64,
    /// Its memory, bytes, where known.
    pub memory_total_bytes: Option<u64>,
    /// Busy in this sample (see the module docs of [`super`]).
    pub busy: bool,
    /// UIDs of the prepared claims holding it.
    pub claims: Vec<String>,
    /// The containers the kubelet says hold it through those claims.
    pub containers: Vec<ContainerUse>,
    /// Its processes.
    pub processes: Vec<ProcessReport>,
}

/// One process on a device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessReport {
    /// Host PID.
    pub pid: u32,
    /// Device memory, bytes, where NVML tells.
    pub used_memory_bytes: Option<u64>,
    /// SM utilization, percent, where NVML gives per-process figures.
    pub sm_percent: Option<u32>,
    /// Its pod's UID, when it runs in a pod.
    pub pod_uid: Option<String>,
    /// Its pod's name, when a claim on the device lists the pod.
    pub pod: Option<String>,
    /// Its pod's namespace, as `pod`.
    pub namespace: Option<String>,
    /// Its container's runtime ID.
    pub container_id: Option<String>,
    /// Its container's name: the one container of its pod the kubelet says holds the device
    /// through its claim (none when several do, or the kubelet was not asked).
    pub container: Option<String>,
    /// The UID of the claim it is attributed to.
    pub claim: Option<String>,
}

/// One prepared claim in a sample.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClaimReport {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
    /// Its devices (DRA device names).
    pub devices: Vec<String>,
    /// The pods that use it, where known.
    pub pods: Vec<PodRef>,
    /// Busy in this sample.
    pub busy: bool,
    /// SM utilization, percent: its whole devices' (the highest), or a share's processes' (their
    /// sum) where NVML gives per-process figures that account for all of its GPU's work.
    pub sm_percent: Option<u32>,
    /// Seconds since it was last busy (or since it was first seen).
    pub idle_seconds: u64,
    /// `idle_seconds` reached the window. Never for a claim of admin-access devices only.
    pub idle: bool,
    /// Device memory its processes use, bytes (a whole device: all of the device's).
    pub memory_used_bytes: u64,
    /// For a share: the memory it was allocated (`consumedCapacity.memory`), bytes.
    pub share_memory_bytes: Option<u64>,
}

/// How long each claim has gone without a busy sample. Times are monotonic.
#[derive(Debug, Default)]
pub struct IdleTracker {
    /// By claim UID: its last busy sample, or when it was first seen.
    since: BTreeMap<String, Instant>,
}

impl IdleTracker {
    /// Records claim `uid` as `busy` or not at `now`; returns how long it has been idle.
    pub fn observe(&mut self, uid: &str, busy: bool, now: Instant) -> Duration {
        let since = self.since.entry(uid.to_owned()).or_insert(now);
        if busy {
            *since = now;
        }
        now.saturating_duration_since(*since)
    }

    /// Forgets the claims not in `uids` (unprepared).
    pub fn retain(&mut self, uids: &BTreeSet<&str>) {
        self.since.retain(|uid, _| uids.contains(uid.as_str()));
    }
}

/// The inputs of one report.
pub struct Inputs<'a> {
    /// This node.
    pub node: &'a str,
    /// Every device by name, published or retired.
    pub devices: &'a BTreeMap<String, NodeDevice>,
    /// The prepared claims by UID.
    pub claims: &'a [(String, ClaimRecord)],
    /// Samples by GPU index (an error: why the GPU could not be sampled).
    pub samples: &'a BTreeMap<u32, Result<GpuSample, String>>,
    /// The pods of each claim, by claim UID, where known.
    pub pods: &'a BTreeMap<String, Vec<PodRef>>,
    /// The containers holding each device, as the kubelet says.
    pub containers: &'a Containers,
    /// When a device is busy and a claim idle.
    pub thresholds: IdleThresholds,
}

/// Builds the report of `inputs` at `now` (`unix`: the same moment in seconds since the epoch),
/// updating `tracker`.
pub fn build(inputs: &Inputs<'_>, tracker: &mut IdleTracker, now: Instant, unix: u64) -> Report {
    let t = inputs.thresholds;
    let mut report = Report {
        node: inputs.node.to_owned(),
        sampled_at_unix: unix,
        idle_sm_percent: t.sm_percent,
        idle_memory_percent: t.memory_percent,
        idle_window_seconds: t.window.as_secs(),
        ..Report::default()
    };
    for (index, sample) in inputs.samples {
        if let Err(e) = sample {
            report.errors.push(format!("GPU {index}: {e}"));
        }
    }
    // Which claims hold each device (admin access apart: it does not count as use).
    let mut holders: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (uid, r) in inputs.claims {
        for d in r.devices.iter().filter(|d| !d.admin_access) {
            holders.entry(&d.device_name).or_default().push(uid);
        }
    }
    // Pod UID -> every (claim UID, pod name, namespace) the pod uses.
    let mut pod_claims: BTreeMap<&str, Vec<(&str, &str, &str)>> = BTreeMap::new();
    for (uid, r) in inputs.claims {
        for p in inputs.pods.get(uid).into_iter().flatten() {
            pod_claims
                .entry(&p.uid)
                .or_default()
                .push((uid, &p.name, &r.namespace));
        }
    }

    for (name, device) in inputs.devices {
        // Unsampled GPUs and placements no claim created are left out.
        let Some(mut d) = device_report(name, device, inputs) else {
            continue;
        };
        d.claims = holders
            .get(name.as_str())
            .map(|c| c.iter().map(|s| (*s).to_owned()).collect())
            .unwrap_or_default();
        // The record of each holder and the pool it holds this device in.
        let held: Vec<(&str, &ClaimRecord, &str)> = inputs
            .claims
            .iter()
            .filter(|(uid, _)| d.claims.contains(uid))
            .flat_map(|(uid, r)| {
                r.devices
                    .iter()
                    .filter(|rd| rd.device_name == *name)
                    .map(move |rd| (uid.as_str(), r, rd.pool_name.as_str()))
            })
            .collect();
        let mut containers: Vec<ContainerUse> = held
            .iter()
            .flat_map(|(_, r, pool)| inputs.containers.of(r, pool, name))
            .cloned()
            .collect();
        containers.sort();
        containers.dedup();
        d.containers = containers;
        for p in &mut d.processes {
            let Some(pod) = p.pod_uid.as_deref() else {
                continue;
            };
            let known = pod_claims.get(pod).map(Vec::as_slice).unwrap_or_default();
            // The pod's claims that hold this device; where it has several (two shares of one
            // GPU), the one whose share mark the process's container has.
            let holding: Vec<&(&str, &str, &str)> = known
                .iter()
                .filter(|(c, _, _)| d.claims.iter().any(|h| h == c))
                .collect();
            let marked = inputs
                .samples
                .get(&device.gpu().raw.index)
                .and_then(|s| s.as_ref().ok())
                .and_then(|s| s.share_claims.get(&p.pid));
            let chosen = match (holding.as_slice(), marked) {
                ([only], _) => Some(*only),
                (several, Some(marks)) => several
                    .iter()
                    .copied()
                    .find(|(c, _, _)| marks.iter().any(|m| m == c))
                    .or_else(|| several.first().copied()),
                (several, None) => several.first().copied(),
            };
            // A pod no claim's reservedFor names, on a device of one claim reserved for no pod
            // (a PodGroup's claim): the pod the kubelet says holds it, when there is one.
            let chosen_by_kubelet;
            let chosen = match chosen {
                None if d.claims.len() == 1
                    && inputs.pods.get(&d.claims[0]).is_none_or(|p| p.is_empty()) =>
                {
                    let pods: BTreeSet<(&str, &str)> = d
                        .containers
                        .iter()
                        .map(|c| (c.pod.as_str(), c.namespace.as_str()))
                        .collect();
                    match pods.into_iter().collect::<Vec<_>>().as_slice() {
                        [(pod_name, ns)] => {
                            chosen_by_kubelet = (d.claims[0].as_str(), *pod_name, *ns);
                            Some(&chosen_by_kubelet)
                        }
                        _ => None,
                    }
                }
                other => other,
            };
            if let Some((claim, pod_name, ns)) = chosen {
                p.claim = Some((*claim).to_owned());
                p.pod = Some((*pod_name).to_owned());
                p.namespace = Some((*ns).to_owned());
                let mut named = held
                    .iter()
                    .filter(|(uid, _, _)| uid == claim)
                    .flat_map(|(_, r, pool)| inputs.containers.of(r, pool, name))
                    .filter(|c| c.pod == *pod_name && c.namespace == *ns);
                if let (Some(only), None) = (named.next(), named.next()) {
                    p.container = Some(only.container.clone());
                }
            } else if d.claims.len() == 1 {
                // One holder: whatever pod runs on it uses that claim.
                p.claim = Some(d.claims[0].clone());
            }
        }
        d.busy = match (d.sm_percent, d.memory_percent) {
            (None, None) => !d.processes.is_empty(),
            (sm, mem) => {
                sm.is_some_and(|s| s >= t.sm_percent) || mem.is_some_and(|m| m >= t.memory_percent)
            }
        };
        report.devices.push(d);
    }

    let mut seen = BTreeSet::new();
    for (uid, r) in inputs.claims {
        seen.insert(uid.as_str());
        let mut c = ClaimReport {
            namespace: r.namespace.clone(),
            name: r.name.clone(),
            uid: uid.clone(),
            devices: r.devices.iter().map(|d| d.device_name.clone()).collect(),
            pods: inputs.pods.get(uid).cloned().unwrap_or_default(),
            ..ClaimReport::default()
        };
        if c.pods.is_empty() {
            // Reserved for no pod (a PodGroup's claim): the pods the kubelet names.
            let named: BTreeSet<&str> = r
                .devices
                .iter()
                .flat_map(|rd| inputs.containers.of(r, &rd.pool_name, &rd.device_name))
                .map(|c| c.pod.as_str())
                .collect();
            c.pods = named
                .into_iter()
                .map(|name| PodRef {
                    name: name.to_owned(),
                    uid: String::new(),
                })
                .collect();
        }
        let mut counted = false;
        for rd in r.devices.iter().filter(|d| !d.admin_access) {
            let Some(d) = report.devices.iter().find(|d| d.device == rd.device_name) else {
                continue;
            };
            counted = true;
            let mine = d
                .processes
                .iter()
                .filter(|p| p.claim.as_deref() == Some(uid));
            if let Some(share) = rd.share.as_ref().filter(|s| !s.whole) {
                c.share_memory_bytes = Some(share.memory_bytes);
                c.memory_used_bytes += mine
                    .clone()
                    .filter_map(|p| p.used_memory_bytes)
                    .sum::<u64>();
                match share_sm_percent(d, uid) {
                    Some(sm) => {
                        c.sm_percent = c.sm_percent.max(Some(sm));
                        c.busy |= sm >= t.sm_percent;
                    }
                    None => {
                        // In doubt (processes no claim is known for, or none listed), busy.
                        let unknown =
                            d.processes.is_empty() || d.processes.iter().any(|p| p.claim.is_none());
                        c.busy |= d.busy && (mine.count() > 0 || unknown);
                    }
                }
            } else {
                c.memory_used_bytes += d.memory_used_bytes;
                c.sm_percent = c.sm_percent.max(d.sm_percent);
                c.busy |= d.busy;
            }
        }
        // Devices not sampled (a failing GPU): in doubt, busy. An IMEX channel is never
        // sampled (no GPU behind it): its claim is judged by its GPUs alone.
        if r.devices.iter().any(|rd| {
            !rd.admin_access
                && rd.imex_channel.is_none()
                && !report.devices.iter().any(|d| d.device == rd.device_name)
        }) {
            c.busy = true;
        }
        let idle_for = tracker.observe(uid, c.busy, now);
        c.idle_seconds = idle_for.as_secs();
        c.idle = counted && !c.busy && idle_for >= t.window;
        report.claims.push(c);
    }
    tracker.retain(&seen);
    report
}

/// The SM utilization of claim `uid`'s share of `d`: the sum of its processes' figures, where
/// NVML gave every process on `d` one and no process outside a claim computed (under MPS, NVML
/// may count the clients' work to the server's process: then the share's own figure is not
/// known). `None`: not known.
fn share_sm_percent(d: &DeviceReport, uid: &str) -> Option<u32> {
    if d.processes.is_empty()
        || d.processes.iter().any(|p| {
            p.sm_percent.is_none() || (p.claim.is_none() && p.sm_percent.is_some_and(|s| s > 0))
        })
    {
        return None;
    }
    let sum: u32 = d
        .processes
        .iter()
        .filter(|p| p.claim.as_deref() == Some(uid))
        .filter_map(|p| p.sm_percent)
        .sum();
    Some(sum.min(100))
}

/// The report of `device` from its GPU's sample, without claims; `None` when its GPU was not
/// sampled or it is a placement no claim created.
fn device_report(name: &str, device: &NodeDevice, inputs: &Inputs<'_>) -> Option<DeviceReport> {
    let gpu = device.gpu();
    let Some(Ok(sample)) = inputs.samples.get(&gpu.raw.index) else {
        return None;
    };
    let mut d = DeviceReport {
        device: name.to_owned(),
        uuid: gpu.raw.uuid.clone(),
        gpu_index: gpu.raw.index,
        gpu_uuid: gpu.raw.uuid.clone(),
        minor: gpu.raw.minor,
        model: gpu.raw.name.clone(),
        pci_bus_id: gpu.pci_bus_id.clone().unwrap_or_default(),
        ..DeviceReport::default()
    };
    let gpu_instance = match device {
        NodeDevice::Gpu(_) => None,
        NodeDevice::Mig { mig, .. } => {
            d.uuid = mig.uuid.clone().unwrap_or_default();
            d.mig_profile = Some(mig.profile.clone());
            d.memory_total_bytes = Some(mig.memory_bytes);
            Some(mig.instance_ids?.0)
        }
        NodeDevice::MigPlacement { profile, .. } => {
            // Exists only as a claim created it: its record says which instance.
            let created = inputs
                .claims
                .iter()
                .flat_map(|(_, r)| &r.devices)
                .find(|rd| rd.device_name == name)
                .and_then(|rd| rd.mig.as_ref())?;
            d.uuid.clone_from(&created.uuid);
            d.mig_profile = Some(profile.clone());
            Some(created.gpu_instance_id)
        }
    };
    d.gpu_instance_id = gpu_instance;
    let processes = sample
        .usage
        .processes
        .iter()
        .filter(|p| gpu_instance.is_none() || p.gpu_instance_id == gpu_instance);
    d.processes = processes
        .map(|p| {
            let container = sample.containers.get(&p.pid);
            ProcessReport {
                pid: p.pid,
                used_memory_bytes: p.used_memory_bytes,
                sm_percent: p.sm_percent,
                pod_uid: container.map(|c| c.pod_uid.clone()),
                container_id: container
                    .map(|c| c.container_id.clone())
                    .filter(|id| !id.is_empty()),
                ..ProcessReport::default()
            }
        })
        .collect();
    if let Some(gi) = gpu_instance {
        d.memory_used_bytes = d.processes.iter().filter_map(|p| p.used_memory_bytes).sum();
        // GPM's figures of the instance, where the GPU has GPM (Hopper and later).
        if let Some(m) = sample.usage.mig.iter().find(|m| m.gpu_instance_id == gi) {
            d.sm_percent = m.sm_percent;
            d.memory_percent = m.memory_percent;
        }
    } else {
        d.sm_percent = sample.usage.sm_percent;
        d.memory_percent = sample.usage.memory_percent;
        d.memory_used_bytes = sample.usage.memory_used_bytes;
        d.memory_total_bytes = Some(gpu.raw.memory_total_bytes);
    }
    Some(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{ClaimState, RecordedDevice, RecordedShare};
    use gpu_inventory::{FakeBackend, MigStrategy, ProcessUsage};

    const MIN: Duration = Duration::from_secs(60);

    fn devices() -> BTreeMap<String, NodeDevice> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/topologies/dgx-a100-mig.yaml"
        );
        let inventory = gpu_inventory::discover(&FakeBackend::from_file(path).unwrap()).unwrap();
        crate::hardware::node_devices(&inventory, MigStrategy::Existing)
    }

    /// The name of the whole GPU at `index`.
    fn gpu(devices: &BTreeMap<String, NodeDevice>, index: u32) -> String {
        devices
            .iter()
            .find(|(_, d)| !d.is_mig() && d.gpu().raw.index == index)
            .map(|(n, _)| n.clone())
            .unwrap()
    }

    fn record(name: &str, devices: Vec<RecordedDevice>) -> ClaimRecord {
        ClaimRecord {
            namespace: "team".into(),
            name: name.into(),
            state: ClaimState::PrepareCompleted,
            devices,
            cdi_spec_path: Default::default(),
            cdi_spec: Default::default(),
        }
    }

    fn held(device: &str, share: Option<(u64, u32)>) -> RecordedDevice {
        RecordedDevice {
            request_names: vec!["gpu".into()],
            pool_name: "node".into(),
            device_name: device.into(),
            cdi_device_ids: Vec::new(),
            uuid: String::new(),
            admin_access: false,
            sharing: None,
            mig: None,
            share: share.map(|(mib, pct)| RecordedShare {
                id: format!("s{mib}"),
                memory_bytes: mib << 20,
                compute_percent: pct,
                whole: false,
            }),
            imex_channel: None,
        }
    }

    fn pod_uid(n: u8) -> String {
        format!("00000000-0000-4000-8000-0000000000{n:02}")
    }

    /// A sample with `sm` percent and processes `(pid, MiB, pod number, GPU instance)`.
    fn sample(
        sm: Option<u32>,
        processes: &[(u32, u64, u8, Option<u32>)],
    ) -> Result<GpuSample, String> {
        Ok(GpuSample {
            usage: GpuUsage {
                sm_percent: sm,
                memory_percent: sm.map(|_| 0),
                memory_used_bytes: processes.iter().map(|p| p.1 << 20).sum(),
                processes: processes
                    .iter()
                    .map(|&(pid, mib, _, gi)| ProcessUsage {
                        pid,
                        used_memory_bytes: Some(mib << 20),
                        gpu_instance_id: gi,
                        compute_instance_id: gi.map(|_| 0),
                        sm_percent: None,
                    })
                    .collect(),
                mig: Vec::new(),
            },
            containers: processes
                .iter()
                .map(|&(pid, _, pod, _)| {
                    (
                        pid,
                        ContainerRef {
                            pod_uid: pod_uid(pod),
                            container_id: format!("c{pod}"),
                        },
                    )
                })
                .collect(),
            share_claims: BTreeMap::new(),
        })
    }

    fn pods(entries: &[(&str, u8)]) -> BTreeMap<String, Vec<PodRef>> {
        let mut m: BTreeMap<String, Vec<PodRef>> = BTreeMap::new();
        for (claim, pod) in entries {
            m.entry((*claim).to_owned()).or_default().push(PodRef {
                name: format!("pod-{pod}"),
                uid: pod_uid(*pod),
            });
        }
        m
    }

    /// The inputs of a report on node `n` with the default thresholds and no container names.
    fn inputs<'a>(
        devices: &'a BTreeMap<String, NodeDevice>,
        claims: &'a [(String, ClaimRecord)],
        samples: &'a BTreeMap<u32, Result<GpuSample, String>>,
        pods: &'a BTreeMap<String, Vec<PodRef>>,
    ) -> Inputs<'a> {
        Inputs {
            node: "n",
            devices,
            claims,
            samples,
            pods,
            containers: Containers::none(),
            thresholds: IdleThresholds::default(),
        }
    }

    fn claim<'r>(r: &'r Report, uid: &str) -> &'r ClaimReport {
        r.claims.iter().find(|c| c.uid == uid).unwrap()
    }

    /// Issue 41, defect 9: one namespace's view names nothing of another's: not its claims,
    /// nor its processes on a GPU both use.
    #[test]
    fn a_namespaces_view_holds_only_its_own() {
        let devices = devices();
        let g4 = gpu(&devices, 4);
        let mut other = record("theirs", vec![held(&g4, Some((10_240, 0)))]);
        other.namespace = "other".into();
        let claims = vec![
            (
                "mine".to_owned(),
                record("mine", vec![held(&g4, Some((10_240, 0)))]),
            ),
            ("theirs".to_owned(), other),
        ];
        let samples = BTreeMap::from([(
            4,
            sample(Some(50), &[(100, 1_024, 1, None), (200, 2_048, 2, None)]),
        )]);
        let pods = pods(&[("mine", 1), ("theirs", 2)]);
        let inputs = inputs(&devices, &claims, &samples, &pods);
        let full = build(&inputs, &mut IdleTracker::default(), Instant::now(), 1);
        assert_eq!(full.claims.len(), 2);
        let view = full.only_namespace("team");
        assert_eq!(
            view.claims
                .iter()
                .map(|c| c.uid.as_str())
                .collect::<Vec<_>>(),
            ["mine"]
        );
        let d = view.devices.iter().find(|d| d.device == g4).unwrap();
        assert_eq!(d.claims, ["mine"]);
        assert_eq!(d.processes.iter().map(|p| p.pid).collect::<Vec<_>>(), [100]);
        let text = serde_json::to_string(&view).unwrap();
        assert!(
            !text.contains("theirs") && !text.contains("\"other\""),
            "{text}"
        );
    }

    /// Issue 41, defect 7: one pod uses two share claims of one GPU, one in each of its
    /// containers. Each process is credited to the claim whose share mark its container has:
    /// the busy second share is not idle, and each shows its own memory.
    #[test]
    fn two_shares_of_one_gpu_in_one_pod_each_get_their_own_processes() {
        let devices = devices();
        let g4 = gpu(&devices, 4);
        let claims = vec![
            (
                "first".to_owned(),
                record("a", vec![held(&g4, Some((10_240, 0)))]),
            ),
            (
                "second".to_owned(),
                record("b", vec![held(&g4, Some((10_240, 0)))]),
            ),
        ];
        let mut gpu_sample =
            sample(Some(90), &[(100, 1_024, 1, None), (200, 6_144, 1, None)]).expect("a sample");
        gpu_sample.share_claims = BTreeMap::from([
            (100, vec!["first".to_owned()]),
            (200, vec!["second".to_owned()]),
        ]);
        let samples = BTreeMap::from([(4, Ok(gpu_sample))]);
        let pods = pods(&[("first", 1), ("second", 1)]);
        let inputs = inputs(&devices, &claims, &samples, &pods);
        let r = build(&inputs, &mut IdleTracker::default(), Instant::now(), 1);
        let d = r.devices.iter().find(|d| d.device == g4).unwrap();
        let by_pid: BTreeMap<u32, Option<&str>> = d
            .processes
            .iter()
            .map(|p| (p.pid, p.claim.as_deref()))
            .collect();
        assert_eq!(
            by_pid,
            BTreeMap::from([(100, Some("first")), (200, Some("second"))])
        );
        assert_eq!(claim(&r, "first").memory_used_bytes, 1_024 << 20);
        assert_eq!(claim(&r, "second").memory_used_bytes, 6_144 << 20);
    }

    #[test]
    fn an_imex_channel_beside_an_idle_gpu_leaves_its_claim_idle() {
        let devices = devices();
        let g5 = gpu(&devices, 5);
        let mut channel = held("imex-channel-0", None);
        channel.imex_channel = Some(crate::checkpoint::RecordedChannel {
            channel: 0,
            major: 235,
            domain_id: "d".into(),
            share_id: Some("s".into()),
        });
        let claims = vec![(
            "idle".to_owned(),
            record("notebook", vec![held(&g5, None), channel]),
        )];
        let samples = BTreeMap::from([(5, sample(Some(0), &[(200, 20_480, 2, None)]))]);
        let pods = pods(&[("idle", 2)]);
        let inputs = inputs(&devices, &claims, &samples, &pods);
        let mut tracker = IdleTracker::default();
        let t0 = Instant::now();
        build(&inputs, &mut tracker, t0, 1);
        let later = build(&inputs, &mut tracker, t0 + 31 * MIN, 2);
        let c = claim(&later, "idle");
        assert!(!c.busy && c.idle, "{c:?}");
    }

    #[test]
    fn a_busy_claim_is_never_idle_and_an_idle_one_is_after_the_window() {
        let devices = devices();
        let (g4, g5) = (gpu(&devices, 4), gpu(&devices, 5));
        let claims = vec![
            ("busy".to_owned(), record("train", vec![held(&g4, None)])),
            ("idle".to_owned(), record("notebook", vec![held(&g5, None)])),
        ];
        let samples = BTreeMap::from([
            (4, sample(Some(80), &[(100, 30_000, 1, None)])),
            // Holds 20 GiB, computes nothing.
            (5, sample(Some(0), &[(200, 20_480, 2, None)])),
        ]);
        let pods = pods(&[("busy", 1), ("idle", 2)]);
        let inputs = inputs(&devices, &claims, &samples, &pods);
        let mut tracker = IdleTracker::default();
        let t0 = Instant::now();
        let first = build(&inputs, &mut tracker, t0, 1);
        assert!(!claim(&first, "idle").idle, "not before the window");
        let later = build(&inputs, &mut tracker, t0 + 31 * MIN, 2);
        let (busy, idle) = (claim(&later, "busy"), claim(&later, "idle"));
        assert!(busy.busy && !busy.idle && busy.idle_seconds == 0);
        assert!(!idle.busy && idle.idle && idle.idle_seconds == 31 * 60);
        assert_eq!(idle.memory_used_bytes, 20_480 << 20);
        // The process is attributed to its pod and claim.
        let d = later.devices.iter().find(|d| d.device == g5).unwrap();
        assert_eq!(d.claims, ["idle"]);
        let p = &d.processes[0];
        assert_eq!(
            (
                p.pod.as_deref(),
                p.namespace.as_deref(),
                p.claim.as_deref(),
                p.container_id.as_deref()
            ),
            (Some("pod-2"), Some("team"), Some("idle"), Some("c2"))
        );
        // Unclaimed GPUs are reported too, without claims.
        assert!(
            later
                .devices
                .iter()
                .any(|d| d.gpu_index == 4 && d.claims.len() == 1)
        );
        // Busy again: the clock restarts.
        let samples = BTreeMap::from([
            (4, sample(Some(80), &[])),
            (5, sample(Some(60), &[(200, 20_480, 2, None)])),
        ]);
        let again = build(
            &Inputs {
                samples: &samples,
                ..inputs
            },
            &mut tracker,
            t0 + 32 * MIN,
            3,
        );
        assert!(!claim(&again, "idle").idle);
        assert_eq!(claim(&again, "idle").idle_seconds, 0);
    }

    #[test]
    fn a_pod_with_two_claims_has_its_processes_attributed_on_both() {
        let devices = devices();
        let (g4, g5) = (gpu(&devices, 4), gpu(&devices, 5));
        let claims = vec![
            ("a".to_owned(), record("first", vec![held(&g4, None)])),
            ("b".to_owned(), record("second", vec![held(&g5, None)])),
        ];
        let samples = BTreeMap::from([
            (4, sample(Some(50), &[(1, 100, 1, None)])),
            (5, sample(Some(0), &[(2, 100, 1, None)])),
        ]);
        let pods = pods(&[("a", 1), ("b", 1)]);
        let inputs = inputs(&devices, &claims, &samples, &pods);
        let r = build(&inputs, &mut IdleTracker::default(), Instant::now(), 0);
        for (device, claim) in [(&g4, "a"), (&g5, "b")] {
            let d = r.devices.iter().find(|d| &d.device == device).unwrap();
            assert_eq!(d.processes[0].claim.as_deref(), Some(claim));
            assert_eq!(d.processes[0].pod.as_deref(), Some("pod-1"));
        }
        assert!(claim(&r, "a").busy && !claim(&r, "b").busy);
    }

    #[test]
    fn shares_are_busy_by_their_own_pods_and_report_memory_against_their_limit() {
        let devices = devices();
        let g6 = gpu(&devices, 6);
        let claims = vec![
            (
                "s1".to_owned(),
                record("infer", vec![held(&g6, Some((10_240, 50)))]),
            ),
            (
                "s2".to_owned(),
                record("lab", vec![held(&g6, Some((20_480, 0)))]),
            ),
        ];
        // Only s1's pod computes; s2's pod holds memory.
        let samples = BTreeMap::from([(
            6,
            sample(Some(90), &[(1, 6_000, 1, None), (2, 1_000, 2, None)]),
        )]);
        let pods = pods(&[("s1", 1), ("s2", 2)]);
        let inputs = inputs(&devices, &claims, &samples, &pods);
        let mut tracker = IdleTracker::default();
        let t0 = Instant::now();
        build(&inputs, &mut tracker, t0, 0);
        let r = build(&inputs, &mut tracker, t0 + 30 * MIN, 0);
        // s2's pod has a process on the busy GPU: in doubt (NVML's per-GPU figure), busy.
        assert!(claim(&r, "s1").busy && claim(&r, "s2").busy);
        assert_eq!(claim(&r, "s1").memory_used_bytes, 6_000 << 20);
        assert_eq!(claim(&r, "s1").share_memory_bytes, Some(10_240 << 20));
        assert_eq!(claim(&r, "s2").memory_used_bytes, 1_000 << 20);

        // s2's pod gone from the GPU: s2 idle after the window, s1 still busy.
        let samples = BTreeMap::from([(6, sample(Some(90), &[(1, 6_000, 1, None)]))]);
        let inputs = Inputs {
            samples: &samples,
            ..inputs
        };
        let mut tracker = IdleTracker::default();
        build(&inputs, &mut tracker, t0, 0);
        let r = build(&inputs, &mut tracker, t0 + 30 * MIN, 0);
        assert!(claim(&r, "s1").busy);
        assert!(claim(&r, "s2").idle);

        // Pods not known (no reservedFor read yet) and a process on the busy GPU: in doubt, busy.
        let unknown = BTreeMap::new();
        let inputs = Inputs {
            pods: &unknown,
            ..inputs
        };
        let mut tracker = IdleTracker::default();
        build(&inputs, &mut tracker, t0, 0);
        let r = build(&inputs, &mut tracker, t0 + 30 * MIN, 0);
        assert!(claim(&r, "s2").busy && !claim(&r, "s2").idle);
    }

    /// `sample` with each process's per-process SM figure set from `sm` (by PID).
    fn with_process_sm(
        mut sample: Result<GpuSample, String>,
        sm: &[(u32, u32)],
    ) -> Result<GpuSample, String> {
        if let Ok(s) = &mut sample {
            for p in &mut s.usage.processes {
                p.sm_percent = sm.iter().find(|(pid, _)| *pid == p.pid).map(|(_, v)| *v);
            }
        }
        sample
    }

    #[test]
    fn shares_with_per_process_figures_are_busy_by_their_own_work() {
        let devices = devices();
        let g6 = gpu(&devices, 6);
        let claims = vec![
            (
                "s1".to_owned(),
                record("infer", vec![held(&g6, Some((10_240, 50)))]),
            ),
            (
                "s2".to_owned(),
                record("lab", vec![held(&g6, Some((20_480, 0)))]),
            ),
        ];
        let pods = pods(&[("s1", 1), ("s2", 2)]);
        let twice = |samples: &BTreeMap<u32, Result<GpuSample, String>>| {
            let inputs = inputs(&devices, &claims, samples, &pods);
            let mut tracker = IdleTracker::default();
            let t0 = Instant::now();
            build(&inputs, &mut tracker, t0, 0);
            build(&inputs, &mut tracker, t0 + 30 * MIN, 0)
        };
        // s2's pod holds memory on the busy GPU but computes nothing: idle, with its own 0 %.
        let both = sample(Some(90), &[(1, 6_000, 1, None), (2, 1_000, 2, None)]);
        let r = twice(&BTreeMap::from([(
            6,
            with_process_sm(both.clone(), &[(1, 88), (2, 0)]),
        )]));
        assert!(claim(&r, "s1").busy && claim(&r, "s1").sm_percent == Some(88));
        assert!(claim(&r, "s2").idle && claim(&r, "s2").sm_percent == Some(0));
        // A process outside any claim computes (MPS's server, in its own pod, where NVML counts
        // the clients' work to it): the shares' own figures are not known; in doubt, busy.
        let mut with_server = both.clone().unwrap();
        with_server.usage.processes.push(ProcessUsage {
            pid: 3,
            ..ProcessUsage::default()
        });
        with_server.containers.insert(
            3,
            ContainerRef {
                pod_uid: pod_uid(9),
                container_id: "mps".into(),
            },
        );
        let r = twice(&BTreeMap::from([(
            6,
            with_process_sm(Ok(with_server), &[(1, 0), (2, 0), (3, 90)]),
        )]));
        assert!(claim(&r, "s1").busy && claim(&r, "s2").busy);
        assert_eq!(claim(&r, "s2").sm_percent, None);
        // No per-process figures (MIG mode, NOT_SUPPORTED): as before, in doubt, busy.
        let r = twice(&BTreeMap::from([(6, both)]));
        assert!(claim(&r, "s2").busy && claim(&r, "s2").sm_percent.is_none());
    }

    #[test]
    fn a_mig_device_is_busy_while_a_process_runs_in_its_instance() {
        let devices = devices();
        let (name, gi) = devices
            .iter()
            .find_map(|(n, d)| match d {
                NodeDevice::Mig { parent, mig } if parent.raw.index == 1 => {
                    Some((n.clone(), mig.instance_ids?.0))
                }
                _ => None,
            })
            .unwrap();
        let claims = vec![("m".to_owned(), record("mig", vec![held(&name, None)]))];
        let pods = pods(&[("m", 3)]);
        // GPU 1 sampled with `processes` and, where given, GPM's SM figure of the instance.
        let with_gpm = |processes: &[(u32, u64, u8, Option<u32>)], sm: Option<u32>| {
            let mut s = sample(None, processes).unwrap();
            s.usage.mig = sm
                .map(|sm| gpu_inventory::MigUsage {
                    gpu_instance_id: gi,
                    sm_percent: Some(sm),
                    memory_percent: Some(0),
                })
                .into_iter()
                .collect();
            let samples = BTreeMap::from([(1, Ok(s))]);
            build(
                &inputs(&devices, &claims, &samples, &pods),
                &mut IdleTracker::default(),
                Instant::now(),
                0,
            )
        };
        let run = |processes: &[(u32, u64, u8, Option<u32>)]| with_gpm(processes, None);
        let r = run(&[(7, 512, 3, Some(gi)), (8, 256, 4, Some(gi + 100))]);
        let d = r.devices.iter().find(|d| d.device == name).unwrap();
        assert!(d.busy && d.sm_percent.is_none());
        assert_eq!(d.processes.len(), 1, "only its own instance's process");
        assert_eq!(d.memory_used_bytes, 512 << 20);
        assert!(claim(&r, "m").busy);
        let r = run(&[(8, 256, 4, Some(gi + 100))]);
        assert!(!claim(&r, "m").busy);

        // With GPM's figures of the instance (Hopper and later), those decide: a process that
        // holds memory and computes nothing leaves it idle; work with no process listed is busy.
        let r = with_gpm(&[(7, 512, 3, Some(gi))], Some(0));
        let d = r.devices.iter().find(|d| d.device == name).unwrap();
        assert_eq!((d.sm_percent, d.busy), (Some(0), false));
        assert!(!claim(&r, "m").busy);
        assert!(claim(&with_gpm(&[], Some(60)), "m").busy);
    }

    #[test]
    fn a_gpu_that_cannot_be_sampled_keeps_its_claims_busy() {
        let devices = devices();
        let g7 = gpu(&devices, 7);
        let claims = vec![("c".to_owned(), record("c", vec![held(&g7, None)]))];
        let samples = BTreeMap::from([(7, Err("NVML: GPU is lost".to_owned()))]);
        let pods = BTreeMap::new();
        let inputs = inputs(&devices, &claims, &samples, &pods);
        let mut tracker = IdleTracker::default();
        let t0 = Instant::now();
        build(&inputs, &mut tracker, t0, 0);
        let r = build(&inputs, &mut tracker, t0 + 60 * MIN, 0);
        assert_eq!(r.errors, ["GPU 7: NVML: GPU is lost"]);
        assert!(claim(&r, "c").busy && !claim(&r, "c").idle);
        assert!(!r.devices.iter().any(|d| d.gpu_index == 7));
    }

    /// A PodGroup's claim (KEP-5729) is reserved for the PodGroup: its reservedFor names no pod.
    /// Its pods are those the kubelet names; a process is credited to the one pod there is, and
    /// with two pods of the group on the node, to the claim alone (the kubelet gives names, the
    /// process's cgroup a UID).
    #[test]
    fn a_pod_groups_claim_has_the_pods_the_kubelet_names() {
        use dra_kubelet::pod_resources::{ClaimDevice, ContainerDevices, PodDevices};
        let devices = devices();
        let g4 = gpu(&devices, 4);
        let claims = vec![("g".to_owned(), record("group", vec![held(&g4, None)]))];
        let samples = BTreeMap::from([(4, sample(Some(50), &[(1, 100, 1, None)]))]);
        let reserved_for_no_pod = BTreeMap::from([("g".to_owned(), Vec::new())]);
        let pod = |name: &str| PodDevices {
            namespace: "team".into(),
            name: name.into(),
            containers: vec![ContainerDevices {
                name: "main".into(),
                devices: vec![ClaimDevice {
                    claim_namespace: "team".into(),
                    claim_name: "group".into(),
                    driver: "gpu.example.com".into(),
                    pool: "node".into(),
                    device: g4.clone(),
                    share_id: None,
                }],
            }],
        };
        let report = |pods: Vec<PodDevices>| {
            let known = Containers::from_kubelet(&pods, "gpu.example.com");
            build(
                &Inputs {
                    containers: &known,
                    ..inputs(&devices, &claims, &samples, &reserved_for_no_pod)
                },
                &mut IdleTracker::default(),
                Instant::now(),
                0,
            )
        };
        let one = report(vec![pod("worker-0")]);
        let c = claim(&one, "g");
        assert_eq!(
            c.pods,
            [PodRef {
                name: "worker-0".into(),
                uid: String::new()
            }]
        );
        let p = &one
            .devices
            .iter()
            .find(|d| d.device == g4)
            .unwrap()
            .processes[0];
        assert_eq!(
            (
                p.claim.as_deref(),
                p.pod.as_deref(),
                p.namespace.as_deref(),
                p.container.as_deref()
            ),
            (Some("g"), Some("worker-0"), Some("team"), Some("main"))
        );
        assert!(c.busy && c.memory_used_bytes == 100 << 20);

        let two = report(vec![pod("worker-0"), pod("worker-1")]);
        let names: Vec<&str> = claim(&two, "g")
            .pods
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(names, ["worker-0", "worker-1"]);
        let p = &two
            .devices
            .iter()
            .find(|d| d.device == g4)
            .unwrap()
            .processes[0];
        assert_eq!((p.claim.as_deref(), p.pod.as_deref()), (Some("g"), None));
        assert_eq!(p.pod_uid.as_deref(), Some(pod_uid(1).as_str()));
    }

    #[test]
    fn a_process_is_named_by_the_one_container_the_kubelet_says_holds_its_device() {
        use dra_kubelet::pod_resources::{ClaimDevice, ContainerDevices, PodDevices};
        let devices = devices();
        let g4 = gpu(&devices, 4);
        let claims = vec![("a".to_owned(), record("first", vec![held(&g4, None)]))];
        let samples = BTreeMap::from([(4, sample(Some(50), &[(1, 100, 1, None)]))]);
        let pods = pods(&[("a", 1)]);
        let holding = |container: &str, driver: &str| ContainerDevices {
            name: container.into(),
            devices: vec![ClaimDevice {
                claim_namespace: "team".into(),
                claim_name: "first".into(),
                driver: driver.into(),
                pool: "node".into(),
                device: g4.clone(),
                share_id: None,
            }],
        };
        let answer = |containers: Vec<ContainerDevices>| {
            vec![PodDevices {
                namespace: "team".into(),
                name: "pod-1".into(),
                containers,
            }]
        };
        let named = |containers: Vec<ContainerDevices>| {
            let known = Containers::from_kubelet(&answer(containers), "gpu.example.com");
            let r = build(
                &Inputs {
                    containers: &known,
                    ..inputs(&devices, &claims, &samples, &pods)
                },
                &mut IdleTracker::default(),
                Instant::now(),
                0,
            );
            let d = r.devices.iter().find(|d| d.device == g4).unwrap().clone();
            let listed: Vec<String> = d.containers.iter().map(|c| c.container.clone()).collect();
            (d.processes[0].container.clone(), listed)
        };
        // Another driver's device of the same name, and a container without devices, aside.
        let (process, listed) = named(vec![
            holding("main", "gpu.example.com"),
            holding("other", "other.example.com"),
            ContainerDevices {
                name: "sidecar".into(),
                devices: Vec::new(),
            },
        ]);
        assert_eq!(
            (process.as_deref(), listed.as_slice()),
            (Some("main"), &["main".to_owned()][..])
        );
        // Two containers hold it: the process's container cannot be told.
        let (process, listed) = named(vec![
            holding("main", "gpu.example.com"),
            holding("helper", "gpu.example.com"),
        ]);
        assert_eq!(process, None);
        assert_eq!(listed, ["helper", "main"]);
        // The kubelet not asked (or failing): no names.
        let r = build(
            &inputs(&devices, &claims, &samples, &pods),
            &mut IdleTracker::default(),
            Instant::now(),
            0,
        );
        let d = r.devices.iter().find(|d| d.device == g4).unwrap();
        assert!(d.containers.is_empty() && d.processes[0].container.is_none());
    }

    #[test]
    fn unprepared_claims_are_forgotten() {
        let mut tracker = IdleTracker::default();
        let t0 = Instant::now();
        tracker.observe("a", false, t0);
        tracker.retain(&BTreeSet::new());
        assert_eq!(tracker.observe("a", false, t0 + MIN), Duration::ZERO);
    }
}
