//! What only the active instance holds and runs, and how it stops: the active lock, the claim
//! controller, and the background work (the first publication, then the periodic tasks, the
//! GPU health monitor and what carries its verdicts, usage sampling). How an instance becomes
//! the active one is the take-over's job, above this.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use gpu_inventory::{GpuBackend, Inventory, Pool};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::claims::{ClaimController, KubeCluster};
use crate::config::Config;
use crate::discovery::rediscover;
use crate::fabric;
use crate::hardware::BackendHardware;
use crate::health;
use crate::health_record;
use crate::instance::ActiveLock;
use crate::metrics::Metrics;
use crate::node_label;
use crate::publisher::{self, SlicePublisher};
use crate::publishing::{Followers, Publishing, publish_with_retry};
use crate::usage;

/// Aborts the task when dropped.
pub(crate) struct AbortOnDrop<T>(pub(crate) JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A task that runs `check` on (a clone of) `controller` every `period`, the first after one
/// period, until it is aborted.
fn every<F, Fut>(
    period: Duration,
    controller: &ClaimController<KubeCluster, BackendHardware>,
    check: F,
) -> JoinHandle<()>
where
    F: Fn(ClaimController<KubeCluster, BackendHardware>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let controller = controller.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.tick().await;
        loop {
            tick.tick().await;
            check(controller.clone()).await;
        }
    })
}

/// Where device health goes besides the slices' taints.
pub(crate) struct Health<'a> {
    /// The kubelet's `NodeWatchResources` stream.
    pub(crate) kubelet: &'a watch::Sender<Vec<dra_kubelet::DeviceHealth>>,
    /// The per-device health gauges, and where usage reports go.
    pub(crate) metrics: &'a Arc<Metrics>,
}

/// What only the active instance runs.
pub(crate) struct Active {
    lock: ActiveLock,
    controller: ClaimController<KubeCluster, BackendHardware>,
    tasks: Vec<AbortOnDrop<()>>,
    monitor: Option<health::HealthMonitor>,
}

impl Active {
    /// How long stopping waits for background claim work (rollbacks, unprepares) to end.
    const QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);

    /// The instance that holds `lock` and serves claims through `controller`, with `tasks`
    /// running already; [`Self::run_tasks`] starts the rest.
    pub(crate) fn new(
        lock: ActiveLock,
        controller: ClaimController<KubeCluster, BackendHardware>,
        tasks: Vec<AbortOnDrop<()>>,
    ) -> Self {
        Self {
            lock,
            controller,
            tasks,
            monitor: None,
        }
    }

    /// The claim controller the gate lets the kubelet's calls through to.
    pub(crate) fn controller(&self) -> &ClaimController<KubeCluster, BackendHardware> {
        &self.controller
    }

    /// Aborts the tasks, stops the health monitor, waits up to [`Self::QUIESCE_TIMEOUT`] for
    /// background claim work and releases the lock (or, with work still running, keeps it
    /// until the process exits).
    pub(crate) async fn stop(self) {
        drop(self.tasks);
        drop(self.monitor);
        if tokio::time::timeout(Self::QUIESCE_TIMEOUT, self.controller.quiesce())
            .await
            .is_err()
        {
            // Releasing the lock now could let the next instance recover a claim this one still
            // works on; keep it until the process exits (the kernel then releases it).
            warn!(lock = %self.lock.path().display(), timeout = ?Self::QUIESCE_TIMEOUT,
                "claim work still running; keeping the active lock until exit");
            std::mem::forget(self.lock);
            return;
        }
        info!(lock = %self.lock.path().display(), "released the active lock");
    }

    /// Publishes the slices and starts the periodic tasks (re-discovery and the NVLink fabric
    /// watch that wakes it, stale claims) and,
    /// with health monitoring, the GPU health monitor whose taints the publisher applies.
    /// Returns once the first publication is in place (it waits out the API server as long as
    /// it takes).
    pub(crate) async fn run_tasks(
        &mut self,
        config: &Config,
        client: kube::Client,
        backend: &Arc<dyn GpuBackend>,
        inventory: &Inventory,
        (publishing, pool): (Publishing, Pool),
        health: Health<'_>,
    ) {
        let publisher = SlicePublisher::new(client.clone(), &config.driver_name, &config.node_name);
        // The previous instance's verdicts: its taints go out with the first publish.
        let record =
            health_record::HealthRecord::new(config.checkpoint_path.with_file_name("health.json"));
        let restored = if config.health_monitoring {
            let record = record.clone();
            tokio::task::spawn_blocking(move || record.load())
                .await
                .unwrap_or_default()
        } else {
            health::GpuHealthMap::new()
        };
        if !restored.is_empty() {
            info!(gpus = ?restored.keys().collect::<Vec<_>>(),
                "GPUs still unhealthy from before the restart; keeping their taints");
            publisher.set_taints(health::taints(&config.driver_name, &restored));
        }
        publish_with_retry(&publisher, &pool).await;
        if config.health_monitoring {
            let monitor = health::HealthMonitor::start(
                Arc::clone(backend),
                inventory.gpus.iter().map(|g| g.raw.uuid.clone()).collect(),
                &restored,
                publisher.wanted_pool(),
                health::HealthConfig::new(&config.node_name),
            );
            let taints = publisher::spawn_taint_publisher(publisher.clone(), monitor.gpu_health());
            self.tasks.push(AbortOnDrop(taints));
            // Every change of the verdicts is recorded for the next instance (off the workers).
            let mut verdicts = monitor.gpu_health();
            let mut stored = restored;
            self.tasks.push(AbortOnDrop(tokio::spawn(async move {
                loop {
                    let now = health::unhealthy(&verdicts.borrow_and_update());
                    if now != stored {
                        let (record, write) = (record.clone(), now.clone());
                        match tokio::task::spawn_blocking(move || record.store(&write)).await {
                            Ok(Ok(())) => stored = now,
                            Ok(Err(e)) => warn!(error = %e, "recording GPU health failed"),
                            Err(e) => warn!(error = %e, "recording GPU health failed"),
                        }
                    }
                    if verdicts.changed().await.is_err() {
                        break;
                    }
                }
            })));
            let mut devices = monitor.device_health();
            let (kubelet, metrics) = (health.kubelet.clone(), Arc::clone(health.metrics));
            self.tasks.push(AbortOnDrop(tokio::spawn(async move {
                loop {
                    let now = devices.borrow_and_update().clone();
                    for d in &now {
                        metrics.set_device_health(&d.device_name, d.status);
                    }
                    kubelet.send_replace(now);
                    if devices.changed().await.is_err() {
                        break;
                    }
                }
            })));
            self.monitor = Some(monitor);
        }
        let clique = config.node_clique_label.as_ref().map(|key| {
            let (clique, cliques) = watch::channel(node_label::NodeClique::of(inventory));
            self.tasks.push(AbortOnDrop(tokio::spawn(node_label::run(
                client.clone(),
                config.node_name.clone(),
                key.clone(),
                config.api_timeout,
                cliques,
            ))));
            clique
        });
        // The fabric watch wakes the rediscovery when a GPU's fabric answer changes.
        let (fabric, fabric_answers) = watch::channel(fabric::Watched::of(inventory));
        let wake = Arc::new(tokio::sync::Notify::new());
        self.tasks.push(AbortOnDrop(tokio::spawn(fabric::watch(
            Arc::clone(backend),
            fabric_answers,
            Arc::clone(&wake),
            config.fabric_watch,
        ))));
        let followers = Followers {
            controller: self.controller.clone(),
            health: self.monitor.as_ref().map(health::HealthMonitor::watched),
            publishing,
            clique,
            fabric,
        };
        let rediscovery = publisher::spawn_rediscovery(
            publisher.clone(),
            config.rediscovery_interval,
            wake,
            pool,
            {
                let backend = Arc::clone(backend);
                let naming = config.naming;
                move || {
                    rediscover(backend.as_ref(), naming)
                        .map(|inventory| followers.follow(&inventory))
                }
            },
        );
        self.tasks.push(AbortOnDrop(rediscovery));
        // Two loops: the stale-claim check waits on the API server (each read bounded by
        // `api_timeout`), which must never hold back the daemons' and GPUs' own checks.
        let period = config.stale_claim_interval;
        self.tasks.push(AbortOnDrop(every(
            period,
            &self.controller,
            |c| async move {
                c.unprepare_stale().await;
            },
        )));
        self.tasks.push(AbortOnDrop(every(
            period,
            &self.controller,
            |c| async move {
                c.restart_dead_daemons().await;
                c.reassert_compute_modes().await;
            },
        )));
        if let Some(usage) = &config.usage {
            let sampler = usage::sampler::run(
                self.controller.clone(),
                Arc::clone(backend),
                usage.clone(),
                config.driver_name.clone(),
                config.node_name.clone(),
                health.metrics.usage_reports(),
            );
            self.tasks.push(AbortOnDrop(tokio::spawn(sampler)));
        }
    }
}
