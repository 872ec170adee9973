//! Publishing what the node can take as its Slurm `Weight`. Slurm tries nodes in tiers of
//! equal weight, lightest first, and with the shared partition's `LLN=YES` picks the least
//! loaded node within a tier by its own count of idle CPUs, which it keeps up to date between
//! the jobs it starts in one scheduling pass. The weight therefore says only what Slurm cannot
//! count itself, in three tiers ([`weight_for`]):
//!
//! 1. `base`: the node has an idle shared GPU;
//! 2. `base + 100`: every shared GPU runs a job, so a newcomer would share one;
//! 3. `base + 200`: the daemon declined the latest newcomer and nothing changed since.
//!
//! It used to be the node's load (`base` plus the share of slots taken). That went stale
//! within a pass: the weight reaches slurmctld only after the daemon placed the job, so a burst
//! of jobs started in one pass all went to the node that was lightest before it, sharing its
//! GPUs while another node had idle ones. Tiers change only when a node's last idle GPU is
//! taken or freed, or it starts or stops refusing, and within a tier LLN spreads by Slurm's
//! own fresh count.
//!
//! `scontrol update NodeName=N Weight=W` runs in a thread of its own, never in a request: a
//! slow or absent slurmctld delays the weight, not a job. The weight is published again every
//! `republish_s` (slurmctld forgets it on restart and reconfigure), and retried after failures.

pub use crate::config::WeightConfig;
use crate::node::NodeLoad;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The weight a node in the state `load` publishes (see the module's tiers).
pub fn weight_for(load: NodeLoad, base: u32) -> u32 {
    let tier = if load.refusing {
        2
    } else if load.empty_gpus == 0 && load.total > 0 {
        1
    } else {
        0
    };
    base.saturating_add(100 * tier)
}

/// How long one scontrol call may take before it is killed.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Want {
    weight: Option<u32>,
    stop: bool,
}

/// The publishing thread. Dropping this stops it.
pub struct Publisher {
    shared: Arc<(Mutex<Want>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Publisher {
    /// Starts publishing for node `node` (nothing is published until [`Publisher::set`]).
    pub fn start(node: String, config: WeightConfig) -> std::io::Result<Publisher> {
        let shared = Arc::new((Mutex::new(Want::default()), Condvar::new()));
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("weight".into())
                .spawn(move || run(&node, &config, &shared))?
        };
        Ok(Publisher {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks for `weight` to be published (the latest wins; no call blocks on Slurm).
    pub fn set(&self, weight: u32) {
        let (lock, cv) = &*self.shared;
        lock.lock().unwrap_or_else(|p| p.into_inner()).weight = Some(weight);
        cv.notify_one();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let (lock, cv) = &*self.shared;
        lock.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
        cv.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(node: &str, config: &WeightConfig, shared: &(Mutex<Want>, Condvar)) {
    let (lock, cv) = shared;
    let republish = (config.republish_s > 0).then(|| Duration::from_secs(config.republish_s));
    let mut published: Option<u32> = None;
    // When the next call is due regardless of changes (republish or retry).
    let mut due: Option<Instant> = None;
    let mut trouble = crate::background::Trouble::default();
    loop {
        let weight = {
            let mut want = lock.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if want.stop {
                    return;
                }
                let now = Instant::now();
                let changed = want.weight.is_some() && want.weight != published;
                let is_due = want.weight.is_some() && due.is_some_and(|d| now >= d);
                if changed || is_due {
                    break;
                }
                want = match due {
                    Some(d) => cv.wait_timeout(want, d - now).unwrap_or_else(|p| p.into_inner()).0,
                    None => cv.wait(want).unwrap_or_else(|p| p.into_inner()),
                };
            }
            want.weight.expect("checked above")
        };
        match update_weight(&config.scontrol, node, weight) {
            Ok(()) => {
                if published != Some(weight) {
                    tracing::info!(node, weight, "published node weight");
                }
                if trouble.recovered() {
                    tracing::info!(node, weight, "publishing the node weight works again");
                }
                published = Some(weight);
                due = republish.map(|r| Instant::now() + r);
            }
            Err(e) => {
                if trouble.failed(&e) {
                    tracing::warn!(node, weight, error = %e, "cannot publish the node weight; retrying every {:?}", config.retry);
                }
                published = None;
                due = Some(Instant::now() + config.retry);
            }
        }
    }
}

/// Runs `scontrol update NodeName=node Weight=weight`, killing it after [`CALL_TIMEOUT`].
fn update_weight(scontrol: &std::path::Path, node: &str, weight: u32) -> Result<(), String> {
    let args = [
        "update".to_string(),
        format!("NodeName={node}"),
        format!("Weight={weight}"),
    ];
    crate::command::run(scontrol, &args, CALL_TIMEOUT).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn load(used: u32, empty_gpus: u32, refusing: bool) -> NodeLoad {
        NodeLoad {
            used,
            total: 8,
            empty_gpus,
            refusing,
        }
    }

    #[test]
    fn the_weight_is_a_tier_idle_gpu_then_sharing_then_refusing() {
        assert_eq!(weight_for(load(0, 4, false), 1), 1);
        assert_eq!(weight_for(load(3, 1, false), 1), 1, "any idle GPU: the first tier");
        assert_eq!(weight_for(load(4, 0, false), 1), 101, "every GPU busy");
        assert_eq!(
            weight_for(load(7, 0, false), 1),
            101,
            "load within a tier is LLN's to weigh"
        );
        assert_eq!(weight_for(load(4, 0, true), 1), 201);
        assert_eq!(weight_for(load(4, 0, true), 50), 250);
        assert_eq!(weight_for(load(0, 0, false), u32::MAX), u32::MAX, "no overflow");
        let no_gpu = NodeLoad {
            used: 0,
            total: 0,
            empty_gpus: 0,
            refusing: false,
        };
        assert_eq!(weight_for(no_gpu, 7), 7);
    }

    /// A stand-in scontrol that appends its arguments to a file (or fails while `fail` exists).
    fn fake_scontrol(dir: &std::path::Path) -> PathBuf {
        let script = dir.join("scontrol");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\n[ -e {d}/fail ] && {{ echo 'Unable to contact slurm controller' >&2; exit 1; }}\necho \"$*\" >>{d}/calls\n",
                d = dir.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    fn calls(dir: &std::path::Path) -> Vec<String> {
        std::fs::read_to_string(dir.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    fn eventually(what: &str, f: impl Fn() -> bool) {
        let start = Instant::now();
        while !f() {
            assert!(start.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn publishes_changes_retries_failures_and_republishes() {
        let dir = std::env::temp_dir().join(format!("weight-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("fail"), "").unwrap();
        let config = WeightConfig {
            scontrol: fake_scontrol(&dir),
            republish_s: 1,
            retry: Duration::from_millis(200),
            ..WeightConfig::default()
        };
        let p = Publisher::start("n7".into(), config).unwrap();
        p.set(26);
        std::thread::sleep(Duration::from_millis(300));
        assert!(calls(&dir).is_empty(), "slurmctld down: nothing published yet");
        std::fs::remove_file(dir.join("fail")).unwrap();
        eventually("retried after the failure", || !calls(&dir).is_empty());
        assert_eq!(calls(&dir)[0], "update NodeName=n7 Weight=26");
        p.set(51);
        p.set(1);
        eventually("the latest weight is published", || {
            calls(&dir).last().map(String::as_str) == Some("update NodeName=n7 Weight=1")
        });
        let n = calls(&dir).len();
        eventually("published again without a change", || calls(&dir).len() > n);
        assert!(calls(&dir)[n..].iter().all(|c| c == "update NodeName=n7 Weight=1"));
        drop(p);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
