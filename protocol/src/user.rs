//! Users by name, as the plugins and the daemon both need them (the site policy's users, the
//! daemon's `slurm_user`): one reentrant lookup, safe inside slurmctld's threads.

/// The uid of user `name` in the system's user database (`getpwnam_r`), if there is one.
pub fn uid(name: &str) -> Option<u32> {
    let cname = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids).
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; buf's length is passed.
    let rc = unsafe { libc::getpwnam_r(cname.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) };
    (rc == 0 && !out.is_null()).then_some(pw.pw_uid)
}

#[cfg(test)]
mod tests {
    #[test]
    fn users_by_name() {
        assert_eq!(super::uid("root"), Some(0));
        assert_eq!(super::uid("no-such-user-here-surely"), None);
        assert_eq!(super::uid("nul\0inside"), None);
    }
}
