//! Issue 41, defect 4: every call the plugin makes to the API server has a deadline. Against an
//! API server that accepts connections and never answers (a blackholed one, as after a network
//! partition), the plugin's own client gives up, a claim read fails naming the deadline and
//! frees the claim, a warning never holds its caller, and a start-up that rebuilds claims from
//! their CDI specs reads them all at once instead of one deadline after another.
//!
//! Each test bounds itself with a generous outer deadline that only a hang reaches: the
//! verdict is whether the call ends, never how fast.

mod common;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use dra_kubelet::Driver;
use gpu_kubelet_plugin::claims::{Cluster, KubeCluster};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

/// Only a hang takes this long.
const HANG: Duration = Duration::from_secs(60);

/// A TCP server on loopback that accepts every connection, reads nothing and answers nothing,
/// holding each connection open for the life of the test. Its address.
fn blackhole() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    format!("http://{address}")
}

/// The plugin's own client (`kube_client`, from a kubeconfig) for `server`, with the plugin's
/// API deadline set to `timeout`.
async fn plugin_client(dir: &std::path::Path, server: &str, timeout: Duration) -> kube::Client {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \
             \"{server}\"}}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\n\
             current-context: c\nusers:\n- name: u\n  user: {{token: t}}\n"
        ),
    )
    .expect("kubeconfig");
    let mut config = gpu_kubelet_plugin::Config::new(
        DRIVER,
        NODE,
        gpu_kubelet_plugin::Backend::Fake {
            topology: "unused".into(),
            state_dir: None,
        },
    );
    config.kubeconfig = Some(kubeconfig);
    config.api_timeout = timeout;
    gpu_kubelet_plugin::kube_client(&config)
        .await
        .expect("a client")
}

#[tokio::test]
async fn the_plugins_client_gives_up_on_an_api_server_that_never_answers() {
    let dir = tempfile::tempdir().unwrap();
    let client = plugin_client(dir.path(), &blackhole(), Duration::from_millis(300)).await;
    // Any call through the plugin's client: its read deadline ends it (kube's default has none).
    let read = tokio::time::timeout(
        HANG,
        Api::<ResourceClaim>::namespaced(client.clone(), "ns").get_opt("a"),
    )
    .await
    .expect("the client's own read deadline ended the call");
    assert!(read.is_err(), "{read:?}");

    // The claim controller's cluster: the read fails naming what and how long; a warning goes
    // to the background and its caller goes on.
    let cluster = KubeCluster::new(client, DRIVER, NODE).with_timeout(Duration::from_millis(300));
    let e = tokio::time::timeout(HANG, cluster.get_claim("ns", "a"))
        .await
        .expect("bounded")
        .expect_err("no answer");
    assert!(e.to_string().contains("ResourceClaim ns/a"), "{e}");
    tokio::time::timeout(HANG, cluster.warn("Test", "never delivered"))
        .await
        .expect("a warning never holds its caller");
    tokio::time::timeout(HANG, cluster.warning("Test", "Test", "never delivered"))
        .await
        .expect("an event's own write is bounded too");
}

/// A prepare whose claim read meets a blackholed API server fails with the read's error, and
/// the claim's lock is free: the kubelet's next call is answered too (it used to wait behind
/// the first for ever).
#[tokio::test]
async fn a_prepare_against_an_unanswering_api_server_fails_and_frees_the_claim() {
    let dir = tempfile::tempdir().unwrap();
    let client = plugin_client(dir.path(), &blackhole(), Duration::from_secs(1)).await;
    let cluster = KubeCluster::new(client, DRIVER, NODE).with_timeout(Duration::from_secs(1));
    let c = controller_over(
        dir.path(),
        cluster,
        Arc::new(ScriptedHardware::default()),
        node_devices(),
    )
    .await;
    for round in 0..2 {
        let r = tokio::time::timeout(HANG, c.prepare(vec![claim_ref("a", "ua")]))
            .await
            .unwrap_or_else(|_| panic!("round {round}: the prepare never ended"));
        let e = r["ua"].as_ref().expect_err("no claim to read").to_string();
        assert!(e.contains("ResourceClaim ns/a"), "round {round}: {e}");
    }
    assert!(c.prepared_claims().await.is_empty());
}

/// A cluster whose claim reads wait until `n` of them are under way at once: rebuilding `n`
/// claims one read after another never gets past the first.
#[derive(Clone)]
struct AllAtOnce {
    inner: Shared,
    barrier: Arc<tokio::sync::Barrier>,
}

impl Cluster for AllAtOnce {
    async fn get_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ResourceClaim>, kube::Error> {
        self.barrier.wait().await;
        self.inner.get_claim(namespace, name).await
    }

    async fn warn(&self, reason: &str, message: &str) {
        self.inner.warn(reason, message).await;
    }
}

/// After a damaged checkpoint, start-up reads every claim it rebuilds from a CDI spec at once,
/// so that an unanswering API server costs one deadline, not one per claim.
#[tokio::test]
async fn a_rebuild_reads_its_claims_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Shared::default();
    let names = [("a", "ua", 1), ("b", "ub", 2), ("c", "uc", 3)];
    for (name, uid, gpu) in names {
        cluster.put(claim(name, uid, &[(DRIVER, NODE, dev(gpu))]));
    }
    let hardware = Arc::new(ScriptedHardware::default());
    let c = controller_in(dir.path(), cluster.clone(), Arc::clone(&hardware)).await;
    let r = c
        .prepare(names.iter().map(|(n, u, _)| claim_ref(n, u)).collect())
        .await;
    assert!(r.values().all(Result::is_ok), "{r:?}");
    drop(c);
    let checkpoint = gpu_kubelet_plugin::checkpoint::CheckpointFile::new(
        Arc::new(gpu_kubelet_plugin::storage::RealFs),
        dir.path().join("plugin/checkpoint.json"),
    );
    for slot in checkpoint.slot_paths() {
        std::fs::write(slot, b"{\"version\":2,\"chec").unwrap();
    }
    let gated = AllAtOnce {
        inner: cluster,
        barrier: Arc::new(tokio::sync::Barrier::new(names.len())),
    };
    let c = tokio::time::timeout(
        HANG,
        controller_over(dir.path(), gated, hardware, node_devices()),
    )
    .await
    .expect("the rebuild's reads were under way together");
    assert_eq!(c.prepared_claims().await, ["ua", "ub", "uc"]);
}

/// Issue 41, defect 9: the reviews that guard `/metrics` and `/usage` have the same deadline. A
/// TokenReview and a SubjectAccessReview sent to an API server that never answers end, and
/// the caller is told 503 (the API server did not answer), never left waiting.
#[tokio::test]
async fn the_http_checks_reviews_end_on_an_api_server_that_never_answers() {
    use gpu_kubelet_plugin::http::auth::{ApiServerReviews, Attributes, Reviews, User};
    let dir = tempfile::tempdir().unwrap();
    let timeout = Duration::from_millis(300);
    let client = plugin_client(dir.path(), &blackhole(), timeout).await;
    let reviews = ApiServerReviews::new(client, timeout);
    let e = tokio::time::timeout(HANG, reviews.authenticate("a-token"))
        .await
        .expect("the TokenReview is bounded")
        .expect_err("no answer");
    assert_eq!(e.status(), hyper::StatusCode::SERVICE_UNAVAILABLE, "{e}");
    assert!(e.to_string().contains("TokenReview"), "{e}");
    let user = User {
        name: "system:serviceaccount:monitoring:prometheus".into(),
        ..User::default()
    };
    let e = tokio::time::timeout(HANG, reviews.authorize(&user, &Attributes::get("/metrics")))
        .await
        .expect("the SubjectAccessReview is bounded")
        .expect_err("no answer");
    assert_eq!(e.status(), hyper::StatusCode::SERVICE_UNAVAILABLE, "{e}");
    assert!(e.to_string().contains("SubjectAccessReview"), "{e}");
}
