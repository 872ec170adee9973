//! The snapshot one placement decision reads ([`crate::placement::Estimates`]), loaded before
//! it is scored: an error here is the request's error, never "nothing known".

use super::{History, HistoryError};
use crate::types::{AppProfile, Estimates, PairEstimate, Wanted};
use rusqlite::{params, OptionalExtension};
use std::collections::BTreeSet;

impl History {
    /// What the history knows of the pairs and applications `wanted` names.
    pub fn estimates(&self, wanted: &Wanted) -> Result<Estimates, HistoryError> {
        let mut out = Estimates::default();
        self.pairs_into(wanted, &mut out)?;
        self.learned_into(wanted, &mut out)?;
        self.profiles_into(wanted, &mut out)?;
        Ok(out)
    }

    /// The pairs `wanted` asks for, as learned.
    fn pairs_into(&self, wanted: &Wanted, out: &mut Estimates) -> Result<(), HistoryError> {
        let mut pair = self.conn.prepare_cached(
            "SELECT e.speed, e.other_speed, e.observations, e.oom FROM pair_estimates e
             JOIN applications a ON a.id = e.app_id JOIN applications o ON o.id = e.other_id
             WHERE e.gpu_model = ?1 AND a.name = ?2 AND o.name = ?3",
        )?;
        for (model, app, other) in &wanted.pairs {
            let found = pair
                .query_row(params![model, app, other], |r| {
                    Ok(PairEstimate {
                        speed: r.get(0)?,
                        other_speed: r.get(1)?,
                        observations: r.get(2)?,
                        oom: r.get(3)?,
                    })
                })
                .optional()?;
            if let Some(e) = found {
                out.insert_pair(model, app, other, e);
            }
        }
        Ok(())
    }

    /// What every learned pair of each model `wanted` names says of a typical pair:
    /// app_means holds each application's mean learned speed and how many pairs it rests on.
    fn learned_into(&self, wanted: &Wanted, out: &mut Estimates) -> Result<(), HistoryError> {
        let mut learned = self
            .conn
            .prepare_cached("SELECT total(mean * pairs), total(pairs) FROM app_means WHERE gpu_model = ?1")?;
        let models: BTreeSet<&String> = wanted
            .apps
            .iter()
            .map(|(m, _)| m)
            .chain(wanted.pairs.iter().map(|(m, _, _)| m))
            .collect();
        for model in models {
            let (sum, n): (f64, f64) = learned.query_row(params![model], |r| Ok((r.get(0)?, r.get(1)?)))?;
            if n > 0.0 {
                out.insert_learned(model, sum, n as u32);
            }
        }
        Ok(())
    }

    /// The application profiles `wanted` asks for: each one's effects and failures.
    fn profiles_into(&self, wanted: &Wanted, out: &mut Estimates) -> Result<(), HistoryError> {
        let mut profile = self.conn.prepare_cached(
            "SELECT e.base, e.base_pairs, e.impact, e.impact_pairs, m.ooms, m.pairs + m.ooms
             FROM applications a
             LEFT JOIN app_effects e ON e.app_id = a.id AND e.gpu_model = ?1
             LEFT JOIN app_means m ON m.app_id = a.id AND m.gpu_model = ?1
             WHERE a.name = ?2",
        )?;
        for (model, app) in &wanted.apps {
            let found = profile
                .query_row(params![model, app], |r| {
                    let both = |x: Option<f64>, n: Option<u32>| x.zip(n);
                    Ok(AppProfile {
                        base: both(r.get(0)?, r.get(1)?),
                        impact: both(r.get(2)?, r.get(3)?),
                        ooms: (
                            r.get::<_, Option<u32>>(4)?.unwrap_or(0),
                            r.get::<_, Option<u32>>(5)?.unwrap_or(0),
                        ),
                    })
                })
                .optional()?;
            if let Some(p) = found {
                out.insert_app(model, app, p);
            }
        }
        Ok(())
    }

    /// What the history knows of `app` beside `other` on `model` (for tools and tests).
    pub fn pair(&self, model: &str, app: &str, other: &str) -> Result<Option<PairEstimate>, HistoryError> {
        let mut w = Wanted::default();
        w.pair(model, app, other);
        Ok(self.estimates(&w)?.pair(model, app, other))
    }

    /// What the history knows of `app` on `model` beside partners in general (for tools and
    /// tests).
    pub fn app(&self, model: &str, app: &str) -> Result<AppProfile, HistoryError> {
        let mut w = Wanted::default();
        w.apps.insert((model.to_string(), app.to_string()));
        Ok(self.estimates(&w)?.app(model, app))
    }
}
