//! The GPUs of a large cluster fall into few kinds as a claim sees them: a GPU's worth to a
//! job depends only on its model, its memory, its index where the job is bound to one, and
//! who runs on it (their applications, memory and put-back notes), never on its node. So one
//! look scores each kind once per job ([`placement::place`]'s own scoring), and weighing a
//! job against every GPU of the cluster is a lookup per GPU: at 1,000 nodes of 8 GPUs, a few
//! dozen kinds instead of 8,000 scorings (`cargo bench -p multiplexd --bench claim`).

use super::{guarded, Candidate, NodeGpus};
use crate::placement::{self, Estimates, GpuState, Knobs};
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
