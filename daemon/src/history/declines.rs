//! The jobs this node declined: how often, when, and why the latest time.

use super::{Cached, History, HistoryError};
use rusqlite::params;
use serde::Serialize;

/// A job declined longer ago than this starts counting again (Slurm job ids come back after
/// `MaxJobId`; a week is far longer than any wait and far shorter than a wrap).
const COUNT_WINDOW_S: f64 = 7.0 * 86_400.0;

/// The declines of a job on a node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decline {
    pub node: String,
    pub count: u32,
    pub first_at: f64,
    pub last_at: f64,
    /// Why the latest decline.
    pub reason: String,
    /// How long the latest decline asked the job to wait (0: it could never run here).
    pub retry_after_s: u32,
}

impl History {
    /// Records that job `job_id` was declined on `node` at `now`.
    pub fn record_decline(
        &self,
        job_id: u32,
        node: &str,
        now: f64,
        reason: &str,
        retry_after_s: u32,
    ) -> Result<(), HistoryError> {
        self.write_one(
            "INSERT INTO declines(job_id, node, count, first_at, last_at, reason, retry_after_s)
             VALUES (?1, ?2, 1, ?3, ?3, ?4, ?5)
             ON CONFLICT (job_id, node) DO UPDATE SET
                count = CASE WHEN last_at < ?3 - ?6 THEN 1 ELSE count + 1 END,
                first_at = CASE WHEN last_at < ?3 - ?6 THEN ?3 ELSE first_at END,
                last_at = ?3, reason = ?4, retry_after_s = ?5",
            params![job_id, node, now, reason, retry_after_s, COUNT_WINDOW_S],
        )?;
        Ok(())
    }

    /// How many times job `job_id` was declined on `node`, counted while the declines came
    /// less than a week apart from the latest before `now`.
    pub fn decline_count(&self, job_id: u32, node: &str, now: f64) -> Result<u32, HistoryError> {
        use rusqlite::OptionalExtension;
        Ok(self
            .conn
            .row(
                "SELECT count FROM declines WHERE job_id = ?1 AND node = ?2 AND last_at > ?3",
                params![job_id, node, now - COUNT_WINDOW_S],
                |r| r.get(0),
            )
            .optional()?
            .unwrap_or(0))
    }

    /// Marks the running job `job_row` as being given back to Slurm ([`crate::separate`]), before
    /// the requeue: the end that the requeue brings may be recorded before `scontrol` returns.
    pub fn mark_separating(&self, job_row: i64) -> Result<(), HistoryError> {
        self.write_one("UPDATE jobs SET separated = 1 WHERE id = ?1", [job_row])?;
        Ok(())
    }

    /// What came of giving job `job_row` back: requeued, or Slurm would not requeue it (it runs
    /// on, and is not tried again); why goes after its placement's decision, which `explain`
    /// shows.
    pub fn record_separation(&self, job_row: i64, requeued: bool, why: &str) -> Result<(), HistoryError> {
        self.write_one(
            "UPDATE jobs SET separated = ?3, decision = decision || ?2 WHERE id = ?1",
            params![
                job_row,
                if requeued {
                    format!("; then requeued to run apart: {why}")
                } else {
                    format!("; Slurm would not requeue it to run apart: {why}")
                },
                if requeued { 1 } else { 2 }
            ],
        )?;
        Ok(())
    }

    /// The jobs given back to Slurm on `node` (or that Slurm would not requeue) within a week of
    /// `now`.
    pub fn separated_jobs(&self, node: &str, now: f64) -> Result<std::collections::HashSet<u32>, HistoryError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT job_id FROM jobs WHERE node = ?1 AND separated > 0 AND started_at > ?2")?;
        let rows = stmt.query_map(params![node, now - COUNT_WINDOW_S], |r| r.get(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The declines of job `job_id` on every node this history knows, latest first.
    pub fn declines(&self, job_id: u32) -> Result<Vec<Decline>, HistoryError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT node, count, first_at, last_at, reason, retry_after_s FROM declines
             WHERE job_id = ?1 ORDER BY last_at DESC",
        )?;
        let rows = stmt.query_map([job_id], |r| {
            Ok(Decline {
                node: r.get(0)?,
                count: r.get(1)?,
                first_at: r.get(2)?,
                last_at: r.get(3)?,
                reason: r.get(4)?,
                retry_after_s: r.get(5)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}
