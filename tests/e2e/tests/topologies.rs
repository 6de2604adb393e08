//! Every fake topology on a real control plane: the API server accepts each node's slices in both
//! MIG strategies (created, not dry-run), and the real scheduler honours the topology attributes:
//! an NVLink pair, one NUMA node, an existing MIG device, and partitionable MIG placements whose
//! shared counters it accounts for. Then re-discovery: an unchanged inventory writes nothing, a
//! lost GPU republishes the pool at the next generation.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::claims::allocation_results;
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::slices::pool_slices;
use gpu_inventory::{FakeBackend, MigStrategy, Topology, discover};
use gpu_kubelet_plugin::publisher::{PublishOutcome, SlicePublisher};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::ListParams;

const DRIVER: &str = "gpu.drust.dev";
/// Pools published only to prove the API server accepts them; no DeviceClass selects them.
const ACCEPT_DRIVER: &str = "accept.drust.dev";
const TIMEOUT: Duration = Duration::from_secs(60);

const TOPOLOGIES: &[&str] = &[
    "dgx-h100",
    "dgx-a100-mig",
    "pcie-l40s",
    "paired-nvlink-bridges",
    "gb200-nvl-tray",
    "mixed-a100-l4",
    "pcie-a100-mig",
];

fn topology_path(name: &str) -> PathBuf {
    repo_path(&format!("examples/topologies/{name}.yaml"))
}

fn node_of(topology: &str) -> String {
    format!("node-{topology}")
}

async fn slices_of(
    client: &kube::Client,
    driver: &str,
    node: &str,
) -> anyhow::Result<Vec<ResourceSlice>> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let params =
        ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={driver}"));
    Ok(api.list(&params).await?.items)
}

/// The node and the devices allocated to the claim of pod `pod`, once it is bound.
async fn allocated(client: &kube::Client, pod: &str) -> anyhow::Result<(String, Vec<String>)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (bound, claim) = match drust_e2e::pods::bound_with_claim(&pods, &claims, pod, TIMEOUT).await
    {
        Ok(b) => b,
        // What the scheduler saw, for a failure that does not reproduce at will.
        Err(e) => anyhow::bail!(
            "{e}\n{}",
            drust_e2e::pods::diagnose(client, "default", pod).await
        ),
    };
    let node = bound
        .spec
        .and_then(|s| s.node_name)
        .context("bound pod has no node")?;
    let results = allocation_results(&claim).context("claim has no allocation")?;
    Ok((node, results.iter().map(|r| r.device.clone()).collect()))
}

async fn unschedulable(client: &kube::Client, pod: &str) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let (reason, message) = drust_e2e::pods::unschedulable(&pods, pod, TIMEOUT).await?;
    ensure!(reason == "Unschedulable", "{reason}: {message}");
    Ok(message)
}

/// A claim for the one GPU of `product` at `bus`, and a pod holding it: takes that GPU away.
async fn block_gpu(
    client: &kube::Client,
    dir: &Path,
    name: &str,
    product: &str,
    bus: &str,
) -> anyhow::Result<Vec<String>> {
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
                expression: >-
                  device.attributes["gpu.drust.dev"].productName == "{product}" &&
                  device.attributes["resource.kubernetes.io"].pciBusID == "{bus}"
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
    Ok(allocated(client, name).await?.1)
}

#[tokio::test]
async fn every_topology_is_accepted_and_scheduled_by_its_topology() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    eprintln!("control plane up: {}", cp.timings());
    let client = cp.client().await?;
    let scratch = tempfile::tempdir()?;

    // 1. Every topology in both strategies is created by the API server, as laid out.
    for topology in TOPOLOGIES {
        let node = node_of(topology);
        cp.register_node(&node, &[]).await?;
        let inventory = discover(&FakeBackend::new(Topology::from_file(topology_path(
            topology,
        ))?))?;
        let publisher = SlicePublisher::new(client.clone(), ACCEPT_DRIVER, &node);
        let mut previous = None;
        let mut generation = 0;
        for strategy in [MigStrategy::Existing, MigStrategy::Partitionable] {
            let pool = inventory.pool(strategy);
            // Without a MIG profile table both strategies publish the same pool: no write.
            let outcome = publisher.publish_pool(&pool).await?;
            if previous.as_ref() == Some(&pool) {
                ensure!(
                    outcome == PublishOutcome::Unchanged { generation },
                    "{topology} {strategy:?}: {outcome:?}"
                );
            } else {
                generation += 1;
                ensure!(
                    matches!(outcome, PublishOutcome::Applied { generation: g, .. } if g == generation),
                    "{topology} {strategy:?}: {outcome:?}"
                );
            }
            let want = pool_slices(ACCEPT_DRIVER, &node, generation, &pool);
            let mut got = slices_of(&client, ACCEPT_DRIVER, &node).await?;
            got.sort_by_key(|s| s.metadata.name.clone());
            ensure!(
                got.len() == want.len(),
                "{topology} {strategy:?}: {} slices stored, {} laid out",
                got.len(),
                want.len()
            );
            for (g, w) in got.iter().zip(&want) {
                ensure!(
                    g.spec == w.spec,
                    "{topology} {strategy:?}: slice differs as stored"
                );
            }
            eprintln!(
                "{topology} {strategy:?}: {} devices, {} counter sets in {} slices accepted",
                pool.devices.len(),
                pool.counter_sets.len(),
                got.len()
            );
            previous = Some(pool);
        }
    }

    // 2. The node plugins, one per topology (the partitionable one later).
    let paired_file = scratch.path().join("paired-nvlink-bridges.yaml");
    std::fs::copy(topology_path("paired-nvlink-bridges"), &paired_file)?;
    let mut plugins = Vec::new();
    for topology in TOPOLOGIES.iter().filter(|t| **t != "pcie-a100-mig") {
        let node = node_of(topology);
        let path = if *topology == "paired-nvlink-bridges" {
            paired_file.clone()
        } else {
            topology_path(topology)
        };
        let mut plugin = NodePlugin::start_with(&cp, DRIVER, &node, &path, |c| {
            c.rediscovery_interval = Duration::from_secs(1);
        })?;
        plugin.wait_ready(&client, TIMEOUT).await?;
        plugins.push(plugin);
    }
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;

    // 3. A 1g.10gb MIG claim lands on an existing MIG device of the DGX A100.
    apply_file(&client, &repo_path("deploy/deviceclasses/mig.yaml")).await?;
    apply_file(&client, &repo_path("examples/mig/mig.yaml")).await?;
    let (node, devices) = allocated(&client, "cuda-1g-10gb").await?;
    ensure!(node == node_of("dgx-a100-mig"), "MIG pod on {node}");
    let a100 = slices_of(&client, DRIVER, &node).await?;
    let device = a100
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == devices[0])
        .context("allocated MIG device not published")?;
    let attrs = device.attributes.as_ref().context("attributes")?;
    ensure!(
        attrs["type"].string.as_deref() == Some("mig"),
        "{devices:?}"
    );
    ensure!(
        attrs["profile"].string.as_deref() == Some("1g.10gb"),
        "{devices:?}"
    );
    ensure!(
        attrs.contains_key("uuid"),
        "an existing MIG device has its UUID"
    );
    // The kubelet's prepare injects the MIG device: its UUID and its capability nodes.
    let a100_plugin = TOPOLOGIES
        .iter()
        .filter(|t| **t != "pcie-a100-mig")
        .position(|t| *t == "dgx-a100-mig")
        .and_then(|i| plugins.get(i))
        .context("A100 plugin")?;
    let pod = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), "default")
        .get("cuda-1g-10gb")
        .await?;
    let claim_name = pod
        .status
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|s| s.into_iter().next())
        .and_then(|s| s.resource_claim_name)
        .context("MIG pod names no claim")?;
    let claim =
        Api::<k8s_openapi::api::resource::v1::ResourceClaim>::namespaced(client.clone(), "default")
            .get(&claim_name)
            .await?;
    let (kubelet, _) =
        drust_e2e::kubelet::Kubelet::register(&a100_plugin.registration_socket()).await?;
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let prepared = kubelet.prepare_v1(&[&claim]).await?.claims[&uid].clone();
    ensure!(prepared.error.is_empty(), "MIG prepare: {}", prepared.error);
    let spec = std::fs::read_to_string(
        a100_plugin
            .config()
            .cdi_root
            .join(format!("{DRIVER}-claim_{uid}.json")),
    )?;
    let mig_uuid = attrs["uuid"].string.clone().unwrap_or_default();
    ensure!(
        spec.contains(&gpu_kubelet_plugin::claims::device_env(
            &device.name,
            &mig_uuid
        )),
        "{spec}"
    );
    ensure!(spec.contains("/dev/nvidia-caps/nvidia-cap"), "{spec}");
    let unprepared = kubelet
        .unprepare_v1(vec![drust_e2e::kubelet::v1_claim(&claim)])
        .await?;
    ensure!(unprepared.claims[&uid].error.is_empty(), "MIG unprepare");

    // 4. NVLink pair: with GPU 0 taken, two linked H100 NVL are GPUs 2+3, not 1+2 (1 and 2 are
    //    not linked) and never 6+7 (their bridge is down).
    let taken = block_gpu(
        &client,
        scratch.path(),
        "hold-nvl-0",
        "NVIDIA H100 NVL",
        "0000:18:00.0",
    )
    .await?;
    ensure!(taken == ["gpu-0000-18-00-0"], "{taken:?}");
    apply_file(&client, &repo_path("examples/nvlink-pair/nvlink-pair.yaml")).await?;
    let (node, devices) = allocated(&client, "nccl-pair").await?;
    ensure!(node == node_of("paired-nvlink-bridges"), "pair on {node}");
    let got: BTreeSet<_> = devices.iter().map(String::as_str).collect();
    ensure!(
        got == BTreeSet::from(["gpu-0000-3a-00-0", "gpu-0000-5d-00-0"]),
        "NVLink pair got {got:?}"
    );

    // 5. One NUMA node: with GPU 0 (NUMA 0) taken, four H100s on one node are GPUs 4-7.
    block_gpu(
        &client,
        scratch.path(),
        "hold-h100-0",
        "NVIDIA H100 80GB HBM3",
        "0000:18:00.0",
    )
    .await?;
    apply_file(
        &client,
        &repo_path("examples/numa-aligned/numa-aligned.yaml"),
    )
    .await?;
    let (node, devices) = allocated(&client, "numa-aligned-training").await?;
    ensure!(node == node_of("dgx-h100"), "NUMA pod on {node}");
    let got: BTreeSet<_> = devices.iter().map(String::as_str).collect();
    ensure!(
        got == BTreeSet::from([
            "gpu-0000-9a-00-0",
            "gpu-0000-ab-00-0",
            "gpu-0000-ba-00-0",
            "gpu-0000-db-00-0"
        ]),
        "NUMA-aligned got {got:?}"
    );

    // 6. Partitionable MIG on the PCIe A100 node (MIG on, no MIG devices): 4g.40gb on both
    //    A100s leaves only the 3g.40gb placements at slice 4, after which no 1g.10gb fits: the
    //    scheduler accounts counters.
    let node = node_of("pcie-a100-mig");
    let mut partitioned =
        NodePlugin::start_with(&cp, DRIVER, &node, &topology_path("pcie-a100-mig"), |c| {
            c.mig_strategy = MigStrategy::Partitionable;
        })?;
    let slices = partitioned.wait_ready(&client, TIMEOUT).await?;
    ensure!(
        slices.iter().any(|s| s.spec.shared_counters.is_some()),
        "no counter-set slice published"
    );
    // The scheduler places pods one at a time without lookahead: were mig-3g-pair placed
    // first, it could take the 3g.40gb placements at slice 0 and leave no room for a 4g.40gb.
    // The example's README says to apply mig-4g-pair first; so does this test.
    let example = std::fs::read_to_string(repo_path(
        "examples/mig-partitionable/mig-partitionable.yaml",
    ))?;
    let is_3g = |d: &serde_yaml_ng::Value| d["metadata"]["name"] == "mig-3g-pair";
    let origin = repo_path("examples/mig-partitionable/mig-partitionable.yaml");
    let first = drust_e2e::manifests::documents_where(&example, |d| !is_3g(d))?;
    drust_e2e::manifests::apply_yaml(&client, &first, &origin).await?;
    let (n4, four) = allocated(&client, "mig-4g-pair").await?;
    let then = drust_e2e::manifests::documents_where(&example, is_3g)?;
    drust_e2e::manifests::apply_yaml(&client, &then, &origin).await?;
    let (n3, three) = allocated(&client, "mig-3g-pair").await?;
    ensure!(n4 == node && n3 == node, "partitionable pods on {n4}, {n3}");
    let four: BTreeSet<_> = four.into_iter().collect();
    let three: BTreeSet<_> = three.into_iter().collect();
    ensure!(
        four == BTreeSet::from([
            "gpu-0000-17-00-0-mig-4g-40gb-0".to_owned(),
            "gpu-0000-65-00-0-mig-4g-40gb-0".to_owned()
        ]),
        "4g.40gb got {four:?}"
    );
    ensure!(
        three
            == BTreeSet::from([
                "gpu-0000-17-00-0-mig-3g-40gb-4".to_owned(),
                "gpu-0000-65-00-0-mig-3g-40gb-4".to_owned()
            ]),
        "3g.40gb got {three:?}"
    );
    apply_file(
        &client,
        &repo_path("examples/mig-partitionable/one-more.yaml"),
    )
    .await?;
    let message = unschedulable(&client, "mig-1g-one-more").await?;
    eprintln!("1g.10gb after a full partition: {message}");

    // 7. Re-discovery on the paired node (every second): unchanged hardware writes nothing; a
    //    lost GPU republishes the pool at generation 2 without it.
    let node = node_of("paired-nvlink-bridges");
    let before = slices_of(&client, DRIVER, &node).await?;
    ensure!(
        before.len() == 1 && before[0].spec.pool.generation == 1,
        "{before:?}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let still = slices_of(&client, DRIVER, &node).await?;
    ensure!(
        still[0].metadata.resource_version == before[0].metadata.resource_version,
        "an unchanged inventory was rewritten"
    );
    let mut topology = Topology::from_file(&paired_file)?;
    let lost = topology.gpus.pop().context("no GPU")?;
    std::fs::write(&paired_file, serde_yaml_ng::to_string(&topology)?)?;
    let after = until(
        "the pool republished without the lost GPU",
        TIMEOUT,
        || async {
            let s = slices_of(&client, DRIVER, &node)
                .await
                .map_err(|e| e.to_string())?;
            Ok((s.len() == 1 && s[0].spec.pool.generation == 2).then_some(s))
        },
    )
    .await?;
    let names: Vec<_> = after[0]
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| d.name.clone())
        .collect();
    ensure!(names.len() == 7, "{names:?}");
    ensure!(
        !names.contains(&"gpu-0000-db-00-0".to_owned()),
        "lost GPU {} still published",
        lost.uuid
    );
    ensure!(
        names.contains(&"gpu-0000-18-00-0".to_owned()),
        "other GPUs keep their names"
    );

    partitioned.stop().await?;
    for p in plugins {
        p.stop().await?;
    }
    cp.stop().await?;
    Ok(())
}
