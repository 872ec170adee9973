//! How well a daemon's history knows a measured table, and what it would choose from it:
//! `multiplex-simulate --table T --grade EXPORT`. The history (a `multiplexd export`) is
//! imported into an in-memory history as `multiplexd import` does, and read through the same
//! estimates and [`placement::place`] the claimer uses; the table is read only to grade.

use crate::input::Table;
use multiplexd::config::DEFAULT_UNKNOWN_PAIR_SPEED;
use multiplexd::history::{Export, History};
use multiplexd::placement::{self, Decision, GpuState, Knobs, Newcomer, Resident};
use std::fmt::Write;
use std::path::Path;

/// One pair of the table, as the history estimates it.
#[derive(Debug, Clone, PartialEq)]
pub struct PairGrade {
    pub app: String,
    pub other: String,
    /// The table's speed of `app` beside `other`; `None`: they cannot share.
    pub truth: Option<f64>,
    /// What placement would predict (the measured estimate, else the prior).
    pub estimate: f64,
    /// How many observations the history has of the pair (0: the prior stands in).
    pub observations: u32,
    /// Whether the history holds that they ran out of memory together.
    pub oom: bool,
}

/// A newcomer of one application at a node whose GPUs each hold one job of an application of
/// the table (one GPU per application): the partner placement chooses, and the best per the
/// table.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceGrade {
    pub app: String,
    /// The partner chosen; `None`: placement would leave the job waiting.
    pub chosen: Option<String>,
    /// What the chosen pair truly adds (both speeds, less the resident's one job); `None`
    /// when it waits or the pair cannot share.
    pub chosen_gain: Option<f64>,
    /// The best partner per the table, and its true gain; `None` when no pair gains at least
    /// `min_gain` (waiting is then the best choice).
    pub best: Option<(String, f64)>,
}

impl ChoiceGrade {
    /// What the choice costs against the best, in jobs' worth of throughput (0: the best).
    pub fn regret(&self) -> f64 {
        let best = self.best.as_ref().map_or(0.0, |b| b.1);
        // A pair that cannot share costs both jobs (they run out of memory): worse than any
        // slowdown.
        let got = match (&self.chosen, self.chosen_gain) {
            (Some(_), Some(g)) => g,
            (Some(_), None) => -1.0,
            (None, _) => 0.0,
        };
        (best - got).max(0.0)
    }
}

/// The whole grade.
#[derive(Debug, Clone, PartialEq)]
pub struct Grade {
    pub model: String,
    pub pairs: Vec<PairGrade>,
    pub choices: Vec<ChoiceGrade>,
}

/// Grades `export` against `table` with the daemon's `knobs`, on GPUs of `gpu_memory_mb`.
pub fn grade(table: &Table, export: &Export, knobs: Knobs, gpu_memory_mb: u64) -> Result<Grade, String> {
    let mut h = History::open(Path::new(":memory:")).map_err(|e| e.to_string())?;
    h.import(export, knobs.unknown_pair_speed)?;
    Ok(Grade {
        model: table.model.clone(),
        pairs: pair_grades(&h, table, knobs)?,
        choices: choice_grades(&h, table, knobs, gpu_memory_mb)?,
    })
}

/// Every pair of the table, as the history estimates it beside the truth.
fn pair_grades(h: &History, table: &Table, knobs: Knobs) -> Result<Vec<PairGrade>, String> {
    let model = table.model.as_str();
    let mut wanted = placement::Wanted::default();
    for a in &table.apps {
        for b in &table.apps {
            wanted.pair(model, a, b);
        }
    }
    let est = h.estimates(&wanted).map_err(|e| e.to_string())?;
    let mut pairs = Vec::new();
    for (ai, a) in table.apps.iter().enumerate() {
        for (bi, b) in table.apps.iter().enumerate() {
            let (estimate, row, _) = placement::estimate(&est, model, a, b, knobs.unknown_pair_speed);
            pairs.push(PairGrade {
                app: a.clone(),
                other: b.clone(),
                truth: table.speed(ai, bi),
                estimate,
                observations: row.as_ref().map_or(0, |r| r.observations),
                oom: row.is_some_and(|r| r.oom),
            });
        }
    }
    Ok(pairs)
}

/// For each application, the partner placement picks among one GPU per application (each
/// holding one job of it) beside the truly best one.
fn choice_grades(h: &History, table: &Table, knobs: Knobs, gpu_memory_mb: u64) -> Result<Vec<ChoiceGrade>, String> {
    let model = table.model.as_str();
    let memory = |app: &str| h.app_mem_peak(app).ok().flatten();
    let gpus: Vec<GpuState> = table
        .apps
        .iter()
        .enumerate()
        .map(|(i, app)| GpuState {
            index: i as u32,
            model: model.to_string(),
            memory_mb: gpu_memory_mb,
            residents: vec![Resident {
                job_id: i as u32 + 1,
                app: app.clone(),
                mem_mb: memory(app),
                put_back: None,
            }],
        })
        .collect();
    let true_gain = |a: usize, b: usize| Some(table.speed(a, b)? + table.speed(b, a)? - 1.0);
    let mut choices = Vec::new();
    for (ai, app) in table.apps.iter().enumerate() {
        let job = Newcomer {
            app,
            mem_mb: memory(app),
        };
        let wanted = placement::wanted(&gpus, &job, knobs.slots);
        let est = h.estimates(&wanted).map_err(|e| e.to_string())?;
        let chosen = match placement::place(&gpus, &job, &est, knobs) {
            Decision::Place { gpu, .. } => Some(gpu as usize),
            Decision::Decline { .. } => None,
        };
        let best = (0..table.apps.len())
            .filter_map(|b| true_gain(ai, b).map(|g| (b, g)))
            .filter(|&(_, g)| g >= knobs.min_gain)
            .max_by(|x, y| x.1.total_cmp(&y.1))
            .map(|(b, g)| (table.apps[b].clone(), g));
        choices.push(ChoiceGrade {
            app: app.clone(),
            chosen: chosen.map(|b| table.apps[b].clone()),
            chosen_gain: chosen.and_then(|b| true_gain(ai, b)),
            best,
        });
    }
    Ok(choices)
}

impl Grade {
    /// The mean absolute error of the pairs the history measured, and how many there are.
    pub fn measured_error(&self) -> (f64, usize) {
        let errs: Vec<f64> = self
            .pairs
            .iter()
            .filter(|p| p.observations > 0 && !p.oom)
            .filter_map(|p| Some((p.estimate - p.truth?).abs()))
            .collect();
        (errs.iter().sum::<f64>() / errs.len().max(1) as f64, errs.len())
    }

    /// The grade in words: one line per pair, one per newcomer, and a summary line of each
    /// (`learning:` and `choices:`, which scripts look for).
    pub fn text(&self) -> String {
        let mut s = String::new();
        let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        let _ = writeln!(
            s,
            "pair (speed of the first beside the second)   true  learned  error  observations"
        );
        for p in &self.pairs {
            let err = p.truth.map(|t| (p.estimate - t).abs());
            let _ = writeln!(
                s,
                "{:<46} {:>5}  {:>7.3}  {:>5}  {}{}",
                format!("{} beside {}", p.app, p.other),
                f(p.truth),
                p.estimate,
                f(err),
                p.observations,
                if p.oom { " (ran out of memory together)" } else { "" }
            );
        }
        let (err, n) = self.measured_error();
        let _ = writeln!(
            s,
            "learning: {n} of {} pairs measured on {}, mean error {err:.3}; the prior stands in for the other {}",
            self.pairs.len(),
            self.model,
            self.pairs.iter().filter(|p| p.observations == 0).count()
        );
        let _ = writeln!(
            s,
            "\nnewcomer: chosen partner (true gain) / best per the table (true gain)"
        );
        for c in &self.choices {
            let chosen = match (&c.chosen, c.chosen_gain) {
                (Some(p), Some(g)) => format!("{p} ({g:+.3})"),
                (Some(p), None) => format!("{p} (cannot share)"),
                (None, _) => "waits".to_string(),
            };
            let best = c
                .best
                .as_ref()
                .map_or("waits".to_string(), |(p, g)| format!("{p} ({g:+.3})"));
            let _ = writeln!(s, "{:<24} {chosen} / {best}", c.app);
        }
        let right = self.choices.iter().filter(|c| c.regret() < 1e-9).count();
        let regret: f64 = self.choices.iter().map(ChoiceGrade::regret).sum::<f64>() / self.choices.len().max(1) as f64;
        let _ = writeln!(
            s,
            "choices: {right} of {} newcomers got the best partner (or waited where none gains); mean regret {regret:.3} jobs' worth",
            self.choices.len()
        );
        s
    }
}

/// The daemon's default knobs for `slots` jobs per GPU, with `min_gain`.
pub fn knobs(slots: u32, min_gain: f64, separate_below: f64) -> Knobs {
    Knobs {
        slots,
        unknown_pair_speed: DEFAULT_UNKNOWN_PAIR_SPEED,
        min_gain,
        share_queue: multiplexd::config::keys::SHARE_QUEUE.default,
        separate_below,
    }
}
