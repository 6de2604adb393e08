//! The controller at scale on the real control plane: `DRUST_SCALE_PODS` pending pods (default
//! 1,000) over `DRUST_SCALE_NODES` fake DGX H100 nodes (default 100), all Unschedulable. Every
//! pod gets exactly one event (the writes are bounded by the pods, not by the resyncs), and the
//! controller's CPU time, peak memory and the time to the last event are printed for
//! BENCHMARKS.md (measured there with `--release`). Its peak memory must stay under the memory
//! limit the chart gives its container, or the Deployment would be OOM-killed at this scale.

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
    // When the scheduler gave up on each pod, and how long after that its event came: which
    // of the two sets the time to the last event.
    let mut verdicts = Vec::new();
    for p in pods.list(&ListParams::default()).await?.items {
        let verdict = p
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .and_then(|c| c.last_transition_time);
        if let Some(t) = verdict {
            verdicts.push((p.metadata.name.unwrap_or_default(), t.0));
        }
    }
    let mut delays = Vec::new();
    for e in events.list(&ListParams::default()).await?.items {
        let pod = e
            .regarding
            .as_ref()
            .and_then(|r| r.name.clone())
            .unwrap_or_default();
        let (Some(at), Some((_, verdict))) = (
            e.event_time.as_ref().map(|t| t.0),
            verdicts.iter().find(|(name, _)| *name == pod),
        ) else {
            continue;
        };
        delays.push(at.duration_since(*verdict).as_secs_f64());
    }
    delays.sort_by(f64::total_cmp);
    verdicts.sort_by_key(|(_, t)| *t);
    let spread = match (verdicts.first(), verdicts.last()) {
        (Some((_, a)), Some((_, b))) => b.duration_since(*a).as_secs_f64(),
        _ => 0.0,
    };
    let at = |q: f64| {
        delays
            .get(((delays.len() as f64 * q) as usize).min(delays.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    eprintln!(
        "scale: the scheduler's verdicts spread over {spread:.1} s; from a pod's verdict to its event: median {:.1} s, p99 {:.1} s, max {:.1} s (second resolution)",
        at(0.5),
        at(0.99),
        delays.last().copied().unwrap_or(0.0)
    );
    let (cpu, rss) = controller.usage()?;
    eprintln!(
        "scale: {pods_wanted} pending pods over {nodes} nodes: pods created in {created:.1?}, an event on every pod {all_events:.1?} after the first was created; events written {after} (after two more resyncs); controller CPU {cpu:.1} s, peak RSS {} MiB",
        rss / 1024
    );
    ensure!(after == pods_wanted, "{after} events after more resyncs");
    let limit = controller
        .memory_limit_kib
        .ok_or_else(|| anyhow::anyhow!("the chart sets no memory limit"))?;
    ensure!(
        rss < limit,
        "peak RSS {} MiB is over the chart's memory limit {} MiB",
        rss / 1024,
        limit / 1024
    );
    Ok(())
}
