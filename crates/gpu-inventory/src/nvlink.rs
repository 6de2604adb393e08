//! NVLink domains: which GPUs of this node are joined by active NVLinks.
//!
//! Derivation (published as the `nvlinkDomain` attribute):
//!
//! 1. Every GPU and every NVSwitch seen at the far end of an active link is a vertex, keyed by its
//!    PCI bus ID in extended BDF form (NVML's `nvmlDeviceGetNvLinkRemotePciInfo_v2`, normalized
//!    like `resource.kubernetes.io/pciBusID`).
//! 2. Each active link group ([`NvLinkGroup`], from `nvmlDeviceGetNvLinkState` = active,
//!    `nvmlDeviceGetNvLinkRemoteDeviceType`) joins its GPU with the remote GPU (a direct link or
//!    an NVLink bridge) or the remote NVSwitch. Links to IBM NPUs and to GPUs that are not on this
//!    node join nothing. A group with zero links (all down) joins nothing; one link up is enough.
//! 3. The domains are the connected components (union-find) that hold at least two GPUs. A GPU
//!    alone in its component (no NVLink, or every link down) gets no domain.
//! 4. A domain's identifier is the lowest PCI bus ID among the NVSwitches of the component, or
//!    among its GPUs when it has no switch. So the value survives the loss of any GPU on an
//!    NVSwitch system, does not depend on NVML enumeration order, and is a plain string
//!    `dddd:bb:dd.f` a claim can `matchAttribute` on. Values are only meaningful within one node,
//!    which is all `matchAttribute` needs (a claim's devices come from one node's pools).

use std::collections::BTreeMap;

use crate::backend::{NvLinkGroup, NvLinkRemote, RawGpu};
use crate::model::standard_pci_bus_id;

/// The key of a vertex: a PCI bus ID as upstream's `pciBusID` attribute would spell it, or the
/// lowercase NVML string when it does not fit that form.
fn bus_key(nvml_bus_id: &str) -> String {
    standard_pci_bus_id(nvml_bus_id).unwrap_or_else(|| nvml_bus_id.trim().to_ascii_lowercase())
}

/// A minimal union-find over vertex indices.
struct UnionFind {
    parent: Vec<usize>,
}

impl UnionFind {
    fn new(n: usize) -> Self {
        Self {
            parent: (0..n).collect(),
        }
    }

    fn find(&mut self, mut v: usize) -> usize {
        while self.parent[v] != v {
            self.parent[v] = self.parent[self.parent[v]];
            v = self.parent[v];
        }
        v
    }

    fn union(&mut self, a: usize, b: usize) {
        let (a, b) = (self.find(a), self.find(b));
        if a != b {
            // Keep the smaller index as root: the result does not depend on union order.
            let (lo, hi) = if a < b { (a, b) } else { (b, a) };
            self.parent[hi] = lo;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    // Switches sort first, so a component's anchor is its lowest switch when it has one.
    Switch,
    Gpu,
}

/// The NVLink domain of each GPU in `gpus` (same order), per the rules in the module docs.
pub fn nvlink_domains(gpus: &[&RawGpu]) -> Vec<Option<String>> {
    let mut vertices: BTreeMap<(Kind, String), usize> = BTreeMap::new();
    let mut keys: Vec<(Kind, String)> = Vec::new();
    let mut vertex = |kind: Kind, key: String| -> usize {
        let next = keys.len();
        *vertices.entry((kind, key.clone())).or_insert_with(|| {
            keys.push((kind, key));
            next
        })
    };
    let gpu_vertices: Vec<usize> = gpus
        .iter()
        .map(|g| vertex(Kind::Gpu, bus_key(&g.pci_bus_id)))
        .collect();
    let mut edges = Vec::new();
    for (g, &from) in gpus.iter().zip(&gpu_vertices) {
        for NvLinkGroup {
            links,
            remote_pci_bus_id,
            remote_device_type,
        } in &g.nvlinks
        {
            if *links == 0 {
                continue;
            }
            let key = bus_key(remote_pci_bus_id);
            match remote_device_type {
                NvLinkRemote::Switch => edges.push((from, vertex(Kind::Switch, key))),
                NvLinkRemote::Gpu => {
                    // Only GPUs of this node: the remote key must be one we enumerated.
                    if let Some(pos) = gpus.iter().position(|o| bus_key(&o.pci_bus_id) == key) {
                        edges.push((from, gpu_vertices[pos]));
                    }
                }
                NvLinkRemote::Ibmnpu => {}
            }
        }
    }
    let mut uf = UnionFind::new(keys.len());
    for (a, b) in edges {
        uf.union(a, b);
    }
    // Per component: how many GPUs, and its anchor (lowest (kind, key)).
    let mut gpu_count: BTreeMap<usize, usize> = BTreeMap::new();
    for &v in &gpu_vertices {
        *gpu_count.entry(uf.find(v)).or_default() += 1;
    }
    let mut anchor: BTreeMap<usize, &(Kind, String)> = BTreeMap::new();
    for (v, key) in keys.iter().enumerate() {
        let root = uf.find(v);
        let entry = anchor.entry(root).or_insert(key);
        if key < *entry {
            *entry = key;
        }
    }
    gpu_vertices
        .iter()
        .map(|&v| {
            let root = uf.find(v);
            (gpu_count.get(&root).copied().unwrap_or(0) >= 2)
                .then(|| anchor.get(&root).map(|(_, key)| key.clone()))
                .flatten()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(bus: &str, links: &[(u32, &str, NvLinkRemote)]) -> RawGpu {
        RawGpu {
            index: 0,
            minor: 0,
            uuid: format!("GPU-{bus}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            brand: "Nvidia".into(),
            architecture: "Hopper".into(),
            cuda_compute_capability_major: 9,
            cuda_compute_capability_minor: 0,
            memory_total_bytes: 1,
            memory_reserved_bytes: 0,
            multiprocessor_count: 1,
            pci_bus_id: format!("00000000:{bus}:00.0"),
            numa_node: None,
            pcie_root: None,
            nvlinks: links
                .iter()
                .map(|&(links, remote, kind)| NvLinkGroup {
                    links,
                    remote_pci_bus_id: format!("00000000:{remote}:00.0"),
                    remote_device_type: kind,
                })
                .collect(),
            mig_mode: Default::default(),
            mig_profiles: Vec::new(),
            mig_devices: Vec::new(),
            fabric: None,
            fabric_error: None,
        }
    }

    use NvLinkRemote::{Gpu, Ibmnpu, Switch};

    fn domains(gpus: &[RawGpu]) -> Vec<Option<String>> {
        nvlink_domains(&gpus.iter().collect::<Vec<_>>())
    }

    fn d(bus: &str) -> Option<String> {
        Some(format!("0000:{bus}:00.0"))
    }

    #[test]
    fn nvlink_domains_follow_switches_bridges_and_active_links() {
        let switched = |bus| gpu(bus, &[(5, "05", Switch), (4, "06", Switch)]);
        type Case = (&'static str, Vec<RawGpu>, Vec<Option<String>>);
        let cases: Vec<Case> = vec![
            (
                "NVSwitch: one domain named after the lowest switch",
                vec![switched("18"), switched("2a"), switched("3a")],
                vec![d("05"), d("05"), d("05")],
            ),
            (
                "bridges in pairs: one domain per pair, named after its lower GPU",
                vec![
                    gpu("18", &[(4, "2a", Gpu)]),
                    gpu("2a", &[(4, "18", Gpu)]),
                    gpu("3a", &[(4, "5d", Gpu)]),
                    gpu("5d", &[(4, "3a", Gpu)]),
                ],
                vec![d("18"), d("18"), d("3a"), d("3a")],
            ),
            (
                "no NVLink: no domain",
                vec![gpu("18", &[]), gpu("2a", &[])],
                vec![None, None],
            ),
            (
                "a pair whose links are all down is two lone GPUs; one side up is enough",
                vec![
                    gpu("18", &[(0, "2a", Gpu)]),
                    gpu("2a", &[]),
                    gpu("3a", &[(1, "5d", Gpu)]),
                    gpu("5d", &[]),
                ],
                vec![None, None, d("3a"), d("3a")],
            ),
            (
                "a GPU alone on a switch, links to absent GPUs and NPUs join nothing",
                vec![
                    gpu("18", &[(18, "05", Switch)]),
                    gpu("2a", &[(4, "ff", Gpu), (2, "04", Ibmnpu)]),
                ],
                vec![None, None],
            ),
            (
                "bridge chains join transitively; a switch anchors a mixed component",
                vec![
                    gpu("18", &[(2, "2a", Gpu)]),
                    gpu("2a", &[(2, "3a", Gpu)]),
                    gpu("3a", &[(1, "f0", Switch)]),
                    gpu("5d", &[(1, "f0", Switch)]),
                ],
                vec![d("f0"), d("f0"), d("f0"), d("f0")],
            ),
        ];
        for (name, gpus, want) in cases {
            assert_eq!(domains(&gpus), want, "{name}");
        }
    }

    #[test]
    fn domains_do_not_depend_on_enumeration_order_or_a_lost_gpu() {
        let switched = |bus| gpu(bus, &[(5, "08", Switch), (5, "05", Switch)]);
        let all = [switched("18"), switched("2a"), switched("3a")];
        let reversed: Vec<RawGpu> = all.iter().rev().cloned().collect();
        assert_eq!(domains(&reversed), vec![d("05"); 3]);
        assert_eq!(domains(&all[1..]), vec![d("05"); 2]);
    }
}
