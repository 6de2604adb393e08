//! The controller at scale on the real control plane: `DRUST_SCALE_PODS` pending pods (default
//! 1,000) over `DRUST_SCALE_NODES` fake DGX H100 nodes (default 100), all Unschedulable. Every
//! pod gets exactly one event (the writes are bounded by the pods, not by the resyncs), and the
//! controller's CPU time, peak memory and the time to the last event are printed for
//! BENCHMARKS.md (measured there with `--release`; not asserted here).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::ensure;
use drust_e2e::manifests::{apply_file, apply_yaml, repo_path};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_pending_pods_get_one_event_each() -> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let result = run(&cp).await;
    cp.stop().await?;
    result
}

async fn run(cp: &ControlPlane) -> anyhow::Result<()> {
    let pods_wanted = env("DRUST_SCALE_PODS", 1000);
    let nodes = env("DRUST_SCALE_NODES", 100);
    let client = cp.client().await?;
    apply_file(&client, &repo_path("deploy/deviceclasses/gpu.yaml")).await?;
    for n in 0..nodes {
        let node = format!("gpu-node-{n:03}");
        cp.register_node(&node, &[]).await?;
        support::create_slices(&client, &node).await?;
    }
    // Faster than the defaults so that the run takes seconds: a resync every 5 s (so every pod
    // is explained several times) and 50 events per second.
    let controller = support::start(
        cp,
        &[
            "explainController.resync=5s",
            "explainController.eventsPerSecond=50",
            "explainController.eventBurst=100",
        ],
    )
    .await?;
    apply_yaml(
        &client,
        r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: gpu-200gi, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu.drust.dev
            selectors:
              - cel:
                  expression: device.capacity["gpu.drust.dev"].memory.compareTo(quantity("200Gi")) >= 0
"#,
        Path::new("template"),
    )
    .await?;
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for i in 0..pods_wanted {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("pending-{i:04}")},
            "spec": {
                "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-200gi"}]}}))?;
        pods.create(&PostParams::default(), &pod).await?;
    }
    let created = started.elapsed();
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let count = || async {
        Ok::<_, anyhow::Error>(
            events
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter(|e| e.reporting_controller.as_deref() == Some("drust-explain-controller"))
                .count(),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last = 0;
    while Instant::now() < deadline {
        last = count().await?;
        if last >= pods_wanted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let all_events = started.elapsed();
    ensure!(last == pods_wanted, "{last} events for {pods_wanted} pods");
    // Two more resyncs: nothing new is written.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let after = count().await?;
    let (cpu, rss) = controller.usage()?;
    eprintln!(
        "scale: {pods_wanted} pending pods over {nodes} nodes: pods created in {created:.1?}, an event on every pod {all_events:.1?} after the first was created; events written {after} (after two more resyncs); controller CPU {cpu:.1} s, peak RSS {} MiB",
        rss / 1024
    );
    ensure!(after == pods_wanted, "{after} events after more resyncs");
    Ok(())
}
