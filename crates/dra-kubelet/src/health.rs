//! Device health for the kubelet: the `v1alpha1.DRAResourceHealth` service (KEP-4680), fed by a
//! watch channel of [`DeviceHealth`] snapshots.
//!
//! Kubelet behaviour this follows (k8s.io/kubernetes v1.36 `pkg/kubelet/cm/dra`):
//! - With the `ResourceHealthStatus` gate (beta, on by default in 1.36) the kubelet calls
//!   `NodeWatchResources` on the DRA socket of every registered plugin and, when the call fails
//!   or the stream ends, calls again every 5 s (`plugin/dra_plugin_manager.go`).
//! - Each response is a list of devices; the kubelet merges them into its cache and marks a
//!   device `Unknown` once its `last_updated_time` is older than its
//!   `health_check_timeout_seconds` (30 s when unset; `healthinfo.go`). A plugin therefore sends
//!   fresh timestamps more often than the timeout, not only on change.
//! - The registration advertises the service by its gRPC name `v1alpha1.DRAResourceHealth` after
//!   the DRAPlugin versions, as k8s.io/dynamic-resource-allocation/kubeletplugin does; the kubelet
//!   picks its DRAPlugin version from the first entries it knows and ignores the rest.

use std::pin::Pin;
use std::time::{Duration, SystemTime};

use futures::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::proto::health_v1alpha1 as pb;

/// The gRPC service name advertised in `GetInfo` when health is served.
pub const HEALTH_SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// A device's health as the plugin last determined it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HealthStatus {
    /// Cannot be determined.
    #[default]
    Unknown,
    /// Operating normally.
    Healthy,
    /// The device reported a problem.
    Unhealthy,
}

/// One device's health, keyed by pool and device name as published in the ResourceSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    /// The ResourceSlice pool.
    pub pool_name: String,
    /// The device name within the pool.
    pub device_name: String,
    /// The status.
    pub status: HealthStatus,
    /// Details for people (the kubelet keeps at most 1024 characters).
    pub message: String,
    /// When the plugin last determined this status (sent as Unix seconds).
    pub last_updated: SystemTime,
    /// How long the kubelet trusts this status without an update (whole seconds are sent);
    /// `None`: the kubelet's default, 30 s.
    pub timeout: Option<Duration>,
}

impl From<HealthStatus> for pb::HealthStatus {
    fn from(s: HealthStatus) -> Self {
        match s {
            HealthStatus::Unknown => Self::Unknown,
            HealthStatus::Healthy => Self::Healthy,
            HealthStatus::Unhealthy => Self::Unhealthy,
        }
    }
}

impl From<&DeviceHealth> for pb::DeviceHealth {
    fn from(d: &DeviceHealth) -> Self {
        let unix = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        };
        Self {
            device: Some(pb::DeviceIdentifier {
                pool_name: d.pool_name.clone(),
                device_name: d.device_name.clone(),
            }),
            health: pb::HealthStatus::from(d.status).into(),
            last_updated_time: unix(d.last_updated),
            health_check_timeout_seconds: d
                .timeout
                .map_or(0, |t| i64::try_from(t.as_secs()).unwrap_or(i64::MAX)),
            message: d.message.clone(),
        }
    }
}

/// The `v1alpha1.DRAResourceHealth` service: every stream sends the current snapshot at once,
/// then each new snapshot, and ends when the sender is gone or the server stops.
pub(crate) struct HealthService {
    pub(crate) health: watch::Receiver<Vec<DeviceHealth>>,
    pub(crate) stop: watch::Receiver<bool>,
}

type ResponseStream =
    Pin<Box<dyn Stream<Item = Result<pb::NodeWatchResourcesResponse, Status>> + Send>>;

fn response(devices: &[DeviceHealth]) -> pb::NodeWatchResourcesResponse {
    pb::NodeWatchResourcesResponse {
        devices: devices.iter().map(Into::into).collect(),
    }
}

#[tonic::async_trait]
impl pb::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ResponseStream;

    async fn node_watch_resources(
        &self,
        _: Request<pb::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let mut health = self.health.clone();
        // The first item is the snapshot current at connect time.
        health.mark_changed();
        let stream = futures::stream::unfold(
            (health, self.stop.clone()),
            |(mut health, mut stop)| async move {
                tokio::select! {
                    changed = health.changed() => changed.ok()?,
                    _ = stop.wait_for(|s| *s) => return None,
                }
                let item = response(&health.borrow_and_update());
                Some((Ok(item), (health, stop)))
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_health_converts_with_unix_seconds_and_timeout() {
        let d = DeviceHealth {
            pool_name: "node-a".into(),
            device_name: "gpu-0".into(),
            status: HealthStatus::Unhealthy,
            message: "xid-79".into(),
            last_updated: SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_900),
            timeout: Some(Duration::from_secs(90)),
        };
        let p = pb::DeviceHealth::from(&d);
        assert_eq!(p.last_updated_time, 1_700_000_000);
        assert_eq!(p.health_check_timeout_seconds, 90);
        assert_eq!(p.health(), pb::HealthStatus::Unhealthy);
        assert_eq!(p.device.map(|i| i.device_name).as_deref(), Some("gpu-0"));
        let default = pb::DeviceHealth::from(&DeviceHealth { timeout: None, ..d });
        assert_eq!(default.health_check_timeout_seconds, 0);
    }
}
