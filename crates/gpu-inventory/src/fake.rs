//! A deterministic fake GPU backend read from a topology file, with call recording and fault
//! injection for tests.
//!
//! Topology file (YAML), one entry per NVML answer ([`RawGpu`] in camelCase):
//! ```yaml
//! system: {driverVersion: "570.124.06", cudaDriverVersion: 12080}
//! gpus:
//!   - {index: 0, minor: 0, uuid: GPU-..., name: NVIDIA H100 80GB HBM3, brand: Nvidia,
//!      architecture: Hopper, cudaComputeCapabilityMajor: 9, cudaComputeCapabilityMinor: 0,
//!      memoryTotalBytes: 85520809984, multiprocessorCount: 132,
//!      pciBusId: "00000000:18:00.0", numaNode: 0, pcieRoot: "pci0000:17",
//!      nvlinks: [{links: 5, remotePciBusId: "00000000:05:00.0", remoteDeviceType: switch}],
//!      migMode: enabled,
//!      migDevices: [{uuid: MIG-..., gpuInstanceId: 1, profileId: 0,
//!                    placement: {start: 0, size: 1}}],
//!      fabric: {clusterUuid: ..., cliqueId: 1, state: completed}}
//! ```
//! Where a MIG-capable GPU lists no `migProfiles`, the fake answers the profile queries from the
//! built-in table of its product ([`crate::mig_tables`]); MIG devices without `attributes` report
//! their profile's resources, as NVML does for a compute instance spanning its GPU instance.
//! See `examples/topologies/` for complete files.
//!
//! Health events: tests inject them in memory with [`FakeBackend::inject_event`], or as files in
//! `<state_dir>/events/` (format and ordering in [`crate::health`]); a waiting
//! [`GpuBackend::wait_health_event`] returns in-memory events first, then files, polling the
//! directory every [`crate::health::EVENT_POLL_INTERVAL`].

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::backend::{BackendError, GpuBackend, MigAttributes, MigMode, RawGpu, SystemInfo};
use crate::health::{EVENT_POLL_INTERVAL, HealthEvent, events_dir, take_event_file};
use crate::mig_tables::builtin_profiles;

/// The contents of a topology file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Topology {
    /// Node-wide driver facts.
    pub system: SystemInfo,
    /// Full GPUs in NVML enumeration order.
    pub gpus: Vec<RawGpu>,
}

/// A topology file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The file could not be read.
    #[error("reading topology file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The YAML does not match the topology schema.
    #[error("parsing topology {origin}: {source}")]
    Parse {
        /// The file, or `<inline>`.
        origin: String,
        /// The cause, with line and column.
        source: serde_yaml_ng::Error,
    },
    /// The topology is inconsistent.
    #[error("topology {origin}: {problem}")]
    Invalid {
        /// The file, or `<inline>`.
        origin: String,
        /// What is wrong, naming the GPU and field.
        problem: String,
    },
}

impl Topology {
    /// Reads and validates a topology file.
    ///
    /// # Errors
    /// [`TopologyError`] naming the file and, for bad content, the GPU and field.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates topology YAML; `origin` names it in errors.
    ///
    /// # Errors
    /// [`TopologyError::Parse`] or [`TopologyError::Invalid`].
    pub fn parse(yaml: &str, origin: &str) -> Result<Self, TopologyError> {
        let topology: Self =
            serde_yaml_ng::from_str(yaml).map_err(|source| TopologyError::Parse {
                origin: origin.to_owned(),
                source,
            })?;
        let mut topology = topology;
        topology.fill_mig_answers();
        topology
            .validate()
            .map_err(|problem| TopologyError::Invalid {
                origin: origin.to_owned(),
                problem,
            })?;
        Ok(topology)
    }

    /// Completes what NVML would answer but the file may leave out: built-in profile tables and
    /// MIG device attributes (see the module docs).
    fn fill_mig_answers(&mut self) {
        for gpu in &mut self.gpus {
            if gpu.mig_mode != MigMode::Unsupported && gpu.mig_profiles.is_empty() {
                gpu.mig_profiles = builtin_profiles(&gpu.name).unwrap_or_default();
            }
            for m in &mut gpu.mig_devices {
                if m.attributes.is_some() {
                    continue;
                }
                if let Some(p) = gpu.mig_profiles.iter().find(|p| p.id == m.profile_id) {
                    m.attributes = Some(MigAttributes {
                        memory_total_bytes: p.memory_size_mib << 20,
                        multiprocessor_count: p.multiprocessor_count,
                        copy_engine_count: p.copy_engine_count,
                        decoder_count: p.decoder_count,
                        encoder_count: p.encoder_count,
                        jpeg_count: p.jpeg_count,
                        ofa_count: p.ofa_count,
                        gpu_instance_slice_count: p.slice_count,
                        compute_instance_slice_count: p.slice_count,
                    });
                }
            }
        }
    }

    fn validate(&self) -> Result<(), String> {
        let mut uuids = BTreeSet::new();
        let mut minors = BTreeSet::new();
        let mut buses = BTreeSet::new();
        for (i, gpu) in self.gpus.iter().enumerate() {
            if usize::try_from(gpu.index).ok() != Some(i) {
                return Err(format!(
                    "gpus[{i}].index is {}, expected {i} (NVML enumeration order)",
                    gpu.index
                ));
            }
            if !uuids.insert(&gpu.uuid) {
                return Err(format!("gpus[{i}].uuid {} is not unique", gpu.uuid));
            }
            if !minors.insert(gpu.minor) {
                return Err(format!("gpus[{i}].minor {} is not unique", gpu.minor));
            }
            if !buses.insert(&gpu.pci_bus_id) {
                return Err(format!(
                    "gpus[{i}].pciBusId {} is not unique",
                    gpu.pci_bus_id
                ));
            }
            if !gpu.mig_devices.is_empty() && gpu.mig_mode != MigMode::Enabled {
                return Err(format!(
                    "gpus[{i}].migDevices are listed but migMode is not enabled"
                ));
            }
            let mut used = 0u64;
            for (j, m) in gpu.mig_devices.iter().enumerate() {
                let Some(p) = gpu.mig_profiles.iter().find(|p| p.id == m.profile_id) else {
                    return Err(format!(
                        "gpus[{i}].migDevices[{j}].profileId {} is not a profile of {}",
                        m.profile_id, gpu.name
                    ));
                };
                if !p.placements.contains(&m.placement) {
                    return Err(format!(
                        "gpus[{i}].migDevices[{j}].placement {:?} is not a placement of profile {}",
                        m.placement, m.profile_id
                    ));
                }
                if m.placement.start.saturating_add(m.placement.size) > 32 {
                    return Err(format!(
                        "gpus[{i}].migDevices[{j}].placement {:?} is beyond 32 memory slices",
                        m.placement
                    ));
                }
                let mask = ((1u64 << m.placement.size) - 1) << m.placement.start;
                if used & mask != 0 {
                    return Err(format!(
                        "gpus[{i}].migDevices[{j}].placement {:?} overlaps another MIG device",
                        m.placement
                    ));
                }
                used |= mask;
                if !uuids.insert(&m.uuid) {
                    return Err(format!(
                        "gpus[{i}].migDevices[{j}].uuid {} is not unique",
                        m.uuid
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Serves NVML queries from a [`Topology`]; records each query and can fail chosen ones.
#[derive(Debug)]
pub struct FakeBackend {
    topology: Topology,
    calls: Mutex<Vec<String>>,
    failing_gpus: Mutex<BTreeSet<u32>>,
    state_dir: Option<PathBuf>,
    injected: Mutex<VecDeque<HealthEvent>>,
    injected_ready: Condvar,
}

impl FakeBackend {
    /// A backend answering from `topology`.
    pub fn new(topology: Topology) -> Self {
        Self {
            topology,
            calls: Mutex::new(Vec::new()),
            failing_gpus: Mutex::new(BTreeSet::new()),
            state_dir: None,
            injected: Mutex::new(VecDeque::new()),
            injected_ready: Condvar::new(),
        }
    }

    /// Queues a health event for [`GpuBackend::wait_health_event`], waking a waiting caller.
    pub fn inject_event(&self, event: HealthEvent) {
        lock(&self.injected).push_back(event);
        self.injected_ready.notify_all();
    }

    /// Keeps what outlives a process on real hardware (created MIG instances) under `dir`, and
    /// reads injected health events from `dir/events/`.
    pub fn with_state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.state_dir = Some(dir.into());
        self
    }

    /// The state directory, if any.
    pub fn state_dir(&self) -> Option<&Path> {
        self.state_dir.as_deref()
    }

    /// The topology served.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Makes every later query for the GPU at `index` fail with [`BackendError::Injected`].
    pub fn fail_gpu(&self, index: u32) {
        lock(&self.failing_gpus).insert(index);
    }

    /// The queries served so far, e.g. `["system", "device_count", "gpu(0)"]`.
    pub fn calls(&self) -> Vec<String> {
        lock(&self.calls).clone()
    }

    fn record(&self, call: String) {
        lock(&self.calls).push(call);
    }
}

/// A poisoned lock only means another test thread panicked; the data is still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl GpuBackend for FakeBackend {
    fn system(&self) -> Result<SystemInfo, BackendError> {
        self.record("system".into());
        Ok(self.topology.system.clone())
    }

    fn device_count(&self) -> Result<u32, BackendError> {
        self.record("device_count".into());
        // validate() guarantees index == position, so the count fits the index type.
        Ok(u32::try_from(self.topology.gpus.len()).unwrap_or(u32::MAX))
    }

    fn gpu(&self, index: u32) -> Result<RawGpu, BackendError> {
        self.record(format!("gpu({index})"));
        if lock(&self.failing_gpus).contains(&index) {
            return Err(BackendError::Injected { call: "gpu", index });
        }
        self.topology
            .gpus
            .get(index as usize)
            .cloned()
            .ok_or_else(|| BackendError::Query {
                call: "nvmlDeviceGetHandleByIndex_v2",
                index,
                message: "Invalid Argument".into(),
            })
    }

    fn wait_health_event(&self, timeout: Duration) -> Result<Option<HealthEvent>, BackendError> {
        let deadline = Instant::now() + timeout;
        let mut queue = lock(&self.injected);
        loop {
            if let Some(event) = queue.pop_front() {
                self.record(format!("health_event({})", event.gpu_uuid));
                return Ok(Some(event));
            }
            if let Some(dir) = &self.state_dir {
                match take_event_file(&events_dir(dir)) {
                    Ok(Some(event)) => {
                        self.record(format!("health_event({})", event.gpu_uuid));
                        return Ok(Some(event));
                    }
                    Ok(None) => {}
                    Err((path, problem)) => return Err(BackendError::EventFile { path, problem }),
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let wait = EVENT_POLL_INTERVAL.min(deadline - now);
            queue = self
                .injected_ready
                .wait_timeout(queue, wait)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE_GPU: &str = r#"
system: {driverVersion: "570.124.06", cudaDriverVersion: 12080}
gpus:
  - {index: 0, minor: 0, uuid: GPU-a, name: NVIDIA H100 80GB HBM3, brand: Nvidia,
     architecture: Hopper, cudaComputeCapabilityMajor: 9, cudaComputeCapabilityMinor: 0,
     memoryTotalBytes: 85520809984, multiprocessorCount: 132, pciBusId: "00000000:18:00.0",
     numaNode: 0}
"#;

    #[test]
    fn a_topology_is_served_query_by_query_and_recorded() {
        let fake = FakeBackend::new(Topology::parse(ONE_GPU, "t").expect("valid"));
        assert_eq!(fake.device_count().expect("count"), 1);
        assert_eq!(fake.gpu(0).expect("gpu").uuid, "GPU-a");
        assert!(fake.gpu(1).is_err());
        assert_eq!(fake.calls(), ["device_count", "gpu(0)", "gpu(1)"]);
    }

    #[test]
    fn an_injected_fault_fails_only_that_gpu() {
        let fake = FakeBackend::new(Topology::parse(ONE_GPU, "t").expect("valid"));
        fake.fail_gpu(0);
        assert!(matches!(
            fake.gpu(0),
            Err(BackendError::Injected { index: 0, .. })
        ));
        assert!(fake.system().is_ok());
    }

    #[test]
    fn injected_events_come_before_event_files_and_each_is_delivered_once() {
        use crate::health::HealthEventKind;
        let state = tempfile::tempdir().expect("tempdir");
        let events = events_dir(state.path());
        std::fs::create_dir_all(&events).expect("mkdir");
        std::fs::write(
            events.join("001.json"),
            r#"{"gpuUuid":"GPU-a","event":"xid","code":79}"#,
        )
        .expect("write");
        let fake = FakeBackend::new(Topology::parse(ONE_GPU, "t").expect("valid"))
            .with_state_dir(state.path());
        fake.inject_event(HealthEvent {
            gpu_uuid: "GPU-a".into(),
            kind: HealthEventKind::GpuLost,
        });
        let wait = Duration::from_millis(10);
        let kinds: Vec<_> = std::iter::from_fn(|| fake.wait_health_event(wait).expect("ok"))
            .map(|e| e.kind)
            .collect();
        assert_eq!(
            kinds,
            [HealthEventKind::GpuLost, HealthEventKind::Xid { code: 79 }]
        );
        assert!(!events.join("001.json").exists());
    }

    #[test]
    fn an_injected_event_wakes_a_waiting_caller() {
        let fake = std::sync::Arc::new(FakeBackend::new(
            Topology::parse(ONE_GPU, "t").expect("valid"),
        ));
        let waiter = {
            let fake = std::sync::Arc::clone(&fake);
            std::thread::spawn(move || fake.wait_health_event(Duration::from_secs(30)))
        };
        std::thread::sleep(Duration::from_millis(20));
        fake.inject_event(HealthEvent {
            gpu_uuid: "GPU-a".into(),
            kind: crate::health::HealthEventKind::DoubleBitEcc,
        });
        let event = waiter.join().expect("joined").expect("ok").expect("event");
        assert_eq!(event.gpu_uuid, "GPU-a");
    }

    #[test]
    fn a_bad_event_file_is_an_error_naming_it() {
        let state = tempfile::tempdir().expect("tempdir");
        let events = events_dir(state.path());
        std::fs::create_dir_all(&events).expect("mkdir");
        std::fs::write(events.join("001.json"), "{").expect("write");
        let fake = FakeBackend::new(Topology::parse(ONE_GPU, "t").expect("valid"))
            .with_state_dir(state.path());
        let err = fake
            .wait_health_event(Duration::from_millis(10))
            .expect_err("bad file");
        assert!(err.to_string().contains("001.json"), "{err}");
        assert_eq!(
            fake.wait_health_event(Duration::from_millis(10))
                .expect("ok"),
            None
        );
    }

    #[test]
    fn bad_topologies_name_the_gpu_and_field() {
        let cases = [
            (ONE_GPU.replace("index: 0", "index: 3"), "gpus[0].index"),
            (
                ONE_GPU.replace("numaNode: 0", "numaNode: 0, colour: red"),
                "colour",
            ),
            (
                format!(
                    "{ONE_GPU}{}",
                    r#"  - {index: 1, minor: 1, uuid: GPU-a, name: x, brand: Nvidia, architecture: Hopper,
     cudaComputeCapabilityMajor: 9, cudaComputeCapabilityMinor: 0, memoryTotalBytes: 1,
     multiprocessorCount: 1, pciBusId: "00000000:19:00.0", numaNode: 0}
"#
                ),
                "gpus[1].uuid GPU-a is not unique",
            ),
        ];
        for (yaml, needle) in cases {
            let err = Topology::parse(&yaml, "bad.yaml")
                .expect_err("must fail")
                .to_string();
            assert!(err.contains(needle) && err.contains("bad.yaml"), "{err}");
        }
    }
}
