//! Putting back in the queue a job that ran out of GPU memory beside a partner, so that no
//! failure of a co-location reaches its user.
//!
//! A job says it ran out of GPU memory (`multiplexd report --oom`, which a training script
//! calls where it catches CUDA's out-of-memory error; the job's own report is the one signal
//! that names the cause, where an exit status does not). Beside partners on its GPU, the
//! failure is the co-location's: the node marks the pair as one that never fits (the claimer
//! never pairs them again), and here the job goes back to Slurm's queue with `scontrol
//! requeue` while it still runs, so that it ends requeued, not failed. Its admin comment says
//! why first ([`multiplex_protocol::spec::put_back_note`]): the claimer claims it again only
//! alone or beside partners whose pair is known to fit, its next run prints the note on its
//! stderr, and `sacct -o AdminComment` keeps it.
//!
//! Bounds, so that a job failing for its own reasons is not rerun forever: a job out of
//! memory alone is its own failure and is never put back; a job Slurm has restarted
//! [`MAX_RESTARTS`] times is not put back again; a job that may not be requeued
//! (`--no-requeue`, not a batch job) is never put back. Each refusal says why in the answer
//! to the report and in the daemon's log.

use crate::slurm::{JobRecord, Slurm, SlurmError};
use multiplex_protocol::spec::{put_back_note, with_note};

/// A job Slurm has restarted this often (put back, given back to run apart, requeued by an
/// admin) is not put back again: each put-back rules out the pair it failed in and claims it
/// only alone or beside a known fit, so a third failure beside partners is the job's own.
pub const MAX_RESTARTS: u32 = 3;

/// What the node knows of a job that ran out of memory beside partners.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfMemory {
    pub job_id: u32,
    /// Its partners' applications on the GPU.
    pub beside: Vec<String>,
    pub node: String,
    pub gpu: u32,
}

/// Whether a job slurmctld holds as `record` may be put back; `Err`: why not, in words.
pub fn may_put_back(record: &JobRecord) -> Result<(), String> {
    if !record.batch {
        return Err("it is not a batch job, and Slurm requeues only those".into());
    }
    if !record.requeue {
        return Err("it may not be requeued (--no-requeue)".into());
    }
    if record.restarts >= MAX_RESTARTS {
        return Err(format!(
            "Slurm has restarted it {} times already (at most {MAX_RESTARTS})",
            record.restarts
        ));
    }
    Ok(())
}

/// Puts `oom`'s job back in the queue: reads its record, writes the note, requeues it.
/// `Ok`: the sentence for the job's output; `Err`: why it was not, for the same.
pub fn put_back(slurm: &dyn Slurm, oom: &OutOfMemory) -> Result<String, String> {
    let job = oom.job_id;
    let record = slurm.job_record(job).map_err(|e| cannot(job, &e))?;
    may_put_back(&record).map_err(|why| format!("job {job} is not put back in the queue: {why}"))?;
    let note = put_back_note(&oom.beside.join(", "), &oom.node, &oom.gpu.to_string());
    let comment = with_note(record.admin_comment.as_deref().unwrap_or_default(), &note);
    slurm.set_admin_comment(job, &comment).map_err(|e| cannot(job, &e))?;
    if let Err(e) = slurm.requeue(job) {
        // Not put back after all: the comment must not say it was.
        let was = record.admin_comment.as_deref().unwrap_or_default();
        if let Err(undo) = slurm.set_admin_comment(job, was) {
            tracing::warn!(job, error = %undo, "cannot take back the put-back note of a job Slurm did not requeue");
        }
        return Err(cannot(job, &e));
    }
    Ok(format!(
        "job {job} is put back in the queue: it starts again from the beginning, alone or beside \
         a partner known to fit (restart {} of at most {MAX_RESTARTS})",
        record.restarts + 1
    ))
}

fn cannot(job: u32, e: &SlurmError) -> String {
    format!("job {job} could not be put back in the queue: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slurm::{Fake, FakeState, Job};
    use multiplex_protocol::spec::put_back as note_of;

    fn running(id: u32) -> Job {
        Job::running_on_n1(
            id,
            "multiplex:app=big | multiplex: claim node:n1 gpu:v100_0 beside:3 speed:0.800",
        )
    }

    fn oom(job_id: u32) -> OutOfMemory {
        OutOfMemory {
            job_id,
            beside: vec!["huge".into()],
            node: "n1".into(),
            gpu: 0,
        }
    }

    #[test]
    fn a_job_out_of_memory_beside_a_partner_is_requeued_with_the_reason_in_its_admin_comment() {
        let slurm = Fake::new(FakeState {
            jobs: vec![running(7)],
            ..FakeState::default()
        });
        let said = put_back(&slurm, &oom(7)).unwrap();
        assert!(said.contains("put back in the queue"), "{said}");
        let s = slurm.state.lock().unwrap();
        let job = &s.jobs[0];
        assert!(job.pending, "requeued");
        let comment = job.admin_comment.as_deref().unwrap();
        assert!(
            comment.starts_with("multiplex:app=big | "),
            "the tag stays first: {comment}"
        );
        assert!(comment.contains("claim node:n1"), "the claim stays: {comment}");
        let note = note_of(Some(comment)).unwrap();
        assert!(note.contains("beside huge on n1 GPU 0"), "{note}");
        assert_eq!(s.restarts, vec![(7, 1)]);
    }

    #[test]
    fn a_job_that_may_not_requeue_is_never_put_back_and_is_left_as_it_was() {
        for state in [
            FakeState {
                no_requeue: vec![7],
                ..FakeState::default()
            },
            FakeState {
                not_batch: vec![7],
                ..FakeState::default()
            },
        ] {
            let slurm = Fake::new(FakeState {
                jobs: vec![running(7)],
                ..state
            });
            let why = put_back(&slurm, &oom(7)).unwrap_err();
            assert!(why.contains("not put back"), "{why}");
            let s = slurm.state.lock().unwrap();
            assert!(!s.jobs[0].pending);
            assert_eq!(s.updates, 0, "neither the comment nor the queue touched");
        }
    }

    #[test]
    fn a_job_that_keeps_failing_is_put_back_at_most_max_restarts_times() {
        let slurm = Fake::new(FakeState {
            jobs: vec![running(7)],
            ..FakeState::default()
        });
        let mut put = 0;
        for _ in 0..10 {
            match put_back(&slurm, &oom(7)) {
                Ok(_) => put += 1,
                Err(why) => {
                    assert!(why.contains("restarted it 3 times"), "{why}");
                    break;
                }
            }
            slurm.state.lock().unwrap().jobs[0].pending = false; // it runs again
        }
        assert_eq!(put, MAX_RESTARTS);
    }

    #[test]
    fn a_job_slurm_will_not_requeue_keeps_the_comment_it_had() {
        let slurm = Fake::new(FakeState {
            jobs: vec![running(7)],
            ..FakeState::default()
        });
        let was = slurm.state.lock().unwrap().jobs[0].admin_comment.clone();
        // The requeue fails after the comment was written (slurmctld's answer, not ours).
        slurm.state.lock().unwrap().jobs[0].pending = true;
        let why = put_back(&slurm, &oom(7)).unwrap_err();
        assert!(why.contains("could not be put back"), "{why}");
        assert_eq!(slurm.state.lock().unwrap().jobs[0].admin_comment, was);
    }

    #[test]
    fn a_job_slurmctld_no_longer_knows_is_not_put_back_and_says_so() {
        let slurm = Fake::new(FakeState::default());
        let why = put_back(&slurm, &oom(7)).unwrap_err();
        assert!(why.contains("could not be put back"), "{why}");
    }
}
