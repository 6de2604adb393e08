//! A client of the kubelet's PodResources API (`v1.PodResourcesLister/List`, KEP-606; DRA
//! devices per container since KEP-3695, GA in Kubernetes 1.36): which containers of which pods
//! on this node hold which DRA devices. Read-only; the kubelet serves it on
//! `<root-dir>/pod-resources/kubelet.sock` ([`DEFAULT_SOCKET`]), as DCGM exporter reads it to
//! name the container of a GPU.
//!
//! Each [`list`] dials the socket afresh (the kubelet re-creates it when it restarts) and is
//! bounded by one timeout, dial included. The kubelet rate-limits the API for all its callers
//! together (100 calls/s, burst 10, in `pkg/kubelet/apis/podresources/constants.go`) and
//! answers the excess `ResourceExhausted` ([`PodResourcesError::Call`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::Endpoint;

use crate::proto::podresources_v1::ListPodResourcesRequest;
use crate::proto::podresources_v1::pod_resources_lister_client::PodResourcesListerClient;

/// Where the kubelet serves the API with its default `--root-dir` (`/var/lib/kubelet`).
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The largest answer accepted, bytes (a node of 110 pods answers a few tens of KiB).
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// One pod the kubelet runs, with the DRA devices of each container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodDevices {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// Its containers (every one, with or without DRA devices).
    pub containers: Vec<ContainerDevices>,
}

/// One container and the DRA devices it was given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerDevices {
    /// The container's name in the pod spec.
    pub name: String,
    /// Every device of every claim the container references.
    pub devices: Vec<ClaimDevice>,
}

/// One allocated device of a claim, as a container holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimDevice {
    /// The claim's namespace.
    pub claim_namespace: String,
    /// The claim's name (the generated name, for a claim from a template).
    pub claim_name: String,
    /// The driver that prepared the device.
    pub driver: String,
    /// Its pool.
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The share's ID, for a device allocated with consumable capacity.
    pub share_id: Option<String>,
}

/// Why a [`list`] failed.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket could not be dialed (no kubelet, or a path the process cannot reach).
    #[error("dialing the kubelet's PodResources socket {socket}: {reason}")]
    Dial {
        /// The socket.
        socket: PathBuf,
        /// The transport's error, with its causes.
        reason: String,
    },
    /// The kubelet refused or failed the call.
    #[error("the kubelet's PodResources List on {socket}: {status}")]
    Call {
        /// The socket.
        socket: PathBuf,
        /// The gRPC status.
        status: Box<tonic::Status>,
    },
    /// No answer within the timeout.
    #[error("the kubelet's PodResources List on {socket} took longer than {timeout:?}")]
    Timeout {
        /// The socket.
        socket: PathBuf,
        /// The timeout.
        timeout: Duration,
    },
}

/// Every pod the kubelet at `socket` runs, with each container's DRA devices, within `timeout`.
///
/// # Errors
/// [`PodResourcesError`]: the socket cannot be dialed, the call fails, or `timeout` passes.
pub async fn list(socket: &Path, timeout: Duration) -> Result<Vec<PodDevices>, PodResourcesError> {
    match tokio::time::timeout(timeout, list_unbounded(socket)).await {
        Ok(answer) => answer,
        Err(_) => Err(PodResourcesError::Timeout {
            socket: socket.to_owned(),
            timeout,
        }),
    }
}

async fn list_unbounded(socket: &Path) -> Result<Vec<PodDevices>, PodResourcesError> {
    let path = socket.to_owned();
    // The URI is not used to dial; tonic wants a valid one (grpc-go's server ignores :authority).
    let channel = Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|e| PodResourcesError::Dial {
            socket: socket.to_owned(),
            reason: causes(&e),
        })?;
    let answer = PodResourcesListerClient::new(channel)
        .max_decoding_message_size(MAX_ANSWER_BYTES)
        .list(ListPodResourcesRequest {})
        .await
        .map_err(|status| PodResourcesError::Call {
            socket: socket.to_owned(),
            status: Box::new(status),
        })?;
    Ok(answer
        .into_inner()
        .pod_resources
        .into_iter()
        .map(|pod| PodDevices {
            namespace: pod.namespace,
            name: pod.name,
            containers: pod
                .containers
                .into_iter()
                .map(|c| ContainerDevices {
                    name: c.name,
                    devices: c
                        .dynamic_resources
                        .into_iter()
                        .flat_map(|claim| {
                            let (namespace, name) = (claim.claim_namespace, claim.claim_name);
                            claim.claim_resources.into_iter().map(move |r| ClaimDevice {
                                claim_namespace: namespace.clone(),
                                claim_name: name.clone(),
                                driver: r.driver_name,
                                pool: r.pool_name,
                                device: r.device_name,
                                share_id: r.share_id,
                            })
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect())
}

/// `e` and its causes, `: `-separated (tonic's own message is only "transport error").
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::podresources_v1 as pb;
    use crate::proto::podresources_v1::pod_resources_lister_server::{
        PodResourcesLister, PodResourcesListerServer,
    };
    use tokio_stream::wrappers::UnixListenerStream;

    /// Answers with `pods`, or never when `hang`.
    struct Kubelet {
        pods: Vec<pb::PodResources>,
        hang: bool,
    }

    #[tonic::async_trait]
    impl PodResourcesLister for Kubelet {
        async fn list(
            &self,
            _: tonic::Request<pb::ListPodResourcesRequest>,
        ) -> Result<tonic::Response<pb::ListPodResourcesResponse>, tonic::Status> {
            if self.hang {
                std::future::pending::<()>().await;
            }
            Ok(tonic::Response::new(pb::ListPodResourcesResponse {
                pod_resources: self.pods.clone(),
            }))
        }
    }

    fn serve(dir: &Path, kubelet: Kubelet) -> PathBuf {
        let socket = dir.join("kubelet.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(kubelet))
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        socket
    }

    // The real kubelet's answers are tested on the real node (`tests/e2e/tests/real_node.rs`);
    // these are the shapes and failures it cannot be made to produce.
    #[tokio::test]
    async fn a_claim_with_two_devices_names_each_for_its_container() {
        let dir = tempfile::tempdir().unwrap();
        let resource = |device: &str| pb::ClaimResource {
            cdi_devices: vec![pb::CdiDevice {
                name: format!("k8s.gpu.example.com/claim=uid-{device}"),
            }],
            driver_name: "gpu.example.com".into(),
            pool_name: "node-a".into(),
            device_name: device.into(),
            share_id: None,
        };
        let socket = serve(
            dir.path(),
            Kubelet {
                pods: vec![pb::PodResources {
                    name: "trainer".into(),
                    namespace: "team".into(),
                    containers: vec![
                        pb::ContainerResources {
                            name: "main".into(),
                            dynamic_resources: vec![pb::DynamicResource {
                                claim_name: "trainer-gpus-x7".into(),
                                claim_namespace: "team".into(),
                                claim_resources: vec![resource("gpu-0"), resource("gpu-1")],
                            }],
                        },
                        pb::ContainerResources {
                            name: "sidecar".into(),
                            dynamic_resources: Vec::new(),
                        },
                    ],
                }],
                hang: false,
            },
        );
        let pods = list(&socket, Duration::from_secs(5)).await.unwrap();
        assert_eq!(pods.len(), 1);
        assert_eq!(
            (pods[0].namespace.as_str(), pods[0].name.as_str()),
            ("team", "trainer")
        );
        let main = &pods[0].containers[0];
        assert_eq!(main.name, "main");
        let devices: Vec<&str> = main.devices.iter().map(|d| d.device.as_str()).collect();
        assert_eq!(devices, ["gpu-0", "gpu-1"]);
        assert!(
            main.devices
                .iter()
                .all(|d| d.claim_name == "trainer-gpus-x7"
                    && d.claim_namespace == "team"
                    && d.driver == "gpu.example.com"
                    && d.pool == "node-a")
        );
        assert!(pods[0].containers[1].devices.is_empty());
    }

    #[tokio::test]
    async fn no_socket_is_a_dial_error_naming_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("absent.sock");
        let e = list(&socket, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, PodResourcesError::Dial { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("absent.sock") && text.contains("No such file"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_kubelet_that_never_answers_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let socket = serve(
            dir.path(),
            Kubelet {
                pods: Vec::new(),
                hang: true,
            },
        );
        let e = list(&socket, Duration::from_millis(200)).await.unwrap_err();
        assert!(matches!(e, PodResourcesError::Timeout { .. }), "{e}");
    }
}
