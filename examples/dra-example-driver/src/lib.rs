//! A minimal DRA driver on [`dra_plugin`]: `count` fake devices `dev-0`, `dev-1`, ...; a
//! prepared claim's containers get `EXAMPLE_DEVICE_<n>=<device>` per allocated device and
//! `EXAMPLE_CLAIM_UID`. Preparing a device "configures" it for the claim: a durable owner file
//! `<state dir>/<device>` naming the claim, which unprepare removes; that stands for whatever a
//! real device needs set, and makes every prepare two-phase, so the lifecycle's two-phase path
//! (its records, rollback and recovery) is exercised through this driver. (The one-phase path,
//! for claims that change nothing on the node, is the GPU driver's for whole GPUs.)
//!
//! Everything else (records, locks, deadlines, rollback, CDI files, start-up recovery, the
//! kubelet's gRPC API) is the lifecycle's ([`dra_plugin::lifecycle`]).

// Errors carry the claim they are about, for the kubelet's message; they are rare.
#![allow(clippy::result_large_err)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::{ClaimRef, PreparedDevice};
use dra_plugin::allocation::{self, AllocationError, ClaimSource};
use dra_plugin::cdi::{CDI_VERSION, CdiDevice, ContainerEdits, Spec};
use dra_plugin::checkpoint::Format;
use dra_plugin::lifecycle::{Driver, Lifecycle, Planned, Prepared};
use dra_plugin::record::{ClaimRecord, Records};
use dra_plugin::storage::{Fs, remove_file, write_atomic};
use serde::{Deserialize, Serialize};

/// How long one read of a claim from the API server may take.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);

/// One prepared device as recorded in the journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// Request names from the allocation.
    pub request_names: Vec<String>,
    /// Pool (this node's name).
    pub pool_name: String,
    /// Device name.
    pub device_name: String,
    /// CDI device IDs.
    pub cdi_device_ids: Vec<String>,
}

/// The journal's format: version 1, no history.
#[derive(Debug, Clone, Copy)]
pub struct ExampleFormat;

impl Format for ExampleFormat {
    type Data = Records<Device>;
    const VERSION: u32 = 1;
    fn min_reader_version(_: &Records<Device>) -> u32 {
        1
    }
}

/// A claim this driver cannot prepare or unprepare; each names the claim and the field.
#[derive(Debug, thiserror::Error)]
pub enum ExampleError {
    /// The lifecycle's own failure.
    #[error(transparent)]
    Lifecycle(#[from] dra_plugin::lifecycle::Error),
    /// The claim could not be read, is not the kubelet's, or holds none of this node's
    /// devices of this driver.
    #[error(transparent)]
    Allocation(#[from] AllocationError),
    /// An allocated device is not one of this node's.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results[{index}].device {device:?} is \
         not a device of this node"
    )]
    UnknownDevice {
        /// The claim.
        claim: ClaimRef,
        /// Index in `results`.
        index: usize,
        /// The device.
        device: String,
    },
    /// A device's owner file could not be written or removed.
    #[error("ResourceClaim {claim}: device {device}: owner file {}: {source}", path.display())]
    Device {
        /// The claim.
        claim: ClaimRef,
        /// The device.
        device: String,
        /// The owner file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The example driver ([`Driver`]).
pub struct ExampleDriver<C> {
    /// DRA driver name.
    pub driver_name: String,
    /// This node's name, also the pool name.
    pub pool: String,
    /// The devices, by name.
    pub devices: BTreeSet<String>,
    /// Where the owner files are.
    pub state_dir: PathBuf,
    /// Every durable write.
    pub fs: Arc<dyn Fs>,
    /// Where claims are read.
    pub claims: C,
}

/// The names of `count` devices: `dev-0` to `dev-<count-1>`.
pub fn device_names(count: usize) -> BTreeSet<String> {
    (0..count).map(|i| format!("dev-{i}")).collect()
}

impl<C: ClaimSource> ExampleDriver<C> {
    fn owner_file(&self, device: &str) -> PathBuf {
        self.state_dir.join(device)
    }

    /// The CDI spec of `claim` on `devices`.
    fn spec(&self, lifecycle: &Lifecycle<Self>, claim: &ClaimRef, devices: &[Device]) -> Spec {
        let cdi = lifecycle.cdi();
        Spec {
            cdi_version: CDI_VERSION.into(),
            kind: cdi.kind(),
            devices: devices
                .iter()
                .enumerate()
                .map(|(n, d)| CdiDevice {
                    name: dra_plugin::cdi::CdiWriter::device_name(&claim.uid, &d.device_name),
                    container_edits: ContainerEdits {
                        env: vec![format!("EXAMPLE_DEVICE_{n}={}", d.device_name)],
                        ..ContainerEdits::default()
                    },
                })
                .collect(),
            container_edits: ContainerEdits {
                env: vec![format!("EXAMPLE_CLAIM_UID={}", claim.uid)],
                ..ContainerEdits::default()
            },
            // The lifecycle names the claim in the annotations.
            ..Spec::default()
        }
    }

    /// Runs blocking owner-file work off the async workers.
    async fn blocking<T: Send + 'static>(
        claim: &ClaimRef,
        work: impl FnOnce() -> Result<T, ExampleError> + Send + 'static,
    ) -> Result<T, ExampleError> {
        tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
            Err(dra_plugin::lifecycle::Error::TaskFailed {
                claim: claim.clone(),
                action: "owner file work",
                message: e.to_string(),
            }
            .into())
        })
    }
}

impl<C: ClaimSource> Driver for ExampleDriver<C> {
    type Device = Device;
    type Format = ExampleFormat;
    type Error = ExampleError;
    type Plan = Vec<Device>;
    type Orphans = Vec<String>;

    async fn plan(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
    ) -> Result<Planned<Self>, ExampleError> {
        let rc = allocation::fetch(&self.claims, claim, API_TIMEOUT).await?;
        let allocated = allocation::allocation(claim, &rc, &self.driver_name, &self.pool)?;
        let mut devices = Vec::new();
        for d in &allocated.devices {
            if !self.devices.contains(d.device) {
                return Err(ExampleError::UnknownDevice {
                    claim: claim.clone(),
                    index: d.index(),
                    device: d.device.to_owned(),
                });
            }
            devices.push(Device {
                request_names: d.request_names(),
                pool_name: d.pool.to_owned(),
                device_name: d.device.to_owned(),
                cdi_device_ids: vec![lifecycle.cdi().device_id(&claim.uid, d.device)],
            });
        }
        Ok(Planned {
            spec: Some(self.spec(lifecycle, claim, &devices)),
            two_phase: true,
            plan: devices.clone(),
            devices,
        })
    }

    /// Writes each device's owner file (durably: it is what the record says to undo).
    async fn prepare_devices(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        devices: Vec<Device>,
    ) -> Result<Prepared<Device>, ExampleError> {
        let spec = self.spec(lifecycle, claim, &devices);
        let work: Vec<(String, PathBuf)> = devices
            .iter()
            .map(|d| (d.device_name.clone(), self.owner_file(&d.device_name)))
            .collect();
        let (fs, dir, c) = (Arc::clone(&self.fs), self.state_dir.clone(), claim.clone());
        Self::blocking(claim, move || {
            for (device, path) in work {
                fs.create_dir_all(&dir)
                    .and_then(|()| write_atomic(fs.as_ref(), &path, c.uid.as_bytes()))
                    .map_err(|source| ExampleError::Device {
                        claim: c.clone(),
                        device,
                        path,
                        source,
                    })?;
            }
            Ok(())
        })
        .await?;
        Ok(Prepared { devices, spec })
    }

    fn changes_node(&self, devices: &[Device]) -> bool {
        !devices.is_empty()
    }

    /// Removes the owner files that name this claim (a device another claim owns is left).
    async fn unprepare_devices(
        &self,
        _: &Lifecycle<Self>,
        claim: &ClaimRef,
        record: &ClaimRecord<Device>,
        _: bool,
    ) -> Result<(), ExampleError> {
        let files: Vec<(String, PathBuf)> = record
            .devices
            .iter()
            .map(|d| (d.device_name.clone(), self.owner_file(&d.device_name)))
            .collect();
        let (fs, c) = (Arc::clone(&self.fs), claim.clone());
        Self::blocking(claim, move || {
            for (device, path) in files {
                let mine = owner(fs.as_ref(), &path).map_err(|source| ExampleError::Device {
                    claim: c.clone(),
                    device: device.clone(),
                    path: path.clone(),
                    source,
                })?;
                // Another claim's file (this one's prepare never wrote it) is left alone.
                if mine.as_deref() != Some(c.uid.as_str()) {
                    continue;
                }
                remove_file(fs.as_ref(), &path).map_err(|source| ExampleError::Device {
                    claim: c.clone(),
                    device,
                    path,
                    source,
                })?;
            }
            Ok(())
        })
        .await
    }

    fn prepared_device(device: &Device) -> PreparedDevice {
        PreparedDevice {
            request_names: device.request_names.clone(),
            pool_name: device.pool_name.clone(),
            device_name: device.device_name.clone(),
            cdi_device_ids: device.cdi_device_ids.clone(),
            share_id: None,
        }
    }

    /// The devices the spec names, when the claim still exists with this UID.
    async fn rebuild_claim(
        &self,
        lifecycle: &Lifecycle<Self>,
        claim: &ClaimRef,
        spec: &Spec,
    ) -> Option<Vec<Device>> {
        match self.claims.get(&claim.namespace, &claim.name).await {
            Ok(Some(rc)) if rc.metadata.uid.as_deref() == Some(claim.uid.as_str()) => {}
            Ok(_) => return None,
            // Its pods may still run: keep it as the spec shows.
            Err(e) => {
                tracing::warn!(claim = %claim, error = %e, "cannot check a recovered claim; keeping it")
            }
        }
        let prefix = format!("{}-", claim.uid);
        Some(
            spec.devices
                .iter()
                .filter_map(|d| d.name.strip_prefix(&prefix))
                .filter(|name| self.devices.contains(*name))
                .map(|name| Device {
                    request_names: Vec::new(),
                    pool_name: self.pool.clone(),
                    device_name: name.to_owned(),
                    cdi_device_ids: vec![lifecycle.cdi().device_id(&claim.uid, name)],
                })
                .collect(),
        )
    }

    /// The claim exists with its UID.
    async fn claim_exists(&self, _: &Lifecycle<Self>, claim: &ClaimRef) -> Result<bool, String> {
        let rc = self.claims.get(&claim.namespace, &claim.name).await?;
        Ok(rc.is_some_and(|rc| rc.metadata.uid.as_deref() == Some(claim.uid.as_str())))
    }

    /// Removes owner files of claims not kept.
    async fn remove_orphans(&self, _: &Lifecycle<Self>, kept: &BTreeSet<String>) -> Vec<String> {
        let files: Vec<PathBuf> = self.devices.iter().map(|d| self.owner_file(d)).collect();
        let (fs, kept) = (Arc::clone(&self.fs), kept.clone());
        let work = move || {
            let mut removed = Vec::new();
            for path in files {
                match owner(fs.as_ref(), &path) {
                    Ok(Some(o)) if !kept.contains(&o) => {}
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e,
                            "cannot read an owner file; retried at the next start");
                        continue;
                    }
                }
                match remove_file(fs.as_ref(), &path) {
                    Ok(()) => removed.push(path.display().to_string()),
                    Err(e) => tracing::warn!(path = %path.display(), error = %e,
                        "removing an orphaned owner file failed; retried at the next start"),
                }
            }
            removed
        };
        tokio::task::spawn_blocking(work).await.unwrap_or_default()
    }
}

/// The claim UID in the owner file at `path`; `None` when there is none.
///
/// # Errors
/// A read error other than absence.
fn owner(fs: &dyn Fs, path: &std::path::Path) -> std::io::Result<Option<String>> {
    match fs.read(path) {
        Ok(bytes) => Ok(Some(String::from_utf8_lossy(&bytes).into_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}
