//! The IMEX daemon Pod's process: runs `chroot <driver root> nvidia-imex -c <config>` and
//! restarts it when its nodes file changes.
//!
//! The nodes file holds one daemon IP per line, and `nvidia-imex` reads it only at start
//! (NVIDIA restarts its daemon on a change of that file when DNS names are off; multi-node.md
//! §3.2). The file is a ConfigMap key: the kubelet swaps in a new version when a member joins,
//! leaves or gets a new IP, and this supervisor notices and restarts the daemon, so every
//! daemon of a clique knows every peer. A daemon that exits on its own ends the supervisor with
//! its status, so the kubelet restarts the container and a daemon that keeps failing shows as
//! CrashLoopBackOff (which the controller reports: NVIDIA #289). SIGTERM is passed on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// What to run and watch.
#[derive(Debug, Clone)]
pub struct Supervised {
    /// The driver root inside the Pod (`/driver-root`).
    pub driver_root: PathBuf,
    /// `nvidia-imex` inside the driver root.
    pub imex: String,
    /// Its config inside the driver root.
    pub config: String,
    /// The nodes file inside the driver root.
    pub nodes_file: String,
    /// How often the nodes file is read.
    pub poll: Duration,
    /// How long the daemon may take to stop after SIGTERM before SIGKILL.
    pub stop_timeout: Duration,
}

/// Why the supervisor ended.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// The daemon could not be started.
    #[error("starting chroot {root} {imex}: {source}")]
    Spawn {
        /// The driver root.
        root: String,
        /// The daemon binary.
        imex: String,
        /// Why.
        source: std::io::Error,
    },
    /// Waiting for the daemon failed.
    #[error("waiting for {imex}: {source}")]
    Wait {
        /// The daemon binary.
        imex: String,
        /// Why.
        source: std::io::Error,
    },
    /// The daemon exited on its own.
    #[error("{imex} exited: {status}")]
    Exited {
        /// The daemon binary.
        imex: String,
        /// Its exit status.
        status: std::process::ExitStatus,
    },
}

fn read(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}

impl Supervised {
    fn spawn(&self) -> Result<Child, SupervisorError> {
        Command::new("chroot")
            .arg(&self.driver_root)
            .args([self.imex.as_str(), "-c", self.config.as_str()])
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| SupervisorError::Spawn {
                root: self.driver_root.display().to_string(),
                imex: self.imex.clone(),
                source,
            })
    }

    /// SIGTERM, then SIGKILL after `stop_timeout`.
    async fn stop(&self, child: &mut Child) {
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        if tokio::time::timeout(self.stop_timeout, child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }

    /// Runs the daemon until it exits on its own ([`SupervisorError::Exited`]) or `shutdown`
    /// resolves (Ok), restarting it whenever the nodes file's content changes. Returns the
    /// number of restarts on shutdown.
    ///
    /// # Errors
    /// [`SupervisorError`].
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<u32, SupervisorError> {
        let nodes = self
            .driver_root
            .join(self.nodes_file.trim_start_matches('/'));
        let mut seen = read(&nodes);
        let mut child = self.spawn()?;
        let mut restarts = 0;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => {
                    self.stop(&mut child).await;
                    return Ok(restarts);
                }
                status = child.wait() => {
                    let status = status.map_err(|source| SupervisorError::Wait {
                        imex: self.imex.clone(),
                        source,
                    })?;
                    return Err(SupervisorError::Exited { imex: self.imex.clone(), status });
                }
                () = tokio::time::sleep(self.poll) => {
                    let now = read(&nodes);
                    if now.is_some() && now != seen {
                        tracing::info!(file = %nodes.display(), "nodes file changed: restarting the IMEX daemon");
                        seen = now;
                        self.stop(&mut child).await;
                        child = self.spawn()?;
                        restarts += 1;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_changed_nodes_file_restarts_the_daemon_and_shutdown_stops_it() {
        let dir = tempfile::tempdir().unwrap();
        let starts = dir.path().join("starts");
        let nodes = dir.path().join("nodes.cfg");
        std::fs::write(&nodes, "10.0.0.1\n").unwrap();
        let imex = dir.path().join("imex");
        std::fs::write(
            &imex,
            format!(
                "#!/bin/sh\necho \"$2\" >> {}\nexec sleep 60\n",
                starts.display()
            ),
        )
        .unwrap();
        let mut perms = std::fs::metadata(&imex).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&imex, perms).unwrap();
        // The test's root stands in for the driver root (chroot needs CAP_SYS_CHROOT).
        let supervised = Supervised {
            driver_root: "/".into(),
            imex: imex.display().to_string(),
            config: "/cfg".into(),
            nodes_file: nodes.display().to_string(),
            poll: Duration::from_millis(50),
            stop_timeout: Duration::from_secs(5),
        };
        let count = || {
            std::fs::read_to_string(&starts)
                .unwrap_or_default()
                .lines()
                .count()
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(async move {
            supervised
                .run(async {
                    let _ = rx.await;
                })
                .await
        });
        // Each step waits for a condition (with a generous deadline), never for a time.
        let wait_for = |n: usize| async move {
            for _ in 0..600 {
                if count() >= n {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            false
        };
        if !wait_for(1).await {
            // No chroot privilege here: nothing to check.
            return;
        }
        std::fs::write(&nodes, "10.0.0.1\n10.0.0.2\n").unwrap();
        assert!(wait_for(2).await, "no restart after the nodes file changed");
        assert_eq!(std::fs::read_to_string(&starts).unwrap(), "/cfg\n/cfg\n");
        tx.send(()).unwrap();
        let restarts = run.await.unwrap().unwrap();
        assert_eq!(restarts, 1);
    }

    #[tokio::test]
    async fn a_daemon_that_exits_ends_the_supervisor_with_its_status() {
        let supervised = Supervised {
            driver_root: "/".into(),
            imex: "/bin/false".into(),
            config: "/cfg".into(),
            nodes_file: "/nonexistent".into(),
            poll: Duration::from_millis(50),
            stop_timeout: Duration::from_secs(5),
        };
        match supervised.run(std::future::pending()).await {
            Err(SupervisorError::Exited { status, .. }) => assert!(!status.success()),
            other => panic!("{other:?}"),
        }
    }
}
