//! Queue-level choice: when a slot of this node frees (or stays free after a decline), the
//! pending multiplexed job that pairs best with what runs here, among the first `lookahead`
//! of Slurm's own priority order, is the one Slurm starts next.
//!
//! Slurm's own mechanisms only, never a second scheduler: the daemon reads the pending jobs
//! of the shared partition with `squeue` (in priority order, with slurmctld's tag that names
//! each job's application), asks [`Node::steer`] which one to start first, and lowers that
//! job's `Nice` with `scontrol update` just enough to put it first. Slurm's next pass starts
//! it; with every other node busy, on the slot that freed here.
//!
//! Bounds (fail-open):
//! - only among the first `lookahead` jobs of Slurm's order, so fair-share, QOS and limits keep
//!   their meaning, and no job is passed over more than [`crate::placement::Bypasses::MAX`]
//!   times by this node;
//! - the raised priority is taken back (the job's own `Nice` restored) as soon as the job has
//!   started, was requeued, or after `hold_s`, whichever comes first, and when the daemon
//!   stops; a daemon killed outright leaves at most the jobs it raised at the front of the
//!   queue, which start at the next free slot;
//! - everything runs on a thread of its own: a slow or absent slurmctld delays steering, never
//!   a request, and with the daemon down Slurm's order is simply its own.

use crate::background::Trouble;
pub use crate::config::SteerConfig;
use crate::node::{Node, PendingJob};
use multiplex_protocol::spec::Spec;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Slurm's bound on a job's `Nice` (NICE_OFFSET - 3).
const MAX_NICE: i64 = 2_147_483_645;
/// How often raised jobs are looked at while some are outstanding.
const HOUSEKEEPING: Duration = Duration::from_secs(2);

/// A pending job of the shared partition, as squeue lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    pub job_id: u32,
    pub nice: i64,
    pub priority: u64,
    /// Slurm would start it now if a slot were free (it waits for `Priority` or `Resources`,
    /// not for its begin time, a hold, a dependency or a limit).
    pub startable: bool,
    /// The application and memory slurmctld's tag names; `None`: not a multiplexed job.
    pub spec: Option<Spec>,
}

/// The fields asked of squeue, `|`-separated, the admin comment (which may hold `|`) last.
const FORMAT: &str = "JobID:0|,Nice:0|,PriorityLong:0|,Reason:0|,admin_comment:0";

/// Reads squeue's lines of [`FORMAT`]. Lines that are not one job (a pending array's
/// `123_[4-9]`) are skipped: Slurm starts such tasks as jobs of their own first.
pub fn parse_queued(out: &str) -> Result<Vec<Queued>, String> {
    let mut jobs = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.splitn(5, '|').collect();
        if f.len() < 5 {
            return Err(format!("squeue printed {line:?}, not 5 fields"));
        }
        let Ok(job_id) = f[0].trim().parse::<u32>() else {
            continue;
        };
        let nice = f[1]
            .trim()
            .parse::<i64>()
            .map_err(|_| format!("squeue printed {:?} where job {job_id}'s nice belongs", f[1]))?;
        let priority = f[2]
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("squeue printed {:?} where job {job_id}'s priority belongs", f[2]))?;
        let startable = matches!(f[3].trim(), "Priority" | "Resources" | "None");
        let comment = f[4].trim();
        let spec = match Spec::from_tag((comment != "(null)").then_some(comment)) {
            Some(Ok(spec)) if spec.app.is_some() => Some(spec),
            _ => None,
        };
        jobs.push(Queued {
            job_id,
            nice,
            priority,
            startable,
            spec,
        });
    }
    Ok(jobs)
}

/// The pending jobs of `partition`, in Slurm's order (priority, then job id).
pub fn pending_jobs(squeue: &Path, partition: &str) -> Result<Vec<Queued>, String> {
    let args = [
        "--noheader".to_string(),
        "--states=PENDING".to_string(),
        format!("--partition={partition}"),
        "--sort=-p,i".to_string(),
        format!("--Format={FORMAT}"),
    ];
    parse_queued(&crate::command::run(squeue, &args, CALL_TIMEOUT)?)
}

/// A job to raise: its id, the `Nice` that should put it first, its own, and the job it must
/// go before (Slurm's first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raise {
    pub job_id: u32,
    pub nice: i64,
    pub own_nice: i64,
    pub before: u32,
}

/// Which job to raise, if any: the first `lookahead` startable multiplexed jobs of `queued`
/// (in Slurm's order) go to `choose`, which answers with an index as [`Node::steer`] does.
pub fn decide(
    queued: &[Queued],
    lookahead: usize,
    choose: impl FnOnce(&[PendingJob]) -> Result<Option<usize>, String>,
) -> Result<Option<Raise>, String> {
    let first: Vec<&Queued> = queued
        .iter()
        .filter(|q| q.startable && q.spec.is_some())
        .take(lookahead)
        .collect();
    if first.len() < 2 {
        return Ok(None);
    }
    let pending: Vec<PendingJob> = first
        .iter()
        .map(|q| {
            let spec = q.spec.as_ref().expect("filtered above");
            PendingJob {
                job_id: q.job_id,
                app: spec.app.as_deref().unwrap_or_default(),
                mem_mb: spec.mem_mb,
            }
        })
        .collect();
    let Some(i) = choose(&pending)?.filter(|&i| i > 0 && i < first.len()) else {
        return Ok(None);
    };
    let (top, job) = (first[0], first[i]);
    // One more than the first's priority. Slurm's priority is the job's factors (0 or more)
    // less its nice, but never below 1: a job at 1 may be anywhere below, and a nice of
    // -(top + 1) lifts it above the first whatever its factors and own nice.
    let above = i64::try_from(top.priority).unwrap_or(i64::MAX).saturating_add(1);
    let nice = if job.priority <= 1 {
        above.saturating_neg()
    } else {
        let lift = i64::try_from(top.priority.saturating_sub(job.priority))
            .unwrap_or(i64::MAX)
            .saturating_add(1);
        job.nice.saturating_sub(lift)
    };
    if nice < -MAX_NICE {
        return Ok(None);
    }
    Ok(Some(Raise {
        job_id: job.job_id,
        nice,
        own_nice: job.nice,
        before: top.job_id,
    }))
}

fn set_nice(scontrol: &Path, job_id: u32, nice: i64) -> Result<(), String> {
    let args = ["update".to_string(), format!("JobId={job_id}"), format!("Nice={nice}")];
    crate::command::run(scontrol, &args, CALL_TIMEOUT).map(|_| ())
}

/// squeue's `fields` (`|`-separated) for the jobs `ids`: one row of trimmed fields per job
/// Slurm still knows.
fn listed(squeue: &Path, ids: &[u32], fields: &str) -> Result<Vec<Vec<String>>, String> {
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let args = [
        "--noheader".to_string(),
        format!("--jobs={}", list.join(",")),
        format!("--Format={fields}"),
    ];
    let out = match crate::command::run(squeue, &args, CALL_TIMEOUT) {
        Ok(out) => out,
        // Every one of them has ended and been purged.
        Err(e) if e.contains("Invalid job id") => String::new(),
        Err(e) => return Err(e),
    };
    Ok(out
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split('|').map(|f| f.trim().to_string()).collect())
        .collect())
}

/// Where the jobs this node raised stand: id to (state, reason, nice).
fn raised_now(squeue: &Path, ids: &[u32]) -> Result<HashMap<u32, (String, String, i64)>, String> {
    let mut now = HashMap::new();
    for row in listed(squeue, ids, "JobID:0|,State:0|,Reason:0|,Nice:0")? {
        if let [id, state, reason, nice] = &row[..] {
            if let (Ok(id), Ok(nice)) = (id.parse::<u32>(), nice.parse::<i64>()) {
                now.insert(id, (state.clone(), reason.clone(), nice));
            }
        }
    }
    Ok(now)
}

/// A job this node raised, until its own `Nice` is back.
struct Raised {
    raise: Raise,
    at: Instant,
}

/// What the steering thread is told.
#[derive(Default)]
struct Signal {
    /// A slot of the node is free (it freed, or stayed free after a decline).
    free: bool,
    stop: bool,
}

/// Tells the steering thread that a slot of the node is free. Cheap: call it from the node's
/// load listener, inside requests.
#[derive(Clone)]
pub struct Poke(Arc<(Mutex<Signal>, Condvar)>);

impl Poke {
    pub fn slot_free(&self) {
        let (lock, cv) = &*self.0;
        lock.lock().unwrap_or_else(|p| p.into_inner()).free = true;
        cv.notify_one();
    }
}

/// The steering thread; dropping it stops the thread, which gives every job it raised its own
/// `Nice` back first.
pub struct Steerer {
    signal: Arc<(Mutex<Signal>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the thread runs: the commands and the choice.
pub struct Steering {
    pub config: SteerConfig,
    pub squeue: PathBuf,
    pub scontrol: PathBuf,
}

impl Steerer {
    /// The poke to hand the node's load listener, before the node is shared.
    pub fn poke() -> Poke {
        Poke(Arc::new((Mutex::new(Signal::default()), Condvar::new())))
    }

    /// Starts steering for `node` on the thread "steer", woken by `poke`.
    pub fn start(node: Arc<Mutex<Node>>, steering: Steering, poke: &Poke) -> std::io::Result<Steerer> {
        let signal = Arc::clone(&poke.0);
        let thread = {
            let signal = Arc::clone(&signal);
            std::thread::Builder::new()
                .name("steer".into())
                .spawn(move || run(&node, &steering, &signal))?
        };
        Ok(Steerer {
            signal,
            thread: Some(thread),
        })
    }
}

impl Drop for Steerer {
    fn drop(&mut self) {
        let (lock, cv) = &*self.signal;
        lock.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
        cv.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(node: &Mutex<Node>, s: &Steering, signal: &(Mutex<Signal>, Condvar)) {
    let (lock, cv) = signal;
    let mut raised: Vec<Raised> = Vec::new();
    let mut trouble = Trouble::default();
    let hold = Duration::from_secs(s.config.hold_s);
    loop {
        let (free, stop) = {
            let mut sig = lock.lock().unwrap_or_else(|p| p.into_inner());
            while !sig.free && !sig.stop {
                if raised.is_empty() {
                    sig = cv.wait(sig).unwrap_or_else(|p| p.into_inner());
                } else {
                    let (g, t) = cv.wait_timeout(sig, HOUSEKEEPING).unwrap_or_else(|p| p.into_inner());
                    sig = g;
                    if t.timed_out() {
                        break;
                    }
                }
            }
            let out = (sig.free, sig.stop);
            sig.free = false;
            out
        };
        if stop {
            give_back(s, &mut raised, None);
            return;
        }
        if free {
            match steer_once(node, s) {
                Ok(Some(r)) => {
                    tracing::info!(
                        job = r.job_id,
                        nice = r.nice,
                        own_nice = r.own_nice,
                        "steered: Slurm starts this pending job next"
                    );
                    raised.retain(|x| x.raise.job_id != r.job_id);
                    raised.push(Raised {
                        raise: r,
                        at: Instant::now(),
                    });
                    if trouble.recovered() {
                        tracing::info!("steering Slurm's queue works again");
                    }
                }
                Ok(None) => {
                    if trouble.recovered() {
                        tracing::info!("steering Slurm's queue works again");
                    }
                }
                Err(e) => {
                    if trouble.failed(&e) {
                        tracing::warn!(error = %e, "cannot steer Slurm's queue; Slurm's own order stands");
                    }
                }
            }
        }
        if !raised.is_empty() {
            give_back(s, &mut raised, Some(hold));
        }
    }
}

/// One look at the queue: raises the job to start next here, if not Slurm's first.
fn steer_once(node: &Mutex<Node>, s: &Steering) -> Result<Option<Raise>, String> {
    let queued = pending_jobs(&s.squeue, &s.config.partition)?;
    let raise = decide(&queued, s.config.lookahead, |pending| {
        let mut node = node.lock().unwrap_or_else(|p| p.into_inner());
        // The slot may have been taken since the poke.
        let load = node.load().map_err(|e| e.to_string())?;
        if load.used >= load.total {
            return Ok(None);
        }
        node.steer(pending).map_err(|e| e.to_string())
    })?;
    let Some(mut r) = raise else {
        return Ok(None);
    };
    // Slurm keeps a priority at 1 or more (priority/multifactor with no weights gives every
    // job 1), so the first nice may not be enough: checked, and lowered further if need be.
    // Once a nice is set, the raise is kept (and given back later) whatever fails after.
    set_nice(&s.scontrol, r.job_id, r.nice)?;
    for tried in 1..=RAISE_TRIES {
        let now = match priorities(&s.squeue, &[r.before, r.job_id]) {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!(job = r.job_id, error = %e, "raised a pending job but cannot read its priority back");
                return Ok(Some(r));
            }
        };
        match (now.get(&r.before), now.get(&r.job_id)) {
            (Some(top), Some(mine)) if mine <= top => {
                let lower = r.own_nice.saturating_sub((r.own_nice - r.nice).saturating_mul(4));
                if tried == RAISE_TRIES || lower < -MAX_NICE {
                    break;
                }
                if let Err(e) = set_nice(&s.scontrol, r.job_id, lower) {
                    tracing::warn!(job = r.job_id, error = %e, "cannot lower a raised job's nice further");
                    return Ok(Some(r));
                }
                r.nice = lower;
            }
            // First now, or one of the two started or left meanwhile.
            _ => return Ok(Some(r)),
        }
    }
    if let Err(e) = set_nice(&s.scontrol, r.job_id, r.own_nice) {
        tracing::warn!(job = r.job_id, error = %e, "cannot give back a job's own nice; trying again later");
        return Ok(Some(r));
    }
    Err(format!(
        "job {}'s priority stayed below job {}'s down to nice {}: Slurm's priority does not follow the nice here",
        r.job_id, r.before, r.nice
    ))
}

/// How many nices a raise tries, each lifting 4 times as much as the one before.
const RAISE_TRIES: usize = 4;

/// The priorities of `ids` as Slurm has them now.
fn priorities(squeue: &Path, ids: &[u32]) -> Result<HashMap<u32, u64>, String> {
    Ok(listed(squeue, ids, "JobID:0|,PriorityLong:0")?
        .into_iter()
        .filter_map(|row| match &row[..] {
            [id, p] => Some((id.parse().ok()?, p.parse().ok()?)),
            _ => None,
        })
        .collect())
}

/// Gives raised jobs their own `Nice` back once they started, were requeued or left the
/// queue's front for another reason, or were raised more than `hold` ago (all of them when
/// `hold` is `None`: the daemon stops). A job whose nice someone else changed since is left
/// alone.
fn give_back(s: &Steering, raised: &mut Vec<Raised>, hold: Option<Duration>) {
    let ids: Vec<u32> = raised.iter().map(|r| r.raise.job_id).collect();
    let now = match raised_now(&s.squeue, &ids) {
        Ok(now) => now,
        Err(e) => {
            tracing::warn!(error = %e, "cannot look up the jobs steering raised; trying again");
            if hold.is_some() {
                return;
            }
            HashMap::new()
        }
    };
    raised.retain(|r| {
        let Some((state, reason, nice)) = now.get(&r.raise.job_id) else {
            return false; // gone from Slurm
        };
        if *nice != r.raise.nice {
            return false; // changed by someone else since
        }
        let waiting = state == "PENDING" && matches!(reason.as_str(), "Priority" | "Resources" | "None");
        let expired = hold.is_none_or(|h| r.at.elapsed() >= h);
        if waiting && !expired {
            return true;
        }
        match set_nice(&s.scontrol, r.raise.job_id, r.raise.own_nice) {
            Ok(()) => {
                tracing::debug!(job = r.raise.job_id, nice = r.raise.own_nice, %state, "gave back the job's own nice");
                false
            }
            // Tried again at the next look, unless the daemon stops.
            Err(e) => {
                tracing::warn!(job = r.raise.job_id, error = %e, "cannot give back the job's own nice");
                hold.is_some()
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_lines_are_read_with_the_tag_and_whether_slurm_could_start_the_job() {
        let out = "41|0|4294901760|Resources|multiplex:app=a\n\
                   42|5|4294901755|Priority|multiplex:app=b,mem=2G | multiplex: requeued, waiting 60 s: x | y\n\
                   43|0|4294901754|BeginTime|multiplex:app=c\n\
                   44_[1-3]|0|4294901753|Priority|multiplex:app=d\n\
                   45|0|4294901752|Priority|(null)\n\
                   46|0|4294901751|Priority|multiplex:app=../x\n";
        let q = parse_queued(out).unwrap();
        assert_eq!(q.iter().map(|j| j.job_id).collect::<Vec<_>>(), [41, 42, 43, 45, 46]);
        assert_eq!((q[1].nice, q[1].priority), (5, 4294901755));
        assert_eq!(q[1].spec.as_ref().unwrap().mem_mb, Some(2048));
        assert!(q[0].startable && q[1].startable && !q[2].startable);
        assert!(q[3].spec.is_none(), "not a multiplexed job");
        assert!(q[4].spec.is_none(), "a tag that does not parse names nothing");
        assert!(parse_queued("41|x|1|Priority|").unwrap_err().contains("nice"));
        assert!(parse_queued("41|0\n").unwrap_err().contains("not 5 fields"));
    }

    fn queued(job_id: u32, nice: i64, priority: u64, app: Option<&str>, startable: bool) -> Queued {
        Queued {
            job_id,
            nice,
            priority,
            startable,
            spec: app.map(|a| Spec {
                app: Some(a.into()),
                mem_mb: None,
            }),
        }
    }

    #[test]
    fn the_chosen_job_gets_just_enough_nice_to_go_first() {
        let q = [
            queued(1, 0, 1000, Some("a"), true),
            queued(2, 0, 999, None, true),
            queued(3, 0, 998, Some("b"), false),
            queued(4, 10, 990, Some("c"), true),
            queued(5, 0, 989, Some("d"), true),
        ];
        let mut seen = Vec::new();
        let r = decide(&q, 3, |p| {
            seen = p.iter().map(|j| (j.job_id, j.app.to_string())).collect();
            Ok(Some(1))
        })
        .unwrap();
        // Only startable multiplexed jobs are candidates, the first 3 of them.
        assert_eq!(seen, [(1, "a".into()), (4, "c".into()), (5, "d".into())]);
        // 990 + 10 - nice = 1001: nice -1.
        assert_eq!(
            r,
            Some(Raise {
                job_id: 4,
                nice: -1,
                own_nice: 10,
                before: 1
            })
        );
        assert_eq!(decide(&q, 3, |_| Ok(None)).unwrap(), None);
        assert_eq!(
            decide(&q, 3, |_| Ok(Some(0))).unwrap(),
            None,
            "the first is first already"
        );
        assert_eq!(decide(&q, 3, |_| Ok(Some(7))).unwrap(), None, "out of range");
        assert_eq!(
            decide(&q[..2], 3, |_| panic!("one candidate: nothing to choose")).unwrap(),
            None
        );
        assert!(decide(&q, 3, |_| Err("history".into())).is_err());
        // Priorities at Slurm's floor of 1 (priority/multifactor with no weights): the nice
        // goes below the first's priority whatever the job's own.
        let floor = [queued(1, 0, 1, Some("a"), true), queued(2, 30, 1, Some("b"), true)];
        assert_eq!(decide(&floor, 2, |_| Ok(Some(1))).unwrap().map(|r| r.nice), Some(-2));
        let far = [
            queued(1, 0, u64::MAX, Some("a"), true),
            queued(2, 0, 5, Some("b"), true),
        ];
        assert_eq!(decide(&far, 2, |_| Ok(Some(1))).unwrap(), None, "beyond Slurm's nice");
    }

    /// A stand-in command that prints `out` and appends its arguments to `dir/calls`.
    fn fake(dir: &Path, name: &str, out: &str) -> PathBuf {
        let script = dir.join(name);
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"{name} $*\" >>{}/calls\nprintf '{out}'\n",
                dir.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    fn raised(job_id: u32, nice: i64, own_nice: i64, ago: Duration) -> Raised {
        Raised {
            raise: Raise {
                job_id,
                nice,
                own_nice,
                before: 1,
            },
            at: Instant::now() - ago,
        }
    }

    #[test]
    fn a_raised_job_gets_its_own_nice_back_once_it_started_was_requeued_or_waited_too_long() {
        let dir = tempfile::tempdir().unwrap();
        // 10 runs, 11 was requeued (BeginTime), 12 still waits at the front, 13 waited too
        // long, 14's nice was changed by someone else, 15 is gone.
        let squeue = fake(
            dir.path(),
            "squeue",
            "10|RUNNING|None|-3\\n11|PENDING|BeginTime|-2\\n12|PENDING|Priority|-4\\n13|PENDING|Resources|-1\\n14|PENDING|Priority|7\\n",
        );
        let s = Steering {
            config: SteerConfig::default(),
            squeue,
            scontrol: fake(dir.path(), "scontrol", ""),
        };
        let mut r = vec![
            raised(10, -3, 0, Duration::ZERO),
            raised(11, -2, 5, Duration::ZERO),
            raised(12, -4, 0, Duration::ZERO),
            raised(13, -1, 0, Duration::from_secs(61)),
            raised(14, -1, 0, Duration::ZERO),
            raised(15, -1, 0, Duration::ZERO),
        ];
        give_back(&s, &mut r, Some(Duration::from_secs(60)));
        assert_eq!(r.iter().map(|x| x.raise.job_id).collect::<Vec<_>>(), [12]);
        let calls = std::fs::read_to_string(dir.path().join("calls")).unwrap();
        let updates: Vec<&str> = calls.lines().filter(|l| l.starts_with("scontrol")).collect();
        assert_eq!(
            updates,
            [
                "scontrol update JobId=10 Nice=0",
                "scontrol update JobId=11 Nice=5",
                "scontrol update JobId=13 Nice=0"
            ]
        );
        // The daemon stops: every job still raised gets its own nice back.
        give_back(&s, &mut r, None);
        assert!(r.is_empty());
        let calls = std::fs::read_to_string(dir.path().join("calls")).unwrap();
        assert!(calls.ends_with("scontrol update JobId=12 Nice=0\n"), "{calls}");
    }

    /// A node of one GPU running x, whose history says b pairs well with x and a badly.
    fn node_beside_x() -> Node {
        let config = crate::config::Config::parse("node = \"n1\"\ndatabase = \":memory:\"\n").unwrap();
        let gpus = vec![crate::config::GpuSpec {
            index: 0,
            model: "v100".into(),
            memory_mb: 16384,
            uuid: None,
        }];
        let mut node = Node::open(config, gpus, crate::node::wall_clock()).unwrap();
        let pair = |app: &str, other: &str, speed: f64| crate::history::PairRow {
            gpu_model: "v100".into(),
            app: app.into(),
            other: other.into(),
            speed,
            other_speed: speed,
            observations: 5,
            variance: Some(0.001),
            oom: false,
        };
        let export = crate::history::Export {
            format: crate::history::EXPORT_FORMAT.into(),
            version: crate::history::EXPORT_VERSION,
            solo: vec![],
            pairs: vec![
                pair("x", "a", 0.3),
                pair("a", "x", 0.3),
                pair("x", "b", 0.9),
                pair("b", "x", 0.9),
            ],
        };
        node.import(&export).unwrap();
        let placed = node
            .place(&multiplex_protocol::PlaceRequest {
                job_id: 7,
                step_id: 0,
                uid: 0,
                app: "x".into(),
                mem_mb: None,
                node: "n1".into(),
                slurm_cuda_visible_devices: None,
                slurm_job_gpus: None,
                slurm_shards_on_node: None,
                restarts: 0,
                cannot_wait: false,
                admin_comment: None,
            })
            .unwrap();
        assert!(matches!(placed, multiplex_protocol::Response::Placed(_)), "{placed:?}");
        node
    }

    #[test]
    fn a_raise_is_read_back_and_lowered_until_slurm_puts_the_job_first() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // Pending: a (first) and b, both at Slurm's floor of 1. Read back, b stays at 1 until
        // its nice is -8 or lower (priority/multifactor whose factors are all below 0).
        let squeue = dir.path().join("squeue");
        std::fs::write(
            &squeue,
            format!(
                "#!/bin/sh\necho \"squeue $*\" >>{d}/calls\n\
                 case \"$*\" in *PENDING*) printf '20|0|1|Resources|multiplex:app=a\\n21|0|1|Priority|multiplex:app=b\\n' ;;\n\
                 *) n=$(sed -n 's/.*Nice=//p' {d}/nice | tail -1); p=1; [ \"$n\" -le -8 ] && p=2; printf '20|1\\n21|%s\\n' $p ;; esac\n"
            ),
        )
        .unwrap();
        let scontrol = dir.path().join("scontrol");
        std::fs::write(
            &scontrol,
            format!("#!/bin/sh\necho \"$*\" >>{d}/nice\necho \"scontrol $*\" >>{d}/calls\n"),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        for f in [&squeue, &scontrol] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let s = Steering {
            config: SteerConfig {
                lookahead: 8,
                ..SteerConfig::default()
            },
            squeue,
            scontrol,
        };
        let node = Mutex::new(node_beside_x());
        let r = steer_once(&node, &s).unwrap().expect("b is raised");
        assert_eq!((r.job_id, r.before, r.own_nice, r.nice), (21, 20, 0, -8));
        let nices = std::fs::read_to_string(dir.path().join("nice")).unwrap();
        assert_eq!(nices, "update JobId=21 Nice=-2\nupdate JobId=21 Nice=-8\n");
        // Where Slurm's priority never follows the nice, the job's own comes back.
        std::fs::write(dir.path().join("nice"), "").unwrap();
        let stuck = dir.path().join("squeue-stuck");
        std::fs::write(
            &stuck,
            "#!/bin/sh\ncase \"$*\" in *PENDING*) printf '20|0|1|Resources|multiplex:app=a\\n21|0|1|Priority|multiplex:app=b\\n' ;;\n*) printf '20|1\\n21|1\\n' ;; esac\n",
        )
        .unwrap();
        std::fs::set_permissions(&stuck, std::fs::Permissions::from_mode(0o755)).unwrap();
        let s = Steering { squeue: stuck, ..s };
        let e = steer_once(&node, &s).unwrap_err();
        assert!(e.contains("does not follow the nice"), "{e}");
        let nices = std::fs::read_to_string(dir.path().join("nice")).unwrap();
        assert!(nices.ends_with("update JobId=21 Nice=0\n"), "{nices}");
        // b is not taken when the first in Slurm's order pairs as well: nothing is raised.
        assert_eq!(
            decide(
                &[queued(1, 0, 5, Some("b"), true), queued(2, 0, 4, Some("b"), true)],
                8,
                |p| { node.lock().unwrap().steer(p).map_err(|e| e.to_string()) }
            )
            .unwrap(),
            None
        );
    }
}
