//! MPS v3 namespaces: one per share of a device, each with its own socket and limits (NVIDIA's
//! MPS guide for r615 and later: "MPS v3 Interface", "MPS v3 Namespaces", "Appendix:
//! Environment Variables").
//!
//! A device's share daemon at the `kernel` level runs on v3 ([`super::Protocol::V3`]) with one
//! server, [`V3_SERVER`]. Each share gets a namespace named after its claim
//! ([`namespace_name`]) holding the share's pinned memory limit and active thread percentage.
//! What v3 gives that legacy MPS does not:
//!
//! - **Per-share limits held by the server.** A namespace's thread percentage overrides the
//!   client's own `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, and its memory limit bounds whatever the
//!   client asks (the guide's notes for v3 under each variable); legacy MPS can only hold every
//!   client of a GPU to the largest share.
//! - **A socket per share.** A client reaches the namespace whose socket it connects to,
//!   `<pipe>/<server>/<namespace>/control`. A share's containers get that directory alone as
//!   their pipe directory ([`MpsControl::namespace_edits`]): not the daemon's control socket
//!   (no tenant can quit or reconfigure the daemon) and not another share's socket.
//!
//! The namespace directory is created here before the namespace (and never removed while the
//! claim is prepared), so a daemon started again after a crash finds it where running
//! containers have it mounted. Whether the real daemon keeps a directory it finds is to be
//! confirmed on an r615 GPU (`tests/gpu/mps_enforcement.sh`); the stand-in keeps it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::{Limit, MpsControl, MpsError, off_workers, parse_mib};
use crate::cdi::ContainerEdits;

/// The one v3 server of a share daemon (a daemon serves one device).
pub const V3_SERVER: &str = "drust";

/// Prefix of the namespaces this driver creates; others are left alone.
const NAMESPACE_PREFIX: &str = "c_";

/// Hex digits of the claim UID's SHA-256 in a namespace name (64 bits).
const NAMESPACE_HASH_DIGITS: usize = 16;

/// The namespace of claim `uid`'s share: `c_` and the first 16 hex digits of the UID's
/// SHA-256 (v3 names are lowercase letters, digits and underscores, up to 64 characters). Short
/// because the daemon binds each namespace's socket at
/// `<pipe>/<server>/<namespace>/control`, and a Unix socket path has at most 107 bytes
/// ([`namespace_sockets_fit`]); hashed so that any UID names one.
pub fn namespace_name(uid: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(uid.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{NAMESPACE_PREFIX}{}", &hex[..NAMESPACE_HASH_DIGITS])
}

/// The longest path a Unix socket may have (`sun_path` holds 108 bytes with the NUL).
const SOCKET_PATH_MAX: usize = 107;

/// Whether the daemon can bind every namespace socket of share daemons under MPS root `root`:
/// the longest is `<root>/<key>/pipe/drust/<namespace>/control` (a key is `gpu-` or `mig-` and a
/// 36-character UUID) as the daemon sees it, which is `/tmp/pipe/...` in a daemon Pod
/// (`daemon_pods`) and the host path otherwise.
///
/// # Errors
/// The longest path's length, when over the limit.
pub fn namespace_sockets_fit(root: &Path, daemon_pods: bool) -> Result<(), String> {
    let pipe_len = if daemon_pods {
        "/tmp/pipe".len()
    } else {
        root.as_os_str().len() + "/gpu-".len() + 36 + "/pipe".len()
    };
    let longest = pipe_len
        + 1
        + V3_SERVER.len()
        + 1
        + NAMESPACE_PREFIX.len()
        + NAMESPACE_HASH_DIGITS
        + "/control".len();
    if longest > SOCKET_PATH_MAX {
        return Err(format!(
            "MPS v3 namespace sockets under {} would be {longest} bytes long, over the {SOCKET_PATH_MAX} \
             a Unix socket path may have: give --mps-root a shorter path (at most {} bytes) or run \
             daemons in Pods",
            root.display(),
            root.as_os_str().len() - (longest - SOCKET_PATH_MAX)
        ));
    }
    Ok(())
}

/// A namespace's limits: pinned device memory in MiB, and the active thread percentage
/// (`None`: not set, the server's 100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceLimits {
    /// Pinned device memory, MiB (at least 1).
    pub pinned_mib: u64,
    /// Active thread percentage, 1..=100.
    pub active_thread_percentage: Option<u32>,
}

impl MpsControl {
    /// `<root>/<key>/pipe/drust/<namespace>`: the socket directory of namespace `name` on daemon
    /// `key`.
    pub fn namespace_dir(&self, key: &str, name: &str) -> PathBuf {
        self.pipe_dir(key).join(V3_SERVER).join(name)
    }

    /// The CDI edits of one share's containers at v3: the namespace's socket directory as the
    /// pipe directory (nothing else of the daemon's) and the share's limits in the environment
    /// as at the legacy level ([`Self::share_edits`]; the namespace holds them whatever the
    /// environment says).
    pub fn namespace_edits(
        &self,
        key: &str,
        claim_uid: &str,
        memory_bytes: u64,
        compute_percent: u32,
    ) -> ContainerEdits {
        let dir = self.namespace_dir(key, &namespace_name(claim_uid));
        Self::share_client_edits(&dir, claim_uid, memory_bytes, compute_percent)
    }

    /// Creates server [`V3_SERVER`] (root's, allowed `devices`) on the v3 daemon of `pipe`.
    pub(super) async fn create_server(&self, pipe: &Path, devices: &str) -> Result<(), MpsError> {
        let allowed = format!("--allowed-devices={devices}");
        self.v3_command(pipe, &["server", "create", V3_SERVER, "--uid=0", &allowed])
            .await?;
        let listed = self
            .v3_command(
                pipe,
                &["server", "list", V3_SERVER, "--format=csv,noheader"],
            )
            .await?;
        if !listed
            .lines()
            .any(|l| l.split(',').next() == Some(V3_SERVER))
        {
            return Err(MpsError::LimitNotApplied {
                pipe_dir: pipe.to_owned(),
                setting: format!("server {V3_SERVER}"),
                wanted: "listed".to_owned(),
                found: listed.trim().to_owned(),
            });
        }
        Ok(())
    }

    /// Makes namespace `name` on the v3 daemon `key` exist with `limits`: its socket directory
    /// created when missing, the namespace created when the server lacks it, its limits set and
    /// read back. Idempotent.
    ///
    /// # Errors
    /// [`MpsError`] when a command fails or the limits do not read back.
    pub async fn set_namespace(
        &self,
        key: &str,
        name: &str,
        limits: NamespaceLimits,
    ) -> Result<(), MpsError> {
        let pipe = self.pipe_dir(key);
        let dir = self.namespace_dir(key, name);
        let server_dir = self.pipe_dir(key).join(V3_SERVER);
        off_workers(&dir.clone(), move || {
            for d in [&server_dir, &dir] {
                if !d.exists() {
                    std::fs::create_dir_all(d)
                        .and_then(|()| {
                            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))
                        })
                        .map_err(|source| MpsError::Dir {
                            path: d.clone(),
                            source,
                        })?;
                }
            }
            Ok(())
        })
        .await?;
        if !self.namespaces(key).await?.iter().any(|(n, _)| n == name) {
            let server = format!("--server={V3_SERVER}");
            self.v3_command(&pipe, &["namespace", "create", name, &server])
                .await?;
        }
        let server = format!("--server={V3_SERVER}");
        let pinned = format!("--pinned-memory-limit={}M", limits.pinned_mib.max(1));
        let threads = limits
            .active_thread_percentage
            .map(|p| format!("--active-thread-percentage={p}"));
        let mut set = vec!["namespace", "set", name, &server, &pinned];
        set.extend(threads.as_deref());
        self.v3_command(&pipe, &set).await?;
        // Read back: `name,server,server-status,pinned-memory-limit,active-thread-percentage,...`.
        let row = self
            .namespaces(key)
            .await?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, row)| row)
            .unwrap_or_default();
        let fields: Vec<&str> = row.split(',').collect();
        let found_pinned = fields.get(3).copied().unwrap_or_default();
        let found_threads = fields.get(4).copied().unwrap_or_default();
        let mut wanted = vec![(
            "pinned memory limit",
            Limit::MiB(limits.pinned_mib.max(1)),
            found_pinned,
        )];
        if let Some(p) = limits.active_thread_percentage {
            wanted.push((
                "active thread percentage",
                Limit::Percentage(p),
                found_threads,
            ));
        }
        for (setting, limit, found) in wanted {
            let applied = match limit {
                Limit::Percentage(p) => found.parse::<f64>().ok() == Some(f64::from(p)),
                Limit::MiB(m) => parse_mib(found) == Some(m),
            };
            if !applied {
                return Err(MpsError::LimitNotApplied {
                    pipe_dir: pipe,
                    setting: format!("namespace {name}: {setting}"),
                    wanted: limit.to_string(),
                    found: found.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Deletes namespace `name` from the v3 daemon `key` (`--force`: its clients, the claim's
    /// own, are gone or going) and removes its socket directory. Nothing to do when the daemon
    /// is confirmed dead (its namespaces went with it) or lacks the namespace.
    ///
    /// # Errors
    /// [`MpsError`] when the daemon's state cannot be told, or the command or the removal fails.
    pub async fn delete_namespace(&self, key: &str, name: &str) -> Result<(), MpsError> {
        match self.liveness(key).await {
            super::Liveness::Answering => {
                if self.namespaces(key).await?.iter().any(|(n, _)| n == name) {
                    let server = format!("--server={V3_SERVER}");
                    self.v3_command(
                        &self.pipe_dir(key),
                        &["namespace", "delete", name, &server, "--force"],
                    )
                    .await?;
                }
            }
            super::Liveness::Dead => {}
            super::Liveness::Unknown(problem) => {
                return Err(MpsError::Unresponsive {
                    pipe_dir: self.pipe_dir(key),
                    problem,
                });
            }
        }
        let dir = self.namespace_dir(key, name);
        off_workers(&dir.clone(), move || match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(MpsError::Dir {
                path: dir,
                source: e,
            }),
            _ => Ok(()),
        })
        .await
    }

    /// The namespaces this driver made on server [`V3_SERVER`] of the v3 daemon `key` (names
    /// starting `c_`), each with its `namespace list` row.
    ///
    /// # Errors
    /// [`MpsError`] when the daemon does not answer.
    pub async fn namespaces(&self, key: &str) -> Result<Vec<(String, String)>, MpsError> {
        let server = format!("--server={V3_SERVER}");
        let listed = self
            .v3_command(
                &self.pipe_dir(key),
                &["namespace", "list", &server, "--format=csv,noheader"],
            )
            .await?;
        Ok(listed
            .lines()
            .map(str::trim)
            .filter_map(|row| {
                let name = row.split(',').next()?;
                name.starts_with(NAMESPACE_PREFIX)
                    .then(|| (name.to_owned(), row.to_owned()))
            })
            .collect())
    }
}
