//! The `pluginregistration.Registration` service the kubelet's plugin watcher dials.

use std::path::PathBuf;

use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info};

use crate::DRA_PLUGIN_TYPE;
use crate::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus as RegistrationStatusMsg,
    RegistrationStatusResponse, registration_server::Registration,
};

/// What the kubelet last told us through `NotifyRegistrationStatus`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RegistrationStatus {
    /// No notification yet.
    #[default]
    Pending,
    /// The kubelet registered the plugin.
    Registered,
    /// The kubelet refused the plugin, with its reason.
    Failed(String),
}

/// Serves `GetInfo` and records `NotifyRegistrationStatus`.
pub(crate) struct RegistrationService {
    pub(crate) driver_name: String,
    pub(crate) endpoint: PathBuf,
    /// The DRAPlugin versions, then the other services served (e.g. the health service).
    pub(crate) supported_versions: Vec<String>,
    pub(crate) status: watch::Sender<RegistrationStatus>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_owned(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: self.supported_versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatusMsg>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let msg = request.into_inner();
        let status = if msg.plugin_registered {
            info!(driver = %self.driver_name, "kubelet registered the plugin");
            RegistrationStatus::Registered
        } else {
            error!(driver = %self.driver_name, error = %msg.error, "kubelet rejected the plugin");
            RegistrationStatus::Failed(msg.error)
        };
        self.status.send_replace(status);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
