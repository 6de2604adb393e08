//! The state the plugin writes is readable by root alone. Over real files, with the claim
//! controller on an in-memory cluster and scripted hardware.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use common::*;
use dra_kubelet::Driver;
use gpu_kubelet_plugin::{Backend, Config};

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

#[tokio::test]
async fn the_checkpoint_cdi_specs_and_directories_we_create_are_owner_only() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Shared::default();
    cluster.put(claim("good", "u1", &[(DRIVER, NODE, dev(0))]));
    let c = controller_in(dir.path(), cluster, Arc::default()).await;
    assert!(c.prepare(vec![claim_ref("good", "u1")]).await["u1"].is_ok());
    assert_eq!(mode(&dir.path().join("plugin/checkpoint.json")), 0o600);
    assert_eq!(mode(&dir.path().join("plugin")), 0o700);
    assert_eq!(mode(&dir.path().join("cdi")), 0o700);
    assert_eq!(
        mode(&dir.path().join(format!("cdi/{DRIVER}-claim_u1.json"))),
        0o600
    );
}

#[test]
fn secure_state_tightens_a_world_readable_checkpoint_cdi_spec_and_plugin_dir() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::new(
        DRIVER,
        NODE,
        Backend::Fake {
            topology: "unused.yaml".into(),
            state_dir: None,
        },
    );
    config.sockets.plugin_dir = dir.path().join("plugins").join(DRIVER);
    config.sockets.registrar_dir = dir.path().join("registry");
    config.checkpoint_path = config.sockets.plugin_dir.join("checkpoint.json");
    config.cdi_root = dir.path().join("cdi");
    let ours = config.cdi_root.join(format!("{DRIVER}-claim_u1.json"));
    let theirs = config.cdi_root.join("other.example.com-x.json");
    std::fs::create_dir_all(&config.sockets.plugin_dir).unwrap();
    std::fs::create_dir_all(&config.cdi_root).unwrap();
    for (path, m) in [
        (&config.sockets.plugin_dir, 0o755),
        (&config.cdi_root, 0o755),
        (&config.checkpoint_path, 0o644),
        (&ours, 0o644),
        (&theirs, 0o644),
    ] {
        if !path.is_dir() {
            std::fs::write(path, b"{}").unwrap();
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(m)).unwrap();
    }
    gpu_kubelet_plugin::secure_state(&config).unwrap();
    assert_eq!(mode(&config.sockets.plugin_dir), 0o700);
    assert_eq!(mode(&config.checkpoint_path), 0o600);
    assert_eq!(mode(&ours), 0o600);
    // The CDI directory and other vendors' specs are not ours to change.
    assert_eq!(mode(&config.cdi_root), 0o755);
    assert_eq!(mode(&theirs), 0o644);
}
