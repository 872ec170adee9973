//! What a look reads beside Slurm's books: how much memory each GPU model has and each
//! application was measured to need, and the estimates its choice weighs. On a node it is the
//! daemon's own history ([`Node`]); the simulator's oracle hands the claimer the true table
//! instead.

use crate::claim::{wanted, Board, Candidate, Inputs, NodeGpus};
use crate::node::Node;
use crate::placement::{Estimates, Knobs, Wanted};
use std::collections::HashMap;
use std::sync::Mutex;

/// What scores a look ([`super::Claimer::look`]).
pub trait Scorer {
    /// Each GPU model's memory, MiB: what the claimer assumes of that model on every node.
    fn gpu_memory(&self) -> HashMap<String, u64>;

    /// What each application's runs were measured to need of a GPU's memory, MiB (those
    /// measured): a job whose tag gives no memory is counted with its application's.
    fn app_memory(&self) -> Result<HashMap<String, u64>, String>;

    /// The placement knobs the choice weighs with.
    fn knobs(&self) -> Knobs;

    /// The estimates the choice reads for `wanted` ([`wanted`]).
    fn estimates(&self, wanted: &Wanted) -> Result<Estimates, String>;

    /// The choice's inputs for one look at `nodes` and `pending` as Slurm's books show them,
    /// each job's memory filled in where known.
    fn inputs(&self, nodes: &[NodeGpus], pending: &[Candidate]) -> Result<Inputs, String> {
        let knobs = self.knobs();
        let mut board = Board::new(nodes.to_vec(), knobs.slots);
        board.measured(self.app_memory()?);
        let pending: Vec<Candidate> = pending
            .iter()
            .map(|p| Candidate {
                mem_mb: board.memory_of(p.mem_mb, &p.app),
                ..p.clone()
            })
            .collect();
        let estimates = self.estimates(&wanted(&board, &pending))?;
        Ok(Inputs {
            nodes: board.nodes().to_vec(),
            pending,
            estimates,
            knobs,
        })
    }
}

fn cannot(e: crate::history::HistoryError) -> String {
    format!("cannot read the history: {e}")
}

impl Scorer for Node {
    fn gpu_memory(&self) -> HashMap<String, u64> {
        Node::gpu_memory(self)
    }

    fn app_memory(&self) -> Result<HashMap<String, u64>, String> {
        let rows = self.history().memory().map_err(cannot)?;
        Ok(rows.into_iter().map(|m| (m.app, m.peak_mb)).collect())
    }

    fn knobs(&self) -> Knobs {
        Node::knobs(self)
    }

    fn estimates(&self, wanted: &Wanted) -> Result<Estimates, String> {
        self.history().estimates(wanted).map_err(cannot)
    }
}

/// The daemon's node, shared with its server: the history is read under the node's lock, and
/// the scoring runs outside it, so that scoring a large cluster never holds up its job steps.
impl Scorer for Mutex<Node> {
    fn gpu_memory(&self) -> HashMap<String, u64> {
        self.lock().unwrap_or_else(|p| p.into_inner()).gpu_memory()
    }

    fn app_memory(&self) -> Result<HashMap<String, u64>, String> {
        Scorer::app_memory(&*self.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn knobs(&self) -> Knobs {
        self.lock().unwrap_or_else(|p| p.into_inner()).knobs()
    }

    fn estimates(&self, wanted: &Wanted) -> Result<Estimates, String> {
        Scorer::estimates(&*self.lock().unwrap_or_else(|p| p.into_inner()), wanted)
    }
}
