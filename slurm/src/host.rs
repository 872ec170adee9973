//! Slurm functions provided by the host process, looked up once with `dlsym(RTLD_DEFAULT)`.
//!
//! A missing symbol is `None`: callers degrade (logging falls back to stderr) instead of
//! failing to load.

use crate::bindings::{
    multiplex_free_job_info_msg_f, multiplex_hostlist_create_f, multiplex_hostlist_destroy_f,
    multiplex_hostlist_find_f, multiplex_hostlist_shift_f, multiplex_load_job_f, multiplex_spank_context_f,
    multiplex_spank_getenv_f, multiplex_spank_job_control_setenv_f, multiplex_spank_option_register_f,
    multiplex_spank_setenv_f, multiplex_strerror_f, spank_err_t, spank_item_t, spank_t,
};
use libc::{c_char, c_void};
use std::sync::OnceLock;

// Written by hand: bindgen cannot type printf-like variadics, Slurm's allocator is in no
// installed header, and slurm_get_errno left the headers in 24.11 (errno says it there).
// Every other prototype is the headers' own (wrapper.h).
type LogFn = unsafe extern "C" fn(fmt: *const c_char, ...);
type XstrdupFn = unsafe extern "C" fn(s: *const c_char) -> *mut c_char;
type XfreeFn = unsafe extern "C" fn(p: *mut *mut c_void);
type SpankGetItemFn = unsafe extern "C" fn(spank_t, spank_item_t, ...) -> spank_err_t;
type GetErrnoFn = unsafe extern "C" fn() -> libc::c_int;

/// The host functions this project uses; each is `None` when the host process lacks it.
pub struct Host {
    pub info: Option<LogFn>,
    pub error: Option<LogFn>,
    pub verbose: Option<LogFn>,
    pub spank_log: Option<LogFn>,
    pub xstrdup: Option<XstrdupFn>,
    pub xfree: Option<XfreeFn>,
    pub spank_option_register: multiplex_spank_option_register_f,
    pub spank_get_item: Option<SpankGetItemFn>,
    pub spank_getenv: multiplex_spank_getenv_f,
    pub spank_setenv: multiplex_spank_setenv_f,
    pub spank_job_control_setenv: multiplex_spank_job_control_setenv_f,
    pub spank_context: multiplex_spank_context_f,
    pub hostlist_create: multiplex_hostlist_create_f,
    pub hostlist_shift: multiplex_hostlist_shift_f,
    pub hostlist_destroy: multiplex_hostlist_destroy_f,
    pub hostlist_find: multiplex_hostlist_find_f,
    pub get_errno: Option<GetErrnoFn>,
    pub strerror: multiplex_strerror_f,
    pub load_job: multiplex_load_job_f,
    pub free_job_info_msg: multiplex_free_job_info_msg_f,
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

/// `resolve!` for a prototype the headers give (bindgen's `Option<unsafe extern "C" fn>`,
/// which is `None` exactly when the pointer is NULL).
macro_rules! resolve_typed {
    ($name:literal, $ty:ty) => {{
        // SAFETY: `$ty` is `Option` of the symbol's own prototype, generated from the Slurm
        // headers; Option of a function pointer has the pointer's layout, NULL being None.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(lookup($name)) }
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
        spank_option_register: resolve_typed!(c"spank_option_register", multiplex_spank_option_register_f),
        spank_get_item: resolve!(c"spank_get_item", SpankGetItemFn),
        spank_getenv: resolve_typed!(c"spank_getenv", multiplex_spank_getenv_f),
        spank_setenv: resolve_typed!(c"spank_setenv", multiplex_spank_setenv_f),
        spank_job_control_setenv: resolve_typed!(c"spank_job_control_setenv", multiplex_spank_job_control_setenv_f),
        spank_context: resolve_typed!(c"spank_context", multiplex_spank_context_f),
        hostlist_create: resolve_typed!(c"slurm_hostlist_create", multiplex_hostlist_create_f),
        hostlist_shift: resolve_typed!(c"slurm_hostlist_shift", multiplex_hostlist_shift_f),
        hostlist_destroy: resolve_typed!(c"slurm_hostlist_destroy", multiplex_hostlist_destroy_f),
        hostlist_find: resolve_typed!(c"slurm_hostlist_find", multiplex_hostlist_find_f),
        get_errno: resolve!(c"slurm_get_errno", GetErrnoFn),
        strerror: resolve_typed!(c"slurm_strerror", multiplex_strerror_f),
        load_job: resolve_typed!(c"slurm_load_job", multiplex_load_job_f),
        free_job_info_msg: resolve_typed!(c"slurm_free_job_info_msg", multiplex_free_job_info_msg_f),
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

/// Walks the hosts of a Slurm host list such as `n[1-3,7]`, expanded by Slurm itself, while
/// `each` returns true. `None` when Slurm cannot read the list or the host process has no
/// hostlist functions.
fn hostlist_walk(list: &str, mut each: impl FnMut(String) -> bool) -> Option<()> {
    let h = host();
    let (create, shift, destroy) = (h.hostlist_create?, h.hostlist_shift?, h.hostlist_destroy?);
    let c = std::ffi::CString::new(list).ok()?;
    // SAFETY: slurm_hostlist_create copies the string; the handle is destroyed below.
    let hl = unsafe { create(c.as_ptr()) };
    if hl.is_null() {
        return None;
    }
    loop {
        // SAFETY: hl is a live host list; shift returns a malloc'd string or NULL when empty.
        let p = unsafe { shift(hl) };
        if p.is_null() {
            break;
        }
        // SAFETY: p is a valid NUL-terminated string from Slurm.
        let name = unsafe { crate::c_str(p) }.unwrap_or_default();
        // SAFETY: slurm_hostlist_shift's result is allocated with malloc (slurm.h).
        unsafe { libc::free(p.cast()) };
        if !each(name) {
            break;
        }
    }
    // SAFETY: hl came from slurm_hostlist_create and is not used afterwards.
    unsafe { destroy(hl) };
    Some(())
}

/// Every host of a Slurm host list such as `gpu[01-04],big1`, expanded by Slurm itself;
/// `None` when Slurm cannot read the list (or the host process has no hostlist functions),
/// or it names more than `limit` hosts.
pub fn hostlist_expand(list: &str, limit: usize) -> Option<Vec<String>> {
    let (mut hosts, mut complete) = (Vec::new(), true);
    hostlist_walk(list, |name| {
        complete = hosts.len() < limit;
        if complete {
            hosts.push(name);
        }
        complete
    })?;
    complete.then_some(hosts)
}

/// Which of `names` the Slurm host list `list` names, in the list's order, found with Slurm's
/// own `hostlist_find`, which searches the list's ranges without expanding them (`list` may be
/// a user's `--nodelist`, `names` are few). `None` when Slurm cannot read the list.
pub fn hostlist_names<'a>(list: &str, names: impl Iterator<Item = &'a str>) -> Option<Vec<String>> {
    let h = host();
    let (create, find, destroy) = (h.hostlist_create?, h.hostlist_find?, h.hostlist_destroy?);
    let c = std::ffi::CString::new(list).ok()?;
    // SAFETY: slurm_hostlist_create copies the string; the handle is destroyed below.
    let hl = unsafe { create(c.as_ptr()) };
    if hl.is_null() {
        return None;
    }
    let mut found: Vec<(i32, String)> = names
        .filter_map(|name| {
            let n = std::ffi::CString::new(name).ok()?;
            // SAFETY: hl is a live host list and n a valid C string; find only reads them.
            let at = unsafe { find(hl, n.as_ptr()) };
            (at >= 0).then(|| (at, name.to_string()))
        })
        .collect();
    // SAFETY: hl came from slurm_hostlist_create and is not used afterwards.
    unsafe { destroy(hl) };
    found.sort();
    Some(found.into_iter().map(|(_, name)| name).collect())
}

/// Slurm's description of its last API error: `slurm_get_errno` where the host has it, else
/// `errno` (Slurm 24.11 sets errno and dropped slurm_get_errno from its headers).
fn last_error() -> String {
    let h = host();
    // SAFETY: slurm_get_errno takes and returns plain values.
    let code = match h.get_errno {
        Some(errno) => unsafe { errno() },
        None => std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
    };
    match h.strerror {
        // SAFETY: slurm_strerror takes a plain value and returns a static string.
        Some(strerror) => unsafe { crate::c_str(strerror(code)) }.unwrap_or_else(|| format!("Slurm error {code}")),
        None => format!("Slurm error {code}"),
    }
}

/// What slurmctld holds of a job that its user cannot set: its admin comment (what a job
/// submit plugin and the claimer wrote there) and its gres request per node (a claimed job's
/// names the GPU it was pinned to by type).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobFacts {
    pub admin_comment: Option<String>,
    pub tres_per_node: Option<String>,
    /// The first entry of its allocation's gres detail, as `scontrol show job -d` prints it
    /// after `GRES=` (`shard:1(IDX:1)` on 22.05, `shard:1(1/2,0/2)` on 24.11): the GPU Slurm
    /// allocated; `None` while it has no allocation.
    pub gres_detail: Option<String>,
}

/// slurm.h's `SHOW_DETAIL` (0x0002 in 22.05, `SLURM_BIT(1)` in 24.11): the allocation's
/// detail, with the GPU index of each gres.
const SHOW_DETAIL: u16 = 0x0002;

/// Job `job_id`'s [`JobFacts`], from slurmctld: one RPC, for slurmstepd, never slurmctld.
pub fn job_facts(job_id: u32) -> Result<JobFacts, String> {
    let h = host();
    let load = h.load_job.ok_or("this process has no slurm_load_job")?;
    let free = h
        .free_job_info_msg
        .ok_or("this process has no slurm_free_job_info_msg")?;
    let mut msg: *mut crate::bindings::job_info_msg = std::ptr::null_mut();
    // The job as 26.05 names it: its id, no step (SLURM_STEP_ID_INITIALIZER's other fields).
    #[cfg(slurm_load_job_step_id)]
    let id = crate::bindings::slurm_step_id_t {
        sluid: 0,
        job_id,
        step_het_comp: crate::bindings::NO_VAL,
        step_id: crate::bindings::NO_VAL,
    };
    #[cfg(not(slurm_load_job_step_id))]
    let id = job_id;
    // SAFETY: slurm_load_job writes a message it allocated into `msg` (or leaves it NULL on
    // failure); SHOW_DETAIL asks for the allocation's detail besides the job as any client
    // sees it.
    if unsafe { load(&mut msg, id, SHOW_DETAIL) } != 0 || msg.is_null() {
        return Err(last_error());
    }
    // SAFETY: msg is the message slurm_load_job returned: `record_count` records at
    // `job_array`, each string NUL-terminated or NULL, and `gres_detail_str` an array of
    // `gres_detail_cnt` such strings; it is read here and freed once below.
    let facts = unsafe {
        let m = &*msg;
        let jobs: &[crate::bindings::slurm_job_info_t] = if m.job_array.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(m.job_array, m.record_count as usize)
        };
        match jobs.iter().find(|j| j.job_id == job_id) {
            Some(j) => Ok(JobFacts {
                admin_comment: crate::c_str(j.admin_comment),
                tres_per_node: crate::c_str(j.tres_per_node),
                gres_detail: if j.gres_detail_cnt > 0 && !j.gres_detail_str.is_null() {
                    crate::c_str(*j.gres_detail_str)
                } else {
                    None
                },
            }),
            None => Err(format!("slurmctld returned no record of job {job_id}")),
        }
    };
    // SAFETY: msg came from slurm_load_job and is not used afterwards.
    unsafe { free(msg) };
    facts
}
