//! Laying out one node's devices as `resource.k8s.io/v1` ResourceSlices of a single pool.
//!
//! Limits mirror k8s.io/api/resource/v1/types.go: at most [`MAX_DEVICES_PER_SLICE`] devices per
//! slice. The pool is named after the node, so the scheduler treats it as node-local.

use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// `ResourceSliceMaxDevices` for slices without taints or counters.
pub const MAX_DEVICES_PER_SLICE: usize = 128;

/// The label our slices carry with the node name, for listing them cheaply.
pub const NODE_LABEL: &str = "resource.drust.dev/node";

/// The slice layout of one node's pool at one generation.
///
/// Slice names are `<node>-<driver>-<n>`, deterministic so server-side apply updates in place.
/// `generation` goes into every slice's pool; the publisher bumps it when content changes.
pub fn resource_slices(
    driver: &str,
    node_name: &str,
    generation: i64,
    devices: &[Device],
) -> Vec<ResourceSlice> {
    let chunks: Vec<&[Device]> = if devices.is_empty() {
        // An empty pool is still published, so the scheduler knows this node has no devices.
        vec![&[]]
    } else {
        devices.chunks(MAX_DEVICES_PER_SLICE).collect()
    };
    let count = i64::try_from(chunks.len()).unwrap_or(i64::MAX);
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(format!("{node_name}-{driver}-{i}")),
                labels: Some([(NODE_LABEL.to_owned(), node_name.to_owned())].into()),
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
                devices: Some(chunk.to_vec()),
                ..Default::default()
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devices(n: usize) -> Vec<Device> {
        (0..n)
            .map(|i| Device {
                name: format!("gpu-{i}"),
                ..Default::default()
            })
            .collect()
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
    fn slice_names_are_deterministic() {
        let a = resource_slices("d", "n", 1, &devices(200));
        let names: Vec<_> = a.iter().filter_map(|s| s.metadata.name.clone()).collect();
        assert_eq!(names, ["n-d-0", "n-d-1"]);
    }
}
