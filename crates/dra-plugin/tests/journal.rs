//! The journal with a small format of its own: concurrent changes become durable together in
//! fewer stores than changes (group commit), each caller returns only once its change is on
//! disk, and a failed store fails every change it carried and puts the records back.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use dra_plugin::checkpoint::{Format, SlotFile};
use dra_plugin::journal::{Journal, UpdateError};
use dra_plugin::storage::{Fs, RealFs};
use serde::{Deserialize, Serialize};
use tokio_util::task::TaskTracker;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Records {
    claims: BTreeMap<String, String>,
}

struct RecordsFormat;

impl Format for RecordsFormat {
    type Data = Records;
    const VERSION: u32 = 1;
    fn min_reader_version(_: &Records) -> u32 {
        1
    }
}

/// `std::fs`, with each file sync counted and held while `held` is set (so that changes pile
/// up behind a store), and writes failing while `fail` is set.
#[derive(Debug, Default)]
struct SlowFs {
    syncs: AtomicUsize,
    fail: AtomicBool,
    held: std::sync::Mutex<bool>,
    released: std::sync::Condvar,
}

impl SlowFs {
    fn hold(&self, held: bool) {
        *self.held.lock().expect("lock") = held;
        self.released.notify_all();
    }
}

impl SlowFs {
    fn check(&self) -> io::Result<()> {
        if self.fail.load(Ordering::SeqCst) {
            Err(io::Error::other("injected: the disk is gone"))
        } else {
            Ok(())
        }
    }
}

impl Fs for SlowFs {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        RealFs.read(path)
    }
    fn write(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        self.check()?;
        RealFs.write(path, bytes)
    }
    fn overwrite(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        self.check()?;
        RealFs.overwrite(path, bytes)
    }
    fn sync_file(&self, path: &Path) -> io::Result<()> {
        let mut held = self.held.lock().expect("lock");
        while *held {
            held = self.released.wait(held).expect("lock");
        }
        drop(held);
        self.syncs.fetch_add(1, Ordering::SeqCst);
        RealFs.sync_file(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        RealFs.sync_dir(dir)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        RealFs.remove(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        RealFs.list(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealFs.create_dir_all(dir)
    }
}

fn journal(dir: &Path, fs: &Arc<SlowFs>) -> Arc<Journal<RecordsFormat>> {
    let file = SlotFile::new(Arc::clone(fs) as Arc<dyn Fs>, dir.join("checkpoint.json"));
    Arc::new(Journal::new(file, TaskTracker::new()))
}

fn on_disk(dir: &Path) -> Records {
    SlotFile::<RecordsFormat>::new(Arc::new(RealFs), dir.join("checkpoint.json"))
        .load()
        .expect("load")
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_changes_share_stores_and_each_returns_durable() {
    let dir = tempfile::tempdir().expect("dir");
    let fs = Arc::new(SlowFs::default());
    let j = journal(dir.path(), &fs);
    // The first store is held at its sync until all twenty changes are staged.
    fs.hold(true);
    let mut tasks = Vec::new();
    for n in 0..20 {
        let j = Arc::clone(&j);
        let path = dir.path().to_owned();
        tasks.push(tokio::spawn(async move {
            let uid = format!("claim-{n:02}");
            j.update(|r: &mut Records| {
                r.claims.insert(uid.clone(), "prepared".into());
                Ok::<_, std::convert::Infallible>(())
            })
            .await
            .expect("update");
            // Returned: the change is on disk.
            assert!(
                on_disk(&path).claims.contains_key(&uid),
                "{uid} not durable"
            );
        }));
    }
    while j.records().await.claims.len() < 20 {
        tokio::task::yield_now().await;
    }
    fs.hold(false);
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(on_disk(dir.path()).claims.len(), 20);
    // The held store carried what was staged when it began; one more carries the rest.
    let syncs = fs.syncs.load(Ordering::SeqCst);
    assert!(
        syncs <= 2,
        "20 changes took {syncs} stores: no group commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_store_fails_its_changes_and_puts_the_records_back() {
    let dir = tempfile::tempdir().expect("dir");
    let fs = Arc::new(SlowFs::default());
    let j = journal(dir.path(), &fs);
    let insert = |uid: &'static str| {
        move |r: &mut Records| {
            r.claims.insert(uid.into(), "prepared".into());
            Ok::<_, String>(())
        }
    };
    j.update(insert("a")).await.expect("a");
    fs.fail.store(true, Ordering::SeqCst);
    match j.update(insert("b")).await {
        Err(UpdateError::Commit(e)) => assert!(e.to_string().contains("the disk is gone"), "{e}"),
        other => panic!("want a commit error, got {other:?}"),
    }
    // In memory as on disk: b is gone, a stays.
    assert_eq!(j.records().await.claims.keys().collect::<Vec<_>>(), ["a"]);
    // A change that refuses stages nothing and says why.
    match j
        .update(|_: &mut Records| Err::<(), _>("no such device".to_owned()))
        .await
    {
        Err(UpdateError::Change(e)) => assert_eq!(e, "no such device"),
        other => panic!("want the change's error, got {other:?}"),
    }
    fs.fail.store(false, Ordering::SeqCst);
    j.update(insert("c")).await.expect("c");
    assert_eq!(
        on_disk(dir.path()).claims.keys().collect::<Vec<_>>(),
        ["a", "c"]
    );
}
