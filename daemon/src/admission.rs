//! What any local user may cost the daemon: how many connections each peer may hold, and how
//! much the daemon's log says about what peers did wrong. Every user of a GPU node can connect
//! to the daemon's socket; root and the Slurm user (slurmstepd) must be served whatever the
//! others do.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Connection limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections one unprivileged uid may hold at once.
    pub per_uid: usize,
    /// Connections all unprivileged uids together may hold: the rest of `total` is kept for
    /// root and the Slurm user.
    pub unprivileged: usize,
    /// Connections in all (each is a thread and a file descriptor).
    pub total: usize,
    /// How long a connection may wait between two requests.
    pub idle: Duration,
    /// How long one request may take to arrive once its first byte has, and one answer to
    /// be taken: a peer that sends (or reads) a byte now and then is cut off.
    pub frame: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            per_uid: 8,
            unprivileged: 64,
            total: 512,
            idle: Duration::from_secs(30),
            frame: Duration::from_secs(5),
        }
    }
}

/// The connections held, by uid.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    by_uid: HashMap<u32, usize>,
    unprivileged: usize,
    total: usize,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The uid holds as many connections as one unprivileged uid may.
    PerUid(usize),
    /// Unprivileged uids together hold as many as they may.
    Unprivileged(usize),
    /// The daemon holds as many connections as it serves at once.
    Total(usize),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::PerUid(n) => write!(
                f,
                "this uid already holds {n} connections to multiplexd, the most it may"
            ),
            Refusal::Unprivileged(n) => write!(f, "users hold {n} connections to multiplexd, the most they may"),
            Refusal::Total(n) => write!(f, "multiplexd serves {n} connections, the most it may"),
        }
    }
}

/// A connection admitted; it is counted until this is dropped.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    uid: u32,
    privileged: bool,
}

impl Ticket {
    /// The limits the connection was admitted under.
    pub fn limits(&self) -> &Limits {
        &self.admission.limits
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut held = self.admission.lock();
        held.total -= 1;
        if !self.privileged {
            held.unprivileged -= 1;
            if let Some(n) = held.by_uid.get_mut(&self.uid) {
                *n -= 1;
                if *n == 0 {
                    held.by_uid.remove(&self.uid);
                }
            }
        }
    }
}

impl Admission {
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            held: Mutex::default(),
        })
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a new connection of `uid`, or says why it may not be served.
    pub fn admit(self: &Arc<Self>, uid: u32, privileged: bool) -> Result<Ticket, Refusal> {
        let mut held = self.lock();
        if held.total >= self.limits.total {
            return Err(Refusal::Total(self.limits.total));
        }
        if !privileged {
            if held.unprivileged >= self.limits.unprivileged {
                return Err(Refusal::Unprivileged(self.limits.unprivileged));
            }
            let mine = held.by_uid.entry(uid).or_default();
            if *mine >= self.limits.per_uid {
                return Err(Refusal::PerUid(self.limits.per_uid));
            }
            *mine += 1;
            held.unprivileged += 1;
        }
        held.total += 1;
        Ok(Ticket {
            admission: Arc::clone(self),
            uid,
            privileged,
        })
    }

    /// Connections held now: (all, unprivileged).
    pub fn held(&self) -> (usize, usize) {
        let held = self.lock();
        (held.total, held.unprivileged)
    }
}

/// What a peer did wrong, as the log counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// A frame that was cut short, too large, not JSON or of another protocol version.
    BadFrame,
    /// A connection refused by the limits.
    Refused,
    /// A request or answer that took longer than the frame deadline.
    TooSlow,
    /// A request the history could not serve (e.g. a full disk).
    Failed,
}

impl Fault {
    /// The `kind` label of `multiplexd_client_faults_total`.
    fn metric(self) -> &'static str {
        match self {
            Fault::BadFrame => "bad_frame",
            Fault::Refused => "refused",
            Fault::TooSlow => "too_slow",
            Fault::Failed => "failed",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Fault::BadFrame => "bad messages",
            Fault::Refused => "connections refused",
            Fault::TooSlow => "messages too slow to arrive or be read",
            Fault::Failed => "requests the history could not serve",
        }
    }
}

/// Logs what peers do wrong without letting them fill the log: the first fault of a kind
/// from a uid in a window is logged (its detail escaped and cut short), the rest are counted
/// and summarised in one line per uid and kind when the window has passed.
#[derive(Debug)]
pub struct Complaints {
    window: Duration,
    seen: Mutex<HashMap<(u32, Fault), Count>>,
}

#[derive(Debug)]
struct Count {
    since: Instant,
    more: u64,
}

/// At most this many characters of a peer's text reach the log.
const DETAIL_CHARS: usize = 160;

/// `text` as it may be logged: cut to [`DETAIL_CHARS`] characters, with control characters,
/// quotes and backslashes escaped (a peer's `\n` cannot start a line of its own).
pub fn escaped(text: &str) -> String {
    let mut out: String = text.chars().take(DETAIL_CHARS).flat_map(char::escape_debug).collect();
    if text.chars().nth(DETAIL_CHARS).is_some() {
        out.push_str("...");
    }
    out
}

impl Complaints {
    pub fn new(window: Duration) -> Complaints {
        Complaints {
            window,
            seen: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<(u32, Fault), Count>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes a fault of `uid`; `detail` is asked for only when it is logged.
    pub fn note(&self, uid: u32, fault: Fault, detail: impl FnOnce() -> String) {
        crate::metrics::global().fault(fault.metric());
        let now = Instant::now();
        let mut seen = self.lock();
        match seen.get_mut(&(uid, fault)) {
            Some(c) if now.duration_since(c.since) < self.window => {
                c.more += 1;
                return;
            }
            Some(c) => summarise(uid, fault, c, self.window),
            None => {}
        }
        seen.insert((uid, fault), Count { since: now, more: 0 });
        drop(seen);
        let (what, detail, every) = (fault.what(), escaped(&detail()), self.window.as_secs());
        let text = format!("{what}: {detail}; more from this uid are counted and logged once every {every} s");
        if fault == Fault::Failed {
            tracing::error!(uid, "{text}");
        } else {
            tracing::warn!(uid, "{text}");
        }
    }

    /// Logs the counts of every window that has passed (a daemon calls this now and then, so
    /// that the last burst is told even if nothing follows it).
    pub fn flush(&self) {
        let now = Instant::now();
        self.lock().retain(|&(uid, fault), c| {
            if now.duration_since(c.since) < self.window {
                return true;
            }
            summarise(uid, fault, c, self.window);
            false
        });
    }
}

fn summarise(uid: u32, fault: Fault, c: &Count, window: Duration) {
    if c.more > 0 {
        tracing::warn!(uid, "{} more {} in {} s", c.more, fault.what(), window.as_secs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_unprivileged_uid_and_all_of_them_are_bounded_and_privileged_peers_keep_the_rest() {
        let a = Admission::new(Limits {
            per_uid: 2,
            unprivileged: 3,
            total: 5,
            ..Limits::default()
        });
        let t1 = a.admit(1001, false).unwrap();
        let _t2 = a.admit(1001, false).unwrap();
        assert_eq!(a.admit(1001, false).unwrap_err(), Refusal::PerUid(2));
        let _t3 = a.admit(1002, false).unwrap();
        assert_eq!(a.admit(1003, false).unwrap_err(), Refusal::Unprivileged(3));
        let _r1 = a.admit(0, true).unwrap();
        let _r2 = a.admit(64030, true).unwrap();
        assert_eq!(a.admit(0, true).unwrap_err(), Refusal::Total(5));
        assert_eq!(a.held(), (5, 3));
        // A connection that closes gives its place back.
        drop(t1);
        assert_eq!(a.held(), (4, 2));
        let _t4 = a.admit(1001, false).unwrap();
        assert_eq!(a.held(), (5, 3));
    }

    #[test]
    fn a_peers_text_is_escaped_and_cut_short() {
        assert_eq!(escaped("bad\nINFO forged"), "bad\\nINFO forged");
        assert_eq!(escaped("\"q\" \\ \u{1b}[31m"), "\\\"q\\\" \\\\ \\u{1b}[31m");
        let long = "x".repeat(10_000);
        let e = escaped(&long);
        assert_eq!(e.len(), DETAIL_CHARS + 3);
        assert!(e.ends_with("..."));
    }
}
