//! The slurmstepd side (remote context): tell the node's daemon once per job step where Slurm
//! started it, remember what the tasks should know, and report the step's end.

use crate::args::{Args, OnDaemonError};
use multiplex_protocol::spec::{default_app, Spec};
use multiplex_protocol::{client, FinishRequest, Request, Response, StartRequest};
use std::time::Duration;

/// What the step learnt from the daemon.
#[derive(Debug, Clone, PartialEq)]
pub enum StepPlan {
    /// Set these variables in every task.
    Recorded { env: Vec<(String, String)> },
    /// Runs as Slurm started it, unrecorded; tell the user this once.
    NotApplied { warning: String },
    /// Fail the step with this sentence.
    Fail { message: String },
}

/// What the step knows about itself, read from Slurm.
#[derive(Debug, Clone, PartialEq)]
pub struct StepInfo {
    pub job_id: u32,
    pub step_id: u32,
    pub uid: u32,
    pub node: String,
    pub job_name: Option<String>,
    /// The job's gres per node as slurmctld holds it (a claim names the GPU by type).
    pub gres: Option<String>,
    /// The GPU Slurm allocated the job (its allocation's gres detail, from slurmctld).
    pub job_gpus: Option<String>,
    /// The job's admin comment as slurmctld holds it (read for the tag).
    pub admin_comment: Option<String>,
}

/// Tells the daemon where the step started, and turns every failure into the configured
/// behaviour.
pub fn plan(args: &Args, spec: &Spec, step: &StepInfo) -> StepPlan {
    let request = StartRequest {
        job_id: step.job_id,
        step_id: step.step_id,
        uid: step.uid,
        app: spec
            .app
            .clone()
            .unwrap_or_else(|| default_app(step.uid, step.job_name.as_deref())),
        mem_mb: spec.mem_mb,
        node: step.node.clone(),
        slurm_gres: step.gres.clone(),
        slurm_job_gpus: step.job_gpus.clone(),
        admin_comment: step.admin_comment.clone(),
    };
    let socket = args.socket_for(&step.node);
    let problem = match client::call(&socket, Duration::from_millis(args.timeout_ms), Request::Start(request)) {
        Ok(Response::Started(p)) => {
            let mut env = p.environment();
            env.push(("MULTIPLEX_NODE".into(), step.node.clone()));
            // For `multiplexd report` inside the job.
            env.push(("MULTIPLEX_SOCKET".into(), socket.display().to_string()));
            return StepPlan::Recorded { env };
        }
        Ok(Response::Refused { reason }) => {
            return StepPlan::Fail {
                message: format!("multiplex: this job cannot run on {}: {reason}", step.node),
            }
        }
        Ok(Response::Error { message }) => format!("multiplexd refused: {message}"),
        Ok(other) => format!("multiplexd gave an unexpected answer: {other:?}"),
        Err(e) => e.to_string(),
    };
    unrecorded(args, &problem)
}

/// What a step does when the daemon (or slurmctld) did not answer as it should: run as Slurm
/// started it, unrecorded, or fail, as `on_daemon_error` says.
pub fn unrecorded(args: &Args, problem: &str) -> StepPlan {
    match args.on_daemon_error {
        OnDaemonError::Run => StepPlan::NotApplied {
            warning: format!("multiplex: not recorded, running where Slurm started it: {problem}"),
        },
        OnDaemonError::Fail => StepPlan::Fail {
            message: format!("multiplex: cannot record this step: {problem}"),
        },
    }
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
            gres: Some("gres/shard:v100_0:1".into()),
            job_gpus: Some("0".into()),
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
        match plan(&args, &Spec::default(), &step()) {
            StepPlan::NotApplied { warning } => {
                assert!(warning.starts_with("multiplex: not recorded"), "{warning}");
                assert!(warning.contains("n1.sock"), "{warning}");
            }
            other => panic!("{other:?}"),
        }
        let args = Args {
            on_daemon_error: OnDaemonError::Fail,
            ..args
        };
        assert!(
            matches!(plan(&args, &Spec::default(), &step()), StepPlan::Fail { message } if message.contains("cannot record"))
        );
    }
}
