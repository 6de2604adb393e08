//! Serving registration and DRAPlugin on their Unix sockets until shutdown.

use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tracing::info;

use crate::SUPPORTED_VERSIONS;
use crate::driver::Driver;
use crate::health::{DeviceHealth, HEALTH_SERVICE, HealthService};
use crate::proto::{dra_v1, dra_v1beta1, health_v1alpha1, pluginregistration};
use crate::registration::{RegistrationService, RegistrationStatus};
use crate::service::{DraPluginV1, DraPluginV1beta1};

/// How long shutdown waits for connected clients to hang up.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Where the sockets live. Defaults are the kubelet's
/// (`/var/lib/kubelet/plugins/<driver>` and `/var/lib/kubelet/plugins_registry`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSockets {
    /// Directory of the DRA service socket `dra.sock`.
    pub plugin_dir: PathBuf,
    /// The kubelet plugin watcher's directory; our registration socket goes here.
    pub registrar_dir: PathBuf,
}

impl PluginSockets {
    /// The kubelet's defaults for `driver_name`.
    pub fn kubelet_defaults(driver_name: &str) -> Self {
        Self {
            plugin_dir: Path::new("/var/lib/kubelet/plugins").join(driver_name),
            registrar_dir: PathBuf::from("/var/lib/kubelet/plugins_registry"),
        }
    }

    /// `<plugin-dir>/dra.sock`, the endpoint advertised in `GetInfo`.
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir.join("dra.sock")
    }

    /// `<registrar-dir>/<driver>-reg.sock`, the socket the plugin watcher discovers.
    pub fn registration_socket(&self, driver_name: &str) -> PathBuf {
        self.registrar_dir.join(format!("{driver_name}-reg.sock"))
    }
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
    health: Option<watch::Receiver<Vec<DeviceHealth>>>,
}

impl<D: Driver> PluginServer<D> {
    /// A server for `driver_name` (the DRA driver name, e.g. `gpu.drust.dev`).
    pub fn new(driver_name: impl Into<String>, sockets: PluginSockets, driver: Arc<D>) -> Self {
        Self {
            driver_name: driver_name.into(),
            sockets,
            driver,
            status: watch::Sender::new(RegistrationStatus::Pending),
            health: None,
        }
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

    /// Binds both sockets (owner-only, mode 0600), serves until `shutdown` completes, then
    /// removes the socket files. The DRA socket is bound before the registration socket appears,
    /// so the kubelet never dials an endpoint that is not there yet.
    ///
    /// # Errors
    /// [`ServeError`] when a directory or socket cannot be created or a server fails.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServeError> {
        let dra_path = self.sockets.dra_socket();
        let reg_path = self.sockets.registration_socket(&self.driver_name);
        let dra_listener = bind(&dra_path)?;
        let reg_listener = bind(&reg_path)?;
        info!(dra = %dra_path.display(), registration = %reg_path.display(), "serving kubelet plugin sockets");

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
                DraPluginV1(Arc::clone(&self.driver)),
            ))
            .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
                DraPluginV1beta1(Arc::clone(&self.driver)),
            ))
            .add_optional_service(health)
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(dra_listener),
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
            .serve_with_incoming_shutdown(UnixListenerStream::new(reg_listener), stopped(stop_rx));
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
        let result = tokio::select! {
            r = &mut servers => r.map(|_| ()),
            () = shutdown => {
                // Unregister first: the plugin watcher sees the socket go away.
                let _ = std::fs::remove_file(&reg_path);
                stop_tx.send_replace(true);
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
        let _ = std::fs::remove_file(&reg_path);
        let _ = std::fs::remove_file(&dra_path);
        result
    }
}

fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ServeError::CreateDir {
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
