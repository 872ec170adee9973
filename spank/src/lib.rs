//! SPANK plugin `multiplex`. The exported callbacks only dispatch on the context; the work is
//! in [`args`] (plugstack.conf), [`remote`] (slurmstepd) and the shared option syntax.
//!
//! It runs inside sbatch, srun and slurmstepd: no threads, every callback behind
//! [`slurm_ffi::guard`], and a daemon that does not answer costs at most `timeout_ms`.

pub mod args;
pub mod remote;

use args::Args;
use libc::{c_char, c_int};
use multiplex_protocol::spec::Spec;
use remote::{StepInfo, StepPlan};
use slurm_ffi::bindings::spank_t;
use slurm_ffi::spank::{self as sp, Context, Spank, StaticOption};
use slurm_ffi::{c_str, log};
use std::sync::Mutex;

slurm_ffi::slurm_plugin!("multiplex", "spank");

const PREFIX: &str = "multiplex";

/// The variable through which Slurm passes the option in the environment: it reads it in
/// sbatch/salloc/srun before the command line (which therefore wins), and it carries the
/// option into the job, where steps see it.
const OPTION_ENV: &str = "SLURM_SPANK__SLURM_SPANK_OPTION_multiplex_multiplex";

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
});

fn state() -> std::sync::MutexGuard<'static, State> {
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
        if sp::context() != Context::Remote {
            return 0;
        }
        // SAFETY: the handle of this callback.
        let spank = unsafe { Spank::from_raw(sp) };
        remote_post_opt(&spank)
    })
}

fn remote_post_opt(spank: &Spank) -> c_int {
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
    let step = slurm_ffi::step_label(step_id);
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
    };
    let args = state().args.clone();
    let plan = match remote::plan(&args, &spec, &info) {
        StepPlan::Declined { reason, retry_after_s } => declined(job_id, step_id, &node, &reason, retry_after_s),
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

/// A declined batch job is requeued and held back for the daemon's `retry_after_s`; any other
/// declined step fails with the reason.
fn declined(job_id: u32, step_id: u32, node: &str, reason: &str, retry_after_s: u32) -> StepPlan {
    let delay = match remote::on_decline(node, step_id, reason, retry_after_s) {
        Ok(delay) => delay,
        Err(message) => return StepPlan::Fail { message },
    };
    if let Err(e) = slurm_ffi::host::requeue(job_id) {
        return StepPlan::Fail {
            message: format!(
                "multiplex: no GPU on {node} can take this job safely now ({reason}), and it could not be requeued: {e}"
            ),
        };
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    if let Err(e) = slurm_ffi::host::set_begin_time(job_id, now + i64::from(delay)) {
        log::error(&format!(
            "{PREFIX}: job {job_id}: requeued, but could not delay its next start: {e}"
        ));
    }
    StepPlan::Fail {
        message: format!(
            "multiplex: requeued, waiting {delay} s: no GPU on {node} can take this job safely now ({reason})"
        ),
    }
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

/// In each task, just before exec: set the daemon's decision, or print the one warning.
/// # Safety
/// Called by Slurm with the pointers its plugin API documents.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_init(sp: spank_t, _ac: c_int, _av: *mut *mut c_char) -> c_int {
    slurm_ffi::guard(PREFIX, "slurm_spank_task_init", -1, || {
        // SAFETY: the handle of this callback.
        let spank = unsafe { Spank::from_raw(sp) };
        let plan = state().plan.clone();
        match plan {
            Some(StepPlan::Placed { env }) => {
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
                    slurm_ffi::step_label(step)
                ));
            }
        }
        0
    })
}
