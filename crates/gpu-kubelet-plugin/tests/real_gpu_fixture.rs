//! What a real GPU published, replayed through the fake backend.
//!
//! `tests/gpu/validate.sh` ran the plugin's NVML backend on a machine with a real GPU and kept
//! its output under `tests/gpu/fixtures/<gpu>-<driver>/`: the backend's raw answers
//! (`probe.json`) and the slices `--dry-run` printed from them (`slices*.json`). A topology made
//! of those raw answers must publish exactly those slices through the fake backend, so the fake
//! used by every other test is shown to agree with the NVML path on real hardware. The published
//! `memory` is what CUDA can allocate (total less the driver's reserve), checked against what
//! CUDA itself reported in the same run. Where `tests/gpu/fabric.sh` recorded the driver's
//! NVLink fabric answers (`fabric.json`: every struct version's return code and fields), they
//! are replayed through drust's reading of them, and the GPU with that answer must publish what
//! it published without one.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/gpu/fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.expect("fixture entry").path())
        .filter(|p| p.join("probe.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_builtin_mig_tables_use_the_profile_ids_a_real_gpu_reports() {
    let mut checked = 0;
    for dir in fixtures() {
        let probe = read_json(&dir.join("probe.json"));
        for gpu in probe["gpus"].as_array().expect("probe.json: gpus") {
            for p in gpu["gpu"]["migProfiles"].as_array().into_iter().flatten() {
                let profile = p["profile"].as_u64().expect("profile") as u32;
                let id = p["id"].as_u64().expect("id") as u32;
                if profile_ids_known(profile) {
                    assert_eq!(
                        gpu_inventory::mig_tables::profile_id(profile),
                        id,
                        "{}: NVML_GPU_INSTANCE_PROFILE {profile}",
                        dir.display()
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 7, "only {checked} profiles checked");
}

#[test]
fn a_builtin_mig_table_is_what_the_real_gpu_reports() {
    let mut compared = 0;
    for dir in fixtures() {
        let probe = read_json(&dir.join("probe.json"));
        for gpu in probe["gpus"].as_array().expect("probe.json: gpus") {
            let raw: gpu_inventory::RawGpu =
                serde_json::from_value(gpu["gpu"].clone()).expect("a RawGpu");
            let Some(mut builtin) = gpu_inventory::mig_tables::builtin_profiles(&raw.name) else {
                continue;
            };
            let mut real = raw.mig_profiles.clone();
            builtin.sort_by_key(|p| p.profile);
            real.sort_by_key(|p| p.profile);
            assert_eq!(builtin, real, "{}: {}", dir.display(), raw.name);
            compared += 1;
        }
    }
    // The H100 fixture has a built-in table (the H200 has none).
    assert!(compared >= 1, "no fixture GPU has a built-in MIG table");
}

/// The driver's reserve nvidia-smi reported in the fixture's run, MiB.
fn smi_reserved_mib(dir: &Path) -> u64 {
    let xml = std::fs::read_to_string(dir.join("nvidia-smi-q.xml")).expect("nvidia-smi-q.xml");
    xml.split("<fb_memory_usage>")
        .nth(1)
        .and_then(|t| t.split("<reserved>").nth(1))
        .and_then(|t| t.split(" MiB").next())
        .and_then(|m| m.trim().parse().ok())
        .expect("fb_memory_usage/reserved")
}

/// The `NVML_GPU_INSTANCE_PROFILE_*` values the built-in tables hold.
fn profile_ids_known(profile: u32) -> bool {
    [0, 1, 2, 3, 4, 7, 9].contains(&profile)
}

#[test]
fn the_fake_backend_publishes_what_nvml_published_on_a_real_gpu() {
    let dirs = fixtures();
    assert!(
        !dirs.is_empty(),
        "no fixture with a probe.json under tests/gpu/fixtures"
    );
    for dir in dirs {
        let probe = read_json(&dir.join("probe.json"));
        // The probe predates the driver's reserve in the raw answers: nvidia-smi's
        // `fb_memory_usage/reserved` of the same run (one GPU per fixture) stands for it.
        let reserved = smi_reserved_mib(&dir) << 20;
        let gpus: Vec<Value> = probe["gpus"]
            .as_array()
            .expect("probe.json: gpus")
            .iter()
            .map(|g| {
                let mut gpu = g["gpu"].clone();
                gpu["memoryReservedBytes"] = json!(reserved);
                gpu
            })
            .collect();
        let total = gpus[0]["memoryTotalBytes"]
            .as_u64()
            .expect("memoryTotalBytes");
        let usable = total - reserved;
        // What CUDA itself reports as the GPU's total (PyTorch, the run's MPS client).
        let cuda = std::fs::read_to_string(dir.join("mps-client.txt")).expect("mps-client.txt");
        let cuda_gib = cuda
            .split("total capacity of ")
            .nth(1)
            .and_then(|t| t.split(" GiB").next())
            .and_then(|g| g.parse::<f64>().ok())
            .expect("PyTorch's total capacity");
        assert!(
            (usable as f64 / f64::from(1u32 << 30) - cuda_gib).abs() < 0.005,
            "{}: published {usable} bytes, CUDA reports {cuda_gib} GiB",
            dir.display()
        );
        let topology = json!({"system": probe["system"], "gpus": gpus});
        let tmp = tempfile::tempdir().expect("tempdir");
        let file = tmp.path().join("topology.yaml");
        std::fs::write(&file, topology.to_string()).expect("write topology");
        for (strategy, slices) in [
            ("existing", "slices.json"),
            ("partitionable", "slices-partitionable.json"),
        ] {
            let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
                .args(["--dry-run", "-o", "json", "--node-name", "gpu-validation"])
                .args(["--mig-strategy", strategy, "--fake-topology"])
                .arg(&file)
                .output()
                .expect("run gpu-kubelet-plugin");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let published: Value = serde_json::from_slice(&out.stdout).expect("JSON slices");
            // The real run published the framebuffer's size; drust now publishes what CUDA can
            // allocate. Everything else must agree as recorded.
            let mut expected = read_json(&dir.join(slices));
            for d in expected[0]["spec"]["devices"]
                .as_array_mut()
                .into_iter()
                .flatten()
            {
                let memory = &mut d["capacity"]["memory"]["value"];
                if *memory == json!(format!("{}Mi", total >> 20)) {
                    *memory = json!(format!("{}Mi", usable >> 20));
                }
            }
            assert!(
                expected[0]["spec"]["devices"]
                    .as_array()
                    .is_some_and(|d| !d.is_empty()),
                "{}: the real GPU published no device",
                dir.display()
            );
            assert_eq!(
                published,
                expected,
                "{} ({strategy}): the fake backend disagrees with NVML",
                dir.display()
            );
        }
    }
}

/// One recorded struct answer of `tests/gpu/fabric.sh` (`fabric.json`), as the driver returned
/// it: the call's return code and, on success, the fields.
fn recorded_answer(rec: &Value) -> (u32, gpu_inventory::fabric::RawFabricAnswer) {
    let code = rec["return"]
        .as_str()
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("a return code");
    let hex = rec["clusterUuid"].as_str().unwrap_or("");
    let mut uuid = [0u8; 16];
    for (k, b) in uuid.iter_mut().enumerate() {
        *b = hex
            .get(2 * k..2 * k + 2)
            .map_or(0, |h| u8::from_str_radix(h, 16).expect("hex"));
    }
    let mask = rec["healthMask"]
        .as_str()
        .map(|m| u32::from_str_radix(m.trim_start_matches("0x"), 16).expect("a hex mask"));
    let raw = gpu_inventory::fabric::RawFabricAnswer {
        cluster_uuid: uuid,
        status: rec["status"].as_u64().unwrap_or(0) as u32,
        clique_id: rec["cliqueId"].as_u64().unwrap_or(0) as u32,
        state: rec["state"].as_u64().unwrap_or(0) as u8,
        health_mask: mask,
        health_summary: rec["healthSummary"].as_u64().map(|s| s as u8),
    };
    (code, raw)
}

#[test]
fn a_real_gpus_fabric_answers_replay_as_no_fabric_and_publish_no_clique_and_no_taint() {
    use gpu_inventory::fabric::{FabricHealthSummary, FabricState, negotiate};
    let mut replayed = 0;
    for dir in fixtures() {
        let Ok(text) = std::fs::read_to_string(dir.join("fabric.json")) else {
            continue;
        };
        let fabric: Value = serde_json::from_str(&text).expect("fabric.json");
        // The driver has the v1 and versioned calls; drust does not need the v4 one it lacks.
        assert_eq!(
            fabric["symbols"]["nvmlDeviceGetGpuFabricInfoV"],
            true,
            "{}",
            dir.display()
        );
        let probe = read_json(&dir.join("probe.json"));
        let mut gpus: Vec<Value> = probe["gpus"]
            .as_array()
            .expect("probe.json: gpus")
            .iter()
            .map(|g| g["gpu"].clone())
            .collect();
        for rec in fabric["gpus"].as_array().expect("fabric.json: gpus") {
            let answers = |v: u8| match v {
                3 => recorded_answer(&rec["v3"]),
                2 => recorded_answer(&rec["v2"]),
                _ => recorded_answer(&rec["v1"]),
            };
            // As the driver answered: v3, Success, state NOT_SUPPORTED, zeros.
            let info = negotiate(|v| Some(answers(v)))
                .expect("no error")
                .expect("an answer, not NOT_SUPPORTED");
            assert_eq!(info.state, FabricState::NotSupported, "{}", dir.display());
            assert!(info.zero_uuid() && info.clique().is_none());
            assert_eq!(info.health_mask, Some(0));
            assert_eq!(info.health_summary, Some(FabricHealthSummary::NotSupported));
            // The same driver, had it not known v3: what it answered an unknown version tag
            // (25, Argument version mismatch) sends drust to v2, which reads the same.
            let mismatch = recorded_answer(&rec["v9Tag"]).0;
            assert_eq!(
                mismatch,
                gpu_inventory::fabric::NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            );
            let v2 = negotiate(|v| {
                Some(if v == 3 {
                    (mismatch, Default::default())
                } else {
                    answers(v)
                })
            })
            .expect("no error")
            .expect("an answer");
            assert_eq!(
                (v2.state, v2.health_summary),
                (FabricState::NotSupported, None)
            );
            let index = rec["index"].as_u64().expect("index") as usize;
            gpus[index]["fabric"] = serde_json::to_value(&info).expect("JSON");
            replayed += 1;
        }
        // Published with and without that answer: the same slices (no clique, no taint).
        let tmp = tempfile::tempdir().expect("tempdir");
        let publish = |gpus: &[Value]| {
            let file = tmp.path().join("topology.yaml");
            std::fs::write(
                &file,
                json!({"system": probe["system"], "gpus": gpus}).to_string(),
            )
            .expect("write topology");
            let out = Command::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"))
                .args(["--dry-run", "-o", "json", "--node-name", "gpu-validation"])
                .arg("--fake-topology")
                .arg(&file)
                .output()
                .expect("run gpu-kubelet-plugin");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            serde_json::from_slice::<Value>(&out.stdout).expect("JSON slices")
        };
        let with = publish(&gpus);
        let without: Vec<Value> = gpus
            .iter()
            .map(|g| {
                let mut g = g.clone();
                g.as_object_mut().map(|o| o.remove("fabric"));
                g
            })
            .collect();
        assert_eq!(with, publish(&without), "{}", dir.display());
        let text = with.to_string();
        assert!(
            !text.contains("nvlinkClique") && !text.contains("taints"),
            "{text}"
        );
    }
    assert!(replayed >= 1, "no fixture has a fabric.json");
}
