//! A node name of the longest length Kubernetes allows (253 characters, a DNS subdomain) on the
//! real API server: every object the plugin names after its node stays within the API's
//! limits. ResourceSlices were named `<node>-<driver>-<i>` (too long) and labelled with the
//! node name (a label value holds 63); Event names (`<node>.<hex ns>`) overflowed and their
//! `reportingInstance` (at most 128) too. Now slices are created by `generateName` as upstream
//! names them, Event names and reporting instances are cut to fit, and the server takes both.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::manifests::repo_path;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::{ListParams, PostParams};

const DRIVER: &str = "gpu.drust.dev";

#[tokio::test]
async fn a_253_character_node_name_publishes_its_slices_and_records_its_events()
-> anyhow::Result<()> {
    let node = format!(
        "{}.{}.{}.{}",
        "a".repeat(63),
        "b".repeat(63),
        "c".repeat(63),
        "d".repeat(61)
    );
    ensure!(node.len() == 253);
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    // The hostname label holds 63 characters; the node name is not the hostname here.
    let object: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node, "labels": {"kubernetes.io/hostname": "a".repeat(63)}},
    }))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &object)
        .await?;

    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = BinaryHost::new(
        "drust-long-node-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        &node,
    )?;
    // A damaged checkpoint: the plugin rebuilds it and records a Warning Event on the Node.
    std::fs::create_dir_all(host.plugin_dir())?;
    std::fs::write(host.plugin_dir().join("checkpoint.json"), b"{ not json")?;
    let log = host.root().join("plugin.log");
    let plugin = PluginProcess(host.command(&log, None)?.spawn()?);
    let tail = || std::fs::read_to_string(&log).unwrap_or_default();

    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let start = Instant::now();
    let (published, recorded) = loop {
        let published = slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await?
            .items;
        let devices: usize = published
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        let recorded: Vec<Event> = events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("CheckpointRecovered"))
            .collect();
        if devices == 8 && !recorded.is_empty() {
            break (published, recorded);
        }
        ensure!(
            start.elapsed() < Duration::from_secs(60),
            "after 60 s: {devices} devices published, {} events\n{}",
            recorded.len(),
            tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for s in &published {
        let name = s.metadata.name.as_deref().context("slice name")?;
        ensure!(
            name.starts_with("00000-gpu.drust.dev-aaaa") && name.len() == 63,
            "{name}"
        );
        ensure!(s.spec.pool.name == node, "pool {}", s.spec.pool.name);
    }
    let event = &recorded[0];
    ensure!(
        event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.as_str()),
        "{event:?}"
    );
    ensure!(
        event.reporting_instance.as_deref().map(str::len) == Some(128),
        "{event:?}"
    );
    ensure!(
        !tail().contains("could not record the warning event"),
        "{}",
        tail()
    );
    stop(plugin).await?;
    cp.stop().await?;
    Ok(())
}
