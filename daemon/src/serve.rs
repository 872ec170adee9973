//! `multiplexd serve`: the node's daemon, wired together. The node (its history, placement and
//! learning) answers on the socket; the weight publisher, reconciliation with Slurm, history
//! sharing and NVML telemetry run beside it on threads of their own, and a stop signal ends
//! them all, the learning queue learned first.

use crate::node::{wall_clock, Node};
use crate::server::{self, Access};
use crate::steer::{Steerer, Steering};
use crate::weight::{weight_for, Publisher};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Runs the daemon for the node that the config at `config_path` describes, until SIGTERM or
/// SIGINT.
pub fn serve(config_path: &Path) -> Result<(), String> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MULTIPLEXD_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = crate::tools::load_config(config_path)?;
    let gpus = crate::gpus::discover(&config.gpus).map_err(|e| e.to_string())?;
    let access = Access {
        privileged_uids: uid_of(&config.slurm_user).into_iter().collect(),
        // Private until Slurm says otherwise: never more than Slurm would show.
        private_jobs: Arc::new(AtomicBool::new(true)),
    };
    let socket = config.socket.clone();
    let node_name = config.node.clone();
    let weight = config.weight.clone();
    let weight_scontrol = config.weight.scontrol.clone();
    let config_mode_observes = config.policy.mode == crate::config::Mode::Observe;
    let reconcile = config.reconcile.clone();
    let share = config.share.clone();
    let telemetry_s = config.telemetry_interval_s.max(1);
    let annotate = config.annotate;
    let steer = config.steer.clone();
    let separate_look_ms = config.policy.separate_look_ms;
    let steer_squeue = config.reconcile.squeue.clone();
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
    if config_mode_observes {
        tracing::info!("observe mode: jobs run where Slurm binds them; no weight is published");
    }
    let publisher = if config_mode_observes {
        None
    } else if weight.publish {
        let base = weight.base;
        let publisher = Publisher::start(node_name.clone(), weight)
            .map_err(|e| format!("cannot start the weight publisher: {e}"))?;
        Some((publisher, base))
    } else {
        tracing::info!("not publishing the node's weight (weight.publish = false)");
        None
    };
    // Queue-level choice: woken whenever the node has a free slot after a change.
    let steer_poke = (!config_mode_observes && steer.lookahead > 0).then(Steerer::poke);
    if publisher.is_some() || steer_poke.is_some() {
        let poke = steer_poke.clone();
        let close = steer.close;
        node.on_load(Box::new(move |load| {
            if let Some((publisher, base)) = &publisher {
                publisher.set(weight_for(load, *base));
            }
            // With `close`, a node that just filled is looked at too: it may close before a
            // slot frees.
            if let Some(poke) = poke.as_ref().filter(|_| load.used < load.total || close) {
                poke.slot_free();
            }
        }))
        .map_err(|e| e.to_string())?;
    }
    // A declined job is watched once it is back in the queue: deferred, or its node closed.
    if let Some(poke) = steer_poke.as_ref().filter(|_| steer.defer || steer.close) {
        let poke = poke.clone();
        node.on_declined(Box::new(move |job_id, wait_s| poke.declined(job_id, wait_s)));
    } else if !config_mode_observes {
        // Otherwise it waits what its SPANK plugin set, even where completing the requeue
        // takes longer than that (Slurm would apply its own delay).
        let keeper = crate::requeued::Keeper::start(weight_scontrol.clone())
            .map_err(|e| format!("cannot start the thread that keeps declined jobs' waits: {e}"))?;
        node.on_declined(Box::new(move |job_id, wait_s| keeper.declined(job_id, wait_s)));
    }
    if annotate {
        let annotator = crate::annotate::Annotator::start(weight_scontrol.clone(), Arc::clone(&access.private_jobs))
            .map_err(|e| format!("cannot start the admin comment writer: {e}"))?;
        node.on_placed(Box::new(move |placed| annotator.tell(placed)));
    }
    raise_file_limit();
    let listener = server::bind(&socket).map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    tracing::info!(node = %node_name, socket = %socket.display(), gpus = gpus.len(), "multiplexd serving");
    let shutdown = Arc::new(AtomicBool::new(false));
    if let Err(e) = node.checkpoint_in_background(Arc::clone(&shutdown)) {
        tracing::warn!(error = %e, "checkpointing on commit instead of in the background");
    }
    if let Err(e) = node.learn_in_background() {
        tracing::warn!(error = %e, "learning inside each finish request instead of on a thread of its own");
    }
    let node = Arc::new(Mutex::new(node));
    {
        let shutdown = Arc::clone(&shutdown);
        let socket = socket.clone();
        let node = Arc::clone(&node);
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
    let steerer = match steer_poke {
        Some(poke) => {
            tracing::info!(lookahead = steer.lookahead, partition = %steer.partition, "steering Slurm's queue: a freed slot goes to the pending job that pairs best");
            let steering = Steering {
                config: steer,
                node: node_name.clone(),
                sinfo: crate::steer::sinfo_beside(&steer_squeue),
                squeue: steer_squeue,
                scontrol: weight_scontrol.clone(),
            };
            Some(
                Steerer::start(Arc::clone(&node), steering, &poke)
                    .map_err(|e| format!("cannot start the steering thread: {e}"))?,
            )
        }
        None => None,
    };
    crate::reconcile::spawn(Arc::clone(&node), reconcile, Arc::clone(&shutdown));
    // Also with `policy.separate_below` 0, which a reload may change.
    if !config_mode_observes {
        crate::separate::spawn(
            Arc::clone(&node),
            weight_scontrol.clone(),
            Duration::from_millis(separate_look_ms),
            Arc::clone(&shutdown),
        );
    }
    crate::share::spawn(Arc::clone(&node), share, Arc::clone(&shutdown));
    match crate::telemetry::NvmlProbe::open(gpus.iter().map(|g| g.index).collect()) {
        Ok(probe) => {
            tracing::info!(interval_s = telemetry_s, "GPU telemetry through NVML");
            crate::telemetry::spawn(
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
    follow_private_data(weight_scontrol, Arc::clone(&access.private_jobs), Arc::clone(&shutdown));
    if let Some(listener) = metrics {
        let (node, private, shutdown) = (
            Arc::clone(&node),
            Arc::clone(&access.private_jobs),
            Arc::clone(&shutdown),
        );
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || crate::metrics::serve(listener, node, private, shutdown))
            .map_err(|e| format!("cannot start the metrics endpoint: {e}"))?;
    }
    // systemd (Type=notify): the socket answers from here on.
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    server::run(listener, Arc::clone(&node), access, shutdown);
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    let _ = std::fs::remove_file(&socket);
    // Every job steering raised gets its own nice back.
    drop(steerer);
    // What ended jobs still have to teach is learned before the daemon exits.
    node.lock().unwrap_or_else(|p| p.into_inner()).stop_learning();
    tracing::info!("stopped");
    Ok(())
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
    let outcome = crate::tools::load_config(config_path).and_then(|new| {
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
/// config` every minute until it answers (the daemon may start before slurmctld), then every
/// ten minutes. Until it has answered, jobs are private.
fn follow_private_data(scontrol: std::path::PathBuf, private: Arc<AtomicBool>, shutdown: Arc<AtomicBool>) {
    let mut trouble = crate::background::Trouble::default();
    let mut known: Option<bool> = None;
    let mut next = std::time::Instant::now();
    let spawned = crate::background::every("privatedata", Duration::from_secs(60), shutdown, move || {
        if std::time::Instant::now() < next {
            return;
        }
        let args = ["show".to_string(), "config".to_string()];
        let answer = crate::command::run(&scontrol, &args, Duration::from_secs(10)).and_then(|out| {
            crate::server::private_jobs(&out).ok_or_else(|| "no PrivateData in its output".to_string())
        });
        match answer {
            Ok(p) => {
                if trouble.recovered() || known != Some(p) {
                    tracing::info!(private_jobs = p, "Slurm's PrivateData read");
                }
                known = Some(p);
                private.store(p, Ordering::Relaxed);
                next = std::time::Instant::now() + Duration::from_secs(600);
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
