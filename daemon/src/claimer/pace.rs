//! How often the claimer reads the queue. squeue asks slurmctld for its whole job table and
//! filters partitions itself, so a read costs slurmctld in proportion to every job it keeps,
//! those of other partitions too (22.8 ms at 8,000 jobs on the 22.05 test cluster). After
//! each read the claimer asks what such reads cost (sdiag, a cheap RPC that takes no job lock:
//! what slurmctld spent on them, by anyone, since the last read) and reads again only once
//! their mean over `[claim] slurmctld_percent` has passed: at 1%, a read of 28 ms every 2.8 s.
//! Its share of slurmctld's time then stays within the bound however long the queue grows,
//! and follows it within a read; an idle cluster's reads (well under a millisecond) still come
//! every look. At least one read every [`LONGEST_S`].

use crate::slurm::{ReadCost, Slurm};
use std::time::Duration;

/// The longest wait between two reads, whatever they cost: a claim waits no longer.
pub const LONGEST_S: f64 = 60.0;

/// The claimer's reads of the queue, spaced by their cost.
#[derive(Debug)]
pub struct Pace {
    /// The share of slurmctld's time the reads may take (0.01: 1%).
    share: f64,
    /// sdiag's count at the last ask.
    seen: Option<ReadCost>,
    /// The mean cost of a read, µs, as last measured.
    mean_us: f64,
    /// sdiag was refused (`PrivateData=usage` to a user who is not an operator): each read's
    /// own duration stands for its cost, which overstates it by squeue's own work.
    timed: bool,
    /// No read before this.
    next: f64,
}

/// What pacing the reads has to say, once: the cost went far from what was last said, or
/// sdiag was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Paced {
    /// The mean cost of a read (ms) and the spacing of the reads it makes (s).
    Spacing { read_ms: f64, every_s: f64 },
    /// sdiag was refused, with its error: each read's duration stands for its cost.
    Timed(String),
}

impl Pace {
    pub fn new(percent: f64) -> Pace {
        Pace {
            share: percent / 100.0,
            seen: None,
            mean_us: 0.0,
            timed: false,
            next: f64::NEG_INFINITY,
        }
    }

    /// Whether a look at `now` reads the queue.
    pub fn due(&self, now: f64) -> bool {
        now >= self.next
    }

    /// After a read at `now` that took `took` here: the next read's time, from slurmctld's
    /// statistics, and what is worth saying of it.
    pub fn read(&mut self, slurm: &dyn Slurm, now: f64, took: Duration) -> Option<Paced> {
        let before = self.spacing();
        let mut said = None;
        if self.timed {
            self.mean_us = took.as_secs_f64() * 1e6;
        } else {
            match slurm.job_reads() {
                Ok(Some(cost)) => self.measured(cost),
                // This Slurm's reads cost slurmctld nothing (the simulator's).
                Ok(None) => {}
                Err(e) => {
                    self.timed = true;
                    self.mean_us = took.as_secs_f64() * 1e6;
                    said = Some(Paced::Timed(e.to_string()));
                }
            }
        }
        self.next = now + self.spacing();
        let after = self.spacing();
        // Said when the spacing leaves the looks' own pace or moves by a half since.
        let moved = (after - before).abs() > 0.5 * before.max(1.0);
        said.or_else(|| {
            moved.then_some(Paced::Spacing {
                read_ms: self.mean_us / 1000.0,
                every_s: after,
            })
        })
    }

    fn measured(&mut self, cost: ReadCost) {
        // Counted since the last ask; since its reset where sdiag's statistics were reset
        // (at midnight, or `sdiag --reset`) in between.
        let window = match self.seen {
            Some(last) if cost.reads >= last.reads && cost.total_us >= last.total_us => ReadCost {
                reads: cost.reads - last.reads,
                total_us: cost.total_us - last.total_us,
            },
            _ => cost,
        };
        if window.reads > 0 {
            self.mean_us = window.total_us as f64 / window.reads as f64;
        }
        self.seen = Some(cost);
    }

    /// Seconds from one read to the next.
    fn spacing(&self) -> f64 {
        (self.mean_us / 1e6 / self.share).min(LONGEST_S)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slurm::{Fake, FakeState};

    fn fake(us_per_job: u64, jobs: usize) -> Fake {
        // What a job is does not matter here, only how many the table holds.
        let job = crate::slurm::Job::running_on_n1(1, "");
        Fake::new(FakeState {
            jobs: vec![job; jobs],
            read_us_per_job: Some(us_per_job),
            ..FakeState::default()
        })
    }

    /// Looks every second for `seconds`, reading where due: how many reads.
    fn reads(pace: &mut Pace, slurm: &Fake, seconds: u32) -> u32 {
        let mut n = 0;
        for t in 0..seconds {
            let now = t as f64;
            if pace.due(now) {
                slurm.jobs("shared").unwrap();
                pace.read(slurm, now, Duration::from_millis(1));
                n += 1;
            }
        }
        n
    }

    #[test]
    fn cheap_reads_come_every_look_and_dear_ones_keep_to_the_share() {
        // 200 jobs at 3 µs each: 0.6 ms a read, every look.
        let mut pace = Pace::new(1.0);
        assert_eq!(reads(&mut pace, &fake(3, 200), 120), 120);
        // 10,000 jobs: 30 ms a read, at 1% one every 3 s once measured.
        let mut pace = Pace::new(1.0);
        let slurm = fake(3, 10_000);
        let n = reads(&mut pace, &slurm, 300);
        let cost = slurm.job_reads().unwrap().unwrap();
        let share = cost.total_us as f64 / 300e6;
        assert!((95..=101).contains(&n), "{n} reads");
        assert!(share <= 0.0101, "{share}");
        // At 40,000 jobs, a quarter as many reads: the share stays.
        let mut pace = Pace::new(1.0);
        let n = reads(&mut pace, &fake(3, 40_000), 300);
        assert!((24..=27).contains(&n), "{n} reads");
        // The share asked for is the share kept.
        let mut pace = Pace::new(5.0);
        assert!((290..=300).contains(&reads(&mut pace, &fake(3, 10_000), 300)));
    }

    #[test]
    fn reads_are_never_further_apart_than_a_minute() {
        let mut pace = Pace::new(0.001);
        assert_eq!(reads(&mut pace, &fake(3, 10_000), 601), 11);
    }

    #[test]
    fn a_slurm_that_cannot_say_is_read_every_look() {
        let slurm = Fake::default();
        let mut pace = Pace::new(1.0);
        assert_eq!(pace.read(&slurm, 0.0, Duration::from_secs(1)), None);
        assert!(pace.due(0.0));
    }

    #[test]
    fn statistics_reset_in_between_are_read_from_their_reset() {
        let mut pace = Pace::new(1.0);
        let cost = |reads, total_us| ReadCost { reads, total_us };
        pace.measured(cost(100, 100_000));
        assert_eq!(pace.mean_us, 1000.0);
        pace.measured(cost(10, 300_000));
        assert_eq!(pace.mean_us, 30_000.0);
        pace.measured(cost(20, 500_000));
        assert_eq!(pace.mean_us, 20_000.0);
    }

    #[test]
    fn where_sdiag_is_refused_each_read_is_timed_and_that_is_said_once() {
        let slurm = fake(3, 10);
        slurm.state.lock().unwrap().job_reads_refused = true;
        let mut pace = Pace::new(1.0);
        let first = pace.read(&slurm, 0.0, Duration::from_millis(40));
        assert!(
            matches!(first, Some(Paced::Timed(ref e)) if e.contains("denied")),
            "{first:?}"
        );
        assert!(!pace.due(3.9) && pace.due(4.0));
        // Later reads are timed too, and said only when the spacing moves far.
        assert_eq!(pace.read(&slurm, 4.0, Duration::from_millis(45)), None);
        assert!(!pace.due(8.4) && pace.due(8.5));
    }
}
