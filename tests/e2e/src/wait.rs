//! Polling the API server until a condition holds.

use std::future::Future;
use std::time::{Duration, Instant};

/// A wait ran out of time.
#[derive(Debug, thiserror::Error)]
#[error("waited {waited:?} for {what}; last seen: {last}")]
pub struct WaitError {
    /// What was awaited.
    pub what: String,
    /// How long.
    pub waited: Duration,
    /// The last observation, for the failure message.
    pub last: String,
}

/// Calls `probe` every 100 ms until it returns `Ok(Some(v))`, for at most `timeout`.
/// `Ok(None)` and `Err(observation)` both mean "not yet"; the last observation goes into the
/// error.
///
/// # Errors
/// [`WaitError`] after `timeout`.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> Result<T, WaitError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, String>>,
{
    let start = Instant::now();
    let mut last = String::from("nothing yet");
    loop {
        match probe().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(observation) => last = observation,
        }
        if start.elapsed() > timeout {
            return Err(WaitError {
                what: what.to_owned(),
                waited: start.elapsed(),
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
