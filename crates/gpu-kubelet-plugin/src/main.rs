//! `gpu-kubelet-plugin`: the drust node plugin binary. Flags in, [`gpu_kubelet_plugin::run`] out.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use gpu_kubelet_plugin::{Backend, Config, DEFAULT_DRIVER_NAME, OutputFormat};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum MigStrategyArg {
    Existing,
    Partitionable,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum NamingArg {
    Drust,
    Nvidia,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Yaml,
    Json,
}

/// Publishes this node's NVIDIA GPUs as DRA ResourceSlices and prepares claims for the kubelet.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// DRA driver name (also the CDI vendor).
    #[arg(long, env = "DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME)]
    driver_name: String,
    /// This node's name (the pool name). Required unless --dry-run.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Use a fake GPU topology file instead of NVML (see examples/topologies/).
    #[arg(long)]
    fake_topology: Option<PathBuf>,
    /// Directory where the fake backend keeps state that outlives the process on real hardware
    /// (created MIG instances) and reads injected health events from (`events/*.json`).
    #[arg(long, requires = "fake_topology")]
    fake_state_dir: Option<PathBuf>,
    /// NVML library to load [default: libnvidia-ml.so.1 in the library directories under
    /// --driver-root, else on the dynamic loader's path].
    #[arg(long)]
    nvml_library: Option<PathBuf>,
    /// Directory of the DRA socket dra.sock [default: /var/lib/kubelet/plugins/<driver>].
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// The kubelet's plugin registration directory.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    registrar_dir: PathBuf,
    /// CDI spec directory.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_root: PathBuf,
    /// Checkpoint file, its first slot; the second is `<stem>.b.<ext>` beside it [default: <plugin-dir>/checkpoint.json].
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// sysfs root.
    #[arg(long, default_value = "/sys")]
    sysfs_root: PathBuf,
    /// Root under which device nodes (/dev/nvidia0, ...) are checked at prepare.
    #[arg(long, default_value = "/")]
    dev_root: PathBuf,
    /// The same root on the host, which CDI specs name for the container runtime
    /// [default: --dev-root].
    #[arg(long)]
    host_dev_root: Option<PathBuf>,
    /// Root of the NVIDIA driver's /proc tables (MIG capability minors).
    #[arg(long, default_value = "/proc")]
    proc_root: PathBuf,
    /// File holding this boot's ID.
    #[arg(long, default_value = "/proc/sys/kernel/random/boot_id")]
    boot_id_file: PathBuf,
    /// Deadline of one claim's prepare or unprepare, in seconds: 1 to 44, so that the plugin
    /// answers before the kubelet's own 45 s timeout gives up on the call.
    #[arg(long, default_value_t = 10, value_parser = claim_deadline)]
    claim_timeout_seconds: u64,
    /// How often to unprepare claims that vanished from the API server, in seconds (1 to
    /// 86400).
    #[arg(long, default_value_t = 60, value_parser = interval)]
    stale_claim_interval_seconds: u64,
    /// Deadline of one call to the API server, in seconds (1 to 44, within the kubelet's
    /// deadline for one call): a claim read, an event, a ResourceSlice or Pod write.
    #[arg(long, default_value_t = 5, value_parser = claim_deadline)]
    api_timeout_seconds: u64,
    /// How often each GPU's usage (utilization, memory, processes by pod) is sampled, in
    /// seconds (1 to 86400); 0 turns sampling, its metrics and idle detection off.
    #[arg(long, default_value_t = 10, value_parser = interval_or_off)]
    usage_interval_seconds: u64,
    /// A device whose SM utilization reaches this percent in a sample is busy (0 to 100).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=100))]
    idle_sm_percent: u32,
    /// A device whose memory activity reaches this percent in a sample is busy (0 to 100).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=100))]
    idle_memory_percent: u32,
    /// How long a claim must go without a busy sample to be idle, in seconds (1 to 86400).
    #[arg(long, default_value_t = 1800, value_parser = interval)]
    idle_window_seconds: u64,
    /// The host's `/proc`, where each GPU process's cgroup names its pod (default: `--proc-root`).
    #[arg(long)]
    usage_proc_root: Option<PathBuf>,
    /// Mark idle claims with a `GPUIdle` condition on their device status (once per idle
    /// spell, again every idle window while it lasts), which the explain controller relays to
    /// their pods as a Warning event.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    idle_events: bool,
    /// The kubelet's PodResources socket, asked which container holds each device (the
    /// `container` label); empty: not asked.
    #[arg(long, default_value = dra_kubelet::pod_resources::DEFAULT_SOCKET)]
    pod_resources_socket: String,
    /// How MIG-capable GPUs are published: `existing` MIG devices (GPUs with MIG disabled as
    /// whole GPUs), or `partitionable`: every possible MIG placement of GPUs with MIG enabled,
    /// consuming shared counters (GPUs with MIG disabled as whole GPUs).
    #[arg(long, value_enum, default_value = "existing")]
    mig_strategy: MigStrategyArg,
    /// How devices are named: `drust` (from PCI addresses: `gpu-0000-18-00-0`), or `nvidia`, as
    /// NVIDIA's DRA driver names them (`gpu-0`, `gpu-0-mig-1g10gb-19-0`, `Ada Lovelace`): NVIDIA
    /// compatibility mode, with `--driver-name gpu.nvidia.com`.
    #[arg(long, value_enum, default_value = "drust")]
    naming: NamingArg,
    /// How often to discover GPUs again and republish the pool when it changed, in seconds (1
    /// to 86400).
    #[arg(long, default_value_t = 60, value_parser = interval)]
    rediscovery_interval_seconds: u64,
    /// This instance's ID (set it to the pod UID): socket names then carry it, so two
    /// instances can serve side by side during a rolling update.
    #[arg(long, env = "POD_UID")]
    instance_id: Option<String>,
    /// Serve /metrics, /usage, /healthz and /readyz on this address (e.g. 0.0.0.0:9477); off
    /// if unset.
    #[arg(long)]
    http_address: Option<std::net::SocketAddr>,
    /// Answer /metrics and /usage only for callers with a bearer token that the API server
    /// authenticates (TokenReview) and authorizes (SubjectAccessReview: `get` on the
    /// non-resource URL, or for /usage?namespace=<ns> `list` on resourceclaims there). Needs
    /// `create` on tokenreviews and subjectaccessreviews. /healthz and /readyz stay open.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    http_auth: bool,
    /// Serve the HTTP endpoint over TLS (HTTPS), with the certificate in
    /// --http-tls-cert-file/--http-tls-key-file, or a self-signed one made at start for
    /// localhost and the node's name (its SHA-256 fingerprint is logged). Use it with
    /// --http-auth: callers send bearer tokens.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    http_tls: bool,
    /// PEM certificate chain (leaf first) for --http-tls, e.g. a kubernetes.io/tls Secret's
    /// tls.crt; read again every 60 s, so a renewed certificate is served without a restart.
    #[arg(long, requires = "http_tls_key_file")]
    http_tls_cert_file: Option<std::path::PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of --http-tls-cert-file.
    #[arg(long, requires = "http_tls_cert_file")]
    http_tls_key_file: Option<std::path::PathBuf>,
    /// Label this node with its GPUs' multi-node NVLink clique (`<clusterUuid>.<cliqueId>`)
    /// under this key (e.g. gpu.drust.dev/nvlink-clique), for gang topology constraints and
    /// node affinity; removed when no GPU is in a clique. Needs `patch` on nodes. Off if unset.
    #[arg(long, value_parser = label_key)]
    node_clique_label: Option<String>,
    /// Allow claims to configure GPU sharing (time-slicing, MPS).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    sharing: bool,
    /// Fractional GPUs: publish whole GPUs and existing MIG devices with consumable capacity
    /// (`memory` in GiB steps, `computePercent`), so independent claims each take a share,
    /// enforced by one MPS daemon per GPU. Needs the MPS control tool; without it the plugin
    /// publishes exclusive devices and says why.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    consumable_capacity: bool,
    /// Device metadata in containers (KEP-5304): for each request of a prepared claim, a JSON
    /// file naming its devices and their attributes (UUID, NVLink clique, PCI, NUMA node, ...),
    /// mounted read-only at `/var/run/kubernetes.io/dra-device-attributes/...` as upstream's
    /// reader expects.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    device_metadata: bool,
    /// How many IMEX channels to publish (imex-channel-0 .. N-1) for ComputeDomains [default:
    /// 1 where --proc-devices has a nvidia-caps-imex-channels line, else 0]. A node without
    /// that line publishes none, whatever this says (logged, not fatal). At most 2048, the
    /// channels NVIDIA's driver creates.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=2048))]
    imex_channels: Option<u32>,
    /// The kernel's device table, read for the IMEX channels' major number.
    #[arg(long, env = "ALT_PROC_DEVICES_PATH", default_value = "/proc/devices")]
    proc_devices: PathBuf,
    /// The MPS control tool (from the driver root).
    #[arg(long, default_value = "nvidia-cuda-mps-control")]
    mps_control_binary: PathBuf,
    /// Host directory for per-claim MPS pipe and log directories (mounted into containers).
    #[arg(long, default_value = "/run/drust/mps")]
    mps_root: PathBuf,
    /// The cgroup v2 root under which share containers' GPU memory limits are set (the
    /// `kernel` enforcement level; the NVIDIA driver needs cgroup v2 at /sys/fs/cgroup).
    #[arg(long, default_value = "/sys/fs/cgroup")]
    cgroup_root: PathBuf,
    /// The drust-cdi-hook binary to install for the `kernel` level (default: beside this one).
    #[arg(long)]
    cdi_hook_binary: Option<PathBuf>,
    /// How long an MPS control daemon may take to start answering, in seconds: at least 1 and
    /// less than --claim-timeout-seconds (the start is part of a prepare).
    #[arg(long, default_value_t = 5, value_parser = claim_deadline)]
    mps_start_timeout_seconds: u64,
    /// Run each MPS control daemon in its own Pod on this node, in this image (the plugin's
    /// own; it needs `chroot`), so daemons and their clients outlive plugin restarts and
    /// rolling updates. Unset: daemons are the plugin's child processes and die with it.
    #[arg(long)]
    mps_daemon_image: Option<String>,
    /// `imagePullPolicy` of the MPS daemon Pods.
    #[arg(long, default_value = "IfNotPresent", value_parser = ["Always", "IfNotPresent", "Never"])]
    mps_daemon_image_pull_policy: String,
    /// Namespace of the MPS daemon Pods (the plugin's own).
    #[arg(long, env = "POD_NAMESPACE")]
    mps_daemon_namespace: Option<String>,
    /// `priorityClassName` of the MPS daemon Pods.
    #[arg(long)]
    mps_daemon_priority_class: Option<String>,
    /// The plugin's DaemonSet (in the daemon Pods' namespace): each daemon Pod names it as its
    /// owner, so deleting it (uninstalling the chart) deletes the daemons. Unset: no owner.
    #[arg(long)]
    mps_daemon_owner: Option<String>,
    /// Root of the NVIDIA driver installation as this process sees it: its libraries,
    /// binaries, firmware and sockets go into every claim's CDI spec.
    #[arg(long, default_value = "/")]
    driver_root: PathBuf,
    /// The same directory on the host, which CDI specs name [default: --driver-root].
    #[arg(long)]
    host_driver_root: Option<PathBuf>,
    /// `nvidia-cdi-hook` as a host path [default: usr/bin/nvidia-cdi-hook or
    /// usr/local/nvidia/toolkit/nvidia-cdi-hook under the driver root, when present].
    #[arg(long)]
    nvidia_cdi_hook: Option<PathBuf>,
    /// Watch GPU health events and publish unhealthy devices as ResourceSlice device taints.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    health_monitoring: bool,
    /// Print the ResourceSlices this node would publish and exit; contacts no API server.
    #[arg(long)]
    dry_run: bool,
    /// With --dry-run: also write what the GPU backend answered (NVML's raw values) to this
    /// file, as a topology that --fake-topology reads: a node captured for tests and dractl.
    #[arg(long, requires = "dry_run", value_name = "FILE")]
    dump_topology: Option<PathBuf>,
    /// Output format of --dry-run.
    #[arg(short = 'o', long, value_enum, default_value = "yaml")]
    output: Format,
}

impl Args {
    fn into_config(self) -> anyhow::Result<Config> {
        let node_name = match (self.node_name, self.dry_run) {
            (Some(n), _) => n,
            (None, true) => "dry-run-node".to_owned(),
            (None, false) => anyhow::bail!("--node-name (or NODE_NAME) is required"),
        };
        anyhow::ensure!(
            self.mps_start_timeout_seconds < self.claim_timeout_seconds,
            "--mps-start-timeout-seconds ({} s) must be less than --claim-timeout-seconds ({} s): \
             an MPS daemon starts within a claim's prepare",
            self.mps_start_timeout_seconds,
            self.claim_timeout_seconds
        );
        let backend = match self.fake_topology {
            Some(topology) => Backend::Fake {
                topology,
                state_dir: self.fake_state_dir,
            },
            None => Backend::Nvml {
                library: self.nvml_library.or_else(|| {
                    gpu_kubelet_plugin::driver_files::find_library(
                        &self.driver_root,
                        "libnvidia-ml.so.1",
                    )
                }),
            },
        };
        let mut config = Config::new(&self.driver_name, &node_name, backend);
        if let Some(dir) = self.plugin_dir {
            config.checkpoint_path = dir.join("checkpoint.json");
            config.sockets.plugin_dir = dir;
        }
        if let Some(path) = self.checkpoint {
            config.checkpoint_path = path;
        }
        config.sockets.registrar_dir = self.registrar_dir;
        config.cdi_root = self.cdi_root;
        config.sysfs_root = self.sysfs_root;
        config.dev_root = self.dev_root;
        config.host_dev_root = self.host_dev_root;
        config.proc_root = self.proc_root;
        config.boot_id_path = self.boot_id_file;
        config.claim_timeout = std::time::Duration::from_secs(self.claim_timeout_seconds);
        config.stale_claim_interval =
            std::time::Duration::from_secs(self.stale_claim_interval_seconds);
        config.api_timeout = std::time::Duration::from_secs(self.api_timeout_seconds);
        config.usage =
            (self.usage_interval_seconds > 0).then(|| gpu_kubelet_plugin::usage::UsageConfig {
                interval: std::time::Duration::from_secs(self.usage_interval_seconds),
                idle: gpu_kubelet_plugin::usage::IdleThresholds {
                    sm_percent: self.idle_sm_percent,
                    memory_percent: self.idle_memory_percent,
                    window: std::time::Duration::from_secs(self.idle_window_seconds),
                },
                proc_root: self
                    .usage_proc_root
                    .clone()
                    .unwrap_or_else(|| config.proc_root.clone()),
                idle_events: self.idle_events,
                pod_resources_socket: (!self.pod_resources_socket.is_empty())
                    .then(|| PathBuf::from(&self.pod_resources_socket)),
            });
        config.kubeconfig = self.kubeconfig;
        config.mig_strategy = match self.mig_strategy {
            MigStrategyArg::Existing => gpu_inventory::MigStrategy::Existing,
            MigStrategyArg::Partitionable => gpu_inventory::MigStrategy::Partitionable,
        };
        config.naming = match self.naming {
            NamingArg::Drust => gpu_inventory::Naming::Drust,
            NamingArg::Nvidia => gpu_inventory::Naming::Nvidia,
        };
        config.rediscovery_interval =
            std::time::Duration::from_secs(self.rediscovery_interval_seconds);
        config.dump_topology = self.dump_topology;
        config.dry_run = self.dry_run.then_some(match self.output {
            Format::Yaml => OutputFormat::Yaml,
            Format::Json => OutputFormat::Json,
        });
        config.instance_id = self.instance_id.filter(|id| !id.is_empty());

        config.http_address = self.http_address;
        config.http_auth = self.http_auth;
        config.node_clique_label = self.node_clique_label.filter(|k| !k.is_empty());
        anyhow::ensure!(
            self.http_tls || self.http_tls_cert_file.is_none(),
            "--http-tls-cert-file and --http-tls-key-file need --http-tls=true"
        );
        config.http_tls = self
            .http_tls
            .then(|| {
                gpu_kubelet_plugin::http::tls::TlsSource::from_flags(
                    self.http_tls_cert_file,
                    self.http_tls_key_file,
                    &config.node_name,
                )
            })
            .transpose()?;
        config.sharing = self.sharing;
        config.health_monitoring = self.health_monitoring;
        config.consumable_capacity = self.consumable_capacity;
        config.device_metadata = self.device_metadata;
        config.imex_channels = self.imex_channels;
        config.proc_devices = self.proc_devices;
        config.mps_control_binary = self.mps_control_binary;
        config.mps_root = self.mps_root;
        config.cgroup_root = self.cgroup_root;
        if let Some(hook) = self.cdi_hook_binary {
            config.cdi_hook_binary = hook;
        }
        config.mps_start_timeout = std::time::Duration::from_secs(self.mps_start_timeout_seconds);
        config.mps_daemon_pods = match (
            self.mps_daemon_image.filter(|i| !i.is_empty()),
            self.mps_daemon_namespace,
        ) {
            (None, _) => None,
            (Some(_), None) => anyhow::bail!(
                "--mps-daemon-image needs --mps-daemon-namespace (or POD_NAMESPACE): the \
                 namespace the daemon Pods are created in"
            ),
            (Some(image), Some(namespace)) => Some(gpu_kubelet_plugin::config::MpsDaemonPods {
                image,
                pull_policy: self.mps_daemon_image_pull_policy,
                namespace,
                priority_class: self.mps_daemon_priority_class.filter(|p| !p.is_empty()),
                owner: self.mps_daemon_owner.filter(|o| !o.is_empty()),
            }),
        };
        config.driver_root = gpu_kubelet_plugin::driver_files::DriverRoot {
            host_root: self
                .host_driver_root
                .unwrap_or_else(|| self.driver_root.clone()),
            root: self.driver_root,
            hook: self.nvidia_cdi_hook,
        };
        Ok(config)
    }
}

/// The kubelet's timeout for a NodePrepareResources or NodeUnprepareResources call, in seconds
/// (`pkg/kubelet/cm/dra/plugin`, 45 s in v1.36).
const KUBELET_CALL_TIMEOUT_SECONDS: u64 = 45;

/// A deadline within one kubelet call: 1 to 44 s.
fn claim_deadline(value: &str) -> Result<u64, String> {
    let seconds = seconds(value)?;
    if (1..KUBELET_CALL_TIMEOUT_SECONDS).contains(&seconds) {
        Ok(seconds)
    } else {
        Err(format!(
            "{seconds} s: must be 1 to {} s, within the kubelet's {KUBELET_CALL_TIMEOUT_SECONDS} s \
             timeout for one call",
            KUBELET_CALL_TIMEOUT_SECONDS - 1
        ))
    }
}

/// A period of background work: 1 s to a day.
fn interval(value: &str) -> Result<u64, String> {
    let seconds = seconds(value)?;
    if (1..=86_400).contains(&seconds) {
        Ok(seconds)
    } else {
        Err(format!("{seconds} s: must be 1 to 86400 s"))
    }
}

fn interval_or_off(value: &str) -> Result<u64, String> {
    match seconds(value)? {
        0 => Ok(0),
        _ => interval(value),
    }
}

/// A label key (`IsQualifiedName`, `k8s.io/apimachinery` `pkg/util/validation`): an optional
/// DNS subdomain prefix and `/`, then a name of at most 63 alphanumerics, `-`, `_`, `.`,
/// beginning and ending with an alphanumeric.
fn label_key(value: &str) -> Result<String, String> {
    let (prefix, name) = value
        .rsplit_once('/')
        .map_or((None, value), |(p, n)| (Some(p), n));
    let name_ok = !name.is_empty() && gpu_kubelet_plugin::node_label::label_value(name);
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            })
    });
    if value.is_empty() || (name_ok && prefix_ok) {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "{value:?} is not a label key: [prefix/]name, the prefix a lowercase DNS subdomain, \
             the name at most 63 alphanumerics, '-', '_', '.', alphanumeric at both ends"
        ))
    }
}

fn seconds(value: &str) -> Result<u64, String> {
    value
        .parse()
        .map_err(|_| format!("{value:?} is not a whole number of seconds"))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {},
                _ = tokio::signal::ctrl_c() => {},
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = args.into_config()?;
    // Everything we create (sockets, state files, directories) is for root alone. Each path is
    // also given its mode explicitly; the umask closes the window between a socket's bind and
    // its chmod.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(gpu_kubelet_plugin::run(config, shutdown_signal()));
    // `run` returns after the claim work it started has ended (hardware actions included). What
    // may still block a thread is the health monitor's wait for the next GPU event, which only
    // ends on its own timeout; exit without waiting for it.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    result?;
    Ok(())
}
