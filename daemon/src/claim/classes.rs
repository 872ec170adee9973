//! The GPUs of a large cluster fall into few kinds as a claim sees them: a GPU's worth to a
//! job depends only on its model, its memory, its index where the job is bound to one, and
//! who runs on it (their applications, memory and put-back notes), never on its node. So one
//! look scores each kind once per job ([`placement::place`]'s own scoring), and weighing a
//! job against every GPU of the cluster is a lookup per GPU: at 1,000 nodes of 8 GPUs, a few
//! dozen kinds instead of 8,000 scorings (`cargo bench -p multiplexd --bench claim`).

use super::{guarded, may_run, newcomer, open_gpus, Candidate, NodeGpus, Offer};
use crate::placement::{self, Decision, Estimates, GpuState, Knobs};
use std::collections::{BTreeSet, HashMap, HashSet};

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

/// The kind of every GPU of a look's nodes, kept as claims seat jobs, and which GPUs of each
/// kind have a free slot (in Slurm's node order, then the node's GPU order): a job's offer
/// weighs each kind with a free GPU once and walks only the GPUs of the kinds that win.
#[derive(Debug, Default)]
pub(super) struct Kinds {
    /// The kinds by hash (bound or not): their ids.
    ids: HashMap<(u64, bool), Vec<usize>>,
    /// Per node, per GPU (in the node's order): its kind, and its kind as jobs bound to no
    /// index see it.
    of: Vec<Vec<(usize, usize)>>,
    /// One GPU of each kind, to score.
    sample: Vec<GpuState>,
    /// Per kind: whether it is a kind as jobs bound to an index see it.
    bound: Vec<bool>,
    /// Per kind: its GPUs with a free slot, as (node, GPU position in the node).
    free: Vec<BTreeSet<(usize, usize)>>,
    /// How many GPUs have a free slot.
    free_gpus: usize,
    /// How many jobs a GPU holds.
    slots: u32,
}

impl Kinds {
    pub(super) fn new(nodes: &[NodeGpus], slots: u32) -> Kinds {
        let mut kinds = Kinds {
            slots,
            ..Kinds::default()
        };
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
        self.bound.push(bound);
        self.free.push(BTreeSet::new());
        id
    }

    /// Node `n`'s GPUs changed (a claim seated a job there).
    pub(super) fn node_changed(&mut self, nodes: &[NodeGpus], n: usize) {
        let old = std::mem::take(&mut self.of[n]);
        for (g, &(bound, unbound)) in old.iter().enumerate() {
            if self.free[bound].remove(&(n, g)) {
                self.free_gpus -= 1;
            }
            self.free[unbound].remove(&(n, g));
        }
        let mut of = Vec::with_capacity(nodes[n].gpus.len());
        for (g, gpu) in nodes[n].gpus.iter().enumerate() {
            let ids = (self.id(gpu, true), self.id(gpu, false));
            if (gpu.residents.len() as u32) < self.slots {
                self.free[ids.0].insert((n, g));
                self.free[ids.1].insert((n, g));
                self.free_gpus += 1;
            }
            of.push(ids);
        }
        self.of[n] = of;
    }

    /// How many kinds there are.
    pub(super) fn len(&self) -> usize {
        self.sample.len()
    }

    /// One GPU of each kind that has a GPU with a free slot, as jobs bound to an index see
    /// them (`bound`) or as the others do.
    pub(super) fn free_samples(&self, bound: bool) -> impl Iterator<Item = &GpuState> {
        (self.sample.iter().zip(&self.free).zip(&self.bound))
            .filter(move |((_, f), &b)| !f.is_empty() && b == bound)
            .map(|((g, _), _)| g)
    }

    /// Whether any GPU has a free slot.
    pub(super) fn any_free(&self) -> bool {
        self.free_gpus > 0
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
        self.kind(kinds, if self.job.gpu.is_some() { bound } else { unbound })
    }

    /// The worth of kind `id` to the job.
    fn kind(&mut self, kinds: &Kinds, id: usize) -> Worth {
        if let Some(w) = self.worth.get(id).copied().flatten() {
            return w;
        }
        let gpu = &kinds.sample[id];
        let job = self.job;
        let eligible = may_run(gpu, job);
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

/// [`offer_by_node`]'s answer from the kinds' free GPUs alone: each kind with a free GPU is
/// scored once, and only the GPUs of the kinds that score best are walked, so an offer costs
/// in proportion to the kinds, not to the cluster's GPUs.
///
/// A node's offer is its best GPU (the highest gain, then the emptier GPU, then the first), and
/// a node whose best is a share worth too little offers nothing (placement declines there);
/// the cluster's offer is the best node's, Slurm's node order breaking ties. So the kinds are
/// walked from the best score down, the fewer residents first on a tie: the first node met
/// through a kind worth taking wins, and a node first met through a kind worth too little
/// offers nothing further down. Where nothing is offered and the job's memory could decide
/// that it fits nowhere (or it names its nodes), [`offer_by_node`] says which.
pub(super) fn offer(nodes: &[NodeGpus], job: &Candidate, history: &Estimates, knobs: Knobs, kinds: &Kinds) -> Offer {
    let mut weighed = Weighed::new(job, history, knobs, kinds);
    let bound = job.gpu.is_some();
    // Every kind with a free GPU that takes the job: (gain, residents, worth taking, kind).
    let mut scored: Vec<(f64, usize, bool, usize)> = Vec::new();
    for id in 0..kinds.len() {
        if kinds.bound[id] != bound || kinds.free[id].is_empty() {
            continue;
        }
        if let Some((gain, residents, least)) = weighed.kind(kinds, id).score {
            let taken = !(knobs.min_gain > 0.0 && residents > 0 && gain < least);
            scored.push((gain, residents, taken, id));
        }
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let allowed: Option<HashSet<usize>> =
        (job.nodes.as_ref()).map(|names| (0..nodes.len()).filter(|&i| names.contains(&nodes[i].node)).collect());
    let may = |n: usize| allowed.as_ref().is_none_or(|a| a.contains(&n));
    // Nodes whose best GPU is a share worth too little: they offer nothing.
    let mut declined: HashSet<usize> = HashSet::new();
    let mut rest = &scored[..];
    while let Some(&(top, ..)) = rest.first() {
        // Gains within placement's tolerance of the best are a tie.
        let tied = rest.iter().take_while(|s| top - s.0 <= 1e-9).count();
        let (mut group, after) = rest.split_at(tied);
        rest = after;
        let mut by_residents: Vec<(f64, usize, bool, usize)> = group.to_vec();
        by_residents.sort_by_key(|s| s.1);
        group = &by_residents;
        while let Some(&(_, residents, ..)) = group.first() {
            let same = group.iter().take_while(|s| s.1 == residents).count();
            let (level, next) = group.split_at(same);
            group = next;
            if let Some(node) = first_taken(kinds, level, &may, &mut declined) {
                let gpus = open_gpus(&nodes[node], job, history).0;
                return match placement::place(&gpus, &newcomer(job), history, knobs) {
                    decision @ Decision::Place { gain, .. } => Offer::Gain { node, decision, gain },
                    decision => unreachable!("the node's scores said it takes the job: {decision:?}"),
                };
            }
        }
    }
    nothing_offered(nodes, job, history, knobs, kinds)
}

/// Where no GPU offers `job` a slot: it waits, unless no GPU could ever hold it. Where its
/// memory could decide that (more than some GPU has) or it names its nodes,
/// [`offer_by_node`] says which.
fn nothing_offered(nodes: &[NodeGpus], job: &Candidate, history: &Estimates, knobs: Knobs, kinds: &Kinds) -> Offer {
    let smallest = kinds.sample.iter().map(|g| g.memory_mb).min().unwrap_or(0);
    if job.nodes.is_some() || job.mem_mb.is_some_and(|m| m > smallest) {
        return match offer_by_node(nodes, job, history, knobs, kinds) {
            Offer::Gain { .. } => unreachable!("a node offered what its kinds did not"),
            other => other,
        };
    }
    let bound = job.gpu.is_some();
    let any_gpu = (kinds.sample.iter().zip(&kinds.bound)).any(|(g, &b)| b == bound && may_run(g, job));
    if any_gpu {
        Offer::Wait
    } else {
        no_gpu_of_its_model(job)
    }
}

/// Among the free GPUs of `level`'s kinds (scored alike), the node met first in Slurm's order
/// whose first GPU there is of a kind worth taking; the nodes met first through a kind worth
/// too little are `declined` from then on.
fn first_taken(
    kinds: &Kinds,
    level: &[(f64, usize, bool, usize)],
    may: &dyn Fn(usize) -> bool,
    declined: &mut HashSet<usize>,
) -> Option<usize> {
    let open = |&&(n, _): &&(usize, usize)| may(n) && !declined.contains(&n);
    if level.iter().all(|s| s.2) {
        // All worth taking (an idle GPU always is): the first node of any of them.
        return level
            .iter()
            .filter_map(|s| kinds.free[s.3].iter().find(open).map(|&(n, _)| n))
            .min();
    }
    let mut gpus: Vec<(usize, usize, bool)> = level
        .iter()
        .flat_map(|s| kinds.free[s.3].iter().filter(open).map(move |&(n, g)| (n, g, s.2)))
        .collect();
    gpus.sort_unstable();
    let mut met = HashSet::new();
    for (n, _, taken) in gpus {
        if !met.insert(n) {
            continue;
        }
        if taken {
            return Some(n);
        }
        declined.insert(n);
    }
    None
}

/// The refusal of a job no GPU of the cluster is of the model (and index) of.
fn no_gpu_of_its_model(job: &Candidate) -> Offer {
    Offer::Never(match &job.model {
        Some(m) => format!("no shared GPU of the cluster is of model {m}"),
        None => "the cluster has no shared GPU".into(),
    })
}

/// [`placement::place`] on every node, the best of them: the highest gain, then the emptier
/// GPU, then Slurm's node order. Each kind of GPU is scored once ([`Kinds`]); the node that
/// wins is then placed on in full, for the decision's words.
pub(super) fn offer_by_node(
    nodes: &[NodeGpus],
    job: &Candidate,
    history: &Estimates,
    knobs: Knobs,
    kinds: &Kinds,
) -> Offer {
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
        None if !any_gpu => no_gpu_of_its_model(job),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{PairEstimate, Resident};

    /// A drawn cluster and job: models and memories that differ, GPUs full, shared and idle,
    /// residents with and without memory and put-back notes, pairs measured, failed and never
    /// seen, jobs bound to an index, asking for a model or for nodes, with and without memory.
    struct Draw(u64);

    impl Draw {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
        fn pick<'a>(&mut self, of: &[&'a str]) -> &'a str {
            of[self.next(of.len() as u64) as usize]
        }
        fn memory(&mut self) -> Option<u64> {
            (self.next(2) == 0).then(|| 2000 + 2000 * self.next(12))
        }
        fn put_back(&mut self, apps: &[&str]) -> Option<Vec<String>> {
            (self.next(5) == 0).then(|| vec![self.pick(apps).to_string()])
        }
    }

    const APPS: [&str; 4] = ["a", "b", "c", "d"];
    const MODELS: [&str; 2] = ["v100", "a100"];

    fn cluster(d: &mut Draw, slots: u32) -> Vec<NodeGpus> {
        (0..1 + d.next(6))
            .map(|n| NodeGpus {
                node: format!("n{n}"),
                gpus: (0..1 + d.next(4) as u32)
                    .map(|index| {
                        let model = d.pick(&MODELS).to_string();
                        GpuState {
                            index,
                            memory_mb: if model == "v100" { 16384 } else { 40960 },
                            model,
                            residents: (0..d.next(u64::from(slots) + 1))
                                .map(|r| Resident {
                                    job_id: 100 * n as u32 + 10 * index + r as u32,
                                    app: d.pick(&APPS).to_string(),
                                    mem_mb: d.memory(),
                                    put_back: d.put_back(&APPS),
                                })
                                .collect(),
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    fn history(d: &mut Draw) -> Estimates {
        let mut h = Estimates::default();
        for model in MODELS {
            for a in APPS {
                for b in APPS {
                    if d.next(3) > 0 {
                        h.insert_pair(
                            model,
                            a,
                            b,
                            PairEstimate {
                                speed: 0.2 + 0.1 * d.next(9) as f64,
                                other_speed: 0.2 + 0.1 * d.next(9) as f64,
                                observations: d.next(4) as u32,
                                oom: d.next(6) == 0,
                            },
                        );
                    }
                }
            }
        }
        h
    }

    fn job(d: &mut Draw, nodes: &[NodeGpus]) -> Candidate {
        Candidate {
            job_id: 1,
            app: d.pick(&APPS).to_string(),
            mem_mb: if d.next(6) == 0 { Some(30000) } else { d.memory() },
            model: (d.next(3) == 0).then(|| d.pick(&MODELS).to_string()),
            gpu: (d.next(3) == 0).then(|| d.next(4) as u32),
            nodes: (d.next(4) == 0).then(|| {
                nodes
                    .iter()
                    .filter(|_| d.next(2) == 0)
                    .map(|n| n.node.clone())
                    .collect()
            }),
            put_back: d.put_back(&APPS),
        }
    }

    #[test]
    fn the_offer_from_the_kinds_free_gpus_is_the_offer_of_every_node_weighed_in_turn() {
        let (mut gains, mut waits, mut nevers) = (0, 0, 0);
        for seed in 0..3000 {
            let mut d = Draw(seed);
            let slots = 2 + d.next(2) as u32;
            let knobs = Knobs {
                slots,
                unknown_pair_speed: 0.5 + 0.1 * d.next(4) as f64,
                min_gain: [0.0, 0.25, 0.5][d.next(3) as usize],
                share_queue: 0.0,
                separate_below: 0.0,
            };
            let nodes = cluster(&mut d, slots);
            let history = history(&mut d);
            let kinds = Kinds::new(&nodes, slots);
            for _ in 0..4 {
                let job = job(&mut d, &nodes);
                let by_node = offer_by_node(&nodes, &job, &history, knobs, &kinds);
                assert_eq!(
                    offer(&nodes, &job, &history, knobs, &kinds),
                    by_node,
                    "seed {seed}: {job:?} on {nodes:?}"
                );
                match by_node {
                    Offer::Gain { .. } => gains += 1,
                    Offer::Wait => waits += 1,
                    Offer::Never(_) => nevers += 1,
                }
            }
        }
        // The draws reach every answer, often.
        assert!(gains > 1000 && waits > 500 && nevers > 100, "{gains} {waits} {nevers}");
    }
}
