//! The claimer's view of the partition's nodes: the node list (sinfo, read again when it may
//! have changed), their GPUs as a look starts from them, and the nodes each job may run on.

use super::Claimer;
use crate::claim::NodeGpus;
use crate::claimer::Scorer;
use crate::placement::GpuState;
use crate::slurm::{Changes, NodeInfo, Slurm, SlurmError};
use multiplex_protocol::gres::split_gpu_type;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often the node list is read again (sinfo).
pub(super) const NODES_EVERY: Duration = Duration::from_secs(60);
/// How soon it is read again when a job names a node it lacks (one added since), or when a
/// node of the list was not up (a slurmd not registered yet as the cluster starts, a node
/// down, drained or resuming): a job's node list is its user's, so this bounds what such a
/// job costs slurmctld, and a node that comes up is used within this, not [`NODES_EVERY`].
pub(super) const NODES_AGAIN: Duration = Duration::from_secs(10);

/// The node list as last read: when, its usable nodes' GPUs as a look starts from them (each
/// GPU with no job yet), and the GPU models' memory they were made with.
#[derive(Debug)]
pub(super) struct NodeList {
    pub at: f64,
    pub infos: Arc<[NodeInfo]>,
    pub gpus: Vec<NodeGpus>,
    pub memory: HashMap<String, u64>,
}

impl Claimer {
    /// The partition's nodes: read again every [`NODES_EVERY`], or after [`NODES_AGAIN`] while
    /// a node is not up, a job of this read names a node the list lacks, or a job found none of
    /// its nodes up. With them (kept beside them), their GPUs, empty, as [`cluster`] makes
    /// them. A list read again and found as it was is the list kept (the same [`Arc`]).
    pub(super) fn node_list(
        &mut self,
        slurm: &dyn Slurm,
        scorer: &dyn Scorer,
        read: &Changes,
        now: f64,
    ) -> Result<Arc<[NodeInfo]>, SlurmError> {
        let stale = self.nodes.as_ref().is_none_or(|list| {
            let age = Duration::from_secs_f64((now - list.at).max(0.0));
            let nodes = &list.infos;
            let some_down = nodes.iter().any(|n| !n.usable());
            age >= NODES_EVERY
                || (age >= NODES_AGAIN && (self.nodes_unsettled || some_down || names_unknown(nodes, read)))
        });
        if stale {
            self.nodes_unsettled = false;
            let infos = slurm.nodes(&self.config.partition)?;
            let memory = scorer.gpu_memory();
            // The GPUs follow from the list and the models' memory: made again only when
            // either changed (a large cluster's list is read every minute and seldom changes).
            self.nodes = Some(match self.nodes.take() {
                Some(was) if *was.infos == *infos && was.memory == memory => NodeList { at: now, ..was },
                _ => NodeList {
                    at: now,
                    gpus: cluster(&infos, &memory),
                    infos: Arc::from(infos),
                    memory,
                },
            });
        }
        Ok(self
            .nodes
            .as_ref()
            .map_or_else(|| Arc::from(Vec::new()), |list| Arc::clone(&list.infos)))
    }

    /// The nodes a job may run on: those `asked` names (its `--nodelist`), less those
    /// `excluded` names (its `--exclude`); `None`: any. A host list Slurm cannot expand counts
    /// as naming no node.
    pub(super) fn allowed_nodes(
        &mut self,
        slurm: &dyn Slurm,
        asked: Option<&str>,
        excluded: Option<&str>,
        infos: &[NodeInfo],
    ) -> Option<Vec<String>> {
        if asked.is_none() && excluded.is_none() {
            return None;
        }
        // A list scontrol could not expand names no node this look, and is asked again.
        let mut expand = |list: &str| -> Vec<String> {
            if let Some(hosts) = self.hostlists.get(list) {
                return hosts.clone();
            }
            match slurm.hostnames(list) {
                Ok(hosts) => self.hostlists.entry(list.to_string()).or_insert(hosts).clone(),
                Err(_) => Vec::new(),
            }
        };
        let asked = asked.map(&mut expand);
        let excluded = excluded.map(&mut expand).unwrap_or_default();
        Some(
            infos
                .iter()
                .map(|i| i.name.clone())
                .filter(|n| asked.as_ref().is_none_or(|a| a.contains(n)) && !excluded.contains(n))
                .collect(),
        )
    }
}

/// Whether a job of a read names a node the node list lacks (a node added since it was read).
fn names_unknown(nodes: &[NodeInfo], read: &Changes) -> bool {
    (read.pending.iter().chain(&read.running))
        .filter_map(|j| j.node.as_deref())
        .any(|n| !n.contains([',', '[']) && !nodes.iter().any(|i| i.name == n))
}

/// The usable nodes and their GPUs (by type, see [`split_gpu_type`]), empty.
fn cluster(infos: &[NodeInfo], memory: &HashMap<String, u64>) -> Vec<NodeGpus> {
    infos
        .iter()
        .filter(|i| i.usable())
        .map(|i| NodeGpus {
            node: i.name.clone(),
            gpus: i
                .gpus()
                .iter()
                .filter_map(|(kind, _)| split_gpu_type(kind))
                .map(|(model, index)| GpuState {
                    index,
                    model: model.to_string(),
                    memory_mb: memory.get(model).copied().unwrap_or(u64::MAX),
                    residents: Vec::new(),
                })
                .collect(),
        })
        .filter(|n| !n.gpus.is_empty())
        .collect()
}
