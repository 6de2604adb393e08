//! Gangs of drust claims under workload-aware scheduling (issue 42): the real kube-apiserver,
//! controller manager and scheduler of Kubernetes 1.36 (`GenericWorkload`, `GangScheduling`,
//! `TopologyAwareWorkloadScheduling`, `DRAWorkloadResourceClaims` and `WorkloadWithJob` on,
//! `scheduling.k8s.io/v1alpha2` served) or, with `DRUST_K8S=1.37`, of 1.37 (the same less
//! `GangScheduling`, `v1beta1` served; [`ControlPlaneOptions::workload_aware`]), two
//! 8-GPU nodes whose ResourceSlices the drust plugin publishes (the fake DGX H100), each node
//! labelled with its NVLink clique as `nodeLabels.nvlinkClique` or an admin would. The nodes run
//! no kubelet: what is checked is what the scheduler decides and the API server stores.
//!
//! - A gang of 4 pods × 4 GPUs (`gang.minCount: 4`) is bound whole, two pods per node, each
//!   pod's claim allocated 4 GPUs of its own node's pool.
//! - A gang of 5 × 4 GPUs needs 20 of the 16: no pod is bound, and no claim stays allocated.
//! - With a topology constraint on the clique label, a gang of 4 × 4 GPUs (two cliques' worth)
//!   is not bound, and a gang of 2 × 4 GPUs lands on one node.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::kubelet::Kubelet;
use drust_e2e::kubernetes::KubernetesVersion;
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::workloads;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{DeleteParams, ListParams};

const TIMEOUT: Duration = Duration::from_secs(120);
const DRIVER: &str = "gpu.drust.dev";
const CLIQUE_LABEL: &str = "gpu.drust.dev/nvlink-clique";
const NODES: [(&str, &str); 2] = [
    ("gpu-node-a", "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.1"),
    ("gpu-node-b", "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.2"),
];

/// Creates [`gang`]'s objects.
async fn submit(
    client: &kube::Client,
    version: KubernetesVersion,
    name: &str,
    min_count: u32,
    pods: u32,
    topology_key: Option<&str>,
    claims: Claims,
) -> anyhow::Result<()> {
    let text = gang(version, name, min_count, pods, topology_key, claims);
    apply_yaml(client, &text, Path::new(&format!("gang {name}"))).await?;
    Ok(())
}

/// How each pod of a gang gets its GPUs.
#[derive(Clone, Copy)]
enum Claims {
    /// A claim of its own from `four-gpus`.
    PerPod,
    /// The PodGroup's one claim from `one-gpu` (`spec.resourceClaims`, KEP-5729), which every
    /// pod names with the same entry.
    OfTheGroup,
}

/// A Workload with one gang template, its PodGroup (`minCount`, and a topology constraint on
/// `topology_key` when given) and `pods` pods of the group, with GPUs as `claims` says.
fn gang(
    version: KubernetesVersion,
    name: &str,
    min_count: u32,
    pods: u32,
    topology_key: Option<&str>,
    claims: Claims,
) -> String {
    let constraints = topology_key.map_or_else(String::new, |key| {
        format!("  schedulingConstraints:\n    topology: [{{key: {key}}}]\n")
    });
    let (entry, template, group_claims) = match claims {
        Claims::PerPod => ("gpus", "four-gpus", String::new()),
        Claims::OfTheGroup => (
            "fabric",
            "one-gpu",
            "  resourceClaims:\n    - {name: fabric, resourceClaimTemplateName: one-gpu}\n"
                .to_owned(),
        ),
    };
    let mut text = workloads::gang(
        version,
        name,
        min_count,
        &format!("{constraints}{group_claims}"),
    );
    for i in 0..pods {
        text.push_str(&format!(
            "---
apiVersion: v1
kind: Pod
metadata: {{name: {name}-{i}, namespace: default, labels: {{gang: {name}}}}}
spec:
  schedulingGroup: {{podGroupName: {name}}}
  terminationGracePeriodSeconds: 0
  containers:
    - name: worker
      image: registry.k8s.io/pause:3.10
      resources: {{claims: [{{name: {entry}}}]}}
  resourceClaims:
    - {{name: {entry}, resourceClaimTemplateName: {template}}}
"
        ));
    }
    text
}

const TEMPLATE: &str = "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: four-gpus, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {deviceClassName: gpu.drust.dev, allocationMode: ExactCount, count: 4}
";

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

/// The gang's pods by name: the node each is bound to (`None`: not bound).
async fn placement(
    pods: &Api<Pod>,
    gang: &str,
) -> anyhow::Result<BTreeMap<String, Option<String>>> {
    Ok(pods
        .list(&ListParams::default().labels(&format!("gang={gang}")))
        .await?
        .items
        .into_iter()
        .map(|p| {
            (
                p.metadata.name.clone().unwrap_or_default(),
                p.spec.and_then(|s| s.node_name),
            )
        })
        .collect())
}

/// Waits until every pod of `gang` (`count` of them) is bound; their nodes.
async fn bound(pods: &Api<Pod>, gang: &str, count: usize) -> anyhow::Result<Vec<String>> {
    Ok(until(
        &format!("the {count} pods of gang {gang} bound"),
        TIMEOUT,
        || async {
            let placed = placement(pods, gang).await.map_err(|e| e.to_string())?;
            let nodes: Vec<String> = placed.values().flatten().cloned().collect();
            Ok((placed.len() == count && nodes.len() == count).then_some(nodes))
        },
    )
    .await?)
}

/// Waits until the scheduler has tried every pod of `gang` and left it Unschedulable.
async fn refused(pods: &Api<Pod>, gang: &str, count: usize) -> anyhow::Result<String> {
    Ok(until(
        &format!("the {count} pods of gang {gang} Unschedulable"),
        TIMEOUT,
        || async {
            let list = pods
                .list(&ListParams::default().labels(&format!("gang={gang}")))
                .await
                .map_err(|e| e.to_string())?;
            let reasons: Vec<String> = list
                .items
                .iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none())
                .filter_map(|p| {
                    p.status
                        .as_ref()?
                        .conditions
                        .as_ref()?
                        .iter()
                        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                        .map(|c| c.message.clone().unwrap_or_default())
                })
                .collect();
            Ok((list.items.len() == count && reasons.len() == count).then(|| reasons.join("; ")))
        },
    )
    .await?)
}

/// The claims of `gang`'s pods that hold an allocation.
async fn allocated(claims: &Api<ResourceClaim>, gang: &str) -> anyhow::Result<Vec<String>> {
    Ok(claims
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(&format!("{gang}-")))
                && c.status
                    .as_ref()
                    .and_then(|s| s.allocation.as_ref())
                    .is_some()
        })
        .filter_map(|c| c.metadata.name)
        .collect())
}

/// Deletes `gang`'s pods at once (no kubelet runs them) and waits until their claims are gone.
async fn remove(pods: &Api<Pod>, claims: &Api<ResourceClaim>, gang: &str) -> anyhow::Result<()> {
    pods.delete_collection(
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
        &ListParams::default().labels(&format!("gang={gang}")),
    )
    .await?;
    until(&format!("gang {gang}'s claims gone"), TIMEOUT, || async {
        let left = claims
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter(|c| {
                c.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(&format!("{gang}-")))
            })
            .count();
        Ok((left == 0).then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn gangs_of_drust_claims_are_bound_whole_or_not_at_all() -> anyhow::Result<()> {
    let version = KubernetesVersion::from_env()?;
    let cp = ControlPlane::start(ControlPlaneOptions::workload_aware()).await?;
    let client = cp.client().await?;
    let mut plugins = Vec::new();
    for (node, clique) in NODES {
        cp.register_node(node, &[(CLIQUE_LABEL, clique)]).await?;
        let mut plugin = NodePlugin::start_with(
            &cp,
            DRIVER,
            node,
            &repo_path("examples/topologies/dgx-h100.yaml"),
            // The stale-claim check every second: the PodGroup claim below must outlive many.
            |c| c.stale_claim_interval = Duration::from_secs(1),
        )?;
        plugin.wait_ready(&client, TIMEOUT).await?;
        plugins.push(plugin);
    }
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    apply_yaml(&client, TEMPLATE, Path::new("four-gpus")).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");

    // 4 × 4 GPUs on two 8-GPU nodes: bound whole, two pods per node, each claim 4 GPUs of the
    // pool of the node its pod is bound to.
    submit(&client, version, "train", 4, 4, None, Claims::PerPod).await?;
    let nodes = bound(&pods, "train", 4).await?;
    for (node, _) in NODES {
        ensure!(
            nodes.iter().filter(|n| *n == node).count() == 2,
            "gang train on {nodes:?}"
        );
    }
    for pod in pods
        .list(&ListParams::default().labels("gang=train"))
        .await?
        .items
    {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let claim_name = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.as_ref())
            .and_then(|s| s.first())
            .and_then(|s| s.resource_claim_name.clone())
            .with_context(|| format!("{name}: no claim"))?;
        let claim = claims.get(&claim_name).await?;
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        ensure!(
            results.len() == 4 && results.iter().all(|r| r.pool == node && r.driver == DRIVER),
            "{name} on {node}: {results:?}"
        );
    }
    remove(&pods, &claims, "train").await?;

    // 5 × 4 GPUs: 20 of 16. Nothing is bound, and nothing stays allocated once the scheduler
    // has given every pod up.
    submit(&client, version, "too-big", 5, 5, None, Claims::PerPod).await?;
    let why = refused(&pods, "too-big", 5).await?;
    eprintln!("gang too-big: {why}");
    let held = allocated(&claims, "too-big").await?;
    ensure!(
        held.is_empty(),
        "claims of a refused gang still allocated: {held:?}"
    );
    ensure!(
        placement(&pods, "too-big")
            .await?
            .values()
            .all(Option::is_none),
        "a pod of the refused gang was bound"
    );
    remove(&pods, &claims, "too-big").await?;

    // One NVLink clique (node label) per gang: 4 × 4 GPUs need both cliques, so the gang is
    // refused; 2 × 4 GPUs fit in one, on one node.
    submit(
        &client,
        version,
        "spans",
        4,
        4,
        Some(CLIQUE_LABEL),
        Claims::PerPod,
    )
    .await?;
    let why = refused(&pods, "spans", 4).await?;
    eprintln!("gang spans: {why}");
    remove(&pods, &claims, "spans").await?;
    submit(
        &client,
        version,
        "pair",
        2,
        2,
        Some(CLIQUE_LABEL),
        Claims::PerPod,
    )
    .await?;
    let nodes = bound(&pods, "pair", 2).await?;
    ensure!(nodes[0] == nodes[1], "gang pair across cliques: {nodes:?}");

    // A PodGroup's claim (KEP-5729): one claim made from the template for the whole group,
    // owned by the PodGroup and reserved for it, not for its pods. Both pods share it, on the
    // node of its allocation; drust prepares it there, and its stale-claim check, which reads
    // claims and not pods, keeps it while the group lives: a claim of the pair, prepared and
    // then deleted with its pod, is unprepared by the check meanwhile.
    // On one node by a topology constraint on the hostname: v1.36.3's scheduler may otherwise
    // bind the second pod elsewhere than the claim's device (kubernetes/kubernetes#140087).
    apply_yaml(&client, ONE_GPU, Path::new("one-gpu")).await?;
    submit(
        &client,
        version,
        "shared",
        2,
        2,
        Some("kubernetes.io/hostname"),
        Claims::OfTheGroup,
    )
    .await?;
    let nodes = bound(&pods, "shared", 2).await?;
    ensure!(nodes[0] == nodes[1], "gang shared across nodes: {nodes:?}");
    let claim = until("the PodGroup's claim allocated", TIMEOUT, || async {
        let list = claims
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(list.items.into_iter().find(|c| {
            c.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.kind == "PodGroup" && o.name == "shared")
                && c.status
                    .as_ref()
                    .and_then(|s| s.allocation.as_ref())
                    .is_some()
        }))
    })
    .await?;
    let reserved = claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.clone())
        .unwrap_or_default();
    ensure!(
        reserved.len() == 1 && reserved[0].resource == "podgroups" && reserved[0].name == "shared",
        "the PodGroup claim is reserved for {reserved:?}"
    );
    for pod in pods
        .list(&ListParams::default().labels("gang=shared"))
        .await?
        .items
    {
        let names: Vec<String> = pod
            .status
            .and_then(|s| s.resource_claim_statuses)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|s| s.resource_claim_name)
            .collect();
        ensure!(
            names == [claim.metadata.name.clone().unwrap_or_default()],
            "{names:?}"
        );
    }
    let node = &nodes[0];
    let plugin = &plugins[NODES.iter().position(|(n, _)| n == node).context("node")?];
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let prepared = kubelet.prepare_v1(&[&claim]).await?;
    ensure!(
        prepared.claims[&uid].error.is_empty() && prepared.claims[&uid].devices.len() == 1,
        "preparing the PodGroup claim: {:?}",
        prepared.claims[&uid]
    );
    // The canary: a claim of the pair, on the pair's node (which may be the other one).
    let pair_node = &bound(&pods, "pair", 2).await?[0];
    let pair_plugin = &plugins[NODES
        .iter()
        .position(|(n, _)| n == pair_node)
        .context("node")?];
    let canary = claims
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("pair-"))
        })
        .context("a claim of the pair")?;
    let canary_uid = canary.metadata.uid.clone().unwrap_or_default();
    let (pair_kubelet, _) = Kubelet::register(&pair_plugin.registration_socket()).await?;
    let answer = pair_kubelet.prepare_v1(&[&canary]).await?;
    ensure!(answer.claims[&canary_uid].error.is_empty(), "{answer:?}");
    remove(&pods, &claims, "pair").await?;
    let recorded = |p: &NodePlugin, uid: &str| -> anyhow::Result<bool> {
        let checkpoint = drust_e2e::plugin::read_checkpoint(&p.config().checkpoint_path)
            .map_err(anyhow::Error::msg)?;
        Ok(checkpoint["claims"].get(uid).is_some())
    };
    until(
        "the stale-claim check unpreparing the deleted canary",
        TIMEOUT,
        || async {
            Ok((!recorded(pair_plugin, &canary_uid).map_err(|e| e.to_string())?).then_some(()))
        },
    )
    .await?;
    ensure!(
        recorded(plugin, &uid)?,
        "the stale-claim check unprepared the PodGroup's claim while the group lives"
    );
    let answer = kubelet
        .unprepare_v1(vec![drust_e2e::kubelet::v1_claim(&claim)])
        .await?;
    ensure!(answer.claims[&uid].error.is_empty(), "{answer:?}");
    drop((kubelet, pair_kubelet));

    for plugin in plugins {
        plugin.stop().await?;
    }
    cp.stop().await?;
    Ok(())
}
