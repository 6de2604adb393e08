//! Crash points for fault-injection tests: `DRUST_FAILPOINT=<name>[@<n>]` makes the process
//! SIGKILL itself the n-th time (default: first) it reaches the named step. Unset, a failpoint
//! costs one relaxed atomic load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The environment variable naming the armed failpoint.
pub const ENV: &str = "DRUST_FAILPOINT";

/// Every failpoint, in the order a prepare then an unprepare passes them.
pub const ALL: [&str; 10] = [
    "prepare/before-started-checkpoint",
    "prepare/after-started-checkpoint",
    "prepare/after-hardware",
    "prepare/after-cdi-write",
    "prepare/after-completed-checkpoint",
    "unprepare/before-started-checkpoint",
    "unprepare/after-started-checkpoint",
    "unprepare/after-cdi-remove",
    "unprepare/after-hardware",
    "unprepare/after-checkpoint",
];

/// Failpoints only a dynamic MIG device passes (partitionable mode): around the creation of its
/// MIG device at prepare, and after its destruction at unprepare. A prepare passes them between
/// `prepare/after-started-checkpoint` and `prepare/after-hardware`.
pub const MIG: [&str; 3] = [
    "prepare/before-mig-create",
    "prepare/after-mig-create",
    "unprepare/after-mig-destroy",
];

struct Armed {
    name: String,
    nth: u32,
    hits: AtomicU32,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var(ENV).ok()?;
            let (name, nth) = match spec.split_once('@') {
                Some((name, n)) => (name.to_owned(), n.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            Some(Armed {
                name,
                nth,
                hits: AtomicU32::new(0),
            })
        })
        .as_ref()
}

/// Marks reaching step `name`; kills the process there if armed for it.
pub fn hit(name: &'static str) {
    let Some(a) = armed() else { return };
    if a.name == name && a.hits.fetch_add(1, Ordering::Relaxed) + 1 == a.nth {
        tracing::warn!(failpoint = name, "failpoint armed: SIGKILL");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}
