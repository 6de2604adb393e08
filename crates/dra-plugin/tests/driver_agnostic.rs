//! This crate names no concept of a particular device: a driver for any device can build on it.
//! Every source file is read (none may be skipped silently) and searched, case-insensitively,
//! for the GPU driver's terms.

use std::path::{Path, PathBuf};

/// Terms of the GPU driver that must not appear here, as whole words or word parts.
const DEVICE_TERMS: [&str; 6] = ["gpu", "nvml", "nvidia", "mig", "mps", "cuda"];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the source directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path
            .extension()
            .is_some_and(|e| e == "rs" || e == "md" || e == "toml")
        {
            out.push(path);
        }
    }
}

/// The device terms in `text`, as `line: term` (a term inside a longer word counts, except
/// `mig` inside words such as `migrate`, which is no MIG).
fn device_terms(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let lower = line.to_ascii_lowercase();
        let words = lower.split(|c: char| !c.is_ascii_alphanumeric());
        for word in words {
            for term in DEVICE_TERMS {
                let hit = if term == "mig" {
                    word == "mig"
                        || word.starts_with("mig") && word[3..].chars().all(|c| c.is_ascii_digit())
                } else {
                    word.contains(term)
                };
                if hit {
                    found.push(format!("{}: {term} ({line})", n + 1));
                }
            }
        }
    }
    found
}

#[test]
fn the_crate_names_no_device_concept() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    files.push(root.join("Cargo.toml"));
    assert!(
        [
            "src/checkpoint.rs",
            "src/storage.rs",
            "src/lifecycle/mod.rs",
            "src/testing.rs"
        ]
        .iter()
        .all(|want| files.iter().any(|f| f.ends_with(want))),
        "the sources were not all found: {files:?}"
    );
    let mut offences = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a source file");
        offences.extend(
            device_terms(&text)
                .into_iter()
                .map(|t| format!("{}:{t}", file.display())),
        );
    }
    assert!(
        offences.is_empty(),
        "device concepts in dra-plugin:\n{}",
        offences.join("\n")
    );
}

#[test]
fn the_search_finds_what_it_looks_for() {
    assert_eq!(device_terms("let gpu_lock = 1;").len(), 1);
    assert_eq!(device_terms("// NVML handle").len(), 1);
    assert_eq!(device_terms("a MIG device, mig1 too").len(), 2);
    assert_eq!(device_terms("CUDA_MPS_PIPE_DIRECTORY").len(), 2);
    assert!(device_terms("migrate the checkpoint; smallest gigabyte").is_empty());
}
