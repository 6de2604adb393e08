//! The Kubernetes API client the plugin's calls go through: from `--kubeconfig` or the
//! in-cluster environment, with `--api-timeout` bounding every call.

use crate::config::Config;
use crate::error::Error;

/// Builds the Kubernetes client from `--kubeconfig` or the in-cluster environment, with
/// `config.api_timeout` as its connect, read and write timeout.
///
/// # Errors
/// [`Error::KubeConfig`].
pub async fn kube_client(config: &Config) -> Result<kube::Client, Error> {
    let (origin, cfg) = match &config.kubeconfig {
        Some(path) => {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(path).map_err(|e| Error::KubeConfig {
                    origin: path.display().to_string(),
                    message: e.to_string(),
                })?;
            let cfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .map_err(|e| Error::KubeConfig {
                    origin: path.display().to_string(),
                    message: e.to_string(),
                });
            (path.display().to_string(), cfg)
        }
        None => (
            "in-cluster".to_owned(),
            kube::Config::incluster().map_err(|e| Error::KubeConfig {
                origin: "in-cluster".into(),
                message: e.to_string(),
            }),
        ),
    };
    // kube's own default has no read or write timeout: a blackholed API server would hold a
    // claim's lock (and start-up) for ever. The plugin makes no watches, so one deadline bounds
    // every call's reads; `KubeCluster` bounds each claim read and event as a whole too.
    let mut cfg = cfg?;
    cfg.connect_timeout = Some(config.api_timeout);
    cfg.read_timeout = Some(config.api_timeout);
    cfg.write_timeout = Some(config.api_timeout);
    kube::Client::try_from(cfg).map_err(|e| Error::KubeConfig {
        origin,
        message: e.to_string(),
    })
}
