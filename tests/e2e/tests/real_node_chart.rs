//! The Helm chart on a real node: `helm install` as the README says, with the plugin image
//! built from the binary just compiled (an OCI archive imported into the node's containerd, the
//! chart's entrypoint and flags, plus `--fake-topology` for the fake DGX H100 and the node's
//! temp-dir paths as values). The DaemonSet pod runs, its probes pass, it registers with the
//! real kubelet as its ServiceAccount (RBAC and the chart's admission policy enforced), and a
//! workload pod gets its GPU. Then a rolling update of the DaemonSet to a new image tag while
//! one workload pod runs and another is being created: no prepare fails, no pod restarts, and
//! the new instance unprepares what the old one prepared. A claim shared through MPS keeps its
//! control daemon (its own Pod, created by the plugin) and a connected client across the rolling
//! update, and the new instance stops the daemon at unprepare. The chart runs with fractional GPUs
//! on: the whole-GPU and MPS claims keep working on shareable GPUs, and a share of one GPU keeps
//! its GPU's daemon (its own Pod) and its connected client across the rolling update as well.
//!
//! The test node runs no kube-proxy, so the `kubernetes` Service's ClusterIP does not route:
//! the plugin pod reaches the API server at the machine's address through the chart's
//! `extraEnv` (`KUBERNETES_SERVICE_HOST`/`_PORT`), as on clusters without kube-proxy.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use drust_e2e::helm::{chart_path, helm_in};
use drust_e2e::host::BinaryHost;
use drust_e2e::images;
use drust_e2e::manifests::repo_path;
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::{
    POD_TIMEOUT, apply_example, container_id, container_started, pids_of_container, ready,
    restarts, seen, sleeping_gpu_pod, succeeded, terminated_message, wait_pod_done, wait_running,
};
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const NAMESPACE: &str = "drust-system";
const RELEASE: &str = "drust";
const IMAGE: &str = "docker.io/library/drust-gpu-kubelet-plugin";
const TIMEOUT: Duration = Duration::from_secs(180);

/// The chart's plugin pods on the node, by name.
async fn plugin_pods(pods: &Api<Pod>) -> anyhow::Result<BTreeMap<String, Pod>> {
    Ok(pods
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}")))
        .await?
        .items
        .into_iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
        .collect())
}

fn image_of(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.as_deref())
        .unwrap_or_default()
}

/// Waits until the only plugin pod runs `image` and is Ready (the old one, if any, gone).
async fn wait_plugin_ready(pods: &Api<Pod>, image: &str, node: &Node) -> anyhow::Result<Pod> {
    let start = Instant::now();
    loop {
        let all = plugin_pods(pods).await?;
        if all.len() == 1
            && let Some(pod) = all.values().next()
            && image_of(pod) == image
            && ready(pod)
        {
            return Ok(pod.clone());
        }
        ensure!(
            start.elapsed() < TIMEOUT,
            "no single Ready plugin pod of {image} after {TIMEOUT:?}: {:#?}\n{}\n{}",
            all.values()
                .map(|p| (
                    p.metadata.name.clone(),
                    image_of(p).to_owned(),
                    p.status.clone()
                ))
                .collect::<Vec<_>>(),
            node.pod_logs(NAMESPACE, RELEASE, 40),
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// One GPU node and the control nodes, and one `DRUST_DEVICE_*` variable: what a one-GPU
/// container must see.
fn sees_one_gpu(log: &str) -> bool {
    let (nodes, env) = seen(log);
    let gpus = nodes
        .iter()
        .filter(|n| {
            n.strip_prefix("/dev/nvidia")
                .and_then(|r| r.split(' ').next())
                .is_some_and(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
        })
        .count();
    let control = [
        "/dev/nvidia-uvm ",
        "/dev/nvidia-uvm-tools ",
        "/dev/nvidiactl ",
    ]
    .iter()
    .all(|c| nodes.iter().any(|n| n.starts_with(c)));
    let devices = env
        .iter()
        .filter(|e| e.starts_with("DRUST_DEVICE_"))
        .count();
    gpus == 1 && nodes.len() == 4 && control && devices == 1
}

/// The claims the plugin's checkpoint (on the host) records.
fn checkpointed_claims(node: &Node) -> anyhow::Result<usize> {
    let path = node.plugin_dir(DRIVER).join("checkpoint.json");
    let v = drust_e2e::plugin::read_checkpoint(&path).map_err(anyhow::Error::msg)?;
    Ok(v["claims"].as_object().map_or(0, serde_json::Map::len))
}

/// A ResourceClaim for one whole GPU shared through MPS: the claim gets its own control daemon.
fn mps_claim() -> anyhow::Result<ResourceClaim> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "mps-gpu", "namespace": "default"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.drust.dev"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.drust.dev/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}},
            }}}],
        }},
    }))?)
}

/// A pod standing for a CUDA process connected to its claim's MPS daemon: the workload image's
/// stand-in client (the fake control tool, `images::FAKE_CUDA_CLIENT`) sends `fake_client_attach` and
/// prints `attached <daemon pid> <n>` every 200 ms while the daemon serves it. When the daemon
/// goes, the container fails: the pod can only stay Running with a live daemon.
fn mps_client_pod(name: &str, claim: serde_json::Value) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "cuda",
                "image": images::WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; \
                    (echo fake_client_attach | /usr/local/bin/fake-cuda-client) & wait $!; \
                    echo lost the MPS daemon > /dev/termination-log; exit 1"],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
            "resourceClaims": [claim],
        },
    }))?)
}

/// A share of one GPU (fractional GPUs): 20 GB of the chart's share class.
fn share_template() -> anyhow::Result<k8s_openapi::api::resource::v1::ResourceClaimTemplate> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "share-20g", "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu-share.drust.dev",
            "capacity": {"requests": {"memory": "20G"}},
        }}]}}},
    }))?)
}

/// `(daemon pid, n)` of each `attached` line the MPS client `pod` has printed so far.
fn attached(node: &Node, pod: &str) -> Vec<(u32, u64)> {
    node.pod_logs("default", pod, 100_000)
        .lines()
        .filter_map(|l| {
            let mut words = l.split(" attached ").nth(1)?.split_whitespace();
            Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
        })
        .collect()
}

/// Waits until the MPS client `pod` has printed a line after `after` (`n`), returning the last
/// one.
async fn attached_after(node: &Node, pod: &str, after: Option<u64>) -> anyhow::Result<(u32, u64)> {
    let start = Instant::now();
    loop {
        if let Some(&last) = attached(node, pod).last()
            && after.is_none_or(|n| last.1 > n)
        {
            return Ok(last);
        }
        ensure!(
            start.elapsed() < TIMEOUT,
            "the MPS client {pod} printed nothing new after {after:?}\n{}\n{}",
            node.pod_logs("default", pod, 20),
            node.pod_logs(NAMESPACE, "mps-control-daemon", 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn the_chart_serves_a_real_kubelet_and_rolls_to_a_new_image_without_failing_a_pod()
-> anyhow::Result<()> {
    let address = drust_e2e::host_address()
        .context("this machine has no non-loopback IPv4 address for pods to reach")?;
    let cp = ControlPlane::start(ControlPlaneOptions {
        pod_address: Some(address),
        ..Default::default()
    })
    .await?;
    let (_, port) = cp.pod_endpoint().context("pod endpoint")?;
    let client = cp.client().await?;
    let node = Node::start(
        &cp,
        NODE,
        NodeOptions::default().label("nvidia.com/gpu.present", "true"),
    )
    .await?;

    // The fake GPU host: device nodes (mknod) and an empty driver root, under a temp dir.
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = BinaryHost::new(
        "drust-chart-node-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        NODE,
    )?
    .on_node(&node);
    host.make_device_nodes()?;
    // The chart mounts the driver root with HostToContainer propagation, which needs a shared
    // mount on the host side: the node's root is one (as `/` on a systemd host).
    let driver_root = node.root().join("driver-root");
    std::fs::create_dir_all(&driver_root)?;
    // Its MPS control tool (the static stand-in), and the directories a root filesystem has
    // that the MPS daemon Pods mount over (`/tmp`, `/dev/shm`).
    for dir in ["usr/bin", "tmp", "dev/shm"] {
        std::fs::create_dir_all(driver_root.join(dir))?;
    }
    std::fs::copy(
        drust_fakes::mps_control(),
        driver_root.join("usr/bin/nvidia-cuda-mps-control"),
    )?;

    // Two tags of the plugin image, from the binary this test run built.
    for tag in ["v1", "v2"] {
        let image = images::plugin(&format!("{IMAGE}:{tag}"), host.binary(), &topology)?;
        let archive = host.root().join(format!("plugin-{tag}.tar"));
        images::write_archive(&image, &archive)?;
        node.import(&archive).await?;
    }

    // The fake GPUs' state (their usage files) where host and plugin pod both see it: in the
    // plugin directory, which the chart mounts at the host's path.
    let fake_state = node.plugin_dir(DRIVER).join("fake-state");

    // helm install as the README says, with this node's paths and the local image.
    let chart = chart_path();
    let helm_home = host.root().join("helm-home");
    let kubeconfig = format!("--kubeconfig={}", cp.kubeconfig_path().display());
    let sets = [
        format!("image.repository={IMAGE}"),
        "image.tag=v1".to_owned(),
        "image.pullPolicy=Never".to_owned(),
        format!("host.kubeletDir={}", node.kubelet_dir().display()),
        format!("host.cdiRoot={}", node.cdi_root().display()),
        format!("host.driverRoot={}", driver_root.display()),
        format!("host.devRoot={}", host.root().display()),
        format!("host.mpsRoot={}", host.root().join("mps").display()),
        // Fractional GPUs on: whole-GPU claims, the MPS claim and a share side by side.
        "features.consumableCapacity=true".to_owned(),
        // A daemon Pod's start is part of a prepare: give this 2-core machine's kubelet room.
        format!(
            "extraArgs={{--fake-topology={},--fake-state-dir={},--claim-timeout-seconds=40,--mps-start-timeout-seconds=30}}",
            images::PLUGIN_TOPOLOGY,
            fake_state.display()
        ),
    ];
    let started = Instant::now();
    drust_e2e::helm::install_chart(
        &helm_home,
        cp.kubeconfig_path(),
        RELEASE,
        NAMESPACE,
        (address, port),
        &sets,
    )
    .await?;

    // The DaemonSet's pod runs and is Ready (readiness probe on /readyz); its slices are
    // published as its own identity.
    let system_pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let v1 = wait_plugin_ready(&system_pods, &format!("{IMAGE}:v1"), &node).await?;
    eprintln!(
        "helm install -> plugin pod Ready: {} ms",
        started.elapsed().as_millis()
    );
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let published = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await?
        .items;
    ensure!(
        published
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum::<usize>()
            == 8,
        "eight GPUs published: {published:?}"
    );

    // A workload pod gets its GPU (the example, on the local busybox image).
    let example = "examples/single-gpu/single-gpu.yaml";
    apply_example(&client, example).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let done = wait_pod_done(&pods, "cuda-one-gpu", &node).await?;
    let log = terminated_message(&done, "cuda").unwrap_or_default();
    ensure!(
        succeeded(&done) && sees_one_gpu(&log),
        "the example through the chart's plugin: {:?}\n{log}",
        done.status
    );
    pods.delete("cuda-one-gpu", &DeleteParams::default())
        .await?;

    // MPS: a client connected to its claim's control daemon, which the plugin runs in its own
    // Pod on this node.
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    claims.create(&PostParams::default(), &mps_claim()?).await?;
    let mps_started = Instant::now();
    pods.create(
        &PostParams::default(),
        &mps_client_pod(
            "mps-client",
            serde_json::json!({"name": "gpu", "resourceClaimName": "mps-gpu"}),
        )?,
    )
    .await?;
    wait_running(&pods, "mps-client", &node).await?;
    let (daemon_pid, _) = attached_after(&node, "mps-client", None).await?;
    eprintln!(
        "MPS claim: daemon pod started, client attached: {} ms",
        mps_started.elapsed().as_millis()
    );
    let mps_uid = claims
        .get("mps-gpu")
        .await?
        .metadata
        .uid
        .context("claim UID")?;
    let daemon_name = format!("mps-control-daemon-{mps_uid}");
    // Checked after the rolling update, so that a daemon without a Pod of its own shows what
    // it costs first: the client losing its server.
    let daemon = system_pods.get_opt(&daemon_name).await?;
    let control_log = host
        .root()
        .join("mps")
        .join(&mps_uid)
        .join("log/control.log");

    // Fractional GPUs: a share of one GPU (its own claim from a template of the chart's share
    // class) connected to the GPU's MPS daemon, which runs in its own Pod too.
    let templates: Api<k8s_openapi::api::resource::v1::ResourceClaimTemplate> =
        Api::namespaced(client.clone(), "default");
    templates
        .create(&PostParams::default(), &share_template()?)
        .await?;
    pods.create(
        &PostParams::default(),
        &mps_client_pod(
            "share-client",
            serde_json::json!({"name": "gpu", "resourceClaimTemplateName": "share-20g"}),
        )?,
    )
    .await?;
    wait_running(&pods, "share-client", &node).await?;
    let (share_daemon_pid, _) = attached_after(&node, "share-client", None).await?;
    let (_, share_claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "share-client", TIMEOUT).await?;
    let share_device = drust_e2e::claims::allocation_results(&share_claim)
        .and_then(|r| r.first())
        .filter(|r| r.share_id.is_some())
        .map(|r| r.device.clone())
        .context("the share client's claim holds a share")?;
    // The share's processes hold 6 GiB of its GPU (the fake NVML's usage file): the chart's
    // plugin attributes them, through the host's /proc and the kubelet's PodResources socket
    // (both mounted read-only), to the share's pod, claim and container.
    let share_gpu = drust_e2e::plugin::fake_gpus(&topology)
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .find(|g| g.name == share_device)
        .context("the share's GPU")?;
    let share_pod = pods.get("share-client").await?;
    let share_pids = pids_of_container(&container_id(&share_pod, "cuda")?)?;
    ensure!(
        !share_pids.is_empty(),
        "no process of the share's container"
    );
    let per_process = (6u64 << 30) / share_pids.len() as u64;
    let processes: Vec<serde_json::Value> = share_pids
        .iter()
        .map(|pid| serde_json::json!({"pid": pid, "usedMemoryBytes": per_process}))
        .collect();
    std::fs::create_dir_all(fake_state.join("usage"))?;
    std::fs::write(
        fake_state.join(format!("usage/{}.json", share_gpu.raw.index)),
        serde_json::json!({"smPercent": 40, "memoryPercent": 10,
            "memoryUsedBytes": per_process * share_pids.len() as u64, "processes": processes})
        .to_string(),
    )?;
    let share_used = per_process * share_pids.len() as u64;

    // `dractl top`, as a user holding only deploy/rbac/dractl-top.yaml, reads the chart's plugin
    // pod through a port-forward, showing the plugin its token (the chart's http.auth): both
    // pods, and the share against its allocation.
    let top_kubeconfig = host.root().join("topper.kubeconfig");
    drust_e2e::rbac::dractl_top_kubeconfig(&cp, &client, &top_kubeconfig).await?;
    let dractl = drust_e2e::binary::dractl_binary().map_err(anyhow::Error::msg)?;
    let top: serde_json::Value = until("dractl top listing both pods", TIMEOUT, || async {
        let out = std::process::Command::new(&dractl)
            .args(["top", "-A", "-o", "json", "--kubeconfig"])
            .arg(&top_kubeconfig)
            .output()
            .map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let top: serde_json::Value = serde_json::from_str(&stdout)
            .map_err(|e| format!("{e}: {stdout}{}", String::from_utf8_lossy(&out.stderr)))?;
        let rows = top["rows"].as_array().map_or(0, Vec::len);
        let share_sampled = top["rows"].as_array().is_some_and(|r| {
            r.iter()
                .any(|r| r["pod"] == "share-client" && r["memoryUsedBytes"] == share_used)
        });
        if rows == 2 && share_sampled {
            Ok(Some(top))
        } else {
            Err(stdout)
        }
    })
    .await?;
    ensure!(top["unreachable"] == serde_json::json!([]), "{top:#}");
    let row = |pod: &str| {
        top["rows"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["pod"] == pod))
            .cloned()
            .with_context(|| format!("{pod} in {top:#}"))
    };
    let (mps_row, share_row) = (row("mps-client")?, row("share-client")?);
    ensure!(
        mps_row["node"] == NODE && mps_row["claims"] == serde_json::json!(["mps-gpu"]),
        "{mps_row:#}"
    );
    ensure!(
        share_row["devices"] == serde_json::json!([share_device])
            // 20G, rounded up to the capacity's 1 GiB steps.
            && share_row["memoryLimitBytes"]
                .as_u64()
                .is_some_and(|b| (20_000_000_000..=21_474_836_480).contains(&b))
            && share_row["gpus"].as_f64().is_some_and(|g| g > 0.0 && g < 1.0),
        "the share against its allocation: {share_row:#}"
    );
    // The process is named by its container, as the kubelet answered the plugin pod: its
    // /usage, read on the pod network with the same user's token.
    let plugin_pod = v1.metadata.name.clone().context("plugin pod name")?;
    let plugin_ip: std::net::IpAddr = v1
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .context("plugin pod IP")?
        .parse()?;
    let topper_token = cp.service_account_token("default", "topper").await?;
    // Over HTTPS (the chart's default http.tls), accepting the plugin's self-signed
    // certificate as Prometheus's insecure_skip_verify does.
    let https = |token: Option<String>| async move {
        drust_e2e::http::get_via(
            (plugin_ip, 9477).into(),
            "/usage",
            token.as_deref(),
            drust_e2e::http::Transport::TlsAnyCertificate,
        )
        .await
    };
    let answer = https(Some(topper_token.clone())).await?;
    ensure!(
        answer.status == 200,
        "{plugin_pod}'s /usage for dractl top's user: {answer:?}"
    );
    let anonymous = https(None).await?;
    ensure!(
        anonymous.status == 401,
        "{plugin_pod}'s /usage without a token: {anonymous:?}"
    );
    let usage: serde_json::Value = serde_json::from_str(&answer.body)?;
    let share_processes: Vec<&serde_json::Value> = usage["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| d["device"] == share_device.as_str())
        .flat_map(|d| d["processes"].as_array().into_iter().flatten())
        .collect();
    ensure!(
        share_processes.len() == share_pids.len()
            && share_processes.iter().all(|p| p["pod"] == "share-client"
                && p["container"] == "cuda"
                && p["namespace"] == "default")
            && usage["podResourcesError"].is_null(),
        "the share's processes by container: {usage:#}"
    );

    let share_key = share_gpu.raw.uuid.to_ascii_lowercase();
    let share_daemon = system_pods
        .get(&format!("mps-control-daemon-{share_key}"))
        .await
        .context("the GPU's MPS daemon runs in its own Pod")?;

    // Rolling update: a pod holds a GPU, another is created while `helm upgrade` moves the
    // DaemonSet to v2 (surge: the new pod registers beside the old one, then the old one hands
    // over and exits).
    pods.create(&PostParams::default(), &sleeping_gpu_pod("holder")?)
        .await?;
    let holder = wait_running(&pods, "holder", &node).await?;
    let holder_started = container_started(&holder);
    let upgrade: Vec<String> = vec![
        "upgrade".to_owned(),
        RELEASE.to_owned(),
        chart.display().to_string(),
        "--namespace".to_owned(),
        NAMESPACE.to_owned(),
        "--reuse-values".to_owned(),
        "--set".to_owned(),
        "image.tag=v2".to_owned(),
        kubeconfig,
    ];
    let upgrade_args: Vec<&str> = upgrade.iter().map(String::as_str).collect();
    let rolled = Instant::now();
    let during = sleeping_gpu_pod("during")?;
    let post = PostParams::default();
    let (upgraded, created) = tokio::join!(
        helm_in(Some(&helm_home), &upgrade_args),
        pods.create(&post, &during)
    );
    ensure!(upgraded?.contains("STATUS: deployed"), "helm upgrade");
    created?;
    let v2 = wait_plugin_ready(&system_pods, &format!("{IMAGE}:v2"), &node).await?;
    eprintln!(
        "helm upgrade -> old plugin pod gone, new one Ready: {} ms",
        rolled.elapsed().as_millis()
    );
    ensure!(v2.metadata.uid != v1.metadata.uid, "a new plugin pod");
    let ds = Api::<DaemonSet>::namespaced(client.clone(), NAMESPACE)
        .get(&format!("{RELEASE}-kubelet-plugin"))
        .await?;
    ensure!(
        ds.status.as_ref().and_then(|s| s.updated_number_scheduled) == Some(1),
        "{:?}",
        ds.status
    );
    let during = wait_running(&pods, "during", &node).await?;
    let holder = pods.get("holder").await?;
    ensure!(
        restarts(&holder) == 0
            && restarts(&during) == 0
            && container_started(&holder) == holder_started,
        "no restarts: holder {:?}, during {:?}",
        holder.status,
        during.status
    );
    // No warning on any workload pod: no failed prepare, nothing retried. (The kubelet warns
    // about every pod that this test node runs no cluster DNS: not the plugin's doing. Warnings
    // about the Node or the control plane, such as cgroup v1, are not about the pods.)
    let warnings: Vec<String> = Api::<Event>::namespaced(client.clone(), "default")
        .list(&ListParams::default().fields("type=Warning,involvedObject.kind=Pod"))
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() != Some("MissingClusterDNS"))
        .map(|e| {
            format!(
                "{:?} {:?}: {:?}",
                e.involved_object.name, e.reason, e.message
            )
        })
        .collect();
    ensure!(warnings.is_empty(), "warnings: {warnings:#?}");

    // The MPS client never lost its daemon: the same daemon process still serves it, its pod
    // never restarted, and the new instance adopted it instead of starting another.
    let (_, n_after_rollout) = attached(&node, "mps-client")
        .last()
        .copied()
        .unwrap_or_default();
    let mps_client = pods.get("mps-client").await?;
    ensure!(
        mps_client.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
        "the MPS client lost its daemon in the rolling update: {:?}\n{}",
        mps_client.status,
        node.pod_logs("default", "mps-client", 10)
    );
    let (pid, _) = attached_after(&node, "mps-client", Some(n_after_rollout)).await?;
    let daemon = daemon.context("the MPS daemon has no Pod of its own")?;
    ensure!(
        daemon.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE),
        "the daemon pod is bound to the node: {:?}",
        daemon.spec
    );
    let daemon_after = system_pods.get(&daemon_name).await?;
    let starts = std::fs::read_to_string(&control_log)?
        .lines()
        .filter(|l| l.starts_with("start "))
        .count();
    ensure!(
        pid == daemon_pid
            && mps_client.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && restarts(&mps_client) == 0
            && daemon_after.metadata.uid == daemon.metadata.uid
            && restarts(&daemon_after) == 0
            && starts == 1,
        "the MPS client kept its daemon across the rolling update: pid {pid} (was {daemon_pid}), \
         client {:?}, daemon {:?}, {starts} daemon starts\n{}",
        mps_client.status,
        daemon_after.status,
        node.pod_logs("default", "mps-client", 10)
    );

    // The share kept its GPU's daemon too: same process, same Pod, never restarted.
    let (_, n) = attached(&node, "share-client")
        .last()
        .copied()
        .unwrap_or_default();
    let (pid, _) = attached_after(&node, "share-client", Some(n)).await?;
    let share_daemon_after = system_pods
        .get(&format!("mps-control-daemon-{share_key}"))
        .await?;
    let share_client = pods.get("share-client").await?;
    ensure!(
        pid == share_daemon_pid
            && restarts(&share_client) == 0
            && share_daemon_after.metadata.uid == share_daemon.metadata.uid
            && restarts(&share_daemon_after) == 0,
        "the share kept its GPU's daemon across the rolling update: pid {pid} (was \
         {share_daemon_pid}), client {:?}, daemon {:?}",
        share_client.status,
        share_daemon_after.status
    );

    // The new instance unprepares what the old one prepared.
    ensure!(
        checkpointed_claims(&node)? == 4,
        "all four claims checkpointed"
    );
    for name in ["holder", "during", "mps-client", "share-client"] {
        pods.delete(name, &DeleteParams::default()).await?;
    }
    claims.delete("mps-gpu", &DeleteParams::default()).await?;
    let start = Instant::now();
    while checkpointed_claims(&node)? > 0
        || std::fs::read_dir(node.cdi_root())?.flatten().count() > 0
    {
        ensure!(
            start.elapsed() < POD_TIMEOUT,
            "claims still prepared after their pods were deleted\n{}",
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The new instance stopped the MPS daemons it adopted (the claim's, and the GPU's with its
    // last share): their Pods and directories are gone.
    ensure!(
        system_pods.get_opt(&daemon_name).await?.is_none()
            && !host.root().join("mps").join(&mps_uid).exists()
            && system_pods
                .get_opt(&format!("mps-control-daemon-{share_key}"))
                .await?
                .is_none()
            && !host.root().join("mps").join(&share_key).exists(),
        "the MPS daemon outlived its claim\n{}",
        node.pod_logs(NAMESPACE, RELEASE, 40)
    );

    helm_in(
        Some(&helm_home),
        &[
            "uninstall",
            RELEASE,
            "--namespace",
            NAMESPACE,
            "--wait",
            &format!("--kubeconfig={}", cp.kubeconfig_path().display()),
        ],
    )
    .await?;
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}
