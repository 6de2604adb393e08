//! The claims' journal: their records as staged in memory, and the group commit that makes them
//! durable in the checkpoint file ([`crate::checkpoint`]). Nothing else in the claim controller
//! writes claim state to disk. GPU-agnostic: it stores [`Checkpoint`]s without looking into
//! them (the first piece of the lifecycle that issue 31's `dra-plugin` crate is to hold).

use std::sync::Arc;

use dra_kubelet::ClaimRef;
use tokio::sync::{Mutex, MutexGuard};
use tokio_util::task::TaskTracker;

use super::error::ClaimError;
use super::lock;
use crate::checkpoint::{Checkpoint, CheckpointFile};

/// Group-commit bookkeeping: changes are numbered (epochs) as they are staged.
#[derive(Default)]
struct Commit {
    /// Epoch of the last staged change.
    staged: u64,
    /// Every change up to this epoch is durable.
    durable: u64,
    /// The checkpoint as last stored.
    durable_state: Checkpoint,
    /// A store is in flight.
    writing: bool,
    /// Epoch ranges `(after, through]` whose store failed, with the error.
    failed: Vec<(u64, u64, String)>,
}

/// The journal of one claim controller.
pub(super) struct Journal {
    file: CheckpointFile,
    /// The checkpoint as staged: durable plus changes waiting for the next group commit.
    staged: Mutex<Checkpoint>,
    commit: std::sync::Mutex<Commit>,
    committed: tokio::sync::Notify,
    /// Where stores run (the controller's background work, so that quiescing waits for them).
    background: TaskTracker,
}

impl Journal {
    /// An empty journal over `file`, storing on `background`.
    pub(super) fn new(file: CheckpointFile, background: TaskTracker) -> Self {
        Self {
            file,
            staged: Mutex::new(Checkpoint::default()),
            commit: std::sync::Mutex::default(),
            committed: tokio::sync::Notify::new(),
            background,
        }
    }

    /// The checkpoint file.
    pub(super) fn file(&self) -> &CheckpointFile {
        &self.file
    }

    /// The records as staged, locked: other claims' changes wait while it is held.
    pub(super) async fn records(&self) -> MutexGuard<'_, Checkpoint> {
        self.staged.lock().await
    }

    /// Starts from `loaded`, the checkpoint start-up recovery found on disk (or rebuilt), as
    /// both the staged and the durable state.
    pub(super) async fn reset(&self, loaded: Checkpoint) {
        *self.staged.lock().await = loaded.clone();
        lock(&self.commit).durable_state = loaded;
    }

    /// Group commit: changes of concurrent claims are staged on the in-memory checkpoint; the
    /// first caller to find no write in flight starts one store of everything staged so far
    /// ([`Self::spawn_commit`]), the others wait for it. A failed store fails every change it
    /// carried (and any staged on top of them) and puts the in-memory checkpoint back to the
    /// durable one.
    ///
    /// Cancel-safe: the store runs as its own task on the blocking pool (an fsync on a slow disk
    /// never holds an async worker), so a caller dropped while waiting leaves nothing half
    /// done: the store finishes, the next waiters are woken, and the change it staged is
    /// durable or failed like any other.
    pub(super) async fn update<R>(
        self: &Arc<Self>,
        claim: &ClaimRef,
        change: impl FnOnce(&mut Checkpoint) -> Result<R, ClaimError>,
    ) -> Result<R, ClaimError> {
        let (r, epoch) = self.stage(change).await?;
        self.durable(claim, epoch).await?;
        Ok(r)
    }

    /// Applies `change` to the in-memory checkpoint only: it becomes durable with the next
    /// store, whoever starts it. Other claims see it at once (device conflicts). Returns the
    /// change's epoch for [`Self::durable`].
    pub(super) async fn stage<R>(
        &self,
        change: impl FnOnce(&mut Checkpoint) -> Result<R, ClaimError>,
    ) -> Result<(R, u64), ClaimError> {
        let mut pending = self.staged.lock().await;
        let mut next = pending.clone();
        let r = change(&mut next)?;
        let mut c = lock(&self.commit);
        if next != *pending {
            *pending = next;
            c.staged += 1;
        }
        // An unchanged checkpoint still waits for what is staged before it: the caller may
        // rely on state that another claim staged.
        Ok((r, c.staged))
    }

    /// Returns once every change up to `epoch` is durable (starting the store if none is in
    /// flight), or with the error of the store that failed it.
    pub(super) async fn durable(
        self: &Arc<Self>,
        claim: &ClaimRef,
        epoch: u64,
    ) -> Result<(), ClaimError> {
        loop {
            let committed = self.committed.notified();
            tokio::pin!(committed);
            committed.as_mut().enable();
            enum Next {
                Failed(String),
                Done,
                Wait,
            }
            let next = {
                let mut c = lock(&self.commit);
                if let Some((_, _, message)) = c
                    .failed
                    .iter()
                    .find(|(lo, hi, _)| *lo < epoch && epoch <= *hi)
                {
                    Next::Failed(message.clone())
                } else if c.durable >= epoch {
                    Next::Done
                } else {
                    if !c.writing {
                        c.writing = true;
                        self.spawn_commit();
                    }
                    Next::Wait
                }
            };
            match next {
                Next::Failed(message) => {
                    return Err(ClaimError::Checkpoint {
                        claim: claim.clone(),
                        source: crate::checkpoint::CheckpointError::Write {
                            path: self.file.path().to_owned(),
                            source: std::io::Error::other(message),
                        },
                    });
                }
                Next::Done => return Ok(()),
                // Enabled before the check: the commit's wake-up cannot be missed.
                Next::Wait => committed.await,
            }
        }
    }

    /// One group-commit store of everything staged, as a task of its own on the blocking pool
    /// (tracked, so [`super::ClaimController::quiesce`] waits for it); the caller has set `writing`. Ends with
    /// `writing` cleared and the waiters woken, whatever happens to whoever started it. One
    /// thread does it all, snapshot, store and bookkeeping: each hop between an async task and
    /// the blocking pool costs a wake-up, which on a busy node is where the latency tail comes
    /// from. Claims that stage while the thread starts go to disk with this store or the next.
    fn spawn_commit(self: &Arc<Self>) {
        let this = Arc::clone(self);
        self.background.spawn_blocking(move || {
            let inner = &*this;
            let (snapshot, target) = {
                let pending = inner.staged.blocking_lock();
                let target = lock(&inner.commit).staged;
                (pending.clone(), target)
            };
            // A panicking store fails the changes it carried, like an error.
            let stored = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                inner.file.store(&snapshot)
            }));
            let outcome = match stored {
                Ok(Ok(())) => Ok(snapshot),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("the checkpoint store panicked".to_owned()),
            };
            match outcome {
                Ok(snapshot) => {
                    let mut c = lock(&inner.commit);
                    c.durable = target;
                    c.durable_state = snapshot;
                    c.writing = false;
                }
                Err(e) => {
                    let mut pending = inner.staged.blocking_lock();
                    let mut c = lock(&inner.commit);
                    *pending = c.durable_state.clone();
                    let range = (c.durable, c.staged, e);
                    c.failed.push(range);
                    c.writing = false;
                }
            }
            inner.committed.notify_waiters();
        });
    }
}
