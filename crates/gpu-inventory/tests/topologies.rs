//! Every example topology through the public API: discovery, the published pool in both MIG
//! strategies, the slice layout within every API limit, and the partitionable model's counters
//! admitting exactly the valid MIG partitions.

use std::collections::BTreeMap;
use std::path::Path;

use gpu_inventory::slices::pool_slices;
use gpu_inventory::validate::validate_pool;
use gpu_inventory::{FakeBackend, Inventory, MigStrategy, Topology, discover, mig};
use k8s_openapi::api::resource::v1::Device;

const TOPOLOGIES: &[&str] = &[
    "dgx-h100",
    "dgx-a100-mig",
    "pcie-l40s",
    "paired-nvlink-bridges",
    "gb200-nvl-tray",
    "mixed-a100-l4",
    "pcie-a100-mig",
];

fn inventory(name: &str) -> Inventory {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/topologies")
        .join(format!("{name}.yaml"));
    discover(&FakeBackend::new(
        Topology::from_file(path).expect("topology"),
    ))
    .expect("discover")
}

fn attr<'a>(
    d: &'a Device,
    key: &str,
) -> Option<&'a k8s_openapi::api::resource::v1::DeviceAttribute> {
    d.attributes.as_ref()?.get(key)
}

fn s(d: &Device, key: &str) -> Option<String> {
    attr(d, key)?.string.clone()
}

#[test]
fn every_topology_lays_out_within_every_api_limit_in_both_strategies() {
    for name in TOPOLOGIES {
        let inv = inventory(name);
        for strategy in [MigStrategy::Existing, MigStrategy::Partitionable] {
            let pool = inv.pool(strategy);
            let slices = pool_slices("gpu.drust.dev", "node-a", 3, &pool);
            validate_pool(&slices).unwrap_or_else(|e| panic!("{name} {strategy:?}: {e}"));
            let devices: usize = slices
                .iter()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum();
            assert_eq!(devices, pool.devices.len(), "{name} {strategy:?}");
        }
    }
}

#[test]
fn topology_facts_show_in_the_published_attributes() {
    // DGX H100: one NVSwitch domain, two NUMA nodes, a pcieRoot per GPU.
    let pool = inventory("dgx-h100").pool(MigStrategy::Existing);
    let domains: Vec<_> = pool.devices.iter().map(|d| s(d, "nvlinkDomain")).collect();
    assert_eq!(domains, vec![Some("0000:05:00.0".to_owned()); 8]);
    let numa: Vec<_> = pool
        .devices
        .iter()
        .filter_map(|d| attr(d, "resource.kubernetes.io/numaNode")?.int)
        .collect();
    assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);
    assert!(
        pool.devices
            .iter()
            .all(|d| s(d, "resource.kubernetes.io/pcieRoot").is_some())
    );

    // Bridged pairs: three linked pairs; the pair whose bridge is down has no domain.
    let pool = inventory("paired-nvlink-bridges").pool(MigStrategy::Existing);
    let domains: Vec<_> = pool.devices.iter().map(|d| s(d, "nvlinkDomain")).collect();
    let pair = |b: &str| Some(format!("0000:{b}:00.0"));
    assert_eq!(
        domains,
        [
            pair("18"),
            pair("18"),
            pair("3a"),
            pair("3a"),
            pair("9a"),
            pair("9a"),
            None,
            None
        ]
    );

    // PCIe L40S: no NVLink, driver version normalized.
    let pool = inventory("pcie-l40s").pool(MigStrategy::Existing);
    assert!(pool.devices.iter().all(|d| s(d, "nvlinkDomain").is_none()));
    assert_eq!(
        attr(&pool.devices[0], "driverVersion").and_then(|a| a.version.clone()),
        Some("580.159.4".to_owned())
    );

    // GB200: the fabric's clique.
    let pool = inventory("gb200-nvl-tray").pool(MigStrategy::Existing);
    assert!(
        pool.devices.iter().all(|d| s(d, "nvlinkClique").as_deref()
            == Some("5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94.32766"))
    );

    // Mixed: two products.
    let pool = inventory("mixed-a100-l4").pool(MigStrategy::Existing);
    let products: std::collections::BTreeSet<_> = pool
        .devices
        .iter()
        .filter_map(|d| s(d, "productName"))
        .collect();
    assert_eq!(products.len(), 2);
}

#[test]
fn mig_enabled_gpus_publish_their_mig_devices_and_never_themselves() {
    let inv = inventory("dgx-a100-mig");
    let pool = inv.pool(MigStrategy::Existing);
    let mig: Vec<&Device> = pool.devices.iter().filter(|d| mig::is_mig(d)).collect();
    assert_eq!(mig.len(), 7 + 3 + 1);
    let whole: Vec<&str> = pool
        .devices
        .iter()
        .filter(|d| !mig::is_mig(d))
        .map(|d| d.name.as_str())
        .collect();
    // GPUs 0-3 have MIG enabled (GPU 3 with no instances): only GPUs 4-7 are whole.
    assert_eq!(
        whole,
        [
            "gpu-0000-87-00-0",
            "gpu-0000-90-00-0",
            "gpu-0000-b7-00-0",
            "gpu-0000-bd-00-0"
        ]
    );
    let profiles: Vec<String> = mig.iter().filter_map(|d| s(d, "profile")).collect();
    assert_eq!(profiles.iter().filter(|p| *p == "1g.10gb").count(), 8);
    for d in mig {
        let parent = s(d, "parentUUID").expect("parentUUID");
        assert!(inv.gpus.iter().any(|g| g.raw.uuid == parent));
        assert!(s(d, "uuid").is_some_and(|u| u.starts_with("MIG-")));
    }
}

/// A placement as the checks below see it.
struct Placement {
    profile_id: u32,
    slices: u32,
    compute: u32,
    consumes: BTreeMap<String, i128>,
}

/// A counter's value, read as the workspace's one quantity type reads it (issue 41: no test
/// parses `Mi`/`Gi` by hand).
fn amount(q: &str) -> i128 {
    let value = k8s_quantity::Quantity::parse(q)
        .expect("a quantity")
        .as_i64()
        .expect("a whole number");
    i128::from(value)
}

fn consumption(d: &Device) -> BTreeMap<String, i128> {
    d.consumes_counters
        .iter()
        .flatten()
        .flat_map(|c| &c.counters)
        .map(|(k, v)| (k.clone(), amount(&v.value.0)))
        .collect()
}

#[test]
fn partitionable_counters_admit_exactly_the_valid_mig_partitions() {
    for name in ["dgx-h100", "dgx-a100-mig", "mixed-a100-l4"] {
        let inv = inventory(name);
        let gpu = &inv.gpus[0];
        let (set, devices) = mig::partitionable(gpu);
        let totals: BTreeMap<String, i128> = set
            .counters
            .iter()
            .map(|(k, v)| (k.clone(), amount(&v.value.0)))
            .collect();
        assert!(
            devices.iter().all(mig::is_mig),
            "{name}: only placements consume the counter set"
        );
        let profiles = &gpu.raw.mig_profiles;
        let placements: Vec<Placement> = devices
            .iter()
            .map(|d| {
                let consumes = consumption(d);
                let start = attr(d, "placementStart")
                    .and_then(|a| a.int)
                    .expect("start");
                let size = attr(d, "placementSize").and_then(|a| a.int).expect("size");
                let profile = s(d, "profile").expect("profile");
                let p = profiles
                    .iter()
                    .find(|p| mig::profile_name(p, gpu.raw.memory_total_bytes) == profile)
                    .expect("profile in table");
                for (k, v) in &consumes {
                    assert!(
                        totals.get(k).is_some_and(|t| v <= t),
                        "{name} {}: {k}",
                        d.name
                    );
                }
                Placement {
                    profile_id: p.id,
                    slices: ((1u32 << size) - 1) << start,
                    compute: p.slice_count,
                    consumes,
                }
            })
            .collect();
        // Every set of placements with disjoint memory slices: the counters admit it exactly when
        // MIG allows it (per-profile instance counts, 7 compute slices).
        let mut checked = 0;
        let mut admitted = 0;
        let mut stack: Vec<(usize, u32, Vec<usize>)> = vec![(0, 0, Vec::new())];
        while let Some((next, used, chosen)) = stack.pop() {
            let mut sum: BTreeMap<&str, i128> = BTreeMap::new();
            for &i in &chosen {
                for (k, v) in &placements[i].consumes {
                    *sum.entry(k).or_default() += v;
                }
            }
            let by_counters = sum
                .iter()
                .all(|(k, v)| totals.get(*k).is_some_and(|t| v <= t));
            let compute: u32 = chosen.iter().map(|&i| placements[i].compute).sum();
            let within_counts = profiles.iter().all(|p| {
                chosen
                    .iter()
                    .filter(|&&i| placements[i].profile_id == p.id)
                    .count()
                    <= p.instance_count as usize
            });
            let by_mig = compute <= 7 && within_counts;
            assert_eq!(by_counters, by_mig, "{name}: placements {chosen:?}");
            checked += 1;
            admitted += usize::from(by_mig);
            for (i, p) in placements.iter().enumerate().skip(next) {
                if p.slices & used == 0 {
                    let mut c = chosen.clone();
                    c.push(i);
                    stack.push((i + 1, used | p.slices, c));
                }
            }
        }
        // Overlapping placements are rejected by the memory-slice counters alone.
        for a in &placements {
            for b in &placements {
                if !std::ptr::eq(a, b) && a.slices & b.slices != 0 {
                    let shared = (0..8)
                        .filter(|s| (a.slices & b.slices) & (1 << s) != 0)
                        .all(|s| {
                            let k = format!("memory-slice-{s}");
                            a.consumes.get(&k).copied().unwrap_or(0)
                                + b.consumes.get(&k).copied().unwrap_or(0)
                                > totals[&k]
                        });
                    assert!(shared, "{name}: overlapping placements both fit");
                }
            }
        }
        assert!(
            checked > 100 && admitted > 50,
            "{name}: {checked} sets, {admitted} valid"
        );
    }
}

/// Partitionable mode must not publish what prepare cannot honour: a MIG placement on a GPU
/// with MIG disabled (creating it needs MIG mode on) or the whole GPU of a MIG-enabled one (it
/// runs no CUDA work). Each GPU is either whole, without counters, or placements only.
#[test]
fn partitionable_mode_publishes_only_what_prepare_can_honour() {
    use gpu_inventory::backend::MigMode;
    let mut enabled_seen = 0;
    let mut disabled_seen = 0;
    for name in TOPOLOGIES {
        let inv = inventory(name);
        let pool = inv.pool(MigStrategy::Partitionable);
        for gpu in &inv.gpus {
            let whole = pool.devices.iter().find(|d| d.name == gpu.name);
            let placements: Vec<&Device> = pool
                .devices
                .iter()
                .filter(|d| s(d, "parentUUID").as_deref() == Some(gpu.raw.uuid.as_str()))
                .collect();
            let counters = pool.counter_sets.iter().any(|c| c.name == gpu.name);
            if gpu.raw.mig_mode == MigMode::Enabled {
                enabled_seen += 1;
                assert!(
                    whole.is_none(),
                    "{name} {}: MIG on, whole GPU published",
                    gpu.name
                );
                assert!(
                    !placements.is_empty() && counters,
                    "{name} {}: MIG on, no placements",
                    gpu.name
                );
            } else {
                disabled_seen += usize::from(gpu.raw.mig_mode == MigMode::Disabled);
                let whole = whole.unwrap_or_else(|| panic!("{name} {}: not published", gpu.name));
                assert!(
                    whole.consumes_counters.is_none() && placements.is_empty() && !counters,
                    "{name} {}: MIG off, yet placements or counters published",
                    gpu.name
                );
            }
        }
    }
    assert!(
        enabled_seen >= 4 && disabled_seen >= 8,
        "{enabled_seen} {disabled_seen}"
    );
}
