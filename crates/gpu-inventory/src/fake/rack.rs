//! Paper racks: the fake topology of each compute tray of an NVIDIA GB200 NVL72 rack, so that a
//! test can stand up 18 nodes (or several racks) of one multi-node NVLink fabric without
//! writing 18 files. Tray 0 of rack 0 is `examples/topologies/gb200-nvl-tray.yaml`'s fabric.
//!
//! Per rack: one cluster UUID ([`cluster_uuid`]) and one clique ([`CLIQUE_ID`]), so every GPU
//! of the rack publishes the same `nvlinkClique` ([`rack_clique`]) and racks differ. Per tray:
//! 4 GB200 GPUs on the Grace-attached PCI domains 0x8, 0x9, 0x18, 0x19 (NUMA nodes 0, 0, 1, 1),
//! the bus number `0x01 + tray`, UUIDs naming the rack, the tray and the GPU
//! (`GPU-<rack, 8 hex>-<tray, 4 hex>-4b20-8000-<GPU, 12 hex>`), so no two GPUs of a rack share
//! a UUID or a PCI address; 18 NVLinks per GPU to the rack's NVLink switch trays. Registration
//! completed with a healthy v3 answer (every health flag false, configuration correct,
//! partition assigned, global fabric manager connected; summary HEALTHY).
//!
//! Write a tray as a topology file with `serde_yaml_ng::to_string(&gb200_nvl72_tray(r, t))`;
//! change a GPU's `fabric` to make it register late, degrade or move to another clique.

use crate::backend::{MigMode, NvLinkGroup, NvLinkRemote, RawGpu, SystemInfo};
use crate::fabric::{FabricHealthSummary, FabricInfo, FabricState};
use crate::fake::Topology;

/// Compute trays in an NVL72 rack.
pub const TRAYS_PER_RACK: u32 = 18;
/// GPUs per compute tray.
pub const GPUS_PER_TRAY: u32 = 4;
/// The clique every GPU of a rack is registered in (what Fabric Manager reports for the
/// default partition of `examples/topologies/gb200-nvl-tray.yaml`).
pub const CLIQUE_ID: u32 = 32766;
/// The health mask of a healthy GB200: degraded bandwidth, route recovery, route unhealthy and
/// access-timeout recovery false (2), configuration correct (1), partition assigned (1),
/// global fabric manager connected (1).
pub const HEALTHY_MASK: u32 = 0xaa | (1 << 8) | (1 << 12) | (1 << 14);

/// The cluster UUID of rack `rack`: rack 0 has the example tray's,
/// `5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94`; the last group counts up.
pub fn cluster_uuid(rack: u32) -> String {
    format!(
        "5b1f2c8e-4d3a-4f7e-9a61-{:012x}",
        0x0c2d_8e7f_3b94_u64 + u64::from(rack)
    )
}

/// The `nvlinkClique` every GPU of rack `rack` publishes.
pub fn rack_clique(rack: u32) -> String {
    format!("{}.{CLIQUE_ID}", cluster_uuid(rack))
}

/// The topology of compute tray `tray` (0..[`TRAYS_PER_RACK`], not checked: a bigger index
/// makes a tray beyond a real rack) of rack `rack`.
pub fn gb200_nvl72_tray(rack: u32, tray: u32) -> Topology {
    let gpus = [(0x8, 0), (0x9, 0), (0x18, 1), (0x19, 1)]
        .into_iter()
        .zip(0u32..)
        .map(|((domain, numa), i)| RawGpu {
            index: i,
            minor: i,
            uuid: format!("GPU-{rack:08x}-{tray:04x}-4b20-8000-{i:012x}"),
            name: "NVIDIA GB200".into(),
            brand: "Nvidia".into(),
            architecture: "Blackwell".into(),
            cuda_compute_capability_major: 10,
            cuda_compute_capability_minor: 0,
            // 189471 MiB.
            memory_total_bytes: 198_674_743_296,
            memory_reserved_bytes: 0,
            multiprocessor_count: 152,
            pci_bus_id: format!("{domain:08x}:{:02x}:00.0", 1 + tray),
            numa_node: Some(numa),
            pcie_root: Some(format!("pci{domain:04x}:00")),
            nvlinks: (0x30..0x39)
                .map(|bus| NvLinkGroup {
                    links: 2,
                    remote_pci_bus_id: format!("00000000:{bus:02x}:00.0"),
                    remote_device_type: NvLinkRemote::Switch,
                })
                .collect(),
            mig_mode: MigMode::Disabled,
            mig_profiles: Vec::new(),
            mig_devices: Vec::new(),
            fabric: Some(FabricInfo {
                state: FabricState::Completed,
                status: 0,
                cluster_uuid: cluster_uuid(rack),
                clique_id: CLIQUE_ID,
                health_mask: Some(HEALTHY_MASK),
                health_summary: Some(FabricHealthSummary::Healthy),
            }),
            fabric_error: None,
        })
        .collect();
    Topology {
        system: SystemInfo {
            driver_version: "570.133.20".into(),
            cuda_driver_version: 12080,
        },
        gpus,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::{FakeBackend, discover};

    #[test]
    fn a_rack_is_18_valid_trays_of_one_clique_with_distinct_gpus() {
        let mut uuids = BTreeSet::new();
        let mut buses = BTreeSet::new();
        for rack in 0..2 {
            for tray in 0..TRAYS_PER_RACK {
                let topology = gb200_nvl72_tray(rack, tray);
                // What a harness writes and the plugin reads: it parses and validates.
                let yaml = serde_yaml_ng::to_string(&topology).expect("serialize");
                let parsed = Topology::parse(&yaml, "tray").expect("a valid topology");
                assert_eq!(parsed, topology);
                let inventory = discover(&FakeBackend::new(parsed)).expect("discover");
                assert_eq!(inventory.gpus.len(), GPUS_PER_TRAY as usize);
                for gpu in &inventory.gpus {
                    assert_eq!(
                        gpu.nvlink_clique.as_deref(),
                        Some(rack_clique(rack).as_str())
                    );
                    assert!(gpu.nvlink_domain.is_some(), "{}", gpu.name);
                    assert!(uuids.insert(gpu.raw.uuid.clone()), "{}", gpu.raw.uuid);
                    if rack == 0 {
                        assert!(
                            buses.insert(gpu.raw.pci_bus_id.clone()),
                            "{}",
                            gpu.raw.pci_bus_id
                        );
                    }
                }
            }
        }
        assert_eq!(uuids.len(), 2 * 18 * 4);
        assert_ne!(rack_clique(0), rack_clique(1));
    }

    #[test]
    fn tray_0_of_rack_0_is_in_the_example_trays_clique() {
        let example = Topology::from_file(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../examples/topologies/gb200-nvl-tray.yaml"),
        )
        .expect("the example tray");
        let ours = gb200_nvl72_tray(0, 0);
        for (e, o) in example.gpus.iter().zip(&ours.gpus) {
            let clique = |g: &RawGpu| g.fabric.as_ref().and_then(FabricInfo::clique);
            assert_eq!(clique(e), clique(o));
            assert_eq!(
                (
                    &e.pci_bus_id,
                    &e.pcie_root,
                    e.numa_node,
                    e.memory_total_bytes
                ),
                (
                    &o.pci_bus_id,
                    &o.pcie_root,
                    o.numa_node,
                    o.memory_total_bytes
                )
            );
            assert_eq!(e.nvlinks, o.nvlinks);
        }
    }
}
