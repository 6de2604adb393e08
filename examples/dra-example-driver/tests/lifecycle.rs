//! The example driver through the lifecycle, in process: what a prepared claim's container is
//! given, what is refused (naming the claim and the field), and that start-up puts a crashed
//! prepare back in order. The same driver's binary is killed at every failpoint in
//! `tests/e2e/tests/example_driver.rs`.

use std::sync::Arc;
use std::time::Duration;

mod common;

use common::FakeClaims;
use dra_example_driver::{ExampleDriver, device_names};
use dra_kubelet::{ClaimRef, Driver as _};
use dra_plugin::cdi::CdiWriter;
use dra_plugin::checkpoint::SlotFile;
use dra_plugin::lifecycle::{Lifecycle, Settings};
use dra_plugin::storage::RealFs;

const DRIVER: &str = "example.drust.dev";
const NODE: &str = "node-a";

struct Node {
    dir: tempfile::TempDir,
    claims: FakeClaims,
}

impl Node {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
            claims: FakeClaims::default(),
        }
    }

    async fn start(&self) -> Lifecycle<ExampleDriver<FakeClaims>> {
        let root = self.dir.path();
        let fs = Arc::new(RealFs);
        let lifecycle = Lifecycle::new(
            ExampleDriver {
                driver_name: DRIVER.into(),
                pool: NODE.into(),
                devices: device_names(4),
                state_dir: root.join("devices"),
                fs: fs.clone(),
                claims: self.claims.clone(),
            },
            SlotFile::new(fs.clone(), root.join("checkpoint.json")),
            CdiWriter::new(fs, root.join("cdi"), DRIVER),
            Settings {
                timeout: Duration::from_secs(10),
                node_name: NODE.into(),
                boot_id: "boot-1".into(),
            },
        );
        lifecycle.recover().await.expect("recovered");
        lifecycle
    }

    fn owner(&self, device: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.path().join("devices").join(device)).ok()
    }

    fn spec(&self, uid: &str) -> Option<serde_json::Value> {
        let path = self
            .dir
            .path()
            .join("cdi")
            .join(format!("{DRIVER}-claim_{uid}.json"));
        Some(serde_json::from_slice(&std::fs::read(path).ok()?).expect("a CDI spec"))
    }
}

#[tokio::test]
async fn a_prepared_claim_names_its_devices_to_the_container_and_unprepare_undoes_it() {
    let node = Node::new();
    let lifecycle = node.start().await;
    let a = node.claims.add(
        "a",
        "uid-a",
        &[
            (DRIVER, NODE, "dev-1"),
            (DRIVER, NODE, "dev-2"),
            ("other.example.com", NODE, "x"),
        ],
    );
    let answer = lifecycle.prepare(vec![a.clone()]).await;
    let devices = answer["uid-a"].as_ref().expect("prepared");
    assert_eq!(
        devices
            .iter()
            .map(|d| d.device_name.as_str())
            .collect::<Vec<_>>(),
        ["dev-1", "dev-2"],
        "only this driver's devices"
    );
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("{DRIVER}/claim=uid-a-dev-1")]
    );
    let spec = node.spec("uid-a").expect("the CDI spec");
    assert_eq!(spec["devices"][0]["name"], "uid-a-dev-1");
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        "EXAMPLE_DEVICE_0=dev-1"
    );
    assert_eq!(
        spec["devices"][1]["containerEdits"]["env"][0],
        "EXAMPLE_DEVICE_1=dev-2"
    );
    assert_eq!(spec["containerEdits"]["env"][0], "EXAMPLE_CLAIM_UID=uid-a");
    assert_eq!(node.owner("dev-1").as_deref(), Some("uid-a"));

    // Prepared once: the same answer again.
    let again = lifecycle.prepare(vec![a.clone()]).await;
    assert_eq!(again["uid-a"].as_ref().expect("prepared"), devices);

    let out = lifecycle.unprepare(vec![a]).await;
    out["uid-a"].as_ref().expect("unprepared");
    assert_eq!(node.spec("uid-a"), None);
    assert_eq!(node.owner("dev-1"), None);
    assert_eq!(lifecycle.prepared_claims().await, Vec::<String>::new());
}

#[tokio::test]
async fn bad_claims_are_refused_naming_the_claim_and_field_and_others_are_untouched() {
    let node = Node::new();
    let lifecycle = node.start().await;
    let a = node.claims.add("a", "uid-a", &[(DRIVER, NODE, "dev-0")]);
    lifecycle.prepare(vec![a.clone()]).await["uid-a"]
        .as_ref()
        .expect("prepared");

    let taken = node.claims.add("b", "uid-b", &[(DRIVER, NODE, "dev-0")]);
    let unknown = node.claims.add("c", "uid-c", &[(DRIVER, NODE, "dev-9")]);
    let foreign = node
        .claims
        .add("d", "uid-d", &[(DRIVER, "other-node", "dev-1")]);
    let missing = ClaimRef {
        namespace: "ns".into(),
        name: "gone".into(),
        uid: "uid-gone".into(),
    };
    let replaced = ClaimRef {
        uid: "uid-old".into(),
        ..node.claims.add("e", "uid-new", &[(DRIVER, NODE, "dev-3")])
    };
    let out = lifecycle
        .prepare(vec![taken, unknown, foreign, missing, replaced])
        .await;
    let error = |uid: &str| out[uid].as_ref().expect_err("refused").to_string();
    assert_eq!(
        error("uid-b"),
        "ResourceClaim ns/b (uid uid-b): status.allocation.devices.results: device \"dev-0\" \
         of pool \"node-a\" is already prepared for claim ns/a (uid uid-a)"
    );
    assert_eq!(
        error("uid-c"),
        "ResourceClaim ns/c (uid uid-c): status.allocation.devices.results[0].device \"dev-9\" \
         is not a device of this node"
    );
    assert!(error("uid-d").contains("has no device of driver example.drust.dev in pool node-a"));
    assert!(error("uid-gone").contains("not found"));
    assert!(
        error("uid-old").contains("metadata.uid is \"uid-new\", not the kubelet's (replaced)"),
        "{}",
        error("uid-old")
    );

    // Nothing of the refused claims is left; the prepared one is intact.
    for uid in ["uid-b", "uid-c", "uid-d", "uid-gone", "uid-old"] {
        assert_eq!(node.spec(uid), None, "{uid}");
    }
    assert_eq!(node.owner("dev-0").as_deref(), Some("uid-a"));
    assert_eq!(node.owner("dev-3"), None);
    assert_eq!(lifecycle.prepared_claims().await, ["uid-a"]);
}

#[tokio::test]
async fn start_up_rewrites_a_lost_spec_and_removes_what_no_claim_owns() {
    let node = Node::new();
    let lifecycle = node.start().await;
    let a = node.claims.add("a", "uid-a", &[(DRIVER, NODE, "dev-0")]);
    lifecycle.prepare(vec![a]).await["uid-a"]
        .as_ref()
        .expect("prepared");
    lifecycle.quiesce().await;
    drop(lifecycle);

    // What a crash could leave: a spec and an owner file of a claim with no record.
    std::fs::write(node.dir.path().join("devices/dev-2"), "uid-crashed").unwrap();
    let stray = serde_json::json!({"cdiVersion": "0.6.0", "kind": format!("{DRIVER}/claim"),
        "annotations": {(format!("{DRIVER}/claim-uid")): "uid-crashed",
                        (format!("{DRIVER}/claim-name")): "crashed"}, "devices": []});
    std::fs::write(
        node.dir
            .path()
            .join(format!("cdi/{DRIVER}-claim_uid-crashed.json")),
        stray.to_string(),
    )
    .unwrap();
    // And a lost spec of the prepared claim.
    std::fs::remove_file(
        node.dir
            .path()
            .join(format!("cdi/{DRIVER}-claim_uid-a.json")),
    )
    .unwrap();

    let lifecycle = node.start().await;
    assert_eq!(
        node.owner("dev-2"),
        None,
        "the orphan owner file is removed"
    );
    assert_eq!(node.spec("uid-crashed"), None, "the orphan spec is removed");
    assert!(node.spec("uid-a").is_some(), "the lost spec is rewritten");
    assert_eq!(node.owner("dev-0").as_deref(), Some("uid-a"));
    assert_eq!(lifecycle.prepared_claims().await, ["uid-a"]);
}

#[tokio::test]
async fn a_prepared_claim_deleted_or_replaced_in_the_api_server_is_unprepared_by_the_stale_check() {
    let node = Node::new();
    let lifecycle = node.start().await;
    let a = node.claims.add("a", "uid-a", &[(DRIVER, NODE, "dev-0")]);
    let b = node.claims.add("b", "uid-b", &[(DRIVER, NODE, "dev-1")]);
    let c = node.claims.add("c", "uid-c", &[(DRIVER, NODE, "dev-2")]);
    let out = lifecycle.prepare(vec![a, b, c]).await;
    assert!(out.values().all(Result::is_ok), "{out:?}");

    // b is deleted, c is re-created under its name with another UID; a is untouched.
    node.claims.0.lock().unwrap().remove("ns/b");
    node.claims.add("c", "uid-c2", &[(DRIVER, NODE, "dev-3")]);
    let mut released = lifecycle.unprepare_stale().await;
    released.sort();
    assert_eq!(released, ["uid-b", "uid-c"]);
    assert_eq!(lifecycle.prepared_claims().await, ["uid-a"]);
    assert_eq!(node.spec("uid-b"), None);
    assert_eq!(node.owner("dev-2"), None);
    assert_eq!(node.owner("dev-0").as_deref(), Some("uid-a"));
}
