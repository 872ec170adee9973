//! The node's interference history in SQLite (WAL, versioned migrations).
//!
//! Jobs placed on a GPU, the steps that ran in them, the intervals during which each job shared
//! its GPU with whom, and the pairwise estimates placement reads. A database that cannot be
//! opened, is corrupt, or is newer than this program is an error: it is never replaced.

use crate::placement::{PairEstimate, PairHistory, Resident};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use std::path::{Path, PathBuf};

/// Each entry upgrades the schema by one version (`PRAGMA user_version`).
const MIGRATIONS: &[&str] = &[
    // 1: the foundation.
    "CREATE TABLE applications (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE
     );
     CREATE TABLE jobs (
        id INTEGER PRIMARY KEY,
        job_id INTEGER NOT NULL,
        node TEXT NOT NULL,
        uid INTEGER NOT NULL,
        app_id INTEGER NOT NULL REFERENCES applications(id),
        gpu INTEGER NOT NULL,
        gpu_model TEXT NOT NULL,
        mem_mb INTEGER,
        owner_step INTEGER NOT NULL,
        slurm_gpus TEXT,
        decision TEXT NOT NULL,
        predicted_speed REAL NOT NULL,
        started_at REAL NOT NULL,
        finished_at REAL,
        exit_status INTEGER
     );
     -- A job id runs at most once at a time on a node (a requeued job gets a new row).
     CREATE UNIQUE INDEX jobs_active ON jobs(job_id, node) WHERE finished_at IS NULL;
     CREATE TABLE steps (
        job_row INTEGER NOT NULL REFERENCES jobs(id),
        step_id INTEGER NOT NULL,
        started_at REAL NOT NULL,
        finished_at REAL,
        exit_status INTEGER,
        PRIMARY KEY (job_row, step_id)
     );
     -- Who shared a GPU with whom, when: one row per job per partner per stretch of time
     -- (partner NULL: alone). The raw material of learning.
     CREATE TABLE intervals (
        id INTEGER PRIMARY KEY,
        job_row INTEGER NOT NULL REFERENCES jobs(id),
        partner_row INTEGER REFERENCES jobs(id),
        started_at REAL NOT NULL,
        ended_at REAL
     );
     CREATE INDEX intervals_open ON intervals(job_row) WHERE ended_at IS NULL;
     CREATE TABLE pair_estimates (
        gpu_model TEXT NOT NULL,
        app_id INTEGER NOT NULL REFERENCES applications(id),
        other_id INTEGER NOT NULL REFERENCES applications(id),
        speed REAL NOT NULL,
        other_speed REAL NOT NULL,
        observations INTEGER NOT NULL,
        variance REAL,
        oom INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (gpu_model, app_id, other_id)
     );",
    // 2: learning. How long an application's job takes alone, per GPU model.
    "CREATE TABLE solo_baselines (
        gpu_model TEXT NOT NULL,
        app_id INTEGER NOT NULL REFERENCES applications(id),
        runtime_s REAL NOT NULL,
        observations INTEGER NOT NULL,
        PRIMARY KEY (gpu_model, app_id)
     );
     CREATE INDEX jobs_by_app ON jobs(app_id, gpu_model, finished_at);
     -- Learning reads every interval of a job.
     CREATE INDEX intervals_by_job ON intervals(job_row);
     -- What runs now, read on every request: without this, a scan of the whole history.
     CREATE INDEX jobs_running ON jobs(node) WHERE finished_at IS NULL;",
    // 3: what jobs report about themselves (progress, running out of memory).
    "CREATE TABLE observations (
        id INTEGER PRIMARY KEY,
        job_row INTEGER NOT NULL REFERENCES jobs(id),
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        value REAL,
        -- The jobs sharing the GPU at that moment, comma-separated job rows.
        partners TEXT NOT NULL
     );
     CREATE INDEX observations_by_job ON observations(job_row);",
    // 4: bounded growth. An interval names its partner's application itself, so that old jobs
    // can be deleted (compacted into the estimates) while the intervals of newer jobs that
    // shared with them still say with what they shared.
    "ALTER TABLE intervals ADD COLUMN partner_app_id INTEGER REFERENCES applications(id);
     UPDATE intervals SET partner_app_id = (SELECT app_id FROM jobs WHERE jobs.id = intervals.partner_row)
      WHERE partner_row IS NOT NULL;",
    // 5: GPU telemetry per job (NVML): peak memory and mean SM utilisation of its processes.
    "CREATE TABLE job_telemetry (
        job_row INTEGER PRIMARY KEY REFERENCES jobs(id),
        samples INTEGER NOT NULL,
        mem_peak_mb INTEGER,
        sm_util_sum REAL NOT NULL,
        sm_util_samples INTEGER NOT NULL
     );
     -- The GPU memory an application's latest measured runs peaked at, refreshed as jobs end.
     -- Each application's mean learned speed beside others (placement's estimate for pairs
     -- never seen), refreshed whenever its estimates change.
     CREATE TABLE app_means (
        gpu_model TEXT NOT NULL,
        app_id INTEGER NOT NULL REFERENCES applications(id),
        mean REAL NOT NULL,
        pairs INTEGER NOT NULL,
        PRIMARY KEY (gpu_model, app_id)
     );
     CREATE TABLE app_memory (
        app_id INTEGER PRIMARY KEY REFERENCES applications(id),
        peak_mb INTEGER NOT NULL
     );",
    // 6: what placement knows of an application for pairs never seen: how many of its pairs
    // ran out of memory, and how it slows others (estimates by partner need an index).
    "ALTER TABLE app_means ADD COLUMN ooms INTEGER NOT NULL DEFAULT 0;
     CREATE INDEX pair_estimates_by_other ON pair_estimates(gpu_model, other_id);",
    // 7: what placement knows of an application beside partners it was never seen with: the
    // joint additive fit of all learned speeds on a model (`learn::fit_effects`), kept up to
    // date as they change (`learn::effect` steps for the applications concerned; refitted whole
    // by an import). Replaces the plain mean of `app_means` and the per-query average
    // of partners' differences (both misled by which partners an application happened to meet).
    "CREATE TABLE app_effects (
        gpu_model TEXT NOT NULL,
        app_id INTEGER NOT NULL REFERENCES applications(id),
        base REAL NOT NULL,
        base_pairs INTEGER NOT NULL,
        impact REAL NOT NULL,
        impact_pairs INTEGER NOT NULL,
        PRIMARY KEY (gpu_model, app_id)
     );",
];

/// The migration that creates `app_effects`: an existing history's are fitted right after it.
const EFFECTS_MIGRATION: usize = 7;

/// Past this size of the WAL file, the background checkpoint waits for the writes to pause.
const WAL_LIMIT: u64 = 64 * 1024 * 1024;

/// How many of an application's latest finished jobs its speeds are fitted from (and how
/// many [`History::compact`] keeps, at least).
pub const LEARN_WINDOW: i64 = 200;

/// A running job's progress reports teach the speed beside a partner until the pair has this
/// many equations (see [`History::learn_from_progress`]).
pub const LEARN_ON_REPORTS_UNTIL: i64 = 3;

/// The solo baseline is a running mean over at most this many runs (later runs weigh more).
const SOLO_WINDOW: i64 = 20;

/// What one finished job taught the history.
#[derive(Debug, Clone, PartialEq)]
pub enum Learned {
    /// Nothing: the job failed, or was not found.
    Nothing(&'static str),
    /// It ran alone: the application's solo runtime is now `runtime_s` (from `runs` runs),
    /// and its speeds beside others were fitted again.
    Solo {
        runtime_s: f64,
        runs: i64,
        fits: Vec<crate::learn::Fit>,
    },
    /// It shared its GPU: the application's speeds beside its partners.
    Shared { fits: Vec<crate::learn::Fit> },
    /// It shared, but the application has no solo runtime yet to compare with.
    NoBaseline,
}

/// A history problem; the text says which file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("cannot open the history database {path}: {source}")]
    Open { path: PathBuf, source: rusqlite::Error },
    #[error("the history database {path} is corrupt ({detail}); it was left as is: move it away to start a new history, or restore a backup")]
    Corrupt { path: PathBuf, detail: String },
    #[error("the history database {path} has schema version {found}, newer than this multiplexd ({known}); it was left as is")]
    TooNew { path: PathBuf, found: i64, known: usize },
    #[error("history database: {0}")]
    Sql(#[from] rusqlite::Error),
}

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

/// `execute` and `query_row` through the connection's statement cache: the history runs the
/// same few statements for every request, and parsing them each time cost more than running
/// them.
trait Cached {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn row<T, P: rusqlite::Params, F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>>(
        &self,
        sql: &str,
        params: P,
        f: F,
    ) -> rusqlite::Result<T>;
}

impl Cached for Connection {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }
    fn row<T, P: rusqlite::Params, F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>>(
        &self,
        sql: &str,
        params: P,
        f: F,
    ) -> rusqlite::Result<T> {
        self.prepare_cached(sql)?.query_row(params, f)
    }
}

/// How many prepared statements each connection keeps (rusqlite's default, 16, is fewer than
/// the history uses).
const STATEMENT_CACHE: usize = 64;

/// The columns of an [`ActiveJob`], read by [`active_job`], then any extra columns given; a
/// WHERE clause follows. A macro, so that the queries built on it are literals: no SQL is
/// formatted per request.
macro_rules! active_job_sql {
    ($($extra:literal)?) => {
        concat!(
            "SELECT j.id, j.job_id, j.uid, a.name, j.gpu, j.mem_mb, j.owner_step, j.started_at,
                j.decision, j.predicted_speed",
            $(", ", $extra,)?
            " FROM jobs j JOIN applications a ON a.id = j.app_id"
        )
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

/// The open SQLite history.
pub struct History {
    conn: Connection,
}

impl History {
    /// Opens (creating if absent) and migrates the database at `path`.
    pub fn open(path: &Path) -> Result<History, HistoryError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| HistoryError::Open {
                path: path.to_path_buf(),
                source: rusqlite::Error::InvalidPath(PathBuf::from(format!("{}: {e}", dir.display()))),
            })?;
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags).map_err(|source| HistoryError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let corrupt = |detail: String| HistoryError::Corrupt {
            path: path.to_path_buf(),
            detail,
        };
        // A file that is not a database fails here, before anything is written to it.
        let check: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| corrupt(e.to_string()))?;
        if check != "ok" {
            return Err(corrupt(check));
        }
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // NORMAL in WAL mode: a committed transaction survives a crash of the process.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let mut history = History { conn };
        history.migrate(path)?;
        Ok(history)
    }

    fn migrate(&mut self, path: &Path) -> Result<(), HistoryError> {
        let version: i64 = self.conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version as usize > MIGRATIONS.len() {
            return Err(HistoryError::TooNew {
                path: path.to_path_buf(),
                found: version,
                known: MIGRATIONS.len(),
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = self.conn.transaction()?;
            tx.execute_batch(sql)?;
            if i + 1 == EFFECTS_MIGRATION {
                // With the default prior: the next change on each model refits with the
                // configured one.
                refit_effects(&tx, crate::config::DEFAULT_UNKNOWN_PAIR_SPEED)?;
            }
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
            tx.commit()?;
        }
        Ok(())
    }

    /// Refits what is known of each application beside partners never seen with it from every
    /// learned speed, with `prior` (`policy.unknown_pair_speed`): for tools that write pair
    /// estimates straight into the database (the daemon itself keeps the fit up to date).
    pub fn refit_effects(&mut self, prior: f64) -> Result<(), HistoryError> {
        let tx = self.conn.transaction()?;
        refit_effects(&tx, prior)?;
        tx.commit()?;
        Ok(())
    }

    /// The schema version in use.
    pub fn schema_version(&self) -> Result<i64, HistoryError> {
        Ok(self.conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    fn app_id(tx: &rusqlite::Transaction, name: &str) -> rusqlite::Result<i64> {
        tx.exec(
            "INSERT INTO applications(name) VALUES (?1) ON CONFLICT(name) DO NOTHING",
            [name],
        )?;
        tx.row("SELECT id FROM applications WHERE name = ?1", [name], |r| r.get(0))
    }

    /// Jobs placed on this node and not finished, oldest first.
    pub fn active_jobs(&self, node: &str) -> Result<Vec<ActiveJob>, HistoryError> {
        let mut stmt = self.conn.prepare_cached(concat!(
            active_job_sql!(),
            " WHERE j.node = ?1 AND j.finished_at IS NULL ORDER BY j.id"
        ))?;
        let rows = stmt.query_map([node], active_job)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The running job `job_id` on `node`, and the rows of the jobs sharing its GPU (one
    /// query: a running job's every progress report asks this).
    pub fn running_job(&self, node: &str, job_id: u32) -> Result<Option<(ActiveJob, Vec<i64>)>, HistoryError> {
        let mut stmt = self.conn.prepare_cached(concat!(
            active_job_sql!("p.id"),
            " LEFT JOIN jobs p ON p.node = j.node AND p.finished_at IS NULL AND p.gpu = j.gpu AND p.id != j.id
             WHERE j.job_id = ?1 AND j.node = ?2 AND j.finished_at IS NULL ORDER BY p.id"
        ))?;
        let mut rows = stmt.query(params![job_id, node])?;
        let mut found: Option<(ActiveJob, Vec<i64>)> = None;
        while let Some(r) = rows.next()? {
            let partner: Option<i64> = r.get(10)?;
            let (_, partners) = match &mut found {
                Some(f) => f,
                None => found.insert((active_job(r)?, Vec::new())),
            };
            partners.extend(partner);
        }
        Ok(found)
    }

    /// How many jobs run on `node` (what [`Self::active_jobs`] would list, counted).
    pub fn active_count(&self, node: &str) -> Result<u32, HistoryError> {
        Ok(self.conn.row(
            "SELECT count(*) FROM jobs WHERE node = ?1 AND finished_at IS NULL",
            [node],
            |r| r.get(0),
        )?)
    }

    /// Records a new job on a GPU, its first step, and the sharing intervals that change:
    /// every resident of that GPU closes its current interval and opens one per partner.
    pub fn record_placement(&mut self, job: &NewJob, residents: &[i64]) -> Result<i64, HistoryError> {
        let tx = self.conn.transaction()?;
        let app_id = Self::app_id(&tx, job.app)?;
        tx.exec(
            "INSERT INTO jobs(job_id, node, uid, app_id, gpu, gpu_model, mem_mb, owner_step, slurm_gpus,
                              decision, predicted_speed, started_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
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
        self.conn.exec(
            "INSERT INTO steps(job_row, step_id, started_at) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
            params![job_row, step_id, now],
        )?;
        Ok(())
    }

    /// Records a step's end; when it is the step that holds the GPU, the job ends too and its
    /// former co-runners' intervals are reopened without it.
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
        let tx = self.conn.transaction()?;
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
            tx.exec(
                "UPDATE jobs SET finished_at = ?2, exit_status = ?3 WHERE id = ?1 AND finished_at IS NULL",
                params![job_row, now, exit_status],
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

    /// Learns from the finished job `job_row`: its solo runtime if it ran alone, and the
    /// pairwise speeds of its application from its latest jobs (see [`crate::learn`]).
    /// Estimates are written for both sides of each pair. Jobs that failed teach nothing (their
    /// runtime is not one run's work), nor do stretches with more than one partner at once.
    pub fn learn_from(&mut self, job_row: i64, prior: f64) -> Result<Learned, HistoryError> {
        let tx = self.conn.transaction()?;
        type JobRow = (i64, String, f64, Option<f64>, Option<i32>);
        let job: Option<JobRow> = tx
            .row(
                "SELECT app_id, gpu_model, started_at, finished_at, exit_status FROM jobs WHERE id = ?1",
                [job_row],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .optional()?;
        let Some((app_id, model, started, Some(finished), exit)) = job else {
            return Ok(Learned::Nothing("the job has not finished here"));
        };
        if exit != Some(0) {
            return Ok(Learned::Nothing("the job failed"));
        }
        let this = equation(intervals_of(&tx, job_row)?.into_iter());
        let mut solo = None;
        if let Some(eq) = &this {
            if eq.shared.is_empty() {
                let runtime = finished - started;
                let old: Option<(f64, i64)> = tx
                    .row(
                        "SELECT runtime_s, observations FROM solo_baselines WHERE gpu_model = ?1 AND app_id = ?2",
                        params![model, app_id],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )
                    .optional()?;
                let (mean, runs) = match old {
                    Some((m, n)) => {
                        let w = n.min(SOLO_WINDOW - 1) as f64;
                        ((m * w + runtime) / (w + 1.0), n + 1)
                    }
                    None => (runtime, 1),
                };
                tx.exec(
                    "INSERT INTO solo_baselines(gpu_model, app_id, runtime_s, observations) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT(gpu_model, app_id) DO UPDATE SET runtime_s = ?3, observations = ?4",
                    params![model, app_id, mean, runs],
                )?;
                solo = Some((mean, runs));
            }
        }
        let Some((equations, reported)) = equations_of(&tx, app_id, &model, job_row)? else {
            tx.commit()?;
            return Ok(Learned::NoBaseline);
        };
        // A new solo runtime or rate alone changes every speed; a shared run without reports
        // only those linked to its partners.
        let partners: Option<Vec<String>> = match (&solo, &this) {
            (None, Some(eq)) if !reported => Some(eq.shared.iter().map(|(p, _)| p.clone()).collect()),
            _ => None,
        };
        let fits = crate::learn::fit(&equations, prior, partners.as_deref());
        store_fits(&tx, &model, app_id, prior, &fits)?;
        tx.commit()?;
        Ok(match solo {
            Some((runtime_s, runs)) => Learned::Solo { runtime_s, runs, fits },
            None => Learned::Shared { fits },
        })
    }

    /// Learns from a progress report of the running job `job_row` while it shares its GPU:
    /// the speeds of its application beside its current partners' applications, from the
    /// stretches between reports so far (of this job and of the application's latest jobs),
    /// so that a pair is known after one report interval instead of when a job of the pair
    /// ends. Only while a pair has fewer than [`LEARN_ON_REPORTS_UNTIL`] equations: after
    /// that, learning at job ends keeps it up to date.
    pub fn learn_from_progress(&mut self, job_row: i64, prior: f64) -> Result<Learned, HistoryError> {
        let tx = self.conn.transaction()?;
        let job: Option<(i64, String)> = tx
            .row(
                "SELECT app_id, gpu_model FROM jobs WHERE id = ?1 AND finished_at IS NULL",
                [job_row],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        let Some((app_id, model)) = job else {
            return Ok(Learned::Nothing("the job is not running here"));
        };
        let partners: Vec<(String, Option<i64>)> = tx
            .prepare_cached(
                "SELECT a.name, e.observations FROM intervals i
                 JOIN applications a ON a.id = i.partner_app_id
                 LEFT JOIN pair_estimates e ON e.gpu_model = ?2 AND e.app_id = ?3 AND e.other_id = i.partner_app_id
                 WHERE i.job_row = ?1 AND i.ended_at IS NULL",
            )?
            .query_map(params![job_row, model, app_id], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        let unsure: Vec<String> = partners
            .into_iter()
            .filter(|(_, n)| n.unwrap_or(0) < LEARN_ON_REPORTS_UNTIL)
            .map(|(p, _)| p)
            .collect();
        if unsure.is_empty() {
            return Ok(Learned::Nothing("it runs alone, or beside partners known well enough"));
        }
        let Some((equations, _)) = equations_of(&tx, app_id, &model, job_row)? else {
            return Ok(Learned::NoBaseline);
        };
        let fits = crate::learn::fit(&equations, prior, Some(&unsure));
        store_fits(&tx, &model, app_id, prior, &fits)?;
        tx.commit()?;
        Ok(Learned::Shared { fits })
    }

    /// Deletes the raw rows (job, steps, intervals, reports) of finished jobs beyond the latest
    /// `keep` of each application and GPU model: what they taught lives on in the solo
    /// runtimes and pair estimates, and learning only reads the latest jobs anyway. Intervals
    /// of kept jobs that shared with a deleted one keep its application. Returns how many
    /// jobs were deleted.
    pub fn compact(&mut self, keep: i64) -> Result<usize, HistoryError> {
        let tx = self.conn.transaction()?;
        tx.execute_batch("CREATE TEMP TABLE IF NOT EXISTS doomed(id INTEGER PRIMARY KEY); DELETE FROM temp.doomed;")?;
        let n = tx.exec(
            "INSERT INTO temp.doomed(id) SELECT id FROM (
                SELECT id, row_number() OVER (PARTITION BY app_id, gpu_model ORDER BY finished_at DESC, id DESC) AS k
                FROM jobs WHERE finished_at IS NOT NULL) WHERE k > ?1",
            [keep],
        )?;
        if n > 0 {
            tx.execute_batch(
                "UPDATE intervals SET partner_row = NULL WHERE partner_row IN (SELECT id FROM temp.doomed);
                 DELETE FROM intervals WHERE job_row IN (SELECT id FROM temp.doomed);
                 DELETE FROM steps WHERE job_row IN (SELECT id FROM temp.doomed);
                 DELETE FROM observations WHERE job_row IN (SELECT id FROM temp.doomed);
                 DELETE FROM job_telemetry WHERE job_row IN (SELECT id FROM temp.doomed);
                 DELETE FROM jobs WHERE id IN (SELECT id FROM temp.doomed);",
            )?;
        }
        tx.execute_batch("DELETE FROM temp.doomed;")?;
        tx.commit()?;
        Ok(n)
    }

    /// Adds one telemetry sample of a job: the memory of its GPU processes together, and
    /// their SM utilisation together when the driver reports it.
    pub fn record_job_sample(
        &mut self,
        job_row: i64,
        mem_mb: Option<u64>,
        sm_util_pct: Option<u32>,
    ) -> Result<(), HistoryError> {
        self.conn.exec(
            "INSERT INTO job_telemetry(job_row, samples, mem_peak_mb, sm_util_sum, sm_util_samples)
             VALUES (?1, 1, ?2, coalesce(?3, 0), ?3 IS NOT NULL)
             ON CONFLICT(job_row) DO UPDATE SET samples = samples + 1,
               mem_peak_mb = max(coalesce(mem_peak_mb, 0), coalesce(?2, 0)),
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
            self.conn.exec(insert, params![job_row, now, kind, value, list])?;
            return Ok(Vec::new());
        }
        let tx = self.conn.transaction()?;
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
            refresh_app_means(&tx, Some((&model, other)))?;
            others.push(other);
            names.push(name);
        }
        refresh_app_means(&tx, Some((&model, app)))?;
        others.push(app);
        update_effects(&tx, &model, &others, prior)?;
        tx.commit()?;
        Ok(names)
    }

    /// Moves WAL checkpoints (which write the database file and sync it) off the request path:
    /// this connection stops checkpointing on commit, and a thread of its own checkpoints
    /// every second until `shutdown`. If that thread cannot open the database, nothing changes.
    pub fn checkpoint_in_background(
        &self,
        path: &Path,
        shutdown: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<(), HistoryError> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| HistoryError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        let mut wal = path.as_os_str().to_owned();
        wal.push("-wal");
        let wal = PathBuf::from(wal);
        let mut trouble = crate::background::Trouble::default();
        crate::background::every("checkpoint", std::time::Duration::from_secs(1), shutdown, move || {
            // A passive checkpoint never waits for the daemon's writes, but under unbroken
            // load it never completes either and the WAL only grows: past WAL_LIMIT, one
            // checkpoint waits for a pause in the writes and truncates.
            let big = std::fs::metadata(&wal).is_ok_and(|m| m.len() > WAL_LIMIT);
            let sql = if big {
                "PRAGMA wal_checkpoint(TRUNCATE)"
            } else {
                "PRAGMA wal_checkpoint(PASSIVE)"
            };
            match conn.query_row(sql, [], |r| r.get::<_, i64>(0)) {
                Ok(_) => {
                    if trouble.recovered() {
                        tracing::info!("history checkpoints work again");
                    }
                }
                Err(e) => {
                    if trouble.failed(&e.to_string()) {
                        tracing::warn!(error = %e, "history checkpoint failed; retrying every second");
                    }
                }
            }
        })
        .map_err(|e| HistoryError::Open {
            path: path.to_path_buf(),
            source: rusqlite::Error::InvalidPath(PathBuf::from(format!("checkpoint thread: {e}"))),
        })?;
        self.conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        Ok(())
    }

    /// The connection, for read-only queries by tools and tests.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The connection, for the import of another node's history.
    pub(crate) fn connection_mut(&mut self) -> &mut Connection {
        &mut self.conn
    }
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

/// An application's mean learned speed over its pairs that ran, how many those are, and how
/// many of its pairs ran out of memory (grouped by the caller). Placement reads the counts
/// (an application's risk of running out of memory); what it expects of an application beside
/// partners never seen with it comes from `app_effects`, not from this mean.
const APP_MEANS: &str = "SELECT gpu_model, app_id,
       coalesce(avg(CASE WHEN observations > 0 AND oom = 0 THEN speed END), 0),
       count(CASE WHEN observations > 0 AND oom = 0 THEN 1 END), count(CASE WHEN oom = 1 THEN 1 END)
     FROM pair_estimates";

/// Recomputes `app_means` for one application on one model, or (`None`) for all.
pub(crate) fn refresh_app_means(tx: &rusqlite::Transaction, only: Option<(&str, i64)>) -> rusqlite::Result<()> {
    // Plain equalities (not `?1 IS NULL OR ...`) so that the primary keys are used.
    match only {
        Some((model, app)) => {
            tx.exec(
                "DELETE FROM app_means WHERE gpu_model = ?1 AND app_id = ?2",
                params![model, app],
            )?;
            tx.exec(
                &format!(
                    "INSERT INTO app_means(gpu_model, app_id, mean, pairs, ooms) {APP_MEANS}
                          WHERE gpu_model = ?1 AND app_id = ?2 GROUP BY gpu_model, app_id"
                ),
                params![model, app],
            )?;
        }
        None => {
            tx.execute_batch(&format!(
                "DELETE FROM app_means;
                 INSERT INTO app_means(gpu_model, app_id, mean, pairs, ooms) {APP_MEANS}
                 GROUP BY gpu_model, app_id;"
            ))?;
        }
    }
    Ok(())
}

/// Refits `app_effects` whole from the learned speeds of every GPU model, with `prior` as the
/// speed effects are counted from (after an import, or when the table is new). The migration
/// that creates the table uses the default prior; a site's own `unknown_pair_speed` takes over
/// as applications learn.
pub(crate) fn refit_effects(tx: &rusqlite::Transaction, prior: f64) -> rusqlite::Result<()> {
    tx.exec("DELETE FROM app_effects", [])?;
    let models: Vec<String> = {
        let mut stmt = tx.prepare_cached("SELECT DISTINCT gpu_model FROM pair_estimates")?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for model in models {
        let learned: Vec<(i64, i64, f64)> = {
            let mut stmt = tx.prepare_cached(
                "SELECT app_id, other_id, speed FROM pair_estimates
                 WHERE gpu_model = ?1 AND observations > 0 AND oom = 0",
            )?;
            let rows = stmt.query_map([&model], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            rows.collect::<Result<_, _>>()?
        };
        let mut ids: Vec<i64> = learned.iter().flat_map(|&(a, b, _)| [a, b]).collect();
        ids.sort_unstable();
        ids.dedup();
        let index = |id: i64| ids.binary_search(&id).expect("collected above");
        let speeds: Vec<(usize, usize, f64)> = learned.iter().map(|&(a, b, y)| (index(a), index(b), y)).collect();
        let effects = crate::learn::fit_effects(ids.len(), &speeds, prior);
        let mut insert = tx.prepare_cached(
            "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?;
        for (k, id) in ids.iter().enumerate() {
            let ((base, base_pairs), (impact, impact_pairs)) = (effects.base[k], effects.impact[k]);
            insert.execute(params![model, id, base, base_pairs, impact, impact_pairs])?;
        }
    }
    Ok(())
}

/// After the estimates of `apps` changed on `model`: coordinate steps of the effects fit
/// ([`crate::learn::effect`]) for those applications, each side twice, reading only their
/// own pairs (the whole fit would read every pair of the model on every finished job).
pub(crate) fn update_effects(
    tx: &rusqlite::Transaction,
    model: &str,
    apps: &[i64],
    prior: f64,
) -> rusqlite::Result<()> {
    let mut apps = apps.to_vec();
    apps.sort_unstable();
    apps.dedup();
    // One side of an application: how many of its learned speeds there are on that side and
    // the sum of what the rest of the model leaves of them (`residual`; `?3` is the prior),
    // with the effects of the other side's applications joined on `other`.
    let leftover = |app: i64, residual: &str, side: &str, other: &str| -> rusqlite::Result<(u32, f64)> {
        tx.row(
            &format!(
                "SELECT count(*), total({residual}) FROM pair_estimates p
                 LEFT JOIN app_effects e ON e.gpu_model = p.gpu_model AND e.app_id = p.{other}
                 WHERE p.gpu_model = ?1 AND p.{side} = ?2 AND p.observations > 0 AND p.oom = 0"
            ),
            params![model, app, prior],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
    };
    for _ in 0..2 {
        for &app in &apps {
            // This application's side: what the prior and its partners' impacts leave.
            let (n, rest) = leftover(app, "p.speed - ?3 - coalesce(e.impact, 0)", "app_id", "other_id")?;
            tx.exec(
                "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
                 VALUES (?1, ?2, ?3, ?4, 0, 0)
                 ON CONFLICT(gpu_model, app_id) DO UPDATE SET base = ?3, base_pairs = ?4",
                params![model, app, prior + crate::learn::effect(rest, n), n],
            )?;
        }
        for &app in &apps {
            // Its effect on partners: what their own expected speeds leave.
            let (n, rest) = leftover(app, "p.speed - coalesce(e.base, ?3)", "other_id", "app_id")?;
            tx.exec(
                "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
                 VALUES (?1, ?2, ?4, 0, ?3, ?5)
                 ON CONFLICT(gpu_model, app_id) DO UPDATE SET impact = ?3, impact_pairs = ?5",
                params![model, app, crate::learn::effect(rest, n), prior, n],
            )?;
        }
    }
    Ok(())
}

/// One interval of a job: start, end (`None` while open), partner application (`None`: alone).
type IntervalRow = (f64, Option<f64>, Option<String>);

/// The intervals of the job `job_row`, in time order.
fn intervals_of(tx: &rusqlite::Transaction, job_row: i64) -> rusqlite::Result<Vec<IntervalRow>> {
    let mut stmt = tx.prepare_cached(
        "SELECT i.started_at, i.ended_at, a.name FROM intervals i
         LEFT JOIN applications a ON a.id = i.partner_app_id
         WHERE i.job_row = ?1 ORDER BY i.started_at",
    )?;
    let rows = stmt.query_map([job_row], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    rows.collect()
}

/// The equations of a job's stretches between progress reports (`(at, done)` in time order;
/// the job's start counts as done 0): the progress made in each, and the time alone and beside
/// each partner within it (`work_s` is left for the caller, who knows the rate alone).
/// Stretches with several partners at once are left out.
fn progress_stretches(intervals: &[IntervalRow], reports: &[(i64, f64, f64)]) -> Vec<(f64, crate::learn::Equation)> {
    let Some(&(start, _, _)) = intervals.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let (mut t0, mut d0) = (start, 0.0);
    for &(_, t1, d1) in reports {
        if t1 <= t0 {
            continue;
        }
        let clipped = intervals.iter().filter_map(|(s, e, p)| {
            // An interval still open (a running job's) lasts at least to this report.
            let (s, e) = ((*s).max(t0), e.map_or(t1, |e| e.min(t1)));
            (e > s).then(|| (s, Some(e), p.clone()))
        });
        if let Some(eq) = equation(clipped) {
            out.push((d1 - d0, eq));
        }
        (t0, d0) = (t1, d1);
    }
    out
}

/// The learning equations of application `app_id` on `model` from its latest jobs (finished
/// and completed, or still running), and whether the job `job_row` reported progress; `None`
/// when there is nothing to measure work by yet (no solo runtime, no stretch run alone).
fn equations_of(
    tx: &rusqlite::Transaction,
    app_id: i64,
    model: &str,
    job_row: i64,
) -> rusqlite::Result<Option<(Vec<crate::learn::Equation>, bool)>> {
    let baseline: Option<f64> = tx
        .row(
            "SELECT runtime_s FROM solo_baselines WHERE gpu_model = ?1 AND app_id = ?2",
            params![model, app_id],
            |r| r.get(0),
        )
        .optional()?;
    // Every interval and progress report of the application's latest jobs, in two queries.
    // Running jobs come first: only their stretches between reports count. (The window is
    // written into the SQL, not bound: SQLite re-prepares a statement each time a LIMIT
    // parameter is bound, which cost a sixth of a large simulation's time.)
    let window = format!(
        "SELECT id FROM jobs WHERE app_id = ?1 AND gpu_model = ?2
         AND (finished_at IS NULL OR exit_status = 0)
         ORDER BY finished_at IS NULL DESC, finished_at DESC LIMIT {LEARN_WINDOW}"
    );
    let rows: Vec<(i64, IntervalRow)> = tx
        .prepare_cached(&format!(
            "SELECT i.job_row, i.started_at, i.ended_at, a.name FROM intervals i
             LEFT JOIN applications a ON a.id = i.partner_app_id
             WHERE i.job_row IN ({window}) ORDER BY i.job_row, i.started_at"
        ))?
        .query_map(params![app_id, model], |r| {
            Ok((r.get(0)?, (r.get(1)?, r.get(2)?, r.get(3)?)))
        })?
        .collect::<Result<_, _>>()?;
    let reports: Vec<(i64, f64, f64)> = tx
        .prepare_cached(&format!(
            "SELECT job_row, at, value FROM observations
             WHERE kind = 'progress' AND value IS NOT NULL AND job_row IN ({window})
             ORDER BY job_row, at"
        ))?
        .query_map(params![app_id, model], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<Result<_, _>>()?;
    let reported = |job: i64| {
        let from = reports.partition_point(|r| r.0 < job);
        let to = reports.partition_point(|r| r.0 <= job);
        &reports[from..to]
    };
    // Jobs that report progress give one equation per stretch between reports (their
    // total work need not be the solo runtime); the others one equation each.
    let mut whole: Vec<crate::learn::Equation> = Vec::new();
    let mut stretches: Vec<(f64, crate::learn::Equation)> = Vec::new();
    for job in rows.chunk_by(|a, b| a.0 == b.0) {
        let intervals: Vec<IntervalRow> = job.iter().map(|(_, r)| r.clone()).collect();
        let progress = reported(job[0].0);
        if progress.is_empty() {
            if let (Some(solo), Some(mut eq)) = (baseline, equation(intervals.into_iter())) {
                eq.work_s = solo;
                whole.push(eq);
            }
        } else {
            stretches.extend(progress_stretches(&intervals, progress));
        }
    }
    // The application's rate alone, in its own unit, from the stretches it ran alone.
    let (done_alone, secs_alone) = stretches
        .iter()
        .filter(|(_, e)| e.shared.is_empty() && e.alone_s > 0.0)
        .fold((0.0, 0.0), |(d, t), (done, e)| (d + done, t + e.alone_s));
    let rate = (secs_alone > 0.0 && done_alone > 0.0).then(|| done_alone / secs_alone);
    if baseline.is_none() && rate.is_none() {
        return Ok(None);
    }
    let mut equations = whole;
    if let Some(rate) = rate {
        equations.extend(stretches.into_iter().map(|(done, mut e)| {
            e.work_s = done / rate;
            e
        }));
    }
    Ok(Some((equations, !reported(job_row).is_empty())))
}

/// Writes fitted speeds of application `app_id` on `model`, both sides of each pair, and
/// refreshes the application's means.
fn store_fits(
    tx: &rusqlite::Transaction,
    model: &str,
    app_id: i64,
    prior: f64,
    fits: &[crate::learn::Fit],
) -> rusqlite::Result<()> {
    let mut touched = vec![app_id];
    for f in fits {
        let other_id: i64 = tx.row("SELECT id FROM applications WHERE name = ?1", [&f.partner], |r| {
            r.get(0)
        })?;
        touched.push(other_id);
        tx.exec(
            "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations, variance)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET speed = ?4, observations = ?6, variance = ?7",
            params![model, app_id, other_id, f.speed, prior, f.observations, f.variance],
        )?;
        // The partner's row sees this side as `other_speed`; its own speed stays unlearned
        // (observations 0) until a job of the partner's application finishes.
        tx.exec(
            "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations)
             VALUES (?1, ?2, ?3, ?4, ?5, 0)
             ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET other_speed = ?5",
            params![model, other_id, app_id, prior, f.speed],
        )?;
    }
    refresh_app_means(tx, Some((model, app_id)))?;
    update_effects(tx, model, &touched, prior)
}

/// The learning equation of a finished job from its intervals in time order: seconds alone
/// and seconds beside each partner application; `None` when a stretch had several partners at
/// once (the linear model does not hold there) or an interval is still open.
fn equation(rows: impl Iterator<Item = IntervalRow>) -> Option<crate::learn::Equation> {
    let mut eq = crate::learn::Equation {
        work_s: 0.0,
        alone_s: 0.0,
        shared: Vec::new(),
    };
    // Partner rows of one stretch share its start: two of them mean two partners at once.
    let mut last_partner_start = f64::NAN;
    for (start, end, partner) in rows {
        let end = end?;
        if end <= start {
            continue; // membership changed twice at one instant
        }
        if partner.is_some() {
            if start == last_partner_start {
                return None;
            }
            last_partner_start = start;
        }
        let t = end - start;
        match partner {
            None => eq.alone_s += t,
            Some(p) => match eq.shared.iter_mut().find(|(q, _)| *q == p) {
                Some((_, acc)) => *acc += t,
                None => eq.shared.push((p, t)),
            },
        }
    }
    Some(eq)
}

impl PairHistory for History {
    fn app_mean(&self, model: &str, app: &str) -> Option<(f64, u32)> {
        self.effect(
            model,
            app,
            "SELECT e.base, e.base_pairs FROM app_effects e JOIN applications a ON a.id = e.app_id
             WHERE e.gpu_model = ?1 AND a.name = ?2",
        )
    }

    fn app_ooms(&self, model: &str, app: &str) -> (u32, u32) {
        let mut stmt = match self.conn.prepare_cached(
            "SELECT m.ooms, m.pairs + m.ooms FROM app_means m JOIN applications a ON a.id = m.app_id
             WHERE m.gpu_model = ?1 AND a.name = ?2",
        ) {
            Ok(s) => s,
            Err(_) => return (0, 0),
        };
        stmt.query_row(params![model, app], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap_or((0, 0))
    }

    fn app_impact(&self, model: &str, app: &str) -> Option<(f64, u32)> {
        self.effect(
            model,
            app,
            "SELECT e.impact, e.impact_pairs FROM app_effects e JOIN applications a ON a.id = e.app_id
             WHERE e.gpu_model = ?1 AND a.name = ?2",
        )
    }

    fn pair(&self, model: &str, app: &str, other: &str) -> Option<PairEstimate> {
        self.pair_uncached(model, app, other)
    }
}

impl History {
    /// One application's row of `app_effects` on a model, by the query given.
    fn effect(&self, model: &str, app: &str, sql: &str) -> Option<(f64, u32)> {
        let mut stmt = self.conn.prepare_cached(sql).ok()?;
        stmt.query_row(params![model, app], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()
            .ok()
            .flatten()
    }
}

impl History {
    fn pair_uncached(&self, model: &str, app: &str, other: &str) -> Option<PairEstimate> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT e.speed, e.other_speed, e.observations, e.oom FROM pair_estimates e
                 JOIN applications a ON a.id = e.app_id JOIN applications o ON o.id = e.other_id
                 WHERE e.gpu_model = ?1 AND a.name = ?2 AND o.name = ?3",
            )
            .ok()?;
        stmt.query_row(params![model, app, other], |r| {
            Ok(PairEstimate {
                speed: r.get(0)?,
                other_speed: r.get(1)?,
                observations: r.get(2)?,
                oom: r.get(3)?,
            })
        })
        .optional()
        .ok()
        .flatten()
    }
}

impl ActiveJob {
    /// This job as a resident of its GPU, for the policy.
    pub fn resident(&self) -> Resident {
        Resident {
            job_id: self.job_id,
            app: self.app.clone(),
            mem_mb: self.mem_mb,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job<'a>(job_id: u32, app: &'a str, gpu: u32, now: f64) -> NewJob<'a> {
        NewJob {
            job_id,
            node: "n1",
            uid: 0,
            app,
            gpu,
            gpu_model: "v100",
            mem_mb: Some(100),
            owner_step: 0,
            slurm_gpus: Some("0"),
            decision: "test",
            predicted_speed: 1.0,
            now,
        }
    }

    #[test]
    fn a_history_from_before_app_effects_gets_them_fitted_when_opened() {
        use crate::placement::PairHistory;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.sqlite");
        {
            // What schema 6 held: learned speeds, both sides of a pair and an unlearned side.
            let h = History::open(&path).unwrap();
            h.connection()
                .execute_batch(
                    "INSERT INTO applications(id, name) VALUES (1, 'a'), (2, 'b'), (3, 'c');
                     INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations)
                     VALUES ('v100', 1, 2, 0.5, 0.9, 2), ('v100', 2, 1, 0.9, 0.5, 1),
                            ('v100', 3, 1, 0.7, 0.4, 0);
                     DROP TABLE app_effects;
                     PRAGMA user_version = 6;",
                )
                .unwrap();
        }
        let h = History::open(&path).unwrap();
        assert_eq!(h.schema_version().unwrap(), MIGRATIONS.len() as i64);
        let speeds = [(0, 1, 0.5), (1, 0, 0.9)];
        let want = crate::learn::fit_effects(2, &speeds, crate::config::DEFAULT_UNKNOWN_PAIR_SPEED);
        assert_eq!(h.app_mean("v100", "a"), Some(want.base[0]));
        assert_eq!(h.app_impact("v100", "b"), Some(want.impact[1]));
        // c's only row was never learned: nothing is known of it.
        assert_eq!(h.app_mean("v100", "c"), None);
        assert_eq!(h.app_mean("a100", "a"), None);
    }

    #[test]
    fn placement_finish_and_intervals() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.sqlite");
        let mut h = History::open(&path).unwrap();
        assert_eq!(h.schema_version().unwrap(), MIGRATIONS.len() as i64);
        let a = h.record_placement(&job(10, "bert", 0, 100.0), &[]).unwrap();
        let b = h.record_placement(&job(11, "resnet", 0, 150.0), &[a]).unwrap();
        h.record_finish(b, 0, 0, true, &[a], 200.0).unwrap();
        let active = h.active_jobs("n1").unwrap();
        assert_eq!(active.len(), 1);
        assert_eq!(active[0].job_id, 10);
        // a: alone 100-150, with b 150-200, alone from 200 (open). b: with a 150-200.
        let rows: Vec<(i64, Option<i64>, f64, Option<f64>)> = h
            .connection()
            .prepare("SELECT job_row, partner_row, started_at, ended_at FROM intervals ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            rows,
            vec![
                (a, None, 100.0, Some(150.0)),
                (a, Some(b), 150.0, Some(200.0)),
                (b, Some(a), 150.0, Some(200.0)),
                (a, None, 200.0, None),
            ]
        );
        // Reopening keeps everything.
        drop(h);
        let h = History::open(&path).unwrap();
        assert_eq!(h.active_jobs("n1").unwrap().len(), 1);
    }

    #[test]
    fn equations_from_intervals() {
        let row = |a: f64, b: Option<f64>, p: Option<&str>| (a, b, p.map(String::from));
        // Alone 0-10, beside b 10-40, an instant beside c, alone 40-50.
        let eq = equation(
            [
                row(0.0, Some(10.0), None),
                row(10.0, Some(40.0), Some("b")),
                row(40.0, Some(40.0), Some("c")),
                row(40.0, Some(50.0), None),
            ]
            .into_iter(),
        )
        .unwrap();
        assert_eq!(eq.alone_s, 20.0);
        assert_eq!(eq.shared, vec![("b".to_string(), 30.0)]);
        // Two partners at once: the linear model does not hold, no equation.
        assert!(equation([row(0.0, Some(5.0), Some("b")), row(0.0, Some(5.0), Some("c"))].into_iter()).is_none());
        // Still open: no equation.
        assert!(equation([row(0.0, None, None)].into_iter()).is_none());
    }

    #[test]
    fn progress_reports_teach_speeds_whatever_the_jobs_lengths() {
        // Application `a` does 2 iterations per second alone and 1 beside `b` (speed 0.5).
        // Its jobs differ in length, so their start and end times alone would mislead; their
        // reports do not. Job 1: alone 0-100 (200 it), beside b 100-300 (200 more).
        let dir = tempfile::tempdir().unwrap();
        let mut h = History::open(&dir.path().join("h.sqlite")).unwrap();
        let a = h.record_placement(&job(1, "a", 0, 0.0), &[]).unwrap();
        h.record_report(a, "progress", Some(100.0), &[], 0.7, 50.0).unwrap();
        h.record_report(a, "progress", Some(200.0), &[], 0.7, 100.0).unwrap();
        let b = h.record_placement(&job(2, "b", 0, 100.0), &[a]).unwrap();
        h.record_report(a, "progress", Some(300.0), &[b], 0.7, 200.0).unwrap();
        h.record_report(a, "progress", Some(400.0), &[b], 0.7, 300.0).unwrap();
        h.record_finish(b, 0, 0, true, &[a], 300.0).unwrap();
        // The last stretch (300-350, alone) ends without a report: its work is unknown.
        h.record_finish(a, 0, 0, true, &[], 350.0).unwrap();
        let learned = h.learn_from(a, 0.7).unwrap();
        let Learned::Shared { fits } = learned else {
            panic!("{learned:?}")
        };
        assert_eq!(fits.len(), 1);
        assert!((fits[0].speed - 0.5).abs() < 1e-3, "{fits:?}");
        // A later, much longer job of `a` beside b (3 it/s would be wrong: it is 1 it/s)
        // keeps the estimate where it is, though its runtime is nothing like the first's.
        let a2 = h.record_placement(&job(3, "a", 0, 1000.0), &[]).unwrap();
        let b2 = h.record_placement(&job(4, "b", 0, 1000.0), &[a2]).unwrap();
        h.record_report(a2, "progress", Some(2000.0), &[b2], 0.7, 3000.0)
            .unwrap();
        h.record_finish(b2, 0, 0, true, &[a2], 3000.0).unwrap();
        h.record_finish(a2, 0, 0, true, &[], 3100.0).unwrap();
        h.learn_from(a2, 0.7).unwrap();
        let e = h.pair("v100", "a", "b").unwrap();
        assert!((e.speed - 0.5).abs() < 1e-3 && e.observations == 3, "{e:?}");
    }

    #[test]
    fn compaction_keeps_the_latest_jobs_and_what_they_shared_with() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = History::open(&dir.path().join("h.sqlite")).unwrap();
        // Five rounds: an `a` job shares with a `b` job that ends first; `a` ends later.
        // Round k: a from 100k to 100k+60, b from 100k to 100k+40.
        let mut last_a = 0;
        for k in 0..5u32 {
            let t = 100.0 * f64::from(k);
            let a = h.record_placement(&job(10 + k, "a", 0, t), &[]).unwrap();
            let b = h.record_placement(&job(20 + k, "b", 0, t + 1.0), &[a]).unwrap();
            h.record_finish(b, 0, 0, true, &[a], t + 40.0).unwrap();
            h.record_finish(a, 0, 0, true, &[], t + 60.0).unwrap();
            last_a = a;
        }
        let before = equation(
            intervals_of(&h.conn.transaction().unwrap(), last_a)
                .unwrap()
                .into_iter(),
        );
        // Keep 2 of each: `b` finishes first in each round, so the newest `a` may outlive its
        // partner's record only through the interval's own application column.
        assert_eq!(h.compact(2).unwrap(), 6);
        let count = |app: &str| -> i64 {
            h.conn
                .query_row(
                    "SELECT count(*) FROM jobs j JOIN applications a ON a.id = j.app_id WHERE a.name = ?1",
                    [app],
                    |r| r.get(0),
                )
                .unwrap()
        };
        assert_eq!((count("a"), count("b")), (2, 2));
        let after = equation(
            intervals_of(&h.conn.transaction().unwrap(), last_a)
                .unwrap()
                .into_iter(),
        );
        assert_eq!(before, after, "the kept job's equation is unchanged");
        assert_eq!(after.unwrap().shared[0].0, "b");
        let orphans: i64 = h
            .conn
            .query_row(
                "SELECT count(*) FROM intervals WHERE job_row NOT IN (SELECT id FROM jobs)",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(orphans, 0);
        assert_eq!(h.compact(2).unwrap(), 0, "nothing more to do");
        // Running jobs are never compacted.
        h.record_placement(&job(99, "a", 1, 1000.0), &[]).unwrap();
        assert_eq!(h.compact(0).unwrap(), 4);
        assert_eq!(h.active_jobs("n1").unwrap().len(), 1);
    }

    #[test]
    fn corrupt_database_is_reported_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.sqlite");
        let junk = b"this is not a database, but someone's precious file".repeat(100);
        std::fs::write(&path, &junk).unwrap();
        let err = History::open(&path).err().expect("must fail");
        let text = err.to_string();
        assert!(text.contains("corrupt") && text.contains("left as is"), "{text}");
        assert_eq!(std::fs::read(&path).unwrap(), junk);
    }

    #[test]
    fn newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.sqlite");
        drop(History::open(&path).unwrap());
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", 99)
            .unwrap();
        let err = History::open(&path).err().expect("must fail");
        assert!(matches!(err, HistoryError::TooNew { found: 99, .. }), "{err}");
    }

    #[test]
    fn estimates_are_read_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::open(&dir.path().join("h.sqlite")).unwrap();
        h.connection()
            .execute_batch(
                "INSERT INTO applications(id, name) VALUES (1, 'a'), (2, 'b');
                 INSERT INTO pair_estimates VALUES ('v100', 1, 2, 0.8, 0.6, 4, 0.01, 0);",
            )
            .unwrap();
        let e = h.pair("v100", "a", "b").unwrap();
        assert_eq!((e.speed, e.other_speed, e.observations, e.oom), (0.8, 0.6, 4, false));
        assert!(h.pair("a100", "a", "b").is_none());
        assert!(h.pair("v100", "b", "a").is_none());
    }
}
