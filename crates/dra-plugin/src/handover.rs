//! The rolling-update handover: one plugin instance among the two a rolling update runs side by
//! side on a node is *active*.
//!
//! With `maxSurge` on the DaemonSet, the new pod starts while the old one still runs. Each
//! instance names its sockets after its pod UID (see [`dra_kubelet::PluginSockets`]), so the
//! kubelet registers both; it sends calls to the most recently registered connected instance
//! (the new one) and falls back to the other when one unregisters
//! (`DRAPluginManager.get`, pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, v1.36).
//!
//! Both instances share the node's state: the checkpoint, the CDI specs, the devices. Upstream's
//! helper serializes every call through a file lock and expects drivers to be stateless across
//! calls (`RollingUpdate`, k8s.io/dynamic-resource-allocation/kubeletplugin). The lifecycle
//! keeps the checkpoint in memory and runs claims concurrently, so we hand over the whole node
//! instead of single calls:
//!
//! - An exclusive `flock` on `<plugin-dir>/active.lock` ([`ActiveLock`]) makes one instance
//!   *active*. Only the active instance loads the checkpoint, prepares and unprepares claims,
//!   publishes ResourceSlices and runs periodic tasks.
//! - A new instance binds and registers its sockets at once (so the kubelet can call it), but
//!   its claim calls wait in the [`Gate`] until it holds the lock, at most [`handover_wait`].
//!   Then it loads the checkpoint (recovery) and serves them.
//! - The old instance, on SIGTERM, unregisters, lets its calls in flight finish, waits for the
//!   work they left running ([`crate::lifecycle::Lifecycle::quiesce`]) and only then
//!   releases the lock. The two never interleave checkpoint writes, and the new one never rolls
//!   back work the old one still has in flight. If the old one dies instead, the kernel
//!   releases the lock and the new one's recovery finishes or rolls back what was in flight,
//!   as after any crash.
//!
//! Readiness does not wait for the lock: the DaemonSet controller stops the old pod only once
//! the new one is ready, and the old pod releases the lock only when it stops. A readiness
//! that waited for the lock would deadlock the rollout.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use dra_kubelet::{ClaimRef, Driver, Method, PrepareResult, UnprepareResult};
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use tokio::sync::watch;

/// The lock file's name in the plugin directory.
pub const LOCK_FILE: &str = "active.lock";

/// The kubelet's deadline for one DRAPlugin call (`defaultClientCallTimeout`,
/// pkg/kubelet/cm/dra/plugin/dra_plugin.go).
pub const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// How often a standby instance tries the lock: bounds the handover gap's polling part.
pub const LOCK_POLL: Duration = Duration::from_millis(10);

/// How long a call may wait for this instance to become active, so that with the claim's own
/// deadline (`claim_timeout`) and a 5 s margin it still ends within the kubelet's 45 s; at
/// least 1 s.
pub fn handover_wait(claim_timeout: Duration) -> Duration {
    KUBELET_CALL_TIMEOUT
        .saturating_sub(claim_timeout)
        .saturating_sub(Duration::from_secs(5))
        .max(Duration::from_secs(1))
}

/// The active lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    /// The lock file could not be opened or created.
    #[error("opening the active lock {path}: {source}")]
    OpenLock {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// `flock` failed for another reason than another holder.
    #[error("locking {path}: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        source: Errno,
    },
}

/// An exclusive `flock` on the lock file: held, this instance is the active one. Released
/// when dropped, or by the kernel when the process dies.
#[derive(Debug)]
pub struct ActiveLock {
    _lock: Flock<File>,
    path: PathBuf,
}

impl ActiveLock {
    fn open(path: &Path) -> Result<File, InstanceError> {
        let err = |source| InstanceError::OpenLock {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(err)?;
        // An older file may have been created with looser permissions.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(err)?;
        Ok(file)
    }

    /// Takes the lock if no other instance holds it.
    ///
    /// # Errors
    /// [`InstanceError`] when the file cannot be opened or `flock` fails otherwise.
    pub fn try_acquire(path: &Path) -> Result<Option<Self>, InstanceError> {
        match Flock::lock(Self::open(path)?, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(Self {
                _lock: lock,
                path: path.to_owned(),
            })),
            Err((_, Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, source)) => Err(InstanceError::Lock {
                path: path.to_owned(),
                source,
            }),
        }
    }

    /// Waits for the lock, trying every `poll`. Polling (instead of a blocking `flock` on a
    /// thread) keeps the wait cancellable at shutdown.
    ///
    /// # Errors
    /// [`InstanceError`] when the file cannot be opened or `flock` fails otherwise.
    pub async fn acquire(path: &Path, poll: Duration) -> Result<Self, InstanceError> {
        loop {
            if let Some(lock) = Self::try_acquire(path)? {
                return Ok(lock);
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Where an instance is in its life, for readiness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Waiting for the active lock; another instance serves claims.
    Standby,
    /// Holding the lock, recovering the checkpoint and publishing ResourceSlices.
    TakingOver,
    /// Serving claims and keeping the ResourceSlices.
    Active,
}

/// A claim call answered by the gate itself or by the driver behind it (`E`, its error).
#[derive(Debug, thiserror::Error)]
pub enum GateError<E> {
    /// This instance did not become active in time: another one still holds the lock.
    #[error(
        "ResourceClaim {claim}: this plugin instance did not become active within {waited_ms} ms \
         (another instance holds {lock}); retry"
    )]
    NotActive {
        /// The claim.
        claim: ClaimRef,
        /// How long the call waited.
        waited_ms: u128,
        /// The lock file.
        lock: PathBuf,
    },
    /// The driver's answer.
    #[error("{0}")]
    Claim(E),
}

/// What a [`Gate`] reports after each call, e.g. to metrics.
pub trait GateObserver<T: Driver>: Send + Sync + 'static {
    /// A call of `method` was answered: by `active` (the instance was active) or by the gate
    /// (`None`); `failures` are the claims' errors.
    fn answered(
        &self,
        active: Option<&T>,
        method: Method,
        failures: &[&GateError<T::Error>],
    ) -> impl std::future::Future<Output = ()> + Send;
}

/// A [`GateObserver`] that observes nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoObserver;

impl<T: Driver + Sync> GateObserver<T> for NoObserver
where
    T::Error: Sync,
{
    async fn answered(&self, _: Option<&T>, _: Method, _: &[&GateError<T::Error>]) {}
}

/// The [`Driver`] the kubelet talks to: holds claim calls until this instance is active, then
/// passes them to the active driver `T` (a [`crate::lifecycle::Lifecycle`], or a driver's
/// wrapper of it), and tells the observer `O` how each call ended.
pub struct Gate<T, O> {
    active: watch::Receiver<Option<T>>,
    wait: Duration,
    lock: PathBuf,
    observer: O,
}

/// Each claim's answer by UID: `R` or the gate's error over the driver's `E`.
type Answers<R, E> = BTreeMap<String, Result<R, GateError<E>>>;

/// Opens the [`Gate`]: sending the driver lets calls through; dropping it makes waiting calls
/// fail at once (shutdown before becoming active).
pub type Activation<T> = watch::Sender<Option<T>>;

impl<T, O> Gate<T, O>
where
    T: Driver + Clone + Sync,
    T::Error: Sync,
    O: GateObserver<T>,
{
    /// A closed gate whose calls wait at most `wait` (see [`handover_wait`]) for the instance
    /// holding `lock` to become active, and the sender that opens it.
    pub fn new(wait: Duration, lock: PathBuf, observer: O) -> (Activation<T>, Self) {
        let (tx, rx) = watch::channel(None);
        (
            tx,
            Self {
                active: rx,
                wait,
                lock,
                observer,
            },
        )
    }

    async fn active(&self) -> Result<T, Duration> {
        let started = tokio::time::Instant::now();
        let mut rx = self.active.clone();
        match tokio::time::timeout(self.wait, rx.wait_for(Option::is_some)).await {
            Ok(Ok(c)) => c.clone().ok_or(started.elapsed()),
            _ => Err(started.elapsed()),
        }
    }

    fn not_active(
        &self,
        claims: &[ClaimRef],
        waited: Duration,
    ) -> Vec<(String, GateError<T::Error>)> {
        claims
            .iter()
            .map(|c| {
                (
                    c.uid.clone(),
                    GateError::NotActive {
                        claim: c.clone(),
                        waited_ms: waited.as_millis(),
                        lock: self.lock.clone(),
                    },
                )
            })
            .collect()
    }

    /// Runs `call` on the active driver (waiting for it at most the gate's wait), or fails
    /// every claim as not active; then tells the observer.
    async fn gated<R, Fut>(
        &self,
        method: Method,
        claims: Vec<ClaimRef>,
        call: impl FnOnce(T, Vec<ClaimRef>) -> Fut,
    ) -> Answers<R, T::Error>
    where
        Fut: std::future::Future<Output = BTreeMap<String, Result<R, T::Error>>>,
    {
        let (active, results): (Option<T>, Answers<R, T::Error>) = match self.active().await {
            Ok(active) => {
                let r = call(active.clone(), claims)
                    .await
                    .into_iter()
                    .map(|(uid, r)| (uid, r.map_err(GateError::Claim)))
                    .collect();
                (Some(active), r)
            }
            Err(waited) => (
                None,
                self.not_active(&claims, waited)
                    .into_iter()
                    .map(|(uid, e)| (uid, Err(e)))
                    .collect(),
            ),
        };
        let failures: Vec<&GateError<T::Error>> =
            results.values().filter_map(|r| r.as_ref().err()).collect();
        self.observer
            .answered(active.as_ref(), method, &failures)
            .await;
        results
    }
}

impl<T, O> Driver for Gate<T, O>
where
    T: Driver + Clone + Sync,
    T::Error: Sync,
    O: GateObserver<T>,
{
    type Error = GateError<T::Error>;

    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, PrepareResult<GateError<T::Error>>> {
        self.gated(Method::Prepare, claims, |c, claims| async move {
            c.prepare(claims).await
        })
        .await
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, UnprepareResult<GateError<T::Error>>> {
        self.gated(Method::Unprepare, claims, |c, claims| async move {
            c.unprepare(claims).await
        })
        .await
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handover_wait_leaves_room_for_the_claim_deadline_within_the_kubelets_45_s() {
        assert_eq!(
            handover_wait(Duration::from_secs(10)),
            Duration::from_secs(30)
        );
        assert_eq!(
            handover_wait(Duration::from_secs(60)),
            Duration::from_secs(1)
        );
    }

    #[tokio::test]
    async fn only_one_holder_at_a_time_and_the_next_gets_it_once_released() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        let first = ActiveLock::try_acquire(&path).unwrap().expect("free lock");
        assert!(ActiveLock::try_acquire(&path).unwrap().is_none());
        let waiter = tokio::spawn({
            let path = path.clone();
            async move { ActiveLock::acquire(&path, LOCK_POLL).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "acquired while held");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .expect("acquired after release")
            .unwrap()
            .unwrap();
        assert_eq!(second.path(), path);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_world_readable_lock_file_is_tightened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let _lock = ActiveLock::try_acquire(&path).unwrap().unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}
