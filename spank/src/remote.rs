//! The slurmstepd side (remote context): ask the node's daemon once per job step, remember
//! the answer for every task of the step, and report the step's end.

use crate::args::{Args, OnDaemonError};
use multiplex_protocol::spec::{default_app, Spec};
use multiplex_protocol::{client, FinishRequest, PlaceRequest, Request, Response};
use std::time::Duration;

/// What the step learnt from the daemon.
#[derive(Debug, Clone, PartialEq)]
pub enum StepPlan {
    /// Set these variables in every task.
    Placed { env: Vec<(String, String)> },
    /// Run on Slurm's own choice; tell the user this once.
    NotApplied { warning: String },
    /// Fail the step with this sentence.
    Fail { message: String },
    /// The daemon found no GPU that can take the step safely; `retry_after_s == 0`: never.
    Declined { reason: String, retry_after_s: u32 },
}

/// What the step knows about itself, read from Slurm.
#[derive(Debug, Clone, PartialEq)]
pub struct StepInfo {
    pub job_id: u32,
    pub step_id: u32,
    pub uid: u32,
    pub node: String,
    pub job_name: Option<String>,
    pub cuda_visible_devices: Option<String>,
    pub job_gpus: Option<String>,
    pub shards_on_node: Option<String>,
    /// Slurm's restart count of the job (its requeues so far).
    pub restarts: u32,
    /// The job's admin comment as slurmctld holds it (read for the tag).
    pub admin_comment: Option<String>,
}

/// Asks the daemon where the step runs, and turns every failure into the configured behaviour.
/// `cannot_wait`: the job's requeue failed, so a decline would fail it (a step that is not the
/// batch script cannot wait either way).
pub fn plan(args: &Args, spec: &Spec, step: &StepInfo, cannot_wait: bool) -> StepPlan {
    let request = PlaceRequest {
        job_id: step.job_id,
        step_id: step.step_id,
        uid: step.uid,
        app: spec
            .app
            .clone()
            .unwrap_or_else(|| default_app(step.uid, step.job_name.as_deref())),
        mem_mb: spec.mem_mb,
        node: step.node.clone(),
        slurm_cuda_visible_devices: step.cuda_visible_devices.clone(),
        slurm_job_gpus: step.job_gpus.clone(),
        slurm_shards_on_node: step.shards_on_node.clone(),
        restarts: step.restarts,
        cannot_wait: cannot_wait || step.step_id != slurm_ffi::bindings::SLURM_BATCH_SCRIPT,
        admin_comment: step.admin_comment.clone(),
    };
    let socket = args.socket_for(&step.node);
    let problem = match client::call(&socket, Duration::from_millis(args.timeout_ms), Request::Place(request)) {
        Ok(Response::Placed(p)) => {
            let mut env = p.environment();
            env.push(("MULTIPLEX_NODE".into(), step.node.clone()));
            // For `multiplexd report` inside the job.
            env.push(("MULTIPLEX_SOCKET".into(), socket.display().to_string()));
            return StepPlan::Placed { env };
        }
        Ok(Response::Declined { reason, retry_after_s }) => return StepPlan::Declined { reason, retry_after_s },
        Ok(Response::Error { message }) => format!("multiplexd refused: {message}"),
        Ok(other) => format!("multiplexd gave an unexpected answer: {other:?}"),
        Err(e) => e.to_string(),
    };
    unplaced(args, &problem)
}

/// What a step does when it cannot be placed for `problem` (the daemon, or slurmctld, did not
/// answer as it should): run on Slurm's GPU choice or fail, as `on_daemon_error` says.
pub fn unplaced(args: &Args, problem: &str) -> StepPlan {
    match args.on_daemon_error {
        OnDaemonError::Run => StepPlan::NotApplied {
            warning: format!("multiplex: not applied, running on Slurm's GPU choice: {problem}"),
        },
        OnDaemonError::Fail => StepPlan::Fail {
            message: format!("multiplex: cannot place this step: {problem}"),
        },
    }
}

/// What a declined step does: a batch job that may retry is requeued to wait (`Some(delay)`);
/// anything else fails with a sentence.
pub fn on_decline(node: &str, step_id: u32, reason: &str, retry_after_s: u32) -> Result<u32, String> {
    if retry_after_s == 0 {
        return Err(format!("multiplex: this job cannot run on {node}: {reason}"));
    }
    if step_id != slurm_ffi::bindings::SLURM_BATCH_SCRIPT {
        return Err(format!(
            "multiplex: no GPU on {node} can take this step safely now ({reason}); run it again in {retry_after_s} s"
        ));
    }
    Ok(retry_after_s)
}

/// Tells the daemon the step ended. Failures are only logged: the step is over either way.
pub fn finish(args: &Args, node: &str, job_id: u32, step_id: u32, exit_status: i32) -> Result<(), String> {
    let req = Request::Finish(FinishRequest {
        job_id,
        step_id,
        exit_status,
    });
    match client::call(&args.socket_for(node), Duration::from_millis(args.timeout_ms), req) {
        Ok(Response::Finished) => Ok(()),
        Ok(Response::Error { message }) => Err(message),
        Ok(other) => Err(format!("unexpected answer: {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocols_step_ids_are_the_headers() {
        use slurm_ffi::bindings;
        assert_eq!(multiplex_protocol::BATCH_STEP, bindings::SLURM_BATCH_SCRIPT);
        assert_eq!(multiplex_protocol::EXTERN_STEP, bindings::SLURM_EXTERN_CONT);
        assert_eq!(multiplex_protocol::INTERACTIVE_STEP, bindings::SLURM_INTERACTIVE_STEP);
        assert_eq!(multiplex_protocol::step_label(bindings::SLURM_BATCH_SCRIPT), "batch");
        assert_eq!(multiplex_protocol::step_label(3), "3");
    }

    fn step() -> StepInfo {
        StepInfo {
            job_id: 5,
            step_id: 0,
            uid: 0,
            node: "n1".into(),
            job_name: Some("wrap".into()),
            cuda_visible_devices: Some("0".into()),
            job_gpus: Some("0".into()),
            shards_on_node: Some("1".into()),
            restarts: 0,
            admin_comment: Some("multiplex:app=a".into()),
        }
    }

    #[test]
    fn a_missing_daemon_runs_with_a_warning_or_fails() {
        let dir = std::env::temp_dir().join(format!("spank-test-{}", std::process::id()));
        let args = Args {
            socket: format!("{}/%n.sock", dir.display()),
            ..Args::default()
        };
        match plan(&args, &Spec::default(), &step(), false) {
            StepPlan::NotApplied { warning } => {
                assert!(warning.starts_with("multiplex: not applied"), "{warning}");
                assert!(warning.contains("n1.sock"), "{warning}");
            }
            other => panic!("{other:?}"),
        }
        let args = Args {
            on_daemon_error: OnDaemonError::Fail,
            ..args
        };
        assert!(
            matches!(plan(&args, &Spec::default(), &step(), false), StepPlan::Fail { message } if message.contains("cannot place"))
        );
    }

    #[test]
    fn only_a_batch_job_that_may_retry_is_requeued() {
        let batch = slurm_ffi::bindings::SLURM_BATCH_SCRIPT;
        assert_eq!(on_decline("n1", batch, "GPU 0: full", 30), Ok(30));
        let never = on_decline("n1", batch, "it needs 99 MiB", 0).unwrap_err();
        assert_eq!(never, "multiplex: this job cannot run on n1: it needs 99 MiB");
        let step = on_decline("n1", 0, "GPU 0: full", 30).unwrap_err();
        assert!(step.contains("run it again in 30 s"), "{step}");
    }
}
