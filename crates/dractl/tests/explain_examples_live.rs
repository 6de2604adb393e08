//! The repository's examples left pending by the real scheduler (v1.36.3) and explained by
//! `dractl explain pod` against the API server, each node with the stage that stops it:
//!
//! - `l40s-node` (the fake PCIe L40S topology): `examples/nvlink-pair` wants H100 NVLs (the
//!   request's selectors), `examples/hopper-or-newer` compute capability 9.0 (the class's
//!   selectors: an L40S is 8.9);
//! - `nvl-node` (the fake paired-NVLink H100 NVL topology) with every GPU tainted NoSchedule, as
//!   the health monitor taints a GPU with an XID error: both stop at the taints;
//! - `examples/gpu-memory` (40 GiB) before a fitting GPU exists: `l4-node` (the L4 of the fake
//!   mixed A100/L4 topology) stops at the request's selectors, `nvl-node` at the taints and
//!   `l40s-node`, its slices deleted, at what is offered; once `l40s-node` publishes again the
//!   scheduler binds the pod there;
//! - `examples/numa-aligned` (four H100 on one NUMA node) on `numa-node`, a DGX H100 with one
//!   GPU of each NUMA node gone: stops at the constraint, 3 devices for each value;
//! - `examples/mig-partitionable`'s `one-more` after the example's two pods took both A100s'
//!   memory slices: `mig-node` stops at counters and capacity. That node's slices come from the
//!   node plugin itself (`--fake-topology`, `--mig-strategy partitionable`);
//! - `examples/fractional-gpus`' 20 GiB of an H100, a fourth time on `shares-node`, one H100
//!   published shareable that three such shares hold: stops at counters and capacity, and the
//!   text names the memory left (20119Mi of 81559Mi) against what the share consumes.
//!
//! The other slices are the plugin's own `--dry-run` snapshots, created directly.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::ensure;
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::pods::{bound_with_claim, unschedulable};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{Device, DeviceTaint, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde::Deserialize as _;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

/// Creates the snapshot's slices for `node`, with the devices `keep` accepts, each changed by
/// `edit`.
async fn create_slices(
    client: &kube::Client,
    snapshot: &str,
    node: &str,
    edit: fn(&mut Device),
    keep: impl Fn(&Device) -> bool,
) -> anyhow::Result<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let text = std::fs::read_to_string(repo_path(&format!(
        "crates/gpu-kubelet-plugin/tests/snapshots/{snapshot}.yaml"
    )))?;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let mut slice = ResourceSlice::deserialize(doc)?;
        slice.metadata.generate_name = Some(format!("{node}-gpus-"));
        slice.spec.node_name = Some(node.to_owned());
        slice.spec.pool.name = node.to_owned();
        if let Some(devices) = slice.spec.devices.as_mut() {
            devices.retain(&keep);
        }
        for device in slice.spec.devices.iter_mut().flatten() {
            edit(device);
        }
        slices.create(&PostParams::default(), &slice).await?;
    }
    Ok(())
}

fn explain(kubeconfig: &Path, pod: &str, json: bool) -> anyhow::Result<Output> {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_dractl"));
    command
        .args(["explain", "pod", pod, "--kubeconfig"])
        .arg(kubeconfig);
    if json {
        command.args(["-o", "json"]);
    }
    Ok(command.output()?)
}

/// Per node, the stage each request is blocked at.
fn stages(json: &Value) -> Vec<(String, Vec<String>)> {
    json["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| {
            let blocked = n["explanation"]["requests"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| r["blockedAt"].as_str().unwrap_or("none").to_owned())
                .collect();
            (n["name"].as_str().unwrap_or("").to_owned(), blocked)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_examples_are_explained_at_the_stage_that_stops_them() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = run(&cp).await;
    cp.stop().await?;
    result
}

async fn run(cp: &ControlPlane) -> anyhow::Result<()> {
    let client = cp.client().await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    cp.register_node("l40s-node", &[]).await?;
    cp.register_node("nvl-node", &[]).await?;
    create_slices(&client, "pcie-l40s", "l40s-node", as_is, |_| true).await?;
    create_slices(&client, "paired-nvlink-bridges", "nvl-node", taint, |_| {
        true
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::copy(cp.kubeconfig_path(), &kubeconfig)?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");

    for (example, pod, l40s_stage) in [
        (
            "examples/nvlink-pair/nvlink-pair.yaml",
            "nccl-pair",
            "requestSelectors",
        ),
        (
            "examples/hopper-or-newer/hopper-or-newer.yaml",
            "fp8-inference",
            "classSelectors",
        ),
    ] {
        apply_file(&client, &repo_path(example)).await?;
        unschedulable(&pods, pod, WAIT).await?;
        let out = explain(&kubeconfig, &format!("default/{pod}"), true)?;
        ensure!(
            out.status.success(),
            "{example}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: Value = serde_json::from_slice(&out.stdout)?;
        let mut got = stages(&json);
        got.sort();
        ensure!(
            got == [
                ("l40s-node".to_owned(), vec![l40s_stage.to_owned()]),
                ("nvl-node".to_owned(), vec!["taintsTolerated".to_owned()]),
            ],
            "{example}: {got:?}"
        );
        let out = explain(&kubeconfig, &format!("default/{pod}"), false)?;
        let human = String::from_utf8_lossy(&out.stdout);
        ensure!(
            human.contains("1 node (nvl-node), does not fit: ")
                && human.contains("have no untolerated taint")
                && human.contains("(gpu.drust.dev/unhealthy=xid-79:NoSchedule)"),
            "{example}: {human}"
        );
        pods.delete(pod, &DeleteParams::default()).await?;
    }

    forty_gib(cp, &client, &kubeconfig, &pods).await?;
    numa(cp, &client, &kubeconfig, &pods).await?;
    partitionable_full(cp, &client, &kubeconfig, &pods).await?;
    shares_full(cp, &client, &kubeconfig, &pods).await
}

/// `examples/fractional-gpus/h100-20gi.yaml` on a node of one shareable H100 that three such
/// shares already hold: the fourth is explained by the memory left.
async fn shares_full(
    cp: &ControlPlane,
    client: &kube::Client,
    kubeconfig: &Path,
    pods: &Api<Pod>,
) -> anyhow::Result<()> {
    apply_file(client, &repo_path("deploy/deviceclasses/gpu-share.yaml")).await?;
    cp.register_node("shares-node", &[]).await?;
    let first = std::sync::Mutex::new(true);
    create_slices(client, "dgx-h100", "shares-node", shareable, |_| {
        std::mem::replace(&mut *first.lock().expect("lock"), false)
    })
    .await?;
    let example = std::fs::read_to_string(repo_path("examples/fractional-gpus/h100-20gi.yaml"))?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    for pod in ["llm-7b", "llm-7b-2", "llm-7b-3", "llm-7b-4"] {
        let text = example.replace("name: llm-7b", &format!("name: {pod}"));
        drust_e2e::manifests::apply_yaml(client, &text, Path::new(pod)).await?;
        if pod != "llm-7b-4" {
            bound_with_claim(pods, &claims, pod, WAIT).await?;
        }
    }
    unschedulable(pods, "llm-7b-4", WAIT).await?;
    let json = explain_json(kubeconfig, "llm-7b-4")?;
    ensure!(
        stage_on(&json, "shares-node") == Some(vec!["countersAndCapacity".to_owned()]),
        "shares: {:?}",
        stages(&json)
    );
    let out = explain(kubeconfig, "default/llm-7b-4", false)?;
    let human = String::from_utf8_lossy(&out.stdout);
    // 81559Mi less three shares of 20Gi.
    ensure!(
        human.contains("memory: 20119Mi of 81559Mi left, the request consumes 20Gi"),
        "shares: {human}"
    );
    Ok(())
}

/// The stage `node`'s requests are blocked at, from `dractl explain pod -o json`.
fn stage_on(json: &Value, node: &str) -> Option<Vec<String>> {
    stages(json)
        .into_iter()
        .find(|(n, _)| n == node)
        .map(|(_, s)| s)
}

fn explain_json(kubeconfig: &Path, pod: &str) -> anyhow::Result<Value> {
    let out = explain(kubeconfig, &format!("default/{pod}"), true)?;
    ensure!(
        out.status.success(),
        "{pod}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The plugin's health taint after an XID 79.
fn taint(device: &mut Device) {
    device.taints = Some(vec![DeviceTaint {
        key: "gpu.drust.dev/unhealthy".into(),
        value: Some("xid-79".into()),
        effect: "NoSchedule".into(),
        ..Default::default()
    }]);
}

/// As published.
fn as_is(_: &mut Device) {}

/// As published with fractional GPUs (`--consumable-capacity`).
fn shareable(device: &mut Device) {
    gpu_inventory::shares::make_shareable(device);
}

fn product(device: &Device) -> Option<String> {
    let attrs = device.attributes.as_ref()?;
    attrs.get("productName")?.string.clone()
}

/// `examples/gpu-memory` while no untainted GPU has 40 GiB, then once one does.
async fn forty_gib(
    cp: &ControlPlane,
    client: &kube::Client,
    kubeconfig: &Path,
    pods: &Api<Pod>,
) -> anyhow::Result<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    slices
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().fields("spec.nodeName=l40s-node"),
        )
        .await?;
    cp.register_node("l4-node", &[]).await?;
    create_slices(client, "mixed-a100-l4", "l4-node", as_is, |d| {
        product(d).is_some_and(|p| p.contains("L4"))
    })
    .await?;
    apply_file(client, &repo_path("examples/gpu-memory/gpu-memory.yaml")).await?;
    unschedulable(pods, "cuda-40gi", WAIT).await?;
    let json = explain_json(kubeconfig, "cuda-40gi")?;
    ensure!(
        stage_on(&json, "l4-node") == Some(vec!["requestSelectors".to_owned()])
            && stage_on(&json, "nvl-node") == Some(vec!["taintsTolerated".to_owned()])
            // Its slices are gone: nothing offered.
            && stage_on(&json, "l40s-node") == Some(vec!["offered".to_owned()]),
        "40 GiB: {:?}",
        stages(&json)
    );
    // A fitting GPU appears: the scheduler places the pod there.
    create_slices(client, "pcie-l40s", "l40s-node", as_is, |_| true).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (pod, _) = bound_with_claim(pods, &claims, "cuda-40gi", WAIT).await?;
    let node = pod.spec.and_then(|s| s.node_name);
    ensure!(node.as_deref() == Some("l40s-node"), "bound to {node:?}");
    Ok(())
}

/// `examples/numa-aligned` on a DGX H100 missing one GPU of each NUMA node.
async fn numa(
    cp: &ControlPlane,
    client: &kube::Client,
    kubeconfig: &Path,
    pods: &Api<Pod>,
) -> anyhow::Result<()> {
    cp.register_node("numa-node", &[]).await?;
    let gone = std::sync::Mutex::new(std::collections::BTreeSet::new());
    create_slices(client, "dgx-h100", "numa-node", as_is, |d| {
        let numa = d
            .attributes
            .as_ref()
            .and_then(|a| a.get("resource.kubernetes.io/numaNode"))
            .and_then(|v| v.int);
        // The first GPU seen of each NUMA node is gone.
        !gone.lock().expect("lock").insert(numa)
    })
    .await?;
    apply_file(
        client,
        &repo_path("examples/numa-aligned/numa-aligned.yaml"),
    )
    .await?;
    unschedulable(pods, "numa-aligned-training", WAIT).await?;
    let json = explain_json(kubeconfig, "numa-aligned-training")?;
    ensure!(
        stage_on(&json, "numa-node") == Some(vec!["constraint".to_owned()]),
        "numa: {:?}",
        stages(&json)
    );
    let node = json["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["name"] == "numa-node")
        .cloned()
        .unwrap_or_default();
    let values = &node["explanation"]["requests"][0]["constraints"][0];
    ensure!(
        values["attribute"] == "resource.kubernetes.io/numaNode"
            && values["values"]
                == serde_json::json!([{"value": "0", "devices": 3}, {"value": "1", "devices": 3}]),
        "numa constraint values: {values}"
    );
    pods.delete("numa-aligned-training", &DeleteParams::default())
        .await?;
    Ok(())
}

/// `examples/mig-partitionable`: its two pods take every A100's memory slices, then
/// `one-more` does not fit; the node's slices are published by the plugin itself.
async fn partitionable_full(
    cp: &ControlPlane,
    client: &kube::Client,
    kubeconfig: &Path,
    pods: &Api<Pod>,
) -> anyhow::Result<()> {
    cp.register_node("mig-node", &[]).await?;
    let host = BinaryHost::new(
        "drust-explain-mig-",
        cp.kubeconfig_path(),
        &repo_path("examples/topologies/pcie-a100-mig.yaml"),
        "gpu.drust.dev",
        "mig-node",
    )?;
    let log = host.root().join("plugin.log");
    let mut cmd = host.command(&log, None)?;
    cmd.args(["--mig-strategy", "partitionable"]);
    let plugin = PluginProcess(cmd.spawn()?);
    let result = async {
        apply_file(client, &repo_path("deploy/deviceclasses/mig.yaml")).await?;
        // mig-4g-pair first, as the example's README says (see topologies.rs).
        let origin = repo_path("examples/mig-partitionable/mig-partitionable.yaml");
        let example = std::fs::read_to_string(&origin)?;
        let is_3g = |d: &serde_yaml_ng::Value| d["metadata"]["name"] == "mig-3g-pair";
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
        for (pod, docs) in [
            (
                "mig-4g-pair",
                drust_e2e::manifests::documents_where(&example, |d| !is_3g(d))?,
            ),
            (
                "mig-3g-pair",
                drust_e2e::manifests::documents_where(&example, is_3g)?,
            ),
        ] {
            drust_e2e::manifests::apply_yaml(client, &docs, &origin).await?;
            bound_with_claim(pods, &claims, pod, WAIT).await?;
        }
        apply_file(
            client,
            &repo_path("examples/mig-partitionable/one-more.yaml"),
        )
        .await?;
        unschedulable(pods, "mig-1g-one-more", WAIT).await?;
        let json = explain_json(kubeconfig, "mig-1g-one-more")?;
        ensure!(
            stage_on(&json, "mig-node") == Some(vec!["countersAndCapacity".to_owned()]),
            "partitionable: {:?}\n{}",
            stages(&json),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        anyhow::Ok(())
    }
    .await;
    stop(plugin).await?;
    result
}
