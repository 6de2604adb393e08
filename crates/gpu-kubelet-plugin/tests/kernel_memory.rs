//! The `kernel` enforcement level, end to end below the kubelet. Compute: each share gets its
//! own MPS v3 namespace on its GPU's daemon, the only socket its containers reach (through the
//! fake control tool, which speaks v3 as NVIDIA documents it). Memory: the plugin's
//! detection, the CDI hook in a share's spec, the installed `drust-cdi-hook` binary run as a
//! container runtime runs it (OCI state on stdin) for a real process in a real cgroup v2
//! directory, the limit reaching the GPU backend for that cgroup, and unprepare and start-up
//! recovery clearing it. The GPU backend is the fake one (a driver r615 topology), so the limit
//! lands in its state dir; `gpu-inventory/tests/mock_nvml.rs` carries the same call through
//! the real NVML backend, and `tests/e2e` runs the hook from containerd on the real node.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use dra_kubelet::Driver;
use gpu_inventory::{FakeBackend, GpuBackend, MemoryLimits, MigStrategy, discover};
use gpu_kubelet_plugin::cdi::CdiWriter;
use gpu_kubelet_plugin::checkpoint::CheckpointFile;
use gpu_kubelet_plugin::claims::{ClaimController, ControllerConfig, RecoveryReport};
use gpu_kubelet_plugin::config::{Backend, Config};
use gpu_kubelet_plugin::hardware::{BackendHardware, node_devices};
use gpu_kubelet_plugin::memory_limits::{KernelMemory, Unavailable};
use gpu_kubelet_plugin::mps::namespace_name;
use gpu_kubelet_plugin::storage::RealFs;

const SHARE: &str = "00000000-0000-4000-8000-0000000000";
/// GPU 0 of the mock libnvidia-ml with `DRUST_MOCK_NVML_UUIDS=fixed`.
const MOCK_GPU0: &str = "GPU-00000000-0000-4000-8000-000000000000";

/// The cgroup v2 mount of this machine (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a
/// hybrid cgroup v1 host such as CI's), from `/proc/self/mountinfo`.
fn cgroup2_root() -> PathBuf {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    info.lines()
        .find_map(|l| {
            let (fields, rest) = l.split_once(" - ")?;
            let mount = fields.split_whitespace().nth(4)?;
            (rest.split_whitespace().next() == Some("cgroup2")).then(|| PathBuf::from(mount))
        })
        .expect("a cgroup v2 hierarchy is mounted (the machine's kind has one)")
}

/// A process in its own new cgroup under `root`, removed on drop.
struct Contained {
    child: Child,
    cgroup: PathBuf,
}

impl Contained {
    fn start(root: &Path, name: &str) -> Self {
        Self::start_in(root.join(format!("drust-test-{}-{name}", std::process::id())))
    }

    fn start_in(cgroup: PathBuf) -> Self {
        std::fs::create_dir_all(&cgroup).expect("create a cgroup (root)");
        let child = Command::new("sleep").arg("300").spawn().expect("sleep");
        std::fs::write(cgroup.join("cgroup.procs"), child.id().to_string())
            .expect("move the process into its cgroup");
        Self { child, cgroup }
    }
}

impl Drop for Contained {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The cgroup empties once the process is reaped.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A pod cgroup as the kubelet's cgroupfs driver names it, under a test cgroup of `root`.
struct PodCgroup {
    top: PathBuf,
    pod: PathBuf,
}

impl PodCgroup {
    fn new(root: &Path) -> Self {
        let top = root.join(format!("drust-test-{}-pods", std::process::id()));
        let pod = top.join("pod0a1b2c3d-0000-4000-8000-000000000001");
        Self { top, pod }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.pod);
        let _ = std::fs::remove_dir(&self.top);
    }
}

/// The fake DGX H100 with a driver of the r615 branch, written under `dir`.
fn r615_topology(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/topologies/dgx-h100.yaml"),
    )
    .expect("topology");
    assert!(text.contains("driverVersion: \"570.124.06\""));
    let path = dir.join("topology.yaml");
    std::fs::write(
        &path,
        text.replace(
            "driverVersion: \"570.124.06\"",
            "driverVersion: \"615.20.01\"",
        ),
    )
    .expect("write");
    path
}

struct Node {
    dir: tempfile::TempDir,
    config: Config,
    backend: Arc<FakeBackend>,
}

impl Node {
    fn new(cgroup_root: &Path) -> Self {
        let dir = tempfile::tempdir().expect("dir");
        let topology = r615_topology(dir.path());
        let state = dir.path().join("fake-state");
        let mut config = Config::new(
            DRIVER,
            NODE,
            Backend::Fake {
                topology: topology.clone(),
                state_dir: Some(state.clone()),
            },
        );
        config.cgroup_root = cgroup_root.to_owned();
        config.cdi_hook_binary = PathBuf::from(env!("CARGO_BIN_EXE_drust-cdi-hook"));
        config.sockets.plugin_dir = dir.path().join("plugin");
        // The device nodes prepare checks, as plain files.
        std::fs::create_dir_all(dir.path().join("dev")).expect("dev");
        for n in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
            .into_iter()
            .map(String::from)
            .chain((0..8).map(|g| format!("nvidia{g}")))
        {
            std::fs::write(dir.path().join("dev").join(n), b"").expect("node");
        }
        let backend = Arc::new(
            FakeBackend::from_file(&topology)
                .expect("topology")
                .with_state_dir(&state),
        );
        Self {
            dir,
            config,
            backend,
        }
    }

    async fn controller(
        &self,
        cluster: Shared,
        kernel: Option<KernelMemory>,
    ) -> ClaimController<Shared, BackendHardware> {
        self.start(cluster, kernel).await.0
    }

    /// A claim controller on this node, and its start-up recovery's report.
    async fn start(
        &self,
        cluster: Shared,
        kernel: Option<KernelMemory>,
    ) -> (ClaimController<Shared, BackendHardware>, RecoveryReport) {
        let root = self.dir.path();
        let inventory = discover(self.backend.as_ref()).expect("discover");
        ClaimController::start(
            cluster,
            Arc::new(BackendHardware::new(
                Arc::clone(&self.backend) as Arc<dyn GpuBackend>,
                root,
                "/proc",
            )),
            ControllerConfig {
                driver_name: DRIVER.into(),
                node_name: NODE.into(),
                timeout: Duration::from_secs(10),
                boot_id: "boot-1".into(),
                sharing: true,
                mps: mps_control(&root.join("mps")),
                driver_edits: Default::default(),
                kernel_memory: kernel.map(Arc::new),
                claim_users: None,
                device_metadata: None,
                imex: None,
            },
            node_devices(&inventory, MigStrategy::Existing).into_values(),
            CdiWriter::new(Arc::new(RealFs), root.join("cdi"), DRIVER),
            CheckpointFile::new(Arc::new(RealFs), root.join("plugin/checkpoint.json")),
        )
        .await
        .expect("controller")
    }

    /// The `kernel` level on this node (driver r615, cgroup v2), its hook installed.
    fn kernel(&self) -> KernelMemory {
        KernelMemory::detect(&self.config, self.backend.as_ref(), true)
            .expect("the kernel level on an r615 driver with cgroup v2")
    }

    /// The GPU at NVML index `index`.
    fn gpu(&self, index: usize) -> gpu_inventory::Gpu {
        discover(self.backend.as_ref()).expect("gpus").gpus[index].clone()
    }

    /// The hooks of the claim's first CDI device.
    fn hooks(&self, uid: &str) -> Vec<serde_json::Value> {
        let path = self
            .dir
            .path()
            .join("cdi")
            .join(format!("{DRIVER}-claim_{uid}.json"));
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("spec")).expect("JSON");
        spec["devices"][0]["containerEdits"]["hooks"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

/// Runs `hook` (a CDI hook entry) as the runtime does: `path` with `args` (`args[0]` the
/// program name) and the OCI state of container `id` with process `pid` on stdin.
fn run_hook(hook: &serde_json::Value, id: &str, pid: u32) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let args: Vec<String> = hook["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string").to_owned())
        .collect();
    let mut child = Command::new(hook["path"].as_str().expect("path"))
        .arg0(&args[0])
        .args(&args[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the hook");
    let state = serde_json::json!({"ociVersion": "1.2.0", "id": id, "status": "created",
        "pid": pid, "bundle": "/run/containerd/bundle"});
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(state.to_string().as_bytes())
        .expect("state");
    child.wait_with_output().expect("hook output")
}

#[tokio::test]
async fn a_share_container_gets_its_hard_limit_on_its_own_cgroup_until_unprepare() {
    let root = cgroup2_root();
    let node = Node::new(&root);
    let kernel = node.kernel();
    let gpu = node.gpu(0);
    let cluster = Shared::default();
    cluster.put(share_claim(
        "a",
        "ua",
        &gpu.name,
        &format!("{SHARE}01"),
        "20Gi",
    ));
    let c = node.controller(cluster, Some(kernel)).await;
    let r = c.prepare(vec![claim_ref("a", "ua")]).await;
    assert!(r["ua"].is_ok(), "{:?}", r["ua"]);

    let hooks = node.hooks("ua");
    assert_eq!(hooks.len(), 1, "{hooks:?}");
    let hook = &hooks[0];
    assert_eq!(hook["hookName"], "createRuntime");
    let installed = node.dir.path().join("plugin/bin").join(
        gpu_kubelet_plugin::memory_limits::installed_hook_name(&node.config.cdi_hook_binary)
            .expect("the hook binary"),
    );
    assert_eq!(hook["path"], installed.display().to_string());
    assert!(hook["timeout"].as_u64().is_some_and(|t| t > 0), "{hook}");

    // The runtime creates the share's container: its cgroup gets the share's 20 GiB.
    let container = Contained::start(&root, "a");
    let out = run_hook(hook, "container-a", container.child.id());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let limits = node.backend.memory_limits();
    assert_eq!(
        limits.get(&(gpu.raw.uuid.clone(), container.cgroup.clone())),
        Some(&MemoryLimits::share(20 << 30)),
        "{limits:?}"
    );
    assert_eq!(limits.len(), 1);

    // A process in the root cgroup is no container: refused, nothing set.
    let out = run_hook(hook, "container-b", std::process::id());
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("root cgroup"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(node.backend.memory_limits().len(), 1);

    // Unprepare clears the limit of the (still existing) cgroup and drops the records.
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    assert!(node.backend.memory_limits().is_empty());
    assert!(!node.dir.path().join("plugin/memory-limits/ua").exists());
}

/// Two containers of one claim in a pod each get the share, and the pod's cgroup the share once:
/// together they cannot hold twice the share. A second claim's share in the same pod on the
/// same GPU adds to the pod's limit; unpreparing a claim takes its share off the pod.
#[tokio::test]
async fn containers_of_one_claim_share_one_limit_in_their_pod() {
    let root = cgroup2_root();
    let node = Node::new(&root);
    let kernel = node.kernel();
    let gpu = node.gpu(2);
    let cluster = Shared::default();
    cluster.put(share_claim(
        "a",
        "ua",
        &gpu.name,
        &format!("{SHARE}05"),
        "10Gi",
    ));
    cluster.put(share_claim(
        "b",
        "ub",
        &gpu.name,
        &format!("{SHARE}06"),
        "5Gi",
    ));
    let c = node.controller(cluster, Some(kernel)).await;
    let r = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    let (hook_a, hook_b) = (node.hooks("ua").remove(0), node.hooks("ub").remove(0));

    let pod = PodCgroup::new(&root);
    let first = Contained::start_in(pod.pod.join("first"));
    let second = Contained::start_in(pod.pod.join("second"));
    let other = Contained::start_in(pod.pod.join("other"));
    for (hook, id, container) in [
        (&hook_a, "first", &first),
        (&hook_a, "second", &second),
        (&hook_b, "other", &other),
    ] {
        let out = run_hook(hook, id, container.child.id());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let uuid = gpu.raw.uuid.clone();
    let limit = |cgroup: &Path| {
        node.backend
            .memory_limits()
            .get(&(uuid.clone(), cgroup.to_owned()))
            .copied()
    };
    let gib = |n: u64| Some(MemoryLimits::share(n << 30));
    assert_eq!(limit(&first.cgroup), gib(10));
    assert_eq!(limit(&second.cgroup), gib(10));
    assert_eq!(limit(&other.cgroup), gib(5));
    assert_eq!(limit(&pod.pod), gib(15), "claim a once, plus claim b");

    assert!(c.unprepare(vec![claim_ref("b", "ub")]).await["ub"].is_ok());
    assert_eq!(limit(&other.cgroup), None);
    assert_eq!(limit(&pod.pod), gib(10));
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    assert!(node.backend.memory_limits().is_empty());
    drop((first, second, other));
}

#[tokio::test]
async fn start_up_clears_the_limits_of_claims_it_does_not_keep() {
    let root = cgroup2_root();
    let node = Node::new(&root);
    let kernel = node.kernel();
    let gpu = node.gpu(1);
    let cluster = Shared::default();
    cluster.put(share_claim(
        "kept",
        "uk",
        &gpu.name,
        &format!("{SHARE}02"),
        "10Gi",
    ));
    let c = node.controller(cluster.clone(), Some(kernel.clone())).await;
    assert!(c.prepare(vec![claim_ref("kept", "uk")]).await["uk"].is_ok());
    let hook = node.hooks("uk").remove(0);
    let kept = Contained::start(&root, "kept");
    assert!(run_hook(&hook, "kept", kept.child.id()).status.success());

    // The same hook for a claim the plugin has no record of (prepared by a build that crashed
    // before its checkpoint, say).
    let mut orphan_hook = hook.clone();
    let args = orphan_hook["args"].as_array_mut().expect("args");
    let at = args.iter().position(|a| a == "--claim").expect("--claim") + 1;
    args[at] = "gone".into();
    let orphan = Contained::start(&root, "orphan");
    assert!(
        run_hook(&orphan_hook, "orphan", orphan.child.id())
            .status
            .success()
    );
    assert_eq!(node.backend.memory_limits().len(), 2);
    c.quiesce().await;
    drop(c);

    let (_again, report) = node.start(cluster, Some(kernel)).await;
    assert!(
        report
            .orphans_removed
            .contains(&"memory limits of claim gone".to_owned()),
        "{report:?}"
    );
    let limits = node.backend.memory_limits();
    assert_eq!(
        limits.keys().cloned().collect::<Vec<_>>(),
        [(gpu.raw.uuid.clone(), kept.cgroup.clone())],
        "the kept claim's limit stays, the orphan's is cleared"
    );
}

#[test]
fn the_kernel_level_needs_the_driver_and_cgroup_v2() {
    let root = cgroup2_root();
    // A driver before r615: no memory partitioning.
    let node = Node::new(&root);
    let old = FakeBackend::new(topology());
    assert!(matches!(
        KernelMemory::detect(&node.config, &old, false),
        Err(Unavailable::Driver)
    ));
    // No cgroup v2 at the root (the hybrid host's /sys/fs/cgroup is a tmpfs of v1 hierarchies).
    let mut config = node.config.clone();
    config.cgroup_root = node.dir.path().to_owned();
    let err = KernelMemory::detect(&config, node.backend.as_ref(), false).expect_err("no v2");
    assert!(err.to_string().contains("cgroup v2"), "{err}");
    // With NVML, the driver needs it at /sys/fs/cgroup, not elsewhere.
    let elsewhere = node.dir.path().join("v2");
    std::fs::create_dir_all(&elsewhere).expect("dir");
    std::fs::write(elsewhere.join("cgroup.controllers"), "memory\n").expect("file");
    config.cgroup_root = elsewhere;
    config.backend = Backend::Nvml { library: None };
    let err = KernelMemory::detect(&config, node.backend.as_ref(), false).expect_err("NVML");
    assert!(err.to_string().contains("/sys/fs/cgroup"), "{err}");
    // MPS v3 namespace sockets that a daemon outside a Pod could not bind under a long root.
    let mut config = node.config.clone();
    config.mps_root = PathBuf::from("/var/lib/kubelet/plugins/gpu.drust.dev/mps-daemons");
    let err = KernelMemory::detect(&config, node.backend.as_ref(), false).expect_err("long");
    assert!(matches!(err, Unavailable::MpsSockets(_)), "{err}");
}

/// The same hook binary with the plugin's NVML backend (`--nvml-library`, the mock
/// libnvidia-ml on an r615 driver): the limit reaches `nvmlDeviceSetMemoryLimits_v1` for the
/// GPU and the container's cgroup (the mock records the call).
#[tokio::test]
async fn the_hook_sets_the_limit_through_nvml() {
    let root = cgroup2_root();
    let node = Node::new(&root);
    let kernel = node.kernel();
    let lib = drust_gotools::go_library("mocknvml", "libnvidia-ml.so.1").expect("the mock");
    let calls = node.dir.path().join("nvml-calls");
    let mut hook =
        serde_json::to_value(kernel.hook("un", "GPU-PLACEHOLDER", 5 << 30)).expect("json");
    let args = hook["args"].as_array_mut().expect("args");
    let fake_at = args
        .iter()
        .position(|a| a == "--fake-topology")
        .expect("the fake backend's flags");
    args.truncate(fake_at);
    args.extend(["--nvml-library".into(), lib.display().to_string().into()]);
    let container = Contained::start(&root, "nvml");
    let args = hook["args"].as_array_mut().expect("args");
    let gpu_at = args.iter().position(|a| a == "--gpu").expect("--gpu") + 1;
    args[gpu_at] = MOCK_GPU0.into();
    let out = {
        use std::os::unix::process::CommandExt;
        let args: Vec<String> = hook["args"]
            .as_array()
            .expect("args")
            .iter()
            .map(|a| a.as_str().expect("string").to_owned())
            .collect();
        let mut child = Command::new(hook["path"].as_str().expect("path"))
            .arg0(&args[0])
            .args(&args[1..])
            .env("DRUST_MOCK_NVML_MACHINE", "dgxh100")
            .env("DRUST_MOCK_NVML_DRIVER_VERSION", "615.20.01")
            .env("DRUST_MOCK_NVML_UUIDS", "fixed")
            .env("DRUST_MOCK_NVML_CALLS", &calls)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("hook");
        let state = serde_json::json!({"ociVersion": "1.2.0", "id": "c-nvml",
            "status": "created", "pid": container.child.id(), "bundle": "/b"});
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(state.to_string().as_bytes())
            .expect("write");
        child.wait_with_output().expect("output")
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let recorded = std::fs::read_to_string(&calls).expect("calls");
    assert_eq!(
        recorded.trim(),
        format!(
            "nvmlDeviceSetMemoryLimits_v1 {MOCK_GPU0} {} 5368709120 5368709120",
            container.cgroup.display()
        )
    );
}

/// Recovery at the `kernel` level with the API server down: a damaged checkpoint is rebuilt
/// from the CDI specs alone, and the limit of a share whose container may still run stays (its
/// claim is kept, so its records are not orphans). Once the API server answers and the kubelet
/// unprepares, the limit goes.
#[tokio::test]
async fn a_rebuild_while_the_api_server_is_down_keeps_the_limits_of_running_shares() {
    use std::sync::atomic::Ordering;
    let root = cgroup2_root();
    let node = Node::new(&root);
    let kernel = node.kernel();
    let gpu = node.gpu(3);
    let cluster = Shared::default();
    cluster.put(share_claim(
        "a",
        "ua",
        &gpu.name,
        &format!("{SHARE}07"),
        "8Gi",
    ));
    let c = node.controller(cluster.clone(), Some(kernel.clone())).await;
    assert!(c.prepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    let container = Contained::start(&root, "rebuilt");
    let hook = node.hooks("ua").remove(0);
    assert!(
        run_hook(&hook, "rebuilt", container.child.id())
            .status
            .success()
    );
    c.quiesce().await;
    drop(c);
    for slot in ["checkpoint.json", "checkpoint.b.json"] {
        let path = node.dir.path().join("plugin").join(slot);
        if path.exists() {
            std::fs::write(path, b"{damaged").expect("damage");
        }
    }

    cluster.unreachable.store(true, Ordering::SeqCst);
    let c = node.controller(cluster.clone(), Some(kernel)).await;
    assert_eq!(c.prepared_claims().await, ["ua"]);
    let key = (gpu.raw.uuid.clone(), container.cgroup.clone());
    assert_eq!(
        node.backend.memory_limits().get(&key),
        Some(&MemoryLimits::share(8 << 30)),
        "the running share's limit was cleared"
    );
    // Its MPS v3 namespace, with its limits, stays too: the rebuilt claim owns it.
    let mps = mps_control(&node.dir.path().join("mps"));
    let daemon = gpu.raw.uuid.to_ascii_lowercase();
    let namespace = |mps: &gpu_kubelet_plugin::mps::MpsControl| {
        let daemon = daemon.clone();
        let mps = mps.clone();
        async move {
            mps.namespaces(&daemon)
                .await
                .expect("namespaces")
                .into_iter()
                .map(|(_, row)| row)
                .collect::<Vec<_>>()
        }
    };
    let rows = namespace(&mps).await;
    assert!(
        rows.len() == 1
            && rows[0].starts_with(&format!("{},drust,Ready,8192M,", namespace_name("ua"))),
        "{rows:?}"
    );

    cluster.unreachable.store(false, Ordering::SeqCst);
    assert!(c.unprepare_stale().await.is_empty());
    assert!(node.backend.memory_limits().contains_key(&key));
    assert_eq!(namespace(&mps).await.len(), 1);
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    assert!(node.backend.memory_limits().is_empty());
}

/// The share's container edits in the claim's CDI spec: its pipe directory mount and
/// environment.
fn share_edits(node: &Node, uid: &str) -> (String, Vec<String>) {
    let path = node
        .dir
        .path()
        .join("cdi")
        .join(format!("{DRIVER}-claim_{uid}.json"));
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("spec")).expect("JSON");
    let edits = &spec["devices"][0]["containerEdits"];
    let pipe = edits["mounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["containerPath"] == "/run/nvidia-mps")
        .and_then(|m| m["hostPath"].as_str())
        .expect("a pipe directory mount")
        .to_owned();
    let env = edits["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| e.as_str().map(str::to_owned))
        .collect();
    (pipe, env)
}

/// A fake CUDA client through pipe directory `pipe` with `env`: the line its namespace's
/// daemon logs for it.
fn attach(log: &Path, pipe: &str, env: &[(&str, &str)]) -> String {
    let before = std::fs::read_to_string(log).unwrap_or_default().len();
    drust_fakes::attach_once(Path::new(pipe), env).expect("the client attaches");
    let text = std::fs::read_to_string(log).expect("log");
    text[before..]
        .lines()
        .find(|l| l.starts_with("client attached"))
        .expect("the daemon logged the client")
        .to_owned()
}

/// At the `kernel` level each share on a GPU gets its own MPS v3 namespace with its limits,
/// and its containers reach that namespace's socket alone: a client that raises its own
/// variables is held to its share, and no tenant sees the daemon's control socket or another
/// share's. A daemon killed under running shares is started again with every share's namespace
/// in the directory the containers have mounted; a share's unprepare deletes its namespace, the
/// last one stops the daemon.
#[tokio::test]
async fn shares_at_the_kernel_level_each_get_their_own_mps_namespace() {
    use std::os::unix::fs::MetadataExt;
    let root = cgroup2_root();
    let node = Node::new(&root);
    let gpu = node.gpu(3);
    let cluster = Shared::default();
    let mut a = share_claim("a", "ua", &gpu.name, &format!("{SHARE}01"), "20Gi");
    results_mut(&mut a)[0]
        .consumed_capacity
        .as_mut()
        .expect("capacity")
        .insert(
            "computePercent".to_owned(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("30".into()),
        );
    cluster.put(a);
    cluster.put(share_claim(
        "b",
        "ub",
        &gpu.name,
        &format!("{SHARE}02"),
        "8Gi",
    ));
    let c = node.controller(cluster, Some(node.kernel())).await;
    let r = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    assert!(r["ua"].is_ok() && r["ub"].is_ok(), "{r:?}");

    let mps = mps_control(&node.dir.path().join("mps"));
    let key = gpu.raw.uuid.to_ascii_lowercase();
    let log = node
        .dir
        .path()
        .join("mps")
        .join(&key)
        .join("log/control.log");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.contains("protocol=3 multiuser=true"), "{text}");
    let (na, nb) = (namespace_name("ua"), namespace_name("ub"));
    let rows = mps.namespaces(&key).await.expect("namespaces");
    let row = |name: &str| {
        rows.iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
            .unwrap_or_default()
    };
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(
        row(&na).starts_with(&format!("{na},drust,Ready,20480M,30,")),
        "{rows:?}"
    );
    assert!(
        row(&nb).starts_with(&format!("{nb},drust,Ready,8192M,-,")),
        "{rows:?}"
    );

    // Each share's containers get their namespace's directory, holding one socket.
    let (pipe_a, env_a) = share_edits(&node, "ua");
    let (pipe_b, _) = share_edits(&node, "ub");
    assert_eq!(pipe_a, mps.namespace_dir(&key, &na).display().to_string());
    assert_eq!(pipe_b, mps.namespace_dir(&key, &nb).display().to_string());
    assert!(env_a.contains(&"CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps".to_owned()));
    for pipe in [&pipe_a, &pipe_b] {
        let entries: Vec<String> = std::fs::read_dir(pipe)
            .expect("namespace dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            entries,
            ["control"],
            "only the namespace's socket in {pipe}"
        );
    }
    // A tenant that raises its variables gets its share's limits all the same.
    let line = attach(
        &log,
        &pipe_a,
        &[
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=81920M"),
        ],
    );
    assert_eq!(
        line,
        format!(
            "client attached namespace={na} pinned=0=81920M threads=100 ceiling pinned=20480M threads=30"
        )
    );
    let line = attach(&log, &pipe_b, &[]);
    assert!(
        line.contains(&format!("namespace={nb}"))
            && line.ends_with("ceiling pinned=8192M threads=100"),
        "{line}"
    );

    // The daemon dies under both shares: the periodic check starts it again, with both
    // namespaces, in the very directories the containers have mounted.
    let inode = |p: &str| std::fs::metadata(p).expect("dir").ino();
    let (ino_a, ino_b) = (inode(&pipe_a), inode(&pipe_b));
    let pid = text
        .lines()
        .find_map(|l| l.split("pid=").nth(1)?.split_whitespace().next())
        .expect("the daemon's pid")
        .to_owned();
    assert!(
        Command::new("kill")
            .args(["-9", &pid])
            .status()
            .expect("kill")
            .success()
    );
    for _ in 0..100 {
        if mps.liveness(&key).await != gpu_kubelet_plugin::mps::Liveness::Answering {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let restarted = c.restart_dead_daemons().await;
    assert!(!restarted.is_empty(), "the dead daemon was started again");
    assert_eq!(mps.namespaces(&key).await.expect("namespaces").len(), 2);
    assert_eq!((inode(&pipe_a), inode(&pipe_b)), (ino_a, ino_b));
    let line = attach(&log, &pipe_a, &[]);
    assert!(line.ends_with("ceiling pinned=20480M threads=30"), "{line}");

    // Unprepare a: its namespace and directory go; b's daemon stays.
    assert!(c.unprepare(vec![claim_ref("a", "ua")]).await["ua"].is_ok());
    let names: Vec<String> = mps
        .namespaces(&key)
        .await
        .expect("namespaces")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, std::slice::from_ref(&nb));
    assert!(!Path::new(&pipe_a).exists());
    let line = attach(&log, &pipe_b, &[]);
    assert!(line.contains(&format!("namespace={nb}")), "{line}");
    // The last share stops the daemon.
    assert!(c.unprepare(vec![claim_ref("b", "ub")]).await["ub"].is_ok());
    assert!(!node.dir.path().join("mps").join(&key).exists());
}

/// Start-up deletes the MPS v3 namespaces of claims it does not keep (a share whose record went
/// while its namespace stayed) and keeps the kept claims'.
#[tokio::test]
async fn start_up_deletes_the_namespaces_of_claims_it_does_not_keep() {
    let root = cgroup2_root();
    let node = Node::new(&root);
    let gpu = node.gpu(4);
    let cluster = Shared::default();
    cluster.put(share_claim(
        "kept",
        "uk",
        &gpu.name,
        &format!("{SHARE}03"),
        "10Gi",
    ));
    let c = node.controller(cluster.clone(), Some(node.kernel())).await;
    assert!(c.prepare(vec![claim_ref("kept", "uk")]).await["uk"].is_ok());
    let mps = mps_control(&node.dir.path().join("mps"));
    let key = gpu.raw.uuid.to_ascii_lowercase();
    mps.set_namespace(
        &key,
        &namespace_name("gone"),
        gpu_kubelet_plugin::mps::NamespaceLimits {
            pinned_mib: 1024,
            active_thread_percentage: None,
        },
    )
    .await
    .expect("an orphan's namespace");
    c.quiesce().await;
    drop(c);

    let (_again, report) = node.start(cluster, Some(node.kernel())).await;
    assert!(
        report
            .orphans_removed
            .contains(&format!("{key}/{}", namespace_name("gone"))),
        "{report:?}"
    );
    let names: Vec<String> = mps
        .namespaces(&key)
        .await
        .expect("namespaces")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, [namespace_name("uk")]);
    assert!(!mps.namespace_dir(&key, &namespace_name("gone")).exists());
}

/// The node moves to the `kernel` level (a drust upgrade on an r615 node) while a GPU's legacy
/// share daemon serves a running share: that share keeps its daemon and unprepares through it,
/// and a new share of the GPU is refused, naming why, until the old one is gone; then the GPU's
/// daemon starts again on MPS v3.
#[tokio::test]
async fn a_legacy_daemon_keeps_its_share_and_new_kernel_level_shares_wait_for_it() {
    let root = cgroup2_root();
    let node = Node::new(&root);
    let gpu = node.gpu(5);
    let cluster = Shared::default();
    cluster.put(share_claim(
        "old",
        "uo",
        &gpu.name,
        &format!("{SHARE}05"),
        "8Gi",
    ));
    cluster.put(share_claim(
        "new",
        "un",
        &gpu.name,
        &format!("{SHARE}06"),
        "8Gi",
    ));
    let before = node.controller(cluster.clone(), None).await;
    assert!(before.prepare(vec![claim_ref("old", "uo")]).await["uo"].is_ok());
    before.quiesce().await;
    drop(before);

    // Issue 41, defect 3: start-up revives the old share through its legacy daemon (it used
    // to fail with a protocol mismatch, retried forever), and the kubelet preparing it again
    // gets it.
    let (c, report) = node.start(cluster, Some(node.kernel())).await;
    assert!(report.failed.is_empty(), "{report:?}");
    let again = c.prepare(vec![claim_ref("old", "uo")]).await;
    assert!(again["uo"].is_ok(), "{again:?}");
    let refused = c.prepare(vec![claim_ref("new", "un")]).await;
    let err = refused["un"]
        .as_ref()
        .expect_err("a legacy daemon runs")
        .to_string();
    assert!(
        err.contains("runs Legacy MPS") && err.contains("needs V3"),
        "{err}"
    );
    assert!(c.unprepare(vec![claim_ref("old", "uo")]).await["uo"].is_ok());
    let key = gpu.raw.uuid.to_ascii_lowercase();
    assert!(
        !node.dir.path().join("mps").join(&key).exists(),
        "the legacy daemon stopped"
    );
    assert!(c.prepare(vec![claim_ref("new", "un")]).await["un"].is_ok());
    let log = std::fs::read_to_string(
        node.dir
            .path()
            .join("mps")
            .join(&key)
            .join("log/control.log"),
    )
    .expect("log");
    assert!(log.contains("options protocol=3"), "{log}");
    let names: Vec<String> = mps_control(&node.dir.path().join("mps"))
        .namespaces(&key)
        .await
        .expect("namespaces")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, [namespace_name("un")]);
}

/// Issue 41, defect 10: a rolling update runs a new plugin (a standby) beside the active old one,
/// and the new one detected the level by copying its hook over the old one's, whose specs then
/// ran the new binary with the old arguments. Each version's hook has a path of its own: the
/// new plugin's install leaves the old hook as it was, the old claim's spec keeps running the
/// old hook, and the old hook goes only once no kept spec names it.
#[tokio::test]
async fn a_new_plugins_hook_is_installed_beside_the_running_ones() {
    let root = cgroup2_root();
    let mut node = Node::new(&root);
    let gpu = node.gpu(2);
    let cluster = Shared::default();
    cluster.put(share_claim(
        "old",
        "uo",
        &gpu.name,
        &format!("{SHARE}07"),
        "8Gi",
    ));
    cluster.put(share_claim(
        "new",
        "un",
        &gpu.name,
        &format!("{SHARE}08"),
        "8Gi",
    ));
    let old = node.controller(cluster.clone(), Some(node.kernel())).await;
    assert!(old.prepare(vec![claim_ref("old", "uo")]).await["uo"].is_ok());
    let old_hook = PathBuf::from(node.hooks("uo")[0]["path"].as_str().expect("path"));
    let old_bytes = std::fs::read(&old_hook).expect("the old hook");

    // The next version's hook: another binary (here the same one with a byte appended).
    let next = node.dir.path().join("next-drust-cdi-hook");
    let mut bytes = old_bytes.clone();
    bytes.push(0);
    std::fs::write(&next, &bytes).expect("next hook");
    node.config.cdi_hook_binary = next;
    let standby = node.kernel();
    assert_eq!(
        std::fs::read(&old_hook).expect("the old hook"),
        old_bytes,
        "the standby's install left the running hook alone"
    );
    assert_ne!(standby.hook_path(), old_hook.as_path());
    old.quiesce().await;
    drop(old);

    // The new plugin takes over: the old claim's spec still names the old hook, which stays;
    // a new claim runs the new one.
    let c = node
        .controller(cluster.clone(), Some(standby.clone()))
        .await;
    assert!(old_hook.is_file(), "a kept spec names it");
    assert_eq!(node.hooks("uo")[0]["path"], old_hook.display().to_string());
    assert!(c.prepare(vec![claim_ref("new", "un")]).await["un"].is_ok());
    assert_eq!(
        node.hooks("un")[0]["path"],
        standby.hook_path().display().to_string()
    );
    // Once the old claim is gone, the next start removes the old hook.
    assert!(c.unprepare(vec![claim_ref("old", "uo")]).await["uo"].is_ok());
    c.quiesce().await;
    drop(c);
    let (_c, report) = node.start(cluster, Some(standby.clone())).await;
    assert!(!old_hook.exists(), "{report:?}");
    assert!(standby.hook_path().is_file());
}
