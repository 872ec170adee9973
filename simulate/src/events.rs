//! The simulated world's event queue: earliest first, ties in the order they were made.

use std::cmp::Ordering;

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Arrive,
    /// A requeued job may be started again.
    Eligible,
    Complete(u32),
    OutOfMemory(u32),
    Report(u32),
    /// A round of GPU telemetry on every node (the event's job means nothing).
    Telemetry,
    /// The claimer looks at the cluster ([`Policy::claim`]).
    Look,
    /// Slurm's pass after a claim: the job starts on the GPU it was pinned to.
    Pass,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Event {
    pub(crate) at: f64,
    pub(crate) seq: u64,
    pub(crate) job: usize,
    pub(crate) kind: Kind,
}

impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    // Earliest first out of the max-heap; ties in the order they were made.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.seq.cmp(&self.seq))
    }
}
