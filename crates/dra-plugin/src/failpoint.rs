//! Crash points for fault-injection tests: `DRA_PLUGIN_FAILPOINT=<name>[@<n>]` makes the process
//! SIGKILL itself the n-th time (default: first) it reaches the named step;
//! `DRA_PLUGIN_FAILPOINT=<name>[@<n>]:pause=<ms>` makes it stall there for that long instead (a
//! slow step, e.g. to have a call in flight at shutdown);
//! `DRA_PLUGIN_FAILPOINT=<name>[@<n>]:hold=<path>` makes it stall until the file `path` exists
//! (checked every 50 ms, for at most [`HOLD_LIMIT`]), so that a test decides when the step goes
//! on (e.g. after it deleted the pod whose prepare is held). Unset, a failpoint costs one relaxed
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

/// The longest a `hold=<path>` failpoint waits for its file: a test that never creates it
/// gets its step back rather than a process stalled for good.
pub const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

struct Armed {
    name: String,
    nth: u32,
    /// What happens there: dying, or stalling.
    action: Action,
    hits: AtomicU32,
}

enum Action {
    Kill,
    /// Stall for this many milliseconds.
    Pause(u64),
    /// Stall until this file exists.
    Hold(std::path::PathBuf),
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var(ENV).ok()?;
            let (spec, action) = if let Some((spec, ms)) = spec.split_once(":pause=") {
                // An unreadable number pauses for no time rather than killing.
                (spec.to_owned(), Action::Pause(ms.parse().unwrap_or(0)))
            } else if let Some((spec, path)) = spec.split_once(":hold=") {
                (spec.to_owned(), Action::Hold(path.into()))
            } else {
                (spec, Action::Kill)
            };
            let (name, nth) = match spec.split_once('@') {
                Some((name, n)) => (name.to_owned(), n.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            Some(Armed {
                name,
                nth,
                action,
                hits: AtomicU32::new(0),
            })
        })
        .as_ref()
}

/// Marks reaching step `name`; kills the process there (or stalls) if armed for it.
pub fn hit(name: &'static str) {
    let Some(a) = armed() else { return };
    if a.name != name || a.hits.fetch_add(1, Ordering::Relaxed) + 1 != a.nth {
        return;
    }
    let stall: Box<dyn FnOnce()> = match &a.action {
        Action::Kill => {
            tracing::warn!(failpoint = name, "failpoint armed: SIGKILL");
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
            return;
        }
        Action::Pause(ms) => {
            tracing::warn!(failpoint = name, ms, "failpoint armed: pausing");
            let ms = *ms;
            Box::new(move || std::thread::sleep(std::time::Duration::from_millis(ms)))
        }
        Action::Hold(path) => {
            tracing::warn!(failpoint = name, path = %path.display(), "failpoint armed: holding until the file exists");
            Box::new(move || {
                let began = std::time::Instant::now();
                while !path.exists() && began.elapsed() < HOLD_LIMIT {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                tracing::warn!(
                    failpoint = name,
                    held_ms = began.elapsed().as_millis() as u64,
                    "failpoint released"
                );
            })
        }
    };
    // Hand this worker's other tasks to another thread while we stall it.
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(stall),
        _ => stall(),
    }
}
