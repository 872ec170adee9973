//! The snapshot one placement decision reads ([`crate::placement::Estimates`]), loaded before
//! it is scored: an error here is the request's error, never "nothing known".

use super::{History, HistoryError};
use crate::types::{AppProfile, Estimates, PairEstimate, Wanted};
use rusqlite::{params, OptionalExtension};
use std::collections::{BTreeSet, HashMap};

/// What [`History::estimates`] read while the database did not change, to be read again
/// without asking SQLite: the claimer weighs mostly the same pairs look after look, and the
/// history changes far less often than it looks (a job's step starting, reporting or ending on
/// its own node, an exchange). `None`: known to have no row.
#[derive(Debug, Default)]
pub(super) struct Memo {
    /// The state of the tables it was read from.
    version: Option<super::Tables>,
    pairs: HashMap<(String, String, String), Option<PairEstimate>>,
    learned: HashMap<String, Option<(f64, u32)>>,
    apps: HashMap<(String, String), Option<AppProfile>>,
}

impl Memo {
    /// The most entries kept: past it the memo starts afresh at the next read. The names a
    /// look asks about come from jobs' tags, which their users choose, and a queue of jobs
    /// under ever new names would otherwise grow it for as long as the history is unchanged.
    pub(super) const MAX: usize = 100_000;

    pub(super) fn len(&self) -> usize {
        self.pairs.len() + self.learned.len() + self.apps.len()
    }
}

impl History {
    /// What the history knows of the pairs and applications `wanted` names.
    pub fn estimates(&self, wanted: &Wanted) -> Result<Estimates, HistoryError> {
        // Inside a transaction (`None`) what is read is kept for this call only.
        let version = self.tables(&["applications", "pair_estimates", "app_effects", "app_means"])?;
        let mut memo = self.memo.borrow_mut();
        if version.is_none() || memo.version != version || memo.len() > Memo::MAX {
            *memo = Memo {
                version,
                ..Memo::default()
            };
        }
        let mut out = Estimates::default();
        self.pairs_into(wanted, &mut memo, &mut out)?;
        self.learned_into(wanted, &mut memo, &mut out)?;
        self.profiles_into(wanted, &mut memo, &mut out)?;
        Ok(out)
    }

    /// The pairs `wanted` asks for, as learned.
    fn pairs_into(&self, wanted: &Wanted, memo: &mut Memo, out: &mut Estimates) -> Result<(), HistoryError> {
        let mut pair = self.conn.prepare_cached(
            "SELECT e.speed, e.other_speed, e.observations, e.oom FROM pair_estimates e
             JOIN applications a ON a.id = e.app_id JOIN applications o ON o.id = e.other_id
             WHERE e.gpu_model = ?1 AND a.name = ?2 AND o.name = ?3",
        )?;
        for key in &wanted.pairs {
            let found = match memo.pairs.get(key) {
                Some(found) => *found,
                None => {
                    let (model, app, other) = key;
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
                    memo.pairs.insert(key.clone(), found);
                    found
                }
            };
            if let Some(e) = found {
                out.insert_pair(&key.0, &key.1, &key.2, e);
            }
        }
        Ok(())
    }

    /// What every learned pair of each model `wanted` names says of a typical pair:
    /// app_means holds each application's mean learned speed and how many pairs it rests on.
    fn learned_into(&self, wanted: &Wanted, memo: &mut Memo, out: &mut Estimates) -> Result<(), HistoryError> {
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
            let found = match memo.learned.get(model) {
                Some(found) => *found,
                None => {
                    let (sum, n): (f64, f64) = learned.query_row(params![model], |r| Ok((r.get(0)?, r.get(1)?)))?;
                    let found = (n > 0.0).then_some((sum, n as u32));
                    memo.learned.insert(model.clone(), found);
                    found
                }
            };
            if let Some((sum, n)) = found {
                out.insert_learned(model, sum, n);
            }
        }
        Ok(())
    }

    /// The application profiles `wanted` asks for: each one's effects and failures.
    fn profiles_into(&self, wanted: &Wanted, memo: &mut Memo, out: &mut Estimates) -> Result<(), HistoryError> {
        let mut profile = self.conn.prepare_cached(
            "SELECT e.base, e.base_pairs, e.impact, e.impact_pairs, m.ooms, m.pairs + m.ooms
             FROM applications a
             LEFT JOIN app_effects e ON e.app_id = a.id AND e.gpu_model = ?1
             LEFT JOIN app_means m ON m.app_id = a.id AND m.gpu_model = ?1
             WHERE a.name = ?2",
        )?;
        for key in &wanted.apps {
            let found = match memo.apps.get(key) {
                Some(found) => *found,
                None => {
                    let (model, app) = key;
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
                    memo.apps.insert(key.clone(), found);
                    found
                }
            };
            if let Some(p) = found {
                out.insert_app(&key.0, &key.1, p);
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
