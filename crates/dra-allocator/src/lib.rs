//! Allocates ResourceClaims to devices exactly as kube-scheduler v1.36 does, device for device.
//!
//! Upstream is the structured-parameters allocator of `k8s.io/dynamic-resource-allocation`
//! v0.36.3, variant `structured/internal/incubating` (the one v1.36's default feature gates
//! select), driven the way the scheduler's DynamicResources plugin drives it
//! (`pkg/scheduler/framework/plugins/dynamicresources`, k8s.io/kubernetes v1.36.3).
//!
//! - [`allocate`] answers for every node what the plugin's PreFilter and Filter decide for a pod
//!   whose claims are the claims without `status.allocation` (claims with one are in use).
//! - [`Allocator`] is upstream's allocator: build it once for the cluster's slices, classes and
//!   allocated devices, then [`Allocator::allocate`] per node, with a deadline or cancellation.
//!   It answers with [`Allocation`]s that borrow from the inputs; [`Allocation::to_api`] builds
//!   the claim's `status.allocation`.
//! - [`apply_defaults`] applies the API server's defaults to objects given without them.
//! - [`gang::place`] places a group of pods on one snapshot as the scheduler's PodGroup cycle
//!   does (a Job's pods, a gang's `minCount`, topology domains, PodGroup claims), and checks
//!   whether devices chosen together would fit where that order does not.
//!
//! ```
//! use dra_allocator::{allocate, apply_defaults, NodeReport, Objects, Options};
//! let mut objects = Objects {
//!     nodes: vec![serde_json::from_str(r#"{"metadata": {"name": "n1"}}"#).unwrap()],
//!     classes: vec![serde_json::from_str(r#"{"metadata": {"name": "gpu"}, "spec": {}}"#).unwrap()],
//!     slices: vec![serde_json::from_str(r#"{"metadata": {"name": "s"}, "spec": {
//!         "driver": "gpu.example.com", "nodeName": "n1",
//!         "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
//!         "devices": [{"name": "gpu-0"}]}}"#).unwrap()],
//!     claims: vec![serde_json::from_str(r#"{"metadata": {"name": "c"}, "spec": {"devices": {
//!         "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}}}"#).unwrap()],
//! };
//! apply_defaults(&mut objects);
//! let report = allocate(&objects, &Options::default());
//! let NodeReport::Allocated { claims, .. } = &report.nodes[0] else { panic!() };
//! let results = claims[0].allocation.devices.as_ref().unwrap().results.as_ref().unwrap();
//! assert_eq!(results[0].device, "gpu-0");
//! ```

mod allocator;
mod attributes;
mod capacity;
mod constraints;
mod defaults;
pub mod explain;
pub mod gang;
mod model;
mod node_selector;
pub mod pod;
mod pools;
mod result;
mod scheduler;

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{AllocationResult, DeviceClass, ResourceClaim, ResourceSlice};
use serde::{Serialize, Serializer};

pub use allocator::{
    ALLOCATION_RESULTS_MAX_SIZE, AllocateError, Allocator, Decision, Interrupt, Pod,
};
pub use defaults::apply_defaults;
pub use model::{AllocatedState, ConsumedCapacity, DeviceId};
pub use result::Allocation;
pub use scheduler::{allocate, explain, explain_with};

/// Everything one run reads (objects as the API server stores them, or given without defaults
/// and then passed through [`apply_defaults`]).
#[derive(Debug, Clone, Default)]
pub struct Objects {
    /// The nodes to answer for.
    pub nodes: Vec<Node>,
    /// All DeviceClasses.
    pub classes: Vec<DeviceClass>,
    /// All ResourceSlices, of every node.
    pub slices: Vec<ResourceSlice>,
    /// All ResourceClaims: with `status.allocation` they are in use, without they are the
    /// pod's claims to allocate (in this order).
    pub claims: Vec<ResourceClaim>,
}

/// Whether a claim has `status.allocation` (its devices are in use).
pub fn is_allocated(claim: &ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .is_some()
}

impl Objects {
    /// The pod's claims: those without `status.allocation`, in input order.
    pub fn to_allocate(&self) -> Vec<&ResourceClaim> {
        self.claims.iter().filter(|c| !is_allocated(c)).collect()
    }
}

/// How to run [`allocate`].
#[derive(Debug, Clone)]
pub struct Options {
    /// Only this node; `None` for every node, in input order.
    pub node: Option<String>,
    /// Time allowed per node (the plugin's `filterTimeout`, 10 s by default); zero disables.
    pub timeout: Duration,
    /// Apply the fix of kubernetes/kubernetes#140438 ([`Features::distinct_attribute_per_device`]).
    pub fix_distinct_attribute: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            node: None,
            timeout: Duration::from_secs(10),
            fix_distinct_attribute: false,
        }
    }
}

/// Allocator features: the scheduler's DRA feature gates as upstream's `structured.Features`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// DRAAdminAccess.
    pub admin_access: bool,
    /// DRAConsumableCapacity.
    pub consumable_capacity: bool,
    /// DRADeviceBindingConditions and DRAResourceClaimDeviceStatus.
    pub device_binding_and_status: bool,
    /// DRADeviceTaints.
    pub device_taints: bool,
    /// DRAListTypeAttributes (not supported: upstream's experimental allocator).
    pub list_type_attributes: bool,
    /// DRAPartitionableDevices.
    pub partitionable_devices: bool,
    /// DRAPrioritizedList.
    pub prioritized_list: bool,
    /// Not a feature gate: the fix of kubernetes/kubernetes#140438 (PR #140600, after v1.36.3).
    /// Upstream's `distinctAttribute` keeps one value per request, so a request with several
    /// devices may repeat a value; with this set every device's value counts. Off by default,
    /// as kube-scheduler v1.36.3 runs.
    pub distinct_attribute_per_device: bool,
}

impl Features {
    /// kube-scheduler v1.36's default feature gates: everything but list-type attributes.
    pub const V1_36: Features = Features {
        admin_access: true,
        consumable_capacity: true,
        device_binding_and_status: true,
        device_taints: true,
        list_type_attributes: false,
        partitionable_devices: true,
        prioritized_list: true,
        distinct_attribute_per_device: false,
    };
}

impl Default for Features {
    fn default() -> Self {
        Features::V1_36
    }
}

/// Why an [`Allocator`] or [`AllocatedState`] cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A quantity field does not hold a quantity (the API server would have rejected it).
    #[error("{object}: {field}: invalid quantity {value:?}: {reason}")]
    InvalidQuantity {
        /// The object, e.g. `ResourceSlice "node-1-gpus"`.
        object: String,
        /// The field path.
        field: String,
        /// The text found.
        value: String,
        /// Why it is not a quantity.
        reason: String,
    },
    /// The feature set needs an allocator variant we do not implement.
    #[error("unsupported feature set: {0}")]
    UnsupportedFeatures(String),
}

/// The answer for every node.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// One entry per node, in input order.
    pub nodes: Vec<NodeReport>,
}

/// Serializes as `true`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct True;

/// Serializes as `false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct False;

impl Serialize for True {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bool(true)
    }
}

impl Serialize for False {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bool(false)
    }
}

/// The plugin's verdict for one node.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(untagged)]
pub enum NodeReport {
    /// The claims fit: one allocation per claim to allocate, in claim order.
    Allocated {
        /// The node name.
        name: String,
        /// Always true.
        allocated: True,
        /// The allocations.
        claims: Vec<ClaimAllocation>,
    },
    /// Unschedulable on this node (`cannot allocate all claims`, or PreFilter's reason).
    NotAllocated {
        /// The node name.
        name: String,
        /// Always false.
        allocated: False,
        /// The plugin's message.
        reason: String,
    },
    /// The plugin's Error status: a problem with the input, or the filter timeout.
    Error {
        /// The node name.
        name: String,
        /// The message.
        error: String,
    },
}

/// One claim's allocation.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClaimAllocation {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// What the scheduler would write to `status.allocation`.
    pub allocation: AllocationResult,
}
