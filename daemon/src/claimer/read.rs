//! What a look reads of Slurm's books, applied to the board the claimer keeps between looks
//! ([`Board`]): the jobs that changed since the last read (every job where Slurm cannot say
//! which changed: squeue), the node list, and the first waiting jobs as the choice weighs them.

use super::{Claimer, Scorer, Seen};
use crate::claim::{Board, Candidate};
use crate::placement::Resident;
use crate::slurm::{Changes, Job, NodeInfo, Slurm, SlurmError};
use multiplex_protocol::gres::split_gpu_type;
use multiplex_protocol::spec::Spec;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The queue as one look read it: the pending jobs, their tags, the waiting jobs the choice
/// weighs (each with its index in `jobs`), and how many wait for a claim in all.
pub(super) struct Queue {
    pub jobs: Vec<Job>,
    pub specs: Vec<Option<Spec>>,
    pub candidates: Vec<(Candidate, usize)>,
    pub waiting: usize,
}

/// The board the claimer keeps between looks, the node list it was made from (each usable
/// node's place on it), and the mark of the read it is up to date with.
pub(super) struct Kept {
    pub board: Board,
    infos: Arc<[NodeInfo]>,
    at: HashMap<String, usize>,
    mark: Option<u64>,
}

impl Claimer {
    /// What changed in Slurm's books since the look before, applied to `board` (made anew
    /// from every job when there is none, when the node list changed, or when Slurm cannot
    /// say what changed), and the first waiting jobs as the choice weighs them.
    pub(super) fn read(
        &mut self,
        slurm: &dyn Slurm,
        scorer: &dyn Scorer,
        board: Option<Kept>,
        now: f64,
    ) -> Result<(Queue, Kept), SlurmError> {
        let (read, infos, mut kept) = self.read_onto(slurm, scorer, board, now)?;
        // Each job's tag, read once per look.
        let tag = |j: &Job| Spec::from_tag(j.admin_comment.as_deref()).and_then(Result::ok);
        let running_specs: Vec<Option<Spec>> = read.running.iter().map(tag).collect();
        let specs: Vec<Option<Spec>> = read.pending.iter().map(tag).collect();
        self.forget(&read, &specs, &running_specs);
        if read.whole {
            let running: HashSet<u32> = read.running.iter().map(|j| j.id).collect();
            kept.board.unseat_unless(|id| running.contains(&id));
        }
        for id in &read.gone {
            kept.board.unseat(*id);
        }
        for (job, spec) in read.running.iter().zip(&running_specs) {
            match self.classify(slurm, job, spec.as_ref(), now) {
                Seen::Resident(gpu) if seat(&mut kept, job, spec.as_ref(), gpu, false) => {}
                _ => {
                    kept.board.unseat(job.id);
                }
            }
        }
        let merges = slurm.merges_gres_updates()?;
        let mut candidates: Vec<(Candidate, usize)> = Vec::new();
        let mut waiting = read.unlisted;
        for (index, (job, spec)) in read.pending.iter().zip(&specs).enumerate() {
            match self.classify(slurm, job, spec.as_ref(), now) {
                Seen::Resident(gpu) => {
                    seat(&mut kept, job, spec.as_ref(), gpu, true);
                }
                Seen::Waiting(spec) => {
                    waiting += 1;
                    if candidates.len() < self.config.lookahead {
                        if let Some(c) = self.candidate(slurm, job, spec, &infos, merges) {
                            candidates.push((c, index));
                        }
                    }
                }
                Seen::Other => {}
            }
        }
        if !candidates.is_empty() {
            self.hold_whole(slurm, &mut kept)?;
        }
        let queue = Queue {
            jobs: read.pending,
            specs,
            candidates,
            waiting,
        };
        Ok((queue, kept))
    }

    /// The jobs that changed since `board`'s mark, the node list, and the board; made anew
    /// (and every job read) where there is none, the node list changed or the slots did.
    fn read_onto(
        &mut self,
        slurm: &dyn Slurm,
        scorer: &dyn Scorer,
        board: Option<Kept>,
        now: f64,
    ) -> Result<(Changes, Arc<[NodeInfo]>, Kept), SlurmError> {
        let partition = self.config.partition.clone();
        let read_all = |since| -> Result<Changes, SlurmError> {
            match slurm.jobs_since(&partition, since)? {
                Some(changes) => Ok(changes),
                None => Ok(Changes::whole(slurm.jobs(&partition)?)),
            }
        };
        let mut read = read_all(board.as_ref().and_then(|k| k.mark))?;
        let infos = self.node_list(slurm, scorer, &read, now)?;
        let slots = scorer.knobs().slots;
        let kept = board.filter(|k| Arc::ptr_eq(&k.infos, &infos) && k.board.slots() == slots);
        let mut kept = match kept {
            Some(kept) => kept,
            None => {
                if !read.whole {
                    read = read_all(None)?;
                }
                let empty = self.nodes.as_ref().map(|list| list.gpus.clone()).unwrap_or_default();
                Kept {
                    at: empty.iter().enumerate().map(|(i, n)| (n.node.clone(), i)).collect(),
                    board: Board::new(empty, slots),
                    infos: Arc::clone(&infos),
                    mark: None,
                }
            }
        };
        kept.mark = Some(read.mark);
        Ok((read, infos, kept))
    }

    /// A GPU a job holds whole (a plain job, of any partition) takes no claim this look: read
    /// fresh from the node records whenever a job waits for one.
    fn hold_whole(&self, slurm: &dyn Slurm, kept: &mut Kept) -> Result<(), SlurmError> {
        for (node, kind) in slurm.held_whole(&self.config.partition)? {
            let (Some(&n), Some((model, index))) = (kept.at.get(&node), split_gpu_type(&kind)) else {
                continue;
            };
            if (kept.board.nodes()[n].gpus.iter()).any(|g| g.index == index && g.model == model) {
                kept.board.hold_whole(n, index);
            }
        }
        Ok(())
    }

    /// Forgets what no longer waits or holds a slot, and host lists no job of this read names
    /// any more (they are users' text; one forgotten is expanded again when named).
    fn forget(&mut self, read: &Changes, specs: &[Option<Spec>], running_specs: &[Option<Spec>]) {
        let pending: HashSet<u32> = read.pending.iter().map(|j| j.id).collect();
        self.pinned_since.retain(|id, _| pending.contains(id));
        let running: HashSet<u32> = read.running.iter().map(|j| j.id).collect();
        self.untyped
            .retain(|id, _| !pending.contains(id) && !read.gone.contains(id) && (!read.whole || running.contains(id)));
        let named: HashSet<&str> = (read.pending.iter().zip(specs))
            .chain(read.running.iter().zip(running_specs))
            .flat_map(|(j, s)| {
                [
                    j.node.as_deref(),
                    j.excluded.as_deref(),
                    s.as_ref().and_then(|s| s.nodes.as_deref()),
                ]
            })
            .flatten()
            .collect();
        self.hostlists.retain(|list, _| named.contains(list.as_str()));
    }
}

/// Seats `job` on its GPU (its model where known, and its index) of its node, for good or for
/// this look only (`passing`: pinned and about to start); false where it holds no GPU the
/// board knows.
fn seat(kept: &mut Kept, job: &Job, spec: Option<&Spec>, gpu: Option<(Option<&str>, u32)>, passing: bool) -> bool {
    let (Some(&node), Some((model, index))) = (job.node.as_deref().and_then(|n| kept.at.get(n)), gpu) else {
        return false;
    };
    let known = (kept.board.nodes()[node].gpus.iter()).any(|g| g.index == index && model.is_none_or(|m| g.model == m));
    if !known {
        return false;
    }
    let hint = spec.and_then(|s| s.mem_mb);
    let resident = Resident {
        job_id: job.id,
        app: spec.and_then(|s| s.app.clone()).unwrap_or_default(),
        mem_mb: hint,
        put_back: multiplex_protocol::spec::put_back_beside(job.admin_comment.as_deref()),
    };
    match passing {
        true => kept.board.seat_for_look(node, index, resident, hint),
        false => kept.board.seat(node, index, resident, hint),
    }
}
