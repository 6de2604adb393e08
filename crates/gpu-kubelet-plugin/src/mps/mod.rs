//! Per-claim MPS control daemons (CUDA Multi-Process Service).
//!
//! A claim whose devices are configured for MPS ([`crate::claim_config::Sharing::Mps`]) gets its
//! own control daemon, driven through `nvidia-cuda-mps-control` in client mode (commands on
//! stdin), as NVIDIA documents it (MPS guide, "Control daemon"):
//!
//! - `CUDA_VISIBLE_DEVICES` lists the claim's GPU or MIG UUIDs, so the daemon serves only them;
//! - its pipe and log directories are `<root>/<claim-uid>/{pipe,log}`: derived from the claim
//!   UID, so undoing never needs a record;
//! - limits: `set_default_active_thread_percentage <pct>` and, per device ordinal,
//!   `set_default_device_pinned_mem_limit <ordinal> <MiB>M`; both are read back
//!   (`get_default_*`) and a daemon that does not report them is stopped and the prepare fails;
//! - start is bounded: the daemon must answer `get_server_list` within the start timeout.
//!
//! Containers reach the daemon through the pipe directory alone, mounted at
//! [`CONTAINER_PIPE_DIR`] with `CUDA_MPS_PIPE_DIRECTORY` pointing there
//! ([`MpsControl::container_edits`]). Each keeps its own `/dev/shm`: Volta and later MPS (every
//! GPU drust shares through MPS, [`MIN_MPS_COMPUTE_CAPABILITY`]) passes nothing through
//! `/dev/shm` between a server and its clients. Seen on an H100, driver 580.159.04
//! (`tests/gpu/mps_shm.sh`, fixture `h100-580.159.04/shm.txt`): clients in their own mount,
//! PID and IPC namespaces, each with a private tmpfs (or the host's, or the daemon's mounted
//! read-only) as `/dev/shm`, all ran through the server on a GPU in `EXCLUSIVE_PROCESS`, and
//! no file appeared in any `/dev/shm`. (NVIDIA's plugins share one `/dev/shm` between a daemon
//! and its clients; a `cuda.shm.*` file there was reported of MPS in 2024,
//! NVIDIA/k8s-device-plugin#467, GPU and driver not stated, and pre-Volta MPS on P4 GPUs
//! needs the shared directory, kubernetes-sigs/dra-driver-nvidia-gpu#978.)
//!
//! # Where a daemon runs
//!
//! With [`DaemonPods`] (the chart's setting), each daemon runs in its own Pod on this node,
//! created through the API server: `chroot <driver root> nvidia-cuda-mps-control -f` in the
//! plugin's own image, privileged, owned by the plugin's DaemonSet (so uninstalling the chart
//! deletes it), with no ServiceAccount token, the driver root read-only, the claim's directory
//! over the driver root's `/tmp`, so the daemon, the servers it spawns and the clients in the
//! claim's containers share one pipe directory (as NVIDIA's DRA driver runs its daemons, in
//! `cmd/gpu-kubelet-plugin/sharing.go`), and a size-limited tmpfs of its own
//! ([`DAEMON_SHM_SIZE`], a memory `emptyDir`) over the driver root's `/dev/shm`, so that
//! nothing the daemon or its servers write lands on the host's. The daemon is then not
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
//!
//! # Protocols
//!
//! Per-claim daemons and the `mps` level's share daemons speak legacy MPS ([`Protocol`]). At the
//! `kernel` level a GPU's share daemon runs on MPS v3 ([`MpsControl::start_v3`], the daemon Pod's
//! command gains `-p 3 -m`), and each share gets its own namespace (`v3.rs`'s module docs). The
//! daemon's protocol is recorded in its directory, so every later call speaks it.
//!
//! The Pod ([`DaemonPods`], `pod.rs`), the v3 namespaces (`v3.rs`), the containers' CDI edits
//! (`edits.rs`) and the control tool's process runner (`runner.rs`) live in their own files; this
//! one holds the daemon's lifecycle (start, limits, liveness, stop) and the legacy protocol's
//! commands.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use tokio::process::Command;
use tracing::{info, warn};

mod edits;
mod pod;
mod runner;
mod v3;

pub use pod::{DaemonPods, DaemonSetOwner};
pub use v3::{NamespaceLimits, V3_SERVER, namespace_name, namespace_sockets_fit};

/// Where containers see the claim's MPS pipe directory.
pub const CONTAINER_PIPE_DIR: &str = "/run/nvidia-mps";

/// Where a share's containers find its mark: a read-only mount at `<this>/<claim UID>` of the
/// socket directory they already have, so that the usage sampler can tell which share a
/// process's container holds (`usage::share_mounts`).
pub const SHARE_MARK_DIR: &str = "/run/drust/shares";

/// The size of a daemon Pod's own `/dev/shm` (a memory `emptyDir`, Kubernetes quantity): a
/// bound on what the daemon and its servers can put in memory there. Volta and later MPS
/// writes nothing there (module docs); the admission policy pins this value.
pub const DAEMON_SHM_SIZE: &str = "16Mi";

/// The lowest CUDA compute capability (major) whose MPS drust runs: Volta (7.0). Its clients'
/// limits (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`) and its
/// server-client protocol without shared `/dev/shm` are Volta MPS's (NVIDIA's MPS guide,
/// "Volta MPS"); pre-Volta MPS has neither.
pub const MIN_MPS_COMPUTE_CAPABILITY: u32 = 7;

/// One device an MPS daemon serves: its UUID (`CUDA_VISIBLE_DEVICES` entry) and its own
/// default pinned-memory limit in bytes (`None`: no limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDevice {
    /// GPU or MIG UUID.
    pub uuid: String,
    /// Bytes, rounded down to whole MiB when applied.
    pub pinned_memory_limit_bytes: Option<u64>,
}

/// The control protocol a daemon speaks (NVIDIA's MPS guide, "MPS v3 Interface"). Recorded in
/// the daemon's directory (`protocol`, holding `3` for v3) before it starts, so that whoever
/// finds the daemon later (a restarted plugin, the next instance of a rolling update) speaks
/// to it in its own protocol, whatever the node's level is by then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Legacy MPS (v2): commands on the tool's stdin; one server per Linux user; limits as
    /// daemon defaults and per server.
    Legacy,
    /// MPS v3 (driver r615 and later): `module verb` commands as the tool's arguments, named
    /// servers with namespaces, each namespace its own socket and limits. The daemon runs with
    /// `-p 3 -m` (multiuser: one root-owned server serves clients of every user).
    V3,
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
    /// A running daemon speaks another protocol than this node's level needs: it was started
    /// before the level changed (an upgrade to the `kernel` level with shares running).
    #[error(
        "MPS control daemon in {pipe_dir} runs {running:?} MPS, this node's share level needs \
         {wanted:?}: new shares of its GPU are prepared once the shares it serves are gone and \
         it stops"
    )]
    ProtocolMismatch {
        /// The pipe directory.
        pipe_dir: PathBuf,
        /// What the daemon speaks.
        running: Protocol,
        /// What the node's level needs.
        wanted: Protocol,
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

    /// `<root>/<uid>/protocol`: `3` for a v3 daemon; absent for a legacy one ([`Protocol`]).
    fn protocol_file(&self, uid: &str) -> PathBuf {
        self.claim_dir(uid).join("protocol")
    }

    /// The protocol daemon `uid` speaks, as recorded in its directory; `None` when it has no
    /// directory (no daemon). Blocking work off the async workers.
    ///
    /// # Errors
    /// [`MpsError::Dir`] when the record cannot be read.
    pub async fn protocol(&self, uid: &str) -> Result<Option<Protocol>, MpsError> {
        let (dir, file) = (self.claim_dir(uid), self.protocol_file(uid));
        off_workers(&dir.clone(), move || {
            if !dir.exists() {
                return Ok(None);
            }
            match std::fs::read_to_string(&file) {
                Ok(text) if text.trim() == "3" => Ok(Some(Protocol::V3)),
                Ok(_) => Ok(Some(Protocol::Legacy)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Some(Protocol::Legacy)),
                Err(source) => Err(MpsError::Dir { path: file, source }),
            }
        })
        .await
    }

    /// The name of the Pod running the daemon of claim `uid`.
    pub fn pod_name(uid: &str) -> String {
        format!("mps-control-daemon-{uid}")
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
        self.start_daemon(uid, devices, active_thread_percentage, Protocol::Legacy)
            .await
    }

    /// Starts daemon `uid` for the one device `uuid` on MPS v3 ([`Protocol::V3`]) and creates
    /// its server, [`V3_SERVER`], owned by root and allowed that device only; the device's
    /// shares then get namespaces ([`Self::set_namespace`]). As [`Self::start`] otherwise:
    /// directories are never removed or recreated here.
    ///
    /// # Errors
    /// As [`Self::start`], and [`MpsError::Failed`] when the server cannot be created.
    pub async fn start_v3(&self, uid: &str, uuid: &str) -> Result<(), MpsError> {
        let device = MpsDevice {
            uuid: uuid.to_owned(),
            pinned_memory_limit_bytes: None,
        };
        self.start_daemon(uid, &[device], None, Protocol::V3).await
    }

    async fn start_daemon(
        &self,
        uid: &str,
        devices: &[MpsDevice],
        active_thread_percentage: Option<u32>,
        protocol: Protocol,
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
        // umask (077) would shut them out.
        let dirs = [
            (self.claim_dir(uid), 0o755),
            (pipe.clone(), 0o755),
            (log.clone(), 0o755),
        ];
        let protocol_file = self.protocol_file(uid);
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
            let recorded = match protocol {
                Protocol::V3 => std::fs::write(&protocol_file, "3\n"),
                Protocol::Legacy => match std::fs::remove_file(&protocol_file) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                    other => other,
                },
            };
            recorded.map_err(|source| MpsError::Dir {
                path: protocol_file,
                source,
            })?;
            Ok(created)
        })
        .await?;
        let result = self
            .start_in(
                uid,
                &pipe,
                &log,
                devices,
                active_thread_percentage,
                protocol,
            )
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
        protocol: Protocol,
    ) -> Result<(), MpsError> {
        let started = tokio::time::Instant::now();
        let visible_ids: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
        if let Some(pods) = &self.pods {
            let owner = self.owner_uid(pods, uid).await?;
            let pod = self.build_daemon_pod(pods, uid, &visible_ids.join(","), owner, protocol)?;
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
                .arg("umask 022 && exec \"$0\" -d \"$@\"")
                .arg(&self.binary)
                .args(protocol.daemon_args())
                .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
                .env("CUDA_MPS_LOG_DIRECTORY", log)
                .env("CUDA_VISIBLE_DEVICES", visible_ids.join(","));
            self.run(daemon, "-d", None).await?;
        }
        // Bounded start: poll until the daemon answers.
        let deadline = started + self.start_timeout;
        loop {
            if self.probe(pipe, protocol).await.is_ok() {
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
        if protocol == Protocol::V3 {
            self.create_server(pipe, &visible_ids.join(",")).await?;
            info!(
                claim = uid,
                elapsed_ms = started.elapsed().as_millis(),
                "MPS control daemon (v3) started"
            );
            return Ok(());
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

    /// Whether the daemon of claim `uid` is alive ([`Liveness`]): one `get_server_list`
    /// (`server list` on v3).
    pub async fn liveness(&self, uid: &str) -> Liveness {
        let protocol = match self.protocol(uid).await {
            Ok(None) => return Liveness::Dead,
            Ok(Some(p)) => p,
            Err(e) => return Liveness::Unknown(e.to_string()),
        };
        match self.probe(&self.pipe_dir(uid), protocol).await {
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
        let protocol = self.protocol(uid).await?.unwrap_or(Protocol::Legacy);
        if quit && self.probe(&pipe, protocol).await.is_ok() {
            // The answer to quit may never come: the daemon exits.
            let _ = match protocol {
                Protocol::Legacy => self.command(&pipe, "quit").await,
                Protocol::V3 => self.v3_command(&pipe, &["-q"]).await,
            };
            let deadline = tokio::time::Instant::now() + self.start_timeout;
            while self.probe(&pipe, protocol).await.is_ok() {
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
}

impl Protocol {
    /// The daemon's options after `-d` or `-f`.
    fn daemon_args(self) -> &'static [&'static str] {
        match self {
            Self::Legacy => &[],
            Self::V3 => &["-p", "3", "-m"],
        }
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

    /// A v3 daemon: started with its server, one namespace per share with the share's limits
    /// read back, a client on a namespace's socket held to that namespace, the namespace
    /// deleted with its directory, the daemon quit in its own protocol.
    #[tokio::test]
    async fn a_v3_daemon_serves_each_share_in_its_own_namespace() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mps = control(tmp.path());
        let key = "gpu-aaaa";
        mps.start_v3(key, "GPU-AAAA").await.expect("start");
        assert_eq!(mps.liveness(key).await, Liveness::Answering);
        let log = || std::fs::read_to_string(tmp.path().join(key).join("log/control.log"));
        let text = log().expect("log");
        assert!(text.contains("protocol=3 multiuser=true"), "{text}");
        assert!(
            text.contains("cmd server create drust --uid=0 --allowed-devices=GPU-AAAA"),
            "{text}"
        );
        let (a, b) = (namespace_name("0a-1"), namespace_name("0b-2"));
        assert!(a.starts_with("c_") && a.len() == 18, "{a}");
        let limits = |mib, pct| NamespaceLimits {
            pinned_mib: mib,
            active_thread_percentage: pct,
        };
        mps.set_namespace(key, &a, limits(10240, Some(25)))
            .await
            .expect("namespace a");
        mps.set_namespace(key, &b, limits(4096, None))
            .await
            .expect("namespace b");
        // Idempotent: a prepare retried, or a daemon started again, sets it once more.
        mps.set_namespace(key, &a, limits(10240, Some(25)))
            .await
            .expect("namespace a again");
        let names: Vec<String> = mps
            .namespaces(key)
            .await
            .expect("list")
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let mut want = [a.clone(), b.clone()];
        want.sort();
        assert_eq!(names, want);
        // A client of share a, raising its own thread percentage, gets a's limits.
        let edits = mps.namespace_edits(key, "0a-1", 10 << 30, 25);
        let pipe = &edits.mounts[0].host_path;
        assert_eq!(pipe, &mps.namespace_dir(key, &a).display().to_string());
        drust_fakes::attach_once(
            Path::new(pipe),
            &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")],
        )
        .expect("a client of namespace a attaches");
        let text = log().expect("log");
        assert!(
            text.contains(&format!(
                "client attached namespace={a} pinned=- threads=100 ceiling pinned=10240M threads=25"
            )),
            "{text}"
        );
        // The legacy commands are not this daemon's: nothing here may send them.
        assert!(!text.contains("refused"), "{text}");
        mps.delete_namespace(key, &a).await.expect("delete a");
        assert!(!mps.namespace_dir(key, &a).exists());
        mps.delete_namespace(key, &a)
            .await
            .expect("deleting twice is fine");
        assert_eq!(mps.namespaces(key).await.expect("list").len(), 1);
        mps.stop(key).await.expect("stop");
        assert_eq!(mps.liveness(key).await, Liveness::Dead);
        assert!(!tmp.path().join(key).exists());
        // With the daemon gone, so are its namespaces: nothing to delete.
        mps.delete_namespace(key, &b).await.expect("dead daemon");
    }

    #[test]
    fn namespace_names_are_short_and_fit_the_socket_path() {
        let name = namespace_name("5f0c2a8e-0d7b-4a43-9f0e-3d1f2b6c7a90");
        assert!(
            name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "{name}"
        );
        assert_ne!(name, namespace_name("5f0c2a8e-0d7b-4a43-9f0e-3d1f2b6c7a91"));
        // The default root, and any root in a daemon Pod, fit; a long host root does not.
        assert!(namespace_sockets_fit(Path::new("/run/drust/mps"), false).is_ok());
        let long = Path::new("/var/lib/kubelet/plugins/gpu.drust.dev/mps-daemons");
        assert!(namespace_sockets_fit(long, true).is_ok());
        let err = namespace_sockets_fit(long, false).expect_err("too long");
        assert!(err.contains("--mps-root"), "{err}");
    }

    #[test]
    fn pinned_limits_are_read_back_in_any_unit() {
        assert_eq!(parse_mib("2048M"), Some(2048));
        assert_eq!(parse_mib("2G"), Some(2048));
        assert_eq!(parse_mib("512"), Some(512));
        assert_eq!(parse_mib("lots"), None);
    }
}
