//! Everything that touches Slurm's C side: bindings generated from the installed headers, the
//! host functions (resolved at run time), and the guard every exported callback goes through.
//!
//! Slurm's functions (`slurm_info`, `slurm_xstrdup`, `spank_setenv`, ...) live in
//! `libslurmfull`, which every Slurm program links. They are looked up with
//! `dlsym(RTLD_DEFAULT, ...)` on first use instead of being linked: a Rust cdylib binds every
//! undefined symbol at load time, so a linked symbol that one host lacks would stop the plugin
//! from loading at all, and unit tests could not link without a Slurm library.

pub mod bindings;
pub mod host;
pub mod job_record;
pub mod log;
pub mod spank;
pub mod srun;

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs one plugin callback, turning a panic into a logged error and `on_panic`.
///
/// Every `extern "C"` function exported to Slurm calls through this, so no unwind ever crosses
/// into C.
pub fn guard<T>(prefix: &str, what: &str, on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            log::error(&format!("{prefix}: internal error in {what}: {msg}"));
            on_panic
        }
    }
}

/// Declares the three symbols every Slurm plugin exports: `plugin_name[]`, `plugin_type[]` (as
/// arrays, not pointers) and `plugin_version`, taken from the headers the crate was built with.
#[macro_export]
macro_rules! slurm_plugin {
    ($name:literal, $type:literal) => {
        #[no_mangle]
        #[used]
        pub static plugin_name: [u8; $name.len() + 1] = $crate::nul_terminated($name);
        #[no_mangle]
        #[used]
        pub static plugin_type: [u8; $type.len() + 1] = $crate::nul_terminated($type);
        #[no_mangle]
        #[used]
        pub static plugin_version: u32 = $crate::bindings::SLURM_VERSION_NUMBER;
    };
}

/// `s` followed by a NUL byte, as a fixed array (used by [`slurm_plugin!`]).
pub const fn nul_terminated<const N: usize>(s: &str) -> [u8; N] {
    let bytes = s.as_bytes();
    assert!(bytes.len() + 1 == N, "array must be one byte longer than the string");
    let mut out = [0u8; N];
    let mut i = 0;
    while i < bytes.len() {
        assert!(bytes[i] != 0, "plugin strings cannot contain NUL");
        out[i] = bytes[i];
        i += 1;
    }
    out
}

/// The Slurm version the bindings were generated from, as `(major, minor, micro)`.
pub const fn version() -> (u32, u32, u32) {
    let v = bindings::SLURM_VERSION_NUMBER;
    ((v >> 16) & 0xff, (v >> 8) & 0xff, v & 0xff)
}

/// How this Slurm writes a gres in a TRES string (`gres:gpu:1` up to 22.05, `gres/gpu:1` from
/// 23.02): the prefix before the gres name.
pub const GRES_PREFIX: &str = if bindings::SLURM_VERSION_NUMBER >= 0x17_02_00 {
    "gres/"
} else {
    "gres:"
};

/// Reads a C string from Slurm, `None` for NULL. Invalid UTF-8 is replaced, never trusted.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string valid for the duration of the call.
pub unsafe fn c_str(p: *const libc::c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: the caller guarantees a valid NUL-terminated string.
        Some(unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// Exports `job_modify` with the signature of the Slurm the crate was built against (23.02
/// added `char **err_msg`), calling `$f(job_desc, job_ptr, submit_uid, err_msg)`; `err_msg` is NULL
/// where the host has none.
#[cfg(slurm_job_modify_err_msg)]
#[macro_export]
macro_rules! export_job_modify {
    ($f:path) => {
        #[no_mangle]
        pub extern "C" fn job_modify(
            job_desc: *mut $crate::bindings::job_desc_msg_t,
            job_ptr: *mut ::libc::c_void,
            submit_uid: u32,
            err_msg: *mut *mut ::libc::c_char,
        ) -> ::libc::c_int {
            $f(job_desc, job_ptr, submit_uid, err_msg)
        }
    };
}

/// Exports `job_modify` with the signature of the Slurm the crate was built against (before
/// 23.02: no `err_msg`), calling `$f(job_desc, job_ptr, submit_uid, err_msg)` with a NULL `err_msg`.
#[cfg(not(slurm_job_modify_err_msg))]
#[macro_export]
macro_rules! export_job_modify {
    ($f:path) => {
        #[no_mangle]
        pub extern "C" fn job_modify(
            job_desc: *mut $crate::bindings::job_desc_msg_t,
            job_ptr: *mut ::libc::c_void,
            submit_uid: u32,
        ) -> ::libc::c_int {
            $f(job_desc, job_ptr, submit_uid, ::std::ptr::null_mut())
        }
    };
}

/// The job a job description names by number, for an update (26.05 moved it into
/// `step_id`: `build.rs` decides from the header).
pub fn job_desc_id(desc: &bindings::job_desc_msg_t) -> u32 {
    #[cfg(slurm_job_desc_step_id)]
    return desc.step_id.job_id;
    #[cfg(not(slurm_job_desc_step_id))]
    return desc.job_id;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_terminated_appends_nul() {
        let a: [u8; 4] = nul_terminated("abc");
        assert_eq!(&a, b"abc\0");
    }

    #[test]
    fn version_matches_installed_slurm() {
        // The job_submit ABI check compares all three numbers with the running Slurm's. Built
        // against another release's root (ROOT/usr/include), that root's slurmctld, run inside it.
        let root = option_env!("SLURM_INCLUDE_DIR")
            .and_then(|i| i.trim_end_matches('/').strip_suffix("/usr/include"))
            .filter(|r| !r.is_empty());
        let out = match root {
            Some(r) => std::process::Command::new("chroot")
                .args([r, "/usr/sbin/slurmctld", "-V"])
                .output(),
            None => std::process::Command::new("slurmctld").arg("-V").output(),
        }
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let (major, minor, micro) = version();
        assert!(
            text.contains(&format!(" {major}.{minor:02}.{micro}")),
            "slurmctld -V says {text}"
        );
    }

    #[test]
    fn guard_turns_panic_into_value() {
        // No Slurm host here: log::error falls back to stderr.
        let v = guard("test", "callback", -1, || -> i32 { panic!("boom") });
        assert_eq!(v, -1);
        assert_eq!(guard("test", "callback", -1, || 7), 7);
    }
}
