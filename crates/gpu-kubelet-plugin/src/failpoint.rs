//! Crash points for fault-injection tests ([`dra_plugin::failpoint`]): the lifecycle's, and
//! those only a dynamic MIG device passes.

pub use dra_plugin::failpoint::{ENV, hit};

/// Every failpoint every claim passes, in the order a prepare then an unprepare passes them
/// ([`dra_plugin::failpoint::LIFECYCLE`]). `tests/failpoints.rs` checks that this and [`MIG`]
/// name every `hit` in the code and that a test arms each.
pub const ALL: [&str; 11] = dra_plugin::failpoint::LIFECYCLE;

/// Failpoints only a dynamic MIG device passes (partitionable mode): around the creation of its
/// MIG device at prepare, and after its destruction at unprepare. A prepare passes them between
/// `prepare/after-started-checkpoint` and `prepare/after-hardware`.
pub const MIG: [&str; 3] = [
    "prepare/before-mig-create",
    "prepare/after-mig-create",
    "unprepare/after-mig-destroy",
];
