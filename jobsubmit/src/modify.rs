//! An update of an existing job (`scontrol update`, job_submit's `job_modify`): what the
//! rewrite would have refused stays refused.

use crate::policy::Policy;
use crate::rewrite::{asks_gpus, partition_names, refuse, unflagged_on_shared, with_gate, JobView, RejectKind};
use crate::tres::{checked_sum, is_gpu, parse_tres, TresEntry};
use multiplex_protocol::spec::TAG_PREFIX;

/// What an accepted update becomes.
#[derive(Debug, Clone, PartialEq)]
pub enum ModifyOk {
    AsAsked,
    /// The update's `--exclude`, with the shared nodes added back.
    ExcNodes(String),
    /// The update's licenses, with the gate's kept: only the claimer (root or the Slurm user)
    /// lets a multiplexed job through the gate.
    Licenses(String),
}

/// An update of a job without --multiplex where the policy names `shared_nodes`. The job's own
/// request is not at hand here (only the update), so: an update that gives it GPUs is refused
/// (its exclusion could not be kept), one that names a shared node in its node list is
/// refused, and a new `--exclude` gets the shared nodes added back.
fn plain_update_off_shared_nodes(update: &JobView, policy: &Policy) -> Result<ModifyOk, (RejectKind, String)> {
    let Some(shared) = policy.shared_nodes.as_ref() else {
        return Ok(ModifyOk::AsAsked);
    };
    let why = "the site shares the GPUs of nodes that are also in other partitions";
    if asks_gpus(update, policy) {
        return Err(refuse(
            RejectKind::SharedNode,
            format!("{why}: a job without --multiplex is given GPUs at submission, not by an update; submit it again"),
        ));
    }
    if let Some(node) = update.req_nodes.iter().find(|n| shared.hosts.contains(*n)) {
        return Err(refuse(
            RejectKind::SharedNode,
            format!("{why}: a job without --multiplex cannot be moved to {node}, whose GPUs are shared"),
        ));
    }
    Ok(match update.exc_nodes.as_deref() {
        None => ModifyOk::AsAsked,
        Some(e) if e.trim().is_empty() => ModifyOk::ExcNodes(shared.list.clone()),
        Some(e) => ModifyOk::ExcNodes(format!("{},{}", e.trim(), shared.list)),
    })
}

/// Checks an update of an existing job (`scontrol update`): a multiplexed job (tagged in
/// `current_tag`, its admin_comment) cannot be modified into what the rewrite would have
/// rejected, and a job without the flag cannot be moved into a shared partition the policy
/// keeps for multiplexed jobs. `update` holds only the fields being changed.
pub fn check_modify(
    update: &JobView,
    current_tag: Option<&str>,
    policy: &Policy,
    privileged: bool,
) -> Result<ModifyOk, (RejectKind, String)> {
    let multiplexed = current_tag.is_some_and(|t| t.starts_with(TAG_PREFIX))
        // An update that also drops the tag (an admin taking the job out of multiplexing) is
        // judged as for a plain job.
        && update.admin_comment.as_deref().is_none_or(|c| c.starts_with(TAG_PREFIX));
    if !multiplexed {
        if let Some(message) = unflagged_on_shared(update.partition.as_deref(), policy) {
            return Err(refuse(RejectKind::SharedPartition, message));
        }
        return plain_update_off_shared_nodes(update, policy);
    }
    let why = "a multiplexed job shares its GPU: ";
    if update.exclusive {
        return Err(refuse(
            RejectKind::Exclusive,
            format!("{why}it cannot be made --exclusive"),
        ));
    }
    if let Some(n) = [update.min_nodes, update.max_nodes]
        .into_iter()
        .flatten()
        .find(|&n| n > 1)
    {
        return Err(refuse(
            RejectKind::TooManyNodes,
            format!("{why}it runs on one node and cannot be given {n}"),
        ));
    }
    if let Some(partition) = update.partition.as_deref() {
        if let Some(p) = partition_names(partition).find(|p| !policy.is_shared(p)) {
            return Err(refuse(
                RejectKind::SharedPartition,
                format!(
                    "{why}it stays in the shared partition{} ({}), not {p}",
                    if policy.partitions.len() > 1 { "s" } else { "" },
                    policy.partitions.join(", ")
                ),
            ));
        }
    }
    update_gres(update, policy, why)?;
    // A user's change of licenses keeps the gate's: dropping it would let the job start where
    // Slurm puts it, ahead of jobs waiting for a claim.
    match update.licenses.as_deref() {
        Some(l) if !privileged => Ok(ModifyOk::Licenses(with_gate(Some(l)))),
        _ => Ok(ModifyOk::AsAsked),
    }
}

/// An update's GPU request for a multiplexed job: slots of the shared gres only, at most the
/// policy's GPUs' worth.
fn update_gres(update: &JobView, policy: &Policy, why: &str) -> Result<(), (RejectKind, String)> {
    let fields = [
        &update.tres_per_node,
        &update.tres_per_job,
        &update.tres_per_task,
        &update.tres_per_socket,
    ];
    let entries: Vec<TresEntry> = fields
        .iter()
        .filter_map(|f| f.as_deref())
        .flat_map(parse_tres)
        .collect();
    if entries.iter().any(is_gpu) {
        return Err(refuse(
            RejectKind::MixedGres,
            format!("{why}it holds {} slots, not whole GPUs", policy.gres),
        ));
    }
    let units = checked_sum(
        entries
            .iter()
            .filter(|e| e.sep.is_some() && e.name == policy.gres)
            .map(|e| e.count),
    );
    let limit = u64::from(policy.max_gpus) * u64::from(policy.gres_per_gpu);
    match units {
        Some(units) if units <= limit => {}
        Some(units) => {
            return Err(refuse(
                RejectKind::TooManyGpus,
                format!("{why}it may hold at most {limit} {} here, not {units}", policy.gres),
            ))
        }
        None => {
            return Err(refuse(
                RejectKind::TooManyGpus,
                format!(
                    "{why}it may hold at most {limit} {} here, not more than can be counted",
                    policy.gres
                ),
            ))
        }
    }
    Ok(())
}
