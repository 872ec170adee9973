//! A simulated job and GPU as the world keeps them.

use crate::input::TraceJob;

#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub(crate) app: usize,
    pub(crate) work: f64,
    pub(crate) submit: f64,
    pub(crate) eligible: f64,
    /// The application's iterations per second alone (the unit of its progress reports).
    pub(crate) rate: f64,
    /// Current run: where, since when, work done by `last`, speed since `last`.
    pub(crate) at: Option<(usize, usize)>,
    pub(crate) start: f64,
    pub(crate) done: f64,
    pub(crate) last: f64,
    pub(crate) speed: f64,
    /// Work done at the latest round of GPU telemetry of this run, and when that was (its start
    /// before the first).
    pub(crate) counted: f64,
    pub(crate) counted_at: f64,
    /// Bumped whenever the completion time changes, and per run (stale events are skipped).
    pub(crate) epoch: u32,
    pub(crate) run: u32,
    pub(crate) doomed: bool,
    /// Doomed as the resident a newcomer outgrew (not as a newcomer).
    pub(crate) outgrown: bool,
    pub(crate) finished: Option<f64>,
    /// Claimed: the node and GPU it was pinned to, until Slurm starts it there.
    pub(crate) pinned: Option<(usize, usize)>,
    /// How often Slurm requeued it (given back to run apart, or put back after running out
    /// of memory), and the application it last ran out of memory beside, once put back.
    pub(crate) restarts: u32,
    pub(crate) put_back: Option<usize>,
    /// Doomed: the application of the partner it does not fit beside.
    pub(crate) clashed_with: Option<usize>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Gpu {
    pub(crate) jobs: Vec<usize>,
    pub(crate) since: f64,
    pub(crate) speed_sum: f64,
}

impl Job {
    pub(crate) fn new(t: &TraceJob, rate: f64) -> Job {
        Job {
            app: t.app,
            work: t.solo_runtime_s,
            submit: t.submit_s,
            eligible: t.submit_s,
            rate,
            at: None,
            start: 0.0,
            done: 0.0,
            last: 0.0,
            speed: 0.0,
            counted: 0.0,
            counted_at: 0.0,
            epoch: 0,
            run: 0,
            doomed: false,
            outgrown: false,
            finished: None,
            pinned: None,
            restarts: 0,
            put_back: None,
            clashed_with: None,
        }
    }
}
