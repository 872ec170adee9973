//! The simulated world: Slurm's part and reality's part.
//!
//! Slurm's part: a FIFO queue, and two ways a job gets its GPU. A policy that places jobs
//! itself ([`Policy::place`]) is Slurm's own shard placement: Slurm picks the node (the shared
//! partition's `LLN=YES`: the node with the fewest jobs, then the first) and the policy the GPU
//! there, as gres first-fit does. A policy that claims ([`Policy::claims`]) is the claimer:
//! every job waits out of Slurm's placement until a look ([`LOOK_S`] after anything changed)
//! pins it to a GPU of a node, and Slurm starts it there at its next pass ([`PASS_S`] later).
//! Reality's part: each job runs at the table's speed beside its current partners; a newcomer
//! beside a job it cannot share with fails with out-of-memory unless that job leaves first, and
//! is requeued. A watchdog stops a run that would never end.

use super::input::{Rng, Table, TraceJob};
use crate::events::{Event, Kind};
use crate::state::{Gpu, Job};
use crate::watchdog::Watchdog;
use std::collections::{BTreeSet, BinaryHeap};

mod fit;

/// How long after something changed (a job arrived, ended or came back) the claimer looks at
/// the cluster: it reads Slurm's queue about once a second.
pub const LOOK_S: f64 = 1.0;
/// How long after a claim (one `scontrol update` of the pending job) Slurm starts the job on
/// the GPU it was pinned to: its next scheduling pass, which the update triggers.
pub const PASS_S: f64 = 1.0;
/// How long a job given back to Slurm to run apart waits before it may be claimed again (the
/// claimer's `PIN_GRACE`: its old pin goes stale).
pub const SEPARATED_WAIT_S: f64 = 30.0;
/// How long a job that does not fit beside its partner runs before it fails.
pub const OOM_AFTER_S: f64 = 60.0;

pub use crate::model::{Cluster, Failures, JobRef, Outcome, Policy, Progress, Shape};

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
    /// Nodes with a free slot, by (jobs on it, index): Slurm's order with `LLN=YES`.
    free: BTreeSet<(u32, usize)>,
    /// Waiting jobs in FIFO order (trace order).
    queue: BTreeSet<usize>,
    /// Jobs of `queue` that may not be claimed yet (back from a failure or a separation, their
    /// wait not over): pruned at each look.
    deferred: BTreeSet<usize>,
    separations: u64,
    /// Whether the policy claims jobs ([`Policy::claims`]), how many pending jobs a look
    /// weighs, whether a look is due, and how many claims were made.
    claims: bool,
    claim_lookahead: usize,
    look_due: bool,
    /// A look due at this time because a trial ends then ([`Policy::look_again`]).
    timed_look: Option<f64>,
    claimed: u64,
    /// Jobs claimed and not yet started (each for [`PASS_S`]): what a look adds to the GPUs.
    pinned: BTreeSet<usize>,
    /// The GPUs whose jobs (running or claimed) changed since the policy's last look: each
    /// look shows the policy only those ([`Cluster`]).
    changed: BTreeSet<usize>,
    events: BinaryHeap<Event>,
    seq: u64,
    oom_failures: u64,
    resident_failures: u64,
    lost_work_s: f64,
    put_back: u64,
    /// Which side of a pair that does not fit dies ([`Failures::resident_dies`]).
    fate: Rng,
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
    let mut w = World::new(table, trace, shape, progress, seed, &*policy);
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
        if let Some(stuck) = watchdog.tick(e.at, e.job) {
            return Err(stuck.describe(trace));
        }
        if !w.event(e, policy)? {
            continue; // nothing changed for Slurm
        }
        if w.claims {
            // Something changed: the claimer sees it at its next read of the queue.
            if !w.look_due {
                w.look_due = true;
                w.push(e.at + LOOK_S, 0, Kind::Look);
            }
        } else {
            w.schedule(e.at, policy)?;
        }
    }
    if let Some(j) = w.jobs.iter().position(|j| j.finished.is_none()) {
        return Err(format!(
            "job {} never finished (no GPU would ever take it?)",
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
        resident_failures: w.resident_failures,
        put_back: w.put_back,
        lost_work_s: w.lost_work_s,
        separations: w.separations,
        claims: w.claimed,
        speed_seconds: w.speed_seconds,
        busy_seconds: w.busy_seconds,
    })
}

impl<'a> World<'a> {
    fn new(
        table: &'a Table,
        trace: &[TraceJob],
        shape: Shape,
        progress: Progress,
        seed: u64,
        policy: &dyn Policy,
    ) -> Self {
        let mut rates = Rng::new(seed ^ 0x005e_ed0f_a995);
        // Each application's own iterations per second alone, between 0.5 and 20: the unit of
        // its reports, which the learned policy must find out for itself.
        let app_rate: Vec<f64> = (0..table.apps.len())
            .map(|_| 0.5 * 40f64.powf(rates.uniform()))
            .collect();
        let mut utils = Rng::new(seed ^ 0x0005_1111);
        let app_util: Vec<f64> = (0..table.apps.len()).map(|_| 0.5 + 0.5 * utils.uniform()).collect();
        let app_bias: Vec<f64> = (0..table.apps.len())
            .map(|_| progress.busy_bias * utils.uniform())
            .collect();
        World {
            table,
            shape,
            slots: policy.slots(&shape),
            progress,
            noise: Rng::new(seed ^ 0x0bad_5eed),
            app_util,
            app_bias,
            busy_noise: Rng::new(seed ^ 0x00b5_ed00),
            jobs: trace.iter().map(|t| Job::new(t, app_rate[t.app])).collect(),
            gpus: vec![Gpu::default(); shape.nodes * shape.gpus_per_node],
            used: vec![0; shape.nodes],
            free: (0..shape.nodes).map(|n| (0, n)).collect(),
            queue: BTreeSet::new(),
            deferred: BTreeSet::new(),
            separations: 0,
            claims: policy.claims(),
            claim_lookahead: policy.claim_lookahead().max(1),
            look_due: false,
            timed_look: None,
            claimed: 0,
            pinned: BTreeSet::new(),
            changed: (0..shape.nodes * shape.gpus_per_node).collect(),
            events: BinaryHeap::new(),
            seq: 0,
            oom_failures: 0,
            resident_failures: 0,
            lost_work_s: 0.0,
            put_back: 0,
            fate: Rng::new(seed ^ 0x00fa_7e5e),
            speed_seconds: 0.0,
            busy_seconds: 0.0,
        }
    }

    /// What one event does; whether it changed anything Slurm acts on (a look or a pass
    /// follows).
    fn event(&mut self, e: Event, policy: &mut dyn Policy) -> Result<bool, String> {
        let now = e.at;
        match e.kind {
            Kind::Arrive => {
                self.queue.insert(e.job);
                Ok(true)
            }
            // A job comes back from a wait after a failure or a separation.
            Kind::Eligible => Ok(true),
            Kind::Complete(epoch) => {
                let job = &self.jobs[e.job];
                if job.epoch != epoch || job.at.is_none() {
                    return Ok(false);
                }
                let (node, _) = self.leave(now, e.job);
                self.jobs[e.job].finished = Some(now);
                policy.finished(now, node, self.job_ref(e.job), true)?;
                Ok(true)
            }
            Kind::OutOfMemory(run) => self.out_of_memory(now, e.job, run, policy),
            Kind::Report(run) => self.report(now, e.job, run, policy),
            Kind::Telemetry => self.telemetry(now, policy),
            Kind::Look => {
                self.look_due = false;
                // A look that claimed changed Slurm's books: where jobs wait that it did not
                // weigh (its lookahead), the claimer's next look, a second later, weighs them.
                if self.look(now, policy)? {
                    self.look_due = true;
                    self.push(now + LOOK_S, 0, Kind::Look);
                }
                if let Some(t) = policy.look_again().filter(|&t| t > now && !self.queue.is_empty()) {
                    if self.timed_look.is_none_or(|at| at <= now || t < at) {
                        self.timed_look = Some(t);
                        self.push(t, 0, Kind::Look);
                    }
                }
                Ok(false)
            }
            Kind::Pass => {
                if let Some((node, g)) = self.jobs[e.job].pinned.take() {
                    self.pinned.remove(&e.job);
                    self.start(now, e.job, node, g);
                    policy.started(now, node, self.job_ref(e.job), g)?;
                }
                Ok(false)
            }
        }
    }

    /// A run that could not share ends out of memory, unless it is stale (a later run, or the
    /// partners it could not share with left in time).
    fn out_of_memory(&mut self, now: f64, j: usize, run: u32, policy: &mut dyn Policy) -> Result<bool, String> {
        let job = &self.jobs[j];
        if job.run != run || job.at.is_none() || !job.doomed {
            return Ok(false);
        }
        let (node, _) = self.leave(now, j);
        self.lost_work_s += self.jobs[j].done;
        policy.out_of_memory(now, node, self.job_ref(j))?;
        policy.finished(now, node, self.job_ref(j), false)?;
        let wait = self.after_failure(j, policy.puts_back());
        self.requeue_for(now, j, wait);
        Ok(true)
    }

    /// A running job reports its progress, noisily; its node may give a job back after.
    fn report(&mut self, now: f64, j: usize, run: u32, policy: &mut dyn Policy) -> Result<bool, String> {
        let job = &self.jobs[j];
        let Some((node, _)) = job.at.filter(|_| job.run == run) else {
            return Ok(false);
        };
        let (done, rate) = (job.done + job.speed * (now - job.last), job.rate);
        let noise = self.progress.noise * self.progress.every_s * self.noise.normal();
        let reported = (done + noise).max(0.0) * rate;
        policy.progress(now, node, self.job_ref(j), reported)?;
        self.push(now + self.progress.every_s, j, Kind::Report(run));
        self.give_back(now, node, policy)
    }

    /// A round of GPU telemetry on every node; each node may give a job back after.
    fn telemetry(&mut self, now: f64, policy: &mut dyn Policy) -> Result<bool, String> {
        let mut changed = false;
        for node in 0..self.shape.nodes {
            let round = self.telemetry_round(now, node);
            if !round.is_empty() {
                policy.telemetry(now, node, &round)?;
                changed |= self.give_back(now, node, policy)?;
            }
        }
        if self.jobs.iter().any(|j| j.finished.is_none()) {
            self.push(now + self.progress.busy_every_s, 0, Kind::Telemetry);
        }
        Ok(changed)
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

    /// The claimer's look: the first pending jobs in Slurm's order (none claimed yet, none
    /// waiting out a requeue), the cluster as Slurm's books show it (running and claimed jobs
    /// alike), and the claims the policy makes, each started by Slurm [`PASS_S`] later on the
    /// GPU it was pinned to. Whether it claimed and jobs wait that it did not weigh.
    fn look(&mut self, now: f64, policy: &mut dyn Policy) -> Result<bool, String> {
        let gpn = self.shape.gpus_per_node;
        let pending: Vec<usize> = self
            .queue
            .iter()
            .copied()
            .filter(|&j| self.jobs[j].eligible <= now)
            .take(self.claim_lookahead)
            .collect();
        if pending.is_empty() {
            return Ok(false);
        }
        let held = self.used.iter().sum::<u32>() as usize + self.pinned.len();
        if held >= self.gpus.len() * self.slots as usize {
            return Ok(false);
        }
        let changed: Vec<(usize, Vec<JobRef>)> = std::mem::take(&mut self.changed)
            .into_iter()
            .map(|gi| (gi, self.holding(gi).into_iter().map(|j| self.job_ref(j)).collect()))
            .collect();
        self.deferred
            .retain(|&j| self.queue.contains(&j) && self.jobs[j].eligible > now);
        let cluster = Cluster {
            changed: &changed,
            waiting: self.queue.len() - self.deferred.len(),
        };
        let unweighed = cluster.waiting > pending.len();
        let refs: Vec<JobRef> = pending.iter().map(|&j| self.job_ref(j)).collect();
        let mut claimed = false;
        for (i, node, g) in policy.claim(now, &cluster, &refs)? {
            let Some(&j) = pending.get(i) else {
                return Err(format!("the policy claimed pending job {i} of {}", pending.len()));
            };
            if node >= self.shape.nodes || g >= gpn || self.jobs[j].pinned.is_some() {
                return Err(format!(
                    "the policy claimed job {} twice or for GPU {g} of node {node}",
                    j + 1
                ));
            }
            let gi = node * gpn + g;
            if self.holding(gi).len() as u32 >= self.slots {
                return Err(format!(
                    "the policy claimed job {} for GPU {g} of node {node}, which has no free slot",
                    j + 1
                ));
            }
            self.changed.insert(gi);
            self.queue.remove(&j);
            self.jobs[j].pinned = Some((node, g));
            self.pinned.insert(j);
            self.claimed += 1;
            claimed = true;
            self.push(now + PASS_S, j, Kind::Pass);
        }
        Ok(claimed && unweighed)
    }

    /// The jobs GPU `gi` holds as Slurm's books show them: those running there, then those
    /// claimed for it and about to start.
    fn holding(&self, gi: usize) -> Vec<usize> {
        let gpn = self.shape.gpus_per_node;
        let mut on = self.gpus[gi].jobs.clone();
        on.extend((self.pinned.iter()).filter(|&&j| self.jobs[j].pinned.is_some_and(|(n, g)| n * gpn + g == gi)));
        on
    }

    fn job_ref(&self, j: usize) -> JobRef {
        JobRef {
            id: j as u32 + 1,
            app: self.jobs[j].app,
            put_back: self.jobs[j].put_back,
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

    /// Slurm's own placement: waiting, eligible jobs in FIFO order, each on the node with the
    /// fewest jobs that has a free slot (`LLN=YES`), the policy choosing the GPU there, until no
    /// node has a free slot.
    fn schedule(&mut self, now: f64, policy: &mut dyn Policy) -> Result<(), String> {
        while let Some(&(_, node)) = self.free.iter().next() {
            let Some(j) = self.queue.iter().copied().find(|&j| self.jobs[j].eligible <= now) else {
                break;
            };
            let view = self.view(node);
            let g = policy.place(now, node, self.job_ref(j), &view)?;
            if g >= self.shape.gpus_per_node || view[g].len() as u32 >= self.slots {
                return Err(format!(
                    "the policy chose GPU {g} of node {node}, which has no free slot"
                ));
            }
            self.queue.remove(&j);
            self.start(now, j, node, g);
            policy.started(now, node, self.job_ref(j), g)?;
        }
        Ok(())
    }

    /// A job requeued to wait `wait_s` with its place in the queue.
    fn requeue_for(&mut self, now: f64, j: usize, wait_s: f64) {
        self.jobs[j].eligible = now + wait_s;
        self.queue.insert(j);
        if wait_s > 0.0 {
            self.deferred.insert(j);
        }
        self.push(now + wait_s, j, Kind::Eligible);
    }

    /// Puts the node in its place among the nodes with a free slot (Slurm counts its jobs
    /// itself, at once).
    fn refile(&mut self, node: usize, before: u32) {
        self.free.remove(&(before, node));
        if self.used[node] < self.capacity() {
            self.free.insert((self.used[node], node));
        }
    }

    fn start(&mut self, now: f64, j: usize, node: usize, g: usize) {
        let gi = node * self.shape.gpus_per_node + g;
        let clash = self.clashes(j, gi);
        // Which side dies: the newcomer as it starts, or a resident as it grows.
        let resident = clash && self.fate.uniform() < self.progress.failures.resident_dies;
        let victim = if resident { self.victim(j, gi) } else { None };
        let doomed = clash && victim.is_none();
        let partner = if doomed { self.clash_partner(j, gi) } else { None };
        self.settle(now, gi);
        let job = &mut self.jobs[j];
        job.at = Some((node, g));
        job.start = now;
        job.done = 0.0;
        job.counted = 0.0;
        job.counted_at = now;
        job.last = now;
        job.doomed = doomed;
        job.clashed_with = partner;
        job.outgrown = false;
        job.run += 1;
        let run = job.run;
        self.gpus[gi].jobs.push(j);
        self.changed.insert(gi);
        self.used[node] += 1;
        self.refile(node, self.used[node] - 1);
        if doomed {
            self.push(now + OOM_AFTER_S, j, Kind::OutOfMemory(run));
        } else if self.progress.every_s > 0.0 {
            self.push(now + self.progress.every_s, j, Kind::Report(run));
        }
        if let Some(v) = victim {
            // From now on it does no work and slows no one, and fails as a doomed newcomer
            // would, unless the newcomer leaves first.
            // A new run as far as events go: its reports stop, and start again if rescued.
            let newcomer = self.jobs[j].app;
            let victim = &mut self.jobs[v];
            victim.doomed = true;
            victim.clashed_with = Some(newcomer);
            victim.outgrown = true;
            victim.run += 1;
            let run = victim.run;
            self.push(now + OOM_AFTER_S, v, Kind::OutOfMemory(run));
        }
        self.respeed(now, gi);
    }

    /// After a report or telemetry on `node`: the running jobs the policy gives back to Slurm
    /// there leave and are requeued, to be claimed again once their pin is stale. Whether there
    /// were any.
    fn give_back(&mut self, now: f64, node: usize, policy: &mut dyn Policy) -> Result<bool, String> {
        let given = policy.separations(now, node)?;
        if given.is_empty() {
            return Ok(false);
        }
        for &id in &given {
            let j = id as usize - 1;
            if self.jobs.get(j).and_then(|job| job.at).map(|(n, _)| n) != Some(node) {
                return Err(format!(
                    "the policy gave back job {id}, which does not run on node {node}"
                ));
            }
            self.leave(now, j);
            self.separations += 1;
            self.jobs[j].restarts += 1;
            policy.finished(now, node, self.job_ref(j), false)?;
            self.requeue_for(now, j, SEPARATED_WAIT_S);
        }
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
        self.changed.insert(gi);
        self.used[node] -= 1;
        self.refile(node, self.used[node] + 1);
        self.jobs[j].epoch += 1;
        self.rescue(now, gi);
        self.respeed(now, gi);
        (node, g)
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
