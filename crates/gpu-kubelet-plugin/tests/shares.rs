//! Shares of a device (consumable capacity) in the claim controller, against an in-memory cluster
//! and the fake MPS tool: what each share's CDI device gets, when the GPU's daemon runs, and the
//! allocations a share cannot be prepared from, each refused naming the result and field. The
//! scheduler's side and the real node are in tests/e2e (`fractional_gpus.rs`, `real_node.rs`).

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use dra_kubelet::Driver;
use gpu_kubelet_plugin::hardware::NodeDevice;
use k8s_openapi::api::resource::v1::ResourceClaim;

const SHARE: &str = "00000000-0000-4000-8000-0000000000";

fn time_slicing() -> serde_json::Value {
    serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}})
}

/// The environment of the claim's (first) CDI device.
fn device_env(dir: &Path, uid: &str) -> Vec<String> {
    let path = dir.join("cdi").join(format!("{DRIVER}-claim_{uid}.json"));
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("CDI spec")).expect("JSON");
    spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

fn daemons(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join("mps"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    v.sort();
    v
}

async fn controller(
    dir: &Path,
    claims: Vec<ResourceClaim>,
) -> gpu_kubelet_plugin::claims::ClaimController<Shared, ScriptedHardware> {
    let cluster = Shared::default();
    for c in claims {
        cluster.put(c);
    }
    controller_in(dir, cluster, Arc::default()).await
}

#[tokio::test]
async fn each_share_gets_its_limits_and_the_whole_gpu_gets_none_and_keeps_its_configs() {
    let dir = tempfile::tempdir().unwrap();
    let gpu = gpus()[0].clone();
    let mut quarter = share_claim("quarter", "uq", dev(0), &format!("{SHARE}01"), "20Gi");
    if let Some(c) = results_mut(&mut quarter)[0].consumed_capacity.as_mut() {
        c.insert(
            "computePercent".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("25".into()),
        );
    }
    let plain = share_claim("plain", "up", dev(0), &format!("{SHARE}02"), "10Gi");
    // A request without capacity on a shareable H100: the whole memory (79 GiB), and a
    // time-slicing config as on any exclusive GPU.
    let whole = with_configs(
        share_claim("whole", "uw", dev(1), &format!("{SHARE}03"), "79Gi"),
        &[("FromClaim", time_slicing())],
    );
    let c = controller(dir.path(), vec![quarter, plain, whole]).await;
    let r = c
        .prepare(vec![
            claim_ref("quarter", "uq"),
            claim_ref("plain", "up"),
            claim_ref("whole", "uw"),
        ])
        .await;
    for (uid, id) in [("uq", "01"), ("up", "02"), ("uw", "03")] {
        let devices = r[uid].as_ref().unwrap_or_else(|e| panic!("{uid}: {e}"));
        assert_eq!(
            devices[0].share_id.as_deref(),
            Some(format!("{SHARE}{id}").as_str())
        );
    }
    let env = device_env(dir.path(), "uq");
    for want in [
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
    ] {
        assert!(env.iter().any(|e| e == want), "{want} in {env:?}");
    }
    let env = device_env(dir.path(), "up");
    assert!(
        env.iter()
            .any(|e| e == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M")
    );
    assert!(!env.iter().any(|e| e.starts_with("CUDA_MPS_ACTIVE_THREAD")));
    let env = device_env(dir.path(), "uw");
    assert!(!env.iter().any(|e| e.starts_with("CUDA_MPS")), "{env:?}");
    // One daemon, the first GPU's; the whole GPU runs without one.
    assert_eq!(daemons(dir.path()), [gpu.raw.uuid.to_ascii_lowercase()]);

    // Unprepare one share: the daemon stays for the other; the last one stops it.
    assert!(c.unprepare(vec![claim_ref("quarter", "uq")]).await["uq"].is_ok());
    assert_eq!(daemons(dir.path()).len(), 1);
    assert!(c.unprepare(vec![claim_ref("plain", "up")]).await["up"].is_ok());
    assert!(daemons(dir.path()).is_empty());
}

#[tokio::test]
async fn allocations_a_share_cannot_be_prepared_from_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let configured = with_configs(
        share_claim("configured", "u1", dev(0), &format!("{SHARE}01"), "20Gi"),
        &[("FromClaim", time_slicing())],
    );
    let mut two_gpus = share_claim("two-gpus", "u2", dev(0), &format!("{SHARE}02"), "20Gi");
    let mut two_of_one = share_claim("two-of-one", "u3", dev(0), &format!("{SHARE}03"), "20Gi");
    for (claim, second) in [(&mut two_gpus, dev(1)), (&mut two_of_one, dev(0))] {
        let results = results_mut(claim);
        let mut more = results[0].clone();
        more.device = second.into();
        more.share_id = Some(format!("{SHARE}99"));
        results.push(more);
    }
    // Half a byte: no whole number of bytes (1.5Gi, which this test used before the workspace's
    // one quantity type, is 1610612736 bytes and is read as such).
    let bad = share_claim("bad", "u4", dev(2), &format!("{SHARE}04"), "0.5");
    let c = controller(dir.path(), vec![configured, two_gpus, two_of_one, bad]).await;
    let r = c
        .prepare(vec![
            claim_ref("configured", "u1"),
            claim_ref("two-gpus", "u2"),
            claim_ref("two-of-one", "u3"),
            claim_ref("bad", "u4"),
        ])
        .await;
    let err = |uid: &str| r[uid].as_ref().expect_err(uid).to_string();
    let e = err("u1");
    assert!(
        e.contains("results[0]") && e.contains("sharing config"),
        "{e}"
    );
    let e = err("u2");
    assert!(
        e.contains("results[1]") && e.contains("shares of one device only"),
        "{e}"
    );
    let e = err("u3");
    assert!(
        e.contains("results[1]") && e.contains("at most one share of a device"),
        "{e}"
    );
    let e = err("u4");
    assert!(
        e.contains("results[0]") && e.contains("consumedCapacity memory"),
        "{e}"
    );
    // Nothing was left behind by the refusals.
    assert!(c.prepared_claims().await.is_empty());
    assert!(daemons(dir.path()).is_empty());
}

#[tokio::test]
async fn a_restart_keeps_the_daemon_of_recorded_shares_and_stops_one_no_share_needs() {
    let dir = tempfile::tempdir().unwrap();
    let a = share_claim("a", "ua", dev(0), &format!("{SHARE}01"), "20Gi");
    let b = share_claim("b", "ub", dev(3), &format!("{SHARE}02"), "20Gi");
    let c = controller(dir.path(), vec![a.clone(), b.clone()]).await;
    let r = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    assert_eq!(daemons(dir.path()).len(), 2);
    drop(c);
    // Claim b's record is lost (a state the plugin itself never leaves, standing for a daemon
    // no share needs); a's daemon must survive the restart, b's GPU's daemon is an orphan.
    let path = dir
        .path()
        .join("cdi")
        .join(format!("{DRIVER}-claim_ub.json"));
    std::fs::remove_file(path).unwrap();
    let checkpoint = gpu_kubelet_plugin::checkpoint::CheckpointFile::new(
        Arc::new(gpu_kubelet_plugin::storage::RealFs),
        dir.path().join("plugin/checkpoint.json"),
    );
    let mut state = checkpoint.load().unwrap().unwrap();
    state.claims.remove("ub");
    checkpoint.store(&state).unwrap();
    drop(checkpoint);
    let keep = gpus()[0].raw.uuid.to_ascii_lowercase();
    let control = mps_control(&dir.path().join("mps"));
    let pid_before =
        std::fs::read_to_string(dir.path().join("mps").join(&keep).join("log/control.log"))
            .unwrap();
    let c = controller(dir.path(), vec![a, b]).await;
    assert_eq!(daemons(dir.path()), std::slice::from_ref(&keep));
    assert!(control.is_running(&keep).await);
    let log = std::fs::read_to_string(dir.path().join("mps").join(&keep).join("log/control.log"))
        .unwrap();
    assert_eq!(
        log.lines().filter(|l| l.starts_with("start ")).count(),
        pid_before
            .lines()
            .filter(|l| l.starts_with("start "))
            .count(),
        "the daemon of a's share was not restarted: {log}"
    );
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    assert!(daemons(dir.path()).is_empty());
}

/// The GPU's daemon holds a server-side ceiling: the largest share's memory and thread
/// percentage (100 once a share reserved none). Set before a share's containers start, on the
/// running server too; lowered when the larger share goes. A client that raises its own
/// variables gets the ceiling (the fake daemon logs what holds for each client).
#[tokio::test]
async fn the_gpus_daemon_caps_every_client_at_the_largest_share() {
    let dir = tempfile::tempdir().unwrap();
    let mut quarter = share_claim("quarter", "uq", dev(0), &format!("{SHARE}01"), "20Gi");
    if let Some(c) = results_mut(&mut quarter)[0].consumed_capacity.as_mut() {
        c.insert(
            "computePercent".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("25".into()),
        );
    }
    let large = share_claim("large", "ul", dev(0), &format!("{SHARE}02"), "30Gi");
    let c = controller(dir.path(), vec![quarter, large]).await;
    assert!(c.prepare(vec![claim_ref("quarter", "uq")]).await["uq"].is_ok());
    let key = gpus()[0].raw.uuid.to_ascii_lowercase();
    let log = || {
        std::fs::read_to_string(dir.path().join("mps").join(&key).join("log/control.log")).unwrap()
    };
    for want in [
        "cmd set_default_device_pinned_mem_limit 0 20480M",
        "cmd set_default_active_thread_percentage 25",
        // Root's server at once, after the ceiling, to hold the GPU before any client.
        "cmd start_server -uid 0",
    ] {
        assert!(log().contains(want), "{want} in {}", log());
    }
    assert!(
        log().find("cmd set_default_device_pinned_mem_limit") < log().find("cmd start_server"),
        "the server starts with the ceiling as its defaults: {}",
        log()
    );
    // A client of the quarter share, served by the server the plugin started.
    let attach = |raised: Option<&str>| {
        let mut client = std::process::Command::new(drust_fakes::mps_control());
        client
            .env(
                "CUDA_MPS_PIPE_DIRECTORY",
                dir.path().join("mps").join(&key).join("pipe"),
            )
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null());
        if let Some(limit) = raised {
            client.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limit);
        }
        let mut child = client.spawn().unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"fake_client_attach\n")
            .unwrap();
        child
    };
    let wait_for = |want: &str| {
        for _ in 0..250 {
            if log().contains(want) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("{want} not in {}", log());
    };
    let mut first = attach(None);
    wait_for("ceiling pinned=0=20480M threads=25.0");
    // A larger share without a compute reservation raises the ceiling on the running server.
    assert!(c.prepare(vec![claim_ref("large", "ul")]).await["ul"].is_ok());
    let pid = log()
        .lines()
        .find_map(|l| {
            l.strip_prefix("start ")
                .and_then(|l| l.split("pid=").nth(1))
        })
        .unwrap()
        .trim()
        .to_owned();
    for want in [
        format!("cmd set_device_pinned_mem_limit {pid} 0 30720M"),
        format!("cmd set_active_thread_percentage {pid} 100"),
    ] {
        assert!(log().contains(&want), "{want} in {}", log());
    }
    // A tenant that raises its own limit to the whole GPU gets the ceiling.
    let mut raised = attach(Some("0=81920M"));
    wait_for("client attached pinned=0=81920M threads=- ceiling pinned=0=30720M threads=100.0");
    // The larger share goes: the ceiling comes back down for clients connecting from now on.
    assert!(c.unprepare(vec![claim_ref("large", "ul")]).await["ul"].is_ok());
    assert!(
        log().contains(&format!("cmd set_device_pinned_mem_limit {pid} 0 20480M")),
        "{}",
        log()
    );
    for child in [&mut first, &mut raised] {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(c.unprepare(vec![claim_ref("quarter", "uq")]).await["uq"].is_ok());
}

#[tokio::test]
async fn the_last_two_shares_unprepared_at_once_stop_the_daemon() {
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let a = share_claim("a", "ua", dev(0), &format!("{SHARE}01"), "20Gi");
        let b = share_claim("b", "ub", dev(0), &format!("{SHARE}02"), "20Gi");
        let c = controller(dir.path(), vec![a, b]).await;
        let both = || vec![claim_ref("a", "ua"), claim_ref("b", "ub")];
        assert!(c.prepare(both()).await.values().all(Result::is_ok));
        assert_eq!(daemons(dir.path()).len(), 1);
        // One kubelet call for both, as when the pods of both end together.
        assert!(c.unprepare(both()).await.values().all(Result::is_ok));
        assert!(
            daemons(dir.path()).is_empty(),
            "round {round}: each kept the daemon for the other"
        );
    }
}

/// No CUDA process may bypass a GPU's share daemon: the GPU is in `EXCLUSIVE_PROCESS` from
/// before its first share's daemon starts until its last share goes; a GPU held whole is left
/// alone; and a restart puts back in the default mode a GPU no recorded share needs (left
/// exclusive by a crash), without touching the GPU of a recorded share.
#[tokio::test]
async fn a_gpu_hosting_shares_admits_only_its_daemon_until_the_last_share_goes() {
    use gpu_inventory::backend::ComputeMode;
    let dir = tempfile::tempdir().unwrap();
    let gpu = |i: usize| gpus()[i].name.clone();
    let a = share_claim("a", "ua", dev(0), &format!("{SHARE}01"), "20Gi");
    let b = share_claim("b", "ub", dev(0), &format!("{SHARE}02"), "10Gi");
    let whole = share_claim("whole", "uw", dev(1), &format!("{SHARE}03"), "79Gi");
    let cluster = Shared::default();
    for c in [a, b, whole] {
        cluster.put(c);
    }
    let hardware = Arc::new(ScriptedHardware::default());
    let modes = || hardware.compute_modes.lock().unwrap().clone();
    let c = controller_in(dir.path(), cluster.clone(), Arc::clone(&hardware)).await;
    let r = c
        .prepare(vec![
            claim_ref("a", "ua"),
            claim_ref("b", "ub"),
            claim_ref("whole", "uw"),
        ])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    assert_eq!(modes().get(&gpu(0)), Some(&ComputeMode::ExclusiveProcess));
    assert_eq!(modes().get(&gpu(1)), None, "a GPU held whole is left alone");
    let first_exclusive = hardware
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.starts_with("compute-mode"))
        .count();
    assert_eq!(
        first_exclusive, 2,
        "set at each share's prepare, whichever found the daemon running"
    );

    // Issue 41, defect 1: reset behind the plugin's back (a GPU reset, `nvidia-smi -c`). The
    // periodic check sees it and puts it right; a GPU held whole is not its business.
    hardware
        .compute_modes
        .lock()
        .unwrap()
        .insert(gpu(0), ComputeMode::Default);
    assert_eq!(c.reassert_compute_modes().await, [gpu(0)]);
    assert_eq!(modes().get(&gpu(0)), Some(&ComputeMode::ExclusiveProcess));
    assert!(c.reassert_compute_modes().await.is_empty(), "already right");
    assert_eq!(modes().get(&gpu(1)), None);

    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    assert_eq!(modes().get(&gpu(0)), Some(&ComputeMode::ExclusiveProcess));
    assert!(c.unprepare(vec![claim_ref("b", "ub")]).await["ub"].is_ok());
    assert_eq!(modes().get(&gpu(0)), Some(&ComputeMode::Default));
    assert!(
        c.reassert_compute_modes().await.is_empty(),
        "no share left: the default mode stays"
    );
    assert_eq!(modes().get(&gpu(0)), Some(&ComputeMode::Default));

    // A share again on GPU 0; GPU 3 left exclusive by a crash. A restart keeps the one and
    // restores the other.
    assert!(c.prepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    drop(c);
    hardware
        .compute_modes
        .lock()
        .unwrap()
        .insert(gpu(3), ComputeMode::ExclusiveProcess);
    let c = controller_in(dir.path(), cluster, Arc::clone(&hardware)).await;
    assert_eq!(modes().get(&gpu(3)), Some(&ComputeMode::Default));
    assert_eq!(modes().get(&gpu(0)), Some(&ComputeMode::ExclusiveProcess));
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    assert!(c.unprepare(vec![claim_ref("whole", "uw")]).await["uw"].is_ok());
    assert_eq!(modes().get(&gpu(0)), Some(&ComputeMode::Default));
}

/// A damaged checkpoint rebuilt while the API server does not answer: the shares are rebuilt
/// from their CDI specs with what the specs show (the share's limits, its GPU's daemon), so the
/// GPU's daemon, both specs and the GPU's exclusive mode all stay under the running
/// containers; once the API server answers, the stale-claim check settles the records (the
/// share IDs come back) and the last share's unprepare stops the daemon as usual.
#[tokio::test]
async fn a_rebuild_while_the_api_server_is_down_stops_nothing_shares_still_use() {
    use gpu_inventory::backend::ComputeMode;
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let a = share_claim("a", "ua", dev(0), &format!("{SHARE}01"), "20Gi");
    let b = share_claim("b", "ub", dev(0), &format!("{SHARE}02"), "10Gi");
    let cluster = Shared::default();
    cluster.put(a);
    cluster.put(b);
    let hardware = Arc::new(ScriptedHardware::default());
    let c = controller_in(dir.path(), cluster.clone(), Arc::clone(&hardware)).await;
    let both = || vec![claim_ref("a", "ua"), claim_ref("b", "ub")];
    assert!(c.prepare(both()).await.values().all(Result::is_ok));
    let key = gpus()[0].raw.uuid.to_ascii_lowercase();
    let log = dir.path().join("mps").join(&key).join("log/control.log");
    let starts = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("start "))
            .count()
    };
    assert_eq!(starts(), 1);
    drop(c);
    for slot in ["checkpoint.json", "checkpoint.b.json"] {
        let path = dir.path().join("plugin").join(slot);
        if path.exists() {
            std::fs::write(path, b"{damaged").unwrap();
        }
    }

    cluster.unreachable.store(true, Ordering::SeqCst);
    let c = controller_in(dir.path(), cluster.clone(), Arc::clone(&hardware)).await;
    let mut prepared = c.prepared_claims().await;
    prepared.sort();
    assert_eq!(prepared, ["ua", "ub"]);
    let control = mps_control(&dir.path().join("mps"));
    assert!(
        control.is_running(&key).await,
        "the GPU's daemon was stopped"
    );
    assert_eq!(starts(), 1, "the GPU's daemon was replaced");
    assert_eq!(daemons(dir.path()), std::slice::from_ref(&key));
    assert_eq!(
        std::fs::read_dir(dir.path().join("cdi")).unwrap().count(),
        2,
        "both CDI specs stay"
    );
    assert_eq!(
        hardware.compute_modes.lock().unwrap().get(&gpus()[0].name),
        Some(&ComputeMode::ExclusiveProcess)
    );

    // Reachable again: the check settles both records.
    cluster.unreachable.store(false, Ordering::SeqCst);
    assert!(c.unprepare_stale().await.is_empty());
    let checkpoint = gpu_kubelet_plugin::checkpoint::CheckpointFile::new(
        Arc::new(gpu_kubelet_plugin::storage::RealFs),
        dir.path().join("plugin/checkpoint.json"),
    );
    let state = checkpoint.load().unwrap().unwrap();
    for (uid, id) in [("ua", "01"), ("ub", "02")] {
        let share = state.claims[uid].devices[0].share.clone().expect("a share");
        assert_eq!(share.id, format!("{SHARE}{id}"), "{uid} settled");
    }
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    assert!(control.is_running(&key).await);
    assert!(c.unprepare(vec![claim_ref("b", "ub")]).await["ub"].is_ok());
    assert!(daemons(dir.path()).is_empty());
}

/// A downgrade: the checkpoint was written by a newer build (a `minReaderVersion` above this
/// build's). This build moves it aside and rebuilds its claims, but takes nothing it finds for
/// an orphan in that start: the GPU's daemon, the GPU's exclusive mode and even the spec of a
/// claim it could not rebuild (gone from the API server) stay as found.
#[tokio::test]
async fn a_checkpoint_from_a_newer_build_stops_nothing() {
    use gpu_inventory::backend::ComputeMode;
    let dir = tempfile::tempdir().unwrap();
    let a = share_claim("a", "ua", dev(0), &format!("{SHARE}01"), "20Gi");
    let gone = share_claim("gone", "ug", dev(0), &format!("{SHARE}02"), "10Gi");
    let cluster = Shared::default();
    cluster.put(a);
    cluster.put(gone);
    let hardware = Arc::new(ScriptedHardware::default());
    let c = controller_in(dir.path(), cluster.clone(), Arc::clone(&hardware)).await;
    let both = || vec![claim_ref("a", "ua"), claim_ref("gone", "ug")];
    assert!(c.prepare(both()).await.values().all(Result::is_ok));
    drop(c);
    cluster.claims.lock().unwrap().remove("ns/gone");
    // The newest slot, as a newer format would write it (the checksum covers `data` only).
    let newer = gpu_kubelet_plugin::checkpoint::VERSION + 1;
    let mut rewritten = 0;
    for slot in ["checkpoint.json", "checkpoint.b.json"] {
        let path = dir.path().join("plugin").join(slot);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let text = text.replacen(
            &format!(
                "\"version\":{},\"minReaderVersion\":{}",
                gpu_kubelet_plugin::checkpoint::VERSION,
                gpu_kubelet_plugin::checkpoint::MIN_READER_VERSION_SHARES
            ),
            &format!("\"version\":{newer},\"minReaderVersion\":{newer}"),
            1,
        );
        rewritten += usize::from(text.contains(&format!("\"minReaderVersion\":{newer}")));
        std::fs::write(&path, text).unwrap();
    }
    assert!(rewritten > 0, "no slot was rewritten");

    let c = controller_in(dir.path(), cluster.clone(), Arc::clone(&hardware)).await;
    assert_eq!(c.prepared_claims().await, ["ua"]);
    let key = gpus()[0].raw.uuid.to_ascii_lowercase();
    let control = mps_control(&dir.path().join("mps"));
    assert!(control.is_running(&key).await);
    assert_eq!(
        std::fs::read_dir(dir.path().join("cdi")).unwrap().count(),
        2,
        "the spec of the claim it could not rebuild stays too"
    );
    assert_eq!(
        hardware.compute_modes.lock().unwrap().get(&gpus()[0].name),
        Some(&ComputeMode::ExclusiveProcess)
    );
    let moved: Vec<String> = std::fs::read_dir(dir.path().join("plugin"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".corrupt"))
        .collect();
    assert!(!moved.is_empty(), "the newer file is kept aside");
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
}

/// Start-up restores only the mode the plugin sets: a GPU an administrator set to
/// `PROHIBITED` (to keep work off it) stays so.
#[tokio::test]
async fn start_up_leaves_an_administrators_prohibited_gpu_alone() {
    use gpu_inventory::backend::ComputeMode;
    let dir = tempfile::tempdir().unwrap();
    let hardware = Arc::new(ScriptedHardware::default());
    let gpu = |i: usize| gpus()[i].name.clone();
    {
        let mut modes = hardware.compute_modes.lock().unwrap();
        modes.insert(gpu(2), ComputeMode::Prohibited);
        modes.insert(gpu(3), ComputeMode::ExclusiveProcess);
    }
    let _c = controller_in(dir.path(), Shared::default(), Arc::clone(&hardware)).await;
    let modes = hardware.compute_modes.lock().unwrap().clone();
    assert_eq!(modes.get(&gpu(2)), Some(&ComputeMode::Prohibited));
    assert_eq!(modes.get(&gpu(3)), Some(&ComputeMode::Default));
}

/// Issue 41: MPS on a GPU older than Volta has neither the client limits a share relies on nor
/// a protocol that leaves each container its own /dev/shm. A share of such a GPU, and an MPS
/// config on it, are refused naming the result and the GPU's compute capability; time slicing
/// and the whole GPU still prepare, and no daemon starts.
#[tokio::test]
async fn mps_on_a_gpu_older_than_volta_is_refused_naming_its_compute_capability() {
    let dir = tempfile::tempdir().unwrap();
    let mut devices = node_devices();
    if let NodeDevice::Gpu(g) = &mut devices[0] {
        // A Tesla P100's.
        g.raw.cuda_compute_capability_major = 6;
        g.raw.cuda_compute_capability_minor = 0;
    }
    let cluster = Shared::default();
    cluster.put(share_claim(
        "s",
        "us",
        dev(0),
        &format!("{SHARE}01"),
        "20Gi",
    ));
    cluster.put(with_configs(
        claim("m", "um", &[(DRIVER, NODE, dev(0))]),
        &[(
            "FromClaim",
            serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}}}),
        )],
    ));
    cluster.put(with_configs(
        claim("t", "ut", &[(DRIVER, NODE, dev(0))]),
        &[("FromClaim", time_slicing())],
    ));
    let c = controller_over(
        dir.path(),
        cluster,
        Arc::new(ScriptedHardware::default()),
        devices,
    )
    .await;
    for (name, uid) in [("s", "us"), ("m", "um")] {
        let r = c.prepare(vec![claim_ref(name, uid)]).await;
        let e = r[uid].as_ref().expect_err("refused").to_string();
        assert!(
            e.contains("status.allocation.devices.results[0]")
                && e.contains("compute capability 7.0 or higher")
                && e.contains("this GPU's is 6.0"),
            "{e}"
        );
    }
    assert!(daemons(dir.path()).is_empty());
    let r = c.prepare(vec![claim_ref("t", "ut")]).await;
    assert!(r["ut"].is_ok(), "{r:?}");
}
