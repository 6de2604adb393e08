//! NVLink fabrics through the plugin's own parts, as `active.rs` wires them: a fake GB200 tray
//! (`gpu_inventory::fake::rack`) whose topology file the test rewrites as Fabric Manager would
//! change what NVML answers, the fabric watch polling it, the rediscovery it wakes, and the pool
//! that would be published (captured instead of written to an API server). The rediscovery
//! interval is an hour, so every publication below was brought by the watch.
//!
//! Registration IN_PROGRESS -> COMPLETED publishes the clique and lifts the taint; a
//! re-partition republishes the new clique; an unhealthy route taints the GPU and keeps its
//! clique; flapping back to IN_PROGRESS withdraws the clique (never a stale one); a failing
//! fabric call taints without a clique.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpu_inventory::Pool;
use gpu_inventory::fabric::{FabricHealthSummary, FabricInfo, FabricState};
use gpu_inventory::fake::rack::{CLIQUE_ID, HEALTHY_MASK, cluster_uuid, gb200_nvl72_tray};
use gpu_kubelet_plugin::config::FabricWatch;
use gpu_kubelet_plugin::fabric::{self, Watched};
use gpu_kubelet_plugin::publisher::{self, PublishOutcome};
use gpu_kubelet_plugin::{Backend, Config, Publishing, open_backend, rediscover};
use tokio::sync::{Notify, mpsc, watch};

const DRIVER: &str = "gpu.drust.dev";

fn write(path: &Path, topology: &gpu_inventory::Topology) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_yaml_ng::to_string(topology).expect("yaml")).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// Tray 3 of rack 0 with `f` applied to every GPU's fabric answer.
fn tray(f: impl Fn(u32, &mut FabricInfo)) -> gpu_inventory::Topology {
    let mut t = gb200_nvl72_tray(0, 3);
    for g in &mut t.gpus {
        if let Some(info) = g.fabric.as_mut() {
            f(g.index, info);
        }
    }
    t
}

fn pending(_: u32, f: &mut FabricInfo) {
    *f = FabricInfo {
        state: FabricState::InProgress,
        status: 0,
        cluster_uuid: "00000000-0000-0000-0000-000000000000".into(),
        clique_id: 0,
        health_mask: Some(0),
        health_summary: Some(FabricHealthSummary::NotSupported),
    };
}

/// (device name, its `nvlinkClique`, its fabric taints as `value:effect`), device by device.
type Published = Vec<(String, Option<String>, Vec<String>)>;

fn summary(pool: &Pool) -> Published {
    pool.devices
        .iter()
        .map(|d| {
            let clique = d
                .attributes
                .as_ref()
                .and_then(|a| a.get("nvlinkClique"))
                .and_then(|a| a.string.clone());
            let taints = d
                .taints
                .iter()
                .flatten()
                .filter(|t| t.key == format!("{DRIVER}/fabric"))
                .map(|t| format!("{}:{}", t.value.clone().unwrap_or_default(), t.effect))
                .collect();
            (d.name.clone(), clique, taints)
        })
        .collect()
}

/// Waits for a published pool that `want` accepts; returns it.
async fn published_until(
    pools: &mut mpsc::UnboundedReceiver<Pool>,
    what: &str,
    want: impl Fn(&Published) -> bool,
) -> Published {
    let mut last = None;
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(pool) = pools.recv().await {
            let s = summary(&pool);
            if want(&s) {
                return Some(s);
            }
            last = Some(s);
        }
        None
    })
    .await;
    match found {
        Ok(Some(s)) => s,
        _ => panic!("no publication with {what}; last: {last:#?}"),
    }
}

#[tokio::test]
async fn fabric_changes_are_published_by_the_watch_with_cliques_never_stale_and_taints_naming_the_condition()
 {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tray.yaml");
    write(&file, &tray(pending));
    let mut config = Config::new(
        DRIVER,
        "tray-3",
        Backend::Fake {
            topology: file.clone(),
            state_dir: None,
        },
    );
    config.fabric_watch = FabricWatch {
        pending: Duration::from_millis(50),
        settled: Duration::from_millis(100),
    };
    let backend = open_backend(&config).expect("backend");
    let inventory = rediscover(backend.as_ref(), config.naming).expect("discover");
    let publishing = Publishing::of(&config).await;

    // Registering: no clique, every GPU tainted.
    let first = publishing.pool(&inventory);
    let s = summary(&first);
    assert_eq!(s.len(), 4);
    for (name, clique, taints) in &s {
        assert_eq!(clique, &None, "{name}");
        assert_eq!(taints, &["registration-in-progress:NoSchedule"], "{name}");
    }

    // The plugin's wiring (active.rs), the publish captured.
    let (answers, answers_rx) = watch::channel(Watched::of(&inventory));
    let wake = Arc::new(Notify::new());
    let watching = tokio::spawn(fabric::watch(
        Arc::clone(&backend),
        answers_rx,
        Arc::clone(&wake),
        config.fabric_watch,
    ));
    let (tx, mut pools) = mpsc::unbounded_channel::<Pool>();
    let discovering = tokio::spawn(publisher::rediscovery(
        Duration::from_secs(3600),
        wake,
        first,
        {
            let backend = Arc::clone(&backend);
            let publishing = publishing.clone();
            move || {
                rediscover(backend.as_ref(), gpu_inventory::Naming::Drust)
                    .map(|inventory| {
                        Watched::follow(&answers, &inventory);
                        publishing.pool(&inventory)
                    })
                    .map_err(|e| e.to_string())
            }
        },
        move |pool| {
            let sent = tx.send(pool).map_err(|e| e.to_string());
            async move { sent.map(|()| PublishOutcome::Unchanged { generation: 1 }) }
        },
    ));

    // Fabric Manager completes the registration: the rack's clique, no taint.
    write(&file, &tray(|_, _| {}));
    let clique = format!("{}.{CLIQUE_ID}", cluster_uuid(0));
    published_until(&mut pools, "the rack's clique and no taint", |s| {
        s.iter()
            .all(|(_, c, t)| c.as_deref() == Some(clique.as_str()) && t.is_empty())
    })
    .await;

    // Re-partitioning: a new clique, republished.
    write(&file, &tray(|_, f| f.clique_id = 7));
    let moved = format!("{}.7", cluster_uuid(0));
    published_until(&mut pools, "the new clique", |s| {
        s.iter()
            .all(|(_, c, _)| c.as_deref() == Some(moved.as_str()))
    })
    .await;

    // GPU 2's route turns unhealthy: its devices are tainted with the reason and the summary,
    // and keep their clique (an unhealthy fabric is not "no clique"); the others are clean.
    write(
        &file,
        &tray(|i, f| {
            f.clique_id = 7;
            if i == 2 {
                f.health_mask = Some(HEALTHY_MASK & !0x30 | 0x10);
                f.health_summary = Some(FabricHealthSummary::Unhealthy);
            }
        }),
    );
    let s = published_until(&mut pools, "GPU 2 tainted", |s| {
        s.iter().any(|(_, _, t)| !t.is_empty())
    })
    .await;
    for (name, c, t) in &s {
        assert_eq!(c.as_deref(), Some(moved.as_str()), "{name}");
        if name == "gpu-0018-04-00-0" {
            assert_eq!(t, &["route-unhealthy:NoSchedule", "unhealthy:NoSchedule"]);
        } else {
            assert!(t.is_empty(), "{name}: {t:?}");
        }
    }

    // Fabric Manager restarts: back to IN_PROGRESS, the clique is withdrawn at once.
    write(&file, &tray(pending));
    published_until(&mut pools, "no clique while registering", |s| {
        s.iter().all(|(_, c, t)| {
            c.is_none() && t == &["registration-in-progress:NoSchedule".to_owned()]
        })
    })
    .await;

    // GPU 0's fabric call fails: no clique, tainted `query-failed`; the others registered.
    let mut failing = tray(|_, _| {});
    failing.gpus[0].fabric = None;
    failing.gpus[0].fabric_error =
        Some("nvmlDeviceGetGpuFabricInfoV (v3) failed: Unknown Error (999)".into());
    write(&file, &failing);
    let s = published_until(&mut pools, "GPU 0's call failing", |s| {
        s.iter().filter(|(_, c, _)| c.is_some()).count() == 3
    })
    .await;
    assert_eq!(s[0].1, None);
    assert_eq!(s[0].2, ["query-failed:NoSchedule"]);

    watching.abort();
    discovering.abort();
}
