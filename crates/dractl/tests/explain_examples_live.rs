//! The repository's examples left pending by the real scheduler (v1.36.3) and explained by
//! `dractl explain pod` against the API server, each node with the stage that stops it:
//!
//! - `l40s-node` (the fake PCIe L40S topology): `examples/nvlink-pair` wants H100 NVLs (the
//!   request's selectors), `examples/hopper-or-newer` compute capability 9.0 (the class's
//!   selectors: an L40S is 8.9);
//! - `nvl-node` (the fake paired-NVLink H100 NVL topology) with every GPU tainted NoSchedule, as
//!   the health monitor taints a GPU with an XID error: both stop at the taints.
//!
//! The slices are the plugin's own `--dry-run` snapshots, created directly.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::ensure;
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::pods::unschedulable;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
use kube::api::{Api, PostParams};
use serde::Deserialize as _;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

async fn create_slices(
    client: &kube::Client,
    snapshot: &str,
    node: &str,
    taint: bool,
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
        if taint {
            for device in slice.spec.devices.iter_mut().flatten() {
                device.taints = Some(vec![DeviceTaint {
                    key: "gpu.drust.dev/unhealthy".into(),
                    value: Some("xid-79".into()),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                }]);
            }
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
    create_slices(&client, "pcie-l40s", "l40s-node", false).await?;
    create_slices(&client, "paired-nvlink-bridges", "nvl-node", true).await?;
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
    }
    Ok(())
}
