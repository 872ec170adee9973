//! The policies compared. `learned` is the daemon itself: one [`Node`] per simulated node,
//! each with its own SQLite history (in memory), driven through the same place, report and
//! finish calls the SPANK plugin makes, on the simulated clock. `oracle` is the daemon's
//! placement code handed the true table instead of a history.

use super::input::{Rng, Table};
use super::world::{JobRef, Policy, Shape};
use crate::config::{Config, GpuSpec, DEFAULT_MIN_GAIN, DEFAULT_UNKNOWN_PAIR_SPEED};
use crate::history::ActiveJob;
use crate::node::Node;
use crate::placement::{self, Decision, GpuState, Knobs, Newcomer, PairEstimate, PairHistory, Resident};
use crate::weight::weight_for;
use multiplex_protocol::{FinishRequest, PlaceRequest, ReportKind, ReportRequest, Response};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

/// The policies by name, in the order they are reported.
pub const ALL: [&str; 6] = ["exclusive", "first-fit", "least-loaded", "random", "learned", "oracle"];

/// Makes the named policy for a cluster.
pub fn make<'a>(name: &str, table: &'a Table, shape: Shape, seed: u64) -> Result<Box<dyn Policy + 'a>, String> {
    make_with(name, table, shape, seed, 0.0, DEFAULT_MIN_GAIN)
}

/// [`make`], with the learned policy's nodes merging their histories every `share_every_s`
/// simulated seconds (`multiplexd export` into `multiplexd import`, as a site's cron job
/// would; 0: never, each node learns alone), and the daemon's `policy.min_gain` for the
/// learned policy and the oracle.
pub fn make_with<'a>(
    name: &str,
    table: &'a Table,
    shape: Shape,
    seed: u64,
    share_every_s: f64,
    min_gain: f64,
) -> Result<Box<dyn Policy + 'a>, String> {
    let k = shape.jobs_per_gpu as usize;
    Ok(match name {
        "exclusive" => Box::new(Exclusive),
        "first-fit" => Box::new(FirstFit(k)),
        "least-loaded" => Box::new(LeastLoaded(k)),
        "random" => Box::new(Random(Rng::new(seed ^ 0x7a4d), k)),
        "oracle" => Box::new(Oracle::new(table, shape, min_gain)),
        "learned" => Box::new(Learned::new(table, shape, share_every_s, min_gain)?),
        other => return Err(format!("unknown policy {other:?}: choose from {}", ALL.join(", "))),
    })
}

fn free_slot(gpus: &[Vec<JobRef>], slots: usize) -> impl Iterator<Item = usize> + '_ {
    gpus.iter()
        .enumerate()
        .filter(move |(_, g)| g.len() < slots)
        .map(|(i, _)| i)
}

/// One job per GPU: Slurm's plain `gpu` gres.
struct Exclusive;

impl Policy for Exclusive {
    fn slots(&self, _shape: &Shape) -> u32 {
        1
    }
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<Option<usize>, String> {
        Ok(free_slot(gpus, 1).next())
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// Slurm's shard placement: the first GPU with a free shard.
struct FirstFit(usize);

impl Policy for FirstFit {
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<Option<usize>, String> {
        Ok(free_slot(gpus, self.0).next())
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// Slurm 23.11's `LL_SHARED_GRES`: the least-loaded GPU (the first of equals).
struct LeastLoaded(usize);

impl Policy for LeastLoaded {
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<Option<usize>, String> {
        Ok(free_slot(gpus, self.0).min_by_key(|&g| gpus[g].len()))
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// A GPU with a free slot, at random.
struct Random(Rng, usize);

impl Policy for Random {
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<Option<usize>, String> {
        let free: Vec<usize> = free_slot(gpus, self.1).collect();
        Ok((!free.is_empty()).then(|| free[self.0.below(free.len())]))
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// The true table as a history: every pair seen, infeasible pairs known.
struct Truth<'a>(&'a Table);

impl PairHistory for Truth<'_> {
    fn pair(&self, _model: &str, app: &str, other: &str) -> Option<PairEstimate> {
        let (a, b) = (self.0.app_index(app)?, self.0.app_index(other)?);
        let (s, o) = (self.0.speed(a, b), self.0.speed(b, a));
        Some(PairEstimate {
            speed: s.unwrap_or(0.0),
            other_speed: o.unwrap_or(0.0),
            observations: 1,
            oom: s.is_none() || o.is_none(),
        })
    }
}

/// The daemon's placement and weight publishing, knowing the table.
struct Oracle<'a> {
    table: &'a Table,
    shape: Shape,
    min_gain: f64,
    used: Vec<u32>,
}

impl<'a> Oracle<'a> {
    fn new(table: &'a Table, shape: Shape, min_gain: f64) -> Self {
        Oracle {
            table,
            shape,
            min_gain,
            used: vec![0; shape.nodes],
        }
    }
}

impl Policy for Oracle<'_> {
    fn place(&mut self, _: f64, node: usize, job: JobRef, gpus: &[Vec<JobRef>]) -> Result<Option<usize>, String> {
        let states: Vec<GpuState> = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuState {
                index: i as u32,
                model: self.table.model.clone(),
                memory_mb: u64::MAX,
                residents: g
                    .iter()
                    .map(|r| Resident {
                        job_id: r.id,
                        app: self.table.apps[r.app].clone(),
                        mem_mb: None,
                    })
                    .collect(),
            })
            .collect();
        let knobs = Knobs {
            slots: self.shape.jobs_per_gpu,
            unknown_pair_speed: DEFAULT_UNKNOWN_PAIR_SPEED,
            explore_margin: 0.0,
            min_gain: self.min_gain,
        };
        let newcomer = Newcomer {
            app: &self.table.apps[job.app],
            mem_mb: None,
        };
        Ok(match placement::place(&states, &newcomer, &Truth(self.table), knobs) {
            Decision::Place { gpu, .. } => {
                self.used[node] += 1;
                Some(gpu as usize)
            }
            Decision::Decline { .. } => None,
        })
    }
    fn weight(&self, node: usize) -> u32 {
        let total = self.shape.gpus_per_node as u32 * self.shape.jobs_per_gpu;
        weight_for(self.used[node], total, 1)
    }
    fn finished(&mut self, _: f64, node: usize, _: JobRef, _: bool) -> Result<(), String> {
        self.used[node] -= 1;
        Ok(())
    }
}

/// The daemon: one [`Node`] per simulated node, its history starting empty.
///
/// What a node does after a job ends (learning from it) runs on a second thread while the
/// world goes on with other nodes; the next request to that node waits for it. Each node
/// sees the same sequence as with everything on one thread, so results do not change.
struct Learned<'a> {
    table: &'a Table,
    share_every_s: f64,
    next_share: f64,
    nodes: Arc<Vec<Mutex<Node>>>,
    /// Per node, ended jobs handed to the learner and not yet learned from.
    pending: Arc<Vec<AtomicU32>>,
    learner: Option<Learner>,
    clock: Arc<AtomicU64>,
    weights: Arc<Vec<AtomicU32>>,
}

/// The learner thread and the way to hand it (node, ended job).
type Learner = (mpsc::Sender<(usize, ActiveJob)>, std::thread::JoinHandle<()>);

impl<'a> Learned<'a> {
    fn new(table: &'a Table, shape: Shape, share_every_s: f64, min_gain: f64) -> Result<Self, String> {
        let clock = Arc::new(AtomicU64::new(0f64.to_bits()));
        let weights = Arc::new((0..shape.nodes).map(|_| AtomicU32::new(1)).collect::<Vec<_>>());
        let gpus: Vec<GpuSpec> = (0..shape.gpus_per_node as u32)
            .map(|index| GpuSpec {
                index,
                model: table.model.clone(),
                memory_mb: 1 << 40,
            })
            .collect();
        let nodes = (0..shape.nodes)
            .map(|n| {
                let config = Config::parse(&format!(
                    "node = \"sim{n}\"\ndatabase = \":memory:\"\njobs_per_gpu = {}\n[policy]\nmin_gain = {min_gain}\n",
                    shape.jobs_per_gpu
                ))?;
                let c = Arc::clone(&clock);
                let mut node = Node::open(
                    config,
                    gpus.clone(),
                    Box::new(move || f64::from_bits(c.load(Ordering::Relaxed))),
                )
                .map_err(|e| e.to_string())?;
                let w = Arc::clone(&weights);
                // The weight the daemon would publish through scontrol, read by Slurm's part.
                node.on_load(Box::new(move |used, total| {
                    w[n].store(weight_for(used, total, 1), Ordering::Relaxed)
                }))
                .map_err(|e| e.to_string())?;
                Ok(Mutex::new(node))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let nodes = Arc::new(nodes);
        let pending = Arc::new((0..shape.nodes).map(|_| AtomicU32::new(0)).collect::<Vec<_>>());
        let (tx, rx) = mpsc::channel::<(usize, ActiveJob)>();
        let learner = {
            let (nodes, pending) = (Arc::clone(&nodes), Arc::clone(&pending));
            std::thread::Builder::new()
                .name("sim-learner".into())
                .spawn(move || {
                    for (n, job) in rx {
                        nodes[n].lock().unwrap_or_else(|p| p.into_inner()).learn_ended(&job);
                        pending[n].fetch_sub(1, Ordering::Release);
                    }
                })
                .map_err(|e| format!("cannot start the learner thread: {e}"))?
        };
        Ok(Learned {
            table,
            share_every_s,
            next_share: share_every_s,
            nodes,
            pending,
            learner: Some((tx, learner)),
            clock,
            weights,
        })
    }

    /// Node `n`, once it has learned from every job that ended on it.
    fn node(&self, n: usize) -> MutexGuard<'_, Node> {
        while self.pending[n].load(Ordering::Acquire) > 0 {
            std::thread::yield_now();
        }
        self.nodes[n].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn at(&mut self, now: f64) {
        self.clock.store(now.to_bits(), Ordering::Relaxed);
        if self.share_every_s > 0.0 && now >= self.next_share {
            while self.next_share <= now {
                self.next_share += self.share_every_s;
            }
            if let Err(e) = self.share() {
                tracing::warn!(error = %e, "sharing histories failed");
            }
        }
    }

    /// Every node's export merged into the first, and the result into every other.
    fn share(&mut self) -> Result<(), String> {
        use crate::report::{export, import};
        let mut first = self.node(0);
        for n in 1..self.nodes.len() {
            let e = export(self.node(n).history()).map_err(|e| e.to_string())?;
            import(first.history_mut(), &e)?;
        }
        let merged = export(first.history()).map_err(|e| e.to_string())?;
        drop(first);
        for n in 1..self.nodes.len() {
            import(self.node(n).history_mut(), &merged)?;
        }
        Ok(())
    }
}

fn unexpected(r: Response) -> String {
    format!("the daemon answered {r:?}")
}

impl Policy for Learned<'_> {
    fn grade(&self) -> Option<String> {
        Some(Learned::grade(self))
    }
    fn place(&mut self, now: f64, node: usize, job: JobRef, _gpus: &[Vec<JobRef>]) -> Result<Option<usize>, String> {
        self.at(now);
        let req = PlaceRequest {
            job_id: job.id,
            step_id: 0,
            uid: 0,
            app: self.table.apps[job.app].clone(),
            mem_mb: None,
            node: format!("sim{node}"),
            slurm_cuda_visible_devices: None,
            slurm_job_gpus: None,
            slurm_shards_on_node: None,
        };
        let answer = self.node(node).place(&req).map_err(|e| e.to_string())?;
        match answer {
            Response::Placed(p) => Ok(Some(p.gpu as usize)),
            Response::Declined { .. } => Ok(None),
            other => Err(unexpected(other)),
        }
    }
    fn weight(&self, node: usize) -> u32 {
        self.weights[node].load(Ordering::Relaxed)
    }
    fn progress(&mut self, now: f64, node: usize, job: JobRef, done: f64) -> Result<(), String> {
        self.report(now, node, job, ReportKind::Progress { done })
    }
    fn out_of_memory(&mut self, now: f64, node: usize, job: JobRef) -> Result<(), String> {
        self.report(now, node, job, ReportKind::OutOfMemory)
    }
    fn finished(&mut self, now: f64, node: usize, job: JobRef, ok: bool) -> Result<(), String> {
        self.at(now);
        let req = FinishRequest {
            job_id: job.id,
            step_id: 0,
            exit_status: if ok { 0 } else { 1 << 8 },
        };
        let (answer, ended) = self.node(node).finish_deferred(&req).map_err(|e| e.to_string())?;
        if let Some(job) = ended {
            self.pending[node].fetch_add(1, Ordering::Release);
            let sent = self.learner.as_ref().map(|(tx, _)| tx.send((node, job)));
            if !matches!(sent, Some(Ok(()))) {
                return Err("the learner thread has stopped".into());
            }
        }
        match answer {
            Response::Finished => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}

impl Learned<'_> {
    fn report(&mut self, now: f64, node: usize, job: JobRef, kind: ReportKind) -> Result<(), String> {
        self.at(now);
        let req = ReportRequest { job_id: job.id, kind };
        let answer = self.node(node).report(&req, 0, true).map_err(|e| e.to_string())?;
        match answer {
            Response::Reported { .. } => Ok(()),
            other => Err(unexpected(other)),
        }
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
        // Wait for the learner: every pending count reaches 0.
        for n in 0..self.nodes.len() {
            drop(self.node(n));
        }
        let graded: Vec<&Mutex<Node>> = self.nodes.iter().step_by(step).collect();
        for node in &graded {
            let node = node.lock().unwrap_or_else(|p| p.into_inner());
            let h = node.history();
            for (ai, a) in self.table.apps.iter().enumerate() {
                for (bi, b) in self.table.apps.iter().enumerate() {
                    let Some(truth) = self.table.speed(ai, bi) else {
                        continue;
                    };
                    let (est, row, _) = crate::placement::estimate(h, model, a, b, DEFAULT_UNKNOWN_PAIR_SPEED);
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
