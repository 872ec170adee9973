//! The schema, and its migrations from any earlier version.

use super::{History, HistoryError};
use std::path::Path;

/// Each entry upgrades the schema by one version (`PRAGMA user_version`).
pub(super) const MIGRATIONS: &[&str] = &[
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
    // 8: whether what a finished job teaches was learned: the daemon learns on a thread of its
    // own after the job's end is committed, and a job whose lesson was still queued when the
    // daemon stopped is learned at its next start. Jobs of older histories count as learned.
    "ALTER TABLE jobs ADD COLUMN learned INTEGER NOT NULL DEFAULT 1;",
    // 9: the declines of each job on each node (how many, the first and the latest, and the
    // latest's reason), so that `explain` says why a job waited after a rerun has truncated its
    // output, and the daemon counts a job's declines across its own restarts. One row per job
    // and node: a job declined thousands of times costs one row, and counting it one read.
    "CREATE TABLE declines (
        job_id INTEGER NOT NULL,
        node TEXT NOT NULL,
        count INTEGER NOT NULL,
        first_at REAL NOT NULL,
        last_at REAL NOT NULL,
        reason TEXT NOT NULL,
        retry_after_s INTEGER NOT NULL,
        PRIMARY KEY (job_id, node)
     );",
    // 10: jobs given back to Slurm because they measured worse beside their partners than
    // taking turns (`crate::separate`): their progress reports still teach, though they did
    // not complete, and a job is given back at most once per node (1: requeued; 2: Slurm would
    // not requeue it, and it ran on).
    "ALTER TABLE jobs ADD COLUMN separated INTEGER NOT NULL DEFAULT 0;",
    // 11: memory the driver never reported was kept as a peak of 0 MiB, which placement read
    // as a job that fits beside anything; it is unknown. (No GPU process of a job uses none.)
    "UPDATE job_telemetry SET mem_peak_mb = NULL WHERE mem_peak_mb = 0;
     DELETE FROM app_memory WHERE peak_mb = 0;",
    // 12: declines went with the step-launch placement that made them: the claimer leaves a
    // job it would not place waiting in Slurm's queue, and nothing is declined any more.
    "DROP TABLE IF EXISTS declines;",
];

/// The migration that creates `app_effects`: an existing history's are fitted right after it.
const EFFECTS_MIGRATION: usize = 7;

impl History {
    pub(super) fn migrate(&mut self, path: &Path) -> Result<(), HistoryError> {
        let version: i64 = self.conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version as usize > MIGRATIONS.len() {
            return Err(HistoryError::TooNew {
                path: path.to_path_buf(),
                found: version,
                known: MIGRATIONS.len(),
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = self.write()?;
            tx.execute_batch(sql)?;
            if i + 1 == EFFECTS_MIGRATION {
                // With the default prior: the next change on each model refits with the
                // configured one.
                super::effects::refit_effects(&tx, crate::config::DEFAULT_UNKNOWN_PAIR_SPEED)?;
            }
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
            tx.commit()?;
        }
        Ok(())
    }
}
