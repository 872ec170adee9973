//! Keeping the history's idea of what runs here true to Slurm's. A job whose end was never
//! reported (the daemon was down when it ended, slurmstepd died) would otherwise hold its slot
//! forever. At start and every `interval_s`, the daemon asks this node's own slurmd which jobs
//! run here (`scontrol listpids`: no slurmctld RPC, so a thousand nodes checking cost
//! slurmctld nothing) and frees the slots of the others.

use crate::background::Trouble;
pub use crate::config::ReconcileConfig;
use crate::node::Node;
use crate::slurm::Slurm;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One check: ask this node's slurmd, then free what it no longer runs here.
pub fn once(node: &Mutex<Node>, slurm: &dyn Slurm, config: &ReconcileConfig) -> Result<Vec<u32>, String> {
    let name = node.lock().unwrap_or_else(|p| p.into_inner()).name().to_string();
    let running = slurm.running_here(&name).map_err(|e| e.to_string())?;
    node.lock()
        .unwrap_or_else(|p| p.into_inner())
        .reconcile(&running, config.grace_s)
        .map_err(|e| e.to_string())
}

/// Checks at start and every `interval_s` until `shutdown`; a failing squeue is logged once
/// per distinct error and changes nothing.
pub fn spawn(node: Arc<Mutex<Node>>, slurm: Arc<dyn Slurm>, config: ReconcileConfig, shutdown: Arc<AtomicBool>) {
    if config.interval_s == 0 {
        tracing::info!("not reconciling with Slurm (reconcile.interval_s = 0)");
        return;
    }
    let every = Duration::from_secs(config.interval_s);
    let mut trouble = Trouble::default();
    let started = crate::background::every("reconcile", every, shutdown, move || {
        match once(&node, slurm.as_ref(), &config) {
            Ok(_) => {
                if trouble.recovered() {
                    tracing::info!("reconciling with Slurm works again");
                }
            }
            Err(e) => {
                if trouble.failed(&e) {
                    tracing::warn!(error = %e, "cannot ask Slurm which jobs run here; slots are kept as they are");
                }
            }
        }
    });
    if let Err(e) = started {
        tracing::error!("cannot start the reconcile thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, GpuSpec};
    use crate::slurm::{Fake, FakeState};
    use multiplex_protocol::StartRequest;

    #[test]
    fn a_job_slurmd_no_longer_runs_frees_its_slot_after_the_grace() {
        let config = Config::parse("node = \"n1\"\ndatabase = \":memory:\"\n").unwrap();
        let gpu = GpuSpec {
            index: 0,
            model: "v100".into(),
            memory_mb: 16384,
            uuid: None,
        };
        let now = Arc::new(std::sync::atomic::AtomicU64::new(100));
        let clock = {
            let now = Arc::clone(&now);
            Box::new(move || now.load(std::sync::atomic::Ordering::SeqCst) as f64)
        };
        let node = Mutex::new(Node::open(config, vec![gpu], clock).unwrap());
        for job in [1, 2] {
            let r = node
                .lock()
                .unwrap()
                .start(&StartRequest::new(job, 0, "a", "n1", 0))
                .unwrap();
            assert!(matches!(r, crate::node::Started::Placed { .. }), "{r:?}");
        }
        let slurm = Fake::new(FakeState {
            running: vec![("n1".into(), 1), ("n2".into(), 2)],
            ..FakeState::default()
        });
        let grace = ReconcileConfig::default();
        // Within the grace nothing is freed.
        assert!(once(&node, &slurm, &grace).unwrap().is_empty());
        now.store(200, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(once(&node, &slurm, &grace).unwrap(), vec![2]);
        slurm.state.lock().unwrap().fail = Some("scontrol: error: slurmd n1 not responding".into());
        assert!(once(&node, &slurm, &grace).unwrap_err().contains("not responding"));
    }
}
