//! Becoming the active instance: waiting for the active lock while another instance holds it
//! (a rolling update runs two side by side), then recovering the claims and opening the gate
//! to the kubelet's calls.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use gpu_inventory::{GpuBackend, Inventory};
use tracing::{info, warn};

use crate::active::{AbortOnDrop, Active};
use crate::cdi::CdiWriter;
use crate::checkpoint::CheckpointFile;
use crate::claim_users::ClaimUsers;
use crate::claims::{ClaimController, ControllerConfig, KubeCluster};
use crate::config::Config;
use crate::discovery::driver_files;
use crate::error::Error;
use crate::hardware::{self, BackendHardware};
use crate::instance::{self, Activation, ActiveLock};
use crate::memory_limits::KernelMemory;
use crate::metrics::Metrics;
use crate::mps;
use crate::storage::{Fs, RealFs};

/// Takes the active lock, waiting while another instance holds it.
///
/// # Errors
/// [`Error::Instance`] when the lock file cannot be opened or locked.
pub(crate) async fn wait_for_lock(lock_path: &Path) -> Result<ActiveLock, Error> {
    if let Some(lock) = ActiveLock::try_acquire(lock_path)? {
        return Ok(lock);
    }
    info!(lock = %lock_path.display(),
        "another instance is active; standing by until it releases the lock");
    let waiting = Instant::now();
    let lock = ActiveLock::acquire(lock_path, instance::LOCK_POLL).await?;
    info!(waited = ?waiting.elapsed(), "the other instance released the active lock");
    Ok(lock)
}

/// The GPUs found at start: the open backend, the first inventory and the `kernel` level's
/// memory limits where the node has them.
pub(crate) struct Found<'a> {
    /// The open backend.
    pub(crate) backend: &'a Arc<dyn GpuBackend>,
    /// The first inventory.
    pub(crate) inventory: &'a Inventory,
    /// The `kernel` level's memory limits; `None`: the `mps` level.
    pub(crate) kernel_memory: Option<Arc<KernelMemory>>,
    /// The IMEX channels published ([`crate::imex::detect`]).
    pub(crate) imex: Option<gpu_inventory::imex::ImexChannels>,
}

/// Holding the lock: recovers the claims and opens the gate. On success the claims flow; the
/// caller then starts [`Active::run_tasks`].
///
/// # Errors
/// [`Error::BootId`], [`Error::Backend`] (the driver version for the driver's files) or
/// [`Error::Claims`] when the prepared claims cannot be reconciled.
pub(crate) async fn take_over(
    lock: ActiveLock,
    config: &Config,
    client: kube::Client,
    found: Found<'_>,
    activation: &Activation<KubeCluster, BackendHardware>,
    metrics: &Arc<Metrics>,
) -> Result<Active, Error> {
    let Found {
        backend,
        inventory,
        kernel_memory,
        imex,
    } = found;
    let recovering = Instant::now();
    let boot_id = std::fs::read_to_string(&config.boot_id_path)
        .map_err(|source| Error::BootId {
            path: config.boot_id_path.clone(),
            source,
        })?
        .trim()
        .to_owned();
    let driver_edits = driver_files(config, backend).await?;
    let claim_users = claim_users(config).await;
    let fs: Arc<dyn Fs> = Arc::new(RealFs);
    let (controller, _report) = ClaimController::start(
        KubeCluster::new(client.clone(), &config.driver_name, &config.node_name)
            .with_timeout(config.api_timeout),
        Arc::new(
            BackendHardware::new(Arc::clone(backend), &config.dev_root, &config.proc_root)
                .with_host_dev_root(
                    config
                        .host_dev_root
                        .as_ref()
                        .unwrap_or(&config.dev_root)
                        .clone(),
                ),
        ),
        ControllerConfig {
            driver_name: config.driver_name.clone(),
            node_name: config.node_name.clone(),
            timeout: config.claim_timeout,
            boot_id,
            sharing: config.sharing,
            mps: mps::MpsControl {
                binary: config.mps_control_binary.clone(),
                root: config.mps_root.clone(),
                start_timeout: config.mps_start_timeout,
                pods: config.mps_daemon_pods.as_ref().map(|pods| mps::DaemonPods {
                    client: client.clone(),
                    namespace: pods.namespace.clone(),
                    node_name: config.node_name.clone(),
                    image: pods.image.clone(),
                    pull_policy: pods.pull_policy.clone(),
                    priority_class: pods.priority_class.clone(),
                    host_driver_root: config.driver_root.host_root.clone(),
                    daemon_binary: daemon_binary(config),
                    owner: pods.owner.clone().map(mps::DaemonSetOwner::new),
                }),
            },
            driver_edits,
            kernel_memory,
            claim_users,
            device_metadata: config.device_metadata.then(|| {
                Arc::new(crate::device_metadata::DeviceMetadata::new(
                    &config.sockets.plugin_dir,
                    &config.driver_name,
                ))
            }),
            imex,
        },
        hardware::node_devices(inventory, config.mig_strategy).into_values(),
        CdiWriter::new(Arc::clone(&fs), &config.cdi_root, &config.driver_name)
            .with_legacy_claim_annotations(crate::config::LEGACY_CLAIM_ANNOTATIONS),
        CheckpointFile::new(fs, &config.checkpoint_path),
    )
    .await?;
    // Claims flow from here on; the slices of the previous instance are still in place.
    activation.send_replace(Some(controller.clone()));
    info!(recovery = ?recovering.elapsed(), "active: serving claims");
    // Claims whose recovery failed are retried by the controller; the gauge follows.
    let mut failing = controller.recovery_failures();
    let gauge = Arc::clone(metrics);
    let failures = tokio::spawn(async move {
        loop {
            gauge.set_recovery_failing(*failing.borrow_and_update());
            if failing.changed().await.is_err() {
                break;
            }
        }
    });
    Ok(Active::new(lock, controller, vec![AbortOnDrop(failures)]))
}

/// The MPS control tool as a daemon Pod runs it, relative to the driver root it chroots into:
/// `--mps-control-binary` under `--driver-root` (the chart's case), else the tool's usual place.
fn daemon_binary(config: &Config) -> PathBuf {
    config
        .mps_control_binary
        .strip_prefix(&config.driver_root.root)
        .ok()
        .filter(|relative| !relative.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("usr/bin/nvidia-cuda-mps-control"))
}

/// The claim-user hook ([`crate::claim_users`]), installed in the plugin directory; `None`, with
/// a warning, when the hook binary cannot be installed (a claim reserved for no pod is then
/// listed with the pods the kubelet names, without UIDs).
async fn claim_users(config: &Config) -> Option<Arc<ClaimUsers>> {
    let (binary, plugin_dir) = (
        config.cdi_hook_binary.clone(),
        config.sockets.plugin_dir.clone(),
    );
    let dir = plugin_dir.clone();
    let installed = tokio::task::spawn_blocking(move || {
        crate::memory_limits::install_hook(&binary, &dir, true)
    })
    .await;
    match installed {
        Ok(Ok(hook)) => Some(Arc::new(ClaimUsers::new(hook, &plugin_dir))),
        Ok(Err((path, e))) => {
            warn!(path = %path.display(), error = %e,
                "installing the CDI hook failed: the pods of PodGroup claims are named without UIDs");
            None
        }
        Err(e) => {
            warn!(error = %e, "installing the CDI hook failed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Backend;

    #[test]
    fn an_mps_daemon_pod_runs_the_configured_tool_inside_the_driver_root() {
        let mut config = Config::new("gpu.drust.dev", "node-a", Backend::Nvml { library: None });
        assert_eq!(
            daemon_binary(&config),
            Path::new("usr/bin/nvidia-cuda-mps-control")
        );
        config.driver_root.root = "/driver-root".into();
        config.mps_control_binary = "/driver-root/opt/nvidia/bin/nvidia-cuda-mps-control".into();
        assert_eq!(
            daemon_binary(&config),
            Path::new("opt/nvidia/bin/nvidia-cuda-mps-control")
        );
        config.mps_control_binary = "/elsewhere/nvidia-cuda-mps-control".into();
        assert_eq!(
            daemon_binary(&config),
            Path::new("usr/bin/nvidia-cuda-mps-control")
        );
    }
}
