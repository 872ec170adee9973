//! The placement policy: the node's GPUs and the interference history in, a decision out.
//! Pure: no I/O, no clock. The daemon, the simulator and the tests call this same code.
//!
//! A GPU's value is the node's predicted total normalised throughput after the newcomer joins
//! it, minus what its residents deliver now. Each job's speed on a shared GPU is the product of
//! its pairwise speeds with every co-runner (1.0 alone). Pairs known to run out of memory and
//! memory hints that do not fit rule a GPU out; when every GPU is ruled out the job is declined.

pub use crate::types::{
    AppProfile, Decision, Estimates, GpuState, Knobs, Newcomer, PairEstimate, Resident, Wanted, CENTER_PRIOR_WEIGHT,
};

/// What [`place`] will read to decide where `job` goes among `gpus`: the newcomer beside every
/// resident of a GPU with a free slot, and each such resident beside the others there.
pub fn wanted(gpus: &[GpuState], job: &Newcomer, slots: u32) -> Wanted {
    let mut w = Wanted::default();
    for gpu in gpus.iter().filter(|g| (g.residents.len() as u32) < slots) {
        for r in &gpu.residents {
            w.pair(&gpu.model, job.app, &r.app);
        }
        w.residents(gpu);
    }
    w
}

/// "1 observation", "4 observations".
fn observations(n: u32) -> String {
    format!("{n} observation{}", if n == 1 { "" } else { "s" })
}

/// The speed of `app` beside `other`: learned if the pair was seen; else from what is known of
/// each application beside others (see [`unseen`]); else the prior. The text says which.
pub fn estimate(
    history: &Estimates,
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
///
/// The additive model is fitted around `prior`, each application's effect pulled towards none;
/// here it is pulled towards what this GPU model's pairs do instead ([`Estimates::center`]),
/// by the same weight.
fn unseen(history: &Estimates, model: &str, app: &str, other: &str, prior: f64) -> (f64, String) {
    let (center, learned) = history.center(model, prior);
    let (base, mut why) = match history.app(model, app).base {
        Some((s, n)) if n > 0 => {
            let ridge = crate::learn::EFFECT_RIDGE;
            let s = s + (center - prior) * ridge / (f64::from(n) + ridge);
            (s, format!("never seen together, {s:.2} from {app}'s {n} other pairs"))
        }
        _ if learned > 0 => (
            center,
            format!("never seen together, assumed {center:.2} from {learned} speeds learned on this GPU model"),
        ),
        _ => (prior, format!("never seen together, assumed {prior:.2}")),
    };
    let impact = match history.app(model, other).impact {
        Some((d, m)) if m > 0 => {
            why.push_str(&format!(", {d:+.2} from {other}'s effect on {m} others"));
            d
        }
        _ => 0.0,
    };
    ((base + impact).clamp(crate::learn::MIN_SPEED, 1.0), why)
}

/// The chance that `a` and `b`, never tried together, run out of memory: the larger of the
/// two applications' failure rates, each how often it ran out of memory with the partners it
/// was tried with (shrunk towards none).
///
/// The larger, not the two combined: a failure is a pair's and counts in both rates, so
/// combining them as independent causes would count it twice (measured in
/// docs/notebook/2026-11-results.md, "Calibrated risk").
fn oom_risk(history: &Estimates, model: &str, a: &str, b: &str) -> f64 {
    let rate = |app: &str| {
        let (ooms, tried) = history.app(model, app).ooms;
        f64::from(ooms) / (f64::from(tried) + OOM_PRIOR_WEIGHT)
    };
    rate(a).max(rate(b))
}

/// Pairs' worth of weight the prior "never runs out of memory" keeps.
const OOM_PRIOR_WEIGHT: f64 = 2.0;
/// What a failure costs, in jobs' worth of throughput, against a placement's predicted gain:
/// a pair never tried is taken when `(1 - risk) gain > risk OOM_PENALTY`. A failed trial holds
/// a slot a minute; its user pays the rest, which the simulator prices (resubmitted half an
/// hour later, its work lost), so JCT counts it. 0.1 over every table with that price (0.3,
/// chosen when a failure cost 3 minutes, was 1.23x least-loaded's JCT on `most-oom` at load
/// 1.5): docs/notebook/2026-11-results.md, "Failures priced".
const OOM_PENALTY: f64 = 0.1;

struct Scored {
    gpu: u32,
    corunners: Vec<u32>,
    speed: f64,
    gain: f64,
    residents: usize,
    /// Some resident was never seen with the newcomer.
    untried: bool,
    reason: String,
}

impl Scored {
    /// The least gain this share is taken for: `min_gain` for pairs seen before; for one
    /// never tried, any gain at all. `min_gain` holds a slot for a better partner the history
    /// knows of; a pair never tried is also how the history learns, and its estimate comes
    /// from what this GPU model's pairs do ([`Estimates::center`]): where few pairs gain,
    /// none is tried; where most do, as before.
    fn least_gain(&self, min_gain: f64) -> f64 {
        if self.untried {
            0.0
        } else {
            min_gain
        }
    }
}

/// The newcomer's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` where the site runs MPS: its share of
/// the predicted slowdowns (`1 - speed`) of the jobs on the GPU, so that the job its partners
/// slow more may use more of the GPU; equal slowdowns give equal shares. Kept between half
/// the equal share and 80%; alone, 100. Only the newcomer's limit is set: MPS fixes a
/// client's limit when it starts. The job slowed more gains most from a larger share
/// (measured in docs/notebook/2026-11-results.md, "Does the daemon read real GPUs right?").
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
/// `history` must hold what [`wanted`] asks for (what it lacks counts as never seen).
pub fn place(gpus: &[GpuState], job: &Newcomer, history: &Estimates, knobs: Knobs) -> Decision {
    let largest = gpus.iter().map(|g| g.memory_mb).max().unwrap_or(0);
    if let Some(need) = job.mem_mb.filter(|&m| !gpus.is_empty() && m > largest) {
        return Decision::Decline {
            reason: format!("it needs {need} MiB of GPU memory and the largest GPU here has {largest} MiB"),
            may_retry: false,
        };
    }
    let mut candidates = Vec::new();
    let mut refusals = Vec::new();
    for gpu in gpus {
        match score(gpu, job, history, knobs) {
            Ok(s) => candidates.push(s),
            Err(why) => refusals.push(format!("GPU {}: {why}", gpu.index)),
        }
    }
    match best(candidates) {
        // Sharing for less than this leaves the slot to a later job that pairs better (Slurm
        // offers it to the next queued job at once) or to this one when a GPU frees.
        Some(s) if knobs.min_gain > 0.0 && s.residents > 0 && s.gain < s.least_gain(knobs.min_gain) => {
            let least = if s.untried {
                "nothing, for a pair never tried,".to_string()
            } else {
                format!("the {:.2}", knobs.min_gain)
            };
            Decision::Decline {
                reason: format!(
                    "sharing the best GPU here would gain {:.2} of a GPU's throughput, less than {least} \
                     worth sharing for ({}): waiting for a better partner or a free GPU",
                    s.gain, s.reason
                ),
                may_retry: true,
            }
        }
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

/// What [`place`] scores `gpu` for `job`, without its words: the gain, how many jobs run
/// there, and the least gain the share is taken for; `None` where the GPU is refused.
pub fn worth(gpu: &GpuState, job: &Newcomer, history: &Estimates, knobs: Knobs) -> Option<(f64, usize, f64)> {
    score(gpu, job, history, knobs)
        .ok()
        .map(|s| (s.gain, s.residents, s.least_gain(knobs.min_gain)))
}

/// The best of the scored GPUs: higher gain wins; on a tie the emptier GPU, then the lower
/// index.
fn best(candidates: Vec<Scored>) -> Option<Scored> {
    let mut best: Option<Scored> = None;
    for s in candidates {
        let better = best
            .as_ref()
            .is_none_or(|b| (s.gain - b.gain > 1e-9) || ((s.gain - b.gain).abs() <= 1e-9 && s.residents < b.residents));
        if better {
            best = Some(s);
        }
    }
    best
}

/// Whether a newcomer needing `job_mem_mb` and every resident of `gpu` have their memory known
/// (a hint, or measured through NVML): placement checks that it fits, and a pair never tried
/// there carries no risk from how often its applications ran out of memory with others (those
/// rates stand in for memory where nothing measures it, and memory is what runs out).
pub fn memory_known(job_mem_mb: Option<u64>, gpu: &GpuState) -> bool {
    job_mem_mb.is_some() && gpu.residents.iter().all(|r| r.mem_mb.is_some())
}

/// Whether a pair's row (`history.pair`) says it never ran together: no speed learned (a pair
/// that ran out of memory is ruled out before this is asked).
pub fn untried_pair(estimate: Option<PairEstimate>) -> bool {
    estimate.is_none_or(|e| e.observations == 0)
}

fn score(gpu: &GpuState, job: &Newcomer, history: &Estimates, knobs: Knobs) -> Result<Scored, String> {
    fits(gpu, job, knobs)?;
    if gpu.residents.is_empty() {
        return Ok(Scored {
            gpu: gpu.index,
            corunners: vec![],
            speed: 1.0,
            gain: 1.0,
            residents: 0,
            untried: false,
            reason: format!("GPU {} is free: runs alone", gpu.index),
        });
    }
    let b = beside(gpu, job, history, knobs.unknown_pair_speed)?;
    given_back_at_once(gpu, job, history, knobs)?;
    let mut gain = b.gain + b.speed;
    // A pair never tried may fail: expected gain, less what a failure costs.
    let risk = 1.0 - b.safe;
    let mut reason = format!("GPU {} shared, {}", gpu.index, b.notes.join(", "));
    if risk > 0.0 {
        gain = b.safe * gain - risk * OOM_PENALTY;
        reason.push_str(&format!("; {:.0}% risk of running out of memory", 100.0 * risk));
    }
    Ok(Scored {
        gpu: gpu.index,
        corunners: gpu.residents.iter().map(|r| r.job_id).collect(),
        speed: b.speed,
        gain,
        residents: gpu.residents.len(),
        untried: b.untried,
        reason,
    })
}

/// Whether the GPU has a slot for the job and, where its memory is known, room.
fn fits(gpu: &GpuState, job: &Newcomer, knobs: Knobs) -> Result<(), String> {
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
    Ok(())
}

/// What the job beside a GPU's residents comes to: its predicted speed, what the residents
/// gain or lose (their speeds now against beside it), the chance that no untried pair runs
/// out of memory, whether any pair is untried, and a note per resident.
struct Beside {
    speed: f64,
    gain: f64,
    safe: f64,
    untried: bool,
    notes: Vec<String>,
}

fn beside(gpu: &GpuState, job: &Newcomer, history: &Estimates, prior: f64) -> Result<Beside, String> {
    let memory_known = memory_known(job.mem_mb, gpu);
    let mut b = Beside {
        speed: 1.0,
        gain: 0.0,
        safe: 1.0,
        untried: false,
        notes: Vec::new(),
    };
    for r in &gpu.residents {
        let (mine, est, why) = estimate(history, &gpu.model, job.app, &r.app, prior);
        if est.is_some_and(|e| e.oom) {
            return Err(format!(
                "{} beside {} (job {}) ran out of memory before",
                job.app, r.app, r.job_id
            ));
        }
        if untried_pair(est) {
            if !memory_known {
                // One gamble on a pair at a time: a second job of it waits for how the first
                // went, so that a pair that does not fit fails once, not once per job that
                // arrives before its failure reaches this history.
                if let Some(trial) = history.trying(&gpu.model, job.app, &r.app) {
                    return Err(format!(
                        "{} beside {} (job {}) was never tried and job {trial} is trying it: \
                         waiting for how that goes",
                        job.app, r.app, r.job_id
                    ));
                }
                b.safe *= 1.0 - oom_risk(history, &gpu.model, job.app, &r.app);
            }
            b.untried = true;
        }
        // The resident's side from its own row: the newcomer's row holds it as `other_speed`
        // only once it was learned (the prior until then), where the resident's row falls
        // back on what is known of each application instead.
        let theirs = estimate(history, &gpu.model, &r.app, job.app, prior).0;
        b.speed *= mine;
        // The resident's speed now, from its pairs with the other residents.
        let now: f64 = gpu
            .residents
            .iter()
            .filter(|o| o.job_id != r.job_id)
            .map(|o| estimate(history, &gpu.model, &r.app, &o.app, prior).0)
            .product();
        b.gain += now * theirs - now;
        b.notes.push(match est.filter(|e| e.observations > 0) {
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
    Ok(b)
}

/// A share whose every pair was measured and that the separation look would undo on its first
/// look (the newcomer given back, its work lost) is no share to make; the estimates may
/// disagree with that look, which reads each side from its own measurements.
fn given_back_at_once(gpu: &GpuState, job: &Newcomer, history: &Estimates, knobs: Knobs) -> Result<(), String> {
    if knobs.separate_below <= 0.0 {
        return Ok(());
    }
    let mut with = gpu.clone();
    with.residents.push(Resident {
        job_id: u32::MAX,
        app: job.app.to_string(),
        mem_mb: job.mem_mb,
        put_back: None,
    });
    // Its text names the partners only, never the newcomer's stand-in id.
    let prior = knobs.unknown_pair_speed;
    match separations(&[with], history, knobs.separate_below, prior, |_| false).pop() {
        Some(s) => Err(format!("{}: a share given back as soon as measured", s.why)),
        None => Ok(()),
    }
}

// Separations: jobs measured to run worse together than one after the other, which
// `crate::separate` gives back to Slurm.

/// A job to give back to Slurm, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Separation {
    pub gpu: u32,
    pub job_id: u32,
    pub why: String,
}

/// What [`separations`] will read: every pair on each GPU that runs more than one job.
pub fn separation_wanted(gpus: &[GpuState]) -> Wanted {
    let mut w = Wanted::default();
    for gpu in gpus {
        w.residents(gpu);
    }
    w
}

/// A newcomer running below this share of its speed alone would finish sooner waiting for
/// its partner to end than sharing with it, whatever its partner does.
const HALF: f64 = 0.5;

/// The speed of each of `apps` on one GPU of `model`: the product of its estimated speeds
/// beside the others (1.0 alone).
fn speeds(history: &Estimates, model: &str, apps: &[&str], prior: f64) -> Vec<f64> {
    apps.iter()
        .enumerate()
        .map(|(i, a)| {
            apps.iter()
                .enumerate()
                .filter(|&(k, _)| k != i)
                .map(|(_, o)| estimate(history, model, a, o, prior).0)
                .product::<f64>()
        })
        .collect()
}

/// The jobs to give back: on each GPU whose residents (oldest first) are all measured beside
/// its newest, that newest job when the GPU delivers less with it than `below` times what the
/// others deliver without it, and it runs slowest there or below half its speed alone.
/// `spared` says of a job that it may not be given back (it was once already). `below` 0:
/// never.
pub fn separations(
    gpus: &[GpuState],
    history: &Estimates,
    below: f64,
    prior: f64,
    spared: impl Fn(u32) -> bool,
) -> Vec<Separation> {
    let mut out = Vec::new();
    if below <= 0.0 {
        return out;
    }
    for gpu in gpus {
        let Some((newest, others)) = gpu.residents.split_last() else {
            continue;
        };
        if others.is_empty() || spared(newest.job_id) {
            continue;
        }
        let measured = |a: &str, b: &str| {
            history
                .pair(&gpu.model, a, b)
                .is_some_and(|e| e.observations > 0 && !e.oom)
        };
        if !others
            .iter()
            .all(|o| measured(&newest.app, &o.app) && measured(&o.app, &newest.app))
        {
            continue;
        }
        let without: Vec<&str> = others.iter().map(|r| r.app.as_str()).collect();
        let mut with = without.clone();
        with.push(&newest.app);
        let before: f64 = speeds(history, &gpu.model, &without, prior).iter().sum();
        let together = speeds(history, &gpu.model, &with, prior);
        let after: f64 = together.iter().sum();
        // Only a newest job that fares worst there, or badly in any case: a job's own side is
        // what its owner reports, so a user who reports too little progress for a job of theirs
        // can make that job look slowed, never another user's, which then is not the slowest.
        let own = together[together.len() - 1];
        let exposed = own < HALF || together.iter().all(|&v| own <= v);
        if after < below * before && exposed {
            let partners: Vec<String> = others.iter().map(|o| format!("{} (job {})", o.app, o.job_id)).collect();
            out.push(Separation {
                gpu: gpu.index,
                job_id: newest.job_id,
                why: format!(
                    "measured beside {} on GPU {}, the GPU delivers {after:.2} of one job alone \
                     against {before:.2} without it",
                    partners.join(", "),
                    gpu.index
                ),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sides of a pair seen 3 times.
    trait With {
        fn with(self, a: &str, b: &str, sa: f64, sb: f64, oom: bool) -> Self;
    }

    impl With for Estimates {
        fn with(mut self, a: &str, b: &str, sa: f64, sb: f64, oom: bool) -> Self {
            for (x, y, sx, sy) in [(a, b, sa, sb), (b, a, sb, sa)] {
                self.insert_pair(
                    "v100",
                    x,
                    y,
                    PairEstimate {
                        speed: sx,
                        other_speed: sy,
                        observations: 3,
                        oom,
                    },
                );
            }
            self
        }
    }

    type Table = Estimates;

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
                    put_back: None,
                })
                .collect(),
        }
    }

    const KNOBS: Knobs = Knobs {
        separate_below: 0.0,
        slots: 2,
        unknown_pair_speed: 0.7,
        min_gain: 0.0,
        share_queue: 0.0,
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
    fn the_residents_side_comes_from_what_is_known_of_it_not_from_the_prior() {
        // new beside old was learned (0.90, 5 times); old's side never was, so new's row still
        // holds the prior (0.70) for it. What is known of old says it runs at 0.30 beside
        // others: sharing gains 0.90 + 0.30 - 1 = 0.20, not 0.60, and min_gain 0.25 declines.
        let mut h = Table::default();
        h.insert_pair(
            "v100",
            "new",
            "old",
            PairEstimate {
                speed: 0.9,
                other_speed: 0.7,
                observations: 5,
                oom: false,
            },
        );
        h.insert_app(
            "v100",
            "old",
            AppProfile {
                base: Some((0.3, 6)),
                ..AppProfile::default()
            },
        );
        let new = Newcomer {
            app: "new",
            mem_mb: None,
        };
        let knobs = Knobs {
            min_gain: 0.25,
            ..KNOBS
        };
        match place(&[gpu(0, &[(1, "old")])], &new, &h, knobs) {
            Decision::Decline { reason, .. } => assert!(reason.contains("would gain 0.20"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_share_the_separation_look_would_undo_is_not_made() {
        // new beside old was measured 16 times from new's side (0.31; old's side in that row
        // still the prior, 0.70), old beside new 3 times from old's own reports (0.40). The
        // separation look would give new back as soon as it ran (0.71 against 1.00): that is
        // the reason given, whatever min_gain says.
        let mut h = Table::default();
        for (a, b, speed, other_speed, observations) in [("new", "old", 0.31, 0.70, 16), ("old", "new", 0.40, 0.70, 3)]
        {
            h.insert_pair(
                "v100",
                a,
                b,
                PairEstimate {
                    speed,
                    other_speed,
                    observations,
                    oom: false,
                },
            );
        }
        let new = Newcomer {
            app: "new",
            mem_mb: None,
        };
        let looks = Knobs {
            separate_below: 0.9,
            ..KNOBS
        };
        match place(&[gpu(0, &[(1, "old")])], &new, &h, looks) {
            Decision::Decline { reason, may_retry } => {
                assert!(may_retry, "{reason}");
                assert!(
                    reason.contains("GPU 0: measured beside old (job 1) on GPU 0, the GPU delivers 0.71 of one job alone against 1.00")
                        && reason.ends_with("a share given back as soon as measured"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        // A free GPU is taken instead; without the look (min_gain 0) the share is made.
        assert_eq!(
            chosen(&place(&[gpu(0, &[(1, "old")]), gpu(1, &[])], &new, &h, looks)),
            1
        );
        assert_eq!(chosen(&place(&[gpu(0, &[(1, "old")])], &new, &h, KNOBS)), 0);
        // Old's side never measured: nothing is refused on a guess.
        let mut once = Table::default();
        once.insert_pair(
            "v100",
            "new",
            "old",
            PairEstimate {
                speed: 0.31,
                other_speed: 0.40,
                observations: 16,
                oom: false,
            },
        );
        assert_eq!(chosen(&place(&[gpu(0, &[(1, "old")])], &new, &once, looks)), 0);
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

    /// A history that knows of each application what `profile` makes of a number, and no pair.
    fn profiles<T: Copy>(of: &[(&str, T)], profile: impl Fn(T) -> AppProfile) -> Estimates {
        let mut h = Estimates::default();
        for &(app, v) in of {
            h.insert_app("v100", app, profile(v));
        }
        h
    }

    #[test]
    fn an_unseen_pair_is_estimated_from_what_is_known_of_each_application() {
        let h = profiles(&[("gentle", (0.9, 4)), ("greedy", (0.4, 4))], |m| AppProfile {
            base: Some(m),
            ..Default::default()
        });
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

    #[test]
    fn where_learned_pairs_rarely_gain_a_pair_never_seen_is_not_taken_for_a_gain() {
        let min_gain = Knobs {
            min_gain: 0.25,
            ..KNOBS
        };
        // A GPU model where the 96 speeds learned so far average 0.45: a pair never seen,
        // of applications nothing is known of, is expected at (96 x 0.45 + 4 x 0.7) / 100.
        let mut h = Estimates::default();
        h.insert_learned("v100", 96.0 * 0.45, 96);
        let center = (96.0 * 0.45 + CENTER_PRIOR_WEIGHT * 0.7) / (96.0 + CENTER_PRIOR_WEIGHT);
        let (speed, _, why) = estimate(&h, "v100", "new", "other", 0.7);
        assert!((speed - center).abs() < 1e-9, "{speed}");
        assert!(
            why.contains("assumed 0.46 from 96 speeds learned on this GPU model"),
            "{why}"
        );
        // So a newcomer waits for a free GPU rather than share with a stranger.
        let gpus = [gpu(0, &[(1, "other")]), gpu(1, &[(2, "x"), (3, "y")])];
        let newcomer = Newcomer {
            app: "new",
            mem_mb: None,
        };
        assert!(matches!(
            place(&gpus, &newcomer, &h, min_gain),
            Decision::Decline { .. }
        ));
        // With nothing learned on the model the prior stands, and the pair is tried.
        assert!(matches!(
            place(&gpus, &newcomer, &Estimates::default(), min_gain),
            Decision::Place { gpu: 0, .. }
        ));
        // An application's own effect is pulled towards that mean, not towards the prior:
        // 0.60 from 2 pairs, with a ridge of 2 pairs, moves half the way from 0.7 to 0.46.
        h.insert_app(
            "v100",
            "new",
            AppProfile {
                base: Some((0.6, 2)),
                ..Default::default()
            },
        );
        let (speed, _, _) = estimate(&h, "v100", "new", "other", 0.7);
        assert!((speed - (0.6 + (center - 0.7) / 2.0)).abs() < 1e-9, "{speed}");

        // Where learned pairs average 0.6, a pair never tried is expected to gain 0.2: below
        // min_gain, which holds a slot for a better partner the history knows of, but a gain,
        // and trying it is how the history learns. A known pair gaining as little waits.
        let mut h = Estimates::default();
        h.insert_learned("v100", 1000.0 * 0.6, 1000);
        match place(&gpus, &newcomer, &h, min_gain) {
            Decision::Place { gpu, gain, .. } => assert!(gpu == 0 && (gain - 0.2).abs() < 0.01, "{gain}"),
            other => panic!("{other:?}"),
        }
        let h = Table::default().with("new", "other", 0.6, 0.6, false);
        match place(&gpus, &newcomer, &h, min_gain) {
            Decision::Decline { reason, .. } => assert!(reason.contains("less than the 0.25"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_unseen_partner_known_to_slow_others_is_avoided() {
        // `hog` slows its partners 0.3 below their usual speed; `mild` leaves them 0.1 above.
        // Nothing is known of the newcomer.
        let h = profiles(&[("hog", (-0.3, 6)), ("mild", (0.1, 6))], |m| AppProfile {
            impact: Some(m),
            ..Default::default()
        });
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
        // `big` ran out of memory with all 18 partners it was tried with: a pair with it never
        // tried is likely to fail (18 / (18 + 2) = 90%), so the newcomer joins the other GPU,
        // although the prior says both pairs are alike.
        let h = profiles(&[("big", (18, 18))], |ooms| AppProfile {
            ooms,
            ..Default::default()
        });
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
        // expected gain (negative at 90% risk) is too little and the job waits instead.
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
                assert!(reason.contains("90% risk of running out of memory"), "{reason}");
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
                assert!(reason.contains("90% risk of running out of memory"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pair_risks_what_its_riskier_application_did() {
        // `a` and `b` each ran out of memory with 5 of their 8 partners (50% after the prior):
        // their pair is a 50% gamble, not the 75% that counting each failure twice makes it.
        let h = profiles(&[("a", (5, 8)), ("b", (5, 8))], |ooms| AppProfile {
            ooms,
            ..Default::default()
        });
        assert!((oom_risk(&h, "v100", "a", "b") - 0.5).abs() < 1e-9);
        assert!((oom_risk(&h, "v100", "a", "new") - 0.5).abs() < 1e-9);
        assert_eq!(oom_risk(&h, "v100", "new", "other"), 0.0);
        let gpus = [gpu(0, &[(1, "b")])];
        match place(&gpus, &Newcomer { app: "a", mem_mb: None }, &h, KNOBS) {
            // The prior's 0.70 each side gains 0.40: 0.5 x 0.40 - 0.5 x OOM_PENALTY < 0, and
            // with no `min_gain` the only GPU with a slot is still taken, saying what it risks.
            Decision::Place { gain, reason, .. } => {
                assert!((gain - (0.5 * 0.4 - 0.5 * OOM_PENALTY)).abs() < 1e-9, "{gain}");
                assert!(reason.contains("50% risk of running out of memory"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn memory_known_to_fit_takes_the_place_of_a_failure_rate() {
        // `big` ran out of memory with all 18 of its partners, but here both jobs' memory is
        // known (measured or hinted) and fits: the pair is no gamble, and with `min_gain` it
        // is taken (the prior's 0.70 each side gains 0.40) instead of declined at 90% risk.
        let h = profiles(&[("big", (18, 18))], |ooms| AppProfile {
            ooms,
            ..Default::default()
        });
        let knobs = Knobs {
            min_gain: 0.25,
            ..KNOBS
        };
        let with_memory = |resident: Option<u64>| {
            let mut g = gpu(0, &[(1, "big")]);
            g.residents[0].mem_mb = resident;
            [g, gpu(1, &[(2, "x"), (3, "y")])]
        };
        let new = |mem_mb| Newcomer { app: "new", mem_mb };
        match place(&with_memory(Some(9000)), &new(Some(6000)), &h, knobs) {
            Decision::Place { gpu, reason, .. } => {
                assert_eq!(gpu, 0);
                assert!(!reason.contains("risk"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // Either side's memory unknown: the rate stands in for it, as before.
        for (resident, newcomer) in [(None, Some(6000)), (Some(9000), None)] {
            let d = place(&with_memory(resident), &new(newcomer), &h, knobs);
            assert!(
                matches!(&d, Decision::Decline { reason, .. } if reason.contains("90% risk")),
                "{d:?}"
            );
        }
        // Known not to fit: ruled out by memory, whatever the rates.
        let d = place(&with_memory(Some(11000)), &new(Some(6000)), &h, knobs);
        assert!(
            matches!(&d, Decision::Decline { reason, .. } if reason.contains("memory: 6000 MiB asked")),
            "{d:?}"
        );
    }

    #[test]
    fn a_snapshot_of_what_wanted_names_decides_as_the_whole_history_does() {
        // Random nodes of 3 GPUs x 3 slots over 6 applications, every pair and profile known
        // (some pairs out of memory): placement over only what `wanted` asked for must decide
        // exactly as placement over everything, or `wanted` misses something scoring reads.
        let apps = ["a", "b", "c", "d", "e", "f"];
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut all = Estimates::default();
        for a in apps {
            for b in apps {
                let speed = 0.2 + next(80) as f64 / 100.0;
                let other_speed = 0.2 + next(80) as f64 / 100.0;
                let (observations, oom) = (next(3) as u32, next(10) == 0);
                let e = PairEstimate {
                    speed,
                    other_speed,
                    observations,
                    oom,
                };
                all.insert_pair("v100", a, b, e);
            }
            let profile = AppProfile {
                base: Some((0.4 + next(50) as f64 / 100.0, next(5) as u32)),
                impact: Some((next(40) as f64 / 100.0 - 0.2, next(5) as u32)),
                ooms: (next(3) as u32, 3 + next(3) as u32),
            };
            all.insert_app("v100", a, profile);
        }
        let knobs = Knobs { slots: 3, ..KNOBS };
        for _ in 0..300 {
            let mut job = 1;
            let gpus: Vec<GpuState> = (0..3)
                .map(|g| {
                    let n = next(4) as usize;
                    let residents: Vec<(u32, &str)> = (0..n)
                        .map(|_| {
                            job += 1;
                            (job, apps[next(6) as usize])
                        })
                        .collect();
                    gpu(g, &residents)
                })
                .collect();
            let newcomer = Newcomer {
                app: apps[next(6) as usize],
                mem_mb: None,
            };
            let w = wanted(&gpus, &newcomer, knobs.slots);
            let mut snapshot = Estimates::default();
            for (model, a, b) in &w.pairs {
                if let Some(e) = all.pair(model, a, b) {
                    snapshot.insert_pair(model, a, b, e);
                }
            }
            for (model, a) in &w.apps {
                snapshot.insert_app(model, a, all.app(model, a));
            }
            assert_eq!(
                place(&gpus, &newcomer, &snapshot, knobs),
                place(&gpus, &newcomer, &all, knobs),
                "{gpus:?} {newcomer:?}"
            );
        }
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
