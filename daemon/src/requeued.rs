//! A job the daemon sent back to Slurm's queue waits the time the daemon chose, not Slurm's
//! requeue delay.
//!
//! Slurm completes a requeue only once the job's run has ended (epilog included). At that
//! moment, if the job's earliest start has already passed, slurmctld replaces it by its own
//! delay: the credential lifetime and a second, 121 s by default. A declined job's SPANK
//! plugin sets its start `decline_retry_s` ahead as it requeues it; when completing the
//! requeue takes longer than that (a busy slurmctld or node, or a short retry), the job waits
//! 121 s instead. Seen in the demo (5 s retries, 300 trace seconds per real second): one
//! decline of five runs cost its job 116 real seconds, and the daemons' average JCT 20%.
//!
//! So, off the request path, the daemon waits for each job it sent back to pend again and
//! then sets its start to what was chosen: for a decline, the time the plugin set (or a second
//! from then, if that passed); for a job given back to run apart, `decline_retry_s` from then.
//! Where the steering thread watches declined jobs (`[steer] defer` or `close`), it sets their
//! start itself, and declines are not kept here.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::time::{Duration, Instant};

/// How long one `scontrol` call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a requeue may take to complete, and how often to look.
const REQUEUE_WITHIN: Duration = Duration::from_secs(30);
const REQUEUE_LOOK: Duration = Duration::from_millis(250);
/// Declined jobs waiting to be kept; past this, the newest are left to Slurm (and said so).
const QUEUE: usize = 1024;

/// Waits (at most `within`) until job `job_id` pends again, its requeue completed. False when
/// it did not (said in the log): then it waits whatever Slurm decided.
fn pends_again(scontrol: &Path, job_id: u32, within: Duration) -> bool {
    let show = [
        "show".to_string(),
        "job".to_string(),
        "-o".to_string(),
        job_id.to_string(),
    ];
    let started = Instant::now();
    loop {
        match crate::command::run(scontrol, &show, CALL_TIMEOUT) {
            Ok(out) if out.split_whitespace().any(|w| w == "JobState=PENDING") => return true,
            Ok(_) if started.elapsed() < within => std::thread::sleep(REQUEUE_LOOK),
            Ok(_) => {
                tracing::warn!(
                    job = job_id,
                    "the requeue did not complete within {} s: the job waits Slurm's own requeue delay",
                    within.as_secs()
                );
                return false;
            }
            Err(e) => {
                tracing::warn!(job = job_id, error = %e, "cannot see whether the requeue completed");
                return false;
            }
        }
    }
}

/// Sets the job's earliest start `wait_s` from now: at least a second, as Slurm rejects a
/// launch credential made in the second the node revoked the last one.
fn set_start(scontrol: &Path, job_id: u32, wait_s: u64) -> Result<String, String> {
    let at = format!("now+{}", wait_s.max(1));
    crate::command::run(
        scontrol,
        &[
            "update".to_string(),
            format!("JobId={job_id}"),
            format!("StartTime={at}"),
        ],
        CALL_TIMEOUT,
    )
}

/// A job given back waits `retry_s` once its requeue has completed (the job pends again), so
/// that Slurm keeps it; until then, or if the requeue does not complete within 30 s, the job
/// waits Slurm's delay. Blocks: runs on the separation thread, outside the node's lock.
pub fn hold(scontrol: &Path, job_id: u32, retry_s: u32) {
    if !pends_again(scontrol, job_id, REQUEUE_WITHIN) {
        return;
    }
    match set_start(scontrol, job_id, u64::from(retry_s)) {
        Ok(_) => tracing::info!(job = job_id, "given back: Slurm may start it again in {retry_s} s"),
        Err(e) => tracing::warn!(job = job_id, error = %e, "cannot set when the job given back may start again"),
    }
}

/// Once declined job `job_id` pends again, sets its start to `until` (a second from now, if
/// that passed): what its SPANK plugin set, unless Slurm replaced it by its own delay.
fn keep(scontrol: &Path, job_id: u32, until: Instant, within: Duration) {
    if !pends_again(scontrol, job_id, within) {
        return;
    }
    let left = until.saturating_duration_since(Instant::now());
    // Whole seconds, rounded up: never before the time the plugin set.
    let wait_s = left.as_secs() + u64::from(left.subsec_nanos() > 0);
    match set_start(scontrol, job_id, wait_s) {
        Ok(_) => tracing::debug!(job = job_id, wait_s, "declined job back in the queue: its wait kept"),
        Err(e) => tracing::warn!(
            job = job_id,
            error = %e,
            "cannot keep the declined job's wait: it may wait Slurm's own requeue delay"
        ),
    }
}

/// Hands declined jobs to the keeping thread.
pub struct Keeper {
    tx: SyncSender<(u32, Instant)>,
}

impl Keeper {
    /// Starts the thread that keeps each declined job's wait.
    pub fn start(scontrol: PathBuf) -> std::io::Result<Keeper> {
        let (tx, rx) = sync_channel(QUEUE);
        std::thread::Builder::new()
            .name("requeued".into())
            .spawn(move || keep_all(rx, &scontrol))?;
        Ok(Keeper { tx })
    }

    /// The node declined `job_id`, which should wait `wait_s` from now. Cheap: call it from the
    /// node's decline listener, inside requests.
    pub fn declined(&self, job_id: u32, wait_s: u32) {
        let until = Instant::now() + Duration::from_secs(u64::from(wait_s));
        if let Err(TrySendError::Full((job, _))) = self.tx.try_send((job_id, until)) {
            tracing::warn!(
                job,
                "too many declined jobs waiting to be kept; this one waits what Slurm decides"
            );
        }
    }
}

/// One job at a time: a requeue completes within a second or two, and declines are rare.
fn keep_all(rx: Receiver<(u32, Instant)>, scontrol: &Path) {
    for (job_id, until) in rx {
        keep(scontrol, job_id, until, REQUEUE_WITHIN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// An scontrol that says the job runs for its first `running` looks, then that it pends,
    /// and logs every update.
    fn fake_scontrol(dir: &Path, running: u32) -> PathBuf {
        let path = dir.join("scontrol");
        let d = dir.display();
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\n\
                 case \"$1\" in\n\
                 show) n=$(cat {d}/looks 2>/dev/null || echo 0); echo $((n + 1)) >{d}/looks\n\
                   if [ \"$n\" -lt {running} ]; then echo 'JobId=7 JobName=x JobState=RUNNING Reason=None'\n\
                   else echo 'JobId=7 JobName=x JobState=PENDING Reason=BeginTime'; fi ;;\n\
                 update) echo \"$*\" >>{d}/updates ;;\n\
                 esac\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn updates(dir: &Path) -> Vec<String> {
        std::fs::read_to_string(dir.join("updates"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn a_declined_job_gets_the_rest_of_its_wait_once_it_pends_again() {
        let dir = tempfile::tempdir().unwrap();
        let scontrol = fake_scontrol(dir.path(), 2);
        let until = Instant::now() + Duration::from_secs(5);
        keep(&scontrol, 7, until, Duration::from_secs(10));
        // Two looks at the running job (0.5 s), then the rest of the 5 s, rounded up.
        let u = updates(dir.path());
        assert!(
            u == ["update JobId=7 StartTime=now+5"] || u == ["update JobId=7 StartTime=now+4"],
            "{u:?}"
        );
        // Its time already passed: it may start in a second (Slurm's 121 s taken back).
        let dir = tempfile::tempdir().unwrap();
        let scontrol = fake_scontrol(dir.path(), 0);
        keep(&scontrol, 7, Instant::now(), Duration::from_secs(10));
        assert_eq!(updates(dir.path()), ["update JobId=7 StartTime=now+1"]);
    }

    #[test]
    fn a_job_that_never_pends_again_is_left_alone() {
        // Its requeue failed (it runs on where it fits) or is still under way.
        let dir = tempfile::tempdir().unwrap();
        let scontrol = fake_scontrol(dir.path(), u32::MAX);
        keep(
            &scontrol,
            7,
            Instant::now() + Duration::from_secs(5),
            Duration::from_millis(600),
        );
        assert!(updates(dir.path()).is_empty());
        let looks: u32 = std::fs::read_to_string(dir.path().join("looks"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(looks >= 2, "{looks}");
    }

    #[test]
    fn a_job_given_back_waits_the_retry_from_when_it_pends_again() {
        let dir = tempfile::tempdir().unwrap();
        let scontrol = fake_scontrol(dir.path(), 1);
        hold(&scontrol, 7, 60);
        assert_eq!(updates(dir.path()), ["update JobId=7 StartTime=now+60"]);
    }
}
