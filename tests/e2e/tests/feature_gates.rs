//! The plugin against an API server with a DRA feature gate off. Such a server drops the
//! gate's fields from the slices it stores (here `DRAPartitionableDevices`: shared counters and
//! counter consumption), so what it holds never equals what the plugin wants. The plugin used
//! to see a difference at every rediscovery and write a new pool generation each time (with
//! `--rediscovery-interval-seconds 1`, one a second), churning every scheduler's view of the
//! node. It now compares with what the server kept of the same wanted slices, and logs once
//! which fields were dropped.

use std::time::{Duration, Instant};

use anyhow::ensure;
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::manifests::repo_path;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::ListParams;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";

/// The highest pool generation of the node's slices, and how many slices there are.
async fn generation(slices: &Api<ResourceSlice>) -> anyhow::Result<(i64, usize)> {
    let items = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await?
        .items;
    Ok((
        items
            .iter()
            .map(|s| s.spec.pool.generation)
            .max()
            .unwrap_or(0),
        items.len(),
    ))
}

#[tokio::test]
async fn with_a_dra_gate_off_the_pool_is_not_republished_at_every_rediscovery() -> anyhow::Result<()>
{
    let cp = ControlPlane::start(ControlPlaneOptions {
        feature_gates: [("DRAPartitionableDevices".to_owned(), false)].into(),
        ..Default::default()
    })
    .await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology = repo_path("examples/topologies/pcie-a100-mig.yaml");
    let host = BinaryHost::new(
        "drust-gate-off-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        NODE,
    )?;
    let log = host.root().join("plugin.log");
    let mut cmd = host.command(&log, None)?;
    cmd.args([
        "--mig-strategy",
        "partitionable",
        "--rediscovery-interval-seconds",
        "1",
    ]);
    let plugin = PluginProcess(cmd.spawn()?);
    let tail = || std::fs::read_to_string(&log).unwrap_or_default();

    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let start = Instant::now();
    let first = loop {
        let (generation, count) = generation(&slices).await?;
        if count > 0 {
            break generation;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "nothing published\n{}",
            tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Six rediscoveries later, still the same generation.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (later, _) = generation(&slices).await?;
    ensure!(
        later == first,
        "the pool went from generation {first} to {later} in 6 s\n{}",
        tail()
    );
    let told = tail().matches("the API server dropped fields").count();
    ensure!(
        told == 1,
        "the dropped fields logged {told} times\n{}",
        tail()
    );
    ensure!(tail().contains("consumesCounters"), "{}", tail());
    stop(plugin).await?;
    cp.stop().await?;
    Ok(())
}
