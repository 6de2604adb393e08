//! What this node publishes and when: the pool made from the inventory ([`Publishing`]), the
//! first publication waiting out the API server, and what takes each rediscovered inventory
//! before its pool goes out ([`Followers`]). The ResourceSlices themselves are written by
//! [`crate::publisher`].

use std::sync::Arc;
use std::time::Duration;

use gpu_inventory::shares::ShareEnforcement;
use gpu_inventory::{GpuBackend, Inventory, Pool};
use tracing::{info, warn};

use crate::claims::{ClaimController, KubeCluster};
use crate::config::Config;
use crate::enforcement;
use crate::fabric::{FabricTaints, Watched};
use crate::hardware::{self, BackendHardware};
use crate::health;
use crate::memory_limits::KernelMemory;
use crate::mps;
use crate::publisher::SlicePublisher;

/// How this node's inventory becomes its published pool.
#[derive(Debug, Clone)]
pub struct Publishing {
    /// The driver: the domain of the taint keys.
    pub driver: String,
    /// How MIG-capable GPUs are published.
    pub strategy: gpu_inventory::MigStrategy,
    /// Whether devices are published for consumable capacity (fractional GPUs): the flag, and
    /// the MPS control tool found to enforce the shares.
    pub shares: bool,
    /// How full GPUs' shares are enforced: [`ShareEnforcement::Kernel`] where the node has the
    /// `kernel` level ([`KernelMemory::detect`]), else [`ShareEnforcement::Mps`].
    pub enforcement: ShareEnforcement,
    /// The GPUs' NVLink fabric taints and when each condition was first seen (shared by
    /// clones: the pool of every rediscovery keeps the times).
    pub fabric: FabricTaints,
    /// The IMEX channels published after the GPUs ([`crate::imex::detect`]); `None`: none.
    pub imex: Option<gpu_inventory::imex::ImexChannels>,
}

impl Publishing {
    /// The pool of `inventory`: its devices under the MIG strategy, shareable with `shares`
    /// ([`gpu_inventory::shares`]), each device tainted with its GPU's NVLink fabric
    /// conditions ([`crate::fabric`]), then the IMEX channels, carrying the node's clique
    /// ([`gpu_inventory::imex`]).
    pub fn pool(&self, inventory: &Inventory) -> Pool {
        let mut pool = inventory.pool(self.strategy);
        if self.shares {
            gpu_inventory::shares::publish_shares(&mut pool, self.enforcement);
        }
        self.fabric.apply(
            &self.driver,
            inventory,
            &mut pool,
            std::time::SystemTime::now(),
        );
        if let Some(imex) = &self.imex {
            let clique = gpu_inventory::imex::node_clique(inventory);
            pool.devices.extend(imex.devices(clique.as_deref()));
        }
        pool
    }

    /// `config`'s publishing: fractional GPUs only when asked for and the MPS control tool is
    /// found (limits nobody can enforce are never handed out; a warning says so).
    pub async fn of(config: &Config) -> Self {
        let shares = config.consumable_capacity && {
            let binary = config.mps_control_binary.clone();
            let found = tokio::task::spawn_blocking(move || mps::find_binary(&binary))
                .await
                .ok()
                .flatten();
            match found {
                Some(path) => {
                    info!(mps_control = %path.display(),
                        "fractional GPUs: devices are published for consumable capacity");
                    true
                }
                None => {
                    warn!(mps_control = %config.mps_control_binary.display(),
                        "fractional GPUs asked for (--consumable-capacity), but the MPS control \
                         tool is not found: shares could not be enforced, so devices are \
                         published for exclusive use only");
                    false
                }
            }
        };
        Self {
            driver: config.driver_name.clone(),
            strategy: config.mig_strategy,
            shares,
            enforcement: ShareEnforcement::Mps,
            fabric: FabricTaints::default(),
            imex: {
                let (path, wanted) = (config.proc_devices.clone(), config.imex_channels);
                tokio::task::spawn_blocking(move || crate::imex::detect(&path, wanted))
                    .await
                    .ok()
                    .flatten()
            },
        }
    }

    /// Finds out whether full GPUs' shares get the `kernel` level (when shares are published at
    /// all), installing the CDI hook unless `--dry-run`; says which level applies and why.
    /// Returns the `kernel` level's memory limits, `None` for the `mps` level.
    pub async fn detect_kernel_memory(
        &mut self,
        config: &Config,
        backend: &Arc<dyn GpuBackend>,
    ) -> Option<Arc<KernelMemory>> {
        if !self.shares {
            return None;
        }
        let kernel = enforcement::detect(config, backend).await;
        if kernel.is_some() {
            self.enforcement = ShareEnforcement::Kernel;
        }
        kernel
    }
}

/// What follows each new inventory before it is published: the claim controller (which
/// devices prepare accepts), the health monitor (which GPUs it watches) and the fabric watch
/// (which answers it compares with). Publishing after
/// them means the scheduler never sees a device that prepare would refuse or whose faults
/// nobody watches.
pub(crate) struct Followers {
    /// Told the devices prepare accepts.
    pub(crate) controller: ClaimController<KubeCluster, BackendHardware>,
    /// Told the GPUs to watch, with health monitoring.
    pub(crate) health: Option<health::WatchedGpus>,
    /// Makes the pool.
    pub(crate) publishing: Publishing,
    /// Told the node's NVLink clique, with `--node-clique-label`.
    pub(crate) clique: Option<tokio::sync::watch::Sender<crate::node_label::NodeClique>>,
    /// Told the GPUs' fabric answers, which the fabric watch compares with.
    pub(crate) fabric: tokio::sync::watch::Sender<Watched>,
}

impl Followers {
    /// Hands `inventory` to the followers (blocking-safe: no await) and returns its pool.
    pub(crate) fn follow(&self, inventory: &Inventory) -> Pool {
        let (added, removed) = self
            .controller
            .set_devices(hardware::node_devices(inventory, self.publishing.strategy).into_values());
        if !added.is_empty() || !removed.is_empty() {
            info!(
                ?added,
                ?removed,
                "devices changed: new ones accepted for claims, gone ones refused (their prepared \
                 claims stay)"
            );
        }
        if let Some(health) = &self.health {
            health.set(inventory.gpus.iter().map(|g| g.raw.uuid.clone()).collect());
        }
        Watched::follow(&self.fabric, inventory);
        if let Some(clique) = &self.clique {
            let now = crate::node_label::NodeClique::of(inventory);
            clique.send_if_modified(|c| {
                let changed = *c != now;
                *c = now;
                changed
            });
        }
        self.publishing.pool(inventory)
    }
}

/// The longest wait between two tries of the first publication.
const PUBLISH_RETRY_CAP: Duration = Duration::from_secs(10);

/// Start-up publishing waits out an unavailable or unreachable API server for as long as it
/// takes: tries 1 s apart, doubling up to [`PUBLISH_RETRY_CAP`], each failure logged. Giving
/// up would only crash-loop the pod (a restart cannot reach the server either) and hide the
/// cause behind a back-off; meanwhile `/readyz` says the instance is still publishing, and the
/// caller stops waiting on shutdown.
pub(crate) async fn publish_with_retry(publisher: &SlicePublisher, pool: &Pool) {
    let mut delay = Duration::from_secs(1);
    let mut attempt = 1u64;
    loop {
        match publisher.publish_pool(pool).await {
            Ok(outcome) => {
                info!(?outcome, attempt, "ResourceSlices in place");
                return;
            }
            Err(e) => {
                warn!(error = %e, attempt, retry_in = ?delay,
                    "publishing ResourceSlices failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(PUBLISH_RETRY_CAP);
                attempt += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tray() -> Inventory {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/topologies/gb200-nvl-tray.yaml");
        let backend = gpu_inventory::FakeBackend::from_file(path).expect("topology");
        gpu_inventory::discover(&backend).expect("inventory")
    }

    fn publishing(imex: Option<gpu_inventory::imex::ImexChannels>) -> Publishing {
        Publishing {
            driver: "gpu.drust.dev".into(),
            strategy: gpu_inventory::MigStrategy::Existing,
            shares: false,
            enforcement: ShareEnforcement::Mps,
            fabric: FabricTaints::default(),
            imex,
        }
    }

    #[test]
    fn the_channels_follow_the_gpus_with_the_nodes_clique() {
        let inventory = tray();
        let gpus = inventory.gpus.len();
        let without = publishing(None).pool(&inventory);
        assert_eq!(without.devices.len(), gpus);
        let with = publishing(Some(gpu_inventory::imex::ImexChannels {
            major: 235,
            count: 2,
        }))
        .pool(&inventory);
        let names: Vec<&str> = with.devices[gpus..]
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(names, ["imex-channel-0", "imex-channel-1"]);
        let clique = with.devices[gpus]
            .attributes
            .as_ref()
            .and_then(|a| a.get("nvlinkClique"))
            .and_then(|a| a.string.clone());
        assert_eq!(clique, inventory.gpus[0].nvlink_clique);
        assert!(clique.is_some());
    }
}
