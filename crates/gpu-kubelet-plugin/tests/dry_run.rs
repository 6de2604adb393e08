//! `gpu-kubelet-plugin --dry-run` as a user runs it: the binary, a topology file, stdout.

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::resource::v1::ResourceSlice;

fn repo(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

fn dry_run(topology: &str, extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
        .args(["--dry-run", "--node-name", "gpu-node-0", "--fake-topology"])
        .arg(repo(topology))
        .args(extra)
        .output()
        .expect("run gpu-kubelet-plugin");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Compares with `tests/snapshots/<name>`; `UPDATE_SNAPSHOTS=1` rewrites it instead.
fn assert_snapshot(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, actual).expect("write snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path).expect("snapshot exists (UPDATE_SNAPSHOTS=1)");
    assert_eq!(
        actual, expected,
        "{name} changed; review and rerun with UPDATE_SNAPSHOTS=1"
    );
}

/// Every topology in `examples/topologies/`, with the MIG strategies worth a snapshot.
const TOPOLOGIES: &[(&str, &[&str])] = &[
    ("dgx-h100", &["existing"]),
    ("dgx-a100-mig", &["existing", "partitionable"]),
    ("pcie-l40s", &["existing"]),
    ("paired-nvlink-bridges", &["existing"]),
    ("gb200-nvl-tray", &["existing"]),
    ("mixed-a100-l4", &["existing"]),
    ("pcie-a100-mig", &["existing", "partitionable"]),
];

fn parse_yaml(yaml: &str) -> Vec<ResourceSlice> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML document"))
        .collect()
}

#[test]
fn every_topology_matches_its_snapshot_and_passes_api_validation() {
    let listed: Vec<String> = std::fs::read_dir(repo("examples/topologies"))
        .expect("topologies dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    for name in &listed {
        assert!(
            TOPOLOGIES.iter().any(|(t, _)| format!("{t}.yaml") == *name),
            "{name} has no snapshot test"
        );
    }
    for (topology, strategies) in TOPOLOGIES {
        for strategy in *strategies {
            let yaml = dry_run(
                &format!("examples/topologies/{topology}.yaml"),
                &["--mig-strategy", strategy],
            );
            let snapshot = match *strategy {
                "existing" => format!("{topology}.yaml"),
                other => format!("{topology}-{other}.yaml"),
            };
            assert_snapshot(&snapshot, &yaml);
            let slices = parse_yaml(&yaml);
            gpu_inventory::validate::validate_pool(&slices)
                .unwrap_or_else(|e| panic!("{snapshot}: {e}"));
        }
    }
}

/// NVIDIA compatibility mode (`--driver-name gpu.nvidia.com --naming nvidia`): NVIDIA's device
/// names and spellings, on a MIG machine in both strategies and an Ada (L40S) machine.
#[test]
fn nvidia_naming_matches_its_snapshots_and_passes_api_validation() {
    for (topology, strategy) in [
        ("dgx-a100-mig", "existing"),
        ("dgx-a100-mig", "partitionable"),
        ("pcie-l40s", "existing"),
    ] {
        let yaml = dry_run(
            &format!("examples/topologies/{topology}.yaml"),
            &[
                "--driver-name",
                "gpu.nvidia.com",
                "--naming",
                "nvidia",
                "--mig-strategy",
                strategy,
            ],
        );
        let snapshot = format!("nvidia-{topology}-{strategy}.yaml");
        assert_snapshot(&snapshot, &yaml);
        let slices = parse_yaml(&yaml);
        gpu_inventory::validate::validate_pool(&slices)
            .unwrap_or_else(|e| panic!("{snapshot}: {e}"));
        dcgm_contract(&slices, &snapshot);
    }
}

/// What NVIDIA's dcgm-exporter reads to label GPU metrics with pods
/// (`internal/pkg/transformation/dra.go` of github.com/NVIDIA/dcgm-exporter): slices of driver
/// `gpu.nvidia.com`, each device's string attributes `type` (`gpu` or `mig`), `uuid` of a GPU,
/// `parentUUID` (required) and `profile` of a MIG device, keyed by pool and device name. Every
/// device must carry them, as strings, with a parent that is a GPU of the node.
fn dcgm_contract(slices: &[ResourceSlice], what: &str) {
    let string = |d: &k8s_openapi::api::resource::v1::Device, name: &str| {
        d.attributes
            .as_ref()
            .and_then(|a| a.get(name))
            .and_then(|v| v.string.clone())
    };
    let devices: Vec<_> = slices
        .iter()
        .inspect(|s| assert_eq!(s.spec.driver, "gpu.nvidia.com", "{what}"))
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect();
    assert!(!devices.is_empty(), "{what}: no device");
    let mut parents = std::collections::BTreeSet::new();
    for d in &devices {
        match string(d, "type").as_deref() {
            Some("gpu") => {
                assert!(
                    string(d, "uuid").is_some_and(|u| u.starts_with("GPU-")),
                    "{what}: {}",
                    d.name
                );
            }
            Some("mig") => {
                let parent = string(d, "parentUUID");
                assert!(
                    parent.as_ref().is_some_and(|u| u.starts_with("GPU-")),
                    "{what}: {}",
                    d.name
                );
                assert!(string(d, "profile").is_some(), "{what}: {}", d.name);
                parents.insert(parent);
            }
            other => panic!("{what}: {} has type {other:?}", d.name),
        }
    }
    assert!(
        what.starts_with("nvidia-pcie") || !parents.is_empty(),
        "{what}: no MIG device"
    );
}

#[test]
fn json_output_is_an_array_of_resource_slices_equal_to_the_yaml() {
    let json = dry_run("examples/topologies/dgx-h100.yaml", &["-o", "json"]);
    let from_json: Vec<ResourceSlice> = serde_json::from_str(&json).expect("JSON array");
    let yaml = dry_run("examples/topologies/dgx-h100.yaml", &[]);
    let from_yaml = parse_yaml(&yaml);
    assert_eq!(from_json, from_yaml);
    assert_eq!(from_json.len(), 1);
    assert_eq!(from_json[0].spec.devices.as_ref().map(Vec::len), Some(8));
    assert!(json.contains("\"apiVersion\": \"resource.k8s.io/v1\""));
}

/// Every topology's YAML, read by PyYAML (a YAML 1.1 reader, as many CI tools and Ruby are),
/// says exactly what the JSON output says: no PCI bus ID read as a base-60 number, no string
/// read as a bool or date. PyYAML is part of the machine's Python; missing, the test fails.
#[test]
fn yaml_output_reads_the_same_in_a_yaml_1_1_reader_as_the_json() {
    const PYYAML: &str = "import json, sys, yaml\n\
        json.dump([d for d in yaml.safe_load_all(sys.stdin) if d is not None], sys.stdout)";
    for (topology, strategies) in TOPOLOGIES {
        for strategy in *strategies {
            let file = format!("examples/topologies/{topology}.yaml");
            let json = dry_run(&file, &["--mig-strategy", strategy, "-o", "json"]);
            let yaml = dry_run(&file, &["--mig-strategy", strategy, "-o", "yaml"]);
            let mut python = Command::new("python3")
                .args(["-c", PYYAML])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("python3 runs");
            std::io::Write::write_all(&mut python.stdin.take().expect("stdin"), yaml.as_bytes())
                .expect("write to python3");
            let out = python.wait_with_output().expect("python3 ends");
            assert!(
                out.status.success(),
                "{topology} ({strategy}): PyYAML: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let read_by_pyyaml: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("JSON from python3");
            let from_json: serde_json::Value = serde_json::from_str(&json).expect("JSON");
            assert_eq!(
                read_by_pyyaml, from_json,
                "{topology} ({strategy}): PyYAML reads the YAML output otherwise"
            );
        }
    }
}

#[test]
fn a_bad_topology_is_a_clear_error_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "system: {driverVersion: x}\ngpus: []\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
        .args(["--dry-run", "--fake-topology"])
        .arg(&bad)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.yaml") && err.contains("cudaDriverVersion"),
        "{err}"
    );
}

/// Durations that cannot work are refused at start with the flag and the reason, never clamped
/// or accepted: a claim deadline of 0 or beyond the kubelet's 45 s call timeout, a zero
/// interval, an MPS start timeout that does not fit in the claim's deadline.
#[test]
fn nonsense_durations_are_refused_naming_the_flag_and_the_limit() {
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
            .args(["--dry-run", "--node-name", "gpu-node-0", "--fake-topology"])
            .arg(repo("examples/topologies/dgx-h100.yaml"))
            .args(extra)
            .output()
            .expect("run gpu-kubelet-plugin")
    };
    for (flags, expected) in [
        (
            &["--claim-timeout-seconds", "0"][..],
            "--claim-timeout-seconds",
        ),
        (
            &["--claim-timeout-seconds", "45"],
            "within the kubelet's 45 s",
        ),
        (&["--claim-timeout-seconds=-3"], "not a whole number"),
        (
            &["--stale-claim-interval-seconds", "0"],
            "must be 1 to 86400 s",
        ),
        (
            &["--rediscovery-interval-seconds", "0"],
            "--rediscovery-interval-seconds",
        ),
        (
            &["--mps-start-timeout-seconds", "0"],
            "--mps-start-timeout-seconds",
        ),
        (
            &[
                "--claim-timeout-seconds",
                "5",
                "--mps-start-timeout-seconds",
                "5",
            ],
            "must be less than --claim-timeout-seconds (5 s)",
        ),
    ] {
        let out = run(flags);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} accepted");
        assert!(stderr.contains(expected), "{flags:?}: {stderr}");
    }
    let out = run(&[
        "--claim-timeout-seconds",
        "44",
        "--mps-start-timeout-seconds",
        "43",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Fractional GPUs (`--consumable-capacity`): with the MPS control tool found, whole GPUs and
/// existing MIG devices are published shareable (snapshot, API validation); partitionable
/// placements stay exclusive; without the tool nothing is shareable and the plugin says why.
#[test]
fn fractional_gpus_are_published_only_where_mps_can_enforce_them() {
    // Any executable stands for the tool here: the plugin only looks for it at start.
    let tool = [
        "--consumable-capacity",
        "true",
        "--mps-control-binary",
        "/bin/sh",
    ];
    let shareable = |slices: &[ResourceSlice]| -> (usize, usize) {
        let devices: Vec<_> = slices
            .iter()
            .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
            .collect();
        let shared = devices
            .iter()
            .filter(|d| d.allow_multiple_allocations == Some(true))
            .count();
        (shared, devices.len())
    };
    let yaml = dry_run("examples/topologies/dgx-a100-mig.yaml", &tool);
    assert_snapshot("dgx-a100-mig-shares.yaml", &yaml);
    let slices = parse_yaml(&yaml);
    gpu_inventory::validate::validate_pool(&slices).expect("valid");
    let (shared, all) = shareable(&slices);
    assert!(all > 8 && shared == all, "{shared} of {all} shareable");
    // Each says how its shares are enforced: a whole GPU under MPS in EXCLUSIVE_PROCESS, a MIG
    // device bounded by itself.
    for d in slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
    {
        let attr = |name: &str| {
            d.attributes
                .as_ref()
                .and_then(|a| a.get(name))
                .and_then(|v| v.string.clone())
        };
        let want = if attr("type").as_deref() == Some("mig") {
            "mig"
        } else {
            "mps"
        };
        assert_eq!(
            attr("shareEnforcement").as_deref(),
            Some(want),
            "{}",
            d.name
        );
    }

    let mut args = tool.to_vec();
    args.extend(["--mig-strategy", "partitionable"]);
    let slices = parse_yaml(&dry_run("examples/topologies/dgx-a100-mig.yaml", &args));
    let (shared, all) = shareable(&slices);
    // GPUs 4-7 have MIG off: whole, shareable; the placements of GPUs 0-3 consume counters.
    assert_eq!(shared, 4, "{shared} of {all} shareable");

    let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
        .args(["--dry-run", "--node-name", "gpu-node-0", "--fake-topology"])
        .arg(repo("examples/topologies/dgx-h100.yaml"))
        .args(["--consumable-capacity", "true"])
        .args([
            "--mps-control-binary",
            "/nonexistent/nvidia-cuda-mps-control",
        ])
        .output()
        .expect("run");
    assert!(out.status.success());
    let slices = parse_yaml(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(shareable(&slices).0, 0);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("MPS control tool is not found")
            && stderr.contains("published for exclusive use only"),
        "{stderr}"
    );
}
