//! The plugin's HTTP endpoint: `/metrics` (Prometheus), `/usage` (the latest GPU usage report as
//! JSON, [`crate::usage::Report`], for `dractl top`), `/healthz` (liveness) and `/readyz`
//! (readiness), for the DaemonSet's probes and Prometheus.
//!
//! - `/healthz`: the process and its gRPC servers answer: a real `GetInfo` on this instance's
//!   registration socket (what the kubelet's plugin watcher calls) and an empty
//!   `NodePrepareResources` on its DRA socket, each within [`PROBE_TIMEOUT`].
//! - `/readyz`: the sockets are served, the kubelet has registered this instance, and the
//!   instance is either standing by or active with its ResourceSlices published. It does not
//!   wait for the active lock (see [`crate::instance`] for why).
//!
//! Both answer 200 with `ok`, or 503 with the reason.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::client::{DraPluginV1Client, RegistrationClient, connect};
use dra_kubelet::proto::{dra_v1, pluginregistration};
use dra_kubelet::{PluginSockets, RegistrationStatus};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, info};

use crate::instance::Role;
use crate::metrics::{CONTENT_TYPE, Metrics};

/// How long one liveness call may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The HTTP endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address could not be bound.
    #[error("binding the HTTP endpoint {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// What the probes look at.
pub struct Probes {
    /// The metrics served at `/metrics`.
    pub metrics: Arc<Metrics>,
    /// This instance's sockets, dialled by the liveness probe.
    pub sockets: PluginSockets,
    /// The DRA driver name (part of the registration socket's name).
    pub driver_name: String,
    /// Whether the kubelet sockets are served.
    pub serving: watch::Receiver<bool>,
    /// What the kubelet reported at registration.
    pub registration: watch::Receiver<RegistrationStatus>,
    /// Standby, taking over, or active.
    pub role: watch::Receiver<Role>,
}

impl Probes {
    /// Liveness: both gRPC servers answer a real call.
    ///
    /// # Errors
    /// Why not, for the 503 body.
    pub async fn live(&self) -> Result<(), String> {
        if !*self.serving.borrow() {
            return Err("the kubelet sockets are not served".into());
        }
        let registration = self.sockets.registration_socket(&self.driver_name);
        let dra = self.sockets.dra_socket();
        let calls = async {
            let mut reg = RegistrationClient::new(
                connect(&registration)
                    .await
                    .map_err(|e| format!("dialling {}: {e}", registration.display()))?,
            );
            reg.get_info(pluginregistration::InfoRequest {})
                .await
                .map_err(|e| format!("GetInfo on {}: {e}", registration.display()))?;
            let mut plugin = DraPluginV1Client::new(
                connect(&dra)
                    .await
                    .map_err(|e| format!("dialling {}: {e}", dra.display()))?,
            );
            plugin
                .node_prepare_resources(dra_v1::NodePrepareResourcesRequest { claims: vec![] })
                .await
                .map_err(|e| format!("NodePrepareResources on {}: {e}", dra.display()))?;
            Ok(())
        };
        tokio::time::timeout(PROBE_TIMEOUT, calls)
            .await
            .map_err(|_| format!("the gRPC servers did not answer within {PROBE_TIMEOUT:?}"))?
    }

    /// Readiness: served, registered, and not in the middle of taking over.
    ///
    /// # Errors
    /// Why not, for the 503 body.
    pub fn ready(&self) -> Result<(), String> {
        if !*self.serving.borrow() {
            return Err("the kubelet sockets are not served".into());
        }
        match &*self.registration.borrow() {
            RegistrationStatus::Registered => {}
            RegistrationStatus::Pending => {
                return Err("the kubelet has not registered this plugin yet".into());
            }
            RegistrationStatus::Failed(e) => {
                return Err(format!("the kubelet rejected this plugin: {e}"));
            }
        }
        match *self.role.borrow() {
            Role::Standby | Role::Active => Ok(()),
            Role::TakingOver => {
                Err("taking over: recovering claims and publishing ResourceSlices".into())
            }
        }
    }

    async fn answer(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        let text = |status: StatusCode, body: String| {
            let mut r = Response::new(Full::new(Bytes::from(body)));
            *r.status_mut() = status;
            r
        };
        let probe = |r: Result<(), String>| match r {
            Ok(()) => text(StatusCode::OK, "ok\n".into()),
            Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
        };
        if req.method() != hyper::Method::GET {
            return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
        }
        match req.uri().path() {
            "/metrics" => {
                let mut r = text(StatusCode::OK, self.metrics.encode());
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(CONTENT_TYPE),
                );
                r
            }
            "/usage" => match serde_json::to_string(&usage_for(
                &self.metrics.usage_report(),
                req.uri().query(),
            )) {
                Ok(json) => {
                    let mut r = text(StatusCode::OK, json);
                    r.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("application/json"),
                    );
                    r
                }
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
            },
            "/healthz" => probe(self.live().await),
            "/readyz" => probe(self.ready()),
            _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
        }
    }
}

/// The usage report `/usage?<query>` answers: the whole report, or with `namespace=<ns>` only
/// that namespace's ([`crate::usage::Report::only_namespace`]).
fn usage_for(report: &crate::usage::Report, query: Option<&str>) -> crate::usage::Report {
    let namespace = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("namespace="));
    match namespace {
        Some(ns) => report.only_namespace(ns),
        None => report.clone(),
    }
}

/// Binds `address`.
///
/// # Errors
/// [`HttpError::Bind`].
pub async fn bind(address: SocketAddr) -> Result<TcpListener, HttpError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| HttpError::Bind { address, source })
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` (HTTP/1.1) until the task is
/// dropped or aborted.
pub async fn serve(listener: TcpListener, probes: Arc<Probes>) {
    if let Ok(addr) = listener.local_addr() {
        info!(address = %addr, "serving /metrics, /healthz and /readyz");
    }
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Per-connection failures (e.g. too many open files) are not fatal.
                debug!(error = %e, "accepting an HTTP connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let probes = Arc::clone(&probes);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let probes = Arc::clone(&probes);
                async move { Ok::<_, Infallible>(probes.answer(&req).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
}
