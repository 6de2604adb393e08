//! The drust node plugin: discovers this node's GPUs, publishes them as ResourceSlices, and
//! prepares claims for the kubelet over the DRA gRPC API.
//!
//! [`run`] wires it together: backend -> inventory -> [`publisher`] -> [`dra_kubelet`] server with
//! the [`claims`] controller behind it, until shutdown.

// Claim errors carry the claim and the cause (a kube::Error among them) so the kubelet gets a
// message naming both; they are per-claim and rare, so their size is not worth boxing.
#![allow(clippy::result_large_err)]

pub mod cdi;
pub mod checkpoint;
pub mod claims;
pub mod config;
pub mod failpoint;
pub mod hardware;
pub mod health;
pub mod publisher;
pub mod storage;

use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::PluginServer;
use gpu_inventory::Pool;
use gpu_inventory::slices::pool_slices;
use gpu_inventory::{FakeBackend, GpuBackend, Inventory, NvmlBackend, Topology};
use tracing::{info, warn};

pub use config::{Backend, Config, DEFAULT_DRIVER_NAME, OutputFormat};

use crate::cdi::CdiWriter;
use crate::checkpoint::CheckpointFile;
use crate::claims::{ClaimController, ControllerConfig, KubeCluster};
use crate::hardware::BackendHardware;
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
    /// Publishing slices failed.
    #[error("publishing this node's ResourceSlices")]
    Publish(#[from] publisher::PublishError),
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
            let fake = FakeBackend::new(Topology::from_file(topology)?);
            Arc::new(match state_dir {
                Some(dir) => fake.with_state_dir(dir),
                None => fake,
            })
        }
        Backend::Nvml { library } => Arc::new(NvmlBackend::load(
            library.as_deref().map(|p| p.as_os_str()),
            config.sysfs_root.clone(),
        )?),
    })
}

/// Opens the configured backend and discovers the inventory.
///
/// # Errors
/// [`Error::Topology`], [`Error::Backend`] or [`Error::Discovery`].
pub fn discover(config: &Config) -> Result<Inventory, Error> {
    Ok(gpu_inventory::discover(open_backend(config)?.as_ref())?)
}

/// Discovers again for re-publication: a fake topology is re-read from its file (so a changed
/// file acts like changed hardware), NVML is asked again through the open backend.
///
/// # Errors
/// [`Error::Topology`] or [`Error::Discovery`].
pub fn rediscover(config: &Config, backend: &dyn GpuBackend) -> Result<Pool, Error> {
    let inventory = match config.backend {
        Backend::Fake { .. } => discover(config)?,
        Backend::Nvml { .. } => gpu_inventory::discover(backend)?,
    };
    Ok(inventory.pool(config.mig_strategy))
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
                text.push_str(
                    &serde_yaml_ng::to_string(s).map_err(|e| Error::Output(e.to_string()))?,
                );
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
    kube::Client::try_from(cfg?).map_err(|e| Error::KubeConfig {
        origin,
        message: e.to_string(),
    })
}

/// Runs the plugin until `shutdown` completes: discover, publish, serve the kubelet.
/// With `config.dry_run` set, prints the slices to stdout and returns.
///
/// # Errors
/// [`Error`] for any start-up failure or a failing server.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
    let backend = open_backend(&config)?;
    let inventory = gpu_inventory::discover(backend.as_ref())?;
    let pool = inventory.pool(config.mig_strategy);
    info!(gpus = inventory.gpus.len(), devices = pool.devices.len(), node = %config.node_name,
        "discovered GPUs");
    if let Some(format) = config.dry_run {
        return write_dry_run(&config, &pool, format, &mut std::io::stdout().lock());
    }

    let client = kube_client(&config).await?;
    let publisher = SlicePublisher::new(client.clone(), &config.driver_name, &config.node_name);
    publish_with_retry(&publisher, &pool).await?;
    let rediscovery =
        publisher::spawn_rediscovery(publisher.clone(), config.rediscovery_interval, pool, {
            let (config, backend) = (config.clone(), Arc::clone(&backend));
            move || rediscover(&config, backend.as_ref())
        });

    let boot_id = std::fs::read_to_string(&config.boot_id_path)
        .map_err(|source| Error::BootId {
            path: config.boot_id_path.clone(),
            source,
        })?
        .trim()
        .to_owned();
    let fs: Arc<dyn Fs> = Arc::new(RealFs);
    let (controller, _report) = ClaimController::start(
        KubeCluster::new(client, &config.driver_name, &config.node_name),
        Arc::new(BackendHardware::new(
            Arc::clone(&backend),
            &config.dev_root,
            &config.proc_root,
        )),
        ControllerConfig {
            driver_name: config.driver_name.clone(),
            node_name: config.node_name.clone(),
            timeout: config.claim_timeout,
            boot_id,
        },
        hardware::node_devices(&inventory, config.mig_strategy).into_values(),
        CdiWriter::new(Arc::clone(&fs), &config.cdi_root, &config.driver_name),
        CheckpointFile::new(fs, &config.checkpoint_path),
    )
    .await?;

    let stale = {
        let controller = controller.clone();
        let period = config.stale_claim_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await;
            loop {
                tick.tick().await;
                controller.unprepare_stale().await;
            }
        })
    };
    let mut server = PluginServer::new(
        config.driver_name.clone(),
        config.sockets.clone(),
        Arc::new(controller),
    );
    let health = config.health_monitoring.then(|| {
        let monitor = health::HealthMonitor::start(
            Arc::clone(&backend),
            inventory.gpus.iter().map(|g| g.raw.uuid.clone()).collect(),
            publisher.wanted_pool(),
            health::HealthConfig::new(&config.node_name),
        );
        let taints = publisher::spawn_taint_publisher(publisher.clone(), monitor.gpu_health());
        (monitor, taints)
    });
    if let Some((monitor, _)) = &health {
        server = server.with_health(monitor.device_health());
    }
    let served = server.serve(shutdown).await;
    if let Some((_, taints)) = health {
        taints.abort();
    }
    stale.abort();
    rediscovery.abort();
    served?;
    info!("stopped");
    Ok(())
}

/// Start-up publishing rides out a briefly unavailable API server: 5 tries, 1 s apart, doubling.
async fn publish_with_retry(publisher: &SlicePublisher, pool: &Pool) -> Result<(), Error> {
    let mut delay = Duration::from_secs(1);
    let mut attempt = 1;
    loop {
        match publisher.publish_pool(pool).await {
            Ok(outcome) => {
                info!(?outcome, "ResourceSlices in place");
                return Ok(());
            }
            Err(e) if attempt < 5 => {
                warn!(error = %e, attempt, "publishing ResourceSlices failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
                attempt += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}
