//! A slow disk must not stall the plugin. The checkpoint's fsync (and the CDI writes) used to run
//! on the async worker threads, so on a 2-core node a disk that takes seconds to sync held the
//! workers and the kubelet's gRPC, the health stream and the liveness probe stopped answering:
//! the kubelet would restart a plugin that was only waiting for its disk. Blocking file work now
//! runs on the blocking pool.
//!
//! The test runs the controller, the real kubelet-facing gRPC server and the real liveness
//! probe on ONE worker thread (stricter than the node's two cores: any blocking call on it
//! stalls everything), makes the checkpoint's fsync hang until the test lets it end, and asks
//! the probe while that write is in flight: the probe must answer before the write ends, which
//! does not depend on how fast this machine is.

mod common;

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use dra_kubelet::{Driver, PluginServer, PluginSockets};
use gpu_kubelet_plugin::cdi::CdiWriter;
use gpu_kubelet_plugin::checkpoint::CheckpointFile;
use gpu_kubelet_plugin::claims::{ClaimController, ControllerConfig};
use gpu_kubelet_plugin::http::Probes;
use gpu_kubelet_plugin::instance::Role;
use gpu_kubelet_plugin::metrics::Metrics;
use gpu_kubelet_plugin::storage::{Fs, RealFs};

/// The real filesystem, with the checkpoint's fsync hanging once armed until
/// [`SlowDisk::end_sync`]; records when the slow sync started and ended.
#[derive(Debug, Default)]
struct SlowDisk {
    armed: std::sync::atomic::AtomicBool,
    sync: Mutex<(Option<Instant>, Option<Instant>)>,
    /// Set by the test to let the hanging fsync end.
    may_end: Mutex<bool>,
    ended: Condvar,
}

impl SlowDisk {
    fn times(&self) -> (Option<Instant>, Option<Instant>) {
        *self.sync.lock().unwrap()
    }

    fn end_sync(&self) {
        *self.may_end.lock().unwrap() = true;
        self.ended.notify_all();
    }
}

impl Fs for SlowDisk {
    fn read(&self, p: &Path) -> std::io::Result<Vec<u8>> {
        RealFs.read(p)
    }
    fn write(&self, p: &Path, b: &[u8]) -> std::io::Result<()> {
        RealFs.write(p, b)
    }
    fn overwrite(&self, p: &Path, b: &[u8]) -> std::io::Result<()> {
        RealFs.overwrite(p, b)
    }
    fn sync_file(&self, p: &Path) -> std::io::Result<()> {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.sync.lock().unwrap().0 = Some(Instant::now());
            let may_end = self.may_end.lock().unwrap();
            drop(self.ended.wait_while(may_end, |may| !*may).unwrap());
            self.sync.lock().unwrap().1 = Some(Instant::now());
        }
        RealFs.sync_file(p)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        RealFs.rename(from, to)
    }
    fn sync_dir(&self, d: &Path) -> std::io::Result<()> {
        RealFs.sync_dir(d)
    }
    fn remove(&self, p: &Path) -> std::io::Result<()> {
        RealFs.remove(p)
    }
    fn list(&self, d: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
        RealFs.list(d)
    }
    fn create_dir_all(&self, d: &Path) -> std::io::Result<()> {
        RealFs.create_dir_all(d)
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_liveness_probe_answers_within_a_second_while_a_checkpoint_write_takes_five() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Shared::default();
    cluster.put(claim("a", "ua", &[(DRIVER, NODE, dev(0))]));
    let disk = Arc::new(SlowDisk::default());
    let (controller, _) = ClaimController::start(
        cluster,
        Arc::new(ScriptedHardware::default()),
        ControllerConfig {
            driver_name: DRIVER.into(),
            node_name: NODE.into(),
            timeout: Duration::from_secs(20),
            boot_id: "boot-1".into(),
            sharing: true,
            mps: mps_control(&dir.path().join("mps")),
            driver_edits: Default::default(),
            kernel_memory: None,
            claim_users: None,
            device_metadata: None,
            imex: None,
        },
        node_devices(),
        CdiWriter::new(Arc::new(RealFs), dir.path().join("cdi"), DRIVER),
        CheckpointFile::new(
            Arc::clone(&disk) as Arc<dyn Fs>,
            dir.path().join("checkpoint.json"),
        ),
    )
    .await
    .unwrap();

    let sockets = PluginSockets {
        plugin_dir: dir.path().join("plugin"),
        registrar_dir: dir.path().join("registry"),
        instance_id: None,
    };
    let server = PluginServer::new(DRIVER, sockets.clone(), Arc::new(controller.clone()));
    let probes = Probes {
        metrics: Arc::new(Metrics::new()),
        sockets,
        driver_name: DRIVER.into(),
        serving: server.serving(),
        registration: server.registration_status(),
        role: tokio::sync::watch::channel(Role::Active).1,
        access: None,
    };
    tokio::spawn(server.serve(std::future::pending()));
    let start = Instant::now();
    while let Err(e) = probes.live().await {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "never live: {e}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let prepare = {
        let c = controller.clone();
        tokio::spawn(async move { c.prepare(vec![claim_ref("a", "ua")]).await })
    };
    while disk.times().0.is_none() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let asked = Instant::now();
    // The write hangs until the probe has answered: an answer only after 120 s means the probe
    // is waiting for the write, whatever the machine's load.
    tokio::time::timeout(Duration::from_secs(120), probes.live())
        .await
        .expect("the probe answers while the checkpoint's fsync hangs")
        .expect("live while the checkpoint syncs");
    let answered = Instant::now();
    let (began, ended) = disk.times();
    eprintln!(
        "liveness answered {} ms after being asked, {} ms into a checkpoint sync that hangs",
        (answered - asked).as_millis(),
        (answered - began.unwrap()).as_millis(),
    );
    assert!(
        ended.is_none(),
        "the probe answered once the write had ended"
    );
    disk.end_sync();

    let r = prepare.await.unwrap();
    assert!(r["ua"].is_ok(), "{r:?}");
    assert!(disk.times().1.is_some(), "the slow write was the claim's");
}
