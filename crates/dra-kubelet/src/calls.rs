//! Bookkeeping of the kubelet's DRAPlugin calls: who may watch them finish (metrics), and how
//! many are still running (so shutdown can let them finish before the process goes away).

use std::time::Duration;

use tokio::sync::watch;

/// Which DRAPlugin method the kubelet called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// `NodePrepareResources`.
    Prepare,
    /// `NodeUnprepareResources`.
    Unprepare,
}

impl Method {
    /// `prepare` or `unprepare`, as used in metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Prepare => "prepare",
            Method::Unprepare => "unprepare",
        }
    }
}

/// One finished DRAPlugin call with at least one claim (empty calls, such as liveness probes,
/// are answered without reaching the driver and are not reported).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRecord {
    /// The method.
    pub method: Method,
    /// The gRPC API version the kubelet used: `v1` or `v1beta1`.
    pub api_version: &'static str,
    /// Claims in the request (after dropping repeats).
    pub claims: usize,
    /// Claims answered with an error.
    pub failed: usize,
    /// Time from receiving the request to having the response, as measured by the server.
    pub elapsed: Duration,
}

/// Watches calls finish, e.g. to count them in metrics. Called on the request's task; keep it
/// cheap and non-blocking.
pub trait CallObserver: Send + Sync + 'static {
    /// `call` was answered.
    fn call_finished(&self, call: &CallRecord);
}

/// Counts calls in flight; shutdown waits for the count to reach zero.
#[derive(Debug, Clone)]
pub(crate) struct InFlight(watch::Sender<usize>);

impl Default for InFlight {
    fn default() -> Self {
        Self(watch::Sender::new(0))
    }
}

/// Decrements the count when the call's future completes or is dropped.
pub(crate) struct InFlightGuard(watch::Sender<usize>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl InFlight {
    /// Counts one more call until the guard is dropped.
    pub(crate) fn enter(&self) -> InFlightGuard {
        self.0.send_modify(|n| *n += 1);
        InFlightGuard(self.0.clone())
    }

    /// Calls running now.
    pub(crate) fn count(&self) -> usize {
        *self.0.borrow()
    }

    /// Completes once no call is in flight.
    pub(crate) async fn idle(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn idle_waits_for_every_guard_to_drop() {
        let calls = InFlight::default();
        let a = calls.enter();
        let b = calls.enter();
        assert_eq!(calls.count(), 2);
        drop(a);
        let idle = calls.idle();
        tokio::pin!(idle);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), &mut idle)
                .await
                .is_err(),
            "idle with a call still in flight"
        );
        drop(b);
        tokio::time::timeout(Duration::from_secs(30), idle)
            .await
            .expect("idle once the last call ended");
    }
}
