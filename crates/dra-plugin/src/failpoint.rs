//! Crash points for fault-injection tests: `DRA_PLUGIN_FAILPOINT=<name>[@<n>]` makes the process
//! SIGKILL itself the n-th time (default: first) it reaches the named step;
//! `DRA_PLUGIN_FAILPOINT=<name>[@<n>]:pause=<ms>` makes it stall there for that long instead (a
//! slow step, e.g. to have a call in flight at shutdown). Unset, a failpoint costs one relaxed
//! atomic load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The environment variable naming the armed failpoint.
pub const ENV: &str = "DRA_PLUGIN_FAILPOINT";

/// Every failpoint of the claim lifecycle, in the order a prepare then an unprepare passes them
/// (`prepare/after-sharing` also when the driver shares nothing). A driver adds its own steps'
/// failpoints (calling [`hit`]); its tests should check that every one is listed and armed.
pub const LIFECYCLE: [&str; 11] = [
    "prepare/before-started-checkpoint",
    "prepare/after-started-checkpoint",
    "prepare/after-hardware",
    "prepare/after-sharing",
    "prepare/after-cdi-write",
    "prepare/after-completed-checkpoint",
    "unprepare/before-started-checkpoint",
    "unprepare/after-started-checkpoint",
    "unprepare/after-cdi-remove",
    "unprepare/after-hardware",
    "unprepare/after-checkpoint",
];

struct Armed {
    name: String,
    nth: u32,
    /// `Some(ms)`: stall instead of dying.
    pause_ms: Option<u64>,
    hits: AtomicU32,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var(ENV).ok()?;
            let (spec, pause_ms) = match spec.split_once(":pause=") {
                Some((spec, ms)) => (spec.to_owned(), ms.parse().ok()),
                None => (spec, None),
            };
            let (name, nth) = match spec.split_once('@') {
                Some((name, n)) => (name.to_owned(), n.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            Some(Armed {
                name,
                nth,
                pause_ms,
                hits: AtomicU32::new(0),
            })
        })
        .as_ref()
}

/// Marks reaching step `name`; kills the process there (or stalls) if armed for it.
pub fn hit(name: &'static str) {
    let Some(a) = armed() else { return };
    if a.name == name && a.hits.fetch_add(1, Ordering::Relaxed) + 1 == a.nth {
        if let Some(ms) = a.pause_ms {
            tracing::warn!(failpoint = name, ms, "failpoint armed: pausing");
            let pause = || std::thread::sleep(std::time::Duration::from_millis(ms));
            // Hand this worker's other tasks to another thread while we stall it.
            match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                    tokio::task::block_in_place(pause);
                }
                _ => pause(),
            }
            return;
        }
        tracing::warn!(failpoint = name, "failpoint armed: SIGKILL");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}
