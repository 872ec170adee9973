//! slurmctld's job record (`job_record_t`), which no installed header describes (it lives in
//! Slurm's private `slurmctld.h`, `src/common/job_record.h` from 24.11): the one field the
//! plugins read, by the layout checked against Slurm 22.05 through 24.11 and 26.05.
//! `build.rs` sets `slurm_job_record_checked` for those releases; built against any other,
//! nothing is read and the record counts as unknown.

use std::ffi::c_void;

/// `job_record_t`'s magic cookie (`JOB_MAGIC` in slurmctld.h, the record's first field).
#[cfg(slurm_job_record_checked)]
const JOB_MAGIC: u32 = 0xf0b7392c;

/// The job record does not have the layout this was checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownLayout;

/// The head of `job_record_t` on the releases checked: the magic cookie, then `char
/// *account`, then `char *admin_comment`; from 26.05 a `slurm_step_id_t` comes first.
#[cfg(slurm_job_record_checked)]
#[repr(C)]
struct Head {
    #[cfg(slurm_job_record_step_id)]
    _step_id: crate::bindings::slurm_step_id_t,
    magic: u32,
    _account: *const libc::c_char,
    admin_comment: *const libc::c_char,
}

/// The `admin_comment` of slurmctld's job record (`None`: no record, or no comment), read
/// through [`Head`].
///
/// # Safety
/// `job_ptr` must be NULL or slurmctld's `job_record_t *`, valid during the call.
pub unsafe fn admin_comment(job_ptr: *const c_void) -> Result<Option<String>, UnknownLayout> {
    if job_ptr.is_null() {
        return Ok(None);
    }
    #[cfg(slurm_job_record_checked)]
    // SAFETY: a job record is far larger than its head (caller's contract), and on the
    // releases checked it begins as `Head` does.
    unsafe {
        let head = &*(job_ptr as *const Head);
        if head.magic != JOB_MAGIC {
            return Err(UnknownLayout);
        }
        Ok(crate::c_str(head.admin_comment))
    }
    #[cfg(not(slurm_job_record_checked))]
    Err(UnknownLayout)
}
