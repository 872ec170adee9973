//! Where a job runs, told to Slurm: after the tag in the job's admin comment, so that
//! `scontrol show job` and `sacct -o JobID,AdminComment` show the GPU the daemon chose and who
//! shares it (Slurm's own `GRES` shows the GPU it took the shard from). It runs on a thread of
//! its own, fed by the placements: `scontrol update` is never on a step's launch path. So a
//! job that ends before the update reaches slurmctld (which refuses updates to finished jobs)
//! keeps only its tag, and the log says so.

use crate::node::Placed;
use multiplex_protocol::spec::{with_note, TAG_PREFIX};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

/// Placements waiting to be written; past this, the newest are dropped (and said so).
const QUEUE: usize = 1024;

/// How long one `scontrol update` may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The note for a placed job. `private`: Slurm keeps jobs private, so other jobs' ids are not
/// named, only counted.
pub fn note(p: &Placed, private: bool) -> String {
    let with = match p.partners.as_slice() {
        [] => "alone".to_string(),
        ids if private => format!(
            "beside {} other job{}",
            ids.len(),
            if ids.len() == 1 { "" } else { "s" }
        ),
        [one] => format!("beside job {one}"),
        ids => format!(
            "beside jobs {}",
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ),
    };
    format!(
        "runs on GPU {} {with} (predicted speed {:.2})",
        p.gpu, p.predicted_speed
    )
}

/// Hands placements to the writing thread.
pub struct Annotator {
    tx: SyncSender<Placed>,
}

impl Annotator {
    /// Starts the thread that runs `scontrol update JobId=N AdminComment=...` for each
    /// placement of a job whose comment carries the tag.
    pub fn start(scontrol: PathBuf, private_jobs: Arc<AtomicBool>) -> std::io::Result<Annotator> {
        let (tx, rx) = sync_channel(QUEUE);
        std::thread::Builder::new()
            .name("annotate".into())
            .spawn(move || write_all(rx, &scontrol, &private_jobs))?;
        Ok(Annotator { tx })
    }

    /// Queues `placed` for writing, if job_submit tagged its job (the request carries the
    /// comment slurmstepd read).
    pub fn tell(&self, placed: Placed) {
        if !placed
            .admin_comment
            .as_deref()
            .is_some_and(|c| c.trim_start().starts_with(TAG_PREFIX))
        {
            return;
        }
        if let Err(TrySendError::Full(p)) = self.tx.try_send(placed) {
            tracing::warn!(
                job = p.job_id,
                "too many placements waiting to reach slurmctld; this job's admin comment is not updated"
            );
        }
    }
}

fn write_all(rx: Receiver<Placed>, scontrol: &std::path::Path, private_jobs: &AtomicBool) {
    for p in rx {
        let Some(comment) = p.admin_comment.as_deref() else {
            continue;
        };
        let text = with_note(comment, &note(&p, private_jobs.load(Ordering::Relaxed)));
        let args = vec![
            "update".to_string(),
            format!("JobId={}", p.job_id),
            format!("AdminComment={text}"),
        ];
        match crate::command::run(scontrol, &args, CALL_TIMEOUT) {
            Ok(_) => {}
            // slurmctld's ESLURM_JOB_FINISHED: a job of a second or two, not a fault.
            Err(e) if e.contains("Job has already finished") => tracing::info!(
                job = p.job_id,
                "the job ended before its note reached slurmctld; its admin comment keeps only the tag"
            ),
            Err(e) => tracing::warn!(
                job = p.job_id,
                "cannot write where the job runs into its admin comment: {e}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(partners: Vec<u32>) -> Placed {
        Placed {
            job_id: 7,
            gpu: 1,
            partners,
            predicted_speed: 0.834,
            admin_comment: Some("multiplex:app=a".into()),
        }
    }

    #[test]
    fn the_note_names_the_gpu_and_the_partners_unless_jobs_are_private() {
        assert_eq!(
            note(&placed(vec![]), false),
            "runs on GPU 1 alone (predicted speed 0.83)"
        );
        assert_eq!(
            note(&placed(vec![5]), false),
            "runs on GPU 1 beside job 5 (predicted speed 0.83)"
        );
        assert_eq!(
            note(&placed(vec![5, 6]), false),
            "runs on GPU 1 beside jobs 5, 6 (predicted speed 0.83)"
        );
        assert_eq!(
            note(&placed(vec![5]), true),
            "runs on GPU 1 beside 1 other job (predicted speed 0.83)"
        );
        assert_eq!(
            note(&placed(vec![5, 6]), true),
            "runs on GPU 1 beside 2 other jobs (predicted speed 0.83)"
        );
    }

    #[test]
    fn scontrol_is_asked_for_tagged_jobs_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("calls");
        let fake = dir.path().join("scontrol");
        std::fs::write(
            &fake,
            format!("#!/bin/sh\nprintf '%s\\n' \"$*\" >> {}\n", log.display()),
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let a = Annotator::start(fake, Arc::new(AtomicBool::new(false))).unwrap();
        let mut plain = placed(vec![]);
        plain.job_id = 8;
        plain.admin_comment = Some("an admin's note".into());
        a.tell(plain);
        let mut again = placed(vec![3]);
        again.admin_comment = Some("multiplex:app=a ticket 9 | multiplex: requeued, waiting 5 s: ...".into());
        a.tell(again);
        drop(a);
        let mut calls = String::new();
        for _ in 0..100 {
            calls = std::fs::read_to_string(&log).unwrap_or_default();
            if calls.lines().count() >= 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            calls,
            "update JobId=7 AdminComment=multiplex:app=a ticket 9 | multiplex: requeued, waiting 5 s: ... \
             | multiplex: runs on GPU 1 beside job 3 (predicted speed 0.83)\n"
        );
    }
}
