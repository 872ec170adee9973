//! The daemon's own code as policies: `learned`, one real [`Node`] per simulated node with
//! its SQLite history, node 0's claimer claiming for the cluster; and `oracle`, the claimer's
//! code handed the true table.

use super::books::{self, Books, Names, View};
use super::input::Table;
use super::world::{Cluster, JobRef, Policy, Shape};
use multiplex_protocol::{FinishRequest, ReportKind, ReportRequest, StartRequest};
use multiplexd::claim::outcome_s;
use multiplexd::claimer::Claimer;
use multiplexd::config::keys::{MIN_GAIN, PUT_BACK, SEPARATE_BELOW, SHARE_QUEUE};
use multiplexd::config::{Config, GpuSpec, DEFAULT_UNKNOWN_PAIR_SPEED};
use multiplexd::history::{ActiveJob, Export, Merger, Tables};
use multiplexd::node::{Node, Started};
use multiplexd::placement::Wanted;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

/// The daemon's settings the learned policy and the oracle run with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// The learned policy's nodes merge their histories every this many simulated seconds
    /// (`multiplexd export` into `multiplexd import`, as `[share] dir` does; 0: never, each
    /// node learns alone and the claimer knows what its own node learned).
    pub share_every_s: f64,
    /// The daemon's `policy.min_gain`.
    pub min_gain: f64,
    /// The daemon's `policy.share_queue`.
    pub share_queue: f64,
    /// The daemon's `policy.separate_below`: a GPU whose measured jobs deliver less than this
    /// times what they would without the newest one gives that one back (0: never).
    pub separate_below: f64,
    /// The claimer's `claim.lookahead`: how many of the first pending jobs in Slurm's order one
    /// look weighs.
    pub lookahead: usize,
    /// Each job is bound to one GPU index from its submission (job_submit's rotation, where
    /// Slurm cannot move a pending job to another GPU type: 22.05), and a claim chooses only
    /// its node.
    pub fixed_gpu: bool,
    /// The daemon's `policy.put_back`: a job out of GPU memory beside a partner is put back in
    /// the queue at once (false: it fails, and its user submits it again).
    pub put_back: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            share_every_s: DEFAULT_SHARE_EVERY_S,
            min_gain: MIN_GAIN.default,
            share_queue: SHARE_QUEUE.default,
            separate_below: SEPARATE_BELOW.default,
            lookahead: multiplexd::config::ClaimConfig::default().lookahead,
            fixed_gpu: false,
            put_back: PUT_BACK.default,
        }
    }
}

/// How often the learned policy's nodes pool what they learn by default: the daemon's
/// `[share] every_s` default.
pub const DEFAULT_SHARE_EVERY_S: f64 = multiplexd::config::keys::SHARE_EVERY_S.default as f64;

impl Options {
    /// The daemon's config for `node` with these settings: the learned policy's daemons and
    /// the oracle read their `[policy]` from one place, checked as the daemon checks its file.
    pub(crate) fn config(&self, node: &str, jobs_per_gpu: u32) -> Result<Config, String> {
        Config::parse(&format!(
            "node = \"{node}\"\ndatabase = \":memory:\"\njobs_per_gpu = {jobs_per_gpu}\n[policy]\n\
             min_gain = {}\nshare_queue = {}\nseparate_below = {}\nput_back = {}\n[claim]\nlookahead = {}\n",
            self.min_gain, self.share_queue, self.separate_below, self.put_back, self.lookahead
        ))
    }
}

/// The daemon: one [`Node`] per simulated node, its history starting empty.
///
/// What a node does whose answer the world does not wait for (learning from a job that
/// ended, importing an exchange's pool) is queued on the node, and a second thread works
/// through the queues while the world goes on with other nodes; anything else asked of a node
/// first does whatever is still queued there itself. Each node has a clock of its own, set to
/// the simulated time of whatever it is asked, so each node sees the same sequence at the same
/// times as with everything on one thread: results do not change.
pub(crate) struct Learned<'a> {
    table: &'a Table,
    share_every_s: f64,
    /// Node 0's daemon is the cluster's claimer, its own [`Claimer`] over Slurm's books
    /// ([`books`]): what the other nodes learn reaches it as pooled histories do
    /// (`share_every_s`). How many pending jobs a look weighs.
    claimer: Claimer,
    lookahead: usize,
    /// Slurm's books as the claimer reads them, kept between its looks.
    books: Books,
    /// What the last exchange pooled (node 0's history after it; before the first, what every
    /// node started from).
    pool: Option<Arc<Export>>,
    put_back: bool,
    next_share: f64,
    nodes: Arc<Vec<Mutex<Slot>>>,
    learner: Option<Learner>,
    /// Per node, the simulated time its daemon reads.
    clocks: Arc<Vec<AtomicU64>>,
    /// Every node does its part of each exchange then, asked anything or not (tests: what
    /// [`Learned::share`] leaves out must change nothing).
    pub(crate) every_node_shares: bool,
    /// How often a node was left out of an exchange.
    pub(crate) left_out: usize,
}

/// A simulated node's daemon, the jobs that ended there it has still to learn from and the pool
/// it has still to import (the world waits for neither; a report and a round of telemetry are
/// recorded at once: the node's separation look, which reads them, follows each at once).
struct Slot {
    node: Node,
    queue: VecDeque<ActiveJob>,
    /// The pooled history of the last exchange, while this node has still to import it: it
    /// does before it is next asked anything ([`Learned::share`]).
    pool: Option<Arc<Export>>,
    /// Asked anything since the last exchange.
    asked: bool,
    /// The state of what its export reads right after it imported a pool (`None` until then).
    imported: Option<Tables>,
}

impl Slot {
    fn new(node: Node) -> Slot {
        Slot {
            node,
            queue: VecDeque::new(),
            pool: None,
            asked: false,
            imported: None,
        }
    }

    /// Does the work queued ([`Self::work`]) before the node is asked something.
    fn catch_up(&mut self) {
        self.work();
        self.asked = true;
    }

    /// Imports the last exchange's pool if it has not yet, then learns from the queued jobs,
    /// in order.
    fn work(&mut self) {
        if let Some(pool) = self.pool.take() {
            self.imported = None;
            if let Err(e) = self.node.import(&pool) {
                tracing::warn!(error = %e, "a node's import of the pooled history failed");
            } else {
                self.imported = self.node.history().exported_state().ok().flatten();
            }
        }
        while let Some(job) = self.queue.pop_front() {
            self.node.learn_ended(&job);
        }
    }

    /// Whether anything was asked of the node since the last exchange, or is queued for it.
    fn was_asked(&self) -> bool {
        self.asked || !self.queue.is_empty()
    }

    /// Whether it holds the last pool and nothing else: it imported it, and nothing its export
    /// reads changed since, nor is any learning queued.
    fn holds_the_pool(&self) -> bool {
        self.pool.is_none()
            && self.queue.is_empty()
            && self.imported.is_some()
            && self.node.history().exported_state().ok().flatten() == self.imported
    }
}

/// The learner thread and the way to tell it a node has work queued.
type Learner = (mpsc::Sender<usize>, std::thread::JoinHandle<()>);

/// A simulated node's daemon, caught up with its queued work.
struct NodeGuard<'a>(MutexGuard<'a, Slot>);

impl std::ops::Deref for NodeGuard<'_> {
    type Target = Node;
    fn deref(&self) -> &Node {
        &self.0.node
    }
}

impl std::ops::DerefMut for NodeGuard<'_> {
    fn deref_mut(&mut self) -> &mut Node {
        &mut self.0.node
    }
}

fn lock(slot: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// The learner thread, which catches up each node it is told of.
fn spawn_learner(nodes: &Arc<Vec<Mutex<Slot>>>) -> Result<Learner, String> {
    let (tx, rx) = mpsc::channel::<usize>();
    let nodes = Arc::clone(nodes);
    let thread = std::thread::Builder::new()
        .name("sim-learner".into())
        .spawn(move || {
            // A node may be named more than once, or caught up already by the world.
            for n in rx {
                lock(&nodes[n]).work();
            }
        })
        .map_err(|e| format!("cannot start the learner thread: {e}"))?;
    Ok((tx, thread))
}

/// Node `n` of `nodes` at simulated time `now`, caught up with the work queued for it.
fn caught_up<'n>(nodes: &'n [Mutex<Slot>], clocks: &[AtomicU64], n: usize, now: f64) -> NodeGuard<'n> {
    let mut slot = lock(&nodes[n]);
    slot.catch_up();
    clocks[n].store(now.to_bits(), Ordering::Relaxed);
    NodeGuard(slot)
}

impl<'a> Learned<'a> {
    pub(crate) fn new(table: &'a Table, shape: Shape, options: Options) -> Result<Self, String> {
        let share_every_s = options.share_every_s;
        let clocks = Arc::new(
            (0..shape.nodes)
                .map(|_| AtomicU64::new(0f64.to_bits()))
                .collect::<Vec<_>>(),
        );
        let gpus: Vec<GpuSpec> = (0..shape.gpus_per_node as u32)
            .map(|index| GpuSpec {
                index,
                model: table.model.clone(),
                // Where the table has no memory, memory never decides.
                memory_mb: table.gpu_memory().unwrap_or(1 << 40),
                uuid: None,
            })
            .collect();
        let claim_config = options.config(&books::node_name(0), shape.jobs_per_gpu)?.claim;
        let nodes = (0..shape.nodes)
            .map(|n| {
                let config = options.config(&books::node_name(n), shape.jobs_per_gpu)?;
                let c = Arc::clone(&clocks);
                let node = Node::open(
                    config,
                    gpus.clone(),
                    Box::new(move || f64::from_bits(c[n].load(Ordering::Relaxed))),
                )
                .map_err(|e| e.to_string())?;
                Ok(Mutex::new(Slot::new(node)))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let nodes = Arc::new(nodes);
        let learner = spawn_learner(&nodes)?;
        Ok(Learned {
            table,
            share_every_s,
            // As the daemon's claimer: a pair's outcome reaches node 0 at the next merge.
            claimer: Claimer::new(claim_config, 1).outcome_after(outcome_s(share_every_s)),
            lookahead: options.lookahead,
            books: Books::new(
                Names::new(table, shape.nodes, shape.gpus_per_node, shape.jobs_per_gpu),
                options.fixed_gpu,
            ),
            put_back: options.put_back,
            pool: None,
            next_share: share_every_s,
            nodes,
            learner: Some(learner),
            clocks,
            every_node_shares: false,
            left_out: 0,
        })
    }

    /// Starts every node from `history` (what `multiplexd import` of a site's earlier export
    /// gives each node).
    pub(crate) fn import(&mut self, history: &Export) -> Result<(), String> {
        for slot in self.nodes.iter() {
            let mut slot = lock(slot);
            slot.node.import(history)?;
        }
        // Each holds it and nothing more: the pool before the first exchange.
        self.pool = Some(Arc::new(history.clone()));
        Ok(())
    }

    /// Node `n`, caught up with the work queued for it.
    fn node(&self, n: usize) -> NodeGuard<'_> {
        let mut slot = lock(&self.nodes[n]);
        slot.catch_up();
        NodeGuard(slot)
    }

    /// Node `n` at simulated time `now`, caught up with the work queued for it.
    fn node_at(&self, n: usize, now: f64) -> NodeGuard<'_> {
        caught_up(&self.nodes, &self.clocks, n, now)
    }

    /// Queues a job that ended on node `n` to learn from and tells the learner thread, unless
    /// jobs queued there before are still to be learned from (the learner learns from all a
    /// node's queued jobs at once).
    fn hand(&self, n: usize, job: ActiveJob) -> Result<(), String> {
        let mut slot = lock(&self.nodes[n]);
        let told = !slot.queue.is_empty();
        slot.queue.push_back(job);
        drop(slot);
        if told {
            return Ok(());
        }
        self.tell_learner(n)
    }

    /// Tells the learner thread node `n` has work to catch up on.
    fn tell_learner(&self, n: usize) -> Result<(), String> {
        match self.learner.as_ref().map(|(tx, _)| tx.send(n)) {
            Some(Ok(())) => Ok(()),
            _ => Err("the learner thread has stopped".into()),
        }
    }

    /// Goes on at simulated time `now`: the histories are shared when due.
    fn at(&mut self, now: f64) -> Result<(), String> {
        if self.share_every_s > 0.0 && now >= self.next_share {
            while self.next_share <= now {
                self.next_share += self.share_every_s;
            }
            if let Err(e) = self.share() {
                tracing::warn!(error = %e, "sharing histories failed");
            }
        }
        Ok(())
    }

    /// Every node's export merged into the first, and the result (the pool) into every other:
    /// each daemon's exchange merges the other nodes' files in memory and imports them at once.
    /// The nodes' exports, each its own daemon's work, are shared among the machine's cores;
    /// their imports go to the learner thread while the world goes on.
    ///
    /// Only the nodes whose export could add something do their part now; the others' is the
    /// same done later or not at all. Merging is a join (`History::import`: the order of
    /// merging does not matter, merging twice changes nothing), so a node that imported the
    /// last pool holds that pool, and unless what its export reads changed since (it learned,
    /// or measured memory: `History::exported_state`), its export would add nothing the last
    /// pool, merged with the others, does not. Each pool holds the one before, so a node's
    /// import of this pool can wait until it is next asked something ([`Slot::catch_up`]),
    /// leaving it what importing every pool in turn would. At 1,000 nodes x 8 GPUs (100,000
    /// jobs, load 1) nearly every node is asked something between two exchanges while jobs
    /// arrive, a few once the queue drains.
    fn share(&mut self) -> Result<(), String> {
        let nodes = self.nodes.len();
        let every = self.every_node_shares;
        let exports = self.on_each(1..nodes, |slot| {
            if !every && (!slot.was_asked() || slot.holds_the_pool()) {
                return Ok(None);
            }
            slot.catch_up();
            slot.node.history().export().map(Some).map_err(|e| e.to_string())
        })?;
        self.left_out += exports.iter().filter(|e| e.is_none()).count();
        let mut others = Merger::default();
        if exports.iter().any(Option::is_none) {
            if let Some(pool) = &self.pool {
                others.add(pool)?;
            }
        }
        for export in exports.iter().flatten() {
            others.add(export)?;
        }
        drop(exports);
        let mut first = self.node(0);
        // A node alone has nothing to merge (and no refit to run for it).
        if nodes > 1 {
            first.import(&others.finish())?;
        }
        let pool = Arc::new(first.history().export().map_err(|e| e.to_string())?);
        drop(first);
        // The nodes asked something import it on the learner thread, while the world goes on
        // (most are asked again before the next exchange, and whichever the world asks first
        // imports it then); the others when next asked.
        let mut asked = Vec::new();
        for (n, slot) in self.nodes.iter().enumerate().skip(1) {
            let mut slot = lock(slot);
            slot.pool = Some(Arc::clone(&pool));
            if slot.asked {
                asked.push(n);
            }
            slot.asked = false;
        }
        for n in asked {
            self.tell_learner(n)?;
        }
        self.pool = Some(pool);
        Ok(())
    }

    /// What each node holds, caught up (tests).
    #[cfg(test)]
    pub(crate) fn exports(&self) -> Vec<Export> {
        (0..self.nodes.len())
            .map(|n| self.node(n).history().export().unwrap())
            .collect()
    }

    /// `work` on each node of `range`, on as many threads as the machine has cores: the
    /// answers in node order, or the first node's error.
    fn on_each<T: Send>(
        &self,
        range: std::ops::Range<usize>,
        work: impl Fn(&mut Slot) -> Result<T, String> + Sync,
    ) -> Result<Vec<T>, String> {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(range.len())
            .max(1);
        let nodes = &self.nodes;
        let chunk = range.len().div_ceil(threads);
        let start = range.start;
        let parts: Vec<Result<Vec<T>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let work = &work;
                    s.spawn(move || {
                        let from = start + t * chunk;
                        let to = (from + chunk).min(range.end);
                        (from..to).map(|n| work(&mut lock(&nodes[n]))).collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a node's exchange panicked".into())))
                .collect()
        });
        let mut out = Vec::with_capacity(range.len());
        for part in parts {
            out.extend(part?);
        }
        Ok(out)
    }
}

impl Policy for Learned<'_> {
    fn settle(&mut self) -> Result<(), String> {
        for n in 0..self.nodes.len() {
            drop(self.node(n));
        }
        Ok(())
    }
    fn grade(&self) -> Option<String> {
        Some(Learned::grade(self))
    }
    fn history(&mut self) -> Option<Result<Export, String>> {
        let merged = self
            .share()
            .and_then(|()| self.node(0).history().export().map_err(|e| e.to_string()));
        Some(merged)
    }
    /// The node's daemon puts a job out of memory beside a partner back in the queue.
    fn puts_back(&self) -> bool {
        self.put_back
    }
    fn claims(&self) -> bool {
        true
    }
    fn claim_lookahead(&self) -> usize {
        self.lookahead
    }
    fn look_again(&self) -> Option<f64> {
        self.claimer.next_trial_end()
    }
    fn started(&mut self, now: f64, node: usize, job: JobRef, gpu: usize) -> Result<(), String> {
        self.at(now)?;
        let req = StartRequest::new(
            job.id,
            0,
            self.table.apps[job.app].clone(),
            format!("sim{node}"),
            gpu as u32,
        );
        match self.node_at(node, now).start(&req).map_err(|e| e.to_string())? {
            Started::Placed { .. } => Ok(()),
            Started::Refused { reason } => Err(format!("the daemon refused job {}: {reason}", job.id)),
        }
    }
    fn claim(&mut self, now: f64, cluster: &Cluster, pending: &[JobRef]) -> Result<Vec<(usize, usize, usize)>, String> {
        self.at(now)?;
        let view = View { cluster, pending };
        let node = caught_up(&self.nodes, &self.clocks, 0, now);
        books::look(&mut self.claimer, &*node, &self.books, view, now)
    }
    fn progress(&mut self, now: f64, node: usize, job: JobRef, done: f64) -> Result<(), String> {
        self.report(now, node, job, ReportKind::Progress { done })
    }
    fn out_of_memory(&mut self, now: f64, node: usize, job: JobRef) -> Result<(), String> {
        self.report(now, node, job, ReportKind::OutOfMemory)
    }
    fn telemetry(&mut self, now: f64, node: usize, jobs: &[(usize, JobRef, u32)]) -> Result<(), String> {
        use multiplexd::gpus::{GpuSample, ProcSample};
        self.at(now)?;
        let mut samples: Vec<GpuSample> = Vec::new();
        for &(gpu, job, util) in jobs {
            let process = ProcSample {
                pid: job.id,
                mem_mb: self.table.memory_of(job.app),
                sm_util_pct: Some(util),
            };
            match samples.iter_mut().find(|s| s.index == gpu as u32) {
                Some(s) => s.processes.push(process),
                None => samples.push(GpuSample {
                    index: gpu as u32,
                    processes: vec![process],
                }),
            }
        }
        // Every process is its job's, run as the job's user (the simulator's uid 0).
        self.node_at(node, now)
            .record_telemetry(&samples, &|pid| Some((pid, 0)))
            .map_err(|e| e.to_string())
    }
    fn separations(&mut self, now: f64, node: usize) -> Result<Vec<u32>, String> {
        self.at(now)?;
        let mut n = self.node_at(node, now);
        let given = n.separations().map_err(|e| e.to_string())?;
        for s in &given {
            n.separated(s.job_id, true, &s.why).map_err(|e| e.to_string())?;
        }
        Ok(given.iter().map(|s| s.job_id).collect())
    }
    fn finished(&mut self, now: f64, node: usize, job: JobRef, ok: bool) -> Result<(), String> {
        self.at(now)?;
        let req = FinishRequest {
            job_id: job.id,
            step_id: 0,
            exit_status: if ok { 0 } else { 1 << 8 },
        };
        let ended = self
            .node_at(node, now)
            .finish_deferred(&req)
            .map_err(|e| e.to_string())?;
        if let Some(job) = ended {
            self.hand(node, job)?;
        }
        Ok(())
    }
}

impl Learned<'_> {
    /// A job's report.
    fn report(&mut self, now: f64, node: usize, job: JobRef, kind: ReportKind) -> Result<(), String> {
        self.at(now)?;
        let req = ReportRequest { job_id: job.id, kind };
        self.node_at(node, now)
            .report(&req, 0, true)
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

impl Drop for Learned<'_> {
    fn drop(&mut self) {
        if let Some((tx, learner)) = self.learner.take() {
            drop(tx);
            let _ = learner.join();
        }
    }
}

/// How many nodes [`Learned::grade`] looks at.
const GRADED_NODES: usize = 16;

impl Learned<'_> {
    /// After the run: how much of the table the nodes learned, and how far off they are (the
    /// table is read here only to grade, never to decide).
    fn grade(&self) -> String {
        let (mut seen, mut seen_err, mut unseen, mut unseen_err) = (0usize, 0.0, 0usize, 0.0);
        let model = &self.table.model;
        // Every node would cost minutes on a large cluster: up to 16 of them, spread evenly.
        let step = self.nodes.len().div_ceil(GRADED_NODES).max(1);
        // After `settle`: every node has done its queued work.
        let graded: Vec<&Mutex<Slot>> = self.nodes.iter().step_by(step).collect();
        let mut every_pair = Wanted::default();
        for a in &self.table.apps {
            for b in &self.table.apps {
                every_pair.pair(model, a, b);
            }
        }
        for slot in &graded {
            let slot = lock(slot);
            let h = match slot.node.history().estimates(&every_pair) {
                Ok(h) => h,
                Err(e) => return format!("learned: cannot read a node's estimates: {e}"),
            };
            let h = &h;
            for (ai, a) in self.table.apps.iter().enumerate() {
                for (bi, b) in self.table.apps.iter().enumerate() {
                    let Some(truth) = self.table.speed(ai, bi) else {
                        continue;
                    };
                    let (est, row, _) = multiplexd::placement::estimate(h, model, a, b, DEFAULT_UNKNOWN_PAIR_SPEED);
                    if row.is_some_and(|r| r.observations > 0 && !r.oom) {
                        seen += 1;
                        seen_err += (est - truth).abs();
                    } else {
                        unseen += 1;
                        unseen_err += (est - truth).abs();
                    }
                }
            }
        }
        let n = graded.len().max(1) as f64;
        format!(
            "learned: each node learned {:.0} of the {} pairs that can share (mean error {:.3}); \
             its estimates for the other {:.0} were off by {:.3} on average",
            seen as f64 / n,
            (seen + unseen) as f64 / n,
            seen_err / seen.max(1) as f64,
            unseen as f64 / n,
            unseen_err / unseen.max(1) as f64
        )
    }
}
