//! One node's daemon state: its shared GPUs, its history, and the answers to start, finish,
//! report and status requests. The server calls this; tests call it directly. Where the
//! daemon is the cluster's claimer, [`Node::claims`] scores its looks over this history.

use crate::config::{Config, GpuSpec};
use crate::history::{ActiveJob, History, HistoryError, NewJob};
use crate::lessons::{Learner, Lesson, Teacher};
use crate::placement::{self, Bypasses, GpuState, Knobs, Wanted};
use multiplex_protocol::spec::Spec;
use multiplex_protocol::{
    step_label, FinishRequest, GpuStatus, NodeStatus, Placement, ReportKind, ReportRequest, Response, StartRequest,
    TaskStatus,
};

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

/// How full the node's shared GPUs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeLoad {
    /// Slots taken and slots in all on the node's shared GPUs.
    pub used: u32,
    pub total: u32,
    /// Shared GPUs with no job.
    pub empty_gpus: u32,
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

    /// How full the node's shared GPUs are.
    pub fn load(&self) -> Result<NodeLoad, HistoryError> {
        let busy = self.history.active_per_gpu(&self.config.node)?;
        let empty_gpus = self
            .gpus
            .iter()
            .filter(|g| !busy.iter().any(|&(gpu, _)| gpu == g.index))
            .count();
        Ok(NodeLoad {
            used: busy.iter().map(|&(_, jobs)| jobs).sum(),
            total: self.gpus.len() as u32 * self.config.jobs_per_gpu,
            empty_gpus: empty_gpus as u32,
        })
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
                if r.mem_mb.is_none() {
                    r.mem_mb = self.history.app_mem_peak(&j.app)?;
                }
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
    pub fn separations(&mut self) -> Result<Vec<crate::separate::Separation>, HistoryError> {
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
        let estimates = self.history.estimates(&crate::separate::wanted(&states))?;
        let spared = self.history.separated_jobs(&self.config.node, (self.clock)())?;
        Ok(crate::separate::separations(
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

    /// The claims of one look at the cluster ([`crate::claim::choose`]) over this daemon's
    /// history: `nodes` and `pending` as Slurm's books show them; a resident or a pending job
    /// without a memory hint counts what its application's earlier runs were measured to use.
    /// `bypasses` is the claimer's own count of passed-over jobs.
    pub fn claims(
        &self,
        nodes: &[crate::claim::NodeGpus],
        pending: &[crate::claim::Candidate],
        bypasses: &mut Bypasses,
    ) -> Result<Vec<crate::claim::Choice>, HistoryError> {
        let mut nodes = nodes.to_vec();
        for gpu in nodes.iter_mut().flat_map(|n| n.gpus.iter_mut()) {
            for r in gpu.residents.iter_mut().filter(|r| r.mem_mb.is_none()) {
                r.mem_mb = self.history.app_mem_peak(&r.app)?;
            }
        }
        let mut pending = pending.to_vec();
        for p in pending.iter_mut().filter(|p| p.mem_mb.is_none()) {
            p.mem_mb = self.history.app_mem_peak(&p.app)?;
        }
        let knobs = self.knobs();
        let estimates = self
            .history
            .estimates(&crate::claim::wanted(&nodes, &pending, knobs.slots))?;
        Ok(crate::claim::choose(&nodes, &pending, &estimates, knobs, bypasses))
    }

    /// The placement knobs.
    fn knobs(&self) -> Knobs {
        Knobs {
            slots: self.config.jobs_per_gpu,
            unknown_pair_speed: self.config.policy.unknown_pair_speed,
            min_gain: self.config.policy.min_gain,
            separate_below: self.config.policy.separate_below,
        }
    }

    /// A job step that started where Slurm put it (the GPU its shard is bound to): recorded
    /// there, where a claim made before Slurm allocated it meant it to run, or where Slurm
    /// chose on its own (no claimer, or its gate lapsed). A step of a job that already holds a
    /// GPU here joins it; telling the same step twice gives the same answer. A job that no GPU
    /// here could ever hold (it needs more memory than the largest has) is refused.
    pub fn start(&mut self, req: &StartRequest) -> Result<Response, HistoryError> {
        self.history.request_seen();
        self.record_unrecorded();
        if req.node != self.config.node {
            return Ok(Response::Error {
                message: format!("this multiplexd serves node {}, not {}", self.config.node, req.node),
            });
        }
        let now = (self.clock)();
        let active = self.active()?;
        if let Some(job) = active.iter().find(|j| j.job_id == req.job_id) {
            self.history.record_step(job.row, req.step_id, now)?;
            let partners: Vec<&ActiveJob> = active
                .iter()
                .filter(|o| o.gpu == job.gpu && o.job_id != job.job_id)
                .collect();
            let reason = if req.step_id == job.owner_step {
                job.decision.clone()
            } else {
                format!(
                    "step {} joins GPU {} held by its job: {}",
                    req.step_id, job.gpu, job.decision
                )
            };
            return Ok(Response::Started(self.placement(
                job.gpu,
                &job.app,
                &partners,
                job.predicted_speed,
                reason,
                job.mem_mb,
            )?));
        }
        let largest = self.gpus.iter().map(|g| g.memory_mb).max().unwrap_or(0);
        if let Some(need) = req.mem_mb.filter(|&m| !self.gpus.is_empty() && m > largest) {
            let reason = format!("it needs {need} MiB of GPU memory and the largest GPU here has {largest} MiB");
            tracing::info!(job = req.job_id, %reason, "refused");
            return Ok(Response::Refused { reason });
        }
        let Some(gpu) = self.bound_gpu(req) else {
            return Ok(Response::Error {
                message: format!(
                    "Slurm bound no GPU of this node's shared pool to this job (gres {}, allocated GPU {})",
                    req.slurm_gres.as_deref().unwrap_or("unset"),
                    req.slurm_job_gpus.as_deref().unwrap_or("unset")
                ),
            });
        };
        let g = self.gpus.iter().find(|g| g.index == gpu).expect("a GPU of the pool");
        let kind = crate::claimer::gres_type(&g.model, gpu);
        let model = g.model.clone();
        let prior = self.config.policy.unknown_pair_speed;
        let residents: Vec<&ActiveJob> = active.iter().filter(|j| j.gpu == gpu).collect();
        let mut wanted = Wanted::default();
        for p in &residents {
            wanted.pair(&model, &req.app, &p.app);
        }
        let estimates = self.history.estimates(&wanted)?;
        let mut predicted_speed = 1.0;
        let mut beside = Vec::new();
        for p in &residents {
            let (speed, _, why) = placement::estimate(&estimates, &model, &req.app, &p.app, prior);
            predicted_speed *= speed;
            beside.push(format!("beside {} (job {}): {why}", p.app, p.job_id));
        }
        let claimed = req
            .slurm_gres
            .as_deref()
            .is_some_and(|g| g.contains(&format!(":{kind}:")));
        // A job srun made is claimed for its node only (`pin=node`): Slurm picks the GPU there.
        let node_claimed = !claimed
            && req.admin_comment.as_deref().is_some_and(|c| {
                Spec::from_tag(Some(c))
                    .and_then(Result::ok)
                    .is_some_and(|s| s.node_only)
                    && c.contains(&format!("{}claimed for {} ", multiplex_protocol::spec::NOTE, req.node))
            });
        let mut reason = if claimed {
            format!("GPU {gpu} ({kind}), claimed for it before Slurm allocated it")
        } else if node_claimed {
            format!("GPU {gpu} ({kind}), Slurm's choice on a node claimed for it (srun made the job)")
        } else {
            format!("GPU {gpu}, where Slurm bound it on its own choice (not claimed)")
        };
        if beside.is_empty() {
            reason.push_str(": alone");
        } else {
            reason.push_str(&format!(": {}", beside.join(", ")));
        }
        self.commit(req, &active, gpu, &model, predicted_speed, reason, now)
    }

    /// The GPU of this node's pool that Slurm bound the job to: the one its gres names by type
    /// (a claim's), else the GPU of its allocation's detail.
    fn bound_gpu(&self, req: &StartRequest) -> Option<u32> {
        let typed = req
            .slurm_gres
            .as_deref()
            .and_then(crate::slurm::gres_type)
            .and_then(|kind| {
                self.gpus
                    .iter()
                    .find(|g| crate::claimer::gres_type(&g.model, g.index) == kind)
                    .map(|g| g.index)
            });
        typed.or_else(|| {
            req.slurm_job_gpus
                .as_deref()?
                .split(',')
                .next()?
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|g| self.gpus.iter().any(|s| s.index == *g))
        })
    }

    /// Records a new job on `gpu` beside the jobs active there and answers with its placement.
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        req: &StartRequest,
        active: &[ActiveJob],
        gpu: u32,
        model: &str,
        predicted_speed: f64,
        reason: String,
        now: f64,
    ) -> Result<Response, HistoryError> {
        let residents: Vec<i64> = active.iter().filter(|j| j.gpu == gpu).map(|j| j.row).collect();
        self.history.record_placement(
            &NewJob {
                job_id: req.job_id,
                node: &self.config.node,
                uid: req.uid,
                app: &req.app,
                gpu,
                gpu_model: model,
                mem_mb: req.mem_mb,
                owner_step: req.step_id,
                slurm_gpus: req.slurm_job_gpus.as_deref(),
                decision: &reason,
                predicted_speed,
                now,
            },
            &residents,
        )?;
        tracing::info!(job = req.job_id, step = %step_label(req.step_id), app = %req.app, gpu, %reason, "started");
        let partners: Vec<&ActiveJob> = active.iter().filter(|j| j.gpu == gpu).collect();
        Ok(Response::Started(self.placement(
            gpu,
            &req.app,
            &partners,
            predicted_speed,
            reason,
            req.mem_mb,
        )?))
    }

    /// The answer for a step of `app` on `gpu` beside `partners`; with MPS, the step's thread
    /// limit from the predicted speeds (see [`placement::mps_share`]).
    fn placement(
        &self,
        gpu: u32,
        app: &str,
        partners: &[&ActiveJob],
        predicted_speed: f64,
        reason: String,
        mem_mb: Option<u64>,
    ) -> Result<Placement, HistoryError> {
        let (mps_thread_percentage, mps_mem_limit_mb) = if self.config.mps {
            let model = gpu_model(&self.gpus, gpu);
            let prior = self.config.policy.unknown_pair_speed;
            let mut wanted = Wanted::default();
            for p in partners {
                wanted.pair(model, &p.app, app);
            }
            let estimates = self.history.estimates(&wanted)?;
            let theirs: Vec<f64> = partners
                .iter()
                .map(|p| placement::estimate(&estimates, model, &p.app, app, prior).0)
                .collect();
            (Some(placement::mps_share(predicted_speed, &theirs)), mem_mb)
        } else {
            (None, None)
        };
        Ok(Placement {
            gpu,
            corunners: partners.iter().map(|p| p.job_id).collect(),
            predicted_speed,
            reason,
            mps_thread_percentage,
            mps_mem_limit_mb,
        })
    }

    /// Records a step's end. The step that was placed first releases the job's GPU slot,
    /// and the node learns from the job (on the learning thread if it runs: the answer comes
    /// once the end is committed).
    pub fn finish(&mut self, req: &FinishRequest) -> Result<Response, HistoryError> {
        let (response, ended) = self.finish_deferred(req)?;
        if let Some(job) = ended {
            self.teach(Lesson::Ended((&job).into()));
        }
        Ok(response)
    }

    /// [`Self::finish`] without the learning: the slot is free when this returns, and the
    /// job that released it (if any) must be handed to [`Self::learn_ended`] before anything
    /// else is asked of this node, so that it sees what it would have seen. Public for
    /// `multiplex-simulate`, which learns on a thread of its own while the other simulated
    /// nodes go on, and stays deterministic.
    pub fn finish_deferred(&mut self, req: &FinishRequest) -> Result<(Response, Option<ActiveJob>), HistoryError> {
        self.finish_step(req)
    }

    fn finish_step(&mut self, req: &FinishRequest) -> Result<(Response, Option<ActiveJob>), HistoryError> {
        self.history.request_seen();
        self.record_unrecorded();
        let now = (self.clock)();
        let active = self.active()?;
        let Some(job) = active.iter().find(|j| j.job_id == req.job_id) else {
            tracing::info!(
                job = req.job_id,
                step = %step_label(req.step_id),
                "finish for a job not running here; ignored"
            );
            return Ok((Response::Finished, None));
        };
        let releases = req.step_id == job.owner_step;
        let remaining: Vec<i64> = active
            .iter()
            .filter(|o| o.gpu == job.gpu && o.row != job.row)
            .map(|o| o.row)
            .collect();
        match self
            .history
            .record_finish(job.row, req.step_id, req.exit_status, releases, &remaining, now)
        {
            Ok(()) => {}
            // The job has ended whatever the disk says: its slot is free now, its end is
            // written once the history takes writes again.
            Err(e) if releases && e.is_write_refused() => {
                tracing::warn!(
                    job = req.job_id,
                    "the history cannot record this job's end now ({e}); its slot is free, and the end is written once it can be"
                );
                self.unrecorded.push(UnrecordedEnd {
                    job: job.clone(),
                    step_id: req.step_id,
                    exit_status: req.exit_status,
                    remaining,
                    at: now,
                });
                return Ok((Response::Finished, None));
            }
            Err(e) => return Err(e),
        }
        if releases {
            // How far off its prediction the job's run was, where its solo runtime is known
            // (one query: only while an endpoint serves the metrics).
            if crate::metrics::served() {
                if let Ok(Some(observed)) = self.history.observed_speed(job.row) {
                    crate::metrics::global()
                        .prediction_error
                        .observe((job.predicted_speed - observed).abs());
                }
            }
        }
        tracing::info!(
            job = req.job_id,
            step = %step_label(req.step_id),
            exit_status = req.exit_status,
            releases,
            "finished"
        );
        Ok((Response::Finished, releases.then(|| job.clone())))
    }

    /// What follows a job's end, inline: learning from it, its application's measured memory,
    /// and now and then compacting the history (see [`Teacher::learn`]). The other half of
    /// [`Self::finish_deferred`].
    pub fn learn_ended(&mut self, job: &ActiveJob) {
        self.teacher.learn(&mut self.history, &Lesson::Ended(job.into()));
    }

    /// Records what a running job reports about itself. `uid` is the reporting peer's; unless
    /// `privileged`, it must be the job's own user.
    pub fn report(&mut self, req: &ReportRequest, uid: u32, privileged: bool) -> Result<Response, HistoryError> {
        self.history.request_seen();
        let Some((job, partners)) = self.history.running_job(&self.config.node, req.job_id)? else {
            return Ok(Response::Error {
                message: format!("job {} is not running on node {}", req.job_id, self.config.node),
            });
        };
        if !privileged && uid != job.uid {
            return Ok(Response::Error {
                message: format!("uid {uid} may not report for job {} of uid {}", job.job_id, job.uid),
            });
        }
        let now = (self.clock)();
        let prior = self.config.policy.unknown_pair_speed;
        let message = match &req.kind {
            ReportKind::Progress { done } if done.is_finite() && *done >= 0.0 => {
                self.history
                    .record_report(job.row, "progress", Some(*done), &partners, prior, now)?;
                if !partners.is_empty() {
                    self.teach(Lesson::Progress((&job).into()));
                }
                format!("progress of job {} recorded: {done}", job.job_id)
            }
            ReportKind::Progress { done } => {
                return Ok(Response::Error {
                    message: format!("progress must be a finite number of at least 0, not {done}"),
                })
            }
            ReportKind::OutOfMemory => {
                let names = self
                    .history
                    .record_report(job.row, "oom", None, &partners, prior, now)?;
                tracing::warn!(job = job.job_id, app = %job.app, partners = ?names, "job ran out of GPU memory");
                crate::metrics::global().oom_marks.inc();
                if names.is_empty() {
                    format!(
                        "job {} ran out of memory alone on GPU {}: recorded",
                        job.job_id, job.gpu
                    )
                } else {
                    format!(
                        "job {} ({}) ran out of memory beside {}: this node will not pair them again",
                        job.job_id,
                        job.app,
                        names.join(", ")
                    )
                }
            }
        };
        Ok(Response::Reported { message })
    }

    /// Records one round of GPU telemetry: each process on a shared GPU is mapped to the
    /// Slurm job it claims and the uid it runs as by `job_of(pid)`; the jobs running here get
    /// the memory and SM utilisation of their processes that run as their user added up.
    /// Processes of other jobs (or none), and processes of another user claiming a job, are
    /// ignored. Where MPS is off, each job's busy GPU time is counted too
    /// ([`crate::config::DEFAULT_BUSY_RECORD_S`]).
    pub fn record_telemetry(
        &mut self,
        samples: &[crate::gpus::GpuSample],
        job_of: &dyn Fn(u32) -> Option<(u32, u32)>,
    ) -> Result<(), HistoryError> {
        let now = (self.clock)();
        let active = self.active()?;
        let mut per_job: std::collections::BTreeMap<i64, (Option<u64>, Option<u32>)> = Default::default();
        for gpu in samples {
            for p in &gpu.processes {
                let Some(job) =
                    job_of(p.pid).and_then(|(id, uid)| active.iter().find(|j| j.job_id == id && j.uid == uid))
                else {
                    continue;
                };
                let e = per_job.entry(job.row).or_default();
                if let Some(m) = p.mem_mb {
                    e.0 = Some(e.0.unwrap_or(0) + m);
                }
                if let Some(u) = p.sm_util_pct {
                    e.1 = Some(e.1.unwrap_or(0) + u);
                }
            }
        }
        for (&row, &(mem, util)) in &per_job {
            self.history.record_job_sample(row, mem, util)?;
        }
        // Under MPS the jobs of a GPU run at once, and a job's SM utilisation no longer tells
        // its share of the GPU's time.
        if !self.config.mps && self.config.busy_record_s > 0 {
            let util = |row: i64| per_job.get(&row).and_then(|e| e.1);
            self.count_busy(&active, &util, now)?;
        }
        self.last_round = Some(now);
        Ok(())
    }

    /// Brings each running job's busy GPU time up to `now` (`util(row)`: its SM utilisation in
    /// this round, percent) and records it every `busy_record_s`. A job's count begins at the
    /// first round that measures it: from its start if it started since the previous round,
    /// else from now (the daemon was not counting before, or its telemetry failed for longer
    /// than two records). A round that measures a counted job not at all counts it idle.
    fn count_busy(
        &mut self,
        active: &[ActiveJob],
        util: &dyn Fn(i64) -> Option<u32>,
        now: f64,
    ) -> Result<(), HistoryError> {
        self.busy.retain(|row, _| active.iter().any(|j| j.row == *row));
        let prior = self.config.policy.unknown_pair_speed;
        // Telemetry that failed for longer than two records knows nothing of the gap: the
        // count begins again rather than spread this round over it.
        let gap = 2.0 * self.config.busy_record_s as f64;
        for job in active {
            let pct = util(job.row);
            let count = match self.busy.get(&job.row).filter(|c| now - c.counted <= gap) {
                Some(&c) => c,
                None => {
                    if pct.is_none() {
                        continue;
                    }
                    let begun = match self.last_round {
                        Some(t) if job.started_at >= t => job.started_at.min(now),
                        _ => now,
                    };
                    self.history
                        .record_report(job.row, crate::history::BUSY, Some(0.0), &[], prior, begun)?;
                    BusyCount {
                        busy_s: 0.0,
                        counted: begun,
                        recorded: begun,
                    }
                }
            };
            let share = f64::from(pct.unwrap_or(0).min(100)) / 100.0;
            let mut count = BusyCount {
                busy_s: count.busy_s + share * (now - count.counted).max(0.0),
                counted: now,
                ..count
            };
            if now - count.recorded >= self.config.busy_record_s as f64 {
                let partners: Vec<i64> = active
                    .iter()
                    .filter(|o| o.gpu == job.gpu && o.row != job.row)
                    .map(|o| o.row)
                    .collect();
                self.history
                    .record_report(job.row, crate::history::BUSY, Some(count.busy_s), &partners, prior, now)?;
                count.recorded = now;
                if !partners.is_empty() {
                    self.teach(Lesson::Progress(job.into()));
                }
            }
            self.busy.insert(job.row, count);
        }
        Ok(())
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
