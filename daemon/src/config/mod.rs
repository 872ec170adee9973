//! `multiplexd.toml`: a raw serde struct (unknown keys are errors) resolved into [`Config`].
//! Every key is defined once, in [`keys`]: its default, range and doc.
//!
//! The configuration of every part of the daemon lives here, so that the parts depend on the
//! configuration and never the other way round.

use serde::Deserialize;
use std::path::{Path, PathBuf};

pub mod keys;
mod values;

use keys::*;

/// The prior speed of each side of a pair never seen, where no config is at hand (the
/// history's upkeep, the simulator's oracle and grades): `policy.unknown_pair_speed`'s default.
pub const DEFAULT_UNKNOWN_PAIR_SPEED: f64 = UNKNOWN_PAIR_SPEED.default;

/// Where the daemon reads its configuration when `--config` is not given.
pub const DEFAULT_CONFIG: &str = "/etc/slurm/multiplexd.toml";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    node: Option<String>,
    socket: Option<PathBuf>,
    database: Option<PathBuf>,
    jobs_per_gpu: Option<u32>,
    telemetry_interval_s: Option<u64>,
    busy_record_s: Option<u64>,
    slurm_user: Option<String>,
    slurm_bin: Option<PathBuf>,
    mps: Option<bool>,
    #[serde(default)]
    gpu: Vec<RawGpu>,
    #[serde(default)]
    policy: RawPolicy,
    #[serde(default)]
    reconcile: RawReconcile,
    #[serde(default)]
    share: RawShare,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    claim: RawClaim,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClaim {
    enabled: Option<bool>,
    partition: Option<String>,
    lookahead: Option<usize>,
    look_ms: Option<u64>,
    slurmctld_percent: Option<f64>,
    lease_s: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShare {
    dir: Option<PathBuf>,
    every_s: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconcile {
    interval_s: Option<u64>,
    grace_s: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    index: u32,
    model: String,
    memory_mb: u64,
    uuid: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    unknown_pair_speed: Option<f64>,
    min_gain: Option<f64>,
    share_queue: Option<f64>,
    separate_below: Option<f64>,
    separate_look_ms: Option<u64>,
    put_back: Option<bool>,
}

/// One shared GPU of the node. Slurm knows it by the gres type `MODEL_INDEX`
/// ([`multiplex_protocol::gres::gpu_type`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSpec {
    pub index: u32,
    pub model: String,
    pub memory_mb: u64,
    /// NVML's UUID of the GPU (what telemetry matches processes by); `None` for GPUs listed
    /// without one, such as the test cluster's.
    pub uuid: Option<String>,
}

/// Where the node's shared GPUs come from.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuSource {
    /// Listed in the config (nodes without NVML, such as the local test cluster).
    Listed(Vec<GpuSpec>),
    /// Found through NVML at start.
    Nvml,
}

/// Placement knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Assumed speed of each side of a pair never seen together (prior).
    pub unknown_pair_speed: f64,
    /// The least predicted gain worth sharing a GPU for; below it the job waits for a better
    /// slot (up to the bypass bound).
    pub min_gain: f64,
    /// How long the queue must be for a share to pay: more jobs waiting than this times the
    /// GPUs times what the share loses against one job alone (0: any queue).
    pub share_queue: f64,
    /// A GPU whose measured jobs together deliver less than this times what they deliver
    /// without the newest one requeues that one (0: never; see [`crate::separate`]).
    pub separate_below: f64,
    /// How often the daemon looks for jobs to give back, milliseconds (read at start).
    pub separate_look_ms: u64,
    /// Whether a job out of GPU memory beside a partner is put back in the queue (read at
    /// start; see [`crate::put_back`]).
    pub put_back: bool,
}

/// The resolved configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub node: String,
    pub socket: PathBuf,
    pub database: PathBuf,
    pub jobs_per_gpu: u32,
    pub telemetry_interval_s: u64,
    /// How often a job's busy GPU time is recorded, seconds (0: never; see
    /// [`BUSY_RECORD_S`]).
    pub busy_record_s: u64,
    /// The user slurmstepd runs as besides root; may start and finish tasks.
    pub slurm_user: String,
    /// The directory of Slurm's commands (scontrol, squeue, sinfo); empty: found on PATH.
    pub slurm_bin: PathBuf,
    pub mps: bool,
    pub gpus: GpuSource,
    pub policy: PolicyConfig,
    pub reconcile: ReconcileConfig,
    pub share: ShareConfig,
    /// Where Prometheus scrapes the daemon (`GET /metrics`); `None`: no endpoint.
    pub metrics_listen: Option<std::net::SocketAddr>,
    pub claim: ClaimConfig,
}

/// A configuration that cannot be used; the text names the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl Config {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text).map_err(|message| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses config text; the error says what is wrong (with line and column from TOML).
    /// Every default and range comes from the key's definition in [`keys`].
    pub fn parse(text: &str) -> Result<Config, String> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        let node = match raw.node {
            Some(n) if !n.is_empty() => n,
            Some(_) => return Err("node must not be empty".into()),
            None => hostname(),
        };
        let share = ShareConfig::read(raw.share, &node)?;
        Ok(Config {
            jobs_per_gpu: JOBS_PER_GPU.read(raw.jobs_per_gpu)?,
            gpus: GpuSource::read(raw.gpu)?,
            policy: PolicyConfig::read(raw.policy)?,
            reconcile: ReconcileConfig {
                interval_s: RECONCILE_INTERVAL_S.read(raw.reconcile.interval_s)?,
                grace_s: RECONCILE_GRACE_S.read(raw.reconcile.grace_s)?,
            },
            share,
            metrics_listen: match raw.metrics.listen.as_deref() {
                None | Some("") => None,
                Some(a) => Some(a.parse::<std::net::SocketAddr>().map_err(|_| {
                    format!("metrics.listen = {a:?}: must be an address and port, such as \"127.0.0.1:9822\"")
                })?),
            },
            claim: ClaimConfig::read(raw.claim)?,
            socket: raw
                .socket
                .unwrap_or_else(|| PathBuf::from(format!("/run/multiplexd/{node}.sock"))),
            database: DATABASE.path(raw.database),
            node,
            telemetry_interval_s: TELEMETRY_INTERVAL_S.read(raw.telemetry_interval_s)?,
            busy_record_s: BUSY_RECORD_S.read(raw.busy_record_s)?,
            slurm_user: SLURM_USER.text(raw.slurm_user),
            slurm_bin: SLURM_BIN.path(raw.slurm_bin),
            mps: MPS.read(raw.mps),
        })
    }
}

impl GpuSource {
    /// The `[[gpu]]` tables: none, found through NVML; each index once, with its memory, a
    /// model that can name a gres type, and a UUID NVML would give.
    fn read(raw: Vec<RawGpu>) -> Result<GpuSource, String> {
        if raw.is_empty() {
            return Ok(GpuSource::Nvml);
        }
        let mut seen = std::collections::BTreeSet::new();
        for g in &raw {
            if !seen.insert(g.index) {
                return Err(format!("gpu index {} is listed twice", g.index));
            }
            if g.memory_mb == 0 {
                return Err(format!("gpu {}: memory_mb must be positive", g.index));
            }
            if multiplex_protocol::spec::parse_app(&g.model).is_err() {
                return Err(format!(
                    "gpu {}: model = {:?} must be 1 to 64 letters, digits, '.', '_' or '-' (it names the GPU's \
                     gres type in Slurm, {:?})",
                    g.index,
                    g.model,
                    multiplex_protocol::gres::gpu_type(&g.model, g.index)
                ));
            }
            if let Some(u) = g
                .uuid
                .as_deref()
                .filter(|u| !u.starts_with("GPU-") && !u.starts_with("MIG-"))
            {
                return Err(format!(
                    "gpu {}: uuid = {u:?} is not a GPU UUID (nvidia-smi -L shows them: GPU-...)",
                    g.index
                ));
            }
        }
        Ok(GpuSource::Listed(
            raw.into_iter()
                .map(|g| GpuSpec {
                    index: g.index,
                    model: g.model,
                    memory_mb: g.memory_mb,
                    uuid: g.uuid,
                })
                .collect(),
        ))
    }
}

impl PolicyConfig {
    fn read(raw: RawPolicy) -> Result<PolicyConfig, String> {
        Ok(PolicyConfig {
            unknown_pair_speed: UNKNOWN_PAIR_SPEED.read(raw.unknown_pair_speed)?,
            min_gain: MIN_GAIN.read(raw.min_gain)?,
            share_queue: SHARE_QUEUE.read(raw.share_queue)?,
            separate_below: SEPARATE_BELOW.read(raw.separate_below)?,
            separate_look_ms: SEPARATE_LOOK_MS.read(raw.separate_look_ms)?,
            put_back: PUT_BACK.read(raw.put_back),
        })
    }
}

impl ShareConfig {
    /// `[share]`: an absolute directory, and a node name that can name this node's file in it.
    fn read(raw: RawShare, node: &str) -> Result<ShareConfig, String> {
        if let Some(dir) = &raw.dir {
            if !dir.is_absolute() {
                return Err(format!(
                    "share.dir = {:?}: must be an absolute path",
                    dir.display().to_string()
                ));
            }
            if node.contains('/') || node.starts_with('.') {
                return Err(format!(
                    "node = {node:?}: cannot name this node's file in share.dir (no '/', no leading '.')"
                ));
            }
        }
        Ok(ShareConfig {
            dir: raw.dir,
            every_s: SHARE_EVERY_S.read(raw.every_s)?,
        })
    }
}

impl ClaimConfig {
    fn read(raw: RawClaim) -> Result<ClaimConfig, String> {
        let partition = CLAIM_PARTITION.text(raw.partition);
        if partition.is_empty() || partition.contains([',', ' ']) {
            return Err(format!("claim.partition = {partition:?}: must name one partition"));
        }
        Ok(ClaimConfig {
            enabled: CLAIM_ENABLED.read(raw.enabled),
            partition,
            lookahead: LOOKAHEAD.read(raw.lookahead)?,
            look_ms: LOOK_MS.read(raw.look_ms)?,
            slurmctld_percent: SLURMCTLD_PERCENT.read(raw.slurmctld_percent)?,
            lease_s: LEASE_S.read(raw.lease_s)?,
        })
    }
}

/// Reads the daemon's config for a command; a missing file says how to name another one.
pub fn load(path: &Path) -> Result<Config, String> {
    Config::load(path).map_err(|e| match &e {
        ConfigError::Read { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            format!("{e} (name the node's config with --config FILE or MULTIPLEXD_CONFIG=FILE)")
        }
        _ => e.to_string(),
    })
}

/// What a config re-read by a running daemon (SIGHUP) changes: `policy.min_gain`,
/// `policy.share_queue` and `policy.separate_below` apply at once; everything else is read at
/// start and takes a restart.
#[derive(Debug, Default, PartialEq)]
pub struct Reload {
    /// The policy to run with from now on (`None`: nothing that applies at once changed).
    pub policy: Option<PolicyConfig>,
    /// `key: old -> new` for each change applied at once.
    pub applied: Vec<String>,
    /// The keys changed in the file that keep their running value until a restart.
    pub needs_restart: Vec<&'static str>,
}

impl Config {
    /// Compares the running config with `new`, the file as it reads now.
    pub fn reload(&self, new: &Config) -> Result<Reload, String> {
        let needs_restart = self.restarts(new);
        let (old, now) = (&self.policy, &new.policy);
        let mut applied = Vec::new();
        for (key, was, is) in [
            (MIN_GAIN.name, old.min_gain, now.min_gain),
            (SHARE_QUEUE.name, old.share_queue, now.share_queue),
            (SEPARATE_BELOW.name, old.separate_below, now.separate_below),
        ] {
            if was != is {
                applied.push(format!("{key}: {was} -> {is}"));
            }
        }
        let policy = (!applied.is_empty()).then(|| PolicyConfig {
            min_gain: now.min_gain,
            share_queue: now.share_queue,
            separate_below: now.separate_below,
            ..old.clone()
        });
        Ok(Reload {
            policy,
            applied,
            needs_restart,
        })
    }

    /// The keys (or tables) changed in `new` that keep their running value until a restart.
    fn restarts(&self, new: &Config) -> Vec<&'static str> {
        // Destructured field by field, so that a key added later must be sorted here.
        let Config {
            node,
            socket,
            database,
            jobs_per_gpu,
            telemetry_interval_s,
            busy_record_s,
            slurm_user,
            slurm_bin,
            mps,
            gpus,
            policy,
            reconcile,
            share,
            metrics_listen,
            claim,
        } = new;
        // The prior is what the learned model was fitted with; min_gain, share_queue and
        // separate_below apply at once ([`Config::reload`]).
        let PolicyConfig {
            unknown_pair_speed,
            min_gain: _,
            share_queue: _,
            separate_below: _,
            separate_look_ms,
            put_back,
        } = policy;
        [
            (*node != self.node, "node"),
            (*socket != self.socket, "socket"),
            (*database != self.database, "database"),
            (*jobs_per_gpu != self.jobs_per_gpu, JOBS_PER_GPU.name),
            (
                *telemetry_interval_s != self.telemetry_interval_s,
                TELEMETRY_INTERVAL_S.name,
            ),
            (*busy_record_s != self.busy_record_s, BUSY_RECORD_S.name),
            (*slurm_user != self.slurm_user, "slurm_user"),
            (*slurm_bin != self.slurm_bin, "slurm_bin"),
            (*mps != self.mps, "mps"),
            (*gpus != self.gpus, "gpu"),
            (*reconcile != self.reconcile, "reconcile"),
            (*share != self.share, "share"),
            (*metrics_listen != self.metrics_listen, "metrics"),
            (*claim != self.claim, "claim"),
            (*separate_look_ms != self.policy.separate_look_ms, SEPARATE_LOOK_MS.name),
            (*put_back != self.policy.put_back, PUT_BACK.name),
            (
                *unknown_pair_speed != self.policy.unknown_pair_speed,
                UNKNOWN_PAIR_SPEED.name,
            ),
        ]
        .into_iter()
        .filter_map(|(changed, key)| changed.then_some(key))
        .collect()
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().split('.').next().unwrap_or("").to_string())
        .unwrap_or_default()
}

/// How the daemon reconciles with Slurm.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconcileConfig {
    /// Seconds between checks (0: never).
    pub interval_s: u64,
    /// Jobs that started less than this long ago are left alone (slurmd may not list them yet).
    pub grace_s: f64,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig {
            interval_s: RECONCILE_INTERVAL_S.default,
            grace_s: RECONCILE_GRACE_S.default,
        }
    }
}

/// The most pending jobs one look of the claimer weighs.
/// The cluster's claimer ([`crate::claimer`]): one daemon of the cluster runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimConfig {
    /// Whether this daemon is the claimer.
    pub enabled: bool,
    /// The partition where multiplexed jobs wait (job_submit's first shared partition).
    pub partition: String,
    /// How many of the first pending multiplexed jobs in Slurm's order one look weighs.
    pub lookahead: usize,
    /// Milliseconds between looks (each reads the queue once).
    pub look_ms: u64,
    /// The share of slurmctld's time, in percent, the queue's reads may take.
    pub slurmctld_percent: f64,
    /// How far ahead the gate is held: with the claimer gone, waiting jobs start where Slurm
    /// puts them within this long.
    pub lease_s: u64,
}

impl Default for ClaimConfig {
    fn default() -> Self {
        ClaimConfig {
            enabled: CLAIM_ENABLED.default,
            partition: CLAIM_PARTITION.default.into(),
            lookahead: LOOKAHEAD.default,
            look_ms: LOOK_MS.default,
            slurmctld_percent: SLURMCTLD_PERCENT.default,
            lease_s: LEASE_S.default,
        }
    }
}

/// Where and how often the daemon shares.
#[derive(Debug, Clone, PartialEq)]
pub struct ShareConfig {
    /// The shared directory; `None`: this node learns alone.
    pub dir: Option<PathBuf>,
    /// Seconds between two exchanges.
    pub every_s: u64,
}

impl Default for ShareConfig {
    fn default() -> Self {
        ShareConfig {
            dir: None,
            every_s: SHARE_EVERY_S.default,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claimer_is_off_unless_asked_and_its_bounds_are_checked() {
        let base = "node = \"n1\"\n";
        assert_eq!(Config::parse(base).unwrap().claim, ClaimConfig::default());
        assert!(!ClaimConfig::default().enabled);
        let c = Config::parse(&format!(
            "{base}[claim]\nenabled = true\npartition = \"gpu-shared\"\nlookahead = 16\nlook_ms = 500\nslurmctld_percent = 0.5\nlease_s = 120\n"
        ))
        .unwrap();
        assert_eq!(
            c.claim,
            ClaimConfig {
                enabled: true,
                partition: "gpu-shared".into(),
                lookahead: 16,
                look_ms: 500,
                slurmctld_percent: 0.5,
                lease_s: 120,
            }
        );
        for (bad, says) in [
            ("lookahead = 0", "claim.lookahead = 0: must be 1 to 64"),
            ("lookahead = 65", "claim.lookahead = 65"),
            ("partition = \"a,b\"", "one partition"),
            ("partition = \"\"", "one partition"),
            ("look_ms = 99", "claim.look_ms = 99: must be 100 to 60000"),
            ("slurmctld_percent = 0", "claim.slurmctld_percent = 0"),
            ("slurmctld_percent = 101", "claim.slurmctld_percent = 101"),
            ("lease_s = 59", "claim.lease_s = 59: must be 60 to 3600"),
            ("lease_s = 3601", "claim.lease_s = 3601"),
            ("jobs = 3", "unknown field"),
        ] {
            let e = Config::parse(&format!("{base}[claim]\n{bad}\n")).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // The example's commented-out lines, as an admin would uncomment them.
        let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/multiplexd.toml")).unwrap();
        let example = example
            .replace("# enabled = false", "enabled = true")
            .replace("# partition = \"shared\"", "partition = \"shared\"")
            .replace("# lookahead = 8", "lookahead = 8")
            .replace("# look_ms = 1000", "look_ms = 1000")
            .replace("# lease_s = 300", "lease_s = 300");
        let e = Config::parse(&example).unwrap().claim;
        assert_eq!(
            e,
            ClaimConfig {
                enabled: true,
                ..ClaimConfig::default()
            },
            "the example's values are the defaults"
        );
        // Read at start only: a reload says it needs a restart.
        let r = Config::parse(base).unwrap().reload(&c).unwrap();
        assert_eq!(r.needs_restart, ["claim"]);
    }

    #[test]
    fn the_gpu_checks_config_parses() {
        // tests/gpu/nvml-check writes its daemon's config in a heredoc that no CI run reads
        // (CI has no GPU): a key the daemon dropped must fail here, not on the GPU machine.
        let script = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/gpu/nvml-check")).unwrap();
        let start = script
            .find("<<TOML\n")
            .expect("nvml-check writes its config with <<TOML")
            + 7;
        let len = script[start..].find("\nTOML\n").expect("and ends it with TOML");
        let text = script[start..start + len]
            .replace("$sock", "/run/x.sock")
            .replace("$state", "/tmp/x");
        let c = Config::parse(&text).unwrap_or_else(|e| panic!("tests/gpu/nvml-check's config: {e}"));
        assert_eq!(c.gpus, GpuSource::Nvml);
        assert_eq!(c.busy_record_s, 2);
    }

    #[test]
    fn example_config_parses_and_names_the_gpus_as_slurm_does() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/multiplexd.toml")).unwrap();
        let c = Config::parse(&text).unwrap();
        assert_eq!(c.jobs_per_gpu, 2);
        assert_eq!(c.busy_record_s, BUSY_RECORD_S.default, "the example shows the default");
        assert_eq!(c.policy.min_gain, MIN_GAIN.default, "the example shows the default");
        assert_eq!(c.slurm_bin, PathBuf::new());
        // The same node as etc/slurm.conf.example's gpu01 and etc/gres.conf.example.
        let GpuSource::Listed(gpus) = &c.gpus else {
            panic!("{:?}", c.gpus)
        };
        assert_eq!(gpus.len(), 4);
        let conf = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/slurm.conf.example")).unwrap();
        let gres = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/gres.conf.example")).unwrap();
        let types: Vec<String> = gpus
            .iter()
            .map(|g| format!("gpu:{}:1", multiplex_protocol::gres::gpu_type(&g.model, g.index)))
            .collect();
        let shards = 4 * c.jobs_per_gpu;
        assert!(
            conf.contains(&format!("Gres={},shard:{shards}", types.join(","))),
            "slurm.conf.example names the GPUs {types:?}"
        );
        for g in gpus {
            let kind = multiplex_protocol::gres::gpu_type(&g.model, g.index);
            assert!(
                gres.contains(&format!("Name=gpu Type={kind} File=/dev/nvidia{}", g.index)),
                "gres.conf.example lacks {kind}"
            );
            assert!(gres.contains(&format!(
                "Name=shard Type={kind} Count={} File=/dev/nvidia{}",
                c.jobs_per_gpu, g.index
            )));
        }
        assert!(conf.contains("Licenses=multiplex:"), "the gate's license");
        assert!(conf.contains(",multiplex-claimer:1\n"), "the claimers' lease license");
        assert_eq!(
            c.share,
            ShareConfig::default(),
            "sharing stays off until a directory is named"
        );
        // The commented-out [share] lines, as an admin would uncomment them.
        let text = text
            .replace("# dir = ", "dir = ")
            .replace("# every_s = 600", "every_s = 600");
        let c = Config::parse(&text).unwrap();
        assert_eq!(c.share.dir, Some(PathBuf::from("/shared/slurm/multiplexd")));
        assert_eq!(c.share.every_s, 600);
    }

    #[test]
    fn a_reread_config_applies_the_policy_knobs_and_names_what_waits_for_a_restart() {
        let base = "node = \"n1\"\njobs_per_gpu = 2\n[policy]\nmin_gain = 0.25\n";
        let running = Config::parse(base).unwrap();
        // Nothing changed: nothing to do.
        assert_eq!(running.reload(&running.clone()).unwrap(), Reload::default());

        let new = Config::parse(
            "node = \"n1\"\njobs_per_gpu = 3\nslurm_bin = \"/opt/slurm/bin\"\n[policy]\nmin_gain = 0.1\n\
             unknown_pair_speed = 0.8\n",
        )
        .unwrap();
        let r = running.reload(&new).unwrap();
        assert_eq!(r.applied, ["policy.min_gain: 0.25 -> 0.1"]);
        assert_eq!(
            r.needs_restart,
            ["jobs_per_gpu", "slurm_bin", "policy.unknown_pair_speed"]
        );
        let p = r.policy.unwrap();
        assert_eq!(p.min_gain, 0.1);
        // What waits for a restart keeps its running value.
        assert_eq!(p.unknown_pair_speed, running.policy.unknown_pair_speed);

        // Only restart keys changed: no policy to apply, the keys named (the default socket
        // is named after the node).
        let r = running.reload(&Config::parse("node = \"n2\"\n[policy]\nmin_gain = 0.25\n").unwrap());
        let r = r.unwrap();
        assert_eq!((r.policy, r.needs_restart), (None, vec!["node", "socket"]));

        // Any threshold from 0 to below 1 applies, whatever the prior: pairs never tried are
        // taken for any predicted gain, so none keeps them from being tried.
        let new = Config::parse("node = \"n1\"\n[policy]\nunknown_pair_speed = 0.9\nmin_gain = 0.5\n").unwrap();
        let p = running.reload(&new).unwrap().policy.unwrap();
        assert_eq!((p.min_gain, p.unknown_pair_speed), (0.5, 0.7));

        // Giving jobs back applies at once (0 stops it); how often it looks takes a restart.
        let new = Config::parse("node = \"n1\"\n[policy]\nseparate_below = 0\nseparate_look_ms = 1000\n").unwrap();
        let r = running.reload(&new).unwrap();
        assert_eq!(r.policy.unwrap().separate_below, 0.0);
        assert!(
            r.needs_restart.contains(&"policy.separate_look_ms"),
            "{:?}",
            r.needs_restart
        );
    }

    #[test]
    fn defaults_are_the_daemons() {
        let c = Config::parse("node = \"n1\"").unwrap();
        assert_eq!(c.jobs_per_gpu, 2);
        assert_eq!(c.gpus, GpuSource::Nvml);
        assert_eq!(c.socket, PathBuf::from("/run/multiplexd/n1.sock"));
        assert_eq!(c.policy.min_gain, MIN_GAIN.default);
        assert_eq!(
            (c.policy.separate_below, c.policy.separate_look_ms),
            (SEPARATE_BELOW.default, SEPARATE_LOOK_MS.default)
        );
        assert_eq!(c.slurm_bin, PathBuf::new());
    }

    #[test]
    fn errors_name_the_problem() {
        let cases = [
            ("nodes = \"x\"", "unknown field `nodes`"),
            ("jobs_per_gpu = 0", "jobs_per_gpu = 0"),
            ("jobs_per_gpu = \"two\"", "invalid type"),
            (
                "[[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 0",
                "memory_mb must be positive",
            ),
            (
                "[[gpu]]\nindex=0\nmodel=\"a\"\nmemory_mb=1\n[[gpu]]\nindex=0\nmodel=\"a\"\nmemory_mb=1",
                "listed twice",
            ),
            (
                "[[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 1\nuuid = \"0\"",
                "uuid = \"0\" is not a GPU UUID",
            ),
            (
                "[[gpu]]\nindex = 0\nmodel = \"Tesla V100\"\nmemory_mb = 1",
                "model = \"Tesla V100\" must be 1 to 64 letters",
            ),
            ("[policy]\nunknown_pair_speed = 2.0", "unknown_pair_speed"),
            ("[policy]\nmin_gain = -0.1", "min_gain"),
            (
                "[share]\ndir = \"shared/x\"",
                "share.dir = \"shared/x\": must be an absolute path",
            ),
            ("[share]\ndir = \"/shared\"\nevery_s = 0", "share.every_s = 0"),
            ("[share]\nfolder = \"/shared\"", "unknown field `folder`"),
            ("[policy]\nmin_gain = 1.0", "policy.min_gain = 1: must be 0 to below 1"),
            // Removed with the claims: Slurm allocates the GPU the claimer chose.
            ("[policy]\nmode = \"observe\"", "unknown field `mode`"),
            ("[policy]\ndecline_retry_s = 60", "unknown field `decline_retry_s`"),
            ("[weight]\npublish = true", "unknown field `weight`"),
            ("[steer]\nlookahead = 8", "unknown field `steer`"),
            ("annotate = true", "unknown field `annotate`"),
            ("[reconcile]\nsqueue = \"squeue\"", "unknown field `squeue`"),
            ("[reconcile]\ngrace_s = 0.5", "reconcile.grace_s = 0.5"),
            (
                "[reconcile]\ngrace_s = inf",
                "reconcile.grace_s = inf: must be 1 to 86400",
            ),
            ("[reconcile]\ngrace_s = nan", "reconcile.grace_s = NaN"),
            (
                "[policy]\nseparate_below = 3",
                "policy.separate_below = 3: must be 0 (never) to 2",
            ),
            (
                "[policy]\nseparate_look_ms = 50",
                "policy.separate_look_ms = 50: must be 100 to 60000",
            ),
            (
                "[metrics]\nlisten = \"9822\"",
                "metrics.listen = \"9822\": must be an address and port",
            ),
        ];
        for (text, want) in cases {
            let e = Config::parse(&format!("node = \"n1\"\n{text}")).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
