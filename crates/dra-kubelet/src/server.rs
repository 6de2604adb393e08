//! Serving registration and DRAPlugin on their Unix sockets until shutdown.

use std::future::Future;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tracing::{info, warn};

use crate::SUPPORTED_VERSIONS;
use crate::calls::{CallObserver, InFlight};
use crate::driver::Driver;
use crate::health::{DeviceHealth, HEALTH_SERVICE, HealthService};
use crate::proto::{dra_v1, dra_v1beta1, health_v1alpha1, pluginregistration};
use crate::registration::{RegistrationService, RegistrationStatus};
use crate::service::{DraPluginV1, DraPluginV1beta1, Shared};
use crate::transport::{Tapped, TransportObserver, WarnLog};

/// How long shutdown waits for connected clients to hang up once no call is in flight.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How long shutdown waits, by default, for calls in flight to finish: the kubelet's own
/// deadline for one call (`defaultClientCallTimeout`, pkg/kubelet/cm/dra/plugin/dra_plugin.go).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(45);

/// Where the sockets live. Defaults are the kubelet's
/// (`/var/lib/kubelet/plugins/<driver>` and `/var/lib/kubelet/plugins_registry`).
///
/// With an `instance_id` (the pod UID under a DaemonSet), both socket names carry it, as the
/// `RollingUpdate` option of k8s.io/dynamic-resource-allocation/kubeletplugin (v1.36) names
/// them: `<driver>-<id>-reg.sock` and `dra-<id>.sock`. Two instances of one driver can then
/// serve side by side during a rolling update (pkg/kubelet/pluginmanager/pluginwatcher/README.md,
/// "Seamless Upgrade"); the kubelet tracks both registrations and calls the most recently
/// registered one that is connected, falling back to the other when one unregisters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSockets {
    /// Directory of the DRA service socket `dra.sock`.
    pub plugin_dir: PathBuf,
    /// The kubelet plugin watcher's directory; our registration socket goes here.
    pub registrar_dir: PathBuf,
    /// This instance's ID, carried in both socket names; `None`: the classic names.
    pub instance_id: Option<String>,
}

impl PluginSockets {
    /// The kubelet's defaults for `driver_name`.
    pub fn kubelet_defaults(driver_name: &str) -> Self {
        Self {
            plugin_dir: Path::new("/var/lib/kubelet/plugins").join(driver_name),
            registrar_dir: PathBuf::from("/var/lib/kubelet/plugins_registry"),
            instance_id: None,
        }
    }

    /// `-<id>` with an instance ID, else empty.
    fn instance_part(&self) -> String {
        self.instance_id
            .as_deref()
            .map_or_else(String::new, |id| format!("-{id}"))
    }

    /// `<plugin-dir>/dra.sock` (`dra-<id>.sock` with an instance ID), the endpoint advertised
    /// in `GetInfo`.
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir
            .join(format!("dra{}.sock", self.instance_part()))
    }

    /// `<registrar-dir>/<driver>-reg.sock` (`<driver>-<id>-reg.sock` with an instance ID), the
    /// socket the plugin watcher discovers.
    pub fn registration_socket(&self, driver_name: &str) -> PathBuf {
        self.registrar_dir
            .join(format!("{driver_name}{}-reg.sock", self.instance_part()))
    }
}

/// Whether `id` can be part of a socket file name: non-empty, at most 128 bytes of ASCII
/// letters, digits, `-`, `_` and `.`, not starting with `.` (the plugin watcher ignores hidden
/// files). A pod UID always qualifies.
pub fn valid_instance_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The socket's directory could not be created.
    #[error("creating socket directory {path}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A stale socket file could not be removed, or the socket could not be bound.
    #[error("binding Unix socket {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The gRPC server on a socket failed.
    #[error("serving gRPC on {path}: {source}")]
    Serve {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        source: tonic::transport::Error,
    },
}

/// The kubelet-facing servers of one driver.
pub struct PluginServer<D> {
    driver_name: String,
    sockets: PluginSockets,
    driver: Arc<D>,
    status: watch::Sender<RegistrationStatus>,
    serving: watch::Sender<bool>,
    observer: Option<Arc<dyn CallObserver>>,
    drain_timeout: Duration,
    health: Option<watch::Receiver<Vec<DeviceHealth>>>,
    transport: Arc<dyn TransportObserver>,
}

impl<D: Driver> PluginServer<D> {
    /// A server for `driver_name` (the DRA driver name, e.g. `gpu.drust.dev`).
    pub fn new(driver_name: impl Into<String>, sockets: PluginSockets, driver: Arc<D>) -> Self {
        Self {
            driver_name: driver_name.into(),
            sockets,
            driver,
            status: watch::Sender::new(RegistrationStatus::Pending),
            serving: watch::Sender::new(false),
            observer: None,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            health: None,
            transport: Arc::new(WarnLog),
        }
    }

    /// Reports transport-level failures on both sockets (streams the HTTP/2 layer resets,
    /// connections closed with an error, peers that do not speak HTTP/2) to `observer` instead
    /// of logging them at warn ([`crate::transport`]).
    #[must_use]
    pub fn with_transport_observer(mut self, observer: Arc<dyn TransportObserver>) -> Self {
        self.transport = observer;
        self
    }

    /// Reports every answered call with claims to `observer` (metrics).
    #[must_use]
    pub fn with_observer(mut self, observer: Arc<dyn CallObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// How long shutdown lets calls in flight finish (default [`DEFAULT_DRAIN_TIMEOUT`]).
    #[must_use]
    pub fn with_drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Also serves `v1alpha1.DRAResourceHealth` on the DRA socket, streaming the snapshots of
    /// `health`, and advertises it at registration ([`crate::health`] has the kubelet's rules:
    /// send fresh `last_updated` times more often than the devices' timeout).
    pub fn with_health(mut self, health: watch::Receiver<Vec<DeviceHealth>>) -> Self {
        self.health = Some(health);
        self
    }

    /// The service names `GetInfo` advertises: the DRAPlugin versions, then the health service
    /// when it is served.
    pub fn supported_services(&self) -> Vec<String> {
        let mut services: Vec<String> =
            SUPPORTED_VERSIONS.iter().map(|v| (*v).to_owned()).collect();
        if self.health.is_some() {
            services.push(HEALTH_SERVICE.to_owned());
        }
        services
    }

    /// Follows what the kubelet reports through `NotifyRegistrationStatus`.
    pub fn registration_status(&self) -> watch::Receiver<RegistrationStatus> {
        self.status.subscribe()
    }

    /// `true` from when both sockets accept calls until shutdown begins.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// Binds both sockets (owner-only, mode 0600; a directory we create is mode 0700), serves
    /// until `shutdown` completes, then removes this instance's socket files and no others.
    /// The DRA socket is bound before the registration socket appears, so the kubelet never
    /// dials an endpoint that is not there yet.
    ///
    /// Shutdown first removes the registration socket (the kubelet unregisters this instance
    /// and sends new calls to another one, if any), stops accepting connections, lets the calls
    /// in flight finish (at most the drain timeout, see [`PluginServer::with_drain_timeout`])
    /// and then waits at most [`SHUTDOWN_GRACE`] for clients to hang up.
    ///
    /// # Errors
    /// [`ServeError`] when a directory or socket cannot be created or a server fails.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServeError> {
        let dra_path = self.sockets.dra_socket();
        let reg_path = self.sockets.registration_socket(&self.driver_name);
        let dra_listener = bind(&dra_path)?;
        let reg_listener = match bind(&reg_path) {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_file(&dra_path);
                return Err(e);
            }
        };
        info!(dra = %dra_path.display(), registration = %reg_path.display(), "serving kubelet plugin sockets");
        let shared = Arc::new(Shared {
            driver: Arc::clone(&self.driver),
            in_flight: InFlight::default(),
            observer: self.observer.clone(),
        });
        let in_flight = shared.in_flight.clone();

        let (stop_tx, stop_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            // An error means the sender is gone, which also means stop.
            let _ = rx.wait_for(|s| *s).await;
        };

        let supported_versions = self.supported_services();
        let health = self.health.clone().map(|health| {
            health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                HealthService {
                    health,
                    stop: stop_rx.clone(),
                },
            )
        });
        let dra = Server::builder()
            .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(
                DraPluginV1(Arc::clone(&shared)),
            ))
            .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
                DraPluginV1beta1(shared),
            ))
            .add_optional_service(health)
            .serve_with_incoming_shutdown(
                tapped(dra_listener, &dra_path, &self.transport),
                stopped(stop_rx.clone()),
            );
        let registration = Server::builder()
            .add_service(
                pluginregistration::registration_server::RegistrationServer::new(
                    RegistrationService {
                        driver_name: self.driver_name.clone(),
                        endpoint: dra_path.clone(),
                        supported_versions,
                        status: self.status.clone(),
                    },
                ),
            )
            .serve_with_incoming_shutdown(
                tapped(reg_listener, &reg_path, &self.transport),
                stopped(stop_rx),
            );
        let servers = async {
            tokio::try_join!(
                async {
                    dra.await.map_err(|source| ServeError::Serve {
                        path: dra_path.clone(),
                        source,
                    })
                },
                async {
                    registration.await.map_err(|source| ServeError::Serve {
                        path: reg_path.clone(),
                        source,
                    })
                },
            )
        };
        tokio::pin!(servers);
        self.serving.send_replace(true);
        let result = tokio::select! {
            r = &mut servers => r.map(|_| ()),
            () = shutdown => {
                self.serving.send_replace(false);
                // Unregister first: the plugin watcher sees the socket go away and the kubelet
                // sends new calls to another instance, if one is registered.
                let _ = std::fs::remove_file(&reg_path);
                stop_tx.send_replace(true);
                // Calls in flight run on their connections' tasks; let them finish so their
                // answers reach the kubelet.
                let running = in_flight.count();
                if running > 0 {
                    info!(calls = running, "letting calls in flight finish");
                    if tokio::time::timeout(self.drain_timeout, in_flight.idle()).await.is_err() {
                        warn!(calls = in_flight.count(), timeout = ?self.drain_timeout,
                            "calls still in flight after the drain timeout; stopping anyway");
                    }
                }
                // Graceful shutdown waits for clients to hang up; a kubelet that keeps its
                // connection open must not keep us from exiting.
                match tokio::time::timeout(SHUTDOWN_GRACE, &mut servers).await {
                    Ok(r) => r.map(|_| ()),
                    Err(_) => {
                        info!(grace = ?SHUTDOWN_GRACE, "clients still connected; closing");
                        Ok(())
                    }
                }
            }
        };
        self.serving.send_replace(false);
        let _ = std::fs::remove_file(&reg_path);
        let _ = std::fs::remove_file(&dra_path);
        result
    }
}

/// The connections accepted on `listener`, each watched for transport-level failures.
fn tapped(
    listener: UnixListener,
    path: &Path,
    observer: &Arc<dyn TransportObserver>,
) -> impl tokio_stream::Stream<Item = io::Result<Tapped<tokio::net::UnixStream>>> + use<> {
    let socket: Arc<str> = Arc::from(path.to_string_lossy().as_ref());
    let observer = Arc::clone(observer);
    UnixListenerStream::new(listener)
        .map(move |conn| conn.map(|c| Tapped::new(c, Arc::clone(&socket), Arc::clone(&observer))))
}

fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    if let Some(dir) = path.parent() {
        // Directories we create are owner-only; existing ones (the kubelet's registry) are
        // left as they are.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| ServeError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
    }
    let bind_err = |source| ServeError::Bind {
        path: path.to_owned(),
        source,
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind_err)?;
    Ok(listener)
}
