//! What is known of each application beside partners never seen with it: its mean learned
//! speed and out-of-memory record (`app_means`), and the additive effects fit (`app_effects`).

use super::{Cached, History, HistoryError};
use rusqlite::params;

impl History {
    /// Refits what is known of each application beside partners never seen with it from every
    /// learned speed, with `prior` (`policy.unknown_pair_speed`): for tools that write pair
    /// estimates straight into the database (the daemon itself keeps both up to date): each
    /// application's out-of-memory record (`app_means`) and the effects fit.
    pub fn refit_effects(&mut self, prior: f64) -> Result<(), HistoryError> {
        let tx = self.write()?;
        refresh_app_means(&tx, None)?;
        refit_effects(&tx, prior)?;
        tx.commit()?;
        Ok(())
    }
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
pub(super) fn refresh_app_means(tx: &rusqlite::Connection, only: Option<(&str, i64)>) -> rusqlite::Result<()> {
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
pub(super) fn refit_effects(tx: &rusqlite::Transaction, prior: f64) -> rusqlite::Result<()> {
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
pub(super) fn update_effects(
    tx: &rusqlite::Connection,
    model: &str,
    apps: &[i64],
    prior: f64,
    pause: &dyn Fn() -> rusqlite::Result<()>,
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
            pause()?;
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
            pause()?;
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
