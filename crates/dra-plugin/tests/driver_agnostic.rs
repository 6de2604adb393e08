//! This crate names no concept of a particular device, nor the product it was first written
//! for: a driver for any device, of any vendor, can build on it. Every source file, its README
//! and its manifest are read (none may be skipped silently) and searched, case-insensitively,
//! for the GPU driver's terms and its brand (`drust`), with no exception: even the annotation
//! keys of the GPU driver's earlier specs are that driver's to name
//! (`CdiWriter::with_legacy_claim_annotations`).

use std::path::{Path, PathBuf};

/// Terms of the GPU driver that must not appear here, as whole words or word parts.
const DEVICE_TERMS: [&str; 7] = ["gpu", "nvml", "nvidia", "mig", "mps", "cuda", "drust"];

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

/// `text` with each inline code span (`` `...` ``) blanked, line by line.
fn without_code_spans(text: &str) -> String {
    text.lines()
        .map(|line| {
            line.split('`')
                .enumerate()
                .map(|(i, part)| if i % 2 == 0 { part } else { "" })
                .collect::<Vec<_>>()
                .join("``")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_crate_names_no_device_concept() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    files.push(root.join("Cargo.toml"));
    files.push(root.join("README.md"));
    assert!(
        [
            "src/checkpoint.rs",
            "src/storage.rs",
            "src/lifecycle/mod.rs",
            "src/testing.rs",
            "README.md"
        ]
        .iter()
        .all(|want| files.iter().any(|f| f.ends_with(want))),
        "the sources were not all found: {files:?}"
    );
    let mut offences = Vec::new();
    for file in &files {
        let mut text = std::fs::read_to_string(file).expect("read a source file");
        if file.extension().is_some_and(|e| e == "md") {
            // Code spans name files of the repository's device driver, as evidence.
            text = without_code_spans(&text);
        }
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
    assert_eq!(device_terms("an older drust build").len(), 1);
    assert_eq!(device_terms("\"claim.drust.dev/uid\"").len(), 1);
}
