//! The examples a user copies, applied as they are to a real control plane and allocated by the
//! real scheduler on fake topologies: a memory floor, "an H100, else an A100" (firstAvailable),
//! an admin's "Hopper or newer" DeviceClass, a GPU and its NUMA-local peer, one GPU shared by two
//! pods, and `resources.limits: {nvidia.com/gpu: 1}` through the extended-resource DeviceClass
//! (KEP-5004). Each impossible case is first seen Pending with the scheduler's reason, then
//! satisfied once the hardware is there.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use drust_e2e::claims::allocation_results;
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams};

const DRIVER: &str = "gpu.drust.dev";
const TIMEOUT: Duration = Duration::from_secs(90);
const MIXED: &str = "node-mixed-a100-l4";
const H100: &str = "node-dgx-h100";

/// The node and allocation results of pod `pod`'s claim, once it is bound.
async fn allocated(
    client: &kube::Client,
    pod: &str,
) -> anyhow::Result<(String, ResourceClaim, Vec<DeviceRequestAllocationResult>)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (bound, claim) = drust_e2e::pods::bound_with_claim(&pods, &claims, pod, TIMEOUT).await?;
    let node = bound
        .spec
        .and_then(|s| s.node_name)
        .context("bound pod has no node")?;
    let results = allocation_results(&claim)
        .context("claim has no allocation")?
        .to_vec();
    Ok((node, claim, results))
}

async fn pending(client: &kube::Client, pod: &str) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let (reason, message) = drust_e2e::pods::unschedulable(&pods, pod, TIMEOUT).await?;
    ensure!(reason == "Unschedulable", "{pod}: {reason}: {message}");
    eprintln!("{pod} pending as expected: {message}");
    Ok(message)
}

/// The string attribute `name` (our domain) of published device `device` on `node`.
async fn attribute(
    client: &kube::Client,
    node: &str,
    device: &str,
    name: &str,
) -> anyhow::Result<String> {
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={DRIVER}")))
        .await?;
    let d = slices
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .with_context(|| format!("device {device} not published on {node}"))?;
    let a = d
        .attributes
        .as_ref()
        .and_then(|a| a.get(name))
        .with_context(|| format!("{device} has no {name}"))?;
    Ok(a.string
        .clone()
        .or_else(|| a.int.map(|i| i.to_string()))
        .or_else(|| a.version.clone())
        .unwrap_or_default())
}

/// Deletes pod `name` in `default` and waits until it is gone (its template claims go with it).
async fn delete_pod(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.delete(name, &DeleteParams::default().grace_period(0))
        .await?;
    until(&format!("pod {name} deleted"), TIMEOUT, || async {
        Ok(pods
            .get_opt(name)
            .await
            .map_err(|e| e.to_string())?
            .is_none()
            .then_some(()))
    })
    .await?;
    Ok(())
}

/// A claim and pod holding the GPU at `bus` on the mixed node.
async fn hold(client: &kube::Client, dir: &Path, name: &str, bus: &str) -> anyhow::Result<()> {
    let yaml = format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: default}}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.drust.dev
          selectors:
            - cel:
                expression: device.attributes["resource.kubernetes.io"].pciBusID == "{bus}"
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  restartPolicy: Never
  containers:
    - {{name: c, image: busybox, resources: {{claims: [{{name: gpu}}]}}}}
  resourceClaims:
    - {{name: gpu, resourceClaimName: {name}}}
"#
    );
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, yaml)?;
    apply_file(client, &path).await?;
    let (node, _, _) = allocated(client, name).await?;
    ensure!(node == MIXED, "{name} on {node}");
    Ok(())
}

#[tokio::test]
async fn every_example_is_allocated_by_the_real_scheduler_or_pending_for_its_reason()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    let scratch = tempfile::tempdir()?;
    for class in ["gpu.yaml", "mig.yaml", "gpu-extended.yaml"] {
        apply_file(
            &client,
            &repo_path(&format!("deploy/deviceclasses/{class}")),
        )
        .await?;
    }

    // Phase 1: only the mixed node (2 x A100 80GB PCIe at 17:00.0 and 65:00.0, 2 x L4 24GB).
    cp.register_node(MIXED, &[]).await?;
    let mut mixed = NodePlugin::start(
        &cp,
        DRIVER,
        MIXED,
        &repo_path("examples/topologies/mixed-a100-l4.yaml"),
    )?;
    mixed.wait_ready(&client, TIMEOUT).await?;

    // An H100, else an A100: no H100 anywhere, so the a100 subrequest.
    apply_file(
        &client,
        &repo_path("examples/h100-else-a100/h100-else-a100.yaml"),
    )
    .await?;
    let (node, _, results) = allocated(&client, "h100-else-a100").await?;
    ensure!(
        node == MIXED && results.len() == 1 && results[0].request == "gpu/a100",
        "firstAvailable without H100: {node} {results:?}"
    );
    let a100 = results[0].device.clone();
    ensure!(
        attribute(&client, MIXED, &a100, "productName").await? == "NVIDIA A100 80GB PCIe",
        "{a100}"
    );

    // At least 40 GiB: with the other A100 held too, only the L4s (24 GB) are free, and the pod
    // waits rather than take one.
    let other_bus = if a100 == "gpu-0000-17-00-0" {
        "0000:65:00.0"
    } else {
        "0000:17:00.0"
    };
    hold(&client, scratch.path(), "hold-a100", other_bus).await?;
    apply_file(&client, &repo_path("examples/gpu-memory/gpu-memory.yaml")).await?;
    pending(&client, "cuda-40gi").await?;

    // Hopper or newer: A100 (8.0) and L4 (8.9) do not qualify.
    apply_file(
        &client,
        &repo_path("examples/hopper-or-newer/hopper-or-newer.yaml"),
    )
    .await?;
    pending(&client, "fp8-inference").await?;

    // Releasing the held A100 lets the 40 GiB pod have it.
    delete_pod(&client, "hold-a100").await?;
    Api::<ResourceClaim>::namespaced(client.clone(), "default")
        .delete("hold-a100", &DeleteParams::default())
        .await?;
    let (node, _, results) = allocated(&client, "cuda-40gi").await?;
    ensure!(node == MIXED, "40Gi pod on {node}");
    let product = attribute(&client, MIXED, &results[0].device, "productName").await?;
    ensure!(product == "NVIDIA A100 80GB PCIe", "40Gi pod got {product}");

    // Phase 2: a DGX H100 joins.
    cp.register_node(H100, &[]).await?;
    let mut dgx = NodePlugin::start(
        &cp,
        DRIVER,
        H100,
        &repo_path("examples/topologies/dgx-h100.yaml"),
    )?;
    dgx.wait_ready(&client, TIMEOUT).await?;

    // The pending Hopper pod is scheduled there.
    let (node, _, results) = allocated(&client, "fp8-inference").await?;
    ensure!(node == H100, "Hopper pod on {node}");
    let cc = attribute(&client, H100, &results[0].device, "cudaComputeCapability").await?;
    ensure!(cc == "9.0.0", "Hopper pod got compute capability {cc}");

    // A new "H100, else A100" pod now gets the h100 subrequest.
    delete_pod(&client, "h100-else-a100").await?;
    apply_file(
        &client,
        &repo_path("examples/h100-else-a100/h100-else-a100.yaml"),
    )
    .await?;
    let (node, _, results) = allocated(&client, "h100-else-a100").await?;
    ensure!(
        node == H100 && results[0].request == "gpu/h100",
        "firstAvailable with H100: {node} {results:?}"
    );

    // A GPU and its NUMA-local peer: two devices on one NUMA node.
    apply_file(
        &client,
        &repo_path("examples/numa-local-peer/numa-local-peer.yaml"),
    )
    .await?;
    let (node, _, results) = allocated(&client, "gpu-with-numa-peer").await?;
    ensure!(results.len() == 2, "{results:?}");
    let mut numa = BTreeSet::new();
    for r in &results {
        let n = Api::<ResourceSlice>::all(client.clone())
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await?
            .items
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .find(|d| d.name == r.device)
            .and_then(|d| {
                d.attributes
                    .as_ref()?
                    .get("resource.kubernetes.io/numaNode")?
                    .int
            })
            .with_context(|| format!("{} has no numaNode", r.device))?;
        numa.insert(n);
    }
    ensure!(
        numa.len() == 1 && results[0].device != results[1].device,
        "GPU and peer: {results:?} on NUMA nodes {numa:?}"
    );

    // One GPU, two pods: one allocation, both pods on its node, both reserved.
    apply_file(&client, &repo_path("examples/gpu-sharing/gpu-sharing.yaml")).await?;
    let (node_a, claim_a, results_a) = allocated(&client, "sharer-a").await?;
    let (node_b, _, results_b) = allocated(&client, "sharer-b").await?;
    ensure!(
        node_a == node_b && results_a == results_b && results_a.len() == 1,
        "sharers: {node_a} {results_a:?} / {node_b} {results_b:?}"
    );
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let shared = until("both sharers reserved the claim", TIMEOUT, || async {
        let c = claims.get("shared-gpu").await.map_err(|e| e.to_string())?;
        let reserved: BTreeSet<String> = c
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .into_iter()
            .flatten()
            .map(|r| r.name.clone())
            .collect();
        Ok(
            (reserved == BTreeSet::from(["sharer-a".to_owned(), "sharer-b".to_owned()]))
                .then_some(c),
        )
    })
    .await?;
    let config = shared
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.opaque.as_ref())
        .context("the sharing config was not stored")?;
    ensure!(
        config.driver == DRIVER
            && config.parameters.0["sharing"]["strategy"] == "TimeSlicing"
            && config.parameters.0["kind"] == "GpuConfig",
        "{config:?}"
    );
    ensure!(claim_a.metadata.name.as_deref() == Some("shared-gpu"));
    // Prepared through the kubelet API, the config reaches the GPU: its time slice is Long
    // (nvidia-smi's 3) while the claim is prepared and back to Default (0) after.
    let plugin = if node_a == H100 { &dgx } else { &mixed };
    let gpu_index = gpu_inventory::discover(&gpu_inventory::FakeBackend::new(
        gpu_inventory::Topology::from_file(match &plugin.config().backend {
            gpu_kubelet_plugin::Backend::Fake { topology, .. } => topology,
            gpu_kubelet_plugin::Backend::Nvml { .. } => bail!("fake backend expected"),
        })?,
    ))?
    .gpus
    .iter()
    .find(|g| g.name == results_a[0].device)
    .map(|g| g.raw.index)
    .context("the shared GPU")?;
    let time_slice = || -> anyhow::Result<Option<u64>> {
        let state = plugin.fake_state_dir()?;
        let Ok(text) = std::fs::read_to_string(state.join("time-slices.json")) else {
            return Ok(None);
        };
        let v: serde_json::Value = serde_json::from_str(&text)?;
        Ok(v[gpu_index.to_string()].as_u64())
    };
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let uid = shared.metadata.uid.clone().context("uid")?;
    let answer = kubelet.prepare_v1(&[&shared]).await?;
    ensure!(
        answer.claims[&uid].error.is_empty(),
        "{}",
        answer.claims[&uid].error
    );
    ensure!(
        time_slice()? == Some(3),
        "time slice while prepared: {:?}",
        time_slice()?
    );
    let r = kubelet.unprepare_v1(vec![v1_claim(&shared)]).await?;
    ensure!(r.claims[&uid].error.is_empty(), "{}", r.claims[&uid].error);
    ensure!(
        time_slice()? == Some(0),
        "time slice after unprepare: {:?}",
        time_slice()?
    );
    drop(kubelet);

    // resources.limits: {nvidia.com/gpu: 1}: the scheduler creates and allocates a claim of
    // the extended-resource class for the pod.
    apply_file(
        &client,
        &repo_path("examples/extended-resource/extended-resource.yaml"),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod = until("the extended-resource pod bound", TIMEOUT, || async {
        let p = pods
            .get("classic-gpu-request")
            .await
            .map_err(|e| e.to_string())?;
        let bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
        let claim = p
            .status
            .as_ref()
            .and_then(|s| s.extended_resource_claim_status.as_ref())
            .is_some();
        if !bound || !claim {
            return Err(format!("{:?}", p.status.and_then(|s| s.conditions)));
        }
        Ok(Some(p))
    })
    .await?;
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.clone())
        .context("no extendedResourceClaimStatus")?;
    ensure!(
        status
            .request_mappings
            .iter()
            .any(|m| m.resource_name == "nvidia.com/gpu"),
        "{status:?}"
    );
    let claim = claims.get(&status.resource_claim_name).await?;
    let results = allocation_results(&claim).context("extended-resource claim not allocated")?;
    ensure!(
        results.len() == 1 && results[0].driver == DRIVER,
        "{results:?}"
    );
    eprintln!(
        "nvidia.com/gpu: 1 got {} on {} through claim {}",
        results[0].device, results[0].pool, status.resource_claim_name
    );

    dgx.stop().await?;
    mixed.stop().await?;
    cp.stop().await?;
    Ok(())
}
