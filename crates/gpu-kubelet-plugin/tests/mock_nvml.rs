//! The plugin's real NVML backend against NVIDIA's own mock of NVML (github.com/NVIDIA/go-nvml,
//! `pkg/nvml/mock`: its DGX A100, H100, H200 and B200 servers), exposed through NVML's C ABI as
//! a `libnvidia-ml.so.1` (`tests/gotools/mocknvml`, built by the harness). For each machine,
//! in both MIG strategies (MIG mode on for partitionable): `gpu-kubelet-plugin --dry-run
//! --nvml-library <mock>` publishes the mock's GPUs with the mock's values, and the fake
//! backend, given the very answers NVML gave (`--dump-topology`, same process), publishes the
//! same slices: the fake used by every other test agrees with the NVML path.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// (machine, product, memory MiB, compute capability, architecture, driver, CUDA): NVIDIA's mock
/// profiles (`pkg/nvml/mock/gpus/*.go`, `mock/dgx*/dgx*.go` of go-nvml v0.13.4-1).
const MACHINES: [(&str, &str, u64, &str, &str, &str, &str); 4] = [
    (
        "dgxa100",
        "Mock NVIDIA A100-SXM4-40GB",
        40_960,
        "8.0.0",
        "Ampere",
        "550.54.15",
        "12.4.0",
    ),
    (
        "dgxh100",
        "NVIDIA H100 80GB HBM3",
        81_920,
        "9.0.0",
        "Hopper",
        "550.54.15",
        "12.4.0",
    ),
    (
        "dgxh200",
        "NVIDIA H200 141GB HBM3e",
        144_384,
        "9.0.0",
        "Hopper",
        "550.54.15",
        "12.4.0",
    ),
    (
        "dgxb200",
        "NVIDIA B200 180GB HBM3e",
        184_320,
        "10.0.0",
        "Blackwell",
        "560.28.3",
        "12.6.0",
    ),
];

fn plugin(args: &[&str], env: &[(&str, &str)]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
        .args(["--dry-run", "-o", "json", "--node-name", "mock-node"])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run gpu-kubelet-plugin");
    assert!(
        out.status.success(),
        "{args:?} {env:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON slices")
}

fn attr<'a>(device: &'a Value, name: &str) -> &'a Value {
    let a = &device["attributes"][name];
    ["string", "int", "version", "bool"]
        .iter()
        .map(|k| &a[*k])
        .find(|v| !v.is_null())
        .unwrap_or(&Value::Null)
}

#[test]
fn the_nvml_backend_publishes_nvidias_mock_gpus_as_the_fake_backend_does() {
    let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("build the mock");
    let dir = tempfile::tempdir().expect("tempdir");
    for (machine, product, mib, cc, arch, driver, cuda) in MACHINES {
        for (strategy, mig) in [("existing", "0"), ("partitionable", "1")] {
            let what = format!("{machine} {strategy}");
            let topology = dir.path().join(format!("{machine}-{strategy}.yaml"));
            let env = [
                ("DRUST_MOCK_NVML_MACHINE", machine),
                ("DRUST_MOCK_NVML_MIG", mig),
            ];
            let lib_arg = lib.to_str().expect("utf-8 path");
            let topo_arg = topology.to_str().expect("utf-8 path");
            let nvml = plugin(
                &[
                    "--nvml-library",
                    lib_arg,
                    "--mig-strategy",
                    strategy,
                    "--dump-topology",
                    topo_arg,
                ],
                &env,
            );
            let fake = plugin(
                &["--fake-topology", topo_arg, "--mig-strategy", strategy],
                &[],
            );
            assert_eq!(nvml, fake, "{what}: the fake backend disagrees with NVML");

            let devices: Vec<&Value> = nvml
                .as_array()
                .expect("slices")
                .iter()
                .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
                .collect();
            let gpus: Vec<&&Value> = devices
                .iter()
                .filter(|d| attr(d, "type") == "gpu")
                .collect();
            let migs: Vec<&&Value> = devices
                .iter()
                .filter(|d| attr(d, "type") == "mig")
                .collect();
            if strategy == "existing" {
                assert_eq!(gpus.len(), 8, "{what}: {devices:#?}");
            } else {
                // MIG mode on: the placements of every profile NVIDIA's mock lists, no whole GPU.
                assert!(
                    gpus.is_empty() && migs.len() >= 8 * 7,
                    "{what}: {} MIG",
                    migs.len()
                );
            }
            for (i, g) in gpus.iter().enumerate() {
                assert_eq!(attr(g, "productName"), product, "{what}");
                assert_eq!(attr(g, "cudaComputeCapability"), cc, "{what}");
                assert_eq!(attr(g, "architecture"), arch, "{what}");
                assert_eq!(attr(g, "driverVersion"), driver, "{what}");
                assert_eq!(attr(g, "cudaDriverVersion"), cuda, "{what}");
                assert_eq!(attr(g, "index"), i, "{what}");
                assert_eq!(attr(g, "minor"), i, "{what}");
                assert!(
                    attr(g, "uuid")
                        .as_str()
                        .is_some_and(|u| u.starts_with("GPU-")),
                    "{what}"
                );
                assert_eq!(
                    g["capacity"]["memory"]["value"],
                    format!("{}Gi", mib / 1024),
                    "{what}"
                );
                // The bridge's bus IDs (the mock has none): 0x18 + 0x10 * index.
                assert_eq!(
                    attr(g, "resource.kubernetes.io/pciBusID").as_str(),
                    Some(format!("0000:{:02x}:00.0", 0x18 + 0x10 * i).as_str()),
                    "{what}"
                );
            }
            for m in &migs {
                assert_eq!(attr(m, "productName"), product, "{what}");
                assert!(
                    attr(m, "profile")
                        .as_str()
                        .is_some_and(|p| p.contains("g.")),
                    "{what}"
                );
            }
            assert!(Path::new(&topology).is_file());
        }
    }
}

/// NVLink fabric answers through the real NVML backend against the mock
/// (`DRUST_MOCK_NVML_FABRIC`, this node's entry): registered GPUs publish the clique, a GPU
/// still registering publishes none and is tainted, an unhealthy route keeps the clique with
/// its taints, a driver that knows struct v2 only still gives the mask, a failing call is
/// tainted; and the fake backend, given the answers NVML gave (`--dump-topology`), publishes
/// the same slices.
#[test]
fn fabric_answers_through_nvml_publish_cliques_and_taints_as_the_fake_backend_does() {
    const UUID: &str = "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94";
    let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("build the mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let fabric = dir.path().join("fabric.json");
    let healthy = 0xaa | (1 << 8) | (1 << 12);
    std::fs::write(
        &fabric,
        serde_json::json!({
            "mock-node": {
                "*": {"state": "completed", "clusterUuid": UUID, "cliqueId": 4,
                      "healthMask": healthy, "healthSummary": 1},
                "3": {"state": "inProgress", "clusterUuid": "00000000000000000000000000000000",
                      "cliqueId": 0},
                "5": {"healthMask": (healthy & !0x30) | 0x10, "healthSummary": 2},
                "6": {"maxVersion": 2, "healthMask": (healthy & !0x3) | 0x1},
                "7": {"return": 999}
            },
            "other-node": {"*": {"state": "completed", "clusterUuid": UUID, "cliqueId": 9}}
        })
        .to_string(),
    )
    .expect("fabric file");
    let topology = dir.path().join("dumped.yaml");
    let (lib_arg, topo_arg) = (
        lib.to_str().expect("utf-8 path"),
        topology.to_str().expect("utf-8 path"),
    );
    let nvml = plugin(
        &["--nvml-library", lib_arg, "--dump-topology", topo_arg],
        &[
            ("DRUST_MOCK_NVML_MACHINE", "dgxb200"),
            (
                "DRUST_MOCK_NVML_FABRIC",
                fabric.to_str().expect("utf-8 path"),
            ),
            ("DRUST_MOCK_NVML_NODE", "mock-node"),
        ],
    );
    let fake = plugin(&["--fake-topology", topo_arg], &[]);
    // The two runs saw each condition first at their own time.
    let untimed = |mut slices: Value| {
        for s in slices.as_array_mut().into_iter().flatten() {
            for d in s["spec"]["devices"].as_array_mut().into_iter().flatten() {
                for t in d["taints"].as_array_mut().into_iter().flatten() {
                    t.as_object_mut().map(|t| t.remove("timeAdded"));
                }
            }
        }
        slices
    };
    assert_eq!(
        untimed(nvml.clone()),
        untimed(fake),
        "the fake backend disagrees with NVML"
    );
    let devices: Vec<&Value> = nvml
        .as_array()
        .expect("slices")
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(devices.len(), 8);
    let clique = format!("{UUID}.4");
    for (i, d) in devices.iter().enumerate() {
        let taints: Vec<String> = d["taints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                assert_eq!(t["key"], "gpu.drust.dev/fabric");
                assert!(t["timeAdded"].is_string(), "{t}");
                format!(
                    "{}:{}",
                    t["value"].as_str().unwrap_or_default(),
                    t["effect"].as_str().unwrap_or_default()
                )
            })
            .collect();
        let (want_clique, want_taints): (Option<&str>, &[&str]) = match i {
            3 => (None, &["registration-in-progress:NoSchedule"]),
            5 => (
                Some(&clique),
                &["route-unhealthy:NoSchedule", "unhealthy:NoSchedule"],
            ),
            // v2: the mask (degraded bandwidth), no summary.
            6 => (Some(&clique), &["degraded-bandwidth:NoSchedule"]),
            7 => (None, &["query-failed:NoSchedule"]),
            _ => (Some(&clique), &[]),
        };
        assert_eq!(attr(d, "nvlinkClique").as_str(), want_clique, "GPU {i}");
        assert_eq!(taints, want_taints, "GPU {i}");
    }
}

/// Usage through the real NVML backend against the mock (`DRUST_MOCK_NVML_USAGE`): the
/// utilization, memory and processes (with per-process SM utilization) its usage file gives
/// GPU 0, each process's pod and
/// container read from its cgroup, and GPU 1 (no file) idle. Run in a child process of this
/// test binary, since the mock reads its environment when it is loaded.
#[test]
fn usage_through_nvml_is_what_the_gpu_reports_with_each_process_s_pod() {
    let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("build the mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let usage = dir.path().join("usage");
    std::fs::create_dir_all(&usage).expect("usage dir");
    std::fs::write(
        usage.join("0.json"),
        r#"{"smPercent": 73, "memoryPercent": 12, "memoryUsedBytes": 3221225472,
            "processes": [{"pid": 4242, "usedMemoryBytes": 1073741824, "smPercent": 61},
                {"pid": 4343}]}"#,
    )
    .expect("usage file");
    let proc_root = dir.path().join("proc");
    std::fs::create_dir_all(proc_root.join("4242")).expect("proc dir");
    std::fs::write(
        proc_root.join("4242/cgroup"),
        "0::/kubepods/burstable/pod0b3c2d1e-8f7a-4b6c-9d5e-1a2b3c4d5e6f/abc123\n",
    )
    .expect("cgroup");
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--ignored", "--exact", "usage_in_a_child", "--nocapture"])
        .env("DRUST_MOCK_NVML_USAGE", &usage)
        .env("DRUST_TEST_MOCK_LIBRARY", &lib)
        .env("DRUST_TEST_PROC_ROOT", &proc_root)
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "the child of usage_through_nvml_is_what_the_gpu_reports_with_each_process_s_pod"]
fn usage_in_a_child() {
    use gpu_kubelet_plugin::usage::sampler::sample_gpus;
    let lib = std::env::var_os("DRUST_TEST_MOCK_LIBRARY").expect("run by its parent test");
    let proc_root = std::env::var_os("DRUST_TEST_PROC_ROOT").expect("run by its parent test");
    let backend = gpu_inventory::NvmlBackend::load(Some(&lib), "/sys".into()).expect("load");
    let samples = sample_gpus(&backend, &[0, 1].into(), Path::new(&proc_root));
    let gpu0 = samples[&0].as_ref().expect("GPU 0");
    assert_eq!(gpu0.usage.sm_percent, Some(73));
    assert_eq!(gpu0.usage.memory_percent, Some(12));
    assert_eq!(gpu0.usage.memory_used_bytes, 3 << 30);
    let procs: Vec<(u32, Option<u64>)> = gpu0
        .usage
        .processes
        .iter()
        .map(|p| (p.pid, p.used_memory_bytes))
        .collect();
    assert_eq!(procs, [(4242, Some(1 << 30)), (4343, None)]);
    // Per-process SM utilization (nvmlDeviceGetProcessUtilization): the computing process's
    // figure, 0 for one without samples.
    let sm: Vec<Option<u32>> = gpu0.usage.processes.iter().map(|p| p.sm_percent).collect();
    assert_eq!(sm, [Some(61), Some(0)]);
    assert_eq!(gpu0.usage.processes[0].gpu_instance_id, None);
    let pod = &gpu0.containers[&4242];
    assert_eq!(
        (pod.pod_uid.as_str(), pod.container_id.as_str()),
        ("0b3c2d1e-8f7a-4b6c-9d5e-1a2b3c4d5e6f", "abc123")
    );
    assert!(
        !gpu0.containers.contains_key(&4343),
        "no cgroup file: no pod"
    );
    let gpu1 = samples[&1].as_ref().expect("GPU 1");
    assert_eq!(
        (
            gpu1.usage.sm_percent,
            gpu1.usage.memory_used_bytes,
            gpu1.usage.processes.len()
        ),
        (Some(0), 0, 0)
    );
}
