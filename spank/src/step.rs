//! slurmstepd's side of a job step, read from Slurm: which job, step, user and node this is,
//! where Slurm bound its shard, and what the daemon recorded ([`crate::remote`] tells it). The
//! callbacks in `lib.rs` call [`post_opt`] and carry out the plan it leaves in the state.

use crate::args::Args;
use crate::remote::{self, StepInfo, StepPlan};
use crate::{state, OPTION_ENV, PREFIX};
use libc::c_int;
use multiplex_protocol::spec::Spec;
use slurm_ffi::log;
use slurm_ffi::spank::Spank;

/// After the options are known, in slurmstepd: tells the daemon where this step started and
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
    let (spec, facts) = match tagged_spec(&args, job_id) {
        Ok(tagged) => tagged,
        Err(plan) => {
            if let StepPlan::NotApplied { warning: text } | StepPlan::Fail { message: text } = &plan {
                log::info(&format!("{text} (job {job_id} step {step})"));
            }
            state().plan = Some(plan);
            return 0;
        }
    };
    if step_id == multiplex_protocol::BATCH_STEP {
        state().notice = rerun_notice(facts.admin_comment.as_deref());
    }
    let info = StepInfo {
        job_id,
        step_id,
        uid,
        node: node.clone(),
        job_name: spank.getenv("SLURM_JOB_NAME"),
        gres: facts.tres_per_node,
        // Slurm's allocation, from slurmctld (never the job's environment, which its user
        // may set): the GPU index its gres detail names.
        job_gpus: facts
            .gres_detail
            .as_deref()
            .and_then(multiplex_protocol::gres::gpu_of_detail)
            .map(|g| g.to_string()),
        admin_comment: facts.admin_comment,
    };
    keep(remote::plan(&args, &spec, &info), (job_id, step_id), node);
    0
}

/// Says what the daemon made of the step and keeps it for the tasks. A failure is carried
/// out in the tasks (task_init), not here: a step that fails in slurmstepd's own callbacks
/// can get the node drained.
fn keep(plan: StepPlan, (job_id, step_id): (u32, u32), node: String) {
    let step = multiplex_protocol::step_label(step_id);
    match &plan {
        StepPlan::Recorded { env } => {
            let summary: Vec<String> = env.iter().take(3).map(|(k, v)| format!("{k}={v}")).collect();
            log::info(&format!("{PREFIX}: job {job_id} step {step}: {}", summary.join(" ")));
            state().placed = Some((job_id, step_id, node));
        }
        StepPlan::NotApplied { warning: text } | StepPlan::Fail { message: text } => {
            // `text` starts with the plugin's prefix already.
            log::info(&format!("{text} (job {job_id} step {step})"));
        }
    }
    state().plan = Some(plan);
}

/// What a rerun's output says first, where the daemon put the job back in the queue (its
/// admin comment's note, [`multiplex_protocol::spec::put_back_note`]): the output of the run
/// that failed is gone where Slurm truncates it for the rerun.
fn rerun_notice(admin_comment: Option<&str>) -> Option<String> {
    multiplex_protocol::spec::put_back(admin_comment)
        .map(|note| format!("{PREFIX}: this job was {note} (sacct -o AdminComment keeps it)"))
}

/// Logs `message` and makes every task of the step fail with it (see task_init).
fn fail_tasks(message: String) -> c_int {
    log::error(&message);
    state().plan = Some(StepPlan::Fail { message });
    0
}

/// How job `job_id` was submitted, as slurmctld's tag says ([`Spec::from_tag`]), with what
/// slurmctld holds of the job; or the plan for a step of a job that has no tag (it runs as
/// Slurm placed it) or whose tag cannot be read.
fn tagged_spec(args: &Args, job_id: u32) -> Result<(Spec, slurm_ffi::host::JobFacts), StepPlan> {
    let facts = match slurm_ffi::host::job_facts(job_id) {
        Ok(f) => f,
        Err(e) => {
            return Err(remote::unrecorded(
                args,
                &format!("cannot ask slurmctld whether job {job_id} was submitted with --multiplex: {e}"),
            ))
        }
    };
    match Spec::from_tag(facts.admin_comment.as_deref()) {
        Some(Ok(spec)) => Ok((spec, facts)),
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
    use super::{is_plain_node_name, rerun_notice};
    use multiplex_protocol::spec::{put_back_note, with_note};

    #[test]
    fn a_rerun_after_a_put_back_says_why_and_a_first_run_says_nothing() {
        let tag = "multiplex:app=a | multiplex: claim node:n1 gpu:v100_0 beside: speed:1.000";
        assert_eq!(rerun_notice(Some(tag)), None);
        assert_eq!(rerun_notice(None), None);
        let put = with_note(tag, &put_back_note("bert", "n2", "1"));
        let said = rerun_notice(Some(&put)).unwrap();
        assert!(
            said.starts_with("multiplex: this job was put back: ran out of GPU memory beside bert on n2 GPU 1;"),
            "{said}"
        );
    }

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
