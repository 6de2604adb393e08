//! The plugin's modules in layers (issue 41, defect 16): a module names only modules of its own
//! layer or below, never one above, so that settings know nothing of the plugin and each part
//! can be read, tested and changed from the bottom up. Every source file is read (a module that
//! is in no layer fails the test), and every `crate::<module>` in code is an arrow (comments and
//! test modules aside). Doc links are read too: one is no dependency, but a link upward makes
//! the layering read wrongly, so a lower module names a higher one in plain text instead.
//!
//! The layers, bottom up:
//! 0. settings and leaf helpers: `config`, `failpoint`, `claim_config`, and `dra_plugin`'s
//!    `cdi` and `storage` (re-exported);
//! 1. the hardware and the node's files: `hardware`, `driver_files`, `mps`, `imex`;
//! 2. what is recorded and enforced per claim: `checkpoint`, `memory_limits`, `claim_users`,
//!    `device_metadata`;
//! 3. the claim controller: `claims`;
//! 4. what watches the claims and GPUs: `usage`, `health`, `health_record`, `publisher`,
//!    `node_label`, `fabric`;
//! 5. `metrics`; 6. `instance` (handover); 7. `http`, with its callers' access check beneath it
//!    (`http/auth.rs`, `http/decision_cache.rs`: modules of `http`, named by no other layer);
//! 8. the plugin's `error` (it names the claims', the handover's and the HTTP endpoint's);
//! 9. the start-up steps, each on its own: `discovery` (backend, inventory, driver files),
//!    `client` (the API client), `state` (root-only state), `enforcement` (the shares' level),
//!    `dry_run`;
//! 10. `publishing` (what the node publishes, and when); 11. `active` (what the active instance
//!     runs, and its stop); 12. `takeover` (becoming active);
//! 13. the wiring: `wiring` (`run`), `lib.rs` (modules and re-exports), `main.rs`, `bin/`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const LAYERS: [&[&str]; 14] = [
    &["config", "failpoint", "claim_config", "cdi", "storage"],
    &["hardware", "driver_files", "mps", "imex"],
    &[
        "checkpoint",
        "memory_limits",
        "claim_users",
        "device_metadata",
    ],
    &["claims"],
    &[
        "usage",
        "health",
        "health_record",
        "publisher",
        "node_label",
        "fabric",
    ],
    &["metrics"],
    &["instance"],
    &["http"],
    &["error"],
    &["discovery", "client", "state", "enforcement", "dry_run"],
    &["publishing"],
    &["active"],
    &["takeover"],
    &["wiring", "lib", "main", "bin"],
];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("the source directory") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The modules `text` names as `crate::<module>` in code (not in comments, not in its test
/// module).
fn arrows(text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut found = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name = module_name(rest);
            if !name.is_empty() {
                found.push(name);
            }
        }
    }
    found
}

/// The module name at the start of `rest` (what follows a `crate::`): lower-case letters and
/// `_`; empty when there is none.
fn module_name(rest: &str) -> String {
    rest.chars()
        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
        .collect()
}

/// The modules `text` links to as `crate::<module>` in its doc comments (`///`, `//!`; not in
/// its test module): `[`crate::m`]`, `[crate::m]`, `[text](crate::m)`, `[text]: crate::m`, each
/// with or without a disambiguator (`mod@crate::m`). A path in plain backticks is no link.
fn doc_links(text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut found = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        let Some(doc) = line
            .strip_prefix("///")
            .or_else(|| line.strip_prefix("//!"))
        else {
            continue;
        };
        let mut from = 0;
        while let Some(at) = doc[from..].find("crate::") {
            let start = from + at;
            from = start + "crate::".len();
            let before = doc[..start].strip_suffix('@').map_or(&doc[..start], |b| {
                b.trim_end_matches(|c: char| c.is_ascii_lowercase())
            });
            let opens = ["[`", "[", "](", "]: "];
            if !opens.iter().any(|o| before.ends_with(o)) {
                continue;
            }
            let name = module_name(&doc[from..]);
            if !name.is_empty() {
                found.push(name);
            }
        }
    }
    found
}

/// Each source file's `read` modules that lie above the file's own, by file.
fn upward(read: fn(&str) -> Vec<String>) -> BTreeMap<String, Vec<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(
        files.len() > 20,
        "the sources were not all found: {files:?}"
    );
    let mut upward: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let module = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|c| c.trim_end_matches(".rs").to_owned())
            .expect("a module");
        let from = layer(&module)
            .unwrap_or_else(|| panic!("module {module} ({}) is in no layer", file.display()));
        let text = std::fs::read_to_string(file).expect("a source file");
        for to in read(&text) {
            let target = layer(&to)
                .unwrap_or_else(|| panic!("{} names crate::{to}, in no layer", file.display()));
            if target > from {
                upward
                    .entry(format!("{} ({module})", relative.display()))
                    .or_default()
                    .push(to);
            }
        }
    }
    upward
}

#[test]
fn no_module_names_one_above_it() {
    let upward = upward(arrows);
    assert!(
        upward.is_empty(),
        "modules naming modules above them: {upward:#?}"
    );
}

#[test]
fn no_doc_link_points_upward() {
    let upward = upward(doc_links);
    assert!(
        upward.is_empty(),
        "doc links to modules above their own (name them in plain text): {upward:#?}"
    );
}

#[test]
fn the_reader_finds_arrows_in_code_only() {
    let text = "use crate::claims::X;\n/// [`crate::usage`]\nlet a = crate::mps::f(crate::cdi::g);\n#[cfg(test)]\nuse crate::http;";
    assert_eq!(arrows(text), ["claims", "mps", "cdi"]);
}

#[test]
fn the_reader_finds_doc_links_only() {
    let text = "//! [`crate::claims`] and [text](crate::mps::X), [`x`](mod@crate::usage)\n\
                /// [crate::http], `crate::metrics` in backticks, (`crate::instance`)\n\
                /// [`mod@crate::health`]\n\
                /// [ref]: crate::checkpoint::slot_paths\n\
                use crate::hardware; // [`crate::config`]\n\
                #[cfg(test)]\n/// [`crate::publisher`]";
    assert_eq!(
        doc_links(text),
        ["claims", "mps", "usage", "http", "health", "checkpoint"]
    );
}
