//! What stops a simulated run that would never end.

use crate::input::TraceJob;

/// Stops a run that would never end: every event the world processes is counted against a
/// budget proportional to the jobs, and events at one instant of simulated time against a
/// smaller one (the clock has stopped). Legitimate runs stay far below both: a job arrives,
/// starts, ends, and between those reports progress, is declined, or fails and is requeued,
/// each of which moves the clock on by at least a minute.
pub(crate) struct Watchdog {
    events: u64,
    budget: u64,
    at: f64,
    at_this_instant: u64,
    instant_budget: u64,
    /// The jobs of the latest events, to name the ones going round.
    recent: std::collections::VecDeque<usize>,
}

/// Why the watchdog stopped a run.
pub(crate) struct Stuck {
    at: f64,
    events: u64,
    clock_stopped: bool,
    jobs: Vec<usize>,
}

impl Watchdog {
    /// Events per job a run may process in all (the worst legitimate runs seen take a few
    /// hundred: 142 declines per job on a table where almost no pair gains), and at one
    /// instant; each on top of a fixed allowance for small traces.
    const EVENTS_PER_JOB: u64 = 20_000;
    const INSTANT_EVENTS_PER_JOB: u64 = 100;
    const RECENT: usize = 1_000;

    pub(crate) fn new(jobs: usize) -> Watchdog {
        let jobs = jobs.max(1) as u64;
        Watchdog {
            events: 0,
            budget: 1_000_000 + Self::EVENTS_PER_JOB.saturating_mul(jobs),
            at: f64::NEG_INFINITY,
            at_this_instant: 0,
            instant_budget: 10_000 + Self::INSTANT_EVENTS_PER_JOB.saturating_mul(jobs),
            recent: std::collections::VecDeque::with_capacity(Self::RECENT),
        }
    }

    pub(crate) fn tick(&mut self, now: f64, job: usize) -> Option<Stuck> {
        self.events += 1;
        if now > self.at {
            self.at = now;
            self.at_this_instant = 0;
        }
        self.at_this_instant += 1;
        if self.recent.len() == Self::RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(job);
        let clock_stopped = self.at_this_instant > self.instant_budget;
        if !clock_stopped && self.events <= self.budget && now.is_finite() {
            return None;
        }
        let mut counts: std::collections::BTreeMap<usize, usize> = Default::default();
        for &j in &self.recent {
            *counts.entry(j).or_default() += 1;
        }
        let mut jobs: Vec<(usize, usize)> = counts.into_iter().collect();
        jobs.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut jobs: Vec<usize> = jobs.into_iter().take(5).map(|(j, _)| j).collect();
        jobs.sort_unstable();
        Some(Stuck {
            at: now,
            events: self.events,
            clock_stopped,
            jobs,
        })
    }
}

impl Stuck {
    pub(crate) fn describe(&self, trace: &[TraceJob]) -> String {
        let why = if !self.at.is_finite() {
            "the simulated clock is no longer a finite number".to_string()
        } else if self.clock_stopped {
            "the simulated clock stopped advancing".to_string()
        } else {
            format!(
                "the run exceeded its budget of {} events per job",
                Watchdog::EVENTS_PER_JOB
            )
        };
        let ids: Vec<&str> = self.jobs.iter().map(|&j| trace[j].id.as_str()).collect();
        format!(
            "the simulation would not end: {why} (at simulated time {:.0} s, after {} events); the jobs going round: {}",
            self.at,
            self.events,
            ids.join(", ")
        )
    }
}
