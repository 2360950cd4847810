//! The stdout protocol of `ingest` and `store`: one JSON object per line
//! (`progress` events while working, one final `result` or `error`);
//! logs go to stderr.

use std::io::Write as _;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// A failure as the protocol reports it: a fixed reason and a one-line
/// message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The reason (a fixed variant name, e.g. `ChecksumMismatch`).
    pub reason: &'static str,
    /// One line naming the URL, name or numbers involved.
    pub message: String,
}

impl Failure {
    /// A failure with `reason` and `message` (made one line).
    pub fn new(reason: &'static str, message: impl Into<String>) -> Self {
        let m: String = message.into();
        Self {
            reason,
            message: m.replace(['\n', '\r'], " "),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

/// An error and its causes as one line: `outer: inner: innermost`.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Serialised writer of protocol lines on stdout.
#[derive(Debug, Clone, Default)]
pub struct Out {
    lock: Arc<Mutex<()>>,
}

impl Out {
    /// A writer on stdout.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes one line (a write error is logged: stdout is gone).
    pub fn line(&self, v: &serde_json::Value) {
        let _g = self.lock.lock();
        let mut so = std::io::stdout().lock();
        let r = writeln!(so, "{v}").and_then(|()| so.flush());
        if let Err(e) = r {
            tracing::warn!(error = %e, "writing to stdout");
        }
    }

    /// Writes the `error` line of `f`.
    pub fn error(&self, f: &Failure) {
        self.line(&serde_json::json!({
            "event": "error",
            "reason": f.reason,
            "message": f.message,
        }));
    }
}

/// Prints `progress()` every `interval` on its own thread until dropped.
#[derive(Debug)]
pub struct Ticker {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Ticker {
    /// Starts the ticker.
    pub fn start(
        out: Out,
        interval: Duration,
        progress: impl Fn() -> serde_json::Value + Send + 'static,
    ) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        let thread = thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(interval) {
                    out.line(&progress());
                }
            })
            .map_err(|e| tracing::warn!(error = %e, "no progress thread"))
            .ok();
        Self {
            stop: Some(tx),
            thread,
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
