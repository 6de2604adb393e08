//! Acting as the kubelet: its calls to a DRA plugin, over the plugin's real Unix sockets.

use std::path::Path;

use dra_kubelet::client::{DraPluginV1Client, DraPluginV1beta1Client, RegistrationClient, connect};
use dra_kubelet::proto::{dra_v1, dra_v1beta1, pluginregistration};
use k8s_openapi::api::resource::v1::ResourceClaim;

/// A kubelet call failed (the RPC itself, not a per-claim error).
#[derive(Debug, thiserror::Error)]
#[error("acting as the kubelet: {problem}")]
pub struct KubeletError {
    /// Which call, and why.
    pub problem: String,
}

/// A kubelet's view of one DRA plugin.
pub struct Kubelet {
    /// Registration service client.
    pub registration: RegistrationClient<tonic::transport::Channel>,
    /// `v1.DRAPlugin` client.
    pub v1: DraPluginV1Client<tonic::transport::Channel>,
    /// `v1beta1.DRAPlugin` client.
    pub v1beta1: DraPluginV1beta1Client<tonic::transport::Channel>,
}

impl Kubelet {
    /// Registers the plugin the way the kubelet's plugin watcher does: dial the registration
    /// socket, `GetInfo`, dial the advertised endpoint, then `NotifyRegistrationStatus`.
    /// Returns the plugin's info along with the clients.
    ///
    /// # Errors
    /// [`KubeletError`] when a socket cannot be dialled or a call fails.
    pub async fn register(
        registration_socket: &Path,
    ) -> Result<(Self, pluginregistration::PluginInfo), KubeletError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| KubeletError {
            problem: format!("{what}: {e}"),
        };
        // The plugin watcher retries a socket that is not accepting yet; so do we, briefly.
        let mut attempt = 0;
        let (mut registration, info) = loop {
            attempt += 1;
            let tried = async {
                let mut client = RegistrationClient::new(
                    connect(registration_socket)
                        .await
                        .map_err(|e| fail("dialling the registration socket", &e))?,
                );
                let info = client
                    .get_info(pluginregistration::InfoRequest {})
                    .await
                    .map_err(|e| fail("GetInfo", &e))?
                    .into_inner();
                Ok::<_, KubeletError>((client, info))
            }
            .await;
            match tried {
                Ok(ok) => break ok,
                Err(e) if attempt >= 50 => return Err(e),
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        };
        let channel = connect(&info.endpoint)
            .await
            .map_err(|e| fail("dialling the advertised endpoint", &e))?;
        registration
            .notify_registration_status(pluginregistration::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .map_err(|e| fail("NotifyRegistrationStatus", &e))?;
        Ok((
            Self {
                registration,
                v1: DraPluginV1Client::new(channel.clone()),
                v1beta1: DraPluginV1beta1Client::new(channel),
            },
            info,
        ))
    }

    /// `v1.NodePrepareResources` for `claims`.
    ///
    /// # Errors
    /// [`KubeletError`] when the RPC itself fails.
    pub async fn prepare_v1(
        &mut self,
        claims: &[&ResourceClaim],
    ) -> Result<dra_v1::NodePrepareResourcesResponse, KubeletError> {
        let claims = claims.iter().map(|c| v1_claim(c)).collect();
        self.v1
            .node_prepare_resources(dra_v1::NodePrepareResourcesRequest { claims })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|e| KubeletError {
                problem: format!("v1 NodePrepareResources: {e}"),
            })
    }

    /// `v1beta1.NodePrepareResources` for `claims`.
    ///
    /// # Errors
    /// [`KubeletError`] when the RPC itself fails.
    pub async fn prepare_v1beta1(
        &mut self,
        claims: &[&ResourceClaim],
    ) -> Result<dra_v1beta1::NodePrepareResourcesResponse, KubeletError> {
        let claims = claims
            .iter()
            .map(|c| {
                let c = v1_claim(c);
                dra_v1beta1::Claim {
                    namespace: c.namespace,
                    uid: c.uid,
                    name: c.name,
                }
            })
            .collect();
        self.v1beta1
            .node_prepare_resources(dra_v1beta1::NodePrepareResourcesRequest { claims })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|e| KubeletError {
                problem: format!("v1beta1 NodePrepareResources: {e}"),
            })
    }

    /// `v1.NodeUnprepareResources` for `claims`.
    ///
    /// # Errors
    /// [`KubeletError`] when the RPC itself fails.
    pub async fn unprepare_v1(
        &mut self,
        claims: Vec<dra_v1::Claim>,
    ) -> Result<dra_v1::NodeUnprepareResourcesResponse, KubeletError> {
        self.v1
            .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest { claims })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|e| KubeletError {
                problem: format!("v1 NodeUnprepareResources: {e}"),
            })
    }
}

/// The claim reference the kubelet sends for `claim`.
pub fn v1_claim(claim: &ResourceClaim) -> dra_v1::Claim {
    dra_v1::Claim {
        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
        uid: claim.metadata.uid.clone().unwrap_or_default(),
        name: claim.metadata.name.clone().unwrap_or_default(),
    }
}
