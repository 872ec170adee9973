//! srun's side (local context). A multiplexed job holds a share of a GPU, not a GPU, and srun
//! asks for its step with the same options as for its job: GPU asks left on srun's command
//! line would make the step ask for a GPU its job does not have. So before srun builds either
//! request, they are taken off srun's options and, when srun makes the job itself, handed to
//! job_submit (`multiplex_protocol::srun`); the step asks for one untyped share of its job's
//! GPU instead (`STEP_SHARE`: Slurm grants a step of a claimed job nothing else).

use crate::{state, PREFIX};
use libc::c_int;
use multiplex_protocol::model;
use multiplex_protocol::spec::Spec;
use multiplex_protocol::srun::{self, GPU_REQUEST_ENV, OPTIONS};
use slurm_ffi::spank::Spank;
use slurm_ffi::srun::Options;
use slurm_ffi::{host, log};

pub(crate) fn post_opt(spank: &Spank) -> c_int {
    if state().option.is_none() {
        return plain(spank);
    }
    // SAFETY: the local context is srun.
    let Some(opts) = (unsafe { Options::of_srun() }) else {
        log::verbose(&format!(
            "{PREFIX}: this srun does not expose its options; its GPU request is passed on as given"
        ));
        return 0;
    };
    let moved = srun::move_gpu_asks(&OPTIONS.map(|name| opts.get(name)), slurm_ffi::GRES_PREFIX);
    match takes_share(spank, &moved) {
        Ok(true) => {}
        Ok(false) => return 0,
        Err(code) => return code,
    }
    for name in &moved.reset {
        if !opts.reset(name) {
            log::error(&format!("{PREFIX}: srun would not unset --{name}"));
            return -1;
        }
    }
    // The step asks for one untyped share of its job's GPU: the only request Slurm grants a
    // step of a job whose shard the claimer typed (`multiplex_protocol::srun::STEP_SHARE`).
    let gres = srun::step_gres(moved.keep_gres.as_deref());
    if !opts.set("gres", &gres) {
        log::error(&format!("{PREFIX}: srun would not take --gres={gres}"));
        return -1;
    }
    let moved_to_job = match moved.reset.is_empty() {
        true => String::new(),
        false => {
            let names: Vec<String> = moved.reset.iter().map(|n| format!("--{n}")).collect();
            format!("; srun's {} moved to the job", names.join(" "))
        }
    };
    log::verbose(&format!(
        "{PREFIX}: the step takes a share of its job's GPU (--gres={gres}){moved_to_job}"
    ));
    0
}

/// srun without `--multiplex` (`multiplex_protocol::model`): GPU asks of one model lose it
/// where job_submit asked for that model's GPUs untyped (the job's tag says so), since the
/// step would find no GPU of that type in its job; where srun makes the job, always, with the
/// model passed on to job_submit, which makes it a node feature or puts it back into the job's
/// request. Anything else leaves srun's options as the user gave them.
fn plain(spank: &Spank) -> c_int {
    // SAFETY: the local context is srun.
    let Some(opts) = (unsafe { Options::of_srun() }) else {
        return 0;
    };
    let Some((model, changes)) = model::untyped_asks(&OPTIONS.map(|name| opts.get(name))) else {
        return 0;
    };
    match std::env::var("SLURM_JOB_ID") {
        Err(_) => {
            if let Err(e) = spank.job_control_setenv(model::SRUN_MODEL_ENV, &model) {
                log::error(&format!("{PREFIX}: cannot pass srun's GPU model on to the job ({e})"));
                return -1;
            }
        }
        Ok(id) => {
            let Ok(job) = id.trim().parse::<u32>() else { return 0 };
            match host::job_facts(job) {
                Ok(facts) if model::tagged(facts.admin_comment.as_deref()) == Some(model.as_str()) => {}
                Ok(_) => return 0,
                Err(e) => {
                    log::verbose(&format!(
                        "{PREFIX}: cannot read job {job} from slurmctld ({e}); srun's GPU request is left as given"
                    ));
                    return 0;
                }
            }
        }
    }
    for (name, value) in &changes {
        if !opts.set(name, value) {
            log::error(&format!("{PREFIX}: srun would not take --{name}={value}"));
            return -1;
        }
    }
    log::verbose(&format!(
        "{PREFIX}: {model} GPUs have a gres type each here: the step asks for them untyped"
    ));
    0
}

/// Whether the step takes a share of its job's GPU instead of srun's GPU asks: where srun
/// makes the job, when it asked for GPUs (handed on to job_submit here); in an existing job,
/// when slurmctld's tag says the job is multiplexed. `Err`: srun's return code.
fn takes_share(spank: &Spank, moved: &srun::Moved) -> Result<bool, c_int> {
    match std::env::var("SLURM_JOB_ID") {
        // srun makes the job: job_submit gets the asks and turns them into the shared GPU.
        Err(_) => {
            if moved.reset.is_empty() {
                return Ok(false); // no GPU asked: job_submit says what is missing
            }
            if let Err(e) = spank.job_control_setenv(GPU_REQUEST_ENV, &srun::encode(&moved.carry)) {
                log::error(&format!("{PREFIX}: cannot pass srun's GPU request on to the job ({e})"));
                return Err(-1);
            }
            Ok(true)
        }
        // A step in an existing job: only a multiplexed job's (slurmctld's tag says which)
        // holds a shared GPU that the step takes instead.
        Ok(id) => {
            let Ok(job) = id.trim().parse::<u32>() else {
                return Ok(false);
            };
            match host::job_facts(job) {
                Ok(facts) => Ok(matches!(Spec::from_tag(facts.admin_comment.as_deref()), Some(Ok(_)))),
                Err(e) => {
                    log::verbose(&format!(
                        "{PREFIX}: cannot read job {job} from slurmctld ({e}); srun's GPU request is left as given"
                    ));
                    Ok(false)
                }
            }
        }
    }
}
