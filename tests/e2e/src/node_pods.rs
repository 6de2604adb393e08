//! What pods on a [`Node`] report and how the tests wait for them: a workload script that
//! prints the container's GPU device nodes and `NVIDIA_*`/`DRUST_*` variables into its
//! termination message, the examples rewritten to run it on the local busybox image, and waits
//! on pod phases with the node's logs in the error.

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

use crate::images::WORKLOAD_IMAGE;
use crate::manifests::{apply_yaml, repo_path};
use crate::node::Node;

/// How long a pod may take to reach the phase a test waits for.
pub const POD_TIMEOUT: Duration = Duration::from_secs(120);

/// What the container reports: its device nodes with their numbers, and its `NVIDIA_*` and
/// `DRUST_*` variables,
/// in its termination message (which the kubelet copies into the pod's status, so the test
/// reads it through the API server; the API server cannot reach this kubelet for logs, whose
/// node IP is loopback) and on stdout.
pub const SCRIPT: &str = r#"{ for f in /dev/nvidia* /dev/nvidia-caps/*; do [ -c "$f" ] && stat -c 'node %n %t:%T' "$f"; done; env | grep -E '^(NVIDIA|DRUST)_' | sort | sed 's/^/env /'; echo done; } > /dev/termination-log; cat /dev/termination-log"#;

/// `examples/<file>` with every container running [`SCRIPT`] in the local busybox image
/// instead of its CUDA image (which this machine cannot pull).
pub fn example_on_busybox(file: &str) -> anyhow::Result<String> {
    crate::manifests::on_workload_image(&std::fs::read_to_string(repo_path(file))?, SCRIPT)
}

/// Applies `examples/<file>` as [`example_on_busybox`] rewrites it.
pub async fn apply_example(client: &kube::Client, file: &str) -> anyhow::Result<()> {
    apply_yaml(client, &example_on_busybox(file)?, &repo_path(file)).await?;
    Ok(())
}

/// Whether `pod`'s `Ready` condition is true (its readiness probes pass).
pub fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether `pod` completed successfully.
pub fn succeeded(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
}

/// The name of the ResourceClaim generated for `pod`'s first pod claim.
pub fn pod_claim_name(pod: &Pod) -> anyhow::Result<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.resource_claim_name.clone())
        .context("the pod's claim")
}

/// Waits for pod `name` to have completed (Succeeded or Failed).
pub async fn wait_pod_done(pods: &Api<Pod>, name: &str, node: &Node) -> anyhow::Result<Pod> {
    wait_phase(pods, name, node, &["Succeeded", "Failed"]).await
}

/// Waits for pod `name` to run; fails at once if it completed instead.
pub async fn wait_running(pods: &Api<Pod>, name: &str, node: &Node) -> anyhow::Result<Pod> {
    let pod = wait_phase(pods, name, node, &["Running", "Succeeded", "Failed"]).await?;
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    ensure!(
        phase == Some("Running"),
        "pod {name} ended: {:?}",
        pod.status
    );
    Ok(pod)
}

/// Polls pod `name` until its phase is one of `phases`, for at most [`POD_TIMEOUT`].
pub async fn wait_phase(
    pods: &Api<Pod>,
    name: &str,
    node: &Node,
    phases: &[&str],
) -> anyhow::Result<Pod> {
    let start = Instant::now();
    loop {
        let pod = pods.get(name).await?;
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        if phases.contains(&phase.as_str()) {
            return Ok(pod);
        }
        if start.elapsed() > POD_TIMEOUT {
            bail!(
                "pod {name} still {phase} after {POD_TIMEOUT:?}: {:?}\n{}",
                pod.status,
                node.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A pod holding one GPU (from the example's `one-h100` template) until it is deleted.
pub fn sleeping_gpu_pod(name: &str) -> anyhow::Result<Pod> {
    sleeping_pod_with_claim(name, "one-h100")
}

/// A busybox pod in `default` that sleeps until deleted (exits at once on SIGTERM), holding a
/// claim from ResourceClaimTemplate `template` in its one container.
pub fn sleeping_pod_with_claim(name: &str, template: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "main",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        },
    }))?)
}

/// The UID of the claim generated for `pod`'s first claim.
pub async fn claim_uid_of(pod: &Pod, claims: &Api<ResourceClaim>) -> anyhow::Result<String> {
    let name = pod_claim_name(pod)?;
    Ok(claims.get(&name).await?.metadata.uid.unwrap_or_default())
}

/// The status of `pod`'s first container.
pub fn container_status(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status.as_ref()?.container_statuses.as_ref()?.first()
}

/// When the pod's first container started (its running state).
pub fn container_started(pod: &Pod) -> Option<String> {
    let running = container_status(pod)?.state.as_ref()?.running.as_ref()?;
    Some(format!("{:?}", running.started_at))
}

/// How often `pod`'s first container restarted (-1 before it has a status).
pub fn restarts(pod: &Pod) -> i32 {
    container_status(pod).map_or(-1, |c| c.restart_count)
}

/// The device nodes (`path major:minor`) and variables (`NAME=value`) in what [`SCRIPT`]
/// printed, each sorted.
pub fn seen(log: &str) -> (Vec<String>, Vec<String>) {
    let pick = |prefix: &str| {
        let mut v: Vec<String> = log
            .lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(str::to_owned)
            .collect();
        v.sort();
        v
    };
    (pick("node "), pick("env "))
}

/// The control device nodes every GPU container gets (`nvidia-uvm`, `nvidia-uvm-tools`,
/// `nvidiactl`), as [`SCRIPT`] prints them.
pub const CONTROL_NODES: [&str; 3] = [
    "/dev/nvidia-uvm ec:0",
    "/dev/nvidia-uvm-tools ec:1",
    "/dev/nvidiactl c3:ff",
];

/// What [`seen`] returns for a container holding exactly the whole GPUs `devices` (device names)
/// of `gpus` (as [`crate::plugin::fake_gpus`] lists a node's): their device nodes and the
/// control nodes, their variables and `NVIDIA_VISIBLE_DEVICES=void`, each sorted.
///
/// # Errors
/// A device not in `gpus`.
pub fn whole_gpus_view(
    gpus: &[gpu_inventory::Gpu],
    devices: impl IntoIterator<Item = impl AsRef<str>>,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let mut nodes: Vec<String> = CONTROL_NODES.iter().map(|n| (*n).to_owned()).collect();
    let mut env = vec!["NVIDIA_VISIBLE_DEVICES=void".to_owned()];
    for device in devices {
        let device = device.as_ref();
        let gpu = gpus
            .iter()
            .find(|g| g.name == device)
            .with_context(|| format!("GPU {device} in the node's topology"))?;
        nodes.push(format!(
            "/dev/nvidia{} c3:{:x}",
            gpu.raw.minor, gpu.raw.minor
        ));
        env.push(gpu_kubelet_plugin::claims::device_env(
            device,
            &gpu.raw.uuid,
        ));
    }
    nodes.sort();
    env.sort();
    Ok((nodes, env))
}

/// The termination message of container `name` of `pod`: what [`SCRIPT`] printed.
pub fn terminated_message(pod: &Pod, name: &str) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == name)?
        .state
        .as_ref()?
        .terminated
        .as_ref()?
        .message
        .clone()
}

/// The runtime ID of `pod`'s container `name` (its status's `containerID` without the
/// `containerd://` scheme).
pub fn container_id(pod: &Pod, name: &str) -> anyhow::Result<String> {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == name))
        .and_then(|c| c.container_id.clone())
        .with_context(|| format!("container {name}'s ID in the pod's status"))?;
    Ok(id
        .split_once("://")
        .map_or(id.clone(), |(_, id)| id.to_owned()))
}

/// The processes of the container with runtime ID `container` on this machine: each PID whose
/// cgroup names it.
pub fn pids_of_container(container: &str) -> anyhow::Result<Vec<u32>> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cgroup) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        if cgroup.contains(container) {
            pids.push(pid);
        }
    }
    Ok(pids)
}
