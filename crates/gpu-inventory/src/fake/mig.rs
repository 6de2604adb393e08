//! MIG device creation and destruction in the fake backend: NVML's placement rules, its GPU
//! instance ids, and state that outlives the process (see the module docs of [`crate::fake`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::backend::{BackendError, MigAttributes, MigMode, MigPlacement, RawGpu, RawMigDevice};

/// The state file under the state dir.
pub const STATE_FILE: &str = "mig.json";
/// While this file exists under the state dir, every MIG creation fails (injected).
pub const FAIL_CREATE_FILE: &str = "fail-mig-create";
/// While this file exists under the state dir, every MIG destruction fails (injected).
pub const FAIL_DESTROY_FILE: &str = "fail-mig-destroy";

/// GPU instance ids the driver hands out (`gi<0..15>`): the nodes of the buddy tree over eight
/// memory slices.
const MAX_GPU_INSTANCES: u32 = 15;

/// What the fake keeps of MIG instances: every GPU whose instances changed since the topology
/// was read, with its full list, and a creation counter that makes UUIDs unique.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigState {
    /// MIG devices created so far (never decremented).
    #[serde(default)]
    pub created: u64,
    /// Current MIG devices by parent GPU UUID; GPUs not listed have the topology's `migDevices`.
    #[serde(default)]
    pub gpus: BTreeMap<String, Vec<RawMigDevice>>,
}

impl MigState {
    /// The MIG devices `gpu` has now.
    pub fn devices<'a>(&'a self, gpu: &'a RawGpu) -> &'a [RawMigDevice] {
        self.gpus
            .get(&gpu.uuid)
            .map_or(&gpu.mig_devices, Vec::as_slice)
    }

    /// Reads the state file; the default state when it does not exist.
    pub fn load(path: &Path) -> Result<Self, BackendError> {
        let bad = |message: String| BackendError::FakeState {
            path: path.to_owned(),
            message,
        };
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(bad(e.to_string())),
        }
    }

    /// Replaces the state file atomically and durably (temp file, fsync, rename, fsync dir), so
    /// a crash leaves the old or the new state, as the driver's own state would be.
    pub fn store(&self, path: &Path) -> Result<(), BackendError> {
        let bad = |e: std::io::Error| BackendError::FakeState {
            path: path.to_owned(),
            message: e.to_string(),
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(bad)?;
        let tmp: PathBuf = dir.join(format!(".{STATE_FILE}.tmp"));
        let mut bytes = serde_json::to_vec_pretty(self).map_err(|e| bad(e.into()))?;
        bytes.push(b'\n');
        let mut f = std::fs::File::create(&tmp).map_err(bad)?;
        f.write_all(&bytes).map_err(bad)?;
        f.sync_all().map_err(bad)?;
        std::fs::rename(&tmp, path).map_err(bad)?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(bad)
    }
}

/// Memory slices of a GPU: the end of its largest placement (8 on A100 and H100).
fn memory_slices(gpu: &RawGpu) -> u32 {
    gpu.mig_profiles
        .iter()
        .flat_map(|p| &p.placements)
        .map(|p| p.start + p.size)
        .max()
        .unwrap_or(8)
}

/// The GPU instance id the driver gives a placement: the index of the placement's node in the
/// buddy tree over the GPU's memory slices (whole GPU 0, halves 1-2, quarters 3-6, slices 7-14),
/// as `nvidia-smi mig -cgi` shows (seven `1g` instances get ids 7..13, two `3g` 1 and 2). A
/// placement that is not a tree node, or whose node id is taken, gets the lowest free id.
fn gpu_instance_id(slices: u32, placement: MigPlacement, used: &[u32]) -> Option<u32> {
    let node = (placement.size.is_power_of_two()
        && slices.is_power_of_two()
        && placement.size <= slices
        && placement.start.is_multiple_of(placement.size))
    .then(|| slices / placement.size - 1 + placement.start / placement.size)
    .filter(|id| *id < MAX_GPU_INSTANCES && !used.contains(id));
    node.or_else(|| (0..MAX_GPU_INSTANCES).find(|id| !used.contains(id)))
}

/// A deterministic `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` from the parent, the instance ids
/// and the creation counter: the same sequence of operations gives the same UUIDs, and a device
/// created again at the same place gets a new one, as on hardware.
pub fn mig_uuid(
    parent: &str,
    gpu_instance_id: u32,
    compute_instance_id: u32,
    serial: u64,
) -> String {
    // FNV-1a, twice with different offsets, for 128 bits.
    let fnv = |seed: u64| {
        let mut h = seed;
        let input = format!("{parent}/{gpu_instance_id}/{compute_instance_id}/{serial}");
        for b in input.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    };
    let hex = format!(
        "{:016x}{:016x}",
        fnv(0xcbf2_9ce4_8422_2325),
        fnv(0x8422_2325_cbf2_9ce4)
    );
    format!(
        "MIG-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Creates a MIG device of `profile_id` at `placement` on `gpu`, which now has `existing`,
/// checking what NVML checks: MIG mode on, a known profile, one of its placements, no memory
/// slice shared with another GPU instance, the profile's instance count, and the GPU's compute
/// slices. `serial` numbers the creation (for the UUID). `Err` holds NVML-style text.
pub fn create(
    gpu: &RawGpu,
    existing: &[RawMigDevice],
    profile_id: u32,
    placement: MigPlacement,
    serial: u64,
) -> Result<RawMigDevice, String> {
    if gpu.mig_mode != MigMode::Enabled {
        return Err(format!(
            "Not Supported: MIG mode is {:?} on GPU {} (enable it with nvidia-smi -mig 1)",
            gpu.mig_mode, gpu.uuid
        ));
    }
    let Some(profile) = gpu.mig_profiles.iter().find(|p| p.id == profile_id) else {
        return Err(format!(
            "Invalid Argument: GPU instance profile {profile_id} is not a profile of {}",
            gpu.name
        ));
    };
    if !profile.placements.contains(&placement) {
        return Err(format!(
            "Invalid Argument: placement {{start: {}, size: {}}} is not a placement of profile \
             {profile_id} (placements {:?})",
            placement.start, placement.size, profile.placements
        ));
    }
    let mask = |p: MigPlacement| ((1u64 << p.size.min(63)) - 1) << p.start.min(63);
    if let Some(other) = existing
        .iter()
        .find(|m| mask(m.placement) & mask(placement) != 0)
    {
        return Err(format!(
            "Insufficient Resources: placement {{start: {}, size: {}}} overlaps GPU instance {} \
             ({} at {{start: {}, size: {}}})",
            placement.start,
            placement.size,
            other.gpu_instance_id,
            other.uuid,
            other.placement.start,
            other.placement.size
        ));
    }
    let same = existing
        .iter()
        .filter(|m| m.profile_id == profile_id)
        .count();
    if u32::try_from(same).unwrap_or(u32::MAX) >= profile.instance_count {
        return Err(format!(
            "Insufficient Resources: profile {profile_id} allows {} instance(s) and {same} exist",
            profile.instance_count
        ));
    }
    let slice_count = |id: u32| {
        gpu.mig_profiles
            .iter()
            .find(|p| p.id == id)
            .map_or(0, |p| p.slice_count)
    };
    let compute_total = gpu
        .mig_profiles
        .iter()
        .map(|p| p.slice_count)
        .max()
        .unwrap_or(0);
    let compute_used: u32 = existing.iter().map(|m| slice_count(m.profile_id)).sum();
    if compute_used + profile.slice_count > compute_total {
        return Err(format!(
            "Insufficient Resources: {compute_used} of {compute_total} compute slices are in use \
             and profile {profile_id} needs {}",
            profile.slice_count
        ));
    }
    let used: Vec<u32> = existing.iter().map(|m| m.gpu_instance_id).collect();
    let Some(gi) = gpu_instance_id(memory_slices(gpu), placement, &used) else {
        return Err(format!(
            "Insufficient Resources: all {MAX_GPU_INSTANCES} GPU instance ids are in use"
        ));
    };
    // A compute instance spanning its GPU instance is the first (and only) one: id 0.
    let ci = 0;
    Ok(RawMigDevice {
        uuid: mig_uuid(&gpu.uuid, gi, ci, serial),
        gpu_instance_id: gi,
        compute_instance_id: ci,
        profile_id,
        placement,
        attributes: Some(MigAttributes {
            memory_total_bytes: profile.memory_size_mib << 20,
            multiprocessor_count: profile.multiprocessor_count,
            copy_engine_count: profile.copy_engine_count,
            decoder_count: profile.decoder_count,
            encoder_count: profile.encoder_count,
            jpeg_count: profile.jpeg_count,
            ofa_count: profile.ofa_count,
            gpu_instance_slice_count: profile.slice_count,
            compute_instance_slice_count: profile.slice_count,
        }),
    })
}

/// The minor of the `/dev/nvidia-caps/nvidia-cap<m>` node guarding GPU instance `gi` (and, with
/// `ci`, its compute instance) of the GPU with minor `gpu_minor`, as the driver numbers them in
/// `/proc/driver/nvidia-caps/mig-minors`: `config` 1, `monitor` 2, then per GPU minor, per GPU
/// instance id 0..=14, the GPU instance's `access` followed by compute instances 0..=7
/// (`gpu0/gi0/access` 3, `gpu0/gi0/ci0/access` 4, `gpu0/gi1/access` 12, `gpu1/gi0/access` 138).
pub fn capability_minor(gpu_minor: u32, gi: u32, ci: Option<u32>) -> u32 {
    const PER_GI: u32 = 1 + 8;
    const PER_GPU: u32 = MAX_GPU_INSTANCES * PER_GI;
    3 + gpu_minor * PER_GPU + gi * PER_GI + ci.map_or(0, |c| 1 + c)
}

/// The driver's `/proc/driver/nvidia-caps/mig-minors` for GPUs with minors `0..gpus` (the real
/// table lists every possible GPU, instance and compute instance, whether it exists or not).
pub fn capability_table(gpus: u32) -> String {
    let mut table = String::from("config 1\nmonitor 2\n");
    for g in 0..gpus {
        for gi in 0..MAX_GPU_INSTANCES {
            table.push_str(&format!(
                "gpu{g}/gi{gi}/access {}\n",
                capability_minor(g, gi, None)
            ));
            for ci in 0..8 {
                table.push_str(&format!(
                    "gpu{g}/gi{gi}/ci{ci}/access {}\n",
                    capability_minor(g, gi, Some(ci))
                ));
            }
        }
    }
    table
}
