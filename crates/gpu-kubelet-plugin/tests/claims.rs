//! The claim controller against an in-memory cluster and scriptable hardware: the edge cases and
//! failure modes the real API server and real GPUs make awkward to produce. The happy path over
//! the real API server is in tests/e2e; crashes are in tests/e2e/tests/fault_injection.rs.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use dra_kubelet::Driver;
use gpu_inventory::{FakeBackend, Topology};
use gpu_kubelet_plugin::cdi::CdiWriter;
use gpu_kubelet_plugin::checkpoint::CheckpointFile;
use gpu_kubelet_plugin::claims::{ClaimController, ControllerConfig, RecoveryReport};
use gpu_kubelet_plugin::hardware::{BackendHardware, Hardware, node_devices as catalogue};
use gpu_kubelet_plugin::storage::RealFs;
use k8s_openapi::api::resource::v1::ResourceClaim;

struct Fixture {
    dir: tempfile::TempDir,
    cluster: Shared,
    hardware: Arc<ScriptedHardware>,
    boot_id: String,
    timeout: Duration,
    /// The MPS control tool (the fake unless a test wraps it) and its command timeout.
    mps_binary: std::path::PathBuf,
    mps_timeout: Duration,
    /// The claim-user hook ([`gpu_kubelet_plugin::claim_users`]), when a test installs it.
    claim_users: Option<Arc<gpu_kubelet_plugin::claim_users::ClaimUsers>>,
    /// The device metadata writer, when a test turns it on.
    device_metadata: Option<Arc<gpu_kubelet_plugin::device_metadata::DeviceMetadata>>,
    /// The IMEX channels, when a test publishes them.
    imex: Option<gpu_inventory::imex::ImexChannels>,
}

type Controller = ClaimController<Shared, ScriptedHardware>;

impl Fixture {
    fn new(claims: Vec<ResourceClaim>) -> Self {
        let cluster = Shared::default();
        for c in claims {
            cluster.put(c);
        }
        Self {
            dir: tempfile::tempdir().unwrap(),
            cluster,
            hardware: Arc::default(),
            boot_id: "boot-1".into(),
            timeout: Duration::from_secs(5),
            mps_binary: drust_fakes::mps_control().to_owned(),
            mps_timeout: Duration::from_secs(10),
            claim_users: None,
            device_metadata: None,
            imex: None,
        }
    }

    fn config(&self) -> ControllerConfig {
        ControllerConfig {
            driver_name: DRIVER.into(),
            node_name: NODE.into(),
            timeout: self.timeout,
            boot_id: self.boot_id.clone(),
            sharing: true,
            mps: gpu_kubelet_plugin::mps::MpsControl {
                binary: self.mps_binary.clone(),
                start_timeout: self.mps_timeout,
                ..mps_control(&self.dir.path().join("mps"))
            },
            driver_edits: Default::default(),
            kernel_memory: None,
            claim_users: self.claim_users.clone(),
            device_metadata: self.device_metadata.clone(),
            imex: self.imex,
        }
    }

    fn cdi(&self) -> CdiWriter {
        CdiWriter::new(Arc::new(RealFs), self.dir.path().join("cdi"), DRIVER)
    }

    fn checkpoint(&self) -> CheckpointFile {
        CheckpointFile::new(Arc::new(RealFs), self.dir.path().join("checkpoint.json"))
    }

    async fn start(&self) -> (Controller, RecoveryReport) {
        ClaimController::start(
            self.cluster.clone(),
            Arc::clone(&self.hardware),
            self.config(),
            node_devices(),
            self.cdi(),
            self.checkpoint(),
        )
        .await
        .unwrap()
    }

    async fn controller(&self) -> Controller {
        self.start().await.0
    }

    fn cdi_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.dir.path().join("cdi"))
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}

#[tokio::test]
async fn prepare_is_idempotent_and_survives_a_restart_without_asking_the_api_server() {
    let f = Fixture::new(vec![claim(
        "two",
        "u2",
        &[(DRIVER, NODE, dev(1)), (DRIVER, NODE, dev(5))],
    )]);
    let first = f
        .controller()
        .await
        .prepare(vec![claim_ref("two", "u2")])
        .await;
    let devices = first["u2"].as_ref().expect("prepared").clone();
    assert_eq!(
        devices
            .iter()
            .map(|d| d.device_name.as_str())
            .collect::<Vec<_>>(),
        [dev(1), dev(5)]
    );
    assert_eq!(f.cluster.gets.load(Ordering::SeqCst), 1);

    let (restarted, report) = f.start().await;
    assert_eq!(report, RecoveryReport::default(), "nothing to reconcile");
    let again = restarted.prepare(vec![claim_ref("two", "u2")]).await;
    assert_eq!(again["u2"].as_ref().expect("prepared"), &devices);
    assert_eq!(
        f.cluster.gets.load(Ordering::SeqCst),
        1,
        "answered from the checkpoint"
    );
    assert_eq!(f.cdi_files(), ["gpu.example.com-claim_u2.json"]);
}

#[tokio::test]
async fn each_bad_claim_gets_its_own_error_naming_the_field_and_good_claims_still_prepare() {
    let f = Fixture::new(vec![
        claim("good", "u1", &[(DRIVER, NODE, dev(0))]),
        claim("unallocated", "u2", &[]),
        claim(
            "elsewhere",
            "u3",
            &[(DRIVER, "node-b", dev(0)), ("other.example.com", NODE, "x")],
        ),
        claim("ghost-device", "u4", &[(DRIVER, NODE, "gpu-99")]),
        claim("same-gpu", "u6", &[(DRIVER, NODE, dev(0))]),
    ]);
    let c = f.controller().await;
    assert!(c.prepare(vec![claim_ref("good", "u1")]).await["u1"].is_ok());
    let results = c
        .prepare(vec![
            claim_ref("unallocated", "u2"),
            claim_ref("elsewhere", "u3"),
            claim_ref("ghost-device", "u4"),
            claim_ref("missing", "u5"),
            claim_ref("good", "wrong-uid"),
            claim_ref("same-gpu", "u6"),
        ])
        .await;
    let err = |uid: &str| results[uid].as_ref().expect_err("must fail").to_string();
    for (uid, needles) in [
        ("u2", &["ns/unallocated", "status.allocation"][..]),
        (
            "u3",
            &["ns/elsewhere", "driver gpu.example.com", "pool node-a"][..],
        ),
        (
            "u4",
            &["ns/ghost-device", "results[0].device", "gpu-99"][..],
        ),
        ("u5", &["ns/missing", "not found"][..]),
        ("wrong-uid", &["ns/good", "metadata.uid", "\"u1\""][..]),
        (
            "u6",
            &["ns/same-gpu", "already prepared for claim ns/good (uid u1)"][..],
        ),
    ] {
        let e = err(uid);
        for n in needles {
            assert!(e.contains(n), "{uid}: {e:?} lacks {n:?}");
        }
    }
    // Only the good claim left anything behind, and it is intact.
    assert_eq!(f.cdi_files(), ["gpu.example.com-claim_u1.json"]);
    assert_eq!(c.prepared_claims().await, ["u1"]);
}

#[tokio::test]
async fn admin_access_may_share_a_device_that_another_claim_holds() {
    let f = Fixture::new(vec![
        claim("user", "u1", &[(DRIVER, NODE, dev(3))]),
        claim_with_admin("monitor", "u2", &[(DRIVER, NODE, dev(3))], true),
    ]);
    let c = f.controller().await;
    let r = c
        .prepare(vec![claim_ref("user", "u1"), claim_ref("monitor", "u2")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
}

#[tokio::test]
async fn unprepare_removes_what_prepare_made_and_unknown_claims_succeed() {
    let f = Fixture::new(vec![
        claim("a", "ua", &[(DRIVER, NODE, dev(2))]),
        claim("b", "ub", &[(DRIVER, NODE, dev(3))]),
    ]);
    let c = f.controller().await;
    let prepared = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    assert!(prepared.values().all(Result::is_ok));
    assert_eq!(f.cdi_files().len(), 2);
    let results = c
        .unprepare(vec![claim_ref("a", "ua"), claim_ref("never", "un")])
        .await;
    assert!(results.values().all(Result::is_ok), "{results:?}");
    assert_eq!(c.prepared_claims().await, ["ub"]);
    assert_eq!(f.cdi_files(), ["gpu.example.com-claim_ub.json"]);
    // Unprepared state is durable: a restart sees only b.
    assert_eq!(f.controller().await.prepared_claims().await, ["ub"]);
    assert!(
        f.hardware
            .calls
            .lock()
            .unwrap()
            .contains(&format!("unprepare {}", dev(2)))
    );
}

/// A PodGroup's claim (KEP-5729) is reserved for the PodGroup: its CDI spec runs the claim-user
/// hook for every container, so that usage can name the pods; a claim reserved for a pod does
/// not. Unprepare removes what the hook recorded.
#[tokio::test]
async fn a_pod_groups_claim_gets_the_claim_user_hook_and_unprepare_drops_its_records() {
    use gpu_kubelet_plugin::claim_users::{CLAIM_USER_COMMAND, ClaimUsers};
    use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;
    let mut group = claim("g", "ug", &[(DRIVER, NODE, dev(2))]);
    group.status.as_mut().unwrap().reserved_for = Some(vec![ResourceClaimConsumerReference {
        api_group: Some("scheduling.k8s.io".into()),
        resource: "podgroups".into(),
        name: "train".into(),
        uid: "pg-1".into(),
    }]);
    let mut pod = claim("p", "up", &[(DRIVER, NODE, dev(3))]);
    pod.status.as_mut().unwrap().reserved_for = Some(vec![ResourceClaimConsumerReference {
        api_group: None,
        resource: "pods".into(),
        name: "worker".into(),
        uid: "pod-1".into(),
    }]);
    let mut f = Fixture::new(vec![group, pod]);
    let users = Arc::new(ClaimUsers::new(
        f.dir.path().join("bin/drust-cdi-hook-x"),
        f.dir.path(),
    ));
    f.claim_users = Some(Arc::clone(&users));
    let c = f.controller().await;
    let r = c
        .prepare(vec![claim_ref("g", "ug"), claim_ref("p", "up")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let hooks = |uid: &str| -> Vec<serde_json::Value> {
        let path = f
            .dir
            .path()
            .join(format!("cdi/gpu.example.com-claim_{uid}.json"));
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        spec["containerEdits"]["hooks"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let group_hooks = hooks("ug");
    assert_eq!(group_hooks.len(), 1, "{group_hooks:?}");
    assert_eq!(group_hooks[0]["hookName"], "createRuntime");
    assert_eq!(group_hooks[0]["args"][1], CLAIM_USER_COMMAND);
    assert_eq!(group_hooks[0]["args"][3], "ug");
    assert!(hooks("up").is_empty(), "a pod's claim runs no hook");

    // What the hook would record as a container of the group starts; gone after unprepare.
    let state = serde_json::json!({"id": "c1", "annotations": {
        "io.kubernetes.cri.sandbox-namespace": "team",
        "io.kubernetes.cri.sandbox-name": "train-0",
        "io.kubernetes.cri.sandbox-uid": "pod-uid-0",
        "io.kubernetes.cri.container-name": "main",
    }});
    let args: Vec<String> = group_hooks[0]["args"].as_array().unwrap()[1..]
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    gpu_kubelet_plugin::claim_users::run_hook(&args, state.to_string().as_bytes()).unwrap();
    assert_eq!(users.recorded_claims().len(), 1);
    let r = c.unprepare(vec![claim_ref("g", "ug")]).await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    assert!(users.recorded_claims().is_empty());
}

/// Device metadata (KEP-5304): prepare writes one file per request naming its devices with
/// their published attributes, and the claim's CDI spec mounts it read-only where upstream's
/// reader looks (a generated claim: under its pod claim name); unprepare removes it.
#[tokio::test]
async fn prepare_writes_each_requests_device_metadata_and_mounts_it_and_unprepare_removes_it() {
    use gpu_kubelet_plugin::device_metadata::DeviceMetadata;
    let mut generated = claim(
        "train-0-gpus-abcde",
        "um",
        &[(DRIVER, NODE, dev(2)), (DRIVER, NODE, dev(3))],
    );
    generated.metadata.annotations = Some(std::collections::BTreeMap::from([(
        "resource.kubernetes.io/pod-claim-name".to_owned(),
        "gpus".to_owned(),
    )]));
    let mut f = Fixture::new(vec![generated]);
    let writer = Arc::new(DeviceMetadata::new(&f.dir.path().join("plugin"), DRIVER));
    f.device_metadata = Some(writer);
    let c = f.controller().await;
    let r = c.prepare(vec![claim_ref("train-0-gpus-abcde", "um")]).await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let host = f
        .dir
        .path()
        .join("plugin/dra-device-metadata/ns_train-0-gpus-abcde/gpus/metadata.json");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&host).unwrap()).unwrap();
    assert_eq!(doc["apiVersion"], "metadata.resource.k8s.io/v1alpha1");
    assert_eq!(doc["metadata"]["uid"], "um");
    assert_eq!(doc["podClaimName"], "gpus");
    let devices = doc["requests"][0]["devices"].as_array().unwrap();
    let names: Vec<&str> = devices
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [dev(2), dev(3)]);
    let gpu = &gpus()[2];
    assert_eq!(
        devices[0]["attributes"]["uuid"]["string"],
        gpu.raw.uuid.as_str()
    );
    assert!(devices[0]["attributes"]["resource.kubernetes.io/pcieRoot"]["string"].is_string());

    let spec_path = f.dir.path().join("cdi/gpu.example.com-claim_um.json");
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
    let mounts: Vec<(String, String)> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["containerEdits"]["mounts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|m| {
            (
                m["hostPath"].as_str().unwrap().to_owned(),
                m["containerPath"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        mounts,
        [(
            host.display().to_string(),
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/gpus/gpu.example.com-metadata.json".to_owned()
        )],
        "one mount, on the request's first device"
    );
    let r = c
        .unprepare(vec![claim_ref("train-0-gpus-abcde", "um")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    assert!(
        !host.exists()
            && !f
                .dir
                .path()
                .join("plugin/dra-device-metadata/ns_train-0-gpus-abcde")
                .exists()
    );
}

#[tokio::test]
async fn concurrent_prepares_of_the_same_claim_agree() {
    let f = Fixture::new(vec![claim("c", "uc", &[(DRIVER, NODE, dev(7))])]);
    let c = f.controller().await;
    let (a, b) = tokio::join!(
        c.prepare(vec![claim_ref("c", "uc")]),
        c.prepare(vec![claim_ref("c", "uc")])
    );
    assert_eq!(a["uc"].as_ref().ok(), b["uc"].as_ref().ok());
    assert_eq!(c.prepared_claims().await, ["uc"]);
    assert_eq!(f.cdi_files().len(), 1);
    let prepares = f
        .hardware
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.starts_with("prepare"))
        .count();
    assert_eq!(prepares, 1, "the GPU was prepared once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_gpu_delays_only_its_own_claim_which_misses_its_deadline_and_is_rolled_back() {
    let mut f = Fixture::new(vec![
        claim("stuck", "us", &[(DRIVER, NODE, dev(0))]),
        claim("fast", "uf", &[(DRIVER, NODE, dev(1))]),
    ]);
    // A deadline no prepare of a fake GPU comes near, and a stuck GPU whose prepare waits until
    // the test releases it: what follows holds however slow this machine is.
    f.timeout = Duration::from_secs(5);
    f.hardware.hold(dev(0));
    let c = f.controller().await;

    let (stuck, fast) = tokio::join!(
        c.prepare(vec![claim_ref("stuck", "us")]),
        c.prepare(vec![claim_ref("fast", "uf")])
    );
    assert!(
        fast["uf"].is_ok(),
        "the other GPU's claim went on: {fast:?}"
    );
    let err = stuck["us"].as_ref().expect_err("deadline").to_string();
    assert!(err.contains("did not finish within 5000 ms"), "{err}");
    let prepare = format!("prepare {}", dev(0));
    assert!(
        !f.hardware.calls.lock().unwrap().contains(&prepare),
        "answered at the deadline, while the stuck GPU's prepare still ran"
    );

    // The rollback waits for the stuck action, then undoes it; a retry then succeeds.
    f.hardware.release();
    let undo = format!("unprepare {}", dev(0));
    let started = Instant::now();
    while !f.hardware.calls.lock().unwrap().contains(&undo) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no rollback of the stuck prepare"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A retry right after the undo may still find the rollback finishing: retried until then.
    let retried = loop {
        let r = c.prepare(vec![claim_ref("stuck", "us")]).await;
        if r["us"].is_ok() || started.elapsed() > Duration::from_secs(120) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(retried["us"].is_ok(), "{retried:?}");
    let calls = f.hardware.calls.lock().unwrap().clone();
    let first_undo = calls
        .iter()
        .position(|c| *c == format!("unprepare {}", dev(0)));
    assert!(first_undo.is_some(), "rolled back: {calls:?}");
    assert_eq!(f.cdi_files().len(), 2);
}

#[tokio::test]
async fn a_failed_hardware_action_rolls_back_everything_the_claim_made() {
    let f = Fixture::new(vec![claim(
        "half",
        "uh",
        &[(DRIVER, NODE, dev(2)), (DRIVER, NODE, dev(6))],
    )]);
    f.hardware.failing.lock().unwrap().insert(dev(6).into());
    let c = f.controller().await;
    let r = c.prepare(vec![claim_ref("half", "uh")]).await;
    assert!(
        r["uh"]
            .as_ref()
            .expect_err("fails")
            .to_string()
            .contains(dev(6))
    );
    assert!(c.prepared_claims().await.is_empty());
    assert!(f.cdi_files().is_empty());
    let calls = f.hardware.calls.lock().unwrap().clone();
    assert!(
        calls.contains(&format!("unprepare {}", dev(2))),
        "{calls:?}"
    );
}

#[tokio::test]
async fn start_drops_claims_of_a_previous_boot_regenerates_lost_specs_and_removes_orphans() {
    let mut f = Fixture::new(vec![
        claim("a", "ua", &[(DRIVER, NODE, dev(0))]),
        claim("b", "ub", &[(DRIVER, NODE, dev(1))]),
    ]);
    let c = f.controller().await;
    assert!(
        c.prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
            .await
            .values()
            .all(Result::is_ok)
    );
    drop(c);

    // The runtime's CDI dir lost a spec; a crash left an orphan spec and a temp file.
    let cdi = f.dir.path().join("cdi");
    std::fs::remove_file(cdi.join("gpu.example.com-claim_ua.json")).unwrap();
    std::fs::write(cdi.join("gpu.example.com-claim_orphan.json"), b"{}").unwrap();
    std::fs::write(cdi.join(".gpu.example.com-claim_ub.json.tmp"), b"{").unwrap();
    std::fs::write(cdi.join("other-vendor.json"), b"{}").unwrap();
    let (_, report) = f.start().await;
    assert_eq!(report.regenerated, ["ua"]);
    assert_eq!(report.orphans_removed.len(), 2, "{report:?}");
    assert_eq!(
        f.cdi_files(),
        [
            "gpu.example.com-claim_ua.json",
            "gpu.example.com-claim_ub.json",
            "other-vendor.json"
        ]
    );

    // After a reboot, every claim is dropped so the kubelet prepares it again.
    f.boot_id = "boot-2".into();
    let (c, report) = f.start().await;
    assert_eq!(report.previous_boot, ["ua", "ub"]);
    assert!(c.prepared_claims().await.is_empty());
    assert_eq!(f.cdi_files(), ["other-vendor.json"]);
}

#[tokio::test]
async fn a_corrupt_checkpoint_is_rebuilt_from_cdi_specs_and_the_api_server_with_a_warning() {
    let f = Fixture::new(vec![
        claim("kept", "uk", &[(DRIVER, NODE, dev(4))]),
        claim("deleted", "ud", &[(DRIVER, NODE, dev(5))]),
        claim("unplannable", "uu", &[(DRIVER, NODE, dev(6))]),
    ]);
    let c = f.controller().await;
    assert!(
        c.prepare(vec![
            claim_ref("kept", "uk"),
            claim_ref("deleted", "ud"),
            claim_ref("unplannable", "uu")
        ])
        .await
        .values()
        .all(Result::is_ok)
    );
    drop(c);
    f.cluster.claims.lock().unwrap().remove("ns/deleted");
    // A claim this build cannot plan now (a config it refuses) may still have running pods:
    // it is kept as its CDI spec shows, never dropped with its spec.
    f.cluster.put(with_configs(
        claim("unplannable", "uu", &[(DRIVER, NODE, dev(6))]),
        &[(
            "FromClaim",
            serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1", "kind": "Bogus"}),
        )],
    ));
    // Both slots damaged (one alone is a torn store, recovered from the other).
    for slot in f.checkpoint().slot_paths() {
        std::fs::write(slot, b"{\"version\":2,\"chec").unwrap();
    }

    let (c, report) = f.start().await;
    assert!(report.corrupt_checkpoint.is_some());
    assert_eq!(report.rebuilt, ["uk", "uu"]);
    assert_eq!(c.prepared_claims().await, ["uk", "uu"]);
    assert_eq!(
        f.cdi_files(),
        [
            "gpu.example.com-claim_uk.json",
            "gpu.example.com-claim_uu.json"
        ]
    );
    let warnings = f.cluster.warnings.lock().unwrap().clone();
    assert!(
        warnings[0].starts_with("CheckpointRecovered: checkpoint"),
        "{warnings:?}"
    );
    assert!(f.dir.path().join("checkpoint.json.corrupt").exists());
    // The rebuilt claim answers like before, from the new checkpoint.
    let r = c.prepare(vec![claim_ref("kept", "uk")]).await;
    assert_eq!(r["uk"].as_ref().expect("prepared")[0].device_name, dev(4));
}

/// Issue 41, defect 13: a checkpoint damaged across a reboot (the CDI directory persistent) used
/// to be rebuilt stamped with the new boot, so the previous boot's claims were kept and revived
/// though their devices were reset. The last start's boot is recorded beside the checkpoint;
/// the rebuilt claims carry it and are released as any previous boot's are.
#[tokio::test]
async fn a_checkpoint_damaged_across_a_reboot_releases_the_previous_boots_claims() {
    let mut f = Fixture::new(vec![
        claim("a", "ua", &[(DRIVER, NODE, dev(1))]),
        claim("b", "ub", &[(DRIVER, NODE, dev(2))]),
    ]);
    let c = f.controller().await;
    let r = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    drop(c);
    for slot in f.checkpoint().slot_paths() {
        std::fs::write(slot, b"{\"version\":2,\"chec").unwrap();
    }
    f.boot_id = "boot-2".into();
    let (c, report) = f.start().await;
    assert!(report.corrupt_checkpoint.is_some());
    assert_eq!(report.previous_boot, ["ua", "ub"], "{report:?}");
    assert!(c.prepared_claims().await.is_empty());
    assert!(f.cdi_files().is_empty(), "{:?}", f.cdi_files());
    // This boot's start is recorded: a damage now keeps what this boot prepared.
    let r = c.prepare(vec![claim_ref("a", "ua")]).await;
    assert!(r["ua"].is_ok(), "{r:?}");
    drop(c);
    for slot in f.checkpoint().slot_paths() {
        std::fs::write(slot, b"{\"version\":2,\"chec").unwrap();
    }
    let (c, report) = f.start().await;
    assert_eq!(report.rebuilt, ["ua"]);
    assert!(report.previous_boot.is_empty(), "{report:?}");
    assert_eq!(c.prepared_claims().await, ["ua"]);
}

#[tokio::test]
async fn claims_that_vanished_from_the_api_server_are_unprepared() {
    let f = Fixture::new(vec![
        claim("live", "ul", &[(DRIVER, NODE, dev(0))]),
        claim("gone", "ug", &[(DRIVER, NODE, dev(1))]),
        claim("recreated", "ur", &[(DRIVER, NODE, dev(2))]),
    ]);
    let c = f.controller().await;
    let all = vec![
        claim_ref("live", "ul"),
        claim_ref("gone", "ug"),
        claim_ref("recreated", "ur"),
    ];
    assert!(c.prepare(all).await.values().all(Result::is_ok));
    f.cluster.claims.lock().unwrap().remove("ns/gone");
    f.cluster
        .put(claim("recreated", "ur-2", &[(DRIVER, NODE, dev(2))]));
    let mut released = c.unprepare_stale().await;
    released.sort();
    assert_eq!(released, ["ug", "ur"]);
    assert_eq!(c.prepared_claims().await, ["ul"]);
}

#[tokio::test]
async fn the_wrong_gpu_or_a_missing_device_node_is_refused_at_prepare() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for n in [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia0",
        "nvidia1",
    ] {
        std::fs::write(dev.join(n), b"").unwrap();
    }
    // The hardware now reports GPU 1 with another UUID than was published.
    let mut now = topology();
    now.gpus[1].uuid = "GPU-00000000-0000-0000-0000-000000000001".into();
    let hw = BackendHardware::new(Arc::new(FakeBackend::new(now)), dir.path(), dir.path());
    let published = node_devices();
    assert!(hw.prepare(&published[0]).is_ok());
    let wrong = hw
        .prepare(&published[1])
        .expect_err("swapped GPU")
        .to_string();
    assert!(
        wrong.contains("refusing to inject the wrong GPU"),
        "{wrong}"
    );
    let missing = hw
        .prepare(&published[2])
        .expect_err("no /dev/nvidia2")
        .to_string();
    assert!(missing.contains("/dev/nvidia2 does not exist"), "{missing}");
}

/// In the chart's pod the host's `/dev` is mounted at `/host/dev` (`--dev-root=/host`), but the
/// container runtime reads CDI specs on the host: their `hostPath` must name the host's path,
/// never the plugin container's.
#[test]
fn cdi_host_paths_name_the_hosts_dev_root_not_the_plugin_containers() {
    let dir = tempfile::tempdir().unwrap();
    let backend = || Arc::new(FakeBackend::new(topology()));
    // The plugin checks nodes under its own mount, the host has them at /dev.
    let in_container =
        BackendHardware::new(backend(), dir.path(), dir.path()).with_host_dev_root("/");
    assert_eq!(in_container.host_path("/dev/nvidia0"), None);
    // A test host whose dev nodes live under a temp dir on the host.
    let test_host =
        BackendHardware::new(backend(), dir.path(), dir.path()).with_host_dev_root("/srv/node-0");
    assert_eq!(
        test_host.host_path("/dev/nvidia0").as_deref(),
        Some("/srv/node-0/dev/nvidia0")
    );
    // Without a host root, the plugin's own root is the host's (a plugin run on the host).
    let on_host = BackendHardware::new(backend(), dir.path(), dir.path());
    assert_eq!(
        on_host.host_path("/dev/nvidiactl"),
        Some(dir.path().join("dev/nvidiactl").display().to_string())
    );
}

/// Prepares, on the fake DGX A100's first existing MIG device (with the driver's capability
/// table and device nodes in place), the claim `claim` makes of that device's name; returns the
/// device, its parent's minor and the claim's CDI spec, the MPS root beside it.
async fn prepare_existing_mig(
    claim: impl FnOnce(&str) -> ResourceClaim,
) -> (
    gpu_inventory::MigDevice,
    u32,
    serde_json::Value,
    tempfile::TempDir,
) {
    let root = tempfile::tempdir().unwrap();
    let topology = Topology::from_file(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/topologies/dgx-a100-mig.yaml"),
    )
    .unwrap();
    let inventory = gpu_inventory::discover(&FakeBackend::new(topology.clone())).unwrap();
    let mig = inventory.mig_devices[0].clone();
    let parent = inventory
        .gpus
        .iter()
        .find(|g| g.name == mig.parent)
        .unwrap()
        .clone();
    let (gi, ci) = mig.instance_ids.unwrap();
    // What the driver shows on such a node: the capability table and its device nodes.
    let caps = root.path().join("driver/nvidia-caps");
    std::fs::create_dir_all(&caps).unwrap();
    let minor = parent.raw.minor;
    std::fs::write(
        caps.join("mig-minors"),
        format!(
            "config 1\nmonitor 2\ngpu{minor}/gi{gi}/access 21\ngpu{minor}/gi{gi}/ci{ci}/access 22\n"
        ),
    )
    .unwrap();
    let dev = root.path().join("dev");
    std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
    for n in [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        &format!("nvidia{minor}"),
        "nvidia-caps/nvidia-cap21",
        "nvidia-caps/nvidia-cap22",
    ] {
        std::fs::write(dev.join(n), b"").unwrap();
    }

    let devices = catalogue(&inventory, gpu_inventory::MigStrategy::Existing);
    let f = Fixture::new(vec![claim(mig.name.as_str())]);
    let hw = Arc::new(BackendHardware::new(
        Arc::new(FakeBackend::new(topology)),
        root.path(),
        root.path(),
    ));
    let (c, _) = ClaimController::start(
        f.cluster.clone(),
        hw,
        f.config(),
        devices.values().cloned(),
        f.cdi(),
        f.checkpoint(),
    )
    .await
    .unwrap();
    let r = c.prepare(vec![claim_ref("slice", "um")]).await;
    assert!(r["um"].is_ok(), "{r:?}");
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(f.dir.path().join("cdi/gpu.example.com-claim_um.json")).unwrap(),
    )
    .unwrap();
    assert!(c.unprepare(vec![claim_ref("slice", "um")]).await["um"].is_ok());
    (mig, minor, spec, f.dir)
}

#[tokio::test]
async fn an_existing_mig_device_is_prepared_with_its_capability_nodes() {
    let (mig, minor, spec, _dir) =
        prepare_existing_mig(|device| claim("slice", "um", &[(DRIVER, NODE, device)])).await;
    let nodes: Vec<&str> = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["path"].as_str())
        .collect();
    assert_eq!(
        nodes,
        [
            format!("/dev/nvidia{minor}"),
            "/dev/nvidia-caps/nvidia-cap21".into(),
            "/dev/nvidia-caps/nvidia-cap22".into()
        ]
    );
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        gpu_kubelet_plugin::claims::device_env(&mig.name, &mig.uuid.clone().unwrap()),
        "the device's own edits name it"
    );
    assert_eq!(
        spec["containerEdits"]["env"][0],
        "NVIDIA_VISIBLE_DEVICES=void"
    );
}

/// A share's metadata (KEP-5304) names its GPU with the GPU's attributes, as a whole GPU's
/// does: upstream's `Device` has no share ID, and each share's claim has its own file.
#[tokio::test]
async fn a_shares_device_metadata_names_its_gpu_and_each_share_has_its_own_file() {
    use gpu_kubelet_plugin::device_metadata::DeviceMetadata;
    let mut f = Fixture::new(vec![
        share_claim(
            "half-a",
            "ua",
            dev(2),
            "00000000-0000-4000-8000-00000000000a",
            "20Gi",
        ),
        share_claim(
            "half-b",
            "ub",
            dev(2),
            "00000000-0000-4000-8000-00000000000b",
            "20Gi",
        ),
    ]);
    f.device_metadata = Some(Arc::new(DeviceMetadata::new(
        &f.dir.path().join("plugin"),
        DRIVER,
    )));
    let c = f.controller().await;
    let r = c
        .prepare(vec![claim_ref("half-a", "ua"), claim_ref("half-b", "ub")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let gpu = &gpus()[2];
    for (name, uid) in [("half-a", "ua"), ("half-b", "ub")] {
        let path = f.dir.path().join(format!(
            "plugin/dra-device-metadata/ns_{name}/gpus/metadata.json"
        ));
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(doc["metadata"]["uid"], uid);
        let devices = doc["requests"][0]["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 1, "{doc}");
        assert_eq!(devices[0]["name"], dev(2));
        assert_eq!(
            devices[0]["attributes"]["uuid"]["string"],
            gpu.raw.uuid.as_str()
        );
    }
    let r = c
        .unprepare(vec![claim_ref("half-a", "ua"), claim_ref("half-b", "ub")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let left = std::fs::read_dir(f.dir.path().join("plugin/dra-device-metadata"))
        .map(Iterator::count)
        .unwrap_or(0);
    assert_eq!(left, 0, "every share's file removed");
}

/// A share of an existing MIG device (fractional GPUs): the MIG device's own nodes, and its
/// share limits under the MIG device's own daemon (keyed by the MIG UUID).
#[tokio::test]
async fn a_share_of_an_existing_mig_device_runs_under_that_mig_devices_daemon() {
    let (mig, minor, spec, dir) = prepare_existing_mig(|device| {
        share_claim(
            "slice",
            "um",
            device,
            "00000000-0000-4000-8000-000000000001",
            "4Gi",
        )
    })
    .await;
    let edits = &spec["devices"][0]["containerEdits"];
    let env: Vec<&str> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        env.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M"),
        "{env:?}"
    );
    let key = mig.uuid.clone().unwrap().to_ascii_lowercase();
    let pipe = edits["mounts"][0]["hostPath"].as_str().unwrap();
    assert!(pipe.ends_with(&format!("mps/{key}/pipe")), "{pipe}");
    // Issue 41: the pipe directory, and again read-only as the share's mark; the container
    // keeps its own /dev/shm.
    let mounts: Vec<(&str, &str)> = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["hostPath"].as_str().unwrap(),
                m["containerPath"].as_str().unwrap(),
            )
        })
        .collect();
    let mark = format!("{}/um", gpu_kubelet_plugin::mps::SHARE_MARK_DIR);
    assert_eq!(
        mounts,
        [(pipe, "/run/nvidia-mps"), (pipe, mark.as_str())],
        "{}",
        edits["mounts"]
    );
    assert_eq!(edits["mounts"][1]["options"][1], "ro");
    assert_eq!(
        edits["deviceNodes"][0]["path"],
        format!("/dev/nvidia{minor}").as_str()
    );
    // The daemon served the MIG device and is gone with its only share.
    assert!(!dir.path().join("mps").join(&key).exists());
}

/// Counts checkpoint stores (syncs of a checkpoint slot) on the real filesystem.
#[derive(Debug, Default)]
struct CountingFs(std::sync::atomic::AtomicUsize);

impl gpu_kubelet_plugin::storage::Fs for CountingFs {
    fn read(&self, p: &std::path::Path) -> std::io::Result<Vec<u8>> {
        RealFs.read(p)
    }
    fn write(&self, p: &std::path::Path, b: &[u8]) -> std::io::Result<()> {
        RealFs.write(p, b)
    }
    fn overwrite(&self, p: &std::path::Path, b: &[u8]) -> std::io::Result<()> {
        RealFs.overwrite(p, b)
    }
    fn sync_file(&self, p: &std::path::Path) -> std::io::Result<()> {
        if p.ends_with("checkpoint.json") || p.ends_with("checkpoint.b.json") {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        RealFs.sync_file(p)
    }
    fn rename(&self, from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
        RealFs.rename(from, to)
    }
    fn sync_dir(&self, d: &std::path::Path) -> std::io::Result<()> {
        RealFs.sync_dir(d)
    }
    fn remove(&self, p: &std::path::Path) -> std::io::Result<()> {
        RealFs.remove(p)
    }
    fn list(&self, d: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
        RealFs.list(d)
    }
    fn create_dir_all(&self, d: &std::path::Path) -> std::io::Result<()> {
        RealFs.create_dir_all(d)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_share_checkpoint_writes_and_all_of_them_are_durable() {
    let claims: Vec<ResourceClaim> = (0..8)
        .map(|i| {
            claim(
                &format!("c{i}"),
                &format!("u{i}"),
                &[(DRIVER, NODE, dev(i))],
            )
        })
        .collect();
    let f = Fixture::new(claims);
    let fs = Arc::new(CountingFs::default());
    let (c, _) = ClaimController::start(
        f.cluster.clone(),
        Arc::clone(&f.hardware),
        f.config(),
        node_devices(),
        CdiWriter::new(fs.clone(), f.dir.path().join("cdi"), DRIVER),
        CheckpointFile::new(fs.clone(), f.dir.path().join("checkpoint.json")),
    )
    .await
    .unwrap();
    let at_start = fs.0.load(Ordering::SeqCst);
    let refs: Vec<_> = (0..8)
        .map(|i| claim_ref(&format!("c{i}"), &format!("u{i}")))
        .collect();
    let r = c.prepare(refs).await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let writes = fs.0.load(Ordering::SeqCst) - at_start;
    assert!(
        writes < 16,
        "8 claims x 2 phases took {writes} checkpoint writes"
    );
    // Every claim is durable: a restart from the file sees all eight.
    assert_eq!(f.controller().await.prepared_claims().await.len(), 8);
}

fn time_slicing(interval: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}})
}

fn mps(pct: u32, limit: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": pct,
                                               "defaultPinnedDeviceMemoryLimit": limit}}})
}

#[tokio::test]
async fn time_slicing_from_the_claim_overrides_the_class_and_is_undone_at_unprepare() {
    let f = Fixture::new(vec![with_configs(
        claim("shared", "u1", &[(DRIVER, NODE, dev(2))]),
        &[
            ("FromClass", time_slicing("Short")),
            ("FromClaim", time_slicing("Long")),
        ],
    )]);
    let c = f.controller().await;
    c.prepare(vec![claim_ref("shared", "u1")]).await["u1"]
        .as_ref()
        .expect("prepared");
    let record = serde_json::to_string(&f.checkpoint().load().expect("cp")).expect("json");
    assert!(record.contains(r#""interval":"Long""#), "{record}");
    c.unprepare(vec![claim_ref("shared", "u1")]).await["u1"]
        .as_ref()
        .expect("unprepared");
    let calls = f.hardware.calls.lock().unwrap().clone();
    let gpu = dev(2);
    assert_eq!(
        calls,
        [
            format!("prepare {gpu}"),
            format!("time-slice {gpu} Long"),
            format!("time-slice {gpu} Default"),
            format!("unprepare {gpu}"),
        ]
    );
}

/// An admin-access claim (a monitor) on a GPU another claim time-slices leaves the GPU's
/// sharing alone, at prepare and at unprepare, whatever config its class or claim carries; no
/// MPS daemon is started for it either.
#[tokio::test]
async fn an_admin_access_claim_never_changes_or_resets_the_gpus_sharing() {
    let f = Fixture::new(vec![
        with_configs(
            claim("user", "u1", &[(DRIVER, NODE, dev(3))]),
            &[("FromClaim", time_slicing("Long"))],
        ),
        with_configs(
            claim_with_admin("monitor", "u2", &[(DRIVER, NODE, dev(3))], true),
            &[("FromClass", time_slicing("Short"))],
        ),
        with_configs(
            claim_with_admin("monitor-mps", "u3", &[(DRIVER, NODE, dev(3))], true),
            &[("FromClaim", mps(30, "1Gi"))],
        ),
    ]);
    let c = f.controller().await;
    let r = c
        .prepare(vec![
            claim_ref("user", "u1"),
            claim_ref("monitor", "u2"),
            claim_ref("monitor-mps", "u3"),
        ])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let r = c
        .unprepare(vec![
            claim_ref("monitor", "u2"),
            claim_ref("monitor-mps", "u3"),
        ])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let gpu = dev(3);
    let slices: Vec<String> = f
        .hardware
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.starts_with("time-slice"))
        .cloned()
        .collect();
    assert_eq!(slices, [format!("time-slice {gpu} Long")]);
    assert!(!f.dir.path().join("mps/u3").exists(), "no MPS daemon");
}

#[tokio::test]
async fn an_mps_claim_gets_its_own_daemon_with_limits_and_the_cdi_edits_to_reach_it() {
    let mut f = Fixture::new(vec![with_configs(
        claim(
            "mps",
            "u1",
            &[(DRIVER, NODE, dev(0)), (DRIVER, NODE, dev(1))],
        ),
        &[("FromClaim", mps(30, "8Gi"))],
    )]);
    // The fake daemon is a Python script; leave room for a loaded machine.
    f.timeout = Duration::from_secs(30);
    let c = f.controller().await;
    c.prepare(vec![claim_ref("mps", "u1")]).await["u1"]
        .as_ref()
        .expect("prepared");
    let mps_dir = f.dir.path().join("mps/u1");
    let log = std::fs::read_to_string(mps_dir.join("log/control.log")).expect("daemon log");
    let uuids: Vec<String> = gpus()[..2].iter().map(|g| g.raw.uuid.clone()).collect();
    assert!(
        log.contains(&format!("CUDA_VISIBLE_DEVICES={}", uuids.join(","))),
        "{log}"
    );
    assert!(
        log.contains("set_default_active_thread_percentage 30"),
        "{log}"
    );
    assert!(
        log.contains("set_default_device_pinned_mem_limit 0 8192M"),
        "{log}"
    );
    assert!(
        log.contains("set_default_device_pinned_mem_limit 1 8192M"),
        "{log}"
    );
    let spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(f.dir.path().join("cdi").join(&f.cdi_files()[0])).expect("spec"),
    )
    .expect("json");
    // Each MPS device's edits reach the daemon; the claim-wide edits do not.
    for edits in spec["devices"].as_array().expect("devices") {
        let edits = &edits["containerEdits"];
        assert!(
            edits["env"]
                .as_array()
                .expect("env")
                .contains(&serde_json::json!(
                    "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps"
                )),
            "{edits}"
        );
        assert_eq!(
            edits["mounts"][0]["hostPath"],
            mps_dir.join("pipe").display().to_string()
        );
    }
    assert!(
        !spec["containerEdits"].to_string().contains("MPS")
            && !spec["containerEdits"].to_string().contains("/mps/"),
        "{}",
        spec["containerEdits"]
    );

    // A restarted plugin finds the daemon alive and leaves it be.
    let (restarted, report) = f.start().await;
    assert!(report.mps_restarted.is_empty(), "{report:?}");
    restarted.unprepare(vec![claim_ref("mps", "u1")]).await["u1"]
        .as_ref()
        .expect("unprepared");
    assert!(
        !mps_dir.exists(),
        "daemon stopped and its directories removed"
    );
}

/// NVIDIA's quickstart claim: a time-sliced request and an MPS request, each with its own
/// config. Only the MPS request's device reaches the claim's daemon: a container of the
/// time-sliced request sees no pipe directory, no shared memory and no MPS variable, at device
/// or claim level.
#[tokio::test]
async fn a_time_sliced_request_beside_an_mps_request_gets_none_of_its_mps_edits() {
    let mut rc = claim(
        "quickstart",
        "u1",
        &[(DRIVER, NODE, dev(0)), (DRIVER, NODE, dev(1))],
    );
    let devices = rc
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .expect("allocated");
    let results = devices.results.as_mut().expect("results");
    results[0].request = "ts-gpu".into();
    results[1].request = "mps-gpu".into();
    let config = |request: &str, parameters: serde_json::Value| {
        k8s_openapi::api::resource::v1::DeviceAllocationConfiguration {
            source: "FromClaim".into(),
            requests: Some(vec![request.into()]),
            opaque: Some(k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration {
                driver: DRIVER.into(),
                parameters: k8s_openapi::apimachinery::pkg::runtime::RawExtension(parameters),
            }),
        }
    };
    devices.config = Some(vec![
        config("ts-gpu", time_slicing("Long")),
        config("mps-gpu", mps(50, "10Gi")),
    ]);
    let mut f = Fixture::new(vec![rc]);
    f.timeout = Duration::from_secs(30);
    let c = f.controller().await;
    c.prepare(vec![claim_ref("quickstart", "u1")]).await["u1"]
        .as_ref()
        .expect("prepared");
    let spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(f.dir.path().join("cdi").join(&f.cdi_files()[0])).expect("spec"),
    )
    .expect("json");
    let device = |name: &str| {
        spec["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .find(|d| d["name"].as_str().is_some_and(|n| n.ends_with(name)))
            .map(|d| d["containerEdits"].clone())
            .unwrap_or_else(|| panic!("no CDI device {name} in {spec}"))
    };
    let (ts, mps) = (device(dev(0)), device(dev(1)));
    let mps_dir = f.dir.path().join("mps/u1");
    assert!(
        !ts.to_string().contains("MPS") && ts["mounts"].is_null(),
        "the time-sliced device's edits: {ts}"
    );
    assert!(
        !spec["containerEdits"].to_string().contains("MPS")
            && !spec["containerEdits"]
                .to_string()
                .contains(&mps_dir.display().to_string()),
        "claim-wide edits: {}",
        spec["containerEdits"]
    );
    assert!(
        mps.to_string()
            .contains("CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps")
            && mps["mounts"][0]["hostPath"] == mps_dir.join("pipe").display().to_string(),
        "the MPS device's edits: {mps}"
    );
    c.unprepare(vec![claim_ref("quickstart", "u1")]).await["u1"]
        .as_ref()
        .expect("unprepared");
}

/// A control command that gets no answer in time (a busy node) is no evidence that a daemon
/// died: neither start-up recovery nor the periodic check quits, replaces or starts a second
/// daemon on it. A daemon confirmed dead is started again in the same directories, so the bind
/// mounts running containers hold (the pipe directory, by inode) reach the new one.
#[tokio::test]
async fn a_slow_daemon_is_never_replaced_and_a_dead_one_restarts_where_containers_look() {
    use std::os::unix::fs::MetadataExt;
    let mut f = Fixture::new(vec![with_configs(
        claim("mps", "u1", &[(DRIVER, NODE, dev(0))]),
        &[("FromClaim", mps(50, "1Gi"))],
    )]);
    f.timeout = Duration::from_secs(30);
    // The fake tool, hung (as on a node whose driver is busy) while `hang` exists.
    let hang = f.dir.path().join("hang");
    let tool = f.dir.path().join("mps-control");
    std::fs::write(
        &tool,
        format!(
            "#!/bin/sh\n[ -e '{}' ] && exec sleep 3600\nexec '{}' \"$@\"\n",
            hang.display(),
            drust_fakes::mps_control().display()
        ),
    )
    .expect("wrapper");
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    f.mps_binary = tool;
    let c = f.controller().await;
    c.prepare(vec![claim_ref("mps", "u1")]).await["u1"]
        .as_ref()
        .expect("prepared");
    let mps_dir = f.dir.path().join("mps/u1");
    let pipe_inode = || {
        std::fs::metadata(mps_dir.join("pipe"))
            .expect("pipe dir")
            .ino()
    };
    let before = pipe_inode();
    let starts = || {
        std::fs::read_to_string(mps_dir.join("log/control.log"))
            .expect("log")
            .lines()
            .filter(|l| l.starts_with("start "))
            .count()
    };
    assert_eq!(starts(), 1);

    std::fs::write(&hang, "").expect("hang");
    f.mps_timeout = Duration::from_millis(500);
    let (restarted, report) = f.start().await;
    assert!(report.mps_restarted.is_empty(), "{report:?}");
    assert!(restarted.restart_dead_daemons().await.is_empty());
    std::fs::remove_file(&hang).expect("unhang");
    let control = mps_control(&f.dir.path().join("mps"));
    assert!(control.is_running("u1").await, "the daemon still runs");
    let log = std::fs::read_to_string(mps_dir.join("log/control.log")).expect("log");
    assert!(
        starts() == 1 && !log.contains("quit"),
        "a slow answer quit or replaced the daemon: {log}"
    );

    // Dead for sure: started again (by the check or by the recovery retry), same directories.
    quit_daemon(&control, "u1").await;
    restarted.restart_dead_daemons().await;
    assert!(control.is_running("u1").await);
    assert_eq!(starts(), 2);
    assert_eq!(pipe_inode(), before, "the pipe directory was recreated");
    restarted.unprepare(vec![claim_ref("mps", "u1")]).await["u1"]
        .as_ref()
        .expect("unprepared");
    assert!(!mps_dir.exists());
}

/// Stops claim `uid`'s MPS daemon behind the plugin's back (its own `quit` command).
async fn quit_daemon(control: &gpu_kubelet_plugin::mps::MpsControl, uid: &str) {
    let quit = std::process::Command::new(&control.binary)
        .env("CUDA_MPS_PIPE_DIRECTORY", control.pipe_dir(uid))
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(b"quit\n")?;
            child.wait()
        })
        .expect("quit");
    assert!(quit.success());
    assert!(!control.is_running(uid).await);
}

#[tokio::test]
async fn a_daemon_that_died_with_the_plugin_is_started_again_at_start() {
    let mut f = Fixture::new(vec![with_configs(
        claim("mps", "u1", &[(DRIVER, NODE, dev(0))]),
        &[("FromClaim", mps(50, "1Gi"))],
    )]);
    f.timeout = Duration::from_secs(30);
    let c = f.controller().await;
    c.prepare(vec![claim_ref("mps", "u1")]).await["u1"]
        .as_ref()
        .expect("prepared");
    // Kill the daemon behind the plugin's back.
    let control = mps_control(&f.dir.path().join("mps"));
    quit_daemon(&control, "u1").await;
    let (_restarted, report) = f.start().await;
    assert_eq!(report.mps_restarted, ["u1"]);
    assert!(control.is_running("u1").await);
    control.stop("u1").await.expect("cleanup");
}

#[tokio::test]
async fn bad_or_unfitting_configs_fail_only_their_claim_and_prepare_nothing() {
    let f = Fixture::new(vec![
        with_configs(
            claim("typo", "u1", &[(DRIVER, NODE, dev(0))]),
            &[(
                "FromClaim",
                serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1", "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercent": 5}}}),
            )],
        ),
        with_configs(
            claim("too-much", "u2", &[(DRIVER, NODE, dev(1))]),
            &[("FromClaim", mps(50, "1Ti"))],
        ),
        claim("good", "u3", &[(DRIVER, NODE, dev(2))]),
    ]);
    let c = f.controller().await;
    let results = c
        .prepare(vec![
            claim_ref("typo", "u1"),
            claim_ref("too-much", "u2"),
            claim_ref("good", "u3"),
        ])
        .await;
    let typo = results["u1"].as_ref().expect_err("typo").to_string();
    assert!(
        typo.contains("ResourceClaim ns/typo")
            && typo.contains(
                "opaque.parameters.sharing.mps.defaultActiveThreadPercent: unknown field"
            ),
        "{typo}"
    );
    let too_much = results["u2"].as_ref().expect_err("too much").to_string();
    assert!(too_much.contains("more than the device's"), "{too_much}");
    results["u3"].as_ref().expect("the good claim prepares");
    assert_eq!(f.cdi_files(), ["gpu.example.com-claim_u3.json"]);
    assert_eq!(c.prepared_claims().await, ["u3"]);
}

#[tokio::test]
async fn a_failed_mps_start_rolls_the_claim_back() {
    let mut f = Fixture::new(vec![with_configs(
        claim("mps", "u1", &[(DRIVER, NODE, dev(3))]),
        &[("FromClaim", mps(50, "1Gi"))],
    )]);
    f.timeout = Duration::from_secs(30);
    let failing = f.dir.path().join("failing-mps-control");
    std::fs::write(
        &failing,
        format!(
            "#!/bin/sh\nFAKE_MPS_FAIL_START=1 exec {} \"$@\"\n",
            mps_control(f.dir.path()).binary.display()
        ),
    )
    .expect("wrapper");
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&failing)
        .status()
        .expect("chmod");
    let mut config = f.config();
    config.mps.binary = failing;
    let (c, _) = ClaimController::start(
        f.cluster.clone(),
        Arc::clone(&f.hardware),
        config,
        node_devices(),
        f.cdi(),
        f.checkpoint(),
    )
    .await
    .unwrap();
    let err = c.prepare(vec![claim_ref("mps", "u1")]).await["u1"]
        .as_ref()
        .expect_err("MPS cannot start")
        .to_string();
    assert!(
        err.contains("MPS sharing") && err.contains("injected failure"),
        "{err}"
    );
    assert!(f.cdi_files().is_empty());
    assert!(c.prepared_claims().await.is_empty());
    assert!(!f.dir.path().join("mps/u1").exists());
    // The GPU was exclusive for the daemon's start only, and is back in its default mode.
    let gpu = dev(3);
    assert_eq!(
        f.hardware.calls.lock().unwrap().clone(),
        [
            format!("prepare {gpu}"),
            format!("compute-mode {gpu} ExclusiveProcess"),
            format!("compute-mode {gpu} Default"),
            format!("compute-mode {gpu} Default"),
            format!("unprepare {gpu}")
        ]
    );
}

/// One claim whose recovery step fails at start (here its CDI spec cannot be rewritten: the
/// path is a directory) used to fail the whole start, so the plugin exited and crash-looped,
/// taking every other claim with it. Now the start succeeds, the others are served, the failure
/// is reported (Warning event naming the claim, the failing count) and the kubelet gets the
/// claim's error, and the step is retried in the background until it succeeds.
#[tokio::test]
async fn a_start_with_one_poisoned_claim_serves_the_others_and_retries_it() {
    let f = Fixture::new(vec![
        claim("a", "ua", &[(DRIVER, NODE, dev(0))]),
        claim("b", "ub", &[(DRIVER, NODE, dev(1))]),
        claim("c", "uc", &[(DRIVER, NODE, dev(2))]),
        claim("d", "ud", &[(DRIVER, NODE, dev(3))]),
    ]);
    let c = f.controller().await;
    let r = c
        .prepare(vec![
            claim_ref("a", "ua"),
            claim_ref("b", "ub"),
            claim_ref("c", "uc"),
        ])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    drop(c);
    let spec_b = f.dir.path().join("cdi/gpu.example.com-claim_ub.json");
    std::fs::remove_file(&spec_b).unwrap();
    std::fs::create_dir(&spec_b).unwrap();

    let (c, report) = f.start().await;
    assert_eq!(
        report
            .failed
            .iter()
            .map(|(u, _)| u.as_str())
            .collect::<Vec<_>>(),
        ["ub"],
        "{report:?}"
    );
    let warnings = f.cluster.warnings.lock().unwrap().clone();
    assert!(
        warnings.iter().any(|w| w.starts_with("ClaimRecoveryFailed")
            && w.contains("ns/b")
            && w.contains("ub")),
        "{warnings:?}"
    );
    let mut failing = c.recovery_failures();
    assert_eq!(*failing.borrow_and_update(), 1);

    // Every other claim is served: a prepared one answers, one unprepares, a new one prepares.
    let r = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("d", "ud")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    assert!(c.unprepare(vec![claim_ref("c", "uc")]).await["uc"].is_ok());
    // The poisoned claim's prepare answers its recovery error, naming the claim.
    let r = c.prepare(vec![claim_ref("b", "ub")]).await;
    let e = r["ub"].as_ref().expect_err("still poisoned").to_string();
    assert!(e.contains("ns/b"), "{e}");
    assert!(
        c.prepared_claims().await.contains(&"ub".to_owned()),
        "a failing recovery never rolls back a prepared claim"
    );

    // Cured: the background retry rewrites the spec and the count drops to 0.
    std::fs::remove_dir(&spec_b).unwrap();
    tokio::time::timeout(Duration::from_secs(10), failing.wait_for(|n| *n == 0))
        .await
        .expect("retried within 10 s")
        .expect("controller alive");
    assert!(spec_b.is_file(), "the spec was regenerated by the retry");
    assert!(c.prepare(vec![claim_ref("b", "ub")]).await["ub"].is_ok());
}

/// A claim's MPS daemon that stops answering while the plugin runs (it crashed, or it lived in
/// the container of the instance that handed over and has since gone) used to stay dead until
/// the next plugin start: the claim's next containers found no server. The periodic check
/// starts it again with the claim's limits; a claim whose daemon answers is left alone.
#[tokio::test]
async fn a_daemon_that_stopped_while_the_plugin_runs_is_started_again_by_the_periodic_check() {
    let mut f = Fixture::new(vec![
        with_configs(
            claim("mps", "u1", &[(DRIVER, NODE, dev(0))]),
            &[("FromClaim", mps(50, "1Gi"))],
        ),
        with_configs(
            claim("alive", "u2", &[(DRIVER, NODE, dev(1))]),
            &[("FromClaim", mps(30, "2Gi"))],
        ),
    ]);
    f.timeout = Duration::from_secs(30);
    let c = f.controller().await;
    let r = c
        .prepare(vec![claim_ref("mps", "u1"), claim_ref("alive", "u2")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    assert!(c.restart_dead_daemons().await.is_empty(), "both answer");
    let control = mps_control(&f.dir.path().join("mps"));
    quit_daemon(&control, "u1").await;

    assert_eq!(c.restart_dead_daemons().await, ["u1"]);
    assert!(control.is_running("u1").await);
    let log = std::fs::read_to_string(f.dir.path().join("mps/u1/log/control.log")).expect("log");
    assert!(
        log.contains("set_default_active_thread_percentage 50"),
        "the restarted daemon has the claim's limits: {log}"
    );
    for uid in ["u1", "u2"] {
        c.unprepare(vec![claim_ref(
            if uid == "u1" { "mps" } else { "alive" },
            uid,
        )])
        .await[uid]
            .as_ref()
            .expect("unprepared");
        assert!(!control.is_running(uid).await);
    }
}

const CHANNELS: gpu_inventory::imex::ImexChannels = gpu_inventory::imex::ImexChannels {
    major: 235,
    count: 1,
};

fn channel_config(domain: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig", "domainID": domain})
}

/// A channel claim as the scheduler allocates it: the device allows multiple allocations, so
/// each result carries a share ID.
fn channel_claim(name: &str, uid: &str, config: Option<serde_json::Value>) -> ResourceClaim {
    let mut c = claim(name, uid, &[(DRIVER, NODE, "imex-channel-0")]);
    if let Some(r) = c
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut())
    {
        r[0].share_id = Some(format!("share-{uid}"));
    }
    match config {
        Some(config) => with_configs(c, &[("FromClaim", config)]),
        None => c,
    }
}

fn spec_of(f: &Fixture, uid: &str) -> serde_json::Value {
    let path = f
        .dir
        .path()
        .join("cdi")
        .join(format!("gpu.example.com-claim_{uid}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).expect("spec")).expect("json")
}

#[tokio::test]
async fn channel_claims_share_the_channel_get_its_device_node_by_numbers_and_leave_nothing() {
    let mut f = Fixture::new(vec![
        channel_claim("a", "ua", Some(channel_config("dom-1"))),
        channel_claim("b", "ub", Some(channel_config("dom-1"))),
    ]);
    f.imex = Some(CHANNELS);
    f.device_metadata = Some(Arc::new(
        gpu_kubelet_plugin::device_metadata::DeviceMetadata::new(
            &f.dir.path().join("plugin"),
            DRIVER,
        ),
    ));
    let metadata = f
        .dir
        .path()
        .join("plugin/dra-device-metadata/ns_a/gpus/metadata.json");
    let c = f.controller().await;
    let prepared = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    for uid in ["ua", "ub"] {
        let devices = prepared[uid].as_ref().expect("both claims hold channel 0");
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].device_name, "imex-channel-0");
        assert_eq!(
            devices[0].share_id.as_deref(),
            Some(format!("share-{uid}").as_str())
        );
    }
    let spec = spec_of(&f, "ua");
    let device = &spec["devices"][0];
    assert_eq!(device["name"], "ua-imex-channel-0");
    assert_eq!(
        device["containerEdits"]["deviceNodes"],
        serde_json::json!([{"path": "/dev/nvidia-caps-imex-channels/channel0",
            "type": "c", "major": 235, "minor": 0, "permissions": "rw"}])
    );
    // No GPU in the claim: none of the GPUs' nodes, files or hooks.
    assert!(
        spec["containerEdits"]
            .as_object()
            .is_none_or(|e| e.values().all(|v| v.as_array().is_none_or(Vec::is_empty))),
        "{spec}"
    );
    let record = serde_json::to_string(&f.checkpoint().load().expect("cp")).expect("json");
    assert!(record.contains(r#""domainId":"dom-1""#), "{record}");
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&metadata).expect("the metadata file"))
            .expect("json");
    let d = &doc["requests"][0]["devices"][0];
    assert_eq!(d["name"], "imex-channel-0");
    assert_eq!(d["attributes"]["type"]["string"], "imex-channel");
    assert_eq!(d["attributes"]["channel"]["int"], 0);
    assert!(
        spec["devices"][0]["containerEdits"]["mounts"]
            .to_string()
            .contains("dra-device-attributes"),
        "the metadata is mounted with the channel: {spec}"
    );
    assert!(
        f.hardware.calls.lock().unwrap().is_empty(),
        "no hardware step"
    );

    // A restart answers from the record, and a lost spec is made again from it alone.
    std::fs::remove_file(
        f.dir
            .path()
            .join("cdi")
            .join("gpu.example.com-claim_ua.json"),
    )
    .expect("remove the spec");
    let restarted = f.controller().await;
    let again = restarted.prepare(vec![claim_ref("a", "ua")]).await;
    assert_eq!(
        again["ua"].as_ref().expect("prepared"),
        prepared["ua"].as_ref().unwrap()
    );
    assert_eq!(spec_of(&f, "ua")["devices"], spec["devices"]);

    let done = restarted
        .unprepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    assert!(done.values().all(Result::is_ok), "{done:?}");
    assert!(f.cdi_files().is_empty(), "{:?}", f.cdi_files());
    assert!(restarted.prepared_claims().await.is_empty());
    assert!(!metadata.exists(), "the metadata went with the claim");
}

#[tokio::test]
async fn a_channel_beside_a_gpu_gets_both_and_the_gpu_keeps_its_edits() {
    let mut both = claim(
        "both",
        "u1",
        &[(DRIVER, NODE, dev(0)), (DRIVER, NODE, "imex-channel-0")],
    );
    if let Some(d) = both
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
    {
        if let Some(r) = d.results.as_mut() {
            r[1].request = "channel".into();
            r[1].share_id = Some("s1".into());
        }
        d.config = Some(vec![
            k8s_openapi::api::resource::v1::DeviceAllocationConfiguration {
                source: "FromClaim".into(),
                requests: Some(vec!["channel".into()]),
                opaque: Some(k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration {
                    driver: DRIVER.into(),
                    parameters: k8s_openapi::apimachinery::pkg::runtime::RawExtension(
                        serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1",
                        "kind": "ComputeDomainChannelConfig", "domainID": "dom-2"}),
                    ),
                }),
            },
        ]);
    }
    let mut f = Fixture::new(vec![both]);
    f.imex = Some(CHANNELS);
    let c = f.controller().await;
    let prepared = c.prepare(vec![claim_ref("both", "u1")]).await;
    let names: Vec<_> = prepared["u1"]
        .as_ref()
        .expect("prepared")
        .iter()
        .map(|d| d.device_name.clone())
        .collect();
    assert_eq!(names, [dev(0).to_owned(), "imex-channel-0".to_owned()]);
    let spec = spec_of(&f, "u1");
    assert_eq!(spec["devices"].as_array().map(Vec::len), Some(2), "{spec}");
    let control = spec["containerEdits"]["deviceNodes"].to_string();
    assert!(
        control.contains("/dev/nvidiactl"),
        "the GPU's control nodes: {spec}"
    );
    assert_eq!(
        f.hardware.calls.lock().unwrap().clone(),
        [format!("prepare {}", dev(0))],
        "the GPU alone has a hardware step"
    );
}

#[tokio::test]
async fn a_channel_without_its_domain_or_on_a_node_without_channels_is_refused() {
    let f = Fixture::new(vec![
        channel_claim("no-config", "u1", None),
        channel_claim(
            "no-domain",
            "u2",
            Some(serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1",
                "kind": "ComputeDomainChannelConfig"})),
        ),
        // drust's API: a config without requests applies to every device (NVIDIA's would
        // skip the GPU).
        with_configs(
            claim("gpu-with-channel-config", "u3", &[(DRIVER, NODE, dev(1))]),
            &[(
                "FromClaim",
                serde_json::json!({"apiVersion": "gpu.drust.dev/v1alpha1",
                    "kind": "ComputeDomainChannelConfig", "domainID": "dom-1"}),
            )],
        ),
    ]);
    let mut with_channels = Fixture {
        imex: Some(CHANNELS),
        ..Fixture::new(Vec::new())
    };
    with_channels.cluster = f.cluster.clone();
    // The node publishes no channel: the claim names a device it does not have.
    let without = f.controller().await;
    let err = without.prepare(vec![claim_ref("no-config", "u1")]).await["u1"]
        .as_ref()
        .expect_err("no channels here")
        .to_string();
    assert!(err.contains("imex-channel-0"), "{err}");

    let c = with_channels.controller().await;
    let results = c
        .prepare(vec![
            claim_ref("no-config", "u1"),
            claim_ref("no-domain", "u2"),
            claim_ref("gpu-with-channel-config", "u3"),
        ])
        .await;
    for (uid, needle) in [
        (
            "u1",
            "no opaque config of kind ComputeDomainChannelConfig applies",
        ),
        ("u2", "opaque.parameters.domainID is missing"),
        ("u3", "configures IMEX channels only"),
    ] {
        let e = results[uid].as_ref().expect_err(uid).to_string();
        assert!(e.contains(needle), "{uid}: {e}");
    }
    assert!(with_channels.cdi_files().is_empty());
    assert!(c.prepared_claims().await.is_empty());
}
