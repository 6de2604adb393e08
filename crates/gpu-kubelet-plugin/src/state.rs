//! The plugin's state made root-only at start: its directory, the checkpoint and its CDI specs,
//! whatever an older version or an operator left.

use std::path::Path;
use std::sync::Arc;

use crate::cdi::CdiWriter;
use crate::checkpoint;
use crate::config::Config;
use crate::error::Error;
use crate::storage::{self, Fs, RealFs};

/// Root-only state: the plugin directory (ours alone) is mode 0700, the checkpoint and our CDI
/// specs 0600, whatever an older version or an operator left. Files written later are created
/// owner-only ([`RealFs`]); the CDI directory, shared with other vendors, is only created 0700
/// when we create it.
///
/// # Errors
/// [`Error::Secure`] naming the path.
pub fn secure_state(config: &Config) -> Result<(), Error> {
    let err = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Secure { path, source }
    };
    let dir = &config.sockets.plugin_dir;
    RealFs.create_dir_all(dir).map_err(err(dir))?;
    storage::restrict_to_owner(dir).map_err(err(dir))?;
    if let Some(parent) = config.checkpoint_path.parent() {
        RealFs.create_dir_all(parent).map_err(err(parent))?;
    }
    for slot in checkpoint::slot_paths(&config.checkpoint_path) {
        storage::restrict_to_owner(&slot).map_err(err(&slot))?;
    }
    let cdi = CdiWriter::new(Arc::new(RealFs), &config.cdi_root, &config.driver_name)
        .with_legacy_claim_annotations(crate::config::LEGACY_CLAIM_ANNOTATIONS);
    if let Ok(specs) = cdi.list() {
        for (_, path) in specs {
            storage::restrict_to_owner(&path).map_err(err(&path))?;
        }
    }
    Ok(())
}
