//! The plugin's run from start to stop, wiring the parts together: discovery, the kubelet
//! server and the HTTP endpoint, the take-over, the active instance's tasks, and the shutdown
//! that unregisters, stops the tasks and hands the lock over.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use dra_kubelet::PluginServer;
use tokio::sync::watch;
use tracing::info;

use crate::active::{AbortOnDrop, Active, Health};
use crate::claims::KubeCluster;
use crate::client::kube_client;
use crate::config::Config;
use crate::discovery::{open_backend, rediscover};
use crate::dry_run;
use crate::error::Error;
use crate::http;
use crate::instance::{self, Gate, Role};
use crate::metrics::Metrics;
use crate::publishing::Publishing;
use crate::state::secure_state;
use crate::takeover::{Found, take_over, wait_for_lock};

/// Runs the plugin until `shutdown` completes: discover, serve the kubelet, and once this
/// instance holds the active lock, recover the claims, publish the slices and prepare claims.
/// With `config.dry_run` set, prints the slices to stdout and returns.
///
/// Two instances may run side by side during a rolling update; see [`crate::instance`] for how
/// they hand over.
///
/// # Errors
/// [`Error`] for any start-up failure or a failing server.
pub async fn run(
    mut config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    if let Some(id) = &config.instance_id
        && !dra_kubelet::valid_instance_id(id)
    {
        return Err(Error::InstanceId(id.clone()));
    }
    config.sockets.instance_id = config.instance_id.clone();
    let backend = open_backend(&config)?;
    let inventory = rediscover(backend.as_ref(), config.naming)?;
    let mut publishing = Publishing::of(&config).await;
    let kernel_memory = publishing.detect_kernel_memory(&config, &backend).await;
    let pool = publishing.pool(&inventory);
    info!(gpus = inventory.gpus.len(), devices = pool.devices.len(), node = %config.node_name,
        "discovered GPUs");
    if let Some(format) = config.dry_run {
        return dry_run::print(&config, backend.as_ref(), &inventory, &pool, format);
    }
    let client = kube_client(&config).await?;
    secure_state(&config)?;
    if config.consumable_capacity && !publishing.shares {
        // Said where an operator looks (`kubectl describe node`), not only in the log.
        let cluster = KubeCluster::new(client.clone(), &config.driver_name, &config.node_name)
            .with_timeout(config.api_timeout);
        let message = format!(
            "fractional GPUs are on (--consumable-capacity) but the MPS control tool {} is not \
             found: shares could not be enforced, so this node's GPUs are published for \
             exclusive use only",
            config.mps_control_binary.display()
        );
        tokio::spawn(async move {
            cluster
                .warning("SharesNotPublished", "Publish", &message)
                .await;
        });
    }

    // The kubelet side first: it answers (and registers) while another instance is active.
    let metrics = Arc::new(Metrics::new());
    let lock_path = config.sockets.plugin_dir.join(instance::LOCK_FILE);
    let (activation, gate) = Gate::new(
        instance::handover_wait(config.claim_timeout),
        lock_path.clone(),
        instance::GateMetrics(Arc::clone(&metrics)),
    );
    let mut server = PluginServer::new(
        config.driver_name.clone(),
        config.sockets.clone(),
        Arc::new(gate),
    )
    .with_observer(Arc::clone(&metrics) as Arc<dyn dra_kubelet::CallObserver>);
    // Device health for the kubelet: advertised from the start, fed once this instance is
    // active (its monitor watches the GPUs).
    let device_health = watch::Sender::new(Vec::<dra_kubelet::DeviceHealth>::new());
    if config.health_monitoring {
        server = server.with_health(device_health.subscribe());
    }
    let role = watch::Sender::new(Role::Standby);
    let http = match config.http_address {
        Some(address) => {
            let listener = http::bind(address).await?;
            let tls = match config.http_tls.clone() {
                Some(source) => Some(Arc::new(
                    http::tls::ServerTls::new(source)
                        .await
                        .map_err(http::HttpError::from)?,
                )),
                None => None,
            };
            let probes = Arc::new(http::Probes {
                metrics: Arc::clone(&metrics),
                sockets: config.sockets.clone(),
                driver_name: config.driver_name.clone(),
                serving: server.serving(),
                registration: server.registration_status(),
                role: role.subscribe(),
                access: config.http_auth.then(|| {
                    http::auth::Gate::new(http::auth::ApiServerReviews::new(
                        client.clone(),
                        config.api_timeout,
                    ))
                }),
            });
            let reloading = tls
                .as_ref()
                .map(|t| AbortOnDrop(tokio::spawn(Arc::clone(t).keep_reloading())));
            Some((
                AbortOnDrop(tokio::spawn(http::serve(listener, probes, tls))),
                reloading,
            ))
        }
        None => None,
    };
    let (stop_serving, serving_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut served = tokio::spawn(server.serve(async {
        let _ = serving_stopped.await;
    }));

    tokio::pin!(shutdown);
    let started = Instant::now();
    // Standing by is cancelled by shutdown; taking over, once the lock is held, is not (it
    // ends with the claims recovered or with an error).
    let lock = tokio::select! {
        r = wait_for_lock(&lock_path) => Some(r),
        () = &mut shutdown => None,
        r = &mut served => return server_ended(r),
    };
    let taken = match lock {
        Some(Ok(lock)) => {
            role.send_replace(Role::TakingOver);
            let recovered = take_over(
                lock,
                &config,
                client.clone(),
                Found {
                    backend: &backend,
                    inventory: &inventory,
                    kernel_memory: kernel_memory.clone(),
                    imex: publishing.imex,
                },
                &activation,
                &metrics,
            )
            .await;
            if recovered.is_ok() {
                metrics.set_active(true, Some(started.elapsed()));
            }
            Some(recovered)
        }
        Some(Err(e)) => Some(Err(e)),
        None => None,
    };
    let mut server_result = None;
    let (mut active, result) = match taken {
        Some(Ok(active)) => (Some(active), Ok(())),
        Some(Err(e)) => (None, Err(e)),
        None => (None, Ok(())),
    };
    if let Some(active) = &mut active {
        let (claims, devices) = active.controller().prepared_summary().await;
        metrics.set_prepared(claims, devices);
        // The first publication waits for the API server as long as it takes; a shutdown
        // meanwhile stops it.
        let stopping = tokio::select! {
            () = active.run_tasks(
                &config,
                client,
                &backend,
                &inventory,
                (publishing, pool),
                Health {
                    kubelet: &device_health,
                    metrics: &metrics,
                },
            ) => false,
            () = &mut shutdown => true,
        };
        if !stopping {
            role.send_replace(Role::Active);
            tokio::select! {
                () = &mut shutdown => {}
                r = &mut served => server_result = Some(server_ended(r)),
            }
        }
    }

    // Unregister and let calls in flight finish (a standby instance answers its waiting calls
    // at once); then the active instance's background work; then hand the lock over.
    drop(activation);
    let _ = stop_serving.send(());
    let served = match server_result {
        Some(r) => r,
        None => server_ended(served.await),
    };
    drop(http);
    stop_after(result.and(served), active, &metrics).await
}

/// Stops the active instance's tasks, waits for its background claim work, releases the lock.
async fn stop_after(
    result: Result<(), Error>,
    active: Option<Active>,
    metrics: &Metrics,
) -> Result<(), Error> {
    if let Some(active) = active {
        active.stop().await;
        metrics.set_active(false, None);
    }
    if result.is_ok() {
        info!("stopped");
    }
    result
}

/// The kubelet server's end as the plugin's result: its own error, or [`Error::TaskFailed`]
/// when its task panicked or was cancelled.
fn server_ended(
    r: Result<Result<(), dra_kubelet::ServeError>, tokio::task::JoinError>,
) -> Result<(), Error> {
    match r {
        Ok(r) => Ok(r?),
        Err(e) => Err(Error::TaskFailed {
            task: "kubelet server",
            message: e.to_string(),
        }),
    }
}
