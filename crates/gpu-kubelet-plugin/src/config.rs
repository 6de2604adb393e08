//! The node plugin's configuration: every host path is a field, defaulting to the kubelet's.

use std::path::PathBuf;
use std::time::Duration;

use dra_kubelet::PluginSockets;

/// The default DRA driver name.
pub const DEFAULT_DRIVER_NAME: &str = "gpu.drust.dev";

/// The hook binary's file name, beside the plugin's own binary and where it is installed
/// (the `kernel` level's hook, `memory_limits`).
pub const HOOK_BINARY: &str = "drust-cdi-hook";

/// The annotation keys (namespace, name, UID) that the plugin's CDI specs named their claim
/// with before the keys became the driver's own (`<driver>/claim-*`, `dra_plugin::cdi`): still
/// read, so that specs on disk written by an earlier build identify their claims.
pub const LEGACY_CLAIM_ANNOTATIONS: [&str; 3] = [
    "claim.drust.dev/namespace",
    "claim.drust.dev/name",
    "claim.drust.dev/uid",
];

/// Where the driver requires cgroup v2, and the default `--cgroup-root`
/// (the `kernel` level's memory limits, `memory_limits`).
pub const DEFAULT_CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Default deadline of one prepare or unprepare, well below the kubelet's 45 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Default deadline of one API server call: half the default claim deadline
/// ([`DEFAULT_TIMEOUT`]), so a prepare that reads its claim still has time for its devices.
pub const DEFAULT_API_TIMEOUT: Duration = Duration::from_secs(5);

/// When a claim counts as idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleThresholds {
    /// A device whose SM utilization (percent, 0..=100) reaches this is busy.
    pub sm_percent: u32,
    /// A device whose memory activity (percent of time memory was read or written) reaches this
    /// is busy.
    pub memory_percent: u32,
    /// How long a claim must go without a busy sample to be idle.
    pub window: Duration,
}

impl Default for IdleThresholds {
    /// 5 % SM, 5 % memory activity, 30 minutes.
    fn default() -> Self {
        Self {
            sm_percent: 5,
            memory_percent: 5,
            window: Duration::from_secs(30 * 60),
        }
    }
}

/// How often GPUs' NVLink fabric answers are polled between rediscoveries (`fabric`): one
/// NVML call per GPU (`nvmlDeviceGetGpuFabricInfoV`; NVML has no event for fabric changes), so a
/// change is published without waiting for the rediscovery interval. GPUs without a fabric
/// (NOT_SUPPORTED) are not polled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FabricWatch {
    /// While any GPU's registration is NOT_STARTED or IN_PROGRESS, or its fabric call fails
    /// (default 5 s): Fabric Manager registers a tray's GPUs within seconds of starting (or of a
    /// partition's activation), and until then the GPUs carry no clique and are tainted, so a
    /// claim that needs the clique waits at most this long (plus one publish) once registration
    /// completes.
    pub pending: Duration,
    /// Otherwise, while any GPU is in a fabric (default 15 s): health mask and summary changes
    /// (a route recovering, bandwidth degraded) and re-partitioning are published within this.
    pub settled: Duration,
}

impl Default for FabricWatch {
    /// 5 s while registration is pending, 15 s once settled.
    fn default() -> Self {
        Self {
            pending: Duration::from_secs(5),
            settled: Duration::from_secs(15),
        }
    }
}

/// How usage is sampled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageConfig {
    /// Time between two samples (default 10 s).
    pub interval: Duration,
    /// When a claim is idle.
    pub idle: IdleThresholds,
    /// The host's `/proc` as the plugin sees it (processes' cgroups).
    pub proc_root: PathBuf,
    /// Mark idle claims with a `GPUIdle` condition on their device status (`usage::idle_status`).
    pub idle_events: bool,
    /// The kubelet's PodResources socket, asked at each sample which container holds each
    /// device (container names); `None`: not asked, names left out. The binary's default is
    /// [`dra_kubelet::pod_resources::DEFAULT_SOCKET`].
    pub pod_resources_socket: Option<PathBuf>,
}

impl Default for UsageConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            idle: IdleThresholds::default(),
            proc_root: PathBuf::from("/proc"),
            idle_events: true,
            pod_resources_socket: None,
        }
    }
}

/// Where the driver lives, as the plugin sees it and as the host does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverRoot {
    /// The driver root as the plugin reads it (`/driver-root` in the chart, `/` on a host).
    pub root: PathBuf,
    /// The same directory on the host, what CDI specs name (`/`, or `/run/nvidia/driver` for
    /// the GPU Operator's driver container).
    pub host_root: PathBuf,
    /// `nvidia-cdi-hook` as a host path, when set explicitly; otherwise `driver_files::HOOK_PATHS` under
    /// the root.
    pub hook: Option<PathBuf>,
}

/// Where GPUs come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// NVML, from this library (`None`: `libnvidia-ml.so.1` on the library path).
    Nvml {
        /// Library to load.
        library: Option<PathBuf>,
    },
    /// A fake topology file (see `examples/topologies/`).
    Fake {
        /// The topology file.
        topology: PathBuf,
        /// Where the fake keeps what outlives the process on real hardware (created MIG
        /// instances) and where tests drop injected health events; `None`: in memory only.
        state_dir: Option<PathBuf>,
    },
}

/// How `--dry-run` prints slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    /// Multi-document YAML, one ResourceSlice per document.
    #[default]
    Yaml,
    /// A JSON array of ResourceSlice objects.
    Json,
}

/// Everything `run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// DRA driver name, e.g. `gpu.drust.dev`; also the CDI vendor.
    pub driver_name: String,
    /// This node's name; the pool's name.
    pub node_name: String,
    /// Kubeconfig file; in-cluster configuration when `None`.
    pub kubeconfig: Option<PathBuf>,
    /// The GPU backend.
    pub backend: Backend,
    /// sysfs root, for values NVML lacks (default `/sys`).
    pub sysfs_root: PathBuf,
    /// Kubelet socket locations.
    pub sockets: PluginSockets,
    /// The CDI spec directory (default `/var/run/cdi`).
    pub cdi_root: PathBuf,
    /// The checkpoint's first slot file (default `<plugin-dir>/checkpoint.json`; the second slot is
    /// beside it, see `checkpoint::slot_paths`).
    pub checkpoint_path: PathBuf,
    /// Root under which device nodes (`/dev/nvidia0`, ...) are checked at prepare (default `/`).
    pub dev_root: PathBuf,
    /// The same root on the host, which CDI specs name (default: `dev_root`).
    pub host_dev_root: Option<PathBuf>,
    /// Root of the driver's `/proc` tables (MIG capability minors; default `/proc`).
    pub proc_root: PathBuf,
    /// This boot's ID (default `/proc/sys/kernel/random/boot_id`).
    pub boot_id_path: PathBuf,
    /// Deadline of one claim's prepare or unprepare.
    pub claim_timeout: Duration,
    /// How often claims that vanished from the API server are unprepared.
    pub stale_claim_interval: Duration,
    /// Deadline of one API server call (a claim read, an event, a slice or Pod write), and the
    /// client's connect, read and write timeouts ([`DEFAULT_API_TIMEOUT`]).
    pub api_timeout: Duration,
    /// GPU usage sampling, idle claims (`usage`); `None`: off.
    pub usage: Option<UsageConfig>,
    /// How MIG-capable GPUs are published (existing MIG devices, or partitionable placements).
    pub mig_strategy: gpu_inventory::MigStrategy,
    /// How devices are named: drust's scheme, or NVIDIA's DRA driver's (compatibility mode).
    pub naming: gpu_inventory::Naming,
    /// How often GPUs are discovered again and the pool republished when it changed.
    pub rediscovery_interval: Duration,
    /// How often GPUs' NVLink fabric answers are polled between rediscoveries; a change
    /// triggers a rediscovery at once.
    pub fabric_watch: FabricWatch,
    /// Print the slices and exit, contacting no API server.
    pub dry_run: Option<OutputFormat>,
    /// With `dry_run`: also write the backend's answers, as a topology file (`--fake-topology`
    /// reads it), to this path.
    pub dump_topology: Option<PathBuf>,
    /// This instance's ID (the pod UID under a DaemonSet); when set, socket names carry it so
    /// two instances can run side by side during a rolling update.
    pub instance_id: Option<String>,
    /// Address of the HTTP endpoint serving `/metrics`, `/healthz` and `/readyz`; `None`: off.
    pub http_address: Option<std::net::SocketAddr>,
    /// Whether `/metrics` and `/usage` answer only callers whose bearer token the API server
    /// authenticates (TokenReview) and authorizes (SubjectAccessReview); off: anyone who
    /// reaches `http_address`. Off by default for local use; the chart turns it on.
    pub http_auth: bool,
    /// TLS on the HTTP endpoint, with the certificate's source; `None`: plain HTTP. The chart
    /// turns it on with `http_auth`, so tokens never cross the pod network in the clear.
    pub http_tls: Option<TlsSource>,
    /// The Node label that names this node's multi-node NVLink clique
    /// (`node_label`); `None`: the node is not labelled.
    pub node_clique_label: Option<String>,
    /// Whether claims may configure GPU sharing (time-slicing, MPS).
    pub sharing: bool,
    /// Whether GPU health events are watched and published as device taints.
    pub health_monitoring: bool,
    /// Fractional GPUs: publish whole GPUs and existing MIG devices for consumable capacity
    /// (KEP-5075, [`gpu_inventory::shares`]) and prepare each share under the GPU's MPS daemon.
    /// Honoured only where the MPS control tool is found (limits nobody can enforce are never
    /// handed out).
    pub consumable_capacity: bool,
    /// Write device metadata files (KEP-5304) and mount them into containers
    /// (`--device-metadata`).
    pub device_metadata: bool,
    /// How many IMEX channels to publish (`imex-channel-0..N`, [`gpu_inventory::imex`]);
    /// `None`: one where `proc_devices` has a `nvidia-caps-imex-channels` line, none otherwise.
    pub imex_channels: Option<u32>,
    /// The kernel's device table the IMEX channels' major is read from (default
    /// `/proc/devices`; NVIDIA's driver takes `ALT_PROC_DEVICES_PATH` for the same).
    pub proc_devices: PathBuf,
    /// The MPS control tool (default `nvidia-cuda-mps-control`, found on `PATH`).
    pub mps_control_binary: PathBuf,
    /// Host directory of the per-claim MPS pipe and log directories (default `/run/drust/mps`);
    /// the container runtime mounts from it, so inside a container it must be the host path.
    pub mps_root: PathBuf,
    /// How long an MPS daemon may take to start answering.
    pub mps_start_timeout: Duration,
    /// Run each MPS daemon in its own Pod on this node (so it outlives the plugin); `None`: as
    /// the plugin's child process.
    pub mps_daemon_pods: Option<MpsDaemonPods>,
    /// Where the NVIDIA driver's files are read and what host path CDI specs name them by
    /// (default: `/` for both, no explicit hook): see `driver_files`.
    pub driver_root: DriverRoot,
    /// The cgroup v2 root the `kernel` level's memory limits are set under (default
    /// `/sys/fs/cgroup`, which the driver requires): see `memory_limits`.
    pub cgroup_root: PathBuf,
    /// The `drust-cdi-hook` binary shipped with the plugin, installed into `<plugin dir>/bin/`
    /// under its digest for the `kernel` level (default: beside the plugin's own binary).
    pub cdi_hook_binary: PathBuf,
}

impl Config {
    /// Defaults for `driver_name` on `node_name`, with the fake topology or NVML backend.
    pub fn new(driver_name: &str, node_name: &str, backend: Backend) -> Self {
        let sockets = PluginSockets::kubelet_defaults(driver_name);
        Self {
            driver_name: driver_name.to_owned(),
            node_name: node_name.to_owned(),
            kubeconfig: None,
            backend,
            sysfs_root: PathBuf::from("/sys"),
            checkpoint_path: sockets.plugin_dir.join("checkpoint.json"),
            sockets,
            cdi_root: PathBuf::from("/var/run/cdi"),
            dev_root: PathBuf::from("/"),
            host_dev_root: None,
            proc_root: PathBuf::from("/proc"),
            boot_id_path: PathBuf::from("/proc/sys/kernel/random/boot_id"),
            claim_timeout: DEFAULT_TIMEOUT,
            stale_claim_interval: Duration::from_secs(60),
            api_timeout: DEFAULT_API_TIMEOUT,
            usage: Some(UsageConfig::default()),
            mig_strategy: gpu_inventory::MigStrategy::Existing,
            naming: gpu_inventory::Naming::Drust,
            rediscovery_interval: Duration::from_secs(60),
            fabric_watch: FabricWatch::default(),
            dry_run: None,
            dump_topology: None,
            instance_id: None,
            http_address: None,
            http_auth: false,
            http_tls: None,
            node_clique_label: None,
            sharing: true,
            health_monitoring: true,
            consumable_capacity: false,
            device_metadata: true,
            imex_channels: None,
            proc_devices: PathBuf::from("/proc/devices"),
            mps_control_binary: PathBuf::from("nvidia-cuda-mps-control"),
            mps_root: PathBuf::from("/run/drust/mps"),
            mps_start_timeout: Duration::from_secs(5),
            mps_daemon_pods: None,
            driver_root: DriverRoot {
                root: PathBuf::from("/"),
                host_root: PathBuf::from("/"),
                hook: None,
            },
            cgroup_root: PathBuf::from(DEFAULT_CGROUP_ROOT),
            cdi_hook_binary: std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(|d| d.join(HOOK_BINARY)))
                .unwrap_or_else(|| PathBuf::from(HOOK_BINARY)),
        }
    }
}

/// How MPS daemon Pods are made (`mps::DaemonPods` without what the plugin knows
/// itself: the client, the node, the driver root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDaemonPods {
    /// Image with `chroot`: the plugin's own.
    pub image: String,
    /// Its `imagePullPolicy`.
    pub pull_policy: String,
    /// Namespace of the Pods: the plugin's own.
    pub namespace: String,
    /// `priorityClassName` of the Pods, if any.
    pub priority_class: Option<String>,
    /// The plugin's DaemonSet (in `namespace`), the Pods' owner, if any.
    pub owner: Option<String>,
}

/// Where the HTTP endpoint's TLS certificate comes from (`--http-tls`, served by `http::tls`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsSource {
    /// A certificate made at start for these DNS names and IP addresses.
    SelfSigned {
        /// Subject alternative names (DNS names or IP addresses).
        names: Vec<String>,
    },
    /// PEM files, read again every `http::tls::RELOAD_INTERVAL`.
    Files {
        /// The certificate chain, leaf first.
        cert: PathBuf,
        /// The private key of the leaf.
        key: PathBuf,
    },
}

impl TlsSource {
    /// The source for `--http-tls-cert-file` and `--http-tls-key-file`: both files, or
    /// neither (self-signed for `node_name`).
    ///
    /// # Errors
    /// [`HalfTlsPair`] when only one of the two is given.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        node_name: &str,
    ) -> Result<Self, HalfTlsPair> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Self::Files { cert, key }),
            (None, None) => {
                let mut names = vec!["localhost".to_owned(), "127.0.0.1".into(), "::1".into()];
                if !node_name.is_empty() {
                    names.push(node_name.to_owned());
                }
                Ok(Self::SelfSigned { names })
            }
            _ => Err(HalfTlsPair),
        }
    }
}

/// One of `--http-tls-cert-file` and `--http-tls-key-file` without the other.
#[derive(Debug, thiserror::Error)]
#[error("--http-tls-cert-file and --http-tls-key-file go together: give both or neither")]
pub struct HalfTlsPair;
