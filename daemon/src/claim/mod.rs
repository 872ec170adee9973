//! The cluster's choice: which pending multiplexed job takes which free GPU slot of which node,
//! before Slurm allocates it. Pure, on the placement code: no I/O, no clock. The claimer
//! ([`crate::claimer`]) feeds it Slurm's own books (what runs where, what waits in which
//! order) and the history's estimates; the simulator feeds it its world.
//!
//! One look at the cluster claims jobs one at a time, each for the GPU where [`place`] puts it
//! across every node (an idle GPU beats a shared slot, so a burst spreads; a good partner
//! beats a poor one), and counts it there before the next is chosen. Among the first pending
//! jobs in Slurm's order, a later one goes first only when it gains more than the first by
//! [`STEER_MARGIN`], and no job is passed over more than [`Bypasses::MAX`] times: after that it
//! goes first wherever it has an offer, on the same terms as any job (a free GPU, or a share
//! worth its risk), so its wait is bounded by the next GPU that frees.

use std::collections::HashMap;

use crate::placement::{self, Decision, Estimates, GpuState, Knobs, Newcomer, Wanted};
pub use board::Board;
use classes::offer;

mod board;
mod classes;

/// One node's shared GPUs, with what runs on each and what was claimed for each (Slurm's books).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeGpus {
    pub node: String,
    pub gpus: Vec<GpuState>,
}

/// A pending multiplexed job, as the claim weighs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub job_id: u32,
    pub app: String,
    /// The memory it needs, MiB: its hint, else what its application's runs measured.
    pub mem_mb: Option<u64>,
    /// The GPU model it asked for (`--gres=gpu:MODEL:1`); `None`: any.
    pub model: Option<String>,
    /// The index of the GPU it must run on, on whichever node (`None`: any): where Slurm
    /// cannot move a pending job to another GPU type (22.05), a job waits on one GPU index
    /// from its submission and a claim chooses only the node.
    pub gpu: Option<u32>,
    /// The nodes it may run on (its `--nodelist`, less its `--exclude`); `None`: any.
    pub nodes: Option<Vec<String>>,
    /// Put back in the queue after it ran out of memory beside a partner, those partners'
    /// applications ([`crate::put_back`]): it runs next alone or beside partners known to fit.
    pub put_back: Option<Vec<String>>,
}

/// What one look decided for one job.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// Pin the job to this GPU of this node (indices into the look's nodes, GPU by its index).
    Pin {
        job: usize,
        node: usize,
        gpu: u32,
        partners: Vec<u32>,
        predicted_speed: f64,
        gain: f64,
        reason: String,
    },
    /// No GPU of the cluster could ever hold it (memory): refused with the reason.
    Refuse { job: usize, reason: String },
}

/// What [`choose_on`] reads of the history for `pending` on `board`.
pub fn wanted(board: &Board, pending: &[Candidate]) -> Wanted {
    let mut w = Wanted::default();
    // Each kind of GPU asks for the same pairs wherever it is; a full one asks for none.
    for job in pending {
        let samples = board.kinds().free_samples(job.gpu.is_some());
        let gpus: Vec<GpuState> = samples.filter(|g| may_run(g, job)).cloned().collect();
        w.extend(placement::wanted(&gpus, &newcomer(job), board.slots()));
    }
    w
}

fn newcomer(job: &Candidate) -> Newcomer<'_> {
    Newcomer {
        app: &job.app,
        mem_mb: job.mem_mb,
    }
}

/// Whether `job` may run on `gpu`: of the model it asked for, and the one index it is bound
/// to, if any.
fn may_run(gpu: &GpuState, job: &Candidate) -> bool {
    job.model.as_ref().is_none_or(|m| &gpu.model == m) && job.gpu.is_none_or(|i| gpu.index == i)
}

/// The GPUs of a node that `job` may run on ([`may_run`]).
fn eligible(gpus: &[GpuState], job: &Candidate) -> Vec<GpuState> {
    gpus.iter().filter(|g| may_run(g, job)).cloned().collect()
}

/// The GPUs of `node` that `job` may join now ([`eligible`] and [`guarded`]), and whether the
/// node has any it may run on at all.
fn open_gpus(node: &NodeGpus, job: &Candidate, history: &Estimates) -> (Vec<GpuState>, bool) {
    let mut gpus = eligible(&node.gpus, job);
    let any = !gpus.is_empty();
    gpus.retain(|g| guarded(g, job, history));
    (gpus, any)
}

/// Whether `job` may join `gpu` as far as jobs put back are concerned ([`crate::put_back`]):
/// a job put back after running out of memory beside a partner runs next alone or beside
/// partners known to fit, so it joins only residents whose pair with it ran on this model
/// without running out of memory (a speed measured on both sides, no out-of-memory mark
/// either way: a resident reports progress beside a newcomer about to run out of memory, and
/// that speed may reach the claimer before the failure does). And the pair it failed in is
/// never made again either way round: the partners its note names are ruled out even before
/// the history hears of the failure (what another node learns reaches the claimer up to
/// [`outcome_s`] later, and a job put back is claimed again within seconds).
///
/// Others may join a resident put back on any pair but the one it failed in: guarding it
/// against every pair not known to fit cost 12-13% of average JCT on the `most-oom` table at
/// load 1.5 (three seeds) and saved 1 to 3 failures per 1,000 jobs
/// (docs/notebook/2026-11-results.md, "Putting back").
fn guarded(gpu: &GpuState, job: &Candidate, history: &Estimates) -> bool {
    let named =
        |put_back: &Option<Vec<String>>, app: &str| put_back.as_ref().is_some_and(|b| b.iter().any(|a| a == app));
    gpu.residents.iter().all(|r| {
        if named(&job.put_back, &r.app) || named(&r.put_back, &job.app) {
            return false;
        }
        if job.put_back.is_none() {
            return true;
        }
        let row = |a: &str, b: &str| history.pair(&gpu.model, a, b);
        let (mine, theirs) = (row(&job.app, &r.app), row(&r.app, &job.app));
        let measured = [mine, theirs].iter().all(|e| e.is_some_and(|e| e.observations > 0));
        let failed = [mine, theirs].iter().flatten().any(|e| e.oom);
        measured && !failed
    })
}

/// Where one job would go now across the cluster.
#[derive(Debug, Clone, PartialEq)]
enum Offer {
    /// Its best GPU: node index and the placement.
    Gain { node: usize, decision: Decision, gain: f64 },
    /// No slot is worth taking (or none fits) now; a better one may come.
    Wait,
    /// No GPU of the cluster could ever hold it.
    Never(String),
}

/// What the claimer remembers from one look to the next.
#[derive(Debug, Default)]
pub struct Memory {
    /// How often each pending job was passed over.
    pub bypasses: Bypasses,
    /// The pairs never seen together that claims put together, until their outcome is known.
    pub trials: Trials,
}

/// How long after a job left Slurm's books what it taught reaches the claimer's history, where
/// the nodes exchange what they learn every `share_every_s`: its node writes it at its next
/// exchange, the claimer's node reads it at its own, each up to `share_every_s` later, and
/// learning and writing take a few seconds more (measured in docs/notebook/2026-11-results.md).
pub fn outcome_s(share_every_s: f64) -> f64 {
    2.0 * share_every_s + 10.0
}

impl Memory {
    /// A claimer's memory whose history learns what other nodes' jobs did `outcome_s` after
    /// it happened at most ([`outcome_s`]).
    pub fn new(outcome_s: f64) -> Memory {
        Memory {
            bypasses: Bypasses::default(),
            trials: Trials {
                outcome_s,
                pairs: HashMap::new(),
            },
        }
    }
}

/// Pairs never seen together (and whose memory does not say they fit) that a claim put
/// together: until the history knows how such a pair went (a speed, or that it ran out of
/// memory), no second job is claimed into it. What another node's job teaches reaches the
/// claimer through `[share] dir` up to `share.every_s` later; without this, each job of a pair
/// that does not fit arriving meanwhile would be claimed into the same failure. A trial ends when the history knows the pair, when
/// its job has run [`Trials::PROVEN_S`] (the pair fits: it is no longer a gamble on memory,
/// though its speed may be unknown until the job reports or ends), or `outcome_s` after its
/// job left Slurm's books without the history learning the pair (a job cancelled, or failed
/// otherwise than out of memory, teaches nothing).
#[derive(Debug, Default)]
pub struct Trials {
    outcome_s: f64,
    /// The pair ([`crate::types::trial_key`]) and its trial.
    pairs: HashMap<(String, String, String), Trial>,
}

/// One pair's trial.
#[derive(Debug, Clone, Copy)]
struct Trial {
    /// The job trying it.
    job: u32,
    /// When it was claimed.
    claimed: f64,
    /// When it was last seen in Slurm's books.
    seen: f64,
    /// Whether it was there at the last look.
    there: bool,
}

impl Trials {
    /// How long a job of a pair never tried must have run for the pair to count as fitting in
    /// memory: a training job runs out of memory as it builds its model and takes its first
    /// steps, within its first minutes.
    pub const PROVEN_S: f64 = 300.0;

    /// How many pairs are being tried.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether no pair is being tried.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// When a trial ends on time alone, if nothing else happens first: its job, there at the
    /// last look, reaches [`Self::PROVEN_S`]; or, gone, its outcome's time runs out. A claimer
    /// that looks only when something changes (the simulator's) looks again then.
    pub fn next_end(&self) -> Option<f64> {
        self.pairs
            .values()
            .map(|t| {
                if t.there {
                    t.claimed + Self::PROVEN_S
                } else {
                    t.seen + self.outcome_s
                }
            })
            .min_by(f64::total_cmp)
    }

    /// Forgets the trials whose outcome `history` knows or that ended long enough ago, and
    /// hands the others to `history`, where placement reads them. `present`: whether a job is
    /// in Slurm's books (holding a slot, or waiting).
    fn lend(&mut self, present: impl Fn(u32) -> bool, history: &mut Estimates, now: f64) {
        let outcome_s = self.outcome_s;
        self.pairs.retain(|(model, a, b), t| {
            let known = |x: &str, y: &str| history.pair(model, x, y).is_some_and(|e| e.observations > 0 || e.oom);
            if known(a, b) || known(b, a) {
                return false;
            }
            t.there = present(t.job);
            if t.there {
                t.seen = now;
                return now - t.claimed < Self::PROVEN_S;
            }
            now - t.seen < outcome_s
        });
        for ((model, a, b), t) in &self.pairs {
            history.try_pair(model, a, b, t.job);
        }
    }

    /// Takes back from `history` the trials of this look, new ones first seen `now`.
    fn take_back(&mut self, history: &mut Estimates, now: f64) {
        for (key, job) in history.take_trying() {
            self.pairs.entry(key).or_insert(Trial {
                job,
                claimed: now,
                seen: now,
                there: true,
            });
        }
    }
}

/// What one look decides on: Slurm's books as [`choose`] weighs them (each job's memory filled
/// in where known) and the estimates it reads. The claimer's scorer builds it
/// ([`crate::claimer::Scorer`]): from the daemon's history, or in the simulator's oracle from
/// the true table.
pub struct Inputs {
    pub nodes: Vec<NodeGpus>,
    pub pending: Vec<Candidate>,
    pub estimates: Estimates,
    pub knobs: Knobs,
}

impl Inputs {
    /// The look's claims ([`choose`]) at `now` (seconds of a steady clock).
    pub fn choose(mut self, memory: &mut Memory, now: f64) -> Vec<Choice> {
        choose(&self.nodes, &self.pending, &mut self.estimates, self.knobs, memory, now)
    }
}

/// Claims for `pending` (the first pending multiplexed jobs, in Slurm's order) on `nodes`
/// ([`choose_on`] on a board of them).
pub fn choose(
    nodes: &[NodeGpus],
    pending: &[Candidate],
    history: &mut Estimates,
    knobs: Knobs,
    memory: &mut Memory,
    now: f64,
) -> Vec<Choice> {
    let mut board = Board::new(nodes.to_vec(), knobs.slots);
    choose_on(&mut board, pending, pending.len(), history, knobs, memory, now)
}

/// Claims for `pending` (the first pending multiplexed jobs, in Slurm's order) on `board`, one
/// job at a time, each seated on its GPU for the rest of the look ([`Board::end_look`] takes
/// them off) before the next is chosen, until no slot is free or no job would take one.
/// `waiting` is how many jobs wait for a claim in all, `pending` and those behind it
/// ([`queue_pays_for`]). `history` must hold what [`wanted`] asks for; `memory` is what the
/// claimer keeps across looks (how often each job was passed over, the pairs being tried),
/// `now` in seconds of any steady clock.
pub fn choose_on(
    board: &mut Board,
    pending: &[Candidate],
    waiting: usize,
    history: &mut Estimates,
    knobs: Knobs,
    memory: &mut Memory,
    now: f64,
) -> Vec<Choice> {
    let present = |id: u32| board.holds(id) || pending.iter().any(|c| c.job_id == id);
    memory.trials.lend(present, history, now);
    let choices = choose_with(board, pending, waiting, history, knobs, &mut memory.bypasses);
    memory.trials.take_back(history, now);
    choices
}

/// Whether `waiting` jobs are queue enough for a share that adds `gain` (jobs' worth of
/// throughput) on one of `gpus` GPUs: more than `share_queue x gpus x (1 - gain)` (the knob
/// `policy.share_queue`; 0: any queue).
///
/// Why: with every GPU busy, a GPU frees for the first job waiting about every `T / gpus` (`T`
/// a job's runtime), so sharing now saves the `waiting` jobs about `waiting x T / gpus` of
/// waiting in all; it costs the two jobs sharing `1 - gain` of a job's speed while they share,
/// a fair part of `T`. Where few wait on many GPUs, a GPU frees sooner than sharing pays.
/// Over every pair table at loads 0.5, 1.0 and 1.5, 0.25 finished jobs sooner than sharing
/// whatever waits in 14 cells of 18 and later in 2 (where every pair gains, at loads 1.0 and
/// 1.5, by 0.4 and 1.4 points); 0.5 held back shares that table needed at load 1.0, 0.125
/// lost less there and 3.5 points more on the V100 table at load 1.5
/// (docs/notebook/2026-11-results.md, "When a share pays").
pub fn queue_pays_for(waiting: usize, gain: f64, gpus: usize, share_queue: f64) -> bool {
    waiting as f64 > share_queue * gpus as f64 * (1.0 - gain)
}

/// Each share among `offers` that `waiting` jobs are too short a queue for
/// ([`queue_pays_for`]) waits for a GPU to free instead.
fn unpaid_shares_wait(offers: &mut [(Offer, bool)], waiting: usize, gpus: usize, share_queue: f64) {
    for (o, _) in offers {
        if let Offer::Gain {
            decision: Decision::Place { corunners, gain, .. },
            ..
        } = o
        {
            if !corunners.is_empty() && !queue_pays_for(waiting, *gain, gpus, share_queue) {
                *o = Offer::Wait;
            }
        }
    }
}

fn choose_with(
    board: &mut Board,
    pending: &[Candidate],
    waiting: usize,
    history: &mut Estimates,
    knobs: Knobs,
    bypasses: &mut Bypasses,
) -> Vec<Choice> {
    let mut left: Vec<usize> = (0..pending.len()).collect();
    // The jobs waiting behind those this look weighs.
    let behind = waiting.saturating_sub(pending.len());
    let gpus: usize = board.nodes().iter().map(|n| n.gpus.len()).sum();
    let mut out = Vec::new();
    while !left.is_empty() && board.kinds().any_free() {
        let ids: Vec<u32> = left.iter().map(|&i| pending[i].job_id).collect();
        // Passed over too often: it goes first wherever it has an offer, but on the same terms
        // as any job (a free GPU or a share worth its risk; a lower bar was measured slower,
        // docs/notebook/2026-11-results.md).
        let mut offers: Vec<(Offer, bool)> = left
            .iter()
            .map(|&i| {
                let starved = bypasses.passed(pending[i].job_id) >= Bypasses::MAX;
                (
                    offer(board.nodes(), &pending[i], history, knobs, board.kinds()),
                    starved,
                )
            })
            .collect();
        unpaid_shares_wait(&mut offers, left.len() + behind, gpus, knobs.share_queue);
        let never = offers.iter().enumerate().find_map(|(k, (o, _))| match o {
            Offer::Never(reason) => Some((k, reason.clone())),
            _ => None,
        });
        if let Some((k, reason)) = never {
            out.push(Choice::Refuse { job: left[k], reason });
            left.remove(k);
            continue;
        }
        let Some(k) = pick(&offers) else { break };
        bypasses.passed_over(&ids, k);
        let (Offer::Gain { node, decision, .. }, _) = offers.swap_remove(k) else {
            unreachable!()
        };
        let choice = pin_choice(left[k], node, decision);
        if let Choice::Pin { gpu, .. } = &choice {
            seat(board, node, *gpu, &pending[left[k]], history);
        }
        out.push(choice);
        left.remove(k);
    }
    out
}

/// The claim of pending job `job` (its index) onto what placement decided for it on `node`.
fn pin_choice(job: usize, node: usize, decision: Decision) -> Choice {
    let Decision::Place {
        gpu,
        corunners,
        predicted_speed,
        gain,
        reason,
    } = decision
    else {
        unreachable!("an offer with a gain is a placement")
    };
    Choice::Pin {
        job,
        node,
        gpu,
        partners: corunners,
        predicted_speed,
        gain,
        reason,
    }
}

/// Which offer is taken: a starved job's with a slot first; else a later job's only if it
/// gains more than the first's by [`STEER_MARGIN`]; else the first's, if anything is worth
/// taking for it.
fn pick(offers: &[(Offer, bool)]) -> Option<usize> {
    let gain = |o: &Offer| match o {
        Offer::Gain { gain, .. } => Some(*gain),
        _ => None,
    };
    offers
        .iter()
        .position(|(o, starved)| *starved && gain(o).is_some())
        .or_else(|| {
            let first = gain(&offers[0].0);
            let mut best: Option<(usize, f64)> = None;
            for (k, (o, _)) in offers.iter().enumerate().skip(1) {
                if let Some(g) = gain(o) {
                    if g > first.unwrap_or(0.0) + STEER_MARGIN && best.is_none_or(|(_, b)| g > b + 1e-9) {
                        best = Some((k, g));
                    }
                }
            }
            best.map(|(k, _)| k).or(first.map(|_| 0))
        })
}

/// `job` claimed onto `gpu` of `node`: a resident there for the rest of the look, and each
/// pair never tried that this claim gambles on (as placement weighed it) is being tried from
/// now on.
fn seat(board: &mut Board, node: usize, gpu: u32, job: &Candidate, history: &mut Estimates) {
    let Some(g) = board.nodes()[node].gpus.iter().find(|g| g.index == gpu) else {
        return;
    };
    if !placement::memory_known(job.mem_mb, g) {
        for r in &g.residents {
            if placement::untried_pair(history.pair(&g.model, &job.app, &r.app)) {
                history.try_pair(&g.model, &job.app, &r.app, job.job_id);
            }
        }
    }
    let resident = placement::Resident {
        job_id: job.job_id,
        app: job.app.clone(),
        mem_mb: job.mem_mb,
        put_back: job.put_back.clone(),
    };
    board.seat_for_look(node, gpu, resident, job.mem_mb);
}

/// How much more a pending job behind the first must gain (jobs' worth of throughput) for
/// the claimer to claim it first ([`crate::claim`]): Slurm's own order stands between near
/// equals.
pub const STEER_MARGIN: f64 = 0.05;

/// The starvation bound of queue-level choice: how often each pending job was passed over.
/// A job passed over [`Bypasses::MAX`] times is never passed again: the choice looks no
/// further down Slurm's order than it.
#[derive(Debug, Default)]
pub struct Bypasses {
    passed: std::collections::HashMap<u32, u32>,
}

impl Bypasses {
    /// How often one job may be passed over (by one node's choices).
    pub const MAX: u32 = 4;
    /// Jobs remembered at most; past it the counts start again (a bound on memory, not on
    /// any job's wait: it takes thousands of choices).
    const KEPT: usize = 10_000;

    /// Lets `choose` pick among as many of `pending` (job ids in Slurm's order) as the bound
    /// allows (it is given how many), and counts the jobs its choice passes over. Nothing to
    /// choose from (fewer than two): `None`, without asking.
    pub fn choose<E>(
        &mut self,
        pending: &[u32],
        choose: impl FnOnce(usize) -> Result<Option<usize>, E>,
    ) -> Result<Option<usize>, E> {
        let reach = self.reach(pending);
        if reach < 2 {
            return Ok(None);
        }
        let chosen = choose(reach)?.filter(|&i| i < reach);
        if let Some(i) = chosen {
            self.record(pending, i);
        }
        Ok(chosen)
    }

    /// How many of `pending` (job ids in Slurm's order) the choice may look at: all, or up
    /// to the first that was passed over too often, which may still be chosen.
    fn reach(&self, pending: &[u32]) -> usize {
        pending
            .iter()
            .position(|id| self.passed.get(id).is_some_and(|&n| n >= Self::MAX))
            .map_or(pending.len(), |i| i + 1)
    }

    /// How often job `id` was passed over so far.
    pub fn passed(&self, id: u32) -> u32 {
        self.passed.get(&id).copied().unwrap_or(0)
    }

    /// `pending[chosen]` goes first: each job before it was passed over once more.
    pub fn passed_over(&mut self, pending: &[u32], chosen: usize) {
        self.record(pending, chosen);
    }

    /// `pending[chosen]` goes first: each job before it was passed over once more.
    fn record(&mut self, pending: &[u32], chosen: usize) {
        if self.passed.len() >= Self::KEPT {
            self.passed.clear();
        }
        for id in &pending[..chosen.min(pending.len())] {
            *self.passed.entry(*id).or_default() += 1;
        }
        if let Some(id) = pending.get(chosen) {
            self.passed.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{PairEstimate, Resident};

    fn knobs() -> Knobs {
        Knobs {
            slots: 2,
            unknown_pair_speed: 0.7,
            min_gain: 0.25,
            // Whatever waits: the queue's own rule is tested on its own.
            share_queue: 0.0,
            separate_below: 0.0,
        }
    }

    fn gpu(index: u32, residents: &[(u32, &str)]) -> GpuState {
        GpuState {
            index,
            model: "v100".into(),
            memory_mb: 16384,
            residents: residents
                .iter()
                .map(|&(job_id, app)| Resident {
                    job_id,
                    app: app.into(),
                    mem_mb: None,
                    put_back: None,
                })
                .collect(),
        }
    }

    fn node(name: &str, gpus: Vec<GpuState>) -> NodeGpus {
        NodeGpus {
            node: name.into(),
            gpus,
        }
    }

    fn job(job_id: u32, app: &str) -> Candidate {
        Candidate {
            job_id,
            app: app.into(),
            mem_mb: None,
            model: None,
            gpu: None,
            nodes: None,
            put_back: None,
        }
    }

    fn pair(h: &mut Estimates, a: &str, b: &str, sa: f64, sb: f64) {
        let e = |speed, other_speed| PairEstimate {
            speed,
            other_speed,
            observations: 5,
            oom: false,
        };
        h.insert_pair("v100", a, b, e(sa, sb));
        h.insert_pair("v100", b, a, e(sb, sa));
    }

    fn pins(choices: &[Choice]) -> Vec<(usize, usize, u32)> {
        choices
            .iter()
            .filter_map(|c| match c {
                Choice::Pin { job, node, gpu, .. } => Some((*job, *node, *gpu)),
                Choice::Refuse { .. } => None,
            })
            .collect()
    }

    /// One look's claims with no pair being tried (`choose`'s trials are tested on their own).
    fn choose_once(
        nodes: &[NodeGpus],
        pending: &[Candidate],
        history: &Estimates,
        knobs: Knobs,
        bypasses: &mut Bypasses,
    ) -> Vec<Choice> {
        choose_with(
            &mut Board::new(nodes.to_vec(), knobs.slots),
            pending,
            pending.len(),
            &mut history.clone(),
            knobs,
            bypasses,
        )
    }

    #[test]
    fn a_pair_never_tried_is_gambled_on_once_until_its_outcome_is_known() {
        // `r` runs on both GPUs; `a` was never seen beside it. The first `a` is claimed into
        // the gamble, the second waits for how it goes (it would fail too if the first does).
        let nodes = [
            node("n1", vec![gpu(0, &[(8, "r")])]),
            node("n2", vec![gpu(0, &[(9, "r")])]),
        ];
        let k = Knobs {
            min_gain: 0.0,
            ..knobs()
        };
        let mut memory = Memory::new(600.0);
        let mut h = Estimates::default();
        let got = choose(&nodes, &[job(1, "a"), job(2, "a")], &mut h, k, &mut memory, 0.0);
        assert_eq!(pins(&got), vec![(0, 0, 0)], "{got:?}");
        assert_eq!(memory.trials.len(), 1);
        // A later look, job 1 running beside 8: job 2 still waits, and a job of another
        // application takes the other slot.
        let mut running = nodes.clone();
        running[0].gpus[0].residents.push(Resident {
            job_id: 1,
            app: "a".into(),
            mem_mb: None,
            put_back: None,
        });
        let got = choose(
            &running,
            &[job(2, "a"), job(3, "c")],
            &mut Estimates::default(),
            k,
            &mut memory,
            5.0,
        );
        assert_eq!(pins(&got), vec![(1, 1, 0)], "{got:?}");
        // Job 1 failed and left; its failure has not reached this history yet: still waiting,
        // until `outcome_s` after it was last seen.
        let got = choose(&nodes, &[job(2, "a")], &mut Estimates::default(), k, &mut memory, 300.0);
        assert!(got.is_empty(), "{got:?}");
        let got = choose(&nodes, &[job(2, "a")], &mut Estimates::default(), k, &mut memory, 606.0);
        assert_eq!(pins(&got), vec![(0, 0, 0)], "forgotten: {got:?}");
        // Once the history knows the pair (here, it ran out of memory), the trial is over and
        // the pair is ruled out by what was learned.
        let mut known = Estimates::default();
        let oom = PairEstimate {
            speed: 0.0,
            other_speed: 0.0,
            observations: 0,
            oom: true,
        };
        known.insert_pair("v100", "a", "r", oom);
        known.insert_pair("v100", "r", "a", oom);
        let got = choose(&nodes, &[job(4, "a")], &mut known, k, &mut memory, 607.0);
        assert!(got.is_empty(), "{got:?}");
        assert!(memory.trials.is_empty(), "{:?}", memory.trials);
        // A trial whose job has run PROVEN_S beside its partner is over: the pair fits.
        let mut memory = Memory::new(600.0);
        choose(&nodes, &[job(1, "a")], &mut Estimates::default(), k, &mut memory, 0.0);
        let soon = choose(
            &running,
            &[job(2, "a")],
            &mut Estimates::default(),
            k,
            &mut memory,
            Trials::PROVEN_S - 1.0,
        );
        assert!(soon.is_empty(), "{soon:?}");
        let got = choose(
            &running,
            &[job(2, "a")],
            &mut Estimates::default(),
            k,
            &mut memory,
            Trials::PROVEN_S,
        );
        assert_eq!(pins(&got), vec![(0, 1, 0)], "{got:?}");
        // A pair whose memory is known to fit is no gamble: two such jobs go at once.
        let mut memory = Memory::new(600.0);
        let mut sized = nodes.clone();
        for n in &mut sized {
            n.gpus[0].residents[0].mem_mb = Some(4_000);
        }
        let with_memory = |id| Candidate {
            mem_mb: Some(4_000),
            ..job(id, "a")
        };
        let got = choose(
            &sized,
            &[with_memory(1), with_memory(2)],
            &mut Estimates::default(),
            k,
            &mut memory,
            0.0,
        );
        assert_eq!(pins(&got).len(), 2, "{got:?}");
        assert!(memory.trials.is_empty());
    }

    #[test]
    fn a_share_is_claimed_only_when_the_queue_is_long_enough_to_pay_for_it() {
        // 16 GPUs, each running one `r`; `a` beside `r` gains 0.4, `b` beside `r` 0.9. With
        // `share_queue` 0.25, a share of `a` takes more than 0.25 x 16 x 0.6 = 2.4 jobs
        // waiting, one of `b` more than 0.4.
        let mut h = Estimates::default();
        pair(&mut h, "a", "r", 0.7, 0.7);
        pair(&mut h, "b", "r", 0.95, 0.95);
        let busy = |free: bool| -> Vec<NodeGpus> {
            (0..4)
                .map(|n| {
                    let gpus = (0..4)
                        .map(|g| {
                            let id = 100 + 4 * n + g;
                            if free && id == 115 {
                                gpu(g, &[])
                            } else {
                                gpu(g, &[(id, "r")])
                            }
                        })
                        .collect();
                    node(&format!("n{n}"), gpus)
                })
                .collect()
        };
        let k = Knobs {
            share_queue: 0.25,
            ..knobs()
        };
        let claims = |nodes: Vec<NodeGpus>, app: &str, waiting: usize, k: Knobs| {
            let mut board = Board::new(nodes, k.slots);
            let got = choose_on(
                &mut board,
                &[job(1, app)],
                waiting,
                &mut h.clone(),
                k,
                &mut Memory::default(),
                0.0,
            );
            pins(&got)
        };
        // The jobs behind the one weighed count: 3 waiting pay for `a`'s share, 2 do not.
        assert_eq!(claims(busy(false), "a", 1, k), vec![]);
        assert_eq!(claims(busy(false), "a", 2, k), vec![]);
        assert_eq!(claims(busy(false), "a", 3, k).len(), 1);
        // A share that gains more pays sooner.
        assert_eq!(claims(busy(false), "b", 1, k).len(), 1);
        // A free GPU is taken whatever waits; with the knob at 0 any queue pays.
        assert_eq!(claims(busy(true), "a", 1, k), vec![(0, 3, 3)]);
        let any = Knobs { share_queue: 0.0, ..k };
        assert_eq!(claims(busy(false), "a", 1, any).len(), 1);
        // The rule itself, at its edge.
        assert!(!queue_pays_for(4, 0.5, 16, 0.5));
        assert!(queue_pays_for(5, 0.5, 16, 0.5));
        assert!(queue_pays_for(1, 1.2, 16, 0.5));
    }

    #[test]
    fn a_burst_spreads_over_idle_gpus_of_every_node_before_any_gpu_is_shared() {
        let nodes = [
            node("n1", vec![gpu(0, &[]), gpu(1, &[])]),
            node("n2", vec![gpu(0, &[]), gpu(1, &[])]),
        ];
        let pending: Vec<Candidate> = (1..=4).map(|i| job(i, "a")).collect();
        let got = pins(&choose_once(
            &nodes,
            &pending,
            &Estimates::default(),
            knobs(),
            &mut Bypasses::default(),
        ));
        let mut gpus: Vec<(usize, u32)> = got.iter().map(|&(_, n, g)| (n, g)).collect();
        gpus.sort_unstable();
        assert_eq!(gpus, vec![(0, 0), (0, 1), (1, 0), (1, 1)], "{got:?}");
        // In Slurm's order.
        assert_eq!(got.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn the_best_node_wins_not_the_first() {
        // n1's GPU holds a job `a` pairs badly with, n2's one it pairs well with.
        let mut h = Estimates::default();
        pair(&mut h, "a", "bad", 0.3, 0.3);
        pair(&mut h, "a", "good", 0.9, 0.9);
        let nodes = [
            node("n1", vec![gpu(0, &[(7, "bad")])]),
            node("n2", vec![gpu(0, &[(8, "good")])]),
        ];
        let got = choose_once(&nodes, &[job(1, "a")], &h, knobs(), &mut Bypasses::default());
        assert_eq!(pins(&got), vec![(0, 1, 0)], "{got:?}");
        let Choice::Pin { partners, .. } = &got[0] else {
            panic!()
        };
        assert_eq!(partners, &vec![8]);
    }

    #[test]
    fn a_later_job_that_pairs_better_goes_first_and_a_poor_share_waits() {
        let mut h = Estimates::default();
        pair(&mut h, "a", "r", 0.4, 0.4);
        pair(&mut h, "b", "r", 0.95, 0.95);
        let nodes = [node("n1", vec![gpu(0, &[(9, "r")])])];
        let mut bypasses = Bypasses::default();
        let got = pins(&choose_once(
            &nodes,
            &[job(1, "a"), job(2, "b")],
            &h,
            knobs(),
            &mut bypasses,
        ));
        assert_eq!(got, vec![(1, 0, 0)]);
        // `a` alone beside `r` would lose: no claim at all.
        let got = choose_once(&nodes, &[job(1, "a")], &h, knobs(), &mut bypasses);
        assert!(got.is_empty(), "{got:?}");
    }

    #[test]
    fn a_job_passed_over_too_often_goes_first_but_never_into_a_losing_share() {
        // `a` gains a little beside `s` and loses beside `r`; each `b` gains much beside `s`.
        let mut h = Estimates::default();
        pair(&mut h, "a", "r", 0.4, 0.4);
        pair(&mut h, "a", "s", 0.7, 0.7);
        pair(&mut h, "b", "r", 0.4, 0.4);
        pair(&mut h, "b", "s", 0.95, 0.95);
        let nodes = [node("n1", vec![gpu(0, &[(8, "r")]), gpu(1, &[(9, "s")])])];
        let mut bypasses = Bypasses::default();
        for round in 0..Bypasses::MAX {
            let got = pins(&choose_once(
                &nodes,
                &[job(1, "a"), job(100 + round, "b")],
                &h,
                knobs(),
                &mut bypasses,
            ));
            assert_eq!(got, vec![(1, 0, 1)], "round {round}");
        }
        // Now `a` takes the slot beside `s` first, whatever gains more behind it.
        let got = pins(&choose_once(
            &nodes,
            &[job(1, "a"), job(200, "b")],
            &h,
            knobs(),
            &mut bypasses,
        ));
        assert_eq!(got, vec![(0, 0, 1)]);
        // But starved or not, it never joins `r`: it waits for a free GPU or a better partner.
        let only_r = [node("n1", vec![gpu(0, &[(8, "r")])])];
        let got = choose_once(&only_r, &[job(1, "a")], &h, knobs(), &mut bypasses);
        assert!(got.is_empty(), "{got:?}");
    }

    #[test]
    fn a_starved_job_that_fits_nowhere_now_does_not_hold_back_the_others() {
        // `big` needs more memory than the shared GPU has left; `small` fits.
        let mut nodes = [node("n1", vec![gpu(0, &[(9, "r")])])];
        nodes[0].gpus[0].residents[0].mem_mb = Some(10_000);
        let mut bypasses = Bypasses::default();
        for id in 0..Bypasses::MAX {
            bypasses.passed_over(&[1, 50 + id], 1);
        }
        let pending = [
            Candidate {
                mem_mb: Some(9_000),
                ..job(1, "big")
            },
            job(2, "small"),
        ];
        let got = pins(&choose_once(
            &nodes,
            &pending,
            &Estimates::default(),
            Knobs {
                min_gain: 0.0,
                ..knobs()
            },
            &mut bypasses,
        ));
        assert_eq!(got, vec![(1, 0, 0)]);
    }

    #[test]
    fn a_job_no_gpu_could_ever_hold_is_refused_with_the_reason_and_one_of_another_model_too() {
        let nodes = [node("n1", vec![gpu(0, &[])])];
        let pending = [
            Candidate {
                mem_mb: Some(40_000),
                ..job(1, "huge")
            },
            Candidate {
                model: Some("a100".into()),
                ..job(2, "x")
            },
            job(3, "y"),
        ];
        let got = choose_once(
            &nodes,
            &pending,
            &Estimates::default(),
            knobs(),
            &mut Bypasses::default(),
        );
        let refused: Vec<(usize, &str)> = got
            .iter()
            .filter_map(|c| match c {
                Choice::Refuse { job, reason } => Some((*job, reason.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(refused.len(), 2, "{got:?}");
        assert_eq!(refused[0].0, 0);
        assert!(refused[0].1.contains("40000 MiB"), "{}", refused[0].1);
        assert_eq!(refused[1], (1, "no shared GPU of the cluster is of model a100"));
        assert_eq!(pins(&got), vec![(2, 0, 0)]);
    }

    #[test]
    fn a_job_put_back_runs_alone_or_beside_a_partner_known_to_fit_never_on_a_gamble() {
        // GPU 0 holds `b` (never tried with `a`, and a great gain on the prior), GPU 1 `c`
        // (measured with `a`, a poor pair), GPU 2 `d` (ran out of memory beside `a`).
        let nodes = [node(
            "n1",
            vec![gpu(0, &[(5, "b")]), gpu(1, &[(6, "c")]), gpu(2, &[(7, "d")])],
        )];
        let mut h = Estimates::default();
        pair(&mut h, "a", "c", 0.6, 0.6);
        let oom = PairEstimate {
            speed: 0.7,
            other_speed: 0.7,
            observations: 0,
            oom: true,
        };
        h.insert_pair("v100", "a", "d", oom);
        h.insert_pair("v100", "d", "a", oom);
        let any = Knobs {
            min_gain: -1.0,
            ..knobs()
        };
        let on = |nodes: &[NodeGpus], pending: &[Candidate], h: &Estimates| {
            choose_once(nodes, pending, h, any, &mut Bypasses::default())
        };
        let choose = |pending: &[Candidate]| pins(&on(&nodes, pending, &h));
        let fresh = job(1, "a");
        let put_back = Candidate {
            put_back: Some(vec!["x".into()]),
            ..job(1, "a")
        };
        assert_eq!(choose(&[fresh]), vec![(0, 0, 0)], "a newcomer takes the gamble");
        assert_eq!(
            choose(std::slice::from_ref(&put_back)),
            vec![(0, 0, 1)],
            "put back: beside the known fit"
        );
        // With no known fit, it waits for a free GPU, and takes one.
        let mut h2 = Estimates::default();
        h2.insert_pair("v100", "a", "d", oom);
        let got = on(&nodes, std::slice::from_ref(&put_back), &h2);
        assert!(got.is_empty(), "waits, is not refused: {got:?}");
        let free = [node("n1", vec![gpu(0, &[(5, "b")]), gpu(1, &[])])];
        let got = pins(&on(&free, std::slice::from_ref(&put_back), &h2));
        assert_eq!(got, vec![(0, 0, 1)], "the free GPU");
        // Nobody joins a job put back on the pair it failed in, whatever the history says: `b`
        // was put back after running out of memory beside `a`, and the history has not heard.
        let mut guarded = nodes.clone();
        guarded[0].gpus[0].residents[0].put_back = Some(vec!["a".into()]);
        guarded[0].gpus.truncate(2);
        let got = pins(&on(&guarded, &[job(1, "a")], &h));
        assert_eq!(got, vec![(0, 0, 1)], "beside c, not b");
        // Put back beside `x`, `b` takes any other newcomer, on a gamble too.
        guarded[0].gpus[0].residents[0].put_back = Some(vec!["x".into()]);
        let got = pins(&on(&guarded, &[job(1, "a")], &h));
        assert_eq!(got, vec![(0, 0, 0)], "beside b");
        // A pair measured on one side only is not known to fit.
        let mut h3 = Estimates::default();
        let seen = PairEstimate {
            speed: 0.9,
            other_speed: 0.9,
            observations: 3,
            oom: false,
        };
        h3.insert_pair("v100", "c", "a", seen);
        let got = on(&nodes, std::slice::from_ref(&put_back), &h3);
        assert!(got.is_empty(), "{got:?}");
    }

    #[test]
    fn a_job_asking_for_a_model_runs_only_on_that_model() {
        let mut a100 = gpu(0, &[]);
        a100.model = "a100".into();
        let nodes = [node("n1", vec![gpu(0, &[])]), node("n2", vec![a100])];
        let pending = [Candidate {
            model: Some("a100".into()),
            ..job(1, "x")
        }];
        assert_eq!(
            pins(&choose_once(
                &nodes,
                &pending,
                &Estimates::default(),
                knobs(),
                &mut Bypasses::default()
            )),
            vec![(0, 1, 0)]
        );
    }

    #[test]
    fn a_job_bound_to_a_gpu_index_runs_only_on_that_index_of_whichever_node() {
        // n1's GPU 0 holds a job, its GPU 1 is idle; n2's are both idle. Jobs bound to index 0
        // and 1 (22.05): GPU 0 of n2 and GPU 1 of n1, whatever kind of GPU the look saw first.
        let nodes = [
            node("n1", vec![gpu(0, &[(5, "x")]), gpu(1, &[])]),
            node("n2", vec![gpu(0, &[]), gpu(1, &[])]),
        ];
        let bound = |id, index| Candidate {
            gpu: Some(index),
            ..job(id, "y")
        };
        let pending = [bound(1, 0), bound(2, 1)];
        let choices = choose_once(
            &nodes,
            &pending,
            &Estimates::default(),
            knobs(),
            &mut Bypasses::default(),
        );
        assert_eq!(pins(&choices), vec![(0, 1, 0), (1, 0, 1)]);
    }

    #[test]
    fn a_job_runs_only_on_the_nodes_it_asked_for() {
        let nodes = [node("n1", vec![gpu(0, &[])]), node("n2", vec![gpu(0, &[(5, "x")])])];
        let pending = [Candidate {
            nodes: Some(vec!["n2".into()]),
            ..job(1, "a")
        }];
        let got = pins(&choose_once(
            &nodes,
            &pending,
            &Estimates::default(),
            knobs(),
            &mut Bypasses::default(),
        ));
        assert_eq!(got, vec![(0, 1, 0)], "n2, though n1 is idle");
        // Asked for a node where it never fits: refused for good, with the reason.
        let big = [Candidate {
            mem_mb: Some(40_000),
            nodes: Some(vec!["n2".into()]),
            ..job(2, "big")
        }];
        let got = choose_once(&nodes, &big, &Estimates::default(), knobs(), &mut Bypasses::default());
        assert!(matches!(&got[..], [Choice::Refuse { .. }]), "{got:?}");
    }

    #[test]
    fn nothing_is_claimed_onto_a_full_cluster() {
        let nodes = [node("n1", vec![gpu(0, &[(1, "a"), (2, "a")])])];
        assert!(choose_once(
            &nodes,
            &[job(3, "a")],
            &Estimates::default(),
            knobs(),
            &mut Bypasses::default()
        )
        .is_empty());
    }

    #[test]
    fn a_job_passed_over_too_often_is_never_passed_again() {
        let mut b = Bypasses::default();
        let pending = [10, 11, 12, 13];
        let offered = |b: &mut Bypasses, pending: &[u32], pick: Option<usize>| {
            let mut seen = 0;
            let chosen = b.choose(pending, |reach| {
                seen = reach;
                Ok::<_, ()>(pick)
            });
            assert_eq!(chosen, Ok(pick.filter(|&i| i < seen)));
            seen
        };
        assert_eq!(offered(&mut b, &pending, None), 4);
        for _ in 0..Bypasses::MAX {
            offered(&mut b, &pending, Some(2));
        }
        // 10 and 11 were passed over MAX times: the choice stops at 10, which it may take.
        assert_eq!(b.reach(&pending), 1);
        assert_eq!(
            b.choose(&pending, |_| -> Result<_, ()> { panic!("nothing to choose from") }),
            Ok(None)
        );
        assert_eq!(offered(&mut b, &[12, 11, 13], None), 2);
        // Chosen at last: its count is forgotten.
        assert_eq!(offered(&mut b, &[13, 11], Some(1)), 2);
        assert_eq!(b.reach(&[11, 13]), 2);
    }
}
