//! Keeping the history's idea of what runs here true to Slurm's. A job whose end was never
//! reported (the daemon was down when it ended, slurmstepd died) would otherwise hold its slot
//! forever and the node would decline everything in the end. At start and every
//! `interval_s`, the daemon asks `squeue` which jobs run on its node and frees the slots of
//! the others.

use crate::background::Trouble;
pub use crate::config::ReconcileConfig;
use crate::node::Node;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// The job ids Slurm has running (or finishing) on `node`.
pub fn running_jobs(squeue: &Path, node: &str) -> Result<HashSet<u32>, String> {
    let args = [
        "--noheader".to_string(),
        format!("--nodelist={node}"),
        "--states=RUNNING,COMPLETING,SUSPENDED,CONFIGURING,STOPPED".to_string(),
        "--format=%A".to_string(),
    ];
    let out = crate::command::run(squeue, &args, CALL_TIMEOUT)?;
    out.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.parse::<u32>()
                .map_err(|_| format!("{} printed {l:?} where a job id belongs", squeue.display()))
        })
        .collect()
}

/// One check: ask Slurm, then free what it no longer runs here.
pub fn once(node: &Mutex<Node>, config: &ReconcileConfig) -> Result<Vec<u32>, String> {
    let name = node.lock().unwrap_or_else(|p| p.into_inner()).name().to_string();
    let running = running_jobs(&config.squeue, &name)?;
    node.lock()
        .unwrap_or_else(|p| p.into_inner())
        .reconcile(&running, config.grace_s)
        .map_err(|e| e.to_string())
}

/// Checks at start and every `interval_s` until `shutdown`; a failing squeue is logged once
/// per distinct error and changes nothing.
pub fn spawn(node: Arc<Mutex<Node>>, config: ReconcileConfig, shutdown: Arc<AtomicBool>) {
    if config.interval_s == 0 {
        tracing::info!("not reconciling with Slurm (reconcile.interval_s = 0)");
        return;
    }
    let every = Duration::from_secs(config.interval_s);
    let mut trouble = Trouble::default();
    let started = crate::background::every("reconcile", every, shutdown, move || match once(&node, &config) {
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
    });
    if let Err(e) = started {
        tracing::error!("cannot start the reconcile thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fake_squeue(dir: &Path, output: &str) -> PathBuf {
        let script = dir.join("squeue");
        std::fs::write(
            &script,
            format!("#!/bin/sh\necho \"$*\" >{}/args\nprintf '{output}'\n", dir.display()),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    #[test]
    fn squeue_output_is_read_strictly() {
        let dir = tempfile::tempdir().unwrap();
        let ok = fake_squeue(dir.path(), "12\\n  13\\n\\n");
        assert_eq!(running_jobs(&ok, "n4").unwrap(), HashSet::from([12, 13]));
        let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
        assert!(args.contains("--nodelist=n4") && args.contains("--format=%A"), "{args}");
        let bad = fake_squeue(dir.path(), "12_3\\n");
        assert!(running_jobs(&bad, "n4")
            .unwrap_err()
            .contains("\"12_3\" where a job id belongs"));
    }
}
