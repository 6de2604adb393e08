//! A ComputeDomain end to end on two real nodes in one NVLink clique (issue 43): the GPU
//! plugin, the ComputeDomain controller and the real scheduler and kubelets, nothing played by
//! the test.
//!
//! Two real nodes of the fake GB200 tray (one clique), each plugin with a fake `/proc/devices`
//! naming `235 nvidia-caps-imex-channels` (so it publishes `imex-channel-0` with the binding
//! conditions) and labelling its Node with the clique as `nvidia.com/gpu.clique`
//! (`--node-clique-label`, what NVIDIA's example selects on). The controller runs in
//! compatibility mode (`--api nvidia`) as a process, its IMEX daemon Pods on an image of its own
//! binary (`chroot` beside it, as the plugin's image has), chrooted into a fake driver root
//! whose `nvidia-imex` and `nvidia-imex-ctl` are drust's stand-ins.
//!
//! NVIDIA's own example (`examples/compute-domains/nvidia/smoke-channel-injection.yaml`, its
//! image swapped for the nodes' local one) is applied as written: the scheduler allocates the
//! channel and holds the pod until the controller's daemon on that node answers `READY`, then
//! binds it; the kubelet has the plugin prepare the channel, and the container lists
//! `/dev/nvidia-caps-imex-channels/channel0`, a character device of major 235, minor 0. A
//! second pod of the domain, kept off the first one's node, makes the other node a member: the
//! domain is `Ready` with both nodes, indices 0 and 1, one clique, each with a Ready daemon
//! Pod whose IP is in the clique's nodes file. Deleting the domain's pods and the domain
//! removes the daemons and the template. Then NVIDIA's `allocationMode: All` example
//! (`negative-allocationmode-all.yaml`, which only NVIDIA's host-managed mode refuses) runs, its
//! container listing every channel the node publishes.

mod cd_support;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::cluster::{Cluster, ClusterOptions, FAKE_IMEX_MAJOR, NodeGroup};
use drust_e2e::driver_root::FakeDriverRoot;
use drust_e2e::images::{self, WORKLOAD_IMAGE};
use drust_e2e::manifests::{apply_yaml, repo_path};
use drust_e2e::wait::until;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use serde_json::{Value, json};

const TRAY: &str = "examples/topologies/gb200-nvl-tray.yaml";
const EXAMPLE: &str = "examples/compute-domains/nvidia/smoke-channel-injection.yaml";
const EXAMPLE_ALL: &str = "examples/compute-domains/nvidia/negative-allocationmode-all.yaml";
/// The daemon Pods' image: the controller's binary and `chroot`.
const DAEMON_IMAGE: &str = "docker.io/library/drust-compute-domain:test";
const TIMEOUT: Duration = Duration::from_secs(240);

#[tokio::test]
#[allow(clippy::too_many_lines)] // one scenario, step by step
async fn nvidias_compute_domain_example_runs_on_two_real_nodes_of_one_clique() -> anyhow::Result<()>
{
    let cluster = Cluster::start(
        ClusterOptions::default().real(
            NodeGroup::new("cd-real-", 2, TRAY)
                .imex_channels()
                .plugin_args(&["--node-clique-label", "nvidia.com/gpu.clique"]),
        ),
    )
    .await?;
    let result = run(&cluster).await;
    if result.is_err() {
        eprintln!("{}", cluster.log_tail());
    }
    cluster.stop().await?;
    result
}

async fn run(cluster: &Cluster) -> anyhow::Result<()> {
    let client = cluster.client().clone();
    let nodes: Vec<String> = cluster
        .real_nodes()
        .iter()
        .map(|n| n.name().to_owned())
        .collect();
    // NVIDIA's CRD and the controller's namespace, as the chart installs them.
    let crd = std::fs::read_to_string(repo_path(
        "deploy/crds/resource.nvidia.com_computedomains.yaml",
    ))?;
    apply_yaml(&client, &crd, Path::new("NVIDIA's ComputeDomain CRD")).await?;
    let namespace: Namespace =
        serde_json::from_value(json!({"metadata": {"name": cd_support::SYSTEM}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await?;

    // The daemon image on both nodes, and the driver root the daemons run in.
    let dir = tempfile::tempdir()?;
    let binary =
        drust_e2e::binary::compute_domain_controller_binary().map_err(anyhow::Error::msg)?;
    let image = images::plugin(DAEMON_IMAGE, &binary, &repo_path(TRAY))?;
    let archive = dir.path().join("daemon.tar");
    images::write_archive(&image, &archive)?;
    for node in cluster.real_nodes() {
        node.node().import(&archive).await?;
    }
    // On a shared mount (a node's directory), as a host's `/` is: the daemon Pod mounts it
    // with HostToContainer propagation. Both nodes share this machine, so one serves both.
    let driver_root = cluster.real_nodes()[0]
        .node()
        .root()
        .join("imex-driver-root");
    FakeDriverRoot::create(&driver_root, "570.124.06")?;
    // A host's root has /tmp, where the daemon Pod mounts its own writable directory (the
    // driver root itself is read-only there, so the runtime cannot make the mount point).
    std::fs::create_dir_all(driver_root.join("tmp"))?;
    let root = driver_root.to_str().context("utf-8 path")?;
    let mut controller = cd_support::Controller::start_with(
        cluster.cp().kubeconfig_path(),
        &[
            "--api",
            "nvidia",
            "--namespace",
            cd_support::SYSTEM,
            "--image",
            DAEMON_IMAGE,
            "--pull-policy",
            "Never",
            "--host-driver-root",
            root,
            // `images::plugin` puts the binary where the plugin's is.
            "--self-binary",
            "/usr/bin/gpu-kubelet-plugin",
        ],
        dir.path(),
    )?;
    let outcome = scenario(cluster, &client, &nodes).await;
    if outcome.is_err() {
        eprintln!("controller log:\n{}", controller.log_text());
    }
    controller.kill();
    outcome
}

async fn scenario(
    cluster: &Cluster,
    client: &kube::Client,
    nodes: &[String],
) -> anyhow::Result<()> {
    // Both nodes labelled with their clique, as the example selects.
    let node_api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let clique = until("both nodes labelled with the clique", TIMEOUT, || async {
        let mut values = Vec::new();
        for n in nodes {
            let node = node_api.get(n).await.map_err(|e| e.to_string())?;
            match node
                .metadata
                .labels
                .and_then(|l| l.get("nvidia.com/gpu.clique").cloned())
            {
                Some(v) => values.push(v),
                None => return Ok(None),
            }
        }
        Ok((values[0] == values[1]).then(|| values[0].clone()))
    })
    .await?;

    // NVIDIA's example, only the image swapped.
    let example = std::fs::read_to_string(repo_path(EXAMPLE))?;
    ensure!(
        example.contains("image: ubuntu:22.04"),
        "the example's image"
    );
    let example = example.replace("image: ubuntu:22.04", &format!("image: {WORKLOAD_IMAGE}"));
    apply_yaml(client, &example, &repo_path(EXAMPLE)).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let first = running(&pods, "hostmanaged-smoke").await?;
    let first_node = first
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .context("bound")?;
    let listing = until("the container's listing", TIMEOUT, || async {
        let log = pods
            .logs("hostmanaged-smoke", &LogParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(log.contains("channel0").then_some(log))
    })
    .await?;
    let channel = listing
        .lines()
        .find(|l| l.ends_with(" channel0"))
        .context("channel0 listed")?;
    ensure!(
        channel.starts_with('c') && channel.contains(&format!("{FAKE_IMEX_MAJOR},")),
        "channel0 a character device of major {FAKE_IMEX_MAJOR}: {listing}"
    );

    // A second pod of the domain on the other node.
    let other = nodes
        .iter()
        .find(|n| **n != first_node)
        .context("the other node")?;
    let second: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "second", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"kubernetes.io/hostname": other},
            "containers": [{"name": "ctr", "image": WORKLOAD_IMAGE,
                "command": ["sh", "-c", "ls -la /dev/nvidia-caps-imex-channels; trap 'exit 0' TERM; sleep 9999 & wait"],
                "resources": {"claims": [{"name": "imex"}]}}],
            "resourceClaims": [{"name": "imex", "resourceClaimTemplateName": "hostmanaged-smoke-channel"}],
        },
    }))?;
    pods.create(&PostParams::default(), &second).await?;
    running(&pods, "second").await?;

    // The domain: Ready, both nodes, indices 0 and 1, one clique, each daemon Ready and listed.
    let domains = cd_support::nvidia_domain_api(client, "default");
    let status = until("the domain Ready with both nodes", TIMEOUT, || async {
        let d = domains
            .get("hostmanaged-smoke")
            .await
            .map_err(|e| e.to_string())?;
        let status = d.data.get("status").cloned().unwrap_or(Value::Null);
        let ready =
            status["status"] == "Ready" && status["nodes"].as_array().map(Vec::len) == Some(2);
        Ok(ready.then_some(status))
    })
    .await?;
    let members = cd_support::members(&status);
    let mut indices: Vec<i64> = members.values().map(|m| m.0).collect();
    indices.sort_unstable();
    ensure!(indices == [0, 1], "indices 0 and 1: {status}");
    ensure!(
        nodes.iter().all(|n| members.contains_key(n)),
        "both nodes members: {status}"
    );
    let daemons: Api<Pod> = Api::namespaced(client.clone(), cd_support::SYSTEM);
    let listed = daemons.list(&ListParams::default()).await?;
    let ips: Vec<String> = listed
        .items
        .iter()
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect();
    ensure!(
        listed.items.len() == 2 && ips.len() == 2,
        "one daemon Pod per node: {:?}",
        listed
            .items
            .iter()
            .map(|p| &p.metadata.name)
            .collect::<Vec<_>>()
    );
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), cd_support::SYSTEM);
    let config = maps.list(&ListParams::default()).await?;
    let files: String = config
        .items
        .iter()
        .flat_map(|m| m.data.iter().flatten())
        .filter(|(k, _)| k.starts_with("nodes"))
        .map(|(_, v)| v.clone())
        .collect();
    ensure!(
        ips.iter().all(|ip| files.contains(ip.as_str())),
        "the clique's nodes file lists both daemons ({ips:?}): {files}"
    );
    eprintln!("clique {clique}: {status}");

    // The domain goes with its daemons and template once its pods are gone.
    for name in ["hostmanaged-smoke", "second"] {
        pods.delete(name, &DeleteParams::default()).await?;
    }
    until("the pods gone", TIMEOUT, || async {
        let left = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(left.items.is_empty().then_some(()))
    })
    .await?;
    domains
        .delete("hostmanaged-smoke", &DeleteParams::default())
        .await?;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), "default");
    until(
        "the daemons, the domain and its template gone",
        TIMEOUT,
        || async {
            let daemons_left = daemons
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            let domain_left = domains
                .get_opt("hostmanaged-smoke")
                .await
                .map_err(|e| e.to_string())?;
            let template_left = templates
                .get_opt("hostmanaged-smoke-channel")
                .await
                .map_err(|e| e.to_string())?;
            Ok(
                (daemons_left == 0 && domain_left.is_none() && template_left.is_none())
                    .then_some(()),
            )
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;

    // NVIDIA's allocationMode All example (refused by NVIDIA's host-managed mode only): its
    // pod gets every channel the node publishes (one here).
    let all = std::fs::read_to_string(repo_path(EXAMPLE_ALL))?
        .replace("image: ubuntu:22.04", &format!("image: {WORKLOAD_IMAGE}"));
    apply_yaml(client, &all, &repo_path(EXAMPLE_ALL)).await?;
    running(&pods, "hostmanaged-all").await?;
    let listing = until("the All pod's listing", TIMEOUT, || async {
        let log = pods
            .logs("hostmanaged-all", &LogParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(log.contains("channel0").then_some(log))
    })
    .await?;
    ensure!(
        listing.lines().filter(|l| l.contains(" channel")).count() == 1,
        "every published channel (one): {listing}"
    );
    let d = domains.get("hostmanaged-all").await?;
    ensure!(
        d.data["spec"]["channel"]["allocationMode"] == "All",
        "the domain as applied: {:?}",
        d.data
    );
    Ok(())
}

/// Waits for pod `name` to run; fails at once if it ended.
async fn running(pods: &Api<Pod>, name: &str) -> anyhow::Result<Pod> {
    until(&format!("pod {name} running"), TIMEOUT, || async {
        let p = pods.get(name).await.map_err(|e| e.to_string())?;
        match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
            Some("Running") => Ok(Some(p)),
            Some("Failed" | "Succeeded") => Err(format!("pod {name} ended: {:?}", p.status)),
            _ => Ok(None),
        }
    })
    .await
    .map_err(anyhow::Error::msg)
}
