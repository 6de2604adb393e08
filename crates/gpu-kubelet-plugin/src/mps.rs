//! Per-claim MPS control daemons (CUDA Multi-Process Service).
//!
//! A claim whose devices are configured for MPS ([`crate::claim_config::Sharing::Mps`]) gets its
//! own control daemon, driven through `nvidia-cuda-mps-control` in client mode (commands on
//! stdin), as NVIDIA documents it (MPS guide, "Control daemon"):
//!
//! - `CUDA_VISIBLE_DEVICES` lists the claim's GPU or MIG UUIDs, so the daemon serves only them;
//! - its pipe, log and shared-memory directories are `<root>/<claim-uid>/{pipe,log,shm}`:
//!   derived from the claim UID, so undoing never needs a record;
//! - limits: `set_default_active_thread_percentage <pct>` and, per device ordinal,
//!   `set_default_device_pinned_mem_limit <ordinal> <MiB>M`; both are read back
//!   (`get_default_*`) and a daemon that does not report them is stopped and the prepare fails;
//! - start is bounded: the daemon must answer `get_server_list` within the start timeout.
//!
//! Containers reach the daemon through the pipe directory, mounted at [`CONTAINER_PIPE_DIR`]
//! with `CUDA_MPS_PIPE_DIRECTORY` pointing there, and share its `/dev/shm`
//! ([`MpsControl::container_edits`]).
//!
//! # Where a daemon runs
//!
//! With [`DaemonPods`] (the chart's setting), each daemon runs in its own Pod on this node,
//! created through the API server: `chroot <driver root> nvidia-cuda-mps-control -f` in the
//! plugin's own image, privileged, owned by the plugin's DaemonSet (so uninstalling the chart
//! deletes it), with no ServiceAccount token, the driver root read-only, the claim's directory
//! over the driver root's `/tmp` and
//! its `shm` over the driver root's `/dev/shm`, so the daemon, the servers it spawns and the
//! clients in the claim's containers share one pipe directory and one `/dev/shm` (as NVIDIA's
//! DRA driver runs its daemons, in `cmd/gpu-kubelet-plugin/sharing.go`). The daemon is then not
//! the plugin's child: a plugin restart or a rolling update of the DaemonSet leaves it running
//! and its clients connected; the next instance finds it answering and adopts it. Why a Pod per
//! claim, not a Deployment: the plugin already decides when a daemon must run (prepare,
//! start-up recovery, the periodic check) and starts a lost one with the claim's limits again;
//! a Deployment's controller would restart a daemon without them. `restartPolicy: Never` keeps
//! that decision with the plugin. The daemon of a GPU shared by several claims (fractional GPUs,
//! `crate::claims`' shares) has the same shape with the GPU's lower-cased UUID in place of the
//! claim UID (directories, Pod name and [`CLAIM_UID_LABEL`]) and no default limits: each share's
//! containers bring their own ([`MpsControl::share_edits`]).
//!
//! Without [`DaemonPods`] (plugins run outside Kubernetes, tests), the daemon is started with
//! `-d` in the plugin's process tree and dies with the plugin's container.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use tracing::{info, warn};

use crate::cdi::{ContainerEdits, Mount};

/// Where containers see the claim's MPS pipe directory.
pub const CONTAINER_PIPE_DIR: &str = "/run/nvidia-mps";

/// One device an MPS daemon serves: its UUID (`CUDA_VISIBLE_DEVICES` entry) and its own
/// default pinned-memory limit in bytes (`None`: no limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDevice {
    /// GPU or MIG UUID.
    pub uuid: String,
    /// Bytes, rounded down to whole MiB when applied.
    pub pinned_memory_limit_bytes: Option<u64>,
}

/// How MPS daemons are run on this node.
#[derive(Debug, Clone)]
pub struct MpsControl {
    /// `nvidia-cuda-mps-control` (from the driver root).
    pub binary: PathBuf,
    /// Host directory holding one `<claim-uid>/` directory per daemon.
    pub root: PathBuf,
    /// How long a daemon may take to answer after its start, and each control command or API
    /// call.
    pub start_timeout: Duration,
    /// Run each daemon in its own Pod (survives plugin restarts); `None`: as a child process.
    pub pods: Option<DaemonPods>,
}

/// Where and how daemon Pods run.
#[derive(Clone)]
pub struct DaemonPods {
    /// The API server.
    pub client: kube::Client,
    /// Namespace of the daemon Pods (the plugin's own).
    pub namespace: String,
    /// This node: the Pods' `spec.nodeName`.
    pub node_name: String,
    /// Image with `chroot` (the plugin's own image).
    pub image: String,
    /// `imagePullPolicy` of that image.
    pub pull_policy: String,
    /// `priorityClassName` of the Pods, if any.
    pub priority_class: Option<String>,
    /// The driver root on the host (mounted at `/driver-root`, the daemon's root).
    pub host_driver_root: PathBuf,
    /// `nvidia-cuda-mps-control` inside the driver root.
    pub daemon_binary: PathBuf,
    /// The DaemonSet of the plugin (in `namespace`), named in each Pod's `ownerReferences` so
    /// that deleting it (`helm uninstall`) deletes the daemons too (garbage collection); `None`:
    /// no owner (plugins run outside the chart).
    pub owner: Option<DaemonSetOwner>,
}

/// The plugin's DaemonSet as the owner of daemon Pods: its name, and its UID once looked up
/// (`GET`, at the first daemon Pod; the chart's RBAC allows exactly that one object).
#[derive(Debug, Clone)]
pub struct DaemonSetOwner {
    name: String,
    uid: Arc<tokio::sync::OnceCell<String>>,
}

impl DaemonSetOwner {
    /// The DaemonSet `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            uid: Arc::default(),
        }
    }
}

impl std::fmt::Debug for DaemonPods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonPods")
            .field("namespace", &self.namespace)
            .field("node_name", &self.node_name)
            .field("image", &self.image)
            .field("host_driver_root", &self.host_driver_root)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

/// Label on every daemon Pod naming the claim it serves (for a GPU's share daemon: the GPU's
/// lower-cased UUID).
pub const CLAIM_UID_LABEL: &str = "drust.dev/mps-claim-uid";

/// Whether a daemon is alive, as far as one control command can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// It answered `get_server_list`.
    Answering,
    /// Confirmed dead: its directory is gone, or the control tool ran and found no daemon.
    Dead,
    /// The tool did not answer in time or could not run: the daemon may be alive (a busy node),
    /// so nothing may quit, replace or restart it on this evidence.
    Unknown(String),
}

/// An MPS action failed.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    /// The daemon's state could not be told, so it was neither replaced nor started beside it.
    #[error(
        "MPS control daemon in {pipe_dir} may still run (no clear answer: {problem}); \
         not starting another"
    )]
    Unresponsive {
        /// The pipe directory.
        pipe_dir: PathBuf,
        /// Why its state is unknown.
        problem: String,
    },
    /// A directory could not be created or removed.
    #[error("MPS directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The control tool could not be run.
    #[error("running {binary} {args}: {source}")]
    Spawn {
        /// The tool.
        binary: PathBuf,
        /// Its arguments or command.
        args: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The control tool failed.
    #[error("{binary} {args} failed ({status}): {stderr}")]
    Failed {
        /// The tool.
        binary: PathBuf,
        /// Its arguments or command.
        args: String,
        /// Exit status.
        status: String,
        /// What it printed.
        stderr: String,
    },
    /// The daemon did not answer in time.
    #[error("MPS control daemon in {pipe_dir} did not {what} within {timeout_ms} ms")]
    Timeout {
        /// The pipe directory.
        pipe_dir: PathBuf,
        /// What it did not do.
        what: &'static str,
        /// The bound.
        timeout_ms: u128,
    },
    /// The API server refused or did not answer a call about the daemon's Pod.
    #[error("MPS control daemon pod {namespace}/{name}: {what}: {problem}")]
    Pod {
        /// Namespace of the Pod.
        namespace: String,
        /// Its name.
        name: String,
        /// The call.
        what: &'static str,
        /// The error.
        problem: String,
    },
    /// The daemon does not report the limits it was given.
    #[error("MPS control daemon in {pipe_dir}: {setting} is {found:?} after setting {wanted:?}")]
    LimitNotApplied {
        /// The pipe directory.
        pipe_dir: PathBuf,
        /// The setting.
        setting: String,
        /// What was set.
        wanted: String,
        /// What the daemon reports.
        found: String,
    },
}

/// Where `binary` is: itself when it names a path (has a `/`), else the first executable of that
/// name on `PATH`; `None` when there is no such executable file. Blocking (file system).
pub fn find_binary(binary: &Path) -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if binary.components().count() > 1 || binary.is_absolute() {
        return executable(binary).then(|| binary.to_owned());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|p| executable(p))
}

impl MpsControl {
    /// `<root>/<uid>`.
    pub fn claim_dir(&self, uid: &str) -> PathBuf {
        self.root.join(uid)
    }

    /// `<root>/<uid>/pipe`.
    pub fn pipe_dir(&self, uid: &str) -> PathBuf {
        self.claim_dir(uid).join("pipe")
    }

    /// `<root>/<uid>/shm`: the `/dev/shm` of the daemon, its servers and its clients.
    pub fn shm_dir(&self, uid: &str) -> PathBuf {
        self.claim_dir(uid).join("shm")
    }

    /// The name of the Pod running the daemon of claim `uid`.
    pub fn pod_name(uid: &str) -> String {
        format!("mps-control-daemon-{uid}")
    }

    /// The CDI edits that connect a container to the claim's daemon.
    pub fn container_edits(&self, uid: &str) -> ContainerEdits {
        ContainerEdits {
            env: vec![format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")],
            mounts: vec![
                Mount {
                    host_path: self.pipe_dir(uid).display().to_string(),
                    container_path: CONTAINER_PIPE_DIR.to_owned(),
                    options: vec!["rbind".into(), "rw".into()],
                },
                Mount {
                    host_path: self.shm_dir(uid).display().to_string(),
                    container_path: "/dev/shm".to_owned(),
                    options: vec!["rbind".into(), "rw".into(), "nosuid".into(), "nodev".into()],
                },
            ],
            ..ContainerEdits::default()
        }
    }

    /// The CDI edits of one share's containers (fractional GPUs, [`crate::claims`]' shares):
    /// connected to the daemon of `key` (its device's), with the share's own limits as the
    /// client environment MPS reads at a client's start (NVIDIA's MPS guide, "Environment
    /// variables"): `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M` (the daemon serves one device,
    /// ordinal 0; rounded down to whole MiB so the share is never exceeded) and, when
    /// `compute_percent` is not 0, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    pub fn share_edits(
        &self,
        key: &str,
        memory_bytes: u64,
        compute_percent: u32,
    ) -> ContainerEdits {
        let mut edits = self.container_edits(key);
        edits.env.push(format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M",
            (memory_bytes >> 20).max(1)
        ));
        if compute_percent > 0 {
            edits.env.push(format!(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute_percent}"
            ));
        }
        edits
    }

    /// Starts the daemon of claim `uid` for the devices `visible_ids` (GPU or MIG UUIDs, in
    /// ordinal order) with `limits`. A daemon of the same claim that answers is quit first (it
    /// may have other limits); one whose state cannot be told is left alone and the start fails
    /// ([`MpsError::Unresponsive`]); a dead one's Pod is deleted. The directories are created
    /// when missing and **never removed or recreated here**: running containers hold bind
    /// mounts of them, which must reach the new daemon (only [`Self::stop`], once no claim needs
    /// the daemon, removes them). On error nothing started is left running, and directories
    /// this call created are removed.
    ///
    /// # Errors
    /// [`MpsError`] when the daemon cannot be started, does not answer in time, or does not
    /// report the limits.
    pub async fn start(
        &self,
        uid: &str,
        devices: &[MpsDevice],
        active_thread_percentage: Option<u32>,
    ) -> Result<(), MpsError> {
        match self.liveness(uid).await {
            Liveness::Answering => self.halt(uid, true).await?,
            Liveness::Dead => self.halt(uid, false).await?,
            Liveness::Unknown(problem) => {
                return Err(MpsError::Unresponsive {
                    pipe_dir: self.pipe_dir(uid),
                    problem,
                });
            }
        }
        let pipe = self.pipe_dir(uid);
        let log = self.claim_dir(uid).join("log");
        // Containers of any user reach the daemon through the pipe directory; the plugin's own
        // umask (077) would shut them out. Shared memory is writable by all, as /dev/shm is.
        let dirs = [
            (self.claim_dir(uid), 0o755),
            (pipe.clone(), 0o755),
            (log.clone(), 0o755),
            (self.shm_dir(uid), 0o1777),
        ];
        // Directory work blocks on a slow disk: off the async workers.
        let created = off_workers(&self.claim_dir(uid), move || {
            let created = !dirs[0].0.exists();
            for (dir, mode) in dirs {
                std::fs::create_dir_all(&dir)
                    .and_then(|()| {
                        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                    })
                    .map_err(|source| MpsError::Dir { path: dir, source })?;
            }
            Ok(created)
        })
        .await?;
        let result = self
            .start_in(uid, &pipe, &log, devices, active_thread_percentage)
            .await;
        if result.is_err() {
            let cleanup = if created {
                self.stop(uid).await
            } else {
                self.halt(uid, true).await
            };
            if let Err(e) = cleanup {
                warn!(claim = uid, error = %e, "cleaning up after a failed MPS start failed");
            }
        }
        result
    }

    async fn start_in(
        &self,
        uid: &str,
        pipe: &Path,
        log: &Path,
        devices: &[MpsDevice],
        active_thread_percentage: Option<u32>,
    ) -> Result<(), MpsError> {
        let started = tokio::time::Instant::now();
        let visible_ids: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
        if let Some(pods) = &self.pods {
            let owner = self.owner_uid(pods, uid).await?;
            let pod = self.build_daemon_pod(pods, uid, &visible_ids.join(","), owner)?;
            self.pod_call(pods, uid, "create", async {
                Api::<Pod>::namespaced(pods.client.clone(), &pods.namespace)
                    .create(&PostParams::default(), &pod)
                    .await
                    .map(drop)
            })
            .await?;
        } else {
            // The daemon creates its pipes with the umask it inherits; give it the usual 022.
            let mut daemon = Command::new("sh");
            daemon
                .arg("-c")
                .arg("umask 022 && exec \"$0\" -d")
                .arg(&self.binary)
                .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
                .env("CUDA_MPS_LOG_DIRECTORY", log)
                .env("CUDA_VISIBLE_DEVICES", visible_ids.join(","));
            self.run(daemon, "-d", None).await?;
        }
        // Bounded start: poll until the daemon answers.
        let deadline = started + self.start_timeout;
        loop {
            if self.command(pipe, "get_server_list").await.is_ok() {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                let pod = match &self.pods {
                    Some(pods) => format!(" (pod: {})", self.pod_state(pods, uid).await),
                    None => String::new(),
                };
                warn!(claim = uid, "MPS control daemon did not answer{pod}");
                return Err(MpsError::Timeout {
                    pipe_dir: pipe.to_owned(),
                    what: "answer after start",
                    timeout_ms: self.start_timeout.as_millis(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Each device its own limit, by its ordinal among the visible devices; MPS takes whole
        // MiB, rounded down so the limit is never exceeded.
        let pinned: Vec<(usize, &str, u64)> = devices
            .iter()
            .enumerate()
            .filter_map(|(ordinal, d)| {
                let bytes = d.pinned_memory_limit_bytes?;
                Some((ordinal, d.uuid.as_str(), (bytes >> 20).max(1)))
            })
            .collect();
        self.set_defaults(pipe, active_thread_percentage, &pinned)
            .await?;
        info!(
            claim = uid,
            devices = visible_ids.len(),
            elapsed_ms = started.elapsed().as_millis(),
            "MPS control daemon started"
        );
        Ok(())
    }

    /// Sets the daemon's default limits, for servers it starts from now on, and reads them back:
    /// the active thread percentage, and each `(ordinal, uuid, MiB)` pinned device memory limit
    /// (`set_default_active_thread_percentage`, `set_default_device_pinned_mem_limit`). One
    /// client run sets every limit, another reads them all back (one answer line per `get_*`
    /// command, in order).
    async fn set_defaults(
        &self,
        pipe: &Path,
        active_thread_percentage: Option<u32>,
        pinned: &[(usize, &str, u64)],
    ) -> Result<(), MpsError> {
        let mut set = Vec::new();
        let mut wanted = Vec::new();
        if let Some(pct) = active_thread_percentage {
            set.push(format!("set_default_active_thread_percentage {pct}"));
            wanted.push((
                "get_default_active_thread_percentage".to_owned(),
                "default active thread percentage".to_owned(),
                Limit::Percentage(pct),
            ));
        }
        for (ordinal, uuid, mib) in pinned {
            set.push(format!(
                "set_default_device_pinned_mem_limit {ordinal} {mib}M"
            ));
            wanted.push((
                format!("get_default_device_pinned_mem_limit {ordinal}"),
                format!("device {ordinal} ({uuid}) pinned memory limit"),
                Limit::MiB(*mib),
            ));
        }
        if set.is_empty() {
            return Ok(());
        }
        self.command(pipe, &set.join("\n")).await?;
        let gets: Vec<&str> = wanted.iter().map(|(g, _, _)| g.as_str()).collect();
        let answers = self.command(pipe, &gets.join("\n")).await?;
        let mut lines = answers.lines().map(str::trim).filter(|l| !l.is_empty());
        for (_, setting, limit) in &wanted {
            let found = lines.next().unwrap_or_default();
            let applied = match limit {
                Limit::Percentage(p) => found.parse::<f64>().ok() == Some(f64::from(*p)),
                Limit::MiB(m) => parse_mib(found) == Some(*m),
            };
            if !applied {
                return Err(MpsError::LimitNotApplied {
                    pipe_dir: pipe.to_owned(),
                    setting: setting.clone(),
                    wanted: limit.to_string(),
                    found: found.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Starts the MPS server of Linux user `server_uid` under daemon `uid` now
    /// (`start_server -uid <server_uid>`) rather than at its first client's connection: on a GPU
    /// in `EXCLUSIVE_PROCESS` the server then holds the GPU's one context from the start, so a
    /// process that bypasses MPS finds no context free even before any share's client came.
    ///
    /// # Errors
    /// [`MpsError`] when the control tool fails.
    pub async fn start_server(&self, uid: &str, server_uid: u32) -> Result<(), MpsError> {
        let pipe = self.pipe_dir(uid);
        let answer = self
            .command(&pipe, &format!("start_server -uid {server_uid}"))
            .await?;
        // NVIDIA documents no answer text; what the tool said is kept in the log.
        info!(
            daemon = uid,
            server_uid,
            answer = answer.trim(),
            "started the MPS server"
        );
        Ok(())
    }

    /// Sets the server-side ceiling of the one-device daemon `uid` (a GPU's share daemon): the
    /// default limits for servers started from now on, and the same limits on each running
    /// server (`get_server_list`; `set_device_pinned_mem_limit <pid> 0 <MiB>M`,
    /// `set_active_thread_percentage <pid> <pct>`), which hold for the clients that connect
    /// from now on. A client's own `CUDA_MPS_*` variables can lower its limits below these but
    /// not raise them above (NVIDIA's MPS guide; a 16G client held to the daemon's 10G default:
    /// `tests/gpu/fixtures/h200-580.159.04/shares.txt`).
    ///
    /// # Errors
    /// [`MpsError`] when a command fails or the defaults do not read back.
    pub async fn set_ceiling(&self, uid: &str, ceiling: Ceiling) -> Result<(), MpsError> {
        let pipe = self.pipe_dir(uid);
        let pinned = [(0usize, uid, ceiling.pinned_mib.max(1))];
        self.set_defaults(&pipe, Some(ceiling.active_thread_percentage), &pinned)
            .await?;
        let servers = self.command(&pipe, "get_server_list").await?;
        let per_server: Vec<String> = servers
            .split_whitespace()
            .filter(|pid| pid.parse::<u32>().is_ok())
            .flat_map(|pid| {
                [
                    format!(
                        "set_device_pinned_mem_limit {pid} 0 {}M",
                        ceiling.pinned_mib.max(1)
                    ),
                    format!(
                        "set_active_thread_percentage {pid} {}",
                        ceiling.active_thread_percentage
                    ),
                ]
            })
            .collect();
        if !per_server.is_empty() {
            let answer = self.command(&pipe, &per_server.join("\n")).await?;
            if let Some(refused) = answer.lines().map(str::trim).find(|l| !l.is_empty()) {
                return Err(MpsError::LimitNotApplied {
                    pipe_dir: pipe,
                    setting: "a running server's limits".to_owned(),
                    wanted: ceiling.to_string(),
                    found: refused.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Whether the daemon of claim `uid` answers.
    pub async fn is_running(&self, uid: &str) -> bool {
        self.liveness(uid).await == Liveness::Answering
    }

    /// Whether the daemon of claim `uid` is alive ([`Liveness`]): one `get_server_list`.
    pub async fn liveness(&self, uid: &str) -> Liveness {
        let dir = self.claim_dir(uid);
        match off_workers(&dir.clone(), move || Ok(dir.exists())).await {
            Ok(false) => return Liveness::Dead,
            Ok(true) => {}
            Err(e) => return Liveness::Unknown(e.to_string()),
        }
        match self.command(&self.pipe_dir(uid), "get_server_list").await {
            Ok(_) => Liveness::Answering,
            // The tool ran and said no daemon answers.
            Err(MpsError::Failed { .. }) => Liveness::Dead,
            Err(e) => Liveness::Unknown(e.to_string()),
        }
    }

    /// Stops the daemon of claim `uid` (if any) and removes its directories. Idempotent.
    ///
    /// # Errors
    /// [`MpsError`] when the daemon keeps answering after `quit` or the directory cannot be
    /// removed.
    pub async fn stop(&self, uid: &str) -> Result<(), MpsError> {
        let dir = self.claim_dir(uid);
        let exists = {
            let dir = dir.clone();
            off_workers(&dir.clone(), move || Ok(dir.exists())).await?
        };
        if !exists {
            // A Pod whose directories are gone serves nobody.
            return self.delete_pod(uid).await;
        }
        self.halt(uid, true).await?;
        off_workers(&dir.clone(), move || match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(MpsError::Dir { path: dir, source }),
        })
        .await
    }

    /// Stops the daemon of claim `uid` (`quit` first, when `quit` and it answers) and deletes
    /// its Pod, keeping its directories.
    async fn halt(&self, uid: &str, quit: bool) -> Result<(), MpsError> {
        let pipe = self.pipe_dir(uid);
        if quit && self.command(&pipe, "get_server_list").await.is_ok() {
            // The answer to quit may never come: the daemon exits.
            let _ = self.command(&pipe, "quit").await;
            let deadline = tokio::time::Instant::now() + self.start_timeout;
            while self.command(&pipe, "get_server_list").await.is_ok() {
                if tokio::time::Instant::now() >= deadline {
                    return Err(MpsError::Timeout {
                        pipe_dir: pipe,
                        what: "exit after quit",
                        timeout_ms: self.start_timeout.as_millis(),
                    });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // The daemon has quit (or never answered): its Pod goes.
        self.delete_pod(uid).await
    }

    /// The Pod that runs the daemon of claim `uid` for `visible_ids` (comma-separated GPU or
    /// MIG UUIDs), as [`Self::start`] creates it (see the module docs; its owner looked up as
    /// there); `None` without [`DaemonPods`].
    ///
    /// # Errors
    /// [`MpsError::Pod`] if the owner cannot be looked up or the Pod cannot be built (a bug).
    pub async fn daemon_pod(&self, uid: &str, visible_ids: &str) -> Result<Option<Pod>, MpsError> {
        match &self.pods {
            Some(pods) => {
                let owner = self.owner_uid(pods, uid).await?;
                self.build_daemon_pod(pods, uid, visible_ids, owner)
                    .map(Some)
            }
            None => Ok(None),
        }
    }

    /// The UID of the owning DaemonSet ([`DaemonPods::owner`]), looked up once.
    async fn owner_uid<'p>(
        &self,
        pods: &'p DaemonPods,
        uid: &str,
    ) -> Result<Option<(&'p str, &'p str)>, MpsError> {
        let Some(owner) = &pods.owner else {
            return Ok(None);
        };
        let found = owner
            .uid
            .get_or_try_init(|| async {
                let api = Api::<DaemonSet>::namespaced(pods.client.clone(), &pods.namespace);
                let problem =
                    match tokio::time::timeout(self.start_timeout, api.get(&owner.name)).await {
                        Ok(Ok(ds)) => match ds.metadata.uid {
                            Some(uid) => return Ok(uid),
                            None => "the DaemonSet has no UID".to_owned(),
                        },
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => format!("no answer within {} ms", self.start_timeout.as_millis()),
                    };
                Err(MpsError::Pod {
                    namespace: pods.namespace.clone(),
                    name: Self::pod_name(uid),
                    what: "look up its owner, DaemonSet",
                    problem: format!("{}: {problem}", owner.name),
                })
            })
            .await?;
        Ok(Some((owner.name.as_str(), found.as_str())))
    }

    fn build_daemon_pod(
        &self,
        pods: &DaemonPods,
        uid: &str,
        visible_ids: &str,
        owner: Option<(&str, &str)>,
    ) -> Result<Pod, MpsError> {
        let binary = Path::new("/").join(&pods.daemon_binary);
        // Not the controller: the DaemonSet controller would release (or count) a Pod it
        // controls that its selector does not match. An owner is enough for the collector.
        let owners = owner.map(|(name, owner_uid)| {
            [
                serde_json::json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                                "name": name, "uid": owner_uid}),
            ]
        });
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": Self::pod_name(uid),
                "namespace": pods.namespace,
                "labels": {
                    "app.kubernetes.io/name": "mps-control-daemon",
                    "app.kubernetes.io/managed-by": "gpu-kubelet-plugin",
                    CLAIM_UID_LABEL: uid,
                },
                "ownerReferences": owners,
            },
            "spec": {
                "nodeName": pods.node_name,
                // The plugin starts a lost daemon again, with the claim's limits.
                "restartPolicy": "Never",
                // The namespace's default account, with no token: the daemon calls no API.
                "serviceAccountName": "default",
                "automountServiceAccountToken": false,
                "enableServiceLinks": false,
                "terminationGracePeriodSeconds": 5,
                "priorityClassName": pods.priority_class,
                // It serves a claim already running here: no taint may keep it off the node.
                "tolerations": [{"operator": "Exists"}],
                "containers": [{
                    "name": "mps-control-daemon",
                    "image": pods.image,
                    "imagePullPolicy": pods.pull_policy,
                    "command": ["chroot", "/driver-root", binary, "-f"],
                    "env": [
                        {"name": "CUDA_VISIBLE_DEVICES", "value": visible_ids},
                        {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/pipe"},
                        {"name": "CUDA_MPS_LOG_DIRECTORY", "value": "/tmp/log"},
                    ],
                    // The daemon and its servers open the GPUs' device nodes.
                    "securityContext": {"privileged": true},
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                    "volumeMounts": [
                        // Read-only: the daemon writes only its pipes, log and shared memory.
                        {"name": "driver-root", "mountPath": "/driver-root", "readOnly": true,
                         "mountPropagation": "HostToContainer"},
                        {"name": "claim", "mountPath": "/driver-root/tmp"},
                        {"name": "shm", "mountPath": "/driver-root/dev/shm"},
                    ],
                }],
                "volumes": [
                    {"name": "driver-root",
                     "hostPath": {"path": pods.host_driver_root, "type": "Directory"}},
                    {"name": "claim",
                     "hostPath": {"path": self.claim_dir(uid), "type": "Directory"}},
                    {"name": "shm",
                     "hostPath": {"path": self.shm_dir(uid), "type": "Directory"}},
                ],
            },
        });
        serde_json::from_value(pod).map_err(|e| MpsError::Pod {
            namespace: pods.namespace.clone(),
            name: Self::pod_name(uid),
            what: "build",
            problem: e.to_string(),
        })
    }

    /// Deletes the daemon Pod of claim `uid` at once (its daemon has quit or is lost), if any.
    async fn delete_pod(&self, uid: &str) -> Result<(), MpsError> {
        let Some(pods) = &self.pods else {
            return Ok(());
        };
        self.pod_call(pods, uid, "delete", async {
            match Api::<Pod>::namespaced(pods.client.clone(), &pods.namespace)
                .delete(
                    &Self::pod_name(uid),
                    &DeleteParams::default().grace_period(0),
                )
                .await
            {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// One API call about the daemon Pod of `uid`, bounded by the start timeout.
    async fn pod_call(
        &self,
        pods: &DaemonPods,
        uid: &str,
        what: &'static str,
        call: impl std::future::Future<Output = Result<(), kube::Error>>,
    ) -> Result<(), MpsError> {
        let problem = match tokio::time::timeout(self.start_timeout, call).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {} ms", self.start_timeout.as_millis()),
        };
        Err(MpsError::Pod {
            namespace: pods.namespace.clone(),
            name: Self::pod_name(uid),
            what,
            problem,
        })
    }

    /// The phase and container state of the daemon Pod of `uid`, for error messages.
    async fn pod_state(&self, pods: &DaemonPods, uid: &str) -> String {
        let api = Api::<Pod>::namespaced(pods.client.clone(), &pods.namespace);
        match tokio::time::timeout(self.start_timeout, api.get_opt(&Self::pod_name(uid))).await {
            Ok(Ok(Some(pod))) => {
                let status = pod.status.unwrap_or_default();
                let containers = status
                    .container_statuses
                    .unwrap_or_default()
                    .into_iter()
                    .map(|c| format!("{:?}", c.state))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!("phase {:?}, {containers}", status.phase)
            }
            Ok(Ok(None)) => "not found".to_owned(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer".to_owned(),
        }
    }

    /// Sends one control command to the daemon of `pipe`; its answer.
    async fn command(&self, pipe: &Path, command: &str) -> Result<String, MpsError> {
        let mut client = Command::new(&self.binary);
        client.env("CUDA_MPS_PIPE_DIRECTORY", pipe);
        self.run(client, command, Some(command)).await
    }

    async fn run(
        &self,
        mut cmd: Command,
        args: &str,
        stdin: Option<&str>,
    ) -> Result<String, MpsError> {
        let spawn_err = |source| MpsError::Spawn {
            binary: self.binary.clone(),
            args: args.to_owned(),
            source,
        };
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        // fork and exec block; keep them off the async workers.
        let mut child = tokio::task::spawn_blocking(move || cmd.spawn())
            .await
            .map_err(|e| spawn_err(std::io::Error::other(e)))?
            .map_err(spawn_err)?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            match pipe.write_all(format!("{text}\n").as_bytes()).await {
                // The tool exited without reading (no daemon to send to): its exit status
                // says so.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                other => other.map_err(spawn_err)?,
            }
        }
        let output = tokio::time::timeout(self.start_timeout, child.wait_with_output())
            .await
            .map_err(|_| MpsError::Timeout {
                pipe_dir: self.root.clone(),
                what: "finish a control command",
                timeout_ms: self.start_timeout.as_millis(),
            })?
            .map_err(spawn_err)?;
        if !output.status.success() {
            return Err(MpsError::Failed {
                binary: self.binary.clone(),
                args: args.to_owned(),
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}

/// A limit as set, to compare with what the daemon reports.
enum Limit {
    Percentage(u32),
    MiB(u64),
}

/// A one-device daemon's server-side limits ([`MpsControl::set_ceiling`]): no client of it
/// gets more, whatever its own variables say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ceiling {
    /// Pinned device memory, MiB.
    pub pinned_mib: u64,
    /// Active thread percentage, 1..=100.
    pub active_thread_percentage: u32,
}

impl std::fmt::Display for Ceiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}M pinned, {}% threads",
            self.pinned_mib, self.active_thread_percentage
        )
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Percentage(p) => write!(f, "{p}"),
            Self::MiB(m) => write!(f, "{m}M"),
        }
    }
}

/// `2048M`, `2G` or `2048` (MiB) as MiB.
fn parse_mib(text: &str) -> Option<u64> {
    let text = text.trim_end_matches('B');
    if let Some(g) = text.strip_suffix('G') {
        return g.parse::<u64>().ok().map(|g| g << 10);
    }
    text.strip_suffix('M').unwrap_or(text).parse().ok()
}

/// Runs blocking file work under `path` on the blocking pool. A panic there is a bug and is
/// resumed here; a task the shutting-down runtime never ran is an error about `path`.
async fn off_workers<T: Send + 'static>(
    path: &Path,
    work: impl FnOnce() -> Result<T, MpsError> + Send + 'static,
) -> Result<T, MpsError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(r) => r,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(join) => Err(MpsError::Dir {
            path: path.to_owned(),
            source: std::io::Error::other(join.to_string()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control(dir: &Path) -> MpsControl {
        MpsControl {
            binary: drust_fakes::mps_control().to_owned(),
            root: dir.to_owned(),
            start_timeout: Duration::from_secs(10),
            pods: None,
        }
    }

    #[tokio::test]
    async fn a_daemon_starts_with_its_limits_and_stops_without_a_trace() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mps = control(tmp.path());
        let devices = [
            MpsDevice {
                uuid: "MIG-a".to_owned(),
                pinned_memory_limit_bytes: Some(1 << 30),
            },
            MpsDevice {
                uuid: "MIG-b".to_owned(),
                pinned_memory_limit_bytes: Some(3 << 30),
            },
        ];
        mps.start("uid-1", &devices, Some(40)).await.expect("start");
        assert!(mps.is_running("uid-1").await);
        let log = std::fs::read_to_string(tmp.path().join("uid-1/log/control.log")).expect("log");
        assert!(log.contains("CUDA_VISIBLE_DEVICES=MIG-a,MIG-b"), "{log}");
        assert!(
            log.contains("set_default_active_thread_percentage 40"),
            "{log}"
        );
        // Each device gets its own limit.
        assert!(
            log.contains("set_default_device_pinned_mem_limit 0 1024M"),
            "{log}"
        );
        assert!(
            log.contains("set_default_device_pinned_mem_limit 1 3072M"),
            "{log}"
        );
        mps.stop("uid-1").await.expect("stop");
        assert!(!mps.is_running("uid-1").await);
        assert!(!tmp.path().join("uid-1").exists());
        mps.stop("uid-1").await.expect("stopping twice is fine");
    }

    /// A control tool that hangs (a wedged driver) fails the start within the start timeout,
    /// is killed, and leaves nothing behind: the claim's prepare fails in time instead of
    /// holding its GPU locks until the kubelet gives up.
    #[tokio::test]
    async fn a_hung_control_tool_fails_the_start_within_the_timeout() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("tmp");
        let tool = tmp.path().join("hung-mps-control");
        std::fs::write(
            &tool,
            "#!/bin/sh
exec sleep 3600
",
        )
        .expect("script");
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let mut mps = control(&tmp.path().join("mps"));
        mps.binary = tool;
        mps.start_timeout = Duration::from_millis(500);
        // The tool never answers (it sleeps an hour): an answer at all is the timeout's.
        let err = mps
            .start(
                "uid-3",
                &[MpsDevice {
                    uuid: "GPU-a".to_owned(),
                    pinned_memory_limit_bytes: None,
                }],
                None,
            )
            .await
            .expect_err("a hung tool");
        assert!(matches!(err, MpsError::Timeout { .. }), "{err}");
        assert!(!tmp.path().join("mps/uid-3").exists());
    }

    #[tokio::test]
    async fn a_daemon_that_fails_to_start_leaves_nothing_behind() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mut mps = control(tmp.path());
        mps.binary = tmp.path().join("missing-binary");
        let err = mps
            .start(
                "uid-2",
                &[MpsDevice {
                    uuid: "GPU-a".to_owned(),
                    pinned_memory_limit_bytes: None,
                }],
                None,
            )
            .await
            .expect_err("no binary");
        assert!(err.to_string().contains("missing-binary"), "{err}");
        assert!(!tmp.path().join("uid-2").exists());
    }

    #[test]
    fn pinned_limits_are_read_back_in_any_unit() {
        assert_eq!(parse_mib("2048M"), Some(2048));
        assert_eq!(parse_mib("2G"), Some(2048));
        assert_eq!(parse_mib("512"), Some(512));
        assert_eq!(parse_mib("lots"), None);
    }
}
