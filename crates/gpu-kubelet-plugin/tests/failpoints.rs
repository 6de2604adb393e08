//! A failpoint nobody arms proves nothing: every `failpoint::hit("<name>")` in the plugin's code
//! and in the lifecycle it runs on (`dra-plugin`) is listed in `failpoint::ALL` or `failpoint::MIG`, every listed one is hit somewhere, and the
//! end-to-end tests that SIGKILL the plugin iterate over those lists (fault_injection.rs over
//! `ALL`, dynamic_mig.rs over `MIG` and `ALL`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpu_kubelet_plugin::failpoint;

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read src").flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

#[test]
fn every_failpoint_in_the_code_is_listed_and_armed_by_a_test() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = crate_dir.join("src");
    let lifecycle = crate_dir.join("../dra-plugin/src/lifecycle");
    let needle = "failpoint::hit(\"";
    let mut hit = BTreeSet::new();
    let files: Vec<PathBuf> = rust_files(&src)
        .into_iter()
        .chain(rust_files(&lifecycle))
        .collect();
    assert!(
        files.iter().any(|f| f.ends_with("lifecycle/prepare.rs"))
            && files.iter().any(|f| f.ends_with("src/hardware.rs")),
        "the sources were not all found: {files:?}"
    );
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read source");
        for (at, _) in text.match_indices(needle) {
            let rest = &text[at + needle.len()..];
            let name = &rest[..rest.find('"').expect("closing quote")];
            hit.insert(name.to_owned());
        }
    }
    assert!(
        hit.len() >= 10,
        "found only {hit:?} under {}",
        src.display()
    );
    let listed: BTreeSet<String> = failpoint::ALL
        .iter()
        .chain(failpoint::MIG.iter())
        .map(|s| (*s).to_owned())
        .collect();
    assert_eq!(
        hit, listed,
        "failpoints hit in the code vs. listed in failpoint::ALL and MIG"
    );

    let e2e = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/e2e/tests");
    for (file, lists) in [
        ("fault_injection.rs", &["failpoint::ALL"][..]),
        ("dynamic_mig.rs", &["failpoint::MIG", "failpoint::ALL"][..]),
    ] {
        let text = std::fs::read_to_string(e2e.join(file)).expect("read the e2e test");
        for list in lists {
            assert!(
                text.contains(&format!("for fp in {list}"))
                    || text.contains(&format!("{list}\n"))
                    || text.contains(&format!("{list}.iter()")),
                "{file} no longer iterates over {list}"
            );
        }
    }
}
