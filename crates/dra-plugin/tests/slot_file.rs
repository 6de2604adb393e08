//! The two-slot checkpoint file with a driver's own format: a small one here (a map of names to
//! counts, version 3, with an unenveloped version 1), so that what the file guarantees is shown
//! without any device driver.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use dra_plugin::checkpoint::{CheckpointError, Format, SlotFile, slot_paths};
use dra_plugin::storage::RealFs;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Counts {
    #[serde(default)]
    counts: BTreeMap<String, u32>,
}

/// Version 3; version 1 was `{"version":1,"names":[…]}` (each name counted once); a file with a
/// count over 100 needs reader version 3.
struct CountsFormat;

impl Format for CountsFormat {
    type Data = Counts;
    const VERSION: u32 = 3;

    fn min_reader_version(data: &Counts) -> u32 {
        if data.counts.values().any(|c| *c > 100) {
            3
        } else {
            2
        }
    }

    fn single_slot(version: u32) -> bool {
        version < 2
    }

    fn unenveloped(version: u32, file: &[u8]) -> Option<Result<Counts, String>> {
        (version == 1).then(|| {
            #[derive(Deserialize)]
            struct V1 {
                names: Vec<String>,
            }
            serde_json::from_slice::<V1>(file)
                .map(|v| Counts {
                    counts: v.names.into_iter().map(|n| (n, 1)).collect(),
                })
                .map_err(|e| e.to_string())
        })
    }
}

fn file(dir: &Path) -> SlotFile<CountsFormat> {
    SlotFile::new(Arc::new(RealFs), dir.join("state/checkpoint.json"))
}

fn counts(pairs: &[(&str, u32)]) -> Counts {
    Counts {
        counts: pairs.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect(),
    }
}

#[test]
fn stores_alternate_slots_and_a_load_takes_the_newest() {
    let dir = tempfile::tempdir().expect("dir");
    let f = file(dir.path());
    assert_eq!(f.load().expect("load"), None);
    for n in 1..=5 {
        f.store(&counts(&[("a", n)])).expect("store");
        // Another handle (a restarted process) reads the same.
        assert_eq!(
            file(dir.path()).load().expect("load"),
            Some(counts(&[("a", n)]))
        );
    }
    let [a, b] = slot_paths(&dir.path().join("state/checkpoint.json"));
    let (a, b) = (
        std::fs::read(a).expect("slot a"),
        std::fs::read(b).expect("slot b"),
    );
    assert_eq!(a.len() % dra_plugin::checkpoint::SLOT_BLOCK, 0);
    let text = String::from_utf8_lossy(&a);
    assert!(
        text.starts_with("{\"version\":3,\"minReaderVersion\":2,\"checksum\":\"sha256:"),
        "{text}"
    );
    assert!(String::from_utf8_lossy(&b).contains("\"generation\":"));
}

#[test]
fn a_damaged_newest_slot_falls_back_to_the_previous_generation() {
    let dir = tempfile::tempdir().expect("dir");
    let f = file(dir.path());
    f.store(&counts(&[("a", 1)])).expect("store 1");
    f.store(&counts(&[("a", 2)])).expect("store 2");
    // Generation 2 is in slot b: flip a byte of its data.
    let [_, b] = slot_paths(&dir.path().join("state/checkpoint.json"));
    let mut bytes = std::fs::read(&b).expect("slot b");
    let at = bytes.windows(3).position(|w| w == b"\"a\"").expect("data");
    bytes[at + 1] = b'z';
    std::fs::write(&b, bytes).expect("damage");
    let again = file(dir.path());
    assert_eq!(again.load().expect("load"), Some(counts(&[("a", 1)])));
    // The next store overwrites the damaged slot.
    again.store(&counts(&[("a", 3)])).expect("store 3");
    assert_eq!(
        file(dir.path()).load().expect("load"),
        Some(counts(&[("a", 3)]))
    );
    // Both damaged: a named corruption error.
    for slot in slot_paths(&dir.path().join("state/checkpoint.json")) {
        std::fs::write(slot, b"{\"version\":3").expect("damage");
    }
    assert!(matches!(
        file(dir.path()).load(),
        Err(CheckpointError::Corrupt { .. })
    ));
}

#[test]
fn a_file_for_a_newer_reader_is_refused_and_one_with_new_fields_is_read() {
    let dir = tempfile::tempdir().expect("dir");
    let f = file(dir.path());
    f.store(&counts(&[("a", 1)])).expect("store");
    let path = dir.path().join("state/checkpoint.json");
    // A version 4 that only added a field, readable by version 2: read, the field ignored.
    let data = r#"{"generation":9,"counts":{"b":2},"newField":true}"#;
    let sum = {
        use sha2::{Digest, Sha256};
        Sha256::digest(data.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let newer =
        format!(r#"{{"version":4,"minReaderVersion":2,"checksum":"sha256:{sum}","data":{data}}}"#);
    std::fs::write(&path, &newer).expect("write");
    assert_eq!(
        file(dir.path()).load().expect("load"),
        Some(counts(&[("b", 2)]))
    );
    // A version 4 that needs reader version 4: refused, naming what this build reads.
    std::fs::write(
        &path,
        newer.replace("\"minReaderVersion\":2", "\"minReaderVersion\":4"),
    )
    .expect("write");
    match file(dir.path()).load() {
        Err(
            e @ CheckpointError::TooNew {
                needed: 4,
                written: 4,
                reads: 3,
                ..
            },
        ) => {
            assert!(e.to_string().contains("reads up to 3"), "{e}");
        }
        other => panic!("want TooNew, got {other:?}"),
    }
}

#[test]
fn a_large_count_is_written_for_newer_readers_only() {
    let dir = tempfile::tempdir().expect("dir");
    file(dir.path())
        .store(&counts(&[("a", 101)]))
        .expect("store");
    let text = std::fs::read_to_string(dir.path().join("state/checkpoint.json")).expect("slot");
    assert!(text.contains("\"minReaderVersion\":3"), "{text}");
}

#[test]
fn an_unenveloped_version_is_upgraded_in_place_at_the_next_store() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state/checkpoint.json");
    std::fs::create_dir_all(path.parent().expect("parent")).expect("dir");
    std::fs::write(&path, r#"{"version":1,"names":["a","b"]}"#).expect("v1");
    let f = file(dir.path());
    assert_eq!(f.load().expect("load"), Some(counts(&[("a", 1), ("b", 1)])));
    // A single-slot file is replaced where it is (its build reads slot 0 alone).
    f.store(&counts(&[("a", 2)])).expect("store");
    let [a, b] = slot_paths(&path);
    assert!(
        !b.exists(),
        "the second slot is not written while slot 0 is single-slot"
    );
    assert!(
        std::fs::read_to_string(&a)
            .expect("a")
            .starts_with("{\"version\":3")
    );
    f.store(&counts(&[("a", 3)])).expect("store");
    assert!(b.exists());
    assert_eq!(
        file(dir.path()).load().expect("load"),
        Some(counts(&[("a", 3)]))
    );
    // A version 1 file that is not one is a corruption error naming the problem.
    std::fs::remove_file(&b).expect("rm");
    std::fs::write(&a, r#"{"version":1}"#).expect("bad v1");
    match file(dir.path()).load() {
        Err(CheckpointError::Corrupt { problem, .. }) => {
            assert!(problem.contains("names"), "{problem}")
        }
        other => panic!("want Corrupt, got {other:?}"),
    }
}
