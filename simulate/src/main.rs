//! `multiplex-simulate`: compares placement policies on a job trace in a simulated cluster, on
//! measured pair speeds. The `learned` policy is multiplexd's own claimer and learning code,
//! each node with its own SQLite history.

use clap::Parser;
use multiplex_simulate::{input, world};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "multiplex-simulate",
    version,
    about = "Compare placement policies on a job trace in a simulated cluster, on measured pair speeds \
             (the `learned` policy is multiplexd's own placement and learning code)"
)]
struct Args {
    /// Pair table, CSV `gpu,job_a,job_b,speed_a,speed_b` (default: the embedded Gavel V100 table).
    #[arg(long)]
    table: Option<PathBuf>,
    /// Each application's GPU memory, CSV `app,mem_mb` (every application of the table): a
    /// pair whose memory together exceeds the GPU's (--gpu-memory-mb) cannot share, and the
    /// learned policy's daemons see each job's memory in their GPU telemetry (--busy-every),
    /// as through NVML. Default: none, only the table's 0,0 pairs cannot share, and the
    /// daemons see no memory.
    #[arg(long)]
    app_memory: Option<PathBuf>,
    /// The GPUs' memory, MiB, with --app-memory (16 GiB, a V100's).
    #[arg(long, default_value_t = 16384)]
    gpu_memory_mb: u64,
    /// Job trace, CSV `job_id,submit_s,app,solo_runtime_s` (default: generated, see --jobs, --load).
    #[arg(long)]
    trace: Option<PathBuf>,
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    #[arg(long, default_value_t = 4)]
    gpus_per_node: usize,
    #[arg(long, default_value_t = 2)]
    jobs_per_gpu: u32,
    /// A policy to run (repeat for several): exclusive, first-fit, least-loaded, random,
    /// learned, oracle. Default: all.
    #[arg(long = "policy")]
    policies: Vec<String>,
    /// Seed of the generated trace and of the random parts of the world.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Jobs of the generated trace.
    #[arg(long, default_value_t = 1000)]
    jobs: usize,
    /// Offered load of the generated trace: its work relative to the cluster's GPUs used one
    /// job per GPU.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// How much of the generated runtimes' spread lies between jobs of one application (0 to
    /// 1; that of their logarithm is 1): 1, a job's length says nothing of its application;
    /// 0.2, an application's runs differ by about 20%, and applications by the rest.
    #[arg(long, default_value_t = 1.0)]
    same_app_runtime_sigma: f64,
    /// Seconds between the progress reports each job sends (0: none, the daemon learns from
    /// start and end times alone).
    #[arg(long, default_value_t = 900.0)]
    progress_every: f64,
    /// Noise of each progress report, as a fraction of one interval's work (standard deviation).
    #[arg(long, default_value_t = 0.05)]
    progress_noise: f64,
    /// Seconds between rounds of GPU telemetry (0: none, as on a node without NVML): the
    /// learned policy's daemons then measure each job's busy GPU time, as they do through NVML
    /// on a time-sliced GPU, whether the job reports progress or not.
    #[arg(long, default_value_t = 0.0)]
    busy_every: f64,
    /// Noise of each round's utilisation of a job, relative (standard deviation).
    #[arg(long, default_value_t = 0.1)]
    busy_noise: f64,
    /// The most by which telemetry overstates a shared job's speed: each application draws a
    /// bias b between 0 and this and shows s + b (1 - s) at speed s.
    #[arg(long, default_value_t = 0.0)]
    busy_bias: f64,
    /// Seconds after a job fails out of GPU memory until its user submits it again (its work
    /// so far is lost): users find failed jobs when they look. 120 with --resident-dies 0 is
    /// the world before failures were priced, an automatic requeue of the newcomer.
    #[arg(long, default_value_t = world::Failures::PRICED.resubmit_after_s)]
    resubmit_after: f64,
    /// Of pairs that do not fit, the share where the resident dies as it grows (and the
    /// newcomer runs on); the rest fail the newcomer as it starts. The table says which pairs
    /// do not fit, not which side grows: a seeded draw per pair made decides.
    #[arg(long, default_value_t = world::Failures::PRICED.resident_dies)]
    resident_dies: f64,
    /// Seconds between merges of the learned policy's node histories, as `[share] dir` pools
    /// them: node 0's daemon is the cluster's claimer and learns what the others did this way
    /// (0: never, each node learns alone and the claimer knows only its own node's jobs).
    #[arg(long, default_value_t = multiplex_simulate::policy::DEFAULT_SHARE_EVERY_S)]
    share_history_every: f64,
    /// The daemon's `policy.min_gain` for the learned policy and the oracle: a job is not
    /// claimed for a share that would add less throughput than this (0: any share).
    #[arg(long, default_value_t = multiplexd::config::keys::MIN_GAIN.default)]
    min_gain: f64,
    /// The daemon's `policy.share_queue` for the learned policy and the oracle: a share is
    /// claimed only while more jobs wait than this times the cluster's GPUs times what the
    /// share loses against one job alone (0: whatever waits).
    #[arg(long, default_value_t = multiplexd::config::keys::SHARE_QUEUE.default)]
    share_queue: f64,
    /// The daemon's `policy.separate_below` for the learned policy: a GPU whose jobs were
    /// measured to deliver less than this times what they would without the newest of them
    /// requeues that one, to be claimed again (0: never).
    #[arg(long, default_value_t = multiplexd::config::keys::SEPARATE_BELOW.default)]
    separate_below: f64,
    /// The claimer's `claim.lookahead` for the learned policy and the oracle: how many of the
    /// first pending jobs in Slurm's order one look weighs.
    #[arg(long, default_value_t = multiplexd::config::ClaimConfig::default().lookahead)]
    lookahead: usize,
    /// Bind each job to one GPU index from its submission, as job_submit does where Slurm cannot
    /// move a pending job to another GPU type (22.05): a claim then chooses only the node.
    #[arg(long)]
    fixed_gpu: bool,
    /// The daemon's `policy.put_back = false` for the learned policy and the oracle: a job out
    /// of GPU memory beside a partner fails and its user submits it again, as under Slurm's
    /// own placement.
    #[arg(long)]
    no_put_back: bool,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Also draw the JCT distributions and the learned policy's gap to the oracle as SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also write the trace that was simulated (generated or read) as CSV, to replay it
    /// elsewhere (e.g. tests/emulate/run on a real local cluster).
    #[arg(long)]
    write_trace: Option<PathBuf>,
    /// Start the learned policy's nodes from this history (a `multiplexd export` file, as a
    /// site imports one into a new node) instead of an empty one: a site's later day.
    #[arg(long)]
    history: Option<PathBuf>,
    /// Also write what the learned policy's nodes learned, merged, as `multiplexd export`
    /// writes it: the history a site has after this trace (for --history, or `multiplexd
    /// import` into a real daemon).
    #[arg(long)]
    write_history: Option<PathBuf>,
    /// With --write-history, divide the solo runtimes written by this: for daemons whose jobs
    /// run this many times faster than the trace says (tests/emulate/run's --time-scale).
    #[arg(long, default_value_t = 1.0)]
    history_time_scale: f64,
    /// Simulate nothing: grade this history (a `multiplexd export` file) against --table
    /// instead: the daemon's estimate of each pair against the table's speed, and the partner
    /// it would choose for a newcomer of each application against the best per the table (as
    /// tests/gpu/real-pairs does after measuring a GPU). Uses --jobs-per-gpu, --min-gain,
    /// --separate-below and --gpu-memory-mb.
    #[arg(long)]
    grade: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Table,
    Json,
    Csv,
}

fn main() -> ExitCode {
    // Output cut short (`multiplex-simulate --format csv | head`) ends the tool quietly, as
    // command-line tools do, instead of a panic on the closed pipe.
    // SAFETY: signal() with SIG_DFL only changes this process's disposition of SIGPIPE,
    // before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    match simulate(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multiplex-simulate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn simulate(a: Args) -> Result<(), String> {
    let (table, table_name) = load_table(&a)?;
    if let Some(path) = &a.grade {
        return grade(&a, path, (&table, &table_name));
    }
    let shape = world::Shape {
        nodes: a.nodes,
        gpus_per_node: a.gpus_per_node,
        jobs_per_gpu: a.jobs_per_gpu,
    };
    let policies = if a.policies.is_empty() {
        multiplex_simulate::policy::ALL.iter().map(|p| p.to_string()).collect()
    } else {
        a.policies.clone()
    };
    multiplex_simulate::check(&shape, &policies)?;
    check_flags(&a)?;
    let (trace, source) = load_trace(&a, &table, &shape)?;
    let heading = format!(
        "{} nodes x {} GPUs x {} jobs per GPU, {} jobs ({source}); pair table {table_name}: {} apps on {}",
        shape.nodes,
        shape.gpus_per_node,
        shape.jobs_per_gpu,
        trace.len(),
        table.apps.len(),
        table.model
    );
    let history = load_history(&a, &policies)?;
    let setup = multiplex_simulate::Setup {
        table,
        trace,
        shape,
        policies,
        seed: a.seed,
        progress: progress(&a),
        options: multiplex_simulate::policy::Options {
            share_every_s: a.share_history_every,
            min_gain: a.min_gain,
            share_queue: a.share_queue,
            separate_below: a.separate_below,
            lookahead: a.lookahead,
            fixed_gpu: a.fixed_gpu,
            put_back: !a.no_put_back,
        },
        history,
    };
    let started = std::time::Instant::now();
    let runs = multiplex_simulate::run(&setup)?;
    write_results(&a, &runs, &heading, started.elapsed().as_secs_f64())
}

/// `--grade PATH`: grades that history against the table, and prints the grade.
fn grade(a: &Args, path: &Path, (table, table_name): (&input::Table, &str)) -> Result<(), String> {
    let export = serde_json::from_str::<multiplexd::history::Export>(&read(path)?)
        .map_err(|e| format!("{}: not a multiplexd history export: {e}", path.display()))?;
    let knobs = multiplex_simulate::grade::knobs(a.jobs_per_gpu, a.min_gain, a.separate_below);
    let grade = multiplex_simulate::grade::grade(table, &export, knobs, a.gpu_memory_mb)?;
    println!("{} graded against {table_name}", path.display());
    print!("{}", grade.text());
    Ok(())
}

/// What the jobs do besides running, and what their failures cost.
fn progress(a: &Args) -> world::Progress {
    world::Progress {
        every_s: a.progress_every,
        noise: a.progress_noise,
        busy_every_s: a.busy_every,
        busy_noise: a.busy_noise,
        busy_bias: a.busy_bias,
        failures: world::Failures {
            resubmit_after_s: a.resubmit_after,
            resident_dies: a.resident_dies,
        },
    }
}

/// The pair table (`--table`, else the embedded V100 one) with its memory (`--app-memory`),
/// and its name for the heading.
fn load_table(a: &Args) -> Result<(input::Table, String), String> {
    let (table, table_name) = match &a.table {
        Some(path) => {
            let text = read(path)?;
            let name = path.display().to_string();
            (input::Table::parse(&text, &name)?, name)
        }
        None => (
            input::Table::parse(input::GAVEL_V100, "gavel-v100")?,
            "gavel-v100 (embedded)".to_string(),
        ),
    };
    Ok(match &a.app_memory {
        Some(path) => (
            table.with_memory(&read(path)?, &path.display().to_string(), a.gpu_memory_mb)?,
            format!("{table_name} with the memory of {}", path.display()),
        ),
        None => (table, table_name),
    })
}

/// The world's flags, each refused with its name where it makes no sense.
fn check_flags(a: &Args) -> Result<(), String> {
    // A report every instant would stop the simulated clock.
    if !(a.progress_every.is_finite() && (a.progress_every == 0.0 || a.progress_every >= 1.0)) {
        return Err(format!(
            "--progress-every {}: must be 0 (no reports) or at least 1 second",
            a.progress_every
        ));
    }
    if !(a.busy_every.is_finite() && (a.busy_every == 0.0 || a.busy_every >= 1.0)) {
        return Err(format!(
            "--busy-every {}: must be 0 (no telemetry) or at least 1 second",
            a.busy_every
        ));
    }
    if !(a.busy_noise.is_finite() && a.busy_noise >= 0.0) {
        return Err(format!("--busy-noise {}: must be 0 or more", a.busy_noise));
    }
    if !(0.0..=1.0).contains(&a.busy_bias) {
        return Err(format!("--busy-bias {}: must be between 0 and 1", a.busy_bias));
    }
    if !(a.progress_noise.is_finite() && a.progress_noise >= 0.0) {
        return Err(format!("--progress-noise {}: must be 0 or more", a.progress_noise));
    }
    if !(a.resubmit_after.is_finite() && a.resubmit_after >= 1.0) {
        return Err(format!(
            "--resubmit-after {}: must be at least 1 second",
            a.resubmit_after
        ));
    }
    if !(0.0..=1.0).contains(&a.resident_dies) {
        return Err(format!("--resident-dies {}: must be between 0 and 1", a.resident_dies));
    }
    multiplexd::config::keys::LOOKAHEAD
        .read(Some(a.lookahead))
        .map_err(|e| format!("--lookahead {}: {e}", a.lookahead))?;
    if !(a.share_history_every.is_finite() && a.share_history_every >= 0.0) {
        return Err(format!(
            "--share-history-every {}: must be 0 or more seconds",
            a.share_history_every
        ));
    }
    Ok(())
}

/// The trace (`--trace`, else generated), written out where `--write-trace` asks, and where
/// it came from for the heading.
fn load_trace(a: &Args, table: &input::Table, shape: &world::Shape) -> Result<(Vec<input::TraceJob>, String), String> {
    let (trace, source) = match &a.trace {
        Some(path) => {
            let text = read(path)?;
            let trace = input::parse_trace(&text, &path.display().to_string(), table)?;
            (trace, format!("trace {}", path.display()))
        }
        None => (
            multiplex_simulate::generated_trace(table, a.jobs, a.load, shape, a.seed, a.same_app_runtime_sigma)?,
            format!("generated trace: load {}, seed {}", a.load, a.seed),
        ),
    };
    if let Some(path) = &a.write_trace {
        std::fs::write(path, input::trace_csv(&trace, table))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok((trace, source))
}

/// The history the learned policy starts from (`--history`); the history flags need it.
fn load_history(a: &Args, policies: &[String]) -> Result<Option<multiplexd::history::Export>, String> {
    if !policies.iter().any(|p| p == "learned") {
        if a.write_history.is_some() {
            return Err("--write-history: writes what the learned policy learned; add --policy learned".into());
        }
        if a.history.is_some() {
            return Err("--history: only the learned policy starts from a history; add --policy learned".into());
        }
    }
    let history = match &a.history {
        Some(path) => Some(
            serde_json::from_str::<multiplexd::history::Export>(&read(path)?)
                .map_err(|e| format!("{}: not a multiplexd history export: {e}", path.display()))?,
        ),
        None => None,
    };
    if !(a.history_time_scale.is_finite() && a.history_time_scale > 0.0) {
        return Err(format!(
            "--history-time-scale {}: must be more than 0",
            a.history_time_scale
        ));
    }
    Ok(history)
}

/// The results in the format asked for, and the files `--write-history` and `--plot` ask for.
fn write_results(a: &Args, runs: &[multiplex_simulate::Run], heading: &str, elapsed: f64) -> Result<(), String> {
    match a.format {
        Format::Table => {
            print!("{}", multiplex_simulate::table(runs, heading));
            println!("simulated in {elapsed:.1} s");
        }
        Format::Json => {
            let all: Vec<&multiplex_simulate::Summary> = runs.iter().map(|r| &r.summary).collect();
            println!("{}", serde_json::to_string_pretty(&all).map_err(|e| e.to_string())?);
        }
        Format::Csv => print!("{}", multiplex_simulate::csv(runs)),
    }
    if let Some(path) = &a.write_history {
        let learned = runs.iter().find_map(|r| r.history.as_ref());
        let mut data = learned
            .ok_or("--write-history: the learned policy did not run")?
            .clone();
        for solo in &mut data.solo {
            solo.runtime_s /= a.history_time_scale;
        }
        let text = serde_json::to_string_pretty(&data).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, multiplex_simulate::plot::svg(runs, heading))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// A file's text, or an error that names it.
fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}
