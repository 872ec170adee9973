//! The jobs this node declined: why, when, and for how long they were sent away.

use super::{Cached, History, HistoryError};
use rusqlite::params;
use serde::Serialize;

/// How far back a job's declines count towards `policy.max_declines` (Slurm job ids come back
/// after `MaxJobId`; a week is far longer than any wait and far shorter than a wrap).
const COUNT_WINDOW_S: f64 = 7.0 * 86_400.0;

/// One decline of a job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decline {
    pub node: String,
    pub at: f64,
    pub reason: String,
    /// How long the job was asked to wait (0: it could never run here).
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
            "INSERT INTO declines(job_id, node, at, reason, retry_after_s) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![job_id, node, now, reason, retry_after_s],
        )?;
        Ok(())
    }

    /// How many times job `job_id` was declined on `node` in the week before `now`.
    pub fn decline_count(&self, job_id: u32, node: &str, now: f64) -> Result<u32, HistoryError> {
        Ok(self.conn.row(
            "SELECT count(*) FROM declines WHERE job_id = ?1 AND node = ?2 AND at > ?3",
            params![job_id, node, now - COUNT_WINDOW_S],
            |r| r.get(0),
        )?)
    }

    /// Every decline of job `job_id` this history holds, oldest first.
    pub fn declines(&self, job_id: u32) -> Result<Vec<Decline>, HistoryError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT node, at, reason, retry_after_s FROM declines WHERE job_id = ?1 ORDER BY at, id")?;
        let rows = stmt.query_map([job_id], |r| {
            Ok(Decline {
                node: r.get(0)?,
                at: r.get(1)?,
                reason: r.get(2)?,
                retry_after_s: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}
