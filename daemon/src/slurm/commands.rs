//! Slurm's own commands (squeue, sinfo, scontrol), each call under [`CALL_TIMEOUT`], and
//! the parsers of what they print.

use super::*;

/// How often `scontrol listpids` is run when steps end while it lists (each such run is cut
/// short by slurmd's error).
const LISTPIDS_TRIES: u32 = 3;

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
    match release_numbers(version)[..] {
        [major, minor, micro, ..] => (major, minor, micro) < (23, 2, 6),
        [major, minor] => (major, minor) < (23, 11),
        _ => true,
    }
}

/// Whether the Slurm of `scontrol --version` (`slurm 24.11.5`) keeps a GPU from being
/// allocated whole and as shards at once: from 23.11 on. 22.05, with a gres Type per GPU, gives
/// a GPU whole while a job still holds a shard of it once another job's shard of that GPU has
/// ended (its node's count of shards in use drops to none; seen on the test cluster).
pub fn keeps_whole_and_shards_apart(version: &str) -> bool {
    release_numbers(version).as_slice() >= [23, 11].as_slice()
}

/// The numbers of the release `scontrol --version` names: `[22, 5, 8]` of `slurm 22.05.8`
/// (`slurm-wlm` on Debian), as far as they read.
pub fn release_numbers(version: &str) -> Vec<u32> {
    version
        .split_whitespace()
        .last()
        .unwrap_or("")
        .split(['.', '-'])
        .map_while(|p| p.parse().ok())
        .collect()
}

impl Commands {
    /// What `scontrol --version` says (`slurm 22.05.8`).
    pub fn version(&self) -> Result<String, SlurmError> {
        Ok(self.run("scontrol", &["--version".to_string()])?.trim().to_string())
    }

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

impl Commands {
    /// Runs `scontrol create reservation` (`create`), replacing one of that name that lapsed
    /// but that slurmctld still keeps (it holds nothing).
    fn create_replacing(&self, create: &[String], name: &str) -> Result<(), SlurmError> {
        match self.run("scontrol", create) {
            Err(SlurmError::Failed(e)) if e.contains("Duplicate reservation name") => {
                self.delete_reservation(name)?;
                self.run("scontrol", create).map(|_| ())
            }
            other => other.map(|_| ()),
        }
    }
}

/// `scontrol create reservation` of `licenses` for root, on no node, from now `until`
/// (`EndTime=now+300`, `Duration=UNLIMITED`): the gate, the claimers' leases and the off switch.
fn reservation(name: &str, licenses: &str, until: &str) -> Vec<String> {
    [
        "create",
        "reservation",
        &format!("ReservationName={name}"),
        &format!("Licenses={licenses}"),
        "Flags=ANY_NODES",
        "Users=root",
        "StartTime=now",
        until,
    ]
    .map(str::to_string)
    .to_vec()
}

/// How often switching the gate off deletes it again after a claimer made it again.
const SWITCH_TRIES: usize = 5;

/// Whether scontrol's error says the job is past being updated as a pending job.
pub(super) fn too_late(text: &str) -> bool {
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

/// The fields of one job asked of squeue for [`Slurm::job_record`], the admin comment last.
const RECORD_FORMAT: &str = "BatchFlag:0|,Requeue:0|,RestartCnt:0|,admin_comment:0";

/// Reads squeue's line of [`RECORD_FORMAT`]; `None` for no line (the job is gone).
pub fn parse_job_record(out: &str) -> Option<JobRecord> {
    let line = out.lines().find(|l| !l.trim().is_empty())?;
    let f: Vec<&str> = line.splitn(4, '|').map(str::trim).collect();
    let [batch, requeue, restarts, comment] = f[..] else {
        return None;
    };
    Some(JobRecord {
        batch: batch == "1",
        requeue: requeue == "1",
        restarts: restarts.parse().ok()?,
        admin_comment: (!comment.is_empty() && comment != "(null)").then(|| comment.to_string()),
    })
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

/// sinfo's `NodeList|GresUsed` lines as the typed items of gres `name` in use, `(node, gres
/// type)`: for `gpu`, the GPUs held whole (`gpu:v100_1:1(IDX:1)`); for `shard`, the GPUs
/// whose shards are in use. Untyped items are left out.
pub fn parse_in_use(out: &str, name: &str) -> Vec<(String, String)> {
    let mut held = Vec::new();
    for line in out.lines() {
        let Some((node, used)) = line.split_once('|') else {
            continue;
        };
        for item in super::split_gres(used) {
            let mut parts = item.split(':');
            if let (Some(g), Some(kind), Some(n), None) = (parts.next(), parts.next(), parts.next(), parts.next()) {
                if g != name {
                    continue;
                }
                let pair = (node.trim().to_string(), kind.to_string());
                if n.parse::<u64>().is_ok_and(|n| n > 0) && !held.contains(&pair) {
                    held.push(pair);
                }
            }
        }
    }
    held
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

    fn held_whole(&self, partition: &str) -> Result<Vec<(String, String)>, SlurmError> {
        let args = [
            "--noheader".to_string(),
            "--Node".to_string(),
            format!("--partition={partition}"),
            "--Format=NodeList:0|,GresUsed:0".to_string(),
        ];
        Ok(parse_in_use(&self.run("sinfo", &args)?, "gpu"))
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
        let version = self.version()?;
        Ok(*self.clears_first.get_or_init(|| merges_gres_updates(&version)))
    }

    fn hold_gate(&self, gate: &Gate, lease_s: u64) -> Result<(), SlurmError> {
        if self.renew_lease(&gate.reservation, lease_s).unwrap_or(false) {
            return Ok(());
        }
        let licenses = format!("{}:{}", gate.license, gate.count);
        let create = reservation(&gate.reservation, &licenses, &format!("EndTime=now+{lease_s}"));
        self.create_replacing(&create, &gate.reservation)
    }

    fn reservations(&self) -> Result<Vec<Reservation>, SlurmError> {
        // Every reservation, one a line: a missing one is no error (`scontrol show reservation
        // NAME` says "not found" on its standard output and exits 1, like any failure).
        let args = ["-o".to_string(), "show".to_string(), "reservation".to_string()];
        Ok(parse_reservations(&self.run("scontrol", &args)?))
    }

    fn take_lease(&self, name: &str, license: &str, seconds: u64) -> Result<bool, SlurmError> {
        let create = reservation(name, &format!("{license}:1"), &format!("EndTime=now+{seconds}"));
        match self.create_replacing(&create, name) {
            Ok(()) => Ok(true),
            Err(SlurmError::Failed(e)) if e.contains("Invalid license specification") => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn renew_lease(&self, name: &str, seconds: u64) -> Result<bool, SlurmError> {
        let renew = [
            "update".to_string(),
            format!("ReservationName={name}"),
            format!("EndTime=now+{seconds}"),
        ];
        match self.run("scontrol", &renew) {
            Ok(_) => Ok(true),
            Err(SlurmError::Failed(e)) if e.contains("Requested reservation is invalid") => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn delete_reservation(&self, name: &str) -> Result<(), SlurmError> {
        match self.run("scontrol", &["delete".to_string(), format!("ReservationName={name}")]) {
            Err(SlurmError::Failed(e)) if e.contains("Requested reservation is invalid") => Ok(()),
            other => other.map(|_| ()),
        }
    }

    fn switch_gate(&self, gate: &Gate, on: bool) -> Result<(), SlurmError> {
        if on {
            return self.delete_reservation(&gate.off);
        }
        let create = reservation(&gate.off, &format!("{}:1", gate.license), "Duration=UNLIMITED");
        // A claimer may make the gate again between the two calls (it holds every license,
        // so the off reservation's one is refused): delete it again, a few times at most.
        let mut last = String::new();
        for _ in 0..SWITCH_TRIES {
            self.delete_reservation(&gate.reservation)?;
            match self.run("scontrol", &create) {
                Ok(_) => return Ok(()),
                Err(SlurmError::Failed(e)) if e.contains("Duplicate reservation name") => return Ok(()),
                Err(SlurmError::Failed(e)) if e.contains("Invalid license specification") => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(SlurmError::Failed(format!(
            "a claimer made the gate again each time it was deleted ({SWITCH_TRIES} times): {last}"
        )))
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

    fn job_record(&self, id: u32) -> Result<JobRecord, SlurmError> {
        let args = [
            "--noheader".to_string(),
            format!("--jobs={id}"),
            format!("--Format={RECORD_FORMAT}"),
        ];
        match self.run("squeue", &args) {
            Ok(out) => parse_job_record(&out).ok_or(SlurmError::NotPending(id)),
            Err(SlurmError::Failed(e)) if e.contains("Invalid job id") => Err(SlurmError::NotPending(id)),
            Err(e) => Err(e),
        }
    }

    fn set_admin_comment(&self, id: u32, admin_comment: &str) -> Result<(), SlurmError> {
        let args = [
            "update".to_string(),
            format!("JobId={id}"),
            format!("AdminComment={admin_comment}"),
        ];
        self.run("scontrol", &args).map(|_| ())
    }

    fn running_here(&self, node: &str) -> Result<HashSet<u32>, SlurmError> {
        // slurmd's own list of the processes of its job steps (`scontrol listpids`): no
        // slurmctld RPC, so a thousand nodes checking cost slurmctld nothing. A step that ends
        // while scontrol lists fails the whole list ("StepId=7.batch does not exist on this
        // node", seen on the test clusters): the list is read again, as it is now.
        let args = ["listpids".to_string(), "*".to_string(), node.to_string()];
        let mut tries = 0;
        loop {
            tries += 1;
            match self.run("scontrol", &args) {
                Ok(out) => return Ok(parse_listpids(&out)),
                Err(SlurmError::Failed(e)) if e.contains("No job steps exist") => return Ok(HashSet::new()),
                Err(SlurmError::Failed(e)) if e.contains("does not exist on this node") && tries < LISTPIDS_TRIES => {
                    tracing::debug!(error = %e, "a step ended while slurmd listed them; listing again");
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn private_jobs(&self) -> Result<bool, SlurmError> {
        let out = self.run("scontrol", &["show".to_string(), "config".to_string()])?;
        private_jobs(&out).ok_or_else(|| SlurmError::Failed("scontrol show config names no PrivateData".into()))
    }

    fn node_record(&self, node: &str) -> Result<NodeRecord, SlurmError> {
        let out = self.run(
            "scontrol",
            &[
                "show".to_string(),
                "node".to_string(),
                "-o".to_string(),
                node.to_string(),
            ],
        )?;
        Ok(parse_node_record(&out))
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
            Ok(out) => Ok(node_list(&out)),
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

    fn job_reads(&self) -> Result<Option<ReadCost>, SlurmError> {
        // sdiag is refused to a user who is not an operator where PrivateData has `usage`.
        Ok(Some(parse_job_reads(&self.run("sdiag", &[])?)))
    }
}

/// The GPU index of `scontrol show job -d -o`'s allocation detail: `GRES=shard:1(IDX:1)`
/// (22.05), `GRES=shard:v100_1:1(IDX:1)`, or per GPU the shards taken of those it has,
/// `GRES=shard:1(0/2,1/2)` (24.11): the first GPU it names.
pub fn parse_job_gpu(out: &str) -> Option<u32> {
    let detail = out.split_whitespace().find_map(|w| w.strip_prefix("GRES="))?;
    multiplex_protocol::gres::gpu_of_detail(detail)
}

/// slurmctld's job table reads of sdiag's output: its line `REQUEST_JOB_INFO ( 2003)
/// count:30 ave_time:65700 total_time:1971000` (not `REQUEST_JOB_INFO_SINGLE`'s); none where
/// it served none since its statistics were reset.
pub fn parse_job_reads(out: &str) -> ReadCost {
    let none = ReadCost::default();
    let Some(line) = out.lines().find(|l| {
        l.trim_start()
            .strip_prefix("REQUEST_JOB_INFO")
            .is_some_and(|rest| rest.trim_start().starts_with('('))
    }) else {
        return none;
    };
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
    };
    match (field("count:"), field("total_time:")) {
        (Some(reads), Some(total_us)) => ReadCost { reads, total_us },
        _ => none,
    }
}

/// The reservations of `scontrol -o show reservation` output (`No reservations in the
/// system` where there are none).
pub fn parse_reservations(out: &str) -> Vec<Reservation> {
    out.lines()
        .filter_map(|line| {
            let field = |key: &str| line.split_whitespace().find_map(|w| w.strip_prefix(key));
            Some(Reservation {
                name: field("ReservationName=")?.to_string(),
                end: field("EndTime=").unwrap_or("unknown").to_string(),
                active: field("State=") == Some("ACTIVE"),
            })
        })
        .collect()
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

/// The `NodeList` of `scontrol show job -o` output; `None` while the job has none.
pub fn node_list(scontrol: &str) -> Option<String> {
    let list = scontrol
        .split_whitespace()
        .find_map(|field| field.strip_prefix("NodeList="))?;
    (!list.is_empty() && list != "(null)").then(|| list.to_string())
}

/// Whether Slurm keeps jobs private, from `scontrol show config`: `PrivateData` naming `jobs`
/// (or `usage`, which implies it); `None` when the text has no `PrivateData` line.
pub fn private_jobs(show_config: &str) -> Option<bool> {
    let value = show_config.lines().find_map(|l| {
        let (key, value) = l.split_once('=')?;
        (key.trim() == "PrivateData").then(|| value.trim().to_ascii_lowercase())
    })?;
    Some(value.split(',').any(|v| matches!(v.trim(), "jobs" | "usage")))
}

/// A node's record from `scontrol show node -o`.
pub fn parse_node_record(text: &str) -> NodeRecord {
    let mut r = NodeRecord::default();
    for word in text.split_whitespace() {
        if let Some(v) = word.strip_prefix("Gres=") {
            for entry in v.split(',').filter(|e| !e.is_empty() && *e != "(null)") {
                let entry = entry.split('(').next().unwrap_or(entry);
                let mut parts = entry.split(':');
                let name = parts.next().unwrap_or("").to_string();
                let count = parts.next_back().and_then(|c| c.parse::<u64>().ok()).unwrap_or(1);
                *r.gres.entry(name).or_default() += count;
            }
        } else if let Some(v) = word.strip_prefix("Partitions=") {
            r.partitions = v.split(',').filter(|p| !p.is_empty()).map(String::from).collect();
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurms_private_data_says_whether_jobs_are_private() {
        let config = |v: &str| format!("Prolog = (null)\nPrivateData             = {v}\nProctrackType = x\n");
        assert_eq!(private_jobs(&config("none")), Some(false));
        assert_eq!(private_jobs(&config("accounts,reservations")), Some(false));
        assert_eq!(private_jobs(&config("jobs")), Some(true));
        assert_eq!(private_jobs(&config("accounts,usage")), Some(true));
        assert_eq!(private_jobs("SlurmUser = slurm\n"), None);
    }
}
