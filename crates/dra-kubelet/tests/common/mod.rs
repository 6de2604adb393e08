//! Shared by the socket tests: a recording driver and a server on temp-dir sockets.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dra_kubelet::proto::dra_v1;
use dra_kubelet::{
    ClaimRef, DeviceHealth, Driver, HealthStatus, PluginServer, PluginSockets, PrepareResult,
    PreparedDevice, RegistrationStatus, UnprepareResult,
};

/// Prepares any claim whose name does not start with "bad"; records every call.
#[derive(Default)]
pub struct Recorder {
    pub calls: Mutex<Vec<(&'static str, Vec<ClaimRef>)>>,
}

impl Driver for Recorder {
    type Error = String;

    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult<String>> {
        self.calls.lock().unwrap().push(("prepare", claims.clone()));
        claims
            .into_iter()
            .map(|c| {
                let r = if c.name.starts_with("bad") {
                    Err(format!(
                        "claim {}/{}: not allocated to us",
                        c.namespace, c.name
                    ))
                } else {
                    Ok(vec![PreparedDevice {
                        request_names: vec!["gpu".into()],
                        pool_name: "node-a".into(),
                        device_name: "gpu-0".into(),
                        cdi_device_ids: vec![format!("example.com/claim={}-gpu-0", c.uid)],
                        share_id: None,
                    }])
                };
                (c.uid, r)
            })
            .collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, UnprepareResult<String>> {
        self.calls
            .lock()
            .unwrap()
            .push(("unprepare", claims.clone()));
        claims.into_iter().map(|c| (c.uid, Ok(()))).collect()
    }
}

pub struct Running {
    pub dir: tempfile::TempDir,
    pub sockets: PluginSockets,
    pub driver: Arc<Recorder>,
    pub status: tokio::sync::watch::Receiver<RegistrationStatus>,
    pub stop: tokio::sync::oneshot::Sender<()>,
    pub task: tokio::task::JoinHandle<Result<(), dra_kubelet::ServeError>>,
}

/// Serves driver `example.com` on sockets under a new temp dir, without health.
pub async fn start() -> Running {
    start_with(None).await.0
}

/// Serves driver `example.com` with device health starting at `initial`; returns the sender
/// of later snapshots and the advertised services.
pub async fn start_with_health(
    initial: Vec<DeviceHealth>,
) -> (
    Running,
    tokio::sync::watch::Sender<Vec<DeviceHealth>>,
    Vec<String>,
) {
    let (tx, rx) = tokio::sync::watch::channel(initial);
    let (running, advertised) = start_with(Some(rx)).await;
    (running, tx, advertised)
}

async fn start_with(
    health: Option<tokio::sync::watch::Receiver<Vec<DeviceHealth>>>,
) -> (Running, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let sockets = PluginSockets {
        plugin_dir: dir.path().join("plugins/example.com"),
        registrar_dir: dir.path().join("plugins_registry"),
        instance_id: None,
    };
    let driver = Arc::new(Recorder::default());
    let mut server = PluginServer::new("example.com", sockets.clone(), Arc::clone(&driver));
    if let Some(rx) = health {
        server = server.with_health(rx);
    }
    let advertised = server.supported_services();
    let status = server.registration_status();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));
    let reg = sockets.registration_socket("example.com");
    for _ in 0..100 {
        if reg.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let running = Running {
        dir,
        sockets,
        driver,
        status,
        stop,
        task,
    };
    (running, advertised)
}

pub fn v1_claim(ns: &str, name: &str, uid: &str) -> dra_v1::Claim {
    dra_v1::Claim {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub fn health(device: &str, status: HealthStatus, message: &str) -> DeviceHealth {
    DeviceHealth {
        pool_name: "node-a".into(),
        device_name: device.into(),
        status,
        message: message.into(),
        last_updated: std::time::SystemTime::now(),
        timeout: Some(Duration::from_secs(60)),
    }
}
