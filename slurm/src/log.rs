//! Logging into the host's log (slurmctld.log, slurmd.log, the user's terminal for
//! sbatch/srun). Always through a `"%s"` format so that user data is never a format string.
//! Without a Slurm host (unit tests) messages go to stderr.

use crate::host::host;
use std::ffi::CString;

/// `msg` as one line of the host's log: its control characters written as escapes (`\n`,
/// `\u{1b}`). What a user wrote into a job (a GPU model, a flag's text) reaches slurmctld's
/// log in the plugins' messages, and a newline in it would start a line of the user's own
/// making there.
fn one_line(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    for c in msg.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn emit(f: Option<unsafe extern "C" fn(*const libc::c_char, ...)>, msg: &str) {
    let c = CString::new(one_line(msg)).expect("NULs escaped");
    match f {
        // SAFETY: "%s" with one valid C string argument matches the printf contract.
        Some(f) => unsafe { f(c"%s".as_ptr(), c.as_ptr()) },
        None => eprintln!("{msg}"),
    }
}

/// `slurm_info`: the normal log of the host daemon.
pub fn info(msg: &str) {
    emit(host().info, msg)
}

/// `slurm_error`: an error in the host's log (and on the user's terminal for client commands).
pub fn error(msg: &str) {
    emit(host().error, msg)
}

/// `slurm_verbose`: detail shown with `-v` or a raised debug level.
pub fn verbose(msg: &str) {
    emit(host().verbose, msg)
}

/// `slurm_spank_log`: a line the user sees on their terminal (local/allocator contexts).
pub fn user(msg: &str) {
    emit(host().spank_log, msg)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_message_is_one_line_whatever_a_user_wrote_into_it() {
        let forged = "model v100\n[2026-11-28T10:00:00] error: forged\r\u{1b}[2J\0 end\ttab";
        let line = super::one_line(forged);
        assert_eq!(
            line,
            "model v100\\n[2026-11-28T10:00:00] error: forged\\r\\u{1b}[2J\\u{0} end\\ttab"
        );
        assert!(!line.chars().any(char::is_control), "{line}");
        // Text without control characters is unchanged, non-ASCII included.
        assert_eq!(super::one_line("gpu:a100-80gb é 3"), "gpu:a100-80gb é 3");
    }
}
