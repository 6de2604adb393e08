//! `bench_usage`: what GPU usage sampling costs the node plugin. The plugin's real NVML backend
//! against the mock `libnvidia-ml` (NVIDIA's go-nvml mock DGX H100, 8 GPUs, each running
//! `--processes` processes whose cgroups name their pods), sampled and turned into a report with
//! 8 prepared claims, `--rounds` times, exactly as the sampler does each interval.
//!
//! Prints the CPU time (user + system, `getrusage`) and wall time per sample, what that is as a
//! share of one core at a 10-second interval, and the resident memory after the first 100
//! samples and at the end (growth: what the sampler keeps).
//!
//! No upstream peer runs here: DCGM exporter needs a GPU and DCGM; the mock's cost per NVML call
//! is its own (cgo into Go, and a file read per call), not the driver's. `--fake` runs the same
//! samples and reports on the fake backend with the same answers: the plugin's own cost.
//!
//! `cargo run --release -p drust-e2e --bin bench_usage -- [--rounds N] [--processes P] [--fake]`

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use gpu_inventory::{GpuBackend, MigStrategy, NvmlBackend};
use gpu_kubelet_plugin::checkpoint::{ClaimRecord, ClaimState, RecordedDevice};
use gpu_kubelet_plugin::usage::IdleThresholds;
use gpu_kubelet_plugin::usage::report::{Containers, IdleTracker, Inputs, PodRef, build};
use gpu_kubelet_plugin::usage::sampler::sample_gpus;

fn arg(name: &str, default: u64) -> anyhow::Result<u64> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .context("a value after the flag")?
            .parse()
            .with_context(|| format!("{name} takes a whole number")),
        None => Ok(default),
    }
}

/// User plus system CPU time of this process.
fn cpu() -> Duration {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).map(|u| {
        let t = |tv: nix::sys::time::TimeVal| {
            Duration::new(tv.tv_sec() as u64, (tv.tv_usec() * 1000) as u32)
        };
        t(u.user_time()) + t(u.system_time())
    });
    usage.unwrap_or_default()
}

/// Resident set size, KiB (`VmRSS` of `/proc/self/status`).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() -> anyhow::Result<()> {
    let rounds = arg("--rounds", 2000)?;
    let processes = arg("--processes", 4)?;
    if std::env::var_os("DRUST_BENCH_USAGE_CHILD").is_none() {
        // The mock reads its environment when it is loaded: set it up, then run again.
        let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1")
            .map_err(anyhow::Error::msg)?;
        let dir = tempfile::tempdir()?;
        let (usage, proc_root) = (dir.path().join("usage"), dir.path().join("proc"));
        std::fs::create_dir_all(&usage)?;
        for gpu in 0..8u32 {
            let procs: Vec<serde_json::Value> = (0..processes)
                .map(|p| {
                    let pid = 10_000 + gpu as u64 * 100 + p;
                    serde_json::json!({"pid": pid, "usedMemoryBytes": 1u64 << 30,
                        "smPercent": 10 + p})
                })
                .collect();
            let json = serde_json::json!({"smPercent": 40 + gpu, "memoryPercent": 10,
                "memoryUsedBytes": processes << 30, "processes": procs});
            std::fs::write(usage.join(format!("{gpu}.json")), json.to_string())?;
            for p in 0..processes {
                let pid = 10_000 + gpu as u64 * 100 + p;
                let d = proc_root.join(pid.to_string());
                std::fs::create_dir_all(&d)?;
                std::fs::write(
                    d.join("cgroup"),
                    format!(
                        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b3c2d1e_8f7a_4b6c_9d5e_1a2b3c4d5e{gpu:02}.slice/cri-containerd-{:064x}.scope\n",
                        pid
                    ),
                )?;
            }
        }
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args().skip(1))
            .env("DRUST_BENCH_USAGE_CHILD", "1")
            .env("DRUST_MOCK_NVML_USAGE", &usage)
            .env("DRUST_MOCK_NVML_LIB", &lib)
            .env("DRUST_BENCH_PROC", &proc_root)
            .status()?;
        anyhow::ensure!(status.success(), "the measuring run failed: {status}");
        return Ok(());
    }
    let lib = std::env::var_os("DRUST_MOCK_NVML_LIB").context("set by the parent")?;
    let proc_root = std::env::var_os("DRUST_BENCH_PROC").context("set by the parent")?;
    // `--fake`: the fake backend with the same answers, to tell the plugin's own cost (and
    // memory) from the mock library's.
    let backend: Box<dyn GpuBackend> = if std::env::args().any(|a| a == "--fake") {
        let fake = gpu_inventory::FakeBackend::from_file(drust_e2e::manifests::repo_path(
            "examples/topologies/dgx-h100.yaml",
        ))?;
        for gpu in 0..8u32 {
            let path = Path::new(&std::env::var_os("DRUST_MOCK_NVML_USAGE").context("usage")?)
                .join(format!("{gpu}.json"));
            fake.set_usage(gpu, serde_json::from_slice(&std::fs::read(path)?)?);
        }
        Box::new(fake)
    } else {
        Box::new(NvmlBackend::load(Some(&lib), "/sys".into())?)
    };
    let backend = backend.as_ref();
    let inventory = gpu_inventory::discover(backend)?;
    let devices = gpu_kubelet_plugin::hardware::node_devices(&inventory, MigStrategy::Existing);
    let claims: Vec<(String, ClaimRecord)> = devices
        .keys()
        .enumerate()
        .map(|(i, name)| {
            let record = ClaimRecord {
                namespace: "team".into(),
                name: format!("claim-{i}"),
                state: ClaimState::PrepareCompleted,
                devices: vec![RecordedDevice {
                    request_names: vec!["gpu".into()],
                    pool_name: "node".into(),
                    device_name: name.clone(),
                    cdi_device_ids: Vec::new(),
                    uuid: String::new(),
                    admin_access: false,
                    sharing: None,
                    mig: None,
                    share: None,
                    imex_channel: None,
                }],
                cdi_spec_path: Default::default(),
                cdi_spec: Default::default(),
            };
            (format!("uid-{i}"), record)
        })
        .collect();
    let pods: BTreeMap<String, Vec<PodRef>> = (0..claims.len())
        .map(|i| {
            (
                format!("uid-{i}"),
                vec![PodRef {
                    name: format!("pod-{i}"),
                    uid: format!("0b3c2d1e-8f7a-4b6c-9d5e-1a2b3c4d5e{i:02}"),
                }],
            )
        })
        .collect();
    let gpus = devices.values().map(|d| d.gpu().raw.index).collect();
    let mut tracker = IdleTracker::default();
    let mut sample = || {
        let samples = sample_gpus(backend, &gpus, Path::new(&proc_root));
        let inputs = Inputs {
            node: "node",
            devices: &devices,
            claims: &claims,
            samples: &samples,
            pods: &pods,
            containers: Containers::none(),
            thresholds: IdleThresholds::default(),
        };
        build(&inputs, &mut tracker, Instant::now(), 0)
    };
    let first = sample();
    anyhow::ensure!(
        first.devices.len() == 8
            && first
                .devices
                .iter()
                .all(|d| d.processes.len() == processes as usize
                    && d.processes.iter().all(|p| p.pod.is_some())),
        "every GPU sampled with its processes attributed: {first:#?}"
    );
    let _ = backend.device_count()?;
    for _ in 1..100 {
        sample();
    }
    let rss_100 = rss_kib();
    let (cpu0, wall0) = (cpu(), Instant::now());
    for _ in 0..rounds {
        sample();
    }
    let (cpu_used, wall) = (cpu() - cpu0, wall0.elapsed());
    let per_cpu = cpu_used / u32::try_from(rounds).unwrap_or(u32::MAX);
    let per_wall = wall / u32::try_from(rounds).unwrap_or(u32::MAX);
    let what = if std::env::args().any(|a| a == "--fake") {
        "fake backend"
    } else {
        "NVML backend, mock library"
    };
    println!(
        "| {what} | 8 GPUs x {processes} processes | {rounds} samples | CPU {:.3} ms/sample | wall {:.3} ms/sample | {:.4} % of one core at 10 s | RSS {} KiB after 100, {} KiB after {} |",
        per_cpu.as_secs_f64() * 1e3,
        per_wall.as_secs_f64() * 1e3,
        per_cpu.as_secs_f64() / 10.0 * 100.0,
        rss_100,
        rss_kib(),
        rounds + 100
    );
    Ok(())
}
