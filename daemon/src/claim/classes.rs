//! The GPUs of a large cluster fall into few kinds as a claim sees them: a GPU's worth to a
//! job depends only on its model, its memory, its index where the job is bound to one, and
//! who runs on it (their applications, memory and put-back notes), never on its node. So one
//! look scores each kind once per job ([`placement::place`]'s own scoring), and weighing a
//! job against every GPU of the cluster is a lookup per GPU: at 1,000 nodes of 8 GPUs, a few
//! dozen kinds instead of 8,000 scorings (`cargo bench -p multiplexd --bench claim`).

use super::{guarded, newcomer, open_gpus, Candidate, NodeGpus, Offer};
use crate::placement::{self, Decision, Estimates, GpuState, Knobs};
use std::collections::HashMap;

/// Whether `a` and `b` are of one kind (`bound`: for jobs bound to a GPU index, which must
/// then be the same).
fn same_kind(a: &GpuState, b: &GpuState, bound: bool) -> bool {
    a.model == b.model
        && a.memory_mb == b.memory_mb
        && (!bound || a.index == b.index)
        && a.residents.len() == b.residents.len()
        && a.residents
            .iter()
            .zip(&b.residents)
            .all(|(x, y)| x.app == y.app && x.mem_mb == y.mem_mb && x.put_back == y.put_back)
}

/// A hash of what [`same_kind`] compares.
fn kind_hash(gpu: &GpuState, bound: bool) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&gpu.model, gpu.memory_mb, bound.then_some(gpu.index)).hash(&mut h);
    for r in &gpu.residents {
        (&r.app, r.mem_mb, &r.put_back).hash(&mut h);
    }
    h.finish()
}

/// The kind of every GPU of a look's nodes, kept as claims seat jobs.
#[derive(Debug, Default)]
pub(super) struct Kinds {
    /// The kinds by hash (bound or not): their ids.
    ids: HashMap<(u64, bool), Vec<usize>>,
    /// Per node, per GPU (in the node's order): its kind, and its kind as jobs bound to no
    /// index see it.
    of: Vec<Vec<(usize, usize)>>,
    /// One GPU of each kind, to score.
    sample: Vec<GpuState>,
}

impl Kinds {
    pub(super) fn new(nodes: &[NodeGpus]) -> Kinds {
        let mut kinds = Kinds::default();
        for n in 0..nodes.len() {
            kinds.of.push(Vec::new());
            kinds.node_changed(nodes, n);
        }
        kinds
    }

    fn id(&mut self, gpu: &GpuState, bound: bool) -> usize {
        let ids = self.ids.entry((kind_hash(gpu, bound), bound)).or_default();
        if let Some(&id) = ids.iter().find(|&&id| same_kind(&self.sample[id], gpu, bound)) {
            return id;
        }
        let id = self.sample.len();
        ids.push(id);
        self.sample.push(gpu.clone());
        id
    }

    /// Node `n`'s GPUs changed (a claim seated a job there).
    pub(super) fn node_changed(&mut self, nodes: &[NodeGpus], n: usize) {
        let of = nodes[n]
            .gpus
            .iter()
            .map(|g| (self.id(g, true), self.id(g, false)))
            .collect();
        self.of[n] = of;
    }

    /// How many kinds there are.
    pub(super) fn len(&self) -> usize {
        self.sample.len()
    }

    /// One GPU of each kind.
    pub(super) fn samples(&self) -> &[GpuState] {
        &self.sample
    }
}

/// What a kind of GPU is to one job: whether it may join it (eligible and guarded), and if
/// so its score, as [`placement::place`] would score it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Worth {
    /// Of the model and index the job asked for.
    pub eligible: bool,
    /// Eligible, and [`guarded`] lets the job join it.
    pub open: bool,
    /// `Some((gain, residents, least gain))`: a slot it would take; `None`: refused there.
    pub score: Option<(f64, usize, f64)>,
}

/// One job's [`Worth`] of each kind, scored on first use.
pub(super) struct Weighed<'a> {
    job: &'a Candidate,
    history: &'a Estimates,
    knobs: Knobs,
    worth: Vec<Option<Worth>>,
}

impl<'a> Weighed<'a> {
    pub(super) fn new(job: &'a Candidate, history: &'a Estimates, knobs: Knobs, kinds: &Kinds) -> Weighed<'a> {
        Weighed {
            job,
            history,
            knobs,
            worth: vec![None; kinds.len()],
        }
    }

    /// The worth of GPU `g` of node `n` to the job.
    pub(super) fn of(&mut self, kinds: &Kinds, n: usize, g: usize) -> Worth {
        let (bound, unbound) = kinds.of[n][g];
        let id = if self.job.gpu.is_some() { bound } else { unbound };
        if let Some(w) = self.worth.get(id).copied().flatten() {
            return w;
        }
        let gpu = &kinds.sample[id];
        let job = self.job;
        let eligible = job.model.as_ref().is_none_or(|m| &gpu.model == m) && job.gpu.is_none_or(|i| gpu.index == i);
        let open = eligible && guarded(gpu, job, self.history);
        let newcomer = placement::Newcomer {
            app: &job.app,
            mem_mb: job.mem_mb,
        };
        let score = open
            .then(|| placement::worth(gpu, &newcomer, self.history, self.knobs))
            .flatten();
        let w = Worth { eligible, open, score };
        if id >= self.worth.len() {
            self.worth.resize(id + 1, None);
        }
        self.worth[id] = Some(w);
        w
    }
}

/// [`placement::place`] on every node, the best of them: the highest gain, then the emptier
/// GPU, then Slurm's node order. Each kind of GPU is scored once ([`Kinds`]); the node that
/// wins is then placed on in full, for the decision's words.
pub(super) fn offer(nodes: &[NodeGpus], job: &Candidate, history: &Estimates, knobs: Knobs, kinds: &Kinds) -> Offer {
    let mut weighed = Weighed::new(job, history, knobs, kinds);
    let mut best: Option<(usize, f64, usize)> = None;
    let mut never = Vec::new();
    let (mut any_gpu, mut eligible_nodes) = (false, 0);
    for (n, node) in nodes.iter().enumerate() {
        if job.nodes.as_ref().is_some_and(|allowed| !allowed.contains(&node.node)) {
            continue;
        }
        let (eligible, seen) = node_offer(node, n, job, knobs, kinds, &mut weighed);
        any_gpu |= eligible;
        eligible_nodes += usize::from(eligible);
        match seen {
            Seen::Gain(gain, residents) => {
                if best.is_none_or(|b| gain - b.1 > 1e-9 || ((gain - b.1).abs() <= 1e-9 && residents < b.2)) {
                    best = Some((n, gain, residents));
                }
            }
            Seen::Never => {
                // It could never fit here: placement says why.
                let gpus = open_gpus(node, job, history).0;
                if let Decision::Decline {
                    may_retry: false,
                    reason,
                } = placement::place(&gpus, &newcomer(job), history, knobs)
                {
                    never.push(reason);
                }
            }
            Seen::Nothing => {}
        }
    }
    match best {
        Some((node, _, _)) => {
            let gpus = open_gpus(&nodes[node], job, history).0;
            match placement::place(&gpus, &newcomer(job), history, knobs) {
                decision @ Decision::Place { gain, .. } => Offer::Gain { node, decision, gain },
                decision => unreachable!("the node's scores said it takes the job: {decision:?}"),
            }
        }
        None if !any_gpu => Offer::Never(match &job.model {
            Some(m) => format!("no shared GPU of the cluster is of model {m}"),
            None => "the cluster has no shared GPU".into(),
        }),
        // Every node that has its GPUs says it could never hold it.
        None if never.len() == eligible_nodes => Offer::Never(never.swap_remove(0)),
        None => Offer::Wait,
    }
}

/// What one node is to a job, as [`placement::place`] would decide on its open GPUs.
enum Seen {
    /// Its best slot: the gain, and how many jobs run there.
    Gain(f64, usize),
    /// None of its GPUs could ever hold the job (memory).
    Never,
    /// No slot worth taking now, or no GPU open to the job.
    Nothing,
}

/// Node `n` for `job` from its GPUs' kinds: whether it has a GPU of the job's model and
/// index at all, and what it offers.
fn node_offer(
    node: &NodeGpus,
    n: usize,
    job: &Candidate,
    knobs: Knobs,
    kinds: &Kinds,
    weighed: &mut Weighed,
) -> (bool, Seen) {
    let (mut eligible, mut open, mut largest) = (false, false, 0);
    let mut best: Option<(f64, usize, f64)> = None;
    for (g, gpu) in node.gpus.iter().enumerate() {
        let w = weighed.of(kinds, n, g);
        eligible |= w.eligible;
        if !w.open {
            continue;
        }
        open = true;
        largest = largest.max(gpu.memory_mb);
        if let Some((gain, residents, least)) = w.score {
            // placement's own order: the higher gain, then the emptier GPU, then the first.
            if best.is_none_or(|b| gain - b.0 > 1e-9 || ((gain - b.0).abs() <= 1e-9 && residents < b.1)) {
                best = Some((gain, residents, least));
            }
        }
    }
    let seen = match best {
        _ if !open => Seen::Nothing,
        _ if job.mem_mb.is_some_and(|need| need > largest) => Seen::Never,
        // A share worth too little: placement declines it.
        Some((gain, residents, least)) if knobs.min_gain > 0.0 && residents > 0 && gain < least => Seen::Nothing,
        Some((gain, residents, _)) => Seen::Gain(gain, residents),
        None => Seen::Nothing,
    };
    (eligible, seen)
}
