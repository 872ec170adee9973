//! Recording what happens to jobs: placements, steps, ends, and what jobs report.

use super::{Cached, History, HistoryError};
use crate::types::Resident;
use rusqlite::params;

/// A job this node is running, as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveJob {
    pub row: i64,
    pub job_id: u32,
    pub uid: u32,
    pub app: String,
    pub gpu: u32,
    pub mem_mb: Option<u64>,
    pub owner_step: u32,
    pub started_at: f64,
    pub decision: String,
    pub predicted_speed: f64,
}

/// What to record for a newly placed job.
pub struct NewJob<'a> {
    pub job_id: u32,
    pub node: &'a str,
    pub uid: u32,
    pub app: &'a str,
    pub gpu: u32,
    pub gpu_model: &'a str,
    pub mem_mb: Option<u64>,
    pub owner_step: u32,
    pub slurm_gpus: Option<&'a str>,
    pub decision: &'a str,
    pub predicted_speed: f64,
    pub now: f64,
}

/// The columns of an [`ActiveJob`], read by [`active_job`]; a
/// WHERE clause follows. A macro, so that the queries built on it are literals: no SQL is
/// formatted per request.
macro_rules! active_job_sql {
    () => {
        "SELECT j.id, j.job_id, j.uid, a.name, j.gpu, j.mem_mb, j.owner_step, j.started_at,
            j.decision, j.predicted_speed FROM jobs j JOIN applications a ON a.id = j.app_id"
    };
}

fn active_job(r: &rusqlite::Row<'_>) -> rusqlite::Result<ActiveJob> {
    Ok(ActiveJob {
        row: r.get(0)?,
        job_id: r.get(1)?,
        uid: r.get(2)?,
        app: r.get(3)?,
        gpu: r.get(4)?,
        mem_mb: r.get::<_, Option<i64>>(5)?.map(|m| m as u64),
        owner_step: r.get(6)?,
        started_at: r.get(7)?,
        decision: r.get(8)?,
        predicted_speed: r.get(9)?,
    })
}

impl History {
    /// Jobs placed on this node and not finished, oldest first.
    pub fn active_jobs(&self, node: &str) -> Result<Vec<ActiveJob>, HistoryError> {
        let now = self.tables(&["jobs", "applications"])?;
        if let Some((then, read_for, active)) = &*self.active.borrow() {
            if now == Some(*then) && read_for == node {
                return Ok(active.clone());
            }
        }
        let mut stmt = self.conn.prepare_cached(concat!(
            active_job_sql!(),
            " WHERE j.node = ?1 AND j.finished_at IS NULL ORDER BY j.id"
        ))?;
        let rows = stmt.query_map([node], active_job)?;
        let active: Vec<ActiveJob> = rows.collect::<Result<_, _>>()?;
        *self.active.borrow_mut() = now.map(|now| (now, node.to_string(), active.clone()));
        Ok(active)
    }

    /// The running job `job_id` on `node`, and the rows of the jobs sharing its GPU (a running
    /// job's every progress report asks this: read from memory while the node's jobs are
    /// unchanged).
    pub fn running_job(&self, node: &str, job_id: u32) -> Result<Option<(ActiveJob, Vec<i64>)>, HistoryError> {
        let active = self.active_jobs(node)?;
        let Some(job) = active.iter().find(|j| j.job_id == job_id) else {
            return Ok(None);
        };
        let partners = (active.iter())
            .filter(|p| p.gpu == job.gpu && p.row != job.row)
            .map(|p| p.row)
            .collect();
        Ok(Some((job.clone(), partners)))
    }

    /// Jobs that ended on `node` and were not learned from yet (their lesson was queued when
    /// the daemon stopped), in the order they ended.
    pub fn unlearned_jobs(&self, node: &str) -> Result<Vec<ActiveJob>, HistoryError> {
        let mut stmt = self.conn.prepare_cached(concat!(
            active_job_sql!(),
            " WHERE j.node = ?1 AND j.finished_at IS NOT NULL AND j.learned = 0 ORDER BY j.finished_at, j.id"
        ))?;
        let rows = stmt.query_map([node], active_job)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Records a new job on a GPU, its first step, and the sharing intervals that change:
    /// every resident of that GPU closes its current interval and opens one per partner.
    pub fn record_placement(&mut self, job: &NewJob, residents: &[i64]) -> Result<i64, HistoryError> {
        let tx = self.write()?;
        let app_id = app_id(&tx, job.app)?;
        tx.exec(
            "INSERT INTO jobs(job_id, node, uid, app_id, gpu, gpu_model, mem_mb, owner_step, slurm_gpus,
                              decision, predicted_speed, started_at, learned)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 0)",
            params![
                job.job_id,
                job.node,
                job.uid,
                app_id,
                job.gpu,
                job.gpu_model,
                job.mem_mb.map(|m| m as i64),
                job.owner_step,
                job.slurm_gpus,
                job.decision,
                job.predicted_speed,
                job.now
            ],
        )?;
        let row = tx.last_insert_rowid();
        tx.exec(
            "INSERT INTO steps(job_row, step_id, started_at) VALUES (?1, ?2, ?3)",
            params![row, job.owner_step, job.now],
        )?;
        let mut members = residents.to_vec();
        members.push(row);
        reopen_intervals(&tx, &members, job.now)?;
        tx.commit()?;
        Ok(row)
    }

    /// Records another step joining a job that already holds a GPU (idempotent).
    pub fn record_step(&mut self, job_row: i64, step_id: u32, now: f64) -> Result<(), HistoryError> {
        self.write_one(
            "INSERT INTO steps(job_row, step_id, started_at) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
            params![job_row, step_id, now],
        )?;
        Ok(())
    }

    /// Records a step's end; when it is the step that holds the GPU, the job ends too and its
    /// former co-runners' intervals are reopened without it.
    /// The speed a job that ended ran at, relative to its application alone on this GPU
    /// model (its solo runtime over its own runtime); `None` without a solo runtime.
    pub fn observed_speed(&self, job_row: i64) -> Result<Option<f64>, HistoryError> {
        use rusqlite::OptionalExtension;
        Ok(self
            .conn
            .query_row(
                "SELECT s.runtime_s / (j.finished_at - j.started_at) FROM jobs j
                 JOIN solo_baselines s ON s.gpu_model = j.gpu_model AND s.app_id = j.app_id
                 WHERE j.id = ?1 AND j.finished_at > j.started_at",
                [job_row],
                |r| r.get::<_, f64>(0),
            )
            .optional()?)
    }

    pub fn record_finish(
        &mut self,
        job_row: i64,
        step_id: u32,
        exit_status: i32,
        releases: bool,
        remaining: &[i64],
        now: f64,
    ) -> Result<(), HistoryError> {
        self.end(job_row, Some((step_id, exit_status)), releases, remaining, now)
    }

    /// Records that a job is gone without its end being reported (it ended while the daemon
    /// was down, or its node's slurmstepd died): its slot is freed, its exit status stays
    /// unknown, and nothing is learned from it.
    pub fn record_gone(&mut self, job_row: i64, remaining: &[i64], now: f64) -> Result<(), HistoryError> {
        self.end(job_row, None, true, remaining, now)
    }

    fn end(
        &mut self,
        job_row: i64,
        step: Option<(u32, i32)>,
        releases: bool,
        remaining: &[i64],
        now: f64,
    ) -> Result<(), HistoryError> {
        let exit_status = step.map(|(_, e)| e);
        let tx = self.write()?;
        match step {
            Some((step_id, exit)) => tx.exec(
                "UPDATE steps SET finished_at = ?3, exit_status = ?4 WHERE job_row = ?1 AND step_id = ?2 AND finished_at IS NULL",
                params![job_row, step_id, now, exit],
            )?,
            None => tx.exec(
                "UPDATE steps SET finished_at = ?2 WHERE job_row = ?1 AND finished_at IS NULL",
                params![job_row, now],
            )?,
        };
        if releases {
            // A job gone without its end teaches nothing: it counts as learned at once.
            tx.exec(
                "UPDATE jobs SET finished_at = ?2, exit_status = ?3, learned = ?4 WHERE id = ?1 AND finished_at IS NULL",
                params![job_row, now, exit_status, step.is_none()],
            )?;
            tx.exec(
                "UPDATE intervals SET ended_at = ?2 WHERE job_row = ?1 AND ended_at IS NULL",
                params![job_row, now],
            )?;
            reopen_intervals(&tx, remaining, now)?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Whether the run `job_row` reported running out of memory already.
    pub fn reported_oom(&self, job_row: i64) -> Result<bool, HistoryError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT 1 FROM observations WHERE job_row = ?1 AND kind = 'oom' LIMIT 1")?;
        Ok(stmt.exists([job_row])?)
    }

    /// Records a job's report. `kind` is `progress` (with `value`) or `oom`; an out-of-memory
    /// report also marks the pair of the job's application with each partner's (both ways) so
    /// that placement never puts them together again. Returns the partners' applications.
    pub fn record_report(
        &mut self,
        job_row: i64,
        kind: &str,
        value: Option<f64>,
        partners: &[i64],
        prior: f64,
        now: f64,
    ) -> Result<Vec<String>, HistoryError> {
        let list = partners.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let insert = "INSERT INTO observations(job_row, at, kind, value, partners) VALUES (?1, ?2, ?3, ?4, ?5)";
        if kind != "oom" {
            // One statement is atomic on its own: a progress report, the most frequent call
            // of a running job, costs no transaction.
            self.write_one(insert, params![job_row, now, kind, value, list])?;
            return Ok(Vec::new());
        }
        let tx = self.write()?;
        tx.exec(insert, params![job_row, now, kind, value, list])?;
        let mut names = Vec::new();
        let mut others = Vec::new();
        let (app, model): (i64, String) =
            tx.row("SELECT app_id, gpu_model FROM jobs WHERE id = ?1", [job_row], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?;
        for &p in partners {
            let (other, name): (i64, String) = tx.row(
                "SELECT j.app_id, a.name FROM jobs j JOIN applications a ON a.id = j.app_id WHERE j.id = ?1",
                [p],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            for (x, y) in [(app, other), (other, app)] {
                tx.exec(
                    "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations, oom)
                     VALUES (?1, ?2, ?3, ?4, ?4, 0, 1)
                     ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET oom = 1",
                    params![model, x, y, prior],
                )?;
            }
            super::effects::refresh_app_means(&tx, Some((&model, other)))?;
            others.push(other);
            names.push(name);
        }
        super::effects::refresh_app_means(&tx, Some((&model, app)))?;
        others.push(app);
        let effects = super::effects::stepped_effects(&tx, &model, &others, prior, &[])?;
        super::effects::write_effects(&tx, &model, &effects)?;
        tx.commit()?;
        Ok(names)
    }
}

/// The id of application `name`, added if new.
pub(super) fn app_id(tx: &rusqlite::Transaction, name: &str) -> rusqlite::Result<i64> {
    let id = |tx: &rusqlite::Transaction| tx.row("SELECT id FROM applications WHERE name = ?1", [name], |r| r.get(0));
    // Known (nearly always: an import reads every application twice a row): no write.
    if let Some(id) = rusqlite::OptionalExtension::optional(id(tx))? {
        return Ok(id);
    }
    tx.exec("INSERT INTO applications(name) VALUES (?1)", [name])?;
    id(tx)
}

/// Closes the open intervals of `members` (the jobs now on one GPU) and opens new ones: one per
/// partner, or one with no partner for a job alone.
fn reopen_intervals(tx: &rusqlite::Transaction, members: &[i64], now: f64) -> rusqlite::Result<()> {
    for &m in members {
        tx.exec(
            "UPDATE intervals SET ended_at = ?2 WHERE job_row = ?1 AND ended_at IS NULL",
            params![m, now],
        )?;
        let partners: Vec<i64> = members.iter().copied().filter(|&p| p != m).collect();
        if partners.is_empty() {
            tx.exec(
                "INSERT INTO intervals(job_row, partner_row, started_at) VALUES (?1, NULL, ?2)",
                params![m, now],
            )?;
        }
        for p in partners {
            tx.exec(
                "INSERT INTO intervals(job_row, partner_row, partner_app_id, started_at)
                 VALUES (?1, ?2, (SELECT app_id FROM jobs WHERE id = ?2), ?3)",
                params![m, p, now],
            )?;
        }
    }
    Ok(())
}

impl ActiveJob {
    /// This job as a resident of its GPU, for the policy.
    pub fn resident(&self) -> Resident {
        Resident {
            job_id: self.job_id,
            app: self.app.clone(),
            mem_mb: self.mem_mb,
            put_back: None,
        }
    }
}
