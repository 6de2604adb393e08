//! drust-explain-controller: puts why a pending pod's DRA claims fit on no node on the pod, as a
//! Warning event (see the library docs for what it reads and writes).

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use kube::runtime::events::Reporter;

#[derive(Parser, Debug)]
#[command(name = "drust-explain-controller", version, about)]
struct Args {
    /// Kubeconfig file; default: in-cluster, else `KUBECONFIG` / `~/.kube/config`.
    #[arg(long, env = "KUBECONFIG_PATH")]
    kubeconfig: Option<std::path::PathBuf>,
    /// Explain a pending pod again after this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    resync: Duration,
    /// Publish an unchanged explanation again after this long.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    republish_after: Duration,
    /// Events per second, over all pods.
    #[arg(long, default_value_t = 5.0)]
    events_per_second: f64,
    /// Events allowed at once before the rate applies.
    #[arg(long, default_value_t = 20)]
    event_burst: u32,
    /// The event's reporting instance (the chart sets the pod name).
    #[arg(long, env = "POD_NAME")]
    instance: Option<String>,
    /// Serve /metrics, /healthz and /readyz on this address (e.g. 0.0.0.0:9478); off if unset.
    #[arg(long)]
    http_address: Option<std::net::SocketAddr>,
    /// Relay this DRA driver's `GPUIdle` device-status conditions to the claims' pods as
    /// Warning events (repeatable; none: no relay).
    #[arg(long)]
    idle_driver: Vec<String>,
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
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    // Every call has a deadline; watches are long-lived and use their own timeouts.
    config.connect_timeout = Some(Duration::from_secs(30));
    let client = kube::Client::try_from(config)?;
    let settings = explain_controller::Settings {
        resync: args.resync,
        republish_after: args.republish_after,
        events_per_second: args.events_per_second,
        burst: args.event_burst,
        idle_drivers: args.idle_driver,
        reporter: Reporter {
            controller: "drust-explain-controller".into(),
            instance: args.instance,
        },
    };
    let shutdown = async {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    let status = std::sync::Arc::new(explain_controller::Status::default());
    // Served before the caches fill, so the readiness probe can say why it is not ready.
    let http = match args.http_address {
        Some(address) => Some(
            explain_controller::status::serve(address, std::sync::Arc::clone(&status))
                .await
                .with_context(|| format!("binding the HTTP endpoint {address}"))?,
        ),
        None => None,
    };
    explain_controller::run(client, settings, std::sync::Arc::clone(&status), shutdown).await?;
    if let Some(http) = http {
        http.abort();
    }
    tracing::info!(
        reconciles = status.reconciles.get(),
        published = status.published.get(),
        deduplicated = status.deduplicated.get(),
        "stopped"
    );
    Ok(())
}
