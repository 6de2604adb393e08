//! The `kernel` enforcement level's memory limits: each share container's cgroup gets a hard
//! limit on its GPU equal to the share's memory, enforced by the driver for every process of
//! the container whatever their environment says (NVIDIA's MPS guide, release 615, "MPS v3
//! Memory Partitioning"; NVML `nvmlDeviceSetMemoryLimits_v1`).
//!
//! A container's cgroup exists only once the runtime creates the container, so the limit is set
//! by a CDI hook in the share's device edits ([`KernelMemory::hook`]): the runtime runs
//! `drust-cdi-hook` (a small binary shipped with the plugin, no shell) with the container's OCI
//! state on stdin. The hook point is `createRuntime`, not `createContainer`: both run after the
//! runtime put the container's process in its cgroup and before the user's program starts, but
//! the OCI runtime spec runs `createContainer` hooks in the container's namespaces, where a
//! private cgroup namespace (the default under cgroup v2) shows the container's cgroup as `/`;
//! `createRuntime` hooks run in the runtime's namespaces, on the host (runc: after the cgroup
//! manager's `Apply` and `Set`, with `prestart`). The hook finds the container's cgroup v2
//! directory from its process (`/proc/<pid>/cgroup`, the `0::` line, under the cgroup v2 root),
//! writes a record first and then sets the limit ([`run_hook`]); when it cannot, it fails, and
//! the runtime does not start the container: a share never runs without its limit.
//!
//! Records: `<records>/<claim uid>/<container id>.json`, `{"gpu": "<uuid>", "cgroup": "<dir>",
//! "bytes": n}`. Unprepare clears every limit its claim's records name whose cgroup still exists
//! (removing the cgroup clears them too, NVML API reference) and removes the records
//! ([`KernelMemory::clear_claim`]); start-up recovery does the same for every claim it does not
//! keep ([`KernelMemory::recorded_claims`]).
//!
//! Requirements, checked at start-up ([`KernelMemory::detect`]): a backend with memory
//! partitioning (driver r615+ with the entry point), cgroup v2 at the cgroup root (the driver
//! requires it at `/sys/fs/cgroup`), and the hook binary installed where the runtime can run it
//! (`<plugin dir>/bin/drust-cdi-hook-<digest>`, a host path). MIG devices are excluded: NVML
//! refuses MIG handles, and their MIG partition already bounds them.
//!
//! The installed hook's name carries the first 16 hex digits of its SHA-256
//! ([`installed_hook_name`]): during a rolling update the new plugin (a standby) installs its
//! own hook beside the running one's, never over it, so each CDI spec keeps running the hook of
//! the plugin that wrote it, with the arguments that hook parses. The active plugin removes,
//! at start-up, every installed hook that is neither its own nor named by a CDI spec it keeps
//! ([`remove_unused_hooks`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpu_inventory::{GpuBackend, MemoryLimits};

use crate::cdi::Hook;
use crate::config::{Backend, Config};
use crate::hardware::{Hardware, HardwareError};

mod hook;
mod records;

pub use hook::{HookError, run_hook};
use records::{Record, lock_records, pod_cgroup, pod_total};

/// The settings' names for the hook binary and the cgroup root (settings import nothing of
/// the plugin; the layers run settings, then this).
pub use crate::config::{DEFAULT_CGROUP_ROOT, HOOK_BINARY};

/// The OCI hook point the hook runs at (see the module docs for why not `createContainer`).
pub const HOOK_POINT: &str = "createRuntime";

/// The hook's subcommand that sets a share's limit.
pub const MEMORY_LIMIT_COMMAND: &str = "memory-limit";

/// The most seconds the runtime lets the hook run (CDI `hooks[].timeout`): NVML's call is quick;
/// a hung driver must not hold container creation for long.
pub const HOOK_TIMEOUT_SECONDS: u32 = 30;

/// The largest OCI state the hook reads from stdin.
const MAX_STATE_BYTES: u64 = 1 << 20;

/// The `kernel` level's memory limits on this node: where the hook is, what it is told and
/// where its records are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelMemory {
    /// The installed hook, a host path.
    hook: PathBuf,
    /// The hook's arguments naming the GPU backend (the plugin's own).
    backend_args: Vec<String>,
    /// The cgroup v2 root.
    cgroup_root: PathBuf,
    /// The record directory.
    records: PathBuf,
}

/// Why the `kernel` level is not available on this node; the `mps` level applies.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    /// The driver or its library has no memory partitioning.
    #[error(
        "the GPU driver has no per-cgroup memory limits (needs r{} or later with \
         nvmlDeviceSetMemoryLimits_v1)",
        gpu_inventory::backend::MEMORY_PARTITIONING_DRIVER_MAJOR
    )]
    Driver,
    /// The driver version could not be read.
    #[error("reading the driver version: {0}")]
    Backend(#[from] gpu_inventory::BackendError),
    /// No cgroup v2 hierarchy where it must be.
    #[error("{root} is not a cgroup v2 hierarchy (no cgroup.controllers){hint}")]
    Cgroup {
        /// The cgroup root checked.
        root: PathBuf,
        /// What else is required.
        hint: &'static str,
    },
    /// The share daemons' MPS v3 namespace sockets would not fit a Unix socket path
    /// ([`crate::mps::namespace_sockets_fit`]).
    #[error("{0}")]
    MpsSockets(String),
    /// The hook binary could not be installed.
    #[error("installing the CDI hook {from} as {to}: {source}")]
    Hook {
        /// The binary shipped with the plugin.
        from: PathBuf,
        /// Where the runtime is to run it.
        to: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

impl KernelMemory {
    /// The `kernel` level for `config` with `backend`, or why not: memory partitioning in the
    /// driver (r615 and later, which also bring MPS v3), cgroup v2 at `config.cgroup_root`
    /// (with NVML, exactly `/sys/fs/cgroup`, the driver's requirement), MPS v3 namespace sockets
    /// that fit under `config.mps_root`, and, with `install`, the hook `config.cdi_hook_binary` copied to
    /// `<plugin dir>/bin/` under its digest ([`installed_hook_name`]; written atomically, mode
    /// 0755, never over an installed hook; `--dry-run` writes nothing).
    /// Blocking (NVML, file copies).
    ///
    /// # Errors
    /// [`Unavailable`], naming what is missing.
    pub fn detect(
        config: &Config,
        backend: &dyn GpuBackend,
        install_hook: bool,
    ) -> Result<Self, Unavailable> {
        if !backend.memory_partitioning()? {
            return Err(Unavailable::Driver);
        }
        let root = &config.cgroup_root;
        let nvml = matches!(config.backend, Backend::Nvml { .. });
        if !root.join("cgroup.controllers").is_file()
            || (nvml && root != Path::new(DEFAULT_CGROUP_ROOT))
        {
            return Err(Unavailable::Cgroup {
                root: root.clone(),
                hint: if nvml {
                    "; the driver needs cgroup v2 mounted at /sys/fs/cgroup"
                } else {
                    ""
                },
            });
        }
        // The level's compute: the GPUs' share daemons on MPS v3, a namespace socket per share.
        crate::mps::namespace_sockets_fit(&config.mps_root, config.mps_daemon_pods.is_some())
            .map_err(Unavailable::MpsSockets)?;
        let hook = self::install_hook(
            &config.cdi_hook_binary,
            &config.sockets.plugin_dir,
            install_hook,
        )
        .map_err(|(to, source)| Unavailable::Hook {
            from: config.cdi_hook_binary.clone(),
            to,
            source,
        })?;
        Ok(Self {
            hook,
            backend_args: backend_args(config),
            cgroup_root: root.clone(),
            records: config.sockets.plugin_dir.join("memory-limits"),
        })
    }

    /// The installed hook this plugin's specs run, a host path.
    pub fn hook_path(&self) -> &Path {
        &self.hook
    }

    /// The `createRuntime` hook that limits the container of `claim_uid`'s share on GPU
    /// `gpu_uuid` to `bytes` of its memory.
    pub fn hook(&self, claim_uid: &str, gpu_uuid: &str, bytes: u64) -> Hook {
        let mut args = vec![
            HOOK_BINARY.to_owned(),
            MEMORY_LIMIT_COMMAND.to_owned(),
            "--gpu".to_owned(),
            gpu_uuid.to_owned(),
            "--bytes".to_owned(),
            bytes.to_string(),
            "--claim".to_owned(),
            claim_uid.to_owned(),
            "--records".to_owned(),
            self.records.display().to_string(),
            "--cgroup-root".to_owned(),
            self.cgroup_root.display().to_string(),
        ];
        args.extend(self.backend_args.iter().cloned());
        Hook {
            hook_name: HOOK_POINT.to_owned(),
            path: self.hook.display().to_string(),
            args,
            env: Vec::new(),
            timeout: Some(HOOK_TIMEOUT_SECONDS),
        }
    }

    /// Clears the limits the hook set for `claim_uid`'s containers and removes their records.
    /// A record whose cgroup is gone needs nothing (the driver dropped its limits with it).
    /// Returns how many limits were cleared. Blocking.
    ///
    /// # Errors
    /// [`HardwareError`] when a limit cannot be cleared (its record stays, for a retry) or a
    /// record cannot be removed.
    pub fn clear_claim<H: Hardware + ?Sized>(
        &self,
        hardware: &H,
        claim_uid: &str,
    ) -> Result<usize, HardwareError> {
        let dir = self.records.join(claim_uid);
        let io = |path: &Path, source: std::io::Error| HardwareError::LimitRecord {
            claim: claim_uid.to_owned(),
            path: path.to_owned(),
            source,
        };
        if !dir.is_dir() {
            return Ok(0);
        }
        let _lock = lock_records(&self.records).map_err(|(path, e)| io(&path, e))?;
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(io(&dir, e)),
        };
        let mut cleared = 0;
        let mut pods = BTreeSet::new();
        for entry in entries {
            let path = entry.map_err(|e| io(&dir, e))?.path();
            // A record the hook was still writing (a crash) names nothing set yet.
            if let Some(record) = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Record>(&b).ok())
            {
                if record.cgroup.is_dir() {
                    hardware.set_memory_limits(
                        &record.gpu,
                        &record.cgroup,
                        MemoryLimits::CLEARED,
                    )?;
                    cleared += 1;
                }
                if let Some(pod) = pod_cgroup(&record.cgroup) {
                    pods.insert((record.gpu.clone(), pod.to_owned()));
                }
            }
            std::fs::remove_file(&path).map_err(|e| io(&path, e))?;
        }
        if let Err(e) = std::fs::remove_dir(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            return Err(io(&dir, e));
        }
        // What the pod still holds of other claims on the GPU, or nothing.
        for (gpu, pod) in pods.into_iter().filter(|(_, pod)| pod.is_dir()) {
            let total = pod_total(&self.records, &gpu, &pod);
            let limits = if total == 0 {
                MemoryLimits::CLEARED
            } else {
                MemoryLimits::share(total)
            };
            hardware.set_memory_limits(&gpu, &pod, limits)?;
        }
        Ok(cleared)
    }

    /// The claims (by UID) that have records, for recovery to clear those it does not keep.
    pub fn recorded_claims(&self) -> BTreeSet<String> {
        std::fs::read_dir(&self.records)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect()
    }
}

/// The hook arguments that open the plugin's backend on the host: NVML from the plugin's
/// library, as a host path (a library under the driver root as the plugin reads it, e.g. the
/// chart's `/driver-root/...`, is named under the driver root on the host), or the fake's files.
fn backend_args(config: &Config) -> Vec<String> {
    let root = &config.driver_root;
    match &config.backend {
        Backend::Nvml { library: None } => Vec::new(),
        Backend::Nvml {
            library: Some(library),
        } => {
            let host = library
                .strip_prefix(&root.root)
                .map_or_else(|_| library.clone(), |rest| root.host_root.join(rest));
            vec!["--nvml-library".to_owned(), host.display().to_string()]
        }
        Backend::Fake {
            topology,
            state_dir,
        } => {
            let mut args = vec!["--fake-topology".to_owned(), topology.display().to_string()];
            if let Some(dir) = state_dir {
                args.extend(["--fake-state-dir".to_owned(), dir.display().to_string()]);
            }
            args
        }
    }
}

/// The hook binary `from` installed in `<plugin_dir>/bin/` under [`installed_hook_name`]
/// (with `install`; written atomically, mode 0755, never over an installed hook): its path, a
/// host path the container runtime runs. Blocking (reads and copies the binary).
///
/// # Errors
/// The path that could not be read or written, and why.
pub fn install_hook(
    from: &Path,
    plugin_dir: &Path,
    install: bool,
) -> Result<PathBuf, (PathBuf, std::io::Error)> {
    let dir = plugin_dir.join("bin");
    let name = installed_hook_name(from).map_err(|e| (from.to_owned(), e))?;
    let hook = dir.join(name);
    if install {
        self::install(from, &hook).map_err(|e| (hook.clone(), e))?;
    }
    Ok(hook)
}

/// Copies `from` to `to` (atomically replaced, mode 0755).
/// `drust-cdi-hook-<the first 16 hex digits of the SHA-256 of the binary at from>`: the name
/// it is installed under (module docs). Blocking (reads the binary).
///
/// # Errors
/// The binary cannot be read.
pub fn installed_hook_name(from: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(std::fs::read(from)?);
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    Ok(format!("{HOOK_BINARY}-{hex}"))
}

/// Removes the installed hooks in `dir` (files named `drust-cdi-hook` or `drust-cdi-hook-*`)
/// other than `keep` and those `specs_name` names (the hook paths of the CDI specs kept).
/// Returns the paths removed; failures are logged. Blocking.
pub fn remove_unused_hooks(dir: &Path, keep: &Path, specs_name: &BTreeSet<String>) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for path in entries.flatten().map(|e| e.path()) {
        let ours = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
            n == HOOK_BINARY
                || n.strip_prefix(HOOK_BINARY)
                    .is_some_and(|r| r.starts_with('-'))
        });
        let shown = path.display().to_string();
        if !ours || path == keep || specs_name.contains(&shown) {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(shown),
            Err(e) => tracing::warn!(path = %shown, error = %e,
                "removing an unused CDI hook binary failed; retried at the next start"),
        }
    }
    removed
}

/// Copies the hook to `to` unless a file with its name (its digest) is there already: an
/// installed hook is never replaced while a container start may run it.
fn install(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = to.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    if to.is_file() {
        return Ok(());
    }
    let tmp = to.with_extension(format!("new{}", std::process::id()));
    std::fs::copy(from, &tmp)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_loads_nvml_from_the_host_path_of_the_plugins_library() {
        let mut config = Config::new(
            "gpu.drust.dev",
            "n",
            Backend::Nvml {
                library: Some("/driver-root/usr/lib64/libnvidia-ml.so.1".into()),
            },
        );
        config.driver_root = crate::driver_files::DriverRoot {
            root: "/driver-root".into(),
            host_root: "/run/nvidia/driver".into(),
            hook: None,
        };
        assert_eq!(
            backend_args(&config),
            [
                "--nvml-library",
                "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.1"
            ]
        );
        config.backend = Backend::Nvml { library: None };
        assert!(backend_args(&config).is_empty());
    }

    #[test]
    fn only_a_kubelet_pod_cgroup_gets_the_pod_level_limit() {
        for (container, pod) in [
            ("/sys/fs/cgroup/kubepods/burstable/pod1a2b-3c/abc", true),
            ("/sys/fs/cgroup/kubepods/pod1a2b-3c/abc", true),
            (
                "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/\
                 kubepods-burstable-pod1a2b_3c.slice/cri-containerd-abc.scope",
                true,
            ),
            (
                "/sys/fs/cgroup/kubepods.slice/kubepods-pod1a2b_3c.slice/x.scope",
                true,
            ),
            ("/sys/fs/cgroup/system.slice/containerd.service", false),
            ("/sys/fs/cgroup/kubepods/burstable/podcast/abc", false),
            (
                "/sys/fs/cgroup/kubepods.slice/kubepods-evil-pod12.slice/x.scope",
                false,
            ),
        ] {
            assert_eq!(
                pod_cgroup(Path::new(container)).is_some(),
                pod,
                "{container}"
            );
        }
    }

    #[test]
    fn bad_hook_arguments_and_states_are_refused_with_the_reason() {
        let args = |extra: &[&str]| -> Vec<String> {
            [
                "memory-limit",
                "--gpu",
                "GPU-1",
                "--bytes",
                "1073741824",
                "--claim",
                "uid-1",
                "--records",
                "/tmp/r",
                "--cgroup-root",
                "/sys/fs/cgroup",
            ]
            .iter()
            .chain(extra)
            .map(|s| (*s).to_owned())
            .collect()
        };
        let never = |_: Option<&Path>,
                     _: Option<(&Path, Option<&Path>)>|
         -> Result<Box<dyn GpuBackend>, String> { Err("not reached".into()) };
        let err = run_hook(
            &args(&["--bogus", "1"]),
            &b""[..],
            Path::new("/proc"),
            never,
        )
        .expect_err("unknown flag");
        assert!(err.to_string().contains("--bogus"), "{err}");
        let mut bad_claim = args(&[]);
        bad_claim[6] = "../etc".into();
        assert!(matches!(
            run_hook(&bad_claim, &b""[..], Path::new("/proc"), never),
            Err(HookError::Usage(_))
        ));
        let err = run_hook(
            &args(&[]),
            &b"{\"id\": \"../x\", \"pid\": 1}"[..],
            Path::new("/proc"),
            never,
        )
        .expect_err("bad id");
        assert!(err.to_string().contains("../x"), "{err}");
        let err = run_hook(
            &args(&[]),
            &b"{\"id\": \"c1\"}"[..],
            Path::new("/proc"),
            never,
        )
        .expect_err("no pid");
        assert!(err.to_string().contains("no pid"), "{err}");
    }
}
