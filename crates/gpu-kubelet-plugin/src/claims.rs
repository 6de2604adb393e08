//! The claim controller's prepare and unprepare, as the kubelet's [`Driver`].
//!
//! Prepare, per claim: read the ResourceClaim from the API server, check its UID and that its
//! allocation has results for this driver in this node's pool, write one CDI spec for the claim,
//! record it in the checkpoint, and answer with the CDI device IDs. A claim already in the
//! checkpoint gets the recorded answer again. Unprepare removes the spec and the record; unknown
//! claims succeed.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;

use dra_kubelet::{ClaimRef, Driver, PrepareResult, PreparedDevice, UnprepareResult};
use gpu_inventory::Gpu;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use tokio::sync::Mutex;
use tracing::info;

use crate::cdi::{CDI_VERSION, CdiDevice, CdiError, CdiWriter, ContainerEdits, DeviceNode, Spec};
use crate::checkpoint::{Checkpoint, CheckpointError, CheckpointFile, ClaimRecord, RecordedDevice};

/// Where ResourceClaims come from: the API server in production, a map in unit tests.
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `namespace/name`, `Ok(None)` when it does not exist.
    fn get(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<ResourceClaim>, kube::Error>> + Send;
}

impl ClaimSource for kube::Client {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
        Api::<ResourceClaim>::namespaced(self.clone(), namespace)
            .get_opt(name)
            .await
    }
}

/// Why one claim could not be prepared or unprepared. Messages name the claim and the field.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The API server could not be asked.
    #[error("ResourceClaim {claim}: reading it from the API server: {source}")]
    Fetch {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: kube::Error,
    },
    /// The claim does not exist.
    #[error("ResourceClaim {claim}: not found")]
    NotFound {
        /// The claim.
        claim: ClaimRef,
    },
    /// The claim was deleted and re-created under the same name.
    #[error("ResourceClaim {claim}: metadata.uid is {found:?}, the kubelet asked for {}", claim.uid)]
    UidMismatch {
        /// The claim as requested.
        claim: ClaimRef,
        /// The UID found in the API server.
        found: String,
    },
    /// The claim has no allocation.
    #[error("ResourceClaim {claim}: status.allocation is not set; the claim is not allocated")]
    NotAllocated {
        /// The claim.
        claim: ClaimRef,
    },
    /// The allocation has no results for this driver and node.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results has no device of driver \
         {driver} in pool {pool}"
    )]
    NotOurs {
        /// The claim.
        claim: ClaimRef,
        /// This driver.
        driver: String,
        /// This node's pool.
        pool: String,
    },
    /// An allocated device is not in this node's inventory.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results[{index}].device {device:?} is \
         not a device of this node"
    )]
    UnknownDevice {
        /// The claim.
        claim: ClaimRef,
        /// Index in `results`.
        index: usize,
        /// The device name.
        device: String,
    },
    /// The CDI spec could not be written or removed.
    #[error("ResourceClaim {claim}: {source}")]
    Cdi {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: CdiError,
    },
    /// The checkpoint could not be written.
    #[error("ResourceClaim {claim}: {source}")]
    Checkpoint {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: CheckpointError,
    },
}

/// Prepares and unprepares claims for one driver on one node.
pub struct ClaimController<S> {
    source: S,
    driver_name: String,
    node_name: String,
    gpus: BTreeMap<String, Gpu>,
    cdi: CdiWriter,
    checkpoint_file: CheckpointFile,
    checkpoint: Mutex<Checkpoint>,
}

impl<S: ClaimSource> ClaimController<S> {
    /// A controller for `gpus` (by device name), resuming from `checkpoint_file`.
    ///
    /// # Errors
    /// [`CheckpointError`] when the checkpoint exists but cannot be read.
    pub fn new(
        source: S,
        driver_name: &str,
        node_name: &str,
        gpus: impl IntoIterator<Item = Gpu>,
        cdi: CdiWriter,
        checkpoint_file: CheckpointFile,
    ) -> Result<Self, CheckpointError> {
        let checkpoint = checkpoint_file.load()?;
        Ok(Self {
            source,
            driver_name: driver_name.to_owned(),
            node_name: node_name.to_owned(),
            gpus: gpus.into_iter().map(|g| (g.name.clone(), g)).collect(),
            cdi,
            checkpoint_file,
            checkpoint: Mutex::new(checkpoint),
        })
    }

    /// The UIDs of the claims currently prepared.
    pub async fn prepared_claims(&self) -> Vec<String> {
        self.checkpoint
            .lock()
            .await
            .claims
            .keys()
            .cloned()
            .collect()
    }

    async fn prepare_one(&self, claim: ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        if let Some(record) = self.checkpoint.lock().await.claims.get(&claim.uid) {
            return Ok(record.devices.iter().map(PreparedDevice::from).collect());
        }
        let rc = self
            .source
            .get(&claim.namespace, &claim.name)
            .await
            .map_err(|source| ClaimError::Fetch {
                claim: claim.clone(),
                source,
            })?
            .ok_or_else(|| ClaimError::NotFound {
                claim: claim.clone(),
            })?;
        let uid = rc.metadata.uid.clone().unwrap_or_default();
        if uid != claim.uid {
            return Err(ClaimError::UidMismatch { claim, found: uid });
        }
        let results = rc
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .ok_or_else(|| ClaimError::NotAllocated {
                claim: claim.clone(),
            })?;

        let mut devices = Vec::new();
        let mut cdi_devices = Vec::new();
        let mut uuids = Vec::new();
        for (index, r) in results.iter().enumerate() {
            if r.driver != self.driver_name || r.pool != self.node_name {
                continue;
            }
            let gpu = self
                .gpus
                .get(&r.device)
                .ok_or_else(|| ClaimError::UnknownDevice {
                    claim: claim.clone(),
                    index,
                    device: r.device.clone(),
                })?;
            uuids.push(gpu.raw.uuid.clone());
            cdi_devices.push(CdiDevice {
                name: CdiWriter::device_name(&claim.uid, &r.device),
                container_edits: ContainerEdits {
                    env: Vec::new(),
                    device_nodes: vec![DeviceNode {
                        path: format!("/dev/nvidia{}", gpu.raw.minor),
                    }],
                },
            });
            devices.push(RecordedDevice {
                request_names: vec![r.request.clone()],
                pool_name: r.pool.clone(),
                device_name: r.device.clone(),
                cdi_device_ids: vec![self.cdi.device_id(&claim.uid, &r.device)],
            });
        }
        if devices.is_empty() {
            return Err(ClaimError::NotOurs {
                claim,
                driver: self.driver_name.clone(),
                pool: self.node_name.clone(),
            });
        }

        let spec = Spec {
            cdi_version: CDI_VERSION.to_owned(),
            kind: self.cdi.kind(),
            devices: cdi_devices,
            // One spec per claim, so the claim's GPUs are listed together for the runtime hook.
            container_edits: ContainerEdits {
                env: vec![format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(","))],
                device_nodes: Vec::new(),
            },
        };
        let cdi_spec: PathBuf =
            self.cdi
                .write(&claim.uid, &spec)
                .map_err(|source| ClaimError::Cdi {
                    claim: claim.clone(),
                    source,
                })?;

        let mut checkpoint = self.checkpoint.lock().await;
        // A concurrent call for the same claim may have finished first; its answer stands.
        if let Some(record) = checkpoint.claims.get(&claim.uid) {
            return Ok(record.devices.iter().map(PreparedDevice::from).collect());
        }
        let mut next = checkpoint.clone();
        next.claims.insert(
            claim.uid.clone(),
            ClaimRecord {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                devices: devices.clone(),
                cdi_spec,
            },
        );
        self.checkpoint_file
            .store(&next)
            .map_err(|source| ClaimError::Checkpoint {
                claim: claim.clone(),
                source,
            })?;
        *checkpoint = next;
        info!(claim = %claim, devices = devices.len(), "prepared");
        Ok(devices.iter().map(PreparedDevice::from).collect())
    }

    async fn unprepare_one(&self, claim: ClaimRef) -> Result<(), ClaimError> {
        let mut checkpoint = self.checkpoint.lock().await;
        self.cdi
            .remove(&claim.uid)
            .map_err(|source| ClaimError::Cdi {
                claim: claim.clone(),
                source,
            })?;
        if checkpoint.claims.contains_key(&claim.uid) {
            let mut next = checkpoint.clone();
            next.claims.remove(&claim.uid);
            self.checkpoint_file
                .store(&next)
                .map_err(|source| ClaimError::Checkpoint {
                    claim: claim.clone(),
                    source,
                })?;
            *checkpoint = next;
            info!(claim = %claim, "unprepared");
        }
        Ok(())
    }
}

impl<S: ClaimSource> Driver for ClaimController<S> {
    type Error = ClaimError;

    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult<ClaimError>> {
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let results =
            futures::future::join_all(claims.into_iter().map(|c| self.prepare_one(c))).await;
        uids.into_iter().zip(results).collect()
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, UnprepareResult<ClaimError>> {
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let results =
            futures::future::join_all(claims.into_iter().map(|c| self.unprepare_one(c))).await;
        uids.into_iter().zip(results).collect()
    }
}
