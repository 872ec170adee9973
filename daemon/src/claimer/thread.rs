//! The claimer's thread: a look every `look_ms`, and what each look did in the log and the
//! metrics.

use super::{ClaimConfig, Claimer, Looked, LEASE_LICENSE, LEASE_PREFIX, LICENSE, OFF_RESERVATION};
use crate::background::Trouble;
use crate::node::Node;
use crate::slurm::Slurm;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Runs the claimer every `look_ms` until `shutdown`. The gate is left to lapse on its own: a
/// daemon that restarts within the lease takes over without a job slipping through.
///
/// `share_every_s` is `[share] every_s`: what another node's job teaches reaches this
/// daemon's history within two exchanges and a few seconds ([`crate::claim::outcome_s`]), and
/// a pair never tried waits that long after its trial ended for the outcome
/// ([`crate::claim::Trials`]).
pub fn spawn(
    node: Arc<Mutex<Node>>,
    slurm: Arc<dyn Slurm>,
    config: ClaimConfig,
    share_every_s: u64,
    shutdown: Arc<AtomicBool>,
) {
    let every = Duration::from_millis(config.look_ms);
    tracing::info!(
        partition = %config.partition,
        lookahead = config.lookahead,
        look_ms = config.look_ms,
        lease_s = config.lease_s,
        "claiming pending multiplexed jobs for the cluster"
    );
    let name = node.lock().unwrap_or_else(|p| p.into_inner()).name().to_string();
    let started = std::thread::Builder::new().name("claim".into()).spawn(move || {
        let mut trouble = Trouble::default();
        let mut claimer: Option<Claimer> = None;
        let start = Instant::now();
        while !shutdown.load(Ordering::SeqCst) {
            let next = Instant::now() + every;
            if claimer.is_none() {
                claimer = first(slurm.as_ref(), &config, share_every_s, &name, &mut trouble);
            }
            if let Some(c) = claimer.as_mut() {
                match c.look(slurm.as_ref(), node.as_ref(), start.elapsed().as_secs_f64()) {
                    Ok(looked) => said(&looked, &mut trouble),
                    Err(e) => {
                        crate::metrics::global().claim("failed", 1);
                        if trouble.failed(&e.to_string()) {
                            tracing::warn!(error = %e, "cannot claim; waiting jobs start where Slurm puts them once the gate lapses");
                        }
                    }
                }
            }
            sleep_until(next, &shutdown);
        }
    });
    if let Err(e) = started {
        tracing::error!(
            "cannot start the claimer ({e}): waiting jobs start where Slurm puts them once the gate lapses"
        );
    }
}

/// The claimer, once Slurm says how many of the gate's licenses slurm.conf has. Where it has
/// the claimers' lease license, the daemon of `node` stands for the lease
/// ([`super::Election`]); without it, it claims alone.
fn first(
    slurm: &dyn Slurm,
    config: &ClaimConfig,
    share_every_s: u64,
    node: &str,
    trouble: &mut Trouble,
) -> Option<Claimer> {
    let count = match slurm.license_total(LICENSE) {
        Ok(count) => count,
        Err(e) => {
            if trouble.failed(&e.to_string()) {
                tracing::warn!(
                    "cannot read how many {LICENSE} licenses slurm.conf has ({e}); no claims until it can, \
                     and waiting jobs start where Slurm puts them"
                );
            }
            return None;
        }
    };
    let claimer = Claimer::new(config.clone(), count).outcome_after(crate::claim::outcome_s(share_every_s as f64));
    match slurm.license_total(LEASE_LICENSE) {
        Ok(n) if n > 0 => {
            tracing::info!(lease = %format!("{LEASE_PREFIX}{node}"), "standing for the claimers' lease: this daemon claims while it holds it");
            Some(claimer.stands_by(node))
        }
        Err(e) if !e.to_string().starts_with("slurm.conf has no license") => {
            if trouble.failed(&e.to_string()) {
                tracing::warn!(
                    "cannot read whether slurm.conf has the claimers' lease license ({e}); no claims until it can"
                );
            }
            None
        }
        _ => {
            tracing::warn!(
                "slurm.conf has no license {LEASE_LICENSE}: this daemon claims alone, with no standby \
                 (add {LEASE_LICENSE}:1 to Licenses= and several daemons with [claim] enabled stand by for each other)"
            );
            Some(claimer)
        }
    }
}

/// What a look did, in the log and the metrics.
fn said(looked: &Looked, trouble: &mut Trouble) {
    if trouble.recovered() {
        tracing::info!("claiming works again");
    }
    match looked.leading {
        Some(true) => tracing::info!("holding the claimers' lease: claiming for the cluster"),
        Some(false) => tracing::info!("standing by: another daemon holds the claimers' lease"),
        None => {}
    }
    match looked.switched {
        Some(true) => tracing::warn!(
            "the gate is switched off (reservation {OFF_RESERVATION}): multiplexed jobs start where Slurm places \
             them, and this claimer neither gates nor claims until `multiplexd gate on`"
        ),
        Some(false) => tracing::info!("the gate is switched on again: gating and claiming"),
        None => {}
    }
    match &looked.paced {
        Some(super::Paced::Spacing { read_ms, every_s }) => tracing::info!(
            read_ms = format!("{read_ms:.1}"),
            every_s = format!("{every_s:.1}"),
            "slurmctld's reads of the job table cost this much each (sdiag): reading the queue this often keeps \
             the claimer within [claim] slurmctld_percent of its time"
        ),
        Some(super::Paced::Timed(e)) => tracing::warn!(
            error = %e,
            "cannot read slurmctld's statistics (sdiag; PrivateData=usage refuses them to a user who is not an \
             operator): each read's own duration stands for its cost, which spaces the reads further than needed"
        ),
        None => {}
    }
    for (job, node, kind) in &looked.claimed {
        tracing::info!(job, %node, gpu = %kind, "claimed");
    }
    for (job, reason) in &looked.refused {
        tracing::info!(job, %reason, "refused: no GPU of the cluster could ever hold it");
    }
    for job in &looked.too_late {
        tracing::info!(job, "the job left the queue before its claim reached slurmctld");
    }
    let metrics = crate::metrics::global();
    metrics.claim("claimed", looked.claimed.len() as u64);
    metrics.claim("refused", looked.refused.len() as u64);
    metrics.claim("too_late", looked.too_late.len() as u64);
}

fn sleep_until(at: Instant, shutdown: &AtomicBool) {
    while Instant::now() < at && !shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50).min(at.saturating_duration_since(Instant::now())));
    }
}
