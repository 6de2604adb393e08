//! Laying out one node's pool as `resource.k8s.io/v1` ResourceSlices the API server accepts.
//!
//! Limits mirror k8s.io/api/resource/v1/types.go and the API server's validation
//! (k8s.io/kubernetes/pkg/apis/resource/validation, `validateResourceSliceSpec`) at v1.36:
//! - a slice holds either `devices` or `sharedCounters`, never both;
//! - at most [`MAX_DEVICES_PER_SLICE`] devices, or [`MAX_DEVICES_PER_SLICE_ADVANCED`] when any
//!   device in the slice has taints or consumes counters;
//! - at most [`MAX_COUNTER_SETS_PER_SLICE`] counter sets per slice.
//!
//! Layout: counter-set slices first (8 sets each), then device slices, filled in order up to the
//! limit that applies to that slice. Every slice carries the same pool generation and the total
//! `resourceSliceCount`. The pool is named after the node, so the scheduler treats it as
//! node-local. [`crate::validate`] checks the result against every per-object rule.

use k8s_openapi::api::resource::v1::{
    CounterSet, Device, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// `ResourceSliceMaxDevices` for slices without taints or counters.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// `ResourceSliceMaxDevicesWithAdvancedFeatures`: taints, counter consumption or list attributes.
pub const MAX_DEVICES_PER_SLICE_ADVANCED: usize = 64;
/// `ResourceSliceMaxCounterSets`.
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;

/// The fewest hexadecimal digits of a slice's index in its name prefix (upstream's
/// `resourceSliceIndexMinLength`, `k8s.io/dynamic-resource-allocation/resourceslice`).
const INDEX_MIN_DIGITS: usize = 5;

/// The longest name prefix the API server uses: it cuts a `generateName` to 58 characters and
/// appends 5 random ones (`names.SimpleNameGenerator` in `k8s.io/apiserver`: 63 - 5).
pub const MAX_NAME_PREFIX: usize = 58;

/// The `metadata.generateName` of slice `index` of `count` in `driver`'s pool on `node_name`,
/// as upstream's resourceslice controller builds it: `<index in hex, zero-padded to at least 5
/// digits (more when count - 1 needs them)>-<driver>-<node>-`, then cut to
/// [`MAX_NAME_PREFIX`] characters, where the server would cut it anyway. The cut matters: the
/// server validates `generateName` itself as a name (at most 253 characters), so for the
/// longest node names upstream's uncut prefix is refused, as a fixed `<node>-<driver>-<i>` was.
pub fn slice_name_prefix(driver: &str, node_name: &str, index: usize, count: usize) -> String {
    let digits = format!("{:x}", count.saturating_sub(1))
        .len()
        .max(INDEX_MIN_DIGITS);
    let mut prefix = format!("{index:0digits$x}-{driver}-{node_name}-");
    // Driver and node names are ASCII (DNS subdomains); the cut never splits a character.
    if prefix.len() > MAX_NAME_PREFIX && prefix.is_char_boundary(MAX_NAME_PREFIX) {
        prefix.truncate(MAX_NAME_PREFIX);
    }
    prefix
}

/// One node's pool content: devices and the counter sets they consume from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pool {
    /// Devices, in publication order.
    pub devices: Vec<Device>,
    /// Counter sets (KEP-4815), unique by name.
    pub counter_sets: Vec<CounterSet>,
}

impl From<Vec<Device>> for Pool {
    fn from(devices: Vec<Device>) -> Self {
        Self {
            devices,
            counter_sets: Vec::new(),
        }
    }
}

/// Whether `device` makes its slice subject to the 64-device limit.
pub fn uses_advanced_features(device: &Device) -> bool {
    device.taints.as_ref().is_some_and(|t| !t.is_empty())
        || device
            .consumes_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
        || device.attributes.as_ref().is_some_and(|a| {
            a.values().any(|v| {
                v.bools.is_some() || v.ints.is_some() || v.strings.is_some() || v.versions.is_some()
            })
        })
}

/// What one slice holds: counter sets or devices.
type SliceContent = (Option<Vec<CounterSet>>, Option<Vec<Device>>);

/// Splits `devices` into runs that each fit one slice.
fn device_chunks(devices: &[Device]) -> Vec<&[Device]> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut advanced = false;
    for (i, d) in devices.iter().enumerate() {
        let next_advanced = advanced || uses_advanced_features(d);
        let limit = if next_advanced {
            MAX_DEVICES_PER_SLICE_ADVANCED
        } else {
            MAX_DEVICES_PER_SLICE
        };
        if i - start + 1 > limit {
            chunks.push(&devices[start..i]);
            start = i;
            advanced = uses_advanced_features(d);
        } else {
            advanced = next_advanced;
        }
    }
    if start < devices.len() {
        chunks.push(&devices[start..]);
    }
    chunks
}

/// The slice layout of one node's pool at one generation.
///
/// Slice names are `<node>-<driver>-<n>`, deterministic so server-side apply updates in place.
/// `generation` goes into every slice's pool; the publisher bumps it when content changes.
pub fn pool_slices(
    driver: &str,
    node_name: &str,
    generation: i64,
    pool: &Pool,
) -> Vec<ResourceSlice> {
    let mut specs: Vec<SliceContent> = pool
        .counter_sets
        .chunks(MAX_COUNTER_SETS_PER_SLICE)
        .map(|c| (Some(c.to_vec()), None))
        .collect();
    specs.extend(
        device_chunks(&pool.devices)
            .into_iter()
            .map(|c| (None, Some(c.to_vec()))),
    );
    if specs.is_empty() {
        // An empty pool is still published, so the scheduler knows this node has no devices:
        // one slice without devices (no `devices: []`, which the API server drops on storing).
        specs.push((None, None));
    }
    let slices = specs.len();
    let count = i64::try_from(slices).unwrap_or(i64::MAX);
    specs
        .into_iter()
        .enumerate()
        .map(|(i, (shared_counters, devices))| ResourceSlice {
            metadata: ObjectMeta {
                generate_name: Some(slice_name_prefix(driver, node_name, i, slices)),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: driver.to_owned(),
                node_name: Some(node_name.to_owned()),
                pool: ResourcePool {
                    name: node_name.to_owned(),
                    generation,
                    resource_slice_count: count,
                },
                devices,
                shared_counters,
                ..Default::default()
            },
        })
        .collect()
}

/// [`pool_slices`] for a pool of plain devices.
pub fn resource_slices(
    driver: &str,
    node_name: &str,
    generation: i64,
    devices: &[Device],
) -> Vec<ResourceSlice> {
    pool_slices(driver, node_name, generation, &Pool::from(devices.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{Counter, DeviceCounterConsumption};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn devices(n: usize) -> Vec<Device> {
        (0..n)
            .map(|i| Device {
                name: format!("gpu-{i}"),
                ..Default::default()
            })
            .collect()
    }

    fn consuming(mut d: Vec<Device>) -> Vec<Device> {
        for d in &mut d {
            d.consumes_counters = Some(vec![DeviceCounterConsumption {
                counter_set: "s".into(),
                counters: [(
                    "c".to_owned(),
                    Counter {
                        value: Quantity("1".into()),
                    },
                )]
                .into(),
            }]);
        }
        d
    }

    #[test]
    fn devices_split_into_slices_of_at_most_128_with_a_consistent_pool() {
        for (n, want) in [(0, 1), (1, 1), (128, 1), (129, 2), (300, 3)] {
            let slices = resource_slices("gpu.example.com", "node-a", 7, &devices(n));
            assert_eq!(slices.len(), want, "{n} devices");
            let total: usize = slices
                .iter()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum();
            assert_eq!(total, n);
            for s in &slices {
                assert_eq!(s.spec.pool.name, "node-a");
                assert_eq!(s.spec.pool.generation, 7);
                assert_eq!(s.spec.pool.resource_slice_count, want as i64);
                assert!(s.spec.devices.as_ref().map_or(0, Vec::len) <= MAX_DEVICES_PER_SLICE);
            }
        }
    }

    #[test]
    fn counter_sets_get_their_own_slices_and_consumers_at_most_64_per_slice() {
        let sets: Vec<CounterSet> = (0..9)
            .map(|i| CounterSet {
                name: format!("s{i}"),
                counters: [(
                    "c".to_owned(),
                    Counter {
                        value: Quantity("1".into()),
                    },
                )]
                .into(),
            })
            .collect();
        let mut all = consuming(devices(100));
        all.extend(devices(130).into_iter().map(|mut d| {
            d.name.push_str("-plain");
            d
        }));
        let pool = Pool {
            devices: all,
            counter_sets: sets,
        };
        let slices = pool_slices("d", "n", 1, &pool);
        let shape: Vec<(usize, usize)> = slices
            .iter()
            .map(|s| {
                (
                    s.spec.shared_counters.as_ref().map_or(0, Vec::len),
                    s.spec.devices.as_ref().map_or(0, Vec::len),
                )
            })
            .collect();
        // 9 sets -> 8 + 1; 100 consumers -> 64 + 36 (+ plain ones up to 64 in that slice);
        // the remaining plain devices fill a slice of up to 128.
        assert_eq!(
            shape,
            [(8, 0), (1, 0), (0, 64), (0, 64), (0, 102)],
            "{shape:?}"
        );
        for s in &slices {
            assert!(s.spec.devices.is_none() || s.spec.shared_counters.is_none());
            assert_eq!(s.spec.pool.resource_slice_count, 5);
        }
    }

    #[test]
    fn slice_name_prefixes_carry_the_index_first_as_upstream() {
        let a = resource_slices("d", "n", 1, &devices(200));
        let names: Vec<_> = a
            .iter()
            .filter_map(|s| s.metadata.generate_name.clone())
            .collect();
        assert_eq!(names, ["00000-d-n-", "00001-d-n-"]);
        assert!(a.iter().all(|s| s.metadata.name.is_none()));
        // More digits once the count needs them (upstream's getIndexLength).
        assert_eq!(slice_name_prefix("d", "n", 0x1f, 0x100001), "00001f-d-n-");
        let long = slice_name_prefix("gpu.drust.dev", &"a".repeat(253), 3, 4);
        assert_eq!(long.len(), MAX_NAME_PREFIX);
        assert!(long.starts_with("00003-gpu.drust.dev-aaa"), "{long}");
    }
}
