//! A gang runs on two real nodes (issue 42): the control plane with workload-aware scheduling
//! (1.36's, or 1.37's with `DRUST_K8S=1.37`: [`ControlPlaneOptions::workload_aware`]), two real nodes (kubelet with
//! `DRAWorkloadResourceClaims`, containerd and the plugin each, fake DGX H100s,
//! [`drust_e2e::cluster`]). A Workload and PodGroup with `gang.minCount: 4`, four pods of four
//! GPUs each: all four are bound together, two per node, and run; each container sees exactly the
//! four GPUs its claim holds (device nodes from the CDI spec, in the log the API server relays
//! from that node's kubelet).
//!
//! Then a PodGroup's claim (KEP-5729, `PodGroup.spec.resourceClaims`): two pods of one gang
//! share the group's one GPU claim, reserved for the PodGroup, prepared by drust on its node,
//! and both containers see that GPU. The gang is kept on one node by a topology constraint on
//! the hostname: v1.36.3's scheduler may otherwise bind the second pod to a node other than the
//! claim's (kubernetes/kubernetes#140087, fixed for 1.37), where drust refuses to prepare it.
//!
//! `tests/gangs.rs` checks the scheduler's verdicts on nodes without a kubelet (minCount not
//! met, topology constraints, the stale-claim check).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
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
use gpu_kubelet_plugin::claim_users::{ClaimUsers, RECORDS_DIR};
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

/// How a gang's pods get their GPUs.
#[derive(Clone, Copy)]
enum Claims {
    /// Each pod its own claim from `four-gpus`.
    PerPod,
    /// The PodGroup's one claim from `one-gpu` (KEP-5729), the group kept on one node by a
    /// topology constraint on the hostname: v1.36.3's scheduler may otherwise bind a later pod
    /// elsewhere than the claim's device (kubernetes/kubernetes#140087, fixed for 1.37).
    OfTheGroup,
}

/// A gang `name` of `pods` pods (`minCount` all of them) for the running Kubernetes `version`,
/// each printing its devices ([`SCRIPT`]) and sleeping, with GPUs as `claims` says.
fn gang(version: KubernetesVersion, name: &str, pods: u32, claims: Claims) -> String {
    let (entry, template, group_spec) = match claims {
        Claims::PerPod => ("gpus", "four-gpus", ""),
        Claims::OfTheGroup => (
            "fabric",
            "one-gpu",
            "  schedulingConstraints:\n    topology: [{key: kubernetes.io/hostname}]\n  \
             resourceClaims:\n    - {name: fabric, resourceClaimTemplateName: one-gpu}\n",
        ),
    };
    let mut text = workloads::gang(version, name, pods, group_spec);
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

const ONE_GPU: &str = "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly: {deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: 1}
";

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
    apply_yaml(
        &client,
        &gang(version, "train", 4, Claims::PerPod),
        Path::new("gang train"),
    )
    .await?;
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
    pods.delete_collection(
        &Default::default(),
        &ListParams::default().labels("gang=train"),
    )
    .await?;
    until("gang train gone", TIMEOUT, || async {
        let left = pods
            .list(&ListParams::default().labels("gang=train"))
            .await
            .map_err(|e| e.to_string())?;
        Ok(left.items.is_empty().then_some(()))
    })
    .await?;

    // A PodGroup's claim (KEP-5729) on real kubelets: one GPU for the whole group, reserved for
    // the PodGroup, prepared once on its node, and seen by both pods. The group is kept on one
    // node by a topology constraint on the hostname: without it, v1.36.3's scheduler may bind the
    // second pod to another node than the claim's allocation (kubernetes/kubernetes#140087, fixed
    // for 1.37 by #140089), where drust refuses to prepare a claim with no device in its pool.
    apply_yaml(&client, ONE_GPU, Path::new("one-gpu")).await?;
    apply_yaml(
        &client,
        &gang(version, "shared", 2, Claims::OfTheGroup),
        Path::new("gang shared"),
    )
    .await?;
    let shared = running(&pods, "shared", 2, &cluster).await?;
    let mut seen_by = BTreeMap::new();
    let mut claim_names = Vec::new();
    for pod in &shared {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let (claim, devices) = claim_of(&claims, pod).await?;
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.clone())
            .unwrap_or_default();
        ensure!(
            reserved.len() == 1
                && reserved[0].resource == "podgroups"
                && reserved[0].name == "shared",
            "the group's claim is reserved for the PodGroup: {reserved:?}"
        );
        ensure!(
            devices.len() == 1 && devices[0].0 == node,
            "{name} on {node}: the group's GPU {devices:?} is on its node"
        );
        claim_names.push(claim.metadata.name.clone().unwrap_or_default());
        seen_by.insert(name.clone(), (node, gpus_seen(&pods, &name).await?));
    }
    ensure!(
        claim_names[0] == claim_names[1],
        "both pods use the PodGroup's one claim: {claim_names:?}"
    );
    let views: Vec<_> = seen_by.values().collect();
    ensure!(
        views[0] == views[1] && views[0].1.len() == 1,
        "both pods, on one node, see the group's one GPU: {seen_by:?}"
    );
    eprintln!(
        "gang shared: one PodGroup claim {}, {seen_by:?}",
        claim_names[0]
    );
    // The claim names no pod; the runtime ran drust's claim-user hook as each container was
    // created, and the plugin's records name both pods with the UIDs the API server holds.
    let (claim, _) = claim_of(&claims, &shared[0]).await?;
    let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
    let node = seen_by
        .values()
        .next()
        .map(|(n, _)| n.clone())
        .unwrap_or_default();
    let plugin_dir = cluster
        .real(&node)
        .context("the group's node")?
        .host()
        .plugin_dir();
    let users =
        ClaimUsers::new(PathBuf::new(), &plugin_dir).users(&BTreeSet::from([claim_uid.clone()]));
    let recorded: BTreeSet<(String, String, String)> = users
        .get(&claim_uid)
        .into_iter()
        .flatten()
        .map(|u| (u.pod.clone(), u.pod_uid.clone(), u.container.clone()))
        .collect();
    let want: BTreeSet<(String, String, String)> = shared
        .iter()
        .map(|p| {
            (
                p.metadata.name.clone().unwrap_or_default(),
                p.metadata.uid.clone().unwrap_or_default(),
                "main".to_owned(),
            )
        })
        .collect();
    ensure!(
        recorded == want,
        "the claim-user records under {} name the group's pods: {recorded:?}, want {want:?}",
        plugin_dir.join(RECORDS_DIR).display()
    );
    eprintln!("gang shared: recorded users {recorded:?}");
    cluster.stop().await?;
    Ok(())
}
