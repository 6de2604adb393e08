//! The whole pipe on a real control plane: the node plugin publishes the fake DGX H100, the real
//! controller-manager creates a claim from an example's ResourceClaimTemplate, the real scheduler
//! allocates a GPU and binds the pod, and we act as the kubelet over the plugin's sockets.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use drust_e2e::claims::allocation_results;
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::{NodePlugin, read_checkpoint};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::Topology;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_pod_gets_an_allocated_gpu_prepared_through_the_kubelet_api() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    eprintln!("control plane up: {}", cp.timings());
    let client = cp.client().await?;
    let node = cp
        .register_node(NODE, &[("nvidia.com/gpu.present", "true")])
        .await?;

    // 1. The plugin publishes the fake DGX H100 as one slice of one pool named after the node.
    let topology_path = repo_path("examples/topologies/dgx-h100.yaml");
    let topology = Topology::from_file(&topology_path)?;
    let mut plugin = NodePlugin::start(&cp, DRIVER, NODE, &topology_path)?;
    let slices = plugin.wait_ready(&client, TIMEOUT).await?;
    ensure!(
        slices.len() == 1,
        "one slice for 8 GPUs, got {}",
        slices.len()
    );
    let slice = &slices[0];
    let pool = &slice.spec.pool;
    assert_eq!(
        (
            pool.name.as_str(),
            pool.generation,
            pool.resource_slice_count
        ),
        (NODE, 1, 1)
    );
    assert_eq!(slice.spec.node_name.as_deref(), Some(NODE));
    let owner = &slice
        .metadata
        .owner_references
        .as_ref()
        .context("no owner")?[0];
    assert_eq!(
        (owner.kind.as_str(), &owner.uid),
        ("Node", &node.metadata.uid.clone().unwrap_or_default())
    );
    let inventory = gpu_kubelet_plugin::discover(plugin.config())?;
    let name_of = |uuid: &str| {
        inventory
            .gpus
            .iter()
            .find(|g| g.raw.uuid == uuid)
            .map(|g| g.name.clone())
    };
    let devices = slice.spec.devices.as_ref().context("no devices")?;
    assert_eq!(devices.len(), 8);
    for (device, gpu) in devices.iter().zip(&topology.gpus) {
        let attrs = device.attributes.as_ref().context("no attributes")?;
        let s = |k: &str| attrs.get(k).and_then(|a| a.string.clone());
        let i = |k: &str| attrs.get(k).and_then(|a| a.int);
        let v = |k: &str| attrs.get(k).and_then(|a| a.version.clone());
        assert_eq!(Some(device.name.clone()), name_of(&gpu.uuid));
        assert_eq!(s("type").as_deref(), Some("gpu"));
        assert_eq!(s("uuid"), Some(gpu.uuid.clone()));
        assert_eq!(s("productName").as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(s("brand").as_deref(), Some("Nvidia"));
        assert_eq!(s("architecture").as_deref(), Some("Hopper"));
        assert_eq!(v("cudaComputeCapability").as_deref(), Some("9.0.0"));
        assert_eq!(v("driverVersion").as_deref(), Some("570.124.6"));
        let want_bus = format!("0000:{}", &gpu.pci_bus_id[9..]).to_lowercase();
        assert_eq!(s("resource.kubernetes.io/pciBusID"), Some(want_bus));
        assert_eq!(
            i("resource.kubernetes.io/numaNode"),
            Some(if gpu.index < 4 { 0 } else { 1 })
        );
        let memory = &device.capacity.as_ref().context("no capacity")?["memory"]
            .value
            .0;
        assert_eq!(memory, "81559Mi");
    }

    // 2. Republishing the same inventory writes nothing.
    let publisher =
        gpu_kubelet_plugin::publisher::SlicePublisher::new(client.clone(), DRIVER, NODE);
    let same: Vec<_> = inventory.gpus.iter().map(|g| g.device()).collect();
    let outcome = publisher.publish(&same).await?;
    assert_eq!(
        outcome,
        gpu_kubelet_plugin::publisher::PublishOutcome::Unchanged { generation: 1 }
    );
    let again = Api::<ResourceSlice>::all(client.clone())
        .get(slice.metadata.name.as_deref().unwrap_or_default())
        .await?;
    assert_eq!(
        again.metadata.resource_version,
        slice.metadata.resource_version
    );

    // 3. DeviceClass and example pod: the real controller-manager and scheduler do the rest.
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    let scheduling = Instant::now();
    apply_file(&client, &repo_path("examples/single-gpu/single-gpu.yaml")).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (pod, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "cuda-one-gpu", TIMEOUT).await?;
    eprintln!(
        "claim allocated and pod bound in {} ms",
        scheduling.elapsed().as_millis()
    );
    assert_eq!(
        pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(NODE)
    );
    let results = allocation_results(&claim).context("claim has no allocation results")?;
    assert_eq!(results.len(), 1);
    let allocated = &results[0];
    assert_eq!(
        (
            allocated.driver.as_str(),
            allocated.pool.as_str(),
            allocated.request.as_str()
        ),
        (DRIVER, NODE, "gpu")
    );
    let gpu = topology
        .gpus
        .iter()
        .find(|g| name_of(&g.uuid).as_deref() == Some(allocated.device.as_str()))
        .context("allocated device is not in the topology")?;

    // 4. Registration, as the kubelet's plugin watcher does it.
    let (kubelet, info) = Kubelet::register(&plugin.registration_socket()).await?;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(info.endpoint, plugin.dra_socket().to_string_lossy());
    // Health monitoring is on by default, so the health service follows the DRAPlugin versions.
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ]
    );

    // 5. Prepare (v1): CDI device ID, CDI spec file, checkpoint entry.
    let uid = claim.metadata.uid.clone().context("claim has no uid")?;
    let resp = kubelet.prepare_v1(&[&claim]).await?;
    let prepared = &resp.claims[&uid];
    assert_eq!(prepared.error, "");
    assert_eq!(prepared.devices.len(), 1);
    let device = &prepared.devices[0];
    let cdi_id = format!("{DRIVER}/claim={uid}-{}", allocated.device);
    assert_eq!(device.cdi_device_ids, vec![cdi_id.clone()]);
    assert_eq!(
        (device.pool_name.as_str(), device.device_name.as_str()),
        (NODE, allocated.device.as_str())
    );
    assert_eq!(device.request_names, ["gpu"]);

    let cdi_root = &plugin.config().cdi_root;
    let spec_path = cdi_root.join(format!("{DRIVER}-claim_{uid}.json"));
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec_path)?)?;
    assert_eq!(spec["kind"], format!("{DRIVER}/claim"));
    assert_eq!(
        spec["devices"][0]["name"],
        format!("{uid}-{}", allocated.device)
    );
    assert_eq!(
        spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
        format!("/dev/nvidia{}", gpu.minor)
    );
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        gpu_kubelet_plugin::claims::device_env(&allocated.device, &gpu.uuid)
    );
    assert_eq!(
        spec["containerEdits"]["env"][0],
        "NVIDIA_VISIBLE_DEVICES=void"
    );
    let checkpoint =
        read_checkpoint(&plugin.config().checkpoint_path).map_err(anyhow::Error::msg)?;
    let record = &checkpoint["claims"][&uid];
    assert_eq!(record["state"], "PrepareCompleted");
    assert_eq!(
        record["devices"][0]["deviceName"],
        allocated.device.as_str()
    );
    assert_eq!(record["devices"][0]["uuid"], gpu.uuid.as_str());

    // 6. v1beta1 and a repeated v1 prepare give the same answer; a stale UID fails alone.
    let beta = kubelet.prepare_v1beta1(&[&claim]).await?;
    assert_eq!(
        beta.claims[&uid].devices[0].cdi_device_ids,
        vec![cdi_id.clone()]
    );
    let mut stale = claim.clone();
    stale.metadata.uid = Some("00000000-0000-0000-0000-000000000000".into());
    let resp = kubelet.prepare_v1(&[&claim, &stale]).await?;
    assert_eq!(resp.claims[&uid].devices, prepared.devices);
    let stale_error = &resp.claims["00000000-0000-0000-0000-000000000000"].error;
    assert!(stale_error.contains("metadata.uid"), "{stale_error}");

    // 7. Unprepare removes the spec and the checkpoint entry; unknown claims succeed.
    let resp = kubelet
        .unprepare_v1(vec![v1_claim(&claim), v1_claim(&stale)])
        .await?;
    assert!(resp.claims.values().all(|r| r.error.is_empty()), "{resp:?}");
    assert!(!spec_path.exists(), "CDI spec left behind");
    let checkpoint =
        read_checkpoint(&plugin.config().checkpoint_path).map_err(anyhow::Error::msg)?;
    assert_eq!(checkpoint["claims"], serde_json::json!({}));
    assert_eq!(
        std::fs::read_dir(cdi_root)?.count(),
        0,
        "stray files in the CDI root"
    );

    // 8. A selector no device satisfies: the pod stays Pending with the scheduler's reason.
    apply_file(
        &client,
        &repo_path("examples/unsatisfiable/unsatisfiable.yaml"),
    )
    .await?;
    let reason = drust_e2e::pods::unschedulable(&pods, "cuda-200gi", TIMEOUT).await?;
    eprintln!("unschedulable: {reason:?}");
    assert_eq!(reason.0, "Unschedulable");
    assert!(
        reason.1.contains("cannot allocate all claims"),
        "{}",
        reason.1
    );

    let _: Api<Node> = Api::all(client);
    plugin.stop().await?;
    cp.stop().await?;
    Ok(())
}
