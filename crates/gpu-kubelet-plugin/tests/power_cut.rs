//! A simulated power cut at every filesystem operation of a prepare/unprepare sequence: writes
//! not yet synced are lost (file contents until `fsync`, directory entries until the directory's
//! `fsync`). After each cut, the restarted controller must recover to a consistent state, and
//! repeating the kubelet's calls must end where an uninterrupted run ends. The power also fails
//! again at every operation of that recovery itself, and the claims include time-sliced ones
//! (a sharing setting on the GPU, which outlives the plugin: the model keeps the hardware across
//! restarts, as a crash of the plugin does) whose GPU settings must end as in the clean run, and
//! two shares of one GPU (consumable capacity) whose MPS daemon, a real process of the fake tool
//! that outlives the restarts as it would a plugin crash, must end running for the share that
//! stays and no other daemon running.
//! Where the cut falls between an in-place overwrite (a checkpoint slot) and its sync, the cut
//! is also taken with that file torn: the first half of the new bytes written, the rest old.

mod common;

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use dra_kubelet::Driver;
use dra_plugin::testing::PowerCutFs;
use gpu_kubelet_plugin::cdi::CdiWriter;
use gpu_kubelet_plugin::checkpoint::{CheckpointFile, ClaimState};
use gpu_kubelet_plugin::claims::{ClaimController, ControllerConfig, RecoveryReport};
use gpu_kubelet_plugin::storage::Fs;

const CDI: &str = "/run/cdi";
const CHECKPOINT: &str = "/var/lib/plugin/checkpoint.json";

async fn controller(
    fs: Arc<PowerCutFs>,
    cluster: &Shared,
    hardware: &Arc<ScriptedHardware>,
    mps: &Path,
) -> Result<ClaimController<Shared, ScriptedHardware>, String> {
    controller_reporting(fs, cluster, hardware, mps)
        .await
        .map(|(c, _)| c)
}

/// A controller on `fs` whose MPS daemons (the fake tool's processes, real: like the GPUs they
/// outlive a plugin crash) live under `mps`.
async fn controller_reporting(
    fs: Arc<PowerCutFs>,
    cluster: &Shared,
    hardware: &Arc<ScriptedHardware>,
    mps: &Path,
) -> Result<(ClaimController<Shared, ScriptedHardware>, RecoveryReport), String> {
    ClaimController::start(
        cluster.clone(),
        Arc::clone(hardware),
        ControllerConfig {
            driver_name: DRIVER.into(),
            node_name: NODE.into(),
            timeout: std::time::Duration::from_secs(5),
            boot_id: "boot".into(),
            sharing: true,
            mps: mps_control(mps),
            driver_edits: Default::default(),
            kernel_memory: None,
            claim_users: None,
            device_metadata: None,
            imex: None,
        },
        node_devices(),
        CdiWriter::new(fs.clone(), CDI, DRIVER),
        CheckpointFile::new(fs, CHECKPOINT),
    )
    .await
    .map_err(|e| e.to_string())
}

/// The kubelet's calls: prepare a, prepare b (2 GPUs), prepare s (time-sliced), unprepare a,
/// prepare c, prepare t (time-sliced), unprepare t, then shares of one GPU: prepare p, prepare
/// q, unprepare p (q keeps the GPU's MPS daemon).
async fn script(c: &ClaimController<Shared, ScriptedHardware>) {
    let _ = c.prepare(vec![claim_ref("a", "ua")]).await;
    let _ = c.prepare(vec![claim_ref("b", "ub")]).await;
    let _ = c.prepare(vec![claim_ref("s", "us")]).await;
    let _ = c.unprepare(vec![claim_ref("a", "ua")]).await;
    let _ = c.prepare(vec![claim_ref("c", "uc")]).await;
    let _ = c.prepare(vec![claim_ref("t", "ut")]).await;
    let _ = c.unprepare(vec![claim_ref("t", "ut")]).await;
    let _ = c.prepare(vec![claim_ref("p", "up")]).await;
    let _ = c.prepare(vec![claim_ref("q", "uq")]).await;
    let _ = c.unprepare(vec![claim_ref("p", "up")]).await;
}

fn time_slicing(interval: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}})
}

fn claims_cluster() -> Shared {
    let cluster = Shared::default();
    cluster.put(claim("a", "ua", &[(DRIVER, NODE, dev(0))]));
    cluster.put(claim(
        "b",
        "ub",
        &[(DRIVER, NODE, dev(1)), (DRIVER, NODE, dev(2))],
    ));
    cluster.put(claim("c", "uc", &[(DRIVER, NODE, dev(3))]));
    cluster.put(with_configs(
        claim("s", "us", &[(DRIVER, NODE, dev(4))]),
        &[("FromClaim", time_slicing("Long"))],
    ));
    cluster.put(with_configs(
        claim("t", "ut", &[(DRIVER, NODE, dev(5))]),
        &[("FromClaim", time_slicing("Short"))],
    ));
    let share = "00000000-0000-4000-8000-00000000000";
    cluster.put(share_claim("p", "up", dev(6), &format!("{share}1"), "20Gi"));
    cluster.put(share_claim("q", "uq", dev(6), &format!("{share}2"), "20Gi"));
    cluster
}

/// The MPS daemons under `mps` that answer (by directory name).
async fn running_daemons(mps: &Path) -> Vec<String> {
    let control = mps_control(mps);
    let mut running = Vec::new();
    for key in std::fs::read_dir(mps)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
    {
        if control.is_running(&key).await {
            running.push(key);
        }
    }
    running.sort();
    running
}

/// Stops every daemon under `mps` (the end of one simulated machine).
async fn stop_daemons(mps: &Path) {
    let control = mps_control(mps);
    for key in std::fs::read_dir(mps)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
    {
        control.stop(&key).await.expect("stopping a daemon");
    }
}

/// Each GPU's compute time slice as the hardware was last told (GPUs never set are absent;
/// `Default` is what a GPU had before any claim).
fn time_slices(hardware: &ScriptedHardware) -> BTreeMap<String, String> {
    let mut slices = BTreeMap::new();
    for call in hardware.calls.lock().unwrap().iter() {
        if let Some(rest) = call.strip_prefix("time-slice ")
            && let Some((gpu, slice)) = rest.split_once(' ')
        {
            slices.insert(gpu.to_owned(), slice.to_owned());
        }
    }
    slices.retain(|_, s| s != "Default");
    slices
}

/// Consistency after recovery: only completed claims, each with its spec; no other files.
async fn check_consistent(
    fs: &PowerCutFs,
    c: &ClaimController<Shared, ScriptedHardware>,
    cut: usize,
) {
    let prepared = c.prepared_claims().await;
    let mut want: Vec<String> = prepared
        .iter()
        .map(|u| format!("{DRIVER}-claim_{u}.json"))
        .collect();
    want.sort();
    let mut have = fs.files(Path::new(CDI));
    have.sort();
    assert_eq!(have, want, "cut {cut}: CDI specs vs prepared claims");
    let dir = fs.files(Path::new("/var/lib/plugin"));
    assert!(
        dir.iter().all(|f| !f.ends_with(".tmp")),
        "cut {cut}: temp files {dir:?}"
    );
}

fn lost() -> io::Error {
    io::Error::other("read-only view")
}

/// Read-only adapter so the checkpoint can be inspected without consuming the power budget.
#[derive(Debug)]
struct PowerCutView(Arc<PowerCutFs>);

impl Fs for PowerCutView {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.0.read(path)
    }
    fn write(&self, _: &Path, _: &[u8]) -> io::Result<()> {
        Err(lost())
    }
    fn overwrite(&self, _: &Path, _: &[u8]) -> io::Result<()> {
        Err(lost())
    }
    fn sync_file(&self, _: &Path) -> io::Result<()> {
        Err(lost())
    }
    fn rename(&self, _: &Path, _: &Path) -> io::Result<()> {
        Err(lost())
    }
    fn sync_dir(&self, _: &Path) -> io::Result<()> {
        Err(lost())
    }
    fn remove(&self, _: &Path) -> io::Result<()> {
        Err(lost())
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        self.0.list(dir)
    }
    fn create_dir_all(&self, _: &Path) -> io::Result<()> {
        Ok(())
    }
}

/// Restarts after a power cut (tearing files overwritten in place with `tear`), with the power
/// failing again after `budget` operations of the recovery (`None`: it holds); returns the
/// filesystem as the power left it and the controller if the start finished.
async fn restart(
    fs: &PowerCutFs,
    tear: bool,
    cluster: &Shared,
    hardware: &Arc<ScriptedHardware>,
    budget: Option<usize>,
    mps: &Path,
) -> (
    Arc<PowerCutFs>,
    Option<ClaimController<Shared, ScriptedHardware>>,
) {
    let after = fs.after_power_cut(tear);
    after.set_budget(budget);
    let after = Arc::new(after);
    let c = controller_reporting(after.clone(), cluster, hardware, mps)
        .await
        .ok()
        .map(|(c, report)| {
            // The checkpoint's stores are atomic: a power cut (torn slot included) never
            // leaves it unreadable, so recovery never falls back to rebuilding from CDI specs.
            assert_eq!(
                report.corrupt_checkpoint, None,
                "torn: {tear}, recovery budget {budget:?}"
            );
            c
        });
    (after, c)
}

#[tokio::test]
async fn a_power_cut_at_any_operation_recovers_and_converges_to_the_uninterrupted_result() {
    // The uninterrupted run: how many operations, and where it ends.
    let clean_fs = Arc::new(PowerCutFs::with_budget(None));
    let cluster = claims_cluster();
    let clean_hw = Arc::new(ScriptedHardware::default());
    let clean_mps = tempfile::tempdir().expect("tempdir");
    let clean = controller(clean_fs.clone(), &cluster, &clean_hw, clean_mps.path())
        .await
        .expect("start");
    script(&clean).await;
    let total_ops = clean_fs.ops();
    let final_claims = clean.prepared_claims().await;
    assert_eq!(final_claims, ["ub", "uc", "uq", "us"]);
    let final_daemons = running_daemons(clean_mps.path()).await;
    assert_eq!(final_daemons, [gpus()[6].raw.uuid.to_ascii_lowercase()]);
    stop_daemons(clean_mps.path()).await;
    let mut final_specs = clean_fs.files(Path::new(CDI));
    final_specs.sort();
    let final_slices = time_slices(&clean_hw);
    assert_eq!(
        final_slices,
        BTreeMap::from([(dev(4).to_owned(), "Long".to_owned())])
    );

    let mut recovered = 0;
    let mut recovery_cuts = 0;
    let mut torn_cuts = 0;
    for cut in 0..=total_ops {
        let fs = Arc::new(PowerCutFs::with_budget(Some(cut)));
        let cluster = claims_cluster();
        let hardware = Arc::new(ScriptedHardware::default());
        let mps = tempfile::tempdir().expect("tempdir");
        let mps = mps.path();
        if let Ok(c) = controller(fs.clone(), &cluster, &hardware, mps).await {
            script(&c).await;
        }
        let tears: &[bool] = if fs.could_tear() {
            torn_cuts += 1;
            &[false, true]
        } else {
            &[false]
        };
        for &tear in tears {
            // How many operations an undisturbed recovery from here makes.
            let (probe, _) = restart(&fs, tear, &cluster, &Arc::default(), None, mps).await;
            let recovery_ops = probe.ops();
            // Power returns; the recovery is cut at each of its operations (and at none):
            // after every such second cut, a third start must still recover and converge.
            for second in (0..recovery_ops).map(Some).chain([None]) {
                let hardware = Arc::new(ScriptedHardware {
                    calls: std::sync::Mutex::new(hardware.calls.lock().unwrap().clone()),
                    ..Default::default()
                });
                let (interrupted, c) = restart(&fs, tear, &cluster, &hardware, second, mps).await;
                let (after, c) = match (second, c) {
                    (None, Some(c)) => (interrupted, c),
                    (None, None) => panic!("cut {cut} (torn: {tear}): restart failed"),
                    (Some(_), _) => {
                        recovery_cuts += 1;
                        let (after, c) =
                            restart(&interrupted, tear, &cluster, &hardware, None, mps).await;
                        let c = c.unwrap_or_else(|| {
                            panic!(
                                "cut {cut} (torn: {tear}), then {second:?} into recovery: \
                                 restart failed"
                            )
                        });
                        (after, c)
                    }
                };
                let at = format!("cut {cut} (torn: {tear}), recovery cut {second:?}");
                check_consistent(&after, &c, cut).await;
                // No half states survive a restart.
                let ckpt = CheckpointFile::new(Arc::new(PowerCutView(after.clone())), CHECKPOINT)
                    .load()
                    .unwrap_or_else(|e| panic!("{at}: checkpoint unreadable after recovery: {e}"))
                    .unwrap_or_default();
                assert!(
                    ckpt.claims
                        .values()
                        .all(|r| r.state == ClaimState::PrepareCompleted),
                    "{at}: {:?}",
                    ckpt.claims
                );
                // The kubelet repeats its calls; the end state is the uninterrupted one.
                script(&c).await;
                assert_eq!(c.prepared_claims().await, final_claims, "{at}");
                let mut specs = after.files(Path::new(CDI));
                specs.sort();
                assert_eq!(specs, final_specs, "{at}");
                assert_eq!(
                    time_slices(&hardware),
                    final_slices,
                    "{at}: GPU time slices"
                );
                // The GPU's MPS daemon runs for q's share, and no other daemon.
                assert_eq!(
                    running_daemons(mps).await,
                    final_daemons,
                    "{at}: MPS daemons"
                );
                recovered += 1;
            }
        }
        stop_daemons(mps).await;
    }
    eprintln!(
        "power cut at each of {total_ops} operations ({torn_cuts} of them also with a torn \
         checkpoint slot), then at each operation of the recovery ({recovery_cuts} second \
         cuts): {recovered} recoveries, all consistent"
    );
    assert!(
        total_ops > 20,
        "the script exercises the filesystem ({total_ops} ops)"
    );
    assert!(recovery_cuts > 0, "some recoveries write and were cut");
    assert!(
        torn_cuts > 0,
        "some cuts fall inside an in-place checkpoint store"
    );
}
