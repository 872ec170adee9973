//! Who fits beside whom on a GPU, who dies when a pair does not fit, and who is rescued when
//! the job it could not fit beside leaves.

use super::{Kind, World};

/// How long a job the daemon put back waits before the claimer may claim it again: Slurm's
/// requeue ends the run and makes the job pending within seconds, and the claimer's next look
/// claims it at once (its old pin is stale); counted generously.
pub const PUT_BACK_S: f64 = 30.0;

impl World<'_> {
    /// Whether job `j` cannot share with one of the jobs on GPU `gi` that hold their memory
    /// for good: those not doomed themselves (a doomed job is about to fail and free it).
    /// Where the table has memory, also when their memory together exceeds the GPU's (each
    /// pair may fit, three may not).
    pub(super) fn clashes(&self, j: usize, gi: usize) -> bool {
        let app = self.jobs[j].app;
        let holding = || self.gpus[gi].jobs.iter().filter(|&&o| o != j && !self.jobs[o].doomed);
        if holding().any(|&o| self.table.speed(app, self.jobs[o].app).is_none()) {
            return true;
        }
        match (self.table.memory_of(app), self.table.gpu_memory()) {
            (Some(mine), Some(gpu)) => {
                mine + holding()
                    .filter_map(|&o| self.table.memory_of(self.jobs[o].app))
                    .sum::<u64>()
                    > gpu
            }
            _ => false,
        }
    }

    /// The application of a job on GPU `gi` that job `j` cannot share with (what its note
    /// names, once put back): one the table says cannot share, else (memory decides) the one
    /// that needs the most.
    pub(super) fn clash_partner(&self, j: usize, gi: usize) -> Option<usize> {
        let app = self.jobs[j].app;
        let holding = || (self.gpus[gi].jobs.iter()).filter(|&&o| o != j && !self.jobs[o].doomed);
        let memory = |o: usize| self.table.memory_of(self.jobs[o].app).unwrap_or(0);
        holding()
            .find(|&&o| self.table.speed(app, self.jobs[o].app).is_none())
            .or_else(|| holding().max_by_key(|&&o| memory(o)))
            .map(|&o| self.jobs[o].app)
    }

    /// The resident of GPU `gi` that dies growing beside newcomer `j`, which does not fit: one
    /// it cannot share with at all, else (memory decides) the one that needs the most.
    pub(super) fn victim(&self, j: usize, gi: usize) -> Option<usize> {
        let app = self.jobs[j].app;
        let holding: Vec<usize> = (self.gpus[gi].jobs.iter())
            .copied()
            .filter(|&o| o != j && !self.jobs[o].doomed)
            .collect();
        let memory = |o: usize| self.table.memory_of(self.jobs[o].app).unwrap_or(0);
        (holding.iter().copied())
            .find(|&o| self.table.speed(app, self.jobs[o].app).is_none())
            .or_else(|| {
                holding
                    .iter()
                    .copied()
                    .max_by_key(|&o| (memory(o), std::cmp::Reverse(o)))
            })
    }

    /// Job `j` failed out of memory beside a partner: the daemon puts it back in the queue
    /// where the policy is the daemon's and Slurm may still restart it
    /// (`multiplexd::put_back::MAX_RESTARTS`); otherwise its user sees the failure and submits
    /// it again later. How long it waits to be eligible again.
    pub(super) fn after_failure(&mut self, j: usize, puts_back: bool) -> f64 {
        let job = &mut self.jobs[j];
        if puts_back && job.restarts < multiplexd::put_back::MAX_RESTARTS {
            job.restarts += 1;
            job.put_back = job.clashed_with;
            self.put_back += 1;
            return PUT_BACK_S;
        }
        self.oom_failures += 1;
        self.resident_failures += u64::from(job.outgrown);
        self.progress.failures.resubmit_after_s
    }

    /// A doomed job whose clashing partners have all left before it ran out of memory has
    /// the memory it needs after all: it runs on (oldest first, so that of two doomed jobs
    /// that cannot share either, the newer stays doomed). Without this a doomed job stayed
    /// doomed alone, and the next job of an application that cannot share with itself,
    /// placed beside it, was doomed in turn: a chain of failures that never ended.
    pub(super) fn rescue(&mut self, now: f64, gi: usize) {
        for k in 0..self.gpus[gi].jobs.len() {
            let m = self.gpus[gi].jobs[k];
            if !self.jobs[m].doomed || self.clashes(m, gi) {
                continue;
            }
            self.jobs[m].doomed = false;
            self.jobs[m].outgrown = false;
            if self.progress.every_s > 0.0 {
                let run = self.jobs[m].run;
                self.push(now + self.progress.every_s, m, Kind::Report(run));
            }
        }
    }
}
