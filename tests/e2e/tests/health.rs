//! GPU health on a real control plane: injected faults become device taints in the
//! ResourceSlice (only on the faulty GPU's devices), the real scheduler keeps claims off a
//! tainted device, the kubelet's health stream follows, and recovery removes the taints.
//!
//! Prints the time from writing an event file to the taint (or its removal) being visible in the
//! API server, observed through a watch on ResourceSlices.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use dra_kubelet::proto::health_v1alpha1::HealthStatus;
use drust_e2e::claims::allocation_results;
use drust_e2e::kubelet::{HealthStream, Kubelet};
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::plugin::NodePlugin;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use futures::{StreamExt, TryStreamExt};
use gpu_inventory::{HealthEvent, HealthEventKind, Topology};
use gpu_kubelet_plugin::health::physical_gpu;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, PostParams, WatchEvent, WatchParams};

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const TIMEOUT: Duration = Duration::from_secs(60);
const KEY: &str = "gpu.drust.dev/unhealthy";

/// Device name -> our taint as (value, effect), over the pool's newest generation.
type Taints = BTreeMap<String, Option<(String, String)>>;

fn devices(slices: &BTreeMap<String, ResourceSlice>) -> Vec<Device> {
    let newest = slices.values().map(|s| s.spec.pool.generation).max();
    slices
        .values()
        .filter(|s| Some(s.spec.pool.generation) == newest)
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect()
}

fn taints(devices: &[Device]) -> Taints {
    devices
        .iter()
        .map(|d| {
            let ours = d
                .taints
                .iter()
                .flatten()
                .find(|t| t.key == KEY)
                .map(|t| (t.value.clone().unwrap_or_default(), t.effect.clone()));
            (d.name.clone(), ours)
        })
        .collect()
}

/// Our expected taints: `faults` maps GPU UUID to (value, effect); every device of such a GPU
/// carries it, every other device nothing.
fn expected(devices: &[Device], faults: &[(&str, &str, &str)]) -> Taints {
    devices
        .iter()
        .map(|d| {
            let gpu = physical_gpu(d);
            let t = faults
                .iter()
                .find(|(uuid, _, _)| Some(*uuid) == gpu)
                .map(|(_, v, e)| ((*v).to_owned(), (*e).to_owned()));
            (d.name.clone(), t)
        })
        .collect()
}

/// Watches our ResourceSlices from now until `pred` holds for the pool's devices, after `act`
/// (the injection) runs; returns the devices and how long after `act` the state was visible.
async fn after_until(
    api: &Api<ResourceSlice>,
    what: &str,
    act: impl FnOnce() -> anyhow::Result<()>,
    pred: impl Fn(&[Device]) -> bool,
) -> anyhow::Result<(Vec<Device>, Duration)> {
    let selector = format!("spec.nodeName={NODE},spec.driver={DRIVER}");
    let list = api.list(&ListParams::default().fields(&selector)).await?;
    let mut slices: BTreeMap<String, ResourceSlice> = list
        .items
        .into_iter()
        .map(|s| (s.metadata.name.clone().unwrap_or_default(), s))
        .collect();
    let rv = list.metadata.resource_version.unwrap_or_default();
    let mut stream = api
        .watch(&WatchParams::default().fields(&selector).timeout(290), &rv)
        .await?
        .boxed();
    let start = Instant::now();
    act()?;
    let watched = async {
        while let Some(event) = stream.try_next().await? {
            match event {
                WatchEvent::Added(s) | WatchEvent::Modified(s) => {
                    slices.insert(s.metadata.name.clone().unwrap_or_default(), s);
                }
                WatchEvent::Deleted(s) => {
                    slices.remove(s.metadata.name.as_deref().unwrap_or_default());
                }
                WatchEvent::Bookmark(_) => {}
                WatchEvent::Error(e) => bail!("watch error: {e:?}"),
            }
            let d = devices(&slices);
            if pred(&d) {
                return Ok((d, start.elapsed()));
            }
        }
        bail!("watch ended")
    };
    match tokio::time::timeout(TIMEOUT, watched).await {
        Ok(r) => r,
        Err(_) => bail!(
            "waited {TIMEOUT:?} for {what}; last seen: {:?}",
            taints(&devices(&slices))
        ),
    }
}

fn event(gpu: &str, kind: HealthEventKind) -> HealthEvent {
    HealthEvent {
        gpu_uuid: gpu.to_owned(),
        kind,
    }
}

/// Reads the health stream until every device of `gpu` (by name in `names`) has `want`.
async fn stream_until(
    stream: &mut HealthStream,
    names: &[String],
    want: HealthStatus,
) -> anyhow::Result<String> {
    let read = async {
        loop {
            let msg = stream.message().await?.context("health stream ended")?;
            let seen: BTreeMap<String, (HealthStatus, String)> = msg
                .devices
                .iter()
                .map(|d| {
                    (
                        d.device.clone().unwrap_or_default().device_name,
                        (d.health(), d.message.clone()),
                    )
                })
                .collect();
            if names
                .iter()
                .all(|n| seen.get(n).is_some_and(|(h, _)| *h == want))
            {
                return Ok::<_, anyhow::Error>(
                    seen.get(&names[0])
                        .map(|(_, m)| m.clone())
                        .unwrap_or_default(),
                );
            }
        }
    };
    tokio::time::timeout(TIMEOUT, read)
        .await
        .context("health stream did not report the change in time")?
}

#[tokio::test]
async fn gpu_faults_taint_only_their_devices_until_the_gpu_recovers() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology_path = repo_path("examples/topologies/dgx-a100-mig.yaml");
    let topology = Topology::from_file(&topology_path)?;
    let mut plugin = NodePlugin::start(&cp, DRIVER, NODE, &topology_path)?;
    plugin.wait_ready(&client, TIMEOUT).await?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());

    // GPU 0 is MIG-enabled (its MIG devices are published), GPU 4 is used whole.
    let mig_gpu = topology.gpus[0].uuid.clone();
    let whole_gpu = topology.gpus[4].uuid.clone();
    let app_gpu = topology.gpus[5].uuid.clone();

    // The kubelet registers the plugin, sees the health service and opens the stream.
    let (kubelet, info) = Kubelet::register(&plugin.registration_socket()).await?;
    ensure!(
        info.supported_versions
            .iter()
            .any(|v| v == dra_kubelet::HEALTH_SERVICE),
        "health service not advertised: {:?}",
        info.supported_versions
    );
    let mut stream = kubelet.health();
    let first = tokio::time::timeout(TIMEOUT, stream.message())
        .await
        .context("the kubelet's health stream sent nothing")??
        .context("no initial health")?;
    ensure!(
        !first.devices.is_empty()
            && first
                .devices
                .iter()
                .all(|d| d.health() == HealthStatus::Healthy),
        "all devices start healthy: {first:?}"
    );

    // 1. XID 79 (fallen off the bus) on GPU 0: NoExecute on each of its MIG devices, nothing
    //    elsewhere.
    let (devs, took) = after_until(
        &slices,
        "NoExecute taint on GPU 0's devices",
        || Ok(plugin.inject_health_event(1, &event(&mig_gpu, HealthEventKind::Xid { code: 79 }))?),
        |d| taints(d) == expected(d, &[(&mig_gpu, "xid-79", "NoExecute")]),
    )
    .await?;
    eprintln!(
        "XID 79 -> NoExecute taint visible in the API server after {} ms",
        took.as_millis()
    );
    let mig_names: Vec<String> = devs
        .iter()
        .filter(|d| physical_gpu(d) == Some(mig_gpu.as_str()))
        .map(|d| d.name.clone())
        .collect();
    ensure!(
        mig_names.len() == 7,
        "GPU 0 has 7 MIG devices: {mig_names:?}"
    );
    let message = stream_until(&mut stream, &mig_names, HealthStatus::Unhealthy).await?;
    ensure!(
        message.contains("xid-79"),
        "health message names the cause: {message}"
    );

    // 2. An application XID (13) on GPU 5 is ignored; a contained ECC error (XID 94) on GPU 4
    //    is NoSchedule. Files are consumed in order, so once 94 shows, 13 was handled.
    let (devs, took) = after_until(
        &slices,
        "NoSchedule taint on GPU 4",
        || {
            plugin.inject_health_event(2, &event(&app_gpu, HealthEventKind::Xid { code: 13 }))?;
            Ok(plugin
                .inject_health_event(3, &event(&whole_gpu, HealthEventKind::Xid { code: 94 }))?)
        },
        |d| {
            taints(d)
                == expected(
                    d,
                    &[
                        (&mig_gpu, "xid-79", "NoExecute"),
                        (&whole_gpu, "xid-94", "NoSchedule"),
                    ],
                )
        },
    )
    .await?;
    eprintln!(
        "XID 94 -> NoSchedule taint visible after {} ms",
        took.as_millis()
    );
    let whole_name = devs
        .iter()
        .find(|d| physical_gpu(d) == Some(whole_gpu.as_str()))
        .map(|d| d.name.clone())
        .context("GPU 4's device")?;

    // 3. The real scheduler does not allocate the tainted GPU to a claim that selects it.
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "wants-gpu-4"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER,
            "selectors": [{"cel": {"expression":
                format!("device.attributes[\"{DRIVER}\"].uuid == \"{whole_gpu}\"")}}]
        }}]}}
    }))?;
    claims.create(&PostParams::default(), &claim).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "on-gpu-4"},
        "spec": {
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "wants-gpu-4"}]
        }
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let (reason, message) = drust_e2e::pods::unschedulable(&pods, "on-gpu-4", TIMEOUT).await?;
    eprintln!("while GPU 4 is tainted the pod is unschedulable: {reason}: {message}");
    let c = claims.get("wants-gpu-4").await?;
    ensure!(
        c.status.and_then(|s| s.allocation).is_none(),
        "claim must not be allocated while its only device is tainted"
    );

    // 4. GPU 4 recovers: its taint goes, the pool is republished, the pod gets its GPU.
    let generation_before = devices_generation(&slices).await?;
    let (_, took) = after_until(
        &slices,
        "GPU 4's taint removed",
        || Ok(plugin.inject_health_event(4, &event(&whole_gpu, HealthEventKind::Recovered))?),
        |d| taints(d) == expected(d, &[(&mig_gpu, "xid-79", "NoExecute")]),
    )
    .await?;
    eprintln!("recovered -> taint removed after {} ms", took.as_millis());
    ensure!(
        devices_generation(&slices).await? > generation_before,
        "republished at a new generation"
    );
    let (bound, claim) =
        drust_e2e::pods::bound_with_claim(&pods, &claims, "on-gpu-4", TIMEOUT).await?;
    ensure!(bound.spec.and_then(|s| s.node_name).as_deref() == Some(NODE));
    let allocated = allocation_results(&claim).unwrap_or_default();
    ensure!(
        allocated.len() == 1 && allocated[0].device == whole_name,
        "the recovered GPU is allocated: {allocated:?}"
    );

    // 5. GPU 0 recovers: no taint of ours is left and the kubelet hears it.
    let (_, took) = after_until(
        &slices,
        "all taints removed",
        || Ok(plugin.inject_health_event(5, &event(&mig_gpu, HealthEventKind::Recovered))?),
        |d| taints(d).values().all(Option::is_none),
    )
    .await?;
    eprintln!(
        "recovered -> NoExecute taints removed after {} ms",
        took.as_millis()
    );
    stream_until(&mut stream, &mig_names, HealthStatus::Healthy).await?;

    drop(stream);
    plugin.stop().await?;
    cp.stop().await?;
    Ok(())
}

async fn devices_generation(api: &Api<ResourceSlice>) -> anyhow::Result<i64> {
    let list = api
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE},spec.driver={DRIVER}")))
        .await?;
    list.items
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .context("no slices")
}

/// Our slices' devices, by name, over the pool's newest generation.
async fn published(api: &Api<ResourceSlice>) -> anyhow::Result<Vec<Device>> {
    let slices: BTreeMap<String, ResourceSlice> = api
        .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await?
        .items
        .into_iter()
        .map(|s| (s.metadata.name.clone().unwrap_or_default(), s))
        .collect();
    Ok(devices(&slices))
}

/// A restarted plugin (the binary, SIGTERM and start again, as a crash loop or an upgrade
/// does) keeps the taint of a GPU its predecessor found unhealthy, from its first publish on:
/// it once republished the slices untainted, and the scheduler placed the next pod on the GPU
/// that had just raised XID 94. The verdicts are kept in `health.json` beside the checkpoint.
/// The same holds across a rolling-update handover to a second instance.
#[tokio::test]
async fn a_restarted_plugin_keeps_the_taints_of_gpus_still_unhealthy() -> anyhow::Result<()> {
    use drust_e2e::host::{BinaryHost, PluginProcess, stop};
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology_path = repo_path("examples/topologies/dgx-h100.yaml");
    let topology = Topology::from_file(&topology_path)?;
    let gpu = topology.gpus[2].uuid.clone();
    let host = BinaryHost::new(
        "drust-health-restart-",
        cp.kubeconfig_path(),
        &topology_path,
        DRIVER,
        NODE,
    )?;
    let log = host.root().join("plugin.log");
    let log_b = host.root().join("plugin-b.log");
    let start_as = |log: &std::path::Path, id: Option<&str>| -> anyhow::Result<PluginProcess> {
        let mut cmd = host.command(log, None)?;
        cmd.arg("--fake-state-dir").arg(host.state_dir());
        if let Some(id) = id {
            cmd.args(["--instance-id", id]);
        }
        Ok(PluginProcess(cmd.spawn()?))
    };
    let start = || start_as(&log, None);
    let tail = || std::fs::read_to_string(&log).unwrap_or_default();
    let tail_b = || std::fs::read_to_string(&log_b).unwrap_or_default();
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let want = |devices: &[Device]| expected(devices, &[(&gpu, "xid-94", "NoSchedule")]);

    let plugin = start()?;
    let began = Instant::now();
    loop {
        let devices = published(&slices).await?;
        if devices.len() == 8 {
            break;
        }
        ensure!(began.elapsed() < TIMEOUT, "not published\n{}", tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Renamed into place: the fake backend polls and must never read half a file.
    drust_e2e::plugin::write_health_event(
        &host.state_dir(),
        1,
        &event(&gpu, HealthEventKind::Xid { code: 94 }),
    )?;
    let began = Instant::now();
    loop {
        let devices = published(&slices).await?;
        if taints(&devices) == want(&devices) {
            break;
        }
        ensure!(began.elapsed() < TIMEOUT, "no taint\n{}", tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Restart: from the first publish on, and for the next 5 s, the taint stays.
    stop(plugin).await?;
    let plugin = start()?;
    // (And until the restarted plugin has said so: how soon depends on the machine's load.)
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(5)
        || !tail().contains("GPUs still unhealthy from before the restart")
    {
        let devices = published(&slices).await?;
        ensure!(
            taints(&devices) == want(&devices),
            "{:?} after the restart: {:?}\n{}",
            began.elapsed(),
            taints(&devices),
            tail()
        );
        ensure!(
            began.elapsed() < TIMEOUT,
            "the restarted plugin never said the GPUs are still unhealthy\n{}",
            tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Rolling-update handover: instance b starts beside the running one, which is then stopped
    // (SIGTERM, as the DaemonSet's surge does); b takes over and the taint never goes.
    let b = start_as(&log_b, Some("b"))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop(plugin).await?;
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(5)
        || !tail_b().contains("GPUs still unhealthy from before the restart")
    {
        let devices = published(&slices).await?;
        ensure!(
            taints(&devices) == want(&devices),
            "{:?} after the handover: {:?}\n{}",
            began.elapsed(),
            taints(&devices),
            tail_b()
        );
        ensure!(
            began.elapsed() < TIMEOUT,
            "b did not take over\n{}",
            tail_b()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop(b).await?;
    cp.stop().await?;
    Ok(())
}
