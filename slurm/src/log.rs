//! Logging into the host's log (slurmctld.log, slurmd.log, the user's terminal for
//! sbatch/srun). Always through a `"%s"` format so that user data is never a format string.
//! Without a Slurm host (unit tests) messages go to stderr.

use crate::host::host;
use std::ffi::CString;

fn emit(f: Option<unsafe extern "C" fn(*const libc::c_char, ...)>, msg: &str) {
    let c = CString::new(msg.replace('\0', "")).expect("NULs removed");
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
