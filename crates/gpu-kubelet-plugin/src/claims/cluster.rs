//! What the claim controller needs from the cluster: reading ResourceClaims and reporting
//! warnings. The API server in production, an in-memory double in unit tests.

use std::future::Future;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
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
}

/// The API server, for one node.
#[derive(Clone)]
pub struct KubeCluster {
    client: kube::Client,
    node_name: String,
    controller: String,
}

impl KubeCluster {
    /// Reads claims through `client`; events are about Node `node_name`, reported by
    /// `<driver>/kubelet-plugin`.
    pub fn new(client: kube::Client, driver_name: &str, node_name: &str) -> Self {
        Self {
            client,
            node_name: node_name.to_owned(),
            controller: format!("{driver_name}/kubelet-plugin"),
        }
    }
}

impl Cluster for KubeCluster {
    async fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ResourceClaim>, kube::Error> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
    }

    async fn warn(&self, reason: &str, message: &str) {
        warn!(reason, message, "warning event");
        let now = k8s_openapi::jiff::Timestamp::now();
        let event = Event {
            metadata: ObjectMeta {
                // Named as client-go's recorder names events, `<object>.<unix ns in hex>`. A
                // generateName `<node>.` is refused: a name prefix must not end in a dot.
                name: Some(format!("{}.{:x}", self.node_name, now.as_nanosecond())),
                namespace: Some("default".into()),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some("Warning".into()),
            reason: Some(reason.into()),
            note: Some(message.chars().take(1024).collect()),
            action: Some("Recover".into()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(format!("{}-{}", self.controller, self.node_name)),
            regarding: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(self.node_name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        };
        if let Err(e) = Api::<Event>::namespaced(self.client.clone(), "default")
            .create(&PostParams::default(), &event)
            .await
        {
            warn!(error = %e, reason, "could not record the warning event");
        }
    }
}
