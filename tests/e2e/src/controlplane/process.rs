//! The component processes: spawn with output to a log file, wait for readiness, stop, and
//! never outlive the test.

use std::fs::File;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::{Component, Error};

/// How often readiness is probed, and how long one probe may take.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Lines of a component's log quoted in a start error.
const LOG_TAIL_LINES: usize = 40;

/// The running components, in start order. Dropping it SIGKILLs and reaps every one.
#[derive(Default)]
pub(super) struct Processes(pub(super) Vec<Process>);

pub(super) struct Process {
    pub(super) component: Component,
    pub(super) child: Child,
    pub(super) log: PathBuf,
}

impl Processes {
    /// Spawns `component` with stdout and stderr written to `<root>/<component>.log`; returns its
    /// index for [`Processes::wait_ready`].
    pub(super) fn spawn(
        &mut self,
        component: Component,
        bin_dir: &Path,
        root: &Path,
        args: impl IntoIterator<Item = String>,
    ) -> Result<usize, Error> {
        let binary = bin_dir.join(component.binary_name());
        let log = log_path(root, component);
        let spawn_err = |source| Error::SpawnComponent {
            component,
            binary: binary.clone(),
            source,
        };
        let stdout = File::create(&log).map_err(|source| Error::WriteFile {
            path: log.clone(),
            source,
        })?;
        let stderr = stdout.try_clone().map_err(spawn_err)?;
        let mut command = Command::new(&binary);
        command
            .args(args)
            .current_dir(root)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        die_with_parent(&mut command);
        let child = command.spawn().map_err(spawn_err)?;
        tracing::debug!(%component, pid = child.id(), log = %log.display(), "spawned");
        self.0.push(Process {
            component,
            child,
            log,
        });
        Ok(self.0.len() - 1)
    }

    /// Probes until `probe` succeeds, the process exits, or `timeout` passes since the process
    /// was spawned. Returns how long it took.
    pub(super) async fn wait_ready<F, Fut>(
        &mut self,
        index: usize,
        timeout: Duration,
        mut probe: F,
    ) -> Result<Duration, Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let started = Instant::now();
        let process = &mut self.0[index];
        loop {
            if let Some(status) = process.try_wait()? {
                return Err(Error::ComponentExited {
                    component: process.component,
                    status,
                    log_tail: log_tail(&process.log),
                    log: process.log.clone(),
                });
            }
            let last_probe = match tokio::time::timeout(PROBE_TIMEOUT, probe()).await {
                Ok(Ok(())) => return Ok(started.elapsed()),
                Ok(Err(e)) => e,
                Err(_) => format!("no answer within {PROBE_TIMEOUT:?}"),
            };
            if started.elapsed() >= timeout {
                return Err(Error::ComponentNotReady {
                    component: process.component,
                    waited: started.elapsed(),
                    last_probe,
                    log_tail: log_tail(&process.log),
                    log: process.log.clone(),
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// SIGTERM to everything but etcd, wait; then etcd (the apiserver needs it to shut down
    /// cleanly). SIGKILL whatever outlives `grace`.
    pub(super) async fn stop(&mut self, grace: Duration) -> Result<(), Error> {
        let (etcd, rest): (Vec<&mut Process>, Vec<&mut Process>) = self
            .0
            .iter_mut()
            .rev()
            .partition(|p| p.component == Component::Etcd);
        for group in [rest, etcd] {
            for process in &group {
                process.terminate()?;
            }
            for process in group {
                process.wait_or_kill(grace).await?;
            }
        }
        Ok(())
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        for process in self.0.iter_mut().rev() {
            // Already reaped (after stop) or exited: try_wait says so and kill is skipped.
            if let Ok(None) = process.child.try_wait() {
                let _ = process.child.kill();
                let _ = process.child.wait();
            }
        }
    }
}

impl Process {
    fn watch_err(&self) -> impl Fn(io::Error) -> Error + use<> {
        let (component, pid) = (self.component, self.child.id());
        move |source| Error::WatchComponent {
            component,
            pid,
            source,
        }
    }

    fn try_wait(&mut self) -> Result<Option<ExitStatus>, Error> {
        let err = self.watch_err();
        self.child.try_wait().map_err(err)
    }

    fn terminate(&self) -> Result<(), Error> {
        // Linux pids fit in i32 (pid_max is at most 2^22).
        let pid = Pid::from_raw(self.child.id() as i32);
        match kill(pid, Signal::SIGTERM) {
            // Exited on its own but not yet reaped: the wait below reaps it.
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(errno) => Err(self.watch_err()(io::Error::from(errno))),
        }
    }

    async fn wait_or_kill(&mut self, grace: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.try_wait()?.is_some() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::warn!(component = %self.component, ?grace, "did not exit after SIGTERM; killing");
        let err = self.watch_err();
        self.child.kill().map_err(&err)?;
        self.child.wait().map_err(err)?;
        Ok(())
    }
}

/// Makes the child get SIGKILL when the spawning thread exits, so a test process killed outright
/// leaves no control plane (or plugin) behind.
#[allow(unsafe_code)]
pub fn die_with_parent(command: &mut Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the hook runs in the forked child before exec. It only calls prctl(2) and
    // getppid(2), both async-signal-safe, and allocates nothing (`io::Error::from(Errno)` is the
    // allocation-free OS-error form), so it is sound in a child forked from a threaded process.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
            // The parent may have died between fork and prctl; the signal would never come.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::from(nix::errno::Errno::ESRCH));
            }
            Ok(())
        });
    }
}

pub(super) fn log_path(root: &Path, component: Component) -> PathBuf {
    root.join(format!("{component}.log"))
}

fn log_tail(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
        }
        Err(e) => format!("(log unreadable: {e})"),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    fn fake_binary(dir: &Path, component: Component, script: &str) {
        let path = dir.join(component.binary_name());
        std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn children_are_killed_when_the_spawning_thread_exits() {
        // Were the parent-death signal missing, sleep would exit 0 after 5 s instead.
        let mut child = std::thread::spawn(|| {
            let mut command = Command::new("sleep");
            command.arg("5");
            die_with_parent(&mut command);
            command.spawn().unwrap()
        })
        .join()
        .unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(Signal::SIGKILL as i32), "{status}");
    }

    #[tokio::test]
    async fn dropping_processes_kills_and_reaps_them() {
        let dir = tempfile::tempdir().unwrap();
        fake_binary(dir.path(), Component::Etcd, "exec sleep 1000");
        let mut processes = Processes::default();
        let index = processes
            .spawn(Component::Etcd, dir.path(), dir.path(), Vec::new())
            .unwrap();
        let pid = processes.0[index].child.id();
        drop(processes);
        // Reaped, so the pid names no process (a zombie would still accept signal 0).
        assert!(kill(Pid::from_raw(pid as i32), None).is_err());
    }

    #[tokio::test]
    async fn stop_terminates_gracefully_before_the_grace_period() {
        let dir = tempfile::tempdir().unwrap();
        fake_binary(dir.path(), Component::KubeScheduler, "exec sleep 1000");
        let mut processes = Processes::default();
        let index = processes
            .spawn(Component::KubeScheduler, dir.path(), dir.path(), Vec::new())
            .unwrap();
        processes.stop(Duration::from_secs(10)).await.unwrap();
        let status = processes.0[index].child.try_wait().unwrap().unwrap();
        assert_eq!(status.signal(), Some(Signal::SIGTERM as i32), "{status}");
    }

    #[tokio::test]
    async fn a_component_that_exits_early_is_reported_with_its_log_tail() {
        let dir = tempfile::tempdir().unwrap();
        fake_binary(
            dir.path(),
            Component::KubeApiserver,
            "echo \"flags: $*\"; echo 'bad flag' >&2; exit 3",
        );
        let mut processes = Processes::default();
        let index = processes
            .spawn(
                Component::KubeApiserver,
                dir.path(),
                dir.path(),
                vec!["--secure-port=1".to_owned()],
            )
            .unwrap();
        let err = processes
            .wait_ready(index, Duration::from_secs(30), || async {
                Err("not yet".to_owned())
            })
            .await
            .unwrap_err();
        match err {
            Error::ComponentExited {
                component,
                status,
                log_tail,
                ..
            } => {
                assert_eq!(component, Component::KubeApiserver);
                assert_eq!(status.code(), Some(3));
                assert_eq!(log_tail, "flags: --secure-port=1\nbad flag");
            }
            other => panic!("unexpected error: {other}"),
        }
    }

    #[tokio::test]
    async fn a_component_that_never_gets_ready_times_out_with_the_last_probe() {
        let dir = tempfile::tempdir().unwrap();
        fake_binary(
            dir.path(),
            Component::Etcd,
            "echo starting; exec sleep 1000",
        );
        let mut processes = Processes::default();
        let index = processes
            .spawn(Component::Etcd, dir.path(), dir.path(), Vec::new())
            .unwrap();
        let err = processes
            .wait_ready(index, Duration::from_millis(300), || async {
                Err("connection refused".to_owned())
            })
            .await
            .unwrap_err();
        let message = err.to_string();
        assert!(
            message.starts_with("etcd not ready after"),
            "unexpected message: {message}"
        );
        assert!(
            message.contains("last probe: connection refused"),
            "{message}"
        );
        assert!(message.ends_with("starting"), "{message}");
    }

    #[test]
    fn log_tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.log");
        let text: Vec<String> = (0..100).map(|i| format!("line {i}")).collect();
        std::fs::write(&path, text.join("\n")).unwrap();
        let tail = log_tail(&path);
        assert_eq!(tail.lines().count(), LOG_TAIL_LINES);
        assert!(tail.starts_with("line 60\n") && tail.ends_with("line 99"));
    }
}
