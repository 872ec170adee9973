//! Learning: what a finished job, or a running job's progress, teaches about its application's
//! speeds alone and beside partners (the equations come from [`super::equations`], the fit
//! from [`crate::learn`]).

use super::effects::{stepped_effects, write_effects, AppEffect, NewSpeed};
pub use super::equations::LEARN_WINDOW;
use super::equations::{equation, equations_of, intervals_of};
use super::{Cached, History, HistoryError};
use rusqlite::{params, OptionalExtension};

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

impl History {
    /// Learns from the finished job `job_row`: its solo runtime if it ran alone, and the
    /// pairwise speeds of its application from its latest jobs (see [`crate::learn`]).
    /// Estimates are written for both sides of each pair. Jobs that failed teach nothing (their
    /// runtime is not one run's work), nor do stretches with more than one partner at once.
    ///
    /// Everything is read and fitted in a read transaction, which takes no lock in WAL mode;
    /// only the results are written in a short write transaction, so that learning on its
    /// own thread barely delays the requests' writes.
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
            drop(tx);
            self.store(&model, app_id, None, None, Some(job_row))?;
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
                solo = Some((mean, runs));
            }
        }
        let Some((equations, reported)) = equations_of(&tx, app_id, &model, job_row, solo.map(|s| s.0))? else {
            drop(tx);
            self.store(&model, app_id, solo, None, Some(job_row))?;
            return Ok(Learned::NoBaseline);
        };
        // A new solo runtime or rate alone changes every speed; a shared run not measured while
        // it ran (no reports, no busy records) only those linked to its partners.
        let partners: Option<Vec<String>> = match (&solo, &this) {
            (None, Some(eq)) if !reported => Some(eq.shared.iter().map(|(p, _)| p.clone()).collect()),
            _ => None,
        };
        let fits = crate::learn::fit(&equations, prior, partners.as_deref());
        let speeds = speeds_to_write(&tx, &model, app_id, prior, &fits)?;
        drop(tx);
        self.store(&model, app_id, solo, Some(&speeds), Some(job_row))?;
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
        let Some((equations, _)) = equations_of(&tx, app_id, &model, job_row, None)? else {
            return Ok(Learned::NoBaseline);
        };
        let fits = crate::learn::fit(&equations, prior, Some(&unsure));
        let speeds = speeds_to_write(&tx, &model, app_id, prior, &fits)?;
        drop(tx);
        self.store(&model, app_id, None, Some(&speeds), None)?;
        Ok(Learned::Shared { fits })
    }

    /// Writes what learning found, in one short write transaction: the application's new solo
    /// runtime and runs, if any, and its fitted speeds with what follows from them, if it
    /// fitted any (the application's effects are updated even when the fit found no pair);
    /// with them, that the finished job `learned` was learned from. Everything to write was
    /// worked out before, in the read transaction: the write lock is held only for writing.
    fn store(
        &mut self,
        model: &str,
        app_id: i64,
        solo: Option<(f64, i64)>,
        speeds: Option<&Speeds>,
        learned: Option<i64>,
    ) -> Result<(), HistoryError> {
        if solo.is_none() && speeds.is_none() && learned.is_none() {
            return Ok(());
        }
        self.write_in_steps(|h| {
            if let Some(job_row) = learned {
                h.conn.exec("UPDATE jobs SET learned = 1 WHERE id = ?1", [job_row])?;
            }
            if let Some((mean, runs)) = solo {
                h.conn.exec(
                    "INSERT INTO solo_baselines(gpu_model, app_id, runtime_s, observations) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT(gpu_model, app_id) DO UPDATE SET runtime_s = ?3, observations = ?4",
                    params![model, app_id, mean, runs],
                )?;
            }
            match speeds {
                Some(speeds) => write_speeds(&h.conn, model, app_id, speeds, &|| h.let_requests_in()),
                None => Ok(()),
            }
        })
    }
}

/// Fitted speeds of one application, ready to write: each with its partner's id, and the
/// effects of every application concerned once they are written.
struct Speeds {
    fits: Vec<(NewSpeed, f64)>,
    prior: f64,
    effects: Vec<AppEffect>,
}

/// Works out, in the read transaction `tx`, what writing `fits` of application `app_id` on
/// `model` means (see [`Speeds`]).
fn speeds_to_write(
    tx: &rusqlite::Connection,
    model: &str,
    app_id: i64,
    prior: f64,
    fits: &[crate::learn::Fit],
) -> rusqlite::Result<Speeds> {
    let mut new = Vec::with_capacity(fits.len());
    let mut touched = vec![app_id];
    for f in fits {
        let other: i64 = tx.row("SELECT id FROM applications WHERE name = ?1", [&f.partner], |r| {
            r.get(0)
        })?;
        touched.push(other);
        let speed = NewSpeed {
            app: app_id,
            other,
            speed: f.speed,
            observations: f.observations,
        };
        new.push((speed, f.variance));
    }
    let pending: Vec<NewSpeed> = new.iter().map(|(s, _)| *s).collect();
    let effects = stepped_effects(tx, model, &touched, prior, &pending)?;
    Ok(Speeds {
        fits: new,
        prior,
        effects,
    })
}

/// Writes fitted speeds of application `app_id` on `model`, both sides of each pair, the
/// application's means and the effects worked out with them; `pause` runs between steps.
fn write_speeds(
    tx: &rusqlite::Connection,
    model: &str,
    app_id: i64,
    speeds: &Speeds,
    pause: &dyn Fn() -> rusqlite::Result<()>,
) -> rusqlite::Result<()> {
    let prior = speeds.prior;
    for (f, variance) in &speeds.fits {
        pause()?;
        tx.exec(
            "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations, variance)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET speed = ?4, observations = ?6, variance = ?7",
            params![model, app_id, f.other, f.speed, prior, f.observations, variance],
        )?;
        // The partner's row sees this side as `other_speed`; its own speed stays unlearned
        // (observations 0) until a job of the partner's application finishes.
        tx.exec(
            "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations)
             VALUES (?1, ?2, ?3, ?4, ?5, 0)
             ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET other_speed = ?5",
            params![model, f.other, app_id, prior, f.speed],
        )?;
    }
    pause()?;
    super::effects::refresh_app_means(tx, Some((model, app_id)))?;
    write_effects(tx, model, &speeds.effects)
}
