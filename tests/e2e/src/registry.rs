//! A container image registry on this machine and the plugin image pushed to it, as a user
//! installs drust: `deploy/Dockerfile` built and pushed by tag with buildah
//! (`tests/scripts/build-image.sh`) to CNCF Distribution's registry
//! (`tests/scripts/build-registry.sh`, from its Go module), from where the node's containerd
//! pulls it (`Node::trust_registry`).
//!
//! The registry serves plain HTTP on loopback only: the node's containerd runs on this machine,
//! and is told so for this one host through its `hosts.toml`.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::scripts::{ScriptError, last_line, script_path};

/// How long a registry has to answer `/v2/` after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The registry or the image could not be had.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A build script could not run or failed.
    #[error(transparent)]
    Script(#[from] ScriptError),
    /// The registry's directory or configuration could not be written, or it could not start.
    #[error("registry: {0}")]
    Io(#[from] std::io::Error),
    /// The registry did not answer `GET /v2/` with 200 in time.
    #[error("the registry on port {port} did not answer GET /v2/ within {START_TIMEOUT:?}: {last}")]
    NotServing {
        /// Its port.
        port: u16,
        /// The last answer or error.
        last: String,
    },
}

/// A running registry (killed on drop), storing its blobs in a temporary directory.
pub struct Registry {
    port: u16,
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// Builds the registry when not cached, starts it on a free loopback port and waits until
    /// it answers `GET /v2/` (the distribution API's version check) with 200.
    ///
    /// # Errors
    /// [`RegistryError`] when it cannot be built, started, or does not answer in time.
    pub async fn start() -> Result<Self, RegistryError> {
        let binary = PathBuf::from(last_line(&script_path("build-registry.sh"), &[]).await?);
        let dir = tempfile::Builder::new()
            .prefix("drust-registry-")
            .tempdir()?;
        let port = crate::ports::free_port()?;
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog: {{level: warn}}\nstorage:\n  filesystem: {{rootdirectory: {}}}\nhttp:\n  addr: 127.0.0.1:{port}\n",
                dir.path().join("data").display()
            ),
        )?;
        let log = std::fs::File::create(dir.path().join("registry.log"))?;
        let mut command = tokio::process::Command::new(binary);
        command
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        crate::die_with_parent(command.as_std_mut());
        let child = command.spawn()?;
        let registry = Self {
            port,
            _child: child,
            _dir: dir,
        };
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            let last = match crate::http::get(port, "/v2/").await {
                Ok((200, _)) => return Ok(registry),
                Ok((status, body)) => format!("{status} {body}"),
                Err(e) => e.to_string(),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(RegistryError::NotServing { port, last });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `127.0.0.1:<port>`: the registry's host in image names.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Builds the plugin image from `deploy/Dockerfile` (`tests/scripts/build-image.sh`; a
    /// rebuild of unchanged sources reuses buildah's layers) and pushes it to this registry as
    /// `<repository>:<tag>` (plain HTTP); returns the pushed image's full name.
    ///
    /// # Errors
    /// [`RegistryError::Script`] when the build or the push fails (its output went to stderr).
    pub async fn push_plugin_image(
        &self,
        repository: &str,
        tag: &str,
    ) -> Result<String, RegistryError> {
        let name = format!("{}/{repository}:{tag}", self.host());
        last_line(
            &script_path("build-image.sh"),
            &[&format!("docker://{name}")],
        )
        .await?;
        Ok(name)
    }
}
