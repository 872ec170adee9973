//! Why a job got its GPU and what came of it, from its rows (`multiplexd explain`).

use super::{History, HistoryError, PairRow};
use rusqlite::OptionalExtension;
use serde::Serialize;

/// Who shared a job's GPU, and for how long.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Partner {
    pub job_id: u32,
    pub app: String,
    pub seconds: f64,
}

/// A job beside another, by Slurm job id and app (one whose record was compacted away is left
/// out).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Corunner {
    pub job_id: u32,
    pub app: String,
}

/// Why a job got its GPU and what came of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    pub job_id: u32,
    pub node: String,
    pub app: String,
    pub gpu: u32,
    pub gpu_model: String,
    pub decision: String,
    pub predicted_speed: f64,
    /// The GPU memory the job said it needs (`--multiplex=mem=`), MiB.
    pub mem_mb: Option<u64>,
    pub started_at: f64,
    pub finished_at: Option<f64>,
    pub exit_status: Option<i32>,
    pub seconds_alone: f64,
    pub partners: Vec<Partner>,
    /// The jobs beside which it reported running out of GPU memory (`multiplexd report
    /// --oom`), if it did; empty when it did not.
    pub out_of_memory_beside: Vec<Corunner>,
    /// Whether it reported running out of GPU memory.
    pub out_of_memory: bool,
    /// What the history now says of the job's application beside each partner's.
    pub learned: Vec<PairRow>,
    /// GPU telemetry (NVML), where the node has it: peak memory of the job's processes, MiB.
    pub gpu_mem_peak_mb: Option<u64>,
    /// Mean SM utilisation of the job's processes, percent.
    pub sm_util_mean_pct: Option<f64>,
}

impl History {
    /// The user of the latest job `job_id` recorded here, if any.
    pub fn job_owner(&self, job_id: u32) -> Result<Option<u32>, HistoryError> {
        Ok(self
            .conn
            .prepare_cached("SELECT uid FROM jobs WHERE job_id = ?1 ORDER BY id DESC LIMIT 1")?
            .query_row([job_id], |r| r.get(0))
            .optional()?)
    }

    /// The latest run of job `job_id` here, explained; `None` if the history has no such job.
    pub fn explain(&self, job_id: u32) -> Result<Option<Explanation>, HistoryError> {
        let conn = &self.conn;
        let row = conn
            .query_row(
                "SELECT j.id, j.node, a.name, j.gpu, j.gpu_model, j.decision, j.predicted_speed, j.started_at,
                        j.finished_at, j.exit_status, j.app_id, j.mem_mb
                 FROM jobs j JOIN applications a ON a.id = j.app_id WHERE j.job_id = ?1 ORDER BY j.id DESC LIMIT 1",
                [job_id],
                |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        Explanation {
                            job_id,
                            node: r.get(1)?,
                            app: r.get(2)?,
                            gpu: r.get(3)?,
                            gpu_model: r.get(4)?,
                            decision: r.get(5)?,
                            predicted_speed: r.get(6)?,
                            mem_mb: r.get(11)?,
                            started_at: r.get(7)?,
                            finished_at: r.get(8)?,
                            exit_status: r.get(9)?,
                            seconds_alone: 0.0,
                            partners: Vec::new(),
                            out_of_memory_beside: Vec::new(),
                            out_of_memory: false,
                            learned: Vec::new(),
                            gpu_mem_peak_mb: None,
                            sm_util_mean_pct: None,
                        },
                        r.get::<_, i64>(10)?,
                    ))
                },
            )
            .optional()?;
        let Some((row, mut e, app_id)) = row else {
            return Ok(None);
        };
        add_intervals(conn, row, &mut e)?;
        add_out_of_memory(conn, row, &mut e)?;
        add_telemetry(conn, row, &mut e)?;
        e.learned = self
            .pair_rows("WHERE e.app_id = ?1 AND e.gpu_model = ?2", &[&app_id, &e.gpu_model])?
            .into_iter()
            .filter(|p| e.partners.iter().any(|q| q.app == p.other))
            .collect();
        Ok(Some(e))
    }
}

/// Whom the job shared its GPU with and for how long, and how long it ran alone.
fn add_intervals(conn: &rusqlite::Connection, row: i64, e: &mut Explanation) -> Result<(), HistoryError> {
    let end = e.finished_at;
    let mut stmt = conn.prepare(
        "SELECT p.job_id, a.name, i.started_at, i.ended_at FROM intervals i
         LEFT JOIN jobs p ON p.id = i.partner_row LEFT JOIN applications a ON a.id = i.partner_app_id
         WHERE i.job_row = ?1 ORDER BY i.started_at",
    )?;
    let rows = stmt.query_map([row], |r| {
        Ok((
            r.get::<_, Option<u32>>(0)?,
            r.get::<_, Option<String>>(1)?,
            r.get::<_, f64>(2)?,
            r.get::<_, Option<f64>>(3)?,
        ))
    })?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for r in rows {
        let (partner_job, partner_app, start, stop) = r?;
        let seconds = (stop.or(end).unwrap_or(now) - start).max(0.0);
        match partner_app {
            // job_id 0: a partner whose own record was compacted away.
            Some(a) => {
                let j = partner_job.unwrap_or(0);
                match e.partners.iter_mut().find(|p| p.job_id == j && p.app == a) {
                    Some(p) => p.seconds += seconds,
                    None => e.partners.push(Partner {
                        job_id: j,
                        app: a,
                        seconds,
                    }),
                }
            }
            None => e.seconds_alone += seconds,
        }
    }
    Ok(())
}

/// Whether the job ran out of memory, and beside whom.
fn add_out_of_memory(conn: &rusqlite::Connection, row: i64, e: &mut Explanation) -> Result<(), HistoryError> {
    if let Some(rows) = conn
        .query_row(
            "SELECT partners FROM observations WHERE job_row = ?1 AND kind = 'oom' ORDER BY at DESC LIMIT 1",
            [row],
            |r| r.get::<_, String>(0),
        )
        .optional()?
    {
        e.out_of_memory = true;
        for partner in rows.split(',').filter_map(|p| p.trim().parse::<i64>().ok()) {
            let c = conn
                .query_row(
                    "SELECT j.job_id, a.name FROM jobs j JOIN applications a ON a.id = j.app_id WHERE j.id = ?1",
                    [partner],
                    |r| {
                        Ok(Corunner {
                            job_id: r.get(0)?,
                            app: r.get(1)?,
                        })
                    },
                )
                .optional()?;
            e.out_of_memory_beside.extend(c);
        }
    }
    Ok(())
}

/// The job's GPU memory peak and mean SM utilisation, where telemetry saw it.
fn add_telemetry(conn: &rusqlite::Connection, row: i64, e: &mut Explanation) -> Result<(), HistoryError> {
    if let Some((peak, sum, n)) = conn
        .query_row(
            "SELECT mem_peak_mb, sm_util_sum, sm_util_samples FROM job_telemetry WHERE job_row = ?1",
            [row],
            |r| Ok((r.get::<_, Option<u64>>(0)?, r.get::<_, f64>(1)?, r.get::<_, u32>(2)?)),
        )
        .optional()?
    {
        e.gpu_mem_peak_mb = peak;
        e.sm_util_mean_pct = (n > 0).then(|| sum / f64::from(n));
    }
    Ok(())
}
