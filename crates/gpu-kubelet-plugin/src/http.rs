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
//! Both answer 200 with `ok`, or 503 with the reason, to anyone: the kubelet probes them
//! without credentials, and they name nothing of the node's workloads.
//!
//! `/metrics` and `/usage` name every namespace's pods, claims and containers. With
//! [`Probes::access`] set (`--http-auth`, the chart's default) they answer only a caller whose
//! bearer token the API server authenticates and whose user it authorizes ([`auth`]): `get` on
//! the non-resource URL `/metrics` or `/usage`; for `/usage?namespace=<ns>`, `list` on
//! `resourceclaims` in `<ns>` is enough too, so a namespace's own users can read its usage.

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
use tracing::{debug, info, warn};

use crate::instance::Role;
use crate::metrics::{CONTENT_TYPE, Metrics};

pub mod auth;
pub mod decision_cache;
pub mod tls;

use auth::{ApiServerReviews, Attributes, Gate};

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
    /// The TLS certificate could not be made or loaded (`--http-tls`).
    #[error("TLS on the HTTP endpoint: {0}")]
    Tls(#[from] tls::TlsError),
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
    /// Who may read `/metrics` and `/usage`; `None`: anyone who reaches the endpoint.
    pub access: Option<Gate<ApiServerReviews>>,
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

    /// `Ok` when [`Probes::access`] is off, or lets `req`'s bearer token do any one of
    /// `alternatives`.
    async fn admit(
        &self,
        req: &Request<Incoming>,
        alternatives: &[Attributes],
    ) -> Result<(), auth::Refusal> {
        let Some(gate) = &self.access else {
            return Ok(());
        };
        let authorization = req.headers().get(hyper::header::AUTHORIZATION);
        let user = gate
            .admit(authorization.map(|v| v.as_bytes()), alternatives)
            .await?;
        debug!(user = %user.name, path = req.uri().path(), "admitted");
        Ok(())
    }

    async fn answer(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != hyper::Method::GET {
            return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
        }
        let probe = |r: Result<(), String>| match r {
            Ok(()) => text(StatusCode::OK, "ok\n".into()),
            Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
        };
        match req.uri().path() {
            "/metrics" => {
                if let Err(refusal) = self.admit(req, &[Attributes::get("/metrics")]).await {
                    return refused(&refusal);
                }
                let mut r = text(StatusCode::OK, self.metrics.encode());
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(CONTENT_TYPE),
                );
                r
            }
            "/usage" => {
                let namespace = usage_namespace(req.uri().query());
                if let Some(ns) = namespace
                    && !dns_label(ns)
                {
                    return text(
                        StatusCode::BAD_REQUEST,
                        format!("namespace {ns:?} is not a namespace name (a DNS label)\n"),
                    );
                }
                let mut alternatives = vec![Attributes::get("/usage")];
                alternatives.extend(
                    namespace
                        .map(|ns| Attributes::list_in("resource.k8s.io", "resourceclaims", ns)),
                );
                if let Err(refusal) = self.admit(req, &alternatives).await {
                    return refused(&refusal);
                }
                let report = self.metrics.usage_report();
                let json = match namespace {
                    Some(ns) => serde_json::to_string(&report.only_namespace(ns)),
                    None => serde_json::to_string(&*report),
                };
                match json {
                    Ok(json) => {
                        let mut r = text(StatusCode::OK, json);
                        r.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static("application/json"),
                        );
                        r
                    }
                    Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
                }
            }
            "/healthz" => probe(self.live().await),
            "/readyz" => probe(self.ready()),
            _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

/// The answer to a refused request: its status, and what it lacks in the body; a 401 says the
/// scheme it wants (RFC 6750).
fn refused(refusal: &auth::Refusal) -> Response<Full<Bytes>> {
    let status = refusal.status();
    if status.is_server_error() {
        warn!(error = %refusal, "the HTTP endpoint could not check a caller's access");
    }
    let mut r = text(status, format!("{refusal}\n"));
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static("Bearer"),
        );
    }
    r
}

/// The namespace `/usage?<query>` asks for (`namespace=<ns>`, the first one), if any: the
/// report is cut to it ([`crate::usage::Report::only_namespace`]) and it is what a namespace's
/// user is authorized for.
fn usage_namespace(query: Option<&str>) -> Option<&str> {
    query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("namespace="))
}

/// Whether `name` can name a namespace: an RFC 1123 label (`IsDNS1123Label`), so that what is
/// authorized and what is served are the same namespace, never an encoding of it.
fn dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
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

/// Serves `/metrics`, `/usage`, `/healthz` and `/readyz` on `listener` (HTTP/1.1, over TLS
/// when `tls` is given) until the task is dropped or aborted. Each connection is served in its
/// own task, so a request waiting for the API server's review, or a slow handshake, holds back
/// no other.
pub async fn serve(listener: TcpListener, probes: Arc<Probes>, tls: Option<Arc<tls::ServerTls>>) {
    if let Ok(addr) = listener.local_addr() {
        if tls.is_none() && probes.access.is_some() {
            warn!(address = %addr, "bearer tokens reach /metrics and /usage in the clear \
                (--http-tls is off)");
        }
        if probes.access.is_some() {
            info!(address = %addr, "serving /metrics and /usage to callers the API server \
                authorizes, /healthz and /readyz to anyone");
        } else {
            warn!(address = %addr, "serving /metrics and /usage, which name every namespace's \
                pods and claims, to anyone who reaches this address (--http-auth is off)");
        }
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
        let acceptor = tls.as_ref().map(|t| t.acceptor());
        tokio::spawn(async move {
            match acceptor {
                None => serve_connection(stream, probes).await,
                Some(acceptor) => {
                    match tokio::time::timeout(tls::HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(stream)) => serve_connection(stream, probes).await,
                        Ok(Err(e)) => debug!(error = %e, "TLS handshake failed"),
                        Err(_) => debug!(
                            "TLS handshake not finished within {:?}",
                            tls::HANDSHAKE_TIMEOUT
                        ),
                    }
                }
            }
        });
    }
}

/// Serves one connection (plain or TLS) with HTTP/1.1.
async fn serve_connection<S>(stream: S, probes: Arc<Probes>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_cut_to_the_first_namespace_asked_for() {
        for (query, want) in [
            (None, None),
            (Some(""), None),
            (Some("namespace=team-a"), Some("team-a")),
            (Some("x=1&namespace=team-a&namespace=b"), Some("team-a")),
            (Some("namespaces=a"), None),
        ] {
            assert_eq!(usage_namespace(query), want, "{query:?}");
        }
    }

    #[test]
    fn only_a_dns_label_names_a_namespace() {
        for ok in ["default", "team-a", "a", &"a".repeat(63)] {
            assert!(dns_label(ok), "{ok}");
        }
        for bad in [
            "",
            "Team",
            "-a",
            "a-",
            "a.b",
            "a%2Fb",
            "a b",
            &"a".repeat(64),
        ] {
            assert!(!dns_label(bad), "{bad}");
        }
    }
}
