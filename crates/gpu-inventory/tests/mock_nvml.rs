//! MIG and health events through the real NVML backend, against NVIDIA's mock of NVML (go-nvml's
//! DGX A100 server with MIG mode on, through `tests/gotools/mocknvml`'s C ABI): profiles with
//! their real-GPU IDs, placements, a MIG device created at a placement and listed with its UUID,
//! instance ids, profile and resources, published as the existing strategy publishes it,
//! destroyed (twice: the second time it is already gone), two devices side by side; then an XID
//! and a double-bit ECC error delivered through NVML's event set to the backend's health wait,
//! and the recovery probe that decides when a tainted GPU is healthy again (rows waiting for a
//! reset keep it unhealthy).
//! Nothing else on this machine has ever run these NVML calls.
//!
//! NVML is loaded once per process and the mock reads its machine at load, so the test runs
//! itself again in a child process with the mock's environment set.

use std::process::Command;
use std::time::Duration;

use gpu_inventory::backend::{MigMode, MigPlacement};
use gpu_inventory::{
    GpuBackend, HealthEventKind, MigStrategy, NvmlBackend, RecoveryProbe, discover,
};

const CHILD: &str = "DRUST_MOCK_NVML_LIB";

/// Runs this binary's test `name` alone in a child process with `env` (NVML loads once per
/// process, and the mock reads its machine at load) and requires that it ran and passed.
fn run_in_child(name: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let out = Command::new(std::env::current_exe().expect("this test"))
        .args(["--exact", name, "--nocapture"])
        .envs(env.iter().copied())
        .output()
        .expect("run the child");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    // The child ran the test (not zero tests).
    assert!(text.contains("1 passed"), "{text}");
}

#[test]
fn mig_devices_and_health_events_run_through_nvml() {
    let Some(lib) = std::env::var_os(CHILD) else {
        let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("the mock");
        let events = tempfile::tempdir().expect("events dir");
        run_in_child(
            "mig_devices_and_health_events_run_through_nvml",
            &[
                (CHILD, lib.as_os_str()),
                ("DRUST_MOCK_NVML_MACHINE", "dgxa100".as_ref()),
                ("DRUST_MOCK_NVML_MIG", "1".as_ref()),
                ("DRUST_MOCK_NVML_EVENTS", events.path().as_os_str()),
            ],
        );
        return;
    };
    let nvml = NvmlBackend::load(Some(&lib), "/sys".into()).expect("load the mock");

    // The A100 40GB profiles, with the IDs a real GPU reports (1 slice: 19).
    let gpu = nvml.gpu(0).expect("GPU 0");
    assert_eq!(gpu.mig_mode, MigMode::Enabled);
    let one = gpu
        .mig_profiles
        .iter()
        .find(|p| p.profile == 0)
        .expect("the 1-slice profile")
        .clone();
    let two = gpu
        .mig_profiles
        .iter()
        .find(|p| p.profile == 1)
        .expect("the 2-slice profile")
        .clone();
    assert_eq!((one.id, two.id), (19, 14));
    assert_eq!(one.placements.len(), 7, "{one:?}");

    // Create a 1g at slice 0: listed, with the profile's resources.
    let at = |start, size| MigPlacement { start, size };
    let made = nvml
        .create_mig_device(0, one.id, at(0, 1))
        .expect("create 1g");
    assert!(made.uuid.starts_with("MIG-"), "{made:?}");
    assert_eq!((made.profile_id, made.placement), (19, at(0, 1)));
    let attrs = made.attributes.clone().expect("attributes");
    assert_eq!(attrs.memory_total_bytes, one.memory_size_mib << 20);
    assert_eq!(attrs.multiprocessor_count, one.multiprocessor_count);
    assert_eq!(
        nvml.gpu_state(0).expect("state").mig_devices,
        vec![made.clone()]
    );

    // Discovery publishes it (existing strategy), named by its profile and slice.
    let inventory = discover(&nvml).expect("discover");
    let pool = inventory.pool(MigStrategy::Existing);
    let uuid = |d: &k8s_openapi::api::resource::v1::Device| {
        d.attributes
            .as_ref()
            .and_then(|a| a.get("uuid"))
            .and_then(|v| v.string.clone())
    };
    let published: Vec<_> = pool
        .devices
        .iter()
        .filter(|d| uuid(d).as_deref() == Some(made.uuid.as_str()))
        .collect();
    assert_eq!(published.len(), 1, "{:#?}", pool.devices);
    assert!(
        published[0].name.ends_with("-mig-1g-5gb-0"),
        "{}",
        published[0].name
    );

    // A 2g beside it.
    let second = nvml
        .create_mig_device(0, two.id, at(2, 2))
        .expect("create 2g");
    assert_eq!(nvml.gpu_state(0).expect("state").mig_devices.len(), 2);

    // Destroy both; destroying again finds nothing.
    for m in [&made, &second] {
        assert!(
            nvml.destroy_mig_device(0, m.gpu_instance_id, m.compute_instance_id)
                .expect("destroy")
        );
        assert!(
            !nvml
                .destroy_mig_device(0, m.gpu_instance_id, m.compute_instance_id)
                .expect("destroy again")
        );
    }
    assert!(nvml.gpu_state(0).expect("state").mig_devices.is_empty());

    // A profile ID no profile has is refused, naming it.
    let err = nvml
        .create_mig_device(0, 99, at(0, 1))
        .expect_err("unknown profile ID");
    assert!(
        err.to_string()
            .contains("no GPU instance profile has ID 99"),
        "{err}"
    );

    // Health: nothing pending, then an XID 79 on GPU 3 and a double-bit ECC error on GPU 5,
    // delivered in order through the event set the backend registers.
    let events = std::path::PathBuf::from(std::env::var_os("DRUST_MOCK_NVML_EVENTS").expect("dir"));
    let quiet = std::time::Instant::now();
    assert_eq!(
        nvml.wait_health_event(Duration::from_millis(300))
            .expect("wait"),
        None
    );
    assert!(quiet.elapsed() >= Duration::from_millis(250));
    std::fs::write(events.join("1.json"), r#"{"gpu": 3, "xid": 79}"#).expect("event");
    std::fs::write(events.join("2.json"), r#"{"gpu": 5, "dbe": true}"#).expect("event");
    let uuid = |i| nvml.gpu(i).expect("gpu").uuid;
    let first = nvml
        .wait_health_event(Duration::from_secs(5))
        .expect("wait")
        .expect("an event");
    assert_eq!(
        (first.gpu_uuid.as_str(), first.kind),
        (uuid(3).as_str(), HealthEventKind::Xid { code: 79 })
    );
    let second = nvml
        .wait_health_event(Duration::from_secs(5))
        .expect("wait")
        .expect("an event");
    assert_eq!(
        (second.gpu_uuid.as_str(), second.kind),
        (uuid(5).as_str(), HealthEventKind::DoubleBitEcc)
    );
    assert_eq!(
        nvml.wait_health_event(Duration::from_millis(100))
            .expect("wait"),
        None
    );

    // Recovery: healthy, unhealthy while rows wait for a reset, healthy again after.
    let gpu3 = uuid(3);
    assert_eq!(
        nvml.probe_recovery(&gpu3).expect("probe"),
        RecoveryProbe::Healthy
    );
    let pending = events.join("remap-pending-3");
    std::fs::write(&pending, "").expect("pending");
    assert_eq!(
        nvml.probe_recovery(&gpu3).expect("probe"),
        RecoveryProbe::Unhealthy("row remapping pending until reset".into())
    );
    std::fs::remove_file(&pending).expect("reset");
    assert_eq!(
        nvml.probe_recovery(&gpu3).expect("probe"),
        RecoveryProbe::Healthy
    );
    assert!(matches!(
        nvml.probe_recovery("GPU-00000000-0000-0000-0000-000000000000")
            .expect("probe"),
        RecoveryProbe::Unhealthy(reason) if reason.starts_with("not reachable")
    ));
}

const COMPUTE_CHILD: &str = "DRUST_MOCK_NVML_COMPUTE_LIB";

/// The compute mode a GPU hosting shares is put in (EXCLUSIVE_PROCESS) and restored from, set
/// and read through the real NVML backend: the calls reach the library (the mock records each
/// with the GPU's UUID) and read back, and a refused mode is an error naming the call.
#[test]
fn compute_modes_run_through_nvml() {
    use gpu_inventory::backend::ComputeMode;
    let Some(lib) = std::env::var_os(COMPUTE_CHILD) else {
        let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("the mock");
        let dir = tempfile::tempdir().expect("dir");
        let calls = dir.path().join("calls");
        run_in_child(
            "compute_modes_run_through_nvml",
            &[
                (COMPUTE_CHILD, lib.as_os_str()),
                ("DRUST_MOCK_NVML_MACHINE", "dgxh100".as_ref()),
                ("DRUST_MOCK_NVML_CALLS", calls.as_os_str()),
            ],
        );
        let recorded = std::fs::read_to_string(&calls).expect("recorded calls");
        let lines: Vec<&str> = recorded.lines().collect();
        assert_eq!(lines.len(), 2, "{recorded}");
        let uuid = lines[0]
            .strip_prefix("nvmlDeviceSetComputeMode ")
            .and_then(|l| l.strip_suffix(" 3"))
            .expect("EXCLUSIVE_PROCESS first");
        assert!(uuid.starts_with("GPU-"), "{recorded}");
        assert_eq!(lines[1], format!("nvmlDeviceSetComputeMode {uuid} 0"));
        return;
    };
    let nvml = NvmlBackend::load(Some(&lib), "/sys".into()).expect("load the mock");
    assert_eq!(nvml.compute_mode(2).expect("read"), ComputeMode::Default);
    nvml.set_compute_mode(2, ComputeMode::ExclusiveProcess)
        .expect("exclusive process");
    assert_eq!(
        nvml.compute_mode(2).expect("read"),
        ComputeMode::ExclusiveProcess
    );
    assert_eq!(nvml.compute_mode(3).expect("read"), ComputeMode::Default);
    nvml.set_compute_mode(2, ComputeMode::Default)
        .expect("default");
    assert_eq!(nvml.compute_mode(2).expect("read"), ComputeMode::Default);
    let err = nvml
        .set_compute_mode(99, ComputeMode::Default)
        .expect_err("no GPU 99");
    assert!(err.to_string().contains("99"), "{err}");
}

const LIMITS_CHILD: &str = "DRUST_TEST_MEMORY_LIMITS_CHILD";

/// Per-cgroup memory limits through the real NVML backend: a driver before r615 has no memory
/// partitioning; on r615 a limit and its clearing reach `nvmlDeviceSetMemoryLimits_v1` with the
/// GPU, the cgroup path and the bytes (the mock records each call), found by UUID; a cgroup
/// that does not exist is refused with an error naming the call and the cgroup.
#[test]
fn memory_limits_run_through_nvml() {
    use gpu_inventory::MemoryLimits;
    let Some(lib) = std::env::var_os(LIMITS_CHILD) else {
        let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("the mock");
        let dir = tempfile::tempdir().expect("dir");
        let calls = dir.path().join("calls");
        let cgroup = dir.path().join("kubepods.slice/pod-a/container-b");
        std::fs::create_dir_all(&cgroup).expect("cgroup dir");
        run_in_child(
            "memory_limits_run_through_nvml",
            &[
                (LIMITS_CHILD, lib.as_os_str()),
                ("DRUST_MOCK_NVML_MACHINE", "dgxh100".as_ref()),
                ("DRUST_MOCK_NVML_DRIVER_VERSION", "615.20.01".as_ref()),
                ("DRUST_MOCK_NVML_CALLS", calls.as_os_str()),
                ("DRUST_TEST_CGROUP", cgroup.as_os_str()),
            ],
        );
        let recorded = std::fs::read_to_string(&calls).expect("recorded calls");
        let lines: Vec<&str> = recorded.lines().collect();
        assert_eq!(lines.len(), 2, "{recorded}");
        let (uuid, rest) = lines[0]
            .strip_prefix("nvmlDeviceSetMemoryLimits_v1 ")
            .and_then(|l| l.split_once(' '))
            .expect("a memory-limit call");
        assert!(uuid.starts_with("GPU-"), "{recorded}");
        let c = cgroup.display();
        assert_eq!(rest, format!("{c} 10737418240 10737418240"));
        assert_eq!(
            lines[1],
            format!("nvmlDeviceSetMemoryLimits_v1 {uuid} {c} 0 18446744073709551615")
        );
        // The same library with the machine's own (pre-615) driver: no memory partitioning.
        let old = NvmlBackend::load(Some(lib.as_os_str()), "/sys".into()).expect("load");
        assert!(!old.memory_partitioning().expect("driver version"));
        return;
    };
    let cgroup = std::path::PathBuf::from(std::env::var_os("DRUST_TEST_CGROUP").expect("cgroup"));
    let nvml = NvmlBackend::load(Some(&lib), "/sys".into()).expect("load the mock");
    assert!(nvml.memory_partitioning().expect("driver version"));
    let uuid = nvml.gpu(1).expect("GPU 1").uuid;
    let index = nvml.index_of(&uuid).expect("found by UUID");
    assert_eq!(index, 1);
    nvml.set_memory_limits(index, &cgroup, MemoryLimits::share(10 << 30))
        .expect("set");
    nvml.set_memory_limits(index, &cgroup, MemoryLimits::CLEARED)
        .expect("clear");
    let gone = cgroup.join("gone");
    let err = nvml
        .set_memory_limits(index, &gone, MemoryLimits::share(1 << 30))
        .expect_err("no such cgroup");
    let text = err.to_string();
    assert!(
        text.contains("nvmlDeviceSetMemoryLimits_v1") && text.contains("gone"),
        "{text}"
    );
}

/// MIG instances' activity through GPM (`nvmlGpmMigSampleGet`, `nvmlGpmMetricsGet`) on the
/// mock's DGX H100 in MIG mode: no figure from an instance's first sample, the usage file's SM
/// and memory-bandwidth figures from the second, no per-process SM figure in MIG mode, and an
/// instance's kept sample dropped with the instance.
#[test]
fn mig_instances_report_their_activity_through_gpm() {
    use gpu_inventory::MigUsage;
    let Some(lib) = std::env::var_os(CHILD) else {
        let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("the mock");
        let usage = tempfile::tempdir().expect("usage dir");
        run_in_child(
            "mig_instances_report_their_activity_through_gpm",
            &[
                (CHILD, lib.as_os_str()),
                ("DRUST_MOCK_NVML_MACHINE", "dgxh100".as_ref()),
                ("DRUST_MOCK_NVML_MIG", "1".as_ref()),
                ("DRUST_MOCK_NVML_USAGE", usage.path().as_os_str()),
            ],
        );
        return;
    };
    let usage_dir = std::env::var_os("DRUST_MOCK_NVML_USAGE").expect("set by the parent");
    let nvml = NvmlBackend::load(Some(&lib), "/sys".into()).expect("load the mock");
    let gpu = nvml.gpu(0).expect("GPU 0");
    let one = gpu
        .mig_profiles
        .iter()
        .find(|p| p.profile == 0)
        .expect("the 1-slice profile")
        .clone();
    let made = nvml
        .create_mig_device(0, one.id, MigPlacement { start: 0, size: 1 })
        .expect("create 1g");
    let gi = made.gpu_instance_id;
    std::fs::write(
        std::path::Path::new(&usage_dir).join("0.json"),
        serde_json::json!({
            "memoryUsedBytes": 1u64 << 30,
            "processes": [{"pid": 77, "usedMemoryBytes": 1u64 << 30, "gpuInstanceId": gi,
                "computeInstanceId": 0, "smPercent": 50}],
            "mig": [{"gpuInstanceId": gi, "smPercent": 37, "memoryPercent": 4}],
        })
        .to_string(),
    )
    .expect("usage file");

    let first = nvml.usage(0).expect("first usage");
    assert_eq!(first.sm_percent, None, "no whole-GPU figure in MIG mode");
    assert_eq!(
        first.mig,
        [MigUsage {
            gpu_instance_id: gi,
            sm_percent: None,
            memory_percent: None,
        }],
        "GPM compares two samples: none from the first"
    );
    let second = nvml.usage(0).expect("second usage");
    assert_eq!(
        second.mig,
        [MigUsage {
            gpu_instance_id: gi,
            sm_percent: Some(37),
            memory_percent: Some(4),
        }]
    );
    assert_eq!(
        second
            .processes
            .iter()
            .map(|p| (p.pid, p.gpu_instance_id, p.sm_percent))
            .collect::<Vec<_>>(),
        [(77, Some(gi), None)],
        "NVML has no per-process SM figures in MIG mode"
    );
    assert!(
        nvml.destroy_mig_device(0, gi, made.compute_instance_id)
            .expect("destroy")
    );
    assert!(nvml.usage(0).expect("after").mig.is_empty());
    // A GPU in MIG mode with no instance: none.
    assert!(nvml.usage(1).expect("GPU 1").mig.is_empty());
}

/// Writes the mock's fabric file (replaced whole, so the mock never reads half of it).
fn write_fabric(path: &std::path::Path, json: &serde_json::Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, json.to_string()).expect("write the fabric file");
    std::fs::rename(&tmp, path).expect("rename the fabric file");
}

#[test]
fn fabric_registration_cliques_and_health_run_through_nvml_v3_v2_and_v1() {
    const UUID: &str = "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94";
    let Some(lib) = std::env::var_os(CHILD) else {
        let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("the mock");
        let dir = tempfile::tempdir().expect("fabric dir");
        let file = dir.path().join("fabric.json");
        // Another node's entry: this library plays tray-3.
        write_fabric(
            &file,
            &serde_json::json!({"tray-9": {"*": {"state": "completed", "clusterUuid": UUID,
                "cliqueId": 9}}}),
        );
        run_in_child(
            "fabric_registration_cliques_and_health_run_through_nvml_v3_v2_and_v1",
            &[
                (CHILD, lib.as_os_str()),
                ("DRUST_MOCK_NVML_MACHINE", "dgxb200".as_ref()),
                ("DRUST_MOCK_NVML_FABRIC", file.as_os_str()),
                ("DRUST_MOCK_NVML_NODE", "tray-3".as_ref()),
                ("FABRIC_FILE", file.as_os_str()),
            ],
        );
        return;
    };
    use gpu_inventory::fabric::{FabricHealthSummary, FabricInfo, FabricState};
    let file = std::path::PathBuf::from(std::env::var_os("FABRIC_FILE").expect("FABRIC_FILE"));
    let nvml = NvmlBackend::load(Some(&lib), "/sys".into()).expect("load the mock");
    let answer = |i| nvml.fabric(i).expect("the GPU answers");

    // No entry for this node: NOT_SUPPORTED, no fabric, no error, no clique.
    let gpu = nvml.gpu(0).expect("GPU 0");
    assert_eq!((gpu.fabric, gpu.fabric_error), (None, None));
    assert_eq!(
        discover(&nvml).expect("discover").gpus[0].nvlink_clique,
        None
    );

    // Fabric Manager is registering the tray: IN_PROGRESS everywhere, no clique.
    write_fabric(
        &file,
        &serde_json::json!({"tray-3": {"*": {"state": "inProgress"}}}),
    );
    let pending = answer(1).info.expect("an answer");
    assert_eq!(pending.state, FabricState::InProgress);
    assert!(pending.pending() && pending.clique().is_none());
    assert!(
        discover(&nvml)
            .expect("discover")
            .gpus
            .iter()
            .all(|g| g.nvlink_clique.is_none())
    );

    // Registered: every GPU in the rack's clique (v3: mask and summary), GPU 2 with degraded
    // bandwidth (mask 0x11a9: bandwidth degraded, the other flags false, configuration fine,
    // partition assigned) and limited capacity: its clique stays.
    write_fabric(
        &file,
        &serde_json::json!({"tray-3": {
            "*": {"state": "completed", "clusterUuid": UUID, "cliqueId": 32766,
                  "healthMask": 0x1_1aa, "healthSummary": 1},
            "2": {"healthMask": 0x1_1a9, "healthSummary": 3}}}),
    );
    let inventory = discover(&nvml).expect("discover");
    let clique = format!("{UUID}.32766");
    assert!(
        inventory
            .gpus
            .iter()
            .all(|g| g.nvlink_clique.as_deref() == Some(clique.as_str())),
        "{:?}",
        inventory
            .gpus
            .iter()
            .map(|g| &g.nvlink_clique)
            .collect::<Vec<_>>()
    );
    let healthy = answer(0).info.expect("an answer");
    assert_eq!(
        healthy,
        FabricInfo {
            state: FabricState::Completed,
            status: 0,
            cluster_uuid: UUID.into(),
            clique_id: 32766,
            health_mask: Some(0x1_1aa),
            health_summary: Some(FabricHealthSummary::Healthy),
        }
    );
    let degraded = answer(2).info.expect("an answer");
    assert_eq!(
        degraded.health_summary,
        Some(FabricHealthSummary::LimitedCapacity)
    );
    let health = degraded.health().expect("a mask");
    assert_eq!(
        (
            health.degraded_bandwidth,
            health.route_unhealthy,
            health.partition_assigned
        ),
        (Some(true), Some(false), Some(true))
    );

    // A driver that knows struct version 2 only (v3 answers ARGUMENT_VERSION_MISMATCH): the
    // mask, no summary. One that knows neither: the v1 call, neither.
    write_fabric(
        &file,
        &serde_json::json!({"tray-3": {"*": {"state": "completed", "clusterUuid": UUID,
            "cliqueId": 32766, "healthMask": 0x1_1aa, "healthSummary": 1, "maxVersion": 2}}}),
    );
    let v2 = answer(0).info.expect("an answer");
    assert_eq!((v2.health_mask, v2.health_summary), (Some(0x1_1aa), None));
    assert_eq!(v2.clique(), Some(clique.clone()));
    write_fabric(
        &file,
        &serde_json::json!({"tray-3": {"*": {"state": "completed", "clusterUuid": UUID,
            "cliqueId": 32766, "healthMask": 0x1_1aa, "maxVersion": 1}}}),
    );
    let v1 = answer(0).info.expect("an answer");
    assert_eq!((v1.health_mask, v1.health_summary), (None, None));
    assert_eq!(v1.clique(), Some(clique.clone()));

    // Fabric Manager re-partitions: a new clique, read at the next call.
    write_fabric(
        &file,
        &serde_json::json!({"tray-3": {"*": {"state": "completed", "clusterUuid": UUID,
            "cliqueId": 7}}}),
    );
    assert_eq!(
        answer(3).info.and_then(|i| i.clique()),
        Some(format!("{UUID}.7"))
    );

    // What the real H100 VM answers (Success, state NOT_SUPPORTED, zeros), an HGX H100 that is
    // no multi-node fabric (COMPLETED, zero UUID), a broken registration (COMPLETED with
    // Insufficient Resources): no clique, no error.
    for entry in [
        serde_json::json!({"state": "notSupported"}),
        serde_json::json!({"state": "completed", "cliqueId": 0}),
        serde_json::json!({"state": "completed", "status": 23}),
    ] {
        write_fabric(&file, &serde_json::json!({"tray-3": {"*": entry}}));
        let a = answer(0);
        assert_eq!(a.error, None, "{entry}");
        assert_eq!(a.info.expect("an answer").clique(), None, "{entry}");
    }

    // The call fails, or answers a state this version does not know: an error naming the
    // call, no fabric, never a panic; discovery keeps the GPU.
    write_fabric(
        &file,
        &serde_json::json!({"tray-3": {"*": {"return": 999}, "1": {"return": 0, "state": 9}}}),
    );
    assert_eq!(
        answer(0).error.as_deref(),
        Some("nvmlDeviceGetGpuFabricInfoV (v3) failed: Unknown Error (999)")
    );
    assert!(
        answer(1)
            .error
            .is_some_and(|e| e.contains("registration state 9")),
    );
    let inventory = discover(&nvml).expect("discover");
    assert!(
        inventory.unavailable.is_empty(),
        "{:?}",
        inventory.unavailable
    );
    assert!(inventory.gpus.iter().all(|g| g.nvlink_clique.is_none()));
}
