//! What a policy and the simulated world exchange: the cluster's shape, the jobs as a policy
//! sees them, the policy's part, and what happened.

/// The cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub jobs_per_gpu: u32,
}

/// What a job that runs out of GPU memory beside a partner costs: which side dies, and when
/// its user submits it again. Its work so far is lost either way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Failures {
    /// How long after a failure its user submits the job again, seconds: a user finds a
    /// failed job when they look, not at once.
    pub resubmit_after_s: f64,
    /// Of pairs that do not fit, the share where the resident dies (it grows into the
    /// newcomer's memory, at an evaluation or a larger batch) and the newcomer runs on; the
    /// rest fail the newcomer as it starts. The table says which pairs do not fit, not which
    /// side grows: a seeded draw per pair made decides.
    pub resident_dies: f64,
}

impl Failures {
    /// As users pay for failures: resubmitted half an hour later, and a quarter of them
    /// killing the resident.
    pub const PRICED: Failures = Failures {
        resubmit_after_s: 1800.0,
        resident_dies: 0.25,
    };
    /// The newcomer always fails, and is back two minutes later (as an automatic requeue
    /// would bring it): the world before failures were priced.
    pub const QUICK: Failures = Failures {
        resubmit_after_s: 120.0,
        resident_dies: 0.0,
    };
}

/// Progress reports from the jobs, as a job that opts in sends them, and what their failures
/// cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Seconds between reports of one job; 0: jobs do not report.
    pub every_s: f64,
    /// Relative noise of each report (standard deviation, as a fraction of one interval's work).
    pub noise: f64,
    /// Seconds between rounds of GPU telemetry on every node, which give the daemon each
    /// running job's SM utilisation over the round as NVML would on a time-sliced GPU (its
    /// utilisation alone times its speed); 0: no GPU telemetry (the default: a simulated node
    /// has no NVML).
    pub busy_every_s: f64,
    /// Relative noise of each round's utilisation of a job (standard deviation).
    pub busy_noise: f64,
    /// The most by which a shared job's utilisation overstates its speed: each application
    /// draws a bias b between 0 and this, and shows `s + b (1 - s)` of its utilisation alone
    /// at speed s (alone, s = 1, unbiased).
    pub busy_bias: f64,
    pub failures: Failures,
}

/// The cluster as one look shows it: the GPUs whose jobs changed since the look before (at
/// the first look, every GPU), each with the jobs it holds now (running, or claimed and about
/// to start), in GPU order (`node * gpus_per_node + gpu`), and how many jobs wait for a
/// claim in all (the look lists the first of them). A claimer keeps what it saw.
#[derive(Debug, Clone, Copy)]
pub struct Cluster<'a> {
    pub changed: &'a [(usize, Vec<JobRef>)],
    pub waiting: usize,
}

/// A job as a policy sees it: its id (as Slurm would number it) and application.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobRef {
    pub id: u32,
    pub app: usize,
    /// The daemon put it back in the queue after it ran out of memory beside a partner, of
    /// this application: its admin comment says so, and the claimer claims it only alone or
    /// beside a known fit.
    pub put_back: Option<usize>,
}

/// A policy: Slurm's own GPU choice, or the claimer and the node daemons.
pub trait Policy {
    /// Jobs per GPU Slurm may put on one GPU under this policy.
    fn slots(&self, shape: &Shape) -> u32 {
        shape.jobs_per_gpu
    }
    /// Slurm's own placement: a GPU of `node` for `job` (`gpus[g]`: the jobs on GPU g), of
    /// those with a free slot (Slurm offers the node only when it has one).
    fn place(&mut self, _now: f64, _node: usize, _job: JobRef, _gpus: &[Vec<JobRef>]) -> Result<usize, String> {
        Err("this policy claims jobs; Slurm places none".into())
    }
    /// Whether the policy claims jobs before Slurm allocates them: every job then waits, out
    /// of Slurm's own placement, until [`Policy::claim`] pins it to a GPU of a node.
    fn claims(&self) -> bool {
        false
    }
    /// When a look would decide otherwise though nothing else changed (a pair's trial ends):
    /// the world looks again then, as the daemon's claimer, which looks every second, would.
    fn look_again(&self) -> Option<f64> {
        None
    }
    /// How many of the first pending jobs in Slurm's order a look weighs ([`Policy::claim`]).
    fn claim_lookahead(&self) -> usize {
        0
    }
    /// One look at the cluster: what changed on its GPUs since the last look ([`Cluster`]),
    /// `pending` the first jobs waiting, in Slurm's order. Answers the claims made: (index
    /// into `pending`, node, GPU), in the order they were made.
    fn claim(
        &mut self,
        _now: f64,
        _cluster: &Cluster,
        _pending: &[JobRef],
    ) -> Result<Vec<(usize, usize, usize)>, String> {
        Ok(Vec::new())
    }
    /// Whether a job out of GPU memory beside a partner is put back in the queue at once (the
    /// node's daemon does it: `multiplexd::put_back`), not left failed for its user to find.
    fn puts_back(&self) -> bool {
        false
    }
    /// Slurm started `job` on GPU `gpu` of `node` (pinned there by a claim, or placed by
    /// Slurm): its step tells the node's daemon.
    fn started(&mut self, _now: f64, _node: usize, _job: JobRef, _gpu: usize) -> Result<(), String> {
        Ok(())
    }
    /// A running job reports its progress (in its own unit, from its start).
    fn progress(&mut self, _now: f64, _node: usize, _job: JobRef, _done: f64) -> Result<(), String> {
        Ok(())
    }
    /// A round of GPU telemetry of `node`: each running job's GPU and its SM utilisation over
    /// the round, percent.
    fn telemetry(&mut self, _now: f64, _node: usize, _jobs: &[(usize, JobRef, u32)]) -> Result<(), String> {
        Ok(())
    }
    /// A job ran out of GPU memory beside its partners (it reports so, then ends).
    fn out_of_memory(&mut self, _now: f64, _node: usize, _job: JobRef) -> Result<(), String> {
        Ok(())
    }
    /// After a report of a job on `node`: the ids of the running jobs there the policy gives
    /// back to Slurm (requeued, to run apart from partners they lose beside).
    fn separations(&mut self, _now: f64, _node: usize) -> Result<Vec<u32>, String> {
        Ok(Vec::new())
    }
    /// A job ended: completed (`ok`) or failed.
    fn finished(&mut self, now: f64, node: usize, job: JobRef, ok: bool) -> Result<(), String>;
    /// After the run: finishes what the policy left in flight; an error there fails the run.
    fn settle(&mut self) -> Result<(), String> {
        Ok(())
    }
    /// After the run, a line on what the policy learned, graded against the table.
    fn grade(&self) -> Option<String> {
        None
    }
    /// After the run, what the policy learned as `multiplexd export` writes it, its nodes'
    /// histories merged (learned policy only).
    fn history(&mut self) -> Option<Result<multiplexd::history::Export, String>> {
        None
    }
}

/// What happened to every job, and the counters.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Per job, in trace order: (submit, start of the run that completed, completion).
    pub jobs: Vec<(f64, f64, f64)>,
    /// Failures users saw: runs that died out of GPU memory beside a partner and were not
    /// put back.
    pub oom_failures: u64,
    /// Of those, how many killed a job that ran first (the resident), and the work every
    /// failed run (put back or not) had done and lost, seconds of work alone.
    pub resident_failures: u64,
    pub lost_work_s: f64,
    /// Runs out of memory beside a partner that the daemon put back in the queue
    /// ([`Policy::puts_back`]): failures no user saw.
    pub put_back: u64,
    /// How many running jobs a policy gave back to Slurm to run apart ([`Policy::separations`]).
    pub separations: u64,
    /// How many claims a policy made ([`Policy::claim`]), each one `scontrol update` of a
    /// pending job.
    pub claims: u64,
    /// Integral of the summed speeds of the jobs on each GPU over time, and of busy time.
    pub speed_seconds: f64,
    pub busy_seconds: f64,
}
