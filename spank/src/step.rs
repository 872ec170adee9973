//! slurmstepd's side of a job step, read from Slurm: which job, step, user and node this is,
//! what the daemon said ([`crate::remote`] asks it), and what happens to a declined step. The
//! callbacks in `lib.rs` call [`post_opt`] and carry out the plan it leaves in the state.

use crate::args::Args;
use crate::remote::{self, StepInfo, StepPlan};
use crate::{state, OPTION_ENV, PREFIX};
use libc::c_int;
use multiplex_protocol::spec::{with_note, Spec};
use slurm_ffi::log;
use slurm_ffi::spank::Spank;

/// After the options are known, in slurmstepd: asks the daemon where this step runs and
/// leaves the plan for the tasks in the state.
pub(crate) fn post_opt(spank: &Spank) -> c_int {
    // Steps started inside a multiplexed job see the option through the job's environment.
    // In slurmstepd the option (Slurm's own copy too) comes from that environment, which the
    // job's user may set: it only says that slurmctld's tag is worth asking for.
    let claimed = state().option.is_some() || spank.getenv(OPTION_ENV).is_some();
    if !claimed {
        return 0; // not a multiplexed job: no traffic to slurmctld or the daemon
    }
    let (Ok(job_id), Ok(step_id), Ok(uid)) = (spank.job_id(), spank.step_id(), spank.uid()) else {
        return fail_tasks(format!("{PREFIX}: cannot read the job's ids from Slurm"));
    };
    let step = multiplex_protocol::step_label(step_id);
    let Some(node) = node_name() else {
        return fail_tasks(format!(
            "{PREFIX}: job {job_id} step {step}: slurmstepd does not say which node this is (SLURMD_NODENAME)"
        ));
    };
    let args = state().args.clone();
    let (spec, comment) = match tagged_spec(&args, job_id) {
        Ok(tagged) => tagged,
        Err(plan) => {
            if let StepPlan::NotApplied { warning: text } | StepPlan::Fail { message: text } = &plan {
                log::info(&format!("{text} (job {job_id} step {step})"));
            }
            state().plan = Some(plan);
            return 0;
        }
    };
    let info = StepInfo {
        job_id,
        step_id,
        uid,
        node: node.clone(),
        job_name: spank.getenv("SLURM_JOB_NAME"),
        cuda_visible_devices: spank.getenv("CUDA_VISIBLE_DEVICES"),
        job_gpus: spank.getenv("SLURM_JOB_GPUS"),
        shards_on_node: spank.getenv("SLURM_SHARDS_ON_NODE"),
        // slurmstepd's own count, not the job's environment (which its user may set); it is
        // 0 for batch steps (22.05 to 24.11), so the daemon also counts its own declines.
        restarts: spank.restart_count().unwrap_or(0),
        admin_comment: Some(comment.clone()),
    };
    let plan = match remote::plan(&args, &spec, &info, false) {
        StepPlan::Declined { reason, retry_after_s } => {
            match declined(job_id, step_id, &node, &reason, retry_after_s, &comment) {
                Declined::Requeued(plan) => plan,
                // A decline would fail a job that cannot be requeued: ask for any GPU where it fits.
                Declined::CannotWait(why) => {
                    log::info(&format!(
                        "{PREFIX}: job {job_id} cannot be requeued to wait ({why}): asking for any GPU where it fits"
                    ));
                    match remote::plan(&args, &spec, &info, true) {
                        StepPlan::Declined { reason, .. } => StepPlan::Fail {
                            message: format!(
                            "multiplex: no GPU on {node} can take this job safely now ({reason}), and it cannot be \
                             requeued to wait ({why}): submit it again later, or let it requeue (sbatch --requeue)"
                        ),
                        },
                        plan => plan,
                    }
                }
            }
        }
        plan => plan,
    };
    match &plan {
        StepPlan::Placed { env } => {
            let summary: Vec<String> = env.iter().take(3).map(|(k, v)| format!("{k}={v}")).collect();
            log::info(&format!("{PREFIX}: job {job_id} step {step}: {}", summary.join(" ")));
            state().placed = Some((job_id, step_id, node));
        }
        StepPlan::NotApplied { warning: text } | StepPlan::Fail { message: text } => {
            // `text` starts with the plugin's prefix already.
            log::info(&format!("{text} (job {job_id} step {step})"));
        }
        // Turned into Fail by `declined` above; logged like it should it ever get here.
        StepPlan::Declined { reason, .. } => {
            log::info(&format!("{PREFIX}: declined: {reason} (job {job_id} step {step})"))
        }
    }
    // A failure is carried out in the tasks (task_init), not here: a step that fails in
    // slurmstepd's own callbacks can get the node drained.
    state().plan = Some(plan);
    0
}

/// Logs `message` and makes every task of the step fail with it (see task_init).
fn fail_tasks(message: String) -> c_int {
    log::error(&message);
    state().plan = Some(StepPlan::Fail { message });
    0
}

/// What became of a declined step.
enum Declined {
    /// Requeued and held back (or failed with the reason): the step's plan.
    Requeued(StepPlan),
    /// The job could not be requeued (the error says why).
    CannotWait(String),
}

/// A declined batch job is requeued and held back for the daemon's `retry_after_s`; any other
/// declined step fails with the reason.
fn declined(job_id: u32, step_id: u32, node: &str, reason: &str, retry_after_s: u32, comment: &str) -> Declined {
    let delay = match remote::on_decline(node, step_id, reason, retry_after_s) {
        Ok(delay) => delay,
        Err(message) => return Declined::Requeued(StepPlan::Fail { message }),
    };
    if let Err(e) = slurm_ffi::host::requeue(job_id) {
        return Declined::CannotWait(e);
    }
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64)
    };
    // The reason also goes into the job's admin comment, after the tag: the rerun truncates
    // the job's output, and `scontrol show job` then says why it waits.
    let why = format!("requeued, waiting {delay} s: no GPU on {node} can take this job safely now ({reason})");
    let note = with_note(comment, &why);
    let begin = now() + i64::from(delay);
    let mut set = slurm_ffi::host::set_begin_time(job_id, begin, Some(&note));
    // A slow slurmctld (one that waited 5 s on a name lookup took that long to answer the
    // update) may apply a start time that has already passed: when the requeue completes,
    // Slurm replaces such a time by its own requeue delay (120 s by default), and the job
    // would wait that long. Ask again, from now.
    if set.is_ok() && now() >= begin {
        log::info(&format!(
            "{PREFIX}: job {job_id}: slurmctld took {} s to delay its next start; asking again",
            now() - begin + i64::from(delay)
        ));
        set = slurm_ffi::host::set_begin_time(job_id, now() + i64::from(delay), None);
    }
    if let Err(e) = set {
        log::error(&format!(
            "{PREFIX}: job {job_id}: requeued, but could not delay its next start: {e}"
        ));
    }
    Declined::Requeued(StepPlan::Fail {
        message: format!("multiplex: {why}"),
    })
}

/// How job `job_id` was submitted, as slurmctld's tag says ([`Spec::from_tag`]), with the admin
/// comment it was read from; or the plan for a step of a job that has no tag (it runs as Slurm
/// placed it) or whose tag cannot be read.
fn tagged_spec(args: &Args, job_id: u32) -> Result<(Spec, String), StepPlan> {
    let comment = match slurm_ffi::host::job_admin_comment(job_id) {
        Ok(c) => c,
        Err(e) => {
            return Err(remote::unplaced(
                args,
                &format!("cannot ask slurmctld whether job {job_id} was submitted with --multiplex: {e}"),
            ))
        }
    };
    match Spec::from_tag(comment.as_deref()) {
        Some(Ok(spec)) => Ok((spec, comment.unwrap_or_default())),
        Some(Err(e)) => Err(StepPlan::Fail {
            message: format!("{PREFIX}: job {job_id}'s multiplex tag in its admin comment is not valid: {e}"),
        }),
        None => Err(StepPlan::NotApplied {
            warning: format!(
                "{PREFIX}: not applied: job {job_id} was not submitted with --multiplex (slurmctld has no multiplex \
                 tag for it), so the option in its environment is ignored"
            ),
        }),
    }
}

/// The Slurm name of this node, as slurmstepd itself set it in its own process environment
/// before any plugin ran (never the job's environment, which its user may set), and only if
/// it is a plain host name: it becomes part of the daemon's socket path.
fn node_name() -> Option<String> {
    let name = std::env::var("SLURMD_NODENAME").ok()?;
    is_plain_node_name(&name).then_some(name)
}

/// Letters, digits, '.', '_' and '-', not starting with '.', at most 255 bytes.
fn is_plain_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::is_plain_node_name;

    #[test]
    fn only_a_plain_host_name_becomes_part_of_a_socket_path() {
        for good in ["n1", "gpu-01", "node_7.cluster", "a"] {
            assert!(is_plain_node_name(good), "{good}");
        }
        for bad in [
            "",
            "..",
            "../../tmp/x",
            ".hidden",
            "n1/../n2",
            "n 1",
            "n1\n",
            &"x".repeat(256),
        ] {
            assert!(!is_plain_node_name(bad), "{bad:?}");
        }
    }
}
