//! GPU telemetry per job (NVML), and the memory each application is measured to need.

use super::{Cached, History, HistoryError};
use rusqlite::{params, OptionalExtension};

impl History {
    /// Adds one telemetry sample of a job: the memory of its GPU processes together, and
    /// their SM utilisation together, each when the driver reports it (memory never reported
    /// stays unknown: a peak of 0 MiB would read as a job that fits beside anything).
    pub fn record_job_sample(
        &mut self,
        job_row: i64,
        mem_mb: Option<u64>,
        sm_util_pct: Option<u32>,
    ) -> Result<(), HistoryError> {
        self.write_one(
            "INSERT INTO job_telemetry(job_row, samples, mem_peak_mb, sm_util_sum, sm_util_samples)
             VALUES (?1, 1, ?2, coalesce(?3, 0), ?3 IS NOT NULL)
             ON CONFLICT(job_row) DO UPDATE SET samples = samples + 1,
               mem_peak_mb = CASE WHEN ?2 IS NULL THEN mem_peak_mb ELSE max(coalesce(mem_peak_mb, 0), ?2) END,
               sm_util_sum = sm_util_sum + coalesce(?3, 0),
               sm_util_samples = sm_util_samples + (?3 IS NOT NULL)",
            params![job_row, mem_mb.map(|m| m as i64), sm_util_pct],
        )?;
        Ok(())
    }

    /// Refreshes what the application of the finished job `job_row` is known to need: the
    /// highest GPU memory its latest (up to 20) measured runs used.
    pub fn refresh_app_memory(&mut self, job_row: i64) -> Result<(), HistoryError> {
        self.conn.exec(
            "INSERT INTO app_memory(app_id, peak_mb)
             SELECT app, peak FROM (
               SELECT j0.app_id AS app,
                      (SELECT max(m) FROM (SELECT t.mem_peak_mb AS m FROM jobs j JOIN job_telemetry t ON t.job_row = j.id
                        WHERE j.app_id = j0.app_id AND t.mem_peak_mb IS NOT NULL ORDER BY j.id DESC LIMIT 20)) AS peak
               FROM jobs j0 WHERE j0.id = ?1)
             WHERE peak IS NOT NULL
             ON CONFLICT(app_id) DO UPDATE SET peak_mb = excluded.peak_mb",
            [job_row],
        )?;
        Ok(())
    }

    /// The GPU memory `app`'s earlier measured runs peaked at, MiB: what a job that gives no
    /// memory hint is assumed to need.
    pub fn app_mem_peak(&self, app: &str) -> Result<Option<u64>, HistoryError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT m.peak_mb FROM app_memory m JOIN applications a ON a.id = m.app_id WHERE a.name = ?1",
        )?;
        Ok(stmt
            .query_row([app], |r| r.get::<_, i64>(0))
            .optional()?
            .map(|m| m.max(0) as u64))
    }
}
