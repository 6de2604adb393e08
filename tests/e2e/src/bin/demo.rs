//! `demo`: the whole driver on a local control plane, in one command.
//!
//! Starts etcd + kube-apiserver + kube-controller-manager + kube-scheduler (building them the
//! first time), runs the drust node plugin on a fake 8-GPU node (`examples/topologies/dgx-h100.yaml`
//! unless `--topology` says otherwise), applies the GPU DeviceClass and `examples/single-gpu`,
//! and then calls the plugin with the kubelet's own code (`tests/gotools/cmd/kubeletpeer`). Prints the published ResourceSlice, the scheduler's allocation,
//! the prepared CDI device IDs and the CDI spec file.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

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
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--topology" => topology = PathBuf::from(args.next().context("--topology FILE")?),
            "-h" | "--help" => {
                println!("usage: demo [--topology FILE]");
                return Ok(());
            }
            other => bail!("unknown argument {other:?} (usage: demo [--topology FILE])"),
        }
    }

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
