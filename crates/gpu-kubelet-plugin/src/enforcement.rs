//! Which level enforces the limits of full GPUs' shares on this node: `kernel` where
//! [`KernelMemory::detect`] finds all it needs, else `mps`; the log says which and why.

use std::sync::Arc;

use gpu_inventory::GpuBackend;
use tracing::{info, warn};

use crate::config::Config;
use crate::memory_limits::KernelMemory;

/// The `kernel` level's memory limits where this node has that level, `None` for the `mps`
/// level. Installs the CDI hook unless `--dry-run`; detection runs off the async workers, and
/// its failing (a panic included) leaves the `mps` level, logged.
pub(crate) async fn detect(
    config: &Config,
    backend: &Arc<dyn GpuBackend>,
) -> Option<Arc<KernelMemory>> {
    let (config2, backend2) = (config.clone(), Arc::clone(backend));
    let install = config.dry_run.is_none();
    let detected = tokio::task::spawn_blocking(move || {
        KernelMemory::detect(&config2, backend2.as_ref(), install)
    })
    .await
    .map_err(|e| e.to_string());
    match detected {
        Ok(Ok(kernel)) => {
            info!(cgroup_root = %config.cgroup_root.display(),
                "shares of full GPUs are enforced at the kernel level: each share container's cgroup \
                 gets a hard GPU memory limit, each share its own MPS v3 namespace");
            Some(Arc::new(kernel))
        }
        Ok(Err(reason)) => {
            info!(%reason, "shares of full GPUs are enforced at the mps level");
            None
        }
        Err(join) => {
            warn!(error = %join, "detecting the kernel enforcement level failed; the mps level applies");
            None
        }
    }
}
