//! Built-in MIG GPU instance profile tables, as NVML reports them on an empty GPU.
//!
//! The NVML backend never uses these: it asks the GPU (`nvmlDeviceGetGpuInstanceProfileInfo`,
//! `nvmlDeviceGetGpuInstancePossiblePlacements_v2`). The fake backend serves them for topology
//! files that do not list `migProfiles`, and the tests check the partitionable model against
//! them.
//!
//! Values are those `nvidia-smi mig -lgip` / `-lgipp` print on each product (memory in MiB =
//! the GiB column x 1024; NVIDIA MIG User Guide, "Supported MIG Profiles"). Placements are in
//! memory slices (8 per GPU); the `1g` profiles never use slice 7, which belongs to the 7-slice
//! profile only.

use crate::backend::{MigPlacement, MigProfile};

/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE`.
pub const PROFILE_1_SLICE: u32 = 0;
/// `NVML_GPU_INSTANCE_PROFILE_2_SLICE`.
pub const PROFILE_2_SLICE: u32 = 1;
/// `NVML_GPU_INSTANCE_PROFILE_3_SLICE`.
pub const PROFILE_3_SLICE: u32 = 2;
/// `NVML_GPU_INSTANCE_PROFILE_4_SLICE`.
pub const PROFILE_4_SLICE: u32 = 3;
/// `NVML_GPU_INSTANCE_PROFILE_7_SLICE`.
pub const PROFILE_7_SLICE: u32 = 4;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1`: one slice with the media extensions (`+me`).
pub const PROFILE_1_SLICE_REV1: u32 = 7;
/// `NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1`: two slices with the media extensions (`+me`).
pub const PROFILE_2_SLICE_REV1: u32 = 8;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2`: one compute slice with two memory slices.
pub const PROFILE_1_SLICE_REV2: u32 = 9;
/// `NVML_GPU_INSTANCE_PROFILE_COUNT`: profile ids are `0..PROFILE_COUNT`.
pub const PROFILE_COUNT: u32 = 17;

/// Memory slices of every MIG-capable GPU in these tables.
pub const MEMORY_SLICES: u32 = 8;

/// The GPU instance profile ID (`nvidia-smi mig -lgip`) of each `NVML_GPU_INSTANCE_PROFILE_*`
/// in these tables: the same on the A100 40GB and 80GB and the H100 (NVIDIA MIG User Guide,
/// "Supported MIG Profiles"), and on the H200 as its NVML reported them
/// (`tests/gpu/fixtures/h200-580.159.04/probe.json`).
pub fn profile_id(profile: u32) -> u32 {
    match profile {
        PROFILE_1_SLICE => 19,
        PROFILE_2_SLICE => 14,
        PROFILE_3_SLICE => 9,
        PROFILE_4_SLICE => 5,
        PROFILE_7_SLICE => 0,
        PROFILE_1_SLICE_REV1 => 20,
        PROFILE_1_SLICE_REV2 => 15,
        // Not in these tables.
        other => 100 + other,
    }
}

/// One row of a table: (`NVML_GPU_INSTANCE_PROFILE_*`, compute slices, instances, SMs, CE, DEC, ENC, JPEG, OFA, MiB,
/// placement starts, placement size).
type Row = (
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u64,
    &'static [u32],
    u32,
);

const A100_40GB: &[Row] = &[
    (
        PROFILE_1_SLICE,
        1,
        7,
        14,
        1,
        0,
        0,
        0,
        0,
        4864,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        PROFILE_1_SLICE_REV1,
        1,
        1,
        14,
        1,
        1,
        0,
        1,
        1,
        4864,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        PROFILE_1_SLICE_REV2,
        1,
        4,
        14,
        1,
        1,
        0,
        0,
        0,
        9856,
        &[0, 2, 4, 6],
        2,
    ),
    (
        PROFILE_2_SLICE,
        2,
        3,
        28,
        2,
        1,
        0,
        0,
        0,
        9856,
        &[0, 2, 4],
        2,
    ),
    (PROFILE_3_SLICE, 3, 2, 42, 3, 2, 0, 0, 0, 19968, &[0, 4], 4),
    (PROFILE_4_SLICE, 4, 1, 56, 4, 2, 0, 0, 0, 19968, &[0], 4),
    (PROFILE_7_SLICE, 7, 1, 98, 7, 5, 0, 1, 1, 40192, &[0], 8),
];

const A100_80GB: &[Row] = &[
    (
        PROFILE_1_SLICE,
        1,
        7,
        14,
        1,
        0,
        0,
        0,
        0,
        9728,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        PROFILE_1_SLICE_REV1,
        1,
        1,
        14,
        1,
        1,
        0,
        1,
        1,
        9728,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        PROFILE_1_SLICE_REV2,
        1,
        4,
        14,
        1,
        1,
        0,
        0,
        0,
        19968,
        &[0, 2, 4, 6],
        2,
    ),
    (
        PROFILE_2_SLICE,
        2,
        3,
        28,
        2,
        1,
        0,
        0,
        0,
        19968,
        &[0, 2, 4],
        2,
    ),
    (PROFILE_3_SLICE, 3, 2, 42, 3, 2, 0, 0, 0, 40192, &[0, 4], 4),
    (PROFILE_4_SLICE, 4, 1, 56, 4, 2, 0, 0, 0, 40192, &[0], 4),
    (PROFILE_7_SLICE, 7, 1, 98, 7, 5, 0, 1, 1, 81152, &[0], 8),
];

const H100_80GB: &[Row] = &[
    (
        PROFILE_1_SLICE,
        1,
        7,
        16,
        1,
        1,
        0,
        1,
        0,
        9984,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        PROFILE_1_SLICE_REV1,
        1,
        1,
        16,
        1,
        1,
        0,
        1,
        1,
        9984,
        &[0, 1, 2, 3, 4, 5, 6],
        1,
    ),
    (
        PROFILE_1_SLICE_REV2,
        1,
        4,
        26,
        1,
        1,
        0,
        1,
        0,
        20096,
        &[0, 2, 4, 6],
        2,
    ),
    (
        PROFILE_2_SLICE,
        2,
        3,
        32,
        2,
        2,
        0,
        2,
        0,
        20096,
        &[0, 2, 4],
        2,
    ),
    (PROFILE_3_SLICE, 3, 2, 60, 3, 3, 0, 3, 0, 40448, &[0, 4], 4),
    (PROFILE_4_SLICE, 4, 1, 64, 4, 4, 0, 4, 0, 40448, &[0], 4),
    (PROFILE_7_SLICE, 7, 1, 132, 8, 7, 0, 7, 1, 81152, &[0], 8),
];

/// Products with a built-in table, by `nvmlDeviceGetName`.
const PRODUCTS: &[(&str, &[Row])] = &[
    ("NVIDIA A100-SXM4-40GB", A100_40GB),
    ("NVIDIA A100-PCIE-40GB", A100_40GB),
    ("NVIDIA A100-SXM4-80GB", A100_80GB),
    ("NVIDIA A100 80GB PCIe", A100_80GB),
    ("NVIDIA H100 80GB HBM3", H100_80GB),
];

/// The profile table of `product` (an `nvmlDeviceGetName` answer), or `None` when we have none.
pub fn builtin_profiles(product: &str) -> Option<Vec<MigProfile>> {
    let rows = PRODUCTS.iter().find(|(p, _)| *p == product)?.1;
    Some(
        rows.iter()
            .map(
                |&(profile, slices, instances, sms, ce, dec, enc, jpeg, ofa, mib, starts, size)| {
                    MigProfile {
                        id: profile_id(profile),
                        profile,
                        slice_count: slices,
                        instance_count: instances,
                        multiprocessor_count: sms,
                        copy_engine_count: ce,
                        decoder_count: dec,
                        encoder_count: enc,
                        jpeg_count: jpeg,
                        ofa_count: ofa,
                        memory_size_mib: mib,
                        placements: starts
                            .iter()
                            .map(|&start| MigPlacement { start, size })
                            .collect(),
                    }
                },
            )
            .collect(),
    )
}

/// The products with a built-in table.
pub fn builtin_products() -> impl Iterator<Item = &'static str> {
    PRODUCTS.iter().map(|(p, _)| *p)
}
