//! Fractional GPUs: devices published for consumable capacity (KEP-5075), so that independent
//! claims each take a share of one GPU by memory and compute.
//!
//! A shareable device has `allowMultipleAllocations: true` and two consumable capacities:
//!
//! | capacity | value | request policy |
//! |---|---|---|
//! | `memory` | the device's bytes | `validRange` min 1 GiB, step 1 GiB; default: the whole memory in steps ([`whole_memory_bytes`]) |
//! | `computePercent` | `100` | `validRange` min 0, step 1; default 0 |
//!
//! Why these: a memory share is what a model needs to load, in the unit `nvidia-smi` and users
//! think in; a step of 1 GiB keeps the scheduler's arithmetic and the MPS pinned limit (whole MiB)
//! exact. The compute share is a percentage, not a count of multiprocessors, because a percentage
//! is what MPS enforces (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), it means the same on every model
//! ("a quarter" is 25 on an A100 and an H100), and MPS turns it into multiprocessors by its own
//! rounding, so a count would promise more precision than anything holds. Its default is 0: a
//! request that names only memory reserves no compute and runs uncapped, next to the shares that
//! reserved theirs (the scheduler never reserves more than 100 on one device).
//!
//! Each shareable device also gets the attribute `shareEnforcement` ([`ShareEnforcement`]): how
//! its shares are enforced, for claims that need a level to select on it.
//!
//! Exclusive use stays possible: a request without capacity consumes each policy's default
//! (upstream `calculateConsumedCapacity`), which for `memory` is the whole device in steps; what
//! is left is below the 1 GiB minimum, so no other share fits next to it. The plugin prepares
//! such an allocation as a plain GPU ([`is_whole`]).
//!
//! Every other capacity the device publishes (`multiprocessors`, a MIG device's engines) stays
//! for selectors but gets a policy that consumes none of it (`validValues: [0]`, default 0):
//! without one, each allocation would consume the whole value and no second share would fit
//! (the API's rule for a capacity without a policy). A request for one of them cannot be
//! satisfied (upstream `violatesPolicy`).
//!
//! Devices that consume shared counters (partitionable MIG placements) stay exclusive: a share of
//! a MIG device that prepare creates would need the device to exist while any share does, and
//! the counters of a placement are consumed once per allocation, not once per device.
//!
//! upstream: `staging/src/k8s.io/api/resource/v1/types.go` (`Device.AllowMultipleAllocations`,
//! `DeviceCapacity.RequestPolicy`), `pkg/apis/resource/validation/validation.go`
//! (`validateRequestPolicyRange`: default within the range and a multiple of the step from min).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceCapacity,
    DeviceRequestAllocationResult, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::model::bytes_quantity;
use crate::slices::Pool;

/// The memory capacity (bytes).
pub const MEMORY: &str = "memory";
/// The compute capacity: a percentage of the device's multiprocessors.
pub const COMPUTE_PERCENT: &str = "computePercent";
/// Granularity of memory shares: 1 GiB.
pub const MEMORY_STEP_BYTES: u64 = 1 << 30;

/// The memory a request without a memory request consumes: the device's bytes rounded down to
/// whole [`MEMORY_STEP_BYTES`] (the policy's default must be a step from the minimum).
pub fn whole_memory_bytes(total_bytes: u64) -> u64 {
    total_bytes - total_bytes % MEMORY_STEP_BYTES
}

/// Whether an allocation that consumed `memory_bytes` of a device of `total_bytes` holds the
/// whole device: nothing another share could use is left ([`whole_memory_bytes`] or more).
pub fn is_whole(memory_bytes: u64, total_bytes: u64) -> bool {
    memory_bytes >= whole_memory_bytes(total_bytes)
}

/// Whether `device` can be published as shareable: it has memory (at least one step), and
/// consumes no shared counters.
pub fn can_share(device: &Device) -> bool {
    device
        .consumes_counters
        .as_ref()
        .is_none_or(|c| c.is_empty())
        && memory_bytes(device).is_some_and(|b| whole_memory_bytes(b) >= MEMORY_STEP_BYTES)
}

/// Why the node plugin will refuse to prepare a claim allocated `results`, if it will, as far as
/// the allocation shows: more than one of them is a share smaller than its device (a share run
/// under its device's MPS daemon; the plugin's `claims::shares::check`). A container reaches
/// one MPS daemon, so a claim holds at most one such share: a request with `count: 2` or two
/// share requests would be allocated by the scheduler and then fail at prepare forever.
/// `device` finds a result's device in the ResourceSlices; only devices this crate published
/// as shareable ([`make_shareable`]: multiple allocations and a `computePercent` capacity)
/// count, so other drivers' allocations never do. For `dractl lint`/`explain` and the explain
/// controller, which name the refusal before a pod waits.
pub fn prepare_refusal<'d>(
    results: &[DeviceRequestAllocationResult],
    device: impl Fn(&DeviceRequestAllocationResult) -> Option<&'d Device>,
) -> Option<String> {
    let shares: Vec<&DeviceRequestAllocationResult> = results
        .iter()
        .filter(|r| r.share_id.is_some())
        .filter(|r| {
            let Some(d) = device(r) else { return false };
            let ours = d.allow_multiple_allocations == Some(true)
                && d.capacity
                    .as_ref()
                    .is_some_and(|c| c.contains_key(COMPUTE_PERCENT));
            let total = memory_bytes(d);
            let used = consumed(&r.consumed_capacity.clone().unwrap_or_default())
                .ok()
                .map(|c| c.memory_bytes);
            ours && matches!((used, total), (Some(u), Some(t)) if !is_whole(u, t))
        })
        .collect();
    if shares.len() < 2 {
        return None;
    }
    let list = shares
        .iter()
        .map(|r| format!("request {:?} on device {}/{}", r.request, r.pool, r.device))
        .collect::<Vec<_>>()
        .join(", ");
    Some(format!(
        "{} shares smaller than a GPU in one claim ({list}): the kubelet plugin of {} prepares at \
         most one per claim, since a container reaches one MPS daemon, so the pod would wait at \
         prepare forever; ask for one share with more memory, or for whole GPUs",
        shares.len(),
        shares[0].driver
    ))
}

/// The devices of `slices` by (driver, pool, device name): what [`prepare_refusal`] looks an
/// allocation result's device up in, built once per set of slices.
pub fn devices_by_name<'s>(
    slices: impl IntoIterator<Item = &'s ResourceSlice>,
) -> std::collections::HashMap<(&'s str, &'s str, &'s str), &'s Device> {
    slices
        .into_iter()
        .flat_map(|s| {
            s.spec.devices.iter().flatten().map(move |d| {
                (
                    (
                        s.spec.driver.as_str(),
                        s.spec.pool.name.as_str(),
                        d.name.as_str(),
                    ),
                    d,
                )
            })
        })
        .collect()
}

/// The `memory` capacity of `device` in bytes, when it publishes one in a form this crate writes
/// ([`bytes_quantity`]).
fn memory_bytes(device: &Device) -> Option<u64> {
    let q = &device.capacity.as_ref()?.get(MEMORY)?.value.0;
    parse_bytes(q)
}

/// A quantity of bytes (a device's capacity, a claim's consumed capacity) as a whole number:
/// any form Kubernetes accepts (`80Gi`, `20G`, `1.5Gi`, `2e9`), `None` for a malformed, negative
/// or fractional one.
fn parse_bytes(q: &str) -> Option<u64> {
    let bytes = k8s_quantity::Quantity::parse(q).ok()?.as_i64()?;
    u64::try_from(bytes).ok()
}

/// Makes every device of `pool` that [`can_share`] shareable, as the module docs describe, its
/// full GPUs at enforcement level `full_gpus` ([`ShareEnforcement::Mps`] or
/// [`ShareEnforcement::Kernel`]; MIG devices are always [`ShareEnforcement::Mig`]). Returns how
/// many devices became shareable.
pub fn publish_shares(pool: &mut Pool, full_gpus: ShareEnforcement) -> usize {
    let mut shared = 0;
    for device in &mut pool.devices {
        if make_shareable_at(device, full_gpus) {
            shared += 1;
        }
    }
    shared
}

/// Makes `device` shareable at the `mps` level; `false` (unchanged) when it [`can_share`] not.
pub fn make_shareable(device: &mut Device) -> bool {
    make_shareable_at(device, ShareEnforcement::Mps)
}

/// Makes `device` shareable, a full GPU at level `full_gpu`; `false` (unchanged) when it
/// [`can_share`] not.
pub fn make_shareable_at(device: &mut Device, full_gpu: ShareEnforcement) -> bool {
    let Some(total) = memory_bytes(device).filter(|_| can_share(device)) else {
        return false;
    };
    let capacities = device.capacity.get_or_insert_with(BTreeMap::new);
    for (name, capacity) in capacities.iter_mut() {
        if name != MEMORY {
            capacity.request_policy = Some(CapacityRequestPolicy {
                default: Some(Quantity("0".into())),
                valid_values: Some(vec![Quantity("0".into())]),
                valid_range: None,
            });
        }
    }
    capacities.insert(
        MEMORY.to_owned(),
        DeviceCapacity {
            value: bytes_quantity(total),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(bytes_quantity(whole_memory_bytes(total))),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: bytes_quantity(MEMORY_STEP_BYTES),
                    step: Some(bytes_quantity(MEMORY_STEP_BYTES)),
                    max: None,
                }),
                valid_values: None,
            }),
        },
    );
    capacities.insert(
        COMPUTE_PERCENT.to_owned(),
        DeviceCapacity {
            value: Quantity("100".into()),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(Quantity("0".into())),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: Quantity("0".into()),
                    step: Some(Quantity("1".into())),
                    max: None,
                }),
                valid_values: None,
            }),
        },
    );
    let mig = device
        .attributes
        .as_ref()
        .and_then(|a| a.get("type"))
        .and_then(|t| t.string.as_deref())
        == Some("mig");
    device.attributes.get_or_insert_with(BTreeMap::new).insert(
        SHARE_ENFORCEMENT.to_owned(),
        crate::model::string(if mig { ShareEnforcement::Mig } else { full_gpu }.as_str()),
    );
    device.allow_multiple_allocations = Some(true);
    true
}

/// The attribute naming how a shareable device's shares are enforced ([`ShareEnforcement`]), so
/// a claim can select on it (`device.attributes["gpu.drust.dev"].shareEnforcement == "mps"`).
pub const SHARE_ENFORCEMENT: &str = "shareEnforcement";

/// How the shares of a device are held to their limits, strongest the node offers (README,
/// "Shares: what holds"). Published as [`SHARE_ENFORCEMENT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareEnforcement {
    /// A full GPU under legacy MPS: the GPU is in `EXCLUSIVE_PROCESS` while it hosts shares, so
    /// no CUDA process runs beside the MPS server; each share's memory and thread limits are its
    /// clients' own (`CUDA_MPS_*`), per process, which a tenant can raise.
    Mps,
    /// A MIG device under legacy MPS: the MIG device bounds every share on it (its memory and
    /// engines); the compute mode is its parent GPU's, shared with other claims, so it is left
    /// alone and a process that bypasses MPS gets the whole MIG device.
    Mig,
    /// A full GPU whose driver partitions memory per cgroup (r615+, cgroup v2): each share
    /// container's cgroup has a hard memory limit of its share on the GPU, set by the plugin's
    /// CDI hook and enforced by the driver for all its processes whatever their environment; the
    /// GPU is in `EXCLUSIVE_PROCESS` as at the `mps` level. Compute is still each client's own
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` under legacy MPS (MPS v3 namespaces are not used yet).
    Kernel,
}

impl ShareEnforcement {
    /// The attribute's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mps => "mps",
            Self::Mig => "mig",
            Self::Kernel => "kernel",
        }
    }
}

/// What one share consumes, read from an allocation result's `consumedCapacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Consumed {
    /// `memory`, bytes.
    pub memory_bytes: u64,
    /// `computePercent`, 0..=100 (0: none reserved).
    pub compute_percent: u32,
}

/// A `consumedCapacity` entry this driver cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("consumedCapacity {name}: {value:?} {problem}")]
pub struct ConsumedError {
    /// The capacity.
    pub name: String,
    /// Its value as allocated.
    pub value: String,
    /// Why it is unusable.
    pub problem: &'static str,
}

/// Reads a share's `consumedCapacity` (capacity name to quantity). A missing `memory` is an
/// error (the scheduler always records every capacity of a shareable device); a missing
/// `computePercent` is 0.
///
/// # Errors
/// [`ConsumedError`] naming the capacity when a value is missing, not a whole number of bytes
/// (or percent), or out of range.
pub fn consumed(consumed: &BTreeMap<String, Quantity>) -> Result<Consumed, ConsumedError> {
    let memory = consumed.get(MEMORY).ok_or_else(|| ConsumedError {
        name: MEMORY.into(),
        value: String::new(),
        problem: "is missing",
    })?;
    let memory_bytes = parse_bytes(&memory.0).ok_or_else(|| ConsumedError {
        name: MEMORY.into(),
        value: memory.0.clone(),
        problem: "is not a whole number of bytes",
    })?;
    let compute_percent = match consumed.get(COMPUTE_PERCENT) {
        None => 0,
        Some(q) => k8s_quantity::Quantity::parse(&q.0)
            .ok()
            .and_then(|p| p.as_i64())
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p <= 100)
            .ok_or_else(|| ConsumedError {
                name: COMPUTE_PERCENT.into(),
                value: q.0.clone(),
                problem: "is not a whole percentage from 0 to 100",
            })?,
    };
    Ok(Consumed {
        memory_bytes,
        compute_percent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(memory: &str) -> Device {
        Device {
            name: "gpu-0".into(),
            capacity: Some(BTreeMap::from([
                (
                    MEMORY.to_owned(),
                    DeviceCapacity {
                        value: Quantity(memory.into()),
                        request_policy: None,
                    },
                ),
                (
                    "multiprocessors".to_owned(),
                    DeviceCapacity {
                        value: Quantity("132".into()),
                        request_policy: None,
                    },
                ),
            ])),
            ..Default::default()
        }
    }

    #[test]
    fn the_enforcement_level_is_the_nodes_for_full_gpus() {
        let level = |d: &Device| {
            d.attributes.as_ref().unwrap()[SHARE_ENFORCEMENT]
                .string
                .clone()
                .unwrap()
        };
        let mut d = gpu("81559Mi");
        assert!(make_shareable_at(&mut d, ShareEnforcement::Kernel));
        assert_eq!(level(&d), "kernel");
        let mut d = gpu("81559Mi");
        assert!(make_shareable(&mut d));
        assert_eq!(level(&d), "mps");
    }

    #[test]
    fn an_h100_gets_memory_in_gib_steps_defaulting_to_all_of_it() {
        let mut d = gpu("81559Mi");
        assert!(make_shareable(&mut d));
        assert_eq!(d.allow_multiple_allocations, Some(true));
        let caps = d.capacity.unwrap();
        let memory = &caps[MEMORY];
        assert_eq!(memory.value.0, "81559Mi");
        let policy = memory.request_policy.as_ref().unwrap();
        // 81559 MiB = 79.6 GiB: the default is the 79 whole GiB.
        assert_eq!(policy.default.as_ref().unwrap().0, "79Gi");
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(
            (
                range.min.0.as_str(),
                range.step.as_ref().unwrap().0.as_str()
            ),
            ("1Gi", "1Gi")
        );
        let compute = &caps[COMPUTE_PERCENT];
        assert_eq!(compute.value.0, "100");
        assert_eq!(
            compute
                .request_policy
                .as_ref()
                .unwrap()
                .default
                .as_ref()
                .unwrap()
                .0,
            "0"
        );
        let sms = caps["multiprocessors"].request_policy.as_ref().unwrap();
        assert_eq!(
            sms.valid_values.as_deref(),
            Some(&[Quantity("0".into())][..])
        );
    }

    #[test]
    fn counter_consuming_and_tiny_devices_stay_exclusive() {
        let mut placement = gpu("10Gi");
        placement.consumes_counters = Some(vec![Default::default()]);
        assert!(!make_shareable(&mut placement));
        assert_eq!(placement.allow_multiple_allocations, None);
        let mut tiny = gpu("512Mi");
        assert!(!make_shareable(&mut tiny));
    }

    #[test]
    fn whole_means_nothing_a_share_could_use_is_left() {
        let total = 81559 << 20;
        assert!(is_whole(79 << 30, total));
        assert!(!is_whole(78 << 30, total));
        assert_eq!(whole_memory_bytes(80 << 30), 80 << 30);
    }

    #[test]
    fn consumed_capacity_is_read_or_refused_by_name() {
        let q = |s: &str| Quantity(s.into());
        let ok = consumed(&BTreeMap::from([
            (MEMORY.to_owned(), q("20Gi")),
            (COMPUTE_PERCENT.to_owned(), q("25")),
            ("multiprocessors".to_owned(), q("0")),
        ]))
        .unwrap();
        assert_eq!(
            ok,
            Consumed {
                memory_bytes: 20 << 30,
                compute_percent: 25
            }
        );
        let e = consumed(&BTreeMap::from([
            (MEMORY.to_owned(), q("20Gi")),
            (COMPUTE_PERCENT.to_owned(), q("250")),
        ]))
        .unwrap_err();
        assert_eq!(e.name, COMPUTE_PERCENT);
        assert_eq!(consumed(&BTreeMap::new()).unwrap_err().name, MEMORY);
        let decimal = consumed(&BTreeMap::from([(MEMORY.to_owned(), q("134217728k"))])).unwrap();
        assert_eq!(decimal.memory_bytes, 125 << 30);
        // Any form Kubernetes writes a whole number in, through the workspace's quantity type.
        for (text, bytes) in [
            ("1.5Gi", 3 << 29),
            ("2e9", 2_000_000_000),
            ("1536Mi", 3 << 29),
        ] {
            let read = consumed(&BTreeMap::from([(MEMORY.to_owned(), q(text))])).unwrap();
            assert_eq!(read.memory_bytes, bytes, "{text}");
        }
        for text in ["0.5", "-1Gi", "lots"] {
            assert_eq!(
                consumed(&BTreeMap::from([(MEMORY.to_owned(), q(text))]))
                    .unwrap_err()
                    .problem,
                "is not a whole number of bytes",
                "{text}"
            );
        }
    }
}
