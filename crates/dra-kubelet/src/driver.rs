//! The domain trait a DRA driver implements, free of gRPC types.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;

/// A ResourceClaim the kubelet asks us to prepare or unprepare, as named in the request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// Name of the ResourceClaim.
    pub name: String,
    /// `metadata.uid` of the ResourceClaim; the key of every per-claim result.
    pub uid: String,
}

impl Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// One allocated device, prepared for a claim.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PreparedDevice {
    /// The claim's request names this device satisfies (`status.allocation.devices.results[].request`).
    pub request_names: Vec<String>,
    /// ResourceSlice pool the device belongs to.
    pub pool_name: String,
    /// Device name within the pool.
    pub device_name: String,
    /// Fully qualified CDI device IDs (`vendor/class=name`) the container runtime injects.
    pub cdi_device_ids: Vec<String>,
    /// Share ID for consumable-capacity allocations (v1 only; dropped for v1beta1).
    pub share_id: Option<String>,
}

/// Result of preparing one claim.
pub type PrepareResult<E> = Result<Vec<PreparedDevice>, E>;
/// Result of unpreparing one claim.
pub type UnprepareResult<E> = Result<(), E>;

/// What a DRA driver does for the kubelet. Implementations must be idempotent: the kubelet
/// repeats calls after restarts and timeouts.
pub trait Driver: Send + Sync + 'static {
    /// Per-claim error; its `Display` text is what the kubelet reports on the pod.
    type Error: Display + Send;

    /// Prepares every claim. The result map is keyed by claim UID and should hold one entry per
    /// requested claim; a missing entry is reported to the kubelet as an error for that claim.
    fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> impl Future<Output = BTreeMap<String, PrepareResult<Self::Error>>> + Send;

    /// Unprepares every claim; unknown claims succeed. Keyed by claim UID like [`Driver::prepare`].
    fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> impl Future<Output = BTreeMap<String, UnprepareResult<Self::Error>>> + Send;
}
