//! The cluster as the choice weighs it, kept from one look to the next: each usable node's
//! GPUs with what holds each, and the kinds of GPU with their free GPUs ([`Kinds`]). A look
//! changes only what Slurm's books changed since the look before (a job started or left), so
//! its cost follows the changes and the waiting jobs, not the cluster's size: at 1,000 nodes
//! of 8 GPUs, a look that copied and sorted every GPU cost more than the claims it made.
//!
//! What holds only for one look is taken off again at its end ([`Board::end_look`]): jobs
//! pinned and about to start (Slurm shows them pending), the claims the look itself made, and
//! GPUs a job holds whole.

use super::classes::Kinds;
use super::NodeGpus;
use crate::placement::{GpuState, Resident};
use std::collections::HashMap;

/// Where a job holds a slot, and the memory its tag gave (`None`: what its application was
/// measured to need, where known, stands in).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Seat {
    node: usize,
    gpu: u32,
    hint: Option<u64>,
}

/// The board: see the module's documentation.
#[derive(Debug)]
pub struct Board {
    nodes: Vec<NodeGpus>,
    kinds: Kinds,
    seats: HashMap<u32, Seat>,
    /// Jobs seated for this look only, in the order seated.
    passing: Vec<u32>,
    /// GPUs taken off for this look: node, place among its GPUs, the GPU.
    held: Vec<(usize, usize, GpuState)>,
    /// What each application was measured to need of a GPU's memory, MiB.
    measured: HashMap<String, u64>,
    slots: u32,
}

impl Board {
    /// A board of `nodes`, each GPU holding up to `slots` jobs; the residents they list hold
    /// their slots with the memory given as their own.
    pub fn new(nodes: Vec<NodeGpus>, slots: u32) -> Board {
        let mut seats = HashMap::new();
        for (n, node) in nodes.iter().enumerate() {
            for g in &node.gpus {
                for r in &g.residents {
                    let hint = r.mem_mb;
                    seats.insert(
                        r.job_id,
                        Seat {
                            node: n,
                            gpu: g.index,
                            hint,
                        },
                    );
                }
            }
        }
        Board {
            kinds: Kinds::new(&nodes, slots),
            nodes,
            seats,
            passing: Vec::new(),
            held: Vec::new(),
            measured: HashMap::new(),
            slots,
        }
    }

    /// The nodes and what holds their GPUs.
    pub fn nodes(&self) -> &[NodeGpus] {
        &self.nodes
    }

    /// How many jobs a GPU holds.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub(super) fn kinds(&self) -> &Kinds {
        &self.kinds
    }

    /// Whether `job` holds a slot (for good or for this look).
    pub fn holds(&self, job: u32) -> bool {
        self.seats.contains_key(&job)
    }

    /// The memory a job is counted with: its own `hint`, else its application's measured.
    pub fn memory_of(&self, hint: Option<u64>, app: &str) -> Option<u64> {
        hint.or_else(|| self.measured.get(app).copied())
    }

    /// `resident` holds a slot of GPU `gpu` (its index) of node `node` from now on (moved
    /// there if it held another, left alone if it holds that one already); `hint` is the memory
    /// its tag gave. False where the node has no such GPU (the job counts nowhere).
    pub fn seat(&mut self, node: usize, gpu: u32, mut resident: Resident, hint: Option<u64>) -> bool {
        let seat = Seat { node, gpu, hint };
        if let Some(&was) = self.seats.get(&resident.job_id) {
            if was == seat && self.resident(&was, resident.job_id).is_some_and(|r| same(r, &resident)) {
                return true;
            }
            self.unseat(resident.job_id);
        }
        let Some(place) = self
            .nodes
            .get(node)
            .and_then(|n| n.gpus.iter().position(|g| g.index == gpu))
        else {
            return false;
        };
        resident.mem_mb = self.memory_of(hint, &resident.app);
        self.seats.insert(resident.job_id, seat);
        self.nodes[node].gpus[place].residents.push(resident);
        self.kinds.node_changed(&self.nodes, node);
        true
    }

    /// As [`Board::seat`], for this look only.
    pub fn seat_for_look(&mut self, node: usize, gpu: u32, resident: Resident, hint: Option<u64>) -> bool {
        let job = resident.job_id;
        if self.seats.contains_key(&job) {
            return false;
        }
        let seated = self.seat(node, gpu, resident, hint);
        if seated {
            self.passing.push(job);
        }
        seated
    }

    /// `job` holds no slot any more.
    pub fn unseat(&mut self, job: u32) -> bool {
        let Some(seat) = self.seats.remove(&job) else {
            return false;
        };
        if let Some(g) = self.nodes[seat.node].gpus.iter_mut().find(|g| g.index == seat.gpu) {
            g.residents.retain(|r| r.job_id != job);
        }
        self.kinds.node_changed(&self.nodes, seat.node);
        true
    }

    /// Every job holding a slot for good that `keep` does not keep leaves its slot.
    pub fn unseat_unless(&mut self, keep: impl Fn(u32) -> bool) {
        let gone: Vec<u32> = self.seats.keys().copied().filter(|&j| !keep(j)).collect();
        for job in gone {
            self.unseat(job);
        }
    }

    /// GPU `gpu` (its index) of node `node` takes no job this look (a job holds it whole).
    pub fn hold_whole(&mut self, node: usize, gpu: u32) {
        let Some(gpus) = self.nodes.get_mut(node).map(|n| &mut n.gpus) else {
            return;
        };
        if let Some(place) = gpus.iter().position(|g| g.index == gpu) {
            let taken = gpus.remove(place);
            self.held.push((node, place, taken));
            self.kinds.node_changed(&self.nodes, node);
        }
    }

    /// The look is over: what it seated leaves, and the GPUs it took off are back.
    pub fn end_look(&mut self) {
        while let Some(job) = self.passing.pop() {
            self.unseat(job);
        }
        while let Some((node, place, gpu)) = self.held.pop() {
            self.nodes[node].gpus.insert(place, gpu);
            self.kinds.node_changed(&self.nodes, node);
        }
    }

    /// What each application was measured to need now: the residents counted with their
    /// application's memory are counted anew where it changed.
    pub fn measured(&mut self, measured: HashMap<String, u64>) {
        if measured == self.measured {
            return;
        }
        let changed = |app: &str| measured.get(app) != self.measured.get(app);
        let mut touched = Vec::new();
        for (n, node) in self.nodes.iter_mut().enumerate() {
            let mut any = false;
            for g in &mut node.gpus {
                for r in &mut g.residents {
                    let Some(seat) = self.seats.get(&r.job_id) else {
                        continue;
                    };
                    if seat.hint.is_none() && changed(&r.app) {
                        r.mem_mb = measured.get(&r.app).copied();
                        any = true;
                    }
                }
            }
            if any {
                touched.push(n);
            }
        }
        self.measured = measured;
        for n in touched {
            self.kinds.node_changed(&self.nodes, n);
        }
    }

    fn resident(&self, seat: &Seat, job: u32) -> Option<&Resident> {
        self.nodes[seat.node]
            .gpus
            .iter()
            .find(|g| g.index == seat.gpu)?
            .residents
            .iter()
            .find(|r| r.job_id == job)
    }
}

/// Whether two residents are one job as the choice weighs it (memory aside: the seat's).
fn same(a: &Resident, b: &Resident) -> bool {
    a.job_id == b.job_id && a.app == b.app && a.put_back == b.put_back
}
