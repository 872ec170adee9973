//! The `multiplexd` tools: `status` asks a running daemon; `history`, `explain`, `export` and
//! `import` read (and seed) the node's history database; `report` is what a job says of itself.
//! Each prints for people (through [`crate::inspect`]) or JSON, and fails with one sentence.

use crate::config::Config;
use crate::history::History;
use crate::inspect;
use crate::slurm::Commands;
use multiplex_protocol::spec::DEFAULT_PARTITION;
use multiplex_protocol::{client, Request, Response};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `multiplexd status`: what runs on which GPU, asked of the running daemon.
pub fn status(config_path: &Path, socket: Option<&Path>, json: bool) -> Result<(), String> {
    let socket = match socket {
        Some(s) => s.to_path_buf(),
        None => crate::config::load(config_path)?.socket,
    };
    let response = client::call(&socket, Duration::from_secs(5), Request::Status).map_err(|e| e.to_string())?;
    let status = match response {
        Response::Status(s) => s,
        Response::Error { message } => return Err(message),
        other => return Err(format!("unexpected answer: {other:?}")),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&status).map_err(|e| e.to_string())?);
        return Ok(());
    }
    print!("{}", inspect::StatusText(&status));
    Ok(())
}

/// The history database named by the config, opened (never created by a tool: a wrong path
/// is an error, not a new empty history).
fn open_history(config_path: &Path) -> Result<History, String> {
    let config = crate::config::load(config_path)?;
    history_of(&config, config_path)
}

/// [`open_history`] for a config already loaded from `config_path`.
fn history_of(config: &Config, config_path: &Path) -> Result<History, String> {
    match std::fs::metadata(&config.database) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "no history database at {} (named by {})",
                config.database.display(),
                config_path.display()
            ))
        }
        Err(e) => {
            return Err(format!(
                "cannot read the history {}: {e} (it is readable by root and the daemon's user only; \
                 multiplexd status and multiplexd explain JOBID ask the daemon instead)",
                config.database.display()
            ))
        }
    }
    History::open(&config.database).map_err(|e| e.to_string())
}

fn json_out<T: serde::Serialize>(v: &T) -> Result<(), String> {
    println!("{}", serde_json::to_string_pretty(v).map_err(|e| e.to_string())?);
    Ok(())
}

/// `multiplexd history`: the solo runtimes and pair speeds learned.
pub fn history(config_path: &Path, json: bool) -> Result<(), String> {
    let h = open_history(config_path)?;
    let data = h.export().map_err(|e| e.to_string())?;
    if json {
        return json_out(&data);
    }
    print!("{}", inspect::HistoryText(&data));
    Ok(())
}

/// `multiplexd explain JOB`: why the job got its GPU (or why it was declined), who shared it,
/// and what was learned from it.
pub fn explain(config_path: &Path, job_id: u32, json: bool) -> Result<(), String> {
    let config = crate::config::load(config_path)?;
    let found = match std::fs::File::open(&config.database) {
        // The history is readable by root and the daemon's user only: others ask the daemon,
        // which answers for their own jobs (all jobs where Slurm does not keep them private).
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            match client::call(&config.socket, Duration::from_secs(5), Request::Explain { job_id }) {
                Ok(Response::Explained {
                    json: serde_json::Value::Null,
                    ..
                }) => None,
                Ok(Response::Explained { text, json }) => Some((text, json)),
                Ok(Response::Error { message }) => return Err(message),
                Ok(other) => return Err(format!("unexpected answer: {other:?}")),
                Err(e) => {
                    return Err(format!(
                        "cannot read the history {} ({}), and the daemon did not answer: {e}",
                        config.database.display(),
                        std::io::Error::from(std::io::ErrorKind::PermissionDenied)
                    ))
                }
            }
        }
        _ => {
            let h = history_of(&config, config_path)?;
            inspect::explained(&h, job_id)
                .map_err(|e| e.to_string())?
                .map(|e| (e.text, e.json))
        }
    };
    let Some((text, data)) = found else {
        return Err(not_here(&config, job_id));
    };
    if json {
        return json_out(&data);
    }
    print!("{text}");
    Ok(())
}

/// Why `explain` has nothing on a job here: where Slurm says it ran, and how to ask there.
fn not_here(config: &Config, job_id: u32) -> String {
    let here = format!("job {job_id} is not in the history of {}", config.node);
    use crate::slurm::Slurm;
    match Commands::new(&config.slurm_bin).job_nodes(job_id) {
        Ok(nodes) => match nodes {
            Some(nodes) if nodes != config.node => format!(
                "{here}: Slurm says it ran on {nodes}; ask that node's daemon there \
                 (multiplexd explain {job_id}, with that node's --config or MULTIPLEXD_CONFIG)"
            ),
            Some(_) => {
                format!("{here}, though Slurm says it ran here: it was not multiplexed, or its record was compacted")
            }
            None => format!("{here}, and Slurm has not placed it on a node yet"),
        },
        Err(_) => format!(
            "{here}, and Slurm no longer knows where it ran (where accounting is kept: sacct -j {job_id} -o NodeList)"
        ),
    }
}

/// `multiplexd gate [on|off]`: switches the cluster's gate off (every multiplexed job waiting
/// at it goes where Slurm places it at once, and no claimer gates or claims) or on again, or
/// says where it stands. Slurm's commands are found as the daemon's config says; on a host
/// without that file (the controller), on PATH.
pub fn gate(config_path: &Path, switch: Option<&str>) -> Result<(), String> {
    use crate::claimer::{gate, LICENSE, OFF_EVERY_S, OFF_RESERVATION, RESERVATION};
    use crate::slurm::Slurm;
    let bin = match config_path.exists() {
        true => crate::config::load(config_path)?.slurm_bin,
        false => PathBuf::new(),
    };
    let slurm = Commands::new(&bin);
    let rights = |e: crate::slurm::SlurmError| {
        format!("{e} (switching the gate takes Slurm's operator or administrator rights: run it as root or SlurmUser)")
    };
    match switch {
        Some("off") => {
            let count = slurm.license_total(LICENSE).map_err(|e| e.to_string())?;
            slurm.switch_gate(&gate(count), false).map_err(rights)?;
            println!(
                "switched off: every multiplexed job waiting at the gate goes where Slurm places it now, and no \
                 claimer gates or claims until `multiplexd gate on` (reservation {OFF_RESERVATION} holds one \
                 {LICENSE} license meanwhile)"
            );
        }
        Some("on") => {
            slurm.switch_gate(&gate(0), true).map_err(rights)?;
            println!("switched on: the claimer makes the gate and claims again within {OFF_EVERY_S} s");
        }
        Some(other) => return Err(format!("gate: '{other}' is neither on nor off")),
        None => {
            let all = slurm.reservations().map_err(|e| e.to_string())?;
            let end = |name: &str| all.iter().find(|r| r.name == name).map(|r| r.end.clone());
            if end(OFF_RESERVATION).is_some() {
                println!(
                    "off: multiplexed jobs start where Slurm places them, and no claimer gates or claims \
                     (`multiplexd gate on` switches it on)"
                );
            } else if let Some(until) = end(RESERVATION) {
                println!("on: the claimer holds the gate until {until} and renews it");
            } else {
                println!(
                    "on, but no claimer holds the gate (no reservation {RESERVATION}): multiplexed jobs start \
                     where Slurm places them until a daemon with [claim] enabled makes it"
                );
            }
        }
    }
    Ok(())
}

/// What `multiplexd node-config` is told.
#[derive(Debug, clap::Args)]
pub struct NodeConfigArgs {
    /// The Slurm node name (default: this host's short name).
    #[arg(long)]
    pub node: Option<String>,
    /// Instead of NVML: this many GPUs, of --model, with --memory-mb each.
    #[arg(long)]
    pub gpus: Option<u32>,
    /// The GPUs' model (the history's key, e.g. v100), with --gpus.
    #[arg(long)]
    pub model: Option<String>,
    /// Each GPU's memory, MiB, with --gpus.
    #[arg(long, default_value_t = 16384)]
    pub memory_mb: u64,
    /// Jobs per GPU: its shards.
    #[arg(long, default_value_t = 2)]
    pub jobs_per_gpu: u32,
    /// Each GPU's device file; %g is its device number.
    #[arg(long, default_value = "/dev/nvidia%g")]
    pub device: String,
    /// Which part to print (gpus: the `[[gpu]]` list alone).
    #[arg(long, value_parser = ["all", "gres", "slurm", "toml", "gpus"], default_value = "all")]
    pub part: String,
}

/// `multiplexd node-config`: the node's gres.conf lines, slurm.conf line and multiplexd.toml,
/// from NVML or from the facts given.
pub fn node_config(a: &NodeConfigArgs) -> Result<(), String> {
    use crate::nodeconf::{self, Facts};
    let node = match &a.node {
        Some(n) => n.clone(),
        None => crate::command::run(Path::new("hostname"), &["-s".to_string()], Duration::from_secs(5))?
            .trim()
            .to_string(),
    };
    if a.jobs_per_gpu == 0 {
        return Err("--jobs-per-gpu must be 1 or more".into());
    }
    if !a.device.contains("%g") {
        return Err(format!(
            "--device {:?} must say where the device number goes (%g)",
            a.device
        ));
    }
    let (gpus, minors) = node_gpus(a)?;
    if gpus.is_empty() {
        return Err("no GPU: NVML found none (or --gpus 0)".into());
    }
    let f = Facts {
        node,
        gpus,
        jobs_per_gpu: a.jobs_per_gpu,
        device: a.device.clone(),
        minors,
    };
    let text = match a.part.as_str() {
        "gres" => nodeconf::gres_conf(&f),
        "slurm" => nodeconf::slurm_node(&f),
        "toml" => nodeconf::multiplexd_toml(&f),
        "gpus" => nodeconf::gpu_list(&f),
        _ => nodeconf::all(&f),
    };
    print!("{text}");
    Ok(())
}

/// The node's GPUs and their device numbers: as given, or NVML's.
fn node_gpus(a: &NodeConfigArgs) -> Result<(Vec<crate::config::GpuSpec>, Vec<u32>), String> {
    use crate::config::{GpuSource, GpuSpec};
    Ok(match (a.gpus, &a.model) {
        (Some(n), Some(model)) => {
            let gpus = (0..n)
                .map(|index| GpuSpec {
                    index,
                    model: model.clone(),
                    memory_mb: a.memory_mb,
                    uuid: None,
                })
                .collect();
            (gpus, vec![])
        }
        (Some(_), None) => return Err("--gpus needs --model".into()),
        (None, _) => {
            let nvml = |e: crate::gpus::GpuError| match e {
                crate::gpus::GpuError::NoNvml(why) => {
                    format!("NVML is unavailable ({why}): give the GPUs with --gpus N --model MODEL [--memory-mb MIB]")
                }
                e => e.to_string(),
            };
            let gpus = crate::gpus::discover(&GpuSource::Nvml).map_err(nvml)?;
            let minors = crate::gpus::minor_numbers().map_err(nvml)?;
            (gpus, minors)
        }
    })
}

/// `multiplexd export FILE`: what the history learned, as JSON for another node.
pub fn export(config_path: &Path, file: &Path) -> Result<(), String> {
    let h = open_history(config_path)?;
    let data = h.export().map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(&data).map_err(|e| e.to_string())?;
    if file == Path::new("-") {
        println!("{text}");
    } else {
        // Written beside and renamed into place: a failed export never leaves half a file.
        crate::share::write_atomically(file, &(text + "\n"))?;
        eprintln!(
            "multiplexd: exported {} solo runtimes and {} pair speeds to {}",
            data.solo.len(),
            data.pairs.len(),
            file.display()
        );
    }
    Ok(())
}

/// `multiplexd import FILE`: merges another node's export (more observations win), into a new
/// history where the node has none yet.
pub fn import(config_path: &Path, file: &Path) -> Result<(), String> {
    let text = if file == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).map_err(|e| format!("cannot read standard input: {e}"))?
    } else {
        read(file)?
    };
    let data: crate::history::Export =
        serde_json::from_str(&text).map_err(|e| format!("{}: not a multiplexd history export: {e}", file.display()))?;
    let config = crate::config::load(config_path)?;
    // Seeding a node before its daemon first starts is what import is for: the history the
    // config names is made (as the daemon would make it) where there is none yet.
    let mut h = if config.database.exists() {
        history_of(&config, config_path)?
    } else {
        let h = History::open(&config.database).map_err(|e| e.to_string())?;
        eprintln!("multiplexd: created the history {}", config.database.display());
        h
    };
    let done = h
        .import(&data, config.policy.unknown_pair_speed)
        .map_err(|e| format!("{}: {e}", file.display()))?;
    eprintln!(
        "multiplexd: imported {}: solo runtimes {} added, {} replaced; pair speeds {} added, {} replaced; \
         applications' memory {} added, {} raised; {} kept (ours had as many observations, or as much memory)",
        file.display(),
        done.solo_added,
        done.solo_replaced,
        done.pairs_added,
        done.pairs_replaced,
        done.memory_added,
        done.memory_raised,
        done.kept
    );
    Ok(())
}

/// `multiplexd report`: a job's progress, or that it ran out of GPU memory, sent to the daemon.
pub fn report(
    job: Option<u32>,
    progress: Option<f64>,
    oom: bool,
    socket: Option<PathBuf>,
    config: &Path,
) -> Result<(), String> {
    let job_id = match job {
        Some(j) => j,
        None => std::env::var("SLURM_JOB_ID")
            .ok()
            .and_then(|v| v.parse().ok())
            .ok_or("no --job given and SLURM_JOB_ID is not set: run this inside the job or name it")?,
    };
    let socket = match socket.or_else(|| std::env::var_os("MULTIPLEX_SOCKET").map(PathBuf::from)) {
        Some(s) => s,
        None => crate::config::load(config)?.socket,
    };
    let kind = match progress {
        Some(done) if !oom => multiplex_protocol::ReportKind::Progress { done },
        _ => multiplex_protocol::ReportKind::OutOfMemory,
    };
    // Out of memory beside a partner, the daemon asks slurmctld to put the job back before it
    // answers (three calls, each bounded by the Slurm adapter's 10 s).
    let wait = match kind {
        multiplex_protocol::ReportKind::OutOfMemory => Duration::from_secs(35),
        _ => Duration::from_secs(5),
    };
    let request = Request::Report(multiplex_protocol::ReportRequest { job_id, kind });
    match client::call(&socket, wait, request).map_err(|e| e.to_string())? {
        Response::Reported { message, .. } => {
            println!("{message}");
            Ok(())
        }
        Response::Error { message } => Err(message),
        other => Err(format!("unexpected answer: {other:?}")),
    }
}

/// A file's text, or an error that names it.
fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// `multiplexd check-config`: compares the daemon's config with gres.conf, slurmctld's record of
/// the node, plugstack.conf and job_submit's policy, and prints one line per check. `Ok(false)`
/// when something disagrees.
/// The value of `key` in a Slurm `key=value` file (slurm.conf, cgroup.conf), case aside.
fn conf_key(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split('#').next()?.trim().split_once('=')?;
        k.trim().eq_ignore_ascii_case(key).then(|| v.trim().to_string())
    })
}

/// Where Slurm's own commands look for slurm.conf.
const DEFAULT_SLURM_CONF: &str = "/etc/slurm/slurm.conf";
/// Where slurmd keeps the files it fetched from slurmctld when it runs configless (21.08 on),
/// and where Slurm's commands on that node read them when there is no slurm.conf of its own.
const CONFIGLESS_SLURM_CONF: &str = "/run/slurm/conf/slurm.conf";

/// slurm.conf as Slurm's commands find it: `SLURM_CONF`, else the default file, else a
/// configless slurmd's copy (`true`: configless); the others' files lie beside it.
fn slurm_conf_path(env: Option<PathBuf>, exists: &dyn Fn(&Path) -> bool) -> (PathBuf, bool) {
    if let Some(p) = env {
        return (p, false);
    }
    let (default, cached) = (Path::new(DEFAULT_SLURM_CONF), Path::new(CONFIGLESS_SLURM_CONF));
    if !exists(default) && exists(cached) {
        return (cached.to_path_buf(), true);
    }
    (default.to_path_buf(), false)
}

pub fn check_config(config_path: &Path) -> Result<bool, String> {
    use crate::check::{self, Inputs, Level};
    use crate::slurm::Slurm;
    let config = crate::config::load(config_path)?;
    let slurm = Commands::new(&config.slurm_bin);
    // gres.conf repeats one NodeName= list on line after line: each is asked of scontrol once.
    let asked = std::cell::RefCell::new(std::collections::HashMap::<String, bool>::new());
    let names_node = |list: &str| {
        *asked.borrow_mut().entry(list.to_string()).or_insert_with(|| {
            slurm
                .hostnames(list)
                .map(|hosts| hosts.contains(&config.node))
                .unwrap_or(false)
        })
    };
    let (slurm_conf, configless) = slurm_conf_path(std::env::var_os("SLURM_CONF").map(PathBuf::from), &|p| p.exists());
    let etc = slurm_conf.parent().unwrap_or(Path::new("/etc/slurm")).to_path_buf();
    let conf_value = |key: &str| read(&slurm_conf).ok().and_then(|text| conf_key(&text, key));
    let plugstack_path = conf_value("PlugStackConfig").map_or_else(|| etc.join("plugstack.conf"), PathBuf::from);
    let plugstack = read(&plugstack_path).map(|text| check::plugstack_socket(&with_includes(&text), &config.node));
    let gres_path = etc.join("gres.conf");
    let gres = read(&gres_path).and_then(|text| check::parse_gres_conf(&text, &|list| names_node(list)));
    let record = slurm.node_record(&config.node).map_err(|e| e.to_string());
    let policy_path = std::env::var_os("MULTIPLEX_JOB_SUBMIT_CONF")
        .map_or_else(|| etc.join("job_submit_multiplex.toml"), PathBuf::from);
    let (policy, mut findings) = job_submit_policy(&policy_path, &names_node);
    if configless {
        let text = format!(
            "configless: no {DEFAULT_SLURM_CONF}; Slurm's files read from slurmd's copy in {}",
            etc.display()
        );
        findings.insert(0, check::Finding { level: Level::Ok, text });
    }
    // cgroup.conf's ConstrainDevices (a key=value file as slurm.conf is).
    let cgroup_path = etc.join("cgroup.conf");
    let constrain_devices = read(&cgroup_path).map(|text| conf_key(&text, "ConstrainDevices"));
    let inputs = Inputs {
        config: &config,
        gres: gres.map_err(|e| format!("{e} ({} is read beside SLURM_CONF)", gres_path.display())),
        constrain_devices,
        gate_licenses: slurm.license_total(crate::claimer::LICENSE).map_err(|e| e.to_string()),
        lease_licenses: slurm
            .license_total(crate::claimer::LEASE_LICENSE)
            .map_err(|e| e.to_string()),
        record,
        plugstack,
        policy,
        slurm: slurm.version().map_err(|e| e.to_string()).map(|v| {
            let apart = crate::slurm::keeps_whole_and_shards_apart(&v);
            (v, apart)
        }),
    };
    findings.extend(check::check(&inputs));
    println!("checking node {} ({})", config.node, config_path.display());
    Ok(print_findings(&findings))
}

/// Prints each finding on a line of its own; `false` when one is an error.
fn print_findings(findings: &[crate::check::Finding]) -> bool {
    use crate::check::Level;
    for f in findings {
        let label = match f.level {
            Level::Ok => "ok",
            Level::Warning => "warning",
            Level::Error => "error",
        };
        println!("{label}: {}", f.text);
    }
    !findings.iter().any(|f| f.level == Level::Error)
}

/// plugstack.conf's text with the lines of the files it includes
/// (`include /etc/slurm/plugstack.conf.d/*.conf`).
fn with_includes(text: &str) -> String {
    let mut all = text.to_string();
    for pattern in text.lines().filter_map(|l| l.trim().strip_prefix("include ")) {
        let pattern = Path::new(pattern.trim());
        let (dir, name) = (pattern.parent().unwrap_or(Path::new("/")), pattern.file_name());
        let name = name.and_then(|n| n.to_str()).unwrap_or("");
        let (head, tail) = name.split_once('*').unwrap_or((name, ""));
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(head) && n.ends_with(tail) && (name.contains('*') || n == name) {
                all.push('\n');
                all.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
    }
    all
}

/// What job_submit's policy at `path` says of this node (`None`: not known), and a note on
/// how it was read.
fn job_submit_policy(
    path: &Path,
    names_node: &dyn Fn(&str) -> bool,
) -> (Option<crate::check::PolicyView>, Vec<crate::check::Finding>) {
    use crate::check::{Finding, Level, PolicyView};
    match read(path) {
        Ok(text) => match text.parse::<toml::Table>() {
            Ok(t) => (
                Some(PolicyView {
                    partitions: t
                        .get("partitions")
                        .and_then(|v| v.as_array())
                        .map(|a| a.iter().filter_map(|p| p.as_str().map(String::from)).collect())
                        .unwrap_or_else(|| vec![DEFAULT_PARTITION.into()]),
                    names_node: t.get("shared_nodes").and_then(|v| v.as_str()).is_some_and(names_node),
                    unflagged_on_shared: t.get("unflagged_on_shared").and_then(|v| v.as_bool()) == Some(true),
                }),
                Vec::new(),
            ),
            Err(e) => (
                None,
                vec![Finding {
                    level: Level::Warning,
                    text: format!("partitions not checked: {} is not valid TOML ({e})", path.display()),
                }],
            ),
        },
        Err(_) => (
            Some(PolicyView {
                partitions: vec![DEFAULT_PARTITION.into()],
                names_node: false,
                unflagged_on_shared: false,
            }),
            vec![Finding {
                level: Level::Ok,
                text: format!(
                    "no job_submit policy at {} here: its defaults (partition {DEFAULT_PARTITION}) assumed",
                    path.display()
                ),
            }],
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_conf_is_found_where_slurms_commands_find_it_configless_too() {
        let only = |present: &'static [&'static str]| move |p: &Path| present.iter().any(|q| Path::new(q) == p);
        let env = Some(PathBuf::from("/srv/slurm/slurm.conf"));
        assert_eq!(
            slurm_conf_path(env, &only(&[])),
            ("/srv/slurm/slurm.conf".into(), false)
        );
        let both = only(&[DEFAULT_SLURM_CONF, CONFIGLESS_SLURM_CONF]);
        assert_eq!(slurm_conf_path(None, &both), (DEFAULT_SLURM_CONF.into(), false));
        let cached = only(&[CONFIGLESS_SLURM_CONF]);
        assert_eq!(slurm_conf_path(None, &cached), (CONFIGLESS_SLURM_CONF.into(), true));
        // Neither: the default, whose absence the check then reports.
        assert_eq!(slurm_conf_path(None, &only(&[])), (DEFAULT_SLURM_CONF.into(), false));
    }
}
