//! `dra-example-driver`: publishes this node's fake devices in a ResourceSlice and prepares
//! claims on them for the kubelet, until SIGTERM or SIGINT.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use dra_example_driver::{ExampleDriver, device_names};
use dra_kubelet::{PluginServer, PluginSockets};
use dra_plugin::cdi::CdiWriter;
use dra_plugin::checkpoint::SlotFile;
use dra_plugin::lifecycle::{Lifecycle, Settings};
use dra_plugin::storage::RealFs;
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use kube::api::{Api, Patch, PatchParams};
use tokio::signal::unix::{SignalKind, signal};

/// How often prepared claims are checked against the API server.
const STALE_CHECK: Duration = Duration::from_secs(60);

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// DRA driver name.
    #[arg(long, default_value = "example.drust.dev")]
    driver_name: String,
    /// This node's name (also the pool name).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// How many fake devices (`dev-0` ...).
    #[arg(long, default_value_t = 8)]
    devices: usize,
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Directory of the DRA socket and the checkpoint (default
    /// `/var/lib/kubelet/plugins/<driver>`).
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// The kubelet's plugin registration directory.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    registrar_dir: PathBuf,
    /// The container runtime's CDI directory.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_root: PathBuf,
    /// Where each device's owner file is (default `<plugin-dir>/devices`).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// This boot's ID.
    #[arg(long, default_value = "/proc/sys/kernel/random/boot_id")]
    boot_id_file: PathBuf,
    /// Deadline of one prepare or unprepare, in seconds.
    #[arg(long, default_value_t = 10)]
    timeout_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let plugin_dir = args
        .plugin_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("/var/lib/kubelet/plugins").join(&args.driver_name));
    std::fs::create_dir_all(&plugin_dir)
        .with_context(|| format!("creating {}", plugin_dir.display()))?;
    let client = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let cfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .with_context(|| format!("using {}", path.display()))?;
            kube::Client::try_from(cfg)?
        }
        None => kube::Client::try_default().await?,
    };
    let devices = device_names(args.devices);
    publish(&client, &args, &devices).await?;

    let boot_id = std::fs::read_to_string(&args.boot_id_file)
        .with_context(|| format!("reading {}", args.boot_id_file.display()))?;
    let fs = Arc::new(RealFs);
    let driver = ExampleDriver {
        driver_name: args.driver_name.clone(),
        pool: args.node_name.clone(),
        devices,
        state_dir: args
            .state_dir
            .clone()
            .unwrap_or_else(|| plugin_dir.join("devices")),
        fs: fs.clone(),
        claims: client,
    };
    let lifecycle = Lifecycle::new(
        driver,
        SlotFile::new(fs.clone(), plugin_dir.join("checkpoint.json")),
        CdiWriter::new(fs, &args.cdi_root, &args.driver_name),
        Settings {
            timeout: Duration::from_secs(args.timeout_secs),
            node_name: args.node_name.clone(),
            boot_id: boot_id.trim().to_owned(),
        },
    );
    let report = lifecycle.recover().await?;
    tracing::info!(?report, "recovered");

    // Claims whose pods went while nobody told the kubelet's plugin (e.g. the driver was down).
    let stale = {
        let lifecycle = lifecycle.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(STALE_CHECK);
            loop {
                every.tick().await;
                lifecycle.unprepare_stale().await;
            }
        })
    };

    let sockets = PluginSockets {
        plugin_dir,
        registrar_dir: args.registrar_dir.clone(),
        instance_id: None,
    };
    let server = PluginServer::new(
        args.driver_name.clone(),
        sockets,
        Arc::new(lifecycle.clone()),
    );
    let (mut term, mut int) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    server
        .serve(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        })
        .await?;
    stale.abort();
    lifecycle.quiesce().await;
    Ok(())
}

/// Publishes (server-side apply) the node's ResourceSlice: one pool of `devices`, each with an
/// `index` attribute. The pool's generation goes up when the devices change.
async fn publish(
    client: &kube::Client,
    args: &Args,
    devices: &std::collections::BTreeSet<String>,
) -> anyhow::Result<()> {
    let api = Api::<ResourceSlice>::all(client.clone());
    let name = format!("{}-{}", args.node_name, args.driver_name.replace('.', "-"));
    let devices: Vec<Device> = devices
        .iter()
        .map(|d| Device {
            name: d.clone(),
            attributes: Some(BTreeMap::from([(
                "index".to_owned(),
                DeviceAttribute {
                    int: d.trim_start_matches("dev-").parse().ok(),
                    ..DeviceAttribute::default()
                },
            )])),
            ..Device::default()
        })
        .collect();
    let existing = api.get_opt(&name).await?;
    let generation = match &existing {
        Some(s) if s.spec.devices.as_ref() == Some(&devices) => s.spec.pool.generation,
        Some(s) => s.spec.pool.generation + 1,
        None => 1,
    };
    let slice = ResourceSlice {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: args.driver_name.clone(),
            node_name: Some(args.node_name.clone()),
            pool: ResourcePool {
                name: args.node_name.clone(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        },
    };
    api.patch(
        &name,
        &PatchParams::apply("dra-example-driver").force(),
        &Patch::Apply(&slice),
    )
    .await
    .with_context(|| format!("publishing ResourceSlice {name}"))?;
    Ok(())
}
