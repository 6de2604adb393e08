//! ResourceSlices and their devices, read once per [`crate::Allocator`] into the shape the
//! search needs: parsed quantities, the CEL view of each device, and what the allocated state
//! says about it.
//!
//! upstream: `k8s.io/dynamic-resource-allocation/api` (`draapi`, the allocator's internal copy of
//! ResourceSlice) and `structured/schedulerapi/types.go` (`AllocatedState`).

use std::collections::BTreeMap;

use foldhash::{HashMap, HashSet, HashSetExt};

use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1::{Device, DeviceTaint, ResourceClaim, ResourceSlice};
use k8s_quantity::{Quantity, QuantityError};

use crate::Error;
use crate::attributes::AttributeTable;

/// A device by driver, pool and device name (`DeviceID`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    /// The driver name.
    pub driver: String,
    /// The pool name.
    pub pool: String,
    /// The device name.
    pub device: String,
}

impl DeviceId {
    /// A device ID from its parts.
    pub fn new(driver: &str, pool: &str, device: &str) -> DeviceId {
        DeviceId {
            driver: driver.to_string(),
            pool: pool.to_string(),
            device: device.to_string(),
        }
    }
}

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.driver, self.pool, self.device)
    }
}

/// Consumed capacity by capacity name: exact amounts (`schedulerapi.ConsumedCapacity`).
pub type ConsumedCapacity = BTreeMap<String, Quantity>;

/// What in-use claims hold, as the scheduler gathers it (`schedulerapi.AllocatedState`; built
/// by `pkg/scheduler/framework/plugins/dynamicresources/allocateddevices.go`).
#[derive(Clone, Debug, Default)]
pub struct AllocatedState {
    /// Devices allocated exclusively.
    pub allocated_devices: HashSet<DeviceId>,
    /// Shares of devices that allow multiple allocations: device plus share ID.
    pub allocated_shared_device_ids: HashSet<(DeviceId, String)>,
    /// Capacity consumed so far, per shared device.
    pub aggregated_capacity: HashMap<DeviceId, ConsumedCapacity>,
}

impl AllocatedState {
    /// Gathers the state from claims: those with `status.allocation` count; results with admin
    /// access do not; with consumable capacity a result with a shareID is a share (plus its
    /// consumedCapacity), any other result a dedicated device.
    ///
    /// # Errors
    /// [`Error::InvalidQuantity`] for a consumedCapacity that is not a quantity.
    pub fn from_claims<'c>(
        claims: impl IntoIterator<Item = &'c ResourceClaim>,
        consumable_capacity: bool,
    ) -> Result<AllocatedState, Error> {
        let mut state = AllocatedState::default();
        for claim in claims {
            state.add_claim(claim, consumable_capacity)?;
        }
        Ok(state)
    }

    /// Adds what one claim holds, as [`AllocatedState::from_claims`] counts it (nothing for a
    /// claim without `status.allocation`): the scheduler's in-flight allocations, made for one
    /// pod and seen by the next (`SignalClaimPendingAllocation`).
    ///
    /// # Errors
    /// [`Error::InvalidQuantity`] for a consumedCapacity that is not a quantity.
    pub fn add_claim(
        &mut self,
        claim: &ResourceClaim,
        consumable_capacity: bool,
    ) -> Result<(), Error> {
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            return Ok(());
        };
        let results = allocation
            .devices
            .as_ref()
            .and_then(|d| d.results.as_deref())
            .unwrap_or_default();
        for (i, result) in results.iter().enumerate() {
            if result.admin_access == Some(true) {
                continue;
            }
            let id = DeviceId::new(&result.driver, &result.pool, &result.device);
            if consumable_capacity && let Some(share) = &result.share_id {
                self.allocated_shared_device_ids
                    .insert((id.clone(), share.clone()));
                if let Some(consumed) = &result.consumed_capacity {
                    let mut parsed = ConsumedCapacity::new();
                    for (name, q) in consumed {
                        let value = parse_quantity(&q.0).map_err(|e| Error::InvalidQuantity {
                            object: format!("ResourceClaim {}", claim_ref(claim)),
                            field: format!(
                                "status.allocation.devices.results[{i}].consumedCapacity[{name}]"
                            ),
                            value: q.0.clone(),
                            reason: e.to_string(),
                        })?;
                        parsed.insert(name.clone(), value);
                    }
                    insert_capacity(&mut self.aggregated_capacity, id, &parsed);
                }
                continue;
            }
            self.allocated_devices.insert(id);
        }
        Ok(())
    }

    /// `IsDeviceAllocated`: dedicated, shared or with consumed capacity.
    pub fn is_device_allocated(&self, id: &DeviceId) -> bool {
        self.allocated_devices.contains(id)
            || self.aggregated_capacity.contains_key(id)
            || self
                .allocated_shared_device_ids
                .iter()
                .any(|(d, _)| d == id)
    }
}

/// `ConsumedCapacityCollection.Insert`.
fn insert_capacity(
    map: &mut HashMap<DeviceId, ConsumedCapacity>,
    id: DeviceId,
    consumed: &ConsumedCapacity,
) {
    let entry = map.entry(id).or_default();
    for (name, q) in consumed {
        match entry.get_mut(name) {
            Some(existing) => *existing = existing.saturating_add(q),
            None => {
                entry.insert(name.clone(), q.clone());
            }
        }
    }
}

/// `klog.KObj` of a claim: `namespace/name`, or the name alone.
pub(crate) fn claim_ref(claim: &ResourceClaim) -> String {
    let name = claim.metadata.name.as_deref().unwrap_or("");
    match claim.metadata.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
        _ => name.to_string(),
    }
}

/// A counter set: counters by name (`CounterSet`).
pub(crate) type Counters = BTreeMap<String, Quantity>;

/// The request policy of a device capacity (`CapacityRequestPolicy`).
#[derive(Debug)]
pub(crate) struct Policy {
    pub default: Option<Quantity>,
    /// `validRange`: min, max, step.
    pub valid_range: Option<(Quantity, Option<Quantity>, Option<Quantity>)>,
    /// `validValues`; `Some(empty)` differs from `None` upstream.
    pub valid_values: Option<Vec<Quantity>>,
}

/// A device capacity.
#[derive(Debug)]
pub(crate) struct Capacity {
    pub value: Quantity,
    pub policy: Option<Policy>,
}

/// A device of a slice, preprocessed.
///
/// Laid out for the search, which reads many devices once each (cold memory): what it reads
/// of every device it considers comes first, within one 64-byte line (the struct is aligned to
/// one); the API object, capacities and the CEL record (read where a device is chosen, has
/// capacities, or meets the evaluator) follow.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct DeviceData<'a> {
    /// Its attributes as constraints and selectors read them: a range of the slice's
    /// `attributes`.
    pub attributes: std::ops::Range<usize>,
    /// Its name: a range of the slice's `names`.
    pub name_at: std::ops::Range<usize>,
    pub taints: &'a [DeviceTaint],
    /// Why selectors cannot see the device (checked once, reported where one is evaluated).
    pub view_error: Option<Box<dra_cel::DeviceError>>,
    /// Some capacity has a request policy.
    pub capacity_policy: bool,
    /// `allowMultipleAllocations` is true.
    pub allow_multiple: bool,
    /// `bindingConditions` is set (even empty).
    pub has_binding_conditions: bool,
    /// `bindingFailureConditions` is set (even empty).
    pub has_binding_failure_conditions: bool,
    // Read less often.
    pub name: &'a str,
    pub obj: &'a Device,
    /// `consumesCounters`: counter set name and counters.
    pub consumes_counters: Vec<(String, Counters)>,
    pub capacity: BTreeMap<String, Capacity>,
    /// What selectors see.
    pub cel: dra_cel::Device,
}

// The fields every considered device is read for share its first cache line.
const _: () =
    assert!(std::mem::offset_of!(DeviceData<'static>, has_binding_failure_conditions) < 64);

/// A ResourceSlice, preprocessed.
#[derive(Debug)]
pub(crate) struct SliceData<'a> {
    pub name: &'a str,
    pub driver: &'a str,
    pub pool: &'a str,
    pub generation: i64,
    pub slice_count: i64,
    /// `nodeName` as given (`Some("")` is set, like a non-nil pointer upstream).
    pub node_name: Option<&'a str>,
    pub all_nodes: bool,
    pub node_selector: Option<&'a NodeSelector>,
    pub per_device_node_selection: bool,
    /// `perDeviceNodeSelection` is set at all (even false).
    pub per_device_node_selection_set: bool,
    /// `sharedCounters`, in order; empty when none.
    pub shared_counters: Vec<(String, Counters)>,
    pub devices: Vec<DeviceData<'a>>,
    /// The attributes of all devices as constraints and selectors read them, device after
    /// device (side by side in memory, so that the search reads few cache lines for
    /// neighbouring devices).
    pub attributes: AttributeTable<'a>,
    /// The names of all devices, one after the other (for the results, as `attributes`).
    pub names: String,
    /// The first device whose name an earlier device of this slice has too.
    pub duplicate_device: Option<&'a str>,
    /// Some device has binding conditions.
    pub has_binding_conditions: bool,
    /// Some device consumes counters.
    pub consumes_counters: bool,
}

impl SliceData<'_> {
    /// Whether the slice carries counter sets.
    pub fn has_shared_counters(&self) -> bool {
        !self.shared_counters.is_empty()
    }
}

/// Parses a quantity of an API object as upstream's `Quantity.UnmarshalJSON` does
/// (`k8s.io/apimachinery/pkg/api/resource/quantity.go`): spaces around it trimmed, then
/// `ParseQuantity`.
///
/// # Errors
/// [`QuantityError`] with upstream's message for text that is not a quantity.
pub(crate) fn parse_quantity(text: &str) -> Result<Quantity, QuantityError> {
    Quantity::parse(text.trim())
}

/// Parses a quantity of a slice.
fn q(slice: &ResourceSlice, field: impl FnOnce() -> String, text: &str) -> Result<Quantity, Error> {
    parse_quantity(text).map_err(|e| Error::InvalidQuantity {
        object: format!(
            "ResourceSlice {:?}",
            slice.metadata.name.as_deref().unwrap_or("")
        ),
        field: field(),
        value: text.to_string(),
        reason: e.to_string(),
    })
}

fn counters(
    slice: &ResourceSlice,
    path: &str,
    counters: &BTreeMap<String, k8s_openapi::api::resource::v1::Counter>,
) -> Result<Counters, Error> {
    let mut out = Counters::new();
    for (name, c) in counters {
        let v = q(
            slice,
            || format!("{path}.counters[{name}].value"),
            &c.value.0,
        )?;
        out.insert(name.clone(), v);
    }
    Ok(out)
}

impl<'a> SliceData<'a> {
    /// Reads one slice.
    ///
    /// # Errors
    /// [`Error::InvalidQuantity`] for a capacity or counter that is not a quantity.
    pub fn new(slice: &'a ResourceSlice) -> Result<SliceData<'a>, Error> {
        let spec = &slice.spec;
        let mut shared_counters = Vec::new();
        for (i, set) in spec.shared_counters.iter().flatten().enumerate() {
            let path = format!("spec.sharedCounters[{i}]");
            shared_counters.push((set.name.clone(), counters(slice, &path, &set.counters)?));
        }
        let mut devices = Vec::new();
        let mut attributes = AttributeTable::default();
        let mut names = String::new();
        for (i, d) in spec.devices.iter().flatten().enumerate() {
            devices.push(DeviceData::new(slice, i, d, &mut names, &mut attributes)?);
        }
        let mut seen = HashSet::with_capacity(devices.len());
        let duplicate_device = devices.iter().map(|d| d.name).find(|n| !seen.insert(*n));
        let has_binding_conditions = devices.iter().any(|d| d.has_binding_conditions);
        let consumes_counters = devices.iter().any(|d| !d.consumes_counters.is_empty());
        Ok(SliceData {
            name: slice.metadata.name.as_deref().unwrap_or(""),
            driver: &spec.driver,
            pool: &spec.pool.name,
            generation: spec.pool.generation,
            slice_count: spec.pool.resource_slice_count,
            node_name: spec.node_name.as_deref(),
            all_nodes: spec.all_nodes.unwrap_or(false),
            node_selector: spec.node_selector.as_ref(),
            per_device_node_selection: spec.per_device_node_selection.unwrap_or(false),
            per_device_node_selection_set: spec.per_device_node_selection.is_some(),
            shared_counters,
            devices,
            attributes,
            names,
            duplicate_device,
            has_binding_conditions,
            consumes_counters,
        })
    }
}

impl<'a> DeviceData<'a> {
    /// Reads device `index` of `slice`, adding its name to the slice's `names` and its
    /// attributes to the slice's `table`.
    fn new(
        slice: &ResourceSlice,
        index: usize,
        d: &'a Device,
        names: &mut String,
        table: &mut AttributeTable<'a>,
    ) -> Result<DeviceData<'a>, Error> {
        let path = format!("spec.devices[{index}]");
        let mut capacity = BTreeMap::new();
        let mut cel_capacity = BTreeMap::new();
        for (name, c) in d.capacity.iter().flatten() {
            let p = format!("{path}.capacity[{name}]");
            let value = q(slice, || format!("{p}.value"), &c.value.0)?;
            cel_capacity.insert(
                name.clone(),
                dra_cel::DeviceCapacity {
                    value: value.clone(),
                },
            );
            let policy = match &c.request_policy {
                None => None,
                Some(pol) => {
                    let default = match &pol.default {
                        Some(v) => Some(q(slice, || format!("{p}.requestPolicy.default"), &v.0)?),
                        None => None,
                    };
                    let valid_range = match &pol.valid_range {
                        Some(r) => Some((
                            q(
                                slice,
                                || format!("{p}.requestPolicy.validRange.min"),
                                &r.min.0,
                            )?,
                            match &r.max {
                                Some(v) => Some(q(
                                    slice,
                                    || format!("{p}.requestPolicy.validRange.max"),
                                    &v.0,
                                )?),
                                None => None,
                            },
                            match &r.step {
                                Some(v) => Some(q(
                                    slice,
                                    || format!("{p}.requestPolicy.validRange.step"),
                                    &v.0,
                                )?),
                                None => None,
                            },
                        )),
                        None => None,
                    };
                    let valid_values = match &pol.valid_values {
                        Some(vs) => {
                            let mut out = Vec::new();
                            for (j, v) in vs.iter().enumerate() {
                                out.push(q(
                                    slice,
                                    || format!("{p}.requestPolicy.validValues[{j}]"),
                                    &v.0,
                                )?);
                            }
                            Some(out)
                        }
                        None => None,
                    };
                    Some(Policy {
                        default,
                        valid_range,
                        valid_values,
                    })
                }
            };
            capacity.insert(name.clone(), Capacity { value, policy });
        }
        let mut consumes_counters = Vec::new();
        for (j, c) in d.consumes_counters.iter().flatten().enumerate() {
            let p = format!("{path}.consumesCounters[{j}]");
            consumes_counters.push((c.counter_set.clone(), counters(slice, &p, &c.counters)?));
        }
        let attributes = d
            .attributes
            .iter()
            .flatten()
            .map(|(k, a)| {
                (
                    k.clone(),
                    dra_cel::DeviceAttribute {
                        int: a.int,
                        bool: a.bool,
                        string: a.string.clone(),
                        version: a.version.clone(),
                        ints: a.ints.clone(),
                        bools: a.bools.clone(),
                        strings: a.strings.clone(),
                        versions: a.versions.clone(),
                    },
                )
            })
            .collect();
        let cel = dra_cel::Device {
            driver: slice.spec.driver.clone(),
            attributes,
            capacity: cel_capacity,
            allow_multiple_allocations: d.allow_multiple_allocations,
        };
        // The allocator's environment has no list-type attributes (see `Allocator::new`).
        let view_error = dra_cel::DeviceView::new(&cel, false).err().map(Box::new);
        Ok(DeviceData {
            obj: d,
            name: &d.name,
            cel,
            view_error,
            capacity_policy: capacity.values().any(|c| c.policy.is_some()),
            attributes: table.push(d.attributes.as_ref()),
            name_at: {
                let start = names.len();
                names.push_str(&d.name);
                start..names.len()
            },
            capacity,
            consumes_counters,
            allow_multiple: d.allow_multiple_allocations == Some(true),
            taints: d.taints.as_deref().unwrap_or_default(),
            has_binding_conditions: d.binding_conditions.is_some(),
            has_binding_failure_conditions: d.binding_failure_conditions.is_some(),
        })
    }
}
