//! A real node: kubelet v1.36.3 and containerd 2.x on this machine, the plugin binary serving
//! that kubelet with fake GPUs (mknod'ed device nodes), and pods whose containers report what
//! they see (read from their termination messages, through the API server). One node at a time
//! (the harness's machine-wide lock), so the tests take turns:
//! - the `single-gpu` example sees exactly its GPU; a running pod survives a kubelet restart and
//!   a plugin restart (nothing unprepared), deleting it unprepares, and a plugin SIGKILLed in the
//!   middle of a pod's prepare ends with the kubelet's retry and the pod Running;
//! - per-request isolation: containers referencing different requests of one claim see only
//!   their own GPUs;
//! - CUDA without the NVIDIA runtime: the CDI spec alone gives the container the driver's files
//!   (fake driver root) and runs the hooks (a recording stand-in);
//! - time-slicing, existing MIG and dynamic MIG pods run with their devices;
//! - an XID shows in the running pod's `allocatedResourcesStatus`, and recovery clears it;
//! - fractional GPUs: two shares of one GPU, each container with its own MPS limits, one daemon;
//!   at the `kernel` level, containerd runs the plugin's CDI hook and the share's memory limit
//!   lands on the container's own cgroup.
//!
//! The Helm chart's DaemonSet on the same kind of node (plugin image, probes, rolling update)
//! is `real_node_chart.rs`.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use drust_e2e::claims::allocated_device;
use drust_e2e::host::{BinaryHost, PluginProcess, expect_killed, stop};
use drust_e2e::images::WORKLOAD_IMAGE;
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::{
    SCRIPT, apply_example, claim_uid_of, container_id, container_started, container_status,
    pids_of_container, pod_claim_name, restarts, seen, sleeping_gpu_pod, succeeded,
    terminated_message, wait_pod_done, wait_running,
};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_kubelet_plugin::claims::device_env;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const TIMEOUT: Duration = Duration::from_secs(120);

/// A control plane, a real node, and the plugin binary serving its kubelet on the fake DGX
/// H100 (`examples/topologies/dgx-h100.yaml`), with its slices published and the `gpu.drust.dev`
/// DeviceClass applied.
struct RealNode {
    cp: ControlPlane,
    client: kube::Client,
    node: Node,
    host: BinaryHost,
    plugin: PluginProcess,
    topology: std::path::PathBuf,
}

impl RealNode {
    /// With `driver`, the plugin's driver root holds a fake driver of the topology's version
    /// ([`drust_e2e::driver_root`]); without, it is empty.
    async fn start(prefix: &str, driver: Option<&str>) -> anyhow::Result<Self> {
        Self::start_on("examples/topologies/dgx-h100.yaml", prefix, driver).await
    }

    /// As [`RealNode::start`] on the fake `topology` (a path in the repository).
    async fn start_on(topology: &str, prefix: &str, driver: Option<&str>) -> anyhow::Result<Self> {
        let real = Self::start_as(topology, prefix, driver, DRIVER, &[]).await?;
        apply_file(&real.client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
        Ok(real)
    }

    /// As [`RealNode::start_on`] with the plugin publishing as `driver_name` with `args` added,
    /// and no DeviceClass applied.
    async fn start_as(
        topology: &str,
        prefix: &str,
        driver: Option<&str>,
        driver_name: &str,
        args: &[&str],
    ) -> anyhow::Result<Self> {
        let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
        let client = cp.client().await?;
        let node = Node::start(&cp, NODE, NodeOptions::default()).await?;
        let topology = repo_path(topology);
        let host = BinaryHost::new(prefix, cp.kubeconfig_path(), &topology, driver_name, NODE)?
            .on_node(&node);
        host.make_device_nodes()?;
        if let Some(version) = driver {
            host.make_driver_root(version)?;
        }
        let mut cmd = host.command(&host.root().join("plugin.log"), None)?;
        cmd.arg("--fake-state-dir").arg(host.state_dir());
        cmd.args(args);
        let plugin = PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?);

        // The plugin publishes; the kubelet registers it.
        let slices: Api<ResourceSlice> = Api::all(client.clone());
        let start = Instant::now();
        while slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await?
            .items
            .is_empty()
        {
            ensure!(start.elapsed() < TIMEOUT, "no ResourceSlice published");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Self {
            cp,
            client,
            node,
            host,
            plugin,
            topology,
        })
    }

    /// Restarts the plugin with `args` added to its flags and waits for its slices to hold
    /// `devices` devices.
    async fn restart_plugin(&mut self, args: &[&str], devices: usize) -> anyhow::Result<()> {
        let old = std::mem::replace(&mut self.plugin, PluginProcess(spawn_placeholder()?));
        stop(old).await?;
        let mut cmd = self
            .host
            .command(&self.host.root().join("plugin.log"), None)?;
        cmd.args(args);
        let _ = std::mem::replace(
            &mut self.plugin,
            PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?),
        );
        let slices: Api<ResourceSlice> = Api::all(self.client.clone());
        let start = Instant::now();
        loop {
            let published: usize = slices
                .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
                .await?
                .items
                .iter()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum();
            if published == devices {
                return Ok(());
            }
            ensure!(
                start.elapsed() < TIMEOUT,
                "{published} devices published, want {devices}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Has the plugin's fake backend report `event` (event file number `seq`).
    fn inject_health_event(
        &self,
        seq: u32,
        event: &gpu_inventory::HealthEvent,
    ) -> anyhow::Result<()> {
        drust_e2e::plugin::write_health_event(&self.host.state_dir(), seq, event)
    }

    async fn stop(self) -> anyhow::Result<()> {
        stop(self.plugin).await?;
        self.node.stop().await?;
        self.cp.stop().await?;
        Ok(())
    }
}

/// A process that has already exited, to stand in while the plugin is swapped.
fn spawn_placeholder() -> anyhow::Result<std::process::Child> {
    let mut child = std::process::Command::new("true").spawn()?;
    child.wait()?;
    Ok(child)
}

#[tokio::test]
async fn real_kubelet_pods_see_exactly_their_gpu_and_keep_it_across_a_kubelet_restart()
-> anyhow::Result<()> {
    let RealNode {
        cp,
        client,
        mut node,
        host,
        plugin,
        topology,
    } = RealNode::start("drust-real-node-", None).await?;
    let example = "examples/single-gpu/single-gpu.yaml";
    apply_example(&client, example).await?;
    // The claim generated for the pod, once allocated (it is deleted when the pod completes).
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let start = Instant::now();
    let claim = loop {
        let allocated = claims
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()));
        if let Some(c) = allocated {
            break c;
        }
        ensure!(
            start.elapsed() < TIMEOUT,
            "no claim allocated\n{}",
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod = wait_pod_done(&pods, "cuda-one-gpu", &node).await?;
    let log = terminated_message(&pod, "cuda").unwrap_or_default();
    eprintln!("what the container saw:\n{log}");
    ensure!(succeeded(&pod), "pod failed: {:?}\n{log}", pod.status);

    // Exactly the allocated GPU's node, the control nodes, and its UUID.
    let device = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref()?.first())
        .map(|r| r.device.clone())
        .context("allocation")?;
    let gpus = drust_e2e::plugin::fake_gpus(&topology).map_err(anyhow::Error::msg)?;
    let gpu = gpus
        .iter()
        .find(|g| g.name == device)
        .context("allocated GPU")?;
    let nodes: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix("node "))
        .collect();
    let mut expected = vec![
        format!("/dev/nvidia{} c3:{:x}", gpu.raw.minor, gpu.raw.minor),
        "/dev/nvidia-uvm ec:0".to_owned(),
        "/dev/nvidia-uvm-tools ec:1".to_owned(),
        "/dev/nvidiactl c3:ff".to_owned(),
    ];
    expected.sort();
    let mut seen: Vec<String> = nodes.iter().map(|s| (*s).to_owned()).collect();
    seen.sort();
    ensure!(
        seen == expected,
        "device nodes: {seen:?}, expected {expected:?}"
    );
    let env: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("env ")).collect();
    let want_env = [
        device_env(&device, &gpu.raw.uuid),
        "NVIDIA_VISIBLE_DEVICES=void".to_owned(),
    ];
    ensure!(
        env == want_env,
        "the environment names exactly {}: {env:?}, want {want_env:?}",
        gpu.raw.uuid
    );

    // Deleting the pod makes the kubelet unprepare: the CDI spec goes.
    let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
    let spec = host
        .cdi_root()
        .join(format!("{DRIVER}-claim_{claim_uid}.json"));
    pods.delete("cuda-one-gpu", &DeleteParams::default())
        .await?;
    let start = Instant::now();
    while spec.exists() {
        ensure!(
            start.elapsed() < TIMEOUT,
            "CDI spec still there after the pod was deleted\n{}",
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A running pod survives a kubelet restart: not restarted, not unprepared.
    let sleeper = sleeping_gpu_pod("gpu-sleeper")?;
    pods.create(&PostParams::default(), &sleeper).await?;
    let running = wait_running(&pods, "gpu-sleeper", &node).await?;
    let started = container_started(&running);
    let sleeper_uid = claim_uid_of(&running, &claims).await?;
    let sleeper_spec = host
        .cdi_root()
        .join(format!("{DRIVER}-claim_{sleeper_uid}.json"));
    ensure!(sleeper_spec.exists(), "the sleeper's CDI spec");
    ensure!(
        host.has_record(&sleeper_uid)?,
        "the sleeper's checkpoint record"
    );
    node.restart_kubelet(&cp).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = pods.get("gpu-sleeper").await?;
    ensure!(
        after.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && container_started(&after) == started
            && restarts(&after) == 0,
        "the pod kept running through the kubelet restart: {:?}",
        after.status
    );
    ensure!(
        sleeper_spec.exists() && host.has_record(&sleeper_uid)?,
        "nothing is unprepared by a kubelet restart"
    );

    // The plugin restarted while the pod runs: the pod keeps running, its claim stays
    // prepared (the checkpoint carries it over), and the kubelet registers the new process.
    stop(plugin).await?;
    let mut cmd = host.command(&host.root().join("plugin.log"), None)?;
    let plugin = PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = pods.get("gpu-sleeper").await?;
    ensure!(
        after.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && container_started(&after) == started
            && restarts(&after) == 0
            && sleeper_spec.exists()
            && host.has_record(&sleeper_uid)?,
        "the pod and its claim outlive a plugin restart: {:?}",
        after.status
    );

    // A new pod works after both restarts (on another GPU: the sleeper holds one).
    apply_example(&client, example).await?;
    let again = wait_pod_done(&pods, "cuda-one-gpu", &node).await?;
    ensure!(
        succeeded(&again),
        "a pod after the kubelet restart: {:?}",
        again.status
    );
    pods.delete("cuda-one-gpu", &DeleteParams::default())
        .await?;

    // Deleting the running pod makes the kubelet unprepare: spec and checkpoint record go.
    pods.delete("gpu-sleeper", &DeleteParams::default()).await?;
    let start = Instant::now();
    while sleeper_spec.exists() || host.has_record(&sleeper_uid)? {
        ensure!(
            start.elapsed() < TIMEOUT,
            "the sleeper's claim is still prepared after its pod was deleted\n{}",
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The plugin SIGKILLed in the middle of a pod's prepare (after writing the CDI spec,
    // before recording completion): the kubelet retries once the plugin is back, the pod ends
    // Running, and nothing is left twice.
    stop(plugin).await?;
    let fp = "prepare/after-cdi-write";
    let mut cmd = host.command(&host.root().join("plugin.log"), Some(fp))?;
    let plugin = PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?);
    pods.create(
        &PostParams::default(),
        &sleeping_gpu_pod("killed-mid-start")?,
    )
    .await?;
    expect_killed(plugin, fp, TIMEOUT).await?;
    let mut cmd = host.command(&host.root().join("plugin.log"), None)?;
    let plugin = PluginProcess(cmd.spawn().context("spawning gpu-kubelet-plugin")?);
    let started = Instant::now();
    let running = wait_running(&pods, "killed-mid-start", &node).await?;
    eprintln!(
        "plugin restarted -> the kubelet's retried prepare -> pod Running: {} ms",
        started.elapsed().as_millis()
    );
    ensure!(restarts(&running) == 0, "restarted: {:?}", running.status);
    let uid = claim_uid_of(&running, &claims).await?;
    let specs: Vec<String> = std::fs::read_dir(host.cdi_root())?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ensure!(
        specs == [format!("{DRIVER}-claim_{uid}.json")],
        "exactly the pod's CDI spec, no temp files: {specs:?}"
    );
    ensure!(host.has_record(&uid)?, "its checkpoint record");
    pods.delete("killed-mid-start", &DeleteParams::default())
        .await?;
    let start = Instant::now();
    while host.has_record(&uid)? {
        ensure!(start.elapsed() < TIMEOUT, "still prepared after deletion");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    RealNode {
        cp,
        client,
        node,
        host,
        plugin,
        topology,
    }
    .stop()
    .await
}

/// One claim with two requests (`a` and `b`, one GPU each) and a pod whose containers reference
/// them: container `a` only request `a`, `b` only `b`, and `both` the whole claim. What each
/// container sees, in device nodes and environment, is exactly its own requests' GPUs.
#[tokio::test]
async fn each_container_sees_only_the_gpus_of_the_requests_it_references() -> anyhow::Result<()> {
    let real = RealNode::start("drust-real-node-requests-", None).await?;
    let claim = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "two-requests", "namespace": "default"},
        "spec": {"devices": {"requests": [
            {"name": "a", "exactly": {"deviceClassName": "gpu.drust.dev"}},
            {"name": "b", "exactly": {"deviceClassName": "gpu.drust.dev"}},
        ]}},
    });
    let container = |name: &str, request: Option<&str>| {
        let mut reference = serde_json::json!({"name": "gpus"});
        if let Some(r) = request {
            reference["request"] = r.into();
        }
        serde_json::json!({
            "name": name,
            "image": WORKLOAD_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", SCRIPT],
            "resources": {"claims": [reference]},
        })
    };
    let pod = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "per-request", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [container("a", Some("a")), container("b", Some("b")), container("both", None)],
            "resourceClaims": [{"name": "gpus", "resourceClaimName": "two-requests"}],
        },
    });
    let yaml = format!(
        "{}---\n{}",
        serde_yaml_ng::to_string(&claim)?,
        serde_yaml_ng::to_string(&pod)?
    );
    apply_yaml(
        &real.client,
        &yaml,
        &real.host.root().join("per-request.yaml"),
    )
    .await?;
    // The allocation, read while the pod holds it (the claim is deallocated once it is done).
    let claims: Api<ResourceClaim> = Api::namespaced(real.client.clone(), "default");
    let start = Instant::now();
    let results = loop {
        let results = claims
            .get("two-requests")
            .await?
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results);
        if let Some(r) = results {
            break r;
        }
        ensure!(
            start.elapsed() < TIMEOUT,
            "claim not allocated\n{}",
            real.node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    let done = wait_pod_done(&pods, "per-request", &real.node).await?;
    ensure!(succeeded(&done), "pod failed: {:?}", done.status);
    let gpus = drust_e2e::plugin::fake_gpus(&real.topology).map_err(anyhow::Error::msg)?;
    // What a container holding `requests` must see: the device nodes and variables of their GPUs.
    let expected = |requests: &[&str]| -> anyhow::Result<(Vec<String>, Vec<String>)> {
        let mut nodes = vec![
            "/dev/nvidia-uvm ec:0".to_owned(),
            "/dev/nvidia-uvm-tools ec:1".to_owned(),
            "/dev/nvidiactl c3:ff".to_owned(),
        ];
        let mut env = vec!["NVIDIA_VISIBLE_DEVICES=void".to_owned()];
        for r in results
            .iter()
            .filter(|r| requests.contains(&r.request.as_str()))
        {
            let gpu = gpus
                .iter()
                .find(|g| g.name == r.device)
                .context("allocated GPU")?;
            nodes.push(format!(
                "/dev/nvidia{} c3:{:x}",
                gpu.raw.minor, gpu.raw.minor
            ));
            env.push(device_env(&r.device, &gpu.raw.uuid));
        }
        nodes.sort();
        env.sort();
        Ok((nodes, env))
    };
    for (name, requests) in [("a", &["a"][..]), ("b", &["b"]), ("both", &["a", "b"])] {
        let log = terminated_message(&done, name).unwrap_or_default();
        eprintln!("container {name} saw:\n{log}");
        let mut nodes: Vec<String> = log
            .lines()
            .filter_map(|l| l.strip_prefix("node "))
            .map(str::to_owned)
            .collect();
        nodes.sort();
        let env: Vec<String> = log
            .lines()
            .filter_map(|l| l.strip_prefix("env "))
            .map(str::to_owned)
            .collect();
        let (want_nodes, want_env) = expected(requests)?;
        ensure!(
            nodes == want_nodes && env == want_env,
            "container {name} (requests {requests:?}) saw nodes {nodes:?} and {env:?}, \
             want {want_nodes:?} and {want_env:?}"
        );
    }
    real.stop().await
}

/// What the CUDA-files container reports, one fact per line, in its termination message.
const DRIVER_FILES_SCRIPT: &str = r#"{ cd /usr/lib/x86_64-linux-gnu && for f in *; do if [ -L "$f" ]; then echo "link $f -> $(readlink "$f")"; else echo "file $f $(cat "$f")"; fi; done; echo "smi $(nvidia-smi)"; for b in nvidia-debugdump nvidia-persistenced nvidia-imex nvidia-imex-ctl nvidia-cuda-mps-control nvidia-cuda-mps-server; do [ -x "/usr/bin/$b" ] && echo "bin $b"; done; nvidia-imex-ctl -c /no/imexd.cfg -q >/dev/null 2>&1; echo "imex-ctl $?"; for f in /lib/firmware/nvidia/*/*; do echo "firmware $f"; done; echo "socket $(stat -c %F /run/nvidia-persistenced/socket)"; echo "ldcache $(cat /etc/drust-fake-ldcache)"; } > /dev/termination-log 2>&1; cat /dev/termination-log"#;

/// A CDI spec alone is enough for a CUDA container, with no NVIDIA runtime on the node: the
/// container sees the driver's versioned libraries (and not an older driver's, nor the host's
/// symlinks), `nvidia-smi` and the other binaries, the GSP firmware and the persistence
/// daemon's socket at their usual paths, and the hooks ran (the stand-in recorded their
/// arguments on the host and made `libcuda.so` and the linker folders in the container).
#[tokio::test]
async fn a_cdi_spec_alone_gives_a_container_the_driver_files_and_runs_the_hooks()
-> anyhow::Result<()> {
    const VERSION: &str = "570.124.06";
    let real = RealNode::start("drust-real-node-driver-", Some(VERSION)).await?;
    let pod = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "cuda-files", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "cuda",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", DRIVER_FILES_SCRIPT],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-h100"}],
        },
    });
    let example = repo_path(SINGLE_GPU);
    let template = single_gpu_template()?;
    apply_yaml(
        &real.client,
        &format!("{template}\n---\n{}", serde_yaml_ng::to_string(&pod)?),
        &example,
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    let done = wait_pod_done(&pods, "cuda-files", &real.node).await?;
    let log = terminated_message(&done, "cuda").unwrap_or_default();
    eprintln!("what the container saw:\n{log}");
    ensure!(succeeded(&done), "pod failed: {:?}\n{log}", done.status);
    let mut want: Vec<String> = drust_e2e::driver_root::LIBRARIES
        .iter()
        .map(|l| format!("file {l}.so.{VERSION} fake {l} {VERSION}"))
        .collect();
    want.push("link libcuda.so -> libcuda.so.1".into());
    want.sort();
    let mut libs: Vec<String> = log
        .lines()
        .filter(|l| l.starts_with("file ") || l.starts_with("link "))
        .map(str::to_owned)
        .collect();
    libs.sort();
    ensure!(
        libs == want,
        "the library directory: {libs:#?}, want {want:#?}"
    );
    let mut expected = vec![
        format!("smi fake nvidia-smi {VERSION}"),
        "bin nvidia-debugdump".to_owned(),
        "bin nvidia-persistenced".to_owned(),
        // The IMEX stand-ins run in the container (static): an unreadable config is status 2.
        "bin nvidia-imex".to_owned(),
        "bin nvidia-imex-ctl".to_owned(),
        "imex-ctl 2".to_owned(),
        format!("firmware /lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),
        format!("firmware /lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"),
        "socket socket".to_owned(),
        "ldcache /usr/lib/x86_64-linux-gnu".to_owned(),
    ];
    expected.retain(|l| !log.lines().any(|seen| seen == l));
    ensure!(
        expected.is_empty(),
        "the container did not see {expected:#?}"
    );

    let calls = std::fs::read_to_string(real.host.driver_root().join("hook.log"))
        .context("the hook stand-in's record")?;
    let calls: Vec<&str> = calls.lines().collect();
    ensure!(
        calls
            == [
                "create-symlinks --link libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
                "update-ldcache --folder /usr/lib/x86_64-linux-gnu",
            ],
        "hook calls: {calls:?}"
    );
    real.stop().await
}

/// Sharing and MIG on the real node (fake DGX A100, four GPUs with MIG): the `gpu-sharing`
/// example's two pods run on the same GPU, seeing the same device; the `mig` example's pod
/// sees its parent GPU's node and its two capability nodes (GPU instance and compute instance
/// access) and no other GPU; and with the plugin restarted in the partitionable strategy, a
/// `1g.10gb` placement is created at prepare and its pod sees the new MIG device.
#[tokio::test]
async fn shared_and_mig_claims_run_with_their_devices_on_the_real_node() -> anyhow::Result<()> {
    use gpu_inventory::fake::mig::capability_minor;
    let mut real = RealNode::start_on(
        "examples/topologies/dgx-a100-mig.yaml",
        "drust-real-node-mig-",
        None,
    )
    .await?;
    apply_file(&real.client, &repo_path("deploy/deviceclasses/mig.yaml")).await?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    let inventory = gpu_inventory::discover(&gpu_inventory::FakeBackend::new(
        gpu_inventory::Topology::from_file(&real.topology)?,
    ))?;
    let control = [
        "/dev/nvidia-uvm ec:0".to_owned(),
        "/dev/nvidia-uvm-tools ec:1".to_owned(),
        "/dev/nvidiactl c3:ff".to_owned(),
    ];

    // Time-sliced: both pods of the shared claim, on one GPU.
    let example = "examples/gpu-sharing/gpu-sharing.yaml";
    apply_example(&real.client, example).await?;
    let mut views = Vec::new();
    for name in ["sharer-a", "sharer-b"] {
        let pod = wait_pod_done(&pods, name, &real.node).await?;
        let log = terminated_message(&pod, "cuda").unwrap_or_default();
        ensure!(succeeded(&pod), "{name} failed: {:?}", pod.status);
        views.push(seen(&log));
    }
    let (nodes, env) = &views[0];
    ensure!(
        views[0] == views[1] && nodes.len() == 4 && env.len() == 2,
        "both sharers see the same one GPU: {views:?}"
    );
    let gpu = inventory
        .gpus
        .iter()
        .find(|g| env.contains(&device_env(&g.name, &g.raw.uuid)))
        .context("the shared GPU by its variable")?;
    let mut want = control.to_vec();
    want.push(format!(
        "/dev/nvidia{} c3:{:x}",
        gpu.raw.minor, gpu.raw.minor
    ));
    want.sort();
    ensure!(*nodes == want, "sharers' nodes {nodes:?}, want {want:?}");

    // An existing MIG device: its parent's node and its two capability nodes.
    let example = "examples/mig/mig.yaml";
    apply_example(&real.client, example).await?;
    let pod = wait_pod_done(&pods, "cuda-1g-10gb", &real.node).await?;
    let (nodes, env) = seen(&terminated_message(&pod, "cuda").unwrap_or_default());
    let mig = inventory
        .mig_devices
        .iter()
        .find(|m| {
            m.uuid
                .as_ref()
                .is_some_and(|u| env.contains(&device_env(&m.name, u)))
        })
        .with_context(|| format!("the MIG device by its variable in {env:?}"))?;
    let parent = inventory
        .gpus
        .iter()
        .find(|g| g.name == mig.parent)
        .context("MIG parent")?;
    let (gi, ci) = mig.instance_ids.context("instance ids")?;
    let minor = parent.raw.minor;
    let mut want = control.to_vec();
    want.push(format!("/dev/nvidia{minor} c3:{minor:x}"));
    for cap in [
        capability_minor(minor, gi, None),
        capability_minor(minor, gi, Some(ci)),
    ] {
        want.push(format!("/dev/nvidia-caps/nvidia-cap{cap} ed:{cap:x}"));
    }
    want.sort();
    ensure!(
        nodes == want && env.len() == 2,
        "MIG pod saw {nodes:?} {env:?}, want {want:?}"
    );

    // Dynamic MIG: a placement on GPU 3 (MIG on, no MIG devices) created at prepare.
    let placements = {
        let mut config = gpu_kubelet_plugin::Config::new(
            DRIVER,
            NODE,
            gpu_kubelet_plugin::Backend::Fake {
                topology: real.topology.clone(),
                state_dir: None,
            },
        );
        config.mig_strategy = gpu_inventory::MigStrategy::Partitionable;
        let inv = gpu_kubelet_plugin::discover(&config)?;
        gpu_kubelet_plugin::hardware::node_devices(&inv, config.mig_strategy).len()
    };
    real.restart_plugin(&["--mig-strategy", "partitionable"], placements)
        .await?;
    let gpu3 = inventory
        .gpus
        .iter()
        .find(|g| g.raw.minor == 3)
        .context("GPU 3")?;
    let yaml = format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: gpu3-1g, namespace: default}}
spec:
  spec:
    devices:
      requests:
        - name: mig
          exactly:
            deviceClassName: mig.drust.dev
            selectors:
              - cel:
                  expression: >-
                    device.attributes["gpu.drust.dev"].profile == "1g.10gb" &&
                    device.attributes["gpu.drust.dev"].parentMinor == 3
---
apiVersion: v1
kind: Pod
metadata: {{name: dynamic-mig, namespace: default}}
spec:
  restartPolicy: Never
  containers:
    - name: cuda
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command: ["/bin/sh", "-c", {script}]
      resources: {{claims: [{{name: mig}}]}}
  resourceClaims:
    - {{name: mig, resourceClaimTemplateName: gpu3-1g}}
"#,
        script = serde_json::to_string(SCRIPT)?
    );
    apply_yaml(
        &real.client,
        &yaml,
        &real.host.root().join("dynamic-mig.yaml"),
    )
    .await?;
    let pod = wait_pod_done(&pods, "dynamic-mig", &real.node).await?;
    let log = terminated_message(&pod, "cuda").unwrap_or_default();
    ensure!(
        succeeded(&pod),
        "dynamic MIG pod failed: {:?}\n{}",
        pod.status,
        real.node.log_tail()
    );
    let (nodes, env) = seen(&log);
    let minor = gpu3.raw.minor;
    let gpu_node = format!("/dev/nvidia{minor} c3:{minor:x}");
    let caps: Vec<&String> = nodes
        .iter()
        .filter(|n| n.starts_with("/dev/nvidia-caps/"))
        .collect();
    ensure!(
        nodes.contains(&gpu_node)
            && caps.len() == 2
            && nodes.len() == 6
            && env.iter().any(
                |e| e.starts_with(gpu_kubelet_plugin::claims::DEVICE_ENV_PREFIX)
                    && e.contains("=MIG-")
            ),
        "dynamic MIG pod saw {nodes:?} {env:?}"
    );
    real.stop().await
}

/// NVIDIA compatibility mode on the real node: the plugin publishes the fake DGX A100 as
/// `gpu.nvidia.com` with NVIDIA's names, the chart's NVIDIA DeviceClasses are applied, and the
/// claims of `examples/nvidia-compat` written as NVIDIA documents them run: both time-sliced
/// pods see the same GPU, whose time slice is Long while they run and Default after; the MPS
/// pair runs under one control daemon with NVIDIA's limits (50 % threads, 10 GiB pinned); and
/// each container of the MIG pair
/// sees its own MIG device, both of one parent GPU.
#[tokio::test]
async fn claims_written_for_nvidias_driver_run_on_the_real_node() -> anyhow::Result<()> {
    let real = RealNode::start_as(
        "examples/topologies/dgx-a100-mig.yaml",
        "drust-real-node-nvidia-",
        None,
        "gpu.nvidia.com",
        &[
            "--naming",
            "nvidia",
            "--mps-control-binary",
            drust_fakes::mps_control().to_str().context("utf-8 path")?,
        ],
    )
    .await?;
    drust_e2e::helm::apply_device_classes(&real.client, &["nvidiaCompatibility=true"])
        .await
        .map_err(anyhow::Error::msg)?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");

    apply_example(&real.client, "examples/nvidia-compat/timeslicing.yaml").await?;
    let mut views = Vec::new();
    for name in ["ts-ctr-a", "ts-ctr-b"] {
        let pod = wait_pod_done(&pods, name, &real.node).await?;
        ensure!(succeeded(&pod), "{name} failed: {:?}", pod.status);
        views.push(seen(&terminated_message(&pod, "ctr").unwrap_or_default()));
    }
    let (nodes, env) = &views[0];
    ensure!(
        views[0] == views[1] && nodes.len() == 4 && env.len() == 2,
        "both time-sliced pods see the same one GPU: {views:?}"
    );
    // DRUST_DEVICE_GPU_<minor>=<uuid>: NVIDIA's device name gpu-<minor>.
    let minor: u32 = env
        .iter()
        .find_map(|e| {
            e.strip_prefix("DRUST_DEVICE_GPU_")?
                .split_once('=')?
                .0
                .parse()
                .ok()
        })
        .with_context(|| format!("the GPU's variable in {env:?}"))?;
    // Set to Long at prepare, and back to Default once both pods finished and the claim was
    // unprepared.
    // The log is colored: drop the escape sequences before reading fields.
    let log = std::fs::read_to_string(real.host.root().join("plugin.log"))?;
    let mut plain = String::with_capacity(log.len());
    let mut escape = false;
    for c in log.chars() {
        match (escape, c) {
            (false, '\u{1b}') => escape = true,
            (true, 'm') => escape = false,
            (true, _) => {}
            (false, c) => plain.push(c),
        }
    }
    let set: Vec<&str> = plain
        .lines()
        .filter(|l| {
            l.contains("set the GPU's compute time slice")
                && l.contains(&format!("device=\"gpu-{minor}\""))
        })
        .collect();
    // Each prepare sets Long and each unprepare puts Default back: once, or twice when the
    // second pod started only after the first had finished and the claim was unprepared.
    ensure!(
        !set.is_empty()
            && set.len().is_multiple_of(2)
            && set
                .chunks(2)
                .all(|p| p[0].contains("slice=Long") && p[1].contains("slice=Default")),
        "time slice changes of gpu-{minor}: {set:?}"
    );
    let slices: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        real.host.state_dir().join("time-slices.json"),
    )?)?;
    ensure!(
        slices[minor.to_string()] == 0,
        "time slice of GPU {minor}: {slices}"
    );

    // MPS: both pods run (sleeping) under the claim's daemon, which has NVIDIA's limits.
    let mps = drust_e2e::manifests::on_workload_image(
        &std::fs::read_to_string(repo_path("examples/nvidia-compat/mps.yaml"))?,
        "sleep 600",
    )?;
    apply_yaml(&real.client, &mps, &real.host.root().join("mps.yaml")).await?;
    for name in ["mps-ctr-a", "mps-ctr-b"] {
        wait_running(&pods, name, &real.node).await?;
    }
    let claim: ResourceClaim = Api::namespaced(real.client.clone(), "default")
        .get("mps-gpu")
        .await?;
    let uid = claim.metadata.uid.context("claim uid")?;
    let control = std::fs::read_to_string(
        real.host
            .root()
            .join("mps")
            .join(&uid)
            .join("log/control.log"),
    )
    .context("the MPS daemon's log")?;
    for want in [
        "set_default_active_thread_percentage 50",
        "set_default_device_pinned_mem_limit 0 10240M",
    ] {
        ensure!(control.contains(want), "MPS log lacks {want:?}:\n{control}");
    }
    for name in ["mps-ctr-a", "mps-ctr-b"] {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await?;
    }

    apply_example(&real.client, "examples/nvidia-compat/mig-pair.yaml").await?;
    let pod = wait_pod_done(&pods, "mig-pair-pod", &real.node).await?;
    ensure!(succeeded(&pod), "mig-pair-pod failed: {:?}", pod.status);
    let migs: Vec<String> = ["ctr0", "ctr1"]
        .iter()
        .map(|c| {
            let (_, env) = seen(&terminated_message(&pod, c).unwrap_or_default());
            env.into_iter()
                .find(|e| e.starts_with("DRUST_DEVICE_GPU_") && e.contains("=MIG-"))
                .unwrap_or_default()
        })
        .collect();
    let parent = |e: &str| e.split("_MIG_").next().map(str::to_owned);
    ensure!(
        migs.iter().all(|m| !m.is_empty())
            && migs[0] != migs[1]
            && parent(&migs[0]) == parent(&migs[1]),
        "MIG pair containers saw {migs:?}"
    );
    real.stop().await
}

/// Fractional GPUs on the real node (issue 17): the plugin publishes with
/// `--consumable-capacity`; two pods with their own claims, a quarter share (20 GB, 25% compute)
/// and a plain 20 GB share, land on one GPU. Each container sees its own limits in its
/// environment and connects to the GPU's one MPS daemon (the fake tool from the driver root
/// stands for a CUDA client), whose log shows each client with its own limits. A third share's
/// client that raises its own memory limit to the whole GPU is held to the daemon's ceiling.
#[tokio::test]
async fn fractional_gpu_shares_run_with_their_own_limits_on_the_real_node() -> anyhow::Result<()> {
    const VERSION: &str = "570.124.06";
    let real = RealNode::start_as(
        "examples/topologies/dgx-h100.yaml",
        "drust-real-node-shares-",
        Some(VERSION),
        DRIVER,
        &[
            "--consumable-capacity",
            "true",
            "--mps-control-binary",
            drust_fakes::mps_control().to_str().context("utf-8 path")?,
        ],
    )
    .await?;
    // The driver root has the MPS tool, as a node's does; containers must not get it.
    std::fs::copy(
        drust_fakes::mps_control(),
        real.host
            .driver_root()
            .join("usr/bin/nvidia-cuda-mps-control"),
    )?;
    apply_file(
        &real.client,
        &repo_path("deploy/deviceclasses/gpu-share.yaml"),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    // What the container sees, then a client connected to the daemon; `stay` keeps it running.
    let pod = |name: &str, compute: Option<&str>, stay: bool, client_env: &str| {
        let mut requests = serde_json::json!({"memory": "20G"});
        if let Some(c) = compute {
            requests["computePercent"] = c.into();
        }
        // Each writes a segment to its /dev/shm and lists what it sees there (issue 41: the
        // shares of one GPU shared the daemon's /dev/shm, so each saw the others').
        let script = format!(
            "echo secret > /dev/shm/{name}-segment; \
             {{ env | grep -E '^(CUDA_MPS|DRUST)_' | sort | sed 's/^/env /'; }} > \
             /dev/termination-log; ls /dev/shm | sed 's/^/shm /' >> /dev/termination-log; \
             grep -o '/run/drust/shares/[^ ]*' /proc/self/mountinfo | sed 's/^/mark /' \
             >> /dev/termination-log; \
             [ -e /usr/bin/nvidia-cuda-mps-control ] && echo 'env \
             MPS_TOOL=mounted' >> /dev/termination-log; (echo fake_client_attach | \
             {client_env} /usr/local/bin/fake-cuda-client) \
             & sleep {}; exit 0",
            if stay { 600 } else { 2 }
        );
        let yaml = format!(
            r"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: default}}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu-share.drust.dev
            capacity: {{requests: {requests}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
    - name: cuda
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command: [/bin/sh, -c, {script}]
      resources: {{claims: [{{name: gpu}}]}}
  resourceClaims:
    - {{name: gpu, resourceClaimTemplateName: {name}}}
",
            script = serde_json::to_string(&script).unwrap_or_default()
        );
        yaml
    };
    apply_yaml(
        &real.client,
        &pod("quarter", Some("25"), true, ""),
        &real.host.root().join("quarter.yaml"),
    )
    .await?;
    wait_running(&pods, "quarter", &real.node).await?;
    // The quarter's segment is in its container's own /dev/shm, found through its process.
    drust_e2e::wait::until("the quarter share's segment", TIMEOUT, || async {
        let found = std::fs::read_dir("/proc")
            .map_err(|e| e.to_string())?
            .flatten()
            .any(|p| p.path().join("root/dev/shm/quarter-segment").exists());
        Ok(found.then_some(()))
    })
    .await?;
    apply_yaml(
        &real.client,
        &pod("plain", None, false, ""),
        &real.host.root().join("plain.yaml"),
    )
    .await?;
    let done = wait_pod_done(&pods, "plain", &real.node).await?;
    ensure!(succeeded(&done), "plain failed: {:?}", done.status);
    let message = terminated_message(&done, "cuda").unwrap_or_default();
    let shm: Vec<&str> = message
        .lines()
        .filter_map(|l| l.strip_prefix("shm "))
        .collect();
    ensure!(
        shm == ["plain-segment"],
        "the plain share's /dev/shm holds {shm:?}: a tenant sees only its own segments"
    );
    ensure!(
        !std::path::Path::new("/dev/shm/quarter-segment").exists(),
        "a share's segment landed in the host's /dev/shm"
    );
    // Its own share's mark alone (never the running quarter's), which the usage sampler reads
    // from the container's mount table.
    let quarter_uid = claim_uid_of(
        &pods.get("quarter").await?,
        &Api::<ResourceClaim>::namespaced(real.client.clone(), "default"),
    )
    .await?;
    let marks: Vec<&str> = message
        .lines()
        .filter_map(|l| l.strip_prefix("mark /run/drust/shares/"))
        .collect();
    ensure!(
        marks.len() == 1 && marks[0].len() == 36 && marks[0] != quarter_uid,
        "the plain share's container has the marks {marks:?} (the quarter's claim: {quarter_uid})"
    );
    let (_, env) = seen(&message);
    ensure!(
        env.iter()
            .any(|e| e == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=19456M")
            && env
                .iter()
                .any(|e| e == "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps")
            && !env
                .iter()
                .any(|e| e.starts_with("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
            && !env.iter().any(|e| e == "MPS_TOOL=mounted"),
        "the plain share's container saw {env:?} (MPS_TOOL=mounted: it had the control tool)"
    );
    // The GPU admits only its MPS server while it hosts shares (the fake NVML's state).
    let modes = || -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::from_str(&std::fs::read_to_string(
            real.host.state_dir().join("compute-modes.json"),
        )?)?)
    };
    ensure!(
        modes()?
            .as_object()
            .is_some_and(|m| m.len() == 1 && m.values().all(|v| v == "exclusiveProcess")),
        "compute modes while shares run: {}",
        modes()?
    );
    // Both on one GPU, under its one daemon, each client with its own limits.
    let gpu = env
        .iter()
        .find_map(|e| e.strip_prefix(gpu_kubelet_plugin::claims::DEVICE_ENV_PREFIX))
        .and_then(|e| e.split_once('='))
        .map(|(_, uuid)| uuid.to_ascii_lowercase())
        .with_context(|| format!("the GPU's variable in {env:?}"))?;
    let daemons: Vec<String> = std::fs::read_dir(real.host.root().join("mps"))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    ensure!(
        daemons == [gpu.clone()],
        "MPS daemons {daemons:?}, want the GPU's {gpu}"
    );
    let log = std::fs::read_to_string(
        real.host
            .root()
            .join("mps")
            .join(&gpu)
            .join("log/control.log"),
    )?;
    for want in [
        "client attached pinned=0=19456M threads=25",
        "client attached pinned=0=19456M threads=-",
    ] {
        ensure!(
            log.contains(want),
            "the daemon's log lacks {want:?}:\n{log}"
        );
    }
    // The plain share is gone (its pod finished): the quarter keeps the daemon.
    ensure!(
        real.host.root().join("mps").join(&gpu).exists(),
        "the daemon stopped while the quarter share runs"
    );
    // A tenant that raises its own limit to the whole GPU is held to the daemon's ceiling, the
    // largest share on the GPU (the fake daemon logs what holds for each client).
    apply_yaml(
        &real.client,
        &pod(
            "greedy",
            None,
            false,
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=81920M",
        ),
        &real.host.root().join("greedy.yaml"),
    )
    .await?;
    let done = wait_pod_done(&pods, "greedy", &real.node).await?;
    ensure!(succeeded(&done), "greedy failed: {:?}", done.status);
    let mut logs = String::new();
    for daemon in std::fs::read_dir(real.host.root().join("mps"))?.flatten() {
        logs += &std::fs::read_to_string(daemon.path().join("log/control.log")).unwrap_or_default();
    }
    let want = "client attached pinned=0=81920M threads=- ceiling pinned=0=19456M threads=100.0";
    ensure!(
        logs.contains(want),
        "the daemons' logs lack {want:?}:\n{logs}"
    );
    pods.delete("quarter", &DeleteParams::default()).await?;
    drust_e2e::wait::until("the last share's daemon stopped", TIMEOUT, || async {
        Ok((!real.host.root().join("mps").join(&gpu).exists()).then_some(()))
    })
    .await?;
    ensure!(
        modes()?
            .as_object()
            .is_some_and(|m| m.values().all(|v| v == "default")),
        "compute modes after the last share: {}",
        modes()?
    );
    real.stop().await
}

/// The `kernel` enforcement level on the real node: with a driver of the r615 branch (the fake
/// GPUs' topology) and cgroup v2 (this host's unified hierarchy), the published shares say
/// `shareEnforcement: kernel`, a claim selects on it, and containerd runs the plugin's CDI hook
/// for the share's container: the limit (the share's 19 GiB of `20G`) lands on the container's
/// own cgroup, which holds every process of the container, the one that dropped its whole
/// environment included, and on its pod's cgroup. Deleting the pod leaves no limit and no
/// record.
#[tokio::test]
async fn a_kernel_level_share_gets_its_memory_limit_on_the_containers_own_cgroup()
-> anyhow::Result<()> {
    let cgroup_root = drust_e2e::host::cgroup2_mount()
        .context("a cgroup v2 hierarchy is mounted (the machine's kind has one)")?;
    let dir = tempfile::tempdir()?;
    let topology = dir.path().join("dgx-h100-r615.yaml");
    drust_e2e::host::write_r615_topology(&topology)?;
    let real = RealNode::start_as(
        topology.to_str().context("utf-8 path")?,
        // Short: the daemon (outside a Pod here) binds the namespace sockets under the host
        // root, and a socket path has at most 107 bytes.
        "drust-k-",
        None,
        DRIVER,
        &[
            "--consumable-capacity",
            "true",
            "--mps-control-binary",
            drust_fakes::mps_control().to_str().context("utf-8 path")?,
            "--cgroup-root",
            &cgroup_root,
        ],
    )
    .await?;
    apply_file(
        &real.client,
        &repo_path("deploy/deviceclasses/gpu-share.yaml"),
    )
    .await?;
    // A CUDA client (the fake tool) that raises its own limits, through the pipe directory the
    // share was given; then the processes the cgroup check looks for.
    let script = "(echo fake_client_attach | CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 \
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=81920M /usr/local/bin/fake-cuda-client > /tmp/attached &); \
        (env -i /bin/sleep 601) & exec /bin/sleep 600";
    let yaml = format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: limited, namespace: default}}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu-share.drust.dev
            selectors:
              - cel: {{expression: 'device.attributes["gpu.drust.dev"].shareEnforcement == "kernel"'}}
            capacity: {{requests: {{memory: 20G}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: limited, namespace: default}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
    - name: cuda
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command: [/bin/sh, -c, {script}]
      env: [{{name: DRUST_TEST_MARKER, value: kernel-share}}]
      resources: {{claims: [{{name: gpu}}]}}
  resourceClaims:
    - {{name: gpu, resourceClaimTemplateName: limited}}
"#,
        script = serde_json::to_string(script)?
    );
    apply_yaml(&real.client, &yaml, &real.host.root().join("limited.yaml")).await?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    wait_running(&pods, "limited", &real.node).await?;

    let fake = || -> anyhow::Result<gpu_inventory::FakeBackend> {
        Ok(gpu_inventory::FakeBackend::from_file(&topology)?.with_state_dir(real.host.state_dir()))
    };
    // Two limits of the share's 19 GiB: the container's cgroup, and its pod's (which bounds all
    // of the pod's containers of the claim together).
    let limits = fake()?.memory_limits();
    ensure!(
        limits.len() == 2
            && limits
                .values()
                .all(|l| *l == gpu_inventory::MemoryLimits::share(19 << 30)),
        "memory limits set: {limits:?}"
    );
    let cgroup = limits
        .keys()
        .map(|(_, c)| c)
        .find(|c| {
            limits
                .keys()
                .any(|(_, pod)| c.parent() == Some(pod.as_path()))
        })
        .context("a container cgroup inside the pod cgroup")?;
    let pod_uid = pods.get("limited").await?.metadata.uid.context("pod UID")?;
    ensure!(
        cgroup
            .parent()
            .and_then(|p| p.file_name())
            .is_some_and(|n| n.to_string_lossy() == format!("pod{pod_uid}")),
        "the pod-level limit is on {}, not the pod's cgroup",
        cgroup.display()
    );
    // Every process in that cgroup is the container's: the one with its environment, and the
    // one that dropped it (env -i), both under the one limit.
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs"))?;
    let (mut marked, mut bare) = (0, 0);
    for pid in procs.split_whitespace() {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if environ
            .split(|b| *b == 0)
            .any(|v| v == b"DRUST_TEST_MARKER=kernel-share")
        {
            marked += 1;
        } else if environ.is_empty() && cmdline.ends_with(b"sleep\x00601\x00") {
            bare += 1;
        }
    }
    ensure!(
        marked >= 1 && bare == 1,
        "cgroup {} holds {procs:?}: {marked} with the container's environment, {bare} without any",
        cgroup.display()
    );
    // Compute: the GPU's daemon runs on MPS v3 and the share has its own namespace, the only
    // socket in the container's pipe directory; the client that raised its variables is held
    // to the namespace's limits.
    let claim_uid = claim_uid_of(
        &pods.get("limited").await?,
        &Api::<ResourceClaim>::namespaced(real.client.clone(), "default"),
    )
    .await?;
    let namespace = gpu_kubelet_plugin::mps::namespace_name(&claim_uid);
    let pid = procs
        .split_whitespace()
        .next()
        .context("a process of the container")?;
    let seen: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root/run/nvidia-mps"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ensure!(
        seen == ["control"],
        "the container's pipe directory holds {seen:?}, not its namespace's socket alone"
    );
    let daemon_log = drust_e2e::wait::until("the client attached", TIMEOUT, || async {
        let mut logs = String::new();
        for daemon in std::fs::read_dir(real.host.root().join("mps"))
            .map_err(|e| e.to_string())?
            .flatten()
        {
            logs +=
                &std::fs::read_to_string(daemon.path().join("log/control.log")).unwrap_or_default();
        }
        Ok(logs.contains("client attached").then_some(logs))
    })
    .await?;
    let want = format!(
        "client attached namespace={namespace} pinned=0=81920M threads=100 \
         ceiling pinned=19456M threads=100"
    );
    ensure!(
        daemon_log.contains("options protocol=3 multiuser=true") && daemon_log.contains(&want),
        "the daemon's log lacks v3 and {want:?}:\n{daemon_log}"
    );

    pods.delete("limited", &DeleteParams::default()).await?;
    let records = real.host.plugin_dir().join("memory-limits");
    drust_e2e::wait::until("the share unprepared", TIMEOUT, || async {
        // One directory per claim with records (beside the lock file).
        let left = std::fs::read_dir(&records)
            .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
            .unwrap_or(0);
        Ok((left == 0).then_some(()))
    })
    .await?;
    let limits = fake()?.memory_limits();
    ensure!(limits.is_empty(), "limits left after the pod: {limits:?}");
    real.stop().await
}

/// A GPU's share daemon that dies under a running share is started again where the share's
/// container looks: the container's client, cut off when the daemon goes, attaches to the new
/// daemon through the bind mount it has held since it started (had the directory been
/// recreated, the mount would show the deleted one, with no daemon behind it). The plugin
/// checks its daemons every second here.
#[tokio::test]
async fn a_share_daemon_that_dies_is_restarted_where_the_running_container_reaches_it()
-> anyhow::Result<()> {
    let real = RealNode::start_as(
        "examples/topologies/dgx-h100.yaml",
        "drust-real-node-daemon-restart-",
        Some("570.124.06"),
        DRIVER,
        &[
            "--consumable-capacity",
            "true",
            "--mps-control-binary",
            drust_fakes::mps_control().to_str().context("utf-8 path")?,
            "--stale-claim-interval-seconds",
            "1",
        ],
    )
    .await?;
    apply_file(
        &real.client,
        &repo_path("deploy/deviceclasses/gpu-share.yaml"),
    )
    .await?;
    // Attach until the daemon goes, then attach again (each try bounded) until a daemon
    // answers; report both daemons' first lines.
    let script = "echo fake_client_attach | /usr/local/bin/fake-cuda-client > /tmp/a; \
        while :; do echo fake_client_attach | /bin/busybox timeout 2 \
        /usr/local/bin/fake-cuda-client > /tmp/b; [ -s /tmp/b ] && break; sleep 0.2; done; \
        echo \"first $(head -n 1 /tmp/a)\" > /dev/termination-log; \
        echo \"second $(head -n 1 /tmp/b)\" >> /dev/termination-log";
    let yaml = format!(
        r"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: share, namespace: default}}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu-share.drust.dev
            capacity: {{requests: {{memory: 20Gi}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: share, namespace: default}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
    - name: cuda
      image: {WORKLOAD_IMAGE}
      imagePullPolicy: Never
      command: [/bin/sh, -c, {script}]
      resources: {{claims: [{{name: gpu}}]}}
  resourceClaims:
    - {{name: gpu, resourceClaimTemplateName: share}}
",
        script = serde_json::to_string(script)?
    );
    apply_yaml(&real.client, &yaml, &real.host.root().join("share.yaml")).await?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    wait_running(&pods, "share", &real.node).await?;
    let mps = real.host.root().join("mps");
    let daemon = drust_e2e::wait::until("the share's client attached", TIMEOUT, || async {
        let dirs: Vec<std::path::PathBuf> = std::fs::read_dir(&mps)
            .map_err(|e| e.to_string())?
            .flatten()
            .map(|e| e.path())
            .collect();
        Ok(dirs.into_iter().find(|d| {
            std::fs::read_to_string(d.join("log/control.log"))
                .is_ok_and(|l| l.contains("client attached"))
        }))
    })
    .await?;
    // The daemon dies (its own quit, from the host).
    let quit = std::process::Command::new(drust_fakes::mps_control())
        .env("CUDA_MPS_PIPE_DIRECTORY", daemon.join("pipe"))
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .context("stdin")
                .map_err(std::io::Error::other)?
                .write_all(b"quit\n")?;
            child.wait()
        })?;
    ensure!(quit.success(), "quit failed");
    let done = wait_pod_done(&pods, "share", &real.node).await?;
    ensure!(
        succeeded(&done),
        "the share's pod failed: {:?}",
        done.status
    );
    let message = terminated_message(&done, "cuda").unwrap_or_default();
    let pid = |which: &str| {
        message
            .lines()
            .find_map(|l| {
                l.strip_prefix(which)?
                    .strip_prefix(" attached ")?
                    .split(' ')
                    .next()
            })
            .map(str::to_owned)
    };
    ensure!(
        pid("first").is_some() && pid("second").is_some() && pid("first") != pid("second"),
        "the container's clients: {message:?}"
    );
    real.stop().await
}

/// The health of the first device in `pod`'s first container's `allocatedResourcesStatus`,
/// with its entry name and resource ID.
fn allocated_health(pod: &Pod) -> Option<(String, String, String)> {
    let status = container_status(pod)?
        .allocated_resources_status
        .as_ref()?
        .first()?;
    let resource = status.resources.as_ref()?.first()?;
    Some((
        status.name.clone(),
        resource.resource_id.clone(),
        resource.health.clone().unwrap_or_default(),
    ))
}

/// Device health through the real kubelet (KEP-4680): an XID on a running pod's GPU makes its
/// `allocatedResourcesStatus` show the device Unhealthy, and recovery shows Healthy again. The
/// pod keeps running throughout (a NoSchedule fault).
#[tokio::test]
async fn an_xid_shows_in_the_running_pods_allocated_resources_status_and_recovery_clears_it()
-> anyhow::Result<()> {
    let real = RealNode::start("drust-real-node-health-", None).await?;
    apply_yaml(
        &real.client,
        &single_gpu_template()?,
        &repo_path(SINGLE_GPU),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    pods.create(&PostParams::default(), &sleeping_gpu_pod("health-watch")?)
        .await?;
    let running = wait_running(&pods, "health-watch", &real.node).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(real.client.clone(), "default");
    let uid = claim_uid_of(&running, &claims).await?;
    let claim_name = pod_claim_name(&running)?;
    let device = allocated_device(&claims, &claim_name)
        .await?
        .context("allocated device")?;
    let gpus = drust_e2e::plugin::fake_gpus(&real.topology).map_err(anyhow::Error::msg)?;
    let gpu = gpus
        .iter()
        .find(|g| g.name == device)
        .context("allocated GPU")?;
    let want_id = format!("{DRIVER}/claim={uid}-{device}");

    // Polls the pod until its device shows `health`; returns how long that took.
    let wait_health = |health: &'static str| {
        let pods = pods.clone();
        let want_id = want_id.clone();
        async move {
            let start = Instant::now();
            loop {
                let pod = pods.get("health-watch").await?;
                let seen = allocated_health(&pod);
                if let Some((name, id, h)) = &seen
                    && h == health
                {
                    ensure!(
                        // `claim:<pod claim>` (and `/<request>` only when the container names one).
                        name == "claim:gpu" && *id == want_id,
                        "entry {name} {id}, want claim:gpu {want_id}"
                    );
                    ensure!(restarts(&pod) == 0, "the pod restarted: {:?}", pod.status);
                    return Ok::<_, anyhow::Error>(start.elapsed());
                }
                ensure!(
                    start.elapsed() < TIMEOUT,
                    "device health still {seen:?}, want {health}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let took = wait_health("Healthy").await?;
    eprintln!(
        "Healthy in the pod's status {} ms after Running",
        took.as_millis()
    );
    real.inject_health_event(
        1,
        &gpu_inventory::HealthEvent {
            gpu_uuid: gpu.raw.uuid.clone(),
            kind: gpu_inventory::HealthEventKind::Xid { code: 94 },
        },
    )?;
    let took = wait_health("Unhealthy").await?;
    eprintln!(
        "XID 94 -> Unhealthy in the pod's status: {} ms",
        took.as_millis()
    );
    real.inject_health_event(
        2,
        &gpu_inventory::HealthEvent {
            gpu_uuid: gpu.raw.uuid.clone(),
            kind: gpu_inventory::HealthEventKind::Recovered,
        },
    )?;
    let took = wait_health("Healthy").await?;
    eprintln!(
        "recovery -> Healthy in the pod's status: {} ms",
        took.as_millis()
    );
    real.stop().await
}

/// Issue 32 on the real node: two pods on two GPUs, real containers whose processes the
/// kubelet placed in its cgroups. The fake backend says the first pod's process computes on its
/// GPU and the second's only holds memory on its own; the plugin reads the real processes'
/// cgroups. After the (shortened) window only the idle pod's claim gets `GPUIdle`; `/metrics` labels
/// each GPU with its pod, claim and the container ID containerd reports in the pod's status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_idle_pod_is_told_and_metrics_name_each_pods_real_container() -> anyhow::Result<()>
{
    let http = drust_e2e::ports::free_port()?;
    let address = format!("127.0.0.1:{http}");
    let real = RealNode::start_as(
        "examples/topologies/dgx-h100.yaml",
        "drust-real-node-usage-",
        None,
        DRIVER,
        &[
            "--usage-interval-seconds",
            "1",
            "--idle-window-seconds",
            "3",
            "--usage-proc-root",
            "/proc",
            "--http-address",
            &address,
        ],
    )
    .await?;
    let result = usage_on_the_real_node(&real, http).await;
    real.stop().await?;
    result
}

/// The single-GPU example, whose first document is the `one-h100` ResourceClaimTemplate.
const SINGLE_GPU: &str = "examples/single-gpu/single-gpu.yaml";

/// The `one-h100` ResourceClaimTemplate of [`SINGLE_GPU`], without its pod.
fn single_gpu_template() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(repo_path(SINGLE_GPU))?
        .split("\n---\n")
        .next()
        .context("the example's template")?
        .to_owned())
}

async fn usage_on_the_real_node(real: &RealNode, http: u16) -> anyhow::Result<()> {
    apply_file(&real.client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    apply_yaml(
        &real.client,
        &single_gpu_template()?,
        &repo_path(SINGLE_GPU),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(real.client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(real.client.clone(), "default");
    let gpus = drust_e2e::plugin::fake_gpus(&real.topology).map_err(anyhow::Error::msg)?;
    let usage_dir = real.host.state_dir().join("usage");
    std::fs::create_dir_all(&usage_dir)?;
    // (pod, SM %, container ID, claim name, GPU index)
    let mut seen = Vec::new();
    for (name, sm) in [("busy-0", 85), ("idle-0", 0)] {
        // The claim's container is named after its pod; a sidecar holds no claim.
        let mut pod = sleeping_gpu_pod(name)?;
        let spec = pod.spec.as_mut().context("pod spec")?;
        let mut sidecar = spec.containers[0].clone();
        spec.containers[0].name = format!("{name}-cuda");
        sidecar.name = "log-shipper".into();
        sidecar.resources = None;
        spec.containers.push(sidecar);
        pods.create(&PostParams::default(), &pod).await?;
        let running = wait_running(&pods, name, &real.node).await?;
        let container = container_id(&running, &format!("{name}-cuda"))?;
        let claim = pod_claim_name(&running)?;
        let device = allocated_device(&claims, &claim)
            .await?
            .context("allocated device")?;
        let index = gpus
            .iter()
            .find(|g| g.name == device)
            .context("allocated GPU")?
            .raw
            .index;
        let pids = pids_of_container(&container)?;
        ensure!(
            !pids.is_empty(),
            "no process of pod {name}'s container {container} found"
        );
        let processes: Vec<serde_json::Value> = pids
            .iter()
            .map(|pid| serde_json::json!({"pid": pid, "usedMemoryBytes": 4u64 << 30}))
            .collect();
        let usage = serde_json::json!({"smPercent": sm, "memoryPercent": 0,
            "memoryUsedBytes": (4u64 << 30) * pids.len() as u64, "processes": processes});
        std::fs::write(usage_dir.join(format!("{index}.json")), usage.to_string())?;
        seen.push((name, sm, container, claim, index));
    }

    let (_, idle_claim) = (&seen[1].0, &seen[1].3);
    let idle_line = format!("drust_claim_idle{{namespace=\"default\",claim=\"{idle_claim}\",");
    let metrics = drust_e2e::wait::until("the idle pod's claim flagged", TIMEOUT, || async {
        let (_, body) = drust_e2e::http::get(http, "/metrics")
            .await
            .map_err(|e| e.to_string())?;
        let flagged = body
            .lines()
            .any(|l| l.starts_with(&idle_line) && l.ends_with(" 1"));
        if flagged { Ok(Some(body)) } else { Err(body) }
    })
    .await?;
    for (name, sm, container, claim, index) in &seen {
        let util = metrics
            .lines()
            .find(|l| l.starts_with(&format!("DCGM_FI_DEV_GPU_UTIL{{gpu=\"{index}\"")))
            .with_context(|| format!("GPU {index}'s utilization"))?;
        // The container's name is the kubelet's (its PodResources API), never the sidecar.
        ensure!(
            util.contains(&format!("pod=\"{name}\""))
                && util.contains(&format!("container=\"{name}-cuda\""))
                && util.contains(&format!("claim=\"{claim}\""))
                && util.ends_with(&format!(" {sm}")),
            "{util}"
        );
        let memory = metrics
            .lines()
            .find(|l| {
                l.starts_with("drust_container_gpu_memory_bytes{")
                    && l.contains(&format!("gpu=\"{index}\""))
            })
            .with_context(|| format!("GPU {index}'s container memory"))?;
        ensure!(
            memory.contains(&format!("pod=\"{name}\""))
                && memory.contains(&format!("container=\"{name}-cuda\""))
                && memory.contains(&format!("container_id=\"{container}\"")),
            "the process is attributed to the container containerd reports for {name}: {memory}"
        );
        let busy = metrics
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "drust_claim_idle{{namespace=\"default\",claim=\"{claim}\","
                ))
            })
            .context("claim idle line")?;
        ensure!(busy.ends_with(if *sm > 0 { " 0" } else { " 1" }), "{busy}");
    }

    // The kubelet's PodResources answer as our client reads it, against the kubelet's own
    // client (tests/gotools/cmd/podresourceslist) on the same kubelet: the same pods,
    // containers and devices. Timed: the plugin makes this call once per sample. Paced at
    // 50 calls/s: the kubelet refuses more than 100/s (burst 10) with ResourceExhausted.
    let socket = real.node.pod_resources_socket();
    let rounds = 20u32;
    let mut answer = Vec::new();
    let mut spent = Duration::ZERO;
    for _ in 0..rounds {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        answer = dra_kubelet::pod_resources::list(&socket, Duration::from_secs(5)).await?;
        spent += started.elapsed();
    }
    let ours_ms = spent.as_secs_f64() * 1e3 / f64::from(rounds);
    let peer = drust_gotools::go_tool("podresourceslist").map_err(anyhow::Error::msg)?;
    let out = std::process::Command::new(&peer)
        .arg("-socket")
        .arg(&socket)
        .args(["-rounds", &rounds.to_string(), "-pace", "20ms"])
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let upstream: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let sorted = |mut pods: Vec<serde_json::Value>| {
        for p in &mut pods {
            if let Some(containers) = p["containers"].as_array_mut() {
                for c in containers.iter_mut() {
                    if let Some(d) = c["devices"].as_array_mut() {
                        d.sort_by_key(|d| d.to_string());
                    }
                }
                containers.sort_by_key(|c| c["name"].to_string());
            }
        }
        pods.sort_by_key(|p| format!("{}/{}", p["namespace"], p["name"]));
        pods
    };
    let ours: Vec<serde_json::Value> = answer
        .iter()
        .map(|p| {
            serde_json::json!({"namespace": p.namespace, "name": p.name,
                "containers": p.containers.iter().map(|c| serde_json::json!({"name": c.name,
                    "devices": c.devices.iter().map(|d| serde_json::json!({
                        "claimNamespace": d.claim_namespace, "claimName": d.claim_name,
                        "driver": d.driver, "pool": d.pool, "device": d.device,
                        "shareId": d.share_id})).collect::<Vec<_>>()}))
                    .collect::<Vec<_>>()})
        })
        .collect();
    let theirs = upstream["pods"].as_array().cloned().unwrap_or_default();
    ensure!(
        sorted(ours.clone()) == sorted(theirs.clone()),
        "drust's client read {ours:#?}\nthe kubelet's client read {theirs:#?}"
    );
    let peer_ms = upstream["millisPerCall"].as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "PodResources List from the real kubelet, dial included, {} pods: drust {ours_ms:.2} ms, \
         the kubelet's client {peer_ms:.2} ms per call (ratio {:.2})",
        answer.len(),
        ours_ms / peer_ms
    );
    for (name, .., claim, _) in &seen {
        let pod = answer
            .iter()
            .find(|p| p.name == *name && p.namespace == "default")
            .with_context(|| format!("{name} in the kubelet's answer: {answer:?}"))?;
        let cuda = format!("{name}-cuda");
        let claim_holds = pod.containers.iter().any(|c| {
            c.name == cuda
                && matches!(c.devices.as_slice(), [d] if d.claim_name == *claim
                    && d.driver == DRIVER && d.pool == NODE)
        });
        let sidecar_holds_none = pod
            .containers
            .iter()
            .any(|c| c.name == "log-shipper" && c.devices.is_empty());
        ensure!(
            pod.containers.len() == 2 && claim_holds && sidecar_holds_none,
            "{name}: {:?}",
            pod.containers
        );
    }

    // Only the idle pod's claim is marked (on its device status, which the explain controller
    // relays to the pod).
    let told = drust_e2e::wait::until("a GPUIdle mark on the idle claim", TIMEOUT, || async {
        drust_e2e::claims::idle_mark(&real.client, "default", idle_claim, DRIVER)
            .await
            .map_err(|e| e.to_string())
    })
    .await?;
    ensure!(told.contains(idle_claim.as_str()), "{told}");
    let busy_claim = &seen[0].3;
    let on_busy = drust_e2e::claims::idle_mark(&real.client, "default", busy_claim, DRIVER).await?;
    ensure!(on_busy.is_none(), "the busy claim was marked: {on_busy:?}");
    for (name, ..) in &seen {
        pods.delete(name, &DeleteParams::default()).await?;
    }
    Ok(())
}
