//! `--dry-run`: the ResourceSlices this node would publish, written out instead of published,
//! and with `--dump-topology` the discovery's answers as a fake topology file.

use std::io::Write;

use gpu_inventory::slices::pool_slices;
use gpu_inventory::{GpuBackend, Inventory, Pool};

use crate::config::{Config, OutputFormat};
use crate::error::Error;

/// Writes the ResourceSlices `config` would publish (generation 1) to `out`.
///
/// # Errors
/// [`Error::Output`] when serialization or the write fails.
pub fn write_dry_run(
    config: &Config,
    pool: &Pool,
    format: OutputFormat,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let slices = pool_slices(&config.driver_name, &config.node_name, 1, pool);
    let text = match format {
        OutputFormat::Json => serde_json::to_string_pretty(&slices)
            .map(|s| s + "\n")
            .map_err(|e| Error::Output(e.to_string()))?,
        OutputFormat::Yaml => {
            let mut text = String::new();
            for s in &slices {
                text.push_str("---\n");
                text.push_str(&gpu_inventory::yaml::to_string(s).map_err(Error::Output)?);
            }
            text
        }
    };
    out.write_all(text.as_bytes())
        .map_err(|e| Error::Output(e.to_string()))
}

/// The dry run: writes `config.dump_topology` (when set) from `backend` and `inventory`, then
/// `pool`'s ResourceSlices to stdout in `format`.
///
/// # Errors
/// [`Error::Backend`] when the backend cannot describe the system, [`Error::Output`] when a
/// write fails.
pub(crate) fn print(
    config: &Config,
    backend: &dyn GpuBackend,
    inventory: &Inventory,
    pool: &Pool,
    format: OutputFormat,
) -> Result<(), Error> {
    if let Some(path) = &config.dump_topology {
        // The answers the pool was made from, in the same process (NVML's UUIDs and state
        // are those of this discovery).
        let topology = gpu_inventory::Topology {
            system: backend.system()?,
            gpus: inventory.gpus.iter().map(|g| g.raw.clone()).collect(),
        };
        let text = gpu_inventory::yaml::to_string(&topology).map_err(Error::Output)?;
        std::fs::write(path, text)
            .map_err(|e| Error::Output(format!("{}: {e}", path.display())))?;
    }
    write_dry_run(config, pool, format, &mut std::io::stdout().lock())
}
