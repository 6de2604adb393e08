//! NVIDIA compatibility mode on the real control plane (issue 16). The chart rendered with
//! `nvidiaCompatibility=true` supplies NVIDIA's DeviceClasses; the plugin publishes the fake DGX
//! A100 (GPUs 0-3 in MIG mode) as `gpu.nvidia.com` with NVIDIA's device names; claims written the
//! way NVIDIA's documentation writes them (`examples/nvidia-compat`, `resource.nvidia.com/v1beta1`
//! configs, the `mig.nvidia.com` class, a `parentUUID` constraint) are allocated by the real
//! scheduler and prepared through the kubelet API: time-slicing sets the GPU's slice, MPS starts
//! the daemon with NVIDIA's limits, the MIG pair lands on one GPU. dcgm-exporter's contract is
//! checked on the slices the API server stores.

use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::claims::allocation_results;
use drust_e2e::kubelet::Kubelet;
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::fake::mig::MigState;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-nvidia";
const TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn claims_written_for_nvidias_driver_are_allocated_and_prepared() -> anyhow::Result<()> {
    // dcgm-exporter reads ResourceSlices through v1beta1, which 1.36 serves only when asked.
    let cp = ControlPlane::start(ControlPlaneOptions {
        runtime_config: vec!["resource.k8s.io/v1beta1=true".to_owned()],
        ..Default::default()
    })
    .await?;
    let result = run(&cp).await;
    cp.stop().await?;
    result
}

async fn run(cp: &ControlPlane) -> anyhow::Result<()> {
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;

    // NVIDIA's DeviceClasses, from the chart.
    let rendered = drust_e2e::helm::apply_device_classes(&client, &["nvidiaCompatibility=true"])
        .await
        .map_err(anyhow::Error::msg)?;
    let mut classes: Vec<&str> = rendered
        .iter()
        .filter_map(|c| c["metadata"]["name"].as_str())
        .collect();
    classes.sort_unstable();
    ensure!(
        classes
            == [
                "gpu.nvidia.com",
                "imex-channel.nvidia.com",
                "mig.nvidia.com"
            ],
        "DeviceClasses: {classes:?}"
    );
    ensure!(
        rendered
            .iter()
            .any(|c| c["metadata"]["name"] == "gpu.nvidia.com"
                && c["spec"]["extendedResourceName"] == "nvidia.com/gpu"),
        "gpu.nvidia.com maps nvidia.com/gpu as NVIDIA's chart does"
    );

    let topology = repo_path("examples/topologies/dgx-a100-mig.yaml");
    let mut plugin = NodePlugin::start_with(cp, DRIVER, NODE, &topology, |c| {
        c.naming = gpu_inventory::Naming::Nvidia;
    })?;
    plugin.wait_ready(&client, TIMEOUT).await?;
    dcgm_contract(&client).await?;

    let state = plugin.fake_state_dir()?;
    let mps_root = plugin.config().mps_root.clone();
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");

    // Time-slicing: the GPU's slice is set to Long (3).
    apply_file(
        &client,
        &repo_path("examples/nvidia-compat/timeslicing.yaml"),
    )
    .await?;
    let (_, claim) = drust_e2e::pods::bound_with_claim(&pods, &claims, "ts-ctr-a", TIMEOUT).await?;
    let device = allocated(&claim)?;
    ensure!(
        device.len() == 1 && device[0].starts_with("gpu-") && !device[0].contains("mig"),
        "time-sliced claim got {device:?}"
    );
    prepare(&kubelet, &claim).await?;
    let slices: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("time-slices.json"))?)?;
    let index = device[0].trim_start_matches("gpu-");
    ensure!(
        slices[index] == 3,
        "time slice of GPU {index} after prepare: {slices}"
    );

    // MPS: the claim's daemon runs with NVIDIA's limits.
    apply_file(&client, &repo_path("examples/nvidia-compat/mps.yaml")).await?;
    let (_, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "mps-ctr-a", TIMEOUT).await?;
    prepare(&kubelet, &claim).await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let log = std::fs::read_to_string(mps_root.join(&uid).join("log/control.log"))
        .context("the MPS daemon's log")?;
    for want in [
        "set_default_active_thread_percentage 50",
        "set_default_device_pinned_mem_limit 0 10240M",
    ] {
        ensure!(log.contains(want), "MPS daemon log lacks {want:?}:\n{log}");
    }

    // Two 1g.10gb MIG devices with one parent (matchAttribute on gpu.nvidia.com/parentUUID).
    apply_file(&client, &repo_path("examples/nvidia-compat/mig-pair.yaml")).await?;
    let (_, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "mig-pair-pod", TIMEOUT).await?;
    let devices = allocated(&claim)?;
    let parents: std::collections::BTreeSet<&str> = devices
        .iter()
        .map(|d| d.split("-mig-").next().unwrap_or(d))
        .collect();
    ensure!(
        devices.len() == 2
            && devices.iter().all(|d| d.contains("-mig-1g10gb-19-"))
            && parents.len() == 1,
        "MIG pair: {devices:?}"
    );
    prepare(&kubelet, &claim).await?;
    // Existing MIG devices (strategy existing): nothing was created.
    let created = MigState::load(&state.join("mig.json"))
        .map(|s| s.gpus.values().map(Vec::len).sum::<usize>())
        .unwrap_or(0);
    ensure!(
        created == 0,
        "{created} MIG devices created for existing ones"
    );
    plugin.stop().await?;
    Ok(())
}

/// The devices allocated to `claim`.
fn allocated(claim: &ResourceClaim) -> anyhow::Result<Vec<String>> {
    Ok(allocation_results(claim)
        .context("claim not allocated")?
        .iter()
        .map(|r| r.device.clone())
        .collect())
}

async fn prepare(kubelet: &Kubelet, claim: &ResourceClaim) -> anyhow::Result<()> {
    let uid = claim.metadata.uid.clone().context("uid")?;
    let answer = kubelet.prepare_v1(&[claim]).await?;
    let a = answer.claims.get(&uid).context("no answer for the claim")?;
    ensure!(a.error.is_empty(), "prepare: {}", a.error);
    Ok(())
}

/// dcgm-exporter's DRA pod mapping (`internal/pkg/transformation/dra.go`, NVIDIA/dcgm-exporter):
/// an informer on `resource.k8s.io/v1beta1` ResourceSlices of driver `gpu.nvidia.com`, devices
/// keyed by pool and device name, the string attributes `type` (`gpu` or `mig`), `uuid` of a GPU,
/// `parentUUID` and `profile` of a MIG device under `basic.attributes`. Read here the same way,
/// through v1beta1, from what the API server stores. Kubernetes 1.36 serves v1beta1 only with
/// `--runtime-config=resource.k8s.io/v1beta1=true` (the README says so).
async fn dcgm_contract(client: &kube::Client) -> anyhow::Result<()> {
    let req = http::Request::get(format!(
        "/apis/resource.k8s.io/v1beta1/resourceslices?fieldSelector=spec.driver%3D{DRIVER}"
    ))
    .body(Vec::new())?;
    let list: serde_json::Value = client.request(req).await?;
    let mut names = Vec::new();
    for s in list["items"].as_array().context("items")? {
        ensure!(
            s["spec"]["pool"]["name"] == NODE,
            "pool {}",
            s["spec"]["pool"]
        );
        for d in s["spec"]["devices"].as_array().into_iter().flatten() {
            let name = d["name"].as_str().context("device name")?;
            let string = |attr: &str| d["basic"]["attributes"][attr]["string"].as_str();
            match string("type") {
                Some("gpu") => ensure!(
                    string("uuid").is_some_and(|u| u.starts_with("GPU-")),
                    "{name}"
                ),
                Some("mig") => ensure!(
                    string("parentUUID").is_some_and(|u| u.starts_with("GPU-"))
                        && string("profile").is_some()
                        && string("uuid").is_some_and(|u| u.starts_with("MIG-")),
                    "{name}"
                ),
                other => anyhow::bail!("{name} has type {other:?}"),
            }
            names.push(name.to_owned());
        }
    }
    names.sort();
    for want in [
        "gpu-4",
        "gpu-7",
        "gpu-0-mig-1g10gb-19-0",
        "gpu-1-mig-3g40gb-9-0",
    ] {
        ensure!(
            names.iter().any(|n| n == want),
            "no device {want} in {names:?}"
        );
    }
    Ok(())
}
