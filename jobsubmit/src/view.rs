//! A job description as the plugin's decisions read it, and how they refuse one.

/// The fields of a job description the rewrite reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobView {
    /// `spank_job_env` entries (`NAME=VALUE`).
    pub spank_env: Vec<String>,
    pub user_id: u32,
    pub name: Option<String>,
    pub partition: Option<String>,
    /// `--account`, when given (slurmctld fills in the default account after job_submit).
    pub account: Option<String>,
    pub admin_comment: Option<String>,
    pub tres_per_node: Option<String>,
    pub tres_per_job: Option<String>,
    pub tres_per_task: Option<String>,
    pub tres_per_socket: Option<String>,
    pub cpus_per_tres: Option<String>,
    pub mem_per_tres: Option<String>,
    /// `--exclusive` (job_desc `shared == 0`).
    pub exclusive: bool,
    /// Requested node counts; `None` when unset.
    pub min_nodes: Option<u32>,
    pub max_nodes: Option<u32>,
    /// Requested task count; `None` when unset.
    pub num_tasks: Option<u32>,
    /// The nodes of the policy's `shared_nodes` that `--nodelist` names, in its order (filled
    /// in only where the policy names shared nodes).
    pub req_nodes: Vec<String>,
    /// `--nodelist`, as given (a multiplexed job's tag keeps it: a claim replaces it).
    pub node_list: Option<String>,
    /// `--exclude`, as given.
    pub exc_nodes: Option<String>,
    /// `--licenses`, as given.
    pub licenses: Option<String>,
    /// `--constraint`, as given.
    pub features: Option<String>,
}

/// Why a job cannot share; maps to one `ESLURM_*` code each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    BadOption,
    NoGpu,
    TooManyGpus,
    TooManyNodes,
    Exclusive,
    MixedGres,
    /// The user and account are not among those the policy lets multiplex.
    NotAllowed,
    /// A job without --multiplex aimed at a shared partition.
    SharedPartition,
    /// A job without --multiplex that asks for GPUs on a node whose GPUs are shared.
    SharedNode,
    /// A GPU model no shared GPU is, or none named where this Slurm needs one.
    UnknownModel,
}

/// A refusal of `kind`, its sentence with the plugin's prefix.
pub(crate) fn refuse(kind: RejectKind, message: String) -> (RejectKind, String) {
    (kind, format!("multiplex: {message}"))
}
