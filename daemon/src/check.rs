//! `multiplexd check-config`: does this node's daemon config agree with what Slurm was told?
//! The node's GPUs and slots in `multiplexd.toml`, gres.conf (and each GPU's own gres Type,
//! the name a claim gives Slurm), slurmctld's record of the node, the gate's license, device
//! fencing (cgroup.conf), plugstack.conf's socket, and the partitions that reach the node.
//! What disagrees is a finding with one sentence; the reading of files and commands is in [`crate::tools`], the
//! comparisons here.

use crate::config::{Config, GpuSource};
use crate::slurm::NodeRecord;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    Warning,
    Error,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub level: Level,
    pub text: String,
}

fn finding(level: Level, text: impl Into<String>) -> Finding {
    Finding {
        level,
        text: text.into(),
    }
}

/// What gres.conf says of one node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GresConf {
    /// GPU index (the N of the device file's trailing number) -> device file.
    pub gpus: BTreeMap<u32, String>,
    /// Shards per GPU index, where the shard line names its file.
    pub shards: BTreeMap<u32, u64>,
    /// The `Type=` of each GPU's gpu line and of its shard line, by GPU index (absent: none).
    pub gpu_types: BTreeMap<u32, String>,
    pub shard_types: BTreeMap<u32, String>,
    /// Shards on lines without a file (Slurm spreads them over the GPUs itself).
    pub shards_without_file: u64,
    /// `AutoDetect=nvml` (or another): the GPUs are not listed in the file.
    pub autodetect: Option<String>,
}

/// `/dev/nvidia[0-3]`, `/dev/nvidia[0,2]`, `/dev/nvidia1`: the files one `File=` names (one
/// bracket group, as gres.conf writes device ranges); `None` for what this cannot read.
pub fn expand_files(spec: &str) -> Option<Vec<String>> {
    let Some((stem, rest)) = spec.split_once('[') else {
        return Some(vec![spec.to_string()]);
    };
    let (inside, tail) = rest.split_once(']')?;
    let mut out = Vec::new();
    for part in inside.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi) = (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?);
        if hi < lo || hi - lo > 4096 {
            return None;
        }
        out.extend((lo..=hi).map(|i| format!("{stem}{i:0w$}{tail}", w = a.len())));
    }
    Some(out)
}

/// The GPU index a device file stands for: its trailing number (`/dev/nvidia3` -> 3).
fn index_of(file: &str) -> Option<u32> {
    let digits: String = file
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse().ok()
}

/// Reads gres.conf for one node. Lines with a `NodeName=` apply to the nodes it names
/// (`node_in(list)` answers, by Slurm's host-list rules); lines without one to every node.
pub fn parse_gres_conf(text: &str, node_in: &dyn Fn(&str) -> bool) -> Result<GresConf, String> {
    let mut g = GresConf::default();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |msg: String| format!("gres.conf line {}: {msg}", n + 1);
        let mut fields: BTreeMap<String, String> = BTreeMap::new();
        for word in line.split_whitespace() {
            let Some((k, v)) = word.split_once('=') else {
                return Err(at(format!("{word:?} is not KEY=VALUE")));
            };
            fields.insert(k.to_ascii_lowercase(), v.to_string());
        }
        if fields.get("nodename").is_some_and(|list| !node_in(list)) {
            continue;
        }
        g.add_line(&fields).map_err(at)?;
    }
    Ok(g)
}

impl GresConf {
    /// Adds what one line of this node's says (its fields, keys in lower case).
    fn add_line(&mut self, fields: &BTreeMap<String, String>) -> Result<(), String> {
        if let Some(a) = fields.get("autodetect") {
            if !a.eq_ignore_ascii_case("off") {
                self.autodetect = Some(a.clone());
            }
        }
        let files = match fields.get("file") {
            Some(f) => expand_files(f).ok_or_else(|| format!("cannot read File={f}"))?,
            None => Vec::new(),
        };
        let index = |f: &str| index_of(f).ok_or_else(|| format!("{f} ends in no GPU number"));
        let kind = fields.get("type");
        match fields.get("name").map(|s| s.as_str()) {
            Some("gpu") => {
                for f in files {
                    let i = index(&f)?;
                    self.gpus.insert(i, f);
                    if let Some(t) = kind {
                        self.gpu_types.insert(i, t.clone());
                    }
                }
            }
            Some("shard") => {
                let count: u64 = match fields.get("count") {
                    Some(c) => c.parse().map_err(|_| format!("Count={c} is not a number"))?,
                    None => 1,
                };
                if files.is_empty() {
                    self.shards_without_file += count;
                }
                for f in &files {
                    let i = index(f)?;
                    // Count= on a line with several files is spread over them.
                    *self.shards.entry(i).or_default() += count / files.len() as u64;
                    if let Some(t) = kind {
                        self.shard_types.insert(i, t.clone());
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The socket plugstack.conf gives the multiplex plugin on `node` (`%n` replaced), from its
/// `socket=` argument; `None` where no line loads `multiplex.so`.
pub fn plugstack_socket(text: &str, node: &str) -> Option<Option<String>> {
    let line = text.lines().map(str::trim).find(|l| {
        !l.starts_with('#')
            && l.split_whitespace()
                .nth(1)
                .is_some_and(|so| so.ends_with("multiplex.so"))
    })?;
    Some(
        line.split_whitespace()
            .find_map(|w| w.strip_prefix("socket="))
            .map(|s| s.replace("%n", node)),
    )
}

/// What job_submit's policy says about this node: its shared partitions, and whether its
/// `shared_nodes` names the node.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyView {
    pub partitions: Vec<String>,
    pub names_node: bool,
    /// Its `unflagged_on_shared`: jobs without --multiplex may run in the shared partitions.
    pub unflagged_on_shared: bool,
}

/// Everything known about the node, from the files and commands that could be read (`Err`:
/// why one could not).
pub struct Inputs<'a> {
    pub config: &'a Config,
    pub gres: Result<GresConf, String>,
    /// cgroup.conf's `ConstrainDevices` (`None`: not set, Slurm's default no).
    pub constrain_devices: Result<Option<String>, String>,
    /// How many of the gate's license slurmctld has (`Err`: none, or it could not be asked).
    pub gate_licenses: Result<u32, String>,
    /// How many of the claimers' lease license slurmctld has (`Err`: none, or unasked).
    pub lease_licenses: Result<u32, String>,
    pub record: Result<NodeRecord, String>,
    pub plugstack: Result<Option<Option<String>>, String>,
    pub policy: Option<PolicyView>,
    /// `scontrol --version`, and whether that Slurm keeps a GPU from being allocated whole
    /// and as shards at once (`slurm::keeps_whole_and_shards_apart`).
    pub slurm: Result<(String, bool), String>,
}

pub fn check(i: &Inputs) -> Vec<Finding> {
    let listed: Option<Vec<u32>> = match &i.config.gpus {
        GpuSource::Listed(g) => Some(g.iter().map(|g| g.index).collect()),
        GpuSource::Nvml => None,
    };
    let mut out = Vec::new();
    gres_gpus(i, listed.as_deref(), &mut out);
    gres_types(i, &mut out);
    devices(i, &mut out);
    gate(i, &mut out);
    lease(i, &mut out);
    shards(i, &mut out);
    record(i, listed.as_deref(), &mut out);
    plugstack(i, &mut out);
    out
}

/// gres.conf's GPUs against those multiplexd.toml lists.
fn gres_gpus(i: &Inputs, listed: Option<&[u32]>, out: &mut Vec<Finding>) {
    let c = i.config;
    match &i.gres {
        Err(e) => out.push(finding(Level::Warning, format!("gres.conf not checked: {e}"))),
        Ok(g) if g.gpus.is_empty() && g.autodetect.is_some() => out.push(finding(
            Level::Ok,
            format!(
                "gres.conf detects the GPUs itself (AutoDetect={}): only shard counts are checked",
                g.autodetect.as_deref().unwrap_or("")
            ),
        )),
        Ok(g) if g.gpus.is_empty() => out.push(finding(
            Level::Error,
            format!("gres.conf gives node {} no GPU (Name=gpu File=...)", c.node),
        )),
        Ok(g) => {
            if let Some(listed) = &listed {
                let missing: Vec<String> = listed
                    .iter()
                    .filter(|i| !g.gpus.contains_key(i))
                    .map(|i| i.to_string())
                    .collect();
                if missing.is_empty() {
                    out.push(finding(
                        Level::Ok,
                        format!("GPUs {} of multiplexd.toml are in gres.conf", join(listed)),
                    ));
                } else {
                    out.push(finding(
                        Level::Error,
                        format!(
                            "multiplexd.toml lists GPU {} that gres.conf does not give node {} (gres.conf has {})",
                            missing.join(", "),
                            c.node,
                            join(&g.gpus.keys().copied().collect::<Vec<_>>())
                        ),
                    ));
                }
                let unshared: Vec<u32> = g
                    .gpus
                    .keys()
                    .filter(|i| g.shards.contains_key(i) && !listed.contains(i))
                    .copied()
                    .collect();
                if !unshared.is_empty() {
                    out.push(finding(
                        Level::Warning,
                        format!(
                            "gres.conf has shards of GPU {} but multiplexd.toml does not list it: jobs Slurm gives a shard of it run on a listed GPU",
                            join(&unshared)
                        ),
                    ));
                }
            }
        }
    }
}

/// Each listed GPU's gres Type in gres.conf, as a claim names it.
fn gres_types(i: &Inputs, out: &mut Vec<Finding>) {
    let c = i.config;
    // Each listed GPU must carry the gres Type a claim names it by, on its gpu and its shard
    // line: a claim for a Type gres.conf lacks is refused by slurmctld, and a Type shared by
    // two GPUs lets Slurm allocate either.
    if let (Ok(g), GpuSource::Listed(gpus)) = (&i.gres, &c.gpus) {
        if g.autodetect.is_none() || !g.gpus.is_empty() {
            let mut wrong = Vec::new();
            for gpu in gpus {
                let want = multiplex_protocol::gres::gpu_type(&gpu.model, gpu.index);
                for (line, types) in [("gpu", &g.gpu_types), ("shard", &g.shard_types)] {
                    let have = types.get(&gpu.index).map_or("none", String::as_str);
                    if have != want {
                        wrong.push(format!("GPU {}'s {line} line has Type={have}, not {want}", gpu.index));
                    }
                }
            }
            if wrong.is_empty() {
                out.push(finding(
                    Level::Ok,
                    "each GPU's gpu and shard lines in gres.conf carry its own Type (MODEL_INDEX), as claims name it",
                ));
            } else {
                out.push(finding(
                    Level::Error,
                    format!(
                        "the claimer cannot name this node's GPUs to Slurm: {} (gres.conf needs Type=MODEL_INDEX on each GPU's gpu and shard lines; etc/gres.conf.example)",
                        wrong.join("; ")
                    ),
                ));
            }
        }
    }
}

/// Device fencing (cgroup.conf).
fn devices(i: &Inputs, out: &mut Vec<Finding>) {
    match &i.constrain_devices {
        Err(e) => out.push(finding(Level::Warning, format!("device fencing not checked: {e}"))),
        Ok(Some(v)) if v.eq_ignore_ascii_case("yes") => out.push(finding(
            Level::Ok,
            "cgroup.conf has ConstrainDevices=yes: each job opens only the GPU Slurm allocated it",
        )),
        Ok(v) => out.push(finding(
            Level::Warning,
            format!(
                "cgroup.conf has ConstrainDevices={}: a job can open every GPU of the node, not only the one Slurm allocated it (set ConstrainDevices=yes with TaskPlugin=task/cgroup)",
                v.as_deref().unwrap_or("no (not set)")
            ),
        )),
    }
}

/// The claimers' lease license, where this daemon may claim.
fn lease(i: &Inputs, out: &mut Vec<Finding>) {
    if !i.config.claim.enabled {
        return;
    }
    let lease = crate::claimer::LEASE_LICENSE;
    match &i.lease_licenses {
        Ok(n) if *n > 0 => out.push(finding(
            Level::Ok,
            format!("slurmctld has the claimers' lease license {lease}: this daemon stands by while another daemon with [claim] enabled claims"),
        )),
        _ => out.push(finding(
            Level::Warning,
            format!(
                "slurmctld has no license {lease}: this daemon claims alone, with no standby, and a second daemon with [claim] enabled would claim beside it (slurm.conf: Licenses={},{lease}:1)",
                multiplex_protocol::spec::GATE_LICENSE
            ),
        )),
    }
}

/// The gate's license in slurmctld.
fn gate(i: &Inputs, out: &mut Vec<Finding>) {
    match &i.gate_licenses {
        Ok(n) if *n > 0 => out.push(finding(
            Level::Ok,
            format!("slurmctld has {n} of the gate's license {}", multiplex_protocol::spec::GATE_LICENSE),
        )),
        Ok(_) => out.push(finding(
            Level::Error,
            format!(
                "slurmctld has no license {0}: job_submit adds {0}:1 to every multiplexed job, which slurmctld then refuses (slurm.conf: Licenses={0}:100000)",
                multiplex_protocol::spec::GATE_LICENSE
            ),
        )),
        Err(e) => out.push(finding(Level::Error, format!("the gate's license: {e}"))),
    }
}

/// gres.conf's shards per GPU against jobs_per_gpu.
fn shards(i: &Inputs, out: &mut Vec<Finding>) {
    let c = i.config;
    if let Ok(g) = &i.gres {
        let wrong: Vec<String> = g
            .shards
            .iter()
            .filter(|(_, &n)| n != u64::from(c.jobs_per_gpu))
            .map(|(i, n)| format!("GPU {i} has {n}"))
            .collect();
        if !wrong.is_empty() {
            out.push(finding(
                Level::Error,
                format!(
                    "jobs_per_gpu = {} but gres.conf's shards disagree ({}): Slurm would start more or fewer jobs per GPU than the daemon places",
                    c.jobs_per_gpu,
                    wrong.join(", ")
                ),
            ));
        } else if !g.shards.is_empty() {
            out.push(finding(
                Level::Ok,
                format!(
                    "gres.conf gives each GPU {} shards, as jobs_per_gpu says",
                    c.jobs_per_gpu
                ),
            ));
        }
        if g.shards.is_empty() && g.shards_without_file == 0 {
            out.push(finding(
                Level::Error,
                format!(
                    "gres.conf gives node {} no shards (Name=shard Count=... File=...)",
                    c.node
                ),
            ));
        }
    }
}

/// slurmctld's record of the node: its gres against jobs_per_gpu and the listed GPUs.
fn record(i: &Inputs, listed: Option<&[u32]>, out: &mut Vec<Finding>) {
    let c = i.config;
    match &i.record {
        Err(e) => out.push(finding(
            Level::Warning,
            format!("slurmctld's record of the node not checked: {e}"),
        )),
        Ok(r) => {
            let gpus = r.gres.get("gpu").copied().unwrap_or(0);
            let shards = r.gres.get("shard").copied().unwrap_or(0);
            let expect = gpus * u64::from(c.jobs_per_gpu);
            if shards != expect {
                out.push(finding(
                    Level::Error,
                    format!(
                        "slurmctld gives {} gpu:{gpus},shard:{shards}, but jobs_per_gpu = {} wants shard:{expect} (slurm.conf Gres=)",
                        c.node, c.jobs_per_gpu
                    ),
                ));
            } else {
                out.push(finding(
                    Level::Ok,
                    format!("slurmctld gives {} gpu:{gpus},shard:{shards}", c.node),
                ));
            }
            if let Some(listed) = &listed {
                if listed.len() as u64 > gpus {
                    out.push(finding(
                        Level::Error,
                        format!(
                            "multiplexd.toml lists {} GPUs, slurmctld knows {gpus} on {}",
                            listed.len(),
                            c.node
                        ),
                    ));
                }
            }
            partitions(i, r, out);
        }
    }
}

/// The node's partitions against job_submit's shared ones: jobs without --multiplex may be
/// given its GPUs whole (another partition of the node, or `unflagged_on_shared`), which is
/// safe only where Slurm keeps a GPU from being held whole and as shards at once.
fn partitions(i: &Inputs, r: &NodeRecord, out: &mut Vec<Finding>) {
    let c = i.config;
    let Some(p) = &i.policy else { return };
    let others: Vec<&str> = r
        .partitions
        .iter()
        .filter(|x| !p.partitions.contains(x))
        .map(String::as_str)
        .collect();
    if !r.partitions.iter().any(|x| p.partitions.contains(x)) {
        let text = format!(
            "{} is in no shared partition of job_submit's policy ({}); it is in {}",
            c.node,
            p.partitions.join(", "),
            r.partitions.join(", ")
        );
        return out.push(finding(Level::Error, text));
    }
    // job_submit keeps GPU jobs without --multiplex off the nodes shared_nodes names.
    let plain_here = match (p.names_node, others.is_empty(), p.unflagged_on_shared) {
        (true, _, _) | (false, true, false) => None,
        (false, true, true) => Some("its shared partitions (unflagged_on_shared = true)".to_string()),
        (false, false, _) => Some(format!("partition {}", others.join(", "))),
    };
    let Some(plain_here) = plain_here else {
        return out.push(finding(
            Level::Ok,
            format!("partitions of {}: {}", c.node, r.partitions.join(", ")),
        ));
    };
    out.push(match &i.slurm {
        Ok((_, true)) => finding(
            Level::Ok,
            format!(
                "jobs without --multiplex of {plain_here} may hold {}'s GPUs whole beside multiplexed jobs: this Slurm gives no GPU whole while shards of it are in use, nor a shard of one held whole",
                c.node
            ),
        ),
        Ok((version, false)) => finding(
            Level::Error,
            format!(
                "jobs without --multiplex of {plain_here} can be given {}'s GPUs whole, and {version} does so even while a multiplexed job holds a shard of the GPU (once another shard of it has ended): name the node in job_submit's shared_nodes, or use Slurm 23.11 or later",
                c.node
            ),
        ),
        Err(e) => finding(
            Level::Warning,
            format!("jobs without --multiplex of {plain_here} can be given {}'s GPUs whole; whether this Slurm keeps them from GPUs whose shards are in use is unknown ({e})", c.node),
        ),
    });
}

/// plugstack.conf's multiplex.so line and its socket.
fn plugstack(i: &Inputs, out: &mut Vec<Finding>) {
    let c = i.config;
    match &i.plugstack {
        Err(e) => out.push(finding(Level::Warning, format!("plugstack.conf not checked: {e}"))),
        Ok(None) => out.push(finding(
            Level::Error,
            "plugstack.conf loads no multiplex.so: jobs on this node are never placed",
        )),
        Ok(Some(None)) => out.push(finding(
            Level::Error,
            "plugstack.conf's multiplex.so line has no socket= argument",
        )),
        Ok(Some(Some(s))) if Path::new(s) == c.socket => {
            out.push(finding(Level::Ok, format!("plugstack.conf's socket is {s}")));
        }
        Ok(Some(Some(s))) => out.push(finding(
            Level::Error,
            format!(
                "plugstack.conf sends this node's jobs to {s}, but the daemon listens on {}",
                c.socket.display()
            ),
        )),
    }
}

fn join(v: &[u32]) -> String {
    v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slurm::parse_node_record;

    const GRES: &str = "# two GPUs\nNodeName=n[1-2] Name=gpu Type=v100_0 File=/dev/nvidia0\n\
        NodeName=n[1-2] Name=gpu Type=v100_1 File=/dev/nvidia1\n\
        NodeName=n1 Name=shard Type=v100_0 Count=2 File=/dev/nvidia0\nNodeName=n1 Name=shard Type=v100_1 Count=2 File=/dev/nvidia1\n\
        NodeName=n9 Name=gpu File=/dev/nvidia[0-7]\n";

    fn n1_or_n2(list: &str) -> bool {
        list == "n[1-2]" || list == "n1"
    }

    fn config(jobs_per_gpu: u32, gpus: &[u32]) -> Config {
        let mut text = format!(
            "node = \"n1\"\nsocket = \"/run/m/n1.sock\"\ndatabase = \"/tmp/x.sqlite\"\njobs_per_gpu = {jobs_per_gpu}\n"
        );
        for g in gpus {
            text.push_str(&format!("[[gpu]]\nindex = {g}\nmodel = \"v100\"\nmemory_mb = 16384\n"));
        }
        Config::parse(&text).unwrap()
    }

    fn record() -> NodeRecord {
        parse_node_record("NodeName=n1 Gres=gpu:2,shard:4 Partitions=shared State=IDLE")
    }

    fn errors(f: &[Finding]) -> Vec<&str> {
        f.iter()
            .filter(|f| f.level == Level::Error)
            .map(|f| f.text.as_str())
            .collect()
    }

    #[test]
    fn files_and_records_are_read() {
        assert_eq!(
            expand_files("/dev/nvidia[0-2,5]").unwrap(),
            ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia5"]
        );
        assert_eq!(expand_files("/x/g[08-10]").unwrap(), ["/x/g08", "/x/g09", "/x/g10"]);
        assert!(expand_files("/dev/nvidia[0-").is_none());
        let g = parse_gres_conf(GRES, &n1_or_n2).unwrap();
        assert_eq!(g.gpus.keys().copied().collect::<Vec<_>>(), [0, 1]);
        assert_eq!(g.shards, BTreeMap::from([(0, 2), (1, 2)]));
        assert_eq!(
            g.gpu_types,
            BTreeMap::from([(0, "v100_0".into()), (1, "v100_1".into())])
        );
        assert_eq!(g.shard_types, g.gpu_types);
        assert!(parse_gres_conf("Name=gpu oops", &n1_or_n2)
            .unwrap_err()
            .contains("line 1"));
        let r = parse_node_record("Gres=gpu:v100:4(S:0-1),shard:8 Partitions=debug,shared");
        assert_eq!(r.gres, BTreeMap::from([("gpu".into(), 4), ("shard".into(), 8)]));
        assert_eq!(r.partitions, ["debug", "shared"]);
        assert_eq!(
            plugstack_socket("# x\nrequired /p/multiplex.so socket=/run/m/%n.sock timeout_ms=1", "n1"),
            Some(Some("/run/m/n1.sock".into()))
        );
        assert_eq!(plugstack_socket("optional /p/other.so", "n1"), None);
    }

    /// What a node that agrees with Slurm in every way gives the check (24.11).
    fn agreeing(c: &Config) -> Inputs<'_> {
        Inputs {
            config: c,
            gres: parse_gres_conf(GRES, &n1_or_n2),
            constrain_devices: Ok(Some("yes".into())),
            gate_licenses: Ok(100_000),
            lease_licenses: Ok(1),
            record: Ok(record()),
            plugstack: Ok(Some(Some("/run/m/n1.sock".into()))),
            slurm: Ok(("slurm 24.11.5".into(), true)),
            policy: Some(PolicyView {
                partitions: vec!["shared".into()],
                names_node: false,
                unflagged_on_shared: false,
            }),
        }
    }

    #[test]
    fn an_agreeing_node_has_no_error_and_each_disagreement_is_named() {
        let c = config(2, &[0, 1]);
        let good = agreeing(&c);
        let f = check(&good);
        assert!(errors(&f).is_empty(), "{f:?}");
        assert!(f.iter().all(|f| f.level == Level::Ok), "{f:?}");

        let c3 = config(3, &[0, 1, 2]);
        let mut r = record();
        r.partitions = vec!["debug".into(), "shared".into()];
        let bad = Inputs {
            config: &c3,
            gres: parse_gres_conf(GRES, &n1_or_n2),
            constrain_devices: Ok(None),
            gate_licenses: Ok(0),
            lease_licenses: Ok(0),
            record: Ok(r),
            plugstack: Ok(Some(Some("/run/other/n1.sock".into()))),
            slurm: Ok(("slurm 22.05.8".into(), false)),
            policy: Some(PolicyView {
                partitions: vec!["shared".into()],
                names_node: false,
                unflagged_on_shared: false,
            }),
        };
        let f = check(&bad);
        let e = errors(&f).join("\n");
        for want in [
            "lists GPU 2 that gres.conf does not give node n1",
            "jobs_per_gpu = 3 but gres.conf's shards disagree (GPU 0 has 2, GPU 1 has 2)",
            "shard:4, but jobs_per_gpu = 3 wants shard:6",
            "lists 3 GPUs, slurmctld knows 2",
            "GPU 2's gpu line has Type=none, not v100_2; GPU 2's shard line has Type=none, not v100_2",
            "slurmctld has no license multiplex",
            "sends this node's jobs to /run/other/n1.sock, but the daemon listens on /run/m/n1.sock",
            "jobs without --multiplex of partition debug can be given n1's GPUs whole, and slurm 22.05.8 does so \
             even while a multiplexed job holds a shard of the GPU",
        ] {
            assert!(e.contains(want), "{want:?} not in:\n{e}");
        }
        // From 23.11 on the same partitions are fine: Slurm keeps whole GPUs and shards apart.
        let apart = Inputs {
            slurm: Ok(("slurm 24.11.5".into(), true)),
            ..bad
        };
        let f = check(&apart);
        assert!(
            f.iter().any(|f| f.level == Level::Ok
                && f.text
                    .contains("jobs without --multiplex of partition debug may hold n1's GPUs whole")),
            "{f:?}"
        );
        assert!(!errors(&f).iter().any(|e| e.contains("without --multiplex")), "{f:?}");
        // So is a job_submit that lets them into the shared partition, on 24.11 only.
        let unflagged = |slurm: (&str, bool)| Inputs {
            slurm: Ok((slurm.0.into(), slurm.1)),
            policy: Some(PolicyView {
                partitions: vec!["shared".into()],
                names_node: false,
                unflagged_on_shared: true,
            }),
            ..agreeing(&c)
        };
        assert!(errors(&check(&unflagged(("slurm 24.11.5", true)))).is_empty());
        assert!(errors(&check(&unflagged(("slurm 22.05.8", false))))[0]
            .contains("of its shared partitions (unflagged_on_shared = true) can be given n1's GPUs whole"));
        let bad = Inputs {
            slurm: Ok(("slurm 22.05.8".into(), false)),
            ..apart
        };
        assert!(
            f.iter().any(|f| f.level == Level::Warning
                && f.text
                    .contains("ConstrainDevices=no (not set): a job can open every GPU")),
            "{f:?}"
        );
        // Named in shared_nodes: no GPU job without --multiplex comes there, on any release.
        let named = Inputs {
            policy: Some(PolicyView {
                partitions: vec!["shared".into()],
                names_node: true,
                unflagged_on_shared: false,
            }),
            constrain_devices: Ok(Some("Yes".into())),
            ..bad
        };
        assert!(
            check(&named)
                .iter()
                .all(|f| f.level != Level::Warning
                    && !(f.level == Level::Error && f.text.contains("without --multiplex"))),
            "{:?}",
            check(&named)
        );
        // What could not be read is said, not guessed.
        let unread = Inputs {
            config: &c,
            gres: Err("cannot read /etc/slurm/gres.conf: No such file".into()),
            constrain_devices: Err("cannot read /etc/slurm/cgroup.conf: No such file".into()),
            gate_licenses: Ok(100_000),
            lease_licenses: Ok(1),
            record: Err("scontrol: not found".into()),
            plugstack: Ok(None),
            policy: None,
            slurm: Err("scontrol: not found".into()),
        };
        let f = check(&unread);
        assert_eq!(
            errors(&f),
            ["plugstack.conf loads no multiplex.so: jobs on this node are never placed"]
        );
        assert_eq!(f.iter().filter(|f| f.level == Level::Warning).count(), 3, "{f:?}");
        // A GPU whose shard line lacks its Type (22.05 then lets no two claimed jobs share it).
        let untyped_shards = GRES.replace("Name=shard Type=v100_1", "Name=shard");
        let f = check(&Inputs {
            gres: parse_gres_conf(&untyped_shards, &n1_or_n2),
            constrain_devices: Ok(Some("yes".into())),
            gate_licenses: Ok(100_000),
            lease_licenses: Ok(1),
            record: Ok(record()),
            plugstack: Ok(Some(Some("/run/m/n1.sock".into()))),
            policy: None,
            slurm: Ok(("slurm 22.05.8".into(), false)),
            config: &c,
        });
        assert_eq!(
            errors(&f),
            ["the claimer cannot name this node's GPUs to Slurm: GPU 1's shard line has Type=none, not v100_1 (gres.conf needs Type=MODEL_INDEX on each GPU's gpu and shard lines; etc/gres.conf.example)"]
        );
        // A daemon that may claim: with the lease license it stands by, without it it is
        // told it claims alone.
        let mut claiming = config(2, &[0, 1]);
        claiming.claim.enabled = true;
        let stands_by = Inputs {
            config: &claiming,
            gres: parse_gres_conf(GRES, &n1_or_n2),
            lease_licenses: Ok(1),
            ..good
        };
        let f = check(&stands_by);
        assert!(f.iter().all(|f| f.level == Level::Ok), "{f:?}");
        assert!(f.iter().any(|f| f.text.contains("this daemon stands by")), "{f:?}");
        let alone = Inputs {
            lease_licenses: Err("slurm.conf has no license \"multiplex-claimer\"".into()),
            ..stands_by
        };
        let f = check(&alone);
        assert!(
            f.iter()
                .any(|f| f.level == Level::Warning && f.text.contains("claims alone, with no standby")),
            "{f:?}"
        );
    }
}
