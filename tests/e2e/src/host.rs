//! A fake GPU node on disk for running the real `gpu-kubelet-plugin` binary (crash, handover and
//! restart tests): a temp dir with the fake host ([`crate::plugin::fake_host`]) and every host
//! path of the plugin under it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use gpu_kubelet_plugin::failpoint;

use crate::plugin::fake_host;

/// A node's directories, the binary, and how it reaches the API server.
pub struct BinaryHost {
    dir: tempfile::TempDir,
    binary: PathBuf,
    kubeconfig: PathBuf,
    topology: PathBuf,
    driver: String,
    node: String,
}

/// The host could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("binary host: {problem}")]
pub struct HostError {
    problem: String,
}

impl BinaryHost {
    /// A fresh host (temp dir prefixed `prefix`) for `driver` on `node` with the fake
    /// `topology`, talking to the API server of `kubeconfig`.
    ///
    /// # Errors
    /// [`HostError`] when the temp dir, the fake host or the binary cannot be had.
    pub fn new(
        prefix: &str,
        kubeconfig: &Path,
        topology: &Path,
        driver: &str,
        node: &str,
    ) -> Result<Self, HostError> {
        let fail = |problem: String| HostError { problem };
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .map_err(|e| fail(format!("temp dir: {e}")))?;
        fake_host(dir.path(), topology).map_err(fail)?;
        Ok(Self {
            binary: crate::binary::plugin_binary().map_err(fail)?,
            dir,
            kubeconfig: kubeconfig.to_owned(),
            topology: topology.to_owned(),
            driver: driver.to_owned(),
            node: node.to_owned(),
        })
    }

    /// The host's root (device root, proc root, everything else below it).
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// `--plugin-dir`.
    pub fn plugin_dir(&self) -> PathBuf {
        self.root().join("plugins").join(&self.driver)
    }

    /// `--registrar-dir`.
    pub fn registry(&self) -> PathBuf {
        self.root().join("registry")
    }

    /// `--cdi-root`.
    pub fn cdi_root(&self) -> PathBuf {
        self.root().join("cdi")
    }

    /// `--fake-state-dir`, when a test passes it.
    pub fn state_dir(&self) -> PathBuf {
        self.root().join("fake-gpu-state")
    }

    /// The node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The plugin command with every host path, logging (appending) to `log`, armed with
    /// `failpoint` if given, dying with the test process. Tests add their own flags.
    ///
    /// # Errors
    /// [`HostError`] when the log file cannot be opened.
    pub fn command(&self, log: &Path, failpoint: Option<&str>) -> Result<Command, HostError> {
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(|e| HostError {
                    problem: format!("log {}: {e}", log.display()),
                })
        };
        let mut cmd = Command::new(&self.binary);
        cmd.args(["--driver-name", &self.driver, "--node-name", &self.node])
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--fake-topology")
            .arg(&self.topology)
            .arg("--plugin-dir")
            .arg(self.plugin_dir())
            .arg("--registrar-dir")
            .arg(self.registry())
            .arg("--cdi-root")
            .arg(self.cdi_root())
            .arg("--proc-root")
            .arg(self.root())
            .arg("--dev-root")
            .arg(self.root())
            .arg("--boot-id-file")
            .arg(self.root().join("boot_id"))
            .arg("--mps-root")
            .arg(self.root().join("mps"))
            .env("RUST_LOG", "info")
            .env_remove(failpoint::ENV)
            .env_remove("POD_UID")
            .stdin(Stdio::null())
            .stdout(open()?)
            .stderr(open()?);
        if let Some(fp) = failpoint {
            cmd.env(failpoint::ENV, fp);
        }
        crate::die_with_parent(&mut cmd);
        Ok(cmd)
    }
}

/// A running plugin process, SIGKILLed on drop if still running.
pub struct PluginProcess(pub Child);

impl std::ops::Deref for PluginProcess {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for PluginProcess {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// SIGTERMs `child` and waits for it, yielding to the runtime so that connections the test
/// dropped actually close (the plugin's graceful shutdown waits for them).
///
/// # Errors
/// [`HostError`] when the process cannot be waited for.
pub async fn stop(mut child: PluginProcess) -> Result<(), HostError> {
    let fail = |e: String| HostError { problem: e };
    let pid = i32::try_from(child.id()).map_err(|e| fail(e.to_string()))?;
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    );
    while child.try_wait().map_err(|e| fail(e.to_string()))?.is_none() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Waits (at most `timeout`) for a plugin armed with failpoint `fp` to have SIGKILLed itself.
///
/// # Errors
/// [`HostError`] when it ended otherwise or is still running after `timeout` (it is then
/// killed).
pub async fn expect_killed(
    mut child: PluginProcess,
    fp: &str,
    timeout: std::time::Duration,
) -> Result<(), HostError> {
    use std::os::unix::process::ExitStatusExt;
    let fail = |problem: String| HostError { problem };
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().map_err(|e| fail(e.to_string()))? {
            if status.signal() == Some(9) {
                return Ok(());
            }
            return Err(fail(format!(
                "{fp}: plugin ended with {status}, not SIGKILL"
            )));
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            return Err(fail(format!(
                "{fp}: failpoint never reached in {timeout:?}"
            )));
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
