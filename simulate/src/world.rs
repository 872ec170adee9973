//! The simulated world: Slurm's part (a FIFO queue, before which a policy may raise a
//! pending job; node choice by the published `Weight`, then, as the shared partition's
//! `LLN=YES` does, the node with the fewest jobs, then index; requeue after a decline or a
//! failure) and reality's part (each job runs at the table's speed beside its current
//! partners; a newcomer beside a job it cannot share with fails with out-of-memory unless that
//! job leaves first). The policy only chooses a GPU on the node Slurm picked, declines, or
//! raises a pending job. A watchdog stops a run that would never end.

use super::input::{Rng, Table, TraceJob};
use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap};

/// How long a job declined by a policy that does not say waits before it is eligible again,
/// seconds (the daemon's default `decline_retry_s`).
pub const DECLINE_RETRY_S: f64 = 60.0;
/// How long after a node's state changed its new weight reaches Slurm: the daemon learns of a
/// job when its step starts on the node and publishes the weight through scontrol after that.
/// Until then Slurm places by the old one: a burst started in one pass sees none of them.
pub const WEIGHT_LAG_S: f64 = 2.0;
/// How long after Slurm starts a job on a node its daemon hears of it (the job's step asks it
/// where to run), as for [`WEIGHT_LAG_S`]: an anticipated deferral lasts this long.
pub const START_SEEN_S: f64 = WEIGHT_LAG_S;
/// How long a daemon waits to hear of an anticipated start that is not on its node (Slurm
/// started the job elsewhere, or not yet) before it takes the deferrals back all the same
/// (the daemon's `SEEN_WITHIN`).
pub const SEEN_WITHIN_S: f64 = 15.0;
/// How long a job that does not fit beside its partner runs before it fails.
pub const OOM_AFTER_S: f64 = 60.0;
/// How long a job that failed waits, requeued, before it is eligible again.
pub const OOM_REQUEUE_S: f64 = 120.0;

/// The cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub jobs_per_gpu: u32,
}

/// Progress reports from the jobs, as a job that opts in sends them.
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
}

/// A job as a policy sees it: its id (as Slurm would number it), application, and how many
/// times it was requeued so far (declines and failures: Slurm's restart count).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobRef {
    pub id: u32,
    pub app: usize,
    pub restarts: u32,
}

/// A policy's answer for a job on a node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    /// Run it on this GPU of the node.
    Gpu(usize),
    /// Requeue it to wait this long (`None`: the world's default, [`DECLINE_RETRY_S`]).
    Decline { retry_after_s: Option<f64> },
}

impl From<Option<usize>> for Choice {
    fn from(gpu: Option<usize>) -> Choice {
        gpu.map_or(Choice::Decline { retry_after_s: None }, Choice::Gpu)
    }
}

/// A policy's queue-level choice for a free slot of a node ([`Policy::steer`]): indices into
/// the pending jobs it was shown.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Steer {
    /// The job Slurm should start first, if not its own first.
    pub raise: Option<usize>,
    /// Jobs the node would decline now, deferred while still pending: not eligible again for
    /// [`DECLINE_RETRY_S`] (the daemon sets their `StartTime`), with no launch and no requeue.
    pub defer: Vec<usize>,
    /// The jobs the node would take now. When the job Slurm starts next (after the raise) is
    /// not one of them, a policy that [`Policy::closes`] closes the node to Slurm (the daemon
    /// reserves the node for [`DECLINE_RETRY_S`], renewed while that lasts) instead of having
    /// it offered the pending jobs one by one to decline each.
    pub take: Vec<usize>,
}

/// A policy: the node daemon's part.
pub trait Policy {
    /// Jobs per GPU Slurm may put on one GPU under this policy.
    fn slots(&self, shape: &Shape) -> u32 {
        shape.jobs_per_gpu
    }
    /// Chooses a GPU of `node` for `job` (`gpus[g]`: the jobs on GPU g), or declines.
    fn place(&mut self, now: f64, node: usize, job: JobRef, gpus: &[Vec<JobRef>]) -> Result<Choice, String>;
    /// How many of the first pending jobs in Slurm's priority order the policy chooses among
    /// when a slot of a node frees ([`Policy::steer`]); 0: it does not steer.
    fn lookahead(&self) -> usize {
        0
    }
    /// Whether the policy defers pending jobs it would decline ([`Steer::defer`]): then the
    /// steering sees, besides the jobs Slurm could start, those the node deferred.
    fn defers(&self) -> bool {
        false
    }
    /// Whether a node closes itself while it would decline the job Slurm starts next
    /// ([`Steer::take`]): then the steering also sees the jobs waiting out a decline, in
    /// Slurm's order.
    fn closes(&self) -> bool {
        false
    }
    /// How many of the jobs after the one Slurm starts next a node that [`Policy::closes`]
    /// and opens for it may defer, those it would decline once that job runs here or
    /// elsewhere ([`Policy::declines_after`]), until its daemon hears of the start
    /// ([`START_SEEN_S`]) or gives up waiting ([`SEEN_WITHIN_S`]); 0: none (`[steer]
    /// anticipate`).
    fn anticipates(&self) -> usize {
        0
    }
    /// Which of `later` (indices into `pending`, in the order Slurm offers them) the node would
    /// decline for now in the pass that starts `pending[next]`, whether it runs on this node or
    /// another, up to the first it would take.
    fn declines_after(
        &mut self,
        _now: f64,
        _node: usize,
        _gpus: &[Vec<JobRef>],
        _pending: &[JobRef],
        _next: usize,
        _later: &[usize],
    ) -> Result<Vec<usize>, String> {
        Ok(Vec::new())
    }
    /// Queue-level choice, as a daemon steers Slurm by raising a pending job's priority and
    /// deferring those it would decline: a slot of `node` (`gpus` as in `place`) freed or
    /// stayed free after a decline, and `pending` are the first jobs Slurm would start next,
    /// in its order. It reaches Slurm before its next pass (the daemon hears of a job's end
    /// from slurmstepd before slurmctld does, and of a decline before the job's requeue frees
    /// the slot); a raised job goes to whichever node Slurm picks.
    fn steer(&mut self, _now: f64, _node: usize, _gpus: &[Vec<JobRef>], _pending: &[JobRef]) -> Result<Steer, String> {
        Ok(Steer::default())
    }
    /// The node's Slurm `Weight` (lower is preferred; `gpus` as in `place`), read
    /// [`WEIGHT_LAG_S`] after each change; equal unless the policy publishes it.
    fn weight(&self, _node: usize, _gpus: &[Vec<JobRef>]) -> u32 {
        1
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
    pub oom_failures: u64,
    pub declines: u64,
    /// Per job in trace order: how many times it was declined.
    pub declines_per_job: Vec<u32>,
    /// How many times a policy had Slurm start another pending job first.
    pub steered: u64,
    /// How many times a policy deferred a pending job (a decline without a launch).
    pub deferred: u64,
    /// How many times a node closed itself to Slurm, or renewed a closure that lapsed (each is
    /// one `scontrol` call of its daemon).
    pub closures: u64,
    /// How many running jobs a policy gave back to Slurm to run apart ([`Policy::separations`]).
    pub separations: u64,
    /// Integral of the summed speeds of the jobs on each GPU over time, and of busy time.
    pub speed_seconds: f64,
    pub busy_seconds: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Arrive,
    Eligible,
    /// A deferral lapses: the node that set it looks again first (the daemon renews a
    /// deferral shortly before it lapses, if it still has a free slot and would still
    /// decline the job).
    Deferred,
    Complete(u32),
    OutOfMemory(u32),
    Report(u32),
    /// A round of GPU telemetry on every node (the event's job means nothing).
    Telemetry,
    /// A node's new weight reaches Slurm (the event's job is the one whose move changed it).
    Weight(usize),
    /// A node's closure lapses unless its daemon renews it (the node, and which closure).
    Closure(usize, u32),
    /// A node's daemon may hear of the start it anticipated ([`Policy::declines_after`]): if
    /// that job runs there, or the daemon waited [`SEEN_WITHIN_S`], it looks at the queue, then
    /// takes back the deferrals it set for that start (the node, and when it opened).
    Seen(usize, f64),
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Event {
    at: f64,
    seq: u64,
    job: usize,
    kind: Kind,
}

impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    // Earliest first out of the max-heap; ties in the order they were made.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Clone)]
struct Job {
    app: usize,
    work: f64,
    submit: f64,
    eligible: f64,
    /// The application's iterations per second alone (the unit of its progress reports).
    rate: f64,
    /// Current run: where, since when, work done by `last`, speed since `last`.
    at: Option<(usize, usize)>,
    start: f64,
    done: f64,
    last: f64,
    speed: f64,
    /// Work done at the latest round of GPU telemetry of this run, and when that was (its start
    /// before the first).
    counted: f64,
    counted_at: f64,
    /// Bumped whenever the completion time changes, and per run (stale events are skipped).
    epoch: u32,
    run: u32,
    doomed: bool,
    finished: Option<f64>,
    /// Requeues so far, and how many of them were declines.
    restarts: u32,
    declines: u32,
    /// A policy raised its priority: Slurm starts it before the FIFO queue.
    bumped: bool,
    /// The node whose policy deferred it, while the deferral lasts.
    deferred_by: Option<usize>,
}

#[derive(Debug, Clone, Default)]
struct Gpu {
    jobs: Vec<usize>,
    since: f64,
    speed_sum: f64,
}

struct World<'a> {
    table: &'a Table,
    shape: Shape,
    slots: u32,
    progress: Progress,
    noise: Rng,
    /// Each application's SM utilisation alone (0.5 to 1), how much its utilisation overstates
    /// its speed when shared ([`Progress::busy_bias`]), and the noise of telemetry.
    app_util: Vec<f64>,
    app_bias: Vec<f64>,
    busy_noise: Rng,
    jobs: Vec<Job>,
    gpus: Vec<Gpu>,
    used: Vec<u32>,
    /// Nodes with a free slot, by (published weight, jobs on it, index): Slurm's order.
    free: BTreeSet<(u32, u32, usize)>,
    weight: Vec<u32>,
    /// Whether a weight event is already due for the node.
    weight_due: Vec<bool>,
    /// The node's jobs when it was last filed in `free`.
    filed_used: Vec<u32>,
    /// Waiting jobs in FIFO order (trace order).
    queue: BTreeSet<usize>,
    /// Waiting jobs whose priority a policy raised, in the order it did: the latest first.
    bumped: Vec<usize>,
    lookahead: usize,
    defers: bool,
    /// Per node, the jobs its policy deferred (some may have lapsed or started since).
    deferrals: Vec<Vec<usize>>,
    closes: bool,
    /// How many jobs after the one a node opens for it may defer ([`Policy::anticipates`]).
    anticipates: usize,
    /// Per node, the jobs it deferred until it hears of a start ([`Kind::Seen`]).
    anticipated: Vec<Vec<usize>>,
    /// Per node: closed to Slurm, and how many closures it had (stale lapses are skipped).
    closed: Vec<bool>,
    closure: Vec<u32>,
    steered: u64,
    deferred: u64,
    closures: u64,
    separations: u64,
    events: BinaryHeap<Event>,
    seq: u64,
    oom_failures: u64,
    declines: u64,
    speed_seconds: f64,
    busy_seconds: f64,
}

/// Runs the trace through the world under `policy`. Deterministic for a seed.
pub fn run(
    table: &Table,
    trace: &[TraceJob],
    shape: Shape,
    progress: Progress,
    seed: u64,
    policy: &mut dyn Policy,
) -> Result<Outcome, String> {
    let slots = policy.slots(&shape);
    let mut rates = Rng::new(seed ^ 0x005e_ed0f_a995);
    // Each application's own iterations per second alone, between 0.5 and 20: the unit of its
    // reports, which the learned policy must find out for itself.
    let app_rate: Vec<f64> = (0..table.apps.len())
        .map(|_| 0.5 * 40f64.powf(rates.uniform()))
        .collect();
    let mut utils = Rng::new(seed ^ 0x0005_1111);
    let app_util: Vec<f64> = (0..table.apps.len()).map(|_| 0.5 + 0.5 * utils.uniform()).collect();
    let app_bias: Vec<f64> = (0..table.apps.len())
        .map(|_| progress.busy_bias * utils.uniform())
        .collect();
    let mut w = World {
        table,
        shape,
        slots,
        progress,
        noise: Rng::new(seed ^ 0x0bad_5eed),
        app_util,
        app_bias,
        busy_noise: Rng::new(seed ^ 0x00b5_ed00),
        jobs: trace
            .iter()
            .map(|t| Job {
                app: t.app,
                work: t.solo_runtime_s,
                submit: t.submit_s,
                eligible: t.submit_s,
                rate: app_rate[t.app],
                at: None,
                start: 0.0,
                done: 0.0,
                last: 0.0,
                speed: 0.0,
                counted: 0.0,
                counted_at: 0.0,
                epoch: 0,
                run: 0,
                doomed: false,
                finished: None,
                restarts: 0,
                declines: 0,
                bumped: false,
                deferred_by: None,
            })
            .collect(),
        gpus: vec![Gpu::default(); shape.nodes * shape.gpus_per_node],
        used: vec![0; shape.nodes],
        free: BTreeSet::new(),
        weight: vec![0; shape.nodes],
        weight_due: vec![false; shape.nodes],
        filed_used: vec![0; shape.nodes],
        queue: BTreeSet::new(),
        bumped: Vec::new(),
        lookahead: policy.lookahead(),
        defers: policy.lookahead() >= 2 && policy.defers(),
        deferrals: vec![Vec::new(); shape.nodes],
        closes: policy.lookahead() >= 1 && policy.closes(),
        anticipates: if policy.lookahead() >= 1 && policy.closes() {
            policy.anticipates()
        } else {
            0
        },
        anticipated: vec![Vec::new(); shape.nodes],
        closed: vec![false; shape.nodes],
        closure: vec![0; shape.nodes],
        steered: 0,
        deferred: 0,
        closures: 0,
        separations: 0,
        events: BinaryHeap::new(),
        seq: 0,
        oom_failures: 0,
        declines: 0,
        speed_seconds: 0.0,
        busy_seconds: 0.0,
    };
    for n in 0..shape.nodes {
        w.weight[n] = policy.weight(n, &w.view(n));
        w.free.insert((w.weight[n], 0, n));
    }
    for (j, t) in trace.iter().enumerate() {
        w.push(t.submit_s, j, Kind::Arrive);
    }
    if w.progress.busy_every_s > 0.0 {
        let first = trace.iter().map(|t| t.submit_s).fold(f64::INFINITY, f64::min);
        if first.is_finite() {
            w.push(first + w.progress.busy_every_s, 0, Kind::Telemetry);
        }
    }
    let mut watchdog = Watchdog::new(trace.len());
    while let Some(e) = w.events.pop() {
        let now = e.at;
        if let Some(stuck) = watchdog.tick(now, e.job) {
            return Err(stuck.describe(trace));
        }
        match e.kind {
            Kind::Arrive => {
                w.queue.insert(e.job);
            }
            Kind::Eligible => {
                // A job comes back from a wait (after a decline or a failure).
                w.look_open(now, policy)?;
            }
            Kind::Closure(node, closure) => {
                if w.closure[node] != closure || !w.closed[node] {
                    continue;
                }
                // It lapses; its daemon renews it if the node would still decline them all.
                w.open(node);
                w.steer(now, node, policy)?;
            }
            Kind::Deferred => {
                // Stale: started, taken back or renewed since.
                let job = &w.jobs[e.job];
                if let Some(node) = job.deferred_by.filter(|_| job.at.is_none() && job.eligible <= now) {
                    w.steer(now, node, policy)?;
                }
            }
            Kind::Seen(node, since) => {
                let here = w.jobs[e.job].at.is_some_and(|(n, _)| n == node);
                if !here && now < since + SEEN_WITHIN_S {
                    w.push(since + SEEN_WITHIN_S, e.job, Kind::Seen(node, since));
                    continue;
                }
                let lifting = std::mem::take(&mut w.anticipated[node]);
                w.steer(now, node, policy)?;
                for j in lifting {
                    if w.anticipated[node].contains(&j) {
                        continue; // deferred again, for the next start
                    }
                    let job = &mut w.jobs[j];
                    if job.at.is_none() && job.deferred_by == Some(node) {
                        job.deferred_by = None;
                        job.eligible = job.eligible.min(now);
                    }
                }
                // The jobs deferred for this start come back.
                w.look_open(now, policy)?;
            }
            Kind::Complete(epoch) => {
                let job = &w.jobs[e.job];
                if job.epoch != epoch || job.at.is_none() {
                    continue;
                }
                let (node, _) = w.leave(now, e.job);
                w.jobs[e.job].finished = Some(now);
                policy.finished(now, node, w.job_ref(e.job), true)?;
                w.reweigh(now, node, e.job);
                w.steer(now, node, policy)?;
            }
            Kind::OutOfMemory(run) => {
                let job = &w.jobs[e.job];
                // Stale: a later run, or the partners it could not share with left in time.
                if job.run != run || job.at.is_none() || !job.doomed {
                    continue;
                }
                let (node, _) = w.leave(now, e.job);
                w.oom_failures += 1;
                policy.out_of_memory(now, node, w.job_ref(e.job))?;
                policy.finished(now, node, w.job_ref(e.job), false)?;
                w.reweigh(now, node, e.job);
                w.requeue(now, e.job);
                w.steer(now, node, policy)?;
            }
            Kind::Report(run) => {
                let job = &w.jobs[e.job];
                let Some((node, _)) = job.at.filter(|_| job.run == run) else {
                    continue;
                };
                let (done, rate) = (job.done + job.speed * (now - job.last), job.rate);
                let noise = w.progress.noise * w.progress.every_s * w.noise.normal();
                let reported = (done + noise).max(0.0) * rate;
                policy.progress(now, node, w.job_ref(e.job), reported)?;
                w.push(now + w.progress.every_s, e.job, Kind::Report(run));
                if !w.give_back(now, node, policy)? {
                    continue; // nothing changed for Slurm
                }
            }
            Kind::Telemetry => {
                let mut changed = false;
                for node in 0..w.shape.nodes {
                    let round = w.telemetry_round(now, node);
                    if !round.is_empty() {
                        policy.telemetry(now, node, &round)?;
                        changed |= w.give_back(now, node, policy)?;
                    }
                }
                if w.jobs.iter().any(|j| j.finished.is_none()) {
                    w.push(now + w.progress.busy_every_s, 0, Kind::Telemetry);
                }
                if !changed {
                    continue; // nothing changed for Slurm
                }
            }
            Kind::Weight(node) => {
                w.weight_due[node] = false;
                let weight = policy.weight(node, &w.view(node));
                w.refile(node, weight);
            }
        }
        w.schedule(now, policy)?;
        // Slurm tries a new or requeued job at once; the daemons of closed nodes see the queue
        // as it is after that (jobs that arrived, came back or started elsewhere) and open if
        // they would take one of its first.
        if w.closes && w.closed.iter().any(|&c| c) {
            for node in 0..w.shape.nodes {
                if w.closed[node] {
                    w.steer(now, node, policy)?;
                }
            }
            w.schedule(now, policy)?;
        }
    }
    if let Some(j) = w.jobs.iter().position(|j| j.finished.is_none()) {
        return Err(format!(
            "job {} never finished (the policy declined it forever?)",
            trace[j].id
        ));
    }
    Ok(Outcome {
        jobs: w
            .jobs
            .iter()
            // A finished job's `start` is that of the run that completed.
            .map(|j| (j.submit, j.start, j.finished.unwrap_or(f64::NAN)))
            .collect(),
        oom_failures: w.oom_failures,
        declines: w.declines,
        declines_per_job: w.jobs.iter().map(|j| j.declines).collect(),
        steered: w.steered,
        deferred: w.deferred,
        closures: w.closures,
        separations: w.separations,
        speed_seconds: w.speed_seconds,
        busy_seconds: w.busy_seconds,
    })
}

/// Stops a run that would never end: every event the world processes is counted against a
/// budget proportional to the jobs, and events at one instant of simulated time against a
/// smaller one (the clock has stopped). Legitimate runs stay far below both: a job arrives,
/// starts, ends, and between those reports progress, is declined, or fails and is requeued,
/// each of which moves the clock on by at least a minute.
struct Watchdog {
    events: u64,
    budget: u64,
    at: f64,
    at_this_instant: u64,
    instant_budget: u64,
    /// The jobs of the latest events, to name the ones going round.
    recent: std::collections::VecDeque<usize>,
}

/// Why the watchdog stopped a run.
struct Stuck {
    at: f64,
    events: u64,
    clock_stopped: bool,
    jobs: Vec<usize>,
}

impl Watchdog {
    /// Events per job a run may process in all (the worst legitimate runs seen take a few
    /// hundred: 142 declines per job on a table where almost no pair gains), and at one
    /// instant; each on top of a fixed allowance for small traces.
    const EVENTS_PER_JOB: u64 = 20_000;
    const INSTANT_EVENTS_PER_JOB: u64 = 100;
    const RECENT: usize = 1_000;

    fn new(jobs: usize) -> Watchdog {
        let jobs = jobs.max(1) as u64;
        Watchdog {
            events: 0,
            budget: 1_000_000 + Self::EVENTS_PER_JOB.saturating_mul(jobs),
            at: f64::NEG_INFINITY,
            at_this_instant: 0,
            instant_budget: 10_000 + Self::INSTANT_EVENTS_PER_JOB.saturating_mul(jobs),
            recent: std::collections::VecDeque::with_capacity(Self::RECENT),
        }
    }

    fn tick(&mut self, now: f64, job: usize) -> Option<Stuck> {
        self.events += 1;
        if now > self.at {
            self.at = now;
            self.at_this_instant = 0;
        }
        self.at_this_instant += 1;
        if self.recent.len() == Self::RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(job);
        let clock_stopped = self.at_this_instant > self.instant_budget;
        if !clock_stopped && self.events <= self.budget && now.is_finite() {
            return None;
        }
        let mut counts: std::collections::BTreeMap<usize, usize> = Default::default();
        for &j in &self.recent {
            *counts.entry(j).or_default() += 1;
        }
        let mut jobs: Vec<(usize, usize)> = counts.into_iter().collect();
        jobs.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut jobs: Vec<usize> = jobs.into_iter().take(5).map(|(j, _)| j).collect();
        jobs.sort_unstable();
        Some(Stuck {
            at: now,
            events: self.events,
            clock_stopped,
            jobs,
        })
    }
}

impl Stuck {
    fn describe(&self, trace: &[TraceJob]) -> String {
        let why = if !self.at.is_finite() {
            "the simulated clock is no longer a finite number".to_string()
        } else if self.clock_stopped {
            "the simulated clock stopped advancing".to_string()
        } else {
            format!(
                "the run exceeded its budget of {} events per job",
                Watchdog::EVENTS_PER_JOB
            )
        };
        let ids: Vec<&str> = self.jobs.iter().map(|&j| trace[j].id.as_str()).collect();
        format!(
            "the simulation would not end: {why} (at simulated time {:.0} s, after {} events); the jobs going round: {}",
            self.at,
            self.events,
            ids.join(", ")
        )
    }
}

impl World<'_> {
    fn push(&mut self, at: f64, job: usize, kind: Kind) {
        self.seq += 1;
        self.events.push(Event {
            at,
            seq: self.seq,
            job,
            kind,
        });
    }

    fn job_ref(&self, j: usize) -> JobRef {
        JobRef {
            id: j as u32 + 1,
            app: self.jobs[j].app,
            restarts: self.jobs[j].restarts,
        }
    }

    /// The jobs on each GPU of `node`, as a policy sees them.
    fn view(&self, node: usize) -> Vec<Vec<JobRef>> {
        let g0 = node * self.shape.gpus_per_node;
        self.gpus[g0..g0 + self.shape.gpus_per_node]
            .iter()
            .map(|g| g.jobs.iter().map(|&o| self.job_ref(o)).collect())
            .collect()
    }

    fn capacity(&self) -> u32 {
        self.shape.gpus_per_node as u32 * self.slots
    }

    /// Slurm's part: start waiting, eligible jobs in priority order (those a policy raised,
    /// then FIFO) on the first node with a free slot in Slurm's order, until no node has one.
    /// Every job started at one instant is one scheduling pass: the weights are those
    /// published before it.
    fn schedule(&mut self, now: f64, policy: &mut dyn Policy) -> Result<(), String> {
        while let Some(&(_, _, node)) = self.free.iter().next() {
            let Some(&j) = self.pending(now, 1).first() else {
                break;
            };
            let view = self.view(node);
            match policy.place(now, node, self.job_ref(j), &view)? {
                Choice::Gpu(g) if g < self.shape.gpus_per_node && (view[g].len() as u32) < self.slots => {
                    self.queue.remove(&j);
                    self.unbump(j);
                    self.start(now, j, node, g);
                    self.reweigh(now, node, j);
                }
                Choice::Gpu(g) => {
                    return Err(format!(
                        "the policy chose GPU {g} of node {node}, which has no free slot"
                    ))
                }
                Choice::Decline { retry_after_s } => {
                    // The declining daemon takes back a raised priority: it was meant for
                    // one slot, and the job is requeued with its place in the queue.
                    self.unbump(j);
                    let job = &mut self.jobs[j];
                    let wait = retry_after_s.unwrap_or(DECLINE_RETRY_S).max(1.0);
                    job.restarts += 1;
                    job.declines += 1;
                    job.eligible = now + wait;
                    self.declines += 1;
                    // The declining daemon watches the job's wait as its own deferral.
                    let node_defers = self.defers && self.deferrals[node].len() < self.lookahead;
                    if node_defers {
                        self.deferrals[node].push(j);
                        self.jobs[j].deferred_by = Some(node);
                    }
                    self.push(now + wait, j, if node_defers { Kind::Deferred } else { Kind::Eligible });
                    // A decline may change what the node publishes.
                    self.reweigh(now, node, j);
                    self.steer(now, node, policy)?;
                }
            }
        }
        Ok(())
    }

    /// The first `k` jobs Slurm would start now, in its order: those a policy raised (the
    /// latest first), then the FIFO queue; only jobs eligible now.
    fn pending(&self, now: f64, k: usize) -> Vec<usize> {
        self.pending_for(now, k, None)
    }

    /// [`World::pending`], as the policy of `node` sees it: with the jobs it deferred.
    fn pending_for(&self, now: f64, k: usize, node: Option<usize>) -> Vec<usize> {
        let eligible = |j: &usize| {
            let job = &self.jobs[*j];
            job.eligible <= now || (node.is_some() && (self.closes || job.deferred_by == node))
        };
        let raised = self.bumped.iter().rev().copied().filter(eligible);
        let fifo = self
            .queue
            .iter()
            .copied()
            .filter(|j| !self.jobs[*j].bumped && eligible(j));
        raised.chain(fifo).take(k).collect()
    }

    /// Queue-level choice: a slot of `node` freed or stayed free; the policy may have Slurm
    /// start another of the first pending jobs first, and defer those the node would decline.
    fn steer(&mut self, now: f64, node: usize, policy: &mut dyn Policy) -> Result<(), String> {
        if self.lookahead < 1 || self.used[node] >= self.capacity() || (self.lookahead < 2 && !self.closes) {
            return Ok(());
        }
        let pending = self.pending_for(now, self.lookahead, (self.defers || self.closes).then_some(node));
        if pending.is_empty() {
            // Nothing to judge a newcomer by: the node is open.
            self.open(node);
            return Ok(());
        }
        let refs: Vec<JobRef> = pending.iter().map(|&j| self.job_ref(j)).collect();
        let steer = policy.steer(now, node, &self.view(node), &refs)?;
        // Only a job Slurm could start now is raised.
        if let Some(i) = steer.raise.filter(|&i| i > 0) {
            let Some(&j) = pending.get(i) else {
                return Err(format!("the policy steered pending job {i} of {}", pending.len()));
            };
            if self.jobs[j].eligible <= now {
                self.steered += 1;
                self.bump(j);
            }
        }
        // Open only while the node would take the job Slurm starts next (after the raise);
        // with none eligible now, the first waiting out a decline that it does not defer again.
        let mut opened_for = None;
        if self.closes {
            let head = self.pending(now, 1).first().copied().or_else(|| {
                (0..pending.len())
                    .find(|i| !steer.defer.contains(i))
                    .map(|i| pending[i])
            });
            let close = !head.is_some_and(|h| steer.take.iter().any(|&i| pending.get(i) == Some(&h)));
            if !close {
                opened_for = head.filter(|&h| self.jobs[h].eligible <= now);
            }
            if close && !self.closed[node] {
                self.closed[node] = true;
                self.closure[node] += 1;
                self.closures += 1;
                self.refile(node, self.weight[node]);
                self.push(
                    now + DECLINE_RETRY_S,
                    pending[0],
                    Kind::Closure(node, self.closure[node]),
                );
            } else if !close {
                self.open(node);
            }
        }
        // A deferral holds the job back from every node: only a node among those Slurm offers
        // jobs to first (the lightest weight among those with a free slot) defers one, or
        // renews its deferral; and at most `lookahead` at a time.
        let first = self.free.iter().next().map(|&(w, _, _)| w) == Some(self.weight[node]);
        let jobs = &self.jobs;
        self.deferrals[node].retain(|&j| jobs[j].deferred_by == Some(node) && jobs[j].eligible > now);
        for &i in steer.defer.iter().filter(|_| first) {
            let Some(&j) = pending.get(i).filter(|_| steer.raise != Some(i)) else {
                return Err(format!("the policy deferred pending job {i} of {}", pending.len()));
            };
            if self.jobs[j].deferred_by == Some(node) && self.jobs[j].eligible > now {
                continue; // deferred already; renewed when it lapses
            }
            if !self.deferrals[node].contains(&j) {
                if self.deferrals[node].len() >= self.lookahead {
                    continue;
                }
                self.deferrals[node].push(j);
            }
            self.deferred += 1;
            self.unbump(j);
            self.jobs[j].deferred_by = Some(node);
            self.jobs[j].eligible = now + DECLINE_RETRY_S;
            self.push(now + DECLINE_RETRY_S, j, Kind::Deferred);
        }
        // Its own deferrals of jobs it would take now are taken back.
        for (i, &j) in pending.iter().enumerate() {
            if self.jobs[j].deferred_by == Some(node) && !steer.defer.contains(&i) {
                self.jobs[j].deferred_by = None;
                self.jobs[j].eligible = self.jobs[j].eligible.min(now);
            }
        }
        // Open for `h`: in the pass that starts it, here or on another node Slurm prefers, Slurm
        // offers the slots of this node still free to the jobs after it, before the daemon
        // hears of the start (or, with `h` elsewhere, looks again). Those the node would
        // decline either way wait until it does; it then closes, or takes them. As the daemon
        // does, any node that opens defers them (not only the first in Slurm's order: within
        // a pass, LLN's order changes with every start).
        if let Some(h) = opened_for.filter(|_| self.anticipates > 0 && self.capacity() > self.used[node]) {
            // The jobs Slurm could start now, after `h` in its order (those waiting out a
            // decline are not offered in this pass, however high they stand).
            let mut offered = vec![h];
            let cap = self.anticipates;
            offered.extend(self.pending(now, cap + 1).into_iter().filter(|&j| j != h));
            offered.truncate(cap + 1);
            let refs: Vec<JobRef> = offered.iter().map(|&j| self.job_ref(j)).collect();
            let later: Vec<usize> = (1..offered.len()).collect();
            let declined = policy.declines_after(now, node, &self.view(node), &refs, 0, &later)?;
            for i in declined {
                let Some(&j) = offered.get(i).filter(|_| i >= 1) else {
                    return Err(format!("the policy anticipated pending job {i} of {}", offered.len()));
                };
                self.deferred += 1;
                self.unbump(j);
                self.jobs[j].deferred_by = Some(node);
                self.jobs[j].eligible = self.jobs[j].eligible.max(now + DECLINE_RETRY_S);
                self.anticipated[node].push(j);
            }
            if !self.anticipated[node].is_empty() {
                self.push(now + START_SEEN_S, h, Kind::Seen(node, now));
            }
        }
        Ok(())
    }

    /// Before a job waiting out a decline, a failure or a deferral comes back: every open
    /// node with a free slot has looked at the queue meanwhile (with `close`, a node looks
    /// every `look_ms` while it has a free slot), and closed if it would decline the job
    /// Slurm starts next, the one coming back among them.
    fn look_open(&mut self, now: f64, policy: &mut dyn Policy) -> Result<(), String> {
        if self.closes {
            for node in 0..self.shape.nodes {
                if !self.closed[node] {
                    self.steer(now, node, policy)?;
                }
            }
        }
        Ok(())
    }

    /// The node is open to Slurm again (its daemon deleted the reservation, or it lapsed).
    fn open(&mut self, node: usize) {
        if self.closed[node] {
            self.closed[node] = false;
            self.closure[node] += 1;
            self.refile(node, self.weight[node]);
        }
    }

    /// Slurm requeues job `j` after a failure: it waits [`OOM_REQUEUE_S`] with its place in
    /// the queue (a job its daemon gives back waits as a declined job, [`Self::requeue_for`]).
    fn requeue(&mut self, now: f64, j: usize) {
        self.requeue_for(now, j, OOM_REQUEUE_S);
    }

    /// A job requeued to wait `wait_s` with its place in the queue.
    fn requeue_for(&mut self, now: f64, j: usize, wait_s: f64) {
        self.jobs[j].restarts += 1;
        self.jobs[j].eligible = now + wait_s;
        self.queue.insert(j);
        self.push(now + wait_s, j, Kind::Eligible);
    }

    /// A job's priority is Slurm's own again.
    fn unbump(&mut self, j: usize) {
        if self.jobs[j].bumped {
            self.jobs[j].bumped = false;
            self.bumped.retain(|&b| b != j);
        }
    }

    /// A waiting job's priority is raised: it goes before every other waiting job.
    fn bump(&mut self, j: usize) {
        self.bumped.retain(|&b| b != j);
        self.bumped.push(j);
        self.jobs[j].bumped = true;
    }

    /// After the node's state changed: its weight, as the policy then says, reaches Slurm
    /// [`WEIGHT_LAG_S`] later.
    fn reweigh(&mut self, now: f64, node: usize, job: usize) {
        if !self.weight_due[node] {
            self.weight_due[node] = true;
            self.push(now + WEIGHT_LAG_S, job, Kind::Weight(node));
        }
    }

    /// Puts the node in its place among the nodes with a free slot, by `weight` and its jobs
    /// now (Slurm counts those itself, at once).
    fn refile(&mut self, node: usize, weight: u32) {
        self.free.remove(&(self.weight[node], self.filed_used[node], node));
        self.weight[node] = weight;
        self.filed_used[node] = self.used[node];
        if self.used[node] < self.capacity() && !self.closed[node] {
            self.free.insert((weight, self.used[node], node));
        }
    }

    /// Whether job `j` cannot share with one of the jobs on GPU `gi` that hold their memory
    /// for good: those not doomed themselves (a doomed job is about to fail and free it).
    /// Where the table has memory, also when their memory together exceeds the GPU's (each
    /// pair may fit, three may not).
    fn clashes(&self, j: usize, gi: usize) -> bool {
        let app = self.jobs[j].app;
        let holding = || self.gpus[gi].jobs.iter().filter(|&&o| o != j && !self.jobs[o].doomed);
        if holding().any(|&o| self.table.speed(app, self.jobs[o].app).is_none()) {
            return true;
        }
        match (self.table.memory_of(app), self.table.gpu_memory()) {
            (Some(mine), Some(gpu)) => {
                mine + holding()
                    .filter_map(|&o| self.table.memory_of(self.jobs[o].app))
                    .sum::<u64>()
                    > gpu
            }
            _ => false,
        }
    }

    fn start(&mut self, now: f64, j: usize, node: usize, g: usize) {
        let gi = node * self.shape.gpus_per_node + g;
        let doomed = self.clashes(j, gi);
        self.settle(now, gi);
        let job = &mut self.jobs[j];
        job.deferred_by = None;
        job.at = Some((node, g));
        job.start = now;
        job.done = 0.0;
        job.counted = 0.0;
        job.counted_at = now;
        job.last = now;
        job.doomed = doomed;
        job.run += 1;
        let run = job.run;
        self.gpus[gi].jobs.push(j);
        self.used[node] += 1;
        self.refile(node, self.weight[node]);
        if doomed {
            self.push(now + OOM_AFTER_S, j, Kind::OutOfMemory(run));
        } else if self.progress.every_s > 0.0 {
            self.push(now + self.progress.every_s, j, Kind::Report(run));
        }
        self.respeed(now, gi);
    }

    /// After a report or telemetry on `node`: the running jobs the policy gives back to Slurm
    /// there leave and are requeued. Whether there were any.
    fn give_back(&mut self, now: f64, node: usize, policy: &mut dyn Policy) -> Result<bool, String> {
        let given = policy.separations(now, node)?;
        let Some(&first) = given.first() else {
            return Ok(false);
        };
        for &id in &given {
            let j = id as usize - 1;
            if self.jobs.get(j).and_then(|job| job.at).map(|(n, _)| n) != Some(node) {
                return Err(format!(
                    "the policy gave back job {id}, which does not run on node {node}"
                ));
            }
            // Requeued by the daemon, which then holds it back as long as a declined job
            // (its default `decline_retry_s`), not Slurm's requeue delay.
            self.leave(now, j);
            self.separations += 1;
            policy.finished(now, node, self.job_ref(j), false)?;
            self.requeue_for(now, j, DECLINE_RETRY_S);
        }
        self.reweigh(now, node, first as usize - 1);
        self.steer(now, node, policy)?;
        Ok(true)
    }

    /// One round of GPU telemetry of `node`: each running job's GPU and its SM utilisation since
    /// the previous round (or its start), as NVML gives it on a time-sliced GPU: its
    /// application's utilisation alone times the work it did per second (overstated by its
    /// bias), with noise.
    fn telemetry_round(&mut self, now: f64, node: usize) -> Vec<(usize, JobRef, u32)> {
        let mut round = Vec::new();
        for g in 0..self.shape.gpus_per_node {
            let gi = node * self.shape.gpus_per_node + g;
            for k in 0..self.gpus[gi].jobs.len() {
                let j = self.gpus[gi].jobs[k];
                let noise = self.progress.busy_noise * self.busy_noise.normal();
                let job = &mut self.jobs[j];
                let done = job.done + job.speed * (now - job.last);
                let secs = now - job.counted_at;
                let util = if secs > 0.0 {
                    let speed = (done - job.counted) / secs;
                    let shown = speed + self.app_bias[job.app] * (1.0 - speed).max(0.0);
                    self.app_util[job.app] * shown * (1.0 + noise)
                } else {
                    0.0
                };
                (job.counted, job.counted_at) = (done, now);
                round.push((g, self.job_ref(j), (100.0 * util.clamp(0.0, 1.0)).round() as u32));
            }
        }
        round
    }

    /// Takes a job off its GPU; returns its (node, gpu).
    fn leave(&mut self, now: f64, j: usize) -> (usize, usize) {
        let (node, g) = self.jobs[j].at.take().expect("a running job");
        let gi = node * self.shape.gpus_per_node + g;
        self.settle(now, gi);
        self.gpus[gi].jobs.retain(|&o| o != j);
        self.used[node] -= 1;
        self.refile(node, self.weight[node]);
        self.jobs[j].epoch += 1;
        self.rescue(now, gi);
        self.respeed(now, gi);
        (node, g)
    }

    /// A doomed job whose clashing partners have all left before it ran out of memory has
    /// the memory it needs after all: it runs on (oldest first, so that of two doomed jobs
    /// that cannot share either, the newer stays doomed). Without this a doomed job stayed
    /// doomed alone, and the next job of an application that cannot share with itself,
    /// placed beside it, was doomed in turn: a chain of failures that never ended.
    fn rescue(&mut self, now: f64, gi: usize) {
        for k in 0..self.gpus[gi].jobs.len() {
            let m = self.gpus[gi].jobs[k];
            if !self.jobs[m].doomed || self.clashes(m, gi) {
                continue;
            }
            self.jobs[m].doomed = false;
            if self.progress.every_s > 0.0 {
                let run = self.jobs[m].run;
                self.push(now + self.progress.every_s, m, Kind::Report(run));
            }
        }
    }

    /// Brings the work of a GPU's jobs and the throughput integrals up to `now`.
    fn settle(&mut self, now: f64, gi: usize) {
        let gpu = &mut self.gpus[gi];
        let dt = now - gpu.since;
        if !gpu.jobs.is_empty() {
            self.busy_seconds += dt;
            self.speed_seconds += dt * gpu.speed_sum;
        }
        gpu.since = now;
        for &j in &gpu.jobs {
            let job = &mut self.jobs[j];
            job.done += job.speed * (now - job.last);
            job.last = now;
        }
    }

    /// Gives each job on the GPU its speed beside the others and its new completion time.
    /// A job doomed to run out of memory does no work and slows no one.
    fn respeed(&mut self, now: f64, gi: usize) {
        let members = self.gpus[gi].jobs.clone();
        let mut sum = 0.0;
        for &j in &members {
            let speed = if self.jobs[j].doomed {
                0.0
            } else {
                members
                    .iter()
                    .filter(|&&o| o != j && !self.jobs[o].doomed)
                    .map(|&o| self.table.speed(self.jobs[j].app, self.jobs[o].app).unwrap_or(1.0))
                    .product()
            };
            sum += speed;
            let job = &mut self.jobs[j];
            job.speed = speed;
            job.epoch += 1;
            if speed > 0.0 {
                let at = now + (job.work - job.done).max(0.0) / speed;
                let epoch = job.epoch;
                self.push(at, j, Kind::Complete(epoch));
            }
        }
        self.gpus[gi].speed_sum = sum;
    }
}
