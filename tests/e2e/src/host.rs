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
    node_dirs: Option<NodeDirs>,
}

/// Where a real node's kubelet and containerd expect a plugin's files.
struct NodeDirs {
    plugin_dir: PathBuf,
    registry: PathBuf,
    cdi_root: PathBuf,
    pod_resources: PathBuf,
}

/// The host could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("binary host: {problem}")]
pub struct HostError {
    problem: String,
}

impl BinaryHost {
    /// Replaces the fake device files under `<root>/dev` with character devices (`mknod`, so
    /// root only): NVIDIA's fixed major 195 for the GPUs (`nvidia<minor>`) and `nvidiactl`
    /// (255), and made-up dynamic majors for `nvidia-uvm`/`nvidia-uvm-tools` (236) and the MIG
    /// capabilities (237), so a container runtime can pass them to a container. Opening one in
    /// the container gives ENXIO (no driver), which proves access.
    ///
    /// # Errors
    /// [`HostError`] when a node cannot be made.
    pub fn make_device_nodes(&self) -> Result<(), HostError> {
        use nix::sys::stat::{Mode, SFlag, makedev, mknod};
        let dev = self.root().join("dev");
        let mut nodes: Vec<PathBuf> = std::fs::read_dir(&dev)
            .into_iter()
            .chain(std::fs::read_dir(dev.join("nvidia-caps")))
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        nodes.sort();
        for path in nodes {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let (major, minor) = match name.as_str() {
                "nvidiactl" => (195, 255),
                "nvidia-uvm" => (236, 0),
                "nvidia-uvm-tools" => (236, 1),
                n if n.starts_with("nvidia-cap") => {
                    (237, n["nvidia-cap".len()..].parse().unwrap_or(0))
                }
                n => (195, n["nvidia".len().min(n.len())..].parse().unwrap_or(0)),
            };
            let fail = |e: nix::Error| HostError {
                problem: format!("mknod {}: {e}", path.display()),
            };
            std::fs::remove_file(&path).map_err(|e| HostError {
                problem: format!("{}: {e}", path.display()),
            })?;
            mknod(
                &path,
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(major, minor),
            )
            .map_err(fail)?;
        }
        Ok(())
    }

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
            node_dirs: None,
        })
    }

    /// The plugin's `--driver-root`: `<root>/driver-root`, empty (no driver files) until
    /// [`BinaryHost::make_driver_root`] fills it.
    pub fn driver_root(&self) -> PathBuf {
        self.root().join("driver-root")
    }

    /// Lays out a fake driver of `version` at [`BinaryHost::driver_root`]
    /// ([`crate::driver_root::FakeDriverRoot`]).
    ///
    /// # Errors
    /// [`HostError`] naming the root when a file cannot be made.
    pub fn make_driver_root(
        &self,
        version: &str,
    ) -> Result<crate::driver_root::FakeDriverRoot, HostError> {
        crate::driver_root::FakeDriverRoot::create(&self.driver_root(), version).map_err(|e| {
            HostError {
                problem: format!("fake driver root {}: {e}", self.driver_root().display()),
            }
        })
    }

    /// The plugin executable this host runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The host's root (device root, proc root, everything else below it).
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Serve the kubelet of `node` instead of a test acting as one: the sockets go to the
    /// kubelet's `plugins_registry` and `plugins/<driver>`, the CDI specs to the directory its
    /// containerd reads.
    #[must_use]
    pub fn on_node(mut self, node: &crate::node::Node) -> Self {
        self.node_dirs = Some(NodeDirs {
            plugin_dir: node.plugin_dir(&self.driver),
            registry: node.registry_dir(),
            cdi_root: node.cdi_root(),
            pod_resources: node.pod_resources_socket(),
        });
        self
    }

    /// `--plugin-dir`.
    pub fn plugin_dir(&self) -> PathBuf {
        self.node_dirs.as_ref().map_or_else(
            || self.root().join("plugins").join(&self.driver),
            |d| d.plugin_dir.clone(),
        )
    }

    /// The CDI spec the plugin writes for claim `uid`: `<cdi root>/<driver>-claim_<uid>.json`.
    pub fn claim_spec(&self, uid: &str) -> PathBuf {
        self.cdi_root()
            .join(format!("{}-claim_{uid}.json", self.driver))
    }

    /// Whether the plugin's checkpoint (`<plugin dir>/checkpoint.json`) records claim `uid`; no
    /// checkpoint yet records none.
    ///
    /// # Errors
    /// The checkpoint cannot be read.
    pub fn has_record(&self, uid: &str) -> anyhow::Result<bool> {
        let v = crate::plugin::read_checkpoint(&self.plugin_dir().join("checkpoint.json"))
            .map_err(anyhow::Error::msg)?;
        Ok(v["claims"].get(uid).is_some())
    }

    /// `--registrar-dir`.
    pub fn registry(&self) -> PathBuf {
        self.node_dirs
            .as_ref()
            .map_or_else(|| self.root().join("registry"), |d| d.registry.clone())
    }

    /// `--cdi-root`.
    pub fn cdi_root(&self) -> PathBuf {
        self.node_dirs
            .as_ref()
            .map_or_else(|| self.root().join("cdi"), |d| d.cdi_root.clone())
    }

    /// `--pod-resources-socket`: the kubelet's on a node; none (`""`) otherwise, so no test
    /// reads this machine's `/var/lib/kubelet`.
    pub fn pod_resources_socket(&self) -> PathBuf {
        self.node_dirs
            .as_ref()
            .map(|d| d.pod_resources.clone())
            .unwrap_or_default()
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
            .arg("--driver-root")
            .arg(self.driver_root())
            .arg("--pod-resources-socket")
            .arg(self.pod_resources_socket())
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

/// Where this machine mounts its cgroup v2 hierarchy (the first `cgroup2` mount in
/// `/proc/self/mountinfo`: `/sys/fs/cgroup` on a unified host, `/sys/fs/cgroup/unified` on a
/// hybrid one such as this project's machine), for the `kernel` level's `--cgroup-root`.
///
/// # Errors
/// When mountinfo cannot be read or has no cgroup2 mount.
pub fn cgroup2_mount() -> std::io::Result<String> {
    std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .find_map(|l| {
            let (fields, rest) = l.split_once(" - ")?;
            let mount = fields.split_whitespace().nth(4)?;
            (rest.split_whitespace().next() == Some("cgroup2")).then(|| mount.to_owned())
        })
        .ok_or_else(|| std::io::Error::other("no cgroup v2 hierarchy is mounted"))
}

/// Writes at `path` the fake DGX H100 (`examples/topologies/dgx-h100.yaml`) with a driver of
/// the r615 branch (615.20.01), whose GPUs partition memory per cgroup: shares get the `kernel`
/// level there.
///
/// # Errors
/// When the example cannot be read, no longer names its driver 570.124.06, or `path` cannot be
/// written.
pub fn write_r615_topology(path: &Path) -> std::io::Result<()> {
    let text = std::fs::read_to_string(crate::manifests::repo_path(
        "examples/topologies/dgx-h100.yaml",
    ))?;
    let (old, new) = (
        "driverVersion: \"570.124.06\"",
        "driverVersion: \"615.20.01\"",
    );
    if !text.contains(old) {
        return Err(std::io::Error::other(format!(
            "examples/topologies/dgx-h100.yaml no longer says {old}"
        )));
    }
    std::fs::write(path, text.replace(old, new))
}
