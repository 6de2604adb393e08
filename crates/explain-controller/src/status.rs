//! What the controller did and whether it is ready, served over HTTP for the Deployment's probes
//! and Prometheus: `/metrics` (OpenMetrics text), `/healthz` (liveness: the process and its
//! async runtime answer) and `/readyz` (readiness: the caches hold their first full list; until
//! then no pod is explained). Each answers 200 `ok` or 503 with the reason.
//!
//! Metrics, all prefixed `drust_explain_`: `reconciles_total`, `explanations_total` (computed),
//! `events_total` (Warning events created), `deduplicated_total` (explanations not published
//! again because the pod already shows them), `errors_total` (reconciles that failed and were
//! retried), `caches_ready` (1 once the caches are filled).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicI64;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The content type of `/metrics`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Counters of what the controller did, and its readiness.
pub struct Status {
    /// Reconcile calls.
    pub reconciles: Counter,
    /// Explanations computed.
    pub explained: Counter,
    /// Events created.
    pub published: Counter,
    /// Explanations not published because they were published already.
    pub deduplicated: Counter,
    /// Reconcile errors.
    pub errors: Counter,
    /// 1 once the caches hold their first full list.
    pub caches_ready: Gauge<i64, AtomicI64>,
    registry: Registry,
}

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Status")
            .field("reconciles", &self.reconciles.get())
            .field("published", &self.published.get())
            .field("caches_ready", &self.caches_ready.get())
            .finish_non_exhaustive()
    }
}

impl Default for Status {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("drust_explain");
        let status = |registry: &mut Registry, name: &str, help: &str| {
            let counter = Counter::default();
            registry.register(name, help, counter.clone());
            counter
        };
        let reconciles = status(&mut registry, "reconciles", "Reconcile calls");
        let explained = status(&mut registry, "explanations", "Explanations computed");
        let published = status(&mut registry, "events", "Warning events created on pods");
        let deduplicated = status(
            &mut registry,
            "deduplicated",
            "Explanations not published again because the pod already shows them",
        );
        let errors = status(
            &mut registry,
            "errors",
            "Reconciles that failed and were retried",
        );
        let caches_ready = Gauge::default();
        registry.register(
            "caches_ready",
            "1 once the caches hold their first full list",
            caches_ready.clone(),
        );
        Self {
            reconciles,
            explained,
            published,
            deduplicated,
            errors,
            caches_ready,
            registry,
        }
    }
}

impl Status {
    /// The metrics in OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// `Ok` once the caches are filled, else why not.
    pub fn ready(&self) -> Result<(), &'static str> {
        if self.caches_ready.get() == 1 {
            Ok(())
        } else {
            Err("the caches do not hold their first list yet")
        }
    }
}

/// The routes: `/metrics`, `/healthz`, `/readyz`.
pub fn router(status: Arc<Status>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Arc<Status>>| async move {
                ([(header::CONTENT_TYPE, CONTENT_TYPE)], s.encode())
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(s): State<Arc<Status>>| async move {
                match s.ready() {
                    Ok(()) => (StatusCode::OK, "ok").into_response(),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
                }
            }),
        )
        .with_state(status)
}

/// Binds `address` and serves [`router`] until the task is dropped.
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve(
    address: SocketAddr,
    status: Arc<Status>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(address).await?;
    tracing::info!(address = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(status)).await {
            tracing::warn!(error = %e, "the HTTP endpoint stopped");
        }
    }))
}
