//! The driver-agnostic side of a Kubernetes DRA kubelet plugin: the claim lifecycle, crash-safe
//! and concurrent, for any driver that implements [`lifecycle::Driver`], with no knowledge of
//! the devices it prepares. The README has a complete small driver.
//!
//! - [`storage`]: the filesystem seam ([`storage::Fs`]) every durable write goes through, so a
//!   test can cut the power at any operation; [`storage::RealFs`] is `std::fs`.
//! - [`checkpoint`]: the two-slot checkpoint file ([`checkpoint::SlotFile`]), generic over the
//!   driver's records and their format history ([`checkpoint::Format`]).
//! - [`journal`]: the records as staged in memory and the group commit that makes concurrent
//!   claims' changes durable with one store ([`journal::Journal`]).
//! - [`record`]: what is kept per claim ([`record::ClaimRecord`]), generic over the driver's
//!   record of a device.
//! - [`allocation`]: the claim the kubelet names, read within a deadline and checked, and its
//!   allocation results of one driver's pool grouped by device ([`allocation::allocation`]).
//! - [`cdi`]: the CDI spec file of each prepared claim ([`cdi::CdiWriter`]).
//! - [`lifecycle`]: prepare and unprepare for the kubelet ([`lifecycle::Lifecycle`], which
//!   serves [`dra_kubelet::Driver`]) over a driver's device work ([`lifecycle::Driver`]): claim
//!   locks, per-call deadlines with background rollback, two-phase records, CDI specs.
//! - [`handover`]: the rolling-update handover between two instances on a node: the active
//!   lock ([`handover::ActiveLock`]) and the [`handover::Gate`] that holds calls until it.
//! - [`failpoint`]: crash points a fault-injection test arms through the environment.
//! - `testing` (feature `testing`): a filesystem that loses power, for drivers' tests.
//!
//! The workspace's device plugin and `examples/dra-example-driver` are its users. A test over this
//! crate's sources keeps it free of any device's concepts (`tests/driver_agnostic.rs`).

pub mod allocation;
pub mod cdi;
pub mod checkpoint;
pub mod failpoint;
pub mod handover;
pub mod journal;
pub mod lifecycle;
pub mod record;
pub mod storage;
#[cfg(feature = "testing")]
pub mod testing;

/// The README's example, compiled as a doctest so that it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
