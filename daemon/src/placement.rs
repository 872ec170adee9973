//! The placement policy: the node's GPUs and the interference history in, a decision out.
//! Pure: no I/O, no clock. The daemon, the simulator and the tests call this same code.
//!
//! A GPU's value is the node's predicted total normalised throughput after the newcomer joins
//! it, minus what its residents deliver now. Each job's speed on a shared GPU is the product of
//! its pairwise speeds with every co-runner (1.0 alone). Pairs known to run out of memory and
//! memory hints that do not fit rule a GPU out; when every GPU is ruled out the job is declined.

use std::cell::RefCell;
use std::collections::HashMap;

/// A job already running on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Resident {
    pub job_id: u32,
    pub app: String,
    pub mem_mb: Option<u64>,
}

/// One shared GPU as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuState {
    pub index: u32,
    pub model: String,
    pub memory_mb: u64,
    pub residents: Vec<Resident>,
}

/// What the history knows about `app` running beside `other` on one GPU model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairEstimate {
    /// Speed of `app` beside `other`, relative to alone.
    pub speed: f64,
    /// Speed of `other` beside `app`.
    pub other_speed: f64,
    /// How many observations the estimate rests on.
    pub observations: u32,
    /// The pair ran out of GPU memory together: never again.
    pub oom: bool,
}

/// The history the policy reads.
pub trait PairHistory {
    /// The estimate for `app` beside `other` on `model`, if any observation exists.
    fn pair(&self, model: &str, app: &str, other: &str) -> Option<PairEstimate>;

    /// What is known of `app` beside others in general: its expected speed beside a typical
    /// partner, already weighed against the prior by how little it rests on, and how many
    /// learned pairs it rests on.
    fn app_mean(&self, _model: &str, _app: &str) -> Option<(f64, u32)> {
        None
    }

    /// How `app` changes its partners' speeds against their speed beside a typical partner,
    /// already weighed against "not at all" by how little it rests on, and how many learned
    /// pairs it rests on.
    fn app_impact(&self, _model: &str, _app: &str) -> Option<(f64, u32)> {
        None
    }

    /// How many of `app`'s pairs ran out of memory, and how many were tried (ran or failed).
    fn app_ooms(&self, _model: &str, _app: &str) -> (u32, u32) {
        (0, 0)
    }
}

/// "1 observation", "4 observations".
fn observations(n: u32) -> String {
    format!("{n} observation{}", if n == 1 { "" } else { "s" })
}

/// The speed of `app` beside `other`: learned if the pair was seen; else from what is known of
/// each application beside others (see [`unseen`]); else the prior. The text says which.
pub(crate) fn estimate(
    history: &dyn PairHistory,
    model: &str,
    app: &str,
    other: &str,
    prior: f64,
) -> (f64, Option<PairEstimate>, String) {
    let pair = history.pair(model, app, other);
    if let Some(e) = pair.filter(|e| e.observations > 0) {
        return (
            e.speed,
            Some(e),
            format!("{:.2} from {}", e.speed, observations(e.observations)),
        );
    }
    // A row without observations of this side (only the other side was learned, or only an
    // out-of-memory mark): its `speed` is a placeholder, but the row still counts for the rest.
    let (s, why) = unseen(history, model, app, other, prior);
    (s, pair, why)
}

/// The speed of `app` beside `other` never seen together, from an additive model (the
/// history's [`crate::learn::fit_effects`]): how `app` fares beside a typical partner plus how
/// `other` changes its partners' speeds.
fn unseen(history: &dyn PairHistory, model: &str, app: &str, other: &str, prior: f64) -> (f64, String) {
    let (base, mut why) = match history.app_mean(model, app) {
        Some((s, n)) if n > 0 => (s, format!("never seen together, {s:.2} from {app}'s {n} other pairs")),
        _ => (prior, format!("never seen together, assumed {prior:.2}")),
    };
    let impact = match history.app_impact(model, other) {
        Some((d, m)) if m > 0 => {
            why.push_str(&format!(", {d:+.2} from {other}'s effect on {m} others"));
            d
        }
        _ => 0.0,
    };
    ((base + impact).clamp(crate::learn::MIN_SPEED, 1.0), why)
}

/// The chance that `a` and `b`, never tried together, run out of memory: from how often each
/// ran out of memory with the partners it was tried with (shrunk towards none).
fn oom_risk(history: &dyn PairHistory, model: &str, a: &str, b: &str) -> f64 {
    let rate = |app: &str| {
        let (ooms, tried) = history.app_ooms(model, app);
        f64::from(ooms) / (f64::from(tried) + OOM_PRIOR_WEIGHT)
    };
    1.0 - (1.0 - rate(a)) * (1.0 - rate(b))
}

/// Pairs' worth of weight the prior "never runs out of memory" keeps.
const OOM_PRIOR_WEIGHT: f64 = 2.0;
/// What a failure costs, in jobs' worth of throughput, against a placement's predicted gain.
const OOM_PENALTY: f64 = 1.0;

/// The job to place.
#[derive(Debug, Clone, PartialEq)]
pub struct Newcomer<'a> {
    pub app: &'a str,
    pub mem_mb: Option<u64>,
}

/// Policy knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knobs {
    /// Jobs per GPU.
    pub slots: u32,
    /// Assumed speed of each side of a pair never seen together.
    pub unknown_pair_speed: f64,
    /// How much predicted gain placement gives up, at most, to try a pair never seen.
    pub explore_margin: f64,
    /// The least predicted gain (jobs' worth of throughput) worth sharing a GPU for: below
    /// it the job is declined and waits for a better partner or a free GPU (0: never).
    pub min_gain: f64,
}

/// The policy's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Place {
        gpu: u32,
        corunners: Vec<u32>,
        /// The newcomer's predicted speed.
        predicted_speed: f64,
        /// Predicted change of the node's total normalised throughput.
        gain: f64,
        reason: String,
    },
    Decline {
        reason: String,
        /// False when no GPU here could ever take the job (it needs more memory than the
        /// largest has), so waiting is pointless.
        may_retry: bool,
    },
}

struct Scored {
    gpu: u32,
    corunners: Vec<u32>,
    speed: f64,
    gain: f64,
    residents: usize,
    /// It would pair the newcomer with an application it was never seen beside.
    explores: bool,
    reason: String,
}

/// The history as one placement reads it: what is known of each application is asked once
/// (scoring asks it for the newcomer beside every resident, and for every resident beside
/// the newcomer), pairs are asked as they come.
struct Memo<'a> {
    history: &'a dyn PairHistory,
    means: PerApp<Option<(f64, u32)>>,
    impacts: PerApp<Option<(f64, u32)>>,
    ooms: PerApp<(u32, u32)>,
}

/// Answers per (GPU model, application).
type PerApp<T> = RefCell<HashMap<(String, String), T>>;

fn memo<T: Copy>(map: &PerApp<T>, model: &str, app: &str, ask: impl FnOnce() -> T) -> T {
    let key = (model.to_string(), app.to_string());
    if let Some(v) = map.borrow().get(&key) {
        return *v;
    }
    let v = ask();
    map.borrow_mut().insert(key, v);
    v
}

impl PairHistory for Memo<'_> {
    fn pair(&self, model: &str, app: &str, other: &str) -> Option<PairEstimate> {
        self.history.pair(model, app, other)
    }
    fn app_mean(&self, model: &str, app: &str) -> Option<(f64, u32)> {
        memo(&self.means, model, app, || self.history.app_mean(model, app))
    }
    fn app_impact(&self, model: &str, app: &str) -> Option<(f64, u32)> {
        memo(&self.impacts, model, app, || self.history.app_impact(model, app))
    }
    fn app_ooms(&self, model: &str, app: &str) -> (u32, u32) {
        memo(&self.ooms, model, app, || self.history.app_ooms(model, app))
    }
}

/// The newcomer's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` where the site runs MPS: its share of
/// the predicted slowdowns (`1 - speed`) of the jobs on the GPU, so that the job its partners
/// slow more may use more of the GPU; equal slowdowns give equal shares. Kept between half
/// the equal share and 80%; alone, 100. Only the newcomer's limit is set: MPS fixes a
/// client's limit when it starts.
///
/// Measured on one H100 (`tests/gpu/mps-check`): a compute-bound job beside a memory-bound
/// one ran at 0.39 and 0.68 of their solo speeds with no limits (sum 1.07), 0.31 and 0.84 at
/// 50/50 (1.15), 0.41 and 0.75 at 60/40 (1.16) and 0.70 and 0.55 at 75/25 (1.25): the job
/// slowed more gains most from a larger share. This rule gives that pair 66/34.
pub fn mps_share(speed: f64, partner_speeds: &[f64]) -> u32 {
    if partner_speeds.is_empty() {
        return 100;
    }
    let slowdown = |s: f64| (1.0 - s).clamp(0.0, 1.0);
    let n = partner_speeds.len() as f64 + 1.0;
    let mine = slowdown(speed);
    let all = mine + partner_speeds.iter().map(|&s| slowdown(s)).sum::<f64>();
    let share = if all < 1e-9 { 1.0 / n } else { mine / all };
    (100.0 * share).round().clamp((50.0 / n).round(), 80.0) as u32
}

/// Chooses a GPU for `job`, or declines with the reason for every GPU.
pub fn place(gpus: &[GpuState], job: &Newcomer, history: &dyn PairHistory, knobs: Knobs) -> Decision {
    let memo = Memo {
        history,
        means: Default::default(),
        impacts: Default::default(),
        ooms: Default::default(),
    };
    let history: &dyn PairHistory = &memo;
    let largest = gpus.iter().map(|g| g.memory_mb).max().unwrap_or(0);
    if let Some(need) = job.mem_mb.filter(|&m| !gpus.is_empty() && m > largest) {
        return Decision::Decline {
            reason: format!("it needs {need} MiB of GPU memory and the largest GPU here has {largest} MiB"),
            may_retry: false,
        };
    }
    let mut best: Option<Scored> = None;
    let mut candidates = Vec::new();
    let mut refusals = Vec::new();
    for gpu in gpus {
        match score(gpu, job, history, knobs) {
            Ok(s) => candidates.push(s),
            Err(why) => refusals.push(format!("GPU {}: {why}", gpu.index)),
        }
    }
    let top = candidates.iter().map(|s| s.gain).fold(f64::NEG_INFINITY, f64::max);
    let margin = knobs.explore_margin;
    for s in candidates {
        let better = match &best {
            None => true,
            Some(b) => {
                // Within `margin` of the best gain, a pair never seen wins: what it teaches
                // is worth that much (bounded: no choice loses more than `margin`).
                let tries = |c: &Scored| margin > 0.0 && c.explores && c.gain >= top - margin;
                let (s_x, b_x) = (tries(&s), tries(b));
                if s_x != b_x {
                    s_x
                } else {
                    // Higher gain wins; on a tie the emptier GPU, then the lower index.
                    (s.gain - b.gain > 1e-9) || ((s.gain - b.gain).abs() <= 1e-9 && s.residents < b.residents)
                }
            }
        };
        if better {
            best = Some(s);
        }
    }
    match best {
        // Sharing for less than this leaves the slot to a later job that pairs better (Slurm
        // offers it to the next queued job at once) or to this one when a GPU frees.
        Some(s) if knobs.min_gain > 0.0 && s.residents > 0 && s.gain < knobs.min_gain => Decision::Decline {
            reason: format!(
                "sharing the best GPU here would gain {:.2} of a GPU's throughput, less than the {:.2} \
                 worth sharing for ({}): waiting for a better partner or a free GPU",
                s.gain, knobs.min_gain, s.reason
            ),
            may_retry: true,
        },
        Some(s) => Decision::Place {
            gpu: s.gpu,
            corunners: s.corunners,
            predicted_speed: s.speed,
            gain: s.gain,
            reason: s.reason,
        },
        None if gpus.is_empty() => Decision::Decline {
            reason: "this node has no shared GPU".into(),
            may_retry: false,
        },
        None => Decision::Decline {
            reason: refusals.join("; "),
            may_retry: true,
        },
    }
}

fn score(gpu: &GpuState, job: &Newcomer, history: &dyn PairHistory, knobs: Knobs) -> Result<Scored, String> {
    if gpu.residents.len() as u32 >= knobs.slots {
        return Err(format!("full ({} of {} jobs)", gpu.residents.len(), knobs.slots));
    }
    if let Some(need) = job.mem_mb {
        let used: u64 = gpu.residents.iter().filter_map(|r| r.mem_mb).sum();
        if used + need > gpu.memory_mb {
            return Err(format!(
                "memory: {need} MiB asked, {} of {} MiB already promised",
                used, gpu.memory_mb
            ));
        }
    }
    if gpu.residents.is_empty() {
        return Ok(Scored {
            gpu: gpu.index,
            corunners: vec![],
            speed: 1.0,
            gain: 1.0,
            residents: 0,
            explores: false,
            reason: format!("GPU {} is free: runs alone", gpu.index),
        });
    }
    let prior = knobs.unknown_pair_speed;
    let mut speed = 1.0;
    let mut gain = 0.0;
    let mut safe = 1.0;
    let mut explores = false;
    let mut notes = Vec::new();
    for r in &gpu.residents {
        let (mine, est, why) = estimate(history, &gpu.model, job.app, &r.app, prior);
        if est.is_some_and(|e| e.oom) {
            return Err(format!(
                "{} beside {} (job {}) ran out of memory before",
                job.app, r.app, r.job_id
            ));
        }
        if est.is_none_or(|e| e.observations == 0) {
            explores = true;
            safe *= 1.0 - oom_risk(history, &gpu.model, job.app, &r.app);
        }
        let theirs = match est {
            Some(e) => e.other_speed,
            None => estimate(history, &gpu.model, &r.app, job.app, prior).0,
        };
        speed *= mine;
        // The resident's speed now, from its pairs with the other residents.
        let now: f64 = gpu
            .residents
            .iter()
            .filter(|o| o.job_id != r.job_id)
            .map(|o| estimate(history, &gpu.model, &r.app, &o.app, prior).0)
            .product();
        gain += now * theirs - now;
        notes.push(match est.filter(|e| e.observations > 0) {
            Some(e) => format!(
                "beside {} (job {}): {:.2}/{:.2} from {}",
                r.app,
                r.job_id,
                mine,
                theirs,
                observations(e.observations)
            ),
            None => format!("beside {} (job {}): {why}", r.app, r.job_id),
        });
    }
    gain += speed;
    // A pair never tried may fail: expected gain, less what a failure costs.
    let risk = 1.0 - safe;
    let mut reason = format!("GPU {} shared, {}", gpu.index, notes.join(", "));
    if risk > 0.0 {
        gain = safe * gain - risk * OOM_PENALTY;
        reason.push_str(&format!("; {:.0}% risk of running out of memory", 100.0 * risk));
    }
    Ok(Scored {
        gpu: gpu.index,
        corunners: gpu.residents.iter().map(|r| r.job_id).collect(),
        speed,
        gain,
        residents: gpu.residents.len(),
        explores,
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Default)]
    struct Table(HashMap<(String, String), PairEstimate>);

    impl Table {
        fn with(mut self, a: &str, b: &str, sa: f64, sb: f64, oom: bool) -> Self {
            self.0.insert(
                (a.into(), b.into()),
                PairEstimate {
                    speed: sa,
                    other_speed: sb,
                    observations: 3,
                    oom,
                },
            );
            self.0.insert(
                (b.into(), a.into()),
                PairEstimate {
                    speed: sb,
                    other_speed: sa,
                    observations: 3,
                    oom,
                },
            );
            self
        }
    }

    impl PairHistory for Table {
        fn pair(&self, _model: &str, app: &str, other: &str) -> Option<PairEstimate> {
            self.0.get(&(app.to_string(), other.to_string())).copied()
        }
    }

    fn gpu(index: u32, residents: &[(u32, &str)]) -> GpuState {
        GpuState {
            index,
            model: "v100".into(),
            memory_mb: 16384,
            residents: residents
                .iter()
                .map(|(j, a)| Resident {
                    job_id: *j,
                    app: a.to_string(),
                    mem_mb: None,
                })
                .collect(),
        }
    }

    const KNOBS: Knobs = Knobs {
        slots: 2,
        unknown_pair_speed: 0.7,
        explore_margin: 0.0,
        min_gain: 0.0,
    };

    fn chosen(d: &Decision) -> u32 {
        match d {
            Decision::Place { gpu, .. } => *gpu,
            Decision::Decline { reason, .. } => panic!("declined: {reason}"),
        }
    }

    #[test]
    fn free_gpu_beats_sharing_with_unknown() {
        let gpus = [gpu(0, &[(1, "a")]), gpu(1, &[])];
        let d = place(&gpus, &Newcomer { app: "b", mem_mb: None }, &Table::default(), KNOBS);
        assert_eq!(chosen(&d), 1);
        assert!(matches!(d, Decision::Place { predicted_speed, .. } if predicted_speed == 1.0));
    }

    #[test]
    fn picks_the_partner_that_interferes_least() {
        let h = Table::default()
            .with("new", "heavy", 0.4, 0.5, false)
            .with("new", "light", 0.9, 0.95, false);
        let gpus = [gpu(0, &[(1, "heavy")]), gpu(1, &[(2, "light")])];
        let d = place(
            &gpus,
            &Newcomer {
                app: "new",
                mem_mb: None,
            },
            &h,
            KNOBS,
        );
        match d {
            Decision::Place {
                gpu,
                corunners,
                predicted_speed,
                gain,
                ..
            } => {
                assert_eq!(gpu, 1);
                assert_eq!(corunners, vec![2]);
                assert!((predicted_speed - 0.9).abs() < 1e-9);
                assert!((gain - (0.9 + 0.95 - 1.0)).abs() < 1e-9);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pair_worth_less_than_min_gain_is_declined_and_waits() {
        // new beside heavy: 0.5 + 0.6 - 1 = 0.1 of a GPU gained, below 0.25.
        let h = Table::default().with("new", "heavy", 0.5, 0.6, false);
        let new = Newcomer {
            app: "new",
            mem_mb: None,
        };
        let knobs = Knobs {
            min_gain: 0.25,
            ..KNOBS
        };
        match place(&[gpu(0, &[(1, "heavy")])], &new, &h, knobs) {
            Decision::Decline { reason, may_retry } => {
                assert!(may_retry, "a better slot may come: {reason}");
                assert!(
                    reason.contains("would gain 0.10") && reason.contains("than the 0.25") && reason.contains("heavy"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        // Without a threshold it shares; with one, a free GPU or a pair never seen (0.7 each:
        // 0.4 gained) is still taken.
        assert_eq!(chosen(&place(&[gpu(0, &[(1, "heavy")])], &new, &h, KNOBS)), 0);
        assert_eq!(
            chosen(&place(&[gpu(0, &[(1, "heavy")]), gpu(1, &[])], &new, &h, knobs)),
            1
        );
        assert_eq!(chosen(&place(&[gpu(0, &[(1, "other")])], &new, &h, knobs)), 0);
    }

    #[test]
    fn a_pair_worth_more_than_a_free_gpu_is_taken() {
        // Sum of speeds 2.1 > 2.0: sharing delivers more than a GPU alone.
        let h = Table::default().with("new", "good", 1.0, 1.1, false);
        let gpus = [gpu(0, &[]), gpu(1, &[(2, "good")])];
        assert_eq!(
            chosen(&place(
                &gpus,
                &Newcomer {
                    app: "new",
                    mem_mb: None
                },
                &h,
                KNOBS
            )),
            1
        );
    }

    #[test]
    fn oom_pairs_and_full_gpus_are_never_chosen() {
        let h = Table::default().with("new", "big", 0.9, 0.9, true);
        let gpus = [gpu(0, &[(1, "big")]), gpu(1, &[(2, "x"), (3, "y")])];
        match place(
            &gpus,
            &Newcomer {
                app: "new",
                mem_mb: None,
            },
            &h,
            KNOBS,
        ) {
            Decision::Decline { reason, .. } => {
                assert!(
                    reason.contains("GPU 0: new beside big (job 1) ran out of memory"),
                    "{reason}"
                );
                assert!(reason.contains("GPU 1: full (2 of 2 jobs)"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn memory_hint_that_does_not_fit_is_declined() {
        let mut g = gpu(0, &[(1, "a")]);
        g.residents[0].mem_mb = Some(10000);
        let d = place(
            &[g.clone()],
            &Newcomer {
                app: "b",
                mem_mb: Some(8000),
            },
            &Table::default(),
            KNOBS,
        );
        assert!(
            matches!(&d, Decision::Decline { reason, may_retry: true } if reason.contains("memory: 8000 MiB asked")),
            "{d:?}"
        );
        let d = place(
            &[g],
            &Newcomer {
                app: "b",
                mem_mb: Some(6000),
            },
            &Table::default(),
            KNOBS,
        );
        assert_eq!(chosen(&d), 0);
    }

    #[test]
    fn a_job_larger_than_every_gpu_is_declined_for_good() {
        let d = place(
            &[gpu(0, &[]), gpu(1, &[])],
            &Newcomer {
                app: "b",
                mem_mb: Some(999_999),
            },
            &Table::default(),
            KNOBS,
        );
        assert!(
            matches!(&d, Decision::Decline { reason, may_retry: false } if reason.contains("largest GPU here has")),
            "{d:?}"
        );
    }

    #[test]
    fn no_gpu_is_a_decline() {
        let d = place(&[], &Newcomer { app: "b", mem_mb: None }, &Table::default(), KNOBS);
        assert!(matches!(d, Decision::Decline { .. }));
    }

    #[test]
    fn three_way_sharing_multiplies_speeds() {
        let h = Table::default()
            .with("n", "a", 0.8, 0.9, false)
            .with("n", "b", 0.5, 0.6, false)
            .with("a", "b", 0.7, 0.7, false);
        let gpus = [gpu(0, &[(1, "a"), (2, "b")])];
        let knobs = Knobs { slots: 3, ..KNOBS };
        match place(&gpus, &Newcomer { app: "n", mem_mb: None }, &h, knobs) {
            Decision::Place {
                predicted_speed, gain, ..
            } => {
                assert!((predicted_speed - 0.4).abs() < 1e-9);
                // a: 0.7 -> 0.7*0.9 ; b: 0.7 -> 0.7*0.6 ; plus n at 0.4
                let want = 0.4 + (0.63 - 0.7) + (0.42 - 0.7);
                assert!((gain - want).abs() < 1e-9, "{gain} vs {want}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A history that knows each application's mean speed beside others, and no pair.
    struct Means(HashMap<String, (f64, u32)>);

    impl PairHistory for Means {
        fn pair(&self, _model: &str, _app: &str, _other: &str) -> Option<PairEstimate> {
            None
        }
        fn app_mean(&self, _model: &str, app: &str) -> Option<(f64, u32)> {
            self.0.get(app).copied()
        }
    }

    #[test]
    fn an_unseen_pair_is_estimated_from_what_is_known_of_each_application() {
        let h = Means(HashMap::from([
            ("gentle".to_string(), (0.9, 4)),
            ("greedy".to_string(), (0.4, 4)),
        ]));
        let newcomer = |app| Newcomer { app, mem_mb: None };
        // Only GPU 0 has a free slot, beside `greedy`, a pair never seen: gentle's speed comes
        // from what is known of it beside others (0.9).
        let gpus = [gpu(0, &[(1, "greedy")]), gpu(1, &[(2, "x"), (3, "y")])];
        match place(&gpus, &newcomer("gentle"), &h, KNOBS) {
            Decision::Place {
                gpu,
                predicted_speed,
                reason,
                ..
            } => {
                assert_eq!(gpu, 0);
                assert!((predicted_speed - 0.9).abs() < 1e-9, "{predicted_speed}");
                assert!(reason.contains("0.90 from gentle's 4 other pairs"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // Nothing known of the application: the flat prior.
        match place(&gpus, &newcomer("new"), &h, KNOBS) {
            Decision::Place {
                predicted_speed,
                reason,
                ..
            } => {
                assert!((predicted_speed - KNOBS.unknown_pair_speed).abs() < 1e-9);
                assert!(reason.contains("never seen together, assumed 0.70"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A history that knows, per application, its mean, its effect on others and its
    /// out-of-memory record, and no pair.
    #[derive(Default)]
    struct Profiles {
        means: HashMap<String, (f64, u32)>,
        impacts: HashMap<String, (f64, u32)>,
        ooms: HashMap<String, (u32, u32)>,
    }

    impl PairHistory for Profiles {
        fn pair(&self, _model: &str, _app: &str, _other: &str) -> Option<PairEstimate> {
            None
        }
        fn app_mean(&self, _model: &str, app: &str) -> Option<(f64, u32)> {
            self.means.get(app).copied()
        }
        fn app_impact(&self, _model: &str, app: &str) -> Option<(f64, u32)> {
            self.impacts.get(app).copied()
        }
        fn app_ooms(&self, _model: &str, app: &str) -> (u32, u32) {
            self.ooms.get(app).copied().unwrap_or((0, 0))
        }
    }

    #[test]
    fn an_unseen_partner_known_to_slow_others_is_avoided() {
        // `hog` slows its partners 0.3 below their usual speed; `mild` leaves them 0.1 above.
        // Nothing is known of the newcomer.
        let h = Profiles {
            impacts: HashMap::from([("hog".to_string(), (-0.3, 6)), ("mild".to_string(), (0.1, 6))]),
            ..Default::default()
        };
        let gpus = [gpu(0, &[(1, "hog")]), gpu(1, &[(2, "mild")])];
        match place(
            &gpus,
            &Newcomer {
                app: "new",
                mem_mb: None,
            },
            &h,
            KNOBS,
        ) {
            Decision::Place {
                gpu,
                predicted_speed,
                reason,
                ..
            } => {
                assert_eq!(gpu, 1, "{reason}");
                assert!((predicted_speed - (0.7 + 0.1)).abs() < 1e-9, "{predicted_speed}");
                assert!(
                    reason.contains("assumed 0.70, +0.10 from mild's effect on 6 others"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_application_that_often_ran_out_of_memory_is_a_risky_partner() {
        // `big` ran out of memory with 6 of the 7 partners it was tried with: a pair with it
        // never tried is likely to fail (6 / (7 + 2) = 67%), so the newcomer joins the other
        // GPU, although the prior says both pairs are alike.
        let h = Profiles {
            ooms: HashMap::from([("big".to_string(), (6, 7))]),
            ..Default::default()
        };
        let gpus = [gpu(0, &[(1, "big")]), gpu(1, &[(2, "small")])];
        let d = place(
            &gpus,
            &Newcomer {
                app: "new",
                mem_mb: None,
            },
            &h,
            KNOBS,
        );
        assert_eq!(chosen(&d), 1, "{d:?}");
        // With only the risky GPU free, the job is still placed without a `min_gain` (a pair
        // never tried is not ruled out), and the reason says what it risks; with one, the
        // expected gain (negative at 67% risk) is too little and the job waits instead.
        let gpus = [gpu(0, &[(1, "big")]), gpu(1, &[(2, "x"), (3, "y")])];
        match place(
            &gpus,
            &Newcomer {
                app: "new",
                mem_mb: None,
            },
            &h,
            KNOBS,
        ) {
            Decision::Place { gpu, reason, .. } => {
                assert_eq!(gpu, 0);
                assert!(reason.contains("67% risk of running out of memory"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let knobs = Knobs {
            min_gain: 0.25,
            ..KNOBS
        };
        match place(
            &gpus,
            &Newcomer {
                app: "new",
                mem_mb: None,
            },
            &h,
            knobs,
        ) {
            Decision::Decline {
                reason,
                may_retry: true,
            } => {
                assert!(reason.contains("67% risk of running out of memory"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn within_the_margin_a_pair_never_seen_is_tried() {
        // GPU 0 pairs the newcomer with `known` (0.72 each way, seen); GPU 1 with `fresh`,
        // never seen (0.7 each way assumed): gains 0.44 and 0.40. Without a margin the known
        // pair wins; with a margin of 0.05 the unseen one is tried; 0.03 is not enough.
        let h = Table::default().with("new", "known", 0.72, 0.72, false);
        let gpus = [gpu(0, &[(1, "known")]), gpu(1, &[(2, "fresh")])];
        let job = Newcomer {
            app: "new",
            mem_mb: None,
        };
        let with = |m| Knobs {
            explore_margin: m,
            ..KNOBS
        };
        assert_eq!(chosen(&place(&gpus, &job, &h, with(0.0))), 0);
        assert_eq!(chosen(&place(&gpus, &job, &h, with(0.05))), 1);
        assert_eq!(chosen(&place(&gpus, &job, &h, with(0.03))), 0);
        // A free GPU is never given up for exploration: its gain (1.0) is far above.
        let gpus = [gpu(0, &[]), gpu(1, &[(2, "fresh")])];
        assert_eq!(chosen(&place(&gpus, &job, &h, with(0.05))), 0);
    }

    #[test]
    fn mps_limits_follow_the_predicted_slowdowns() {
        assert_eq!(mps_share(1.0, &[]), 100);
        // The measured H100 pair: the compute-bound newcomer slowed to 0.39, its partner to 0.68.
        assert_eq!(mps_share(0.39, &[0.68]), 66);
        assert_eq!(mps_share(0.68, &[0.39]), 34);
        // Equal, or no slowdown at all: equal shares.
        assert_eq!(mps_share(0.7, &[0.7]), 50);
        assert_eq!(mps_share(1.0, &[1.0]), 50);
        // Bounds: never below half the equal share, never above 80%.
        assert_eq!(mps_share(0.95, &[0.1]), 25);
        assert_eq!(mps_share(0.1, &[0.95]), 80);
        assert_eq!(mps_share(0.5, &[0.5, 0.5]), 33);
    }
}
