//! What is known of each application beside partners never seen with it: its mean learned
//! speed and out-of-memory record (`app_means`), and the additive effects fit (`app_effects`).

use super::{Cached, History, HistoryError};
use rusqlite::{params, OptionalExtension};
use std::collections::{BTreeMap, HashMap};

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
            // A whole refit (`History::refit_effects`, for tools that write estimates
            // themselves); an import refreshes only the applications it changed.
            tx.exec("DELETE FROM app_means", [])?;
            tx.exec(
                &format!("INSERT INTO app_means(gpu_model, app_id, mean, pairs, ooms) {APP_MEANS} GROUP BY gpu_model, app_id"),
                [],
            )?;
        }
    }
    Ok(())
}

/// Refits `app_effects` whole from the learned speeds of every GPU model, with `prior` as the
/// speed effects are counted from (after an import, or when the table is new). The migration
/// that creates the table uses the default prior; a site's own `unknown_pair_speed` takes over
/// as applications learn.
pub(super) fn refit_effects(tx: &rusqlite::Transaction, prior: f64) -> rusqlite::Result<()> {
    let pairs: Vec<PairSpeed> = {
        let mut stmt =
            tx.prepare_cached("SELECT gpu_model, app_id, other_id, speed, observations, oom FROM pair_estimates")?;
        let rows = stmt.query_map([], |r| {
            Ok(PairSpeed {
                model: r.get(0)?,
                app: r.get(1)?,
                other: r.get(2)?,
                speed: r.get(3)?,
                observations: r.get(4)?,
                oom: r.get(5)?,
            })
        })?;
        rows.collect::<Result<_, _>>()?
    };
    refit_from(tx, pairs, prior)
}

/// One row of `pair_estimates` as the effects fit reads it.
pub(super) struct PairSpeed {
    pub model: String,
    pub app: i64,
    pub other: i64,
    pub speed: f64,
    pub observations: u32,
    pub oom: bool,
}

/// [`refit_effects`] from the pairs already read (every row of the table: an import holds them
/// after its merge). The fit takes each model's pairs that ran together and did not run out of
/// memory; a model with none has no effects.
pub(super) fn refit_from(
    tx: &rusqlite::Transaction,
    pairs: impl IntoIterator<Item = PairSpeed>,
    prior: f64,
) -> rusqlite::Result<()> {
    let mut learned: BTreeMap<String, Vec<(i64, i64, f64)>> = BTreeMap::new();
    for p in pairs {
        let speeds = learned.entry(p.model).or_default();
        if p.observations > 0 && !p.oom {
            speeds.push((p.app, p.other, p.speed));
        }
    }
    // What is held, to write only what the fit changes: after most imports, little or nothing.
    type Effect = (u64, u32, u64, u32);
    let mut held: HashMap<(String, i64), Effect> = {
        let mut stmt =
            tx.prepare_cached("SELECT gpu_model, app_id, base, base_pairs, impact, impact_pairs FROM app_effects")?;
        let rows = stmt.query_map([], |r| {
            let held = (
                r.get::<_, f64>(2)?.to_bits(),
                r.get(3)?,
                r.get::<_, f64>(4)?.to_bits(),
                r.get(5)?,
            );
            Ok(((r.get(0)?, r.get(1)?), held))
        })?;
        rows.collect::<Result<_, _>>()?
    };
    let mut write = tx.prepare_cached(
        "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT(gpu_model, app_id) DO UPDATE SET base = ?3, base_pairs = ?4, impact = ?5, impact_pairs = ?6",
    )?;
    for (model, mut learned) in learned {
        // In key order: the fit sums in this order, and a history holding the same rows fits
        // the same effects however its rows arrived (merged in another order).
        learned.sort_unstable_by_key(|&(a, b, _)| (a, b));
        let mut ids: Vec<i64> = learned.iter().flat_map(|&(a, b, _)| [a, b]).collect();
        ids.sort_unstable();
        ids.dedup();
        let index = |id: i64| ids.binary_search(&id).expect("collected above");
        let speeds: Vec<(usize, usize, f64)> = learned.iter().map(|&(a, b, y)| (index(a), index(b), y)).collect();
        let effects = crate::learn::fit_effects(ids.len(), &speeds, prior);
        for (k, &id) in ids.iter().enumerate() {
            let ((base, base_pairs), (impact, impact_pairs)) = (effects.base[k], effects.impact[k]);
            let fitted = (base.to_bits(), base_pairs, impact.to_bits(), impact_pairs);
            if held.remove(&(model.clone(), id)) != Some(fitted) {
                write.execute(params![model, id, base, base_pairs, impact, impact_pairs])?;
            }
        }
    }
    // Those the fit no longer has.
    let mut delete = tx.prepare_cached("DELETE FROM app_effects WHERE gpu_model = ?1 AND app_id = ?2")?;
    for (model, id) in held.into_keys() {
        delete.execute(params![model, id])?;
    }
    Ok(())
}

/// What is known of one application beside partners never seen with it (a row of
/// `app_effects`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct AppEffect {
    pub app: i64,
    pub base: f64,
    pub base_pairs: u32,
    pub impact: f64,
    pub impact_pairs: u32,
}

/// A learned speed about to be written: application `app` beside `other` on the model,
/// fitted from `observations` jobs.
#[derive(Debug, Clone, Copy)]
pub(super) struct NewSpeed {
    pub app: i64,
    pub other: i64,
    pub speed: f64,
    pub observations: u32,
}

/// After the estimates of `apps` changed on `model` (or will change by `pending`, not yet
/// written): coordinate steps of the effects fit ([`crate::learn::effect`]) for those
/// applications, each side twice, over only their own pairs (the whole fit would read every
/// pair of the model on every finished job). Reads only, so that learning can do it before it
/// takes the write lock; [`write_effects`] stores the result.
pub(super) fn stepped_effects(
    conn: &rusqlite::Connection,
    model: &str,
    apps: &[i64],
    prior: f64,
    pending: &[NewSpeed],
) -> rusqlite::Result<Vec<AppEffect>> {
    let mut apps = apps.to_vec();
    apps.sort_unstable();
    apps.dedup();
    let (by_app, by_other) = pair_speeds(conn, model, &apps, pending)?;
    let mut effects = current_effects(conn, model, &apps, &by_app, &by_other)?;
    // A row written for the first time starts as an application nothing is known of.
    let fresh = |app: i64| AppEffect {
        app,
        base: prior,
        base_pairs: 0,
        impact: 0.0,
        impact_pairs: 0,
    };
    for _ in 0..2 {
        for &app in &apps {
            // This application's side: what the prior and its partners' impacts leave.
            let (mut n, mut rest) = (0u32, 0.0);
            for (&(_, other), &speed) in by_app.range((app, i64::MIN)..=(app, i64::MAX)) {
                n += 1;
                rest += speed - prior - effects.get(&other).map_or(0.0, |e| e.impact);
            }
            let e = effects.entry(app).or_insert_with(|| fresh(app));
            e.base = prior + crate::learn::effect(rest, n);
            e.base_pairs = n;
        }
        for &app in &apps {
            // Its effect on partners: what their own expected speeds leave.
            let (mut n, mut rest) = (0u32, 0.0);
            for (&(_, partner), &speed) in by_other.range((app, i64::MIN)..=(app, i64::MAX)) {
                n += 1;
                rest += speed - effects.get(&partner).map_or(prior, |e| e.base);
            }
            let e = effects.entry(app).or_insert_with(|| fresh(app));
            e.impact = crate::learn::effect(rest, n);
            e.impact_pairs = n;
        }
    }
    Ok(apps.iter().map(|app| effects[app]).collect())
}

/// The learned speeds that count (seen together, never out of memory) on either side of
/// `apps`, with `pending` applied, by (app, other) and by (other, app).
fn pair_speeds(
    conn: &rusqlite::Connection,
    model: &str,
    apps: &[i64],
    pending: &[NewSpeed],
) -> rusqlite::Result<(Speeds, Speeds)> {
    let mut by_app: Speeds = Speeds::new();
    let mut by_other: Speeds = Speeds::new();
    for &app in apps {
        for side in ["app_id", "other_id"] {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT app_id, other_id, speed FROM pair_estimates
                 WHERE gpu_model = ?1 AND {side} = ?2 AND observations > 0 AND oom = 0"
            ))?;
            let rows = stmt.query_map(params![model, app], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            for row in rows {
                let (a, o, speed): (i64, i64, f64) = row?;
                by_app.insert((a, o), speed);
                by_other.insert((o, a), speed);
            }
        }
    }
    for p in pending {
        let oom: Option<bool> = conn
            .row(
                "SELECT oom FROM pair_estimates WHERE gpu_model = ?1 AND app_id = ?2 AND other_id = ?3",
                params![model, p.app, p.other],
                |r| r.get(0),
            )
            .optional()?;
        if p.observations > 0 && oom != Some(true) {
            by_app.insert((p.app, p.other), p.speed);
            by_other.insert((p.other, p.app), p.speed);
        } else {
            by_app.remove(&(p.app, p.other));
            by_other.remove(&(p.other, p.app));
        }
    }
    Ok((by_app, by_other))
}

/// The current effects, as stored, of `apps` and of every application on their pairs.
fn current_effects(
    conn: &rusqlite::Connection,
    model: &str,
    apps: &[i64],
    by_app: &Speeds,
    by_other: &Speeds,
) -> rusqlite::Result<std::collections::HashMap<i64, AppEffect>> {
    let mut effects = std::collections::HashMap::new();
    for &id in apps
        .iter()
        .chain(by_app.keys().map(|(_, o)| o))
        .chain(by_other.keys().map(|(_, a)| a))
    {
        if effects.contains_key(&id) {
            continue;
        }
        let found = conn
            .row(
                "SELECT base, base_pairs, impact, impact_pairs FROM app_effects WHERE gpu_model = ?1 AND app_id = ?2",
                params![model, id],
                |r| {
                    Ok(AppEffect {
                        app: id,
                        base: r.get(0)?,
                        base_pairs: r.get(1)?,
                        impact: r.get(2)?,
                        impact_pairs: r.get(3)?,
                    })
                },
            )
            .optional()?;
        if let Some(e) = found {
            effects.insert(id, e);
        }
    }
    Ok(effects)
}

/// Pair speeds by (application, other) or (other, application).
type Speeds = std::collections::BTreeMap<(i64, i64), f64>;

/// Stores what [`stepped_effects`] found for model `model`.
pub(super) fn write_effects(tx: &rusqlite::Connection, model: &str, effects: &[AppEffect]) -> rusqlite::Result<()> {
    for e in effects {
        tx.exec(
            "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT(gpu_model, app_id) DO UPDATE SET base = ?3, base_pairs = ?4, impact = ?5, impact_pairs = ?6",
            params![model, e.app, e.base, e.base_pairs, e.impact, e.impact_pairs],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The coordinate steps of the effects fit as they were written in SQL, reading their own
    /// writes: the reference that [`stepped_effects`] (which works them out
    /// before the write lock is taken) must match.
    fn effects_by_sql_steps(tx: &rusqlite::Connection, model: &str, apps: &[i64], prior: f64) {
        let mut apps = apps.to_vec();
        apps.sort_unstable();
        apps.dedup();
        let leftover = |app: i64, residual: &str, side: &str, other: &str| -> (u32, f64) {
            tx.query_row(
                &format!(
                    "SELECT count(*), total({residual}) FROM pair_estimates p
                     LEFT JOIN app_effects e ON e.gpu_model = p.gpu_model AND e.app_id = p.{other}
                     WHERE p.gpu_model = ?1 AND p.{side} = ?2 AND p.observations > 0 AND p.oom = 0"
                ),
                rusqlite::params![model, app, prior],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
        };
        for _ in 0..2 {
            for &app in &apps {
                let (n, rest) = leftover(app, "p.speed - ?3 - coalesce(e.impact, 0)", "app_id", "other_id");
                tx.execute(
                    "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
                     VALUES (?1, ?2, ?3, ?4, 0, 0)
                     ON CONFLICT(gpu_model, app_id) DO UPDATE SET base = ?3, base_pairs = ?4",
                    rusqlite::params![model, app, prior + crate::learn::effect(rest, n), n],
                )
                .unwrap();
            }
            for &app in &apps {
                let (n, rest) = leftover(app, "p.speed - coalesce(e.base, ?3)", "other_id", "app_id");
                tx.execute(
                    "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
                     VALUES (?1, ?2, ?4, 0, ?3, ?5)
                     ON CONFLICT(gpu_model, app_id) DO UPDATE SET impact = ?3, impact_pairs = ?5",
                    rusqlite::params![model, app, crate::learn::effect(rest, n), prior, n],
                )
                .unwrap();
            }
        }
    }

    #[test]
    fn effects_worked_out_before_writing_match_the_steps_that_read_their_own_writes() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let prior = 0.5;
        for round in 0..40 {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("h.sqlite");
            let h = History::open(&path).unwrap();
            let c = h.connection();
            let apps = 2 + (next() % 10) as i64;
            for a in 1..=apps {
                c.execute(
                    "INSERT INTO applications(id, name) VALUES (?1, ?2)",
                    rusqlite::params![a, format!("a{a}")],
                )
                .unwrap();
            }
            // Random pairs: learned or not, some out of memory; effects known for some.
            for a in 1..=apps {
                for o in 1..=apps {
                    if next() % 3 == 0 {
                        continue;
                    }
                    let speed = 0.1 + (next() % 1000) as f64 / 1000.0;
                    c.execute(
                        "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations, oom)
                         VALUES ('v100', ?1, ?2, ?3, 0.5, ?4, ?5)",
                        rusqlite::params![a, o, speed, (next() % 3) as i64, i64::from(next() % 7 == 0)],
                    )
                    .unwrap();
                }
                if next() % 2 == 0 {
                    c.execute(
                        "INSERT INTO app_effects(gpu_model, app_id, base, base_pairs, impact, impact_pairs)
                         VALUES ('v100', ?1, ?2, 3, ?3, 2)",
                        rusqlite::params![
                            a,
                            0.3 + (next() % 500) as f64 / 1000.0,
                            (next() % 200) as f64 / 1000.0 - 0.1
                        ],
                    )
                    .unwrap();
                }
            }
            // One application's new speeds, not yet written.
            let app = 1 + (next() % apps as u64) as i64;
            let mut pending = Vec::new();
            for other in 1..=apps {
                if next() % 2 == 0 {
                    pending.push(NewSpeed {
                        app,
                        other,
                        speed: 0.2 + (next() % 900) as f64 / 1000.0,
                        observations: (next() % 3) as u32,
                    });
                }
            }
            let mut touched: Vec<i64> = vec![app];
            touched.extend(pending.iter().map(|p| p.other));
            let found = stepped_effects(c, "v100", &touched, prior, &pending).unwrap();

            // The reference: write the speeds, then step in SQL.
            c.execute_batch("BEGIN").unwrap();
            for p in &pending {
                c.execute(
                    "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations)
                     VALUES ('v100', ?1, ?2, ?3, 0.5, ?4)
                     ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET speed = ?3, observations = ?4",
                    rusqlite::params![p.app, p.other, p.speed, p.observations],
                )
                .unwrap();
            }
            effects_by_sql_steps(c, "v100", &touched, prior);
            let read = |c: &rusqlite::Connection| -> Vec<(i64, f64, u32, f64, u32)> {
                let mut stmt = c
                    .prepare("SELECT app_id, base, base_pairs, impact, impact_pairs FROM app_effects ORDER BY app_id")
                    .unwrap();
                let rows = stmt
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
                    .unwrap();
                rows.collect::<Result<_, _>>().unwrap()
            };
            let expected = read(c);
            c.execute_batch("ROLLBACK").unwrap();
            write_effects(c, "v100", &found).unwrap();
            let got = read(c);
            assert_eq!(got.len(), expected.len(), "round {round}");
            for (g, e) in got.iter().zip(&expected) {
                assert!(
                    g.0 == e.0 && g.2 == e.2 && g.4 == e.4 && (g.1 - e.1).abs() < 1e-12 && (g.3 - e.3).abs() < 1e-12,
                    "round {round}: {g:?} against {e:?}"
                );
            }
        }
    }
}
