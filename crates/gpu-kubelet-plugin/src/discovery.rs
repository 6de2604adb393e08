//! What this node has: the GPU backend opened as configured, the GPUs it discovers (the
//! inventory), and the driver's files that CDI specs hand to containers.

use std::sync::Arc;

use gpu_inventory::{FakeBackend, GpuBackend, Inventory, NvmlBackend};
use tracing::{info, warn};

use crate::cdi::ContainerEdits;
use crate::config::{Backend, Config};
use crate::error::Error;

/// Opens the configured backend.
///
/// # Errors
/// [`Error::Topology`] or [`Error::Backend`].
pub fn open_backend(config: &Config) -> Result<Arc<dyn GpuBackend>, Error> {
    Ok(match &config.backend {
        Backend::Fake {
            topology,
            state_dir,
        } => {
            // Follows its file: an edited topology acts like changed hardware.
            let fake = FakeBackend::from_file(topology)?;
            Arc::new(match state_dir {
                Some(dir) => fake.with_state_dir(dir),
                None => fake,
            })
        }
        Backend::Nvml { library } => Arc::new(
            NvmlBackend::load(
                library.as_deref().map(|p| p.as_os_str()),
                config.sysfs_root.clone(),
            )?
            // A hung nvidia-smi holds its GPU's lock: never longer than one claim's deadline.
            .with_tool_timeout(config.claim_timeout),
        ),
    })
}

/// Opens the configured backend and discovers the inventory.
///
/// # Errors
/// [`Error::Topology`], [`Error::Backend`] or [`Error::Discovery`].
pub fn discover(config: &Config) -> Result<Inventory, Error> {
    rediscover(open_backend(config)?.as_ref(), config.naming)
}

/// Discovers again for re-publication, through the open backend: NVML is asked again, a fake
/// backend re-reads its topology file ([`FakeBackend::from_file`]), so the devices prepare
/// acts on are always those just discovered.
///
/// # Errors
/// [`Error::Discovery`].
pub fn rediscover(
    backend: &dyn GpuBackend,
    naming: gpu_inventory::Naming,
) -> Result<Inventory, Error> {
    Ok(gpu_inventory::discover_with(backend, naming)?)
}

/// The CDI edits of the driver's files under `config.driver_root`, for the driver version NVML
/// reports (blocking work, off the async workers). Missing files are logged, not fatal: the
/// plugin still serves claims (device nodes alone are enough for containers that bring their
/// own driver libraries), but says that CUDA containers will not find the driver.
///
/// # Errors
/// [`Error::Backend`] when the backend cannot tell the driver version.
pub(crate) async fn driver_files(
    config: &Config,
    backend: &Arc<dyn GpuBackend>,
) -> Result<ContainerEdits, Error> {
    let (root, backend) = (config.driver_root.clone(), Arc::clone(backend));
    let files = tokio::task::spawn_blocking(move || {
        let version = backend.system().map(|s| s.driver_version)?;
        Ok::<_, gpu_inventory::BackendError>(root.discover(&version))
    })
    .await
    .unwrap_or_else(|join| std::panic::resume_unwind(join.into_panic()))?;
    if files.missing_libcuda() {
        warn!(driver_root = %config.driver_root.root.display(), version = %files.version,
            "libcuda.so.<driver version> not found under the driver root: CUDA containers \
             will not find the driver (set --driver-root to the driver installation)");
    }
    info!(
        libraries = files.libraries.len(),
        binaries = files.binaries.len(),
        firmware = files.firmware.len(),
        sockets = files.sockets.len(),
        hook = ?files.hook,
        "driver files for CDI specs"
    );
    Ok(files.container_edits())
}
