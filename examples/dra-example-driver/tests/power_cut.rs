//! A power cut at every file-system operation of the example driver's calls
//! ([`dra_plugin::testing::PowerCutFs`]): after each cut (and, where a checkpoint slot was
//! being overwritten, with that slot torn), the restarted driver must recover to a consistent
//! state (every completed claim has its CDI spec and its devices' owner files, nothing else is
//! left), and repeating the kubelet's calls must end exactly where an uninterrupted run ends.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::FakeClaims;
use dra_example_driver::{ExampleDriver, device_names};
use dra_kubelet::{ClaimRef, Driver as _};
use dra_plugin::cdi::CdiWriter;
use dra_plugin::checkpoint::SlotFile;
use dra_plugin::lifecycle::{Lifecycle, Settings};
use dra_plugin::storage::Fs;
use dra_plugin::testing::PowerCutFs;

const DRIVER: &str = "example.drust.dev";
const NODE: &str = "node-a";
const CDI: &str = "/run/cdi";
const PLUGIN: &str = "/var/lib/plugin";
const STATE: &str = "/var/lib/plugin/devices";

/// Claims `a` (dev-1), `b` (dev-2, dev-3) and `c` (dev-1).
fn claims() -> FakeClaims {
    let claims = FakeClaims::default();
    for (name, devices) in [
        ("a", &["dev-1"][..]),
        ("b", &["dev-2", "dev-3"]),
        ("c", &["dev-1"]),
    ] {
        let allocated: Vec<(&str, &str, &str)> =
            devices.iter().map(|d| (DRIVER, NODE, *d)).collect();
        claims.add(name, &format!("u{name}"), &allocated);
    }
    claims
}

fn claim(name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        name: name.into(),
        uid: format!("u{name}"),
    }
}

/// A lifecycle on `fs`, recovered; `Err` when recovery itself failed (the power is out).
async fn start(
    fs: Arc<PowerCutFs>,
    claims: &FakeClaims,
) -> Result<Lifecycle<ExampleDriver<FakeClaims>>, String> {
    let lifecycle = Lifecycle::new(
        ExampleDriver {
            driver_name: DRIVER.into(),
            pool: NODE.into(),
            devices: device_names(4),
            state_dir: STATE.into(),
            fs: fs.clone(),
            claims: claims.clone(),
        },
        SlotFile::new(fs.clone(), Path::new(PLUGIN).join("checkpoint.json")),
        CdiWriter::new(fs, CDI, DRIVER),
        Settings {
            timeout: Duration::from_secs(10),
            node_name: NODE.into(),
            boot_id: "boot".into(),
        },
    );
    lifecycle.recover().await.map_err(|e| e.to_string())?;
    Ok(lifecycle)
}

/// The kubelet's calls: prepare a, prepare b, unprepare a, prepare c.
async fn script(l: &Lifecycle<ExampleDriver<FakeClaims>>) {
    let _ = l.prepare(vec![claim("a")]).await;
    let _ = l.prepare(vec![claim("b")]).await;
    let _ = l.unprepare(vec![claim("a")]).await;
    let _ = l.prepare(vec![claim("c")]).await;
}

/// What the node holds: prepared claims, CDI spec files, owner files (device: claim UID).
async fn state(
    fs: &PowerCutFs,
    l: &Lifecycle<ExampleDriver<FakeClaims>>,
) -> (Vec<String>, Vec<String>, BTreeMap<String, String>) {
    let owners = fs
        .files(Path::new(STATE))
        .into_iter()
        .map(|d| {
            let owner = fs.read(&Path::new(STATE).join(&d)).unwrap_or_default();
            (d, String::from_utf8_lossy(&owner).into_owned())
        })
        .collect();
    (l.prepared_claims().await, fs.files(Path::new(CDI)), owners)
}

/// Right after recovery: every record is completed, with its spec and its owner files, and
/// there is no spec, owner file or temp file without one.
async fn check_consistent(fs: &PowerCutFs, l: &Lifecycle<ExampleDriver<FakeClaims>>, cut: usize) {
    let records = l.records().await.clone();
    let (prepared, specs, owners) = state(fs, l).await;
    assert_eq!(
        prepared.len(),
        records.claims.len(),
        "cut {cut}: a record not completed"
    );
    let want_specs: Vec<String> = prepared
        .iter()
        .map(|uid| format!("{DRIVER}-claim_{uid}.json"))
        .collect();
    assert_eq!(specs, want_specs, "cut {cut}: CDI specs");
    let want_owners: BTreeMap<String, String> = records
        .claims
        .iter()
        .flat_map(|(uid, r)| {
            r.devices
                .iter()
                .map(move |d| (d.device_name.clone(), uid.clone()))
        })
        .collect();
    assert_eq!(owners, want_owners, "cut {cut}: owner files");
    for dir in [CDI, PLUGIN, STATE] {
        let temp: Vec<String> = fs
            .files(Path::new(dir))
            .into_iter()
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(temp.is_empty(), "cut {cut}: temp files {temp:?} in {dir}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_at_every_operation_recovers_and_ends_like_the_clean_run() {
    let claims = claims();
    let clean_fs = Arc::new(PowerCutFs::with_budget(None));
    let clean = start(clean_fs.clone(), &claims).await.expect("clean start");
    script(&clean).await;
    let want = state(&clean_fs, &clean).await;
    assert_eq!(want.0, ["ub", "uc"]);
    let total_ops = clean_fs.ops();
    assert!(total_ops > 20, "only {total_ops} operations");

    let mut cuts = 0;
    for cut in 0..=total_ops {
        let fs = Arc::new(PowerCutFs::with_budget(Some(cut)));
        // The first start may itself lose power; then the next one runs on what survived.
        if let Ok(l) = start(fs.clone(), &claims).await {
            script(&l).await;
            l.quiesce().await;
        }
        let tears: &[bool] = if fs.could_tear() {
            &[false, true]
        } else {
            &[false]
        };
        for &tear in tears {
            let after = Arc::new(fs.after_power_cut(tear));
            let l = start(after.clone(), &claims)
                .await
                .unwrap_or_else(|e| panic!("cut {cut} (torn: {tear}): recovery failed: {e}"));
            check_consistent(&after, &l, cut).await;
            script(&l).await;
            assert_eq!(
                state(&after, &l).await,
                want,
                "cut {cut} (torn: {tear}): repeating the calls ends elsewhere"
            );
            cuts += 1;
        }
    }
    eprintln!("{cuts} power cuts over {total_ops} operations");
}
