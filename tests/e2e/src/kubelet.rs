//! The kubelet's calls to a DRA plugin, made by the kubelet's own code.
//!
//! [`Kubelet`] drives `tests/gotools/cmd/kubeletpeer` ([`drust_gotools::KubeletPeer`]), which
//! is the kubelet v1.36.3 registration operation and DRA plugin client: it dials the
//! registration socket with grpc-go's `DialContext` on the bare path, the DRA socket with
//! `grpc.NewClient("unix:" + endpoint)`, and calls prepare, unprepare and the health stream
//! with the kubelet's options and per-call timeout (45 s). No test acts as the kubelet with a
//! client of ours: a stand-in written by us would share our assumptions (issue 11).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dra_kubelet::proto::{dra_v1, health_v1alpha1, pluginregistration};
use drust_gotools::{KubeletPeer, PeerEvent, Service};
use k8s_openapi::api::resource::v1::ResourceClaim;
use prost::Message as _;
use tokio::sync::broadcast;

/// A kubelet call failed (the RPC itself, not a per-claim error).
#[derive(Debug, thiserror::Error)]
#[error("kubelet: {problem}")]
pub struct KubeletError {
    /// Which call, and why (the kubelet's own message where it gave one).
    pub problem: String,
}

fn fail(what: &str, e: &dyn std::fmt::Display) -> KubeletError {
    KubeletError {
        problem: format!("{what}: {e}"),
    }
}

/// One kubelet, and the plugin it registered. Clones share the kubelet (and its connection).
#[derive(Clone)]
pub struct Kubelet {
    peer: Arc<KubeletPeer>,
    driver: String,
    /// The health stream's messages from registration on, until [`Kubelet::health`] takes them.
    health: Arc<Mutex<Option<broadcast::Receiver<PeerEvent>>>>,
}

impl Kubelet {
    /// Registers the plugin behind `registration_socket` as the kubelet's plugin manager does
    /// once it has seen the socket: waits up to 10 s for the socket file, then runs the
    /// kubelet's registration (dial, `GetInfo`, validation, the DRA handler's dial of the
    /// advertised endpoint and its health stream, `NotifyRegistrationStatus`), retrying a
    /// failed attempt as the plugin manager does (every 500 ms here, for 10 s).
    /// Returns the plugin's info as `GetInfo` gave it.
    ///
    /// # Errors
    /// [`KubeletError`] with the kubelet's message when registration keeps failing.
    pub async fn register(
        registration_socket: &Path,
    ) -> Result<(Self, pluginregistration::PluginInfo), KubeletError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !registration_socket.exists() {
            if Instant::now() > deadline {
                return Err(fail(
                    "waiting for the registration socket",
                    &registration_socket.display(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let peer = KubeletPeer::start()
            .await
            .map_err(|e| fail("starting the kubelet", &e))?;
        let events = peer.events();
        let registration = loop {
            match peer.register(registration_socket).await {
                Ok(r) => break r,
                Err(e) if Instant::now() > deadline => return Err(fail("registration", &e)),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        let info = pluginregistration::PluginInfo {
            r#type: dra_kubelet::DRA_PLUGIN_TYPE.to_owned(),
            name: registration.driver.clone(),
            endpoint: registration.endpoint,
            supported_versions: registration.services,
        };
        Ok((
            Self {
                peer: Arc::new(peer),
                driver: registration.driver,
                health: Arc::new(Mutex::new(Some(events))),
            },
            info,
        ))
    }

    /// `NodePrepareResources` for `claims` with the kubelet's chosen service (`v1.DRAPlugin`).
    ///
    /// # Errors
    /// [`KubeletError`] when the RPC itself fails.
    pub async fn prepare_v1(
        &self,
        claims: &[&ResourceClaim],
    ) -> Result<dra_v1::NodePrepareResourcesResponse, KubeletError> {
        self.prepare(Service::V1, claims).await
    }

    /// `NodePrepareResources` the way the kubelet calls a plugin that offers only
    /// `v1beta1.DRAPlugin`: over v1beta1, answered in the kubelet's v1 form.
    ///
    /// # Errors
    /// [`KubeletError`] when the RPC itself fails.
    pub async fn prepare_v1beta1(
        &self,
        claims: &[&ResourceClaim],
    ) -> Result<dra_v1::NodePrepareResourcesResponse, KubeletError> {
        self.prepare(Service::V1beta1, claims).await
    }

    async fn prepare(
        &self,
        service: Service,
        claims: &[&ResourceClaim],
    ) -> Result<dra_v1::NodePrepareResourcesResponse, KubeletError> {
        let request = dra_v1::NodePrepareResourcesRequest {
            claims: claims.iter().map(|c| v1_claim(c)).collect(),
        };
        self.peer
            .prepare(&self.driver, service, &request)
            .await
            .map_err(|e| fail(&format!("{service:?} NodePrepareResources"), &e))
    }

    /// `NodeUnprepareResources` for `claims` over `v1.DRAPlugin`.
    ///
    /// # Errors
    /// [`KubeletError`] when the RPC itself fails.
    pub async fn unprepare_v1(
        &self,
        claims: Vec<dra_v1::Claim>,
    ) -> Result<dra_v1::NodeUnprepareResourcesResponse, KubeletError> {
        self.unprepare(Service::V1, claims).await
    }

    /// `NodeUnprepareResources` over `v1beta1.DRAPlugin`, as [`Kubelet::prepare_v1beta1`].
    ///
    /// # Errors
    /// [`KubeletError`] when the RPC itself fails.
    pub async fn unprepare_v1beta1(
        &self,
        claims: Vec<dra_v1::Claim>,
    ) -> Result<dra_v1::NodeUnprepareResourcesResponse, KubeletError> {
        self.unprepare(Service::V1beta1, claims).await
    }

    async fn unprepare(
        &self,
        service: Service,
        claims: Vec<dra_v1::Claim>,
    ) -> Result<dra_v1::NodeUnprepareResourcesResponse, KubeletError> {
        let request = dra_v1::NodeUnprepareResourcesRequest { claims };
        self.peer
            .unprepare(&self.driver, service, &request)
            .await
            .map_err(|e| fail(&format!("{service:?} NodeUnprepareResources"), &e))
    }

    /// The messages of the `NodeWatchResources` stream the kubelet opened at registration
    /// (when the plugin advertised the health service): the first call gets them from
    /// registration on, later calls from then on. The kubelet reopens the stream every 5 s
    /// when it ends.
    pub fn health(&self) -> HealthStream {
        let taken = self.health.lock().ok().and_then(|mut h| h.take());
        HealthStream {
            events: taken.unwrap_or_else(|| self.peer.events()),
            driver: self.driver.clone(),
        }
    }
}

/// The kubelet's health stream for one driver, as [`Kubelet::health`] gives it.
pub struct HealthStream {
    events: broadcast::Receiver<PeerEvent>,
    driver: String,
}

impl HealthStream {
    /// The next message; `None` once the kubelet is gone.
    ///
    /// # Errors
    /// [`KubeletError`] when a message does not decode.
    pub async fn message(
        &mut self,
    ) -> Result<Option<health_v1alpha1::NodeWatchResourcesResponse>, KubeletError> {
        loop {
            match self.events.recv().await {
                Ok(PeerEvent::Health { driver, response }) if driver == self.driver => {
                    return health_v1alpha1::NodeWatchResourcesResponse::decode(
                        response.as_slice(),
                    )
                    .map(Some)
                    .map_err(|e| fail("decoding a health message", &e));
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    return Err(fail("health stream", &format!("missed {n} events")));
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(None),
            }
        }
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
