//! The jobs this node gave back to Slurm to run apart ([`crate::separate`]), and what came of it.

use super::{History, HistoryError};
use rusqlite::params;

/// A job given back longer ago than this is not remembered as given back (Slurm job ids come
/// back after `MaxJobId`; a week is far longer than any wait and far shorter than a wrap).
const REMEMBERED_S: f64 = 7.0 * 86_400.0;

impl History {
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
        let rows = stmt.query_map(params![node, now - REMEMBERED_S], |r| r.get(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}
