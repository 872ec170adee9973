//! What a node learned, for other nodes and for people: `export` writes it, `import` merges
//! another node's, `history` lists it.

use super::effects::PairSpeed;
use super::jobs::app_id;
use super::{Cached, History, HistoryError};
use rusqlite::params;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};

/// One learned pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairRow {
    pub gpu_model: String,
    pub app: String,
    pub other: String,
    /// Speed of `app` beside `other`, relative to alone.
    pub speed: f64,
    /// Speed of `other` beside `app`.
    pub other_speed: f64,
    pub observations: u32,
    pub variance: Option<f64>,
    pub oom: bool,
}

/// One application's solo runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SoloRow {
    pub gpu_model: String,
    pub app: String,
    pub runtime_s: f64,
    pub runs: u32,
}

/// The GPU memory an application's latest measured runs peaked at (NVML), MiB.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryRow {
    pub app: String,
    pub peak_mb: u64,
}

/// What `export` writes and `import` reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Export {
    /// Always [`EXPORT_FORMAT`].
    pub format: String,
    pub version: u32,
    pub solo: Vec<SoloRow>,
    pub pairs: Vec<PairRow>,
    /// Absent from the exports of older daemons (read as none); older daemons skip it.
    #[serde(default)]
    pub memory: Vec<MemoryRow>,
}

pub const EXPORT_FORMAT: &str = "multiplexd-history";
pub const EXPORT_VERSION: u32 = 1;

/// What an import changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Imported {
    pub solo_added: usize,
    pub solo_replaced: usize,
    pub pairs_added: usize,
    pub pairs_replaced: usize,
    pub kept: usize,
    /// Applications whose memory was unknown here, and those whose memory the import raised.
    pub memory_added: usize,
    pub memory_raised: usize,
}

impl History {
    pub(super) fn pair_rows(&self, filter: &str, args: &[&dyn rusqlite::ToSql]) -> Result<Vec<PairRow>, HistoryError> {
        let sql = format!(
            "SELECT e.gpu_model, a.name, o.name, e.speed, e.other_speed, e.observations, e.variance, e.oom
             FROM pair_estimates e JOIN applications a ON a.id = e.app_id JOIN applications o ON o.id = e.other_id
             {filter} ORDER BY e.gpu_model, a.name, o.name"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map(args, |r| {
            Ok(PairRow {
                gpu_model: r.get(0)?,
                app: r.get(1)?,
                other: r.get(2)?,
                speed: r.get(3)?,
                other_speed: r.get(4)?,
                observations: r.get(5)?,
                variance: r.get(6)?,
                oom: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Every pair estimate.
    pub fn pairs(&self) -> Result<Vec<PairRow>, HistoryError> {
        self.pair_rows("", &[])
    }

    /// Every solo runtime.
    pub fn solos(&self) -> Result<Vec<SoloRow>, HistoryError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT s.gpu_model, a.name, s.runtime_s, s.observations FROM solo_baselines s
             JOIN applications a ON a.id = s.app_id ORDER BY s.gpu_model, a.name",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(SoloRow {
                gpu_model: r.get(0)?,
                app: r.get(1)?,
                runtime_s: r.get(2)?,
                runs: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Every application's measured memory.
    pub fn memory(&self) -> Result<Vec<MemoryRow>, HistoryError> {
        // Read at every look of the claimer.
        let mut stmt = self.conn.prepare_cached(
            "SELECT a.name, m.peak_mb FROM app_memory m JOIN applications a ON a.id = m.app_id ORDER BY a.name",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(MemoryRow {
                app: r.get(0)?,
                peak_mb: r.get::<_, i64>(1)?.max(0) as u64,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Everything learned, for another node.
    pub fn export(&self) -> Result<Export, HistoryError> {
        Ok(Export {
            format: EXPORT_FORMAT.into(),
            version: EXPORT_VERSION,
            solo: self.solos()?,
            pairs: self.pairs()?,
            memory: self.memory()?,
        })
    }

    /// Merges another node's export: a row is added when it is new here and replaces ours when it
    /// ranks above it ([`pair_order`], [`solo_order`]: resting on more observations first); an
    /// out-of-memory mark is never dropped, nor is the larger of two measured memories (until
    /// this node's own next measured run of the application). What is known of each application
    /// is then refitted, with `prior` (`policy.unknown_pair_speed`).
    ///
    /// The order the exports arrive in does not matter: nodes that merged the same exports hold
    /// the same rows, whichever merged what first.
    pub fn import(&mut self, data: &Export, prior: f64) -> Result<Imported, String> {
        check_export(data)?;
        let mut done = Imported::default();
        let sql = |e: rusqlite::Error| e.to_string();
        let tx = self.write().map_err(sql)?;
        let mut apps = Apps::read(&tx).map_err(sql)?;
        merge_solo(&tx, &mut apps, &data.solo, &mut done).map_err(sql)?;
        let (changed, pairs) = merge_pairs(&tx, &mut apps, &data.pairs, &mut done).map_err(sql)?;
        merge_memory(&tx, &mut apps, &data.memory, &mut done).map_err(sql)?;
        // The means follow from the pairs, and every other write of a pair refreshes its
        // application's: only those whose pairs this import changed are made again.
        for (model, app) in &changed {
            super::effects::refresh_app_means(&tx, Some((model, *app))).map_err(sql)?;
        }
        // The merge holds every pair as now written: the fit need not read them again.
        let pairs = pairs.into_iter().map(|((model, app, other), (ranked, oom))| PairSpeed {
            model,
            app,
            other,
            speed: ranked.speed,
            observations: ranked.observations,
            oom,
        });
        super::effects::refit_from(&tx, pairs, prior).map_err(sql)?;
        tx.commit().map_err(sql)?;
        Ok(done)
    }
}

/// Several exports merged in memory by [`History::import`]'s rules, so that importing the
/// result once leaves the tables as importing each in turn would (the estimate ranking first
/// wins, [`pair_order`]; out-of-memory marks are kept; the larger memory), with one refit of
/// what is known of each application instead of one per export: a node of a large cluster
/// merges hundreds of other nodes' files each exchange. The result, in key order, is the same
/// whatever order the exports were added in.
#[derive(Debug, Default)]
pub struct Merger {
    solo: Vec<SoloRow>,
    pairs: Vec<PairRow>,
    memory: Vec<MemoryRow>,
    solo_at: HashMap<(String, String), usize>,
    pair_at: HashMap<(String, String, String), usize>,
    memory_at: HashMap<String, usize>,
}

impl Merger {
    /// Merges `data`, checked whole first: one that import would refuse is refused here, and
    /// nothing of it is merged.
    pub fn add(&mut self, data: &Export) -> Result<(), String> {
        check_export(data)?;
        for s in &data.solo {
            match self.solo_at.get(&(s.gpu_model.clone(), s.app.clone())) {
                Some(&i) if solo_order(s.rank(), self.solo[i].rank()) != Ordering::Greater => {}
                Some(&i) => self.solo[i] = s.clone(),
                None => {
                    self.solo_at
                        .insert((s.gpu_model.clone(), s.app.clone()), self.solo.len());
                    self.solo.push(s.clone());
                }
            }
        }
        for p in &data.pairs {
            let key = (p.gpu_model.clone(), p.app.clone(), p.other.clone());
            match self.pair_at.get(&key) {
                Some(&i) if pair_order(&Ranked::of(p), &Ranked::of(&self.pairs[i])) != Ordering::Greater => {
                    self.pairs[i].oom |= p.oom
                }
                Some(&i) => {
                    let oom = self.pairs[i].oom || p.oom;
                    self.pairs[i] = PairRow { oom, ..p.clone() };
                }
                None => {
                    self.pair_at.insert(key, self.pairs.len());
                    self.pairs.push(p.clone());
                }
            }
        }
        for m in &data.memory {
            match self.memory_at.get(&m.app) {
                Some(&i) => self.memory[i].peak_mb = self.memory[i].peak_mb.max(m.peak_mb),
                None => {
                    self.memory_at.insert(m.app.clone(), self.memory.len());
                    self.memory.push(m.clone());
                }
            }
        }
        Ok(())
    }

    /// What was merged, as one export, its rows in key order (as [`History::export`] writes
    /// them).
    pub fn finish(self) -> Export {
        let (mut solo, mut pairs, mut memory) = (self.solo, self.pairs, self.memory);
        solo.sort_by(|a, b| (&a.gpu_model, &a.app).cmp(&(&b.gpu_model, &b.app)));
        pairs.sort_by(|a, b| (&a.gpu_model, &a.app, &a.other).cmp(&(&b.gpu_model, &b.app, &b.other)));
        memory.sort_by(|a, b| a.app.cmp(&b.app));
        Export {
            format: EXPORT_FORMAT.into(),
            version: EXPORT_VERSION,
            solo,
            pairs,
            memory,
        }
    }
}

/// What ranks one estimate of a pair above another.
#[derive(Debug, Clone, Copy)]
struct Ranked {
    observations: u32,
    variance: Option<f64>,
    speed: f64,
    other_speed: f64,
}

impl Ranked {
    fn of(p: &PairRow) -> Ranked {
        Ranked {
            observations: p.observations,
            variance: p.variance,
            speed: p.speed,
            other_speed: p.other_speed,
        }
    }
}

/// Which of two estimates of one pair a merge keeps (the greater): the one resting on more
/// observations; between equals, the one with the smaller measured spread (a variance before
/// none), then the larger speeds. Every row's values take part, so two nodes holding different
/// estimates on as many observations keep the same one, whichever merges the other's: with
/// "ours on a tie" they kept their own for good, and what a node held depended on the order it
/// read the other nodes' files in.
fn pair_order(a: &Ranked, b: &Ranked) -> Ordering {
    a.observations
        .cmp(&b.observations)
        .then_with(|| match (a.variance, b.variance) {
            (Some(x), Some(y)) => y.total_cmp(&x),
            (Some(_), None) => Ordering::Greater,
            (None, Some(_)) => Ordering::Less,
            (None, None) => Ordering::Equal,
        })
        .then_with(|| a.speed.total_cmp(&b.speed))
        .then_with(|| a.other_speed.total_cmp(&b.other_speed))
}

/// Which of two solo baselines (runs, runtime) a merge keeps (the greater): the one resting on
/// more runs, then the longer runtime (as [`pair_order`], so that the order of merging does not
/// matter).
fn solo_order(a: (u32, f64), b: (u32, f64)) -> Ordering {
    a.0.cmp(&b.0).then_with(|| a.1.total_cmp(&b.1))
}

impl SoloRow {
    fn rank(&self) -> (u32, f64) {
        (self.runs, self.runtime_s)
    }
}

/// An export this daemon can merge: its format and version, speeds in (0, 1], positive solo
/// runtimes and memories. Checked whole before anything is written.
fn check_export(data: &Export) -> Result<(), String> {
    if data.format != EXPORT_FORMAT {
        return Err(format!("not a multiplexd history export (format {:?})", data.format));
    }
    if data.version != EXPORT_VERSION {
        return Err(format!(
            "export version {} is not supported (this multiplexd reads version {EXPORT_VERSION})",
            data.version
        ));
    }
    for p in &data.pairs {
        let speed = |x: f64| x > 0.0 && x <= 1.0;
        if !speed(p.speed) || !speed(p.other_speed) {
            return Err(format!(
                "pair {} / {} on {}: speeds must be in (0, 1], not {} / {}; nothing was imported",
                p.app, p.other, p.gpu_model, p.speed, p.other_speed
            ));
        }
    }
    if let Some(s) = data.solo.iter().find(|s| s.runtime_s.is_nan() || s.runtime_s <= 0.0) {
        return Err(format!(
            "solo runtime of {} on {} must be positive, not {}; nothing was imported",
            s.app, s.gpu_model, s.runtime_s
        ));
    }
    if let Some(m) = data
        .memory
        .iter()
        .find(|m| m.peak_mb == 0 || m.peak_mb > i64::MAX as u64)
    {
        return Err(format!(
            "memory of {} must be a positive number of MiB, not {}; nothing was imported",
            m.app, m.peak_mb
        ));
    }
    Ok(())
}

/// What one query reads, by key: what an import merges into, read once.
fn held<K: std::hash::Hash + Eq, V>(
    tx: &rusqlite::Transaction,
    sql: &str,
    row: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<(K, V)>,
) -> rusqlite::Result<HashMap<K, V>> {
    let mut stmt = tx.prepare_cached(sql)?;
    let rows = stmt.query_map([], row)?;
    rows.collect()
}

/// The applications an import names, by name: read once, each new one added (and numbered by
/// SQLite) the first time a row names it, in the order the rows name them.
struct Apps(HashMap<String, i64>);

impl Apps {
    fn read(tx: &rusqlite::Transaction) -> rusqlite::Result<Apps> {
        held(tx, "SELECT name, id FROM applications", |r| Ok((r.get(0)?, r.get(1)?))).map(Apps)
    }

    fn id(&mut self, tx: &rusqlite::Transaction, name: &str) -> rusqlite::Result<i64> {
        if let Some(&id) = self.0.get(name) {
            return Ok(id);
        }
        let id = app_id(tx, name)?;
        self.0.insert(name.to_string(), id);
        Ok(id)
    }
}

/// Each solo baseline: added where new, replacing ours where it ranks above it
/// ([`solo_order`]). What is here is read once; only what changes is written.
fn merge_solo(
    tx: &rusqlite::Transaction,
    apps: &mut Apps,
    solo: &[SoloRow],
    done: &mut Imported,
) -> rusqlite::Result<()> {
    let mut have: HashMap<(String, i64), (u32, f64)> = held(
        tx,
        "SELECT gpu_model, app_id, observations, runtime_s FROM solo_baselines",
        |r| Ok(((r.get(0)?, r.get(1)?), (r.get(2)?, r.get(3)?))),
    )?;
    for s in solo {
        let id = apps.id(tx, &s.app)?;
        let ours = have.get(&(s.gpu_model.clone(), id)).copied();
        match ours {
            Some(o) if solo_order(s.rank(), o) != Ordering::Greater => done.kept += 1,
            _ => {
                tx.exec(
                    "INSERT INTO solo_baselines(gpu_model, app_id, runtime_s, observations) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT(gpu_model, app_id) DO UPDATE SET runtime_s = ?3, observations = ?4",
                    params![s.gpu_model, id, s.runtime_s, s.runs],
                )?;
                have.insert((s.gpu_model.clone(), id), (s.runs, s.runtime_s));
                if ours.is_some() {
                    done.solo_replaced += 1;
                } else {
                    done.solo_added += 1;
                }
            }
        }
    }
    Ok(())
}

/// A history's pairs by GPU model, application and partner (ids): how each ranks, and its
/// out-of-memory mark.
type HeldPairs = HashMap<(String, i64, i64), (Ranked, bool)>;

/// Each pair: added where new, replacing ours where it ranks above it ([`pair_order`]); an
/// out-of-memory mark is never dropped. What is here is read once; only what changes is
/// written. Returns the applications (by model) whose pairs changed, and every pair now held.
fn merge_pairs(
    tx: &rusqlite::Transaction,
    apps: &mut Apps,
    pairs: &[PairRow],
    done: &mut Imported,
) -> rusqlite::Result<(BTreeSet<(String, i64)>, HeldPairs)> {
    let mut changed = BTreeSet::new();
    let sql = "SELECT gpu_model, app_id, other_id, observations, variance, speed, other_speed, oom FROM pair_estimates";
    let mut have: HeldPairs = held(tx, sql, |r| {
        let ranked = Ranked {
            observations: r.get(3)?,
            variance: r.get(4)?,
            speed: r.get(5)?,
            other_speed: r.get(6)?,
        };
        Ok(((r.get(0)?, r.get(1)?, r.get(2)?), (ranked, r.get(7)?)))
    })?;
    for p in pairs {
        let (a, o) = (apps.id(tx, &p.app)?, apps.id(tx, &p.other)?);
        let key = (p.gpu_model.clone(), a, o);
        let ours = have.get(&key).copied();
        match ours {
            Some((ranked, oom)) if pair_order(&Ranked::of(p), &ranked) != Ordering::Greater => {
                if p.oom && !oom {
                    tx.exec(
                        "UPDATE pair_estimates SET oom = 1 WHERE gpu_model = ?1 AND app_id = ?2 AND other_id = ?3",
                        params![p.gpu_model, a, o],
                    )?;
                    have.insert(key, (ranked, true));
                    changed.insert((p.gpu_model.clone(), a));
                }
                done.kept += 1;
            }
            _ => {
                let oom = p.oom || ours.is_some_and(|(_, oom)| oom);
                tx.exec(
                    "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations, variance, oom)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET speed = ?4, other_speed = ?5,
                       observations = ?6, variance = ?7, oom = ?8",
                    params![p.gpu_model, a, o, p.speed, p.other_speed, p.observations, p.variance, oom],
                )?;
                have.insert(key, (Ranked::of(p), oom));
                changed.insert((p.gpu_model.clone(), a));
                if ours.is_some() {
                    done.pairs_replaced += 1;
                } else {
                    done.pairs_added += 1;
                }
            }
        }
    }
    Ok((changed, have))
}

/// Each application's measured memory: the larger of ours and theirs.
fn merge_memory(
    tx: &rusqlite::Transaction,
    apps: &mut Apps,
    memory: &[MemoryRow],
    done: &mut Imported,
) -> rusqlite::Result<()> {
    let mut have: HashMap<i64, i64> = held(tx, "SELECT app_id, peak_mb FROM app_memory", |r| {
        Ok((r.get(0)?, r.get(1)?))
    })?;
    for m in memory {
        let id = apps.id(tx, &m.app)?;
        let ours = have.get(&id).copied();
        match ours {
            Some(ours) if ours >= m.peak_mb as i64 => done.kept += 1,
            _ => {
                tx.exec(
                    "INSERT INTO app_memory(app_id, peak_mb) VALUES (?1, ?2)
                     ON CONFLICT(app_id) DO UPDATE SET peak_mb = ?2",
                    params![id, m.peak_mb as i64],
                )?;
                have.insert(id, m.peak_mb as i64);
                if ours.is_some() {
                    done.memory_raised += 1;
                } else {
                    done.memory_added += 1;
                }
            }
        }
    }
    Ok(())
}
