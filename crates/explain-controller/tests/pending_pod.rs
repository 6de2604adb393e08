//! The explain controller on the real control plane (v1.36.3), running as the ServiceAccount
//! and with exactly the RBAC the chart renders for it (`explainController.enabled=true`): a pod
//! the real scheduler leaves Unschedulable gets a Warning event with the explanation within
//! seconds, once (re-explaining every second publishes nothing new); a pod that fits gets none.
//! Its HTTP endpoint, on the port and with the probes the chart renders: ready once its caches
//! are filled, and its counters say what it did. A pod whose claim the scheduler allocates as
//! two shares of GPUs (which the node plugin refuses at prepare) gets an event saying so.

use std::time::{Duration, Instant};

mod support;

use anyhow::ensure;
use drust_e2e::manifests::{apply_file, repo_path};
use drust_e2e::pods::unschedulable;
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_pod_gets_one_event_naming_the_stage() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = run(&cp).await;
    cp.stop().await?;
    result
}

async fn events_on(client: &kube::Client, pod: &str) -> anyhow::Result<Vec<Event>> {
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
                && e.reporting_controller.as_deref() == Some("drust-explain-controller")
        })
        .collect())
}

async fn run(cp: &ControlPlane) -> anyhow::Result<()> {
    cp.register_node("gpu-node-0", &[]).await?;
    let client = cp.client().await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    support::create_slices(&client, "gpu-node-0").await?;

    // Off by default: the chart renders no controller.
    let default = drust_e2e::helm::template("drust", support::NAMESPACE, &[]).await?;
    ensure!(
        !default.contains("explain-controller"),
        "the controller is off by default"
    );

    // The chart's own objects for the controller (its Deployment needs a node to run on: the
    // binary runs here instead, with the Deployment's arguments and the ServiceAccount's token).
    let controller = support::start(cp, &["explainController.resync=1s"]).await?;
    let outcome = async {
        ready(&controller).await?;
        check(&client).await?;
        counted(&controller).await
    }
    .await;
    if outcome.is_err() {
        eprintln!(
            "controller log:\n{}",
            std::fs::read_to_string(controller.log()).unwrap_or_default()
        );
    }
    outcome
}

/// `/readyz` answers 200 within seconds (the caches filled); `/healthz` too.
async fn ready(controller: &support::Controller) -> anyhow::Result<()> {
    drust_e2e::wait::until("the controller ready", Duration::from_secs(30), || async {
        match drust_e2e::http::get(controller.http, "/readyz").await {
            Ok((200, _)) => Ok(Some(())),
            Ok((status, body)) => Err(format!("/readyz answered {status}: {body}")),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    let (status, body) = drust_e2e::http::get(controller.http, "/healthz").await?;
    ensure!(status == 200 && body == "ok", "/healthz: {status} {body}");
    Ok(())
}

/// `/metrics` counts the one event and the explanations not published again.
async fn counted(controller: &support::Controller) -> anyhow::Result<()> {
    let (status, metrics) = drust_e2e::http::get(controller.http, "/metrics").await?;
    ensure!(status == 200, "/metrics answered {status}");
    let value = |name: &str| drust_e2e::http::sample(&metrics, name).unwrap_or(-1.0);
    ensure!(
        value("drust_explain_events_total") == 1.0
            && value("drust_explain_caches_ready") == 1.0
            && value("drust_explain_errors_total") == 0.0
            && value("drust_explain_deduplicated_total") >= 1.0
            && value("drust_explain_reconciles_total") >= 2.0,
        "{metrics}"
    );
    Ok(())
}

async fn check(client: &kube::Client) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    apply_file(
        client,
        &repo_path("examples/unsatisfiable/unsatisfiable.yaml"),
    )
    .await?;
    unschedulable(&pods, "cuda-200gi", Duration::from_secs(60)).await?;
    let started = Instant::now();
    let event =
        drust_e2e::wait::until("the explanation event", Duration::from_secs(30), || async {
            Ok(events_on(client, "cuda-200gi")
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .next())
        })
        .await?;
    eprintln!("event after {:?}", started.elapsed());
    ensure!(event.type_.as_deref() == Some("Warning"), "{event:?}");
    ensure!(
        event.reason.as_deref() == Some("CannotAllocateDevices"),
        "{event:?}"
    );
    let note = event.note.clone().unwrap_or_default();
    ensure!(
        note.starts_with("DRA claims fit on none of 1 node (dractl explain pod for details). 1 node (gpu-node-0): claim default/cuda-200gi-gpu-")
            && note.contains(", request gpu: 0 of 8 devices match the request's selectors, the request needs 1 (`device.capacity[\"gpu.drust.dev\"].memory.compareTo(quantity(\"200Gi\")) >= 0` removed 8)."),
        "{note}"
    );
    ensure!(
        event.reporting_instance.as_deref() == Some("explain-controller-test"),
        "{event:?}"
    );

    // Explained again every second (resync=1s): the same explanation is not published again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let events = events_on(client, "cuda-200gi").await?;
    ensure!(events.len() == 1, "one event, got {}", events.len());
    Ok(())
}

/// A claim of two shares smaller than a GPU (`count: 2` on the share class): the real scheduler
/// allocates it and binds the pod, and the node plugin would refuse it at prepare forever. The
/// controller puts a Warning event on the claim and on the pod, naming the refusal, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_two_shares_gets_an_event_before_its_pod_waits_at_prepare() -> anyhow::Result<()>
{
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = async {
        cp.register_node("gpu-node-0", &[]).await?;
        let client = cp.client().await?;
        apply_file(&client, &repo_path("deploy/deviceclasses/gpu-share.yaml")).await?;
        support::create_slices_of(&client, "gpu-node-0", "dgx-a100-mig-shares.yaml").await?;
        let controller = support::start(&cp, &["explainController.resync=1s"]).await?;
        ready(&controller).await?;
        let manifest = std::env::temp_dir().join(format!("two-shares-{}.yaml", std::process::id()));
        std::fs::write(
            &manifest,
            "apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: two-shares, namespace: default}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu-share.drust.dev
          count: 2
          capacity: {requests: {memory: 10Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: two-shares, namespace: default}
spec:
  containers: [{name: c, image: busybox, resources: {claims: [{name: gpu}]}}]
  resourceClaims: [{name: gpu, resourceClaimName: two-shares}]
",
        )?;
        apply_file(&client, &manifest).await?;
        let _ = std::fs::remove_file(&manifest);
        for object in ["two-shares"] {
            let events = drust_e2e::wait::until(
                "the refusal events on the claim and the pod",
                Duration::from_secs(60),
                || async {
                    let events = events_on(&client, object).await.map_err(|e| e.to_string())?;
                    Ok((events.len() >= 2).then_some(events))
                },
            )
            .await?;
            let kinds: Vec<&str> = events
                .iter()
                .filter_map(|e| e.regarding.as_ref()?.kind.as_deref())
                .collect();
            ensure!(
                kinds.contains(&"ResourceClaim") && kinds.contains(&"Pod"),
                "{events:?}"
            );
            for event in &events {
                let note = event.note.clone().unwrap_or_default();
                ensure!(
                    event.reason.as_deref() == Some("DevicesWillNotBePrepared")
                        && note.starts_with("Claim default/two-shares is allocated, but 2 shares smaller than a GPU in one claim")
                        && note.contains("prepares at most one per claim"),
                    "{event:?}"
                );
            }
        }
        // Checked again every second: published once.
        tokio::time::sleep(Duration::from_secs(3)).await;
        ensure!(events_on(&client, "two-shares").await?.len() == 2);
        Ok(())
    }
    .await;
    cp.stop().await?;
    result
}

/// Issue 41, defect 8: the kubelet plugin no longer writes events about pods (nothing can tie
/// such an event to the pod's node); it marks an idle claim with a `GPUIdle` condition on the
/// claim's device status, which the API server lets only the plugin of the claim's node write.
/// The controller, run as the chart runs it (`--idle-driver=gpu.drust.dev`), relays the mark to
/// the pod the claim is reserved for as a Warning event, once per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_idle_mark_on_a_claim_reaches_its_pod() -> anyhow::Result<()> {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = async {
        cp.register_node("gpu-node-0", &[]).await?;
        let client = cp.client().await?;
        apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
        support::create_slices(&client, "gpu-node-0").await?;
        let controller = support::start(&cp, &["explainController.resync=1s"]).await?;
        ready(&controller).await?;
        let manifest = std::env::temp_dir().join(format!("idle-{}.yaml", std::process::id()));
        std::fs::write(
            &manifest,
            "apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: notebook, namespace: default}
spec:
  devices:
    requests:
      - name: gpu
        exactly: {deviceClassName: gpu.drust.dev}
---
apiVersion: v1
kind: Pod
metadata: {name: jupyter-0, namespace: default}
spec:
  containers: [{name: c, image: busybox, resources: {claims: [{name: gpu}]}}]
  resourceClaims: [{name: gpu, resourceClaimName: notebook}]
",
        )?;
        apply_file(&client, &manifest).await?;
        let _ = std::fs::remove_file(&manifest);
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
        let allocated = drust_e2e::wait::until(
            "the claim allocated and reserved for its pod",
            Duration::from_secs(60),
            || async {
                let c = claims.get("notebook").await.map_err(|e| e.to_string())?;
                let reserved = c
                    .status
                    .as_ref()
                    .is_some_and(|s| s.reserved_for.as_ref().is_some_and(|r| !r.is_empty()));
                Ok(reserved.then_some(c))
            },
        )
        .await?;
        let result = allocated
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .and_then(|r| r.first())
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no allocation result"))?;
        // What the plugin of gpu-node-0 writes (here as the cluster's admin).
        let note = "GPU idle for 31m (no sample at or above 5% SM or 5% memory activity): \
                    ResourceClaim default/notebook holds a GPU.";
        let status = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "notebook", "namespace": "default"},
            "status": {"devices": [{
                "driver": result.driver, "pool": result.pool, "device": result.device,
                "conditions": [{"type": "GPUIdle", "status": "True", "reason": "NoActivity",
                    "message": note, "lastTransitionTime": "2026-11-27T12:00:00Z"}]}]}
        });
        claims
            .patch_status(
                "notebook",
                &kube::api::PatchParams::apply("gpu.drust.dev/kubelet-plugin").force(),
                &kube::api::Patch::Apply(&status),
            )
            .await?;
        let events = drust_e2e::wait::until(
            "the GPUIdle event on the pod",
            Duration::from_secs(60),
            || async {
                let events = events_on(&client, "jupyter-0")
                    .await
                    .map_err(|e| e.to_string())?;
                let idle: Vec<Event> = events
                    .into_iter()
                    .filter(|e| e.reason.as_deref() == Some("GPUIdle"))
                    .collect();
                Ok((!idle.is_empty()).then_some(idle))
            },
        )
        .await?;
        ensure!(
            events[0].type_.as_deref() == Some("Warning")
                && events[0].note.as_deref() == Some(note),
            "{events:?}"
        );
        // Checked again every second: relayed once.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let again = events_on(&client, "jupyter-0").await?;
        ensure!(
            again
                .iter()
                .filter(|e| e.reason.as_deref() == Some("GPUIdle"))
                .count()
                == 1,
            "{again:?}"
        );
        Ok(())
    }
    .await;
    cp.stop().await?;
    result
}
