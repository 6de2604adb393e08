//! Runs the plugin's real NVML, driver-file and MPS code on a machine with a GPU, without a
//! kubelet or an API server; `tests/gpu/validate.sh` drives it and keeps what it prints as a
//! fixture.
//!
//! ```text
//! gpu_probe nvml      --driver-root DIR            # JSON: system, every GPU, gpu_state, one
//!                                                  # health-event wait, the driver files found
//! gpu_probe mps-start --driver-root DIR --mps-root DIR --uid UID [--threads N] [--pinned-mib M]
//! gpu_probe mps-stop  --driver-root DIR --mps-root DIR --uid UID
//! gpu_probe mps-start-v3 --driver-root DIR --mps-root DIR --uid KEY
//! gpu_probe mps-namespace --driver-root DIR --mps-root DIR --uid KEY --claim UID --pinned-mib M [--threads N]
//! gpu_probe mps-namespace-delete --driver-root DIR --mps-root DIR --uid KEY --claim UID
//! gpu_probe mig       --driver-root DIR            # create and destroy one MIG device
//! gpu_probe usage     --driver-root DIR [--rounds N] [--interval-ms M]
//!                     # N samples (default 3) of every GPU as the usage sampler takes them,
//!                     # M ms apart (default 1000): NVML's answer, each process's pod and
//!                     # container from /proc/<pid>/cgroup, the time each took, the RSS
//! ```
//!
//! Nothing here changes a GPU's settings: no MIG mode, no time slice, no clocks. `mig` needs a
//! GPU whose MIG mode an administrator already enabled; it creates the smallest MIG device at
//! the first free placement and destroys it again, as a partitionable claim's prepare and
//! unprepare do. `mps-start`
//! starts an MPS control daemon (a process) for every GPU with the limits given, the way a
//! prepare does, and `mps-stop` quits it the way an unprepare does.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use gpu_inventory::{GpuBackend, NvmlBackend};
use gpu_kubelet_plugin::driver_files::{BINARY_DIRS, DriverRoot, find_library};
use gpu_kubelet_plugin::mps::{MpsControl, MpsDevice, NamespaceLimits, namespace_name};
use serde_json::json;

struct Args {
    command: String,
    driver_root: PathBuf,
    mps_root: PathBuf,
    uid: String,
    threads: Option<u32>,
    pinned_mib: Option<u64>,
    claim: String,
    rounds: u32,
    interval_ms: u64,
}

fn args() -> anyhow::Result<Args> {
    let mut it = std::env::args().skip(1);
    let command = it
        .next()
        .context("usage: gpu_probe nvml|mps-start|mps-stop [flags]")?;
    let mut a = Args {
        command,
        driver_root: PathBuf::from("/"),
        mps_root: PathBuf::from("/tmp/drust-probe-mps"),
        uid: "4d7a2b5e-9c1f-4e0a-8b3d-2f6e1a7c9d10".to_owned(),
        threads: None,
        pinned_mib: None,
        claim: String::new(),
        rounds: 3,
        interval_ms: 1000,
    };
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--driver-root" => a.driver_root = value.into(),
            "--mps-root" => a.mps_root = value.into(),
            "--uid" => a.uid = value,
            "--threads" => a.threads = Some(value.parse().context("--threads")?),
            "--pinned-mib" => a.pinned_mib = Some(value.parse().context("--pinned-mib")?),
            "--claim" => a.claim = value,
            "--rounds" => a.rounds = value.parse().context("--rounds")?,
            "--interval-ms" => a.interval_ms = value.parse().context("--interval-ms")?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

fn nvml(root: &Path) -> anyhow::Result<NvmlBackend> {
    let library = find_library(root, "libnvidia-ml.so.1");
    NvmlBackend::load(
        library.as_deref().map(Path::as_os_str),
        PathBuf::from("/sys"),
    )
    .context("loading NVML")
}

fn probe_nvml(root: &Path) -> anyhow::Result<serde_json::Value> {
    let library = find_library(root, "libnvidia-ml.so.1");
    let backend = nvml(root)?;
    let system = backend.system().context("system")?;
    let count = backend.device_count().context("device_count")?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let started = Instant::now();
        let gpu = backend
            .gpu(index)
            .with_context(|| format!("gpu({index})"))?;
        let full_us = started.elapsed().as_micros();
        let started = Instant::now();
        let state = backend
            .gpu_state(index)
            .with_context(|| format!("gpu_state({index})"))?;
        let state_us = started.elapsed().as_micros();
        let agrees = state.uuid == gpu.uuid && state.minor == gpu.minor;
        gpus.push(json!({
            "gpu": gpu,
            "gpuStateAgrees": agrees,
            "gpuStateMigDevices": state.mig_devices.len(),
            "fullQueryMicros": full_us,
            "stateQueryMicros": state_us,
        }));
    }
    let started = Instant::now();
    let health = match backend.wait_health_event(Duration::from_secs(2)) {
        Ok(None) => json!({"result": "no event", "waitedMillis": started.elapsed().as_millis()}),
        Ok(Some(e)) => json!({"result": "event", "event": format!("{e:?}")}),
        Err(e) => json!({"result": "error", "error": e.to_string()}),
    };
    let files = DriverRoot {
        root: root.to_owned(),
        host_root: root.to_owned(),
        hook: None,
    }
    .discover(&system.driver_version);
    Ok(json!({
        "nvmlLibrary": library.map(|p| p.display().to_string()),
        "system": system,
        "deviceCount": count,
        "gpus": gpus,
        "healthEventWait": health,
        "driverFiles": {
            "missingLibcuda": files.missing_libcuda(),
            "libraries": files.libraries,
            "binaries": files.binaries,
            "firmware": files.firmware,
            "sockets": files.sockets,
            "hook": files.hook,
            "containerEdits": files.container_edits(),
        },
    }))
}

fn probe_mig(root: &Path) -> anyhow::Result<serde_json::Value> {
    use gpu_inventory::backend::MigMode;
    let backend = nvml(root)?;
    for index in 0..backend.device_count()? {
        let gpu = backend.gpu(index)?;
        if gpu.mig_mode != MigMode::Enabled {
            continue;
        }
        let Some(profile) = gpu.mig_profiles.iter().min_by_key(|p| p.slice_count) else {
            continue;
        };
        let mut refusals = Vec::new();
        for placement in &profile.placements {
            let started = Instant::now();
            let created = match backend.create_mig_device(index, profile.id, *placement) {
                Ok(created) => created,
                Err(e) => {
                    refusals.push(format!("{placement:?}: {e}"));
                    continue;
                }
            };
            let create_ms = started.elapsed().as_millis();
            let listed = backend
                .gpu_state(index)?
                .mig_devices
                .iter()
                .any(|d| d.uuid == created.uuid);
            let started = Instant::now();
            let destroyed = backend.destroy_mig_device(
                index,
                created.gpu_instance_id,
                created.compute_instance_id,
            )?;
            let destroy_ms = started.elapsed().as_millis();
            let gone = !backend
                .gpu_state(index)?
                .mig_devices
                .iter()
                .any(|d| d.uuid == created.uuid);
            return Ok(json!({
                "gpu": index,
                "profile": profile.id,
                "created": format!("{created:?}"),
                "listedAfterCreate": listed,
                "destroyed": destroyed,
                "goneAfterDestroy": gone,
                "createMillis": create_ms,
                "destroyMillis": destroy_ms,
                "refusedPlacements": refusals,
            }));
        }
        bail!(
            "GPU {index}: every placement of profile {} was refused: {refusals:?}",
            profile.id
        );
    }
    Ok(json!({"skipped": "no GPU has MIG mode enabled"}))
}

fn mps_binary(root: &Path) -> PathBuf {
    BINARY_DIRS
        .iter()
        .map(|dir| root.join(dir).join("nvidia-cuda-mps-control"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("nvidia-cuda-mps-control"))
}

async fn mps(a: &Args) -> anyhow::Result<serde_json::Value> {
    let control = MpsControl {
        binary: mps_binary(&a.driver_root),
        root: a.mps_root.clone(),
        start_timeout: Duration::from_secs(10),
        pods: None,
    };
    let started = Instant::now();
    if a.command == "mps-stop" {
        control.stop(&a.uid).await?;
        return Ok(json!({"stopped": true, "millis": started.elapsed().as_millis()}));
    }
    // The `kernel` level's share daemon (MPS v3) of GPU 0 and a share's namespace on it, as
    // the plugin makes them.
    match a.command.as_str() {
        "mps-start-v3" => {
            let uuid = nvml(&a.driver_root)?.gpu_state(0)?.uuid;
            control.start_v3(&a.uid, &uuid).await?;
            return Ok(
                json!({"started": true, "millis": started.elapsed().as_millis(),
                "device": uuid, "pipeDirectory": control.pipe_dir(&a.uid),
                "running": control.is_running(&a.uid).await}),
            );
        }
        "mps-namespace" | "mps-namespace-delete" => {
            let name = namespace_name(&a.claim);
            if a.command == "mps-namespace-delete" {
                control.delete_namespace(&a.uid, &name).await?;
            } else {
                let limits = NamespaceLimits {
                    pinned_mib: a.pinned_mib.context("--pinned-mib")?,
                    active_thread_percentage: a.threads,
                };
                control.set_namespace(&a.uid, &name, limits).await?;
            }
            return Ok(
                json!({"namespace": name, "millis": started.elapsed().as_millis(),
                "directory": control.namespace_dir(&a.uid, &name),
                "namespaces": control.namespaces(&a.uid).await?}),
            );
        }
        _ => {}
    }
    let backend = nvml(&a.driver_root)?;
    let mut devices = Vec::new();
    for index in 0..backend.device_count()? {
        devices.push(MpsDevice {
            uuid: backend.gpu_state(index)?.uuid,
            pinned_memory_limit_bytes: a.pinned_mib.map(|m| m << 20),
        });
    }
    control.start(&a.uid, &devices, a.threads).await?;
    Ok(json!({
        "started": true,
        "millis": started.elapsed().as_millis(),
        "binary": control.binary,
        "pipeDirectory": control.pipe_dir(&a.uid),
        "devices": devices.iter().map(|d| &d.uuid).collect::<Vec<_>>(),
        "running": control.is_running(&a.uid).await,
    }))
}

/// This process's resident set, KiB (`VmRSS` of `/proc/self/status`).
fn rss_kib() -> Option<u64> {
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// `rounds` samples of every GPU through the sampler's own code, `interval_ms` apart.
fn probe_usage(a: &Args) -> anyhow::Result<serde_json::Value> {
    use gpu_kubelet_plugin::usage::sampler::sample_gpus;
    let backend = nvml(&a.driver_root)?;
    let gpus: std::collections::BTreeSet<u32> =
        (0..backend.device_count().context("device_count")?).collect();
    let rss_before = rss_kib();
    let mut rounds = Vec::new();
    for round in 0..a.rounds {
        if round > 0 {
            std::thread::sleep(Duration::from_millis(a.interval_ms));
        }
        let started = Instant::now();
        let samples = sample_gpus(&backend, &gpus, Path::new("/proc"));
        let micros = started.elapsed().as_micros();
        let samples: serde_json::Map<String, serde_json::Value> = samples
            .into_iter()
            .map(|(index, sample)| {
                let value = match sample {
                    Ok(s) => json!({
                        "usage": s.usage,
                        "pods": s.containers.iter().map(|(pid, c)| (pid.to_string(),
                            json!({"podUid": c.pod_uid, "containerId": c.container_id})))
                            .collect::<serde_json::Map<_, _>>(),
                    }),
                    Err(e) => json!({"error": e}),
                };
                (index.to_string(), value)
            })
            .collect();
        rounds.push(json!({"micros": micros, "gpus": samples}));
    }
    Ok(json!({
        "rounds": rounds,
        "rssKibBefore": rss_before,
        "rssKibAfter": rss_kib(),
    }))
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let a = args()?;
    let out = match a.command.as_str() {
        "nvml" => probe_nvml(&a.driver_root)?,
        "mig" => probe_mig(&a.driver_root)?,
        "usage" => probe_usage(&a)?,
        "mps-start" | "mps-stop" | "mps-start-v3" | "mps-namespace" | "mps-namespace-delete" => {
            tokio::runtime::Runtime::new()?.block_on(mps(&a))?
        }
        other => bail!(
            "unknown command {other}: nvml, mig, usage, mps-start, mps-stop, mps-start-v3, \
             mps-namespace or mps-namespace-delete"
        ),
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
