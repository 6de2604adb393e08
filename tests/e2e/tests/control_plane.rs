//! The harness itself: a real control plane starts, the real scheduler binds a Pod to a Node
//! that no kubelet backs, and stopping leaves no process behind.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use drust_e2e::{ControlPlane, ControlPlaneOptions};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::{Api, ObjectMeta, PostParams};
use nix::sys::signal::kill;
use nix::unistd::Pid;

const SCHEDULE_TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn scheduler_binds_a_pod_to_a_registered_node_and_stop_leaves_no_process()
-> anyhow::Result<()> {
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    eprintln!("warm start: {} ms", cp.timings().startup.as_millis());

    cp.register_node("node-a", &[("drust.example/role", "e2e")])
        .await?;

    let pods: Api<Pod> = Api::namespaced(cp.client().await?, "default");
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("pause".to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "pause".to_owned(),
                image: Some("registry.k8s.io/pause:3.10".to_owned()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    pods.create(&PostParams::default(), &pod)
        .await
        .context("creating pod default/pause")?;

    let created = Instant::now();
    let node = loop {
        let pod = pods
            .get("pause")
            .await
            .context("reading pod default/pause")?;
        if let Some(node) = pod.spec.and_then(|s| s.node_name) {
            break node;
        }
        if created.elapsed() > SCHEDULE_TIMEOUT {
            bail!(
                "pod default/pause not bound after {SCHEDULE_TIMEOUT:?}; status: {:?}",
                pod.status
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("scheduled in {} ms", created.elapsed().as_millis());
    assert_eq!(node, "node-a");

    let pids = cp.pids();
    assert_eq!(pids.len(), 4, "one process per component: {pids:?}");
    cp.stop().await?;
    for (component, pid) in pids {
        // stop() reaped every child, so the pid no longer names a process of ours.
        let alive = kill(Pid::from_raw(pid as i32), None).is_ok();
        assert!(!alive, "{component} (pid {pid}) survived stop");
    }
    Ok(())
}
