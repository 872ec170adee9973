//! `multiplexd`: the command line. `serve` runs the node daemon (see [`multiplexd::serve`]); the
//! tools (`status`, `report`, `history`, `explain`, `export`, `import`, `check-config`, `gate`,
//! `node-config`) are in [`multiplexd::tools`].

use clap::{Parser, Subcommand};
use multiplexd::config::DEFAULT_CONFIG;
use multiplexd::{serve, tools};
use std::path::PathBuf;
use std::process::ExitCode;

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
    /// Check that this node's config agrees with gres.conf, slurmctld's record of the node,
    /// plugstack.conf and job_submit's partitions; exits 1 when something disagrees.
    CheckConfig {
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Switch the cluster's gate off (every multiplexed job waiting at it goes where Slurm
    /// places it at once, and no claimer gates or claims until it is switched on) or on again;
    /// without an argument, say where it stands.
    Gate {
        #[arg(value_parser = ["on", "off"])]
        switch: Option<String>,
        /// The daemon's config (for slurm_bin); where the file is absent, Slurm's commands on PATH.
        #[arg(long, env = "MULTIPLEXD_CONFIG", default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Print this node's configuration from its GPUs (NVML) or from the facts given: its
    /// gres.conf lines, its slurm.conf NodeName line and its multiplexd.toml.
    NodeConfig(tools::NodeConfigArgs),
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
    if !matches!(cli.command, Command::Serve { .. }) {
        // A tool whose output is cut short (`multiplexd export - | head`) ends quietly, as
        // command-line tools do, instead of panicking on the closed pipe. The daemon keeps
        // Rust's default (SIGPIPE ignored): a client that goes away must not stop it.
        // SAFETY: signal() with SIG_DFL only changes this process's disposition of SIGPIPE,
        // before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Serve { config } => serve::serve(&config),
        Command::Status { config, socket, json } => tools::status(&config, socket.as_deref(), json),
        Command::Report {
            job,
            progress,
            oom,
            socket,
            config,
        } => tools::report(job, progress, oom, socket, &config),
        Command::History { config, json } => tools::history(&config, json),
        Command::Explain { job_id, config, json } => tools::explain(&config, job_id, json),
        Command::Export { file, config } => tools::export(&config, &file),
        Command::Import { file, config } => tools::import(&config, &file),
        Command::Gate { switch, config } => tools::gate(&config, switch.as_deref()),
        Command::NodeConfig(args) => tools::node_config(&args),
        Command::CheckConfig { config } => match tools::check_config(&config) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multiplexd: {e}");
            ExitCode::FAILURE
        }
    }
}
