//! The claim controller against an in-memory claim source: edge cases the real API server makes
//! awkward to produce. The happy path over the real API server is in tests/e2e.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use dra_kubelet::{ClaimRef, Driver};
use gpu_inventory::{FakeBackend, Topology, discover};
use gpu_kubelet_plugin::cdi::CdiWriter;
use gpu_kubelet_plugin::checkpoint::CheckpointFile;
use gpu_kubelet_plugin::claims::{ClaimController, ClaimSource};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
    ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

const DRIVER: &str = "gpu.example.com";
const NODE: &str = "node-a";

#[derive(Default)]
struct Claims {
    claims: Mutex<BTreeMap<String, ResourceClaim>>,
    gets: AtomicUsize,
}

impl ClaimSource for &'static Claims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        Ok(self
            .claims
            .lock()
            .unwrap()
            .get(&format!("{namespace}/{name}"))
            .cloned())
    }
}

fn claim(name: &str, uid: &str, results: &[(&str, &str, &str)]) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        status: (!results.is_empty()).then(|| ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(
                        results
                            .iter()
                            .map(|(driver, pool, device)| DeviceRequestAllocationResult {
                                driver: (*driver).into(),
                                pool: (*pool).into(),
                                device: (*device).into(),
                                request: "gpus".into(),
                                ..Default::default()
                            })
                            .collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn claim_ref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    source: &'static Claims,
}

impl Fixture {
    fn new(claims: Vec<ResourceClaim>) -> Self {
        let source: &'static Claims = Box::leak(Box::default());
        for c in claims {
            let key = format!(
                "{}/{}",
                c.metadata.namespace.clone().unwrap_or_default(),
                c.metadata.name.clone().unwrap_or_default()
            );
            source.claims.lock().unwrap().insert(key, c);
        }
        Self {
            dir: tempfile::tempdir().unwrap(),
            source,
        }
    }

    fn controller(&self) -> ClaimController<&'static Claims> {
        let topology = Topology::from_file(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../examples/topologies/dgx-h100.yaml"),
        )
        .unwrap();
        let inventory = discover(&FakeBackend::new(topology)).unwrap();
        ClaimController::new(
            self.source,
            DRIVER,
            NODE,
            inventory.gpus,
            CdiWriter::new(self.dir.path().join("cdi"), DRIVER),
            CheckpointFile::new(self.dir.path().join("checkpoint.json")),
        )
        .unwrap()
    }

    fn cdi_files(&self) -> usize {
        std::fs::read_dir(self.dir.path().join("cdi")).map_or(0, |d| d.count())
    }
}

#[tokio::test]
async fn prepare_is_idempotent_and_survives_a_restart_without_asking_the_api_server() {
    let f = Fixture::new(vec![claim(
        "two",
        "u2",
        &[(DRIVER, NODE, "gpu-1"), (DRIVER, NODE, "gpu-5")],
    )]);
    let first = f.controller().prepare(vec![claim_ref("two", "u2")]).await;
    let devices = first["u2"].as_ref().expect("prepared").clone();
    assert_eq!(
        devices
            .iter()
            .map(|d| d.device_name.as_str())
            .collect::<Vec<_>>(),
        ["gpu-1", "gpu-5"]
    );
    assert_eq!(f.source.gets.load(Ordering::SeqCst), 1);

    let restarted = f.controller();
    let again = restarted.prepare(vec![claim_ref("two", "u2")]).await;
    assert_eq!(again["u2"].as_ref().expect("prepared"), &devices);
    assert_eq!(
        f.source.gets.load(Ordering::SeqCst),
        1,
        "answered from the checkpoint"
    );
    assert_eq!(f.cdi_files(), 1);
}

#[tokio::test]
async fn each_bad_claim_gets_its_own_error_naming_the_field_and_good_claims_still_prepare() {
    let f = Fixture::new(vec![
        claim("good", "u1", &[(DRIVER, NODE, "gpu-0")]),
        claim("unallocated", "u2", &[]),
        claim(
            "elsewhere",
            "u3",
            &[
                (DRIVER, "node-b", "gpu-0"),
                ("other.example.com", NODE, "x"),
            ],
        ),
        claim("ghost-device", "u4", &[(DRIVER, NODE, "gpu-99")]),
    ]);
    let c = f.controller();
    let results = c
        .prepare(vec![
            claim_ref("good", "u1"),
            claim_ref("unallocated", "u2"),
            claim_ref("elsewhere", "u3"),
            claim_ref("ghost-device", "u4"),
            claim_ref("missing", "u5"),
            claim_ref("good", "wrong-uid"),
        ])
        .await;
    assert!(results["u1"].is_ok());
    let err = |uid: &str| results[uid].as_ref().expect_err("must fail").to_string();
    for (uid, needles) in [
        ("u2", &["ns/unallocated", "status.allocation"][..]),
        (
            "u3",
            &["ns/elsewhere", "driver gpu.example.com", "pool node-a"][..],
        ),
        (
            "u4",
            &["ns/ghost-device", "results[0].device", "gpu-99"][..],
        ),
        ("u5", &["ns/missing", "not found"][..]),
        ("wrong-uid", &["ns/good", "metadata.uid", "\"u1\""][..]),
    ] {
        let e = err(uid);
        for n in needles {
            assert!(e.contains(n), "{uid}: {e:?} lacks {n:?}");
        }
    }
    // Only the good claim left anything behind, and it is intact.
    assert_eq!(f.cdi_files(), 1);
    assert_eq!(c.prepared_claims().await, ["u1"]);
}

#[tokio::test]
async fn unprepare_removes_what_prepare_made_and_unknown_claims_succeed() {
    let f = Fixture::new(vec![
        claim("a", "ua", &[(DRIVER, NODE, "gpu-2")]),
        claim("b", "ub", &[(DRIVER, NODE, "gpu-3")]),
    ]);
    let c = f.controller();
    let prepared = c
        .prepare(vec![claim_ref("a", "ua"), claim_ref("b", "ub")])
        .await;
    assert!(prepared.values().all(Result::is_ok));
    assert_eq!(f.cdi_files(), 2);
    let results = c
        .unprepare(vec![claim_ref("a", "ua"), claim_ref("never", "un")])
        .await;
    assert!(results.values().all(Result::is_ok), "{results:?}");
    assert_eq!(c.prepared_claims().await, ["ub"]);
    assert_eq!(f.cdi_files(), 1);
    // Unprepared state is durable: a restart sees only b.
    assert_eq!(f.controller().prepared_claims().await, ["ub"]);
}

#[tokio::test]
async fn concurrent_prepares_of_the_same_claim_agree() {
    let f = Fixture::new(vec![claim("c", "uc", &[(DRIVER, NODE, "gpu-7")])]);
    let c = f.controller();
    let (a, b) = tokio::join!(
        c.prepare(vec![claim_ref("c", "uc")]),
        c.prepare(vec![claim_ref("c", "uc")])
    );
    assert_eq!(a["uc"].as_ref().ok(), b["uc"].as_ref().ok());
    assert_eq!(c.prepared_claims().await, ["uc"]);
    assert_eq!(f.cdi_files(), 1);
}
