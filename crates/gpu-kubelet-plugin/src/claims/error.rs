//! Why one claim could not be prepared or unprepared. Messages name the claim and the field.

use dra_kubelet::ClaimRef;
use dra_plugin::allocation::AllocationError;

use crate::hardware::HardwareError;

/// A per-claim failure, reported to the kubelet for that claim only.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The API server could not be asked.
    #[error("ResourceClaim {claim}: reading it from the API server: {source}")]
    Fetch {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: kube::Error,
    },
    /// The claim does not exist.
    #[error("ResourceClaim {claim}: not found")]
    NotFound {
        /// The claim.
        claim: ClaimRef,
    },
    /// The claim is not the kubelet's (deleted and created again under its name), is not
    /// allocated, or holds no device of this driver in this node's pool
    /// ([`dra_plugin::allocation::allocation`]).
    #[error(transparent)]
    Allocation(#[from] dra_plugin::allocation::AllocationError),
    /// An allocated device is not in this node's inventory.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results[{index}].device {device:?} is \
         not a device of this node"
    )]
    UnknownDevice {
        /// The claim.
        claim: ClaimRef,
        /// Index in `results`.
        index: usize,
        /// The device name.
        device: String,
    },
    /// An allocated device was published once but is gone from this node's newest inventory.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results[{index}].device {device:?} is \
         no longer on this node (gone at re-discovery; its ResourceSlice no longer lists it)"
    )]
    DeviceGone {
        /// The claim.
        claim: ClaimRef,
        /// Index in `results`.
        index: usize,
        /// The device name.
        device: String,
    },
    /// A share of a device (consumable capacity) this driver cannot prepare.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results[{index}] (device {device:?}): {problem}"
    )]
    Share {
        /// The claim.
        claim: ClaimRef,
        /// Index in `results`.
        index: usize,
        /// The device name.
        device: String,
        /// What is wrong, naming the field.
        problem: String,
    },
    /// A device that would run under MPS (an MPS config, or a share of it) is on a GPU older
    /// than Volta ([`crate::mps::MIN_MPS_COMPUTE_CAPABILITY`]), whose MPS has neither the
    /// per-client limits drust sets nor a protocol that leaves each container its own
    /// `/dev/shm`.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results[{index}] (device {device:?}): \
         MPS sharing needs a Volta or later GPU (CUDA compute capability 7.0 or higher); this \
         GPU's is {major}.{minor}: use time slicing or the whole GPU"
    )]
    MpsUnsupported {
        /// The claim.
        claim: ClaimRef,
        /// Index in `results`.
        index: usize,
        /// The device name.
        device: String,
        /// The GPU's CUDA compute capability, major.
        major: u32,
        /// The GPU's CUDA compute capability, minor.
        minor: u32,
    },
    /// An allocated device is prepared for another claim, and neither has admin access.
    #[error(
        "ResourceClaim {claim}: status.allocation.devices.results[{index}].device {device:?} is \
         already prepared for claim {holder}; refusing to give one GPU to two claims"
    )]
    DeviceInUse {
        /// The claim.
        claim: ClaimRef,
        /// Index in `results`.
        index: usize,
        /// The device name.
        device: String,
        /// `namespace/name (uid)` of the claim holding it.
        holder: String,
    },
    /// The opaque configuration of the allocation cannot be used.
    #[error("ResourceClaim {claim}: {source}")]
    Config {
        /// The claim.
        claim: ClaimRef,
        /// What is wrong, naming the config entry and field.
        source: crate::claim_config::ConfigError,
    },
    /// The claim's MPS control daemon could not be started or stopped.
    #[error("ResourceClaim {claim}: MPS sharing: {source}")]
    Mps {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: crate::mps::MpsError,
    },
    /// A hardware action failed.
    #[error("ResourceClaim {claim}: {source}")]
    Hardware {
        /// The claim.
        claim: ClaimRef,
        /// The cause.
        source: HardwareError,
    },
    /// The lifecycle itself failed: a CDI spec or the checkpoint could not be written, a task
    /// ended abnormally, or the call missed its deadline ([`dra_plugin::lifecycle::Error`]).
    #[error(transparent)]
    Lifecycle(#[from] dra_plugin::lifecycle::Error),
}

impl ClaimError {
    /// A short, stable name of the failure kind, for metric labels
    /// (`drust_claim_errors_total{reason}`).
    pub fn reason(&self) -> &'static str {
        match self {
            ClaimError::Fetch { .. } => "api-server",
            ClaimError::NotFound { .. } => "not-found",
            ClaimError::Allocation(e) => match e {
                AllocationError::Fetch { .. } => "api-server",
                AllocationError::NotFound { .. } => "not-found",
                AllocationError::Replaced { .. } => "uid-mismatch",
                AllocationError::NotAllocated { .. } => "not-allocated",
                AllocationError::NotOurs { .. } => "not-ours",
            },
            ClaimError::UnknownDevice { .. } => "unknown-device",
            ClaimError::DeviceGone { .. } => "device-gone",
            ClaimError::Share { .. } => "share",
            ClaimError::MpsUnsupported { .. } => "mps-unsupported",
            ClaimError::DeviceInUse { .. } => "device-in-use",
            ClaimError::Config { .. } => "config",
            ClaimError::Mps { .. } => "mps",
            ClaimError::Hardware { .. } => "hardware",
            ClaimError::Lifecycle(e) => e.reason(),
        }
    }
}
