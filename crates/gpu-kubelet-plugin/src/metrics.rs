//! Prometheus metrics of the node plugin, in the OpenMetrics text format served at `/metrics`.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `drust_kubelet_requests_total` | counter | `method`, `api_version` | DRAPlugin calls with claims answered |
//! | `drust_kubelet_request_duration_seconds` | histogram | `method`, `api_version` | time to answer one call (seconds) |
//! | `drust_claim_errors_total` | counter | `method`, `reason` | claims answered with an error |
//! | `drust_prepared_claims` | gauge | | claims whose prepare completed |
//! | `drust_prepared_devices` | gauge | | devices held by those claims |
//! | `drust_device_healthy` | gauge | `device` | 1 healthy, 0 unhealthy, -1 unknown (health monitoring failing, or the GPU not watched) |
//! | `drust_instance_active` | gauge | | 1 while this instance holds the active lock |
//! | `drust_active_lock_wait_seconds` | gauge | | how long this instance waited for the lock |
//!
//! GPU usage (DCGM exporter's names, per-container memory, idle claims): see
//! [`crate::usage::collector`].
//!
//! `method` is `prepare` or `unprepare`; `api_version` is `v1` or `v1beta1`; `reason` is
//! [`crate::claims::ClaimError::reason`] or `not-active` (the instance never became active
//! within the handover wait, see `instance`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use dra_kubelet::{CallObserver, CallRecord};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::usage::collector::UsageCollector;
use crate::usage::report::Report;

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: &'static str,
    api_version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    method: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

/// 1 ms to about 65 s, doubling: covers a fast idempotent prepare and the kubelet's 45 s limit.
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Every metric of the plugin. Cheap to share behind an `Arc`; all updates are lock-free or
/// take a short internal lock.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// The latest usage report ([`crate::usage`]), encoded at each scrape and served at
    /// `/usage`.
    usage: watch::Sender<Arc<Report>>,
    requests: Family<CallLabels, Counter>,
    durations: Family<CallLabels, Histogram, fn() -> Histogram>,
    errors: Family<ErrorLabels, Counter>,
    prepared_claims: Gauge,
    prepared_devices: Gauge,
    device_healthy: Family<DeviceLabels, Gauge>,
    active: Gauge,
    lock_wait: Gauge<f64, AtomicU64>,
    recovery_failing: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All metrics registered, at zero.
    pub fn new() -> Self {
        let mut root = Registry::default();
        // Usage keeps DCGM exporter's names (no prefix): see `crate::usage::collector`.
        let usage = watch::Sender::new(Arc::new(Report::default()));
        root.register_collector(Box::new(UsageCollector::new(usage.subscribe())));
        let registry = root.sub_registry_with_prefix("drust");
        let requests = Family::<CallLabels, Counter>::default();
        registry.register(
            "kubelet_requests",
            "DRAPlugin calls with claims answered, by method and API version",
            requests.clone(),
        );
        let durations = Family::<CallLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram,
        );
        registry.register(
            "kubelet_request_duration_seconds",
            "Time to answer one DRAPlugin call, by method and API version",
            durations.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "claim_errors",
            "Claims answered with an error, by method and reason",
            errors.clone(),
        );
        let prepared_claims = Gauge::default();
        registry.register(
            "prepared_claims",
            "Claims whose prepare completed",
            prepared_claims.clone(),
        );
        let prepared_devices = Gauge::default();
        registry.register(
            "prepared_devices",
            "Devices held by prepared claims",
            prepared_devices.clone(),
        );
        let device_healthy = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "device_healthy",
            "1 when the device is healthy, 0 when unhealthy, -1 when unknown",
            device_healthy.clone(),
        );
        let active = Gauge::default();
        registry.register(
            "instance_active",
            "1 while this instance holds the active lock and serves claims",
            active.clone(),
        );
        let lock_wait = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "active_lock_wait_seconds",
            "How long this instance waited for the active lock",
            lock_wait.clone(),
        );
        let recovery_failing = Gauge::default();
        registry.register(
            "claims_recovery_failing",
            "Claims whose recovery at start failed and is being retried",
            recovery_failing.clone(),
        );
        Self {
            registry: root,
            usage,
            requests,
            durations,
            errors,
            prepared_claims,
            prepared_devices,
            device_healthy,
            active,
            lock_wait,
            recovery_failing,
        }
    }

    /// Counts one claim answered with an error.
    pub fn claim_failed(&self, method: dra_kubelet::Method, reason: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels {
                method: method.as_str(),
                reason,
            })
            .inc();
    }

    /// Sets the prepared-claims and prepared-devices gauges.
    pub fn set_prepared(&self, claims: usize, devices: usize) {
        self.prepared_claims
            .set(i64::try_from(claims).unwrap_or(i64::MAX));
        self.prepared_devices
            .set(i64::try_from(devices).unwrap_or(i64::MAX));
    }

    /// Records `device`'s health (the health monitor calls this on every change): 1 healthy,
    /// 0 unhealthy, -1 unknown.
    pub fn set_device_health(&self, device: &str, status: dra_kubelet::HealthStatus) {
        let value = match status {
            dra_kubelet::HealthStatus::Healthy => 1,
            dra_kubelet::HealthStatus::Unhealthy => 0,
            dra_kubelet::HealthStatus::Unknown => -1,
        };
        self.device_healthy
            .get_or_create(&DeviceLabels {
                device: device.to_owned(),
            })
            .set(value);
    }

    /// Records that this instance became active after waiting `waited` for the lock, or
    /// stopped being active.
    pub fn set_active(&self, active: bool, waited: Option<Duration>) {
        self.active.set(i64::from(active));
        if let Some(w) = waited {
            self.lock_wait.set(w.as_secs_f64());
        }
    }

    /// Sets how many claims' recovery at start is failing (being retried).
    pub fn set_recovery_failing(&self, claims: usize) {
        self.recovery_failing
            .set(i64::try_from(claims).unwrap_or(i64::MAX));
    }

    /// Where the usage sampler publishes its reports ([`crate::usage::sampler::run`]).
    pub fn usage_reports(&self) -> watch::Sender<Arc<Report>> {
        self.usage.clone()
    }

    /// The latest usage report (empty until the first sample).
    pub fn usage_report(&self) -> Arc<Report> {
        Arc::clone(&self.usage.borrow())
    }

    /// The metrics in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl CallObserver for Metrics {
    fn call_finished(&self, call: &CallRecord) {
        let labels = CallLabels {
            method: call.method.as_str(),
            api_version: call.api_version,
        };
        self.requests.get_or_create(&labels).inc();
        self.durations
            .get_or_create(&labels)
            .observe(call.elapsed.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_exposed_with_its_labels_and_values() {
        let m = Metrics::new();
        m.call_finished(&CallRecord {
            method: dra_kubelet::Method::Prepare,
            api_version: "v1",
            claims: 2,
            failed: 1,
            elapsed: Duration::from_millis(3),
        });
        m.claim_failed(dra_kubelet::Method::Prepare, "not-found");
        m.set_prepared(1, 2);
        m.set_device_health("gpu-0", dra_kubelet::HealthStatus::Healthy);
        m.set_device_health("gpu-1", dra_kubelet::HealthStatus::Unhealthy);
        m.set_device_health("gpu-2", dra_kubelet::HealthStatus::Unknown);
        m.set_active(true, Some(Duration::from_millis(1500)));
        let text = m.encode();
        for line in [
            r#"drust_kubelet_requests_total{method="prepare",api_version="v1"} 1"#,
            r#"drust_kubelet_request_duration_seconds_count{method="prepare",api_version="v1"} 1"#,
            r#"drust_kubelet_request_duration_seconds_bucket{le="0.004",method="prepare",api_version="v1"} 1"#,
            r#"drust_claim_errors_total{method="prepare",reason="not-found"} 1"#,
            "drust_prepared_claims 1",
            "drust_prepared_devices 2",
            r#"drust_device_healthy{device="gpu-0"} 1"#,
            r#"drust_device_healthy{device="gpu-1"} 0"#,
            r#"drust_device_healthy{device="gpu-2"} -1"#,
            "drust_instance_active 1",
            "drust_active_lock_wait_seconds 1.5",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing in:\n{text}"
            );
        }
    }
}
