//! What a look reads beside Slurm's books: how much memory each GPU model has, and the
//! estimates its choice weighs. On a node it is the daemon's own history ([`Node`]); the
//! simulator's oracle hands the claimer the true table instead.

use crate::claim::{wanted, Candidate, Inputs, NodeGpus};
use crate::node::Node;
use std::collections::HashMap;
use std::sync::Mutex;

/// What scores a look ([`super::Claimer::look`]).
pub trait Scorer {
    /// Each GPU model's memory, MiB: what the claimer assumes of that model on every node.
    fn gpu_memory(&self) -> HashMap<String, u64>;

    /// The choice's inputs for the queue a look read: `nodes` and `pending` as Slurm's books
    /// show them, each job's memory filled in where known, and the estimates the choice reads.
    fn inputs(&self, nodes: &[NodeGpus], pending: &[Candidate]) -> Result<Inputs, String>;
}

impl Scorer for Node {
    fn gpu_memory(&self) -> HashMap<String, u64> {
        Node::gpu_memory(self)
    }

    /// A resident or a pending job without a memory hint counts what its application's
    /// earlier runs were measured to use.
    fn inputs(&self, nodes: &[NodeGpus], pending: &[Candidate]) -> Result<Inputs, String> {
        let cannot = |e: crate::history::HistoryError| format!("cannot read the history: {e}");
        // Each application's measured memory, read once a look (a large cluster runs
        // thousands of jobs of a few dozen applications).
        let mut measured: HashMap<String, Option<u64>> = HashMap::new();
        let mut memory = |hint: Option<u64>, app: &str| -> Result<Option<u64>, String> {
            if hint.is_some() {
                return Ok(hint);
            }
            if let Some(&m) = measured.get(app) {
                return Ok(m);
            }
            let m = self.job_memory(None, app).map_err(cannot)?;
            measured.insert(app.to_string(), m);
            Ok(m)
        };
        let mut nodes = nodes.to_vec();
        for gpu in nodes.iter_mut().flat_map(|n| n.gpus.iter_mut()) {
            for r in &mut gpu.residents {
                r.mem_mb = memory(r.mem_mb, &r.app)?;
            }
        }
        let mut pending = pending.to_vec();
        for p in &mut pending {
            p.mem_mb = memory(p.mem_mb, &p.app)?;
        }
        let knobs = self.knobs();
        let estimates = self
            .history()
            .estimates(&wanted(&nodes, &pending, knobs.slots))
            .map_err(cannot)?;
        Ok(Inputs {
            nodes,
            pending,
            estimates,
            knobs,
        })
    }
}

/// The daemon's node, shared with its server: the history is read under the node's lock, and
/// the scoring runs outside it, so that scoring a large cluster never holds up its job steps.
impl Scorer for Mutex<Node> {
    fn gpu_memory(&self) -> HashMap<String, u64> {
        self.lock().unwrap_or_else(|p| p.into_inner()).gpu_memory()
    }

    fn inputs(&self, nodes: &[NodeGpus], pending: &[Candidate]) -> Result<Inputs, String> {
        Scorer::inputs(&*self.lock().unwrap_or_else(|p| p.into_inner()), nodes, pending)
    }
}
