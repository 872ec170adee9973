//! One node's daemon state: its shared GPUs, its history, and what start, finish, report
//! and status requests do to them ([`steps`], [`telemetry`]). The server calls this and puts
//! the answers on the wire; tests call it directly. Where the
//! daemon is the cluster's claimer, its looks are scored over this history
//! ([`crate::claimer::Scorer`]).

mod steps;
mod telemetry;

pub use steps::{Bound, RequestError, Started};

use crate::config::{Config, GpuSpec};
use crate::history::{ActiveJob, History, HistoryError};
use crate::lessons::{Learner, Lesson, Teacher};
use crate::placement::{GpuState, Knobs};
use multiplex_protocol::{GpuStatus, NodeStatus, TaskStatus};

/// Seconds since the Unix epoch.
pub type Clock = Box<dyn Fn() -> f64 + Send>;

/// The wall clock.
pub fn wall_clock() -> Clock {
    Box::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    })
}

/// The daemon's state for its node.
pub struct Node {
    config: Config,
    gpus: Vec<GpuSpec>,
    history: History,
    clock: Clock,
    /// Learning inline, through `history`; unused while `learner` runs.
    teacher: Teacher,
    /// The learning thread, once [`Self::learn_in_background`] started it.
    learner: Option<Learner>,
    /// Ends of jobs the history could not record (its disk was full, or it could not be
    /// written): their slots are free at once, and each is written when the history takes
    /// writes again (tried before every request). A restart before that loses only the exit
    /// status: reconcile frees such a job as one whose end was never heard of.
    unrecorded: Vec<UnrecordedEnd>,
    /// Per running job (its row), the busy GPU time counted so far (`busy_record_s`).
    busy: std::collections::HashMap<i64, BusyCount>,
    /// When the latest round of GPU telemetry was recorded.
    last_round: Option<f64>,
}

/// A running job's busy GPU time since its count began.
#[derive(Debug, Clone, Copy)]
struct BusyCount {
    /// Seconds busy since the count began (at 0, recorded).
    busy_s: f64,
    /// When the count was last brought up to date, and last recorded.
    counted: f64,
    recorded: f64,
}

/// A job's end the history has not recorded yet.
struct UnrecordedEnd {
    job: ActiveJob,
    step_id: u32,
    exit_status: i32,
    remaining: Vec<i64>,
    at: f64,
}

impl Node {
    /// Opens the node's history. `gpus` are the shared GPUs (from the config or NVML).
    pub fn open(config: Config, gpus: Vec<GpuSpec>, clock: Clock) -> Result<Node, HistoryError> {
        let history = History::open(&config.database)?;
        let mut node = Node {
            teacher: Teacher::new(config.policy.unknown_pair_speed),
            config,
            gpus,
            history,
            clock,
            learner: None,
            unrecorded: Vec::new(),
            busy: Default::default(),
            last_round: None,
        };
        node.teacher.compact(&mut node.history);
        for job in node.history.active_jobs(&node.config.node)? {
            tracing::info!(job = job.job_id, gpu = job.gpu, app = %job.app, "recovered running job from history");
        }
        // What the learning thread had not learned yet when the daemon stopped.
        for job in node.history.unlearned_jobs(&node.config.node)? {
            tracing::info!(job = job.job_id, app = %job.app, "learning from a job that ended before the daemon stopped");
            node.teacher.learn(&mut node.history, &Lesson::Ended((&job).into()));
        }
        Ok(node)
    }

    /// What the metrics' gauges read ([`crate::metrics::Snapshot`]).
    pub fn metrics_snapshot(&self) -> crate::metrics::Snapshot {
        crate::metrics::Snapshot {
            status: self.status().ok(),
            history_jobs: self.history_jobs().ok(),
            database: self.database().to_path_buf(),
        }
    }

    /// How many job rows the history holds.
    pub fn history_jobs(&self) -> Result<i64, HistoryError> {
        Ok(self
            .history
            .connection()
            .query_row("SELECT count(*) FROM jobs", [], |r| r.get(0))?)
    }

    /// The history database's path.
    pub fn database(&self) -> &std::path::Path {
        &self.config.database
    }

    /// The node name this daemon serves.
    pub fn name(&self) -> &str {
        &self.config.node
    }

    /// Merges another node's export into this node's history (see [`History::import`]),
    /// with this daemon's `policy.unknown_pair_speed` for the refit it ends with.
    pub fn import(&mut self, data: &crate::history::Export) -> Result<crate::history::Imported, String> {
        self.history.import(data, self.config.policy.unknown_pair_speed)
    }

    /// The history, for tools and tests.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// Checkpoints the history from a thread of its own (see
    /// [`History::checkpoint_in_background`]).
    pub fn checkpoint_in_background(
        &self,
        shutdown: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<(), HistoryError> {
        self.history.checkpoint_in_background(&self.config.database, shutdown)
    }

    /// From now on learns on a thread of its own, through a connection of its own (see
    /// [`crate::lessons`]): a finish or a report answers once its row is committed.
    pub fn learn_in_background(&mut self) -> Result<(), HistoryError> {
        if self.learner.is_none() {
            let teacher = std::mem::replace(&mut self.teacher, Teacher::new(self.config.policy.unknown_pair_speed));
            self.learner = Some(Learner::start(&self.history, &self.config.database, teacher)?);
        }
        Ok(())
    }

    /// The running config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Runs with `policy` from the next placement on (a config re-read on SIGHUP; see
    /// [`Config::reload`]).
    pub fn set_policy(&mut self, policy: crate::config::PolicyConfig) {
        self.config.policy = policy;
    }

    /// Learns what is still queued, then stops the learning thread (at shutdown): later
    /// lessons are learned inline.
    pub fn stop_learning(&mut self) {
        if let Some(learner) = self.learner.take() {
            learner.stop();
        }
    }

    /// Learns `lesson` on the learning thread if it runs, else now.
    fn teach(&mut self, lesson: Lesson) {
        let lesson = match &self.learner {
            None => lesson,
            Some(learner) => match learner.send(lesson) {
                Ok(()) => return,
                Err(lesson) => {
                    tracing::error!("the learning thread is gone; learning inline");
                    self.learner = None;
                    lesson
                }
            },
        };
        self.teacher.learn(&mut self.history, &lesson);
    }

    fn active(&self) -> Result<Vec<ActiveJob>, HistoryError> {
        let mut active = self.history.active_jobs(&self.config.node)?;
        active.retain(|j| !self.unrecorded.iter().any(|u| u.job.row == j.row));
        Ok(active)
    }

    /// Writes the ends the history could not take before; those that still fail wait.
    fn record_unrecorded(&mut self) {
        if self.unrecorded.is_empty() {
            return;
        }
        let mut still = Vec::new();
        for u in std::mem::take(&mut self.unrecorded) {
            match self
                .history
                .record_finish(u.job.row, u.step_id, u.exit_status, true, &u.remaining, u.at)
            {
                Ok(()) => {
                    tracing::info!(job = u.job.job_id, "recorded the end the history could not take before");
                    self.teach(Lesson::Ended((&u.job).into()));
                }
                Err(_) => still.push(u),
            }
        }
        self.unrecorded = still;
    }

    /// The node's GPUs and their jobs as placement reads them (a job without a memory hint
    /// counts what its application's earlier runs were measured to use).
    fn gpu_states(&self, active: &[ActiveJob]) -> Result<Vec<GpuState>, HistoryError> {
        let mut states = Vec::with_capacity(self.gpus.len());
        for g in &self.gpus {
            let mut residents = Vec::new();
            for j in active.iter().filter(|j| j.gpu == g.index) {
                let mut r = j.resident();
                r.mem_mb = self.job_memory(r.mem_mb, &r.app)?;
                residents.push(r);
            }
            states.push(GpuState {
                index: g.index,
                model: g.model.clone(),
                memory_mb: g.memory_mb,
                residents,
            });
        }
        Ok(states)
    }

    /// The jobs this node gives back to Slurm now: those measured to deliver less beside their
    /// partners than taking turns would ([`crate::separate`]), each at most once. The history is
    /// only read; [`Self::separating`] marks one before Slurm is asked to requeue it. Nothing
    /// with `policy.separate_below` 0, and no query while no GPU is shared.
    pub fn separations(&mut self) -> Result<Vec<crate::placement::Separation>, HistoryError> {
        let below = self.config.policy.separate_below;
        if below <= 0.0 {
            return Ok(Vec::new());
        }
        let active = self.active()?;
        let shared = |j: &ActiveJob| active.iter().any(|o| o.gpu == j.gpu && o.row != j.row);
        if !active.iter().any(shared) {
            return Ok(Vec::new());
        }
        let states = self.gpu_states(&active)?;
        let estimates = self.history.estimates(&crate::placement::separation_wanted(&states))?;
        let spared = self.history.separated_jobs(&self.config.node, (self.clock)())?;
        Ok(crate::placement::separations(
            &states,
            &estimates,
            below,
            self.config.policy.unknown_pair_speed,
            |job| spared.contains(&job),
        ))
    }

    /// Marks `job_id` (running here) as being given back to Slurm, before the requeue: what its
    /// reports taught still counts, and it is not given back again on this node. Its row, for
    /// [`History::record_separation`] once Slurm answered; `None` if it no longer runs here.
    pub fn separating(&mut self, job_id: u32) -> Result<Option<i64>, HistoryError> {
        let Some(job) = self.active()?.into_iter().find(|j| j.job_id == job_id) else {
            return Ok(None);
        };
        self.history.mark_separating(job.row)?;
        Ok(Some(job.row))
    }

    /// [`Self::separating`] and its outcome at once: Slurm requeued `job_id` to run apart
    /// (`requeued`), or would not, and why.
    pub fn separated(&mut self, job_id: u32, requeued: bool, why: &str) -> Result<(), HistoryError> {
        if let Some(row) = self.separating(job_id)? {
            self.history.record_separation(row, requeued, why)?;
        }
        Ok(())
    }

    /// Whether `job_id` runs on this node (the daemon placed it and has not heard of its end).
    pub fn runs(&self, job_id: u32) -> Result<bool, HistoryError> {
        Ok(self.active()?.iter().any(|j| j.job_id == job_id))
    }

    /// How much memory each GPU model of this node has, MiB: what the claimer assumes of that
    /// model on every node.
    pub fn gpu_memory(&self) -> std::collections::HashMap<String, u64> {
        let mut memory = std::collections::HashMap::new();
        for g in &self.gpus {
            let m = memory.entry(g.model.clone()).or_insert(g.memory_mb);
            *m = (*m).min(g.memory_mb);
        }
        memory
    }

    /// What a job of `app` is assumed to need of a GPU's memory, MiB: its own `hint`, else what
    /// its application's earlier runs were measured to use (NVML), else nothing known.
    pub fn job_memory(&self, hint: Option<u64>, app: &str) -> Result<Option<u64>, HistoryError> {
        match hint {
            Some(m) => Ok(Some(m)),
            None => self.history.app_mem_peak(app),
        }
    }

    /// The placement knobs.
    pub fn knobs(&self) -> Knobs {
        Knobs {
            slots: self.config.jobs_per_gpu,
            unknown_pair_speed: self.config.policy.unknown_pair_speed,
            min_gain: self.config.policy.min_gain,
            share_queue: self.config.policy.share_queue,
            separate_below: self.config.policy.separate_below,
        }
    }

    /// Frees the slots of jobs that Slurm no longer runs on this node (their end was never
    /// reported: the daemon was down, or slurmstepd died). `running` is what Slurm says runs
    /// here; jobs placed less than `grace_s` ago are left alone. Returns the freed job ids.
    pub fn reconcile(
        &mut self,
        running: &std::collections::HashSet<u32>,
        grace_s: f64,
    ) -> Result<Vec<u32>, HistoryError> {
        let now = (self.clock)();
        let active = self.active()?;
        let mut gone = Vec::new();
        for job in &active {
            if running.contains(&job.job_id) || now - job.started_at < grace_s {
                continue;
            }
            // The GPU's other jobs, less those this loop already found gone.
            let remaining: Vec<i64> = active
                .iter()
                .filter(|o| o.gpu == job.gpu && o.row != job.row && !gone.contains(&o.job_id))
                .map(|o| o.row)
                .collect();
            self.history.record_gone(job.row, &remaining, now)?;
            tracing::warn!(
                job = job.job_id,
                gpu = job.gpu,
                app = %job.app,
                "Slurm no longer runs this job here and its end was never reported; its slot is free again"
            );
            gone.push(job.job_id);
        }
        Ok(gone)
    }

    /// What runs where.
    pub fn status(&self) -> Result<NodeStatus, HistoryError> {
        let active = self.active()?;
        Ok(NodeStatus {
            node: self.config.node.clone(),
            jobs_per_gpu: self.config.jobs_per_gpu,
            gpus: self
                .gpus
                .iter()
                .map(|g| GpuStatus {
                    index: g.index,
                    model: g.model.clone(),
                    memory_mb: g.memory_mb,
                    tasks: active
                        .iter()
                        .filter(|j| j.gpu == g.index)
                        .map(|j| TaskStatus {
                            job_id: j.job_id,
                            app: j.app.clone(),
                            uid: j.uid,
                            since_unix_s: j.started_at as i64,
                        })
                        .collect(),
                })
                .collect(),
        })
    }
}

/// The model of GPU `gpu` among `gpus` (the key of the pair history), "unknown" if none.
/// A function of the list rather than a method, so that it borrows only the list.
fn gpu_model(gpus: &[GpuSpec], gpu: u32) -> &str {
    gpus.iter()
        .find(|g| g.index == gpu)
        .map_or("unknown", |g| g.model.as_str())
}
