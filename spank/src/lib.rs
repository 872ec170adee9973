//! SPANK plugin `multiplex`. The exported callbacks dispatch on the context and carry out
//! plans; the work is in [`args`] (plugstack.conf), `step` (slurmstepd's side, read from
//! Slurm), `srun` (srun's GPU options), [`remote`] (asking the node's daemon) and the shared
//! option syntax.
//!
//! It runs inside sbatch, srun and slurmstepd: no threads, every callback behind
//! [`slurm_ffi::guard`], and a daemon that does not answer costs at most `timeout_ms`.

pub mod args;
pub mod remote;
mod srun;
mod step;

use args::Args;
use libc::{c_char, c_int};
use multiplex_protocol::spec::Spec;
use remote::StepPlan;
use slurm_ffi::bindings::spank_t;
use slurm_ffi::spank::{self as sp, Context, Spank, StaticOption};
use slurm_ffi::{c_str, log};
use std::sync::Mutex;

slurm_ffi::slurm_plugin!("multiplex", "spank");

pub(crate) const PREFIX: &str = "multiplex";

/// The variable through which Slurm passes the option in the environment: it reads it in
/// sbatch/salloc/srun before the command line (which therefore wins), and it carries the
/// option into the job, where steps see it.
pub(crate) const OPTION_ENV: &str = "SLURM_SPANK__SLURM_SPANK_OPTION_multiplex_multiplex";

/// The user-facing environment equivalent of `--multiplex[=SPEC]`.
const USER_ENV: &str = "SLURM_MULTIPLEX";

static OPTION: StaticOption = StaticOption::new(
    c"multiplex",
    c"[app=NAME,mem=SIZE]",
    c"[multiplex] Share a GPU with other jobs, placed by measured interference. app=NAME keys the history (default: user and job name); mem=SIZE is the job's peak GPU memory, e.g. 16G.",
    2,
    option_cb,
);

/// Per-process state: one job step in slurmstepd, one command in sbatch/srun.
struct State {
    args: Args,
    /// `None`: flag not given; `Some(None)`: bare flag; `Some(Some(v))`: with a value.
    option: Option<Option<String>>,
    plan: Option<StepPlan>,
    /// (job, step, node) the daemon placed, to report the end to.
    placed: Option<(u32, u32, String)>,
    worst_exit: i32,
    /// One line for the job's output before its batch script runs: why this run is a rerun
    /// (the daemon put the job back in the queue after it ran out of memory beside a partner).
    notice: Option<String>,
}

static STATE: Mutex<State> = Mutex::new(State {
    args: Args {
        socket: String::new(),
        timeout_ms: 2000,
        on_daemon_error: args::OnDaemonError::Run,
    },
    option: None,
    plan: None,
    placed: None,
    worst_exit: 0,
    notice: None,
});

pub(crate) fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// # Safety
/// `av` must hold `ac` valid C strings.
unsafe fn argv(ac: c_int, av: *mut *mut c_char) -> Vec<String> {
    if av.is_null() {
        return Vec::new();
    }
    // SAFETY: caller's contract.
    (0..ac.max(0) as usize)
        .filter_map(|i| unsafe { c_str(*av.add(i)) })
        .collect()
}

/// Reads plugstack.conf arguments; an error is logged with the bad argument in every context.
fn load_args(ac: c_int, av: *mut *mut c_char) -> Result<(), ()> {
    // SAFETY: Slurm passes ac/av from plugstack.conf.
    let words = unsafe { argv(ac, av) };
    match Args::parse(&words) {
        Ok(a) => {
            state().args = a;
            Ok(())
        }
        Err(e) => {
            log::error(&format!("{PREFIX}: plugstack.conf: {e}"));
            Err(())
        }
    }
}

/// # Safety
/// Called by Slurm with the pointers its plugin API documents.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init(sp: spank_t, ac: c_int, av: *mut *mut c_char) -> c_int {
    slurm_ffi::guard(PREFIX, "slurm_spank_init", -1, || {
        if load_args(ac, av).is_err() {
            return -1;
        }
        if matches!(sp::context(), Context::Allocator | Context::Local) {
            honour_user_env();
        }
        // SAFETY: the handle of this callback.
        let spank = unsafe { Spank::from_raw(sp) };
        if let Err(e) = spank.register_option(&OPTION) {
            log::error(&format!("{PREFIX}: cannot register --multiplex: {e}"));
            return -1;
        }
        0
    })
}

/// `SLURM_MULTIPLEX=SPEC` acts as `--multiplex=SPEC`: Slurm reads the option's own variable
/// after this callback and before the command line, so the command line still wins.
fn honour_user_env() {
    if let Some(v) = std::env::var_os(USER_ENV) {
        if std::env::var_os(OPTION_ENV).is_none() {
            // sbatch/salloc/srun are single-threaded while plugins initialise.
            std::env::set_var(OPTION_ENV, v);
        }
    }
}

unsafe extern "C" fn option_cb(_val: c_int, optarg: *const c_char, remote: c_int) -> c_int {
    slurm_ffi::guard(PREFIX, "--multiplex", -1, || {
        // SAFETY: Slurm passes NULL or the option's argument.
        let value = unsafe { c_str(optarg) };
        if let Err(e) = Spec::parse(value.as_deref()) {
            let msg = format!("{PREFIX}: invalid --multiplex value: {e}");
            if remote == 0 {
                log::error(&msg);
            } else {
                log::error(&format!("{msg} (on the node)"));
            }
            return -1;
        }
        state().option = Some(value);
        0
    })
}

/// # Safety
/// Called by Slurm with the pointers its plugin API documents.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init_post_opt(sp: spank_t, _ac: c_int, _av: *mut *mut c_char) -> c_int {
    slurm_ffi::guard(PREFIX, "slurm_spank_init_post_opt", -1, || {
        // SAFETY: the handle of this callback.
        let spank = unsafe { Spank::from_raw(sp) };
        match sp::context() {
            Context::Remote => step::post_opt(&spank),
            Context::Local => srun::post_opt(&spank),
            _ => 0,
        }
    })
}

/// In each task, just before exec: set what the daemon recorded, or print the one warning.
/// # Safety
/// Called by Slurm with the pointers its plugin API documents.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_init(sp: spank_t, _ac: c_int, _av: *mut *mut c_char) -> c_int {
    slurm_ffi::guard(PREFIX, "slurm_spank_task_init", -1, || {
        // SAFETY: the handle of this callback.
        let spank = unsafe { Spank::from_raw(sp) };
        let (plan, notice) = {
            let s = state();
            (s.plan.clone(), s.notice.clone())
        };
        if let Some(notice) = notice.filter(|_| spank.task_local_id() == Ok(0)) {
            // This process becomes the task: its stderr is the job's output.
            eprintln!("{notice}");
        }
        match plan {
            Some(StepPlan::Recorded { env }) => {
                for (k, v) in env {
                    if let Err(e) = spank.setenv(&k, &v) {
                        log::error(&format!("{PREFIX}: cannot set {k}: {e}"));
                        return -1;
                    }
                }
            }
            Some(StepPlan::NotApplied { warning }) if spank.task_local_id() == Ok(0) => {
                // This process becomes the task: its stderr is the job's stderr.
                eprintln!("{warning}");
            }
            Some(StepPlan::Fail { message }) => {
                if spank.task_local_id() == Ok(0) {
                    eprintln!("{message}");
                }
                // The task exits with status 1 before running anything.
                return -1;
            }
            _ => {}
        }
        0
    })
}

/// # Safety
/// Called by Slurm with the pointers its plugin API documents.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_exit(sp: spank_t, _ac: c_int, _av: *mut *mut c_char) -> c_int {
    slurm_ffi::guard(PREFIX, "slurm_spank_task_exit", 0, || {
        // SAFETY: the handle of this callback.
        let spank = unsafe { Spank::from_raw(sp) };
        if let Ok(status) = spank.task_exit_status() {
            let mut s = state();
            if status != 0 && s.worst_exit == 0 {
                s.worst_exit = status;
            }
        }
        0
    })
}

/// # Safety
/// Called by Slurm with the pointers its plugin API documents.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_exit(_sp: spank_t, _ac: c_int, _av: *mut *mut c_char) -> c_int {
    slurm_ffi::guard(PREFIX, "slurm_spank_exit", 0, || {
        if sp::context() != Context::Remote {
            return 0;
        }
        let (placed, args, worst) = {
            let mut s = state();
            (s.placed.take(), s.args.clone(), s.worst_exit)
        };
        if let Some((job, step, node)) = placed {
            if let Err(e) = remote::finish(&args, &node, job, step, worst) {
                log::error(&format!(
                    "{PREFIX}: job {job} step {}: could not report the end to multiplexd: {e}",
                    multiplex_protocol::step_label(step)
                ));
            }
        }
        0
    })
}
