//! The lifecycle's own per-claim failures; a driver's error type wraps them
//! ([`super::Driver::Error`] is `From<Error>`).

use dra_kubelet::ClaimRef;

use crate::cdi::CdiError;
use crate::checkpoint::CheckpointError;

/// A per-claim failure of the lifecycle itself (not of the driver's device work), reported to
/// the kubelet for that claim only. Messages name the claim.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The CDI spec could not be written or removed.
    #[error("ResourceClaim {claim}: {source}")]
    Cdi {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: CdiError,
    },
    /// The checkpoint could not be written.
    #[error("ResourceClaim {claim}: {source}")]
    Checkpoint {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: CheckpointError,
    },
    /// An allocated device is prepared for another claim.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results: device {device:?} of pool \
         {pool:?} is already prepared for claim {holder}"
    )]
    DeviceInUse {
        /// The claim.
        claim: ClaimRef,
        /// The device's pool.
        pool: String,
        /// The device.
        device: String,
        /// `namespace/name (uid <uid>)` of the claim holding it.
        holder: String,
    },
    /// A task doing the work ended abnormally (it panicked or was cancelled).
    #[error("ResourceClaim {claim}: {action} ended abnormally: {message}")]
    TaskFailed {
        /// The claim.
        claim: ClaimRef,
        /// What the task was doing.
        action: &'static str,
        /// The task's failure.
        message: String,
    },
    /// A claim prepared before the restart whose recovery step fails; it stays prepared and
    /// the step is retried in the background.
    #[error(
        "ResourceClaim {claim}: prepared before the plugin restarted, but recovering it fails \
         (retried in the background): {source}"
    )]
    Recovery {
        /// The claim.
        claim: ClaimRef,
        /// The failing step's error (the driver's).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The call did not finish within its deadline; what it started is being rolled back.
    #[error(
        "ResourceClaim {claim}: {action} did not finish within {timeout_ms} ms; what it started \
         is being rolled back, retry later"
    )]
    Deadline {
        /// The claim.
        claim: ClaimRef,
        /// `prepare` or `unprepare`.
        action: &'static str,
        /// The deadline.
        timeout_ms: u128,
    },
}

impl Error {
    /// A short, stable name of the failure kind, for metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Cdi { .. } => "cdi",
            Error::Checkpoint { .. } => "checkpoint",
            Error::TaskFailed { .. } => "task-failed",
            Error::Deadline { .. } => "deadline",
            Error::Recovery { .. } => "recovery",
            Error::DeviceInUse { .. } => "device-in-use",
        }
    }
}
