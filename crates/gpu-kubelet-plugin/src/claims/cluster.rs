//! What the claim controller needs from the cluster: reading ResourceClaims and reporting
//! warnings. The API server in production, an in-memory double in unit tests.
//!
//! Every call to the API server has a deadline ([`KubeCluster::with_timeout`]): a claim read
//! that misses it fails (the caller's retry policy applies: the kubelet calls prepare again,
//! the stale-claim check and usage sampling try at their next round, recovery keeps a claim it
//! cannot look up as its CDI spec shows), and a warning event is written in the background,
//! so a slow API server never delays the work it reports on.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use tracing::warn;

/// The cluster, as the claim controller sees it.
pub trait Cluster: Send + Sync + 'static {
    /// The claim `namespace/name`, `Ok(None)` when it does not exist.
    fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<ResourceClaim>, kube::Error>> + Send;

    /// Reports a Warning event about this node (best effort: failures are logged).
    fn warn(&self, reason: &str, message: &str) -> impl Future<Output = ()> + Send;

    /// Makes `devices` this driver's entries of claim `namespace/name`'s `status.devices`
    /// (KEP-4817), replacing the ones it wrote before; none removes them. The API server lets
    /// a plugin's token write them only for claims allocated on its own node
    /// (`DRAResourceClaimGranularStatusAuthorization`, beta in 1.36: `associated-node:patch` on
    /// `resourceclaims/driver`). The default writes nothing.
    fn set_device_status(
        &self,
        namespace: &str,
        name: &str,
        devices: Vec<AllocatedDeviceStatus>,
    ) -> impl Future<Output = Result<(), kube::Error>> + Send {
        let _ = (namespace, name, devices);
        async { Ok(()) }
    }
}

use crate::config::DEFAULT_API_TIMEOUT;

/// The API server, for one node.
#[derive(Clone)]
pub struct KubeCluster {
    client: kube::Client,
    node_name: String,
    controller: String,
    timeout: Duration,
}

impl KubeCluster {
    /// Reads claims through `client`; events are about Node `node_name`, reported by
    /// `<driver>/kubelet-plugin`. Each call's deadline is [`DEFAULT_API_TIMEOUT`].
    pub fn new(client: kube::Client, driver_name: &str, node_name: &str) -> Self {
        Self {
            client,
            node_name: node_name.to_owned(),
            controller: format!("{driver_name}/kubelet-plugin"),
            timeout: DEFAULT_API_TIMEOUT,
        }
    }

    /// The same with each call's deadline `timeout`.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// `call` within the deadline; a call that misses it is a [`kube::Error::Service`] holding
    /// an `io::ErrorKind::TimedOut` that names the deadline and what was asked.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, kube::Error> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(kube::Error::Service(Box::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the API server did not answer {what} within {} ms",
                    self.timeout.as_millis()
                ),
            )))),
        }
    }
}

impl Cluster for KubeCluster {
    async fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ResourceClaim>, kube::Error> {
        let api = Api::<ResourceClaim>::namespaced(self.client.clone(), namespace);
        self.bounded(
            &format!("a read of ResourceClaim {namespace}/{name}"),
            api.get_opt(name),
        )
        .await
    }

    /// In the background: the caller goes on at once.
    async fn warn(&self, reason: &str, message: &str) {
        let (this, reason, message) = (self.clone(), reason.to_owned(), message.to_owned());
        tokio::spawn(async move { this.warning(&reason, "Recover", &message).await });
    }

    /// A server-side apply of the claim's status, field manager `<driver>/kubelet-plugin`:
    /// the entries it names become this manager's, those it wrote before and leaves out go.
    async fn set_device_status(
        &self,
        namespace: &str,
        name: &str,
        devices: Vec<AllocatedDeviceStatus>,
    ) -> Result<(), kube::Error> {
        let api = Api::<ResourceClaim>::namespaced(self.client.clone(), namespace);
        let body = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"devices": devices},
        });
        let params = PatchParams::apply(&self.controller).force();
        let patch = Patch::Apply(&body);
        self.bounded(
            &format!("the status of ResourceClaim {namespace}/{name}"),
            api.patch_status(name, &params, &patch),
        )
        .await
        .map(drop)
    }
}

impl KubeCluster {
    /// A Warning event about this node with `reason`, `action` (what the plugin was doing, e.g.
    /// `Recover`, `Publish`) and `message` (cut to the API's 1 KiB); best effort, failures
    /// are logged. Within the deadline.
    pub async fn warning(&self, reason: &str, action: &str, message: &str) {
        warn!(reason, message, "warning event");
        let regarding = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node_name.clone()),
            ..Default::default()
        };
        self.event(
            "default",
            &self.node_name,
            regarding,
            reason,
            action,
            message,
        )
        .await;
    }

    /// A Warning event in `namespace` about `regarding` (named `name`); best effort.
    async fn event(
        &self,
        namespace: &str,
        name: &str,
        regarding: ObjectReference,
        reason: &str,
        action: &str,
        message: &str,
    ) {
        let now = k8s_openapi::jiff::Timestamp::now();
        let event = Event {
            metadata: ObjectMeta {
                name: Some(event_name(name, now.as_nanosecond())),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some("Warning".into()),
            reason: Some(reason.into()),
            note: Some(message.chars().take(1024).collect()),
            action: Some(action.into()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(reporting_instance(&self.controller, &self.node_name)),
            regarding: Some(regarding),
            ..Default::default()
        };
        let api = Api::<Event>::namespaced(self.client.clone(), namespace);
        let params = PostParams::default();
        let create = api.create(&params, &event);
        if let Err(e) = self
            .bounded(&format!("an event about {name}"), create)
            .await
        {
            warn!(error = %e, reason, "could not record the warning event");
        }
    }
}

/// The API server's limit on an object name (a DNS-1123 subdomain).
const MAX_NAME: usize = 253;
/// The API server's limit on `reportingController` and `reportingInstance` of an Event
/// (`ValidateEventCreate`, `pkg/apis/core/validation/events.go`).
const MAX_REPORTING: usize = 128;

/// An Event name as client-go's recorder makes one, `<object>.<unix ns in hex>`, with the object
/// name cut so that the whole stays within [`MAX_NAME`] for a node name of any allowed length
/// (client-go does not cut, so its events about a 253-character node are refused). A cut
/// ending in `.` or `-` is trimmed, to stay a DNS subdomain. (A `generateName` of `<node>.` is
/// no way out: a name prefix must not end in a dot.)
fn event_name(object: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    let keep = MAX_NAME.saturating_sub(suffix.len()).min(object.len());
    // Object names are ASCII; a cut never splits a character.
    let base = object.get(..keep).unwrap_or(object);
    format!("{}{suffix}", base.trim_end_matches(['.', '-']))
}

/// `<controller>-<node>`, cut to the API server's 128 characters for long node names.
fn reporting_instance(controller: &str, node: &str) -> String {
    let mut instance = format!("{controller}-{node}");
    if instance.len() > MAX_REPORTING {
        let cut = (0..=MAX_REPORTING)
            .rev()
            .find(|i| instance.is_char_boundary(*i))
            .unwrap_or(0);
        instance.truncate(cut);
    }
    instance
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_and_reporting_instances_fit_for_a_253_character_node() {
        let node = format!(
            "{}.{}.{}.{}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61)
        );
        assert_eq!(node.len(), 253);
        let name = event_name(&node, 0x187a_2b3c_4d5e_6f70);
        assert!(name.len() <= MAX_NAME, "{}", name.len());
        assert!(name.ends_with(".187a2b3c4d5e6f70"), "{name}");
        assert!(!name.contains("..") && !name.contains(".-"), "{name}");
        assert_eq!(event_name("gpu-node-0", 0xff), "gpu-node-0.ff");
        let instance = reporting_instance("gpu.drust.dev/kubelet-plugin", &node);
        assert_eq!(instance.len(), MAX_REPORTING);
        assert_eq!(
            reporting_instance("gpu.drust.dev/kubelet-plugin", "gpu-node-0"),
            "gpu.drust.dev/kubelet-plugin-gpu-node-0"
        );
    }
}
