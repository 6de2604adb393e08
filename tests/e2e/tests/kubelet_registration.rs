//! The real plugin binary, on a real control plane, registered and called by the kubelet's own
//! code (v1.36.3, `tests/gotools/cmd/kubeletpeer` in watch mode): its plugin watcher finds the
//! registration socket in the registry directory, its registration operation dials it the way
//! every real kubelet does (`grpc.DialContext` on the bare path, issue 11), its DRA plugin
//! manager dials `unix:<endpoint>` and opens the health stream, and its `DRAPlugin` makes every
//! call. Then the plugin stops (the kubelet deregisters it) and starts again (it registers anew).

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use dra_kubelet::proto::{dra_v1, health_v1alpha1};
use drust_e2e::claims::allocated_claim;
use drust_e2e::host::{BinaryHost, PluginProcess, stop};
use drust_e2e::kubelet::v1_claim;
use drust_e2e::manifests::repo_path;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use drust_gotools::{KubeletPeer, PeerEvent, Service};
use prost::Message as _;

const DRIVER: &str = "gpu.drust.dev";
const NODE: &str = "gpu-node-0";
const TIMEOUT: Duration = Duration::from_secs(60);

fn start(host: &BinaryHost) -> anyhow::Result<PluginProcess> {
    let mut cmd = host.command(&host.root().join("plugin.log"), None)?;
    Ok(PluginProcess(
        cmd.spawn().context("spawning gpu-kubelet-plugin")?,
    ))
}

fn log(host: &BinaryHost) -> String {
    std::fs::read_to_string(host.root().join("plugin.log")).unwrap_or_default()
}

async fn next_event(
    events: &mut tokio::sync::broadcast::Receiver<PeerEvent>,
    what: &str,
    mut want: impl FnMut(&PeerEvent) -> bool,
) -> anyhow::Result<PeerEvent> {
    tokio::time::timeout(TIMEOUT, async {
        loop {
            let e = events.recv().await?;
            if want(&e) {
                return Ok::<_, anyhow::Error>(e);
            }
        }
    })
    .await
    .with_context(|| format!("the kubelet did not see {what} within {TIMEOUT:?}"))?
}

#[tokio::test]
async fn the_kubelets_plugin_manager_registers_the_plugin_binary_and_every_rpc_succeeds()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let client = cp.client().await?;
    cp.register_node(NODE, &[]).await?;
    let topology = repo_path("examples/topologies/dgx-h100.yaml");
    let host = BinaryHost::new(
        "drust-kubelet-",
        cp.kubeconfig_path(),
        &topology,
        DRIVER,
        NODE,
    )?;
    let names: Vec<String> =
        drust_e2e::plugin::fake_gpu_names(&topology).map_err(anyhow::Error::msg)?;
    let claim = allocated_claim(&client, "single", DRIVER, NODE, &[names[0].clone()]).await?;
    let beta = allocated_claim(&client, "beta", DRIVER, NODE, &[names[1].clone()]).await?;
    let uid = |c: &k8s_openapi::api::resource::v1::ResourceClaim| {
        c.metadata.uid.clone().unwrap_or_default()
    };

    // The kubelet's plugin manager watches the registry before the plugin starts, as on a node.
    std::fs::create_dir_all(host.registry())?;
    let kubelet = KubeletPeer::watch(&host.registry()).await?;
    let mut events = kubelet.events();
    let plugin = start(&host)?;
    let started = Instant::now();
    let registered = next_event(
        &mut events,
        "the plugin's registration",
        |e| matches!(e, PeerEvent::Registered(r) if r.driver == DRIVER),
    )
    .await
    .with_context(|| format!("plugin log:\n{}", log(&host)))?;
    let PeerEvent::Registered(registration) = registered else {
        bail!("not a registration: {registered:?}");
    };
    eprintln!(
        "plugin start -> registered by the kubelet's plugin manager: {} ms",
        started.elapsed().as_millis()
    );
    ensure!(
        registration.endpoint == host.plugin_dir().join("dra.sock").to_string_lossy(),
        "endpoint: {registration:?}"
    );
    ensure!(
        registration.services
            == [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                dra_kubelet::HEALTH_SERVICE
            ],
        "advertised services: {:?}",
        registration.services
    );

    // The health stream the kubelet opened on registration reports every GPU, healthy (its
    // first message may come before the inventory is loaded, with no devices).
    let gpus = names.len();
    let health = next_event(&mut events, "every GPU in a health message", |e| {
        let PeerEvent::Health { response, .. } = e else {
            return false;
        };
        health_v1alpha1::NodeWatchResourcesResponse::decode(response.as_slice())
            .is_ok_and(|h| h.devices.len() == gpus)
    })
    .await?;
    let PeerEvent::Health { response, .. } = health else {
        bail!("not health: {health:?}");
    };
    let health = health_v1alpha1::NodeWatchResourcesResponse::decode(response.as_slice())?;
    ensure!(
        health
            .devices
            .iter()
            .all(|d| d.health() == health_v1alpha1::HealthStatus::Healthy),
        "health: {health:?}"
    );

    // v1 prepare, with a claim that is not ours failing alone; unprepare.
    let mut stranger = v1_claim(&claim);
    stranger.uid = "00000000-0000-0000-0000-000000000000".into();
    let answer: dra_v1::NodePrepareResourcesResponse = kubelet
        .prepare(
            DRIVER,
            Service::V1,
            &dra_v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim(&claim), stranger],
            },
        )
        .await?;
    let prepared = &answer.claims[&uid(&claim)];
    ensure!(prepared.error.is_empty(), "v1 prepare: {prepared:?}");
    ensure!(
        prepared.devices[0].cdi_device_ids
            == [format!("{DRIVER}/claim={}-{}", uid(&claim), names[0])],
        "CDI IDs: {prepared:?}"
    );
    ensure!(
        !answer.claims["00000000-0000-0000-0000-000000000000"]
            .error
            .is_empty(),
        "a stale UID fails: {answer:?}"
    );
    let spec = host
        .cdi_root()
        .join(format!("{DRIVER}-claim_{}.json", uid(&claim)));
    ensure!(spec.exists(), "CDI spec {}", spec.display());
    let answer: dra_v1::NodeUnprepareResourcesResponse = kubelet
        .unprepare(
            DRIVER,
            Service::V1,
            &dra_v1::NodeUnprepareResourcesRequest {
                claims: vec![v1_claim(&claim)],
            },
        )
        .await?;
    ensure!(
        answer.claims[&uid(&claim)].error.is_empty(),
        "v1 unprepare: {answer:?}"
    );
    ensure!(!spec.exists(), "CDI spec left after unprepare");

    // The kubelet's v1beta1 path on the same plugin.
    let answer: dra_v1::NodePrepareResourcesResponse = kubelet
        .prepare(
            DRIVER,
            Service::V1beta1,
            &dra_v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim(&beta)],
            },
        )
        .await?;
    ensure!(
        answer.claims[&uid(&beta)].error.is_empty()
            && answer.claims[&uid(&beta)].devices[0].device_name == names[1],
        "v1beta1 prepare: {answer:?}"
    );
    let answer: dra_v1::NodeUnprepareResourcesResponse = kubelet
        .unprepare(
            DRIVER,
            Service::V1beta1,
            &dra_v1::NodeUnprepareResourcesRequest {
                claims: vec![v1_claim(&beta)],
            },
        )
        .await?;
    ensure!(
        answer.claims[&uid(&beta)].error.is_empty(),
        "v1beta1 unprepare: {answer:?}"
    );

    // Stopping the plugin removes its registration socket: the kubelet deregisters it.
    stop(plugin).await?;
    next_event(
        &mut events,
        "the deregistration",
        |e| matches!(e, PeerEvent::Deregistered { driver, .. } if driver == DRIVER),
    )
    .await?;

    // Started again, it is registered again and serves.
    let plugin = start(&host)?;
    next_event(
        &mut events,
        "the second registration",
        |e| matches!(e, PeerEvent::Registered(r) if r.driver == DRIVER),
    )
    .await
    .with_context(|| format!("plugin log:\n{}", log(&host)))?;
    let answer: dra_v1::NodePrepareResourcesResponse = kubelet
        .prepare(
            DRIVER,
            Service::V1,
            &dra_v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim(&claim)],
            },
        )
        .await?;
    ensure!(
        answer.claims[&uid(&claim)].error.is_empty(),
        "prepare after the restart: {answer:?}"
    );

    // Nothing failed below gRPC on either socket.
    let log = log(&host);
    ensure!(
        !log.contains("HTTP/2") && !log.contains("peer reset"),
        "transport warnings in the plugin log:\n{log}"
    );
    stop(plugin).await?;
    drop(kubelet);
    cp.stop().await?;
    Ok(())
}
