//! slurmctld's job record (`job_record_t`), which no installed header describes (it lives in
//! slurmctld's private `slurmctld.h`): the one field the plugins read, by the layout checked
//! against Slurm 22.05 through 24.11. `build.rs` sets `slurm_job_record_checked` for those
//! releases; built against any other, nothing is read and the record counts as unknown.

use std::ffi::c_void;

/// `job_record_t`'s magic cookie (`JOB_MAGIC` in slurmctld.h, the record's first field).
#[cfg(slurm_job_record_checked)]
const JOB_MAGIC: u32 = 0xf0b7392c;

/// The job record does not have the layout this was checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownLayout;

/// The `admin_comment` of slurmctld's job record (`None`: no record, or no comment). The
/// layout checked: the magic cookie, then `char *account`, then `char *admin_comment`.
///
/// # Safety
/// `job_ptr` must be NULL or slurmctld's `job_record_t *`, valid during the call.
pub unsafe fn admin_comment(job_ptr: *const c_void) -> Result<Option<String>, UnknownLayout> {
    if job_ptr.is_null() {
        return Ok(None);
    }
    #[cfg(slurm_job_record_checked)]
    // SAFETY: a job record is far larger than these three words (caller's contract), and on
    // the releases checked its third word is `char *admin_comment`.
    unsafe {
        if *(job_ptr as *const u32) != JOB_MAGIC {
            return Err(UnknownLayout);
        }
        Ok(crate::c_str(*(job_ptr as *const *const libc::c_char).add(2)))
    }
    #[cfg(not(slurm_job_record_checked))]
    Err(UnknownLayout)
}
