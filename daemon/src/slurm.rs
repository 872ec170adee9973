//! Every conversation the daemon has with Slurm goes through [`Slurm`]: one typed interface,
//! one timeout policy ([`CALL_TIMEOUT`]), Slurm's own commands as the real implementation
//! ([`Commands`]), and an in-memory [`Fake`] that the unit tests and the simulator share.
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

impl Job {
    /// The gres type it asks for (the GPU it is pinned to): `v100_1` of `shard:v100_1:1`.
    pub fn gres_type(&self) -> Option<&str> {
        gres_type(&self.gres)
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

/// The type of a gres request's first item, with or without Slurm's `gres:`/`gres/` prefix:
/// `v100_1` of `shard:v100_1:1` or `gres/shard:v100_1:1`; `None` for `shard:1`.
pub fn gres_type(gres: &str) -> Option<&str> {
    let first = gres.split(',').next()?;
    let first = first
        .strip_prefix("gres:")
        .or_else(|| first.strip_prefix("gres/"))
        .unwrap_or(first);
    let mut parts = first.split(':');
    parts.next()?;
    let second = parts.next()?;
    parts.next().map(|_| second)
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

/// The reservation that holds every gate license while a claimer runs: a job that still holds
/// one of them waits (`Reason=Licenses`) until a claim drops it or the reservation lapses.
#[derive(Debug, Clone, PartialEq)]
pub struct Gate {
    pub reservation: String,
    pub license: String,
    /// How many of the license slurm.conf has (all of them are reserved).
    pub count: u32,
}

/// What the daemon asks of Slurm.
pub trait Slurm: Send + Sync {
    /// The jobs of `partition` that wait or hold a slot (pending, running, configuring,
    /// completing), in Slurm's order (priority, then job id). One squeue.
    fn jobs(&self, partition: &str) -> Result<Vec<Job>, SlurmError>;
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
    /// Lets a pending job through the gate without pinning it (Slurm places it), writing
    /// `admin_comment`: a job no GPU of the cluster could hold, to fail at once with the reason.
    fn release(&self, job: u32, licenses: &str, admin_comment: &str) -> Result<(), SlurmError>;
    /// Requeues a running job. One scontrol requeue.
    fn requeue(&self, job: u32) -> Result<(), SlurmError>;
    /// The jobs that the slurmd of `node` runs (asks that slurmd, not slurmctld).
    fn running_here(&self, node: &str) -> Result<HashSet<u32>, SlurmError>;
    /// `scontrol show config`, whole.
    fn config(&self) -> Result<String, SlurmError>;
    /// `scontrol show node -o NODE`, whole.
    fn node_record(&self, node: &str) -> Result<String, SlurmError>;
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
}

/// Slurm's own commands, each run with [`CALL_TIMEOUT`].
#[derive(Debug)]
pub struct Commands {
    /// The directory of scontrol, squeue and sinfo; empty: found on PATH.
    pub bin: PathBuf,
    /// Whether a claim must clear the job's gres before it sets the GPU's type (asked of
    /// `scontrol --version` at the first claim; [`merges_gres_updates`]).
    clears_first: std::sync::OnceLock<bool>,
}

/// Whether Slurm `version` (`slurm 22.05.8`) merges a job update's gres into the job's gres
/// instead of replacing it: before 23.02.6 (SchedMD bug 17184) an update from an untyped
/// shard to a typed one is refused ("with and without type identification"), and one from a
/// type to another leaves the old type allocated beside the new, a shard that is never given
/// back. There a claim first clears the job's gres (`TresPerNode=`), then sets the type.
pub fn merges_gres_updates(version: &str) -> bool {
    let numbers: Vec<u32> = version
        .split_whitespace()
        .last()
        .unwrap_or("")
        .split(['.', '-'])
        .map_while(|p| p.parse().ok())
        .collect();
    match numbers[..] {
        [major, minor, micro, ..] => (major, minor, micro) < (23, 2, 6),
        [major, minor] => (major, minor) < (23, 11),
        _ => true,
    }
}

impl Commands {
    pub fn new(bin: &Path) -> Commands {
        Commands {
            bin: bin.to_path_buf(),
            clears_first: std::sync::OnceLock::new(),
        }
    }

    fn program(&self, name: &str) -> PathBuf {
        if self.bin.as_os_str().is_empty() {
            PathBuf::from(name)
        } else {
            self.bin.join(name)
        }
    }

    fn run(&self, program: &str, args: &[String]) -> Result<String, SlurmError> {
        crate::command::run(&self.program(program), args, CALL_TIMEOUT).map_err(SlurmError::Failed)
    }

    /// `scontrol update JobId=...` for a pending job; the ways slurmctld says it is too late
    /// become [`SlurmError::NotPending`].
    fn update_pending(&self, job: u32, fields: Vec<String>) -> Result<(), SlurmError> {
        let mut args = vec!["update".to_string(), format!("JobId={job}")];
        args.extend(fields);
        self.run("scontrol", &args).map(|_| ()).map_err(|e| match e {
            SlurmError::Failed(text) if too_late(&text) => SlurmError::NotPending(job),
            e => e,
        })
    }
}

/// Whether scontrol's error says the job is past being updated as a pending job.
fn too_late(text: &str) -> bool {
    [
        "Job is no longer pending",
        "Job has already finished",
        "Invalid job id",
        // A pending-only field (the node list) on a job that just started.
        "Invalid node name specified",
        "Requested operation is presently disabled",
    ]
    .iter()
    .any(|m| text.contains(m))
}

/// The fields asked of squeue, `|`-separated, the admin comment (which may hold `|`) last.
/// A pending job's node is the one it asked for (`ReqNodes`, what a claim sets); a running
/// job's the one it runs on (`NodeList`).
const JOB_FORMAT: &str =
    "JobID:0|,StateCompact:0|,Reason:0|,NodeList:0|,ReqNodes:0|,ExcNodes:0|,tres-per-node:0|,Licenses:0|,admin_comment:0";

/// Reads squeue's lines of [`JOB_FORMAT`]. Lines that are not one job (a pending array's
/// `123_[4-9]`) are skipped: Slurm starts such tasks as jobs of their own first.
pub fn parse_jobs(out: &str) -> Result<Vec<Job>, SlurmError> {
    let mut jobs = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.splitn(9, '|').map(str::trim).collect();
        if f.len() < 9 {
            return Err(SlurmError::Failed(format!("squeue printed {line:?}, not 9 fields")));
        }
        let Ok(id) = f[0].parse::<u32>() else {
            continue;
        };
        let null = |s: &str| (!s.is_empty() && s != "(null)" && s != "N/A").then(|| s.to_string());
        let gres = f[6].replace("gres/", "").replace("gres:", "");
        let pending = f[1] == "PD";
        jobs.push(Job {
            id,
            pending,
            reason: f[2].to_string(),
            node: if pending { null(f[4]) } else { null(f[3]) },
            excluded: null(f[5]),
            gres: if gres == "(null)" || gres == "N/A" {
                String::new()
            } else {
                gres
            },
            licenses: null(f[7]).unwrap_or_default(),
            admin_comment: null(f[8]),
        });
    }
    Ok(jobs)
}

/// Reads sinfo's lines of `NodeList|StateLong|Gres`.
pub fn parse_nodes(out: &str) -> Result<Vec<NodeInfo>, SlurmError> {
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let f: Vec<&str> = line.splitn(3, '|').map(str::trim).collect();
            match f[..] {
                [name, state, gres] => Ok(NodeInfo {
                    name: name.to_string(),
                    state: state.to_string(),
                    gres: gres.to_string(),
                }),
                _ => Err(SlurmError::Failed(format!("sinfo printed {line:?}, not 3 fields"))),
            }
        })
        .collect()
}

impl Slurm for Commands {
    fn jobs(&self, partition: &str) -> Result<Vec<Job>, SlurmError> {
        let args = [
            "--noheader".to_string(),
            "--states=PENDING,RUNNING,CONFIGURING,COMPLETING".to_string(),
            format!("--partition={partition}"),
            "--sort=-p,i".to_string(),
            format!("--Format={JOB_FORMAT}"),
        ];
        parse_jobs(&self.run("squeue", &args)?)
    }

    fn nodes(&self, partition: &str) -> Result<Vec<NodeInfo>, SlurmError> {
        let args = [
            "--noheader".to_string(),
            "--Node".to_string(),
            format!("--partition={partition}"),
            "--Format=NodeList:0|,StateLong:0|,Gres:0".to_string(),
        ];
        parse_nodes(&self.run("sinfo", &args)?)
    }

    fn claim(&self, pin: &Pin) -> Result<(), SlurmError> {
        // The job holds the gate's license meanwhile: cleared, it still waits for the pin.
        if pin.gres.is_some() && pin.untyped && Slurm::merges_gres_updates(self)? {
            self.update_pending(pin.job, vec!["TresPerNode=".to_string()])?;
        }
        let mut fields = vec![format!("Licenses={}", pin.licenses)];
        if let Some(gres) = &pin.gres {
            fields.push(format!("Gres={gres}"));
        }
        fields.push(format!("NodeList={}", pin.node));
        fields.push(format!("AdminComment={}", pin.admin_comment));
        if pin.start_now {
            fields.push("StartTime=now".to_string());
        }
        self.update_pending(pin.job, fields)
    }

    fn merges_gres_updates(&self) -> Result<bool, SlurmError> {
        if let Some(&c) = self.clears_first.get() {
            return Ok(c);
        }
        let version = self.run("scontrol", &["--version".to_string()])?;
        Ok(*self.clears_first.get_or_init(|| merges_gres_updates(&version)))
    }

    fn hold_gate(&self, gate: &Gate, lease_s: u64) -> Result<(), SlurmError> {
        let renew = [
            "update".to_string(),
            format!("ReservationName={}", gate.reservation),
            format!("EndTime=now+{lease_s}"),
        ];
        if self.run("scontrol", &renew).is_ok() {
            return Ok(());
        }
        let create = [
            "create".to_string(),
            "reservation".to_string(),
            format!("ReservationName={}", gate.reservation),
            format!("Licenses={}:{}", gate.license, gate.count),
            "Flags=ANY_NODES".to_string(),
            "Users=root".to_string(),
            "StartTime=now".to_string(),
            format!("EndTime=now+{lease_s}"),
        ];
        match self.run("scontrol", &create) {
            // One that ended but that slurmctld still keeps under its name.
            Err(SlurmError::Failed(e)) if e.contains("Duplicate reservation name") => {
                let delete = ["delete".to_string(), format!("ReservationName={}", gate.reservation)];
                self.run("scontrol", &delete)?;
                self.run("scontrol", &create).map(|_| ())
            }
            other => other.map(|_| ()),
        }
    }

    fn release(&self, job: u32, licenses: &str, admin_comment: &str) -> Result<(), SlurmError> {
        self.update_pending(
            job,
            vec![format!("Licenses={licenses}"), format!("AdminComment={admin_comment}")],
        )
    }

    fn requeue(&self, job: u32) -> Result<(), SlurmError> {
        self.run("scontrol", &["requeue".to_string(), job.to_string()])
            .map(|_| ())
    }

    fn running_here(&self, node: &str) -> Result<HashSet<u32>, SlurmError> {
        // slurmd's own list of the processes of its job steps (`scontrol listpids`): no
        // slurmctld RPC, so a thousand nodes checking cost slurmctld nothing.
        match self.run("scontrol", &["listpids".to_string(), "*".to_string(), node.to_string()]) {
            Ok(out) => Ok(parse_listpids(&out)),
            Err(SlurmError::Failed(e)) if e.contains("No job steps exist") => Ok(HashSet::new()),
            Err(e) => Err(e),
        }
    }

    fn config(&self) -> Result<String, SlurmError> {
        self.run("scontrol", &["show".to_string(), "config".to_string()])
    }

    fn node_record(&self, node: &str) -> Result<String, SlurmError> {
        self.run(
            "scontrol",
            &[
                "show".to_string(),
                "node".to_string(),
                "-o".to_string(),
                node.to_string(),
            ],
        )
    }

    fn hostnames(&self, list: &str) -> Result<Vec<String>, SlurmError> {
        let out = self.run(
            "scontrol",
            &["show".to_string(), "hostnames".to_string(), list.to_string()],
        )?;
        Ok(out.split_whitespace().map(str::to_string).collect())
    }

    fn job_nodes(&self, id: u32) -> Result<Option<String>, SlurmError> {
        let args = ["show".to_string(), "job".to_string(), "-o".to_string(), id.to_string()];
        match self.run("scontrol", &args) {
            Ok(out) => Ok(crate::inspect::node_list(&out)),
            Err(SlurmError::Failed(e)) if too_late(&e) => Err(SlurmError::NotPending(id)),
            Err(e) => Err(e),
        }
    }

    fn job_gpu(&self, id: u32) -> Result<Option<u32>, SlurmError> {
        let args = [
            "show".to_string(),
            "job".to_string(),
            "-d".to_string(),
            "-o".to_string(),
            id.to_string(),
        ];
        Ok(parse_job_gpu(&self.run("scontrol", &args)?))
    }

    fn license_total(&self, name: &str) -> Result<u32, SlurmError> {
        let args = [
            "show".to_string(),
            "licenses".to_string(),
            "-o".to_string(),
            name.to_string(),
        ];
        let out = self.run("scontrol", &args)?;
        parse_license_total(&out).ok_or_else(|| {
            SlurmError::Failed(format!(
                "slurm.conf has no license {name:?} (scontrol show licenses said {:?}); add Licenses={name}:100000",
                out.trim()
            ))
        })
    }
}

/// The GPU index of `scontrol show job -d -o`'s allocation detail: `GRES=shard:1(IDX:1)`
/// (22.05), `GRES=shard:v100_1:1(IDX:1)`, or per GPU the shards taken of those it has,
/// `GRES=shard:1(0/2,1/2)` (24.11): the first GPU it names.
pub fn parse_job_gpu(out: &str) -> Option<u32> {
    let detail = out.split_whitespace().find_map(|w| w.strip_prefix("GRES="))?;
    multiplex_protocol::gres::gpu_of_detail(detail)
}

/// The total of `scontrol show licenses -o NAME`: `LicenseName=multiplex Total=100000 ...`.
pub fn parse_license_total(out: &str) -> Option<u32> {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix("Total="))?
        .parse()
        .ok()
}

/// The job ids of `scontrol listpids` (`PID JOBID STEPID LOCALID GLOBALID` lines).
pub fn parse_listpids(out: &str) -> HashSet<u32> {
    out.lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter_map(|id| id.parse::<u32>().ok())
        .collect()
}

/// Slurm in memory: the jobs and nodes a test or the simulator sets, updates applied as
/// slurmctld applies them (a claim of a job that is not pending fails with
/// [`SlurmError::NotPending`]), and every call counted.
#[derive(Debug, Default)]
pub struct Fake {
    pub state: Mutex<FakeState>,
}

/// What [`Fake`] holds.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct FakeState {
    pub jobs: Vec<Job>,
    pub nodes: Vec<NodeInfo>,
    /// Until when (seconds from the fake's start of time, [`FakeState::now`]) the gate holds.
    pub gate_until: Option<u64>,
    pub now: u64,
    /// Jobs each slurmd runs.
    pub running: Vec<(String, u32)>,
    pub config: String,
    /// Reads (squeue, sinfo) and updates (claims, gate holds, releases, requeues) made.
    pub reads: u64,
    pub updates: u64,
    pub claims: Vec<Pin>,
    /// Each running job's GPU index, where its gres has no type.
    pub gpus: Vec<(u32, u32)>,
    /// How many gate licenses slurm.conf has.
    pub licenses: u32,
    /// Whether the Slurm faked merges gres updates (22.05).
    pub merges: bool,
    /// The next call of these kinds fails with this text.
    pub fail: Option<String>,
}

impl Fake {
    pub fn new(state: FakeState) -> Fake {
        Fake {
            state: Mutex::new(state),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut FakeState) -> Result<T, SlurmError>) -> Result<T, SlurmError> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = s.fail.take() {
            return Err(SlurmError::Failed(e));
        }
        f(&mut s)
    }

    fn pending_job(s: &mut FakeState, id: u32) -> Result<&mut Job, SlurmError> {
        match s.jobs.iter_mut().find(|j| j.id == id) {
            Some(j) if j.pending => Ok(j),
            _ => Err(SlurmError::NotPending(id)),
        }
    }
}

impl Slurm for Fake {
    fn jobs(&self, _partition: &str) -> Result<Vec<Job>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.jobs.clone())
        })
    }

    fn nodes(&self, _partition: &str) -> Result<Vec<NodeInfo>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.nodes.clone())
        })
    }

    fn claim(&self, pin: &Pin) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += if pin.gres.is_some() && pin.untyped && s.merges {
                2
            } else {
                1
            };
            let job = Fake::pending_job(s, pin.job)?;
            job.licenses = pin.licenses.clone();
            if let Some(gres) = &pin.gres {
                job.gres = gres.clone();
            }
            job.node = Some(pin.node.clone());
            job.admin_comment = Some(pin.admin_comment.clone());
            s.claims.push(pin.clone());
            Ok(())
        })
    }

    fn merges_gres_updates(&self) -> Result<bool, SlurmError> {
        self.with(|s| Ok(s.merges))
    }

    fn hold_gate(&self, _gate: &Gate, lease_s: u64) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            s.gate_until = Some(s.now + lease_s);
            Ok(())
        })
    }

    fn release(&self, job: u32, licenses: &str, admin_comment: &str) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            let job = Fake::pending_job(s, job)?;
            job.licenses = licenses.to_string();
            job.admin_comment = Some(admin_comment.to_string());
            Ok(())
        })
    }

    fn requeue(&self, job: u32) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            match s.jobs.iter_mut().find(|j| j.id == job && !j.pending) {
                Some(j) => {
                    j.pending = true;
                    Ok(())
                }
                None => Err(SlurmError::Failed(format!("job {job} is not running"))),
            }
        })
    }

    fn running_here(&self, node: &str) -> Result<HashSet<u32>, SlurmError> {
        self.with(|s| Ok(s.running.iter().filter(|(n, _)| n == node).map(|(_, j)| *j).collect()))
    }

    fn config(&self) -> Result<String, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.config.clone())
        })
    }

    fn node_record(&self, node: &str) -> Result<String, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            match s.nodes.iter().find(|n| n.name == node) {
                Some(n) => Ok(format!(
                    "NodeName={} Gres={} State={}",
                    n.name,
                    n.gres,
                    n.state.to_uppercase()
                )),
                None => Err(SlurmError::Failed(format!("Node {node} not found"))),
            }
        })
    }

    fn hostnames(&self, list: &str) -> Result<Vec<String>, SlurmError> {
        self.with(|_| Ok(list.split(',').map(str::to_string).collect()))
    }

    fn job_nodes(&self, id: u32) -> Result<Option<String>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            match s.jobs.iter().find(|j| j.id == id) {
                Some(j) => Ok(j.node.clone()),
                None => Err(SlurmError::NotPending(id)),
            }
        })
    }

    fn job_gpu(&self, id: u32) -> Result<Option<u32>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.gpus.iter().find(|(j, _)| *j == id).map(|(_, g)| *g))
        })
    }

    fn license_total(&self, _name: &str) -> Result<u32, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.licenses)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn listpids_names_the_jobs_this_slurmd_runs() {
        let out = "PID      JOBID    STEPID   LOCALID GLOBALID\n123      17       batch    0       0\n\
                   124      17       batch    -       -\n200      21       0        0       0\n";
        assert_eq!(parse_listpids(out), HashSet::from([17, 21]));
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
