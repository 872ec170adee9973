//! GPU telemetry, as the node records it: each job's memory and SM utilisation, and where
//! MPS is off its busy GPU time.

use super::{BusyCount, Node};
use crate::history::{ActiveJob, HistoryError};
use crate::lessons::Lesson;

impl Node {
    /// Records one round of GPU telemetry: each process on a shared GPU is mapped to the
    /// Slurm job it claims and the uid it runs as by `job_of(pid)`; the jobs running here get
    /// the memory and SM utilisation of their processes that run as their user added up.
    /// Processes of other jobs (or none), and processes of another user claiming a job, are
    /// ignored. Where MPS is off, each job's busy GPU time is counted too
    /// ([`crate::config::keys::BUSY_RECORD_S`]).
    pub fn record_telemetry(
        &mut self,
        samples: &[crate::gpus::GpuSample],
        job_of: &dyn Fn(u32) -> Option<(u32, u32)>,
    ) -> Result<(), HistoryError> {
        let now = (self.clock)();
        let active = self.active()?;
        let mut per_job: std::collections::BTreeMap<i64, (Option<u64>, Option<u32>)> = Default::default();
        for gpu in samples {
            for p in &gpu.processes {
                let Some(job) =
                    job_of(p.pid).and_then(|(id, uid)| active.iter().find(|j| j.job_id == id && j.uid == uid))
                else {
                    continue;
                };
                let e = per_job.entry(job.row).or_default();
                if let Some(m) = p.mem_mb {
                    e.0 = Some(e.0.unwrap_or(0) + m);
                }
                if let Some(u) = p.sm_util_pct {
                    e.1 = Some(e.1.unwrap_or(0) + u);
                }
            }
        }
        for (&row, &(mem, util)) in &per_job {
            self.history.record_job_sample(row, mem, util)?;
        }
        // Under MPS the jobs of a GPU run at once, and a job's SM utilisation no longer tells
        // its share of the GPU's time.
        if !self.config.mps && self.config.busy_record_s > 0 {
            let util = |row: i64| per_job.get(&row).and_then(|e| e.1);
            self.count_busy(&active, &util, now)?;
        }
        self.last_round = Some(now);
        Ok(())
    }

    /// Brings each running job's busy GPU time up to `now` (`util(row)`: its SM utilisation in
    /// this round, percent) and records it every `busy_record_s`. A job's count begins at the
    /// first round that measures it: from its start if it started since the previous round,
    /// else from now (the daemon was not counting before, or its telemetry failed for longer
    /// than two records). A round that measures a counted job not at all counts it idle.
    fn count_busy(
        &mut self,
        active: &[ActiveJob],
        util: &dyn Fn(i64) -> Option<u32>,
        now: f64,
    ) -> Result<(), HistoryError> {
        self.busy.retain(|row, _| active.iter().any(|j| j.row == *row));
        let prior = self.config.policy.unknown_pair_speed;
        // Telemetry that failed for longer than two records knows nothing of the gap: the
        // count begins again rather than spread this round over it.
        let gap = 2.0 * self.config.busy_record_s as f64;
        for job in active {
            let pct = util(job.row);
            let count = match self.busy.get(&job.row).filter(|c| now - c.counted <= gap) {
                Some(&c) => c,
                None => {
                    if pct.is_none() {
                        continue;
                    }
                    let begun = match self.last_round {
                        Some(t) if job.started_at >= t => job.started_at.min(now),
                        _ => now,
                    };
                    self.history
                        .record_report(job.row, crate::history::BUSY, Some(0.0), &[], prior, begun)?;
                    BusyCount {
                        busy_s: 0.0,
                        counted: begun,
                        recorded: begun,
                    }
                }
            };
            let share = f64::from(pct.unwrap_or(0).min(100)) / 100.0;
            let mut count = BusyCount {
                busy_s: count.busy_s + share * (now - count.counted).max(0.0),
                counted: now,
                ..count
            };
            if now - count.recorded >= self.config.busy_record_s as f64 {
                let partners: Vec<i64> = active
                    .iter()
                    .filter(|o| o.gpu == job.gpu && o.row != job.row)
                    .map(|o| o.row)
                    .collect();
                self.history
                    .record_report(job.row, crate::history::BUSY, Some(count.busy_s), &partners, prior, now)?;
                count.recorded = now;
                if !partners.is_empty() {
                    self.teach(Lesson::Progress(job.into()));
                }
            }
            self.busy.insert(job.row, count);
        }
        Ok(())
    }
}
