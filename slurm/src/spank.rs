//! A safe face for the SPANK handle: items, job environment, option registration.

use crate::bindings::{self, spank_option, spank_t};
use crate::host::host;
use libc::{c_char, c_int};
use std::ffi::CString;

/// Where the plugin is running (`spank_context()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// srun
    Local,
    /// slurmstepd, next to the tasks
    Remote,
    /// sbatch, salloc
    Allocator,
    Slurmd,
    JobScript,
    Error,
}

/// The current SPANK context.
pub fn context() -> Context {
    let Some(f) = host().spank_context else {
        return Context::Error;
    };
    // SAFETY: spank_context takes no arguments and only reads global state; it returns a
    // spank_context_t, whose values the constants below are.
    match unsafe { f() } {
        bindings::S_CTX_LOCAL => Context::Local,
        bindings::S_CTX_REMOTE => Context::Remote,
        bindings::S_CTX_ALLOCATOR => Context::Allocator,
        bindings::S_CTX_SLURMD => Context::Slurmd,
        bindings::S_CTX_JOB_SCRIPT => Context::JobScript,
        _ => Context::Error,
    }
}

/// A SPANK error code with Slurm's meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpankError(pub bindings::spank_err_t);

impl std::fmt::Display for SpankError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "spank error {}", self.0)
    }
}

fn check(rc: bindings::spank_err_t) -> Result<(), SpankError> {
    if rc == bindings::ESPANK_SUCCESS {
        Ok(())
    } else {
        Err(SpankError(rc))
    }
}

const MISSING: SpankError = SpankError(bindings::ESPANK_NOT_AVAIL);

/// The handle Slurm passes to every callback.
#[derive(Clone, Copy)]
pub struct Spank(spank_t);

impl Spank {
    /// Wraps the handle of the current callback.
    ///
    /// # Safety
    /// `sp` must be the handle Slurm passed to the running callback and is used only during it.
    pub unsafe fn from_raw(sp: spank_t) -> Self {
        Spank(sp)
    }

    fn get_u32(&self, item: bindings::spank_item_t) -> Result<u32, SpankError> {
        let f = host().spank_get_item.ok_or(MISSING)?;
        let mut v: u32 = 0;
        // SAFETY: for S_JOB_ID / S_JOB_STEPID / S_JOB_NODEID / S_JOB_UID /
        // S_SLURM_RESTART_COUNT the variadic argument is a `uint32_t *` (uid_t is 32 bits on
        // Linux), per spank.h.
        check(unsafe { f(self.0, item, &mut v as *mut u32) })?;
        Ok(v)
    }

    /// The Slurm job id.
    pub fn job_id(&self) -> Result<u32, SpankError> {
        self.get_u32(bindings::S_JOB_ID)
    }

    /// The job step id (batch and extern steps have Slurm's reserved large values).
    pub fn step_id(&self) -> Result<u32, SpankError> {
        self.get_u32(bindings::S_JOB_STEPID)
    }

    /// This node's index among the step's nodes.
    pub fn node_id(&self) -> Result<u32, SpankError> {
        self.get_u32(bindings::S_JOB_NODEID)
    }

    /// The job owner's uid.
    pub fn uid(&self) -> Result<u32, SpankError> {
        self.get_u32(bindings::S_JOB_UID)
    }

    /// How many times Slurm has requeued (restarted) the job, as slurmstepd was told.
    pub fn restart_count(&self) -> Result<u32, SpankError> {
        self.get_u32(bindings::S_SLURM_RESTART_COUNT)
    }

    /// Exit status of the task that just exited (in `slurm_spank_task_exit`).
    pub fn task_exit_status(&self) -> Result<i32, SpankError> {
        let f = host().spank_get_item.ok_or(MISSING)?;
        let mut v: c_int = 0;
        // SAFETY: S_TASK_EXIT_STATUS takes an `int *`, per spank.h.
        check(unsafe { f(self.0, bindings::S_TASK_EXIT_STATUS, &mut v as *mut c_int) })?;
        Ok(v)
    }

    /// The task's local id on this node (task callbacks only).
    pub fn task_local_id(&self) -> Result<i32, SpankError> {
        let f = host().spank_get_item.ok_or(MISSING)?;
        let mut v: c_int = 0;
        // SAFETY: S_TASK_ID takes an `int *`, per spank.h.
        check(unsafe { f(self.0, bindings::S_TASK_ID, &mut v as *mut c_int) })?;
        Ok(v)
    }

    /// A variable of the job's environment (remote context only).
    pub fn getenv(&self, name: &str) -> Option<String> {
        let f = host().spank_getenv?;
        let name = CString::new(name).ok()?;
        let mut buf = vec![0 as c_char; 8192];
        // SAFETY: buf is writable for its full length, which is what we pass.
        let rc = unsafe { f(self.0, name.as_ptr(), buf.as_mut_ptr(), buf.len() as c_int) };
        if rc != bindings::ESPANK_SUCCESS {
            return None;
        }
        // SAFETY: on success Slurm wrote a NUL-terminated string into buf.
        unsafe { crate::c_str(buf.as_ptr()) }
    }

    /// Sets a variable of the job's environment, overwriting (remote context only).
    pub fn setenv(&self, name: &str, value: &str) -> Result<(), SpankError> {
        let f = host().spank_setenv.ok_or(MISSING)?;
        let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) else {
            return Err(SpankError(bindings::ESPANK_BAD_ARG));
        };
        // SAFETY: both are valid C strings; Slurm copies them.
        check(unsafe { f(self.0, n.as_ptr(), v.as_ptr(), 1) })
    }

    /// Sets a variable of the job's SPANK environment, which job_submit, the prolog and the
    /// epilog see (local and allocator contexts, before the job is submitted).
    pub fn job_control_setenv(&self, name: &str, value: &str) -> Result<(), SpankError> {
        let f = host().spank_job_control_setenv.ok_or(MISSING)?;
        let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) else {
            return Err(SpankError(bindings::ESPANK_BAD_ARG));
        };
        // SAFETY: both are valid C strings; Slurm copies them.
        check(unsafe { f(self.0, n.as_ptr(), v.as_ptr(), 1) })
    }

    /// Registers a command-line option. Slurm keeps the pointer, so the option is `'static`.
    pub fn register_option(&self, opt: &'static StaticOption) -> Result<(), SpankError> {
        let f = host().spank_option_register.ok_or(MISSING)?;
        // SAFETY: Slurm reads the option (it never writes it) and may keep the pointer: the
        // option and its strings are 'static.
        check(unsafe { f(self.0, &opt.0 as *const spank_option as *mut spank_option) })
    }
}

/// A `struct spank_option` that can live in a `static`.
pub struct StaticOption(spank_option);

// SAFETY: the option only holds pointers to 'static immutable strings and a function pointer;
// nothing writes through them.
unsafe impl Sync for StaticOption {}

impl StaticOption {
    /// An option `--name[=arginfo]`; `has_arg` is 0 (flag), 1 (required) or 2 (optional).
    pub const fn new(
        name: &'static std::ffi::CStr,
        arginfo: &'static std::ffi::CStr,
        usage: &'static std::ffi::CStr,
        has_arg: c_int,
        cb: unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int,
    ) -> Self {
        StaticOption(spank_option {
            name: name.as_ptr() as *mut c_char,
            arginfo: arginfo.as_ptr() as *mut c_char,
            usage: usage.as_ptr() as *mut c_char,
            has_arg,
            val: 0,
            cb: Some(cb),
        })
    }
}
