//! ComputeDomains at scale on paper nodes: 64 nodes joining at once are all listed with
//! distinct indices that never change while they join (NVIDIA #1050), and a 256-pod domain
//! (64 nodes x 4 pods, placed by the real kube-scheduler, held in PreBind by the binding
//! conditions) becomes Ready, timed (NVIDIA #816 reports 8 minutes; issue 43 wants under 30 s).
//! The time is printed; it is asserted only against a bound ten times the issue's.

mod cd_support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::ensure;
use cd_support::*;
use drust_e2e::ControlPlaneOptions;
use drust_e2e::wait::until;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

/// Watches the domain's status every 100 ms until dropped and records, per node, every index
/// it was listed with.
struct IndexRecorder {
    seen: Arc<Mutex<BTreeMap<String, BTreeSet<i64>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl IndexRecorder {
    fn start(client: &Client, name: &str) -> Self {
        let seen: Arc<Mutex<BTreeMap<String, BTreeSet<i64>>>> = Arc::default();
        let (client, name, s) = (client.clone(), name.to_owned(), Arc::clone(&seen));
        let task = tokio::spawn(async move {
            loop {
                if let Ok(status) = domain_status(&client, &name).await {
                    let mut seen = s.lock().unwrap_or_else(PoisonError::into_inner);
                    for (node, m) in members(&status) {
                        seen.entry(node).or_default().insert(m.0);
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        IndexRecorder { seen, task }
    }

    /// Nodes listed with more than one index.
    fn renumbered(&self) -> BTreeMap<String, BTreeSet<i64>> {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, i)| i.len() > 1)
            .map(|(n, i)| (n.clone(), i.clone()))
            .collect()
    }
}

impl Drop for IndexRecorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_nodes_joining_at_once_are_all_listed_with_distinct_stable_indices()
-> anyhow::Result<()> {
    let (cp, client) = start(ControlPlaneOptions::default()).await?;
    let dir = tempfile::tempdir()?;
    let nodes: Vec<String> = (0..64).map(|i| format!("tray-{i:02}")).collect();
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let controller = Controller::start(&cp, "drust", dir.path())?;
    let cd = create_domain(&client, "big", "big-channel", 64).await?;
    let uid = cd.uid().unwrap_or_default();
    let recorder = IndexRecorder::start(&client, "big");
    // All 64 claims allocated at once (the test as the scheduler).
    let joins = nodes.iter().enumerate().map(|(i, n)| {
        let (client, uid, n) = (client.clone(), uid.clone(), n.clone());
        async move { allocated_claim(&client, &format!("c{i}"), &uid, &n).await }
    });
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(joins)
        .buffer_unordered(64)
        .collect()
        .await;
    results.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    let status = wait_status(&client, "big", "64 members, Ready", |s| {
        members(s).len() == 64 && s["status"] == "Ready"
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}\ncontroller log:\n{}", controller.log_text()))?;
    let all = members(&status);
    let indices: BTreeSet<i64> = all.values().map(|m| m.0).collect();
    ensure!(indices == (0..64).collect(), "{all:?}");
    let ips: BTreeSet<&str> = all.values().map(|m| m.2.as_str()).collect();
    ensure!(ips.len() == 64 && !ips.contains(""), "{all:?}");
    let renumbered = recorder.renumbered();
    ensure!(
        renumbered.is_empty(),
        "indices changed while joining: {renumbered:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_256_pod_domain_on_64_paper_nodes_is_ready_and_every_pod_bound() -> anyhow::Result<()> {
    // kube-controller-manager's default 20 requests/s makes the resourceclaim controller
    // alone take ~24 s to create 256 claims (measured); raised here, as on a production control
    // plane, so the time measured is the scheduler's and this controller's.
    let qps = [
        "--kube-api-qps=200".to_owned(),
        "--kube-api-burst=400".to_owned(),
    ];
    let options = ControlPlaneOptions {
        controller_manager_args: qps.to_vec(),
        scheduler_args: qps.to_vec(),
        ..ControlPlaneOptions::default()
    };
    let (cp, client) = start(options).await?;
    let dir = tempfile::tempdir()?;
    let nodes: Vec<String> = (0..64).map(|i| format!("tray-{i:02}")).collect();
    paper_nodes(&cp, &client, &nodes, |_| Some(CLIQUE_A)).await?;
    let _kubelet = PaperKubelet::start(&client);
    let controller = Controller::start(&cp, "drust", dir.path())?;
    create_domain(&client, "job", "job-channel", 64).await?;
    let templates: Api<k8s_openapi::api::resource::v1::ResourceClaimTemplate> =
        Api::namespaced(client.clone(), WORK);
    until("template job-channel", TIMEOUT, || async {
        templates
            .get_opt("job-channel")
            .await
            .map_err(|e| e.to_string())
    })
    .await?;
    let recorder = IndexRecorder::start(&client, "job");
    let start = Instant::now();
    let creates = (0..256).map(|i| {
        let client = client.clone();
        let node = nodes[i / 4].clone();
        async move {
            create_pod(
                &client,
                &format!("worker-{i:03}"),
                "job-channel",
                Some(&node),
            )
            .await
        }
    });
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(creates)
        .buffer_unordered(32)
        .collect()
        .await;
    results.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    let created = start.elapsed();
    let pods: Api<Pod> = Api::namespaced(client.clone(), WORK);
    let ready_at: Arc<Mutex<Option<Duration>>> = Arc::default();
    let allocated_at: Arc<Mutex<Option<Duration>>> = Arc::default();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), WORK);
    let bound_at = until("256 pods bound", Duration::from_secs(600), || {
        let (pods, client, claims) = (pods.clone(), client.clone(), claims.clone());
        let ready_at = Arc::clone(&ready_at);
        let allocated_at = Arc::clone(&allocated_at);
        async move {
            let allocated = claims.list(&ListParams::default()).await.map_or(0, |l| {
                l.items
                    .iter()
                    .filter(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()))
                    .count()
            });
            if allocated == 256 {
                allocated_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(start.elapsed());
            }
            let ready = domain_status(&client, "job")
                .await
                .is_ok_and(|s| s["status"] == "Ready");
            if ready {
                ready_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(start.elapsed());
            }
            let l = pods
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let bound = l
                .items
                .iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
                .count();
            if bound == 256 {
                Ok(Some(start.elapsed()))
            } else {
                Err(format!("{bound} of 256 bound"))
            }
        }
    })
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "{e}\ncontroller log tail:\n{}",
            tail(&controller.log_text())
        )
    })?;
    let status = wait_status(&client, "job", "job Ready", |s| s["status"] == "Ready").await?;
    let ready_at = ready_at
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .unwrap_or_else(|| start.elapsed());
    let allocated_at = allocated_at
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .unwrap_or_default();
    println!(
        "256-pod ComputeDomain on 64 paper nodes: pods created in {:.1} s, all 256 claims \
         allocated at {:.1} s, domain Ready at {:.1} s, all pods bound at {:.1} s",
        created.as_secs_f64(),
        allocated_at.as_secs_f64(),
        ready_at.as_secs_f64(),
        bound_at.as_secs_f64()
    );
    let all = members(&status);
    ensure!(all.len() == 64, "{all:?}");
    let indices: BTreeSet<i64> = all.values().map(|m| m.0).collect();
    ensure!(indices == (0..64).collect(), "{all:?}");
    ensure!(
        recorder.renumbered().is_empty(),
        "{:?}",
        recorder.renumbered()
    );
    // Every pod on its pinned node.
    for p in pods.list(&ListParams::default()).await?.items {
        let i: usize = p.name_any().trim_start_matches("worker-").parse()?;
        let node = p.spec.and_then(|s| s.node_name).unwrap_or_default();
        ensure!(node == nodes[i / 4], "worker-{i:03} on {node}");
    }
    // Ten times the 30 s: a loaded 2-core machine, not a regression bound.
    ensure!(bound_at < Duration::from_secs(300), "{bound_at:?}");
    Ok(())
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
