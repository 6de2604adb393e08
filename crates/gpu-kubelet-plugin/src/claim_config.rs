//! The driver's configuration API: opaque parameters in DeviceClasses and ResourceClaims.
//!
//! A DeviceClass (`spec.config[].opaque`) or a ResourceClaim (`spec.devices.config[].opaque`)
//! carries, for `driver: <our driver name>`, an object of API version [`API_VERSION`]:
//!
//! ```yaml
//! apiVersion: gpu.drust.dev/v1alpha1
//! kind: GpuConfig                # whole GPUs; MigDeviceConfig for MIG devices
//! sharing:
//!   strategy: TimeSlicing        # or MPS (MIG devices: MPS only)
//!   timeSlicing: {interval: Default}          # Default | Short | Medium | Long
//!   mps:
//!     defaultActiveThreadPercentage: 50       # 1..=100, % of the GPU's SMs per client
//!     defaultPinnedDeviceMemoryLimit: 10Gi    # quantity, bytes of device memory per client
//! ```
//!
//! Decoding is strict: an unknown field, a wrong type or a value out of range is an error that
//! names the claim, the config entry and the field path (e.g. `sharing.mps.defaultPinnedDevice
//! MemoryLimit`). The allocation lists class configs before claim configs
//! (`DeviceAllocationConfiguration.source`, KEP-4381); for each allocated device the last entry
//! that applies to its request wins, so a claim overrides its class. An entry applies when its
//! `requests` is empty or names the device's request (a main request also covers its
//! subrequests, `<request>/<subrequest>`, KEP-4816). A config whose kind does not fit the device
//! (a `GpuConfig` on a MIG device, time-slicing on a MIG device) is an error for that claim.
//!
//! # NVIDIA's configuration API
//!
//! Claims written for NVIDIA's DRA driver carry `apiVersion: resource.nvidia.com/v1beta1`
//! ([`NVIDIA_API_VERSION`]; NVIDIA's `api/nvidia.com/resource/v1beta1`), which is read too and
//! mapped onto the same sharing:
//!
//! ```yaml
//! apiVersion: resource.nvidia.com/v1beta1
//! kind: GpuConfig                # or MigDeviceConfig (no timeSlicingConfig)
//! sharing:
//!   strategy: MPS                # or TimeSlicing
//!   timeSlicingConfig: {interval: Long}
//!   mpsConfig:
//!     defaultActiveThreadPercentage: 50
//!     defaultPinnedDeviceMemoryLimit: 10Gi
//!     defaultPerDevicePinnedMemoryLimit: {"GPU-...": 5Gi, "1": 8Gi}
//! ```
//!
//! Decoding is strict as NVIDIA's is (unknown fields are errors). Where NVIDIA's semantics
//! differ, NVIDIA's win for its API: a config whose `requests` is empty applies only to devices
//! of its kind (a `GpuConfig` skips MIG devices instead of failing on them), and the keys of
//! `defaultPerDevicePinnedMemoryLimit` are device UUIDs or indices into the sorted UUIDs of the
//! devices the config applies to. What drust does not do is an error naming the field, never
//! ignored: `TimeSlicing` on a MIG device (a no-op in NVIDIA's driver), an active thread
//! percentage of 0, a pinned limit under 1 MiB (NVIDIA's own minimum), a per-device limit for a
//! MIG device created at prepare (no UUID yet), and the kinds `VfioDeviceConfig` and
//! `ComputeDomainDaemonConfig`.
//!
//! # IMEX channels
//!
//! An IMEX channel (`imex-channel-<N>`, [`gpu_inventory::imex`]) is prepared only with the
//! ComputeDomain it serves, named by a `ComputeDomainChannelConfig` in either API version,
//! with NVIDIA's field names (`api/nvidia.com/resource/v1beta1/computedomainconfig.go`):
//!
//! ```yaml
//! apiVersion: gpu.drust.dev/v1alpha1      # or resource.nvidia.com/v1beta1
//! kind: ComputeDomainChannelConfig
//! domainID: 6f1c...                        # the ComputeDomain's UID; required
//! allocationMode: Single                   # optional; or All
//! ```
//!
//! A channel with no such config, a `domainID` that is missing or not a label value, or the
//! kind on a GPU or MIG device is an error naming the field ([`resolve_channels`]). The claim
//! gets the channels it was allocated: `allocationMode: All` goes with a request for every
//! channel the node publishes (`--imex-channels`; the ComputeDomain controller's template for a
//! domain whose `channel.allocationMode` is `All`), where NVIDIA's driver injects all 2048
//! channels beside the one it allocates.

use dra_cel::libs::quantity::Quantity;
use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde::{Deserialize, Serialize};

/// The API version of every configuration object this driver reads.
pub const API_VERSION: &str = "gpu.drust.dev/v1alpha1";
/// Kind configuring whole GPUs.
pub const KIND_GPU: &str = "GpuConfig";
/// Kind configuring MIG devices.
pub const KIND_MIG: &str = "MigDeviceConfig";
/// Kind naming the ComputeDomain of an IMEX channel (both API versions, NVIDIA's fields).
pub const KIND_CHANNEL: &str = "ComputeDomainChannelConfig";
/// NVIDIA's configuration API version, read beside ours (same kind names).
pub const NVIDIA_API_VERSION: &str = "resource.nvidia.com/v1beta1";
/// Kinds of NVIDIA's API that drust does not implement.
const NVIDIA_UNSUPPORTED_KINDS: [&str; 2] = ["VfioDeviceConfig", "ComputeDomainDaemonConfig"];

/// `kind: ComputeDomainChannelConfig`: the ComputeDomain an IMEX channel serves. The same
/// fields in both API versions (NVIDIA's).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeDomainChannelConfig {
    /// [`API_VERSION`] or [`NVIDIA_API_VERSION`].
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    /// Always [`KIND_CHANNEL`].
    pub kind: String,
    /// The ComputeDomain's UID; required, a label value.
    #[serde(rename = "domainID", default)]
    pub domain_id: Option<String>,
    /// `Single` (the default): the claim gets the domain's one channel. NVIDIA's `All` (every
    /// channel of the node) is refused: a node here serves one domain on channel 0.
    #[serde(rename = "allocationMode", default)]
    pub allocation_mode: Option<String>,
}

/// NVIDIA's `GpuConfig` (`resource.nvidia.com/v1beta1`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaGpuConfig {
    api_version: String,
    kind: String,
    #[serde(default)]
    sharing: Option<NvidiaSharing>,
}

/// NVIDIA's `GpuSharing`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaSharing {
    strategy: Strategy,
    #[serde(default)]
    time_slicing_config: Option<NvidiaTimeSlicing>,
    #[serde(default)]
    mps_config: Option<NvidiaMps>,
}

/// NVIDIA's `MigDeviceConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaMigDeviceConfig {
    api_version: String,
    kind: String,
    #[serde(default)]
    sharing: Option<NvidiaMigSharing>,
}

/// NVIDIA's `MigDeviceSharing`: no time-slicing settings.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaMigSharing {
    strategy: Strategy,
    #[serde(default)]
    mps_config: Option<NvidiaMps>,
}

/// NVIDIA's `TimeSlicingConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaTimeSlicing {
    #[serde(default)]
    interval: TimeSlice,
}

/// NVIDIA's `MpsConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaMps {
    #[serde(default)]
    default_active_thread_percentage: Option<i64>,
    #[serde(default)]
    default_pinned_device_memory_limit: Option<String>,
    #[serde(default)]
    default_per_device_pinned_memory_limit: Option<std::collections::BTreeMap<String, String>>,
}

/// `kind: GpuConfig`: settings for a whole GPU.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    /// Always [`API_VERSION`].
    pub api_version: String,
    /// Always [`KIND_GPU`].
    pub kind: String,
    /// How the GPU is shared by the containers of the claim; `None`: not configured (the
    /// driver's default, exclusive use without MPS and the GPU's current time slice).
    #[serde(default)]
    pub sharing: Option<SharingSpec>,
}

/// `kind: MigDeviceConfig`: settings for a MIG device.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigDeviceConfig {
    /// Always [`API_VERSION`].
    pub api_version: String,
    /// Always [`KIND_MIG`].
    pub kind: String,
    /// How the MIG device is shared; MIG devices support MPS only (NVIDIA does not time-slice
    /// inside a MIG device).
    #[serde(default)]
    pub sharing: Option<SharingSpec>,
}

/// `sharing`, as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SharingSpec {
    /// The strategy.
    pub strategy: Strategy,
    /// Settings of [`Strategy::TimeSlicing`]; only with that strategy.
    #[serde(default)]
    pub time_slicing: Option<TimeSlicingSpec>,
    /// Settings of [`Strategy::Mps`]; only with that strategy.
    #[serde(default)]
    pub mps: Option<MpsSpec>,
}

/// A sharing strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum Strategy {
    /// The GPU's scheduler interleaves the processes of the claim's containers.
    TimeSlicing,
    /// A per-claim MPS control daemon runs the containers' CUDA work concurrently.
    #[serde(rename = "MPS")]
    Mps,
}

/// `sharing.timeSlicing`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TimeSlicingSpec {
    /// The time slice; `Default` when unset.
    #[serde(default)]
    pub interval: TimeSlice,
}

/// The GPU compute time slice, as `nvidia-smi compute-policy --set-timeslice` names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum TimeSlice {
    /// The driver's default (`--set-timeslice 0`).
    #[default]
    Default,
    /// About 1 ms (`1`).
    Short,
    /// About 2 ms (`2`).
    Medium,
    /// About 5 ms (`3`).
    Long,
}

impl TimeSlice {
    /// The value `nvidia-smi compute-policy --set-timeslice` takes.
    pub fn nvidia_smi_value(self) -> u8 {
        match self {
            Self::Default => 0,
            Self::Short => 1,
            Self::Medium => 2,
            Self::Long => 3,
        }
    }
}

/// `sharing.mps`, as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsSpec {
    /// Percentage (1..=100) of the device's SMs each MPS client may use
    /// (`set_default_active_thread_percentage`).
    #[serde(default)]
    pub default_active_thread_percentage: Option<u32>,
    /// Device memory each MPS client may pin, a Kubernetes quantity such as `10Gi`
    /// (`set_default_device_pinned_mem_limit`).
    #[serde(default)]
    pub default_pinned_device_memory_limit: Option<String>,
}

/// The sharing a device gets, decoded and checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "strategy")]
pub enum Sharing {
    /// Time-slicing with this interval.
    TimeSlicing {
        /// The time slice.
        interval: TimeSlice,
    },
    /// MPS with these limits.
    #[serde(rename = "MPS")]
    Mps(MpsLimits),
}

/// MPS limits, checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsLimits {
    /// 1..=100, or `None` for MPS's default (100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u32>,
    /// Bytes, or `None` for no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_memory_limit_bytes: Option<u64>,
}

/// The kind of device a config is applied to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A whole GPU.
    Gpu,
    /// A MIG device (existing or created at prepare).
    Mig,
    /// An IMEX channel ([`gpu_inventory::imex`]).
    ImexChannel,
}

/// One allocated device of the claim, as the config resolution sees it.
#[derive(Debug, Clone, Copy)]
pub struct ConfigTarget<'a> {
    /// The allocation result's request (`<request>` or `<request>/<subrequest>`).
    pub request: &'a str,
    /// The device name.
    pub device: &'a str,
    /// Its kind.
    pub kind: DeviceKind,
    /// Its memory in bytes, to check memory limits against.
    pub memory_bytes: u64,
    /// Its GPU or MIG UUID; `None` for a MIG device created at prepare.
    pub uuid: Option<&'a str>,
}

/// A configuration that cannot be used. Every variant names the config entry
/// (`status.allocation.devices.config[<index>]`) so the claim's author can find it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The parameters are not an object of ours.
    #[error("status.allocation.devices.config[{index}] ({source_name}): {problem}")]
    Decode {
        /// Index in the allocation's config list.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_name: String,
        /// What is wrong, with the field path.
        problem: String,
    },
    /// The config does not fit the device it applies to.
    #[error(
        "status.allocation.devices.config[{index}] ({source_name}) applies to request {request:?} \
         (device {device}): {problem}"
    )]
    Mismatch {
        /// Index in the allocation's config list.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_name: String,
        /// The request.
        request: String,
        /// The device.
        device: String,
        /// What does not fit.
        problem: String,
    },
    /// GPU sharing is switched off on this node (`--sharing=false`).
    #[error(
        "status.allocation.devices.config[{index}] ({source_name}) configures {strategy:?} \
         sharing, but sharing is disabled \
         for this driver (--sharing=false)"
    )]
    SharingDisabled {
        /// Index in the allocation's config list.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_name: String,
        /// The strategy asked for.
        strategy: Strategy,
    },
    /// The MPS devices of one claim ask for different thread percentages; they share one daemon.
    #[error(
        "request {first_request} (device {first}) and request {second_request} (device \
         {second}) configure different MPS defaultActiveThreadPercentage ({first_value:?} and \
         {second_value:?}); the MPS devices of one claim share one control daemon and so one \
         percentage"
    )]
    MpsConflict {
        /// The request of the first device.
        first_request: String,
        /// One device.
        first: String,
        /// Its percentage.
        first_value: Option<u32>,
        /// The request of the second device.
        second_request: String,
        /// Another device.
        second: String,
        /// Its percentage.
        second_value: Option<u32>,
    },
    /// An IMEX channel that no `ComputeDomainChannelConfig` names the ComputeDomain of.
    #[error(
        "request {request:?} (device {device}) is an IMEX channel, but no opaque config of \
         kind {KIND_CHANNEL} applies to it: spec.devices.config[].opaque.parameters.domainID \
         must name the ComputeDomain it serves"
    )]
    ChannelWithoutDomain {
        /// The request.
        request: String,
        /// The device.
        device: String,
    },
}

/// A decoded entry: which requests it applies to and what it says.
#[derive(Debug)]
struct Entry {
    index: usize,
    source_name: String,
    requests: Vec<String>,
    kind: DeviceKind,
    sharing: Option<SharingSpec>,
    /// Written in NVIDIA's API: an entry without `requests` skips devices of another kind.
    nvidia: bool,
    /// NVIDIA's `defaultPerDevicePinnedMemoryLimit`: UUID or index -> quantity.
    per_device: std::collections::BTreeMap<String, String>,
    /// A `ComputeDomainChannelConfig`'s `domainID`, checked.
    domain_id: Option<String>,
}

/// The opaque configs of `driver` in `configs`, decoded, class configs before claim configs
/// (later wins).
fn entries(
    configs: &[DeviceAllocationConfiguration],
    driver: &str,
) -> Result<Vec<Entry>, ConfigError> {
    let mut entries = Vec::new();
    for (index, c) in configs.iter().enumerate() {
        let Some(opaque) = c.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let mut entry = decode(index, &c.source, &opaque.parameters.0)?;
        entry.requests = c.requests.clone().unwrap_or_default();
        entries.push(entry);
    }
    entries.sort_by_key(|e| e.source_name != "FromClass");
    Ok(entries)
}

/// The entry that configures `t`: the last that applies to its request (an entry in NVIDIA's
/// API without `requests` skips devices of another kind).
fn chosen<'e>(entries: &'e [Entry], t: &ConfigTarget<'_>) -> Option<&'e Entry> {
    entries.iter().rev().find(|e| {
        applies(&e.requests, t.request) && !(e.nvidia && e.requests.is_empty() && e.kind != t.kind)
    })
}

/// What the device is, and the kind that configures it, for errors.
fn kind_words(kind: DeviceKind) -> (&'static str, &'static str) {
    match kind {
        DeviceKind::Gpu => ("a whole GPU", KIND_GPU),
        DeviceKind::Mig => ("a MIG device", KIND_MIG),
        DeviceKind::ImexChannel => ("an IMEX channel", KIND_CHANNEL),
    }
}

/// The ComputeDomain UID of every IMEX channel target (all of `targets` are channels), from
/// the allocation's `configs` for `driver`.
///
/// # Errors
/// [`ConfigError`] for an entry that does not decode or whose kind does not fit the channel,
/// and [`ConfigError::ChannelWithoutDomain`] for a channel no `ComputeDomainChannelConfig`
/// applies to.
pub fn resolve_channels(
    configs: &[DeviceAllocationConfiguration],
    driver: &str,
    targets: &[ConfigTarget<'_>],
) -> Result<Vec<String>, ConfigError> {
    let entries = entries(configs, driver)?;
    targets
        .iter()
        .map(|t| {
            let missing = || ConfigError::ChannelWithoutDomain {
                request: t.request.to_owned(),
                device: t.device.to_owned(),
            };
            let e = chosen(&entries, t).ok_or_else(missing)?;
            if e.kind != DeviceKind::ImexChannel {
                let (have, want) = kind_words(t.kind);
                return Err(ConfigError::Mismatch {
                    index: e.index,
                    source_name: e.source_name.clone(),
                    request: t.request.to_owned(),
                    device: t.device.to_owned(),
                    problem: format!("the device is {have}; use kind {want}"),
                });
            }
            e.domain_id.clone().ok_or_else(missing)
        })
        .collect()
}

/// Resolves the sharing of every target from the allocation's `configs` for `driver`.
/// Returns one entry per target, in order (`None`: no sharing configured).
///
/// # Errors
/// [`ConfigError`] for the first entry that does not decode, does not fit its device, or asks
/// for sharing while `sharing_enabled` is false.
pub fn resolve(
    configs: &[DeviceAllocationConfiguration],
    driver: &str,
    sharing_enabled: bool,
    targets: &[ConfigTarget<'_>],
) -> Result<Vec<Option<Sharing>>, ConfigError> {
    // Class configs first, then claim configs, each in list order: later wins.
    let entries = entries(configs, driver)?;
    // Which entry configures each target: the last that applies to its request.
    let chosen: Vec<Option<&Entry>> = targets.iter().map(|t| chosen(&entries, t)).collect();
    let mut out = Vec::with_capacity(targets.len());
    for (t, e) in targets.iter().zip(&chosen) {
        let Some(e) = *e else {
            out.push(None);
            continue;
        };
        let mismatch = |problem: String| ConfigError::Mismatch {
            index: e.index,
            source_name: e.source_name.clone(),
            request: t.request.to_owned(),
            device: t.device.to_owned(),
            problem,
        };
        if e.kind == DeviceKind::ImexChannel && t.kind != DeviceKind::ImexChannel {
            let (have, want) = kind_words(t.kind);
            return Err(mismatch(format!(
                "kind {KIND_CHANNEL} configures IMEX channels only; the device is {have} (use \
                 kind {want}, or list the channel's request in the config's requests)"
            )));
        }
        if e.kind != t.kind {
            let (have, want) = kind_words(t.kind);
            return Err(mismatch(format!("the device is {have}; use kind {want}")));
        }
        let Some(spec) = &e.sharing else {
            out.push(None);
            continue;
        };
        if !sharing_enabled {
            return Err(ConfigError::SharingDisabled {
                index: e.index,
                source_name: e.source_name.clone(),
                strategy: spec.strategy,
            });
        }
        out.push(Some(match spec.strategy {
            Strategy::TimeSlicing => {
                if t.kind == DeviceKind::Mig {
                    return Err(mismatch(
                        "sharing.strategy TimeSlicing is not supported on MIG devices; use MPS"
                            .into(),
                    ));
                }
                Sharing::TimeSlicing {
                    interval: spec
                        .time_slicing
                        .as_ref()
                        .map(|t| t.interval)
                        .unwrap_or_default(),
                }
            }
            Strategy::Mps => {
                let decode_error = |problem| ConfigError::Decode {
                    index: e.index,
                    source_name: e.source_name.clone(),
                    problem,
                };
                let mut limits = mps_limits(spec.mps.as_ref()).map_err(decode_error)?;
                if !e.per_device.is_empty() {
                    let applies_to: Vec<Option<&str>> = targets
                        .iter()
                        .zip(&chosen)
                        .filter(|(_, c)| c.is_some_and(|c| std::ptr::eq(c, e)))
                        .map(|(t, _)| t.uuid)
                        .collect();
                    if let Some(limit) =
                        per_device_limit(&e.per_device, t.uuid, &applies_to).map_err(&mismatch)?
                    {
                        limits.pinned_memory_limit_bytes = Some(limit);
                    }
                }
                if let Some(limit) = limits.pinned_memory_limit_bytes
                    && limit > t.memory_bytes
                {
                    return Err(mismatch(format!(
                        "sharing.mps.defaultPinnedDeviceMemoryLimit is {limit} bytes, more than \
                         the device's {} bytes",
                        t.memory_bytes
                    )));
                }
                Sharing::Mps(limits)
            }
        }));
    }

    // One MPS daemon per claim: its devices must agree on the daemon-wide percentage.
    let mut first: Option<(&ConfigTarget<'_>, Option<u32>)> = None;
    for (t, s) in targets.iter().zip(&out) {
        if let Some(Sharing::Mps(l)) = s {
            match first {
                None => first = Some((t, l.active_thread_percentage)),
                Some((f, p)) if p != l.active_thread_percentage => {
                    return Err(ConfigError::MpsConflict {
                        first_request: f.request.to_owned(),
                        first: f.device.to_owned(),
                        first_value: p,
                        second_request: t.request.to_owned(),
                        second: t.device.to_owned(),
                        second_value: l.active_thread_percentage,
                    });
                }
                Some(_) => {}
            }
        }
    }
    Ok(out)
}

/// Checks one opaque configuration object (`opaque.parameters` for this driver) on its own, as
/// prepare would decode it: either API, strictly, with the value ranges prepare enforces. What
/// depends on the allocated devices (kinds against devices, limits against their memory,
/// per-device keys) is left to prepare. `dractl lint` uses it.
///
/// # Errors
/// What is wrong, naming the field (`opaque.parameters.sharing.mps...`).
pub fn check_parameters(parameters: &serde_json::Value) -> Result<(), String> {
    let problem = |e: ConfigError| match e {
        ConfigError::Decode { problem, .. } => problem,
        other => other.to_string(),
    };
    let entry = decode(0, "lint", parameters).map_err(problem)?;
    if let Some(spec) = &entry.sharing
        && spec.strategy == Strategy::Mps
    {
        mps_limits(spec.mps.as_ref())?;
    }
    Ok(())
}

fn applies(requests: &[String], request: &str) -> bool {
    requests.is_empty()
        || requests.iter().any(|r| {
            r == request
                || request
                    .strip_prefix(r.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        })
}

fn decode(
    index: usize,
    source: &str,
    parameters: &serde_json::Value,
) -> Result<Entry, ConfigError> {
    let fail = |problem: String| ConfigError::Decode {
        index,
        source_name: source.to_owned(),
        problem,
    };
    let object = parameters
        .as_object()
        .ok_or_else(|| fail("opaque.parameters must be an object".into()))?;
    let field = |name: &str| object.get(name).and_then(serde_json::Value::as_str);
    let api_version = field("apiVersion")
        .ok_or_else(|| fail("opaque.parameters.apiVersion is missing".into()))?;
    if api_version != API_VERSION && api_version != NVIDIA_API_VERSION {
        return Err(fail(format!(
            "opaque.parameters.apiVersion {api_version:?} is not supported; this driver reads \
             {API_VERSION} and NVIDIA's {NVIDIA_API_VERSION}"
        )));
    }
    let kind = field("kind").ok_or_else(|| fail("opaque.parameters.kind is missing".into()))?;
    let strict = |e: serde_path_to_error::Error<serde_json::Error>| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            fail(format!("opaque.parameters: {inner}"))
        } else {
            fail(format!("opaque.parameters.{path}: {inner}"))
        }
    };
    if kind == KIND_CHANNEL {
        let c: ComputeDomainChannelConfig =
            serde_path_to_error::deserialize(parameters).map_err(strict)?;
        let domain_id = check_channel_config(&c).map_err(fail)?;
        return Ok(Entry {
            index,
            source_name: source.to_owned(),
            requests: Vec::new(),
            kind: DeviceKind::ImexChannel,
            sharing: None,
            nvidia: api_version == NVIDIA_API_VERSION,
            per_device: Default::default(),
            domain_id: Some(domain_id),
        });
    }
    if api_version == NVIDIA_API_VERSION {
        return decode_nvidia(index, source, kind, parameters, &strict);
    }
    let (kind, sharing) = match kind {
        KIND_GPU => {
            let c: GpuConfig = serde_path_to_error::deserialize(parameters).map_err(strict)?;
            (DeviceKind::Gpu, c.sharing)
        }
        KIND_MIG => {
            let c: MigDeviceConfig =
                serde_path_to_error::deserialize(parameters).map_err(strict)?;
            (DeviceKind::Mig, c.sharing)
        }
        other => {
            return Err(fail(format!(
                "opaque.parameters.kind {other:?} is not a kind of {API_VERSION} (expected \
                 {KIND_GPU}, {KIND_MIG} or {KIND_CHANNEL})"
            )));
        }
    };
    if let Some(s) = &sharing {
        let stray = match s.strategy {
            Strategy::TimeSlicing => s.mps.is_some().then_some("mps"),
            Strategy::Mps => s.time_slicing.is_some().then_some("timeSlicing"),
        };
        if let Some(stray) = stray {
            return Err(fail(format!(
                "opaque.parameters.sharing.{stray} is set but sharing.strategy is {:?}",
                s.strategy
            )));
        }
    }
    Ok(Entry {
        index,
        source_name: source.to_owned(),
        requests: Vec::new(),
        kind,
        sharing,
        nvidia: false,
        per_device: Default::default(),
        domain_id: None,
    })
}

/// An entry written in NVIDIA's API, as our sharing (see the module docs for what differs).
fn decode_nvidia(
    index: usize,
    source: &str,
    kind: &str,
    parameters: &serde_json::Value,
    strict: &dyn Fn(serde_path_to_error::Error<serde_json::Error>) -> ConfigError,
) -> Result<Entry, ConfigError> {
    let fail = |problem: String| ConfigError::Decode {
        index,
        source_name: source.to_owned(),
        problem,
    };
    let (kind, strategy, time_slicing, mps) = match kind {
        KIND_GPU => {
            let c: NvidiaGpuConfig =
                serde_path_to_error::deserialize(parameters).map_err(strict)?;
            let s = c.sharing;
            (
                DeviceKind::Gpu,
                s.as_ref().map(|s| s.strategy),
                s.as_ref().and_then(|s| s.time_slicing_config.clone()),
                s.and_then(|s| s.mps_config),
            )
        }
        KIND_MIG => {
            let c: NvidiaMigDeviceConfig =
                serde_path_to_error::deserialize(parameters).map_err(strict)?;
            let s = c.sharing;
            (
                DeviceKind::Mig,
                s.as_ref().map(|s| s.strategy),
                None,
                s.and_then(|s| s.mps_config),
            )
        }
        other if NVIDIA_UNSUPPORTED_KINDS.contains(&other) => {
            return Err(fail(format!(
                "opaque.parameters.kind {other:?} of {NVIDIA_API_VERSION} is not implemented by \
                 this driver (it configures whole GPUs, MIG devices and IMEX channels: \
                 {KIND_GPU}, {KIND_MIG}, {KIND_CHANNEL})"
            )));
        }
        other => {
            return Err(fail(format!(
                "opaque.parameters.kind {other:?} is not a kind of {NVIDIA_API_VERSION} (expected \
                 {KIND_GPU}, {KIND_MIG} or {KIND_CHANNEL})"
            )));
        }
    };
    let Some(strategy) = strategy else {
        return Ok(Entry {
            index,
            source_name: source.to_owned(),
            requests: Vec::new(),
            kind,
            sharing: None,
            nvidia: true,
            per_device: Default::default(),
            domain_id: None,
        });
    };
    let stray = match strategy {
        Strategy::TimeSlicing => mps.is_some().then_some("mpsConfig"),
        Strategy::Mps => time_slicing.is_some().then_some("timeSlicingConfig"),
    };
    if let Some(stray) = stray {
        return Err(fail(format!(
            "opaque.parameters.sharing.{stray} is set but sharing.strategy is {strategy:?}"
        )));
    }
    let mut per_device = std::collections::BTreeMap::new();
    let mps = match mps {
        None => None,
        Some(m) => {
            let percentage = match m.default_active_thread_percentage {
                None => None,
                Some(p @ 1..=100) => Some(p as u32),
                Some(p) => {
                    return Err(fail(format!(
                        "opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage is \
                         {p}; this driver takes 1..=100 (0 would leave MPS clients no threads)"
                    )));
                }
            };
            let at_least_mib = |field: &str, text: &str| -> Result<(), ConfigError> {
                match Quantity::parse(text).ok().and_then(|q| q.as_i64()) {
                    Some(bytes) if bytes >= 1 << 20 => Ok(()),
                    _ => Err(fail(format!(
                        "opaque.parameters.sharing.mpsConfig.{field} {text:?}: a pinned memory \
                         limit must be a quantity of at least 1Mi"
                    ))),
                }
            };
            if let Some(text) = &m.default_pinned_device_memory_limit {
                at_least_mib("defaultPinnedDeviceMemoryLimit", text)?;
            }
            for (key, text) in m.default_per_device_pinned_memory_limit.iter().flatten() {
                at_least_mib(&format!("defaultPerDevicePinnedMemoryLimit[{key:?}]"), text)?;
                per_device.insert(key.clone(), text.clone());
            }
            Some(MpsSpec {
                default_active_thread_percentage: percentage,
                default_pinned_device_memory_limit: m.default_pinned_device_memory_limit,
            })
        }
    };
    Ok(Entry {
        index,
        source_name: source.to_owned(),
        requests: Vec::new(),
        kind,
        sharing: Some(SharingSpec {
            strategy,
            time_slicing: time_slicing.map(|t| TimeSlicingSpec {
                interval: t.interval,
            }),
            mps,
        }),
        nvidia: true,
        per_device,
        domain_id: None,
    })
}

/// The checked `domainID` of `c`.
fn check_channel_config(c: &ComputeDomainChannelConfig) -> Result<String, String> {
    let field = "opaque.parameters.domainID";
    let id = match c.domain_id.as_deref() {
        None | Some("") => {
            return Err(format!(
                "{field} is missing: a {KIND_CHANNEL} names the ComputeDomain (its UID) the \
                 channel serves"
            ));
        }
        Some(id) => id,
    };
    // NVIDIA's ValidateDomainID: a label value (it names files and labels).
    let label_value = id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
    if !label_value {
        return Err(format!(
            "{field} {id:?} is not a valid label value (at most 63 characters: alphanumerics, \
             '-', '_', '.', beginning and ending with an alphanumeric)"
        ));
    }
    match c.allocation_mode.as_deref() {
        None | Some("Single" | "All") => Ok(id.to_owned()),
        Some(other) => Err(format!(
            "opaque.parameters.allocationMode {other:?} is not supported: Single or All \
             (the claim gets the channels it was allocated)"
        )),
    }
}

/// NVIDIA's `defaultPerDevicePinnedMemoryLimit` for the device `uuid`: its key is the device's
/// UUID or its index among the sorted UUIDs of `applies_to` (the devices the config applies
/// to). `Ok(None)` when no key names it.
///
/// # Errors
/// A key that is neither a UUID of those devices nor an index among them, or a device the map
/// cannot name (a MIG device created at prepare has no UUID yet).
fn per_device_limit(
    limits: &std::collections::BTreeMap<String, String>,
    uuid: Option<&str>,
    applies_to: &[Option<&str>],
) -> Result<Option<u64>, String> {
    let field = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit";
    let mut sorted: Vec<&str> = applies_to.iter().flatten().copied().collect();
    sorted.sort_unstable();
    if applies_to.iter().any(Option::is_none) {
        return Err(format!(
            "{field} cannot name a MIG device created at prepare (it has no UUID until then)"
        ));
    }
    let mut found = None;
    for (key, text) in limits {
        let named = match key.parse::<usize>() {
            Ok(i) => *sorted.get(i).ok_or_else(|| {
                format!(
                    "{field} key {key:?} is not an index of the {} devices the config applies to",
                    sorted.len()
                )
            })?,
            Err(_) if sorted.contains(&key.as_str()) => key.as_str(),
            Err(_) => {
                return Err(format!(
                    "{field} key {key:?} is neither a UUID of the devices the config applies to \
                     nor an index among them"
                ));
            }
        };
        if Some(named) == uuid {
            let bytes = Quantity::parse(text)
                .ok()
                .and_then(|q| q.as_i64())
                .and_then(|b| u64::try_from(b).ok())
                .ok_or_else(|| format!("{field}[{key:?}] {text:?} is not a quantity of bytes"))?;
            found = Some(bytes);
        }
    }
    Ok(found)
}

fn mps_limits(spec: Option<&MpsSpec>) -> Result<MpsLimits, String> {
    let Some(spec) = spec else {
        return Ok(MpsLimits::default());
    };
    if let Some(p) = spec.default_active_thread_percentage
        && !(1..=100).contains(&p)
    {
        return Err(format!(
            "opaque.parameters.sharing.mps.defaultActiveThreadPercentage is {p}; it must be 1..=100"
        ));
    }
    let pinned = match &spec.default_pinned_device_memory_limit {
        None => None,
        Some(text) => {
            let field = "opaque.parameters.sharing.mps.defaultPinnedDeviceMemoryLimit";
            let q = Quantity::parse(text).map_err(|e| format!("{field} {text:?}: {e}"))?;
            let bytes = q
                .as_i64()
                .and_then(|b| u64::try_from(b).ok())
                .filter(|b| *b > 0)
                .ok_or_else(|| {
                    format!("{field} {text:?} must be a positive whole number of bytes")
                })?;
            Some(bytes)
        }
    };
    Ok(MpsLimits {
        active_thread_percentage: spec.default_active_thread_percentage,
        pinned_memory_limit_bytes: pinned,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration;
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
    use serde_json::json;

    const DRIVER: &str = "gpu.drust.dev";
    const GIB: u64 = 1 << 30;

    fn entry(
        source: &str,
        requests: &[&str],
        parameters: serde_json::Value,
    ) -> DeviceAllocationConfiguration {
        DeviceAllocationConfiguration {
            source: source.into(),
            requests: (!requests.is_empty())
                .then(|| requests.iter().map(|r| (*r).to_owned()).collect()),
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER.into(),
                parameters: RawExtension(parameters),
            }),
        }
    }

    fn gpu(request: &str) -> ConfigTarget<'_> {
        ConfigTarget {
            request,
            device: "gpu-0",
            kind: DeviceKind::Gpu,
            memory_bytes: 80 * GIB,
            uuid: Some("GPU-bbbb"),
        }
    }

    fn mig(request: &str) -> ConfigTarget<'_> {
        ConfigTarget {
            request,
            device: "gpu-0-mig-1g.10gb-0",
            kind: DeviceKind::Mig,
            memory_bytes: 10 * GIB,
            uuid: Some("MIG-aaaa"),
        }
    }

    fn nvidia(kind: &str, sharing: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": NVIDIA_API_VERSION, "kind": kind, "sharing": sharing})
    }

    fn channel(request: &str) -> ConfigTarget<'_> {
        ConfigTarget {
            request,
            device: "imex-channel-0",
            kind: DeviceKind::ImexChannel,
            memory_bytes: 0,
            uuid: None,
        }
    }

    fn domain(api_version: &str, extra: serde_json::Value) -> serde_json::Value {
        let mut v =
            json!({"apiVersion": api_version, "kind": KIND_CHANNEL, "domainID": "3f6e-uid"});
        if let (Some(o), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            for (k, x) in extra {
                if x.is_null() {
                    o.remove(k);
                } else {
                    o.insert(k.clone(), x.clone());
                }
            }
        }
        v
    }

    #[test]
    fn a_channel_gets_its_domain_from_either_api_version() {
        for api in [API_VERSION, NVIDIA_API_VERSION] {
            let configs = [entry("FromClaim", &["channel"], domain(api, json!({})))];
            assert_eq!(
                resolve_channels(&configs, DRIVER, &[channel("channel")]),
                Ok(vec!["3f6e-uid".to_owned()]),
                "{api}"
            );
            let single = [entry(
                "FromClaim",
                &[],
                domain(api, json!({"allocationMode": "Single"})),
            )];
            assert_eq!(
                resolve_channels(&single, DRIVER, &[channel("channel")]),
                Ok(vec!["3f6e-uid".to_owned()]),
                "{api}"
            );
            // What the ComputeDomain controller's template for an `All` domain carries.
            let all = [entry(
                "FromClaim",
                &[],
                domain(api, json!({"allocationMode": "All"})),
            )];
            assert_eq!(
                resolve_channels(&all, DRIVER, &[channel("channel")]),
                Ok(vec!["3f6e-uid".to_owned()]),
                "{api}"
            );
        }
    }

    #[test]
    fn bad_channel_configs_are_errors_naming_the_field() {
        let cases = [
            (
                domain(API_VERSION, json!({"domainID": null})),
                "opaque.parameters.domainID is missing",
            ),
            (
                domain(NVIDIA_API_VERSION, json!({"domainID": ""})),
                "opaque.parameters.domainID is missing",
            ),
            (
                domain(API_VERSION, json!({"domainID": "a/b"})),
                "opaque.parameters.domainID \"a/b\" is not a valid label value",
            ),
            (
                domain(API_VERSION, json!({"allocationMode": "Every"})),
                "opaque.parameters.allocationMode \"Every\" is not supported: Single or All",
            ),
            (
                domain(API_VERSION, json!({"numChannels": 2})),
                "opaque.parameters.numChannels: unknown field `numChannels`",
            ),
        ];
        for (parameters, want) in cases {
            let configs = [entry("FromClaim", &[], parameters)];
            let err = resolve_channels(&configs, DRIVER, &[channel("c")])
                .expect_err(want)
                .to_string();
            assert!(err.contains(want), "{err} should contain {want}");
        }
    }

    #[test]
    fn a_channel_without_a_domain_is_refused() {
        let err = resolve_channels(&[], DRIVER, &[channel("c")]).expect_err("no config");
        assert!(
            matches!(err, ConfigError::ChannelWithoutDomain { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("domainID"), "{err}");
        // A GPU config for the channel's request is no domain either.
        let configs = [entry(
            "FromClaim",
            &["c"],
            json!({"apiVersion": API_VERSION, "kind": KIND_GPU}),
        )];
        let err = resolve_channels(&configs, DRIVER, &[channel("c")])
            .expect_err("gpu config")
            .to_string();
        assert!(
            err.contains("the device is an IMEX channel; use kind ComputeDomainChannelConfig"),
            "{err}"
        );
    }

    #[test]
    fn a_channel_config_on_a_gpu_or_mig_device_is_refused() {
        for api in [API_VERSION, NVIDIA_API_VERSION] {
            let configs = [entry("FromClaim", &["gpu"], domain(api, json!({})))];
            for target in [gpu("gpu"), mig("gpu")] {
                let err = resolve(&configs, DRIVER, true, &[target])
                    .expect_err("channel config on a GPU")
                    .to_string();
                assert!(
                    err.contains("configures IMEX channels only"),
                    "{api}: {err}"
                );
            }
        }
        // NVIDIA's semantics: a channel config without requests skips the GPU.
        let configs = [entry(
            "FromClaim",
            &[],
            domain(NVIDIA_API_VERSION, json!({})),
        )];
        assert_eq!(
            resolve(&configs, DRIVER, true, &[gpu("gpu")]),
            Ok(vec![None])
        );
    }

    #[test]
    fn lint_accepts_a_channel_config_and_names_a_missing_domain() {
        assert_eq!(check_parameters(&domain(API_VERSION, json!({}))), Ok(()));
        let err = check_parameters(&domain(NVIDIA_API_VERSION, json!({"domainID": null})))
            .expect_err("missing");
        assert!(err.contains("domainID"), "{err}");
    }

    #[test]
    fn nvidias_api_maps_onto_the_same_sharing() {
        let configs = [entry(
            "FromClaim",
            &[],
            nvidia(
                KIND_GPU,
                json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            ),
        )];
        assert_eq!(
            resolve(&configs, DRIVER, true, &[gpu("r")]).expect("valid"),
            [Some(Sharing::TimeSlicing {
                interval: TimeSlice::Long
            })]
        );
        let configs = [entry(
            "FromClaim",
            &[],
            nvidia(
                KIND_MIG,
                json!({"strategy": "MPS", "mpsConfig": {
                    "defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "4Gi"}}),
            ),
        )];
        assert_eq!(
            resolve(&configs, DRIVER, true, &[mig("r")]).expect("valid"),
            [Some(Sharing::Mps(MpsLimits {
                active_thread_percentage: Some(50),
                pinned_memory_limit_bytes: Some(4 * GIB),
            }))]
        );
    }

    #[test]
    fn an_nvidia_config_without_requests_skips_devices_of_another_kind() {
        // NVIDIA's rule: a GpuConfig for every request leaves the MIG device to the MIG config.
        let configs = [
            entry(
                "FromClaim",
                &[],
                nvidia(KIND_MIG, json!({"strategy": "MPS"})),
            ),
            entry(
                "FromClaim",
                &[],
                nvidia(
                    KIND_GPU,
                    json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}),
                ),
            ),
        ];
        let got = resolve(&configs, DRIVER, true, &[gpu("a"), mig("b")]).expect("valid");
        assert_eq!(
            got,
            [
                Some(Sharing::TimeSlicing {
                    interval: TimeSlice::Short
                }),
                Some(Sharing::Mps(MpsLimits::default())),
            ]
        );
        // Naming the request still makes a wrong kind an error, as NVIDIA's does.
        let configs = [entry(
            "FromClaim",
            &["b"],
            nvidia(KIND_GPU, json!({"strategy": "MPS"})),
        )];
        let err = resolve(&configs, DRIVER, true, &[mig("b")]).expect_err("wrong kind");
        assert!(
            err.to_string().contains("use kind MigDeviceConfig"),
            "{err}"
        );
    }

    #[test]
    fn nvidias_per_device_limits_name_devices_by_uuid_or_sorted_index() {
        let two = |request: &'static str, uuid: &'static str| ConfigTarget {
            uuid: Some(uuid),
            ..gpu(request)
        };
        let targets = [two("r", "GPU-bbbb"), two("r", "GPU-aaaa")];
        let configs = [entry(
            "FromClaim",
            &[],
            nvidia(
                KIND_GPU,
                json!({"strategy": "MPS", "mpsConfig": {
                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                    // Index 0 of the sorted UUIDs is GPU-aaaa.
                    "defaultPerDevicePinnedMemoryLimit": {"0": "2Gi", "GPU-bbbb": "6Gi"}}}),
            ),
        )];
        let got = resolve(&configs, DRIVER, true, &targets).expect("valid");
        let pinned = |s: &Option<Sharing>| match s {
            Some(Sharing::Mps(l)) => l.pinned_memory_limit_bytes,
            _ => None,
        };
        assert_eq!(
            got.iter().map(pinned).collect::<Vec<_>>(),
            [Some(6 * GIB), Some(2 * GIB)]
        );
        let bad = |per_device: serde_json::Value, targets: &[ConfigTarget<'_>]| {
            let configs = [entry(
                "FromClaim",
                &[],
                nvidia(
                    KIND_GPU,
                    json!({"strategy": "MPS", "mpsConfig": {
                        "defaultPerDevicePinnedMemoryLimit": per_device}}),
                ),
            )];
            resolve(&configs, DRIVER, true, targets)
                .expect_err("refused")
                .to_string()
        };
        let err = bad(json!({"2": "1Gi"}), &targets);
        assert!(
            err.contains("key \"2\" is not an index of the 2 devices"),
            "{err}"
        );
        let err = bad(json!({"GPU-cccc": "1Gi"}), &targets);
        assert!(err.contains("neither a UUID"), "{err}");
        let placement = ConfigTarget {
            uuid: None,
            ..gpu("r")
        };
        let err = bad(json!({"0": "1Gi"}), &[placement]);
        assert!(err.contains("created at prepare"), "{err}");
    }

    #[test]
    fn what_drust_does_not_do_of_nvidias_api_is_an_error_naming_the_field() {
        let refused = |parameters: serde_json::Value, target: ConfigTarget<'_>| {
            let configs = [entry("FromClaim", &[], parameters)];
            resolve(&configs, DRIVER, true, &[target])
                .expect_err("refused")
                .to_string()
        };
        for (parameters, target, needle) in [
            (
                nvidia(
                    KIND_MIG,
                    json!({"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
                ),
                mig("r"),
                "sharing.timeSlicingConfig",
            ),
            (
                nvidia(KIND_MIG, json!({"strategy": "TimeSlicing"})),
                mig("r"),
                "TimeSlicing is not supported on MIG devices",
            ),
            (
                nvidia(
                    KIND_GPU,
                    json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
                ),
                gpu("r"),
                "defaultActiveThreadPercentage is 0",
            ),
            (
                nvidia(
                    KIND_GPU,
                    json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "512Ki"}}),
                ),
                gpu("r"),
                "defaultPinnedDeviceMemoryLimit \"512Ki\"",
            ),
            (
                nvidia(
                    KIND_GPU,
                    json!({"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}),
                ),
                gpu("r"),
                "sharing.timeSlicingConfig is set but sharing.strategy is Mps",
            ),
            (
                nvidia(KIND_GPU, json!({"strategy": "Exclusive"})),
                gpu("r"),
                "sharing.strategy: unknown variant `Exclusive`",
            ),
            (
                nvidia(
                    KIND_GPU,
                    json!({"strategy": "MPS", "mpsConfig": {"maxConnections": 4}}),
                ),
                gpu("r"),
                "sharing.mpsConfig.maxConnections: unknown field `maxConnections`",
            ),
            (
                json!({"apiVersion": NVIDIA_API_VERSION, "kind": "VfioDeviceConfig"}),
                gpu("r"),
                "\"VfioDeviceConfig\" of resource.nvidia.com/v1beta1 is not implemented",
            ),
        ] {
            let err = refused(parameters, target);
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    fn time_slicing(interval: &str) -> serde_json::Value {
        json!({"apiVersion": API_VERSION, "kind": KIND_GPU,
               "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}})
    }

    fn mps(kind: &str, pct: u32, limit: &str) -> serde_json::Value {
        json!({"apiVersion": API_VERSION, "kind": kind,
               "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": pct,
                                                      "defaultPinnedDeviceMemoryLimit": limit}}})
    }

    #[test]
    fn claim_config_overrides_class_config_whatever_the_list_order() {
        let configs = [
            entry("FromClaim", &[], time_slicing("Long")),
            entry("FromClass", &[], time_slicing("Short")),
        ];
        let got = resolve(&configs, DRIVER, true, &[gpu("gpu")]).expect("valid");
        assert_eq!(
            got,
            [Some(Sharing::TimeSlicing {
                interval: TimeSlice::Long
            })]
        );
    }

    #[test]
    fn a_config_applies_only_to_the_requests_it_names_and_their_subrequests() {
        let configs = [entry("FromClaim", &["a"], time_slicing("Medium"))];
        let got = resolve(
            &configs,
            DRIVER,
            true,
            &[gpu("a/h100"), gpu("b"), gpu("ab")],
        )
        .expect("valid");
        assert_eq!(
            got,
            [
                Some(Sharing::TimeSlicing {
                    interval: TimeSlice::Medium
                }),
                None,
                None
            ]
        );
    }

    /// Two requests of one claim share its one MPS daemon: different thread percentages are an
    /// error naming both requests and devices (it was silently the first request's), while
    /// pinned-memory limits are per device, each kept and checked against its own device.
    #[test]
    fn mps_requests_of_one_claim_must_agree_on_the_percentage_but_keep_their_own_limits() {
        let configs = [
            entry("FromClaim", &["a"], mps(KIND_MIG, 50, "4Gi")),
            entry("FromClaim", &["b"], mps(KIND_MIG, 30, "4Gi")),
        ];
        let err = resolve(&configs, DRIVER, true, &[mig("a"), mig("b")])
            .expect_err("one daemon, two percentages")
            .to_string();
        assert!(
            err.contains("request a (device gpu-0-mig-1g.10gb-0)")
                && err.contains("request b (device gpu-0-mig-1g.10gb-0)")
                && err.contains("Some(50) and Some(30)"),
            "{err}"
        );

        let configs = [
            entry("FromClaim", &["a"], mps(KIND_MIG, 50, "2Gi")),
            entry("FromClaim", &["b"], mps(KIND_MIG, 50, "6Gi")),
        ];
        let got = resolve(&configs, DRIVER, true, &[mig("a"), mig("b")]).expect("valid");
        let limits: Vec<Option<u64>> = got
            .iter()
            .map(|s| match s {
                Some(Sharing::Mps(l)) => l.pinned_memory_limit_bytes,
                _ => None,
            })
            .collect();
        assert_eq!(limits, [Some(2 * GIB), Some(6 * GIB)]);

        // Checked against each device: 12Gi fits no 10 GB MIG device, whatever the other says.
        let configs = [
            entry("FromClaim", &["a"], mps(KIND_MIG, 50, "2Gi")),
            entry("FromClaim", &["b"], mps(KIND_MIG, 50, "12Gi")),
        ];
        let err = resolve(&configs, DRIVER, true, &[mig("a"), mig("b")])
            .expect_err("more than the device")
            .to_string();
        assert!(err.contains("more than the device's"), "{err}");
    }

    #[test]
    fn mps_limits_are_decoded_to_bytes() {
        let configs = [entry("FromClaim", &[], mps(KIND_MIG, 50, "4Gi"))];
        let got = resolve(&configs, DRIVER, true, &[mig("r")]).expect("valid");
        assert_eq!(
            got,
            [Some(Sharing::Mps(MpsLimits {
                active_thread_percentage: Some(50),
                pinned_memory_limit_bytes: Some(4 * GIB),
            }))]
        );
    }

    #[test]
    fn configs_of_other_drivers_and_without_opaque_are_ignored() {
        let mut other = entry("FromClaim", &[], json!("not even an object"));
        other.opaque.as_mut().expect("opaque").driver = "other.example.com".into();
        let none = DeviceAllocationConfiguration {
            source: "FromClass".into(),
            requests: None,
            opaque: None,
        };
        let got = resolve(&[other, none], DRIVER, true, &[gpu("r")]).expect("valid");
        assert_eq!(got, [None]);
    }

    #[test]
    fn bad_configs_name_the_entry_and_field() {
        let cases: Vec<(serde_json::Value, ConfigTarget<'static>, &str)> = vec![
            (
                json!([1]),
                gpu("r"),
                "status.allocation.devices.config[0] (FromClaim): opaque.parameters must be an object",
            ),
            (json!({"kind": KIND_GPU}), gpu("r"), "apiVersion is missing"),
            (
                json!({"apiVersion": "gpu.drust.dev/v9", "kind": KIND_GPU}),
                gpu("r"),
                "\"gpu.drust.dev/v9\" is not supported",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": "TpuConfig"}),
                gpu("r"),
                "kind \"TpuConfig\" is not a kind",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": KIND_GPU, "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"intervall": "Long"}}}),
                gpu("r"),
                "opaque.parameters.sharing.timeSlicing.intervall: unknown field `intervall`, expected `interval`",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": KIND_GPU, "sharing": {"strategy": "Magic"}}),
                gpu("r"),
                "opaque.parameters.sharing.strategy: unknown variant `Magic`",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": KIND_GPU, "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": "half"}}}),
                gpu("r"),
                "opaque.parameters.sharing.mps.defaultActiveThreadPercentage: invalid type",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": KIND_GPU, "sharing": {"strategy": "TimeSlicing", "mps": {}}}),
                gpu("r"),
                "sharing.mps is set but sharing.strategy is TimeSlicing",
            ),
            (
                mps(KIND_GPU, 0, "1Gi"),
                gpu("r"),
                "defaultActiveThreadPercentage is 0; it must be 1..=100",
            ),
            (mps(KIND_GPU, 101, "1Gi"), gpu("r"), "must be 1..=100"),
            (
                mps(KIND_GPU, 50, "lots"),
                gpu("r"),
                "defaultPinnedDeviceMemoryLimit \"lots\"",
            ),
            (
                mps(KIND_GPU, 50, "-1Gi"),
                gpu("r"),
                "must be a positive whole number of bytes",
            ),
            (
                mps(KIND_MIG, 50, "20Gi"),
                mig("r"),
                "more than the device's 10737418240 bytes",
            ),
            (
                mps(KIND_MIG, 50, "1Gi"),
                gpu("r"),
                "the device is a whole GPU; use kind GpuConfig",
            ),
            (
                mps(KIND_GPU, 50, "1Gi"),
                mig("r"),
                "the device is a MIG device; use kind MigDeviceConfig",
            ),
            (
                json!({"apiVersion": API_VERSION, "kind": KIND_MIG, "sharing": {"strategy": "TimeSlicing"}}),
                mig("r"),
                "TimeSlicing is not supported on MIG devices",
            ),
        ];
        for (parameters, target, needle) in cases {
            let configs = [entry("FromClaim", &[], parameters.clone())];
            let err = resolve(&configs, DRIVER, true, &[target])
                .expect_err(&format!("{parameters} must fail"))
                .to_string();
            assert!(err.contains(needle), "{parameters}: {err}");
            assert!(
                err.starts_with("status.allocation.devices.config[0] (FromClaim)"),
                "{err}"
            );
        }
    }

    #[test]
    fn sharing_is_refused_when_disabled_but_a_plain_config_is_not() {
        let configs = [entry("FromClass", &[], time_slicing("Long"))];
        let err = resolve(&configs, DRIVER, false, &[gpu("r")]).expect_err("disabled");
        assert!(err.to_string().contains("sharing is disabled"), "{err}");
        let plain = [entry(
            "FromClass",
            &[],
            json!({"apiVersion": API_VERSION, "kind": KIND_GPU}),
        )];
        assert_eq!(
            resolve(&plain, DRIVER, false, &[gpu("r")]).expect("plain"),
            [None]
        );
    }

    #[test]
    fn mps_devices_of_one_claim_must_agree_on_the_thread_percentage() {
        let configs = [
            entry("FromClaim", &["a"], mps(KIND_GPU, 50, "1Gi")),
            entry("FromClaim", &["b"], mps(KIND_GPU, 30, "1Gi")),
        ];
        let mut second = gpu("b");
        second.device = "gpu-1";
        let err = resolve(&configs, DRIVER, true, &[gpu("a"), second]).expect_err("conflict");
        assert!(
            err.to_string().contains("share one control daemon"),
            "{err}"
        );
    }

    #[test]
    fn resolved_sharing_round_trips_through_the_checkpoint_form() {
        for s in [
            Sharing::TimeSlicing {
                interval: TimeSlice::Short,
            },
            Sharing::Mps(MpsLimits {
                active_thread_percentage: Some(25),
                pinned_memory_limit_bytes: None,
            }),
        ] {
            let text = serde_json::to_string(&s).expect("serialize");
            assert_eq!(
                serde_json::from_str::<Sharing>(&text).expect("parse"),
                s,
                "{text}"
            );
        }
    }
}
