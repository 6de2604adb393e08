//! The drust node plugin: discovers this node's GPUs, publishes them as ResourceSlices, and
//! prepares claims for the kubelet over the DRA gRPC API.
//!
//! [`run`] wires it together: backend -> inventory -> [`publisher`] -> [`dra_kubelet`] server with
//! the [`claims`] controller behind it, until shutdown.

pub mod cdi;
pub mod checkpoint;
pub mod claims;
pub mod config;
mod fsutil;
pub mod publisher;

use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::PluginServer;
use gpu_inventory::slices::resource_slices;
use gpu_inventory::{FakeBackend, GpuBackend, Inventory, NvmlBackend, Topology};
use k8s_openapi::api::resource::v1::Device;
use tracing::{info, warn};

pub use config::{Backend, Config, DEFAULT_DRIVER_NAME, OutputFormat};

use crate::cdi::CdiWriter;
use crate::checkpoint::CheckpointFile;
use crate::claims::ClaimController;
use crate::publisher::SlicePublisher;

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
    /// The checkpoint could not be read at start.
    #[error("resuming from the checkpoint")]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The kubelet sockets could not be served.
    #[error("serving the kubelet")]
    Serve(#[from] dra_kubelet::ServeError),
    /// Writing `--dry-run` output failed.
    #[error("writing dry-run output: {0}")]
    Output(String),
}

/// Opens the configured backend and discovers the inventory.
///
/// # Errors
/// [`Error::Topology`], [`Error::Backend`] or [`Error::Discovery`].
pub fn discover(config: &Config) -> Result<Inventory, Error> {
    let backend: Box<dyn GpuBackend> = match &config.backend {
        Backend::Fake { topology } => Box::new(FakeBackend::new(Topology::from_file(topology)?)),
        Backend::Nvml { library } => Box::new(NvmlBackend::load(
            library.as_deref().map(|p| p.as_os_str()),
            config.sysfs_root.clone(),
        )?),
    };
    Ok(gpu_inventory::discover(backend.as_ref())?)
}

/// Writes the ResourceSlices `config` would publish (generation 1) to `out`.
///
/// # Errors
/// [`Error::Output`] when serialization or the write fails.
pub fn write_dry_run(
    config: &Config,
    devices: &[Device],
    format: OutputFormat,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let slices = resource_slices(&config.driver_name, &config.node_name, 1, devices);
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
    let inventory = discover(&config)?;
    let devices: Vec<Device> = inventory.gpus.iter().map(|g| g.device()).collect();
    info!(gpus = devices.len(), node = %config.node_name, "discovered GPUs");
    if let Some(format) = config.dry_run {
        return write_dry_run(&config, &devices, format, &mut std::io::stdout().lock());
    }

    let client = kube_client(&config).await?;
    let publisher = SlicePublisher::new(client.clone(), &config.driver_name, &config.node_name);
    publish_with_retry(&publisher, &devices).await?;

    let controller = ClaimController::new(
        client,
        &config.driver_name,
        &config.node_name,
        inventory.gpus,
        CdiWriter::new(&config.cdi_root, &config.driver_name),
        CheckpointFile::new(&config.checkpoint_path),
    )?;
    PluginServer::new(
        config.driver_name.clone(),
        config.sockets.clone(),
        Arc::new(controller),
    )
    .serve(shutdown)
    .await?;
    info!("stopped");
    Ok(())
}

/// Start-up publishing rides out a briefly unavailable API server: 5 tries, 1 s apart, doubling.
async fn publish_with_retry(publisher: &SlicePublisher, devices: &[Device]) -> Result<(), Error> {
    let mut delay = Duration::from_secs(1);
    let mut attempt = 1;
    loop {
        match publisher.publish(devices).await {
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
