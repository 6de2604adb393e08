//! Dynamic MIG through the claim controller with the real hardware layer over the fake backend:
//! placements created at prepare and recorded before their CDI spec, destroyed at unprepare,
//! clean rollback of failed creations, and start-up reclamation of orphaned MIG devices.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{DRIVER, NODE, Shared, claim, claim_ref, mps_control};
use dra_kubelet::Driver;
use gpu_inventory::fake::mig::{capability_minor, capability_table};
use gpu_inventory::{FakeBackend, GpuBackend, MigStrategy, Topology, discover};
use gpu_kubelet_plugin::cdi::CdiWriter;
use gpu_kubelet_plugin::checkpoint::{CheckpointFile, slot_paths};
use gpu_kubelet_plugin::claims::{ClaimController, ControllerConfig, RecoveryReport};
use gpu_kubelet_plugin::hardware::{BackendHardware, NodeDevice, node_devices};
use gpu_kubelet_plugin::storage::RealFs;

/// GPU 3 of the fake DGX A100 has MIG enabled and no MIG devices.
const GPU3: u32 = 3;
const ONE_G_AT_0: &str = "gpu-0000-4e-00-0-mig-1g-10gb-0";
const TWO_G_AT_0: &str = "gpu-0000-4e-00-0-mig-2g-20gb-0";

fn topology_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/topologies/dgx-a100-mig.yaml")
}

/// A node with the fake DGX A100 in partitionable mode: a temp dir holding the fake's state,
/// the driver's capability table and device nodes, the CDI root and the checkpoint.
struct Node {
    dir: tempfile::TempDir,
    cluster: Shared,
    topology: Topology,
}

type Controller = ClaimController<Shared, BackendHardware>;

impl Node {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let topology = Topology::from_file(topology_path()).unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("driver/nvidia-caps")).unwrap();
        let gpus = u32::try_from(topology.gpus.len()).unwrap();
        std::fs::write(
            root.join("driver/nvidia-caps/mig-minors"),
            capability_table(gpus),
        )
        .unwrap();
        std::fs::create_dir_all(root.join("dev/nvidia-caps")).unwrap();
        let mut nodes: Vec<String> = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
            .map(String::from)
            .to_vec();
        for g in 0..gpus {
            nodes.push(format!("nvidia{g}"));
        }
        for m in 3..=capability_minor(gpus - 1, 14, Some(7)) {
            nodes.push(format!("nvidia-caps/nvidia-cap{m}"));
        }
        for n in nodes {
            std::fs::write(root.join("dev").join(n), b"").unwrap();
        }
        Self {
            dir,
            cluster: Shared::default(),
            topology,
        }
    }

    /// A fresh backend on the node's state dir, as a restarted plugin opens it.
    fn backend(&self) -> Arc<FakeBackend> {
        Arc::new(
            FakeBackend::new(self.topology.clone()).with_state_dir(self.dir.path().join("state")),
        )
    }

    fn checkpoint(&self) -> CheckpointFile {
        CheckpointFile::new(Arc::new(RealFs), self.dir.path().join("checkpoint.json"))
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        self.dir
            .path()
            .join(format!("cdi/{DRIVER}-claim_{uid}.json"))
    }

    async fn start(&self, backend: Arc<FakeBackend>) -> (Controller, RecoveryReport) {
        let inventory = discover(backend.as_ref()).unwrap();
        let devices = node_devices(&inventory, MigStrategy::Partitionable);
        ClaimController::start(
            self.cluster.clone(),
            Arc::new(BackendHardware::new(
                backend,
                self.dir.path(),
                self.dir.path(),
            )),
            ControllerConfig {
                driver_name: DRIVER.into(),
                node_name: NODE.into(),
                timeout: Duration::from_secs(10),
                boot_id: "boot-1".into(),
                sharing: true,
                mps: mps_control(&self.dir.path().join("mps")),
                driver_edits: Default::default(),
                kernel_memory: None,
                claim_users: None,
                device_metadata: None,
                imex: None,
            },
            devices.into_values(),
            CdiWriter::new(Arc::new(RealFs), self.dir.path().join("cdi"), DRIVER),
            self.checkpoint(),
        )
        .await
        .unwrap()
    }

    fn mig_on_gpu3(&self, backend: &FakeBackend) -> Vec<gpu_inventory::backend::RawMigDevice> {
        backend.gpu(GPU3).unwrap().mig_devices
    }
}

#[tokio::test]
async fn a_placement_is_created_at_prepare_recorded_with_its_cdi_spec_and_destroyed_at_unprepare() {
    let node = Node::new();
    let backend = node.backend();
    let (c, _) = node.start(Arc::clone(&backend)).await;
    node.cluster
        .put(claim("small", "u1", &[(DRIVER, NODE, ONE_G_AT_0)]));

    let started = Instant::now();
    let r = c.prepare(vec![claim_ref("small", "u1")]).await;
    let took = started.elapsed();
    let devices = r["u1"].as_ref().expect("prepared");
    eprintln!("dynamic MIG prepare (fake backend, 1g.10gb): {took:?}");
    assert_eq!(devices[0].device_name, ONE_G_AT_0);

    // The MIG device exists at the allocated placement, with the driver's GPU instance id 7.
    let mig = node.mig_on_gpu3(&backend);
    assert_eq!(mig.len(), 1, "{mig:?}");
    assert_eq!(
        (
            mig[0].profile_id,
            mig[0].placement.start,
            mig[0].placement.size
        ),
        // Profile ID 19: 1g.10gb on an A100 80GB.
        (19, 0, 1)
    );
    assert_eq!(mig[0].gpu_instance_id, 7);

    // The checkpoint records it; the CDI spec names it and its capability nodes.
    let cp = node.checkpoint().load().unwrap().unwrap();
    let recorded = cp.claims["u1"].devices[0].mig.clone().expect("recorded");
    assert_eq!(recorded.uuid, mig[0].uuid);
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(node.spec_path("u1")).unwrap()).unwrap();
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        gpu_kubelet_plugin::claims::device_env(ONE_G_AT_0, &mig[0].uuid)
    );
    let nodes: Vec<&str> = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["path"].as_str())
        .collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidia3".to_owned(),
            format!(
                "/dev/nvidia-caps/nvidia-cap{}",
                capability_minor(3, 7, None)
            ),
            format!(
                "/dev/nvidia-caps/nvidia-cap{}",
                capability_minor(3, 7, Some(0))
            ),
        ]
    );

    // A repeated prepare answers from the checkpoint: nothing created twice.
    let again = c.prepare(vec![claim_ref("small", "u1")]).await;
    assert_eq!(again["u1"].as_ref().unwrap(), devices);
    assert_eq!(node.mig_on_gpu3(&backend).len(), 1);

    let r = c.unprepare(vec![claim_ref("small", "u1")]).await;
    assert!(r["u1"].is_ok(), "{r:?}");
    assert!(node.mig_on_gpu3(&backend).is_empty());
    assert!(!node.spec_path("u1").exists());
    // Unprepare is idempotent.
    let r = c.unprepare(vec![claim_ref("small", "u1")]).await;
    assert!(r["u1"].is_ok(), "{r:?}");
}

#[tokio::test]
async fn a_failed_creation_names_the_claim_device_profile_and_placement_and_leaves_nothing() {
    let node = Node::new();
    let backend = node.backend();
    let (c, _) = node.start(Arc::clone(&backend)).await;
    node.cluster
        .put(claim("small", "u1", &[(DRIVER, NODE, ONE_G_AT_0)]));
    backend.fail_mig_create(GPU3);
    let r = c.prepare(vec![claim_ref("small", "u1")]).await;
    let err = r["u1"].as_ref().expect_err("injected").to_string();
    for needle in [
        "ns/small",
        ONE_G_AT_0,
        "1g.10gb",
        "memory slices 0..1",
        "injected",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    assert!(node.mig_on_gpu3(&backend).is_empty());
    assert!(node.checkpoint().load().unwrap().unwrap().claims.is_empty());
    assert!(!node.spec_path("u1").exists());
}

#[tokio::test]
async fn when_a_later_placement_of_a_claim_fails_the_created_one_is_destroyed() {
    let node = Node::new();
    let backend = node.backend();
    let (c, _) = node.start(Arc::clone(&backend)).await;
    // Overlapping placements (never allocated together by the scheduler): the second fails.
    node.cluster.put(claim(
        "two",
        "u2",
        &[(DRIVER, NODE, ONE_G_AT_0), (DRIVER, NODE, TWO_G_AT_0)],
    ));
    let r = c.prepare(vec![claim_ref("two", "u2")]).await;
    let err = r["u2"].as_ref().expect_err("overlap").to_string();
    assert!(err.contains("overlaps GPU instance 7"), "{err}");
    assert!(node.mig_on_gpu3(&backend).is_empty(), "rolled back");
    assert!(node.checkpoint().load().unwrap().unwrap().claims.is_empty());
}

#[tokio::test]
async fn start_up_destroys_mig_devices_no_claim_owns_and_keeps_the_recorded_ones() {
    let node = Node::new();
    let backend = node.backend();
    let (c, report) = node.start(Arc::clone(&backend)).await;
    // The topology's own MIG devices (GPUs 0-2) are not ours to keep in partitionable mode.
    assert_eq!(report.mig_orphans_destroyed.len(), 7 + 3 + 1, "{report:?}");
    node.cluster
        .put(claim("small", "u1", &[(DRIVER, NODE, ONE_G_AT_0)]));
    assert!(c.prepare(vec![claim_ref("small", "u1")]).await["u1"].is_ok());
    let kept = node.mig_on_gpu3(&backend)[0].clone();
    // A crash between creation and the checkpoint write leaves a device nobody recorded.
    let orphan = backend
        .create_mig_device(
            GPU3,
            14, // 2g.20gb
            gpu_inventory::backend::MigPlacement { start: 2, size: 2 },
        )
        .unwrap();
    drop(c);

    let restarted = node.backend();
    let (c, report) = node.start(Arc::clone(&restarted)).await;
    assert_eq!(report.mig_orphans_destroyed.len(), 1, "{report:?}");
    assert!(
        report.mig_orphans_destroyed[0].contains(&orphan.uuid),
        "{report:?}"
    );
    assert_eq!(node.mig_on_gpu3(&restarted), [kept]);
    assert!(c.unprepare(vec![claim_ref("small", "u1")]).await["u1"].is_ok());
    assert!(node.mig_on_gpu3(&restarted).is_empty());
}

#[tokio::test]
async fn a_rebuilt_checkpoint_adopts_the_mig_devices_of_its_claims() {
    let node = Node::new();
    let backend = node.backend();
    let (c, _) = node.start(Arc::clone(&backend)).await;
    node.cluster
        .put(claim("small", "u1", &[(DRIVER, NODE, ONE_G_AT_0)]));
    assert!(c.prepare(vec![claim_ref("small", "u1")]).await["u1"].is_ok());
    let kept = node.mig_on_gpu3(&backend);
    drop(c);
    for slot in slot_paths(&node.dir.path().join("checkpoint.json")) {
        std::fs::write(slot, b"{damaged").unwrap();
    }

    let restarted = node.backend();
    let (c, report) = node.start(Arc::clone(&restarted)).await;
    assert_eq!(report.rebuilt, ["u1"], "{report:?}");
    assert!(report.mig_orphans_destroyed.is_empty(), "{report:?}");
    assert_eq!(node.mig_on_gpu3(&restarted), kept);
    // Unprepare destroys it: the rebuilt record holds the device.
    assert!(c.unprepare(vec![claim_ref("small", "u1")]).await["u1"].is_ok());
    assert!(node.mig_on_gpu3(&restarted).is_empty());
}

#[test]
fn partitionable_gpus_list_every_mig_name_as_a_placement() {
    let backend = FakeBackend::new(Topology::from_file(topology_path()).unwrap());
    let inventory = discover(&backend).unwrap();
    let devices = node_devices(&inventory, MigStrategy::Partitionable);
    // GPU 0's existing 1g.10gb at slice 0 shares its name with the placement: it is a placement.
    let name = "gpu-0000-07-00-0-mig-1g-10gb-0";
    assert!(
        matches!(&devices[name], NodeDevice::MigPlacement { profile, profile_id: 19, placement, .. }
            if profile == "1g.10gb" && placement.start == 0 && placement.size == 1),
        "{:?}",
        devices[name]
    );
    let existing = node_devices(&inventory, MigStrategy::Existing);
    assert!(matches!(&existing[name], NodeDevice::Mig { .. }));
}

/// Prepare serves exactly what partitionable mode publishes: a placement on a GPU with MIG off
/// (it could never be created) and the whole GPU of a MIG-enabled one (it runs no CUDA work)
/// are refused as unknown devices, and nothing is created or recorded for them.
#[tokio::test]
async fn partitionable_mode_refuses_placements_on_mig_off_gpus_and_whole_mig_on_gpus() {
    let node = Node::new();
    let backend = node.backend();
    let inventory = discover(backend.as_ref()).unwrap();
    let pool = inventory.pool(MigStrategy::Partitionable);
    let published: Vec<&str> = pool.devices.iter().map(|d| d.name.as_str()).collect();
    let devices = node_devices(&inventory, MigStrategy::Partitionable);
    assert_eq!(
        devices.keys().map(String::as_str).collect::<Vec<_>>(),
        {
            let mut p = published.clone();
            p.sort_unstable();
            p
        },
        "prepare knows exactly the published devices"
    );
    let gpu = |minor: u32| {
        inventory
            .gpus
            .iter()
            .find(|g| g.raw.minor == minor)
            .unwrap()
            .name
            .clone()
    };
    // GPU 3: MIG on. GPU 4: MIG off (the topology's comments).
    let whole_mig_on = gpu(GPU3);
    let placement_mig_off = format!("{}-mig-1g-10gb-0", gpu(4));
    assert!(!published.contains(&whole_mig_on.as_str()));
    assert!(!published.contains(&placement_mig_off.as_str()));
    assert!(published.contains(&gpu(4).as_str()));

    let (c, _) = node.start(Arc::clone(&backend)).await;
    node.cluster
        .put(claim("whole", "u1", &[(DRIVER, NODE, &whole_mig_on)]));
    node.cluster
        .put(claim("placed", "u2", &[(DRIVER, NODE, &placement_mig_off)]));
    let r = c
        .prepare(vec![claim_ref("whole", "u1"), claim_ref("placed", "u2")])
        .await;
    for (uid, device) in [("u1", &whole_mig_on), ("u2", &placement_mig_off)] {
        let e = r[uid].as_ref().expect_err("refused").to_string();
        assert!(e.contains(device.as_str()), "{uid}: {e}");
        assert!(!node.spec_path(uid).exists());
    }
    assert!(backend.gpu(4).unwrap().mig_devices.is_empty());
    let cp = node.checkpoint().load().unwrap().unwrap_or_default();
    assert!(cp.claims.is_empty(), "{:?}", cp.claims.keys());
}
