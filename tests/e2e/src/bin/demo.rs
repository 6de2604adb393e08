//! `demo`: the whole driver on a local control plane, in one command.
//!
//! Starts etcd + kube-apiserver + kube-controller-manager + kube-scheduler (building them the
//! first time) and a fake 8-GPU node (`examples/topologies/dgx-h100.yaml` unless `--topology`
//! says otherwise), applies the GPU DeviceClass and `examples/single-gpu`, and shows what a user
//! cares about:
//! - where this machine can run a real node (root, overlayfs, Debian's runc, CNI plugins and
//!   busybox; [`drust_e2e::node::unsupported`]): a real kubelet and containerd (built the first
//!   time), the plugin binary with mknod'ed fake GPUs and a fake driver root, and the example's
//!   pod running (busybox instead of its CUDA image), printing what its container sees: its GPU's
//!   device node, its variables, the driver's files and `nvidia-smi`;
//! - elsewhere (or with `--no-node`): it says why, and the kubelet's own code
//!   (`tests/gotools/cmd/kubeletpeer`) registers the plugin and prepares the claim instead.
//!
//! Either way it prints the published ResourceSlice, the scheduler's allocation, and the CDI
//! spec of the prepared claim.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::{apply_file, apply_yaml, on_workload_image, repo_path};
use drust_e2e::node::{Node, NodeError, NodeOptions};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::ListParams;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const TIMEOUT: Duration = Duration::from_secs(90);

fn section(title: &str) {
    println!("\n=== {title} ===");
}

/// YAML of a Kubernetes object without the noise of managedFields.
fn yaml<T: serde::Serialize>(obj: &T) -> anyhow::Result<String> {
    let mut value = serde_json::to_value(obj)?;
    if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.remove("managedFields");
    }
    Ok(serde_yaml_ng::to_string(&value)?)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut topology = repo_path("examples/topologies/dgx-h100.yaml");
    let mut real_node = true;
    const USAGE: &str = "usage: demo [--topology FILE] [--no-node]";
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--topology" => topology = PathBuf::from(args.next().context("--topology FILE")?),
            "--no-node" => real_node = false,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown argument {other:?} ({USAGE})"),
        }
    }
    let why_not = if real_node {
        // Root, but packages missing: install them as the tests do.
        if let Err(e) = drust_e2e::node::ensure_packages() {
            println!("{e}");
        }
        drust_e2e::node::unsupported()
    } else {
        Some("--no-node".to_owned())
    };

    section(
        "control plane (Kubernetes v1.36.3: etcd, kube-apiserver, kube-controller-manager, kube-scheduler)",
    );
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    println!(
        "up in {:.1} s at {}",
        cp.timings().startup.as_secs_f64(),
        cp.server_url()
    );
    let client = cp.client().await?;
    match why_not {
        None => match real_node_demo(&cp, &client, &topology).await {
            Err(e)
                if matches!(
                    e.downcast_ref::<NodeError>(),
                    Some(NodeError::Unsupported(_))
                ) =>
            {
                println!("this machine cannot run a real node ({e}); the kubelet's code instead");
            }
            other => {
                cp.stop().await?;
                println!("control plane stopped");
                return other;
            }
        },
        Some(why) => println!(
            "\nno real node here ({why}): the kubelet's own code plays the kubelet instead"
        ),
    }
    cp.register_node(NODE, &[]).await?;
    println!(
        "registered Node {NODE} (no kubelet process; the kubelet's own registration and DRA client code plays its part)"
    );

    section(&format!(
        "node plugin on {NODE}, fake GPUs from {}",
        topology.display()
    ));
    let mut plugin = NodePlugin::start(&cp, DRIVER, NODE, &topology)?;
    let slices = plugin.wait_ready(&client, TIMEOUT).await?;
    for slice in &slices {
        println!("{}", yaml(slice)?);
    }

    section(
        "DeviceClass and pod (deploy/deviceclasses/gpu.yaml, examples/single-gpu/single-gpu.yaml)",
    );
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    apply_file(&client, &repo_path("examples/single-gpu/single-gpu.yaml")).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims = Api::<ResourceClaim>::namespaced(client.clone(), "default");
    let (_, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "cuda-one-gpu", TIMEOUT).await?;
    let claim_name = claim.metadata.name.clone().unwrap_or_default();
    println!("pod default/cuda-one-gpu bound to {NODE}; ResourceClaim default/{claim_name}:");
    let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
    println!(
        "{}",
        yaml(&serde_json::json!({ "allocation": allocation }))?
    );

    section(
        "kubelet (its v1.36.3 code): registration and NodePrepareResources (v1) over the plugin's sockets",
    );
    let (kubelet, info) = Kubelet::register(&plugin.registration_socket()).await?;
    println!(
        "GetInfo: type={} name={} endpoint={} versions={:?}",
        info.r#type, info.name, info.endpoint, info.supported_versions
    );
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let resp = kubelet.prepare_v1(&[&claim]).await?;
    let prepared = resp.claims.get(&uid).context("no answer for the claim")?;
    if !prepared.error.is_empty() {
        bail!("prepare failed: {}", prepared.error);
    }
    for d in &prepared.devices {
        println!(
            "prepared {}/{} for request(s) {:?}: CDI device IDs {:?}",
            d.pool_name, d.device_name, d.request_names, d.cdi_device_ids
        );
    }

    let spec_path = plugin
        .config()
        .cdi_root
        .join(format!("{DRIVER}-claim_{uid}.json"));
    section(&format!("CDI spec {}", spec_path.display()));
    print!("{}", std::fs::read_to_string(&spec_path)?);

    section("cleanup");
    let resp = kubelet.unprepare_v1(vec![v1_claim(&claim)]).await?;
    println!(
        "NodeUnprepareResources: error={:?}; CDI spec removed: {}",
        resp.claims
            .get(&uid)
            .map(|r| r.error.as_str())
            .unwrap_or("no answer"),
        !spec_path.exists()
    );
    plugin.stop().await?;
    cp.stop().await?;
    println!("control plane stopped");
    Ok(())
}

/// What the demo pod's container prints: its GPU device nodes, its variables, the driver's
/// files CDI mounted and what `nvidia-smi` says.
const SCRIPT: &str = r#"echo "device nodes:"; for f in /dev/nvidia*; do [ -c "$f" ] && echo "  $f"; done; echo "environment:"; env | grep -E '^(NVIDIA|DRUST)_' | sort | sed 's/^/  /'; echo "driver libraries:"; ls /usr/lib/x86_64-linux-gnu | sed 's/^/  /'; echo "nvidia-smi: $(nvidia-smi)""#;

/// The demo on a real node: kubelet and containerd, the plugin binary, the example's pod.
async fn real_node_demo(
    cp: &ControlPlane,
    client: &kube::Client,
    topology: &std::path::Path,
) -> anyhow::Result<()> {
    section("real node: kubelet v1.36.3 and containerd 2.x on this machine (built the first time)");
    let node = Node::start(cp, NODE, NodeOptions::default()).await?;
    println!(
        "Node {NODE} Ready; containerd reads CDI specs from {}",
        node.cdi_root().display()
    );

    section(&format!(
        "node plugin (target/debug/gpu-kubelet-plugin) on {NODE}, fake GPUs from {}",
        topology.display()
    ));
    let host = BinaryHost::new("drust-demo-", cp.kubeconfig_path(), topology, DRIVER, NODE)?
        .on_node(&node);
    host.make_device_nodes()?;
    let version = gpu_inventory::Topology::from_file(topology)?
        .system
        .driver_version;
    host.make_driver_root(&version)?;
    let mut cmd = host.command(&host.root().join("plugin.log"), None)?;
    let plugin = PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?);
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let start = std::time::Instant::now();
    let published = loop {
        let list = slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await?
            .items;
        if !list.is_empty() {
            break list;
        }
        if start.elapsed() > TIMEOUT {
            bail!(
                "no ResourceSlice published; plugin log: {}",
                host.root().join("plugin.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for slice in &published {
        println!("{}", yaml(slice)?);
    }

    section(
        "DeviceClass and pod (deploy/deviceclasses/gpu.yaml, examples/single-gpu/single-gpu.yaml, image swapped for local busybox)",
    );
    apply_file(client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    let example = repo_path("examples/single-gpu/single-gpu.yaml");
    apply_yaml(
        client,
        &on_workload_image(&std::fs::read_to_string(&example)?, SCRIPT)?,
        &example,
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims = Api::<ResourceClaim>::namespaced(client.clone(), "default");
    let (_, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "cuda-one-gpu", TIMEOUT).await?;
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    println!(
        "pod default/cuda-one-gpu bound to {NODE}; ResourceClaim default/{}:",
        claim.metadata.name.clone().unwrap_or_default()
    );
    let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
    println!(
        "{}",
        yaml(&serde_json::json!({ "allocation": allocation }))?
    );

    // The spec exists while the pod runs; read it as soon as the kubelet had the claim prepared.
    let spec_path = host.cdi_root().join(format!("{DRIVER}-claim_{uid}.json"));
    let start = std::time::Instant::now();
    let mut spec = None;
    let pod = loop {
        if spec.is_none() {
            spec = std::fs::read_to_string(&spec_path).ok();
        }
        let pod = pods.get("cuda-one-gpu").await?;
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        if phase == "Succeeded" || phase == "Failed" {
            break pod;
        }
        if start.elapsed() > TIMEOUT {
            bail!("pod still {phase}:\n{}", node.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    section(&format!(
        "CDI spec {} (written at prepare, removed at unprepare)",
        spec_path.display()
    ));
    println!(
        "{}",
        spec.as_deref()
            .unwrap_or("(the pod finished before it was read)")
    );

    section("what the container saw (its log, read from the node)");
    match container_log(&node) {
        Some(text) => print!("{text}"),
        None => println!("(no container log found under {})", node.root().display()),
    }
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    println!("pod phase: {phase}");

    section("cleanup");
    pods.delete("cuda-one-gpu", &Default::default()).await?;
    stop(plugin).await?;
    node.stop().await?;
    println!("node stopped; machine state restored");
    if phase != "Succeeded" {
        bail!("the pod ended {phase}");
    }
    Ok(())
}

/// The log of the demo pod's container, from the node's pod log directory (the API server
/// cannot reach a kubelet on a loopback address for logs).
fn container_log(node: &Node) -> Option<String> {
    let pods_dir = node.root().join("pod-logs");
    for pod in std::fs::read_dir(&pods_dir).ok()?.flatten() {
        if !pod.file_name().to_string_lossy().contains("cuda-one-gpu") {
            continue;
        }
        let dir = pod.path().join("cuda");
        let file = std::fs::read_dir(&dir).ok()?.flatten().next()?.path();
        let raw = std::fs::read_to_string(file).ok()?;
        // CRI log lines: `<time> <stream> <tag> <text>`.
        return Some(
            raw.lines()
                .filter_map(|l| l.splitn(4, ' ').nth(3))
                .map(|l| format!("{l}\n"))
                .collect(),
        );
    }
    None
}
