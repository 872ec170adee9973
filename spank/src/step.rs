//! slurmstepd's side of a job step, read from Slurm: which job, step, user and node this is,
//! what the daemon said ([`crate::remote`] asks it), and what happens to a declined step. The
//! callbacks in `lib.rs` call [`post_opt`] and carry out the plan it leaves in the state.

use crate::remote::{self, StepInfo, StepPlan};
use crate::{state, OPTION_ENV, PREFIX};
use libc::c_int;
use multiplex_protocol::spec::Spec;
use slurm_ffi::log;
use slurm_ffi::spank::Spank;

/// After the options are known, in slurmstepd: asks the daemon where this step runs and
/// leaves the plan for the tasks in the state.
pub(crate) fn post_opt(spank: &Spank) -> c_int {
    // Steps started inside a multiplexed job see the option through the job's environment.
    let option = state().option.clone().or_else(|| spank.getenv(OPTION_ENV).map(Some));
    let Some(value) = option else {
        return 0; // not a multiplexed job: no daemon traffic
    };
    let spec = match Spec::parse(value.as_deref()) {
        Ok(s) => s,
        Err(e) => return fail_tasks(format!("{PREFIX}: invalid --multiplex value: {e}")),
    };
    let (Ok(job_id), Ok(step_id), Ok(uid)) = (spank.job_id(), spank.step_id(), spank.uid()) else {
        return fail_tasks(format!("{PREFIX}: cannot read the job's ids from Slurm"));
    };
    let step = multiplex_protocol::step_label(step_id);
    let Some(node) = node_name(spank) else {
        return fail_tasks(format!(
            "{PREFIX}: job {job_id} step {step}: cannot tell which node this is"
        ));
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
    };
    let args = state().args.clone();
    let plan = match remote::plan(&args, &spec, &info, false) {
        StepPlan::Declined { reason, retry_after_s } => {
            match declined(job_id, step_id, &node, &reason, retry_after_s) {
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
fn declined(job_id: u32, step_id: u32, node: &str, reason: &str, retry_after_s: u32) -> Declined {
    let delay = match remote::on_decline(node, step_id, reason, retry_after_s) {
        Ok(delay) => delay,
        Err(message) => return Declined::Requeued(StepPlan::Fail { message }),
    };
    if let Err(e) = slurm_ffi::host::requeue(job_id) {
        return Declined::CannotWait(e);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    if let Err(e) = slurm_ffi::host::set_begin_time(job_id, now + i64::from(delay)) {
        log::error(&format!(
            "{PREFIX}: job {job_id}: requeued, but could not delay its next start: {e}"
        ));
    }
    Declined::Requeued(StepPlan::Fail {
        message: format!(
            "multiplex: requeued, waiting {delay} s: no GPU on {node} can take this job safely now ({reason})"
        ),
    })
}

/// The Slurm name of this node. slurmstepd's environment has no SLURMD_NODENAME yet at this
/// point (several slurmd may share one host), so it is this node's entry in the step's list.
fn node_name(spank: &Spank) -> Option<String> {
    if let Some(n) = spank.getenv("SLURMD_NODENAME") {
        return Some(n);
    }
    let list = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
        .iter()
        .find_map(|v| spank.getenv(v))?;
    let index = spank.node_id().ok()? as usize;
    slurm_ffi::host::hostlist_nth(&list, index)
}
