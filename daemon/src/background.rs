//! What the daemon's background threads (weight publishing, reconciling, telemetry, history
//! checkpoints) have in common: a task run periodically until shutdown, and failures that
//! recur every period but should be logged once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A recurring failure, to be logged once per distinct message and once when it ends.
#[derive(Debug, Default)]
pub struct Trouble {
    last: Option<String>,
}

impl Trouble {
    /// Notes a failure; true when it is new (differs from the last one) and should be logged.
    pub fn failed(&mut self, error: &str) -> bool {
        if self.last.as_deref() == Some(error) {
            return false;
        }
        self.last = Some(error.to_string());
        true
    }

    /// Notes a success; true when it ends a run of failures and should be logged.
    pub fn recovered(&mut self) -> bool {
        self.last.take().is_some()
    }
}

/// Runs `task` on a thread named `name` now and then every `interval`, until `shutdown`
/// (looked at five times a second, so a stopping daemon is not held up by a long interval).
pub fn every(
    name: &str,
    interval: Duration,
    shutdown: Arc<AtomicBool>,
    mut task: impl FnMut() + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new().name(name.into()).spawn(move || loop {
        task();
        let next = Instant::now() + interval;
        while Instant::now() < next {
            if shutdown.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(200).min(interval));
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn a_failure_is_said_once_and_so_is_its_end() {
        let mut t = Trouble::default();
        assert!(!t.recovered(), "nothing to recover from");
        assert!(t.failed("no slurmctld"));
        assert!(!t.failed("no slurmctld"), "the same again");
        assert!(t.failed("timeout"), "a different failure");
        assert!(t.recovered());
        assert!(!t.recovered());
    }

    #[test]
    fn runs_until_shutdown() {
        let count = Arc::new(AtomicU32::new(0));
        let shutdown = Arc::new(AtomicBool::new(false));
        let c = Arc::clone(&count);
        every("test", Duration::from_millis(10), Arc::clone(&shutdown), move || {
            c.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let start = Instant::now();
        while count.load(Ordering::SeqCst) < 3 {
            assert!(start.elapsed() < Duration::from_secs(5), "ran again and again");
            std::thread::sleep(Duration::from_millis(5));
        }
        shutdown.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(100));
        let after = count.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(count.load(Ordering::SeqCst), after, "stopped");
    }
}
