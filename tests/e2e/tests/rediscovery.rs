//! Re-discovery keeps publish, prepare and health in step, on a real control plane. The claim
//! controller's devices and the health monitor's GPUs used to be fixed when the plugin took
//! over: a GPU that appeared later was published, yet every prepare of it failed as an unknown
//! device and its faults were ignored as events "for a GPU we do not publish". Now both follow
//! each new inventory before it is published: a new GPU can be prepared and is health-watched;
//! a GPU that disappears is refused for new claims while the claim prepared on it stays
//! prepared and unprepares cleanly.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use drust_e2e::claims::allocated_claim;
use drust_e2e::kubelet::{Kubelet, v1_claim};
use drust_e2e::manifests::repo_path;
use drust_e2e::plugin::{NodePlugin, fake_gpu_names, fake_host, read_checkpoint};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use gpu_inventory::{HealthEvent, HealthEventKind, Topology};
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kube::Api;
use kube::api::ListParams;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const TIMEOUT: Duration = Duration::from_secs(60);
const TAINT_KEY: &str = "gpu.drust.dev/unhealthy";

/// The devices of the node's newest pool generation.
async fn published(slices: &Api<ResourceSlice>) -> anyhow::Result<Vec<Device>> {
    let items = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE},spec.driver={DRIVER}")))
        .await?
        .items;
    let newest = items.iter().map(|s| s.spec.pool.generation).max();
    Ok(items
        .into_iter()
        .filter(|s| Some(s.spec.pool.generation) == newest)
        .flat_map(|s| s.spec.devices.unwrap_or_default())
        .collect())
}

/// Polls the published devices until `pred` holds; returns them.
async fn published_until(
    slices: &Api<ResourceSlice>,
    what: &str,
    pred: impl Fn(&[Device]) -> bool,
) -> anyhow::Result<Vec<Device>> {
    let start = Instant::now();
    loop {
        let devices = published(slices).await?;
        if pred(&devices) {
            return Ok(devices);
        }
        ensure!(
            start.elapsed() < TIMEOUT,
            "waited {TIMEOUT:?} for {what}; published: {:?}",
            devices.iter().map(|d| &d.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn write_topology(path: &Path, topology: &Topology) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_yaml_ng::to_string(topology)?)?;
    // Renamed into place: the plugin never reads half a file.
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[tokio::test]
async fn a_gpu_found_by_rediscovery_is_prepared_and_watched_and_a_lost_one_is_refused()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let full_path = repo_path("examples/topologies/dgx-h100.yaml");
    let full = Topology::from_file(&full_path)?;
    let names = fake_gpu_names(&full_path).map_err(anyhow::Error::msg)?;
    let scratch = tempfile::tempdir()?;
    let path = scratch.path().join("node.yaml");
    let mut seven = full.clone();
    let newcomer = seven.gpus.pop().context("a GPU")?;
    write_topology(&path, &seven)?;
    let (first, last) = (names[0].clone(), names[7].clone());

    let mut plugin = NodePlugin::start_with(&cp, DRIVER, NODE, &path, |c| {
        c.rediscovery_interval = Duration::from_secs(1);
        c.health_monitoring = true;
    })?;
    plugin.wait_ready(&client, TIMEOUT).await?;
    // The host side of the eighth GPU (its device node) exists before NVML reports it.
    fake_host(&plugin.config().dev_root, &full_path).map_err(anyhow::Error::msg)?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let (kubelet, _) = Kubelet::register(&plugin.registration_socket()).await?;
    let cdi_spec = |uid: &str| {
        plugin
            .config()
            .cdi_root
            .join(format!("{DRIVER}-claim_{uid}.json"))
    };

    // A claim on GPU 0, prepared while GPU 0 is there.
    let held = allocated_claim(&client, "held", DRIVER, NODE, std::slice::from_ref(&first)).await?;
    let held_uid = held.metadata.uid.clone().context("uid")?;
    let r = kubelet.prepare_v1(&[&held]).await?;
    ensure!(
        r.claims[&held_uid].error.is_empty(),
        "{:?}",
        r.claims[&held_uid]
    );

    // 1. An eighth GPU appears: published, then prepared (it used to fail as unknown).
    write_topology(&path, &full)?;
    published_until(&slices, "the new GPU published", |d| {
        d.iter().any(|d| d.name == last)
    })
    .await?;
    let newer = allocated_claim(
        &client,
        "on-newcomer",
        DRIVER,
        NODE,
        std::slice::from_ref(&last),
    )
    .await?;
    let newer_uid = newer.metadata.uid.clone().context("uid")?;
    let r = kubelet.prepare_v1(&[&newer]).await?;
    let answer = &r.claims[&newer_uid];
    ensure!(
        answer.error.is_empty(),
        "prepare of a GPU found by re-discovery: {}",
        answer.error
    );
    ensure!(cdi_spec(&newer_uid).exists());

    // 2. Its faults are watched: an XID 79 taints it (it used to be ignored).
    plugin.inject_health_event(
        1,
        &HealthEvent {
            gpu_uuid: newcomer.uuid.clone(),
            kind: HealthEventKind::Xid { code: 79 },
        },
    )?;
    published_until(&slices, "the new GPU tainted", |d| {
        d.iter().any(|d| {
            d.name == last
                && d.taints
                    .iter()
                    .flatten()
                    .any(|t| t.key == TAINT_KEY && t.effect == "NoExecute")
        })
    })
    .await?;
    let r = kubelet.unprepare_v1(vec![v1_claim(&newer)]).await?;
    ensure!(
        r.claims[&newer_uid].error.is_empty(),
        "{:?}",
        r.claims[&newer_uid]
    );

    // 3. GPU 0 disappears: unpublished, refused for a new claim by name, while the claim
    //    prepared on it stays prepared (CDI spec and checkpoint) and then unprepares cleanly.
    let mut without_first = full.clone();
    without_first.gpus.remove(0);
    // NVML numbers the GPUs it still sees from 0 (device minors stay).
    for (i, g) in without_first.gpus.iter_mut().enumerate() {
        g.index = u32::try_from(i)?;
    }
    write_topology(&path, &without_first)?;
    published_until(&slices, "GPU 0 unpublished", |d| {
        !d.is_empty() && d.iter().all(|d| d.name != first)
    })
    .await?;
    let late = allocated_claim(&client, "late", DRIVER, NODE, std::slice::from_ref(&first)).await?;
    let late_uid = late.metadata.uid.clone().context("uid")?;
    let r = kubelet.prepare_v1(&[&late]).await?;
    let refused = &r.claims[&late_uid].error;
    ensure!(
        refused.contains(&first) && refused.contains("no longer on this node"),
        "a claim for a GPU that is gone: {refused:?}"
    );
    ensure!(!cdi_spec(&late_uid).exists());
    ensure!(
        cdi_spec(&held_uid).exists(),
        "the claim prepared on the lost GPU lost its CDI spec"
    );
    let checkpoint = read_checkpoint(&plugin.config().checkpoint_path)
        .map_err(anyhow::Error::msg)?
        .to_string();
    ensure!(checkpoint.contains(&held_uid), "{checkpoint}");
    // A repeated prepare of the held claim answers from the checkpoint, as before.
    let r = kubelet.prepare_v1(&[&held]).await?;
    ensure!(
        r.claims[&held_uid].error.is_empty(),
        "{:?}",
        r.claims[&held_uid]
    );
    let r = kubelet.unprepare_v1(vec![v1_claim(&held)]).await?;
    ensure!(
        r.claims[&held_uid].error.is_empty(),
        "{:?}",
        r.claims[&held_uid]
    );
    ensure!(!cdi_spec(&held_uid).exists());
    let checkpoint = read_checkpoint(&plugin.config().checkpoint_path)
        .map_err(anyhow::Error::msg)?
        .to_string();
    ensure!(!checkpoint.contains(&held_uid), "{checkpoint}");

    plugin.stop().await?;
    cp.stop().await?;
    Ok(())
}
