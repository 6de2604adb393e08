//! The drust node plugin: discovers this node's GPUs, publishes them as ResourceSlices, and
//! prepares claims for the kubelet over the DRA gRPC API.
//!
//! [`run`] wires it together: backend -> inventory -> [`publisher`] -> [`dra_kubelet`] server with
//! the [`claims`] controller behind it, until shutdown.

// Claim errors carry the claim and the cause (a kube::Error among them) so the kubelet gets a
// message naming both; they are per-claim and rare, so their size is not worth boxing.
#![allow(clippy::result_large_err)]

pub use dra_plugin::cdi;
pub mod checkpoint;
pub mod claim_config;
pub mod claims;
pub mod config;
pub mod driver_files;
pub mod failpoint;
pub mod hardware;
pub mod health;
pub mod health_record;
pub mod http;
pub mod instance;
pub mod memory_limits;
pub mod metrics;
pub mod mps;
pub mod publisher;
pub mod usage;
pub use dra_plugin::storage;

use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dra_kubelet::PluginServer;
use gpu_inventory::Pool;
use gpu_inventory::slices::pool_slices;
use gpu_inventory::{FakeBackend, GpuBackend, Inventory, NvmlBackend};
use tokio::sync::watch;
use tracing::{info, warn};

pub use config::{Backend, Config, DEFAULT_DRIVER_NAME, OutputFormat};

use crate::cdi::CdiWriter;
use crate::checkpoint::CheckpointFile;
use crate::claims::{ClaimController, ControllerConfig, KubeCluster};
use crate::hardware::BackendHardware;
use crate::instance::{Activation, ActiveLock, Gate, Role};
use crate::metrics::Metrics;
use crate::publisher::SlicePublisher;
use crate::storage::{Fs, RealFs};

/// The plugin could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The topology file could not be used.
    #[error("loading the fake topology")]
    Topology(#[from] gpu_inventory::TopologyError),
    /// NVML could not be loaded.
    #[error("opening the GPU backend")]
    Backend(#[from] gpu_inventory::BackendError),
    /// Discovery failed.
    #[error("discovering GPUs")]
    Discovery(#[from] gpu_inventory::DiscoveryError),
    /// No usable Kubernetes client configuration.
    #[error("building the Kubernetes client ({origin}): {message}")]
    KubeConfig {
        /// The kubeconfig path or `in-cluster`.
        origin: String,
        /// The cause.
        message: String,
    },
    /// The claim state could not be reconciled at start.
    #[error("reconciling prepared claims at start")]
    Claims(#[from] claims::ClaimError),
    /// The boot ID could not be read.
    #[error("reading the boot ID from {path}: {source}")]
    BootId {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The kubelet sockets could not be served.
    #[error("serving the kubelet")]
    Serve(#[from] dra_kubelet::ServeError),
    /// Writing `--dry-run` output failed.
    #[error("writing dry-run output: {0}")]
    Output(String),
    /// `--instance-id` cannot be part of a file name.
    #[error(
        "instance ID {0:?} (--instance-id, POD_UID): must be 1-128 ASCII letters, digits, '-', \
         '_' or '.', not starting with '.' (it becomes part of the socket file names)"
    )]
    InstanceId(String),
    /// The active lock could not be taken.
    #[error("taking the active lock")]
    Instance(#[from] instance::InstanceError),
    /// The HTTP endpoint could not start.
    #[error("starting the HTTP endpoint")]
    Http(#[from] http::HttpError),
    /// A state file or directory could not be made owner-only.
    #[error("restricting {path} to its owner: {source}")]
    Secure {
        /// The file or directory.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A task of the plugin ended abnormally.
    #[error("{task} ended abnormally: {message}")]
    TaskFailed {
        /// Which task.
        task: &'static str,
        /// The panic or cancellation.
        message: String,
    },
}

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

/// What follows each new inventory before it is published: the claim controller (which
/// devices prepare accepts) and the health monitor (which GPUs it watches). Publishing after
/// them means the scheduler never sees a device that prepare would refuse or whose faults
/// nobody watches.
struct Followers {
    controller: ClaimController<KubeCluster, BackendHardware>,
    health: Option<health::WatchedGpus>,
    publishing: Publishing,
}

/// How this node's inventory becomes its published pool.
#[derive(Debug, Clone, Copy)]
pub struct Publishing {
    /// How MIG-capable GPUs are published.
    pub strategy: gpu_inventory::MigStrategy,
    /// Whether devices are published for consumable capacity (fractional GPUs): the flag, and
    /// the MPS control tool found to enforce the shares.
    pub shares: bool,
    /// How full GPUs' shares are enforced:
    /// [`gpu_inventory::shares::ShareEnforcement::Kernel`] where the node has the `kernel`
    /// level ([`memory_limits::KernelMemory::detect`]), else
    /// [`gpu_inventory::shares::ShareEnforcement::Mps`].
    pub enforcement: gpu_inventory::shares::ShareEnforcement,
}

impl Publishing {
    /// The pool of `inventory`: its devices under the MIG strategy, shareable with `shares`
    /// ([`gpu_inventory::shares`]).
    pub fn pool(&self, inventory: &Inventory) -> Pool {
        let mut pool = inventory.pool(self.strategy);
        if self.shares {
            gpu_inventory::shares::publish_shares(&mut pool, self.enforcement);
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
            strategy: config.mig_strategy,
            shares,
            enforcement: gpu_inventory::shares::ShareEnforcement::Mps,
        }
    }

    /// Finds out whether full GPUs' shares get the `kernel` level (when shares are published at
    /// all), installing the CDI hook unless `--dry-run`; says which level applies and why.
    pub async fn detect_kernel_memory(
        &mut self,
        config: &Config,
        backend: &Arc<dyn GpuBackend>,
    ) -> Option<Arc<memory_limits::KernelMemory>> {
        if !self.shares {
            return None;
        }
        let (config2, backend2) = (config.clone(), Arc::clone(backend));
        let install = config.dry_run.is_none();
        let detected = tokio::task::spawn_blocking(move || {
            memory_limits::KernelMemory::detect(&config2, backend2.as_ref(), install)
        })
        .await
        .map_err(|e| e.to_string());
        match detected {
            Ok(Ok(kernel)) => {
                info!(cgroup_root = %config.cgroup_root.display(),
                    "shares of full GPUs are enforced at the kernel level: each share container's cgroup \
                     gets a hard GPU memory limit, each share its own MPS v3 namespace");
                self.enforcement = gpu_inventory::shares::ShareEnforcement::Kernel;
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
}

impl Followers {
    /// Hands `inventory` to the followers (blocking-safe: no await) and returns its pool.
    fn follow(&self, inventory: &Inventory) -> Pool {
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
        self.publishing.pool(inventory)
    }
}

/// Writes the ResourceSlices `config` would publish (generation 1) to `out`.
///
/// # Errors
/// [`Error::Output`] when serialization or the write fails.
pub fn write_dry_run(
    config: &Config,
    pool: &Pool,
    format: OutputFormat,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let slices = pool_slices(&config.driver_name, &config.node_name, 1, pool);
    let text = match format {
        OutputFormat::Json => serde_json::to_string_pretty(&slices)
            .map(|s| s + "\n")
            .map_err(|e| Error::Output(e.to_string()))?,
        OutputFormat::Yaml => {
            let mut text = String::new();
            for s in &slices {
                text.push_str("---\n");
                text.push_str(&gpu_inventory::yaml::to_string(s).map_err(Error::Output)?);
            }
            text
        }
    };
    out.write_all(text.as_bytes())
        .map_err(|e| Error::Output(e.to_string()))
}

/// Builds the Kubernetes client from `--kubeconfig` or the in-cluster environment.
///
/// # Errors
/// [`Error::KubeConfig`].
pub async fn kube_client(config: &Config) -> Result<kube::Client, Error> {
    let (origin, cfg) = match &config.kubeconfig {
        Some(path) => {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(path).map_err(|e| Error::KubeConfig {
                    origin: path.display().to_string(),
                    message: e.to_string(),
                })?;
            let cfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .map_err(|e| Error::KubeConfig {
                    origin: path.display().to_string(),
                    message: e.to_string(),
                });
            (path.display().to_string(), cfg)
        }
        None => (
            "in-cluster".to_owned(),
            kube::Config::incluster().map_err(|e| Error::KubeConfig {
                origin: "in-cluster".into(),
                message: e.to_string(),
            }),
        ),
    };
    // kube's own default has no read or write timeout: a blackholed API server would hold a
    // claim's lock (and start-up) for ever. The plugin makes no watches, so one deadline bounds
    // every call's reads; `KubeCluster` bounds each claim read and event as a whole too.
    let mut cfg = cfg?;
    cfg.connect_timeout = Some(config.api_timeout);
    cfg.read_timeout = Some(config.api_timeout);
    cfg.write_timeout = Some(config.api_timeout);
    kube::Client::try_from(cfg).map_err(|e| Error::KubeConfig {
        origin,
        message: e.to_string(),
    })
}

/// Runs the plugin until `shutdown` completes: discover, serve the kubelet, and once this
/// instance holds the active lock, recover the claims, publish the slices and prepare claims.
/// With `config.dry_run` set, prints the slices to stdout and returns.
///
/// Two instances may run side by side during a rolling update; see [`instance`] for how they
/// hand over.
///
/// # Errors
/// [`Error`] for any start-up failure or a failing server.
pub async fn run(
    mut config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    if let Some(id) = &config.instance_id
        && !dra_kubelet::valid_instance_id(id)
    {
        return Err(Error::InstanceId(id.clone()));
    }
    config.sockets.instance_id = config.instance_id.clone();
    let backend = open_backend(&config)?;
    let inventory = rediscover(backend.as_ref(), config.naming)?;
    let mut publishing = Publishing::of(&config).await;
    let kernel_memory = publishing.detect_kernel_memory(&config, &backend).await;
    let pool = publishing.pool(&inventory);
    info!(gpus = inventory.gpus.len(), devices = pool.devices.len(), node = %config.node_name,
        "discovered GPUs");
    if let Some(format) = config.dry_run {
        if let Some(path) = &config.dump_topology {
            // The answers the pool was made from, in the same process (NVML's UUIDs and state
            // are those of this discovery).
            let topology = gpu_inventory::Topology {
                system: backend.system()?,
                gpus: inventory.gpus.iter().map(|g| g.raw.clone()).collect(),
            };
            let text = gpu_inventory::yaml::to_string(&topology).map_err(Error::Output)?;
            std::fs::write(path, text)
                .map_err(|e| Error::Output(format!("{}: {e}", path.display())))?;
        }
        return write_dry_run(&config, &pool, format, &mut std::io::stdout().lock());
    }
    let client = kube_client(&config).await?;
    secure_state(&config)?;
    if config.consumable_capacity && !publishing.shares {
        // Said where an operator looks (`kubectl describe node`), not only in the log.
        let cluster = KubeCluster::new(client.clone(), &config.driver_name, &config.node_name)
            .with_timeout(config.api_timeout);
        let message = format!(
            "fractional GPUs are on (--consumable-capacity) but the MPS control tool {} is not \
             found: shares could not be enforced, so this node's GPUs are published for \
             exclusive use only",
            config.mps_control_binary.display()
        );
        tokio::spawn(async move {
            cluster
                .warning("SharesNotPublished", "Publish", &message)
                .await;
        });
    }

    // The kubelet side first: it answers (and registers) while another instance is active.
    let metrics = Arc::new(Metrics::new());
    let lock_path = config.sockets.plugin_dir.join(instance::LOCK_FILE);
    let (activation, gate) = Gate::new(
        instance::handover_wait(config.claim_timeout),
        lock_path.clone(),
        instance::GateMetrics(Arc::clone(&metrics)),
    );
    let mut server = PluginServer::new(
        config.driver_name.clone(),
        config.sockets.clone(),
        Arc::new(gate),
    )
    .with_observer(Arc::clone(&metrics) as Arc<dyn dra_kubelet::CallObserver>);
    // Device health for the kubelet: advertised from the start, fed once this instance is
    // active (its monitor watches the GPUs).
    let device_health = watch::Sender::new(Vec::<dra_kubelet::DeviceHealth>::new());
    if config.health_monitoring {
        server = server.with_health(device_health.subscribe());
    }
    let role = watch::Sender::new(Role::Standby);
    let http = match config.http_address {
        Some(address) => {
            let listener = http::bind(address).await?;
            let probes = Arc::new(http::Probes {
                metrics: Arc::clone(&metrics),
                sockets: config.sockets.clone(),
                driver_name: config.driver_name.clone(),
                serving: server.serving(),
                registration: server.registration_status(),
                role: role.subscribe(),
            });
            Some(AbortOnDrop(tokio::spawn(http::serve(listener, probes))))
        }
        None => None,
    };
    let (stop_serving, serving_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut served = tokio::spawn(server.serve(async {
        let _ = serving_stopped.await;
    }));

    tokio::pin!(shutdown);
    let started = Instant::now();
    // Standing by is cancelled by shutdown; taking over, once the lock is held, is not (it
    // ends with the claims recovered or with an error).
    let lock = tokio::select! {
        r = wait_for_lock(&lock_path) => Some(r),
        () = &mut shutdown => None,
        r = &mut served => return server_ended(r),
    };
    let taken = match lock {
        Some(Ok(lock)) => {
            role.send_replace(Role::TakingOver);
            let recovered = take_over(
                lock,
                &config,
                client.clone(),
                Found {
                    backend: &backend,
                    inventory: &inventory,
                    kernel_memory: kernel_memory.clone(),
                },
                &activation,
                &metrics,
            )
            .await;
            if recovered.is_ok() {
                metrics.set_active(true, Some(started.elapsed()));
            }
            Some(recovered)
        }
        Some(Err(e)) => Some(Err(e)),
        None => None,
    };
    let mut server_result = None;
    let (mut active, result) = match taken {
        Some(Ok(active)) => (Some(active), Ok(())),
        Some(Err(e)) => (None, Err(e)),
        None => (None, Ok(())),
    };
    if let Some(active) = &mut active {
        let (claims, devices) = active.controller.prepared_summary().await;
        metrics.set_prepared(claims, devices);
        // The first publication waits for the API server as long as it takes; a shutdown
        // meanwhile stops it.
        let stopping = tokio::select! {
            () = active.run_tasks(
                &config,
                client,
                &backend,
                &inventory,
                (publishing, pool),
                Health {
                    kubelet: &device_health,
                    metrics: &metrics,
                },
            ) => false,
            () = &mut shutdown => true,
        };
        if !stopping {
            role.send_replace(Role::Active);
            tokio::select! {
                () = &mut shutdown => {}
                r = &mut served => server_result = Some(server_ended(r)),
            }
        }
    }

    // Unregister and let calls in flight finish (a standby instance answers its waiting calls
    // at once); then the active instance's background work; then hand the lock over.
    drop(activation);
    let _ = stop_serving.send(());
    let served = match server_result {
        Some(r) => r,
        None => server_ended(served.await),
    };
    drop(http);
    stop_after(result.and(served), active, &metrics).await
}

/// Stops the active instance's tasks, waits for its background claim work, releases the lock.
async fn stop_after(
    result: Result<(), Error>,
    active: Option<Active>,
    metrics: &Metrics,
) -> Result<(), Error> {
    if let Some(active) = active {
        active.stop().await;
        metrics.set_active(false, None);
    }
    if result.is_ok() {
        info!("stopped");
    }
    result
}

fn server_ended(
    r: Result<Result<(), dra_kubelet::ServeError>, tokio::task::JoinError>,
) -> Result<(), Error> {
    match r {
        Ok(r) => Ok(r?),
        Err(e) => Err(Error::TaskFailed {
            task: "kubelet server",
            message: e.to_string(),
        }),
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

/// A task that runs `check` on (a clone of) `controller` every `period`, the first after one
/// period, until it is aborted.
fn every<F, Fut>(
    period: std::time::Duration,
    controller: &ClaimController<KubeCluster, BackendHardware>,
    check: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(ClaimController<KubeCluster, BackendHardware>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
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

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What only the active instance runs.
struct Active {
    lock: ActiveLock,
    controller: ClaimController<KubeCluster, BackendHardware>,
    tasks: Vec<AbortOnDrop<()>>,
    monitor: Option<health::HealthMonitor>,
}

/// Where device health goes besides the slices' taints.
struct Health<'a> {
    /// The kubelet's `NodeWatchResources` stream.
    kubelet: &'a watch::Sender<Vec<dra_kubelet::DeviceHealth>>,
    metrics: &'a Arc<Metrics>,
}

impl Active {
    /// How long stopping waits for background claim work (rollbacks, unprepares) to end.
    const QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);

    async fn stop(self) {
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
}

/// The MPS control tool as a daemon Pod runs it, relative to the driver root it chroots into:
/// `--mps-control-binary` under `--driver-root` (the chart's case), else the tool's usual place.
fn daemon_binary(config: &Config) -> std::path::PathBuf {
    config
        .mps_control_binary
        .strip_prefix(&config.driver_root.root)
        .ok()
        .filter(|relative| !relative.as_os_str().is_empty())
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| std::path::PathBuf::from("usr/bin/nvidia-cuda-mps-control"))
}

/// The CDI edits of the driver's files under `config.driver_root`, for the driver version NVML
/// reports (blocking work, off the async workers). Missing files are logged, not fatal: the
/// plugin still serves claims (device nodes alone are enough for containers that bring their
/// own driver libraries), but says that CUDA containers will not find the driver.
async fn driver_files(
    config: &Config,
    backend: &Arc<dyn GpuBackend>,
) -> Result<cdi::ContainerEdits, Error> {
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

/// Takes the active lock, waiting while another instance holds it.
async fn wait_for_lock(lock_path: &std::path::Path) -> Result<ActiveLock, Error> {
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
struct Found<'a> {
    backend: &'a Arc<dyn GpuBackend>,
    inventory: &'a Inventory,
    kernel_memory: Option<Arc<memory_limits::KernelMemory>>,
}

/// Holding the lock: recovers the claims and opens the gate. On success the claims flow; the
/// caller then starts [`Active::run_tasks`].
async fn take_over(
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
        },
        hardware::node_devices(inventory, config.mig_strategy).into_values(),
        CdiWriter::new(Arc::clone(&fs), &config.cdi_root, &config.driver_name),
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
    Ok(Active {
        lock,
        controller,
        tasks: vec![AbortOnDrop(failures)],
        monitor: None,
    })
}

impl Active {
    /// Publishes the slices and starts the periodic tasks (re-discovery, stale claims) and,
    /// with health monitoring, the GPU health monitor whose taints the publisher applies.
    async fn run_tasks(
        &mut self,
        config: &Config,
        client: kube::Client,
        backend: &Arc<dyn GpuBackend>,
        inventory: &Inventory,
        (publishing, pool): (Publishing, Pool),
        health: Health<'_>,
    ) {
        let publisher = SlicePublisher::new(client, &config.driver_name, &config.node_name);
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
        let followers = Followers {
            controller: self.controller.clone(),
            health: self.monitor.as_ref().map(health::HealthMonitor::watched),
            publishing,
        };
        let rediscovery =
            publisher::spawn_rediscovery(publisher.clone(), config.rediscovery_interval, pool, {
                let backend = Arc::clone(backend);
                let naming = config.naming;
                move || {
                    rediscover(backend.as_ref(), naming)
                        .map(|inventory| followers.follow(&inventory))
                }
            });
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

/// Root-only state: the plugin directory (ours alone) is mode 0700, the checkpoint and our CDI
/// specs 0600, whatever an older version or an operator left. Files written later are created
/// owner-only ([`RealFs`]); the CDI directory, shared with other vendors, is only created 0700
/// when we create it.
///
/// # Errors
/// [`Error::Secure`] naming the path.
pub fn secure_state(config: &Config) -> Result<(), Error> {
    let err = |path: &std::path::Path| {
        let path = path.to_owned();
        move |source| Error::Secure { path, source }
    };
    let dir = &config.sockets.plugin_dir;
    RealFs.create_dir_all(dir).map_err(err(dir))?;
    storage::restrict_to_owner(dir).map_err(err(dir))?;
    if let Some(parent) = config.checkpoint_path.parent() {
        RealFs.create_dir_all(parent).map_err(err(parent))?;
    }
    for slot in checkpoint::slot_paths(&config.checkpoint_path) {
        storage::restrict_to_owner(&slot).map_err(err(&slot))?;
    }
    let cdi = CdiWriter::new(Arc::new(RealFs), &config.cdi_root, &config.driver_name);
    if let Ok(specs) = cdi.list() {
        for (_, path) in specs {
            storage::restrict_to_owner(&path).map_err(err(&path))?;
        }
    }
    Ok(())
}

/// The longest wait between two tries of the first publication.
const PUBLISH_RETRY_CAP: Duration = Duration::from_secs(10);

/// Start-up publishing waits out an unavailable or unreachable API server for as long as it
/// takes: tries 1 s apart, doubling up to [`PUBLISH_RETRY_CAP`], each failure logged. Giving
/// up would only crash-loop the pod (a restart cannot reach the server either) and hide the
/// cause behind a back-off; meanwhile `/readyz` says the instance is still publishing, and the
/// caller stops waiting on shutdown.
async fn publish_with_retry(publisher: &SlicePublisher, pool: &Pool) {
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

    #[test]
    fn an_mps_daemon_pod_runs_the_configured_tool_inside_the_driver_root() {
        let mut config = Config::new("gpu.drust.dev", "node-a", Backend::Nvml { library: None });
        assert_eq!(
            daemon_binary(&config),
            std::path::Path::new("usr/bin/nvidia-cuda-mps-control")
        );
        config.driver_root.root = "/driver-root".into();
        config.mps_control_binary = "/driver-root/opt/nvidia/bin/nvidia-cuda-mps-control".into();
        assert_eq!(
            daemon_binary(&config),
            std::path::Path::new("opt/nvidia/bin/nvidia-cuda-mps-control")
        );
        config.mps_control_binary = "/elsewhere/nvidia-cuda-mps-control".into();
        assert_eq!(
            daemon_binary(&config),
            std::path::Path::new("usr/bin/nvidia-cuda-mps-control")
        );
    }
}
