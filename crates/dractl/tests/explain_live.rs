//! `dractl explain pod|claim NAMESPACE/NAME` against the real control plane (v1.36.3), run as a
//! ServiceAccount that holds only `deploy/rbac/dractl-explain.yaml`: the README's unsatisfiable
//! example, left pending by the real scheduler, is explained at the request's selectors; a claim
//! it says fits on `gpu-node-0` is then put there by the scheduler; `dractl simulate` then counts
//! the NVLink pairs left.
//!
//! The node's devices are the fake DGX H100's slices as the plugin publishes them
//! (`crates/gpu-kubelet-plugin/tests/snapshots/dgx-h100.yaml`), created directly.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::pods::{bound_with_claim, unschedulable};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, PostParams};
use serde::Deserialize;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

fn dractl(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<Output> {
    Ok(std::process::Command::new(env!("CARGO_BIN_EXE_dractl"))
        .arg("explain")
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .output()?)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_pod_is_explained_with_only_the_documented_rbac() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = run(&cp).await;
    cp.stop().await?;
    result
}

async fn run(cp: &ControlPlane) -> anyhow::Result<()> {
    cp.register_node("gpu-node-0", &[]).await?;
    let client = cp.client().await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    // The snapshot's slices have generated names: created, not applied.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let snapshot = std::fs::read_to_string(repo_path(
        "crates/gpu-kubelet-plugin/tests/snapshots/dgx-h100.yaml",
    ))?;
    for doc in serde_yaml_ng::Deserializer::from_str(&snapshot) {
        let slice = ResourceSlice::deserialize(doc)?;
        slices.create(&PostParams::default(), &slice).await?;
    }
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    drust_e2e::rbac::dractl_explain_kubeconfig(cp, &client, "explainer", &kubeconfig).await?;

    // The README's unsatisfiable example: a GPU with 200 GiB, which no H100 of the node has.
    apply_file(
        &client,
        &repo_path("examples/unsatisfiable/unsatisfiable.yaml"),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let (reason, message) = unschedulable(&pods, "cuda-200gi", WAIT).await?;
    ensure!(
        reason == "Unschedulable" && message.contains("cannot allocate all claims"),
        "the scheduler's own reason says no more: {reason}: {message}"
    );
    let out = dractl(&kubeconfig, &["pod", "default/cuda-200gi"])?;
    ensure!(out.status.success(), "dractl: {}", text(&out.stderr));
    let human = text(&out.stdout);
    ensure!(
        human.starts_with("Does not fit: the pod's claims fit on no node (1 node checked).\n"),
        "{human}"
    );
    ensure!(
        human.contains(", request gpu: 0 of 8 devices match the request's selectors, the request needs 1 (`device.capacity[\"gpu.drust.dev\"].memory.compareTo(quantity(\"200Gi\")) >= 0` removed 8)"),
        "{human}"
    );
    let out = dractl(&kubeconfig, &["pod", "default/cuda-200gi", "-o", "json"])?;
    ensure!(out.status.success(), "dractl: {}", text(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout)?;
    let request = &json["nodes"][0]["explanation"]["requests"][0];
    ensure!(request["blockedAt"] == "requestSelectors", "{json}");
    let claim = request["claim"].as_str().unwrap_or("");
    ensure!(
        claim.starts_with("default/cuda-200gi-gpu-"),
        "the claim generated from the template: {claim}"
    );

    // A claim that fits: dractl names the node, and the scheduler then binds a pod using it there.
    apply_yaml(
        &client,
        r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: one-gpu, namespace: default}
spec:
  devices:
    requests: [{name: gpu, exactly: {deviceClassName: gpu.drust.dev}}]
"#,
        Path::new("one-gpu claim"),
    )
    .await?;
    let out = dractl(&kubeconfig, &["claim", "default/one-gpu"])?;
    ensure!(out.status.success(), "dractl: {}", text(&out.stderr));
    ensure!(
        text(&out.stdout) == "Fits on 1 of 1 node: gpu-node-0.\n",
        "{}",
        text(&out.stdout)
    );
    apply_yaml(
        &client,
        r#"
apiVersion: v1
kind: Pod
metadata: {name: uses-one-gpu, namespace: default}
spec:
  containers: [{name: c, image: busybox, resources: {claims: [{name: gpu}]}}]
  resourceClaims: [{name: gpu, resourceClaimName: one-gpu}]
"#,
        Path::new("uses-one-gpu pod"),
    )
    .await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (bound, _) = bound_with_claim(&pods, &claims, "uses-one-gpu", WAIT).await?;
    let node = bound
        .spec
        .and_then(|s| s.node_name)
        .context("bound pod has a node")?;
    ensure!(node == "gpu-node-0", "bound to {node}");

    // Capacity left, read from the live cluster with the same role: one H100 is now held by
    // one-gpu, so three NVLink pairs fit on the other seven.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dractl"))
        .arg("simulate")
        .arg("--claim-template")
        .arg(repo_path("examples/simulate/nvlink-pair-template.yaml"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .output()?;
    ensure!(
        out.status.success(),
        "dractl simulate: {}",
        text(&out.stderr)
    );
    ensure!(
        text(&out.stdout).starts_with("3 more pods fit.\nPer node: gpu-node-0: 3.\n"),
        "{}",
        text(&out.stdout)
    );

    // A pod that does not exist: exit 1, naming the call that failed.
    let out = dractl(&kubeconfig, &["pod", "default/missing"])?;
    ensure!(out.status.code() == Some(1), "{}", text(&out.stderr));
    ensure!(
        text(&out.stderr).contains("get pod default/missing"),
        "{}",
        text(&out.stderr)
    );
    Ok(())
}
