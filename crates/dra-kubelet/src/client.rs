//! Dialing a plugin's Unix sockets from Rust, for tests of what the kubelet never sends and for
//! tools.
//!
//! This is not how the kubelet dials: its plugin watcher uses grpc-go's `DialContext` on the bare
//! socket path, which sends the percent-encoded path as `:authority`, while this client sends a
//! fixed `[::]:50051`. Tests of the kubelet's behaviour use its own code
//! (`tests/gotools/cmd/kubeletpeer`, `drust_gotools::KubeletPeer`); a client of ours would share
//! our assumptions, which is how issue 11 went unnoticed.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

pub use crate::proto::dra_v1::dra_plugin_client::DraPluginClient as DraPluginV1Client;
pub use crate::proto::dra_v1beta1::dra_plugin_client::DraPluginClient as DraPluginV1beta1Client;
pub use crate::proto::health_v1alpha1::dra_resource_health_client::DraResourceHealthClient;
pub use crate::proto::pluginregistration::registration_client::RegistrationClient;

/// Opens a gRPC channel to the Unix socket at `path`.
///
/// # Errors
/// The transport error when the socket cannot be reached.
pub async fn connect(path: impl AsRef<Path>) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.as_ref().to_owned();
    // The URI is ignored by the connector; tonic requires a syntactically valid one.
    Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}
