//! A gang runs on two real nodes (issue 42): the control plane with workload-aware scheduling
//! (1.36's, or 1.37's with `DRUST_K8S=1.37`: [`ControlPlaneOptions::workload_aware`]), two real nodes (kubelet with
//! `DRAWorkloadResourceClaims`, containerd and the plugin each, fake DGX H100s,
//! [`drust_e2e::cluster`]). A Workload and PodGroup with `gang.minCount: 4`, four pods of four
//! GPUs each: all four are bound together, two per node, and run; each container sees exactly the
//! four GPUs its claim holds (device nodes from the CDI spec, in the log the API server relays
//! from that node's kubelet).
//!
//! `tests/gangs.rs` checks the scheduler's verdicts on nodes without a kubelet (minCount not
//! met, topology constraints, the stale-claim check).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::ControlPlaneOptions;
use drust_e2e::cluster::{Cluster, ClusterOptions, DRIVER, NodeGroup};
use drust_e2e::images::WORKLOAD_IMAGE;
use drust_e2e::kubernetes::KubernetesVersion;
use drust_e2e::manifests::apply_yaml;
use drust_e2e::node_pods::{SCRIPT, seen};
use drust_e2e::wait::until;
use drust_e2e::workloads;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{ListParams, LogParams};

const TIMEOUT: Duration = Duration::from_secs(240);

const TEMPLATES: &str = "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: four-gpus, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: 4}
";

/// A gang `name` of `pods` pods (`minCount` all of them), each printing its devices
/// ([`SCRIPT`]) and sleeping, each with its own claim from `four-gpus`.
fn gang(version: KubernetesVersion, name: &str, pods: u32) -> String {
    let (entry, template, claims) = ("gpus", "four-gpus", "");
    let mut text = workloads::gang(version, name, pods, claims);
    let command =
        serde_json::to_string(&format!("{SCRIPT}; trap 'exit 0' TERM; sleep 3600 & wait"))
            .unwrap_or_default();
    for i in 0..pods {
        text.push_str(&format!(
            "---
apiVersion: v1
kind: Pod
metadata: {{name: {name}-{i}, namespace: default, labels: {{gang: {name}}}}}
spec:
  schedulingGroup: {{podGroupName: {name}}}
  restartPolicy: Never
  terminationGracePeriodSeconds: 2
  containers:
    - name: main
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command: [/bin/sh, -c, {command}]
      resources: {{claims: [{{name: {entry}}}]}}
  resourceClaims:
    - {{name: {entry}, resourceClaimTemplateName: {template}}}
"
        ));
    }
    text
}

/// Waits until the `count` pods of `gang` run; the pods.
async fn running(
    pods: &Api<Pod>,
    gang: &str,
    count: usize,
    cluster: &Cluster,
) -> anyhow::Result<Vec<Pod>> {
    until(
        &format!("the {count} pods of gang {gang} Running"),
        TIMEOUT,
        || async {
            let list = pods
                .list(&ListParams::default().labels(&format!("gang={gang}")))
                .await
                .map_err(|e| e.to_string())?
                .items;
            let phases: Vec<&str> = list
                .iter()
                .map(|p| {
                    p.status
                        .as_ref()
                        .and_then(|s| s.phase.as_deref())
                        .unwrap_or("")
                })
                .collect();
            if phases.iter().any(|p| *p == "Failed" || *p == "Succeeded") {
                return Err(format!("a pod of gang {gang} ended: {phases:?}"));
            }
            Ok((list.len() == count && phases.iter().all(|p| *p == "Running")).then_some(list))
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))
}

/// The GPU device nodes (`/dev/nvidiaN`) pod `name`'s container printed, once it has.
async fn gpus_seen(pods: &Api<Pod>, name: &str) -> anyhow::Result<Vec<String>> {
    let log = until(
        &format!("pod {name}'s devices printed"),
        TIMEOUT,
        || async {
            let log = pods
                .logs(name, &LogParams::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok(log.contains("done").then_some(log))
        },
    )
    .await?;
    let (nodes, _) = seen(&log);
    Ok(nodes
        .into_iter()
        .filter(|n| {
            n.strip_prefix("/dev/nvidia")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect())
}

/// The claim of `pod` (its one entry) and its devices as the API server stores them.
async fn claim_of(
    claims: &Api<ResourceClaim>,
    pod: &Pod,
) -> anyhow::Result<(ResourceClaim, Vec<(String, String)>)> {
    let claim_name = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|s| s.first())
        .and_then(|s| s.resource_claim_name.clone())
        .context("the pod's claim")?;
    let claim = claims.get(&claim_name).await?;
    let devices = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| (r.pool, r.device))
        .collect();
    Ok((claim, devices))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gang_runs_whole_on_two_real_nodes() -> anyhow::Result<()> {
    let version = KubernetesVersion::from_env()?;
    let cluster = Cluster::start(ClusterOptions {
        control_plane: ControlPlaneOptions::workload_aware(),
        ..ClusterOptions::default().real(
            NodeGroup::new("gang-", 2, "examples/topologies/dgx-h100.yaml")
                // The kubelet refuses DRAWorkloadResourceClaims without the gate it depends on.
                .kubelet_feature_gate("GenericWorkload", true)
                .kubelet_feature_gate("DRAWorkloadResourceClaims", true),
        )
    })
    .await?;
    let client = cluster.client().clone();
    apply_yaml(&client, TEMPLATES, Path::new("templates")).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");

    // 4 pods × 4 GPUs on two 8-GPU nodes: all bound together, two per node, running, each
    // container with exactly its claim's four GPUs.
    apply_yaml(&client, &gang(version, "train", 4), Path::new("gang train")).await?;
    let train = running(&pods, "train", 4, &cluster).await?;
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for pod in &train {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        *per_node.entry(node.clone()).or_default() += 1;
        let (_, devices) = claim_of(&claims, pod).await?;
        ensure!(
            devices.len() == 4 && devices.iter().all(|(pool, _)| *pool == node),
            "{name} on {node}: {devices:?}"
        );
        let gpus = gpus_seen(&pods, &name).await?;
        ensure!(
            gpus.len() == 4,
            "{name} sees {gpus:?}, its claim holds {devices:?}"
        );
    }
    ensure!(
        per_node.len() == 2 && per_node.values().all(|n| *n == 2),
        "gang train per node: {per_node:?}"
    );

    eprintln!("gang train: {per_node:?} ({DRIVER})");
    cluster.stop().await?;
    Ok(())
}
