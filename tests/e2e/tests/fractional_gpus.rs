//! Fractional GPUs on the real control plane (issue 17): the plugin publishes the fake DGX H100
//! with `--consumable-capacity`; the real scheduler packs independent claims onto one GPU by the
//! memory they ask for, and each share is prepared through the kubelet API with its own limits
//! under the GPU's single MPS daemon.
//!
//! An H100 80GB has 81559 MiB (79.6 GiB): four shares of `20Gi` do not fit on one (80 GiB), four
//! of `20G` do (20 decimal GB, rounded up by the request policy to 19 GiB). The proof uses those.
//!
//! Steps: four claims land on one GPU with distinct share IDs, each prepared with a 19 GiB pinned
//! limit in its own CDI device, one daemon for the GPU; a fifth claim goes to another GPU;
//! exclusive whole-GPU claims take the six others and never land next to a share; with every GPU
//! full a share stays Pending with the scheduler's reason; unpreparing and deleting one share
//! keeps the daemon for the other three, and the pending claim takes the freed share; the last
//! share's unprepare stops the daemon. A health taint on the GPU keeps new shares off it while
//! its share stays prepared. Then the two examples of `examples/fractional-gpus`, as
//! written, on this node and on a node with A100s.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::claims::allocation_results;
use drust_e2e::kubelet::Kubelet;
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams};

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "node-shares";
const A100_NODE: &str = "node-shares-a100";
const TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn shares_of_one_gpu_are_packed_prepared_with_their_limits_and_freed() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = run(&cp).await;
    cp.stop().await?;
    result
}

/// A ResourceClaimTemplate `name` of class `class` asking for `memory` (none: no capacity
/// request), and a pod using it.
fn pod_with_claim(name: &str, class: &str, memory: Option<&str>) -> String {
    let capacity = memory.map_or_else(String::new, |m| {
        format!("\n            capacity:\n              requests:\n                memory: {m}")
    });
    format!(
        r"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: {name}
  namespace: default
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: {class}{capacity}
---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
spec:
  containers:
    - name: c
      image: busybox
      resources:
        claims:
          - name: gpu
  resourceClaims:
    - name: gpu
      resourceClaimTemplateName: {name}
"
    )
}

struct Share {
    claim: ResourceClaim,
    device: String,
    share_id: Option<String>,
}

async fn bound(
    client: &kube::Client,
    name: &str,
    class: &str,
    memory: Option<&str>,
) -> anyhow::Result<Share> {
    apply_yaml(
        client,
        &pod_with_claim(name, class, memory),
        Path::new(name),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (_, claim) = drust_e2e::pods::bound_with_claim(&pods, &claims, name, TIMEOUT).await?;
    let r = allocation_results(&claim)
        .and_then(|r| r.first())
        .context("claim not allocated")?
        .clone();
    Ok(Share {
        device: r.device,
        share_id: r.share_id,
        claim,
    })
}

async fn prepare(kubelet: &Kubelet, claim: &ResourceClaim) -> anyhow::Result<Option<String>> {
    let uid = claim.metadata.uid.clone().context("uid")?;
    let answer = kubelet.prepare_v1(&[claim]).await?;
    let a = answer.claims.get(&uid).context("no answer for the claim")?;
    ensure!(a.error.is_empty(), "prepare: {}", a.error);
    ensure!(a.devices.len() == 1, "prepared devices: {:?}", a.devices);
    Ok(a.devices[0].share_id.clone())
}

async fn unprepare(kubelet: &Kubelet, claim: &ResourceClaim) -> anyhow::Result<()> {
    let uid = claim.metadata.uid.clone().context("uid")?;
    let answer = kubelet
        .unprepare_v1(vec![drust_e2e::kubelet::v1_claim(claim)])
        .await?;
    let a = answer.claims.get(&uid).context("no answer for the claim")?;
    ensure!(a.error.is_empty(), "unprepare: {}", a.error);
    Ok(())
}

/// The environment of the claim's CDI device, from its spec on disk.
fn cdi_env(cdi_root: &Path, claim: &ResourceClaim) -> anyhow::Result<Vec<String>> {
    let uid = claim.metadata.uid.clone().context("uid")?;
    let path = std::fs::read_dir(cdi_root)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains(&uid))
        .with_context(|| format!("no CDI spec for claim {uid}"))?;
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let mut env: Vec<String> = spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    env.extend(
        spec["containerEdits"]["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned)),
    );
    Ok(env)
}

/// Whether `device` of our pool carries our health taint in the newest slices.
async fn tainted(slices: &Api<ResourceSlice>, device: &str) -> Result<bool, String> {
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await
        .map_err(|e| e.to_string())?;
    let newest = list.items.iter().map(|s| s.spec.pool.generation).max();
    Ok(list
        .items
        .iter()
        .filter(|s| Some(s.spec.pool.generation) == newest)
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .any(|d| {
            d.name == device
                && d.taints
                    .iter()
                    .flatten()
                    .any(|t| t.key == "gpu.drust.dev/unhealthy")
        }))
}

/// The MPS daemon directories under the plugin's MPS root.
fn daemons(mps_root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(mps_root)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[allow(clippy::too_many_lines)] // one scenario, step by step
async fn run(cp: &ControlPlane) -> anyhow::Result<()> {
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let classes =
        drust_e2e::helm::apply_device_classes(&client, &["features.consumableCapacity=true"])
            .await
            .map_err(anyhow::Error::msg)?;
    ensure!(
        classes
            .iter()
            .any(|c| c["metadata"]["name"] == "gpu-share.drust.dev"),
        "the chart renders the share class"
    );
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let mut plugin = NodePlugin::start_with(cp, DRIVER, NODE, &topology, |c| {
        c.consumable_capacity = true;
    })?;
    plugin.wait_ready(&client, TIMEOUT).await?;
    let (cdi_root, mps_root) = (
        plugin.config().cdi_root.clone(),
        plugin.config().mps_root.clone(),
    );

    // What the API server stores: every GPU shareable, its memory policy intact (the
    // DRAConsumableCapacity feature is on by default in 1.36).
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let stored = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await?;
    let devices: Vec<_> = stored
        .items
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect();
    ensure!(devices.len() == 8, "{} devices published", devices.len());
    for d in &devices {
        let memory = d
            .capacity
            .as_ref()
            .and_then(|c| c.get("memory"))
            .context("memory capacity")?;
        let policy = memory
            .request_policy
            .as_ref()
            .context("memory requestPolicy")?;
        ensure!(
            d.allow_multiple_allocations == Some(true)
                && memory.value.0 == "81559Mi"
                && policy.default.as_ref().map(|q| q.0.as_str()) == Some("79Gi"),
            "device {} as stored: {d:?}",
            d.name
        );
    }

    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;

    // Four shares of 20 GB on one GPU, each with its own share ID and limit, one daemon.
    // Prepare latencies (kubelet call to answer) are printed for BENCHMARKS.md.
    let (mut share_ms, mut whole_ms) = (Vec::new(), Vec::new());
    let mut first = Vec::new();
    for i in 0..4 {
        let s = bound(
            &client,
            &format!("share-{i}"),
            "gpu-share.drust.dev",
            Some("20G"),
        )
        .await?;
        ensure!(s.share_id.is_some(), "share-{i} has no shareID");
        let started = std::time::Instant::now();
        let prepared = prepare(&kubelet, &s.claim).await?;
        share_ms.push(started.elapsed().as_secs_f64() * 1e3);
        ensure!(
            prepared == s.share_id,
            "prepare answered share {prepared:?} for allocation share {:?}",
            s.share_id
        );
        let env = cdi_env(&cdi_root, &s.claim)?;
        for want in [
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=19456M",
            "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
        ] {
            ensure!(
                env.iter().any(|e| e == want),
                "share-{i} lacks {want}: {env:?}"
            );
        }
        ensure!(
            !env.iter()
                .any(|e| e.starts_with("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")),
            "no compute asked for, none capped: {env:?}"
        );
        first.push(s);
    }
    let gpu0 = first[0].device.clone();
    ensure!(
        first.iter().all(|s| s.device == gpu0),
        "four 19 GiB shares fit one 79.6 GiB GPU: {:?}",
        first.iter().map(|s| &s.device).collect::<Vec<_>>()
    );
    let ids: BTreeSet<_> = first.iter().map(|s| s.share_id.clone()).collect();
    ensure!(ids.len() == 4, "share IDs {ids:?}");
    let running = daemons(&mps_root);
    ensure!(
        running.len() == 1 && running.iter().all(|d| d.starts_with("gpu-")),
        "one MPS daemon for the GPU, keyed by its UUID: {running:?}"
    );
    let daemon = running.into_iter().next().unwrap_or_default();
    let log = std::fs::read_to_string(mps_root.join(&daemon).join("log/control.log"))?;
    // Each share brings its own limits; the daemon's defaults are only the ceiling, the
    // largest share on the GPU (19 GiB, no compute reserved: 100%), so a client that raises
    // its own variables gets no more than that.
    ensure!(
        log.contains("set_default_device_pinned_mem_limit 0 19456M")
            && log.contains("set_default_active_thread_percentage 100")
            && !log
                .lines()
                .any(|l| l.starts_with("cmd set_default_device_pinned_mem_limit")
                    && !l.ends_with(" 19456M")),
        "the GPU's daemon holds the largest share as its ceiling, nothing else: {log}"
    );

    // A fifth goes to another GPU.
    let fifth = bound(&client, "share-4", "gpu-share.drust.dev", Some("20G")).await?;
    ensure!(fifth.device != gpu0, "the fifth share went to the full GPU");
    prepare(&kubelet, &fifth.claim).await?;
    ensure!(
        daemons(&mps_root).len() == 2,
        "a second GPU, a second daemon"
    );

    // Exclusive whole-GPU claims (no capacity request: the whole memory) take the six GPUs
    // without shares, never one with a share.
    let mut exclusive = Vec::new();
    for i in 0..6 {
        let e = bound(&client, &format!("whole-{i}"), "gpu.drust.dev", None).await?;
        ensure!(
            e.device != gpu0 && e.device != fifth.device,
            "whole-{i} landed on a GPU holding shares: {}",
            e.device
        );
        let started = std::time::Instant::now();
        prepare(&kubelet, &e.claim).await?;
        whole_ms.push(started.elapsed().as_secs_f64() * 1e3);
        let env = cdi_env(&cdi_root, &e.claim)?;
        ensure!(
            !env.iter().any(|v| v.starts_with("CUDA_MPS")),
            "a whole GPU runs without MPS: {env:?}"
        );
        exclusive.push(e);
    }
    eprintln!(
        "prepare latency, ms: shares of one GPU {share_ms:.1?} (the first starts the daemon); \
         whole GPUs {whole_ms:.1?}"
    );
    let whole: BTreeSet<_> = exclusive.iter().map(|e| e.device.clone()).collect();
    ensure!(whole.len() == 6, "six distinct whole GPUs: {whole:?}");
    ensure!(daemons(&mps_root).len() == 2, "whole GPUs start no daemon");
    // Fill the fifth's GPU.
    for i in 5..8 {
        let s = bound(
            &client,
            &format!("share-{i}"),
            "gpu-share.drust.dev",
            Some("20G"),
        )
        .await?;
        ensure!(s.device == fifth.device, "share-{i} on {}", s.device);
    }

    // Every GPU full: a share waits, with the scheduler's reason.
    apply_yaml(
        &client,
        &pod_with_claim("waiting", "gpu-share.drust.dev", Some("20G")),
        Path::new("waiting"),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let (reason, message) = drust_e2e::pods::unschedulable(&pods, "waiting", TIMEOUT).await?;
    ensure!(
        reason == "Unschedulable" && message.contains("cannot allocate all claims"),
        "pending share: {reason}: {message}"
    );

    // One share goes: its unprepare leaves the daemon to the other three, and the waiting share
    // takes its place on that GPU.
    let gone = first.remove(0);
    unprepare(&kubelet, &gone.claim).await?;
    ensure!(
        daemons(&mps_root).contains(&daemon),
        "the GPU's daemon stopped while three shares still use it"
    );
    pods.delete("share-0", &DeleteParams::default().grace_period(0))
        .await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (_, waiting) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "waiting", TIMEOUT).await?;
    let r = allocation_results(&waiting)
        .and_then(|r| r.first())
        .context("waiting claim not allocated")?;
    ensure!(
        r.device == gpu0,
        "the freed share was taken on {}",
        r.device
    );
    prepare(&kubelet, &waiting).await?;

    // The last share of the GPU stops its daemon.
    for s in &first {
        unprepare(&kubelet, &s.claim).await?;
    }
    ensure!(
        daemons(&mps_root).contains(&daemon),
        "the waiting share still uses the daemon"
    );
    unprepare(&kubelet, &waiting).await?;
    until("the GPU's daemon stopped", TIMEOUT, || async {
        Ok((!daemons(&mps_root).contains(&daemon)).then_some(()))
    })
    .await?;

    // The example "20 GiB of any H100" takes the GPU its pods left.
    for pod in ["share-1", "share-2", "share-3", "waiting"] {
        pods.delete(pod, &DeleteParams::default().grace_period(0))
            .await?;
    }
    apply_file(
        &client,
        &repo_path("examples/fractional-gpus/h100-20gi.yaml"),
    )
    .await?;
    let (_, claim) = drust_e2e::pods::bound_with_claim(&pods, &claims, "llm-7b", TIMEOUT).await?;
    let r = allocation_results(&claim)
        .and_then(|r| r.first())
        .context("llm-7b not allocated")?;
    ensure!(
        r.device == gpu0 && r.share_id.is_some(),
        "llm-7b: {} share {:?}",
        r.device,
        r.share_id
    );
    prepare(&kubelet, &claim).await?;
    let env = cdi_env(&cdi_root, &claim)?;
    ensure!(
        env.iter()
            .any(|e| e == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"),
        "llm-7b: {env:?}"
    );

    // A health taint on the GPU covers its shares: a new share stays off it (every other GPU
    // is full, so it waits) while llm-7b stays prepared; recovery lets the share in.
    let uuid = drust_e2e::plugin::fake_gpus(&topology)
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .find(|g| g.name == gpu0)
        .context("gpu0 in the topology")?
        .raw
        .uuid;
    let event = |kind| gpu_inventory::HealthEvent {
        gpu_uuid: uuid.clone(),
        kind,
    };
    plugin.inject_health_event(1, &event(gpu_inventory::HealthEventKind::Xid { code: 94 }))?;
    until("the GPU's taint", TIMEOUT, || async {
        Ok(tainted(&slices, &gpu0).await?.then_some(()))
    })
    .await?;
    apply_yaml(
        &client,
        &pod_with_claim("after-fault", "gpu-share.drust.dev", Some("20G")),
        Path::new("after-fault"),
    )
    .await?;
    let (_, message) = drust_e2e::pods::unschedulable(&pods, "after-fault", TIMEOUT).await?;
    ensure!(
        message.contains("cannot allocate all claims"),
        "after-fault: {message}"
    );
    ensure!(
        prepare(&kubelet, &claim).await?.is_some(),
        "llm-7b stays prepared on the tainted GPU"
    );
    plugin.inject_health_event(2, &event(gpu_inventory::HealthEventKind::Recovered))?;
    let (_, after) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "after-fault", TIMEOUT).await?;
    let r = allocation_results(&after)
        .and_then(|r| r.first())
        .context("after-fault not allocated")?;
    ensure!(r.device == gpu0, "after-fault on {}", r.device);
    plugin.stop().await?;

    // The example "a quarter of an A100 80GB" on a node with A100s and L4s.
    cp.register_node(A100_NODE, &[]).await?;
    let topology = repo_path("examples/topologies/mixed-a100-l4.yaml");
    let mut plugin = NodePlugin::start_with(cp, DRIVER, A100_NODE, &topology, |c| {
        c.consumable_capacity = true;
    })?;
    plugin.wait_ready(&client, TIMEOUT).await?;
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    apply_file(
        &client,
        &repo_path("examples/fractional-gpus/a100-quarter.yaml"),
    )
    .await?;
    let (pod, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "a100-quarter", TIMEOUT).await?;
    ensure!(
        pod.spec.and_then(|s| s.node_name).as_deref() == Some(A100_NODE),
        "a100-quarter bound elsewhere"
    );
    prepare(&kubelet, &claim).await?;
    let env = cdi_env(&plugin.config().cdi_root, &claim)?;
    for want in [
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
    ] {
        ensure!(
            env.iter().any(|e| e == want),
            "a100-quarter lacks {want}: {env:?}"
        );
    }
    plugin.stop().await?;
    Ok(())
}

/// Without the MPS control tool a node publishes no shares (limits nobody could enforce are never
/// handed out) and says why in a Warning event on its Node, where `kubectl describe node` shows it.
#[tokio::test]
async fn without_mps_the_node_publishes_no_shares_and_says_so_on_the_node() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = async {
        let client = cp.client().await?;
        cp.register_node(NODE, &[]).await?;
        let topology = repo_path("examples/topologies/dgx-h100.yaml");
        let mut plugin = NodePlugin::start_with(&cp, DRIVER, NODE, &topology, |c| {
            c.consumable_capacity = true;
            c.mps_control_binary = "/nonexistent/nvidia-cuda-mps-control".into();
        })?;
        let slices = plugin.wait_ready(&client, TIMEOUT).await?;
        let shared = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.allow_multiple_allocations == Some(true))
            .count();
        ensure!(
            shared == 0,
            "{shared} devices published shareable without MPS"
        );
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(client.clone());
        let event = until("the node's SharesNotPublished event", TIMEOUT, || async {
            let list = events
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok(list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some("SharesNotPublished")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(NODE)
            }))
        })
        .await?;
        ensure!(
            event.type_.as_deref() == Some("Warning")
                && event.action.as_deref() == Some("Publish")
                && event
                    .note
                    .as_deref()
                    .is_some_and(|n| n.contains("exclusive use only")),
            "{event:?}"
        );
        plugin.stop().await?;
        anyhow::Ok(())
    }
    .await;
    cp.stop().await?;
    result
}
