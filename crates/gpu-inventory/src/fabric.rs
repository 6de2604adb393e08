//! A GPU's place and health in a multi-node NVLink fabric, as NVML's fabric calls report it:
//! the answer ([`FabricInfo`]), its health mask decoded ([`FabricHealth`]), the clique it
//! publishes ([`FabricInfo::clique`]), and how an answer is obtained from whichever struct
//! version the driver accepts ([`negotiate`]).
//!
//! # The calls (nvml.h of CUDA 13.x, go-nvml v0.13.4-1 `pkg/nvml/nvml.h`)
//!
//! | call | struct | fields |
//! |---|---|---|
//! | `nvmlDeviceGetGpuFabricInfoV`, `.version` = `NVML_STRUCT_VERSION(GpuFabricInfo, 3)` | `nvmlGpuFabricInfo_v3_t` (40 bytes) | version, clusterUuid[16], status, cliqueId, state, healthMask, healthSummary |
//! | `nvmlDeviceGetGpuFabricInfoV`, version 2 | `nvmlGpuFabricInfo_v2_t` (36 bytes) | the same without healthSummary |
//! | `nvmlDeviceGetGpuFabricInfo` (deprecated in 13.0) | `nvmlGpuFabricInfo_t` | clusterUuid[16], status, cliqueId, state |
//!
//! [`negotiate`] asks for version 3, falls back to 2 where the driver answers
//! `NVML_ERROR_ARGUMENT_VERSION_MISMATCH` (25), and to the v1 call where version 2 is refused
//! too or `nvmlDeviceGetGpuFabricInfoV` is missing. `nvmlDeviceGetGpuFabricInfo_v4` (per-type
//! clique lists) is not asked: driver 580 lacks it and its legacy clique equals v3's.
//!
//! # What GPUs answer
//!
//! | GPU | answer | published |
//! |---|---|---|
//! | pre-Hopper, PCIe without NVSwitch | `NVML_ERROR_NOT_SUPPORTED` | no fabric ([`None`]) |
//! | H100 80GB HBM3 VM, driver 580.159.04 (`tests/gpu/fixtures/h100-580.159.04/fabric.json`) | Success, state NOT_SUPPORTED, zero UUID, clique 0, mask 0, summary 0, for v1, v2 and v3 | state [`FabricState::NotSupported`]: no clique |
//! | HGX H100 + NVSwitch, bare metal | COMPLETED / Success, zero cluster UUID | no clique (not a multi-node fabric) |
//! | GB200/GB300 NVL72 | COMPLETED / Success, cluster UUID, clique | `<clusterUuid>.<cliqueId>` |
//! | any, while Fabric Manager starts or waits for a partition | NOT_STARTED or IN_PROGRESS | no clique until COMPLETED |
//! | broken registration (Azure/azhpc-images PR #506) | COMPLETED, status `Insufficient Resources`, zero UUID | no clique |

use serde::{Deserialize, Serialize};

/// `NVML_SUCCESS`.
pub const NVML_SUCCESS: u32 = 0;
/// `NVML_ERROR_NOT_SUPPORTED`: the GPU has no fabric.
pub const NVML_ERROR_NOT_SUPPORTED: u32 = 3;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`: the library lacks the entry point.
pub const NVML_ERROR_FUNCTION_NOT_FOUND: u32 = 13;
/// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`: the driver does not know the struct version asked for
/// (what driver 580 answers a version tag of 9).
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: u32 = 25;

/// A GPU's answer to the fabric calls: registration state, cluster and clique, health.
///
/// In a topology file (`fabric:` of a GPU) only `state` is required:
/// `{state: completed, clusterUuid: 5b1f..., cliqueId: 32766, healthMask: 0x2aaa,
/// healthSummary: healthy}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FabricInfo {
    /// Registration state with the fabric manager (`state`).
    pub state: FabricState,
    /// The registration's result (`status`, an `nvmlReturn_t`; 0 is success). NVML: "must be
    /// checked only if state returns complete".
    #[serde(default, skip_serializing_if = "is_zero")]
    pub status: u32,
    /// The fabric's cluster UUID (16 bytes), canonical 8-4-4-4-12 lowercase hex; all zeros (or
    /// empty in a topology file) where the GPU is in no multi-node fabric.
    #[serde(default)]
    pub cluster_uuid: String,
    /// The clique (GPUs that reach each other over NVLink) within the cluster (`cliqueId`).
    #[serde(default)]
    pub clique_id: u32,
    /// `healthMask` (struct version 2 and later); `None` where only v1 answered. Decoded by
    /// [`FabricInfo::health`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_mask: Option<u32>,
    /// `healthSummary` (struct version 3); `None` where only v1 or v2 answered, or the driver
    /// gave a value this version does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_summary: Option<FabricHealthSummary>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// `nvmlGpuFabricState_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FabricState {
    /// `NVML_GPU_FABRIC_STATE_NOT_SUPPORTED` (0): the call succeeded but the GPU takes part in
    /// no fabric (an H100 VM with driver 580 answers so).
    NotSupported,
    /// `NVML_GPU_FABRIC_STATE_NOT_STARTED` (1): Fabric Manager has not begun registering it.
    NotStarted,
    /// `NVML_GPU_FABRIC_STATE_IN_PROGRESS` (2): registration under way (Fabric Manager starting,
    /// or waiting for a partition to be activated).
    InProgress,
    /// `NVML_GPU_FABRIC_STATE_COMPLETED` (3): the only state whose cluster and clique are
    /// trustworthy, and only with `status` success.
    Completed,
}

impl FabricState {
    /// NVML's value; `None` for a value this version does not know.
    pub fn from_nvml(state: u8) -> Option<Self> {
        Some(match state {
            0 => Self::NotSupported,
            1 => Self::NotStarted,
            2 => Self::InProgress,
            3 => Self::Completed,
            _ => return None,
        })
    }
}

/// `NVML_GPU_FABRIC_HEALTH_SUMMARY_*`: the driver's verdict on the GPU's fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FabricHealthSummary {
    /// 0: no verdict.
    NotSupported,
    /// 1.
    Healthy,
    /// 2: the fabric cannot be relied on.
    Unhealthy,
    /// 3: the fabric works with less than its full capacity (paths down, bandwidth degraded).
    LimitedCapacity,
}

impl FabricHealthSummary {
    /// NVML's value; `None` for a value this version does not know.
    pub fn from_nvml(summary: u8) -> Option<Self> {
        Some(match summary {
            0 => Self::NotSupported,
            1 => Self::Healthy,
            2 => Self::Unhealthy,
            3 => Self::LimitedCapacity,
            _ => return None,
        })
    }
}

/// `NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_*` other than NOT_SUPPORTED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncorrectConfiguration {
    /// 1: the configuration is correct.
    None,
    /// 2: wrong system GUID.
    SysGuid,
    /// 3: wrong chassis serial number.
    ChassisSerialNumber,
    /// 4: no partition (deprecated by the driver in favour of `partitionAssigned`).
    NoPartition,
    /// 5: too few NVLinks trained.
    InsufficientNvlinks,
    /// 6: GPU firmware incompatible with the fabric.
    IncompatibleGpuFirmware,
    /// 7: the GPU is in a location the fabric does not expect.
    InvalidLocation,
    /// 8: the GPU's state is invalid for the fabric.
    GpuStateInvalid,
    /// A value this version does not know (9 to 15).
    Other(u8),
}

/// The health mask decoded (`NVML_GPU_FABRIC_HEALTH_GET`): each 2-bit field is 0 not supported
/// (`None`), 1 true, 2 false; 3 is undefined and read as not supported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FabricHealth {
    /// Bits 0-1: NVLink bandwidth is degraded.
    pub degraded_bandwidth: Option<bool>,
    /// Bits 2-3: the fabric is recovering a route.
    pub route_recovery: Option<bool>,
    /// Bits 4-5: a route is unhealthy.
    pub route_unhealthy: Option<bool>,
    /// Bits 6-7: the fabric is recovering from an access timeout.
    pub access_timeout_recovery: Option<bool>,
    /// Bits 8-11; `None`: not supported.
    pub incorrect_configuration: Option<IncorrectConfiguration>,
    /// Bits 12-13: the GPU is in an assigned fabric partition.
    pub partition_assigned: Option<bool>,
    /// Bits 14-15: the global fabric manager is connected.
    pub global_fabric_manager_connected: Option<bool>,
}

impl FabricHealth {
    /// Decodes `healthMask`.
    pub fn from_mask(mask: u32) -> Self {
        let flag = |shift: u32| match (mask >> shift) & 0x3 {
            1 => Some(true),
            2 => Some(false),
            _ => None,
        };
        let incorrect = match (mask >> 8) & 0xf {
            0 => None,
            1 => Some(IncorrectConfiguration::None),
            2 => Some(IncorrectConfiguration::SysGuid),
            3 => Some(IncorrectConfiguration::ChassisSerialNumber),
            4 => Some(IncorrectConfiguration::NoPartition),
            5 => Some(IncorrectConfiguration::InsufficientNvlinks),
            6 => Some(IncorrectConfiguration::IncompatibleGpuFirmware),
            7 => Some(IncorrectConfiguration::InvalidLocation),
            8 => Some(IncorrectConfiguration::GpuStateInvalid),
            // Four bits: fits a u8.
            n => Some(IncorrectConfiguration::Other(n as u8)),
        };
        Self {
            degraded_bandwidth: flag(0),
            route_recovery: flag(2),
            route_unhealthy: flag(4),
            access_timeout_recovery: flag(6),
            incorrect_configuration: incorrect,
            partition_assigned: flag(12),
            global_fabric_manager_connected: flag(14),
        }
    }
}

impl FabricInfo {
    /// `<clusterUuid>.<cliqueId>` when registration completed with success and the cluster UUID
    /// is not all zeros (an NVSwitch system that is no multi-node fabric reports zeros; NVIDIA's
    /// driver treats them as "no clique" too, `nvlib.go` `getCliqueIDStrict`). The clique ID
    /// alone is not unique across clusters (NVIDIA/nccl #1301).
    pub fn clique(&self) -> Option<String> {
        (self.state == FabricState::Completed && self.status == NVML_SUCCESS && !self.zero_uuid())
            .then(|| format!("{}.{}", self.cluster_uuid, self.clique_id))
    }

    /// Whether the cluster UUID is all zeros (or empty).
    pub fn zero_uuid(&self) -> bool {
        self.cluster_uuid.trim_matches(['0', '-']).is_empty()
    }

    /// Whether registration is still to come: NOT_STARTED or IN_PROGRESS.
    pub fn pending(&self) -> bool {
        matches!(
            self.state,
            FabricState::NotStarted | FabricState::InProgress
        )
    }

    /// The decoded health mask; `None` where only v1 answered.
    pub fn health(&self) -> Option<FabricHealth> {
        self.health_mask.map(FabricHealth::from_mask)
    }
}

/// One GPU's fabric answer as a whole: the information, or why the call failed. What
/// [`crate::GpuBackend::fabric`] returns and what a watcher compares.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FabricAnswer {
    /// The answer; `None` where the GPU has no fabric (`NVML_ERROR_NOT_SUPPORTED`, or no entry
    /// point) or the call failed.
    pub info: Option<FabricInfo>,
    /// Why the call failed (an error other than NOT_SUPPORTED, or an answer this version
    /// cannot read).
    pub error: Option<String>,
}

impl FabricAnswer {
    /// The answer of [`negotiate`].
    pub fn of(result: Result<Option<FabricInfo>, FabricQueryError>) -> Self {
        match result {
            Ok(info) => Self { info, error: None },
            Err(e) => Self {
                info: None,
                error: Some(e.to_string()),
            },
        }
    }
}

/// A fabric struct as the driver filled it, whichever version: the fields a version lacks are
/// `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawFabricAnswer {
    /// `clusterUuid`.
    pub cluster_uuid: [u8; 16],
    /// `status`.
    pub status: u32,
    /// `cliqueId`.
    pub clique_id: u32,
    /// `state`.
    pub state: u8,
    /// `healthMask` (v2, v3).
    pub health_mask: Option<u32>,
    /// `healthSummary` (v3).
    pub health_summary: Option<u8>,
}

/// A fabric call failed, or answered what this version cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FabricQueryError {
    /// The call returned an error other than NOT_SUPPORTED.
    #[error("{call} failed: {}", nvml_return_name(*.code))]
    Failed {
        /// The call and struct version.
        call: &'static str,
        /// Its `nvmlReturn_t`.
        code: u32,
    },
    /// The call succeeded with a registration state this version does not know.
    #[error("{call} answered registration state {state}, which this version does not know")]
    UnknownState {
        /// The call and struct version.
        call: &'static str,
        /// The state.
        state: u8,
    },
}

/// The calls [`negotiate`] makes, by struct version (3, 2, 1).
pub fn call_name(version: u8) -> &'static str {
    match version {
        3 => "nvmlDeviceGetGpuFabricInfoV (v3)",
        2 => "nvmlDeviceGetGpuFabricInfoV (v2)",
        _ => "nvmlDeviceGetGpuFabricInfo",
    }
}

/// Asks `ask` for struct version 3, then 2, then the v1 call, and reads the first answer.
/// `ask(version)` makes the call and returns its `nvmlReturn_t` and the struct, or `None` when
/// the library has no entry point for it.
///
/// - Success: the answer, read ([`FabricInfo`]; a summary value this version does not know is
///   left out, an unknown state is [`FabricQueryError::UnknownState`]).
/// - `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`, or no entry point: the next version.
/// - `NVML_ERROR_NOT_SUPPORTED` or `NVML_ERROR_FUNCTION_NOT_FOUND`, or no version left: `None`,
///   the GPU has no fabric.
///
/// # Errors
/// [`FabricQueryError`] for any other error, or an answer this version cannot read.
pub fn negotiate(
    mut ask: impl FnMut(u8) -> Option<(u32, RawFabricAnswer)>,
) -> Result<Option<FabricInfo>, FabricQueryError> {
    for version in [3, 2, 1] {
        let call = call_name(version);
        match ask(version) {
            None => {}
            Some((NVML_SUCCESS, raw)) => return read(call, &raw).map(Some),
            Some((NVML_ERROR_ARGUMENT_VERSION_MISMATCH, _)) => {}
            Some((NVML_ERROR_NOT_SUPPORTED | NVML_ERROR_FUNCTION_NOT_FOUND, _)) => {
                return Ok(None);
            }
            Some((code, _)) => return Err(FabricQueryError::Failed { call, code }),
        }
    }
    Ok(None)
}

fn read(call: &'static str, raw: &RawFabricAnswer) -> Result<FabricInfo, FabricQueryError> {
    let state = FabricState::from_nvml(raw.state).ok_or(FabricQueryError::UnknownState {
        call,
        state: raw.state,
    })?;
    Ok(FabricInfo {
        state,
        status: raw.status,
        cluster_uuid: uuid_string(&raw.cluster_uuid),
        clique_id: raw.clique_id,
        health_mask: raw.health_mask,
        health_summary: raw.health_summary.and_then(FabricHealthSummary::from_nvml),
    })
}

/// 16 bytes as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_string(b: &[u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// An `nvmlReturn_t` as NVML's `nvmlErrorString` spells the ones the fabric calls give, with
/// its number (`Insufficient Resources (23)`).
pub fn nvml_return_name(code: u32) -> String {
    let name = match code {
        0 => "Success",
        1 => "Uninitialized",
        2 => "Invalid Argument",
        3 => "Not Supported",
        4 => "Insufficient Permissions",
        6 => "Not Found",
        13 => "Function Not Found",
        15 => "GPU is lost",
        17 => "Driver Not Loaded",
        23 => "Insufficient Resources",
        25 => "Argument version mismatch",
        27 => "System not ready",
        999 => "Unknown Error",
        _ => return format!("NVML error {code}"),
    };
    format!("{name} ({code})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fabric_cluster_uuids_are_canonical() {
        let b = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0, 1, 2, 3, 4, 5, 6, 7,
        ];
        assert_eq!(uuid_string(&b), "12345678-9abc-def0-0001-020304050607");
    }

    #[test]
    fn every_health_mask_field_decodes_at_its_shift() {
        let none = FabricHealth::from_mask(0);
        assert_eq!(
            none,
            FabricHealth {
                degraded_bandwidth: None,
                route_recovery: None,
                route_unhealthy: None,
                access_timeout_recovery: None,
                incorrect_configuration: None,
                partition_assigned: None,
                global_fabric_manager_connected: None,
            }
        );
        // Everything reported and fine: four "false" flags (0xaa), configuration NONE, partition
        // assigned, GFM connected.
        let fine = FabricHealth::from_mask(0xaa | (1 << 8) | (1 << 12) | (1 << 14));
        assert_eq!(
            fine,
            FabricHealth {
                degraded_bandwidth: Some(false),
                route_recovery: Some(false),
                route_unhealthy: Some(false),
                access_timeout_recovery: Some(false),
                incorrect_configuration: Some(IncorrectConfiguration::None),
                partition_assigned: Some(true),
                global_fabric_manager_connected: Some(true),
            }
        );
        for (mask, want) in [
            (1 << 0, "degraded"),
            (1 << 2, "recovery"),
            (1 << 4, "unhealthy"),
            (1 << 6, "timeout"),
            (2 << 12, "unassigned"),
            (2 << 14, "gfm"),
        ] {
            let h = FabricHealth::from_mask(mask);
            let got = match () {
                () if h.degraded_bandwidth == Some(true) => "degraded",
                () if h.route_recovery == Some(true) => "recovery",
                () if h.route_unhealthy == Some(true) => "unhealthy",
                () if h.access_timeout_recovery == Some(true) => "timeout",
                () if h.partition_assigned == Some(false) => "unassigned",
                () if h.global_fabric_manager_connected == Some(false) => "gfm",
                () => "nothing",
            };
            assert_eq!(got, want, "{mask:#x}");
        }
        for (value, want) in [
            (2, IncorrectConfiguration::SysGuid),
            (3, IncorrectConfiguration::ChassisSerialNumber),
            (4, IncorrectConfiguration::NoPartition),
            (5, IncorrectConfiguration::InsufficientNvlinks),
            (6, IncorrectConfiguration::IncompatibleGpuFirmware),
            (7, IncorrectConfiguration::InvalidLocation),
            (8, IncorrectConfiguration::GpuStateInvalid),
            (15, IncorrectConfiguration::Other(15)),
        ] {
            assert_eq!(
                FabricHealth::from_mask(value << 8).incorrect_configuration,
                Some(want)
            );
        }
        // The undefined value 3 of a 2-bit field reads as not supported.
        assert_eq!(FabricHealth::from_mask(3).degraded_bandwidth, None);
    }

    fn info(state: FabricState, status: u32, uuid: &str) -> FabricInfo {
        FabricInfo {
            state,
            status,
            cluster_uuid: uuid.into(),
            clique_id: 7,
            health_mask: None,
            health_summary: None,
        }
    }

    #[test]
    fn only_a_successful_registration_in_a_real_cluster_has_a_clique() {
        let uuid = "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94";
        let zero = "00000000-0000-0000-0000-000000000000";
        for (state, status, cluster, want) in [
            (FabricState::Completed, 0, uuid, Some(format!("{uuid}.7"))),
            (FabricState::Completed, 0, zero, None),
            (FabricState::Completed, 0, "", None),
            (FabricState::Completed, 23, uuid, None),
            (FabricState::InProgress, 0, uuid, None),
            (FabricState::NotStarted, 0, uuid, None),
            (FabricState::NotSupported, 0, uuid, None),
        ] {
            assert_eq!(
                info(state, status, cluster).clique(),
                want,
                "{state:?} {status} {cluster}"
            );
        }
    }

    /// A driver for [`negotiate`]: the answer of each struct version (`None`: no entry point).
    fn driver(
        v3: Option<u32>,
        v2: Option<u32>,
        v1: Option<u32>,
        raw: RawFabricAnswer,
    ) -> impl FnMut(u8) -> Option<(u32, RawFabricAnswer)> {
        move |version| {
            let rc = match version {
                3 => v3,
                2 => v2,
                _ => v1,
            }?;
            let mut answer = raw;
            if version < 3 {
                answer.health_summary = None;
            }
            if version < 2 {
                answer.health_mask = None;
            }
            Some((rc, answer))
        }
    }

    #[test]
    fn the_newest_struct_the_driver_accepts_answers_and_nothing_crashes() {
        let gb200 = RawFabricAnswer {
            cluster_uuid: [0x5b; 16],
            status: 0,
            clique_id: 32766,
            state: 3,
            health_mask: Some(0x1aaa),
            health_summary: Some(1),
        };
        let clique = "5b5b5b5b-5b5b-5b5b-5b5b-5b5b5b5b5b5b.32766";
        const MISMATCH: u32 = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        /// The v3, v2 and v1 return codes (`None`: no entry point), and what is read: whether
        /// the mask and the summary are there, no fabric, or an error containing the text.
        type Case = (
            Option<u32>,
            Option<u32>,
            Option<u32>,
            Result<Option<(bool, bool)>, &'static str>,
        );
        // (v3, v2, v1 answers, the expected result: clique, mask present, summary present).
        let cases: [Case; 9] = [
            // v3 answers.
            (Some(0), Some(0), Some(0), Ok(Some((true, true)))),
            // A driver that knows v2 only.
            (Some(MISMATCH), Some(0), Some(0), Ok(Some((true, false)))),
            // A driver that knows neither: the v1 call.
            (
                Some(MISMATCH),
                Some(MISMATCH),
                Some(0),
                Ok(Some((false, false))),
            ),
            // A library without nvmlDeviceGetGpuFabricInfoV.
            (None, None, Some(0), Ok(Some((false, false)))),
            // No fabric at all.
            (Some(3), Some(0), Some(0), Ok(None)),
            (None, None, None, Ok(None)),
            (Some(MISMATCH), Some(MISMATCH), None, Ok(None)),
            // Any other error is reported, naming the call.
            (
                Some(999),
                Some(0),
                Some(0),
                Err("(v3) failed: Unknown Error (999)"),
            ),
            (
                Some(MISMATCH),
                Some(15),
                Some(0),
                Err("(v2) failed: GPU is lost (15)"),
            ),
        ];
        for (v3, v2, v1, want) in cases {
            let got = negotiate(driver(v3, v2, v1, gb200));
            match (got, want) {
                (Ok(Some(info)), Ok(Some((mask, summary)))) => {
                    assert_eq!(info.clique().as_deref(), Some(clique));
                    assert_eq!(info.health_mask.is_some(), mask, "{v3:?} {v2:?} {v1:?}");
                    assert_eq!(
                        info.health_summary.is_some(),
                        summary,
                        "{v3:?} {v2:?} {v1:?}"
                    );
                }
                (Ok(None), Ok(None)) => {}
                (Err(e), Err(needle)) => {
                    assert!(e.to_string().contains(needle), "{e}");
                }
                (got, want) => panic!("{v3:?} {v2:?} {v1:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn answers_this_version_does_not_know_are_errors_or_left_out_never_a_panic() {
        let mut raw = RawFabricAnswer {
            state: 9,
            ..Default::default()
        };
        let err = negotiate(driver(Some(0), None, None, raw)).expect_err("unknown state");
        assert_eq!(
            err,
            FabricQueryError::UnknownState {
                call: "nvmlDeviceGetGpuFabricInfoV (v3)",
                state: 9
            }
        );
        raw.state = 3;
        raw.health_summary = Some(200);
        raw.health_mask = Some(u32::MAX);
        let info = negotiate(driver(Some(0), None, None, raw))
            .expect("read")
            .expect("an answer");
        assert_eq!(info.health_summary, None);
        let health = info.health().expect("a mask");
        assert_eq!(
            health.incorrect_configuration,
            Some(IncorrectConfiguration::Other(15))
        );
        assert_eq!(health.degraded_bandwidth, None);
        assert_eq!(
            FabricAnswer::of(Err(err)).error.as_deref(),
            Some(
                "nvmlDeviceGetGpuFabricInfoV (v3) answered registration state 9, which this \
                 version does not know"
            )
        );
    }

    #[test]
    fn topology_files_may_give_the_state_alone_or_every_field() {
        let short: FabricInfo = serde_yaml_ng::from_str("{state: inProgress}").expect("short");
        assert_eq!(short.state, FabricState::InProgress);
        assert!(short.zero_uuid() && short.clique().is_none() && short.pending());
        let full: FabricInfo = serde_yaml_ng::from_str(
            "{state: completed, status: 0, clusterUuid: 5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94, \
             cliqueId: 1, healthMask: 0x1aaa, healthSummary: limitedCapacity}",
        )
        .expect("full");
        assert_eq!(full.health_mask, Some(0x1aaa));
        assert_eq!(
            full.health_summary,
            Some(FabricHealthSummary::LimitedCapacity)
        );
        let err = serde_yaml_ng::from_str::<FabricInfo>("{state: completed, colour: 1}")
            .expect_err("unknown field");
        assert!(err.to_string().contains("colour"), "{err}");
    }
}
