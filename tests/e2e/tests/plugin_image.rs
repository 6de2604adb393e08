//! The image a user installs (issue 41): `deploy/Dockerfile` built with buildah, as written but
//! for its build stage's base image (a local Debian 12 image with Debian's Rust, made by
//! `tests/scripts/build-image.sh` from Debian's archive), pushed by tag to a registry running on
//! this machine (CNCF Distribution, from its Go module), and installed with the chart exactly as
//! the README says: `helm install ... --set image.repository=<registry>/drust/gpu-kubelet-plugin
//! --set image.tag=0.1.0`. The node's containerd pulls it from the registry (its `hosts.toml`
//! lets it speak plain HTTP to that one host), and the image runs everything the chart asks of
//! it:
//! - the node plugin: its pod is Ready, publishes the fake GPUs and a workload gets one;
//! - the explain controller (same image, another command, as a non-root user on a read-only
//!   root): Ready, and it tells a pod whose claim fits nowhere why;
//! - the CDI hook: with a driver of the r615 branch (the fake topology), the plugin copies the
//!   image's hook to the host and a `kernel`-level share's container start runs it there, which
//!   sets the share's memory limit;
//! - `chroot`: the share's GPU gets its MPS daemon in a Pod of the same image.
//!
//! The fake topology and the fake GPUs' state live in the plugin directory, which the chart
//! mounts at the host's path: the plugin (in its pod) and the hook (on the host) read the same
//! files by the same paths.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use drust_e2e::helm::helm_in;
use drust_e2e::host::BinaryHost;
use drust_e2e::node::{Node, NodeOptions};
use drust_e2e::node_pods::{
    apply_example, ready, succeeded, terminated_message, wait_pod_done, wait_running,
};
use drust_e2e::registry::Registry;
use drust_e2e::wait::until;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::{ListParams, PostParams};

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const NAMESPACE: &str = "drust-system";
const RELEASE: &str = "drust";
/// The repository and tag the README's install names.
const REPOSITORY: &str = "drust/gpu-kubelet-plugin";
const TAG: &str = "0.1.0";
const TIMEOUT: Duration = Duration::from_secs(180);

/// The pods of the release's `component`, once one is Ready.
async fn wait_ready(pods: &Api<Pod>, component: &str, node: &Node) -> anyhow::Result<Pod> {
    let selector =
        format!("app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}");
    let start = Instant::now();
    loop {
        let found = pods
            .list(&ListParams::default().labels(&selector))
            .await?
            .items;
        if let Some(pod) = found.iter().find(|p| ready(p)) {
            return Ok(pod.clone());
        }
        ensure!(
            start.elapsed() < TIMEOUT,
            "no Ready {component} pod: {:?}\n{}",
            found.iter().map(|p| &p.status).collect::<Vec<_>>(),
            node.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The image ID the kubelet reports for the pod's first container (`<repository>@sha256:...`:
/// where containerd got it).
fn image_id(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or("", |c| c.image_id.as_str())
}

#[tokio::test]
async fn the_readme_install_pulls_the_dockerfile_image_which_runs_plugin_controller_and_hook()
-> anyhow::Result<()> {
    // The image first: a cold build is the longest step, and needs no cluster.
    let registry = Registry::start().await?;
    let pushed = registry.push_plugin_image(REPOSITORY, TAG).await?;
    let repository = format!("{}/{REPOSITORY}", registry.host());

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
    node.trust_registry(&registry.host())?;

    // The host's cgroup v2 hierarchy (where the machine has one), for the `kernel` level: the
    // plugin's `--cgroup-root`, the same path in its pod (the chart mounts the host's
    // /sys/fs/cgroup with its submounts) and for the hook on the host.
    let cgroup_root = drust_e2e::host::cgroup2_mount()
        .context("a cgroup v2 hierarchy is mounted (the machine's kind has one)")?;
    ensure!(
        cgroup_root.starts_with("/sys/fs/cgroup"),
        "cgroup v2 at {cgroup_root}, outside the /sys/fs/cgroup the chart mounts"
    );

    // A DGX H100 whose driver is of the r615 branch: its GPUs partition memory per cgroup, so
    // shares get the `kernel` level, and the plugin installs its hook.
    let host_dir = tempfile::Builder::new().prefix("drust-image-").tempdir()?;
    let topology = host_dir.path().join("dgx-h100-r615.yaml");
    drust_e2e::host::write_r615_topology(&topology)?;
    let host = BinaryHost::new(
        "drust-image-node-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        NODE,
    )?
    .on_node(&node);
    host.make_device_nodes()?;
    let driver_root = node.root().join("driver-root");
    for dir in ["usr/bin", "tmp", "dev/shm"] {
        std::fs::create_dir_all(driver_root.join(dir))?;
    }
    std::fs::copy(
        drust_fakes::mps_control(),
        driver_root.join("usr/bin/nvidia-cuda-mps-control"),
    )?;
    // Where plugin pod and host see the same paths.
    let plugin_dir = node.plugin_dir(DRIVER);
    std::fs::create_dir_all(&plugin_dir)?;
    let shared_topology = plugin_dir.join("topology.yaml");
    std::fs::copy(&topology, &shared_topology)?;
    let fake_state = plugin_dir.join("fake-state");

    // helm install as the README says, with this node's paths and the registry's image.
    let helm_home = host.root().join("helm-home");
    let kubeconfig = format!("--kubeconfig={}", cp.kubeconfig_path().display());
    let sets = [
        format!("image.repository={repository}"),
        format!("image.tag={TAG}"),
        format!("host.kubeletDir={}", node.kubelet_dir().display()),
        format!("host.cdiRoot={}", node.cdi_root().display()),
        format!("host.driverRoot={}", driver_root.display()),
        format!("host.devRoot={}", host.root().display()),
        format!("host.mpsRoot={}", host.root().join("mps").display()),
        "features.consumableCapacity=true".to_owned(),
        "explainController.enabled=true".to_owned(),
        format!(
            "extraArgs={{--fake-topology={},--fake-state-dir={},--cgroup-root={cgroup_root},--claim-timeout-seconds=40,--mps-start-timeout-seconds=30}}",
            shared_topology.display(),
            fake_state.display()
        ),
    ];
    drust_e2e::helm::install_chart(
        &helm_home,
        cp.kubeconfig_path(),
        RELEASE,
        NAMESPACE,
        (address, port),
        &sets,
    )
    .await?;

    // The plugin: its pod runs the pushed image, pulled from the registry by tag.
    let system_pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let plugin = wait_ready(&system_pods, "kubelet-plugin", &node).await?;
    let image = plugin
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default();
    ensure!(image == pushed, "the plugin pod runs {image}, not {pushed}");
    ensure!(
        image_id(&plugin).starts_with(&format!("{repository}@sha256:")),
        "the plugin's image came from the registry: {}",
        image_id(&plugin)
    );
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let published: usize = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await?
        .items
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    ensure!(
        published >= 8,
        "the eight GPUs published: {published} devices"
    );

    // A workload pod gets its GPU (the example, on the local busybox image).
    apply_example(&client, "examples/single-gpu/single-gpu.yaml").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let done = wait_pod_done(&pods, "cuda-one-gpu", &node).await?;
    ensure!(
        succeeded(&done),
        "the example through the image's plugin: {:?}\n{}",
        done.status,
        terminated_message(&done, "cuda").unwrap_or_default()
    );

    // The explain controller: Ready (its caches listed), and a pod whose claim asks for a GPU
    // no node has gets its Warning event.
    let controller = wait_ready(&system_pods, "explain-controller", &node).await?;
    ensure!(
        image_id(&controller).starts_with(&format!("{repository}@sha256:")),
        "the explain controller's image: {}",
        image_id(&controller)
    );
    let impossible: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "impossible", "namespace": "default"},
        "spec": {
            "containers": [{"name": "c", "image": drust_e2e::images::WORKLOAD_IMAGE,
                            "imagePullPolicy": "Never", "command": ["true"],
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "impossible"}],
        },
    }))?;
    let template: k8s_openapi::api::resource::v1::ResourceClaimTemplate =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "impossible", "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.drust.dev",
                "selectors": [{"cel": {"expression":
                    "device.attributes[\"gpu.drust.dev\"].productName == \"NVIDIA B300\""}}],
            }}]}}},
        }))?;
    Api::<k8s_openapi::api::resource::v1::ResourceClaimTemplate>::namespaced(
        client.clone(),
        "default",
    )
    .create(&PostParams::default(), &template)
    .await?;
    pods.create(&PostParams::default(), &impossible).await?;
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    // The controller's reason (`explain_controller::REASON`; the harness does not link it).
    let explained = until("the impossible pod's explanation", TIMEOUT, || async {
        let found = events
            .list(&ListParams::default().fields("involvedObject.name=impossible"))
            .await
            .map_err(|e| e.to_string())?
            .items;
        Ok(found
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("CannotAllocateDevices")))
    })
    .await
    .with_context(|| node.log_tail())?;
    ensure!(
        explained
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("selector"),
        "the explanation names the selector: {:?}",
        explained.message
    );

    // The hook: a `kernel`-level share. containerd runs the hook the plugin copied from the
    // image to the host, which sets the share's limit (19 GiB of `20G`) on the container's
    // cgroup; the GPU's MPS daemon runs in a Pod of the image (`chroot`).
    let yaml = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: limited, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu-share.drust.dev
            selectors:
              - cel: {expression: 'device.attributes["gpu.drust.dev"].shareEnforcement == "kernel"'}
            capacity: {requests: {memory: 20G}}
"#;
    drust_e2e::manifests::apply_yaml(&client, yaml, &host.root().join("limited.yaml")).await?;
    let share: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "limited", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "cuda", "image": drust_e2e::images::WORKLOAD_IMAGE,
                            "imagePullPolicy": "Never", "command": ["/bin/sleep", "600"],
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "limited"}],
        },
    }))?;
    pods.create(&PostParams::default(), &share).await?;
    wait_running(&pods, "limited", &node)
        .await
        .with_context(|| node.pod_logs(NAMESPACE, RELEASE, 40))?;
    let hooks: Vec<String> = std::fs::read_dir(plugin_dir.join("bin"))
        .context("the plugin's hook directory on the host")?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ensure!(
        hooks.len() == 1 && hooks[0].starts_with("drust-cdi-hook-"),
        "the image's hook installed on the host: {hooks:?}"
    );
    let limits = gpu_inventory::FakeBackend::from_file(&topology)?
        .with_state_dir(fake_state.clone())
        .memory_limits();
    ensure!(
        !limits.is_empty()
            && limits
                .values()
                .all(|l| *l == gpu_inventory::MemoryLimits::share(19 << 30)),
        "the hook set the share's memory limits: {limits:?}\n{}",
        node.log_tail()
    );
    let daemons = system_pods
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| {
            p.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("mps-control-daemon-"))
        })
        .collect::<Vec<_>>();
    ensure!(
        daemons.len() == 1
            && daemons[0]
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.image.as_deref())
                == Some(pushed.as_str())
            && daemons[0].status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
        "the share's MPS daemon runs in a Pod of the image: {:?}",
        daemons
            .iter()
            .map(|p| (&p.metadata.name, &p.status))
            .collect::<Vec<_>>()
    );

    helm_in(
        Some(&helm_home),
        &["uninstall", RELEASE, "--namespace", NAMESPACE, &kubeconfig],
    )
    .await?;
    node.stop().await?;
    cp.stop().await?;
    Ok(())
}
