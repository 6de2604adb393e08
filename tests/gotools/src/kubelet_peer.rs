//! [`KubeletPeer`]: the Go program `cmd/kubeletpeer`, which registers DRA plugins and calls
//! them with the kubelet v1.36.3 code itself (its plugin-manager registration operation and
//! its `DRAPluginManager`/`DRAPlugin` client), driven over JSON Lines on its stdin and stdout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{Mutex, broadcast, oneshot};

/// The gRPC service name of `v1.DRAPlugin`, as the kubelet names it.
pub const DRA_V1: &str = "v1.DRAPlugin";
/// The gRPC service name of `v1beta1.DRAPlugin`.
pub const DRA_V1BETA1: &str = "v1beta1.DRAPlugin";

/// Which DRAPlugin service the kubelet uses for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// `v1.DRAPlugin`: what the kubelet picks when the plugin advertises it.
    V1,
    /// `v1beta1.DRAPlugin`: the kubelet's path for a plugin that offers only v1beta1 (the same
    /// connection; v1 messages converted by the kubelet's `V1Beta1ClientWrapper`).
    V1beta1,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Self::V1 => DRA_V1,
            Self::V1beta1 => DRA_V1BETA1,
        }
    }
}

/// A plugin the kubelet's registration accepted: what its `GetInfo` advertised.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Registration {
    /// The DRA driver name.
    pub driver: String,
    /// The DRA service socket the kubelet dials (`grpc.NewClient("unix:" + endpoint)`).
    pub endpoint: String,
    /// The advertised services (`supported_versions`).
    #[serde(default)]
    pub services: Vec<String>,
}

/// Something the kubelet side observed on its own.
#[derive(Debug, Clone, PartialEq)]
pub enum PeerEvent {
    /// The DRA registration handler accepted a plugin.
    Registered(Registration),
    /// The plugin watcher saw a registration socket go away (watch mode only).
    Deregistered {
        /// The DRA driver name.
        driver: String,
        /// Its DRA service socket.
        endpoint: String,
    },
    /// One message of the `NodeWatchResources` health stream the kubelet opened:
    /// the binary encoding of a `v1alpha1.NodeWatchResourcesResponse`.
    Health {
        /// The DRA driver name.
        driver: String,
        /// The encoded response.
        response: Vec<u8>,
    },
}

/// The kubelet peer failed, or the kubelet code returned an error.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// Building or starting the Go program failed.
    #[error("starting the kubelet peer: {0}")]
    Start(String),
    /// The kubelet's code returned an error (a failed registration, a failed RPC); the text is
    /// the kubelet's own message, e.g. `RegisterPlugin error -- failed to get plugin info ...`.
    #[error("kubelet: {0}")]
    Kubelet(String),
    /// The peer exited, or spoke something unexpected.
    #[error("kubelet peer: {0}")]
    Protocol(String),
    /// A response did not decode as the expected message.
    #[error("decoding the kubelet's response: {0}")]
    Decode(#[from] prost::DecodeError),
}

#[derive(Debug, Deserialize)]
struct Line {
    id: Option<i64>,
    ok: Option<serde_json::Value>,
    error: Option<String>,
    event: Option<String>,
    driver: Option<String>,
    endpoint: Option<String>,
    services: Option<Vec<String>>,
    response: Option<String>,
}

type Pending =
    Arc<std::sync::Mutex<HashMap<i64, oneshot::Sender<Result<serde_json::Value, String>>>>>;

/// The kubelet side of DRA plugin sockets, one Go process. Dropping it kills the process.
pub struct KubeletPeer {
    child: Mutex<Child>,
    stdin: Mutex<ChildStdin>,
    pending: Pending,
    next: AtomicI64,
    events: broadcast::Sender<PeerEvent>,
    _keep: broadcast::Receiver<PeerEvent>,
}

impl KubeletPeer {
    /// Starts a peer that registers plugins one socket at a time ([`KubeletPeer::register`]).
    ///
    /// # Errors
    /// [`PeerError::Start`] when the Go tool cannot be built or started.
    pub async fn start() -> Result<Self, PeerError> {
        Self::spawn(&[]).await
    }

    /// Starts a peer running the kubelet's whole plugin manager on `registry_dir` (the
    /// kubelet's `<root-dir>/plugins_registry`): it discovers registration sockets with its
    /// fsnotify watcher, registers each, and deregisters a plugin whose socket goes away;
    /// follow it with [`KubeletPeer::wait_registered`].
    ///
    /// # Errors
    /// [`PeerError::Start`] when the Go tool cannot be built or started.
    pub async fn watch(registry_dir: &Path) -> Result<Self, PeerError> {
        Self::spawn(&["-registry-dir".into(), registry_dir.to_owned()]).await
    }

    async fn spawn(args: &[PathBuf]) -> Result<Self, PeerError> {
        let bin = tokio::task::spawn_blocking(|| crate::go_tool("kubeletpeer"))
            .await
            .map_err(|e| PeerError::Start(e.to_string()))?
            .map_err(PeerError::Start)?;
        let verbosity = std::env::var("DRUST_KUBELET_PEER_V").unwrap_or_else(|_| "0".into());
        let mut child = Command::new(&bin)
            .args(args)
            .arg("-v")
            .arg(verbosity)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| PeerError::Start(format!("{}: {e}", bin.display())))?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| PeerError::Start("no stdin".into()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| PeerError::Start("no stdout".into()))?;
        let pending: Pending = Arc::default();
        let (events, keep) = broadcast::channel(1024);
        let reader_pending = Arc::clone(&pending);
        let reader_events = events.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(l) = serde_json::from_str::<Line>(&line) else {
                    eprintln!("kubelet peer: unexpected line {line:?}");
                    continue;
                };
                if let Some(event) = l.event.as_deref() {
                    let event = match event {
                        "registered" => PeerEvent::Registered(Registration {
                            driver: l.driver.unwrap_or_default(),
                            endpoint: l.endpoint.unwrap_or_default(),
                            services: l.services.unwrap_or_default(),
                        }),
                        "deregistered" => PeerEvent::Deregistered {
                            driver: l.driver.unwrap_or_default(),
                            endpoint: l.endpoint.unwrap_or_default(),
                        },
                        "health" => match B64.decode(l.response.unwrap_or_default()) {
                            Ok(response) => PeerEvent::Health {
                                driver: l.driver.unwrap_or_default(),
                                response,
                            },
                            Err(e) => {
                                eprintln!("kubelet peer: health event: {e}");
                                continue;
                            }
                        },
                        other => {
                            eprintln!("kubelet peer: unknown event {other:?}");
                            continue;
                        }
                    };
                    let _ = reader_events.send(event);
                    continue;
                }
                let Some(id) = l.id else { continue };
                let answer = match (l.error, l.ok) {
                    (Some(e), _) => Err(e),
                    (None, ok) => Ok(ok.unwrap_or(serde_json::Value::Null)),
                };
                let waiter = reader_pending.lock().ok().and_then(|mut p| p.remove(&id));
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(answer);
                    }
                    None => eprintln!("kubelet peer: reply {id} nobody waits for: {answer:?}"),
                }
            }
            // The process is gone: fail everyone still waiting.
            if let Ok(mut p) = reader_pending.lock() {
                p.clear();
            }
        });
        Ok(Self {
            child: Mutex::new(child),
            stdin: Mutex::new(stdin),
            pending,
            next: AtomicI64::new(1),
            events,
            _keep: keep,
        })
    }

    async fn call(&self, mut command: serde_json::Value) -> Result<serde_json::Value, PeerError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        command["id"] = id.into();
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .map_err(|_| PeerError::Protocol("poisoned".into()))?
            .insert(id, tx);
        let mut line = command.to_string();
        line.push('\n');
        {
            let mut stdin = self.stdin.lock().await;
            stdin
                .write_all(line.as_bytes())
                .await
                .map_err(|e| PeerError::Protocol(format!("writing a command: {e}")))?;
            stdin
                .flush()
                .await
                .map_err(|e| PeerError::Protocol(format!("writing a command: {e}")))?;
        }
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(PeerError::Kubelet(e)),
            Err(_) => {
                let status = self.child.lock().await.try_wait().ok().flatten();
                Err(PeerError::Protocol(format!(
                    "the process ended before answering (exit: {status:?})"
                )))
            }
        }
    }

    /// Runs the kubelet's registration of the plugin behind `socket` once, exactly as its
    /// plugin manager does for a socket it discovered: dial the bare path with grpc-go's
    /// `DialContext` (blocking, 10 s), `GetInfo` (1 s), validate, register with the DRA
    /// handler (which dials the advertised endpoint with `grpc.NewClient("unix:" + endpoint)`
    /// and, when offered, opens the health stream), then `NotifyRegistrationStatus`.
    ///
    /// # Errors
    /// [`PeerError::Kubelet`] with the kubelet's message when any step fails.
    pub async fn register(&self, socket: &Path) -> Result<Registration, PeerError> {
        let v = self
            .call(serde_json::json!({"op": "register", "socket": socket}))
            .await?;
        serde_json::from_value(v).map_err(|e| PeerError::Protocol(e.to_string()))
    }

    /// Waits up to `timeout` for the plugin manager (watch mode) or a registration to accept
    /// a plugin of `driver`.
    ///
    /// # Errors
    /// [`PeerError::Protocol`] on timeout.
    pub async fn wait_registered(
        &self,
        driver: &str,
        timeout: Duration,
    ) -> Result<Registration, PeerError> {
        let mut rx = self.events.subscribe();
        tokio::time::timeout(timeout, async {
            loop {
                match rx.recv().await {
                    Ok(PeerEvent::Registered(r)) if r.driver == driver => return Ok(r),
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        return Err(PeerError::Protocol("the peer exited".into()));
                    }
                }
            }
        })
        .await
        .map_err(|_| PeerError::Protocol(format!("{driver} not registered within {timeout:?}")))?
    }

    /// Everything the peer observes from now on.
    pub fn events(&self) -> broadcast::Receiver<PeerEvent> {
        self.events.subscribe()
    }

    async fn rpc<Resp: prost::Message + Default>(
        &self,
        op: &str,
        driver: &str,
        service: Service,
        request: &impl prost::Message,
    ) -> Result<Resp, PeerError> {
        let v = self
            .call(serde_json::json!({
                "op": op,
                "driver": driver,
                "service": service.name(),
                "request": B64.encode(request.encode_to_vec()),
            }))
            .await?;
        let b64 = v["response"]
            .as_str()
            .ok_or_else(|| PeerError::Protocol(format!("no response in {v}")))?;
        let bytes = B64
            .decode(b64)
            .map_err(|e| PeerError::Protocol(e.to_string()))?;
        Ok(Resp::decode(bytes.as_slice())?)
    }

    /// `NodePrepareResources` through the kubelet's `DRAPlugin` for `driver` (its per-call
    /// timeout, its service choice). `request` and the answer are v1 messages whatever
    /// `service` is, as inside the kubelet.
    ///
    /// # Errors
    /// [`PeerError::Kubelet`] when the RPC fails (not for per-claim errors, which are in the
    /// response).
    pub async fn prepare<Resp: prost::Message + Default>(
        &self,
        driver: &str,
        service: Service,
        request: &impl prost::Message,
    ) -> Result<Resp, PeerError> {
        self.rpc("prepare", driver, service, request).await
    }

    /// `NodeUnprepareResources`, as [`KubeletPeer::prepare`].
    ///
    /// # Errors
    /// [`PeerError::Kubelet`] when the RPC fails.
    pub async fn unprepare<Resp: prost::Message + Default>(
        &self,
        driver: &str,
        service: Service,
        request: &impl prost::Message,
    ) -> Result<Resp, PeerError> {
        self.rpc("unprepare", driver, service, request).await
    }
}
