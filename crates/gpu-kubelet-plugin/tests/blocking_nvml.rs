//! Issue 41, defect 11: start-up's NVML calls (listing and destroying orphaned MIG devices in
//! partitionable mode, adopting them for rebuilt claims) ran on the async workers. On a node
//! whose driver is slow to answer they held the workers, and with them the kubelet's gRPC and
//! the probes. They run on the blocking pool now.
//!
//! The test starts the controller on ONE worker thread with the MIG listing hanging, and checks
//! that another task on that worker runs while the listing still hangs. A watchdog thread ends
//! the hang after a minute so that a regression fails instead of hanging; the verdict is
//! whether the task ran before the watchdog, not how fast.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use gpu_inventory::{FakeBackend, MigStrategy, discover};
use gpu_kubelet_plugin::hardware::node_devices;

#[tokio::test(flavor = "current_thread")]
async fn start_up_lists_mig_devices_off_the_async_worker() {
    let dir = tempfile::tempdir().unwrap();
    let topology =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/topologies/dgx-a100-mig.yaml");
    let inventory = discover(&FakeBackend::from_file(topology).unwrap()).unwrap();
    let devices: Vec<_> = node_devices(&inventory, MigStrategy::Partitionable)
        .into_values()
        .collect();
    let hardware = Arc::new(ScriptedHardware::default());
    hardware.hold("mig-devices");
    let watchdog_fired = Arc::new(AtomicBool::new(false));
    {
        let (hardware, fired) = (Arc::clone(&hardware), Arc::clone(&watchdog_fired));
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(60));
            fired.store(true, Ordering::SeqCst);
            hardware.release();
        });
    }
    let root = dir.path().to_owned();
    let start = tokio::spawn({
        let hardware = Arc::clone(&hardware);
        async move { controller_over(&root, Shared::default(), hardware, devices).await }
    });
    // This loop shares the one worker with the start-up: it runs only if the start-up's NVML
    // call left the worker free.
    loop {
        let listing = hardware
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("mig-devices"));
        if listing {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !watchdog_fired.load(Ordering::SeqCst),
        "the worker was held by the MIG listing until the watchdog ended it"
    );
    hardware.release();
    let c = start.await.expect("start-up");
    assert!(c.prepared_claims().await.is_empty());
}
