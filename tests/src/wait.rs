//! The one poller of the tests: [`eventually`] waits for a state to be
//! reached (never for time to pass) and names what it awaited when it gives
//! up.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`eventually`] polls.
pub const POLL: Duration = Duration::from_millis(100);

/// What a poll returns: done with a value, or not yet (with what was seen,
/// for the panic message).
pub trait Attempt {
    /// The value handed back once the awaited state is reached.
    type Output;
    /// `Ok(value)` once done, else `Err(what was seen)`.
    fn outcome(self) -> Result<Self::Output, String>;
}

impl<T> Attempt for Option<T> {
    type Output = T;
    fn outcome(self) -> Result<T, String> {
        self.ok_or_else(|| "not yet".to_string())
    }
}

impl Attempt for bool {
    type Output = ();
    fn outcome(self) -> Result<(), String> {
        if self { Ok(()) } else { Err("false".into()) }
    }
}

impl<T, E: Debug> Attempt for Result<T, E> {
    type Output = T;
    fn outcome(self) -> Result<T, String> {
        self.map_err(|e| format!("{e:?}"))
    }
}

/// Polls `f` every [`POLL`] until it reports done (`Some`, `true`, `Ok`) and
/// returns its value; panics after `deadline` naming `what` and the last
/// thing seen. The deadline is generous on purpose: a loaded 2-core machine
/// may take seconds for what a quiet one does in milliseconds.
pub async fn eventually<A, F, Fut>(what: &str, deadline: Duration, mut f: F) -> A::Output
where
    A: Attempt,
    F: FnMut() -> Fut,
    Fut: Future<Output = A>,
{
    let start = Instant::now();
    loop {
        match f().await.outcome() {
            Ok(v) => return v,
            Err(last) => {
                assert!(
                    start.elapsed() < deadline,
                    "timed out after {deadline:?} waiting for {what}; last seen: {last}"
                );
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for blocking (non-async) tests: polls `f` from the calling
/// thread.
pub fn eventually_blocking<A: Attempt>(
    what: &str,
    deadline: Duration,
    mut f: impl FnMut() -> A,
) -> A::Output {
    let start = Instant::now();
    loop {
        match f().outcome() {
            Ok(v) => return v,
            Err(last) => {
                assert!(
                    start.elapsed() < deadline,
                    "timed out after {deadline:?} waiting for {what}; last seen: {last}"
                );
            }
        }
        std::thread::sleep(POLL);
    }
}

/// Waits (blocking) until the file at `path` contains `needle`: a process's
/// "ready" line in its log. Returns the file's text.
pub fn file_contains(path: &std::path::Path, needle: &str, deadline: Duration) -> String {
    eventually_blocking(
        &format!("{needle:?} in {}", path.display()),
        deadline,
        || {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if text.contains(needle) {
                Ok(text)
            } else {
                Err(text)
            }
        },
    )
}

/// dhcrelay's last start-up line (ISC dhcrelay 4.4, `-d`): its interfaces
/// and fallback socket are open.
pub const DHCRELAY_READY: &str = "Sending on   Socket/fallback";
