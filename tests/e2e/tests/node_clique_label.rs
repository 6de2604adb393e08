//! The NVLink clique Node label (`nodeLabels.nvlinkClique`, `--node-clique-label`; issues 42
//! and 43) on a real control plane, with exactly the chart's RBAC and admission policies: the
//! plugin, as the chart's ServiceAccount with a token bound to its pod on `gpu-node-a`, labels
//! its Node with the fake GB200 tray's clique, and removes the label when its GPUs are in no
//! clique. With that same token, every other write the `patch` on nodes could make is refused:
//! another node's label, another label, a taint or `unschedulable`, an annotation, a value that
//! is not a clique.

use std::path::Path;
use std::time::Duration;

use anyhow::ensure;
use drust_e2e::manifests::repo_path;
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);
const RELEASE: &str = "drust";
const NAMESPACE: &str = "drust-system";
const DRIVER: &str = "gpu.drust.dev";
const LABEL: &str = "gpu.drust.dev/nvlink-clique";
const POLICY: &str = "drust-node-clique-label";
/// The clique of every GPU of `examples/topologies/gb200-nvl-tray.yaml`.
const CLIQUE: &str = "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.32766";

async fn client_from(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(kubeconfig)?,
        &KubeConfigOptions::default(),
    )
    .await?;
    Ok(kube::Client::try_from(config)?)
}

fn label_of(node: &Node) -> Option<String> {
    node.metadata.labels.as_ref()?.get(LABEL).cloned()
}

/// `node`'s clique label once it reads `want`.
async fn wait_label(nodes: &Api<Node>, node: &str, want: Option<&str>) -> anyhow::Result<()> {
    until(
        &format!("Node {node}'s label {LABEL} = {want:?}"),
        TIMEOUT,
        || async {
            let n = nodes.get(node).await.map_err(|e| e.to_string())?;
            Ok((label_of(&n).as_deref() == want).then_some(()))
        },
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_plugin_labels_its_own_node_with_its_clique_and_nothing_else() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let admin = cp.client().await?;
    let scratch = tempfile::tempdir()?;
    for node in ["gpu-node-a", "gpu-node-b"] {
        cp.register_node(node, &[("nvidia.com/gpu.present", "true")])
            .await?;
    }
    // The chart as the README installs it, with the clique label on.
    let installed = drust_e2e::helm::install_chart(
        &scratch.path().join("helm-home"),
        cp.kubeconfig_path(),
        RELEASE,
        NAMESPACE,
        (std::net::Ipv4Addr::LOCALHOST.into(), 443),
        &[format!("nodeLabels.nvlinkClique={LABEL}")],
    )
    .await?;
    ensure!(installed.contains("STATUS: deployed"), "{installed}");

    // The plugin's identity: the chart's ServiceAccount, its token bound to the DaemonSet's pod
    // on gpu-node-a (no kubelet runs it; the scheduler binds it).
    let kubeconfig = scratch.path().join("plugin.kubeconfig");
    drust_e2e::rbac::chart_plugin_kubeconfig(&cp, &admin, "gpu-node-a", &kubeconfig, TIMEOUT)
        .await?;
    let as_plugin: Api<Node> = Api::all(client_from(&kubeconfig).await?);
    let nodes: Api<Node> = Api::all(admin.clone());

    // The policy is loaded by an informer: wait until it refuses a write to another node.
    let other_node = json!({"metadata": {"labels": {LABEL: CLIQUE}}});
    until("the node label policy enforced", TIMEOUT, || async {
        match as_plugin
            .patch(
                "gpu-node-b",
                &PatchParams {
                    dry_run: true,
                    ..Default::default()
                },
                &Patch::Merge(&other_node),
            )
            .await
        {
            Err(kube::Error::Api(e)) if e.message.contains(POLICY) => Ok(Some(())),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;

    // The plugin on the GB200 tray labels its own node with the tray's clique.
    let mut plugin = NodePlugin::start_with(
        &cp,
        DRIVER,
        "gpu-node-a",
        &repo_path("examples/topologies/gb200-nvl-tray.yaml"),
        |c| {
            c.kubeconfig = Some(kubeconfig.clone());
            c.node_clique_label = Some(LABEL.to_owned());
        },
    )?;
    plugin.wait_ready(&admin, TIMEOUT).await?;
    wait_label(&nodes, "gpu-node-a", Some(CLIQUE)).await?;
    ensure!(
        label_of(&nodes.get("gpu-node-b").await?).is_none(),
        "gpu-node-b labelled"
    );

    // Every other write of the same token is refused by the policy.
    let refusals = [
        (
            "gpu-node-b",
            json!({"metadata": {"labels": {LABEL: CLIQUE}}}),
            "may only label its own Node",
        ),
        (
            "gpu-node-a",
            json!({"metadata": {"labels": {"tier": "gold"}}}),
            "may only change the Node label",
        ),
        (
            "gpu-node-a",
            json!({"metadata": {"labels": {"nvidia.com/gpu.present": null}}}),
            "may only change the Node label",
        ),
        (
            "gpu-node-a",
            json!({"metadata": {"labels": {LABEL: "gold"}}}),
            "must name an NVLink clique",
        ),
        (
            "gpu-node-a",
            json!({"spec": {"unschedulable": true}}),
            "may not change a Node's spec",
        ),
        (
            "gpu-node-a",
            json!({"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}),
            "may not change a Node's spec",
        ),
        (
            "gpu-node-a",
            json!({"metadata": {"annotations": {"a": "b"}}}),
            "may not change a Node's spec",
        ),
    ];
    for (node, patch, want) in &refusals {
        let result = as_plugin
            .patch(node, &PatchParams::default(), &Patch::Merge(patch))
            .await;
        ensure!(
            matches!(&result, Err(kube::Error::Api(e)) if e.message.contains(POLICY) && e.message.contains(want)),
            "{node} {patch}: expected the policy's {want:?}, got {result:?}"
        );
    }
    let status = as_plugin
        .patch_status(
            "gpu-node-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"capacity": {"nvidia.com/gpu": "99"}}})),
        )
        .await;
    ensure!(
        status.is_err(),
        "the plugin patched its Node's status: {status:?}"
    );
    let a = nodes.get("gpu-node-a").await?;
    ensure!(
        label_of(&a).as_deref() == Some(CLIQUE)
            && !a
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key("tier"))
            && a.spec.as_ref().and_then(|s| s.unschedulable) != Some(true),
        "{:?}",
        a.metadata.labels
    );

    // The same node's GPUs in no clique (a DGX H100): the label goes.
    plugin.stop().await?;
    let mut plugin = NodePlugin::start_with(
        &cp,
        DRIVER,
        "gpu-node-a",
        &repo_path("examples/topologies/dgx-h100.yaml"),
        |c| {
            c.kubeconfig = Some(kubeconfig.clone());
            c.node_clique_label = Some(LABEL.to_owned());
        },
    )?;
    plugin.wait_ready(&admin, TIMEOUT).await?;
    wait_label(&nodes, "gpu-node-a", None).await?;
    plugin.stop().await?;
    cp.stop().await?;
    Ok(())
}
