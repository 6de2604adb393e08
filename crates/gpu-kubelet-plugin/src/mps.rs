//! Per-claim MPS control daemons (CUDA Multi-Process Service).
//!
//! A claim whose devices are configured for MPS ([`crate::claim_config::Sharing::Mps`]) gets its
//! own control daemon, started with `nvidia-cuda-mps-control -d` and driven through the same tool
//! in client mode (commands on stdin), as NVIDIA documents it (MPS guide, "Control daemon"):
//!
//! - `CUDA_VISIBLE_DEVICES` lists the claim's GPU or MIG UUIDs, so the daemon serves only them;
//! - `CUDA_MPS_PIPE_DIRECTORY` is `<root>/<claim-uid>/pipe` and `CUDA_MPS_LOG_DIRECTORY`
//!   `<root>/<claim-uid>/log`: derived from the claim UID, so undoing never needs a record;
//! - limits: `set_default_active_thread_percentage <pct>` and, per device ordinal,
//!   `set_default_device_pinned_mem_limit <ordinal> <MiB>M`; both are read back
//!   (`get_default_*`) and a daemon that does not report them is stopped and the prepare fails;
//! - start is bounded: the daemon must answer `get_server_list` within the start timeout.
//!
//! Containers reach the daemon through the pipe directory, mounted at [`CONTAINER_PIPE_DIR`]
//! with `CUDA_MPS_PIPE_DIRECTORY` pointing there ([`MpsControl::container_edits`]).
//!
//! The daemon runs in the plugin's process tree (and so its container): when the plugin restarts,
//! start-up recovery starts the daemons of prepared claims again, but running clients of the old
//! daemon lose it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

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
    /// How long a daemon may take to answer after `-d`, and each control command.
    pub start_timeout: Duration,
}

/// An MPS action failed.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
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

impl MpsControl {
    /// `<root>/<uid>`.
    pub fn claim_dir(&self, uid: &str) -> PathBuf {
        self.root.join(uid)
    }

    /// `<root>/<uid>/pipe`.
    pub fn pipe_dir(&self, uid: &str) -> PathBuf {
        self.claim_dir(uid).join("pipe")
    }

    /// The CDI edits that connect a container to the claim's daemon.
    pub fn container_edits(&self, uid: &str) -> ContainerEdits {
        ContainerEdits {
            env: vec![format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")],
            mounts: vec![Mount {
                host_path: self.pipe_dir(uid).display().to_string(),
                container_path: CONTAINER_PIPE_DIR.to_owned(),
                options: vec!["rbind".into(), "rw".into()],
            }],
            ..ContainerEdits::default()
        }
    }

    /// Starts the daemon of claim `uid` for the devices `visible_ids` (GPU or MIG UUIDs, in
    /// ordinal order) with `limits`, replacing any leftover daemon of the same claim. On error
    /// nothing is left running.
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
        self.stop(uid).await?;
        let pipe = self.pipe_dir(uid);
        let log = self.claim_dir(uid).join("log");
        // Containers of any user reach the daemon through the pipe directory; the plugin's own
        // umask (077) would shut them out.
        let dirs = [self.claim_dir(uid), pipe.clone(), log.clone()];
        // Directory work blocks on a slow disk: off the async workers.
        off_workers(&self.claim_dir(uid), move || {
            for dir in dirs {
                std::fs::create_dir_all(&dir)
                    .and_then(|()| {
                        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
                    })
                    .map_err(|source| MpsError::Dir { path: dir, source })?;
            }
            Ok(())
        })
        .await?;
        let result = self
            .start_in(uid, &pipe, &log, devices, active_thread_percentage)
            .await;
        if result.is_err()
            && let Err(e) = self.stop(uid).await
        {
            warn!(claim = uid, error = %e, "cleaning up after a failed MPS start failed");
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
        // Bounded start: poll until the daemon answers.
        let deadline = started + self.start_timeout;
        loop {
            if self.command(pipe, "get_server_list").await.is_ok() {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(MpsError::Timeout {
                    pipe_dir: pipe.to_owned(),
                    what: "answer after start",
                    timeout_ms: self.start_timeout.as_millis(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // One client run sets every limit, another reads them all back (one answer line per
        // `get_*` command, in order).
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
        // Each device its own limit, by its ordinal among the visible devices.
        for (ordinal, device) in devices.iter().enumerate() {
            if let Some(bytes) = device.pinned_memory_limit_bytes {
                // MPS takes whole MiB; round down so the limit is never exceeded.
                let mib = (bytes >> 20).max(1);
                set.push(format!(
                    "set_default_device_pinned_mem_limit {ordinal} {mib}M"
                ));
                wanted.push((
                    format!("get_default_device_pinned_mem_limit {ordinal}"),
                    format!("device {ordinal} ({}) pinned memory limit", device.uuid),
                    Limit::MiB(mib),
                ));
            }
        }
        if !set.is_empty() {
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
        }
        info!(
            claim = uid,
            devices = visible_ids.len(),
            elapsed_ms = started.elapsed().as_millis(),
            "MPS control daemon started"
        );
        Ok(())
    }

    /// Whether the daemon of claim `uid` answers.
    pub async fn is_running(&self, uid: &str) -> bool {
        self.command(&self.pipe_dir(uid), "get_server_list")
            .await
            .is_ok()
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
            return Ok(());
        }
        let pipe = self.pipe_dir(uid);
        if self.command(&pipe, "get_server_list").await.is_ok() {
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
        off_workers(&dir.clone(), move || match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(MpsError::Dir { path: dir, source }),
        })
        .await
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
            pipe.write_all(format!("{text}\n").as_bytes())
                .await
                .map_err(spawn_err)?;
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
            binary: Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fakes/nvidia-cuda-mps-control"),
            root: dir.to_owned(),
            start_timeout: Duration::from_secs(10),
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
        let started = std::time::Instant::now();
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
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "took {:?}",
            started.elapsed()
        );
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
