//! Test doubles shared by the claim-controller tests: an in-memory cluster, scriptable
//! hardware, and allocated-claim builders over the fake DGX H100.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use dra_kubelet::ClaimRef;
use gpu_inventory::backend::ComputeMode;
use gpu_inventory::{FakeBackend, Gpu, Topology, discover};
use gpu_kubelet_plugin::cdi::CdiWriter;
use gpu_kubelet_plugin::checkpoint::CheckpointFile;
use gpu_kubelet_plugin::claim_config::TimeSlice;
use gpu_kubelet_plugin::claims::{ClaimController, Cluster, ControllerConfig};
use gpu_kubelet_plugin::hardware::{CreatedMig, Hardware, HardwareError, NodeDevice};
use gpu_kubelet_plugin::mps::MpsControl;
use gpu_kubelet_plugin::storage::RealFs;
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceRequestAllocationResult, OpaqueDeviceConfiguration, ResourceClaim, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

pub const DRIVER: &str = "gpu.example.com";
pub const NODE: &str = "node-a";

#[derive(Default)]
pub struct Claims {
    pub claims: Mutex<BTreeMap<String, ResourceClaim>>,
    pub gets: AtomicUsize,
    pub warnings: Mutex<Vec<String>>,
    /// While set, every lookup fails as an unreachable API server's does.
    pub unreachable: std::sync::atomic::AtomicBool,
}

/// The test's handle and the controller's share one in-memory cluster.
#[derive(Clone, Default)]
pub struct Shared(pub Arc<Claims>);

impl std::ops::Deref for Shared {
    type Target = Claims;
    fn deref(&self) -> &Claims {
        &self.0
    }
}

impl Cluster for Shared {
    async fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ResourceClaim>, kube::Error> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        if self.unreachable.load(Ordering::SeqCst) {
            return Err(kube::Error::Service("connection refused (test)".into()));
        }
        Ok(self
            .claims
            .lock()
            .unwrap()
            .get(&format!("{namespace}/{name}"))
            .cloned())
    }

    async fn warn(&self, reason: &str, message: &str) {
        self.warnings
            .lock()
            .unwrap()
            .push(format!("{reason}: {message}"));
    }
}

impl Claims {
    pub fn put(&self, c: ResourceClaim) {
        let key = format!(
            "{}/{}",
            c.metadata.namespace.clone().unwrap_or_default(),
            c.metadata.name.clone().unwrap_or_default()
        );
        self.claims.lock().unwrap().insert(key, c);
    }
}

/// Hardware whose prepare of a held device waits until the test releases it, can fail, and
/// records its calls.
#[derive(Default)]
pub struct ScriptedHardware {
    /// GPUs whose prepare waits in [`ScriptedHardware::release`] (by GPU name).
    pub held: Mutex<HashSet<String>>,
    pub released: Condvar,
    pub failing: Mutex<HashSet<String>>,
    pub calls: Mutex<Vec<String>>,
    /// Each GPU's compute mode (by GPU name; absent: default), as set.
    pub compute_modes: Mutex<std::collections::HashMap<String, ComputeMode>>,
}

impl ScriptedHardware {
    /// Makes the prepare of GPU `name` wait until [`ScriptedHardware::release`].
    pub fn hold(&self, name: &str) {
        self.held.lock().unwrap().insert(name.to_owned());
    }

    /// Lets every held prepare go on.
    pub fn release(&self) {
        self.held.lock().unwrap().clear();
        self.released.notify_all();
    }
}

impl Hardware for ScriptedHardware {
    fn prepare(&self, device: &NodeDevice) -> Result<Option<CreatedMig>, HardwareError> {
        let gpu = device.gpu();
        let held = self.held.lock().unwrap();
        drop(
            self.released
                .wait_while(held, |held| held.contains(&gpu.name))
                .unwrap(),
        );
        self.calls
            .lock()
            .unwrap()
            .push(format!("prepare {}", gpu.name));
        if self.failing.lock().unwrap().contains(&gpu.name) {
            return Err(HardwareError::Injected {
                device: gpu.name.clone(),
                message: "injected".into(),
            });
        }
        Ok(None)
    }

    fn unprepare(
        &self,
        device: &NodeDevice,
        _created: Option<&CreatedMig>,
    ) -> Result<(), HardwareError> {
        let gpu = device.gpu();
        self.calls
            .lock()
            .unwrap()
            .push(format!("unprepare {}", gpu.name));
        Ok(())
    }

    fn set_time_slice(&self, device: &NodeDevice, slice: TimeSlice) -> Result<(), HardwareError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("time-slice {} {slice:?}", device.gpu().name));
        Ok(())
    }

    /// Logs `mig-devices <gpu>`, then waits while `mig-devices` is held (as a slow NVML).
    fn mig_devices(&self, gpu: &Gpu) -> Result<Vec<CreatedMig>, HardwareError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("mig-devices {}", gpu.name));
        let held = self.held.lock().unwrap();
        drop(
            self.released
                .wait_while(held, |held| held.contains("mig-devices"))
                .unwrap(),
        );
        Ok(Vec::new())
    }

    fn compute_mode(&self, gpu: &Gpu) -> Result<ComputeMode, HardwareError> {
        Ok(self
            .compute_modes
            .lock()
            .unwrap()
            .get(&gpu.name)
            .copied()
            .unwrap_or_default())
    }

    fn set_compute_mode(
        &self,
        gpu: &gpu_inventory::Gpu,
        mode: ComputeMode,
    ) -> Result<(), HardwareError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("compute-mode {} {mode:?}", gpu.name));
        self.compute_modes
            .lock()
            .unwrap()
            .insert(gpu.name.clone(), mode);
        Ok(())
    }
}

/// MPS daemons under `root`, run by the fake control tool in tests/fakes.
pub fn mps_control(root: &Path) -> MpsControl {
    MpsControl {
        binary: drust_fakes::mps_control().to_owned(),
        root: root.to_owned(),
        start_timeout: Duration::from_secs(10),
        pods: None,
    }
}

/// `claim` with opaque configs for `DRIVER` (`(source, parameters)`, applying to all requests).
pub fn with_configs(
    mut claim: ResourceClaim,
    configs: &[(&str, serde_json::Value)],
) -> ResourceClaim {
    let devices = claim
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .expect("an allocated claim");
    devices.config = Some(
        configs
            .iter()
            .map(|(source, parameters)| DeviceAllocationConfiguration {
                source: (*source).into(),
                requests: None,
                opaque: Some(OpaqueDeviceConfiguration {
                    driver: DRIVER.into(),
                    parameters: RawExtension(parameters.clone()),
                }),
            })
            .collect(),
    );
    claim
}

pub fn claim(name: &str, uid: &str, results: &[(&str, &str, &str)]) -> ResourceClaim {
    claim_with_admin(name, uid, results, false)
}

pub fn claim_with_admin(
    name: &str,
    uid: &str,
    results: &[(&str, &str, &str)],
    admin: bool,
) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        status: (!results.is_empty()).then(|| ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(
                        results
                            .iter()
                            .map(|(driver, pool, device)| DeviceRequestAllocationResult {
                                driver: (*driver).into(),
                                pool: (*pool).into(),
                                device: (*device).into(),
                                request: "gpus".into(),
                                admin_access: admin.then_some(true),
                                ..Default::default()
                            })
                            .collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A claim holding one share of `device` (consumable capacity): `shareID` `share_id` and
/// `consumedCapacity` memory `memory` (e.g. `20Gi`), compute 0.
#[allow(dead_code)] // not every test binary uses it
pub fn share_claim(
    name: &str,
    uid: &str,
    device: &str,
    share_id: &str,
    memory: &str,
) -> ResourceClaim {
    let mut c = claim(name, uid, &[(DRIVER, NODE, device)]);
    let r = &mut results_mut(&mut c)[0];
    r.share_id = Some(share_id.into());
    r.consumed_capacity = Some(std::collections::BTreeMap::from([
        ("memory".to_owned(), Quantity(memory.into())),
        ("computePercent".to_owned(), Quantity("0".into())),
    ]));
    c
}

/// The allocation results of an allocated `claim` (made by [`claim`]).
#[allow(dead_code)] // not every test binary uses it
pub fn results_mut(
    claim: &mut ResourceClaim,
) -> &mut Vec<k8s_openapi::api::resource::v1::DeviceRequestAllocationResult> {
    claim
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut())
        .expect("an allocated claim")
}

pub fn claim_ref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub fn topology() -> Topology {
    Topology::from_file(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/topologies/dgx-h100.yaml"),
    )
    .unwrap()
}

pub fn gpus() -> Vec<Gpu> {
    discover(&FakeBackend::new(topology())).unwrap().gpus
}

/// The fake DGX H100's devices as the claim controller sees them.
pub fn node_devices() -> Vec<NodeDevice> {
    gpus().into_iter().map(NodeDevice::Gpu).collect()
}

/// The published device name of the GPU at NVML index `i`.
pub fn dev(i: usize) -> &'static str {
    Box::leak(gpus()[i].name.clone().into_boxed_str())
}

/// A claim controller over the fake DGX H100 with its CDI specs, checkpoint (`plugin/`) and MPS
/// directories under `dir`.
pub async fn controller_in(
    dir: &Path,
    cluster: Shared,
    hardware: Arc<ScriptedHardware>,
) -> ClaimController<Shared, ScriptedHardware> {
    controller_over(dir, cluster, hardware, node_devices()).await
}

/// [`controller_in`] over `devices` in place of the fake DGX H100's.
pub async fn controller_over<C: Cluster>(
    dir: &Path,
    cluster: C,
    hardware: Arc<ScriptedHardware>,
    devices: Vec<NodeDevice>,
) -> ClaimController<C, ScriptedHardware> {
    ClaimController::start(
        cluster,
        hardware,
        ControllerConfig {
            driver_name: DRIVER.into(),
            node_name: NODE.into(),
            timeout: Duration::from_secs(5),
            boot_id: "boot-1".into(),
            sharing: true,
            mps: mps_control(&dir.join("mps")),
            driver_edits: Default::default(),
            kernel_memory: None,
            claim_users: None,
            device_metadata: None,
            imex: None,
        },
        devices,
        CdiWriter::new(Arc::new(RealFs), dir.join("cdi"), DRIVER),
        CheckpointFile::new(Arc::new(RealFs), dir.join("plugin/checkpoint.json")),
    )
    .await
    .unwrap()
    .0
}
