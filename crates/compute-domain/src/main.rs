//! drust-compute-domain-controller: keeps, per ComputeDomain, the channel claim template, the
//! IMEX daemons, the membership and the channel claims' binding conditions (see the library
//! docs for what it reads and writes). `crds <dir>` writes the two CRDs instead.

use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use compute_domain::crd::{DrustComputeDomain, NvidiaComputeDomain};
use kube::runtime::events::Reporter;

#[derive(Parser, Debug)]
#[command(name = "drust-compute-domain-controller", version, about)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Which ComputeDomain API to serve: NVIDIA's `resource.nvidia.com/v1beta1`
    /// (compatibility mode) or drust's `compute.drust.dev/v1alpha1`.
    #[arg(long, value_enum, default_value = "drust")]
    api: ApiKind,
    /// Kubeconfig file; default: in-cluster, else `KUBECONFIG` / `~/.kube/config`.
    #[arg(long, env = "KUBECONFIG_PATH")]
    kubeconfig: Option<std::path::PathBuf>,
    /// The controller's namespace: IMEX daemon Pods and their ConfigMaps go there.
    #[arg(long, env = "POD_NAMESPACE", default_value = "drust-system")]
    namespace: String,
    /// The daemon Pods' image (needs `chroot` and `sh`: the plugin's image).
    #[arg(
        long,
        env = "IMEX_DAEMON_IMAGE",
        default_value = "ghcr.io/drust/gpu-kubelet-plugin"
    )]
    image: String,
    /// The daemon Pods' image pull policy.
    #[arg(long, default_value = "IfNotPresent")]
    pull_policy: String,
    /// The driver root on the nodes (`/`, or `/run/nvidia/driver` with the GPU Operator).
    #[arg(long, default_value = "/")]
    host_driver_root: String,
    /// `nvidia-imex` inside the driver root.
    #[arg(long, default_value = "usr/bin/nvidia-imex")]
    imex_binary: String,
    /// `nvidia-imex-ctl` inside the driver root.
    #[arg(long, default_value = "usr/bin/nvidia-imex-ctl")]
    imex_ctl_binary: String,
    /// The daemon Pods' priority class (empty: none).
    #[arg(long, default_value = "")]
    priority_class: String,
    /// This binary's path inside the image (the daemon Pods run it: `imex-daemon`, and their
    /// readiness probe `imex-ready`).
    #[arg(long, default_value = "/usr/bin/drust-compute-domain-controller")]
    self_binary: String,
    /// Reconcile every domain again after this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    resync: Duration,
    /// The deadline of each API call.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    api_timeout: Duration,
    /// Domains reconciled at once.
    #[arg(long, default_value_t = 8)]
    concurrency: u16,
    /// The event's reporting instance (the chart sets the pod name).
    #[arg(long, env = "POD_NAME")]
    instance: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The IMEX daemon Pod's process: runs `chroot <driver-root> <imex> -c <config>`,
    /// restarts it when the nodes file changes, passes SIGTERM on, and exits with the daemon
    /// when it exits on its own.
    ImexDaemon {
        /// The driver root inside the Pod.
        #[arg(long)]
        driver_root: std::path::PathBuf,
        /// `nvidia-imex` inside the driver root.
        #[arg(long)]
        imex: String,
        /// The daemon's config inside the driver root.
        #[arg(long)]
        config: String,
        /// The nodes file inside the driver root.
        #[arg(long)]
        nodes_file: String,
        /// How often the nodes file is read.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        poll: Duration,
    },
    /// The IMEX daemon Pod's readiness probe: exit 0 when `chroot <driver-root> <ctl> -c
    /// <config> -q` answers exactly `READY`, else 1 with the answer on stderr.
    ImexReady {
        /// The driver root inside the Pod.
        #[arg(long)]
        driver_root: String,
        /// `nvidia-imex-ctl` inside the driver root.
        #[arg(long)]
        ctl: String,
        /// The daemon's config inside the driver root.
        #[arg(long)]
        config: String,
        /// How long the answer may take.
        #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Print the `imexd.cfg` the controller gives every daemon (`tests/gpu/imex.sh` runs a
    /// real `nvidia-imex` with it).
    ImexConfig,
    /// Write both CRDs (YAML) into a directory, as `deploy/crds/` holds them.
    Crds {
        /// The directory.
        dir: std::path::PathBuf,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum ApiKind {
    Nvidia,
    Drust,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    if let Some(Command::ImexDaemon {
        driver_root,
        imex,
        config,
        nodes_file,
        poll,
    }) = &args.command
    {
        let supervised = compute_domain::supervisor::Supervised {
            driver_root: driver_root.clone(),
            imex: imex.clone(),
            config: config.clone(),
            nodes_file: nodes_file.clone(),
            poll: *poll,
            stop_timeout: Duration::from_secs(4),
        };
        let restarts = supervised.run(terminated()).await?;
        tracing::info!(restarts, "stopped");
        return Ok(());
    }
    if let Some(Command::ImexReady {
        driver_root,
        ctl,
        config,
        timeout,
    }) = &args.command
    {
        return compute_domain::imex::probe_ready(driver_root, ctl, config, *timeout)
            .map_err(anyhow::Error::msg);
    }
    if let Some(Command::ImexConfig) = &args.command {
        print!("{}", compute_domain::imex::imexd_cfg());
        return Ok(());
    }
    if let Some(Command::Crds { dir }) = &args.command {
        for (file, yaml) in [
            (
                "resource.nvidia.com_computedomains.yaml",
                compute_domain::crd::crd_yaml::<NvidiaComputeDomain>()?,
            ),
            (
                "compute.drust.dev_computedomains.yaml",
                compute_domain::crd::crd_yaml::<DrustComputeDomain>()?,
            ),
        ] {
            let path = dir.join(file);
            std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    config.connect_timeout = Some(Duration::from_secs(30));
    let client = kube::Client::try_from(config)?;
    let settings = compute_domain::Settings {
        daemon: compute_domain::imex::DaemonSettings {
            namespace: args.namespace,
            image: args.image,
            pull_policy: args.pull_policy,
            host_driver_root: args.host_driver_root,
            imex_binary: args.imex_binary,
            imex_ctl_binary: args.imex_ctl_binary,
            priority_class: args.priority_class,
            self_binary: args.self_binary,
        },
        reporter: Reporter {
            controller: "drust-compute-domain-controller".into(),
            instance: args.instance,
        },
        field_manager: "drust-compute-domain-controller".into(),
        resync: args.resync,
        api_timeout: args.api_timeout,
        concurrency: args.concurrency,
    };
    let shutdown = terminated();
    match args.api {
        ApiKind::Nvidia => {
            compute_domain::run::<NvidiaComputeDomain>(client, settings, shutdown).await
        }
        ApiKind::Drust => {
            compute_domain::run::<DrustComputeDomain>(client, settings, shutdown).await
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
async fn terminated() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
