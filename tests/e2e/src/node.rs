//! A real node for the tests: containerd 2.x (with Debian's runc and CNI plugins) and kubelet
//! v1.36.3 against a [`ControlPlane`], every path under a temp dir where the kubelet allows it.
//!
//! `../shared/docs/real-node.md` has the facts this follows (the host quirks, the settings that
//! run). Binaries come from `tests/scripts/build-node.sh` (cached in `~/.cache/drust/node`); the
//! sandbox and workload images are built locally ([`crate::images`]) and imported with `ctr`.
//!
//! What the node changes outside its temp dir, and how it is put back (on [`Node::stop`] and on
//! drop, so also when a test fails):
//! - mounts (the temp dir's own shared bind mount, the kubelet's bind mount of its root dir,
//!   pod volumes, container rootfs, network namespaces, which containerd keeps under its state
//!   dir): every mount under the temp dir is unmounted;
//! - containers: every container in the node's runc root is killed and deleted, and the shims
//!   and any process started from the temp dir are killed;
//! - the node's cgroups: `/kubepods` (cgroup root `/`, the default) or its own cgroup root
//!   ([`NodeOptions::cgroup_root`]) in every hierarchy, removed bottom-up when the node
//!   created it;
//! - the node's CNI bridge (`drustbr0` by default): deleted;
//! - sysctls the kubelet sets at start (`vm.overcommit_memory`, `kernel.panic`,
//!   `kernel.panic_on_oops`) and the bridge plugin's `net.ipv4.ip_forward`: restored to the
//!   values read before;
//! - `/var/lib/kubelet` (its `device-plugins/kubelet.sock`), `/var/log/containers` and
//!   `/var/log/pods`: removed when they were not there before; network namespaces left in
//!   `/run/netns`: unmounted and removed.
//!
//! The last two are the machine's, not one node's: a [`Machine`] holds them and the lock file
//! [`LOCK`], and puts them back when the last node started on it is gone. One
//! [`Machine`] at a time per machine: [`Machine::acquire`] waits for the lock, so tests of one
//! binary, and test runs side by side, take turns. Several nodes of one test share a
//! [`Machine`] ([`Node::start_on`]), each with its own [`NodeOptions::numbered`] bridge, pod
//! subnet and cgroup root; [`crate::cluster`] starts them that way.
//!
//! Two kubelets on one machine share the fixed paths. That is safe for what the tests run (no
//! device plugin, pod logs under each node's root): the device manager's registration socket
//! `/var/lib/kubelet/device-plugins/kubelet.sock` is taken over by the kubelet that starts last
//! (`CleanupPluginDirectory` in `pkg/kubelet/cm/devicemanager/manager.go` removes the other's
//! socket file; its server keeps serving on the open listener, so its health check stays
//! green), and both write the same empty device checkpoint `kubelet_internal_checkpoint`
//! (atomically: a temp file renamed); `/var/log/containers` holds one symlink per container ID.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio::process::{Child, Command};

use crate::ControlPlane;
use crate::images;

const BUILD_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/scripts/build-node.sh"
);
const PACKAGES_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/scripts/install-node-packages.sh"
);
const RUNC: &str = "/usr/sbin/runc";
/// The machine-wide lock a running [`Node`] holds (an exclusive `flock`).
pub const LOCK: &str = "/run/drust-node.lock";
const CNI_BIN: &str = "/usr/lib/cni";
/// The sysctls the kubelet sets at start, and `net.ipv4.ip_forward`, which the CNI bridge
/// plugin turns on for its gateway.
const SYSCTLS: [&str; 4] = [
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
    "net/ipv4/ip_forward",
];
/// What the kubelet creates whatever its flags say; removed on cleanup when it was not there.
const KUBELET_FIXED: [&str; 4] = [
    "/var/lib/kubelet/device-plugins/kubelet.sock",
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
];

/// Starting or running the node failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// This machine cannot run a node (not root, no overlayfs, a package missing).
    #[error("this machine cannot run a real node: {0}")]
    Unsupported(String),
    /// Something failed; the text says what, with log tails where useful.
    #[error("real node: {0}")]
    Failed(String),
}

fn failed(what: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::Failed(format!("{what}: {e}"))
}

/// The Debian packages the node needs, each with a file it installs.
const PACKAGES: [(&str, &str); 3] = [
    (RUNC, "runc"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    (images::BUSYBOX, "busybox-static"),
];

/// Why this machine cannot run a node, if it cannot: root, overlayfs, runc, the CNI plugins
/// and busybox are needed (`apt-get install runc containernetworking-plugins busybox-static`;
/// [`ensure_packages`] does that).
pub fn unsupported() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems
        .lines()
        .any(|l| l.trim_end().ends_with("overlay"))
    {
        return Some("no overlayfs in /proc/filesystems".into());
    }
    PACKAGES
        .iter()
        .find(|(path, _)| !Path::new(path).exists())
        .map(|(path, package)| format!("{path} is missing: install Debian's {package}"))
}

/// Installs the Debian packages the node needs when one is missing and this process is root,
/// with `tests/scripts/install-node-packages.sh` (apt-get; it says so on stderr). Concurrent
/// callers, in this process or in test binaries run side by side, share the script's lock: one
/// installs, the others wait and find the packages there. Blocking (apt-get takes a minute or
/// two on a fresh machine): call it from a blocking thread.
///
/// # Errors
/// [`NodeError::Failed`] when the script fails (its messages went to stderr).
pub fn ensure_packages() -> Result<(), NodeError> {
    let missing = PACKAGES.iter().any(|(path, _)| !Path::new(path).exists());
    if !missing || !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    // The script's stderr goes straight to ours: a test harness's output capture (which takes
    // only what `eprint!` writes) must not hide that apt-get runs.
    let status = std::process::Command::new(PACKAGES_SCRIPT)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .map_err(|e| failed(&format!("running {PACKAGES_SCRIPT}"), e))?;
    if !status.success() {
        return Err(failed(
            PACKAGES_SCRIPT,
            format!("{status} (its messages are above)"),
        ));
    }
    Ok(())
}

/// This machine's part in running real nodes: the lock [`LOCK`], the node binaries, and what
/// the kubelets change outside their temp dirs (sysctls, fixed paths, `/run/netns`), put back
/// when the last [`Node`] holding it is gone (each node holds it in an [`Arc`]).
pub struct Machine {
    bins: PathBuf,
    sysctls: Vec<(PathBuf, String)>,
    created: Vec<PathBuf>,
    netns_before: Vec<PathBuf>,
    /// [`LOCK`], held for the machine's life (released when the file is closed).
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl Machine {
    /// Installs missing Debian packages ([`ensure_packages`]), builds (or finds cached) the node
    /// binaries, waits for [`LOCK`] and records what the kubelets will change.
    ///
    /// # Errors
    /// [`NodeError::Unsupported`] when [`unsupported`] says so; [`NodeError::Failed`] otherwise.
    pub async fn acquire() -> Result<Arc<Self>, NodeError> {
        tokio::task::spawn_blocking(ensure_packages)
            .await
            .map_err(|e| failed("installing the node's packages", e))??;
        if let Some(why) = unsupported() {
            return Err(NodeError::Unsupported(why));
        }
        let bins = build_binaries().await?;
        let lock = tokio::task::spawn_blocking(|| {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(LOCK)?;
            nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
                .map_err(|(_, e)| std::io::Error::from(e))
        })
        .await
        .map_err(|e| failed("waiting for the node lock", e))?
        .map_err(|e| failed(&format!("locking {LOCK}"), e))?;
        Ok(Arc::new(Self {
            bins,
            sysctls: SYSCTLS
                .iter()
                .map(|s| {
                    let p = Path::new("/proc/sys").join(s);
                    let v = std::fs::read_to_string(&p).unwrap_or_default();
                    (p, v.trim().to_owned())
                })
                .collect(),
            created: KUBELET_FIXED
                .iter()
                .map(PathBuf::from)
                .filter(|p| !p.exists())
                .collect(),
            netns_before: list_dir(Path::new("/run/netns")),
            _lock: lock,
        }))
    }

    /// Puts the sysctls back, removes the fixed paths the kubelets created and network
    /// namespaces left in `/run/netns`.
    fn restore(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for ns in list_dir(Path::new("/run/netns")) {
            if !self.netns_before.contains(&ns) {
                if let Err(e) = nix::mount::umount2(&ns, nix::mount::MntFlags::MNT_DETACH)
                    && e != nix::errno::Errno::EINVAL
                    && e != nix::errno::Errno::ENOENT
                {
                    problems.push(format!("unmounting {}: {e}", ns.display()));
                }
                let _ = std::fs::remove_file(&ns);
            }
        }
        for (path, value) in &self.sysctls {
            if !value.is_empty() && std::fs::write(path, value).is_err() {
                problems.push(format!("restoring {}", path.display()));
            }
        }
        for p in &self.created {
            if p.is_dir() {
                let _ = std::fs::remove_dir_all(p);
            } else {
                let _ = std::fs::remove_file(p);
            }
        }
        problems
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        for problem in self.restore() {
            eprintln!("real node machine: {problem}");
        }
    }
}

/// A running node: containerd and the kubelet.
pub struct Node {
    name: String,
    dir: Option<tempfile::TempDir>,
    root: PathBuf,
    options: NodeOptions,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    kubelet_args: Vec<String>,
    /// The node's cgroup (its `/kubepods` or its own cgroup root), when the node created it.
    created_cgroup: Option<PathBuf>,
    /// Dropped after the node's own cleanup ([`Drop`] runs before the fields are dropped).
    machine: Arc<Machine>,
}

/// Node options.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Node labels, set by the kubelet at registration.
    pub labels: BTreeMap<String, String>,
    /// The CNI bridge the node's pods attach to (a Linux interface name: at most 15 bytes).
    pub bridge: String,
    /// The node's pod subnet (host-local IPAM); the bridge takes its first address.
    pub pod_subnet: String,
    /// The kubelet's `cgroupRoot` in cgroupfs form: `/` puts pods under `/kubepods`; another
    /// root is created in every hierarchy for the node (the kubelet wants it to exist).
    pub cgroup_root: String,
    /// The kubelet's feature gates (`featureGates` in its configuration); none by default.
    pub feature_gates: BTreeMap<String, bool>,
}

impl Default for NodeOptions {
    /// No labels, bridge `drustbr0`, pods in 10.88.77.0/24, cgroup root `/`.
    fn default() -> Self {
        Self {
            labels: BTreeMap::new(),
            bridge: "drustbr0".to_owned(),
            pod_subnet: "10.88.77.0/24".to_owned(),
            cgroup_root: "/".to_owned(),
            feature_gates: BTreeMap::new(),
        }
    }
}

impl NodeOptions {
    /// Options for the `index`-th of several nodes on one [`Machine`] (0 to 177): bridge
    /// `drustbr<index>`, pods in `10.88.<77 + index>.0/24`, cgroup root `/drust-node<index>`.
    /// Every bridge is a gateway on this host, which forwards between them: a pod reaches the
    /// pods of the other nodes.
    ///
    /// # Panics
    /// When `index` is above 177 (the subnet's third octet would pass 254).
    pub fn numbered(index: u8) -> Self {
        assert!(index <= 177, "node index {index} above 177");
        Self {
            bridge: format!("drustbr{index}"),
            pod_subnet: format!("10.88.{}.0/24", 77 + u16::from(index)),
            cgroup_root: format!("/drust-node{index}"),
            ..Self::default()
        }
    }

    /// These options with label `key=value` added.
    #[must_use]
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }
}

impl Node {
    /// Starts containerd and the kubelet for node `name` against `cp`, imports the sandbox and
    /// workload images, and waits (up to 2 minutes) for the Node to be Ready; then removes the
    /// taints set at registration (the test control plane runs no node-lifecycle controller).
    ///
    /// Missing Debian packages are installed first ([`ensure_packages`]).
    ///
    /// # Errors
    /// [`NodeError::Unsupported`] when [`unsupported`] says so; [`NodeError::Failed`] otherwise.
    pub async fn start(
        cp: &ControlPlane,
        name: &str,
        options: NodeOptions,
    ) -> Result<Self, NodeError> {
        let machine = Machine::acquire().await?;
        Self::start_on(&machine, cp, name, options).await
    }

    /// [`Node::start`] on a [`Machine`] already acquired, beside the other nodes started on it:
    /// give each its own bridge, pod subnet and cgroup root ([`NodeOptions::numbered`]).
    ///
    /// # Errors
    /// [`NodeError::Failed`].
    pub async fn start_on(
        machine: &Arc<Machine>,
        cp: &ControlPlane,
        name: &str,
        options: NodeOptions,
    ) -> Result<Self, NodeError> {
        let dir = tempfile::Builder::new()
            .prefix("drust-node-")
            .tempdir()
            .map_err(|e| failed("temp dir", e))?;
        let root = dir.path().to_owned();
        share(&root)?;
        let mut node = Self {
            name: name.to_owned(),
            dir: Some(dir),
            root,
            options,
            containerd: None,
            kubelet: None,
            kubelet_args: Vec::new(),
            created_cgroup: None,
            machine: Arc::clone(machine),
        };
        node.make_cgroup_root()?;
        node.start_containerd().await?;
        node.import_images().await?;
        node.start_kubelet(cp).await?;
        node.wait_ready(cp).await?;
        Ok(node)
    }

    /// The cgroup the node's pods live under: `/kubepods` for cgroup root `/`, else the
    /// node's own cgroup root.
    fn pods_cgroup(&self) -> PathBuf {
        let root = Path::new(&self.options.cgroup_root);
        if root == Path::new("/") {
            root.join("kubepods")
        } else {
            root.to_owned()
        }
    }

    /// Creates the kubelet's cgroup root in every hierarchy unless it is `/`, with the cpuset
    /// of its parent (a new cgroup v1 cpuset is empty, and no task may join an empty one);
    /// records the cgroup this node must remove on cleanup.
    fn make_cgroup_root(&mut self) -> Result<(), NodeError> {
        let root = Path::new(&self.options.cgroup_root);
        let own = self.pods_cgroup();
        if root != Path::new("/") {
            // Under the machine's lock only a killed test's node can have left it.
            for dir in cgroup_dirs(root) {
                remove_cgroup_tree(&dir);
            }
        }
        if cgroup_dirs(&own).iter().any(|c| c.exists()) {
            if root != Path::new("/") {
                return Err(failed(
                    &format!("cgroup root {}", root.display()),
                    "is still there with processes in it (another node's?)",
                ));
            }
            return Ok(());
        }
        self.created_cgroup = Some(own.clone());
        if root == Path::new("/") {
            return Ok(());
        }
        for dir in cgroup_dirs(root) {
            std::fs::create_dir(&dir).map_err(|e| failed(&dir.display().to_string(), e))?;
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let (Some(parent), true) = (dir.parent(), dir.join(file).exists()) else {
                    continue;
                };
                let value = std::fs::read_to_string(parent.join(file))
                    .map_err(|e| failed(&parent.join(file).display().to_string(), e))?;
                std::fs::write(dir.join(file), value.trim())
                    .map_err(|e| failed(&dir.join(file).display().to_string(), e))?;
            }
        }
        Ok(())
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The options the node was started with.
    pub fn options(&self) -> &NodeOptions {
        &self.options
    }

    /// The kubelet's process ID, while it runs.
    pub fn kubelet_pid(&self) -> Option<u32> {
        self.kubelet.as_ref().and_then(Child::id)
    }

    /// containerd's process ID, while it runs.
    pub fn containerd_pid(&self) -> Option<u32> {
        self.containerd.as_ref().and_then(Child::id)
    }

    /// The temp dir everything lives under: a shared mount (as `/` on a systemd host), so a
    /// hostPath volume with `HostToContainer` propagation may name a directory below it.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The kubelet's `--root-dir`.
    pub fn kubelet_dir(&self) -> PathBuf {
        self.root.join("kubelet")
    }

    /// Where a DRA plugin puts its registration socket (`<root-dir>/plugins_registry`).
    pub fn registry_dir(&self) -> PathBuf {
        self.kubelet_dir().join("plugins_registry")
    }

    /// Where a DRA plugin keeps its DRA socket (`<root-dir>/plugins/<driver>`).
    pub fn plugin_dir(&self, driver: &str) -> PathBuf {
        self.kubelet_dir().join("plugins").join(driver)
    }

    /// The kubelet's PodResources API socket (`<root-dir>/pod-resources/kubelet.sock`).
    pub fn pod_resources_socket(&self) -> PathBuf {
        self.kubelet_dir()
            .join("pod-resources")
            .join("kubelet.sock")
    }

    /// The CDI spec directory containerd reads (`cdi_spec_dirs`).
    pub fn cdi_root(&self) -> PathBuf {
        self.root.join("cdi")
    }

    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.root.join("containerd/containerd.sock")
    }

    /// A tail of the kubelet's and containerd's logs, for failure messages.
    pub fn log_tail(&self) -> String {
        ["kubelet.log", "containerd.log"]
            .iter()
            .map(|f| {
                let log = std::fs::read_to_string(self.root.join(f)).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                format!(
                    "--- {f}\n{}",
                    lines[lines.len().saturating_sub(30)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The last `lines` lines the kubelet logged for each container of every pod in `namespace`
    /// whose name starts with `pod_prefix` (`<root>/pod-logs/<ns>_<pod>_<uid>/<container>/N.log`,
    /// CRI log format), for failure messages. Empty when there are none.
    pub fn pod_logs(&self, namespace: &str, pod_prefix: &str, lines: usize) -> String {
        let mut out = String::new();
        let prefix = format!("{namespace}_{pod_prefix}");
        let Ok(pods) = std::fs::read_dir(self.root.join("pod-logs")) else {
            return out;
        };
        let mut pods: Vec<PathBuf> = pods
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
            })
            .collect();
        pods.sort();
        for pod in pods {
            let mut files = walk_files(&pod);
            files.sort();
            for file in files {
                let log = std::fs::read_to_string(&file).unwrap_or_default();
                let all: Vec<&str> = log.lines().collect();
                out.push_str(&format!(
                    "--- {}\n{}\n",
                    file.strip_prefix(&self.root).unwrap_or(&file).display(),
                    all[all.len().saturating_sub(lines)..].join("\n")
                ));
            }
        }
        out
    }

    fn log(&self, file: &str) -> Result<std::fs::File, NodeError> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join(file))
            .map_err(|e| failed(file, e))
    }

    async fn start_containerd(&mut self) -> Result<(), NodeError> {
        let r = &self.root;
        for d in [
            "containerd/root",
            "containerd/state",
            "containerd/conf.d",
            "containerd/certs.d",
            "containerd/opt",
            "cni/net.d",
            "cdi",
            "runc",
            "shim",
        ] {
            std::fs::create_dir_all(r.join(d)).map_err(|e| failed(d, e))?;
        }
        std::fs::set_permissions(
            r.join("cdi"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .map_err(|e| failed("cdi", e))?;
        let config = format!(
            r#"version = 3
root = "{r}/containerd/root"
state = "{r}/containerd/state"
imports = ["{r}/containerd/conf.d/*.toml"]
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{r}/containerd/containerd.sock"

[ttrpc]
  address = "{r}/containerd/containerd.sock.ttrpc"

[plugins.'io.containerd.internal.v1.opt']
  path = "{r}/containerd/opt"

[plugins.'io.containerd.shim.v1.manager']
  socket_dir = "{r}/shim"

[plugins.'io.containerd.cri.v1.images'.registry]
  config_path = "{r}/containerd/certs.d"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{sandbox}"

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["{r}/cdi"]
  netns_mounts_under_state_dir = true

  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"

    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        Root = "{r}/runc"

  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{r}/cni/net.d"
"#,
            r = r.display(),
            sandbox = images::SANDBOX_IMAGE,
        );
        std::fs::write(r.join("containerd/config.toml"), config)
            .map_err(|e| failed("containerd config", e))?;
        let cni = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "drust",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.options.bridge,
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.options.pod_subnet}]],
                        // A default route through the bridge, so that pods reach the
                        // machine's own address (the API server, for the chart's plugin).
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": format!("{}/cni/ipam", r.display()),
                    },
                },
                {"type": "loopback"},
            ],
        });
        std::fs::write(r.join("cni/net.d/10-drust.conflist"), cni.to_string())
            .map_err(|e| failed("CNI config", e))?;
        let bins = &self.machine.bins;
        let mut cmd = Command::new(bins.join("containerd"));
        cmd.arg("--config")
            .arg(r.join("containerd/config.toml"))
            .env(
                "PATH",
                format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bins.display()),
            )
            .stdin(Stdio::null())
            .stdout(self.log("containerd.log")?)
            .stderr(self.log("containerd.log")?)
            .kill_on_drop(true);
        self.containerd = Some(cmd.spawn().map_err(|e| failed("starting containerd", e))?);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.ctr(&["version"]).await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(failed(
                    "containerd did not answer within 30 s",
                    self.log_tail(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs `ctr -a <socket> -n k8s.io ARGS` and returns its stdout.
    ///
    /// # Errors
    /// [`NodeError::Failed`] with its stderr when it fails.
    pub async fn ctr(&self, args: &[&str]) -> Result<String, NodeError> {
        let out = Command::new(self.machine.bins.join("ctr"))
            .arg("-a")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io"])
            .args(args)
            .output()
            .await
            .map_err(|e| failed("running ctr", e))?;
        if !out.status.success() {
            return Err(failed(
                &format!("ctr {}", args.join(" ")),
                String::from_utf8_lossy(&out.stderr),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Lets the node's containerd pull images of `host` (`<address>:<port>`, a registry that
    /// serves plain HTTP) by name: a `hosts.toml` for it under the CRI plugin's registry
    /// `config_path`, which containerd reads at every pull.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn trust_registry(&self, host: &str) -> Result<(), NodeError> {
        let dir = self.root.join("containerd/certs.d").join(host);
        std::fs::create_dir_all(&dir).map_err(|e| failed("registry hosts directory", e))?;
        std::fs::write(
            dir.join("hosts.toml"),
            format!(
                "server = \"http://{host}\"\n\n[host.\"http://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
            ),
        )
        .map_err(|e| failed("registry hosts.toml", e))
    }

    /// Imports an OCI image archive into the CRI's namespace.
    ///
    /// # Errors
    /// [`NodeError::Failed`] when `ctr images import` fails.
    pub async fn import(&self, archive: &Path) -> Result<(), NodeError> {
        let path = archive.to_string_lossy();
        self.ctr(&["images", "import", "--platform", "linux/amd64", &path])
            .await
            .map(|_| ())
    }

    async fn import_images(&self) -> Result<(), NodeError> {
        for image in [images::sandbox(), images::workload()] {
            let image = image.map_err(|e| failed("image", e))?;
            let archive = self.root.join(format!(
                "{}.tar",
                image
                    .name
                    .rsplit('/')
                    .next()
                    .unwrap_or("image")
                    .replace(':', "_")
            ));
            images::write_archive(&image, &archive)
                .map_err(|e| failed("writing an image archive", e))?;
            self.import(&archive).await?;
        }
        Ok(())
    }

    async fn start_kubelet(&mut self, cp: &ControlPlane) -> Result<(), NodeError> {
        let kubelet_dir = self.kubelet_dir();
        std::fs::create_dir_all(&kubelet_dir).map_err(|e| failed("kubelet dir", e))?;
        let cgroup_v1 = !Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        let mut config = serde_json::json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": free_port()?,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port()?,
            "authentication": {
                "anonymous": {"enabled": true},
                "webhook": {"enabled": false},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": !cgroup_v1,
            "failSwapOn": false,
            "oomScoreAdj": 0,
            "evictionHard": {},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "resolvConf": "",
            "makeIPTablesUtilChains": false,
            "localStorageCapacityIsolation": false,
            "containerRuntimeEndpoint": format!("unix://{}", self.containerd_socket().display()),
            "serializeImagePulls": false,
            "podLogsDir": self.root.join("pod-logs"),
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s",
            "cgroupRoot": self.options.cgroup_root,
        });
        if !self.options.feature_gates.is_empty() {
            config["featureGates"] = serde_json::json!(self.options.feature_gates);
        }
        let config_path = self.root.join("kubelet-config.json");
        std::fs::write(&config_path, config.to_string())
            .map_err(|e| failed("kubelet config", e))?;
        let labels: Vec<String> = self
            .options
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let mut args = vec![
            format!("--config={}", config_path.display()),
            format!("--kubeconfig={}", cp.kubeconfig_path().display()),
            format!("--root-dir={}", kubelet_dir.display()),
            format!("--cert-dir={}", self.root.join("kubelet-pki").display()),
            format!("--hostname-override={}", self.name),
            "--node-ip=127.0.0.1".to_owned(),
            "--v=2".to_owned(),
        ];
        if !labels.is_empty() {
            args.push(format!("--node-labels={}", labels.join(",")));
        }
        self.kubelet_args = args;
        self.spawn_kubelet()
    }

    fn spawn_kubelet(&mut self) -> Result<(), NodeError> {
        let mut cmd = Command::new(self.machine.bins.join("kubelet"));
        cmd.args(&self.kubelet_args)
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(self.log("kubelet.log")?)
            .stderr(self.log("kubelet.log")?)
            .kill_on_drop(true);
        self.kubelet = Some(cmd.spawn().map_err(|e| failed("starting the kubelet", e))?);
        Ok(())
    }

    /// Restarts the kubelet (SIGTERM, then the same command) and waits until the new process
    /// has reported the node Ready. Containers keep running meanwhile.
    ///
    /// # Errors
    /// [`NodeError::Failed`] when it does not come back within 2 minutes.
    pub async fn restart_kubelet(&mut self, cp: &ControlPlane) -> Result<(), NodeError> {
        if let Some(mut k) = self.kubelet.take() {
            terminate(&mut k, Duration::from_secs(10)).await;
        }
        let since = k8s_openapi::jiff::Timestamp::now();
        self.spawn_kubelet()?;
        self.wait_ready_since(cp, Some(since)).await
    }

    async fn wait_ready(&mut self, cp: &ControlPlane) -> Result<(), NodeError> {
        self.wait_ready_since(cp, None).await
    }

    /// Waits for the Ready condition, reported (heartbeat) at or after `since` if given.
    async fn wait_ready_since(
        &mut self,
        cp: &ControlPlane,
        since: Option<k8s_openapi::jiff::Timestamp>,
    ) -> Result<(), NodeError> {
        let client = cp.client().await.map_err(|e| failed("client", e))?;
        let nodes: Api<NodeObject> = Api::all(client);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(k) = self.kubelet.as_mut()
                && let Ok(Some(status)) = k.try_wait()
            {
                return Err(failed(
                    &format!("the kubelet exited ({status})"),
                    self.log_tail(),
                ));
            }
            if let Ok(Some(node)) = nodes.get_opt(&self.name).await {
                let ready = node
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| {
                        c.iter().any(|c| {
                            c.type_ == "Ready"
                                && c.status == "True"
                                && since.is_none_or(|t| {
                                    // Heartbeats are stored in whole seconds.
                                    c.last_heartbeat_time
                                        .as_ref()
                                        .is_some_and(|h| h.0.as_second() >= t.as_second())
                                })
                        })
                    });
                if ready {
                    // Nothing in the test control plane lifts the taints set at registration.
                    let patch = serde_json::json!({"spec": {"taints": null}});
                    nodes
                        .patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map_err(|e| failed("removing the node's taints", e))?;
                    // The kubelet refuses a loopback --node-ip as the Node's address
                    // (`validateNodeIP` in its node status setters) and publishes none, so the
                    // API server could not reach it for logs, exec or port-forwards: the
                    // address it listens on is set here (the kubelet leaves it alone).
                    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
                    if addresses.is_none_or(Vec::is_empty) {
                        let status = serde_json::json!({"status": {"addresses": [
                            {"type": "InternalIP", "address": "127.0.0.1"}]}});
                        nodes
                            .patch_status(
                                &self.name,
                                &PatchParams::default(),
                                &Patch::Merge(&status),
                            )
                            .await
                            .map_err(|e| failed("setting the node's address", e))?;
                    }
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(failed(
                    "the node was not Ready within 120 s",
                    self.log_tail(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Stops the kubelet and containerd and puts the machine back as it was.
    ///
    /// # Errors
    /// [`NodeError::Failed`] when cleanup left something behind (it still does all it can).
    pub async fn stop(mut self) -> Result<(), NodeError> {
        if let Some(mut k) = self.kubelet.take() {
            terminate(&mut k, Duration::from_secs(10)).await;
        }
        self.cleanup()
    }

    /// Everything [`Node::stop`] does after stopping the kubelet; idempotent, synchronous (also
    /// run on drop).
    fn cleanup(&mut self) -> Result<(), NodeError> {
        let Some(dir) = self.dir.take() else {
            return Ok(());
        };
        let mut problems = Vec::new();
        if let Some(mut k) = self.kubelet.take() {
            let _ = k.start_kill();
        }
        // Containers: kill and delete through runc (the shim keeps each containerd namespace's
        // containers under `<Root>/<namespace>/<id>`), then any process left in the node's
        // cgroups, then whatever still runs from our dir (shims, containerd).
        for namespace in list_dir(&self.root.join("runc")) {
            for id in list_dir(&namespace) {
                if let Some(id) = id.file_name().and_then(|n| n.to_str()) {
                    let _ = std::process::Command::new(RUNC)
                        .arg("--root")
                        .arg(&namespace)
                        .args(["delete", "--force", id])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }
        let left: Vec<u32> = cgroup_dirs(&self.pods_cgroup())
            .iter()
            .flat_map(|c| kill_cgroup_processes(c, Duration::from_secs(10)))
            .collect();
        if !left.is_empty() {
            problems.push(format!(
                "processes {left:?} still in {} after SIGKILL",
                self.pods_cgroup().display()
            ));
        }
        if let Some(mut c) = self.containerd.take() {
            let _ = c.start_kill();
        }
        kill_processes_mentioning(&self.root);
        // Mounts under our dir (network namespaces included: containerd keeps them under its
        // state dir), deepest first.
        let mut mounts = mounts_under(&self.root);
        mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
        for m in &mounts {
            if let Err(e) = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH)
                && e != nix::errno::Errno::EINVAL
                && e != nix::errno::Errno::ENOENT
            {
                problems.push(format!("unmounting {}: {e}", m.display()));
            }
        }
        // The bridge the CNI plugin made.
        let _ = std::process::Command::new("ip")
            .args(["link", "delete", &self.options.bridge])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(cgroup) = self.created_cgroup.take() {
            for c in cgroup_dirs(&cgroup) {
                remove_cgroup_tree(&c);
            }
        }
        if std::env::var_os(crate::KEEP_ENV).is_some() {
            let kept = dir.keep();
            eprintln!("real node kept in {}", kept.display());
        } else if let Err(e) = dir.close() {
            problems.push(format!("removing the temp dir: {e}"));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(NodeError::Failed(problems.join("; ")))
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Err(e) = self.cleanup() {
            eprintln!("{e}");
        }
    }
}

async fn terminate(child: &mut Child, grace: Duration) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

/// Runs `build-node.sh`, which builds the kubelet of the version `DRUST_K8S` selects (refused
/// here first when unknown).
async fn build_binaries() -> Result<PathBuf, NodeError> {
    crate::kubernetes::KubernetesVersion::from_env().map_err(|e| failed("build-node.sh", e))?;
    let out = Command::new("bash")
        .arg(BUILD_SCRIPT)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| failed("running build-node.sh", e))?
        .wait_with_output()
        .await
        .map_err(|e| failed("running build-node.sh", e))?;
    if !out.status.success() {
        return Err(failed("build-node.sh", out.status));
    }
    let dir = PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next_back()
            .unwrap_or_default()
            .trim(),
    );
    for b in ["kubelet", "containerd", "containerd-shim-runc-v2", "ctr"] {
        if !dir.join(b).is_file() {
            return Err(failed(
                "build-node.sh",
                format!("{b} missing in {}", dir.display()),
            ));
        }
    }
    Ok(dir)
}

fn free_port() -> Result<u16, NodeError> {
    crate::ports::free_port().map_err(|e| failed("picking a port", e))
}

fn list_dir(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect()
}

/// Makes `dir` a shared mount (a bind mount of itself, `MS_SHARED`), as systemd makes `/` on
/// real hosts: containerd refuses a hostPath volume with `HostToContainer` or `Bidirectional`
/// propagation (the chart's driver root) whose host side is on a private mount ("is mounted on
/// / but it is not a shared or slave mount"), and this machine's `/` is private. The mount is
/// under the node's dir, so [`Node::stop`] unmounts it with the rest.
fn share(dir: &Path) -> Result<(), NodeError> {
    use nix::mount::{MsFlags, mount};
    mount(
        Some(dir),
        dir,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| failed(&format!("bind-mounting {}", dir.display()), e))?;
    mount(
        None::<&str>,
        dir,
        None::<&str>,
        MsFlags::MS_SHARED | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| failed(&format!("making {} a shared mount", dir.display()), e))
}

/// Every regular file at or under `dir` (no symlinks followed).
fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in list_dir(dir) {
        if entry.is_symlink() {
            continue;
        } else if entry.is_dir() {
            files.extend(walk_files(&entry));
        } else if entry.is_file() {
            files.push(entry);
        }
    }
    files
}

/// `path` (absolute, e.g. `/kubepods`) in every cgroup hierarchy mounted under /sys/fs/cgroup.
fn cgroup_dirs(path: &Path) -> Vec<PathBuf> {
    let rel = path.strip_prefix("/").unwrap_or(path);
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        return vec![base.join(rel)];
    }
    list_dir(base)
        .into_iter()
        .filter(|h| h.is_dir() && !h.is_symlink())
        .map(|h| h.join(rel))
        .collect()
}

/// Removes a cgroup directory and its children, deepest first (cgroupfs directories are
/// removed with rmdir; their files go with them).
fn remove_cgroup_tree(dir: &Path) {
    for child in list_dir(dir) {
        if child.is_dir() {
            remove_cgroup_tree(&child);
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// SIGKILLs every process in cgroup directory `dir` and below until none is left, for at most
/// `wait`; returns those still there then.
fn kill_cgroup_processes(dir: &Path, wait: Duration) -> Vec<u32> {
    fn pids(dir: &Path, out: &mut Vec<u32>) {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        out.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        for child in list_dir(dir) {
            if child.is_dir() {
                pids(&child, out);
            }
        }
    }
    let deadline = Instant::now() + wait;
    loop {
        let mut left = Vec::new();
        pids(dir, &mut left);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        for pid in &left {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Mount points at or under `dir`, from /proc/self/mountinfo.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(m.replace("\\040", " ")))
        .filter(|m| m.starts_with(dir))
        .collect()
}

/// SIGKILLs every process whose command line mentions `dir` (containerd, shims, stray
/// helpers), except this one.
fn kill_processes_mentioning(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let me = std::process::id();
    for p in list_dir(Path::new("/proc")) {
        let Some(pid) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let cmdline = std::fs::read(p.join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}
