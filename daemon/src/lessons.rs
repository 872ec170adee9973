//! What ended and running jobs teach the history, off the request path: a finish answers once
//! the job's end is committed, and a thread of its own, on a connection of its own, learns
//! from it (least squares, the effects update, now and then a compaction). Tests, tools and
//! the simulator learn inline instead, so that what they ask next sees what was learned.
//!
//! Requests come first: the thread runs at the scheduler's idle priority, starts a lesson in a
//! pause between requests (waiting at most [`POSTPONE_AT_MOST`] for one), and its long writes
//! commit and give way whenever a request waits for the write lock.

use crate::history::{ActiveJob, History, HistoryError, Learned, LEARN_WINDOW};
use std::collections::HashSet;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Compact the history after this many finished jobs (and at start).
const COMPACT_EVERY: u32 = 500;

/// The learning thread starts a lesson once no request was served for this long...
const QUIET: Duration = Duration::from_millis(2);
/// ...or once it has waited this long for such a pause: at least one lesson a second under
/// requests that never pause for 2 ms, which no node's slurmstepds send for long (a job array's
/// burst of steps). The placement bench sends them, and at 100 ms the lessons forced into its
/// stream made place latency's 99th percentile clearly worse (docs/notebook/2026-11-results.md,
/// "Does it scale?").
const POSTPONE_AT_MOST: Duration = Duration::from_secs(1);

/// The learning connection's page cache. Every commit of a request empties it (SQLite drops
/// a connection's cache when another connection wrote), so it only serves within a lesson: a
/// fit reads one application's latest jobs and its pairs.
const LEARNER_CACHE_KIB: u32 = 512;

/// One thing to learn from.
#[derive(Debug, Clone)]
pub enum Lesson {
    /// A job that ended here and released its GPU slot.
    Ended(Pupil),
    /// A running job that reported progress beside partners.
    Progress(Pupil),
}

/// The job a lesson is about: what learning reads it by, and what its log lines name. (Not
/// the whole [`ActiveJob`]: lessons wait in a queue while requests do not pause.)
#[derive(Debug, Clone)]
pub struct Pupil {
    /// The job's row in the history.
    pub row: i64,
    pub job_id: u32,
    pub app: String,
}

impl From<&ActiveJob> for Pupil {
    fn from(job: &ActiveJob) -> Pupil {
        Pupil {
            row: job.row,
            job_id: job.job_id,
            app: job.app.clone(),
        }
    }
}

/// How a node learns: the state of learning, whichever connection it writes through.
#[derive(Debug)]
pub struct Teacher {
    /// `policy.unknown_pair_speed`.
    prior: f64,
    finishes_since_compaction: u32,
}

impl Teacher {
    pub fn new(prior: f64) -> Teacher {
        Teacher {
            prior,
            finishes_since_compaction: 0,
        }
    }

    /// Learns `lesson` into `history`. Failing is logged, never a job's problem.
    pub fn learn(&mut self, history: &mut History, lesson: &Lesson) {
        match lesson {
            Lesson::Ended(job) => {
                self.ended(history, job);
                if let Err(e) = history.refresh_app_memory(job.row) {
                    tracing::warn!(job = job.job_id, error = %e, "cannot refresh the application's measured memory");
                }
                self.finishes_since_compaction += 1;
                if self.finishes_since_compaction >= COMPACT_EVERY {
                    self.compact(history);
                }
            }
            Lesson::Progress(job) => self.progress(history, job),
        }
    }

    /// Deletes raw rows of old jobs (see [`History::compact`]); failing is only logged.
    pub fn compact(&mut self, history: &mut History) {
        self.finishes_since_compaction = 0;
        match history.compact(LEARN_WINDOW) {
            Ok(0) => {}
            Ok(n) => tracing::info!(jobs = n, "compacted old jobs into the estimates"),
            Err(e) => tracing::warn!(error = %e, "cannot compact the history"),
        }
    }

    fn ended(&self, history: &mut History, job: &Pupil) {
        match history.learn_from(job.row, self.prior) {
            Ok(Learned::Solo { runtime_s, runs, fits }) => tracing::info!(
                job = job.job_id,
                app = %job.app,
                solo_s = format!("{runtime_s:.1}"),
                runs,
                pairs = %describe(&fits),
                "learned the solo runtime"
            ),
            Ok(Learned::Shared { fits }) => {
                tracing::info!(job = job.job_id, app = %job.app, pairs = %describe(&fits), "learned pair speeds")
            }
            Ok(Learned::NoBaseline) => tracing::info!(
                job = job.job_id,
                app = %job.app,
                "shared its GPU, but this application has no solo runtime yet to compare with"
            ),
            Ok(Learned::Nothing(why)) => tracing::debug!(job = job.job_id, why, "nothing learned"),
            Err(e) => tracing::error!(job = job.job_id, error = %e, "learning from the job failed"),
        }
    }

    /// See [`History::learn_from_progress`].
    fn progress(&self, history: &mut History, job: &Pupil) {
        match history.learn_from_progress(job.row, self.prior) {
            Ok(Learned::Shared { fits }) => tracing::info!(
                job = job.job_id,
                app = %job.app,
                pairs = %describe(&fits),
                "learned pair speeds from progress"
            ),
            Ok(Learned::NoBaseline) => tracing::debug!(job = job.job_id, "no rate alone yet to learn progress by"),
            Ok(other) => tracing::debug!(job = job.job_id, ?other, "nothing learned from progress"),
            Err(e) => tracing::error!(job = job.job_id, error = %e, "learning from progress failed"),
        }
    }
}

/// The set, even if a thread panicked holding it (it stays a valid set).
fn lock(set: &Mutex<HashSet<i64>>) -> MutexGuard<'_, HashSet<i64>> {
    set.lock().unwrap_or_else(|p| p.into_inner())
}

fn describe(fits: &[crate::learn::Fit]) -> String {
    fits.iter()
        .map(|f| format!("{}:{:.2}({})", f.partner, f.speed, f.observations))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Lowers the calling thread to the scheduler's idle class (Linux `SCHED_IDLE`): it runs when
/// a core would otherwise idle, so that learning never takes a core from a request (on a
/// 2-core node a busy learner otherwise made placements several times slower at the 99th
/// percentile). Failing is only logged: learning then competes as any thread does.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(0, ...) changes only the calling thread's policy; `param`
    // lives across the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot lower the learning thread's priority");
    }
}

/// The learning thread of a serving daemon.
pub struct Learner {
    lessons: mpsc::Sender<Lesson>,
    /// Job rows with a progress lesson queued: a job's reports (any number, from its own
    /// user) queue one lesson at a time, so the queue is bounded by the jobs running here
    /// plus those ending.
    progress_queued: Arc<Mutex<HashSet<i64>>>,
    thread: JoinHandle<()>,
}

impl Learner {
    /// Opens a second connection to the history `beside` (at `path`) and starts the thread
    /// that learns through it, with `teacher`; its long writes give way to `beside`'s.
    pub fn start(beside: &History, path: &Path, mut teacher: Teacher) -> Result<Learner, HistoryError> {
        let mut history = beside.open_beside(path)?;
        history.limit_cache(LEARNER_CACHE_KIB)?;
        let (lessons, inbox) = mpsc::channel::<Lesson>();
        let progress_queued: Arc<Mutex<HashSet<i64>>> = Arc::default();
        let queued = Arc::clone(&progress_queued);
        let thread = std::thread::Builder::new()
            .name("learn".into())
            .spawn(move || {
                idle_priority();
                for lesson in inbox {
                    history.wait_for_a_pause(QUIET, POSTPONE_AT_MOST);
                    if let Lesson::Progress(job) = &lesson {
                        // From here on, a new report of the job queues a lesson again.
                        lock(&queued).remove(&job.row);
                    }
                    teacher.learn(&mut history, &lesson);
                }
            })
            .map_err(|e| HistoryError::Thread(e.to_string()))?;
        Ok(Learner {
            lessons,
            progress_queued,
            thread,
        })
    }

    /// Queues `lesson` (a progress lesson of a job that has one queued already is dropped:
    /// that one learns from every report so far). Gives it back if the thread is gone (it never
    /// stops before [`Self::stop`] unless it panicked).
    pub fn send(&self, lesson: Lesson) -> Result<(), Lesson> {
        if let Lesson::Progress(job) = &lesson {
            if !lock(&self.progress_queued).insert(job.row) {
                return Ok(());
            }
        }
        self.lessons.send(lesson).map_err(|e| e.0)
    }

    /// Learns what is still queued, then ends the thread.
    pub fn stop(self) {
        drop(self.lessons);
        if self.thread.join().is_err() {
            tracing::error!("the learning thread panicked");
        }
    }
}
