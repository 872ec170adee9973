//! Slurm functions provided by the host process, looked up once with `dlsym(RTLD_DEFAULT)`.
//!
//! A missing symbol is `None`: callers degrade (logging falls back to stderr) instead of
//! failing to load.

use crate::bindings::{job_desc_msg_t, spank_err_t, spank_item_t, spank_option, spank_t};
use libc::{c_char, c_int, c_void};
use std::sync::OnceLock;

type LogFn = unsafe extern "C" fn(fmt: *const c_char, ...);
type XstrdupFn = unsafe extern "C" fn(s: *const c_char) -> *mut c_char;
type XfreeFn = unsafe extern "C" fn(p: *mut *mut c_void);
type SpankOptionRegisterFn = unsafe extern "C" fn(spank_t, *mut spank_option) -> spank_err_t;
type SpankGetItemFn = unsafe extern "C" fn(spank_t, spank_item_t, ...) -> spank_err_t;
type SpankGetenvFn = unsafe extern "C" fn(spank_t, *const c_char, *mut c_char, c_int) -> spank_err_t;
type SpankSetenvFn = unsafe extern "C" fn(spank_t, *const c_char, *const c_char, c_int) -> spank_err_t;
type SpankContextFn = unsafe extern "C" fn() -> c_int;
type HostlistCreateFn = unsafe extern "C" fn(*const c_char) -> *mut c_void;
type HostlistShiftFn = unsafe extern "C" fn(*mut c_void) -> *mut c_char;
type HostlistDestroyFn = unsafe extern "C" fn(*mut c_void);
type RequeueFn = unsafe extern "C" fn(job_id: u32, flags: u32) -> c_int;
type InitJobDescFn = unsafe extern "C" fn(*mut job_desc_msg_t);
type UpdateJobFn = unsafe extern "C" fn(*mut job_desc_msg_t) -> c_int;
type GetErrnoFn = unsafe extern "C" fn() -> c_int;
type StrerrorFn = unsafe extern "C" fn(c_int) -> *mut c_char;

/// The host functions this project uses; each is `None` when the host process lacks it.
pub struct Host {
    pub info: Option<LogFn>,
    pub error: Option<LogFn>,
    pub verbose: Option<LogFn>,
    pub spank_log: Option<LogFn>,
    pub xstrdup: Option<XstrdupFn>,
    pub xfree: Option<XfreeFn>,
    pub spank_option_register: Option<SpankOptionRegisterFn>,
    pub spank_get_item: Option<SpankGetItemFn>,
    pub spank_getenv: Option<SpankGetenvFn>,
    pub spank_setenv: Option<SpankSetenvFn>,
    pub spank_context: Option<SpankContextFn>,
    pub hostlist_create: Option<HostlistCreateFn>,
    pub hostlist_shift: Option<HostlistShiftFn>,
    pub hostlist_destroy: Option<HostlistDestroyFn>,
    pub requeue: Option<RequeueFn>,
    pub init_job_desc_msg: Option<InitJobDescFn>,
    pub update_job: Option<UpdateJobFn>,
    pub get_errno: Option<GetErrnoFn>,
    pub strerror: Option<StrerrorFn>,
}

fn lookup(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: dlsym with RTLD_DEFAULT and a valid NUL-terminated name only reads the loader's
    // tables; a NULL result is handled by the caller.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

macro_rules! resolve {
    ($name:literal, $ty:ty) => {{
        let p = lookup($name);
        if p.is_null() {
            None
        } else {
            // SAFETY: the symbol is Slurm's exported function of that name; `$ty` is its C
            // prototype from the Slurm headers (log functions are printf-like variadics).
            Some(unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
        }
    }};
}

/// The host's functions, resolved on first use.
pub fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| Host {
        info: resolve!(c"slurm_info", LogFn),
        error: resolve!(c"slurm_error", LogFn),
        verbose: resolve!(c"slurm_verbose", LogFn),
        spank_log: resolve!(c"slurm_spank_log", LogFn),
        xstrdup: resolve!(c"slurm_xstrdup", XstrdupFn),
        xfree: resolve!(c"slurm_xfree", XfreeFn),
        spank_option_register: resolve!(c"spank_option_register", SpankOptionRegisterFn),
        spank_get_item: resolve!(c"spank_get_item", SpankGetItemFn),
        spank_getenv: resolve!(c"spank_getenv", SpankGetenvFn),
        spank_setenv: resolve!(c"spank_setenv", SpankSetenvFn),
        spank_context: resolve!(c"spank_context", SpankContextFn),
        hostlist_create: resolve!(c"slurm_hostlist_create", HostlistCreateFn),
        hostlist_shift: resolve!(c"slurm_hostlist_shift", HostlistShiftFn),
        hostlist_destroy: resolve!(c"slurm_hostlist_destroy", HostlistDestroyFn),
        requeue: resolve!(c"slurm_requeue", RequeueFn),
        init_job_desc_msg: resolve!(c"slurm_init_job_desc_msg", InitJobDescFn),
        update_job: resolve!(c"slurm_update_job", UpdateJobFn),
        get_errno: resolve!(c"slurm_get_errno", GetErrnoFn),
        strerror: resolve!(c"slurm_strerror", StrerrorFn),
    })
}

/// Copies `s` into memory from Slurm's allocator, so Slurm may `xfree` it (e.g. `err_msg`).
/// NUL bytes inside `s` are dropped. Returns NULL if the host has no `slurm_xstrdup`.
pub fn xstrdup(s: &str) -> *mut c_char {
    let c = std::ffi::CString::new(s.replace('\0', "")).expect("NULs removed");
    match host().xstrdup {
        // SAFETY: slurm_xstrdup copies a valid NUL-terminated string and returns xmalloc'd memory.
        Some(f) => unsafe { f(c.as_ptr()) },
        None => std::ptr::null_mut(),
    }
}

/// Frees a string that Slurm allocated (`xfree`), setting the pointer to NULL.
///
/// # Safety
/// `*p` must be NULL or a pointer obtained from Slurm's allocator that nothing else frees.
pub unsafe fn xfree(p: &mut *mut c_char) {
    if p.is_null() {
        return;
    }
    if let Some(f) = host().xfree {
        // SAFETY: per the caller's contract `*p` came from xmalloc; slurm_xfree NULLs it.
        unsafe { f((p as *mut *mut c_char).cast()) };
    }
    *p = std::ptr::null_mut();
}

/// Replaces a string field Slurm owns with a copy of `value` from Slurm's allocator.
///
/// # Safety
/// `*field` must be NULL or owned by Slurm's allocator.
pub unsafe fn replace_string(field: &mut *mut c_char, value: &str) {
    // SAFETY: forwarded contract.
    unsafe { xfree(field) };
    *field = xstrdup(value);
}

/// The `n`-th host (from 0) of a Slurm host list such as `n[1-3,7]`, expanded by Slurm itself.
pub fn hostlist_nth(list: &str, n: usize) -> Option<String> {
    let h = host();
    let (create, shift, destroy) = (h.hostlist_create?, h.hostlist_shift?, h.hostlist_destroy?);
    let c = std::ffi::CString::new(list).ok()?;
    // SAFETY: slurm_hostlist_create copies the string; the handle is destroyed below.
    let hl = unsafe { create(c.as_ptr()) };
    if hl.is_null() {
        return None;
    }
    let mut found = None;
    for i in 0..=n {
        // SAFETY: hl is a live host list; shift returns a malloc'd string or NULL when empty.
        let p = unsafe { shift(hl) };
        if p.is_null() {
            break;
        }
        if i == n {
            // SAFETY: p is a valid NUL-terminated string from Slurm.
            found = unsafe { crate::c_str(p) };
        }
        // SAFETY: slurm_hostlist_shift's result is allocated with malloc (slurm.h).
        unsafe { libc::free(p.cast()) };
    }
    // SAFETY: hl came from slurm_hostlist_create and is not used afterwards.
    unsafe { destroy(hl) };
    found
}

/// Slurm's description of its last API error.
fn last_error() -> String {
    let h = host();
    match (h.get_errno, h.strerror) {
        // SAFETY: both take and return plain values; slurm_strerror returns a static string.
        (Some(errno), Some(strerror)) => unsafe {
            let code = errno();
            crate::c_str(strerror(code)).unwrap_or_else(|| format!("Slurm error {code}"))
        },
        _ => "unknown Slurm error".into(),
    }
}

/// Asks slurmctld to requeue batch job `job_id`. An RPC: for slurmstepd, never slurmctld.
pub fn requeue(job_id: u32) -> Result<(), String> {
    let f = host().requeue.ok_or("this process has no slurm_requeue")?;
    // SAFETY: slurm_requeue takes plain values and makes one RPC.
    match unsafe { f(job_id, 0) } {
        0 => Ok(()),
        _ => Err(last_error()),
    }
}

/// Sets a pending job's earliest start (`--begin`) to `begin`, in seconds since the epoch.
/// An RPC, like [`requeue`].
pub fn set_begin_time(job_id: u32, begin: i64) -> Result<(), String> {
    let h = host();
    let init = h
        .init_job_desc_msg
        .ok_or("this process has no slurm_init_job_desc_msg")?;
    let update = h.update_job.ok_or("this process has no slurm_update_job")?;
    let mut desc = std::mem::MaybeUninit::<job_desc_msg_t>::zeroed();
    // SAFETY: slurm_init_job_desc_msg sets every field of the message to "not set" (pointers
    // NULL); slurm_update_job only reads it, and nothing in it needs freeing.
    unsafe {
        init(desc.as_mut_ptr());
        let d = desc.assume_init_mut();
        d.job_id = job_id;
        d.begin_time = begin as _;
        match update(d) {
            0 => Ok(()),
            _ => Err(last_error()),
        }
    }
}
