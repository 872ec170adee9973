//! `multiplexd serve` runs the node daemon; `multiplexd status` asks a running one;
//! `history`, `explain`, `export` and `import` read (and seed) the node's history database.

use clap::{Parser, Subcommand};
use multiplex_protocol::{client, Request, Response};
use multiplexd::config::{Config, DEFAULT_CONFIG};
use multiplexd::history::History;
use multiplexd::inspect;
use multiplexd::node::{wall_clock, Node};
use multiplexd::server::{self, Access};
use multiplexd::weight::{weight_for, Publisher};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Parser)]
#[command(name = "multiplexd", version, about = "GPU co-location daemon for Slurm nodes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon for this node.
    Serve {
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Show what runs on which GPU of a running daemon.
    Status {
        /// The daemon's config (for its socket path).
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG, conflicts_with = "socket")]
        config: PathBuf,
        /// The daemon's socket, instead of reading the config.
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Report from inside a job: its progress, or that it ran out of GPU memory (so that this
    /// node never pairs it with its co-runners again).
    Report {
        /// The job (default: $SLURM_JOB_ID).
        #[arg(long)]
        job: Option<u32>,
        /// Work done so far, in the job's own unit (iterations, samples), from its start.
        #[arg(long, required_unless_present = "oom", conflicts_with = "oom")]
        progress: Option<f64>,
        /// The job ran out of GPU memory.
        #[arg(long)]
        oom: bool,
        /// The daemon's socket (default: $MULTIPLEX_SOCKET, set in multiplexed jobs, else
        /// the config's).
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Show what the history learned: solo runtimes and pair speeds.
    History {
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Explain why a job got its GPU, who shared it, and what was learned.
    Explain {
        /// The Slurm job id.
        job_id: u32,
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write what the history learned (solo runtimes, pair speeds) as JSON, to seed another node.
    Export {
        /// The file to write, or - for standard output.
        file: PathBuf,
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Merge another node's export into this node's history (more observations win).
    Import {
        /// The file to read, or - for standard input.
        file: PathBuf,
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve { config } => serve(&config),
        Command::Status { config, socket, json } => status(&config, socket.as_deref(), json),
        Command::Report {
            job,
            progress,
            oom,
            socket,
            config,
        } => report_cmd(job, progress, oom, socket, &config),
        Command::History { config, json } => history(&config, json),
        Command::Explain { job_id, config, json } => explain(&config, job_id, json),
        Command::Export { file, config } => export(&config, &file),
        Command::Import { file, config } => import(&config, &file),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multiplexd: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(config_path: &Path) -> Result<(), String> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MULTIPLEXD_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = load_config(config_path)?;
    let gpus = multiplexd::gpus::discover(&config.gpus).map_err(|e| e.to_string())?;
    let access = Access {
        privileged_uids: uid_of(&config.slurm_user).into_iter().collect(),
    };
    let socket = config.socket.clone();
    let node_name = config.node.clone();
    let weight = config.weight.clone();
    let config_mode_observes = config.policy.mode == multiplexd::config::Mode::Observe;
    let reconcile = config.reconcile.clone();
    let share = config.share.clone();
    let telemetry_s = config.telemetry_interval_s.max(1);
    let mut node = Node::open(config, gpus.clone(), wall_clock()).map_err(|e| e.to_string())?;

    // Block the stop signals before any thread starts, so only the waiting thread sees them.
    let signals = stop_signals();
    if config_mode_observes {
        tracing::info!("observe mode: jobs run where Slurm binds them; no weight is published");
    } else if weight.publish {
        let base = weight.base;
        let publisher = Publisher::start(node_name.clone(), weight)
            .map_err(|e| format!("cannot start the weight publisher: {e}"))?;
        node.on_load(Box::new(move |load| publisher.set(weight_for(load, base))))
            .map_err(|e| e.to_string())?;
    } else {
        tracing::info!("not publishing the node's weight (weight.publish = false)");
    }
    let listener = server::bind(&socket).map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    tracing::info!(node = %node_name, socket = %socket.display(), gpus = gpus.len(), "multiplexd serving");
    let shutdown = Arc::new(AtomicBool::new(false));
    {
        let shutdown = Arc::clone(&shutdown);
        let socket = socket.clone();
        std::thread::spawn(move || {
            let sig = wait_for(&signals);
            tracing::info!(signal = sig, "stopping");
            shutdown.store(true, Ordering::SeqCst);
            let _ = std::os::unix::net::UnixStream::connect(&socket);
        });
    }
    if let Err(e) = node.checkpoint_in_background(Arc::clone(&shutdown)) {
        tracing::warn!(error = %e, "checkpointing on commit instead of in the background");
    }
    if let Err(e) = node.learn_in_background() {
        tracing::warn!(error = %e, "learning inside each finish request instead of on a thread of its own");
    }
    let node = Arc::new(Mutex::new(node));
    multiplexd::reconcile::spawn(Arc::clone(&node), reconcile, Arc::clone(&shutdown));
    multiplexd::share::spawn(Arc::clone(&node), share, Arc::clone(&shutdown));
    match multiplexd::telemetry::NvmlProbe::open(gpus.iter().map(|g| g.index).collect()) {
        Ok(probe) => {
            tracing::info!(interval_s = telemetry_s, "GPU telemetry through NVML");
            multiplexd::telemetry::spawn(
                Arc::clone(&node),
                Box::new(probe),
                Duration::from_secs(telemetry_s),
                Arc::clone(&shutdown),
            );
        }
        Err(e) => tracing::info!(
            "no GPU telemetry: NVML is unavailable ({e}); learning from job start and end times and job reports only"
        ),
    }
    server::run(listener, Arc::clone(&node), access, shutdown);
    let _ = std::fs::remove_file(&socket);
    // What ended jobs still have to teach is learned before the daemon exits.
    node.lock().unwrap_or_else(|p| p.into_inner()).stop_learning();
    tracing::info!("stopped");
    Ok(())
}

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it; pthread_sigmask only
    // changes this thread's mask (inherited by threads started later).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_for(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: set was initialised by stop_signals; sig is a valid out pointer.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}

fn uid_of(user: &str) -> Option<u32> {
    if let Ok(uid) = user.parse() {
        return Some(uid);
    }
    let uid = multiplex_protocol::user::uid(user);
    if uid.is_none() {
        tracing::warn!(user, "slurm_user does not exist; only root may place tasks");
    }
    uid
}

fn status(config_path: &Path, socket: Option<&Path>, json: bool) -> Result<(), String> {
    let socket = match socket {
        Some(s) => s.to_path_buf(),
        None => load_config(config_path)?.socket,
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

/// Reads the daemon's config; a missing file says how to name another one.
fn load_config(path: &Path) -> Result<Config, String> {
    Config::load(path).map_err(|e| match &e {
        multiplexd::config::ConfigError::Read { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            format!("{e} (name the node's config with --config FILE or MULTIPLEXD_CONFIG=FILE)")
        }
        _ => e.to_string(),
    })
}

/// The history database named by the config, opened (never created by a tool: a wrong path
/// is an error, not a new empty history).
fn open_history(config_path: &Path) -> Result<History, String> {
    let config = load_config(config_path)?;
    history_of(&config, config_path)
}

/// [`open_history`] for a config already loaded from `config_path`.
fn history_of(config: &Config, config_path: &Path) -> Result<History, String> {
    if !config.database.exists() {
        return Err(format!(
            "no history database at {} (named by {})",
            config.database.display(),
            config_path.display()
        ));
    }
    History::open(&config.database).map_err(|e| e.to_string())
}

fn json_out<T: serde::Serialize>(v: &T) -> Result<(), String> {
    println!("{}", serde_json::to_string_pretty(v).map_err(|e| e.to_string())?);
    Ok(())
}

fn history(config_path: &Path, json: bool) -> Result<(), String> {
    let h = open_history(config_path)?;
    let data = h.export().map_err(|e| e.to_string())?;
    if json {
        return json_out(&data);
    }
    print!("{}", inspect::HistoryText(&data));
    Ok(())
}

fn explain(config_path: &Path, job_id: u32, json: bool) -> Result<(), String> {
    let config = load_config(config_path)?;
    let h = history_of(&config, config_path)?;
    let Some(e) = h.explain(job_id).map_err(|e| e.to_string())? else {
        // Declined here, and never run here (it waits, or ran elsewhere).
        let declines = h.declines(job_id).map_err(|e| e.to_string())?;
        if declines.is_empty() {
            return Err(not_here(&config, job_id));
        }
        if json {
            return json_out(&serde_json::json!({ "job_id": job_id, "declines": declines }));
        }
        println!("job {job_id} has not run on {}", config.node);
        print!("{}", inspect::DeclinesText(&declines));
        return Ok(());
    };
    if json {
        return json_out(&e);
    }
    print!("{}", inspect::ExplanationText(&e));
    Ok(())
}

/// Why `explain` has nothing on a job here: where Slurm says it ran, and how to ask there.
fn not_here(config: &Config, job_id: u32) -> String {
    let here = format!("job {job_id} is not in the history of {}", config.node);
    let args = [
        "show".to_string(),
        "job".to_string(),
        "-o".to_string(),
        job_id.to_string(),
    ];
    match multiplexd::command::run(&config.weight.scontrol, &args, Duration::from_secs(5)) {
        Ok(out) => match inspect::node_list(&out) {
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

fn export(config_path: &Path, file: &Path) -> Result<(), String> {
    let h = open_history(config_path)?;
    let data = h.export().map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(&data).map_err(|e| e.to_string())?;
    if file == Path::new("-") {
        println!("{text}");
    } else {
        // Written beside and renamed into place: a failed export never leaves half a file.
        multiplexd::share::write_atomically(file, &(text + "\n"))?;
        eprintln!(
            "multiplexd: exported {} solo runtimes and {} pair speeds to {}",
            data.solo.len(),
            data.pairs.len(),
            file.display()
        );
    }
    Ok(())
}

fn import(config_path: &Path, file: &Path) -> Result<(), String> {
    let text = if file == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).map_err(|e| format!("cannot read standard input: {e}"))?
    } else {
        read(file)?
    };
    let data: multiplexd::history::Export =
        serde_json::from_str(&text).map_err(|e| format!("{}: not a multiplexd history export: {e}", file.display()))?;
    let config = load_config(config_path)?;
    let mut h = history_of(&config, config_path)?;
    let done = h
        .import(&data, config.policy.unknown_pair_speed)
        .map_err(|e| format!("{}: {e}", file.display()))?;
    eprintln!(
        "multiplexd: imported {}: solo runtimes {} added, {} replaced; pair speeds {} added, {} replaced; {} kept (ours had as many observations)",
        file.display(),
        done.solo_added,
        done.solo_replaced,
        done.pairs_added,
        done.pairs_replaced,
        done.kept
    );
    Ok(())
}

fn report_cmd(
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
        None => load_config(config)?.socket,
    };
    let kind = match progress {
        Some(done) if !oom => multiplex_protocol::ReportKind::Progress { done },
        _ => multiplex_protocol::ReportKind::OutOfMemory,
    };
    let request = Request::Report(multiplex_protocol::ReportRequest { job_id, kind });
    match client::call(&socket, Duration::from_secs(5), request).map_err(|e| e.to_string())? {
        Response::Reported { message } => {
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
