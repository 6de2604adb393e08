//! Every log line of a claim carries the claim's span (uid, namespace, name). Its own test
//! binary: tracing caches per-callsite interest process-wide, so a test without a subscriber
//! running in parallel could hide these lines from the subscriber installed here.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use dra_kubelet::Driver;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn every_log_line_of_a_claim_carries_its_uid_namespace_and_name() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .without_time()
        .with_max_level(tracing::Level::INFO)
        .with_writer({
            let c = captured.clone();
            move || c.clone()
        })
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let dir = tempfile::tempdir().unwrap();
    let cluster = Shared::default();
    cluster.put(claim("good", "u1", &[(DRIVER, NODE, dev(0))]));
    cluster.put(claim("broken", "u2", &[(DRIVER, NODE, dev(1))]));
    let hardware = Arc::new(ScriptedHardware::default());
    hardware.failing.lock().unwrap().insert(dev(1).to_owned());
    let c = controller_in(dir.path(), cluster, Arc::clone(&hardware)).await;
    let r = c
        .prepare(vec![claim_ref("good", "u1"), claim_ref("broken", "u2")])
        .await;
    assert!(r["u1"].is_ok() && r["u2"].is_err(), "{r:?}");
    assert!(c.unprepare(vec![claim_ref("good", "u1")]).await["u1"].is_ok());

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let lines =
        |needle: &str| -> Vec<&str> { text.lines().filter(|l| l.contains(needle)).collect() };
    // The good claim: its prepare and its unprepare, each in its own span.
    let prepared = lines(": prepared");
    assert_eq!(prepared.len(), 1, "{text}");
    assert!(
        prepared[0].contains("prepare{uid=u1 namespace=ns name=good}"),
        "{}",
        prepared[0]
    );
    let unprepared: Vec<&str> = lines(": unprepared");
    assert!(
        unprepared
            .iter()
            .any(|l| l.contains("unprepare{uid=u1 namespace=ns name=good}")),
        "{text}"
    );
    // The broken claim's rollback logs inside the prepare span of that claim, not the other's.
    assert!(
        unprepared
            .iter()
            .any(|l| l.contains("prepare{uid=u2 namespace=ns name=broken}")),
        "{text}"
    );
    for l in text.lines().filter(|l| l.contains("u2")) {
        assert!(!l.contains("uid=u1"), "mixed spans: {l}");
    }
}
