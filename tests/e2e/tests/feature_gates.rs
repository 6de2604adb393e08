//! The plugin against an API server with DRA feature gates off. Such a server drops the
//! gates' fields from the slices it stores (here `DRAPartitionableDevices`: shared counters and
//! counter consumption; `DRADeviceTaints`: the taints of an unhealthy GPU), so what it holds
//! never equals what the plugin wants. The plugin used
//! to see a difference at every rediscovery and write a new pool generation each time (with
//! `--rediscovery-interval-seconds 1`, one a second), churning every scheduler's view of the
//! node. It now compares with what the server kept of the same wanted slices, and logs once
//! which fields were dropped.

use std::time::{Duration, Instant};

use anyhow::ensure;
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::manifests::repo_path;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::{HealthEvent, HealthEventKind};
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
async fn with_dra_gates_off_the_pool_is_not_republished_at_every_rediscovery() -> anyhow::Result<()>
{
    let cp = ControlPlane::start(ControlPlaneOptions {
        feature_gates: [
            ("DRAPartitionableDevices".to_owned(), false),
            ("DRADeviceTaints".to_owned(), false),
            // Depends on DRADeviceTaints (`pkg/features/kube_features.go`): off by default in
            // 1.36.3, GA and on in 1.37.2, where the API server refuses it on without its
            // dependency.
            ("DRADeviceTaintRules".to_owned(), false),
        ]
        .into(),
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
    cmd.arg("--fake-state-dir").arg(host.state_dir());
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

    // A GPU turns unhealthy: the plugin publishes its taint once, the server drops it, and the
    // pool again stays at its generation.
    let event = HealthEvent {
        gpu_uuid: "GPU-5e0c4a1b-7d2f-4c83-9b6e-2f1a8d3c7e40".to_owned(),
        kind: HealthEventKind::Xid { code: 79 },
    };
    // Renamed into place: the fake backend polls and must never read half a file.
    drust_e2e::plugin::write_health_event(&host.state_dir(), 1, &event)?;
    let start = Instant::now();
    while !tail().contains("spec.devices[].taints") {
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "the dropped taints were never noticed\n{}",
            tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (tainted, _) = generation(&slices).await?;
    ensure!(
        tainted == first + 1,
        "the taint took the pool from generation {first} to {tainted}, not one write\n{}",
        tail()
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (later, _) = generation(&slices).await?;
    ensure!(
        later == tainted,
        "with the taint dropped, the pool went from generation {tainted} to {later} in 6 s\n{}",
        tail()
    );
    // Once per set of dropped fields: counters alone, then counters and taints.
    let told = tail().matches("the API server dropped fields").count();
    ensure!(
        told == 2,
        "the dropped fields logged {told} times\n{}",
        tail()
    );
    stop(plugin).await?;
    cp.stop().await?;
    Ok(())
}
