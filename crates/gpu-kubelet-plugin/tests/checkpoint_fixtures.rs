//! Every checkpoint format drust ever wrote, read by this build: the files under
//! `tests/fixtures/checkpoints/v<N>/` were written by the writer of format version N itself (its
//! commit's own `CheckpointFile::store`, `tests/fixtures/checkpoints/README.md`), so what is
//! tested is the bytes an upgraded node finds on disk, not our idea of them. A file of a format
//! newer than this build is refused as too new, which start-up answers by rebuilding the claims
//! from the CDI specs and the API server and removing nothing (`claims/recovery.rs`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpu_kubelet_plugin::checkpoint::{Checkpoint, CheckpointError, CheckpointFile, ClaimState};
use gpu_kubelet_plugin::storage::RealFs;

const TRAIN: &str = "6f1c2b0a-0000-4000-8000-000000000001";
const INFER: &str = "6f1c2b0a-0000-4000-8000-000000000002";
const SHARE: &str = "6f1c2b0a-0000-4000-8000-000000000003";
const BOOT: &str = "3c1f6a2e-9b7d-4c55-8f0e-5d2b7a1c9e40";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoints")
}

/// Loads fixture `version` (which must hold exactly `files`) from a copy, as a plugin would.
fn load(version: &str, files: &[&str]) -> Result<Option<Checkpoint>, CheckpointError> {
    let from = fixtures().join(version);
    let mut found: Vec<String> = std::fs::read_dir(&from)
        .unwrap_or_else(|e| panic!("{}: {e}", from.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    found.sort();
    assert_eq!(found, files, "the files of fixture {version}");
    let dir = tempfile::tempdir().unwrap();
    for f in files {
        std::fs::copy(from.join(f), dir.path().join(f)).unwrap();
    }
    CheckpointFile::new(Arc::new(RealFs), dir.path().join("checkpoint.json")).load()
}

fn device_names(c: &Checkpoint, uid: &str) -> Vec<String> {
    c.claims[uid]
        .devices
        .iter()
        .map(|d| d.device_name.clone())
        .collect()
}

#[test]
fn version_1_reads_as_completed_claims() {
    let c = load("v1", &["checkpoint.json"]).unwrap().unwrap();
    assert_eq!(c.claims.keys().collect::<Vec<_>>(), [TRAIN]);
    let r = &c.claims[TRAIN];
    assert_eq!(
        (r.namespace.as_str(), r.name.as_str()),
        ("team-a", "train-gpu")
    );
    assert_eq!(r.state, ClaimState::PrepareCompleted);
    assert_eq!(device_names(&c, TRAIN), ["gpu-0000-18-00-0"]);
    assert!(
        r.cdi_spec_path
            .ends_with(format!("gpu.drust.dev-claim_{TRAIN}.json"))
    );
}

#[test]
fn version_2_keeps_each_claims_phase_the_boot_and_the_spec() {
    let c = load("v2", &["checkpoint.json"]).unwrap().unwrap();
    assert_eq!(c.boot_id, BOOT);
    assert_eq!(c.claims[TRAIN].state, ClaimState::PrepareCompleted);
    assert_eq!(c.claims[INFER].state, ClaimState::PrepareStarted);
    let d = &c.claims[INFER].devices[0];
    assert_eq!(d.uuid, "GPU-0b1e4a5e-7a3c-4e1b-9f2a-000000000001");
    assert_eq!(c.claims[TRAIN].cdi_spec.devices.len(), 1);
    assert!(c.claims[INFER].devices.iter().all(|d| d.mig.is_none()));
}

#[test]
fn version_3_keeps_the_mig_device_prepare_created() {
    let c = load("v3", &["checkpoint.json"]).unwrap().unwrap();
    let mig = c.claims[INFER].devices[0]
        .mig
        .as_ref()
        .expect("the created MIG device");
    assert_eq!(mig.uuid, "MIG-5d0c9a1e-0000-4000-8000-000000000001");
    assert_eq!((mig.gpu_instance_id, mig.compute_instance_id), (9, 0));
    assert_eq!(device_names(&c, TRAIN), ["gpu-0000-18-00-0"]);
}

#[test]
fn version_4_takes_the_newer_of_its_two_slots() {
    let c = load("v4", &["checkpoint.b.json", "checkpoint.json"])
        .unwrap()
        .unwrap();
    assert_eq!(c.boot_id, BOOT);
    assert_eq!(c.claims.len(), 2);
    // The second store (slot b) moved the second claim on to completed.
    assert_eq!(c.claims[INFER].state, ClaimState::PrepareCompleted);
    assert!(c.claims[INFER].devices[0].mig.is_some());
}

#[test]
fn version_5_keeps_shares_and_sharing_configs() {
    let c = load("v5", &["checkpoint.b.json", "checkpoint.json"])
        .unwrap()
        .unwrap();
    let share = c.claims[SHARE].devices[0]
        .share
        .as_ref()
        .expect("the share");
    assert_eq!(share.id, "00000000-0000-4000-8000-000000000031");
    assert_eq!((share.memory_bytes, share.compute_percent), (20 << 30, 25));
    assert!(!share.whole);
    assert!(c.claims[TRAIN].devices[0].sharing.is_some());
    assert_eq!(c.claims[INFER].state, ClaimState::PrepareCompleted);
}

#[test]
fn a_format_newer_than_this_build_is_refused_as_too_new() {
    match load("v6-too-new", &["checkpoint.json"]) {
        Err(CheckpointError::TooNew { needed, .. }) => assert_eq!(needed, 6),
        other => panic!("want TooNew, got {other:?}"),
    }
}
