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

use dra_cel::libs::quantity::Quantity;
use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde::{Deserialize, Serialize};

/// The API version of every configuration object this driver reads.
pub const API_VERSION: &str = "gpu.drust.dev/v1alpha1";
/// Kind configuring whole GPUs.
pub const KIND_GPU: &str = "GpuConfig";
/// Kind configuring MIG devices.
pub const KIND_MIG: &str = "MigDeviceConfig";

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
}

/// A decoded entry: which requests it applies to and what it says.
#[derive(Debug)]
struct Entry {
    index: usize,
    source_name: String,
    requests: Vec<String>,
    kind: DeviceKind,
    sharing: Option<SharingSpec>,
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
    let mut entries = Vec::new();
    for (index, c) in configs.iter().enumerate() {
        let Some(opaque) = c.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let mut entry = decode(index, &c.source, &opaque.parameters.0)?;
        entry.requests = c.requests.clone().unwrap_or_default();
        entries.push(entry);
    }
    // Class configs first, then claim configs, each in list order: later wins.
    entries.sort_by_key(|e| e.source_name != "FromClass");

    let mut out = Vec::with_capacity(targets.len());
    for t in targets {
        let Some(e) = entries
            .iter()
            .rev()
            .find(|e| applies(&e.requests, t.request))
        else {
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
        if e.kind != t.kind {
            let (have, want) = match t.kind {
                DeviceKind::Gpu => ("a whole GPU", KIND_GPU),
                DeviceKind::Mig => ("a MIG device", KIND_MIG),
            };
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
                let limits =
                    mps_limits(spec.mps.as_ref()).map_err(|problem| ConfigError::Decode {
                        index: e.index,
                        source_name: e.source_name.clone(),
                        problem,
                    })?;
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
    if api_version != API_VERSION {
        return Err(fail(format!(
            "opaque.parameters.apiVersion {api_version:?} is not supported; this driver reads \
             {API_VERSION}"
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
                 {KIND_GPU} or {KIND_MIG})"
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
    })
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
        }
    }

    fn mig(request: &str) -> ConfigTarget<'_> {
        ConfigTarget {
            request,
            device: "gpu-0-mig-1g.10gb-0",
            kind: DeviceKind::Mig,
            memory_bytes: 10 * GIB,
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
