//! A prepare that misses its deadline is rolled back in the background, except for a claim that
//! was prepared before the call: one whose recovery step (here a slow `revive`) ran past the
//! deadline keeps its record and its CDI spec, since its containers may be running. A prepare
//! that fails is answered within the deadline even when its rollback is slow: the rollback goes
//! on in the background, to completion.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use dra_kubelet::{ClaimRef, Driver as _, PreparedDevice};
use dra_plugin::cdi::{CDI_VERSION, CdiWriter, Spec};
use dra_plugin::checkpoint::{Format, SlotFile};
use dra_plugin::lifecycle::{Driver, Error, Lifecycle, Planned, Prepared, Settings};
use dra_plugin::record::{ClaimRecord, Records};
use dra_plugin::storage::RealFs;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Dev(String);

struct V1;
impl Format for V1 {
    type Data = Records<Dev>;
    const VERSION: u32 = 1;
    fn min_reader_version(_: &Records<Dev>) -> u32 {
        1
    }
}

/// `revive` fails its first `fail` calls, then waits until `release` is true before it succeeds.
/// The device step fails when `fail_prepare`; undoing the devices waits until `undo` is true,
/// then sets `undone`.
struct Slow {
    revives: AtomicU32,
    fail: u32,
    release: watch::Receiver<bool>,
    fail_prepare: bool,
    undo: watch::Receiver<bool>,
    undone: Arc<AtomicBool>,
}

impl Driver for Slow {
    type Device = Dev;
    type Format = V1;
    type Error = Error;
    type Plan = ();
    type Orphans = ();

    async fn plan(&self, _: &Lifecycle<Self>, _: &ClaimRef) -> Result<Planned<Self>, Error> {
        Ok(Planned {
            devices: vec![Dev("dev-0".into())],
            spec: None,
            two_phase: true,
            plan: (),
        })
    }
    async fn prepare_devices(
        &self,
        l: &Lifecycle<Self>,
        claim: &ClaimRef,
        (): (),
    ) -> Result<Prepared<Dev>, Error> {
        if self.fail_prepare {
            return Err(Error::TaskFailed {
                claim: claim.clone(),
                action: "device step",
                message: "the device refused".into(),
            });
        }
        let spec = Spec {
            cdi_version: CDI_VERSION.into(),
            kind: l.cdi().kind(),
            ..Spec::default()
        };
        Ok(Prepared {
            devices: vec![Dev("dev-0".into())],
            spec,
        })
    }
    fn changes_node(&self, _: &[Dev]) -> bool {
        true
    }
    async fn unprepare_devices(
        &self,
        _: &Lifecycle<Self>,
        _: &ClaimRef,
        _: &ClaimRecord<Dev>,
        _: bool,
    ) -> Result<(), Error> {
        let mut undo = self.undo.clone();
        let _ = undo.wait_for(|u| *u).await;
        self.undone.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn prepared_device(d: &Dev) -> PreparedDevice {
        PreparedDevice {
            request_names: vec![],
            pool_name: "node-a".into(),
            device_name: d.0.clone(),
            cdi_device_ids: vec![],
            share_id: None,
        }
    }
    async fn revive(
        &self,
        _: &Lifecycle<Self>,
        claim: &ClaimRef,
        _: &ClaimRecord<Dev>,
    ) -> Result<bool, Error> {
        if self.revives.fetch_add(1, Ordering::SeqCst) < self.fail {
            return Err(Error::TaskFailed {
                claim: claim.clone(),
                action: "revive",
                message: "not yet".into(),
            });
        }
        let mut release = self.release.clone();
        let _ = release.wait_for(|r| *r).await;
        Ok(true)
    }
    async fn rebuild_claim(&self, _: &Lifecycle<Self>, _: &ClaimRef, _: &Spec) -> Option<Vec<Dev>> {
        None
    }
    async fn remove_orphans(&self, _: &Lifecycle<Self>, _: &BTreeSet<String>) {}
}

fn lifecycle(dir: &std::path::Path, fail: u32, release: watch::Receiver<bool>) -> Lifecycle<Slow> {
    with_driver(
        dir,
        Slow {
            revives: AtomicU32::new(0),
            fail,
            release,
            fail_prepare: false,
            undo: watch::channel(true).1,
            undone: Arc::default(),
        },
    )
}

fn with_driver(dir: &std::path::Path, driver: Slow) -> Lifecycle<Slow> {
    let fs = Arc::new(RealFs);
    Lifecycle::new(
        driver,
        SlotFile::new(fs.clone(), dir.join("checkpoint.json")),
        CdiWriter::new(fs, dir.join("cdi"), "dev.example.com"),
        Settings {
            timeout: Duration::from_millis(300),
            node_name: "node-a".into(),
            boot_id: "boot-1".into(),
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_prepared_before_stays_prepared_when_its_recovery_misses_the_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let claim = ClaimRef {
        namespace: "ns".into(),
        name: "a".into(),
        uid: "uid-a".into(),
    };
    let (release, released) = watch::channel(true);
    let first = lifecycle(dir.path(), 0, released.clone());
    first.recover().await.expect("start");
    first.prepare(vec![claim.clone()]).await["uid-a"]
        .as_ref()
        .expect("prepared");
    first.quiesce().await;
    drop(first);

    // After a restart, the claim's recovery step fails once (so a prepare runs it again), and
    // the kubelet's retry finds it slow: past the 300 ms deadline.
    release.send_replace(false);
    let second = lifecycle(dir.path(), 1, released);
    let report = second.recover().await.expect("start");
    assert_eq!(report.failed.len(), 1, "{report:?}");
    let answer = second.prepare(vec![claim.clone()]).await;
    let error = answer["uid-a"].as_ref().expect_err("missed the deadline");
    assert!(
        error.to_string().contains("did not finish within 300 ms"),
        "{error}"
    );

    // The step finishes after the deadline; the claim must still be prepared.
    release.send_replace(true);
    second.quiesce().await;
    assert_eq!(second.prepared_claims().await, ["uid-a"]);
    assert!(
        dir.path()
            .join("cdi/dev.example.com-claim_uid-a.json")
            .exists(),
        "its CDI spec is kept"
    );
}

/// Issue 41, defect 6: a prepare whose device step fails answers the kubelet with that failure
/// while its rollback is still undoing the devices (here held until the test lets it go), and
/// the rollback runs to completion afterwards: it was never dropped with the kubelet's call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prepare_answers_while_its_rollback_runs_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (undo, undo_rx) = watch::channel(false);
    let undone = Arc::new(AtomicBool::new(false));
    let l = with_driver(
        dir.path(),
        Slow {
            revives: AtomicU32::new(0),
            fail: 0,
            release: watch::channel(true).1,
            fail_prepare: true,
            undo: undo_rx,
            undone: Arc::clone(&undone),
        },
    );
    l.recover().await.expect("start");
    let claim = ClaimRef {
        namespace: "ns".into(),
        name: "a".into(),
        uid: "uid-a".into(),
    };
    // Only a hang takes a minute: the rollback used to run inline, so the answer waited on it.
    let answer = tokio::time::timeout(Duration::from_secs(60), l.prepare(vec![claim.clone()]))
        .await
        .expect("answered while the rollback waits");
    let error = answer["uid-a"]
        .as_ref()
        .expect_err("the device step failed");
    assert!(error.to_string().contains("the device refused"), "{error}");
    assert!(!undone.load(Ordering::SeqCst), "the rollback is still held");

    undo.send_replace(true);
    l.quiesce().await;
    assert!(
        undone.load(Ordering::SeqCst),
        "the rollback ran to completion"
    );
    assert!(l.prepared_claims().await.is_empty());
    assert!(
        l.records().await.claims.is_empty(),
        "the record is released"
    );
}
