//! srun's own options, read and changed in srun's process the way Slurm's cli_filter plugins do
//! it: `slurm_option_get`, `slurm_option_set` and `slurm_option_reset` from libslurmfull, on
//! srun's global `opt`, which srun exports (22.05 and 24.11 alike). `slurm_opt_t` stays opaque:
//! options are named as on the command line (`gres`, `gpus-per-task`), so no layout of
//! Slurm's private structs is assumed.
//!
//! Only for the SPANK plugin's local context, in `slurm_spank_init_post_opt`: srun has parsed
//! its options there and has not yet built the job's request or the step's from them.

use libc::{c_char, c_int, c_void};
use std::ffi::CString;

// Written by hand: slurm_opt.h is not an installed header. The prototypes are those of
// src/common/slurm_opt.h, unchanged from 22.05 to 24.11.
type GetFn = unsafe extern "C" fn(opt: *mut c_void, name: *const c_char) -> *mut c_char;
type SetFn = unsafe extern "C" fn(opt: *mut c_void, name: *const c_char, value: *const c_char, early: bool) -> c_int;
type ResetFn = unsafe extern "C" fn(opt: *mut c_void, name: *const c_char) -> bool;

/// srun's options, when this process is srun and has the functions.
pub struct Options {
    opt: *mut c_void,
    get: GetFn,
    set: SetFn,
    reset: ResetFn,
}

fn lookup(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: as in host::lookup.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

impl Options {
    /// srun's options, or `None` when a symbol is missing (not srun, or a Slurm that moved them).
    ///
    /// # Safety
    /// The process must be srun (the SPANK local context): sbatch and salloc export an `opt`
    /// of their own, which this must not be used on.
    pub unsafe fn of_srun() -> Option<Options> {
        let (opt, get, set, reset) = (
            lookup(c"opt"),
            lookup(c"slurm_option_get"),
            lookup(c"slurm_option_set"),
            lookup(c"slurm_option_reset"),
        );
        if [opt, get, set, reset].iter().any(|p| p.is_null()) {
            return None;
        }
        // SAFETY: each symbol is Slurm's function of that name with the prototype above, and
        // `opt` is srun's `slurm_opt_t` (the caller's contract).
        unsafe {
            Some(Options {
                opt,
                get: std::mem::transmute::<*mut c_void, GetFn>(get),
                set: std::mem::transmute::<*mut c_void, SetFn>(set),
                reset: std::mem::transmute::<*mut c_void, ResetFn>(reset),
            })
        }
    }

    /// An option's value as srun holds it (`None` for an unknown name or an unset string).
    pub fn get(&self, name: &str) -> Option<String> {
        let n = CString::new(name).ok()?;
        // SAFETY: a valid option struct and name; the result is NULL or an xmalloc'd string
        // that we own and free below.
        let mut p = unsafe { (self.get)(self.opt, n.as_ptr()) };
        // SAFETY: NULL or a NUL-terminated string.
        let value = unsafe { crate::c_str(p) };
        // SAFETY: p came from Slurm's allocator and nothing else holds it.
        unsafe { crate::host::xfree(&mut p) };
        value
    }

    /// Sets an option as if given on the command line; false when srun refused the value.
    pub fn set(&self, name: &str, value: &str) -> bool {
        let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) else {
            return false;
        };
        // SAFETY: valid option struct and strings; Slurm copies the value.
        unsafe { (self.set)(self.opt, n.as_ptr(), v.as_ptr(), false) == 0 }
    }

    /// Returns an option to its unset state; false for a name srun does not know.
    pub fn reset(&self, name: &str) -> bool {
        let Ok(n) = CString::new(name) else { return false };
        // SAFETY: valid option struct and name.
        unsafe { (self.reset)(self.opt, n.as_ptr()) }
    }
}
