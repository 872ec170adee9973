//! Every conversation the daemon has with Slurm goes through [`Slurm`]: one typed interface,
//! one timeout policy ([`CALL_TIMEOUT`]), Slurm's own commands as the real implementation
//! ([`Commands`]), and an in-memory [`Fake`] that the unit tests and the simulator share (the
//! simulator's claimer is [`crate::claimer::Claimer`] itself, looking at the fake). Each
//! call answers in typed values; the text of Slurm's commands is read here and nowhere else.
//!
//! What each call costs slurmctld is part of the contract: [`Slurm::jobs`] and
//! [`Slurm::nodes`] are one RPC each (squeue reads the queue under slurmctld's job lock), every
//! update is one RPC, and [`Slurm::running_here`] asks the node's own slurmd, never slurmctld.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// The longest any one Slurm command may take before it is killed and counts as failed.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a call to Slurm failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlurmError {
    /// The job is no longer pending (it started, ended or was cancelled meanwhile) or
    /// slurmctld no longer knows it: the update came too late, which is no fault.
    #[error("job {0} is no longer pending")]
    NotPending(u32),
    /// Anything else: the command's own words.
    #[error("{0}")]
    Failed(String),
}

/// A job of the shared partition that waits or holds a slot, as squeue lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub id: u32,
    pub pending: bool,
    /// Slurm's reason for a pending job (`Licenses`, `Priority`, `Resources`, ...).
    pub reason: String,
    /// The node it runs on, or, pending, the nodes it asked for or a claim pinned it to
    /// (`None`: any).
    pub node: Option<String>,
    /// The nodes it may not run on (`--exclude`).
    pub excluded: Option<String>,
    /// Its gres request per node in Slurm's normal form, `gres:` (22.05) or `gres/`
    /// (23.11+) dropped: `shard:v100_1:1`, `shard:1`.
    pub gres: String,
    /// Its licenses (`multiplex:1`), empty for none.
    pub licenses: String,
    /// slurmctld's admin comment (job_submit's tag first), which the job's user cannot set.
    pub admin_comment: Option<String>,
}

#[cfg(test)]
impl Job {
    /// A job running on GPU 0 of node `n1` (`shard:v100_0:1`) with this admin comment: the
    /// unit tests' running job.
    pub(crate) fn running_on_n1(id: u32, admin_comment: &str) -> Job {
        Job {
            id,
            pending: false,
            reason: "None".into(),
            node: Some("n1".into()),
            excluded: None,
            gres: "shard:v100_0:1".into(),
            licenses: String::new(),
            admin_comment: Some(admin_comment.into()),
        }
    }
}

impl Job {
    /// The gres type it asks for (the GPU it is pinned to): `v100_1` of `shard:v100_1:1`.
    pub fn gres_type(&self) -> Option<&str> {
        multiplex_protocol::gres::type_of(&self.gres)
    }

    /// How many of its gres it asks for per node (1 when unreadable).
    pub fn gres_count(&self) -> u32 {
        self.gres
            .split(',')
            .next()
            .and_then(|g| g.rsplit(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(1)
    }

    /// Whether it still holds the gate's license (`name`): it waits for a claim.
    pub fn gated(&self, name: &str) -> bool {
        self.licenses
            .split(',')
            .any(|l| l.split([':', '=']).next().is_some_and(|n| n.trim() == name))
    }
}

/// A node of the shared partition, as sinfo lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    /// Slurm's state (`idle`, `mixed`, `allocated`, `drained`, `down*`, ...).
    pub state: String,
    /// Its gres as configured: `gpu:v100_0:1,gpu:v100_1:1,shard:v100_0:2,shard:v100_1:2`.
    pub gres: String,
}

impl NodeInfo {
    /// Whether Slurm may start jobs there now.
    pub fn usable(&self) -> bool {
        let s = self
            .state
            .trim_end_matches(['*', '~', '#', '!', '%', '$', '@', '^', '-']);
        matches!(
            s,
            "idle" | "mixed" | "mix" | "allocated" | "alloc" | "completing" | "comp"
        )
    }

    /// The node's GPUs by gres type, each with how many shards it has: `[("v100_0", 2), ...]`,
    /// in the order of their types. Untyped GPUs are left out (a claim names a GPU by type).
    pub fn gpus(&self) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = Vec::new();
        for item in split_gres(&self.gres) {
            let mut parts = item.split(':');
            let (Some(name), Some(kind), Some(_)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            if name == "gpu" && !out.iter().any(|(t, _)| t == kind) {
                out.push((kind.to_string(), 0));
            }
        }
        for item in split_gres(&self.gres) {
            let mut parts = item.split(':');
            let (Some("shard"), Some(kind), Some(n)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            if let (Some(gpu), Ok(n)) = (out.iter_mut().find(|(t, _)| t == kind), n.parse::<u32>()) {
                gpu.1 += n;
            }
        }
        out
    }
}

/// A gres list's items, without their `(S:0-1)` or `(IDX:...)` suffixes.
fn split_gres(field: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in field.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&field[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&field[start..]);
    items
        .into_iter()
        .map(|i| i.split('(').next().unwrap_or(i).trim())
        .filter(|i| !i.is_empty() && *i != "(null)")
        .collect()
}

/// One claim: a pending job pinned to one GPU (its gres type) of one node, its gate license
/// dropped and its admin comment written, in one update (two where Slurm merges gres updates
/// and the job's gres has no type yet: [`merges_gres_updates`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Pin {
    pub job: u32,
    pub node: String,
    /// The gres it then asks for: `shard:v100_1:1`; `None`: its gres stays (a claim for a node
    /// only, where Slurm picks the GPU).
    pub gres: Option<String>,
    /// Its gres has no type yet (its first claim): where Slurm merges gres updates, it is
    /// cleared first.
    pub untyped: bool,
    /// Its licenses without the gate's (empty: none).
    pub licenses: String,
    pub admin_comment: String,
    /// It may start at once: a job Slurm requeued (the separation look gave it back), which
    /// Slurm would otherwise hold for its requeue delay (121 s) past this claim.
    pub start_now: bool,
}

/// The reservation that holds every gate license while a claimer runs.
pub const GATE_RESERVATION: &str = "multiplex-gate";
/// The reservation whose presence says the gate is switched off (`multiplexd gate off`).
pub const OFF_RESERVATION: &str = "multiplex-off";

/// The reservation that holds every gate license while a claimer runs: a job that still holds
/// one of them waits (`Reason=Licenses`) until a claim drops it or the reservation lapses.
#[derive(Debug, Clone, PartialEq)]
pub struct Gate {
    pub reservation: String,
    pub license: String,
    /// How many of the license slurm.conf has (all of them are reserved).
    pub count: u32,
    /// The reservation whose presence says the gate is switched off (`multiplexd gate off`):
    /// it holds one of the licenses, so that no gate of all of them can be made meanwhile.
    pub off: String,
}

/// A reservation as slurmctld lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Reservation {
    pub name: String,
    /// Its `EndTime` as slurmctld prints it.
    pub end: String,
    /// Whether it is in force (`State=ACTIVE`): one past its end time holds nothing, though
    /// slurmctld keeps it, and an update of its end time brings it back.
    pub active: bool,
}

/// What slurmctld has spent serving reads of its whole job table (`REQUEST_JOB_INFO`, what
/// squeue sends), by anyone, as sdiag counts since its statistics were last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadCost {
    pub reads: u64,
    pub total_us: u64,
}

/// The jobs of a partition as one read found them: every one, or what changed since the read
/// before ([`Slurm::jobs_since`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Changes {
    /// What to ask from next time.
    pub mark: u64,
    /// `running` is every job that holds a slot: forget what earlier reads said.
    pub whole: bool,
    /// Every pending job, in Slurm's order (or the first of them: see `unlisted`).
    pub pending: Vec<Job>,
    /// Pending jobs after those listed that wait for a claim, where a reader lists only the
    /// first (the simulator's books, at the claimer's lookahead); squeue lists every one: 0.
    pub unlisted: usize,
    /// Jobs that hold a slot, new or changed since the mark (every one, where `whole`).
    pub running: Vec<Job>,
    /// Jobs that held a slot at the mark and hold none now.
    pub gone: Vec<u32>,
}

impl Changes {
    /// Every job of a read, `whole`: pending and running apart, each in Slurm's order.
    pub fn whole(jobs: Vec<Job>) -> Changes {
        let (pending, running) = jobs.into_iter().partition(|j| j.pending);
        Changes {
            mark: 0,
            whole: true,
            pending,
            unlisted: 0,
            running,
            gone: Vec::new(),
        }
    }
}

/// What the daemon asks of Slurm.
pub trait Slurm: Send + Sync {
    /// The jobs of `partition` that wait or hold a slot (pending, running, configuring,
    /// completing), in Slurm's order (priority, then job id). One squeue.
    fn jobs(&self, partition: &str) -> Result<Vec<Job>, SlurmError>;
    /// The jobs of `partition` that changed since the read that answered `since` (every one,
    /// `whole`, for `None`); `None` where this Slurm cannot say what changed: read them all
    /// ([`Slurm::jobs`]). squeue cannot; the simulator's books can.
    fn jobs_since(&self, _partition: &str, _since: Option<u64>) -> Result<Option<Changes>, SlurmError> {
        Ok(None)
    }
    /// The nodes of `partition`. One sinfo.
    fn nodes(&self, partition: &str) -> Result<Vec<NodeInfo>, SlurmError>;
    /// Makes a claim. One scontrol update (two for an untyped job where Slurm merges gres
    /// updates).
    fn claim(&self, pin: &Pin) -> Result<(), SlurmError>;
    /// Whether this Slurm merges a job update's gres into the job's ([`merges_gres_updates`]):
    /// then a job whose gres already has a type may be claimed again only onto that type's
    /// index. Asked once.
    fn merges_gres_updates(&self) -> Result<bool, SlurmError>;
    /// Keeps the gate closed until `lease_s` seconds from now, making its reservation if it is
    /// missing or lapsed. One scontrol update (two or three when it has to be made).
    fn hold_gate(&self, gate: &Gate, lease_s: u64) -> Result<(), SlurmError>;
    /// Every reservation, as `scontrol -o show reservation` lists them. One scontrol show.
    fn reservations(&self) -> Result<Vec<Reservation>, SlurmError>;
    /// Makes reservation `name` of one `license` for `seconds` from now: `Ok(false)` where
    /// another reservation holds that license (a lock of Slurm's own: it has one). One
    /// scontrol create (three where a lapsed one of the same name is still kept).
    fn take_lease(&self, name: &str, license: &str, seconds: u64) -> Result<bool, SlurmError>;
    /// Extends reservation `name` to `seconds` from now: `Ok(false)` where it is gone. One
    /// scontrol update.
    fn renew_lease(&self, name: &str, seconds: u64) -> Result<bool, SlurmError>;
    /// Deletes reservation `name`; one already gone is no error. One scontrol delete.
    fn delete_reservation(&self, name: &str) -> Result<(), SlurmError>;
    /// Switches the gate off (its reservation deleted and the off reservation made, so that
    /// every gated job goes where Slurm places it and no claimer gates again) or on again (the
    /// off reservation deleted: the claimer makes the gate at its next look). Two or three
    /// scontrol calls.
    fn switch_gate(&self, gate: &Gate, on: bool) -> Result<(), SlurmError>;
    /// Lets a pending job through the gate without pinning it (Slurm places it), writing
    /// `admin_comment`: a job no GPU of the cluster could hold, to fail at once with the reason.
    fn release(&self, job: u32, licenses: &str, admin_comment: &str) -> Result<(), SlurmError>;
    /// Requeues a running job. One scontrol requeue.
    fn requeue(&self, job: u32) -> Result<(), SlurmError>;
    /// What slurmctld holds of job `id` that decides whether it may be put back in the queue
    /// (one squeue of that job). `Err(NotPending)`: slurmctld no longer knows it.
    fn job_record(&self, id: u32) -> Result<JobRecord, SlurmError>;
    /// Sets job `id`'s admin comment (running or pending). One scontrol update.
    fn set_admin_comment(&self, id: u32, admin_comment: &str) -> Result<(), SlurmError>;
    /// The jobs that the slurmd of `node` runs (asks that slurmd, not slurmctld).
    fn running_here(&self, node: &str) -> Result<HashSet<u32>, SlurmError>;
    /// Whether Slurm keeps jobs private (`PrivateData` of `scontrol show config` names `jobs`,
    /// or `usage`, which implies it); an error where it does not say.
    fn private_jobs(&self) -> Result<bool, SlurmError>;
    /// slurmctld's record of `node` (`scontrol show node -o`): its gres and partitions.
    fn node_record(&self, node: &str) -> Result<NodeRecord, SlurmError>;
    /// The host names a host list names (`scontrol show hostnames`).
    fn hostnames(&self, list: &str) -> Result<Vec<String>, SlurmError>;
    /// The node list job `id` ran or runs on (`None`: not placed yet). `Err(NotPending)`:
    /// slurmctld no longer knows it.
    fn job_nodes(&self, id: u32) -> Result<Option<String>, SlurmError>;
    /// The index of the GPU running job `id` holds a shard of, from slurmctld's detail of its
    /// allocation (`None`: none it names). For a job whose gres has no type: one that started
    /// on Slurm's own choice.
    fn job_gpu(&self, id: u32) -> Result<Option<u32>, SlurmError>;
    /// How many of license `name` slurm.conf has (`scontrol show licenses`).
    fn license_total(&self, name: &str) -> Result<u32, SlurmError>;
    /// What slurmctld spent on job table reads so far (sdiag); `Ok(None)`: this Slurm cannot
    /// say (the simulator's, whose reads cost no slurmctld anything).
    fn job_reads(&self) -> Result<Option<ReadCost>, SlurmError> {
        Ok(None)
    }
    /// The GPUs of the partition's nodes that jobs hold whole, `(node, gres type)`, as
    /// Slurm's node records count them (sinfo's `GresUsed`: jobs of every partition, plain
    /// ones too): a claim never picks one. The simulator's Slurm runs multiplexed jobs only.
    fn held_whole(&self, _partition: &str) -> Result<Vec<(String, String)>, SlurmError> {
        Ok(Vec::new())
    }
}

mod commands;
mod fake;

/// What slurmctld holds of a job that decides whether it may be put back in the queue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobRecord {
    /// A batch job (`sbatch`): only those can be requeued.
    pub batch: bool,
    /// Whether it may be requeued (`--no-requeue` says no; `JobRequeue` the default).
    pub requeue: bool,
    /// How often Slurm restarted it so far (requeues of every kind).
    pub restarts: u32,
    /// slurmctld's admin comment (job_submit's tag first).
    pub admin_comment: Option<String>,
}

/// slurmctld's record of a node: its gres and partitions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeRecord {
    /// gres name -> count (`gpu:v100:4(S:0)` counts 4 for gpu).
    pub gres: std::collections::BTreeMap<String, u64>,
    pub partitions: Vec<String>,
}

pub use commands::*;
pub use fake::{Fake, FakeState};

#[cfg(test)]
mod tests {
    use super::commands::too_late;
    use super::*;

    #[test]
    fn the_node_list_of_scontrol_show_job() {
        let out = "JobId=12 JobName=wrap UserId=root(0) NodeList=n2 BatchHost=n2 NumNodes=1\n";
        assert_eq!(node_list(out).as_deref(), Some("n2"));
        assert_eq!(node_list("JobId=12 NodeList=(null) ReqNodeList=(null)"), None);
        assert_eq!(node_list("JobId=12"), None);
    }

    #[test]
    fn sdiag_says_what_job_table_reads_cost() {
        let out = "Remote Procedure Call statistics by message type
\tREQUEST_PARTITION_INFO                  ( 2009) count:32     ave_time:97     total_time:3113
\tREQUEST_JOB_INFO_SINGLE                 ( 2021) count:4      ave_time:236    total_time:946
\tREQUEST_JOB_INFO                        ( 2003) count:30     ave_time:65700  total_time:1971000
";
        assert_eq!(
            parse_job_reads(out),
            ReadCost {
                reads: 30,
                total_us: 1_971_000
            }
        );
        // None served since the statistics were reset: no line.
        let none = ReadCost::default();
        assert_eq!(
            parse_job_reads(&out.replace("REQUEST_JOB_INFO  ", "REQUEST_NODE_INFO ")),
            none
        );
    }

    #[test]
    fn squeue_lines_become_jobs_on_either_release() {
        let out = "12|PD|Licenses||(null)|n2|gres:shard:v100_0:1|multiplex:1|multiplex:app=bert\n\
                   13|R|None|n2|n2||gres/shard:v100_1:1|(null)|multiplex:app=x; note | with a bar\n\
                   14_[1-3]|PD|Priority||(null)||gres/shard:1|multiplex:1|(null)\n\
                   15|PD|Resources|n9|n1|(null)|N/A||(null)\n";
        let jobs = parse_jobs(out).unwrap();
        assert_eq!(jobs.len(), 3);
        assert_eq!(
            jobs[2].node.as_deref(),
            Some("n1"),
            "a pending job's node is the one it asked for"
        );
        assert!(jobs[0].pending && jobs[0].gated("multiplex") && jobs[0].node.is_none());
        assert_eq!(
            (jobs[0].excluded.as_deref(), jobs[1].excluded.as_deref()),
            (Some("n2"), None)
        );
        assert_eq!(jobs[0].gres_type(), Some("v100_0"));
        assert_eq!(jobs[1].gres, "shard:v100_1:1");
        assert_eq!(jobs[1].node.as_deref(), Some("n2"));
        assert!(!jobs[1].gated("multiplex"));
        assert_eq!(
            jobs[1].admin_comment.as_deref(),
            Some("multiplex:app=x; note | with a bar")
        );
        assert_eq!((jobs[2].gres.as_str(), jobs[2].gres_type()), ("", None));
        assert_eq!(jobs[2].id, 15);
        assert!(parse_jobs("12|PD|x").is_err());
        let untyped = Job {
            gres: "shard:2".into(),
            ..jobs[0].clone()
        };
        assert_eq!((untyped.gres_type(), untyped.gres_count()), (None, 2));
        assert!(Job {
            licenses: "matlab:2,multiplex:1".into(),
            ..jobs[0].clone()
        }
        .gated("multiplex"));
        assert!(!Job {
            licenses: "multiplexer:1".into(),
            ..jobs[0].clone()
        }
        .gated("multiplex"));
    }

    #[test]
    fn sinfo_lines_become_nodes_and_their_gpus_by_type() {
        let nodes = parse_nodes(
            "n1|idle|gpu:v100_0:1,gpu:v100_1:1,shard:v100_0:2,shard:v100_1:2\n\
             n2|down*|gpu:a100_0:1(S:0),shard:a100_0:4(S:0)\n\
             n3|mixed|gpu:2,shard:4\n",
        )
        .unwrap();
        assert_eq!(nodes[0].gpus(), vec![("v100_0".into(), 2), ("v100_1".into(), 2)]);
        assert!(nodes[0].usable() && !nodes[1].usable() && nodes[2].usable());
        assert_eq!(nodes[1].gpus(), vec![("a100_0".into(), 4)]);
        assert!(nodes[2].gpus().is_empty(), "untyped GPUs cannot be claimed");
        assert!(parse_nodes("n1|idle").is_err());
    }

    #[test]
    fn whole_gpus_and_shards_are_kept_apart_from_23_11_on() {
        for (version, apart) in [
            ("slurm 22.05.8", false),
            ("slurm 23.02.7", false),
            ("slurm 23.11.0", true),
            ("slurm 24.11.5", true),
            ("slurm 26.05.5", true),
            ("slurm-wlm 24.11", true),
            ("garbage", false),
        ] {
            assert_eq!(keeps_whole_and_shards_apart(version), apart, "{version}");
        }
    }

    #[test]
    fn gpus_held_whole_are_the_typed_gpus_in_use() {
        // 22.05: a plain job holds n1's GPU 0, a multiplexed one a shard of its GPU 1.
        let text = "n1|gpu:v100_0:1(IDX:0),gpu:v100_1:0(IDX:N/A),shard:v100_0:0(IDX:N/A),shard:v100_1:1(IDX:1)\n\
             n2|gpu:v100_0:0(IDX:N/A),gpu:v100_1:0(IDX:N/A),shard:v100_0:0(IDX:N/A),shard:v100_1:0(IDX:N/A)\n\
             n3|gpu:2(IDX:0-1),shard:0\n\
             n4|gpu:a100_0:1(IDX:0),gpu:a100_1:1(IDX:1)\n";
        let pairs = |p: &[(&str, &str)]| -> Vec<(String, String)> {
            p.iter().map(|(n, k)| (n.to_string(), k.to_string())).collect()
        };
        assert_eq!(
            parse_in_use(text, "gpu"),
            pairs(&[("n1", "v100_0"), ("n4", "a100_0"), ("n4", "a100_1")])
        );
        assert_eq!(parse_in_use(text, "shard"), pairs(&[("n1", "v100_1")]));
    }

    #[test]
    fn the_gpu_of_a_job_from_its_allocation_detail_on_either_release() {
        let d2205 = "JobId=5 JobName=x\n   Nodes=n2 CPU_IDs=0 Mem=0 GRES=shard:1(IDX:1)\n";
        assert_eq!(parse_job_gpu(d2205), Some(1));
        assert_eq!(parse_job_gpu("Nodes=n1 GRES=shard:v100_0:1(IDX:0-1)"), Some(0));
        assert_eq!(parse_job_gpu("Nodes=n2 CPU_IDs=0 Mem=0 GRES=shard:1(0/2,1/2)"), Some(1));
        assert_eq!(parse_job_gpu("Nodes=n2 GRES="), None);
        assert_eq!(parse_job_gpu("JobId=5"), None);
        assert_eq!(
            parse_license_total("LicenseName=multiplex Total=100000 Used=3 Free=99997 Reserved=100000 Remote=no"),
            Some(100000)
        );
        assert_eq!(parse_license_total("No licenses configured"), None);
    }

    #[test]
    fn reservations_as_slurmctld_lists_them() {
        let out = "ReservationName=multiplex-claimer-n1 StartTime=2026-11-28T08:00:00 EndTime=2026-11-28T08:01:00 \
                   Flags=ANY_NODES Licenses=multiplex-claimer:1 State=INACTIVE BurstBuffer=(null)\n\
                   ReservationName=multiplex-gate StartTime=2026-11-28T08:44:44 \
                   EndTime=2026-11-28T08:45:44 Duration=00:01:00 Licenses=multiplex:100000 State=ACTIVE\n";
        let names = |v: Vec<Reservation>| v.into_iter().map(|r| (r.name, r.end, r.active)).collect::<Vec<_>>();
        assert_eq!(
            names(parse_reservations(out)),
            vec![
                ("multiplex-claimer-n1".into(), "2026-11-28T08:01:00".into(), false),
                ("multiplex-gate".into(), "2026-11-28T08:45:44".into(), true)
            ]
        );
        assert_eq!(parse_reservations("No reservations in the system\n"), vec![]);
    }

    #[test]
    fn listpids_names_the_jobs_this_slurmd_runs() {
        let out = "PID      JOBID    STEPID   LOCALID GLOBALID\n123      17       batch    0       0\n\
                   124      17       batch    -       -\n200      21       0        0       0\n";
        assert_eq!(parse_listpids(out), HashSet::from([17, 21]));
    }

    /// A fake `scontrol` in a directory of its own: each call is counted in `calls`, the first
    /// `fail` fail with `error` on stderr, later ones list jobs 17 and 21.
    fn fake_scontrol(fail: u32, error: &str) -> tempfile::TempDir {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "#!/bin/sh\nn=$(cat \"$(dirname \"$0\")/calls\" 2>/dev/null || echo 0)\nn=$((n + 1))\n\
             echo $n > \"$(dirname \"$0\")/calls\"\n\
             if [ $n -le {fail} ]; then echo '{error}' >&2; exit 1; fi\n\
             printf 'PID JOBID STEPID LOCALID GLOBALID\\n123 17 batch 0 0\\n200 21 0 0 0\\n'\n"
        );
        let path = dir.path().join("scontrol");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    fn calls(dir: &tempfile::TempDir) -> String {
        std::fs::read_to_string(dir.path().join("calls"))
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn a_step_ending_while_slurmd_lists_them_is_listed_again() {
        let ended = "scontrol: error: StepId=7.batch does not exist on this node";
        let dir = fake_scontrol(1, ended);
        let slurm = Commands::new(dir.path());
        assert_eq!(slurm.running_here("n1").unwrap(), HashSet::from([17, 21]));
        assert_eq!(calls(&dir), "2");
        // Steps ending on every try: an error after a few, not a loop.
        let dir = fake_scontrol(100, ended);
        let e = Commands::new(dir.path()).running_here("n1").unwrap_err();
        assert!(e.to_string().contains("does not exist on this node"), "{e}");
        assert_eq!(calls(&dir), "3");
        // Any other failure is not tried again; no steps at all is an empty list.
        let dir = fake_scontrol(1, "slurm_load_node error: Unable to contact slurm controller");
        assert!(Commands::new(dir.path()).running_here("n1").is_err());
        assert_eq!(calls(&dir), "1");
        let dir = fake_scontrol(1, "No job steps exist on this node.");
        assert_eq!(Commands::new(dir.path()).running_here("n1").unwrap(), HashSet::new());
    }

    #[test]
    fn releases_before_23_02_6_merge_gres_updates() {
        for (v, merges) in [
            ("slurm 22.05.8", true),
            ("slurm-wlm 22.05.8", true),
            ("slurm 23.02.5", true),
            ("slurm 23.02.6", false),
            ("slurm 23.11.10", false),
            ("slurm 24.11.5", false),
            ("slurm 25.05.0-0rc1", false),
            ("gibberish", true),
        ] {
            assert_eq!(merges_gres_updates(v), merges, "{v}");
        }
    }

    #[test]
    fn too_late_is_told_apart_from_a_failure() {
        assert!(too_late(
            "scontrol: error: Job is no longer pending execution for job 5"
        ));
        assert!(too_late("slurm_update error: Invalid job id specified"));
        assert!(!too_late("slurm_update error: Access/permission denied"));
    }

    #[test]
    fn the_fake_applies_a_claim_only_to_a_pending_job_and_counts_every_call() {
        let job = |id, pending| Job {
            id,
            pending,
            reason: String::new(),
            node: None,
            excluded: None,
            gres: "shard:1".into(),
            licenses: "multiplex:1".into(),
            admin_comment: None,
        };
        let fake = Fake::new(FakeState {
            jobs: vec![job(1, true), job(2, false)],
            ..FakeState::default()
        });
        let pin = |id| Pin {
            job: id,
            node: "n1".into(),
            gres: Some("shard:v100_1:1".into()),
            untyped: true,
            start_now: false,
            licenses: String::new(),
            admin_comment: "multiplex:app=a".into(),
        };
        fake.claim(&pin(1)).unwrap();
        assert_eq!(fake.claim(&pin(2)), Err(SlurmError::NotPending(2)));
        assert_eq!(fake.claim(&pin(3)), Err(SlurmError::NotPending(3)));
        let jobs = fake.jobs("shared").unwrap();
        assert_eq!(jobs[0].gres_type(), Some("v100_1"));
        assert!(!jobs[0].gated("multiplex"));
        let s = fake.state.lock().unwrap();
        assert_eq!((s.reads, s.updates, s.claims.len()), (1, 3, 1));
    }
}
