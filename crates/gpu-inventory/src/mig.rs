//! MIG devices: existing ones, and the partitionable model (KEP-4815 shared counters).
//!
//! Partitionable model of one GPU with MIG mode enabled and a profile table (`migProfiles`):
//! - one counter set named after the GPU device, with the counters `memory-slice-0` ..
//!   `memory-slice-7` (1 each), `multiprocessors` (the GPU's SMs), `memory` (the GPU's bytes),
//!   and `copy-engines`, `decoders`, `encoders`, `jpeg-engines`, `ofa-engines` (the largest
//!   profile's counts, i.e. the full GPU's media engines as MIG sees them); counters whose total
//!   is 0 are left out;
//! - one device per possible placement of every profile, consuming its memory slices and its
//!   profile's SMs, memory and engines.
//!
//! Two placements overlap in memory slices exactly when MIG forbids them together, and the
//! engine counters carry the remaining rule (one `+me` instance: it takes the single OFA), so
//! the scheduler's counter accounting admits exactly the valid partitions.
//!
//! The whole GPU is not part of the model: with MIG mode on, CUDA runs only inside MIG devices,
//! so a claim for the whole GPU could not be honoured at prepare. A GPU with MIG off is
//! published whole instead, without placements (creating a MIG device needs MIG mode on, which
//! needs a GPU reset the plugin does not do).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::backend::{MigPlacement, MigProfile, RawMigDevice};
use crate::mig_tables::{MEMORY_SLICES, PROFILE_1_SLICE_REV1, PROFILE_2_SLICE_REV1, PROFILE_COUNT};
use crate::model::{Gpu, bytes_quantity, capacity, count, int, string};
use crate::naming::{Naming, mig_device_name, nvidia_mig_device_name};

/// The MIG profile name NVML would print without its `MIG ` prefix, e.g. `1g.10gb`,
/// `1g.5gb+me`: `<compute slices>g.<GB>gb`, where GB is the profile's memory rounded up to
/// eighths of the GPU's memory, times the GPU's memory in whole GiB (rounded up), rounded; the
/// suffix follows the NVML profile id (`_REV1` = `+me`, `_GFX` = `+gfx`, `_NO_ME` = `-me`,
/// `_ALL_ME` = `+me.all`).
pub fn profile_name(profile: &MigProfile, gpu_memory_bytes: u64) -> String {
    let total_mib = (gpu_memory_bytes >> 20).max(1);
    let eighths = (profile.memory_size_mib * 8).div_ceil(total_mib);
    let total_gib = total_mib.div_ceil(1024);
    let gb = (eighths * total_gib + 4) / 8;
    let suffix = match profile.profile {
        PROFILE_1_SLICE_REV1 | PROFILE_2_SLICE_REV1 => "+me",
        10..=12 => "+gfx",
        13 | 14 => "-me",
        15 | 16 => "+me.all",
        _ => "",
    };
    format!("{}g.{gb}gb{suffix}", profile.slice_count)
}

/// One published MIG device: existing (`uuid` set) or a possible placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDevice {
    /// Device name ([`crate::naming::mig_device_name`]).
    pub name: String,
    /// The parent GPU's device name.
    pub parent: String,
    /// `MIG-...` for an existing device; `None` for a placement not created yet.
    pub uuid: Option<String>,
    /// Profile name, e.g. `1g.10gb`.
    pub profile: String,
    /// NVML GPU instance profile id.
    pub profile_id: u32,
    /// Memory slices occupied.
    pub placement: MigPlacement,
    /// GPU instance and compute instance ids of an existing device.
    pub instance_ids: Option<(u32, u32)>,
    /// Framebuffer bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG engines.
    pub jpeg_engines: u32,
    /// Optical flow accelerators.
    pub ofa_engines: u32,
}

/// The existing MIG devices of `gpu` whose profile is in its table; others are skipped with a
/// warning (we could not name or describe them).
pub fn existing_devices(gpu: &Gpu) -> Vec<MigDevice> {
    gpu.raw
        .mig_devices
        .iter()
        .filter_map(|m| {
            let Some(profile) = gpu.raw.mig_profiles.iter().find(|p| p.id == m.profile_id) else {
                tracing::warn!(gpu = %gpu.name, mig = %m.uuid, profile = m.profile_id,
                    "MIG device of a profile NVML did not list; not published");
                return None;
            };
            Some(existing_device(gpu, profile, m))
        })
        .collect()
}

fn existing_device(gpu: &Gpu, profile: &MigProfile, m: &RawMigDevice) -> MigDevice {
    let name = profile_name(profile, gpu.raw.memory_total_bytes);
    let partial_ci = m
        .attributes
        .as_ref()
        .filter(|a| a.compute_instance_slice_count < a.gpu_instance_slice_count)
        .map(|_| m.compute_instance_id);
    let mut device = placement_device(gpu, profile, m.placement);
    device.name = mig_name(gpu, profile, &name, m.placement.start, partial_ci);
    device.uuid = Some(m.uuid.clone());
    device.instance_ids = Some((m.gpu_instance_id, m.compute_instance_id));
    if let Some(a) = &m.attributes {
        device.memory_bytes = a.memory_total_bytes;
        device.multiprocessors = a.multiprocessor_count;
        device.copy_engines = a.copy_engine_count;
        device.decoders = a.decoder_count;
        device.encoders = a.encoder_count;
        device.jpeg_engines = a.jpeg_count;
        device.ofa_engines = a.ofa_count;
    }
    device
}

/// The device name of a MIG device of `profile` (named `name`) at memory slice `start` of `gpu`,
/// in the GPU's naming scheme.
fn mig_name(
    gpu: &Gpu,
    profile: &MigProfile,
    name: &str,
    start: u32,
    compute_instance: Option<u32>,
) -> String {
    match gpu.naming {
        Naming::Drust => mig_device_name(&gpu.name, name, start, compute_instance),
        Naming::Nvidia => {
            nvidia_mig_device_name(gpu.raw.minor, name, profile.id, start, compute_instance)
        }
    }
}

/// A possible placement of `profile` at `placement` on `gpu`, with the profile's resources.
fn placement_device(gpu: &Gpu, profile: &MigProfile, placement: MigPlacement) -> MigDevice {
    let name = profile_name(profile, gpu.raw.memory_total_bytes);
    MigDevice {
        name: mig_name(gpu, profile, &name, placement.start, None),
        parent: gpu.name.clone(),
        uuid: None,
        profile: name,
        profile_id: profile.id,
        placement,
        instance_ids: None,
        memory_bytes: profile.memory_size_mib << 20,
        multiprocessors: profile.multiprocessor_count,
        copy_engines: profile.copy_engine_count,
        decoders: profile.decoder_count,
        encoders: profile.encoder_count,
        jpeg_engines: profile.jpeg_count,
        ofa_engines: profile.ofa_count,
    }
}

impl MigDevice {
    /// The `resource.k8s.io/v1` Device: `type` = `mig`, `profile`, `uuid` (existing devices),
    /// `placementStart`/`placementSize` (memory slices), `gpuInstanceId`/`computeInstanceId`
    /// (existing devices), the parent's product and location attributes
    /// ([`Gpu::parent_attributes`]); capacities `memory` (bytes), `multiprocessors`,
    /// `copyEngines`, `decoders`, `encoders`, `jpegEngines`, `ofaEngines`.
    pub fn device(&self, parent: &Gpu) -> Device {
        let mut attributes = parent.parent_attributes();
        attributes.extend([
            ("type".to_owned(), string("mig")),
            ("profile".to_owned(), string(&self.profile)),
            ("placementStart".to_owned(), int(self.placement.start)),
            ("placementSize".to_owned(), int(self.placement.size)),
        ]);
        if let Some(uuid) = &self.uuid {
            attributes.insert("uuid".to_owned(), string(uuid));
        }
        if let Some((gi, ci)) = self.instance_ids {
            attributes.insert("gpuInstanceId".to_owned(), int(gi));
            attributes.insert("computeInstanceId".to_owned(), int(ci));
        }
        let capacities = BTreeMap::from([
            (
                "memory".to_owned(),
                capacity(bytes_quantity(self.memory_bytes)),
            ),
            ("multiprocessors".to_owned(), count(self.multiprocessors)),
            ("copyEngines".to_owned(), count(self.copy_engines)),
            ("decoders".to_owned(), count(self.decoders)),
            ("encoders".to_owned(), count(self.encoders)),
            ("jpegEngines".to_owned(), count(self.jpeg_engines)),
            ("ofaEngines".to_owned(), count(self.ofa_engines)),
        ]);
        Device {
            name: self.name.clone(),
            attributes: Some(attributes),
            capacity: Some(capacities),
            ..Default::default()
        }
    }

    /// What this placement takes from its parent's counter set.
    fn consumption(&self) -> BTreeMap<String, u64> {
        let mut c: BTreeMap<String, u64> = (self.placement.start
            ..self.placement.start + self.placement.size)
            .map(|s| (memory_slice(s), 1))
            .collect();
        c.insert(MULTIPROCESSORS.into(), self.multiprocessors.into());
        c.insert(MEMORY.into(), self.memory_bytes);
        c.insert(COPY_ENGINES.into(), self.copy_engines.into());
        c.insert(DECODERS.into(), self.decoders.into());
        c.insert(ENCODERS.into(), self.encoders.into());
        c.insert(JPEG_ENGINES.into(), self.jpeg_engines.into());
        c.insert(OFA_ENGINES.into(), self.ofa_engines.into());
        c
    }
}

/// Counter names of the partitionable model.
pub const MULTIPROCESSORS: &str = "multiprocessors";
/// Framebuffer bytes.
pub const MEMORY: &str = "memory";
/// Copy engines.
pub const COPY_ENGINES: &str = "copy-engines";
/// Video decoders.
pub const DECODERS: &str = "decoders";
/// Video encoders.
pub const ENCODERS: &str = "encoders";
/// JPEG engines.
pub const JPEG_ENGINES: &str = "jpeg-engines";
/// Optical flow accelerators.
pub const OFA_ENGINES: &str = "ofa-engines";

/// `memory-slice-<n>`.
pub fn memory_slice(n: u32) -> String {
    format!("memory-slice-{n}")
}

/// The counter totals of `gpu`'s set (before dropping zeros).
fn totals(gpu: &Gpu) -> BTreeMap<String, u64> {
    let profiles = &gpu.raw.mig_profiles;
    let largest = profiles
        .iter()
        .max_by_key(|p| (p.slice_count, p.memory_size_mib));
    let slices = profiles
        .iter()
        .flat_map(|p| &p.placements)
        .map(|p| p.start + p.size)
        .max()
        .unwrap_or(MEMORY_SLICES);
    let mut t: BTreeMap<String, u64> = (0..slices).map(|s| (memory_slice(s), 1)).collect();
    t.insert(MULTIPROCESSORS.into(), gpu.raw.multiprocessor_count.into());
    t.insert(MEMORY.into(), gpu.raw.memory_total_bytes);
    let engine = |f: fn(&MigProfile) -> u32| u64::from(largest.map_or(0, f));
    t.insert(COPY_ENGINES.into(), engine(|p| p.copy_engine_count));
    t.insert(DECODERS.into(), engine(|p| p.decoder_count));
    t.insert(ENCODERS.into(), engine(|p| p.encoder_count));
    t.insert(JPEG_ENGINES.into(), engine(|p| p.jpeg_count));
    t.insert(OFA_ENGINES.into(), engine(|p| p.ofa_count));
    t
}

fn quantity(name: &str, v: u64) -> Quantity {
    if name == MEMORY {
        bytes_quantity(v)
    } else {
        Quantity(v.to_string())
    }
}

/// Every possible placement of every profile of `gpu`, by `NVML_GPU_INSTANCE_PROFILE_*` then start.
pub fn placements(gpu: &Gpu) -> Vec<MigDevice> {
    let mut profiles: Vec<&MigProfile> = gpu
        .raw
        .mig_profiles
        .iter()
        .filter(|p| p.profile < PROFILE_COUNT)
        .collect();
    profiles.sort_by_key(|p| p.profile);
    profiles
        .into_iter()
        .flat_map(|p| p.placements.iter().map(move |&pl| (p, pl)))
        .map(|(p, pl)| placement_device(gpu, p, pl))
        .collect()
}

/// The name of `gpu`'s counter set: the GPU's name (NVIDIA's driver: `gpu-<minor>-counter-set`).
fn counter_set_name(gpu: &Gpu) -> String {
    match gpu.naming {
        Naming::Drust => gpu.name.clone(),
        Naming::Nvidia => format!("{}-counter-set", gpu.name),
    }
}

/// The partitionable model of `gpu` (see the module docs): its counter set, then every
/// placement, each consuming from that set. Only meaningful for a GPU with MIG mode enabled.
pub fn partitionable(gpu: &Gpu) -> (CounterSet, Vec<Device>) {
    let totals = totals(gpu);
    let keep = |name: &String| totals.get(name).is_some_and(|&v| v > 0);
    let counters = totals
        .iter()
        .filter(|(n, _)| keep(n))
        .map(|(n, &v)| {
            (
                n.clone(),
                Counter {
                    value: quantity(n, v),
                },
            )
        })
        .collect();
    let consumes = |c: BTreeMap<String, u64>| {
        Some(vec![DeviceCounterConsumption {
            counter_set: counter_set_name(gpu),
            counters: c
                .into_iter()
                .filter(|(n, v)| *v > 0 && keep(n))
                .map(|(n, v)| {
                    let q = quantity(&n, v);
                    (n, Counter { value: q })
                })
                .collect(),
        }])
    };
    let mut devices = Vec::new();
    for p in placements(gpu) {
        let mut d = p.device(gpu);
        d.consumes_counters = consumes(p.consumption());
        devices.push(d);
    }
    (
        CounterSet {
            name: counter_set_name(gpu),
            counters,
        },
        devices,
    )
}

/// Attributes of a device that mark it as a MIG device, for tests and callers that filter.
pub fn is_mig(device: &Device) -> bool {
    device
        .attributes
        .as_ref()
        .and_then(|a| a.get("type"))
        .and_then(|a: &DeviceAttribute| a.string.as_deref())
        == Some("mig")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig_tables::{builtin_products, builtin_profiles};

    /// Total bytes NVML reports for each product with a table.
    fn memory_bytes(product: &str) -> u64 {
        match product {
            p if p.contains("40GB") => 40960 << 20,
            p if p.contains("A100") => 81920 << 20,
            _ => 81559 << 20,
        }
    }

    #[test]
    fn profile_names_match_nvidia_smi_for_every_builtin_table() {
        let want: &[(&str, &[&str])] = &[
            (
                "NVIDIA A100-SXM4-40GB",
                &[
                    "1g.5gb",
                    "1g.5gb+me",
                    "1g.10gb",
                    "2g.10gb",
                    "3g.20gb",
                    "4g.20gb",
                    "7g.40gb",
                ],
            ),
            (
                "NVIDIA A100-SXM4-80GB",
                &[
                    "1g.10gb",
                    "1g.10gb+me",
                    "1g.20gb",
                    "2g.20gb",
                    "3g.40gb",
                    "4g.40gb",
                    "7g.80gb",
                ],
            ),
            (
                "NVIDIA H100 80GB HBM3",
                &[
                    "1g.10gb",
                    "1g.10gb+me",
                    "1g.20gb",
                    "2g.20gb",
                    "3g.40gb",
                    "4g.40gb",
                    "7g.80gb",
                ],
            ),
        ];
        for (product, names) in want {
            let profiles = builtin_profiles(product).expect("table");
            let got: Vec<String> = profiles
                .iter()
                .map(|p| profile_name(p, memory_bytes(product)))
                .collect();
            assert_eq!(&got, names, "{product}");
        }
    }

    #[test]
    fn every_placement_fits_and_instance_counts_match_placements() {
        for product in builtin_products() {
            for p in builtin_profiles(product).expect("table") {
                assert!(!p.placements.is_empty(), "{product} profile {}", p.id);
                for pl in &p.placements {
                    assert!(
                        pl.size >= 1 && pl.start + pl.size <= MEMORY_SLICES,
                        "{product} {pl:?}"
                    );
                    // Placements are aligned to their size (MIG's buddy layout).
                    assert_eq!(pl.start % pl.size.min(4), 0, "{product} {pl:?}");
                }
                // Placements of one profile never overlap, so instanceCount of them fit at once,
                // except the +me profiles, whose single OFA/JPEG engine limits them to one.
                let mut used = 0u32;
                let mut disjoint = 0;
                for pl in &p.placements {
                    let mask = ((1u32 << pl.size) - 1) << pl.start;
                    if used & mask == 0 {
                        used |= mask;
                        disjoint += 1;
                    }
                }
                if p.ofa_count == 0 || p.slice_count == 7 {
                    assert_eq!(disjoint, p.instance_count, "{product} profile {}", p.id);
                } else {
                    assert_eq!(p.instance_count, 1, "{product} profile {}", p.id);
                }
                // SMs scale with compute slices within one GPC's worth of rounding.
                assert!(
                    p.multiprocessor_count >= 14 * p.slice_count,
                    "{product} {}",
                    p.id
                );
            }
        }
    }
}
