//! `multiplexd.toml`: a raw serde struct (unknown keys are errors) resolved into [`Config`].
//!
//! The configuration of every part of the daemon lives here, so that the parts depend on the
//! configuration and never the other way round.

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default of `policy.unknown_pair_speed`, the prior speed of each side of a pair never seen.
pub const DEFAULT_UNKNOWN_PAIR_SPEED: f64 = 0.7;

/// Default of `policy.min_gain`: decline a job whose best GPU on the node would add less than
/// a quarter of a GPU's throughput. On the Gavel V100 world of `multiplex-simulate` (4 nodes
/// x 4 GPUs, 1,000 jobs, 30 seeds) it cut the learned policy's average JCT by 9% at load 1.0
/// and 11% at load 1.5 against no threshold, and changed nothing at load 0.5; 0.3 was
/// slightly better still there, but 0.4 (what a pair never seen is predicted to add with the
/// default `unknown_pair_speed`) stops the daemon from trying new pairs at all.
pub const DEFAULT_MIN_GAIN: f64 = 0.25;

/// Default of `busy_record_s`: every 5 minutes the daemon records each running job's busy GPU
/// time, which NVML's per-process SM utilisation adds up to on a time-sliced GPU; each record
/// ends a stretch that measures the job's speed beside its partners, as a progress report
/// does, so that a job that reports nothing is measured within minutes of a new pair, not when
/// a job of the pair ends (`docs/results.md`, "Busy GPU time instead of progress reports").
/// Not under MPS, where a job's utilisation no longer tells its share of the GPU's time.
pub const DEFAULT_BUSY_RECORD_S: u64 = 300;

/// The longest `reconcile.grace_s` (a day).
const MAX_GRACE_S: f64 = 86_400.0;

/// Default of `policy.max_declines`: 0, never stop declining. Bounding declines (3, with the
/// wait doubling to 960 s) cut declines per job 7 to 30 times in `tests/bench/tables-matrix`,
/// but it also took away the waiting that makes the learned policy good: average JCT rose 1%
/// to 91% (most on a table where few pairs gain, load 1.0; 5% on V100 at load 1.0). With
/// `[steer]` closing, declines are single ones of many jobs, which bounds do not reach, and a
/// wait growing to 960 s moved average JCT by -4% to +5% across the tables (docs/results.md):
/// a site chooses the trade.
pub const DEFAULT_MAX_DECLINES: u32 = 0;

/// Default of `policy.decline_retry_max_s`: 0, the wait does not grow (it is
/// `decline_retry_s` every time).
pub const DEFAULT_DECLINE_RETRY_MAX_S: u32 = 0;

/// Default of `policy.separate_below`: a GPU whose jobs were measured to deliver together less
/// than 0.9 of what they would without the newest of them (the pair loses clearly against
/// taking turns) gives that job back to Slurm (see [`crate::separate`]). The margin below 1
/// pays for the work the requeued job loses and its wait. In `multiplex-simulate` (5 seeds,
/// `--steer 8 --close`, docs/results.md) it cut the learned policy's average JCT by 9.8% on
/// V100 at loads 1.0 and 1.5 and by 6.1% at 1.0 where few pairs gain, and moved the other
/// tables and loads by -0.8% to +3.8%. A threshold of 1.0 lost 3.1% where few pairs gain at
/// load 1.5; 0.8 did about as well as 0.9.
pub const DEFAULT_SEPARATE_BELOW: f64 = 0.9;

/// Default of `policy.separate_look_ms`: measurements change at jobs' progress reports, minutes
/// apart, so a look every 5 s costs nothing and loses little.
pub const DEFAULT_SEPARATE_LOOK_MS: u64 = 5000;

/// How long a job declined after `restarts` requeues waits: `first` doubled per requeue, at
/// most `max` (never below `first`: a `max` of 0 or below `first` keeps the wait at `first`).
/// Backing off makes declines rarer: a job that no GPU here suits does not come back every
/// minute.
pub fn retry_after(first: u32, max: u32, restarts: u32) -> u32 {
    let doubled = u64::from(first) << restarts.min(20);
    doubled.min(u64::from(max.max(first))) as u32
}

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
    mps: Option<bool>,
    annotate: Option<bool>,
    #[serde(default)]
    gpu: Vec<RawGpu>,
    #[serde(default)]
    policy: RawPolicy,
    #[serde(default)]
    weight: RawWeight,
    #[serde(default)]
    reconcile: RawReconcile,
    #[serde(default)]
    share: RawShare,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    steer: RawSteer,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSteer {
    lookahead: Option<usize>,
    partition: Option<String>,
    hold_s: Option<u64>,
    defer: Option<bool>,
    close: Option<bool>,
    look_ms: Option<u64>,
    anticipate: Option<usize>,
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
    squeue: Option<PathBuf>,
    grace_s: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWeight {
    publish: Option<bool>,
    base: Option<u32>,
    republish_s: Option<u64>,
    scontrol: Option<PathBuf>,
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
    decline_retry_s: Option<u32>,
    decline_retry_max_s: Option<u32>,
    max_declines: Option<u32>,
    separate_below: Option<f64>,
    separate_look_ms: Option<u64>,
    mode: Option<Mode>,
}

/// Whether the daemon decides where jobs run, or only watches Slurm decide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The daemon picks each job's GPU, may decline, and publishes the node's weight.
    #[default]
    Decide,
    /// Each job runs on the GPU Slurm bound its shard to; the daemon records and learns from
    /// it as usual but never overrides, never declines and publishes no weight. For a site
    /// that wants a history before it lets the daemon decide, and for comparing the daemon
    /// with Slurm's own shard placement on the same cluster.
    Observe,
}

/// One shared GPU of the node.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSpec {
    pub index: u32,
    pub model: String,
    pub memory_mb: u64,
    /// NVML's UUID of the GPU, by which jobs are told their GPU (`CUDA_VISIBLE_DEVICES`);
    /// `None`: by index (GPUs listed without one, such as the test cluster's).
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
    /// The least predicted gain worth sharing a GPU for; below it the job is declined.
    pub min_gain: f64,
    /// How long a declined job waits before Slurm tries again, the first time; each requeue
    /// of the job doubles it (see [`retry_after`]).
    pub decline_retry_s: u32,
    /// The longest wait after a decline (0: no growth).
    pub decline_retry_max_s: u32,
    /// After this many requeues of a job, the daemon no longer declines it for a poor pair:
    /// it takes the best GPU where sharing loses no throughput (0: never).
    pub max_declines: u32,
    /// A GPU whose measured jobs together deliver less than this times what they deliver
    /// without the newest one requeues that one (0: never; see [`crate::separate`]).
    pub separate_below: f64,
    /// How often the daemon looks for jobs to give back, milliseconds (read at start).
    pub separate_look_ms: u64,
    pub mode: Mode,
}

impl PolicyConfig {
    /// Whether a job's declines so far change anything (`max_declines` or a growing wait).
    pub fn counts_declines(&self) -> bool {
        self.max_declines > 0 || self.decline_retry_max_s > self.decline_retry_s
    }

    /// Whether a job declined or requeued `restarts` times has waited long enough for a good
    /// partner (see `max_declines`).
    pub fn waited_enough(&self, restarts: u32) -> bool {
        self.max_declines > 0 && restarts >= self.max_declines
    }

    /// The least gain worth sharing for, for a job declined or requeued `restarts` times: past
    /// `max_declines`, any share that loses no throughput. (A pair that loses, or cannot fit,
    /// still waits: placing it would slow both jobs for hours to save minutes.)
    pub fn min_gain_after(&self, restarts: u32) -> f64 {
        if self.waited_enough(restarts) {
            self.min_gain.min(f64::MIN_POSITIVE)
        } else {
            self.min_gain
        }
    }

    /// How long a job declined after `restarts` declines or requeues waits.
    pub fn retry_after(&self, restarts: u32) -> u32 {
        retry_after(self.decline_retry_s, self.decline_retry_max_s, restarts)
    }
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
    /// [`DEFAULT_BUSY_RECORD_S`]).
    pub busy_record_s: u64,
    /// The user slurmstepd runs as besides root; may place and finish tasks.
    pub slurm_user: String,
    pub mps: bool,
    /// Write where each job runs into its admin comment (`scontrol update`).
    pub annotate: bool,
    pub gpus: GpuSource,
    pub policy: PolicyConfig,
    pub weight: WeightConfig,
    pub reconcile: ReconcileConfig,
    pub share: ShareConfig,
    /// Where Prometheus scrapes the daemon (`GET /metrics`); `None`: no endpoint.
    pub metrics_listen: Option<std::net::SocketAddr>,
    pub steer: SteerConfig,
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
    pub fn parse(text: &str) -> Result<Config, String> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        let node = match raw.node {
            Some(n) if !n.is_empty() => n,
            Some(_) => return Err("node must not be empty".into()),
            None => hostname(),
        };
        let jobs_per_gpu = raw.jobs_per_gpu.unwrap_or(2);
        if !(1..=16).contains(&jobs_per_gpu) {
            return Err(format!("jobs_per_gpu = {jobs_per_gpu}: must be between 1 and 16"));
        }
        let gpus = if raw.gpu.is_empty() {
            GpuSource::Nvml
        } else {
            let mut seen = std::collections::BTreeSet::new();
            for g in &raw.gpu {
                if !seen.insert(g.index) {
                    return Err(format!("gpu index {} is listed twice", g.index));
                }
                if g.memory_mb == 0 {
                    return Err(format!("gpu {}: memory_mb must be positive", g.index));
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
            GpuSource::Listed(
                raw.gpu
                    .into_iter()
                    .map(|g| GpuSpec {
                        index: g.index,
                        model: g.model,
                        memory_mb: g.memory_mb,
                        uuid: g.uuid,
                    })
                    .collect(),
            )
        };
        let unknown_pair_speed = raw.policy.unknown_pair_speed.unwrap_or(DEFAULT_UNKNOWN_PAIR_SPEED);
        if !(0.0..=1.0).contains(&unknown_pair_speed) || unknown_pair_speed == 0.0 {
            return Err(format!(
                "policy.unknown_pair_speed = {unknown_pair_speed}: must be in (0, 1]"
            ));
        }
        let min_gain = raw.policy.min_gain.unwrap_or(DEFAULT_MIN_GAIN);
        check_min_gain(min_gain).map_err(|e| format!("policy.min_gain = {min_gain}: {e}"))?;
        let decline_retry_s = raw.policy.decline_retry_s.unwrap_or(60);
        let decline_retry_max_s = raw.policy.decline_retry_max_s.unwrap_or(DEFAULT_DECLINE_RETRY_MAX_S);
        if decline_retry_max_s != 0 && decline_retry_max_s < decline_retry_s {
            return Err(format!(
                "policy.decline_retry_max_s = {decline_retry_max_s}: must be 0 (no growth) or at least \
                 policy.decline_retry_s ({decline_retry_s})"
            ));
        }
        let separate_below = raw.policy.separate_below.unwrap_or(DEFAULT_SEPARATE_BELOW);
        if !(0.0..=2.0).contains(&separate_below) {
            return Err(format!(
                "policy.separate_below = {separate_below}: must be between 0 (never separate) and 2"
            ));
        }
        let separate_look_ms = raw.policy.separate_look_ms.unwrap_or(DEFAULT_SEPARATE_LOOK_MS);
        if !(MIN_LOOK_MS..=MAX_LOOK_MS).contains(&separate_look_ms) {
            return Err(format!(
                "policy.separate_look_ms = {separate_look_ms}: must be between {MIN_LOOK_MS} and {MAX_LOOK_MS} \
                 (milliseconds between looks for jobs to give back)"
            ));
        }
        let dw = WeightConfig::default();
        let base = raw.weight.base.unwrap_or(dw.base);
        if base == 0 || base > 1_000_000 {
            return Err(format!("weight.base = {base}: must be between 1 and 1000000"));
        }
        let weight = WeightConfig {
            publish: raw.weight.publish.unwrap_or(dw.publish),
            base,
            republish_s: raw.weight.republish_s.unwrap_or(dw.republish_s),
            scontrol: raw.weight.scontrol.unwrap_or(dw.scontrol),
            retry: dw.retry,
        };
        let dr = ReconcileConfig::default();
        let reconcile = ReconcileConfig {
            interval_s: raw.reconcile.interval_s.unwrap_or(dr.interval_s),
            squeue: raw.reconcile.squeue.unwrap_or(dr.squeue),
            grace_s: raw.reconcile.grace_s.unwrap_or(dr.grace_s),
        };
        // `inf` would keep the slots of jobs that ended while the daemon was down for ever.
        if !(1.0..=MAX_GRACE_S).contains(&reconcile.grace_s) {
            return Err(format!(
                "reconcile.grace_s = {}: must be between 1 and {MAX_GRACE_S} seconds",
                reconcile.grace_s
            ));
        }
        let ds = ShareConfig::default();
        let share = ShareConfig {
            dir: raw.share.dir,
            every_s: raw.share.every_s.unwrap_or(ds.every_s),
        };
        if let Some(dir) = &share.dir {
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
        if share.every_s == 0 {
            return Err("share.every_s = 0: must be at least 1 second".into());
        }
        let metrics_listen = match raw.metrics.listen.as_deref() {
            None | Some("") => None,
            Some(a) => Some(a.parse::<std::net::SocketAddr>().map_err(|_| {
                format!("metrics.listen = {a:?}: must be an address and port, such as \"127.0.0.1:9822\"")
            })?),
        };
        let dst = SteerConfig::default();
        let steer = SteerConfig {
            lookahead: raw.steer.lookahead.unwrap_or(dst.lookahead),
            partition: raw.steer.partition.unwrap_or(dst.partition),
            hold_s: raw.steer.hold_s.unwrap_or(dst.hold_s),
            defer: raw.steer.defer.unwrap_or(dst.defer),
            close: raw.steer.close.unwrap_or(dst.close),
            look_ms: raw.steer.look_ms.unwrap_or(dst.look_ms),
            anticipate: raw.steer.anticipate.unwrap_or(dst.anticipate),
        };
        if steer.anticipate > MAX_ANTICIPATE {
            return Err(format!(
                "steer.anticipate = {}: must be between 0 and {MAX_ANTICIPATE} (pending jobs deferred while this node opens for one)",
                steer.anticipate
            ));
        }
        if !(MIN_LOOK_MS..=MAX_LOOK_MS).contains(&steer.look_ms) {
            return Err(format!(
                "steer.look_ms = {}: must be between {MIN_LOOK_MS} and {MAX_LOOK_MS} (milliseconds between looks at the queue)",
                steer.look_ms
            ));
        }
        if steer.close && steer.lookahead == 0 {
            return Err(
                "steer.close = true needs steer.lookahead: the node closes when it would take none of the first `lookahead` pending jobs next"
                    .into(),
            );
        }
        if steer.lookahead == 1 || steer.lookahead > MAX_LOOKAHEAD {
            return Err(format!(
                "steer.lookahead = {}: must be 0 (off) or between 2 and {MAX_LOOKAHEAD}",
                steer.lookahead
            ));
        }
        if steer.partition.is_empty() || steer.partition.contains([',', ' ']) {
            return Err(format!(
                "steer.partition = {:?}: must name one partition",
                steer.partition
            ));
        }
        if !(1..=3600).contains(&steer.hold_s) {
            return Err(format!(
                "steer.hold_s = {}: must be between 1 and 3600 seconds",
                steer.hold_s
            ));
        }
        Ok(Config {
            steer,
            weight,
            reconcile,
            share,
            metrics_listen,
            socket: raw
                .socket
                .unwrap_or_else(|| PathBuf::from(format!("/run/multiplexd/{node}.sock"))),
            database: raw
                .database
                .unwrap_or_else(|| PathBuf::from("/var/lib/multiplexd/history.sqlite")),
            node,
            jobs_per_gpu,
            telemetry_interval_s: raw.telemetry_interval_s.unwrap_or(10),
            busy_record_s: raw.busy_record_s.unwrap_or(DEFAULT_BUSY_RECORD_S),
            slurm_user: raw.slurm_user.unwrap_or_else(|| "slurm".into()),
            mps: raw.mps.unwrap_or(false),
            annotate: raw.annotate.unwrap_or(true),
            gpus,
            policy: PolicyConfig {
                unknown_pair_speed,
                min_gain,
                decline_retry_s,
                decline_retry_max_s,
                max_declines: raw.policy.max_declines.unwrap_or(DEFAULT_MAX_DECLINES),
                separate_below,
                separate_look_ms,
                mode: raw.policy.mode.unwrap_or_default(),
            },
        })
    }
}

/// What a config re-read by a running daemon (SIGHUP) changes: the decline knobs of
/// `[policy]` apply at once; everything else is read at start and takes a restart.
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
        // Destructured field by field, so that a key added later must be sorted here.
        let Config {
            node,
            socket,
            database,
            jobs_per_gpu,
            telemetry_interval_s,
            busy_record_s,
            slurm_user,
            mps,
            annotate,
            gpus,
            policy,
            weight,
            reconcile,
            share,
            metrics_listen,
            steer,
        } = new;
        let mut needs_restart = Vec::new();
        let mut restart_if = |changed: bool, key: &'static str| {
            if changed {
                needs_restart.push(key);
            }
        };
        restart_if(*node != self.node, "node");
        restart_if(*socket != self.socket, "socket");
        restart_if(*database != self.database, "database");
        restart_if(*jobs_per_gpu != self.jobs_per_gpu, "jobs_per_gpu");
        restart_if(
            *telemetry_interval_s != self.telemetry_interval_s,
            "telemetry_interval_s",
        );
        restart_if(*busy_record_s != self.busy_record_s, "busy_record_s");
        restart_if(*slurm_user != self.slurm_user, "slurm_user");
        restart_if(*mps != self.mps, "mps");
        restart_if(*annotate != self.annotate, "annotate");
        restart_if(*gpus != self.gpus, "gpu");
        restart_if(*weight != self.weight, "weight");
        restart_if(*reconcile != self.reconcile, "reconcile");
        restart_if(*share != self.share, "share");
        restart_if(*metrics_listen != self.metrics_listen, "metrics");
        restart_if(*steer != self.steer, "steer");
        // The prior is what the learned model was fitted with; observe/decide decides which
        // threads run.
        let PolicyConfig {
            unknown_pair_speed,
            min_gain,
            decline_retry_s,
            decline_retry_max_s,
            max_declines,
            separate_below,
            separate_look_ms,
            mode,
        } = policy;
        restart_if(
            *separate_look_ms != self.policy.separate_look_ms,
            "policy.separate_look_ms",
        );
        restart_if(
            *unknown_pair_speed != self.policy.unknown_pair_speed,
            "policy.unknown_pair_speed",
        );
        restart_if(*mode != self.policy.mode, "policy.mode");

        let old = &self.policy;
        let mut applied = Vec::new();
        let mut note = |changed: bool, key: &str, was: String, now: String| {
            if changed {
                applied.push(format!("policy.{key}: {was} -> {now}"));
            }
        };
        note(
            *min_gain != old.min_gain,
            "min_gain",
            old.min_gain.to_string(),
            min_gain.to_string(),
        );
        note(
            *decline_retry_s != old.decline_retry_s,
            "decline_retry_s",
            old.decline_retry_s.to_string(),
            decline_retry_s.to_string(),
        );
        note(
            *decline_retry_max_s != old.decline_retry_max_s,
            "decline_retry_max_s",
            old.decline_retry_max_s.to_string(),
            decline_retry_max_s.to_string(),
        );
        note(
            *max_declines != old.max_declines,
            "max_declines",
            old.max_declines.to_string(),
            max_declines.to_string(),
        );
        note(
            *separate_below != old.separate_below,
            "separate_below",
            old.separate_below.to_string(),
            separate_below.to_string(),
        );
        if applied.is_empty() {
            return Ok(Reload {
                policy: None,
                applied,
                needs_restart,
            });
        }
        Ok(Reload {
            policy: Some(PolicyConfig {
                min_gain: *min_gain,
                decline_retry_s: *decline_retry_s,
                decline_retry_max_s: *decline_retry_max_s,
                max_declines: *max_declines,
                separate_below: *separate_below,
                ..old.clone()
            }),
            applied,
            needs_restart,
        })
    }
}

/// Whether `min_gain` is a threshold placement can use: a share of a GPU's throughput, from 0
/// (never decline for a poor pair) to below 1 (a whole GPU). It applies to pairs seen before;
/// a pair never tried is taken for any predicted gain (see `placement`), so no threshold keeps
/// new pairs from being tried.
pub fn check_min_gain(min_gain: f64) -> Result<(), String> {
    if !(0.0..1.0).contains(&min_gain) {
        return Err("must be at least 0 (never decline for a poor pair) and below 1".to_string());
    }
    Ok(())
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
    /// The squeue to run.
    pub squeue: PathBuf,
    /// Jobs placed less than this long ago are left alone (Slurm may not list them yet).
    pub grace_s: f64,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig {
            interval_s: 60,
            squeue: PathBuf::from("squeue"),
            grace_s: 30.0,
        }
    }
}

/// The most pending jobs queue-level choice weighs at once.
pub const MAX_LOOKAHEAD: usize = 64;
/// Bounds of `[steer] look_ms`: below 100 ms the daemon's squeue calls would load
/// slurmctld; above a minute a closed node would stay closed to a job it would take.
pub const MIN_LOOK_MS: u64 = 100;
/// `[steer] anticipate`'s default. In the simulator (4 x 4 GPUs, load 1.5, where the queue
/// holds hundreds) the declines left fell with every step up, 32, 64, 128, 256: on a table
/// where few pairs gain the node would decline nearly the whole queue beside the job it opened
/// for, and the first job past the bound is offered and declined. The cost: one `scontrol`
/// call to defer and one to take back, each sending slurmctld one update per job (scontrol
/// 22.05 loops over the list), per opening that has jobs to defer.
pub const DEFAULT_ANTICIPATE: usize = 256;
/// The most jobs `[steer] anticipate` defers at once.
pub const MAX_ANTICIPATE: usize = 1024;
pub const MAX_LOOK_MS: u64 = 60_000;

/// Queue-level choice ([`crate::steer`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SteerConfig {
    /// How many of the first pending multiplexed jobs in Slurm's order the daemon chooses
    /// among when a slot of its node frees (0: it does not steer).
    pub lookahead: usize,
    /// The partition where multiplexed jobs wait (job_submit's first shared partition).
    pub partition: String,
    /// The longest a job keeps the priority steering gave it before it is taken back, and
    /// the longest one deferral lasts.
    pub hold_s: u64,
    /// Whether the pending jobs this node would decline are deferred (their `StartTime` set
    /// `hold_s` ahead, renewed while this node would still decline them) instead of being
    /// started here to be declined and requeued.
    pub defer: bool,
    /// Whether this node closes itself to Slurm while it has a free slot and would decline the
    /// job Slurm starts next, after its own raise among the first `lookahead` pending
    /// multiplexed jobs (a reservation of the node for `hold_s`, renewed while that lasts,
    /// deleted as soon as it would take the next job).
    pub close: bool,
    /// Milliseconds between looks at the queue with `close` on, whatever the node's state: a
    /// job that arrived and that this node would take opens it within this long, and a job
    /// coming back from a wait that it would decline closes it.
    pub look_ms: u64,
    /// With `close`: when this node opens for the job Slurm starts next, the pending jobs
    /// after it (up to this many) that it would decline in the pass that starts it (here,
    /// where a slot stays free after it, or on another node Slurm prefers) are deferred
    /// until the daemon hears of its start or gives up waiting (15 s), and the node closes
    /// then if it must: in that pass, Slurm offers the slots still free to them, one after
    /// another, before the daemon can look (0: none are).
    pub anticipate: usize,
}

impl Default for SteerConfig {
    fn default() -> Self {
        SteerConfig {
            lookahead: 0,
            partition: "shared".into(),
            hold_s: 60,
            defer: false,
            close: false,
            look_ms: 5000,
            anticipate: DEFAULT_ANTICIPATE,
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
            every_s: 600,
        }
    }
}

/// How the daemon publishes its node's weight.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightConfig {
    pub publish: bool,
    /// The weight of the idle node; a busy one gets up to `base + 100`.
    pub base: u32,
    /// Publish again this often even without a change (0: never).
    pub republish_s: u64,
    /// The scontrol to run.
    pub scontrol: PathBuf,
    /// How soon a failed publication is tried again.
    pub retry: Duration,
}

impl Default for WeightConfig {
    fn default() -> Self {
        WeightConfig {
            publish: true,
            base: 1,
            republish_s: 60,
            scontrol: PathBuf::from("scontrol"),
            retry: Duration::from_secs(5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steering_is_off_unless_asked_and_its_bounds_are_checked() {
        let base = "node = \"n1\"\n";
        assert_eq!(Config::parse(base).unwrap().steer, SteerConfig::default());
        assert_eq!(SteerConfig::default().lookahead, 0);
        let c = Config::parse(&format!(
            "{base}[steer]\nlookahead = 8\npartition = \"gpu-shared\"\nhold_s = 30\ndefer = false\n"
        ))
        .unwrap();
        assert_eq!(
            c.steer,
            SteerConfig {
                lookahead: 8,
                partition: "gpu-shared".into(),
                hold_s: 30,
                defer: false,
                close: false,
                look_ms: 5000,
                anticipate: DEFAULT_ANTICIPATE
            }
        );
        for (bad, says) in [
            ("lookahead = 1", "steer.lookahead = 1"),
            ("lookahead = 65", "between 2 and 64"),
            ("partition = \"a,b\"", "one partition"),
            ("partition = \"\"", "one partition"),
            ("hold_s = 0", "steer.hold_s = 0"),
            ("close = true", "needs steer.lookahead"),
            ("look_ms = 99", "steer.look_ms = 99: must be between 100 and 60000"),
            ("look_ms = 60001", "steer.look_ms = 60001"),
            (
                "anticipate = 1025",
                "steer.anticipate = 1025: must be between 0 and 1024",
            ),
            ("jobs = 3", "unknown field"),
        ] {
            let e = Config::parse(&format!("{base}[steer]\n{bad}\n")).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // The example's commented-out lines, as an admin would uncomment them.
        let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/multiplexd.toml")).unwrap();
        let example = example
            .replace("# lookahead = 8", "lookahead = 8")
            .replace("# partition = \"shared\"", "partition = \"shared\"")
            .replace("# hold_s = 60", "hold_s = 60")
            .replace("# defer = false", "defer = true")
            .replace("# close = false", "close = true")
            .replace("# look_ms = 5000", "look_ms = 250")
            .replace("# anticipate = 256", "anticipate = 4");
        let e = Config::parse(&example).unwrap().steer;
        assert_eq!(
            (
                e.lookahead,
                e.partition.as_str(),
                e.hold_s,
                e.defer,
                e.close,
                e.look_ms,
                e.anticipate
            ),
            (8, "shared", 60, true, true, 250, 4)
        );
        // Read at start only: a reload says it needs a restart.
        let r = Config::parse(base).unwrap().reload(&c).unwrap();
        assert_eq!(r.needs_restart, ["steer"]);
    }

    #[test]
    fn example_config_parses() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/multiplexd.toml")).unwrap();
        let c = Config::parse(&text).unwrap();
        assert_eq!(c.jobs_per_gpu, 2);
        assert_eq!(c.busy_record_s, DEFAULT_BUSY_RECORD_S, "the example shows the default");
        // The same node as etc/slurm.conf.example's gpu01 and etc/gres.conf.example.
        assert!(matches!(c.gpus, GpuSource::Listed(ref g) if g.len() == 4));
        let conf = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/slurm.conf.example")).unwrap();
        let gres = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/gres.conf.example")).unwrap();
        let shards = 4 * c.jobs_per_gpu;
        assert!(conf.contains(&format!(
            "NodeName=gpu[01-02] CPUs=64 RealMemory=512000 Gres=gpu:4,shard:{shards}"
        )));
        assert!(gres.contains("Name=gpu File=/dev/nvidia[0-3]"));
        assert_eq!(
            gres.lines()
                .filter(|l| l.starts_with(&format!("Name=shard Count={} File=/dev/nvidia", c.jobs_per_gpu)))
                .count(),
            4
        );
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
    fn a_reread_config_applies_the_decline_knobs_and_names_what_waits_for_a_restart() {
        let base = "node = \"n1\"\njobs_per_gpu = 2\n[policy]\nmin_gain = 0.25\ndecline_retry_s = 60\n";
        let running = Config::parse(base).unwrap();
        // Nothing changed: nothing to do.
        assert_eq!(running.reload(&running.clone()).unwrap(), Reload::default());

        let new = Config::parse(
            "node = \"n1\"\njobs_per_gpu = 3\nannotate = false\n[policy]\nmin_gain = 0.1\ndecline_retry_s = 120\n\
             unknown_pair_speed = 0.8\nmode = \"observe\"\n",
        )
        .unwrap();
        let r = running.reload(&new).unwrap();
        assert_eq!(
            r.applied,
            ["policy.min_gain: 0.25 -> 0.1", "policy.decline_retry_s: 60 -> 120"]
        );
        assert_eq!(
            r.needs_restart,
            ["jobs_per_gpu", "annotate", "policy.unknown_pair_speed", "policy.mode"]
        );
        let p = r.policy.unwrap();
        assert_eq!((p.min_gain, p.decline_retry_s), (0.1, 120));
        // What waits for a restart keeps its running value.
        assert_eq!(p.unknown_pair_speed, running.policy.unknown_pair_speed);
        assert_eq!(p.mode, running.policy.mode);

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
    fn defaults() {
        let c = Config::parse("node = \"n1\"").unwrap();
        assert_eq!(c.jobs_per_gpu, 2);
        assert_eq!(c.gpus, GpuSource::Nvml);
        assert_eq!(c.socket, PathBuf::from("/run/multiplexd/n1.sock"));
        assert_eq!(c.policy.min_gain, DEFAULT_MIN_GAIN);
        assert_eq!(c.policy.max_declines, DEFAULT_MAX_DECLINES);
        assert_eq!(
            (c.policy.separate_below, c.policy.separate_look_ms),
            (DEFAULT_SEPARATE_BELOW, DEFAULT_SEPARATE_LOOK_MS)
        );
        assert_eq!(
            (c.policy.decline_retry_s, c.policy.decline_retry_max_s),
            (60, DEFAULT_DECLINE_RETRY_MAX_S)
        );
    }

    #[test]
    fn the_wait_after_a_decline_doubles_per_requeue_up_to_the_most() {
        let waits: Vec<u32> = (0..7).map(|r| retry_after(60, 960, r)).collect();
        assert_eq!(waits, [60, 120, 240, 480, 960, 960, 960]);
        assert_eq!(retry_after(60, 960, u32::MAX), 960, "no overflow");
        assert_eq!(retry_after(5, 5, 3), 5);
        assert_eq!(retry_after(60, 0, 3), 60, "0: no growth");
        assert_eq!(retry_after(0, 960, 4), 0, "0 stays 0");
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
            ("[policy]\nunknown_pair_speed = 2.0", "unknown_pair_speed"),
            // Removed: placement no longer gives up predicted gain to try pairs never seen.
            ("[policy]\nexplore_margin = 0.05", "unknown field `explore_margin`"),
            ("[policy]\nmin_gain = -0.1", "min_gain"),
            (
                "[share]\ndir = \"shared/x\"",
                "share.dir = \"shared/x\": must be an absolute path",
            ),
            ("[share]\ndir = \"/shared\"\nevery_s = 0", "share.every_s = 0"),
            ("[share]\nfolder = \"/shared\"", "unknown field `folder`"),
            ("[policy]\nmin_gain = 1.0", "policy.min_gain = 1: must be at least 0"),
            ("[policy]\nexplore = true", "unknown field `explore`"),
            (
                "[policy]\nmode = \"advise\"",
                "unknown variant `advise`, expected `decide` or `observe`",
            ),
            ("[weight]\nbase = 0", "weight.base = 0"),
            (
                "[policy]\ndecline_retry_s = 120\ndecline_retry_max_s = 60",
                "policy.decline_retry_max_s = 60: must be 0 (no growth) or at least policy.decline_retry_s (120)",
            ),
            ("[reconcile]\ngrace_s = 0.5", "reconcile.grace_s = 0.5"),
            (
                "[reconcile]\ngrace_s = inf",
                "reconcile.grace_s = inf: must be between 1 and 86400",
            ),
            ("[reconcile]\ngrace_s = nan", "reconcile.grace_s = NaN"),
            ("[weight]\npublish = 1", "invalid type"),
            (
                "[policy]\nseparate_below = 3",
                "policy.separate_below = 3: must be between 0 (never separate) and 2",
            ),
            ("[policy]\nseparate_below = nan", "policy.separate_below = NaN"),
            ("[policy]\nseparate_look_ms = 50", "policy.separate_look_ms = 50"),
        ];
        for (text, want) in cases {
            let err = Config::parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        // TOML errors carry the line.
        let err = Config::parse("node = \"n1\"\njobs_per_gpu = = 2").unwrap_err();
        assert!(err.contains("line 2"), "{err}");
    }
}
