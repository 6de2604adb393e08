//! NVML calls `nvml-wrapper` 0.13 lacks or gets wrong, made through its loaded function table
//! (`Nvml::lib`) and raw device handles. Each `unsafe` block calls one NVML function with a
//! handle NVML gave us and out-pointers to properly sized, zeroed, repr(C) values we own.
#![allow(unsafe_code)]

use std::mem;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try, nvml_try_count};
use nvml_wrapper::{Device, GpmSample, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t,
    nvmlEventData_t, nvmlEventSet_t, nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t,
    nvmlGpuFabricInfo_v3_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_IBMNPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH, nvmlIntNvLinkDeviceType_t,
    nvmlReturn_t,
};

use crate::backend::{MigPlacement, NvLinkRemote};
use crate::fabric::{FabricInfo, FabricQueryError, RawFabricAnswer, negotiate};

/// `nvmlSetMemoryLimits_v1_t` (NVML 13.4 header, `nvml.h`): 24 bytes on x86_64.
#[repr(C)]
struct SetMemoryLimitsV1 {
    /// The cgroup's full sysfs path, NUL-terminated.
    name_space: *const std::os::raw::c_char,
    soft_limit: u64,
    hard_limit: u64,
}

/// `nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t, nvmlSetMemoryLimits_v1_t *)`.
type SetMemoryLimitsFn = unsafe extern "C" fn(
    nvml_wrapper_sys::bindings::nvmlDevice_t,
    *mut SetMemoryLimitsV1,
) -> nvmlReturn_t;

/// `nvmlDeviceSetMemoryLimits_v1`, looked up in the library NVML was loaded from: drivers
/// before r615 lack it, and nvml-wrapper-sys 0.10's table does not know it.
pub(super) struct MemoryLimitsEntry {
    set: SetMemoryLimitsFn,
    // Keeps the library mapped while `set` may be called (NVML holds it too).
    _library: libloading::Library,
}

impl MemoryLimitsEntry {
    /// Looks the entry point up in `library` (the path or name NVML was loaded from); `None`
    /// when the library lacks it.
    pub(super) fn find(library: &std::ffi::OsStr) -> Option<Self> {
        // SAFETY: the library is libnvidia-ml, already loaded and initialized by nvml-wrapper;
        // opening it again only takes a reference and runs no initializers a second time.
        let lib = unsafe { libloading::Library::new(library) }.ok()?;
        // SAFETY: the symbol's type is the documented C signature above.
        let set = unsafe { lib.get::<SetMemoryLimitsFn>(b"nvmlDeviceSetMemoryLimits_v1\0") }
            .ok()
            .map(|s| *s)?;
        Some(Self { set, _library: lib })
    }

    /// Sets (or with soft 0 and hard `u64::MAX`, clears) the limits of `cgroup` on `device`.
    pub(super) fn set(
        &self,
        device: &Device<'_>,
        cgroup: &std::ffi::CStr,
        soft: u64,
        hard: u64,
    ) -> Result<(), NvmlError> {
        let mut limits = SetMemoryLimitsV1 {
            name_space: cgroup.as_ptr(),
            soft_limit: soft,
            hard_limit: hard,
        };
        // SAFETY: `device` is a live handle of the same library; `limits` is a valid,
        // initialized struct whose string outlives the call.
        nvml_try(unsafe { (self.set)(device.handle(), &mut limits) })
    }
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`; `None` for an unknown remote.
pub(super) fn nvlink_remote_device_type(
    nvml: &Nvml,
    device: &Device<'_>,
    link: u32,
) -> Result<Option<NvLinkRemote>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetNvLinkRemoteDeviceType.as_ref())?;
    let mut kind: nvmlIntNvLinkDeviceType_t = 0;
    // SAFETY: `device` is a live handle from this `nvml`; `kind` is a valid out-pointer to the
    // C enum's integer type.
    nvml_try(unsafe { sym(device.handle(), link, &mut kind) })?;
    #[allow(non_upper_case_globals)]
    Ok(match kind {
        nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU => Some(NvLinkRemote::Gpu),
        nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_IBMNPU => Some(NvLinkRemote::Ibmnpu),
        nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH => Some(NvLinkRemote::Switch),
        _ => None,
    })
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` for `profile` on an empty GPU.
pub(super) fn possible_placements(
    nvml: &Nvml,
    device: &Device<'_>,
    profile: u32,
) -> Result<Vec<MigPlacement>, NvmlError> {
    let sym = nvml_sym(
        nvml.lib()
            .nvmlDeviceGetGpuInstancePossiblePlacements_v2
            .as_ref(),
    )?;
    let mut count: u32 = 0;
    // SAFETY: a null placements array with a count pointer asks NVML for the count only.
    nvml_try_count(unsafe { sym(device.handle(), profile, std::ptr::null_mut(), &mut count) })?;
    let mut placements: Vec<nvmlGpuInstancePlacement_t> =
        vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    // SAFETY: `placements` holds `count` initialized elements; NVML writes at most `count` and
    // stores how many it wrote back into `count`.
    nvml_try(unsafe {
        sym(
            device.handle(),
            profile,
            placements.as_mut_ptr(),
            &mut count,
        )
    })?;
    placements.truncate(count as usize);
    Ok(placements
        .into_iter()
        .map(|p| MigPlacement {
            start: p.start,
            size: p.size,
        })
        .collect())
}

/// The GPU instance behind a MIG device: ids, profile and placement.
pub(super) struct GpuInstanceInfo {
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub profile_id: u32,
    pub placement: MigPlacement,
}

/// `nvmlDeviceGetGpuInstanceId`, `nvmlDeviceGetComputeInstanceId` on the MIG handle, then
/// `nvmlDeviceGetGpuInstanceById` on the parent and `nvmlGpuInstanceGetInfo`.
pub(super) fn gpu_instance_info(
    nvml: &Nvml,
    parent: &Device<'_>,
    mig: &Device<'_>,
) -> Result<GpuInstanceInfo, NvmlError> {
    let lib = nvml.lib();
    let gi_id_sym = nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())?;
    let ci_id_sym = nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())?;
    let by_id_sym = nvml_sym(lib.nvmlDeviceGetGpuInstanceById.as_ref())?;
    let info_sym = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    let (mut gi, mut ci) = (0u32, 0u32);
    // SAFETY: `mig` is a live MIG device handle; the ids are valid out-pointers.
    nvml_try(unsafe { gi_id_sym(mig.handle(), &mut gi) })?;
    // SAFETY: as above.
    nvml_try(unsafe { ci_id_sym(mig.handle(), &mut ci) })?;
    let mut instance: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: `parent` is a live GPU handle; `instance` is a valid out-pointer for the handle.
    nvml_try(unsafe { by_id_sym(parent.handle(), gi, &mut instance) })?;
    // SAFETY: an all-zero nvmlGpuInstanceInfo_t is a valid value (integers and a null pointer).
    let mut info: nvmlGpuInstanceInfo_t = unsafe { mem::zeroed() };
    // SAFETY: `instance` came from NVML just above; `info` is a valid out-pointer.
    nvml_try(unsafe { info_sym(instance, &mut info) })?;
    Ok(GpuInstanceInfo {
        gpu_instance_id: gi,
        compute_instance_id: ci,
        profile_id: info.profileId,
        placement: MigPlacement {
            start: info.placement.start,
            size: info.placement.size,
        },
    })
}

/// Creates a GPU instance of `profile` at `placement` (`nvmlDeviceCreateGpuInstanceWithPlacement`)
/// and a compute instance spanning it: the first compute instance profile whose slice count is
/// `slice_count` (`nvmlGpuInstanceGetComputeInstanceProfileInfo`, shared engines), created with
/// `nvmlGpuInstanceCreateComputeInstance`. Returns the GPU and compute instance ids. When the
/// compute instance cannot be made, the GPU instance is destroyed again before the error returns.
pub(super) fn create_mig(
    nvml: &Nvml,
    device: &Device<'_>,
    profile: u32,
    placement: MigPlacement,
    slice_count: u32,
) -> Result<(u32, u32), NvmlError> {
    let lib = nvml.lib();
    let create_gi = nvml_sym(lib.nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?;
    let gi_info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    let ci_profile = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref())?;
    let create_ci = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())?;
    let ci_info = nvml_sym(lib.nvmlComputeInstanceGetInfo_v2.as_ref())?;
    let destroy_gi = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?;

    let at = nvmlGpuInstancePlacement_t {
        start: placement.start,
        size: placement.size,
    };
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: `device` is a live GPU handle; `at` is a valid placement we own for the call;
    // `gi` is a valid out-pointer for the new instance's handle.
    nvml_try(unsafe { create_gi(device.handle(), profile, &at, &mut gi) })?;
    let made = (|| {
        // SAFETY: an all-zero nvmlGpuInstanceInfo_t is a valid value (integers and a null pointer).
        let mut info: nvmlGpuInstanceInfo_t = unsafe { mem::zeroed() };
        // SAFETY: `gi` was just created by NVML; `info` is a valid out-pointer.
        nvml_try(unsafe { gi_info(gi, &mut info) })?;
        let mut chosen = None;
        for id in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            // SAFETY: an all-zero profile info is a valid value (integers only).
            let mut p: nvmlComputeInstanceProfileInfo_t = unsafe { mem::zeroed() };
            // SAFETY: `gi` is live; `p` is a valid out-pointer. Unsupported ids answer an error.
            let r =
                unsafe { ci_profile(gi, id, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut p) };
            if nvml_try(r).is_ok() && p.sliceCount == slice_count {
                chosen = Some(p.id);
                break;
            }
        }
        let ci_profile_id = chosen.ok_or(NvmlError::NotSupported)?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `gi` is live; `ci` is a valid out-pointer for the new compute instance.
        nvml_try(unsafe { create_ci(gi, ci_profile_id, &mut ci) })?;
        // SAFETY: an all-zero nvmlComputeInstanceInfo_t is a valid value (integers, null handles).
        let mut cinfo: nvmlComputeInstanceInfo_t = unsafe { mem::zeroed() };
        // SAFETY: `ci` was just created by NVML; `cinfo` is a valid out-pointer.
        nvml_try(unsafe { ci_info(ci, &mut cinfo) })?;
        Ok((info.id, cinfo.id))
    })();
    if made.is_err() {
        // SAFETY: `gi` is the live instance created above, destroyed once here and not used
        // afterwards.
        let _ = nvml_try(unsafe { destroy_gi(gi) });
    }
    made
}

/// Destroys compute instance `ci` of GPU instance `gi` (`nvmlComputeInstanceDestroy`), then the
/// GPU instance (`nvmlGpuInstanceDestroy`). `Ok(false)` when the GPU instance does not exist; a
/// missing compute instance is skipped.
pub(super) fn destroy_mig(
    nvml: &Nvml,
    device: &Device<'_>,
    gi: u32,
    ci: u32,
) -> Result<bool, NvmlError> {
    let lib = nvml.lib();
    let gi_by_id = nvml_sym(lib.nvmlDeviceGetGpuInstanceById.as_ref())?;
    let ci_by_id = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceById.as_ref())?;
    let destroy_ci = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref())?;
    let destroy_gi = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?;
    let mut instance: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: `device` is a live GPU handle; `instance` is a valid out-pointer.
    match nvml_try(unsafe { gi_by_id(device.handle(), gi, &mut instance) }) {
        Err(NvmlError::NotFound) => return Ok(false),
        other => other?,
    }
    let mut compute: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: `instance` came from NVML just above; `compute` is a valid out-pointer.
    match nvml_try(unsafe { ci_by_id(instance, ci, &mut compute) }) {
        Err(NvmlError::NotFound) => {}
        Err(e) => return Err(e),
        // SAFETY: `compute` is the live compute instance NVML just returned, used once.
        Ok(()) => nvml_try(unsafe { destroy_ci(compute) })?,
    }
    // SAFETY: `instance` is live (its compute instance is gone); not used after this call.
    nvml_try(unsafe { destroy_gi(instance) })?;
    Ok(true)
}

/// The GPU's fabric answer ([`negotiate`]): `nvmlDeviceGetGpuFabricInfoV` with struct version
/// 3, then 2, then `nvmlDeviceGetGpuFabricInfo`, each where the library has it.
pub(super) fn fabric_info(
    nvml: &Nvml,
    device: &Device<'_>,
) -> Result<Option<FabricInfo>, FabricQueryError> {
    let lib = nvml.lib();
    let versioned = nvml_sym(lib.nvmlDeviceGetGpuFabricInfoV.as_ref()).ok();
    let v1 = nvml_sym(lib.nvmlDeviceGetGpuFabricInfo.as_ref()).ok();
    // SAFETY (all three calls): `device` is a live handle of this `nvml`; each out-pointer is a
    // zeroed, properly sized repr(C) struct we own, whose `version` (v2, v3) names that size
    // (NVML_STRUCT_VERSION: the size, with the version in the top byte), so the driver writes
    // within it or answers ARGUMENT_VERSION_MISMATCH.
    negotiate(|version| match version {
        3 => {
            let sym = versioned?;
            // SAFETY: an all-zero struct of integers and byte arrays is a valid value.
            let mut s: nvmlGpuFabricInfo_v3_t = unsafe { mem::zeroed() };
            s.version = struct_version::<nvmlGpuFabricInfo_v3_t>(3);
            // SAFETY: see above.
            let rc = unsafe { sym(device.handle(), &mut s) };
            Some((
                rc,
                RawFabricAnswer {
                    cluster_uuid: s.clusterUuid,
                    status: s.status,
                    clique_id: s.cliqueId,
                    state: s.state,
                    health_mask: Some(s.healthMask),
                    health_summary: Some(s.healthSummary),
                },
            ))
        }
        2 => {
            let sym = versioned?;
            // SAFETY: as above.
            let mut s: nvmlGpuFabricInfo_v2_t = unsafe { mem::zeroed() };
            s.version = struct_version::<nvmlGpuFabricInfo_v2_t>(2);
            // SAFETY: the v2 struct is a prefix of the v3 type the binding declares; its version
            // tells the driver to write no more than the v2 size.
            let rc = unsafe { sym(device.handle(), (&raw mut s).cast()) };
            Some((
                rc,
                RawFabricAnswer {
                    cluster_uuid: s.clusterUuid,
                    status: s.status,
                    clique_id: s.cliqueId,
                    state: s.state,
                    health_mask: Some(s.healthMask),
                    health_summary: None,
                },
            ))
        }
        _ => {
            let sym = v1?;
            // SAFETY: as above.
            let mut s: nvmlGpuFabricInfo_t = unsafe { mem::zeroed() };
            // SAFETY: see above.
            let rc = unsafe { sym(device.handle(), &mut s) };
            Some((
                rc,
                RawFabricAnswer {
                    cluster_uuid: s.clusterUuid,
                    status: s.status,
                    clique_id: s.cliqueId,
                    state: s.state,
                    health_mask: None,
                    health_summary: None,
                },
            ))
        }
    })
}

/// `NVML_STRUCT_VERSION(<T>, version)`: the struct's size with the version in the top byte.
fn struct_version<T>(version: u32) -> u32 {
    // Fabric structs are tens of bytes: the size always fits the low 24 bits.
    (mem::size_of::<T>() as u32) | (version << 24)
}

/// An NVML event set with the GPUs registered on it (`nvmlEventSetCreate`,
/// `nvmlDeviceRegisterEvents`), freed on drop (`nvmlEventSetFree`).
///
/// nvml-wrapper's `EventSet` borrows its `Nvml`, so it cannot live in the backend beside it;
/// this owns the raw handle instead. The owner must drop it before the `Nvml` it came from
/// (`NvmlBackend` declares its event state before `nvml`, and fields drop in order).
pub(super) struct EventWatch {
    set: nvmlEventSet_t,
    free: unsafe extern "C" fn(nvmlEventSet_t) -> nvmlReturn_t,
    /// Raw device handle (as an address) and UUID of each registered GPU.
    gpus: Vec<(usize, String)>,
}

// SAFETY: NVML handles are process-wide and valid on any thread; operations on one event set
// are not thread-safe, which the owner guarantees by keeping the watch behind a mutex.
unsafe impl Send for EventWatch {}

impl Drop for EventWatch {
    fn drop(&mut self) {
        // SAFETY: `set` came from nvmlEventSetCreate and is freed exactly once, here, while the
        // library is still loaded (see the type's docs).
        let _ = unsafe { (self.free)(self.set) };
    }
}

impl EventWatch {
    /// The UUIDs of the registered GPUs.
    pub(super) fn uuids(&self) -> impl Iterator<Item = &str> {
        self.gpus.iter().map(|(_, u)| u.as_str())
    }
}

/// One event from `nvmlEventSetWait_v2`.
pub(super) struct RawEvent {
    /// The UUID of the GPU it came from, when that GPU is one we registered.
    pub uuid: Option<String>,
    /// `nvmlEventType*` bits.
    pub event_type: u64,
    /// The XID for `nvmlEventTypeXidCriticalError`.
    pub data: u64,
}

/// Creates an event set and registers `event_types` (masked by what each GPU supports) for
/// every GPU in `gpus`; a GPU that cannot be registered is left out and returned in the second
/// list with NVML's reason.
pub(super) fn watch_events(
    nvml: &Nvml,
    gpus: &[(Device<'_>, String)],
    event_types: u64,
) -> Result<(EventWatch, Vec<(String, NvmlError)>), NvmlError> {
    let lib = nvml.lib();
    let create = nvml_sym(lib.nvmlEventSetCreate.as_ref())?;
    let register = nvml_sym(lib.nvmlDeviceRegisterEvents.as_ref())?;
    let free = *nvml_sym(lib.nvmlEventSetFree.as_ref())?;
    let mut set: nvmlEventSet_t = std::ptr::null_mut();
    // SAFETY: `set` is a valid out-pointer for the new set's handle.
    nvml_try(unsafe { create(&mut set) })?;
    let mut watch = EventWatch {
        set,
        free,
        gpus: Vec::new(),
    };
    let mut skipped = Vec::new();
    for (device, uuid) in gpus {
        let supported = match device.supported_event_types() {
            Ok(t) => t.bits(),
            Err(e) => {
                skipped.push((uuid.clone(), e));
                continue;
            }
        };
        // SAFETY: `device` is a live handle from this `nvml` and `watch.set` a live set.
        let handle = unsafe { device.handle() };
        // SAFETY: as above; NVML only reads its arguments.
        match nvml_try(unsafe { register(handle, event_types & supported, watch.set) }) {
            Ok(()) => watch.gpus.push((handle as usize, uuid.clone())),
            Err(e) => skipped.push((uuid.clone(), e)),
        }
    }
    Ok((watch, skipped))
}

/// `nvmlEventSetWait_v2`: the next event within `timeout_ms`, `None` on timeout.
pub(super) fn wait_event(
    nvml: &Nvml,
    watch: &EventWatch,
    timeout_ms: u32,
) -> Result<Option<RawEvent>, NvmlError> {
    let wait = nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref())?;
    // SAFETY: an all-zero nvmlEventData_t is valid (a null device handle and integers).
    let mut data: nvmlEventData_t = unsafe { mem::zeroed() };
    // SAFETY: `watch.set` is a live set; `data` is a valid out-pointer.
    match nvml_try(unsafe { wait(watch.set, &mut data, timeout_ms) }) {
        Ok(()) => {}
        Err(NvmlError::Timeout) => return Ok(None),
        Err(e) => return Err(e),
    }
    let uuid = watch
        .gpus
        .iter()
        .find(|(h, _)| *h == data.device as usize)
        .map(|(_, u)| u.clone());
    Ok(Some(RawEvent {
        uuid,
        event_type: data.eventType,
        data: data.eventData,
    }))
}

/// `nvmlDeviceGetRemappedRows`: (a remapping is pending until reset, a remapping failed).
pub(super) fn remapped_rows(nvml: &Nvml, device: &Device<'_>) -> Result<(bool, bool), NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut corrected, mut uncorrected, mut pending, mut failed) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: `device` is a live handle; the four counters are valid out-pointers.
    nvml_try(unsafe {
        sym(
            device.handle(),
            &mut corrected,
            &mut uncorrected,
            &mut pending,
            &mut failed,
        )
    })?;
    Ok((pending != 0, failed != 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fabric_struct_versions_are_the_ones_driver_580_accepts() {
        // tests/gpu/fixtures/h100-580.159.04/fabric.json: v2 33554468, v3 50331688.
        assert_eq!(struct_version::<nvmlGpuFabricInfo_v2_t>(2), 33_554_468);
        assert_eq!(struct_version::<nvmlGpuFabricInfo_v3_t>(3), 50_331_688);
    }
}

/// The last GPM sample of each MIG instance (by GPU index and GPU instance), kept between two
/// usage queries so that the next figures compare it with a new one. The samples are NVML's
/// (`nvmlGpmSampleAlloc`), held as raw handles because a `GpmSample` borrows the `Nvml` that
/// owns this store; each is freed when taken back, when its instance is gone, or by
/// [`GpmSamples::free_all`].
#[derive(Default)]
pub(super) struct GpmSamples(std::sync::Mutex<std::collections::BTreeMap<(u32, u32), RawSample>>);

/// A sample's handle; owned by the store alone.
struct RawSample(nvml_wrapper_sys::bindings::nvmlGpmSample_t);

// SAFETY: an opaque pointer NVML allocated, used only under the store's mutex; NVML's GPM calls
// are not tied to the thread that allocated the sample.
unsafe impl Send for RawSample {}

impl GpmSamples {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<(u32, u32), RawSample>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes back the sample kept for `key`; the caller owns (and frees) it.
    pub(super) fn take<'n>(&self, nvml: &'n Nvml, key: (u32, u32)) -> Option<GpmSample<'n>> {
        let raw = self.lock().remove(&key)?;
        // SAFETY: allocated by `nvml`'s nvmlGpmSampleAlloc (see `keep`) and owned by the map
        // alone until this removal: one owner again.
        Some(unsafe { GpmSample::from_handle(nvml, raw.0) })
    }

    /// Keeps `sample` for `key`, freeing any sample kept before.
    pub(super) fn keep(&self, nvml: &Nvml, key: (u32, u32), sample: GpmSample<'_>) {
        let old = self.lock().insert(key, RawSample(sample.into_handle()));
        if let Some(old) = old {
            // SAFETY: as in `take`.
            drop(unsafe { GpmSample::from_handle(nvml, old.0) });
        }
    }

    /// Frees the samples of GPU `index` whose instance is not in `instances`.
    pub(super) fn retain(&self, nvml: &Nvml, index: u32, instances: &[u32]) {
        let gone: Vec<RawSample> = {
            let mut held = self.lock();
            let keys: Vec<(u32, u32)> = held
                .keys()
                .filter(|(i, gi)| *i == index && !instances.contains(gi))
                .copied()
                .collect();
            keys.iter().filter_map(|k| held.remove(k)).collect()
        };
        for raw in gone {
            // SAFETY: as in `take`.
            drop(unsafe { GpmSample::from_handle(nvml, raw.0) });
        }
    }

    /// Frees every sample (before `nvml` is shut down).
    pub(super) fn free_all(&self, nvml: &Nvml) {
        let all = std::mem::take(&mut *self.lock());
        for (_, raw) in all {
            // SAFETY: as in `take`.
            drop(unsafe { GpmSample::from_handle(nvml, raw.0) });
        }
    }
}
