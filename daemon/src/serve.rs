//! `multiplexd serve`: the node's daemon, wired together. The node (its history and learning)
//! answers on the socket; reconciliation with slurmd, history sharing, NVML telemetry, the
//! separation look and, on the one daemon of the cluster that runs it, the claimer run beside
//! it on threads of their own, and a stop signal ends them all, the learning queue learned
//! first.

use crate::config::GpuSpec;
use crate::node::{wall_clock, Node};
use crate::server::{self, Access};
use crate::slurm::Slurm;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Runs the daemon for the node that the config at `config_path` describes, until SIGTERM or
/// SIGINT.
pub fn serve(config_path: &Path) -> Result<(), String> {
    init_logging();
    let config = crate::config::load(config_path)?;
    let gpus = crate::gpus::discover(&config.gpus).map_err(|e| e.to_string())?;
    let slurm: Arc<dyn Slurm> = Arc::new(crate::slurm::Commands::new(&config.slurm_bin));
    let access = Access {
        privileged_uids: uid_of(&config.slurm_user).into_iter().collect(),
        // Private until Slurm says otherwise: never more than Slurm would show.
        private_jobs: Arc::new(AtomicBool::new(true)),
        // Jobs out of memory beside a partner are put back through Slurm, unless turned off.
        slurm: config.policy.put_back.then(|| Arc::clone(&slurm)),
    };
    let socket = config.socket.clone();
    // What the background threads read; the node owns the config from here on.
    let wiring = config.clone();
    // Bound before anything starts, so that a taken port stops the daemon with the reason.
    let metrics = match config.metrics_listen {
        Some(addr) => {
            let l = crate::metrics::bind(addr)?;
            tracing::info!(%addr, "metrics for Prometheus at /metrics");
            Some(l)
        }
        None => None,
    };
    let mut node = Node::open(config, gpus.clone(), wall_clock()).map_err(|e| e.to_string())?;

    // Block the stop and reload signals before any thread starts, so that only the waiting
    // thread sees them.
    let signals = daemon_signals();
    raise_file_limit();
    let listener = server::bind(&socket).map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    tracing::info!(node = %wiring.node, socket = %socket.display(), gpus = gpus.len(), "multiplexd serving");
    let shutdown = Arc::new(AtomicBool::new(false));
    if let Err(e) = node.checkpoint_in_background(Arc::clone(&shutdown)) {
        tracing::warn!(error = %e, "checkpointing on commit instead of in the background");
    }
    if let Err(e) = node.learn_in_background() {
        tracing::warn!(error = %e, "learning inside each finish request instead of on a thread of its own");
    }
    let node = Arc::new(Mutex::new(node));
    follow_signals(signals, config_path, &node, &socket, &shutdown);
    start_background(&node, &slurm, &wiring, &gpus, &shutdown);
    follow_private_data(
        Arc::clone(&slurm),
        Arc::clone(&access.private_jobs),
        Arc::clone(&shutdown),
    );
    if let Some(listener) = metrics {
        start_metrics(listener, &node, &access, &shutdown)?;
    }
    // systemd (Type=notify): the socket answers from here on.
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    server::run(listener, Arc::clone(&node), access, shutdown);
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    let _ = std::fs::remove_file(&socket);
    // What ended jobs still have to teach is learned before the daemon exits.
    node.lock().unwrap_or_else(|p| p.into_inner()).stop_learning();
    tracing::info!("stopped");
    Ok(())
}

/// The log on stderr, at MULTIPLEXD_LOG's level (default info).
fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MULTIPLEXD_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// A thread that waits for the stop and reload signals: SIGHUP rereads the config, the others
/// stop the daemon (and wake the server with a connection to its own socket).
fn follow_signals(
    signals: libc::sigset_t,
    config_path: &Path,
    node: &Arc<Mutex<Node>>,
    socket: &Path,
    shutdown: &Arc<AtomicBool>,
) {
    let (shutdown, socket, node) = (Arc::clone(shutdown), socket.to_path_buf(), Arc::clone(node));
    let config_path = config_path.to_path_buf();
    std::thread::spawn(move || loop {
        let sig = wait_for(&signals);
        if sig == libc::SIGHUP {
            reload(&config_path, &node);
            continue;
        }
        tracing::info!(signal = sig, "stopping");
        shutdown.store(true, Ordering::SeqCst);
        let _ = std::os::unix::net::UnixStream::connect(&socket);
        break;
    });
}

/// The background threads: reconciling with Slurm, giving back poor shares, pooling the
/// history, the claimer where this daemon is it, GPU telemetry.
fn start_background(
    node: &Arc<Mutex<Node>>,
    slurm: &Arc<dyn Slurm>,
    config: &crate::config::Config,
    gpus: &[GpuSpec],
    shutdown: &Arc<AtomicBool>,
) {
    crate::reconcile::spawn(
        Arc::clone(node),
        Arc::clone(slurm),
        config.reconcile.clone(),
        Arc::clone(shutdown),
    );
    // Also with `policy.separate_below` 0, which a reload may change.
    crate::separate::spawn(
        Arc::clone(node),
        Arc::clone(slurm),
        Duration::from_millis(config.policy.separate_look_ms),
        Arc::clone(shutdown),
    );
    crate::share::spawn(Arc::clone(node), config.share.clone(), Arc::clone(shutdown));
    if config.claim.enabled {
        crate::claimer::spawn(
            Arc::clone(node),
            Arc::clone(slurm),
            config.claim.clone(),
            config.share.every_s,
            Arc::clone(shutdown),
        );
    }
    start_telemetry(node, gpus, config.telemetry_interval_s, shutdown);
}

/// The Prometheus endpoint's thread.
fn start_metrics(
    listener: std::net::TcpListener,
    node: &Arc<Mutex<Node>>,
    access: &Access,
    shutdown: &Arc<AtomicBool>,
) -> Result<(), String> {
    let (node, private, shutdown) = (Arc::clone(node), Arc::clone(&access.private_jobs), Arc::clone(shutdown));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let snapshot = move || node.lock().unwrap_or_else(|p| p.into_inner()).metrics_snapshot();
            crate::metrics::serve(listener, Box::new(snapshot), private, shutdown)
        })
        .map_err(|e| format!("cannot start the metrics endpoint: {e}"))?;
    Ok(())
}

/// GPU telemetry every `interval_s` through NVML, where it works and the interval is not 0.
fn start_telemetry(node: &Arc<Mutex<Node>>, gpus: &[GpuSpec], interval_s: u64, shutdown: &Arc<AtomicBool>) {
    if interval_s == 0 {
        tracing::info!(
            "no GPU telemetry (telemetry_interval_s = 0): learning from job start and end times and job reports only"
        );
        return;
    }
    match crate::telemetry::NvmlProbe::open(gpus.iter().map(|g| g.index).collect()) {
        Ok(probe) => {
            tracing::info!(interval_s, "GPU telemetry through NVML");
            crate::telemetry::spawn(
                Arc::clone(node),
                Box::new(probe),
                Duration::from_secs(interval_s),
                Arc::clone(shutdown),
            );
        }
        Err(e) => tracing::info!(
            "no GPU telemetry: NVML is unavailable ({e}); learning from job start and end times and job reports only"
        ),
    }
}

fn daemon_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it; pthread_sigmask only
    // changes this thread's mask (inherited by threads started later).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Re-reads the config on SIGHUP (systemd's ExecReload): the decline knobs of `[policy]`
/// apply from the next placement on; other changed keys are named as waiting for a restart. A
/// file that no longer parses changes nothing, and the log says why.
fn reload(config_path: &Path, node: &Mutex<Node>) {
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Reloading]);
    let outcome = crate::config::load(config_path).and_then(|new| {
        let mut node = node.lock().unwrap_or_else(|p| p.into_inner());
        let reload = node.config().reload(&new)?;
        if let Some(policy) = reload.policy.clone() {
            node.set_policy(policy);
        }
        Ok(reload)
    });
    match outcome {
        Ok(reload) => {
            if reload.applied.is_empty() {
                tracing::info!(config = %config_path.display(), "config re-read: nothing that applies at once changed");
            } else {
                tracing::info!(config = %config_path.display(), changes = %reload.applied.join(", "), "config reloaded");
            }
            if !reload.needs_restart.is_empty() {
                tracing::warn!(
                    keys = %reload.needs_restart.join(", "),
                    "changed in the config but read only at start: they keep their running values until multiplexd restarts"
                );
            }
            crate::metrics::global().config_reload("applied");
        }
        Err(e) => {
            tracing::error!("config not reloaded, the daemon runs on with the config it had: {e}");
            crate::metrics::global().config_reload("failed");
        }
    }
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
}

fn wait_for(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: set was initialised by daemon_signals; sig is a valid out pointer.
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

/// Raises this process's soft limit on open files to the hard one: every connection is a file
/// descriptor, and a service's default soft limit (often 1,024) is what a local user would
/// exhaust first. Failing is only logged.
fn raise_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the rlimit struct given, which lives across
    // the calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open-file limit");
            return;
        }
        if lim.rlim_cur < lim.rlim_max {
            let wanted = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0 {
                tracing::warn!(error = %std::io::Error::last_os_error(), "cannot raise the open-file limit");
                return;
            }
        }
    }
    tracing::debug!(open_files = lim.rlim_max, "open-file limit");
}

/// Keeps `private` to whether Slurm keeps jobs private (`PrivateData`), asking `scontrol show
/// config` every minute until it answers (the daemon may start before slurmctld), then never
/// again: PrivateData changes with a reconfigure, which admins follow with a daemon reload or
/// restart. Until it has answered, jobs are private.
fn follow_private_data(slurm: Arc<dyn Slurm>, private: Arc<AtomicBool>, shutdown: Arc<AtomicBool>) {
    let mut trouble = crate::background::Trouble::default();
    let mut known = false;
    let spawned = crate::background::every("privatedata", Duration::from_secs(60), shutdown, move || {
        if known {
            return;
        }
        let answer = slurm.private_jobs().map_err(|e| e.to_string());
        match answer {
            Ok(p) => {
                tracing::info!(private_jobs = p, "Slurm's PrivateData read");
                known = true;
                private.store(p, Ordering::Relaxed);
            }
            Err(e) => {
                if trouble.failed(&e) {
                    tracing::warn!(
                        "cannot read Slurm's PrivateData ({e}); users see only their own jobs until it can be read"
                    );
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the thread that reads Slurm's PrivateData ({e}): users see only their own jobs");
    }
}
