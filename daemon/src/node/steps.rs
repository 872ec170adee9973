//! The requests of a job's steps: start, finish and report. Each answers with what
//! happened, in the daemon's terms ([`Started`], [`RequestError`]); `crate::server` alone puts
//! that on the wire.

use super::{gpu_model, Node, UnrecordedEnd};
use crate::history::{ActiveJob, HistoryError, NewJob};
use crate::lessons::Lesson;
use crate::placement::{self, Estimates, Wanted};
use crate::put_back::OutOfMemory;
use multiplex_protocol::spec::Spec;
use multiplex_protocol::Claim;
use multiplex_protocol::{step_label, FinishRequest, Placement, ReportKind, ReportRequest, StartRequest};

/// How a started step came by its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The claimer pinned the job to this GPU before Slurm allocated it.
    Claimed,
    /// The claimer pinned the job to this node; Slurm chose the GPU (a job srun made).
    NodeClaimed,
    /// Slurm chose on its own (no claimer, or the gate's lease lapsed).
    Unclaimed,
    /// Another step of a job that already holds its GPU here.
    Joined,
}

/// What became of a start.
#[derive(Debug, Clone, PartialEq)]
pub enum Started {
    /// Recorded on its GPU: what its tasks should know.
    Placed { placement: Placement, bound: Bound },
    /// No GPU here could ever hold it (it needs more memory than the largest has).
    Refused { reason: String },
}

/// Why a request was not served.
#[derive(Debug)]
pub enum RequestError {
    /// The history failed: the daemon's fault, not the asker's.
    History(HistoryError),
    /// The request names another node.
    OtherNode { serves: String, asked: String },
    /// Slurm bound the job to no GPU of this node's shared pool.
    NoGpu {
        gres: Option<String>,
        allocated: Option<String>,
    },
    /// A report for a job not running here.
    NotRunning { job_id: u32, node: String },
    /// A report from a user not the job's.
    NotTheOwner { uid: u32, job_id: u32, owner: u32 },
    /// Progress that is not a finite number of at least 0.
    BadProgress { done: f64 },
}

impl From<HistoryError> for RequestError {
    fn from(e: HistoryError) -> Self {
        RequestError::History(e)
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestError::History(e) => write!(f, "{e}"),
            RequestError::OtherNode { serves, asked } => write!(f, "this multiplexd serves node {serves}, not {asked}"),
            RequestError::NoGpu { gres, allocated } => write!(
                f,
                "Slurm bound no GPU of this node's shared pool to this job (gres {}, allocated GPU {})",
                gres.as_deref().unwrap_or("unset"),
                allocated.as_deref().unwrap_or("unset")
            ),
            RequestError::NotRunning { job_id, node } => write!(f, "job {job_id} is not running on node {node}"),
            RequestError::NotTheOwner { uid, job_id, owner } => {
                write!(f, "uid {uid} may not report for job {job_id} of uid {owner}")
            }
            RequestError::BadProgress { done } => {
                write!(f, "progress must be a finite number of at least 0, not {done}")
            }
        }
    }
}

impl Node {
    /// A job step that started where Slurm put it (the GPU its shard is bound to): recorded
    /// there, where a claim made before Slurm allocated it meant it to run, or where Slurm
    /// chose on its own (no claimer, or its gate lapsed). A step of a job that already holds a
    /// GPU here joins it; telling the same step twice gives the same answer. A job that no GPU
    /// here could ever hold (it needs more memory than the largest has) is refused.
    pub fn start(&mut self, req: &StartRequest) -> Result<Started, RequestError> {
        self.history.request_seen();
        self.record_unrecorded();
        if req.node != self.config.node {
            return Err(RequestError::OtherNode {
                serves: self.config.node.clone(),
                asked: req.node.clone(),
            });
        }
        let now = (self.clock)();
        let active = self.active()?;
        if let Some(job) = active.iter().find(|j| j.job_id == req.job_id) {
            return self.join(req, job, &active, now);
        }
        let largest = self.gpus.iter().map(|g| g.memory_mb).max().unwrap_or(0);
        if let Some(need) = req.mem_mb.filter(|&m| !self.gpus.is_empty() && m > largest) {
            let reason = format!("it needs {need} MiB of GPU memory and the largest GPU here has {largest} MiB");
            tracing::info!(job = req.job_id, %reason, "refused");
            return Ok(Started::Refused { reason });
        }
        let Some(gpu) = self.bound_gpu(req) else {
            return Err(RequestError::NoGpu {
                gres: req.slurm_gres.clone(),
                allocated: req.slurm_job_gpus.clone(),
            });
        };
        self.place(req, &active, gpu, now)
    }

    /// Another step of a job that holds its GPU here: it joins the job there.
    fn join(
        &mut self,
        req: &StartRequest,
        job: &ActiveJob,
        active: &[ActiveJob],
        now: f64,
    ) -> Result<Started, RequestError> {
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
        // Only the MPS limit reads the history here.
        let estimates = if self.config.mps {
            self.estimates_beside(gpu_model(&self.gpus, job.gpu), &job.app, &partners)?
        } else {
            Estimates::default()
        };
        let placement = self.placement(
            job.gpu,
            &job.app,
            &partners,
            &estimates,
            job.predicted_speed,
            reason,
            job.mem_mb,
        );
        Ok(Started::Placed {
            placement,
            bound: Bound::Joined,
        })
    }

    /// A new job on `gpu`, where Slurm bound it: recorded there, with how it came by the GPU
    /// and how fast it is predicted to run beside the jobs there.
    fn place(&mut self, req: &StartRequest, active: &[ActiveJob], gpu: u32, now: f64) -> Result<Started, RequestError> {
        let g = self.gpus.iter().find(|g| g.index == gpu).expect("a GPU of the pool");
        let kind = multiplex_protocol::gres::gpu_type(&g.model, gpu);
        let model = g.model.clone();
        let prior = self.config.policy.unknown_pair_speed;
        let residents: Vec<&ActiveJob> = active.iter().filter(|j| j.gpu == gpu).collect();
        // One snapshot of the history for the whole start: the prediction, and the MPS limit.
        let estimates = self.estimates_beside(&model, &req.app, &residents)?;
        let mut predicted_speed = 1.0;
        let mut beside = Vec::new();
        for p in &residents {
            let (speed, _, why) = placement::estimate(&estimates, &model, &req.app, &p.app, prior);
            predicted_speed *= speed;
            beside.push(format!("beside {} (job {}): {why}", p.app, p.job_id));
        }
        let (bound, claimed_speed) = bound(req, &kind, &residents);
        let mut reason = match bound {
            Bound::Claimed => format!("GPU {gpu} ({kind}), claimed for it before Slurm allocated it"),
            Bound::NodeClaimed => {
                format!("GPU {gpu} ({kind}), Slurm's choice on a node claimed for it (srun made the job)")
            }
            _ => format!("GPU {gpu}, where Slurm bound it on its own choice (not claimed)"),
        };
        if beside.is_empty() {
            reason.push_str(": alone");
        } else {
            reason.push_str(&format!(": {}", beside.join(", ")));
        }
        let predicted_speed = claimed_speed.unwrap_or(predicted_speed);
        let placement = self.commit(req, active, gpu, &model, &estimates, predicted_speed, reason, now)?;
        Ok(Started::Placed { placement, bound })
    }

    /// The GPU of this node's pool that Slurm bound the job to: the one its gres names by type
    /// (a claim's), else the GPU of its allocation's detail.
    fn bound_gpu(&self, req: &StartRequest) -> Option<u32> {
        let typed = req
            .slurm_gres
            .as_deref()
            .and_then(multiplex_protocol::gres::type_of)
            .and_then(|kind| {
                self.gpus
                    .iter()
                    .find(|g| multiplex_protocol::gres::gpu_type(&g.model, g.index) == kind)
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
        estimates: &Estimates,
        predicted_speed: f64,
        reason: String,
        now: f64,
    ) -> Result<Placement, HistoryError> {
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
        Ok(self.placement(gpu, &req.app, &partners, estimates, predicted_speed, reason, req.mem_mb))
    }

    /// What the history knows of `app` beside each of `partners` on `model`, both ways.
    fn estimates_beside(&self, model: &str, app: &str, partners: &[&ActiveJob]) -> Result<Estimates, HistoryError> {
        let mut wanted = Wanted::default();
        for p in partners {
            wanted.pair(model, app, &p.app);
            wanted.pair(model, &p.app, app);
        }
        self.history.estimates(&wanted)
    }

    /// The answer for a step of `app` on `gpu` beside `partners`; with MPS, the step's thread
    /// limit from the predicted speeds (see [`placement::mps_share`]).
    #[allow(clippy::too_many_arguments)]
    fn placement(
        &self,
        gpu: u32,
        app: &str,
        partners: &[&ActiveJob],
        estimates: &Estimates,
        predicted_speed: f64,
        reason: String,
        mem_mb: Option<u64>,
    ) -> Placement {
        let (mps_thread_percentage, mps_mem_limit_mb) = if self.config.mps {
            let model = gpu_model(&self.gpus, gpu);
            let prior = self.config.policy.unknown_pair_speed;
            let theirs: Vec<f64> = partners
                .iter()
                .map(|p| placement::estimate(estimates, model, &p.app, app, prior).0)
                .collect();
            (Some(placement::mps_share(predicted_speed, &theirs)), mem_mb)
        } else {
            (None, None)
        };
        Placement {
            gpu,
            corunners: partners.iter().map(|p| p.job_id).collect(),
            predicted_speed,
            reason,
            mps_thread_percentage,
            mps_mem_limit_mb,
        }
    }

    /// Records a step's end. The step that was placed first releases the job's GPU slot,
    /// and the node learns from the job (on the learning thread if it runs: the answer comes
    /// once the end is committed).
    pub fn finish(&mut self, req: &FinishRequest) -> Result<(), RequestError> {
        if let Some(job) = self.finish_deferred(req)? {
            self.teach(Lesson::Ended((&job).into()));
        }
        Ok(())
    }

    /// [`Self::finish`] without the learning: the slot is free when this returns, and the
    /// job that released it (if any) must be handed to [`Self::learn_ended`] before anything
    /// else is asked of this node, so that it sees what it would have seen. Public for
    /// `multiplex-simulate`, which learns on a thread of its own while the other simulated
    /// nodes go on, and stays deterministic.
    pub fn finish_deferred(&mut self, req: &FinishRequest) -> Result<Option<ActiveJob>, RequestError> {
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
            return Ok(None);
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
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        }
        if releases {
            self.count_prediction_error(job);
        }
        tracing::info!(
            job = req.job_id,
            step = %step_label(req.step_id),
            exit_status = req.exit_status,
            releases,
            "finished"
        );
        Ok(releases.then(|| job.clone()))
    }

    /// How far off its prediction a job's run was, where its solo runtime is known (one query:
    /// only while an endpoint serves the metrics).
    fn count_prediction_error(&self, job: &ActiveJob) {
        if crate::metrics::served() {
            if let Ok(Some(observed)) = self.history.observed_speed(job.row) {
                crate::metrics::global()
                    .prediction_error
                    .observe((job.predicted_speed - observed).abs());
            }
        }
    }

    /// What follows a job's end, inline: learning from it, its application's measured memory,
    /// and now and then compacting the history (see [`Teacher::learn`]). The other half of
    /// [`Self::finish_deferred`].
    pub fn learn_ended(&mut self, job: &ActiveJob) {
        self.teacher.learn(&mut self.history, &Lesson::Ended(job.into()));
    }

    /// Records what a running job reports about itself. `uid` is the reporting peer's; unless
    /// `privileged`, it must be the job's own user.
    /// Returns what was recorded, in words, and for a job out of memory beside partners what
    /// putting it back in the queue needs ([`crate::put_back`], done outside the node's lock).
    pub fn report(
        &mut self,
        req: &ReportRequest,
        uid: u32,
        privileged: bool,
    ) -> Result<(String, Option<OutOfMemory>), RequestError> {
        self.history.request_seen();
        let Some((job, partners)) = self.history.running_job(&self.config.node, req.job_id)? else {
            return Err(RequestError::NotRunning {
                job_id: req.job_id,
                node: self.config.node.clone(),
            });
        };
        if !privileged && uid != job.uid {
            return Err(RequestError::NotTheOwner {
                uid,
                job_id: job.job_id,
                owner: job.uid,
            });
        }
        let now = (self.clock)();
        let prior = self.config.policy.unknown_pair_speed;
        match &req.kind {
            ReportKind::Progress { done } if done.is_finite() && *done >= 0.0 => {
                self.history
                    .record_report(job.row, "progress", Some(*done), &partners, prior, now)?;
                if !partners.is_empty() {
                    self.teach(Lesson::Progress((&job).into()));
                }
                Ok((format!("progress of job {} recorded: {done}", job.job_id), None))
            }
            ReportKind::Progress { done } => Err(RequestError::BadProgress { done: *done }),
            // One per run: a job's own user could otherwise repeat the report and have the
            // daemon ask slurmctld (as root) three times for each.
            ReportKind::OutOfMemory if self.history.reported_oom(job.row)? => Ok((
                format!("job {} ran out of memory: reported already, recorded once", job.job_id),
                None,
            )),
            ReportKind::OutOfMemory => {
                let names = self
                    .history
                    .record_report(job.row, "oom", None, &partners, prior, now)?;
                Ok(self.ran_out_of_memory(&job, names))
            }
        }
    }

    /// What follows from `job` running out of memory beside the applications `beside`
    /// (recorded): alone, nothing more; beside partners, putting it back in the queue.
    fn ran_out_of_memory(&self, job: &ActiveJob, beside: Vec<String>) -> (String, Option<OutOfMemory>) {
        tracing::warn!(job = job.job_id, app = %job.app, partners = ?beside, "job ran out of GPU memory");
        crate::metrics::global().oom_marks.inc();
        if beside.is_empty() {
            let said = format!(
                "job {} ran out of memory alone on GPU {}: recorded",
                job.job_id, job.gpu
            );
            return (said, None);
        }
        let said = format!(
            "job {} ({}) ran out of memory beside {}: this node will not pair them again",
            job.job_id,
            job.app,
            beside.join(", ")
        );
        let put_back = OutOfMemory {
            job_id: job.job_id,
            beside,
            node: self.config.node.clone(),
            gpu: job.gpu,
        };
        (said, Some(put_back))
    }
}

/// How a new job came by GPU `kind` here, and the speed its claim was made on where it runs
/// beside the partners it was claimed beside (where they changed since, the node's own
/// prediction stands). Slurm's books say whether the claim's GPU was allocated (the typed
/// shard it names); the claim, written by the claimer under the tag, says what it was made for.
fn bound(req: &StartRequest, kind: &str, residents: &[&ActiveJob]) -> (Bound, Option<f64>) {
    let claimed = req
        .slurm_gres
        .as_deref()
        .is_some_and(|g| g.contains(&format!(":{kind}:")));
    let claim = Claim::from_comment(req.admin_comment.as_deref())
        .and_then(Result::ok)
        .filter(|c| c.node == req.node);
    // A job srun made is claimed for its node only (`pin=node`): Slurm picks the GPU there.
    // Its tag is read only where that can be so.
    let node_claimed = !claimed
        && claim.as_ref().is_some_and(|c| c.gpu.is_none())
        && Spec::from_tag(req.admin_comment.as_deref())
            .and_then(Result::ok)
            .is_some_and(|s| s.node_only);
    let bound = match (claimed, node_claimed) {
        (true, _) => Bound::Claimed,
        (false, true) => Bound::NodeClaimed,
        (false, false) => return (Bound::Unclaimed, None),
    };
    let speed = claim.and_then(|c| {
        let mut now_beside: Vec<u32> = residents.iter().map(|p| p.job_id).collect();
        let mut then_beside = c.partners;
        now_beside.sort_unstable();
        then_beside.sort_unstable();
        (now_beside == then_beside).then_some(c.predicted_speed)
    });
    (bound, speed)
}
