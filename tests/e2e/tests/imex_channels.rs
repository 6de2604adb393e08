//! IMEX channels on a real node (issue 43): the plugin, given a `/proc/devices` with a
//! `235 nvidia-caps-imex-channels` line (the harness's [`NodeGroup::imex_channels`]: the host's
//! own table plus that line; no NVIDIA driver here, and 235 is free), publishes `imex-channel-0` with the binding conditions of the
//! ComputeDomain contract. The test acts as the ComputeDomain controller:
//!
//! 1. A pod with a claim of DeviceClass `imex-channel.drust.dev` and a
//!    `ComputeDomainChannelConfig` is allocated the channel but stays unbound (the scheduler
//!    holds it in PreBind and says so in a `BindingConditionsPending` event) until the test sets `IMEXDaemonReady=True` on the claim's
//!    `status.devices` entry; then it runs, and its container sees
//!    `/dev/nvidia-caps-imex-channels/channel0` as a character device of major 235, minor 0
//!    (made by the runtime from the CDI spec: checked by `stat`, never opened, since no driver
//!    backs the major), and the channel in its device metadata file. Once the pod and claim
//!    are gone, the node keeps no record or CDI spec of the claim.
//! 2. A second claim whose entry gets `IMEXDaemonFailed=True`: the scheduler deallocates it
//!    (the API server stores a claim without that allocation) and allocates again, and the pod
//!    still waits for the new allocation's readiness.
//!
//! Two paper nodes of a GB200 tray (`NodeGroup::imex_channels` on paper nodes too) publish the
//! channel with the NVLink clique their GPUs share; the DGX H100's channel has none.
//!
//! Binding conditions need `DRADeviceBindingConditions` and `DRAResourceClaimDeviceStatus`
//! (both beta and on by default in v1.36.3, `pkg/features/kube_features.go`) and
//! `allowMultipleAllocations` `DRAConsumableCapacity` (beta, on): the harness sets no gate.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use drust_e2e::cluster::{Cluster, ClusterOptions, DRIVER, FAKE_IMEX_MAJOR, NodeGroup};
use drust_e2e::images::WORKLOAD_IMAGE;
use drust_e2e::manifests::apply_yaml;
use drust_e2e::wait::until;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};

const DGX_H100: &str = "examples/topologies/dgx-h100.yaml";
/// A GB200 tray: its four GPUs share one NVLink clique.
const GB200_TRAY: &str = "examples/topologies/gb200-nvl-tray.yaml";
const TIMEOUT: Duration = Duration::from_secs(180);
const CHANNEL: &str = "imex-channel-0";

fn claim_yaml(name: &str, api_version: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: default}}
spec:
  devices:
    requests:
      - name: channel
        exactly: {{deviceClassName: imex-channel.drust.dev}}
    config:
      - requests: [channel]
        opaque:
          driver: {DRIVER}
          parameters:
            apiVersion: {api_version}
            kind: ComputeDomainChannelConfig
            domainID: domain-{name}
"
    )
}

/// The pod on `node` (the real node: paper nodes publish channels too, and run nothing).
fn pod(name: &str, claim: &str, node: &str) -> anyhow::Result<Pod> {
    let script = "stat -c '%F %t %T' /dev/nvidia-caps-imex-channels/channel0; \
        cat $(find /var/run/kubernetes.io/dra-device-attributes -name '*.json') | tr -d '\\n'; \
        echo; echo done; trap 'exit 0' TERM; sleep 3600 & wait";
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
            "containers": [{
                "name": "c",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "resources": {"claims": [{"name": "imex"}]},
            }],
            "resourceClaims": [{"name": "imex", "resourceClaimName": claim}],
        },
    }))?)
}

/// The claim's channel allocation: (pool, shareID), once allocated.
fn channel_allocation(claim: &ResourceClaim) -> Option<(String, Option<String>)> {
    drust_e2e::claims::allocation_results(claim)?
        .iter()
        .find(|r| r.device == CHANNEL && r.driver == DRIVER)
        .map(|r| (r.pool.clone(), r.share_id.clone()))
}

/// Waits for the scheduler's `BindingConditionsPending` event on `pod` (its PreBind waits for
/// the binding conditions: v1.36.3 `dynamicresources.go`), then checks the pod is unbound.
async fn held_in_prebind(events: &Api<Event>, pods: &Api<Pod>, pod: &str) -> anyhow::Result<()> {
    let selector = format!("involvedObject.name={pod},reason=BindingConditionsPending");
    until(&format!("{pod} held in PreBind"), TIMEOUT, || async {
        let list = events
            .list(&ListParams::default().fields(&selector))
            .await
            .map_err(|e| e.to_string())?;
        Ok((!list.items.is_empty()).then_some(()))
    })
    .await?;
    let p = pods.get(pod).await?;
    ensure!(
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_none(),
        "{pod} is bound while its binding conditions are pending"
    );
    Ok(())
}

/// Waits for the claim to be allocated the channel (with a share ID other than `not`), and
/// checks the pod is not bound meanwhile.
async fn allocated_unbound(
    claims: &Api<ResourceClaim>,
    pods: &Api<Pod>,
    claim: &str,
    pod: &str,
    not: Option<&Option<String>>,
) -> anyhow::Result<(String, Option<String>)> {
    let allocation = until(
        &format!("{claim} allocated the channel"),
        TIMEOUT,
        || async {
            let c = claims.get(claim).await.map_err(|e| e.to_string())?;
            Ok(channel_allocation(&c).filter(|(_, share)| Some(share) != not))
        },
    )
    .await?;
    let p = pods.get(pod).await?;
    ensure!(
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_none(),
        "{pod} is bound before its IMEX daemon is ready: {:?}",
        p.spec.as_ref().and_then(|s| s.node_name.clone())
    );
    Ok(allocation)
}

/// Sets `condition=True` on the claim's status.devices entry for the channel, as the
/// ComputeDomain controller does.
async fn set_condition(
    claims: &Api<ResourceClaim>,
    claim: &str,
    pool: &str,
    share: &Option<String>,
    condition: &str,
) -> anyhow::Result<()> {
    let c = claims.get(claim).await?;
    let mut entry = serde_json::json!({
        "driver": DRIVER,
        "pool": pool,
        "device": CHANNEL,
        "conditions": [{
            "type": condition,
            "status": "True",
            "reason": "Test",
            "message": "set by the test acting as the ComputeDomain controller",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "observedGeneration": c.metadata.generation,
        }],
    });
    if let Some(share) = share {
        entry["shareID"] = serde_json::json!(share);
    }
    claims
        .patch_status(
            claim,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"devices": [entry]}})),
        )
        .await
        .with_context(|| format!("setting {condition} on {claim}"))?;
    Ok(())
}

#[tokio::test]
async fn a_channel_pod_waits_for_its_imex_daemon_and_gets_the_channel_device() -> anyhow::Result<()>
{
    let cluster = Cluster::start(
        ClusterOptions::default()
            .real(NodeGroup::new("imex-", 1, DGX_H100).imex_channels())
            .paper(NodeGroup::new("imex-tray-", 2, GB200_TRAY).imex_channels()),
    )
    .await?;
    let client = cluster.client().clone();
    let node = cluster.real_nodes()[0].name().to_owned();

    // Published with the contract's shape.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let device = until("imex-channel-0 published", TIMEOUT, || async {
        let list = slices
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(list
            .items
            .into_iter()
            .filter(|s| s.spec.driver == DRIVER && s.spec.node_name.as_deref() == Some(&node))
            .flat_map(|s| s.spec.devices.unwrap_or_default())
            .find(|d| d.name == CHANNEL))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    let attributes = device.attributes.clone().unwrap_or_default();
    ensure!(
        attributes.get("type").and_then(|a| a.string.as_deref()) == Some("imex-channel")
            && attributes.get("channel").and_then(|a| a.int) == Some(0)
            && device.allow_multiple_allocations == Some(true)
            && device.binding_conditions == Some(vec!["IMEXDaemonReady".to_owned()])
            && device.binding_failure_conditions == Some(vec!["IMEXDaemonFailed".to_owned()]),
        "published as {device:?}"
    );

    ensure!(
        !attributes.contains_key("nvlinkClique"),
        "the DGX H100 is in no clique: {device:?}"
    );
    // Paper nodes of a GB200 tray publish the channel with the clique their GPUs share.
    for tray in ["imex-tray-0", "imex-tray-1"] {
        let slices = until(&format!("{tray}'s channel"), TIMEOUT, || async {
            let list = slices
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let mine: Vec<ResourceSlice> = list
                .items
                .into_iter()
                .filter(|s| s.spec.driver == DRIVER && s.spec.node_name.as_deref() == Some(tray))
                .collect();
            let has = mine
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .any(|d| d.name == CHANNEL);
            Ok(has.then_some(mine))
        })
        .await?;
        let devices: Vec<_> = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .collect();
        let clique = |name: &str| {
            devices
                .iter()
                .find(|d| d.name == name)
                .and_then(|d| d.attributes.as_ref()?.get("nvlinkClique")?.string.clone())
        };
        let gpu_clique = devices
            .iter()
            .find(|d| d.name != CHANNEL)
            .and_then(|d| clique(&d.name));
        ensure!(
            gpu_clique.is_some() && clique(CHANNEL) == gpu_clique,
            "{tray}: the channel carries its GPUs' clique {gpu_clique:?}: {devices:?}"
        );
    }

    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");

    // 1. Held until ready, then the channel in the container.
    apply_yaml(
        &client,
        &claim_yaml("channel-a", "gpu.drust.dev/v1alpha1"),
        Path::new("claim a"),
    )
    .await?;
    pods.create(&PostParams::default(), &pod("imex-a", "channel-a", &node)?)
        .await?;
    let (pool, share) = allocated_unbound(&claims, &pods, "channel-a", "imex-a", None)
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    held_in_prebind(&events, &pods, "imex-a").await?;
    set_condition(&claims, "channel-a", &pool, &share, "IMEXDaemonReady").await?;
    let ready_at = std::time::Instant::now();
    let log = until("imex-a's container ran", TIMEOUT, || async {
        let p = pods.get("imex-a").await.map_err(|e| e.to_string())?;
        if matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Failed" | "Succeeded")
        ) {
            return Err(format!("the pod ended: {:?}", p.status));
        }
        let log = pods
            .logs("imex-a", &LogParams::default())
            .await
            .unwrap_or_default();
        Ok(log.lines().any(|l| l == "done").then_some(log))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    // A figure for the report, not a verdict: the scheduler polls binding conditions every 5 s.
    eprintln!(
        "imex-a: ran {:?} after IMEXDaemonReady: {log}",
        ready_at.elapsed()
    );
    let mut lines = log.lines();
    // busybox's stat prints the numbers in hex.
    let want = format!("character special file {FAKE_IMEX_MAJOR:x} 0");
    ensure!(
        lines.next() == Some(want.as_str()),
        "channel0 is a character device, major {FAKE_IMEX_MAJOR}, minor 0: {log}"
    );
    let metadata = lines.next().unwrap_or_default();
    ensure!(
        metadata.contains(CHANNEL) && metadata.contains("imex-channel"),
        "the channel in the device metadata: {metadata}"
    );
    let uid = claims.get("channel-a").await?.metadata.uid.context("uid")?;
    pods.delete("imex-a", &DeleteParams::default()).await?;
    claims.delete("channel-a", &DeleteParams::default()).await?;
    let host = cluster.real_nodes()[0].host();
    until("channel-a unprepared", TIMEOUT, || async {
        let record = host.has_record(&uid).map_err(|e| e.to_string())?;
        Ok((!record && !host.claim_spec(&uid).exists()).then_some(()))
    })
    .await?;

    // 2. A failed daemon: deallocated, allocated again, still held.
    apply_yaml(
        &client,
        &claim_yaml("channel-b", "resource.nvidia.com/v1beta1"),
        Path::new("claim b"),
    )
    .await?;
    pods.create(&PostParams::default(), &pod("imex-b", "channel-b", &node)?)
        .await?;
    let (pool, share) = allocated_unbound(&claims, &pods, "channel-b", "imex-b", None)
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    held_in_prebind(&events, &pods, "imex-b").await?;
    set_condition(&claims, "channel-b", &pool, &share, "IMEXDaemonFailed").await?;
    let failed_at = std::time::Instant::now();
    // The stored claim loses that allocation (a new one has another share ID).
    let (pool, again) = allocated_unbound(&claims, &pods, "channel-b", "imex-b", Some(&share))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    eprintln!(
        "channel-b: allocated again {:?} after IMEXDaemonFailed",
        failed_at.elapsed()
    );
    let c = claims.get("channel-b").await?;
    let failed_kept = c
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .is_some_and(|d| {
            d.iter().any(|e| {
                e.conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "IMEXDaemonFailed")
            })
        });
    ensure!(
        !failed_kept,
        "the failed allocation's status went with it: {:?}",
        c.status
    );
    set_condition(&claims, "channel-b", &pool, &again, "IMEXDaemonReady").await?;
    until("imex-b runs", TIMEOUT, || async {
        let p = pods.get("imex-b").await.map_err(|e| e.to_string())?;
        Ok((p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")).then_some(()))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", cluster.log_tail()))?;
    Ok(())
}
