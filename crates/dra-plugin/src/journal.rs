//! The claims' journal: a driver's records as staged in memory, and the group commit that makes
//! them durable in its checkpoint file ([`crate::checkpoint`]). A driver that changes its claim
//! records only through [`Journal::update`] and [`Journal::stage`] has one writer of claim
//! state on disk. It stores the driver's [`Format::Data`] without looking into it.

use std::sync::{Arc, PoisonError};

use tokio::sync::{Mutex, MutexGuard};
use tokio_util::task::TaskTracker;

use crate::checkpoint::{CheckpointError, Format, SlotFile};

/// A poisoned lock only means a panicking thread held it; the bookkeeping is still consistent
/// because every critical section is panic-free.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// [`Journal::update`] failed: the change itself, or the store that was to make it durable.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError<E> {
    /// The change refused (nothing was staged).
    #[error(transparent)]
    Change(E),
    /// The store carrying the change failed: the change is undone in memory.
    #[error(transparent)]
    Commit(CheckpointError),
}

/// Group-commit bookkeeping: changes are numbered (epochs) as they are staged.
struct Commit<D> {
    /// Epoch of the last staged change.
    staged: u64,
    /// Every change up to this epoch is durable.
    durable: u64,
    /// The records as last stored.
    durable_state: D,
    /// A store is in flight.
    writing: bool,
    /// Epoch ranges `(after, through]` whose store failed, with the error.
    failed: Vec<(u64, u64, String)>,
}

/// The journal of one driver's claims, in format `F`.
pub struct Journal<F: Format> {
    file: SlotFile<F>,
    /// The records as staged: durable plus changes waiting for the next group commit.
    staged: Mutex<F::Data>,
    commit: std::sync::Mutex<Commit<F::Data>>,
    committed: tokio::sync::Notify,
    /// Where stores run (the controller's background work, so that quiescing waits for them).
    background: TaskTracker,
}

impl<F> Journal<F>
where
    F: Format + 'static,
    F::Data: Clone + PartialEq + Default + Send + Sync + 'static,
{
    /// An empty journal over `file`, storing on `background` (a tracker the driver waits on
    /// before it exits, so that no store is cut short by a shutdown).
    pub fn new(file: SlotFile<F>, background: TaskTracker) -> Self {
        Self {
            file,
            staged: Mutex::new(F::Data::default()),
            commit: std::sync::Mutex::new(Commit {
                staged: 0,
                durable: 0,
                durable_state: F::Data::default(),
                writing: false,
                failed: Vec::new(),
            }),
            committed: tokio::sync::Notify::new(),
            background,
        }
    }

    /// The checkpoint file.
    pub fn file(&self) -> &SlotFile<F> {
        &self.file
    }

    /// The records as staged, locked: other claims' changes wait while it is held.
    pub async fn records(&self) -> MutexGuard<'_, F::Data> {
        self.staged.lock().await
    }

    /// Starts from `loaded`, the records start-up recovery found on disk (or rebuilt), as both
    /// the staged and the durable state.
    pub async fn reset(&self, loaded: F::Data) {
        *self.staged.lock().await = loaded.clone();
        lock(&self.commit).durable_state = loaded;
    }

    /// Applies `change` to the records and returns once it is durable.
    ///
    /// Group commit: changes of concurrent claims are staged on the in-memory records; the
    /// first caller to find no write in flight starts one store of everything staged so far
    /// (one task on the blocking pool), the others wait for it. A failed store fails every change it
    /// carried (and any staged on top of them) and puts the in-memory records back to the
    /// durable ones.
    ///
    /// Cancel-safe: the store runs as its own task on the blocking pool (an fsync on a slow disk
    /// never holds an async worker), so a caller dropped while waiting leaves nothing half
    /// done: the store finishes, the next waiters are woken, and the change it staged is
    /// durable or failed like any other.
    ///
    /// # Errors
    /// [`UpdateError::Change`] when `change` fails (nothing staged), [`UpdateError::Commit`]
    /// when the store fails.
    pub async fn update<R, E>(
        self: &Arc<Self>,
        change: impl FnOnce(&mut F::Data) -> Result<R, E>,
    ) -> Result<R, UpdateError<E>> {
        let (r, epoch) = self.stage(change).await.map_err(UpdateError::Change)?;
        self.durable(epoch).await.map_err(UpdateError::Commit)?;
        Ok(r)
    }

    /// Applies `change` to the in-memory records only: it becomes durable with the next store,
    /// whoever starts it. Other claims see it at once (device conflicts). Returns the change's
    /// epoch for [`Self::durable`].
    ///
    /// # Errors
    /// What `change` returns; nothing is staged then.
    pub async fn stage<R, E>(
        &self,
        change: impl FnOnce(&mut F::Data) -> Result<R, E>,
    ) -> Result<(R, u64), E> {
        let mut pending = self.staged.lock().await;
        let mut next = pending.clone();
        let r = change(&mut next)?;
        let mut c = lock(&self.commit);
        if next != *pending {
            *pending = next;
            c.staged += 1;
        }
        // An unchanged record set still waits for what is staged before it: the caller may
        // rely on state that another claim staged.
        Ok((r, c.staged))
    }

    /// Returns once every change up to `epoch` is durable (starting the store if none is in
    /// flight), or with the error of the store that failed it.
    ///
    /// # Errors
    /// [`CheckpointError::Write`] with the failed store's message.
    pub async fn durable(self: &Arc<Self>, epoch: u64) -> Result<(), CheckpointError> {
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
                    return Err(CheckpointError::Write {
                        path: self.file.path().to_owned(),
                        source: std::io::Error::other(message),
                    });
                }
                Next::Done => return Ok(()),
                // Enabled before the check: the commit's wake-up cannot be missed.
                Next::Wait => committed.await,
            }
        }
    }

    /// One group-commit store of everything staged, as a task of its own on the blocking pool
    /// (tracked on the journal's `background`, so a driver that waits on it before exiting never
    /// cuts a store short); the caller has set `writing`. Ends with
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
