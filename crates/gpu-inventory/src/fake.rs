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
//!      migDevices: [{uuid: MIG-..., gpuInstanceId: 1, profileId: 19,
//!                    placement: {start: 0, size: 1}}],
//!      fabric: {clusterUuid: ..., cliqueId: 1, state: completed}}
//! ```
//! `fabric` is [`crate::fabric::FabricInfo`] (state, status, cluster, clique, `healthMask`,
//! `healthSummary`); `fabricError: "..."` in its place makes the fabric call fail with that
//! message.
//! Where a MIG-capable GPU lists no `migProfiles`, the fake answers the profile queries from the
//! built-in table of its product ([`crate::mig_tables`]); MIG devices without `attributes` report
//! their profile's resources, as NVML does for a compute instance spanning its GPU instance.
//! See `examples/topologies/` for complete files, and [`rack`] for the 18 trays of a GB200
//! NVL72 rack (one multi-node NVLink clique) made on demand.
//!
//! # MIG devices created and destroyed
//! [`GpuBackend::create_mig_device`] and [`GpuBackend::destroy_mig_device`] follow NVML's rules
//! ([`mig::create`]): MIG mode must be enabled, the profile must be in the GPU's table and the
//! placement one of its placements, no memory slice may be shared with another GPU instance,
//! the profile's instance count and the GPU's compute slices are respected. GPU instance ids are
//! the driver's (the placement's node in the buddy tree over the memory slices, else the lowest
//! free id), the compute instance spans its GPU instance (id 0), and UUIDs are deterministic
//! ([`mig::mig_uuid`]). [`GpuBackend::gpu`] lists the devices as they are now.
//!
//! With a state dir ([`FakeBackend::with_state_dir`]) the devices outlive the process, as they
//! do on hardware across a plugin restart: `<state_dir>/mig.json` (replaced atomically) holds
//!
//! ```json
//! {"created": 3, "gpus": {"GPU-<uuid>": [{"uuid": "MIG-...", "gpuInstanceId": 7,
//!   "computeInstanceId": 0, "profileId": 19, "placement": {"start": 0, "size": 1},
//!   "attributes": {...}}]}}
//! ```
//!
//! `gpus` lists every GPU whose devices changed since the topology was read, with all of its
//! devices (an empty list once the last was destroyed); other GPUs have the topology's
//! `migDevices`; `created` counts creations (it makes UUIDs unique). Every backend opened on the
//! same state dir sees the same devices. Without a state dir the same state lives in memory.
//!
//! Faults: [`FakeBackend::fail_mig_create`] / [`FakeBackend::fail_mig_destroy`] in process, or,
//! for a separate process, the files `<state_dir>/fail-mig-create` and
//! `<state_dir>/fail-mig-destroy`: while one exists (any content) every creation (destruction)
//! fails with [`BackendError::Injected`] and changes nothing.
//!
//! # Memory limits
//! A topology whose driver version is r615 or later ([`crate::backend::driver_has_memory_partitioning`])
//! has memory partitioning. [`GpuBackend::set_memory_limits`] refuses a cgroup directory that
//! does not exist, as the driver would, and keeps each limit set in memory and, with a state
//! dir, as one file per GPU and cgroup, `<state_dir>/memory-limits/<gpu uuid>/<cgroup path with
//! `/` as `%2F`>.json` holding `{"cgroup": "...", "softBytes": n, "hardBytes": n}`, removed when
//! the limits are cleared: a hook process and the plugin setting limits at once never lose one
//! another's. [`FakeBackend::memory_limits`] lists them.
//!
//! # Usage
//! [`GpuBackend::usage`] answers from `<state_dir>/usage/<index>.json` ([`GpuUsage`] as JSON,
//! read at each call), else from [`FakeBackend::set_usage`], else an idle GPU.
//!
//! # Health events
//! Tests inject them in memory with [`FakeBackend::inject_event`], or as files in
//! `<state_dir>/events/` (format and ordering in [`crate::health`]); a waiting
//! [`GpuBackend::wait_health_event`] returns in-memory events first, then files, polling the
//! directory every [`crate::health::EVENT_POLL_INTERVAL`].

pub mod mig;
pub mod rack;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::backend::{
    BackendError, ComputeMode, FabricAnswer, GpuBackend, GpuState, GpuUsage, MemoryLimits,
    MigAttributes, MigMode, MigPlacement, RawGpu, RawMigDevice, SystemInfo,
};
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
        Ok(Self::read(path.as_ref())?.0)
    }

    /// Reads and validates a topology file; the topology and the text it was parsed from.
    fn read(path: &Path) -> Result<(Self, String), TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Read {
            path: path.to_owned(),
            source,
        })?;
        let topology = Self::parse(&text, &path.display().to_string())?;
        Ok((topology, text))
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
    topology: std::sync::RwLock<std::sync::Arc<Topology>>,
    /// The file the topology came from and its text as last read, when it is followed
    /// ([`FakeBackend::from_file`]).
    source: Option<(PathBuf, Mutex<String>)>,
    calls: Mutex<Vec<String>>,
    failing_gpus: Mutex<BTreeSet<u32>>,
    /// Whether waiting for health events fails (see [`FakeBackend::fail_health_events`]).
    failing_events: std::sync::atomic::AtomicBool,
    state_dir: Option<PathBuf>,
    time_slices: Mutex<BTreeMap<u32, u8>>,
    compute_modes: Mutex<BTreeMap<u32, ComputeMode>>,
    /// Memory limits set without a state dir, by GPU UUID and cgroup.
    memory_limits: Mutex<BTreeMap<(String, PathBuf), MemoryLimits>>,
    /// MIG devices as changed in this process (without a state dir); also serializes
    /// read-modify-write of the state file within the process.
    mig: Mutex<mig::MigState>,
    failing_mig: Mutex<BTreeSet<(&'static str, u32)>>,
    injected: Mutex<VecDeque<HealthEvent>>,
    injected_ready: Condvar,
    /// Usage set in process ([`FakeBackend::set_usage`]), by GPU index.
    usage: Mutex<BTreeMap<u32, GpuUsage>>,
}

impl FakeBackend {
    /// A backend answering from `topology`.
    pub fn new(topology: Topology) -> Self {
        Self {
            topology: std::sync::RwLock::new(std::sync::Arc::new(topology)),
            source: None,
            calls: Mutex::new(Vec::new()),
            failing_gpus: Mutex::new(BTreeSet::new()),
            failing_events: std::sync::atomic::AtomicBool::new(false),
            state_dir: None,
            time_slices: Mutex::new(BTreeMap::new()),
            compute_modes: Mutex::new(BTreeMap::new()),
            memory_limits: Mutex::new(BTreeMap::new()),
            mig: Mutex::new(mig::MigState::default()),
            failing_mig: Mutex::new(BTreeSet::new()),
            injected: Mutex::new(VecDeque::new()),
            injected_ready: Condvar::new(),
            usage: Mutex::new(BTreeMap::new()),
        }
    }

    /// A backend answering from the topology file `path`, and following it as NVML follows the
    /// hardware: each [`GpuBackend::device_count`] (where every discovery starts) re-reads the
    /// file, so an edited file acts like GPUs that appeared, vanished or changed. A file that
    /// no longer parses is logged and the last good topology kept.
    ///
    /// # Errors
    /// [`TopologyError`] when the file cannot be read or is invalid at first.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let path = path.as_ref();
        let (topology, text) = Topology::read(path)?;
        let mut fake = Self::new(topology);
        fake.source = Some((path.to_owned(), Mutex::new(text)));
        Ok(fake)
    }

    /// Re-reads the followed topology file if its text changed.
    fn follow_file(&self) {
        let Some((path, last)) = &self.source else {
            return;
        };
        let Ok(text) = std::fs::read_to_string(path) else {
            tracing::warn!(path = %path.display(), "cannot re-read the fake topology; keeping the last one");
            return;
        };
        let mut last = lock(last);
        if *last == text {
            return;
        }
        match Topology::parse(&text, &path.display().to_string()) {
            Ok(t) => {
                *self
                    .topology
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = std::sync::Arc::new(t);
                *last = text;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the fake topology no longer parses; keeping the last one")
            }
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
        let dir = dir.into();
        // Settings outlive the process, as on a real GPU.
        if let Some(saved) = std::fs::read_to_string(dir.join("time-slices.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
        {
            self.time_slices = Mutex::new(saved);
        }
        if let Some(saved) = std::fs::read_to_string(dir.join("compute-modes.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
        {
            self.compute_modes = Mutex::new(saved);
        }
        self.state_dir = Some(dir);
        self
    }

    /// The compute time slice last set on each GPU (by index; see
    /// [`GpuBackend::set_compute_time_slice`]); GPUs never set are absent. With a state
    /// directory, also kept in `<state_dir>/time-slices.json` as `{"<index>": <value>}`.
    pub fn time_slices(&self) -> BTreeMap<u32, u8> {
        lock(&self.time_slices).clone()
    }

    /// The compute mode last set on each GPU (by index; see [`GpuBackend::set_compute_mode`]);
    /// GPUs never set are absent (in [`ComputeMode::Default`]). With a state directory, also
    /// kept in `<state_dir>/compute-modes.json`.
    pub fn compute_modes(&self) -> BTreeMap<u32, ComputeMode> {
        lock(&self.compute_modes).clone()
    }

    /// The memory limits set now, by GPU UUID and cgroup directory (see the module docs); from
    /// the state directory when there is one, so limits another process set are listed too.
    /// A cgroup that no longer exists has none: removing a cgroup clears its limits (NVML API
    /// reference, `nvmlSetMemoryLimits_v1_t`).
    pub fn memory_limits(&self) -> BTreeMap<(String, PathBuf), MemoryLimits> {
        let mut found = self.memory_limits_set();
        found.retain(|(_, cgroup), _| cgroup.is_dir());
        found
    }

    fn memory_limits_set(&self) -> BTreeMap<(String, PathBuf), MemoryLimits> {
        let Some(dir) = &self.state_dir else {
            return lock(&self.memory_limits).clone();
        };
        let mut found = BTreeMap::new();
        let Ok(gpus) = std::fs::read_dir(dir.join(MEMORY_LIMITS_DIR)) else {
            return found;
        };
        for gpu in gpus.flatten() {
            let uuid = gpu.file_name().to_string_lossy().into_owned();
            for file in std::fs::read_dir(gpu.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let record = std::fs::read_to_string(file.path())
                    .ok()
                    .and_then(|t| serde_json::from_str::<LimitFile>(&t).ok());
                if let Some(r) = record {
                    found.insert(
                        (uuid.clone(), r.cgroup),
                        MemoryLimits {
                            soft_bytes: r.soft_bytes,
                            hard_bytes: r.hard_bytes,
                        },
                    );
                }
            }
        }
        found
    }

    /// The state directory, if any.
    pub fn state_dir(&self) -> Option<&Path> {
        self.state_dir.as_deref()
    }

    /// The topology served now.
    pub fn topology(&self) -> std::sync::Arc<Topology> {
        std::sync::Arc::clone(
            &self
                .topology
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Makes every later wait for a health event fail (`failing`) with
    /// [`BackendError::Injected`] (call `wait_health_event`, index 0), or succeed again, as an
    /// NVML event set does when the driver misbehaves.
    pub fn fail_health_events(&self, failing: bool) {
        self.failing_events
            .store(failing, std::sync::atomic::Ordering::SeqCst);
    }

    /// Makes every later query for the GPU at `index` fail with [`BackendError::Injected`].
    pub fn fail_gpu(&self, index: u32) {
        lock(&self.failing_gpus).insert(index);
    }

    /// Makes every later MIG creation on the GPU at `index` fail with
    /// [`BackendError::Injected`].
    pub fn fail_mig_create(&self, index: u32) {
        lock(&self.failing_mig).insert((CREATE, index));
    }

    /// Makes every later MIG destruction on the GPU at `index` fail with
    /// [`BackendError::Injected`].
    pub fn fail_mig_destroy(&self, index: u32) {
        lock(&self.failing_mig).insert((DESTROY, index));
    }

    /// The queries served so far, e.g. `["system", "device_count", "gpu(0)"]`.
    pub fn calls(&self) -> Vec<String> {
        lock(&self.calls).clone()
    }

    /// Runs `f` on the current MIG state (from the state file, else memory) while holding the
    /// state lock; stores the state again when `f` returns `Ok(true)`.
    fn with_mig<R>(
        &self,
        f: impl FnOnce(&mut mig::MigState) -> Result<(R, bool), BackendError>,
    ) -> Result<R, BackendError> {
        let mut memory = lock(&self.mig);
        let file = self.state_dir.as_ref().map(|d| d.join(mig::STATE_FILE));
        let mut state = match &file {
            Some(path) => mig::MigState::load(path)?,
            None => memory.clone(),
        };
        let (r, changed) = f(&mut state)?;
        if changed {
            if let Some(path) = &file {
                state.store(path)?;
            }
            *memory = state;
        }
        Ok(r)
    }

    fn injected(&self, call: &'static str, index: u32) -> bool {
        let file = match call {
            CREATE => mig::FAIL_CREATE_FILE,
            _ => mig::FAIL_DESTROY_FILE,
        };
        lock(&self.failing_mig).contains(&(call, index))
            || self
                .state_dir
                .as_ref()
                .is_some_and(|d| d.join(file).exists())
    }

    fn raw_gpu(&self, index: u32) -> Result<RawGpu, BackendError> {
        self.topology()
            .gpus
            .get(index as usize)
            .cloned()
            .ok_or_else(|| BackendError::Query {
                call: "nvmlDeviceGetHandleByIndex_v2",
                index,
                message: "Invalid Argument".into(),
            })
    }

    /// Makes [`GpuBackend::usage`] of the GPU at `index` answer `usage` (without a state dir;
    /// with one, its usage file wins).
    pub fn set_usage(&self, index: u32, usage: GpuUsage) {
        lock(&self.usage).insert(index, usage);
    }

    fn record(&self, call: String) {
        lock(&self.calls).push(call);
    }
}

const CREATE: &str = "create_mig_device";
const DESTROY: &str = "destroy_mig_device";

/// A poisoned lock only means another test thread panicked; the data is still usable.
/// Where [`FakeBackend`] keeps memory limits under its state dir.
const MEMORY_LIMITS_DIR: &str = "memory-limits";

/// One memory-limit file of [`FakeBackend`].
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LimitFile {
    cgroup: PathBuf,
    soft_bytes: u64,
    hard_bytes: u64,
}

/// `cgroup` as one file name: `%` as `%25`, `/` as `%2F`.
fn escape_path(cgroup: &Path) -> String {
    cgroup
        .to_string_lossy()
        .replace('%', "%25")
        .replace('/', "%2F")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl GpuBackend for FakeBackend {
    fn system(&self) -> Result<SystemInfo, BackendError> {
        self.record("system".into());
        Ok(self.topology().system.clone())
    }

    fn device_count(&self) -> Result<u32, BackendError> {
        self.record("device_count".into());
        self.follow_file();
        // validate() guarantees index == position, so the count fits the index type.
        Ok(u32::try_from(self.topology().gpus.len()).unwrap_or(u32::MAX))
    }

    fn gpu(&self, index: u32) -> Result<RawGpu, BackendError> {
        self.record(format!("gpu({index})"));
        if lock(&self.failing_gpus).contains(&index) {
            return Err(BackendError::Injected { call: "gpu", index });
        }
        let mut gpu = self.raw_gpu(index)?;
        gpu.mig_devices = self.with_mig(|state| Ok((state.devices(&gpu).to_vec(), false)))?;
        Ok(gpu)
    }

    /// Not recorded among the calls (the plugin polls it on a timer). Re-reads a followed
    /// topology file first, so a test that rewrites the file changes what the GPU answers, as
    /// Fabric Manager changes what NVML answers.
    fn fabric(&self, index: u32) -> Result<FabricAnswer, BackendError> {
        if lock(&self.failing_gpus).contains(&index) {
            return Err(BackendError::Injected {
                call: "fabric",
                index,
            });
        }
        self.follow_file();
        Ok(self.raw_gpu(index)?.fabric_answer())
    }

    /// Not recorded among the calls (the plugin samples it on a timer). Answers, in order: the
    /// state dir's `usage/<index>.json` (read at each call, so a test in another process
    /// changes it at will), the in-process [`FakeBackend::set_usage`], an idle GPU.
    fn usage(&self, index: u32) -> Result<GpuUsage, BackendError> {
        if index as usize >= self.topology().gpus.len() {
            return Err(BackendError::Query {
                call: "nvmlDeviceGetHandleByIndex_v2",
                index,
                message: "Invalid Argument".into(),
            });
        }
        if let Some(dir) = &self.state_dir {
            let path = dir.join("usage").join(format!("{index}.json"));
            match std::fs::read(&path) {
                Ok(bytes) => {
                    return serde_json::from_slice(&bytes).map_err(|e| BackendError::FakeState {
                        path,
                        message: e.to_string(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(BackendError::FakeState {
                        path,
                        message: e.to_string(),
                    });
                }
            }
        }
        Ok(lock(&self.usage)
            .get(&index)
            .cloned()
            .unwrap_or_else(GpuUsage::idle))
    }

    fn gpu_state(&self, index: u32) -> Result<GpuState, BackendError> {
        self.record(format!("gpu_state({index})"));
        if lock(&self.failing_gpus).contains(&index) {
            return Err(BackendError::Injected {
                call: "gpu_state",
                index,
            });
        }
        let topology = self.topology();
        let gpu = topology
            .gpus
            .get(index as usize)
            .ok_or_else(|| BackendError::Query {
                call: "nvmlDeviceGetHandleByIndex_v2",
                index,
                message: "Invalid Argument".into(),
            })?;
        Ok(GpuState {
            uuid: gpu.uuid.clone(),
            minor: gpu.minor,
            mig_devices: self.with_mig(|state| Ok((state.devices(gpu).to_vec(), false)))?,
        })
    }

    fn create_mig_device(
        &self,
        index: u32,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<RawMigDevice, BackendError> {
        self.record(format!(
            "{CREATE}({index}, {profile_id}, {}+{})",
            placement.start, placement.size
        ));
        if self.injected(CREATE, index) {
            return Err(BackendError::Injected {
                call: CREATE,
                index,
            });
        }
        let gpu = self.raw_gpu(index)?;
        self.with_mig(|state| {
            let mut devices = state.devices(&gpu).to_vec();
            let device = mig::create(&gpu, &devices, profile_id, placement, state.created + 1)
                .map_err(|message| BackendError::Query {
                    call: "nvmlDeviceCreateGpuInstanceWithPlacement",
                    index,
                    message,
                })?;
            state.created += 1;
            devices.push(device.clone());
            state.gpus.insert(gpu.uuid.clone(), devices);
            Ok((device, true))
        })
    }

    fn destroy_mig_device(
        &self,
        index: u32,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    ) -> Result<bool, BackendError> {
        self.record(format!(
            "{DESTROY}({index}, {gpu_instance_id}, {compute_instance_id})"
        ));
        if self.injected(DESTROY, index) {
            return Err(BackendError::Injected {
                call: DESTROY,
                index,
            });
        }
        let gpu = self.raw_gpu(index)?;
        self.with_mig(|state| {
            let mut devices = state.devices(&gpu).to_vec();
            let before = devices.len();
            // The compute instance, then its GPU instance: with one compute instance per GPU
            // instance, the device goes entirely.
            devices.retain(|m| m.gpu_instance_id != gpu_instance_id);
            if devices.len() == before {
                return Ok((false, false));
            }
            state.gpus.insert(gpu.uuid.clone(), devices);
            Ok((true, true))
        })
    }

    fn compute_mode(&self, index: u32) -> Result<ComputeMode, BackendError> {
        self.raw_gpu(index)?;
        Ok(lock(&self.compute_modes)
            .get(&index)
            .copied()
            .unwrap_or_default())
    }

    fn set_compute_mode(&self, index: u32, mode: ComputeMode) -> Result<(), BackendError> {
        const CALL: &str = "set_compute_mode";
        self.record(format!("{CALL}({index}, {mode:?})"));
        if lock(&self.failing_gpus).contains(&index) {
            return Err(BackendError::Injected { call: CALL, index });
        }
        self.raw_gpu(index)?;
        let mut modes = lock(&self.compute_modes);
        modes.insert(index, mode);
        if let Some(dir) = &self.state_dir {
            let text = serde_json::to_string(&*modes).unwrap_or_default();
            let path = dir.join("compute-modes.json");
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&path, text))
                .map_err(|e| BackendError::Action {
                    call: CALL,
                    index,
                    message: format!("writing {}: {e}", path.display()),
                })?;
        }
        Ok(())
    }

    fn memory_partitioning(&self) -> Result<bool, BackendError> {
        Ok(crate::backend::driver_has_memory_partitioning(
            &self.topology().system.driver_version,
        ))
    }

    fn set_memory_limits(
        &self,
        index: u32,
        cgroup: &Path,
        limits: MemoryLimits,
    ) -> Result<(), BackendError> {
        const CALL: &str = "set_memory_limits";
        self.record(format!(
            "{CALL}({index}, {}, {}, {})",
            cgroup.display(),
            limits.soft_bytes,
            limits.hard_bytes
        ));
        if lock(&self.failing_gpus).contains(&index) {
            return Err(BackendError::Injected { call: CALL, index });
        }
        if !self.memory_partitioning()? {
            return Err(BackendError::Unsupported { call: CALL, index });
        }
        let uuid = self.raw_gpu(index)?.uuid;
        if !cgroup.is_dir() {
            return Err(BackendError::Action {
                call: CALL,
                index,
                message: format!("cgroup {} does not exist", cgroup.display()),
            });
        }
        let cleared = limits == MemoryLimits::CLEARED;
        let Some(dir) = &self.state_dir else {
            let mut set = lock(&self.memory_limits);
            if cleared {
                set.remove(&(uuid, cgroup.to_owned()));
            } else {
                set.insert((uuid, cgroup.to_owned()), limits);
            }
            return Ok(());
        };
        let gpu_dir = dir.join(MEMORY_LIMITS_DIR).join(&uuid);
        let file = gpu_dir.join(format!("{}.json", escape_path(cgroup)));
        let failed = |e: std::io::Error| BackendError::Action {
            call: CALL,
            index,
            message: format!("writing {}: {e}", file.display()),
        };
        if cleared {
            return match std::fs::remove_file(&file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(failed(e)),
                _ => Ok(()),
            };
        }
        let text = serde_json::to_string(&LimitFile {
            cgroup: cgroup.to_owned(),
            soft_bytes: limits.soft_bytes,
            hard_bytes: limits.hard_bytes,
        })
        .unwrap_or_default();
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        std::fs::create_dir_all(&gpu_dir)
            .and_then(|()| std::fs::write(&tmp, text))
            .and_then(|()| std::fs::rename(&tmp, &file))
            .map_err(failed)
    }

    fn set_compute_time_slice(&self, index: u32, value: u8) -> Result<(), BackendError> {
        self.record(format!("set_compute_time_slice({index}, {value})"));
        if lock(&self.failing_gpus).contains(&index) {
            return Err(BackendError::Injected {
                call: "set_compute_time_slice",
                index,
            });
        }
        if index as usize >= self.topology().gpus.len() || value > 3 {
            return Err(BackendError::Action {
                call: "set_compute_time_slice",
                index,
                message: format!("invalid GPU index or time slice {value}"),
            });
        }
        let mut slices = lock(&self.time_slices);
        slices.insert(index, value);
        if let Some(dir) = &self.state_dir {
            let text = serde_json::to_string(&*slices).unwrap_or_default();
            let path = dir.join("time-slices.json");
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&path, text))
                .map_err(|e| BackendError::Action {
                    call: "set_compute_time_slice",
                    index,
                    message: format!("writing {}: {e}", path.display()),
                })?;
        }
        Ok(())
    }

    fn wait_health_event(&self, timeout: Duration) -> Result<Option<HealthEvent>, BackendError> {
        if self
            .failing_events
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(BackendError::Injected {
                call: "wait_health_event",
                index: 0,
            });
        }
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
    fn memory_limits_need_r615_and_an_existing_cgroup_and_outlive_the_backend() {
        let dir = tempfile::tempdir().expect("dir");
        let cgroup = dir.path().join("cg/pod/c1");
        std::fs::create_dir_all(&cgroup).expect("cgroup");
        let old = FakeBackend::new(Topology::parse(ONE_GPU, "t").expect("valid"));
        assert!(!old.memory_partitioning().expect("version"));
        assert!(matches!(
            old.set_memory_limits(0, &cgroup, MemoryLimits::share(1 << 30)),
            Err(BackendError::Unsupported { .. })
        ));
        let r615 = Topology::parse(&ONE_GPU.replace("570.124.06", "615.20.01"), "t").expect("ok");
        let fake = FakeBackend::new(r615.clone()).with_state_dir(dir.path().join("state"));
        assert!(fake.memory_partitioning().expect("version"));
        let err = fake
            .set_memory_limits(0, &dir.path().join("gone"), MemoryLimits::share(1 << 30))
            .expect_err("no such cgroup");
        assert!(err.to_string().contains("does not exist"), "{err}");
        fake.set_memory_limits(0, &cgroup, MemoryLimits::share(2 << 30))
            .expect("set");
        // Another process's backend on the same state dir sees it.
        let other = FakeBackend::new(r615).with_state_dir(dir.path().join("state"));
        let key = ("GPU-a".to_owned(), cgroup.clone());
        assert_eq!(
            other.memory_limits().get(&key),
            Some(&MemoryLimits::share(2 << 30))
        );
        other
            .set_memory_limits(0, &cgroup, MemoryLimits::CLEARED)
            .expect("clear");
        assert!(fake.memory_limits().is_empty());
        // Removing the cgroup drops its limits, as the driver does.
        fake.set_memory_limits(0, &cgroup, MemoryLimits::share(2 << 30))
            .expect("set");
        std::fs::remove_dir(&cgroup).expect("remove");
        assert!(fake.memory_limits().is_empty());
    }

    #[test]
    fn a_topology_is_served_query_by_query_and_recorded() {
        let fake = FakeBackend::new(Topology::parse(ONE_GPU, "t").expect("valid"));
        assert_eq!(fake.device_count().expect("count"), 1);
        assert_eq!(fake.gpu(0).expect("gpu").uuid, "GPU-a");
        assert!(fake.gpu(1).is_err());
        assert_eq!(fake.calls(), ["device_count", "gpu(0)", "gpu(1)"]);
    }

    #[test]
    fn the_fabric_answer_follows_the_topology_file_without_a_rediscovery() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.yaml");
        let with = |fabric: &str| format!("{}{fabric}\n", ONE_GPU.trim_end().trim_end_matches('}'));
        std::fs::write(&path, with(", fabric: {state: inProgress}}")).expect("write");
        let fake = FakeBackend::from_file(&path).expect("valid");
        let state = |a: FabricAnswer| a.info.map(|i| i.state);
        assert_eq!(
            state(fake.fabric(0).expect("answer")),
            Some(crate::fabric::FabricState::InProgress)
        );
        std::fs::write(
            &path,
            with(", fabric: {state: completed, clusterUuid: 5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94, cliqueId: 2}}"),
        )
        .expect("rewrite");
        let done = fake.fabric(0).expect("answer").info.expect("info");
        assert_eq!(
            done.clique().as_deref(),
            Some("5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.2")
        );
        std::fs::write(&path, with(", fabricError: \"Unknown Error (999)\"}")).expect("rewrite");
        let failed = fake.fabric(0).expect("answer");
        assert_eq!(
            (failed.info, failed.error.as_deref()),
            (None, Some("Unknown Error (999)"))
        );
        assert!(fake.calls().is_empty(), "polls are not recorded");
        fake.fail_gpu(0);
        assert!(fake.fabric(0).is_err());
    }

    /// Prepare checks a GPU with the light query: it must tell the same identity and MIG
    /// devices as the full one, also after a MIG device is created.
    #[test]
    fn the_light_gpu_state_agrees_with_the_full_query() {
        let topology = Topology::from_file(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../examples/topologies/dgx-a100-mig.yaml"),
        )
        .expect("example topology");
        let fake = FakeBackend::new(topology);
        let count = fake.device_count().expect("count");
        assert!(count > 1);
        // Free GPU 0's first MIG device, then create one in its place.
        let first = fake.gpu_state(0).expect("state").mig_devices[0].clone();
        fake.destroy_mig_device(0, first.gpu_instance_id, first.compute_instance_id)
            .expect("destroy");
        let before = fake.gpu_state(0).expect("state").mig_devices.len();
        let profiles = fake.gpu(0).expect("gpu").mig_profiles;
        let created = profiles
            .iter()
            .flat_map(|p| p.placements.iter().map(move |&at| (p.id, at)))
            .find_map(|(id, at)| fake.create_mig_device(0, id, at).ok());
        assert!(created.is_some(), "some placement is free");
        for index in 0..count {
            let full = GpuState::from(fake.gpu(index).expect("gpu"));
            assert_eq!(fake.gpu_state(index).expect("state"), full, "GPU {index}");
        }
        assert_eq!(
            fake.gpu_state(0).expect("state").mig_devices.len(),
            before + 1
        );
        fake.fail_gpu(1);
        assert!(matches!(
            fake.gpu_state(1),
            Err(BackendError::Injected { index: 1, .. })
        ));
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

    const A100_MIG: &str = r#"
system: {driverVersion: "550.54.15", cudaDriverVersion: 12040}
gpus:
  - {index: 0, minor: 0, uuid: GPU-m, name: NVIDIA A100-SXM4-80GB, brand: Nvidia,
     architecture: Ampere, cudaComputeCapabilityMajor: 8, cudaComputeCapabilityMinor: 0,
     memoryTotalBytes: 85899345920, multiprocessorCount: 108, pciBusId: "00000000:07:00.0",
     numaNode: 0, migMode: enabled,
     migDevices: [{uuid: MIG-pre, gpuInstanceId: 2, profileId: 9, placement: {start: 4, size: 4}}]}
  - {index: 1, minor: 1, uuid: GPU-d, name: NVIDIA A100-SXM4-80GB, brand: Nvidia,
     architecture: Ampere, cudaComputeCapabilityMajor: 8, cudaComputeCapabilityMinor: 0,
     memoryTotalBytes: 85899345920, multiprocessorCount: 108, pciBusId: "00000000:0F:00.0",
     numaNode: 0, migMode: disabled}
"#;

    fn a100() -> FakeBackend {
        FakeBackend::new(Topology::parse(A100_MIG, "a100").expect("valid"))
    }

    fn at(start: u32, size: u32) -> MigPlacement {
        MigPlacement { start, size }
    }

    #[test]
    fn created_mig_devices_get_the_drivers_instance_ids_and_are_listed_until_destroyed() {
        let fake = a100();
        let one = fake
            .create_mig_device(0, 19, at(1, 1))
            .expect("1g.10gb at 1");
        assert_eq!((one.gpu_instance_id, one.compute_instance_id), (8, 0));
        let two = fake
            .create_mig_device(0, 14, at(2, 2))
            .expect("2g.20gb at 2");
        assert_eq!(two.gpu_instance_id, 4);
        assert!(
            one.uuid.starts_with("MIG-") && one.uuid.len() == 40,
            "{}",
            one.uuid
        );
        assert_ne!(one.uuid, two.uuid);
        let listed: Vec<u32> = fake
            .gpu(0)
            .expect("gpu")
            .mig_devices
            .iter()
            .map(|m| m.gpu_instance_id)
            .collect();
        assert_eq!(listed, [2, 8, 4]);
        assert!(fake.destroy_mig_device(0, 8, 0).expect("destroy"));
        assert!(!fake.destroy_mig_device(0, 8, 0).expect("already gone"));
        // The topology's own device can be destroyed too; the GPU is then empty.
        assert!(fake.destroy_mig_device(0, 2, 0).expect("destroy"));
        assert!(fake.destroy_mig_device(0, 4, 0).expect("destroy"));
        assert!(fake.gpu(0).expect("gpu").mig_devices.is_empty());
        // Created again at the same place: the same id, a new UUID.
        let again = fake.create_mig_device(0, 19, at(1, 1)).expect("again");
        assert_eq!(again.gpu_instance_id, 8);
        assert_ne!(again.uuid, one.uuid);
    }

    #[test]
    fn mig_creation_follows_nvmls_placement_rules() {
        let fake = a100();
        fake.create_mig_device(0, 20, at(0, 1))
            .expect("1g.10gb+me at 0");
        let cases = [
            (1, 19, at(0, 1), "MIG mode is Disabled"),
            (0, 99, at(0, 1), "profile 99 is not a profile"),
            (0, 14, at(1, 2), "not a placement of profile 14"),
            (0, 5, at(0, 4), "overlaps GPU instance 7"),
            (0, 19, at(5, 1), "overlaps GPU instance 2"),
            (0, 20, at(1, 1), "profile 20 allows 1 instance"),
            (0, 0, at(0, 8), "overlaps"),
        ];
        for (index, profile, placement, needle) in cases {
            let err = fake
                .create_mig_device(index, profile, placement)
                .expect_err(needle)
                .to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        // Nothing refused was created.
        assert_eq!(fake.gpu(0).expect("gpu").mig_devices.len(), 2);
    }

    #[test]
    fn the_same_operations_give_the_same_uuids() {
        let (a, b) = (a100(), a100());
        for fake in [&a, &b] {
            fake.create_mig_device(0, 19, at(0, 1)).expect("create");
            fake.create_mig_device(0, 19, at(3, 1)).expect("create");
        }
        assert_eq!(a.gpu(0).expect("gpu"), b.gpu(0).expect("gpu"));
    }

    #[test]
    fn mig_devices_outlive_the_backend_in_the_state_dir() {
        let dir = tempfile::tempdir().expect("tempdir");
        let topology = Topology::parse(A100_MIG, "a100").expect("valid");
        let first = FakeBackend::new(topology.clone()).with_state_dir(dir.path());
        let made = first.create_mig_device(0, 19, at(0, 1)).expect("create");
        // A restarted plugin (a new backend on the same dir) sees it and can destroy it.
        let second = FakeBackend::new(topology.clone()).with_state_dir(dir.path());
        assert!(second.gpu(0).expect("gpu").mig_devices.contains(&made));
        assert!(
            second
                .destroy_mig_device(0, made.gpu_instance_id, 0)
                .expect("destroy")
        );
        assert!(!first.gpu(0).expect("gpu").mig_devices.contains(&made));
        let text = std::fs::read_to_string(dir.path().join("mig.json")).expect("state file");
        assert!(
            text.contains("\"created\": 1") && text.contains("GPU-m"),
            "{text}"
        );
        // A damaged state file is a named error, not a panic or an empty GPU.
        std::fs::write(dir.path().join("mig.json"), b"{").expect("write");
        let err = second.gpu(0).expect_err("corrupt").to_string();
        assert!(err.contains("mig.json"), "{err}");
    }

    #[test]
    fn injected_mig_faults_change_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake = FakeBackend::new(Topology::parse(A100_MIG, "a100").expect("valid"))
            .with_state_dir(dir.path());
        std::fs::write(dir.path().join("fail-mig-create"), b"").expect("arm");
        assert!(matches!(
            fake.create_mig_device(0, 19, at(0, 1)),
            Err(BackendError::Injected { index: 0, .. })
        ));
        std::fs::remove_file(dir.path().join("fail-mig-create")).expect("disarm");
        let made = fake.create_mig_device(0, 19, at(0, 1)).expect("create");
        fake.fail_mig_destroy(0);
        assert!(fake.destroy_mig_device(0, made.gpu_instance_id, 0).is_err());
        assert!(fake.gpu(0).expect("gpu").mig_devices.contains(&made));
        fake.fail_mig_create(0);
        assert!(fake.create_mig_device(0, 19, at(1, 1)).is_err());
        assert_eq!(fake.gpu(0).expect("gpu").mig_devices.len(), 2);
    }

    #[test]
    fn the_partitionable_pool_does_not_change_when_mig_devices_are_created() {
        use crate::model::{MigStrategy, discover};
        let fake = a100();
        let before = discover(&fake).expect("discover");
        fake.create_mig_device(0, 19, at(0, 1)).expect("create");
        fake.create_mig_device(0, 14, at(2, 2)).expect("create");
        fake.destroy_mig_device(0, 2, 0).expect("destroy");
        let after = discover(&fake).expect("discover");
        assert_ne!(
            before.mig_devices, after.mig_devices,
            "the inventory sees them"
        );
        assert_eq!(
            before.pool(MigStrategy::Partitionable),
            after.pool(MigStrategy::Partitionable)
        );
    }

    #[test]
    fn capability_minors_follow_the_drivers_numbering() {
        // Values from the mig-minors table of a real driver.
        assert_eq!(mig::capability_minor(0, 0, None), 3);
        assert_eq!(mig::capability_minor(0, 0, Some(0)), 4);
        assert_eq!(mig::capability_minor(0, 1, None), 12);
        assert_eq!(mig::capability_minor(3, 3, Some(3)), 439);
        assert_eq!(mig::capability_minor(6, 11, Some(7)), 920);
        let table = mig::capability_table(2);
        assert_eq!(table.lines().count(), 2 + 2 * 15 * 9);
        assert!(table.contains("gpu1/gi14/ci7/access 272\n"), "{table}");
    }
}
