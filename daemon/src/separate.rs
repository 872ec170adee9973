//! Separating jobs that were measured to run worse together than one after the other.
//!
//! Placement tries a pair it has never seen on a prior (and on what each application did
//! beside others). A pair can turn out far worse than that: on the V100 table, resnet50 at
//! batch 16 beside a transformer at batch 16 runs at 0.32 and 0.14 of its speed alone, so
//! that both would finish sooner taking turns. Once both sides of every pair on a GPU are
//! measured (progress reports give that within a report interval or two), a GPU whose jobs
//! together deliver less than `below` times what they would without its newest job gives that
//! job back to Slurm, if it runs slowest there or below half its speed alone: it is requeued
//! to start again elsewhere, or here once it fits better. The newest job goes: it has the
//! least work to lose, and the others were there first. The second condition is for hostile
//! users: each side of a pair is learned from what that side's jobs report, so a user who
//! under-reports a job of theirs makes only that job look slowed; another user's newcomer is
//! then not the slowest, and is given back only if it runs below half speed beside it.
//!
//! [`crate::placement::separations`] is pure: the daemon and the simulator call this same
//! code. The daemon looks every `policy.separate_look_ms` on a thread of its own ([`spawn`])
//! and gives a job back with `scontrol requeue`: Slurm's own requeue. The job comes back pending, still pinned to its old
//! GPU, and the claimer claims it again once that pin is stale ([`crate::claimer::PIN_GRACE`],
//! shorter than Slurm's delay before a requeued job may start). Bounds (fail-open): a job is
//! given back at most once per node (a week), only on measurements (never on a prior); a job
//! Slurm cannot requeue (`--no-requeue`, not a batch job) runs on; with the daemon down,
//! nothing is given back.

use crate::background::Trouble;
use crate::node::Node;
use crate::slurm::Slurm;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One look: the jobs to give back, each recorded as given back first (its end, which the
/// requeue brings, may reach the daemon before `scontrol` returns), then requeued through
/// Slurm outside the node's lock (a slow slurmctld delays this thread only). Returns the jobs
/// requeued; the first failure to requeue one is the error, after the others were tried.
pub fn once(node: &Mutex<Node>, slurm: &dyn Slurm) -> Result<Vec<u32>, String> {
    let lock = || node.lock().unwrap_or_else(|p| p.into_inner());
    let given = lock().separations().map_err(|e| e.to_string())?;
    let mut done = Vec::new();
    let mut failed = None;
    for s in given {
        let Some(row) = lock().separating(s.job_id).map_err(|e| e.to_string())? else {
            continue; // it ended meanwhile
        };
        let (requeued, why) = match slurm.requeue(s.job_id) {
            Ok(_) => {
                tracing::info!(job = s.job_id, gpu = s.gpu, "requeued to run apart: {}", s.why);
                crate::metrics::global().separation("requeued");
                done.push(s.job_id);
                (true, s.why)
            }
            Err(e) => {
                // Not again: a job Slurm will not requeue runs on where it is.
                crate::metrics::global().separation("refused");
                failed.get_or_insert(format!("cannot requeue job {} to run apart: {e}", s.job_id));
                (false, format!("{} ({e})", s.why))
            }
        };
        if let Err(e) = lock().history().record_separation(row, requeued, &why) {
            tracing::warn!(job = s.job_id, error = %e, "the history cannot record why the job was given back");
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(done),
    }
}

/// Looks every `every` until `shutdown` (nothing with `policy.separate_below` 0:
/// [`Node::separations`] answers nothing then).
pub fn spawn(node: Arc<Mutex<Node>>, slurm: Arc<dyn Slurm>, every: Duration, shutdown: Arc<AtomicBool>) {
    let mut trouble = Trouble::default();
    let started = crate::background::every("separate", every, shutdown, move || match once(&node, slurm.as_ref()) {
        Ok(_) => {
            if trouble.recovered() {
                tracing::info!("giving jobs back to Slurm works again");
            }
        }
        Err(e) => {
            if trouble.failed(&e) {
                tracing::warn!(error = %e, "a job measured to lose beside its partners runs on");
            }
        }
    });
    if let Err(e) = started {
        tracing::error!("cannot start the thread that separates jobs that lose together: {e}");
    }
}

#[cfg(test)]
mod tests {
    use crate::placement::{separation_wanted, separations, Estimates, GpuState, PairEstimate, Resident};

    fn gpu(index: u32, apps: &[(&str, u32)]) -> GpuState {
        GpuState {
            index,
            model: "v100".into(),
            memory_mb: 16_000,
            residents: apps
                .iter()
                .map(|&(app, job_id)| Resident {
                    job_id,
                    app: app.into(),
                    mem_mb: None,
                    put_back: None,
                })
                .collect(),
        }
    }

    fn learned(pairs: &[(&str, &str, f64, u32)]) -> Estimates {
        let mut h = Estimates::default();
        for &(a, b, speed, observations) in pairs {
            h.insert_pair(
                "v100",
                a,
                b,
                PairEstimate {
                    speed,
                    other_speed: 0.0,
                    observations,
                    oom: false,
                },
            );
        }
        h
    }

    #[test]
    fn a_pair_measured_worse_than_taking_turns_gives_back_its_newest_job() {
        let gpus = [
            gpu(0, &[("resnet", 1), ("transformer", 2)]),
            gpu(1, &[("a", 3), ("b", 4)]),
        ];
        let h = learned(&[
            ("resnet", "transformer", 0.32, 1),
            ("transformer", "resnet", 0.14, 1),
            ("a", "b", 0.7, 2),
            ("b", "a", 0.6, 2),
        ]);
        let s = separations(&gpus, &h, 1.0, 0.7, |_| false);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!((s[0].gpu, s[0].job_id), (0, 2));
        assert!(
            s[0].why.contains("0.46") && s[0].why.contains("resnet (job 1)"),
            "{}",
            s[0].why
        );
        // A higher bar also separates the pair that gains a little (1.30 < 1.5).
        assert_eq!(separations(&gpus, &h, 1.5, 0.7, |_| false).len(), 2);
        // A newcomer that runs at half speed or more and faster than the job it slows stays: the
        // other side is what that job's owner reports (a user reporting too little progress
        // cannot evict others); one below half speed goes whatever its partner does.
        let fast_newcomer = learned(&[("resnet", "transformer", 0.05, 1), ("transformer", "resnet", 0.6, 1)]);
        assert!(separations(&gpus[..1], &fast_newcomer, 1.0, 0.7, |_| false).is_empty());
        let slow_newcomer = learned(&[("resnet", "transformer", 0.05, 1), ("transformer", "resnet", 0.45, 1)]);
        assert_eq!(separations(&gpus[..1], &slow_newcomer, 1.0, 0.7, |_| false).len(), 1);
        // 0: never; a job given back once is spared.
        assert!(separations(&gpus, &h, 0.0, 0.7, |_| false).is_empty());
        assert!(separations(&gpus, &h, 1.0, 0.7, |j| j == 2).is_empty());
    }

    #[test]
    fn nothing_is_given_back_on_a_guess() {
        let gpus = [gpu(0, &[("resnet", 1), ("transformer", 2)])];
        // Only one side measured: the other is a prior's guess.
        let one_side = learned(&[("resnet", "transformer", 0.32, 1), ("transformer", "resnet", 0.14, 0)]);
        assert!(separations(&gpus, &one_side, 1.0, 0.7, |_| false).is_empty());
        // A job alone, or nothing known: nothing to separate.
        assert!(separations(&[gpu(0, &[("resnet", 1)])], &one_side, 1.0, 0.7, |_| false).is_empty());
        assert!(separations(&gpus, &Estimates::default(), 1.0, 0.7, |_| false).is_empty());
        assert_eq!(separation_wanted(&gpus).pairs.len(), 2);
    }
}
