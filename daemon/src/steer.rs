//! Queue-level choice: when a slot of this node frees (or stays free after a decline), the
//! pending multiplexed job that pairs best with what runs here, among the first `lookahead`
//! of Slurm's own priority order, is the one Slurm starts next.
//!
//! Slurm's own mechanisms only, never a second scheduler: the daemon reads the pending jobs
//! of the shared partition with `squeue` (in priority order, with slurmctld's tag that names
//! each job's application), asks [`Node::steer`] which one to start first, and lowers that
//! job's `Nice` with `scontrol update` just enough to put it first. Slurm's next pass starts
//! it; with every other node busy, on the slot that freed here. Those of the first jobs this
//! node would decline now it defers (`[steer] defer`): their `StartTime` is set `hold_s` ahead,
//! renewed while this node would still decline them, and set to now once it would take them.
//! A decline that costs no launch, no prolog and no requeue. With `[steer] close`, a node that
//! would not take the job Slurm starts next (after its own raise, if any) on its free slot, or,
//! when full, on whichever slot frees first, closes itself to Slurm instead (a reservation
//! `multiplex-<node>` of itself, for root, with `IGNORE_JOBS`), renews that while it lasts, and
//! deletes it as soon as it would take that job (after raising it): a node that would refuse
//! every newcomer is not offered them one by one to decline each.
//!
//! Bounds (fail-open):
//! - only among the first `lookahead` jobs of Slurm's order, so fair-share, QOS and limits keep
//!   their meaning, and no job is passed over more than [`crate::placement::Bypasses::MAX`]
//!   times by this node;
//! - the raised priority is taken back (the job's own `Nice` restored) as soon as the job has
//!   started, was requeued, or after `hold_s`, whichever comes first, and when the daemon
//!   stops; a daemon killed outright leaves at most the jobs it raised at the front of the
//!   queue, which start at the next free slot; a deferral or a closure lapses by itself after
//!   `hold_s` unless renewed, and the daemon takes back its deferrals and its closure when it
//!   stops (and deletes a closure left from before when it starts);
//! - everything runs on a thread of its own: a slow or absent slurmctld delays steering, never
//!   a request, and with the daemon down Slurm's order is simply its own.

use crate::background::Trouble;
pub use crate::config::SteerConfig;
use crate::node::{Node, PendingJob};
use crate::placement;
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
/// How often the queue is looked at while a deferral is due for renewal, and how often the
/// daemon looks for an anticipated start ([`anticipate`]).
const DUE_EVERY: Duration = Duration::from_millis(250);
/// The longest the jobs deferred in anticipation of a start wait for the daemon to hear of it
/// (the job started elsewhere, or not at all): then they are taken back all the same.
const SEEN_WITHIN: Duration = Duration::from_secs(15);

/// A pending job of the shared partition, as squeue lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    pub job_id: u32,
    pub nice: i64,
    pub priority: u64,
    /// Slurm would start it now if a slot were free (it waits for `Priority` or `Resources`,
    /// not for its begin time, a hold, a dependency or a limit).
    pub startable: bool,
    /// It waits for its begin time (`StartTime`), which a deferral sets.
    pub begin_time: bool,
    /// Slurm may requeue it (not `--no-requeue`): a decline sends it back to wait rather than
    /// failing it.
    pub requeue: bool,
    /// The application and memory slurmctld's tag names; `None`: not a multiplexed job.
    pub spec: Option<Spec>,
}

impl Queued {
    /// The job as steering weighs it; `None`: not a multiplexed job.
    fn pending(&self) -> Option<PendingJob<'_>> {
        let spec = self.spec.as_ref()?;
        Some(PendingJob {
            job_id: self.job_id,
            app: spec.app.as_deref().unwrap_or_default(),
            mem_mb: spec.mem_mb,
        })
    }
}

/// The fields asked of squeue, `|`-separated, the admin comment (which may hold `|`) last.
const FORMAT: &str = "JobID:0|,Nice:0|,PriorityLong:0|,Reason:0|,Requeue:0|,admin_comment:0";

/// Reads squeue's lines of [`FORMAT`]. Lines that are not one job (a pending array's
/// `123_[4-9]`) are skipped: Slurm starts such tasks as jobs of their own first.
pub fn parse_queued(out: &str) -> Result<Vec<Queued>, String> {
    let mut jobs = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.splitn(6, '|').collect();
        if f.len() < 6 {
            return Err(format!("squeue printed {line:?}, not 6 fields"));
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
        let startable = waits_for_a_slot(f[3].trim());
        let begin_time = f[3].trim() == "BeginTime";
        let requeue = f[4].trim() != "0";
        let comment = f[5].trim();
        let spec = match Spec::from_tag((comment != "(null)").then_some(comment)) {
            Some(Ok(spec)) if spec.app.is_some() => Some(spec),
            _ => None,
        };
        jobs.push(Queued {
            job_id,
            nice,
            priority,
            startable,
            begin_time,
            requeue,
            spec,
        });
    }
    Ok(jobs)
}

/// Whether a pending job's Slurm reason says it waits only for its turn or for a slot: also
/// `ReqNodeNotAvail, May be reserved for other job`, which Slurm 24.11 gives while every node
/// with a free slot is closed (reserved).
fn waits_for_a_slot(reason: &str) -> bool {
    matches!(reason, "Priority" | "Resources" | "None") || reason.starts_with("ReqNodeNotAvail")
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

/// What one look at the queue decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decided {
    /// The job to start first, if not Slurm's first.
    pub raise: Option<Raise>,
    /// Jobs to defer (or to keep deferred): this node would decline them now.
    pub defer: Vec<u32>,
    /// Jobs this node deferred that it would take now: their deferral is taken back.
    pub lift: Vec<u32>,
    /// This node would not take the job Slurm starts next (there is at least one candidate,
    /// and the raise is in): it closes itself to Slurm, or stays closed.
    pub close: bool,
    /// The job Slurm starts next, when this node would take it (and so stays open).
    pub open_for: Option<u32>,
}

/// What to do with the queue. The candidates are the first `lookahead` multiplexed jobs of
/// `queued` (in Slurm's order) that Slurm could start now, or that wait only for a begin time:
/// a deferral of this node's (`ours`), or with `close`, any (a job waiting out a decline comes
/// back to whichever node is open). They go to `choose`, which answers as [`Node::steer`]
/// does. Only a job Slurm could start now is raised, and only above the first such job not
/// deferred; only this node's own deferrals are taken back.
pub fn decide(
    queued: &[Queued],
    lookahead: usize,
    ours: &HashMap<u32, Instant>,
    close: bool,
    choose: impl FnOnce(&[PendingJob]) -> Result<placement::Steering, String>,
) -> Result<Decided, String> {
    let first: Vec<&Queued> = queued
        .iter()
        .filter(|q| q.spec.is_some() && (q.startable || (q.begin_time && (close || ours.contains_key(&q.job_id)))))
        .take(lookahead)
        .collect();
    if first.is_empty() {
        return Ok(Decided::default());
    }
    let pending: Vec<PendingJob> = first.iter().filter_map(|q| q.pending()).collect();
    let steering = choose(&pending)?;
    let defer: Vec<u32> = steering
        .defer
        .iter()
        .filter_map(|&i| first.get(i).map(|q| q.job_id))
        .collect();
    let lift = steering
        .take
        .iter()
        .filter_map(|&i| {
            first
                .get(i)
                .filter(|q| q.begin_time && ours.contains_key(&q.job_id))
                .map(|q| q.job_id)
        })
        .collect();
    // Slurm's first of those it could start now that are not deferred.
    let top = first.iter().position(|q| q.startable && !defer.contains(&q.job_id));
    let raise = match (top, steering.raise) {
        (Some(t), Some(i)) if i > t && i < first.len() && first[i].startable => raise(first[t], first[i]),
        _ => None,
    };
    // The job Slurm starts next, once the raise is in: the node stays open only for it, and
    // for one that cannot be requeued (a decline fails it, with the reason, as without
    // closing; a node closed to it would hold it back for good). With none startable now, it
    // is the first waiting out a begin time that is not deferred again: a node that would take
    // a declined job back when its wait ends does not close to it meanwhile.
    let next = if raise.is_some() {
        steering.raise
    } else {
        top.or_else(|| first.iter().position(|q| !defer.contains(&q.job_id)))
    };
    let open_for = |n: usize| steering.take.contains(&n) || first.get(n).is_some_and(|q| !q.requeue);
    Ok(Decided {
        raise,
        defer,
        lift,
        close: close && !next.is_some_and(open_for),
        open_for: next.filter(|&n| steering.take.contains(&n)).map(|n| first[n].job_id),
    })
}

/// The nice that puts `job` before `top`, Slurm's first, if Slurm allows one.
fn raise(top: &Queued, job: &Queued) -> Option<Raise> {
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
        return None;
    }
    Some(Raise {
        job_id: job.job_id,
        nice,
        own_nice: job.nice,
        before: top.job_id,
    })
}

/// The jobs to defer while this node opens for `next` (`[steer] anticipate`), if Slurm could
/// start `next` now: Slurm's pass that starts it here offers the slot still free after it to
/// the multiplexed jobs behind it that Slurm could start now (and to `lifting`, deferrals
/// about to be taken back), one after another, before the daemon hears of the start. Of the first `cap` of them, `declines`
/// (as [`Node::declines_after`], given the jobs with `next` first) names those this node would
/// decline then, up to the first it would take.
pub fn anticipate(
    queued: &[Queued],
    next: u32,
    cap: usize,
    lifting: &[u32],
    declines: impl FnOnce(&[PendingJob], &[usize]) -> Result<Vec<usize>, String>,
) -> Result<Vec<u32>, String> {
    let startable = |q: &Queued| q.startable || lifting.contains(&q.job_id);
    let Some(head) = queued
        .iter()
        .find(|q| q.job_id == next && q.spec.is_some() && startable(q))
    else {
        return Ok(Vec::new());
    };
    let after = queued
        .iter()
        .filter(|q| q.job_id != next && q.spec.is_some() && startable(q))
        .take(cap);
    let offered: Vec<&Queued> = std::iter::once(head).chain(after).collect();
    if offered.len() < 2 {
        return Ok(Vec::new());
    }
    let pending: Vec<PendingJob> = offered.iter().filter_map(|q| q.pending()).collect();
    let later: Vec<usize> = (1..offered.len()).collect();
    Ok(declines(&pending, &later)?
        .into_iter()
        .filter_map(|i| offered.get(i).filter(|_| i >= 1).map(|q| q.job_id))
        .collect())
}

/// Sets a pending job's begin time: `at` is Slurm's time spec (`now`, `now+60`).
fn set_start(scontrol: &Path, job_id: u32, at: &str) -> Result<(), String> {
    set_starts(scontrol, &[job_id], at)
}

/// [`set_start`] for several jobs in one call (scontrol takes a list of job ids and sends one
/// update per job; a job that started or left meanwhile fails alone, and scontrol says so).
fn set_starts(scontrol: &Path, job_ids: &[u32], at: &str) -> Result<(), String> {
    let ids: Vec<String> = job_ids.iter().map(u32::to_string).collect();
    let args = [
        "update".to_string(),
        format!("JobId={}", ids.join(",")),
        format!("StartTime={at}"),
    ];
    crate::command::run(scontrol, &args, CALL_TIMEOUT).map(|_| ())
}

/// Jobs deferred while this node opened for one ([`anticipate`]), until its daemon hears of
/// that job's start.
#[derive(Debug, Clone, PartialEq)]
struct Anticipation {
    for_job: u32,
    jobs: Vec<u32>,
    since: Instant,
}

/// Takes back the deferrals of `jobs` at once; one by one if the list fails (one of them
/// started or left meanwhile). What still fails lapses by itself after `hold_s`.
fn lift_jobs(s: &Steering, jobs: &[u32]) {
    if jobs.is_empty() || set_starts(&s.scontrol, jobs, "now").is_ok() {
        return;
    }
    for &id in jobs {
        if let Err(e) = set_start(&s.scontrol, id, "now") {
            tracing::debug!(job = id, error = %e, "did not take back a deferral; it lapses by itself");
        }
    }
}

fn set_nice(scontrol: &Path, job_id: u32, nice: i64) -> Result<(), String> {
    let args = ["update".to_string(), format!("JobId={job_id}"), format!("Nice={nice}")];
    crate::command::run(scontrol, &args, CALL_TIMEOUT).map(|_| ())
}

/// The name of the reservation that closes `node` to Slurm.
fn closure_name(node: &str) -> String {
    format!("multiplex-{node}")
}

/// Closes `node` to Slurm for `hold_s` seconds from now: a reservation of the node for root
/// that no job asks for, so Slurm starts nothing new there until it lapses or is deleted;
/// jobs running there run on (`IGNORE_JOBS`). An ended reservation of the same name that
/// slurmctld still keeps is deleted first.
fn close_node(scontrol: &Path, node: &str, hold_s: u64) -> Result<(), String> {
    let name = closure_name(node);
    let create = [
        "create".to_string(),
        "reservation".to_string(),
        format!("ReservationName={name}"),
        format!("Nodes={node}"),
        "StartTime=now".to_string(),
        format!("EndTime=now+{hold_s}"),
        "Users=root".to_string(),
        "Flags=IGNORE_JOBS".to_string(),
    ];
    match crate::command::run(scontrol, &create, CALL_TIMEOUT) {
        Err(e) if e.contains("Duplicate reservation name") => {
            open_node(scontrol, node)?;
            crate::command::run(scontrol, &create, CALL_TIMEOUT).map(|_| ())
        }
        other => other.map(|_| ()),
    }
}

/// Keeps `node` closed `hold_s` seconds from now; a closure that lapsed meanwhile is made anew.
fn renew_closure(scontrol: &Path, node: &str, hold_s: u64) -> Result<(), String> {
    let args = [
        "update".to_string(),
        format!("ReservationName={}", closure_name(node)),
        format!("EndTime=now+{hold_s}"),
    ];
    match crate::command::run(scontrol, &args, CALL_TIMEOUT) {
        Ok(_) => Ok(()),
        Err(_) => close_node(scontrol, node, hold_s),
    }
}

/// Opens `node` to Slurm again: deletes its closure. One that is gone already is fine.
fn open_node(scontrol: &Path, node: &str) -> Result<(), String> {
    let args = ["delete".to_string(), format!("ReservationName={}", closure_name(node))];
    match crate::command::run(scontrol, &args, CALL_TIMEOUT) {
        Err(e) if e.contains("reservation is invalid") => Ok(()),
        other => other.map(|_| ()),
    }
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
    /// Jobs this node declined, and when their wait ends.
    declined: Vec<(u32, Instant)>,
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

    /// The node declined `job_id`, which Slurm holds back for `wait_s`: watched from then on
    /// like a deferral of this node's, renewed or taken back before it lapses. Cheap: call it
    /// from the node's decline listener, inside requests.
    pub fn declined(&self, job_id: u32, wait_s: u32) {
        let (lock, cv) = &*self.0;
        let until = Instant::now() + Duration::from_secs(u64::from(wait_s));
        lock.lock()
            .unwrap_or_else(|p| p.into_inner())
            .declined
            .push((job_id, until));
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
    /// This node's name in Slurm.
    pub node: String,
    pub squeue: PathBuf,
    pub scontrol: PathBuf,
    /// sinfo, to see which nodes Slurm offers pending jobs first ([`offered_first`]).
    pub sinfo: PathBuf,
}

/// The sinfo beside `squeue` (the same installation), or the one on PATH.
pub fn sinfo_beside(squeue: &Path) -> PathBuf {
    match squeue.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => dir.join("sinfo"),
        None => PathBuf::from("sinfo"),
    }
}

/// The fields asked of sinfo, one line per node.
const NODES: &str = "NodeList:|,Weight:|,Gres:";
/// The fields asked of squeue for the jobs holding shards.
const HOLDING: &str = "NodeList:|,tres-per-node:";

/// Whether `node` (which has a free slot) is among the nodes of `partition` that Slurm offers
/// pending jobs first: of those with a free shard, the ones of the lightest weight (LLN picks
/// among them). Only such a node defers a job: a deferral holds the job back from every
/// node, and a lighter node with a free slot would have been offered it first. The shards in
/// use are counted from the jobs that hold them (sinfo's GresUsed undercounts shards on
/// Slurm 22.05).
pub fn offered_first(sinfo: &Path, squeue: &Path, partition: &str, node: &str) -> Result<bool, String> {
    let nodes = [
        "--noheader".to_string(),
        "--Node".to_string(),
        format!("--partition={partition}"),
        format!("--Format={NODES}"),
    ];
    let jobs = [
        "--noheader".to_string(),
        "--states=RUNNING,CONFIGURING,COMPLETING".to_string(),
        format!("--partition={partition}"),
        format!("--Format={HOLDING}"),
    ];
    parse_offered_first(
        &crate::command::run(sinfo, &nodes, CALL_TIMEOUT)?,
        &crate::command::run(squeue, &jobs, CALL_TIMEOUT)?,
        node,
    )
}

/// [`offered_first`] from sinfo's lines of [`NODES`] and squeue's of [`HOLDING`].
pub fn parse_offered_first(nodes: &str, jobs: &str, node: &str) -> Result<bool, String> {
    let mut used: HashMap<&str, u64> = HashMap::new();
    for line in jobs.lines().filter(|l| !l.trim().is_empty()) {
        let Some((name, tres)) = line.split_once('|') else {
            return Err(format!("squeue printed {line:?}, not 2 fields"));
        };
        // `gres:shard:1` (22.05) or `gres/shard:1` (24.11).
        let tres = tres.trim().replace("gres/", "").replace("gres:", "").replace('=', ":");
        *used.entry(name.trim()).or_default() += gres_count(&tres, "shard");
    }
    let mut free: Vec<(&str, u64)> = Vec::new();
    for line in nodes.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('|').map(str::trim).collect();
        let [name, weight, gres, ..] = f[..] else {
            return Err(format!("sinfo printed {line:?}, not 3 fields"));
        };
        let weight = weight
            .parse::<u64>()
            .map_err(|_| format!("sinfo printed {weight:?} where node {name}'s weight belongs"))?;
        // This node has a free slot (steering defers only then), even while Slurm still
        // counts the shard of a job that is just leaving it.
        if name == node || gres_count(gres, "shard") > used.get(name).copied().unwrap_or(0) {
            free.push((name, weight));
        }
    }
    let lightest = free.iter().map(|(_, w)| *w).min();
    Ok(free.iter().any(|(n, w)| *n == node && Some(*w) == lightest))
}

/// How many of gres `name` a sinfo Gres or GresUsed field counts: `gpu:2,shard:4`,
/// `gpu:0,shard:(null):3(IDX:0,2)`, `shard:v100:4(S:0)`.
fn gres_count(field: &str, name: &str) -> u64 {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in field.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&field[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&field[start..]);
    items
        .iter()
        .filter_map(|item| {
            // Drop a trailing `(...)`: the indexes or sockets.
            let item = match item.strip_suffix(')').and_then(|_| item.rfind('(')) {
                Some(open) if open > 0 => &item[..open],
                _ => item,
            };
            let mut parts = item.split(':');
            (parts.next() == Some(name)).then(|| parts.next_back().and_then(|n| n.parse::<u64>().ok()))?
        })
        .sum()
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
    // The jobs this node deferred, to when their deferral lapses.
    let mut deferred: HashMap<u32, Instant> = HashMap::new();
    // Until when this node is closed to Slurm, while it is.
    let mut closed: Option<Instant> = None;
    // The jobs deferred while this node opened for one, until the daemon hears of its start.
    let mut anticipation: Option<Anticipation> = None;
    // A slot freed while the daemon waited to hear of an anticipated start.
    let mut owed_free = false;
    if s.config.close {
        // A closure left by a daemon that died lapses by itself; this one starts open.
        if let Err(e) = open_node(&s.scontrol, &s.node) {
            tracing::warn!(error = %e, "cannot delete a closure of this node left from before; it lapses by itself");
        }
    }
    // The node was full at the last look (with `close`, a full node is looked at now and
    // then: it is closed before a slot frees if it would decline the first jobs then).
    let mut full = false;
    // The job the last anticipation was for ([`Looking::anticipated_for`]).
    let mut anticipated_for: Option<u32> = None;
    let mut trouble = Trouble::default();
    let hold = Duration::from_secs(s.config.hold_s);
    // A deferral is renewed this long before it lapses (if this node would still decline the
    // job), so that Slurm never sees it lapse in between.
    let renew_before = (hold / 4).max(HOUSEKEEPING);
    let look_every = Duration::from_millis(s.config.look_ms);
    let mut last_look = Instant::now();
    loop {
        let (free, stop) = {
            let mut sig = lock.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                for (id, until) in std::mem::take(&mut sig.declined) {
                    if deferred.len() < s.config.lookahead || deferred.contains_key(&id) {
                        deferred.insert(id, until);
                    }
                }
                if sig.free || sig.stop {
                    break;
                }
                // With `close`, the node looks at the queue every `look_ms` whatever its
                // state: closed or full, a job it would take opens it; open with a free slot,
                // a job coming back from a wait (a decline, a failure, another node's
                // deferral) that it would decline closes it before Slurm offers it the job.
                if raised.is_empty()
                    && deferred.is_empty()
                    && closed.is_none()
                    && !s.config.close
                    && anticipation.is_none()
                {
                    sig = cv.wait(sig).unwrap_or_else(|p| p.into_inner());
                } else {
                    // A deferral due for renewal is looked at often: a job this node declined
                    // may wait only seconds once it is back in the queue.
                    let now = Instant::now();
                    let due = deferred
                        .values()
                        .any(|u| u.saturating_duration_since(now) <= renew_before);
                    let every = if due || anticipation.is_some() {
                        DUE_EVERY
                    } else if raised.is_empty() && deferred.is_empty() {
                        // With `[steer] close`: a job that arrived, or moved up the queue,
                        // and that this node would take opens it within `look_ms`; one it
                        // would decline closes it.
                        look_every
                    } else {
                        HOUSEKEEPING
                    };
                    let (g, t) = cv.wait_timeout(sig, every).unwrap_or_else(|p| p.into_inner());
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
            if let Some(a) = anticipation.take() {
                lift_jobs(s, &a.jobs);
            }
            lift_all(s, &mut deferred);
            if closed.take().is_some() {
                match open_node(&s.scontrol, &s.node) {
                    Ok(()) => tracing::info!("opened: the daemon stops"),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot open this node as the daemon stops; its closure lapses by itself")
                    }
                }
            }
            return;
        }
        let now = Instant::now();
        deferred.retain(|_, until| *until > now);
        closed = closed.filter(|until| *until > now);
        let renew = deferred
            .values()
            .any(|until| until.saturating_duration_since(now) <= renew_before);
        // An anticipated start: nothing is steered until the daemon heard of it (the node's
        // view lacks the job until then), and then its deferrals are taken back, once this look
        // at the queue has closed the node if it must.
        let seen = anticipation.as_ref().is_some_and(|a| {
            a.since.elapsed() >= SEEN_WITHIN
                || node
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .runs(a.for_job)
                    .unwrap_or(true)
        });
        if anticipation.is_some() && !seen {
            owed_free |= free;
            continue;
        }
        let free = free || std::mem::take(&mut owed_free);
        let lifting = if seen { anticipation.take() } else { None };
        let lifting_ids: &[u32] = lifting.as_ref().map_or(&[], |a| &a.jobs);
        if let Some(a) = &lifting {
            anticipated_for = Some(a.for_job);
        }
        // Closed or full, the node looks at every wake, as before; open, at most every
        // `look_ms` (a wake for a raise given back or a deferral due needs no squeue).
        let periodic = s.config.close && (closed.is_some() || full || last_look.elapsed() >= look_every);
        if free || renew || periodic || seen {
            last_look = Instant::now();
            let looked = steer_once(
                node,
                s,
                Looking {
                    deferred: &mut deferred,
                    closed: &mut closed,
                    full: &mut full,
                    anticipation: &mut anticipation,
                    lifting: lifting_ids,
                    anticipated_for,
                },
                renew_before,
            );
            match looked {
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
        if let Some(old) = lifting {
            let again: &[u32] = anticipation.as_ref().map_or(&[], |a| &a.jobs);
            let lift: Vec<u32> = old.jobs.into_iter().filter(|id| !again.contains(id)).collect();
            tracing::info!(
                job = old.for_job,
                jobs = ?lift,
                waited_ms = old.since.elapsed().as_millis() as u64,
                "anticipated start seen (or waited for long enough): deferrals taken back"
            );
            lift_jobs(s, &lift);
        }
        if !raised.is_empty() {
            give_back(s, &mut raised, Some(hold));
        }
    }
}

/// What one look at the queue reads and changes of the steering thread's state.
struct Looking<'a> {
    deferred: &'a mut HashMap<u32, Instant>,
    closed: &'a mut Option<Instant>,
    full: &'a mut bool,
    anticipation: &'a mut Option<Anticipation>,
    /// Jobs deferred in anticipation whose deferral is taken back after this look.
    lifting: &'a [u32],
    /// The job the last anticipation was for: it is not anticipated again (a job Slurm could
    /// start but does not, waiting on something else, would hold the jobs behind it back at
    /// every look).
    anticipated_for: Option<u32>,
}

/// Defers the jobs this node would decline once `next` runs here ([`anticipate`]), in one
/// call, before the node opens for `next`. Recorded even if scontrol says some failed (a job
/// that started meanwhile): the rest were deferred and are taken back all the same. Called
/// only with no anticipation outstanding: the thread looks at the queue again only once the
/// last one was seen, and takes it.
fn anticipate_for(
    node: &Mutex<Node>,
    s: &Steering,
    queued: &[Queued],
    next: u32,
    lifting: &[u32],
    anticipation: &mut Option<Anticipation>,
) {
    let jobs = anticipate(queued, next, s.config.anticipate, lifting, |pending, later| {
        let mut node = node.lock().unwrap_or_else(|p| p.into_inner());
        node.declines_after(pending, 0, later).map_err(|e| e.to_string())
    });
    let jobs = match jobs {
        Ok(jobs) if jobs.is_empty() => return,
        Ok(jobs) => jobs,
        Err(e) => {
            tracing::warn!(job = next, error = %e, "cannot weigh the jobs after the next one; none deferred");
            return;
        }
    };
    let hold_s = s.config.hold_s;
    match set_starts(&s.scontrol, &jobs, &format!("now+{hold_s}")) {
        Ok(()) => tracing::info!(
            job = next,
            deferred = ?jobs,
            hold_s,
            "anticipated: deferred the jobs this node would decline once the job it opens for runs here"
        ),
        Err(e) => {
            tracing::warn!(job = next, deferred = ?jobs, error = %e, "could not defer all the jobs this node would decline after the next one")
        }
    }
    *anticipation = Some(Anticipation {
        for_job: next,
        jobs,
        since: Instant::now(),
    });
}

/// Deferred first and checked after: slurmctld starts a job within moments of a slot freeing
/// (Slurm 24.11 did, before a check ahead of the deferral was done). A deferral holds the job
/// back from every node, so unless this node is among those Slurm offers jobs first, its
/// deferrals among `defer` are taken back at once: the jobs would wait for nothing.
fn keep_deferrals_if_first(s: &Steering, defer: &[u32], deferred: &mut HashMap<u32, Instant>, renew_before: Duration) {
    let now = Instant::now();
    let fresh: Vec<u32> = defer
        .iter()
        .copied()
        .filter(|id| {
            deferred
                .get(id)
                .is_some_and(|until| until.saturating_duration_since(now) > renew_before)
        })
        .collect();
    if fresh.is_empty() {
        return;
    }
    let first = offered_first(&s.sinfo, &s.squeue, &s.config.partition, &s.node);
    if let Err(e) = &first {
        tracing::warn!(error = %e, "cannot tell which nodes Slurm offers jobs first; deferring none");
    }
    if !matches!(first, Ok(true)) {
        tracing::debug!(jobs = ?fresh, "another node is offered pending jobs first: taking the deferrals back");
        for id in fresh {
            if let Err(e) = set_start(&s.scontrol, id, "now") {
                tracing::debug!(job = id, error = %e, "did not take back a deferral; it lapses by itself");
            }
            deferred.remove(&id);
        }
    }
}

/// One look at the queue: defers the jobs this node would decline now (or renews their
/// deferral when it lapses within `renew_before`), takes back the deferrals of those it would
/// take now, and raises the job to start next here, if not Slurm's first.
fn steer_once(
    node: &Mutex<Node>,
    s: &Steering,
    look: Looking,
    renew_before: Duration,
) -> Result<Option<Raise>, String> {
    let Looking {
        deferred,
        closed,
        full,
        anticipation,
        lifting,
        anticipated_for,
    } = look;
    let queued = pending_jobs(&s.squeue, &s.config.partition)?;
    // The slot may have been taken since the poke: with no slot free, nothing is steered and
    // no job needs deferring. A full node that would decline the job Slurm starts next
    // whichever of its jobs ends is closed now: Slurm may start that job on the freed slot
    // before slurmstepd tells the daemon of the end (seen on 24.11).
    let room = {
        let load = node.lock().unwrap_or_else(|p| p.into_inner()).load();
        let load = load.map_err(|e| e.to_string())?;
        load.total.saturating_sub(load.used)
    };
    *full = room == 0;
    let is_full = *full;
    let decided = decide(&queued, s.config.lookahead, deferred, s.config.close, |pending| {
        let mut node = node.lock().unwrap_or_else(|p| p.into_inner());
        if is_full {
            let take = if s.config.close {
                node.takes_after_an_end(pending).map_err(|e| e.to_string())?
            } else {
                Vec::new()
            };
            return Ok(placement::Steering {
                take,
                ..Default::default()
            });
        }
        let mut steering = node.steer(pending).map_err(|e| e.to_string())?;
        if !s.config.defer {
            steering.defer.clear();
        }
        Ok(steering)
    })?;
    // A job this node declined that Slurm does not list yet (on its way back to the queue)
    // is weighed once it is listed; until then a closed node is not opened for want of
    // candidates.
    let listed: std::collections::HashSet<u32> = queued.iter().map(|q| q.job_id).collect();
    let in_transit = s.config.close && deferred.keys().any(|id| !listed.contains(id));
    tracing::debug!(
        pending = queued.len(),
        full = *full,
        in_transit,
        close = decided.close,
        raise = ?decided.raise.as_ref().map(|r| r.job_id),
        "looked at the queue"
    );
    let now = Instant::now();
    // A node closes before anything else is done, so that Slurm does not start a job here
    // meanwhile; it opens only after the raise below, so that Slurm starts the raised job.
    if s.config.close && decided.close {
        set_closure(s, closed, true, renew_before);
    }
    let leave_closed = in_transit && closed.is_some();
    for &id in &decided.defer {
        if deferred
            .get(&id)
            .is_some_and(|until| until.saturating_duration_since(now) > renew_before)
        {
            continue;
        }
        // At most `lookahead` deferred at a time: a node that would decline most of the
        // queue does not walk through it deferring every job.
        if !deferred.contains_key(&id) && deferred.len() >= s.config.lookahead {
            continue;
        }
        match set_start(&s.scontrol, id, &format!("now+{}", s.config.hold_s)) {
            Ok(()) => {
                let hold_s = s.config.hold_s;
                if deferred.insert(id, now + Duration::from_secs(hold_s)).is_some() {
                    tracing::debug!(
                        job = id,
                        hold_s,
                        "deferral renewed: this node would still decline the job"
                    );
                } else {
                    tracing::info!(job = id, hold_s, "deferred: this node would decline the job now");
                }
            }
            Err(e) => {
                tracing::warn!(job = id, error = %e, "cannot defer a pending job; Slurm may start it here to be declined")
            }
        }
    }
    for &id in &decided.lift {
        match set_start(&s.scontrol, id, "now") {
            Ok(()) => {
                tracing::info!(job = id, "deferral taken back: this node would take the job now");
                deferred.remove(&id);
            }
            // It started or ended meanwhile, most likely; a deferral lapses by itself anyway.
            Err(e) => {
                tracing::debug!(job = id, error = %e, "did not take back a deferral; it lapses by itself");
                deferred.remove(&id);
            }
        }
    }
    // Those due for renewal that Slurm lists as pending but that were not renewed (behind the
    // first `lookahead`) lapse by themselves; those it does not list yet (a declined job on
    // its way back to the queue) are looked at again soon.
    deferred.retain(|id, until| {
        decided.defer.contains(id) || !listed.contains(id) || until.saturating_duration_since(now) > renew_before
    });
    // The raise goes out before the check, which takes two more calls to Slurm.
    let raised = raise_now(s, decided.raise);
    // Before the node opens: Slurm may start the next job at once, and offer the slot still
    // free after it to the jobs behind it in the same pass.
    if let Some(next) = decided
        .open_for
        .filter(|_| s.config.close && s.config.anticipate > 0 && !decided.close && !leave_closed && room >= 1)
        .filter(|&n| anticipated_for != Some(n))
    {
        anticipate_for(node, s, &queued, next, lifting, anticipation);
    }
    if s.config.close && !decided.close && !leave_closed {
        set_closure(s, closed, false, renew_before);
    }
    keep_deferrals_if_first(s, &decided.defer, deferred, renew_before);
    raised
}

/// Closes this node to Slurm (`close`: it would decline the job Slurm starts next), keeps it
/// closed (renewed when its closure lapses within `renew_before`), or opens it. A failure
/// leaves the node as it was, and says so: a closure lapses by itself.
fn set_closure(s: &Steering, closed: &mut Option<Instant>, close: bool, renew_before: Duration) {
    let now = Instant::now();
    let hold_s = s.config.hold_s;
    match (close, *closed) {
        (true, Some(until)) if until.saturating_duration_since(now) > renew_before => {}
        (true, Some(_)) => match renew_closure(&s.scontrol, &s.node, hold_s) {
            Ok(()) => {
                tracing::debug!(
                    hold_s,
                    "closure renewed: this node would still decline the job Slurm starts next"
                );
                *closed = Some(now + Duration::from_secs(hold_s));
            }
            Err(e) => tracing::warn!(error = %e, "cannot renew this node's closure; it lapses by itself"),
        },
        (true, None) => match close_node(&s.scontrol, &s.node, hold_s) {
            Ok(()) => {
                tracing::info!(
                    hold_s,
                    reservation = %closure_name(&s.node),
                    "closed: this node would decline the job Slurm starts next"
                );
                *closed = Some(now + Duration::from_secs(hold_s));
            }
            Err(e) => tracing::warn!(error = %e, "cannot close this node; Slurm may start jobs here to be declined"),
        },
        (false, Some(_)) => match open_node(&s.scontrol, &s.node) {
            Ok(()) => {
                tracing::info!("opened: this node would take the job Slurm starts next, or none is pending");
                *closed = None;
            }
            Err(e) => tracing::warn!(error = %e, "cannot open this node; its closure lapses by itself"),
        },
        (false, None) => {}
    }
}

/// Lowers the nice of the job to raise, checks that Slurm put it first, and lowers it further
/// if need be.
fn raise_now(s: &Steering, raise: Option<Raise>) -> Result<Option<Raise>, String> {
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
        let waiting = state == "PENDING" && waits_for_a_slot(reason);
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

/// The daemon stops: every deferral it set that has not lapsed is taken back, so no job
/// waits for a daemon that no longer looks. A job that started or left meanwhile is refused
/// by scontrol, which is fine.
fn lift_all(s: &Steering, deferred: &mut HashMap<u32, Instant>) {
    let now = Instant::now();
    for (id, until) in deferred.drain() {
        if until > now {
            if let Err(e) = set_start(&s.scontrol, id, "now") {
                tracing::debug!(job = id, error = %e, "did not take back a deferral");
                // slurmctld may be stopping too: the rest lapse by themselves rather than
                // hold the daemon's exit for a timeout each.
                if e.contains("did not finish within") || e.contains("Unable to contact") {
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_lines_are_read_with_the_tag_and_whether_slurm_could_start_the_job() {
        let out = "41|0|4294901760|Resources|1|multiplex:app=a\n\
                   42|5|4294901755|Priority|1|multiplex:app=b,mem=2G | multiplex: requeued, waiting 60 s: x | y\n\
                   43|0|4294901754|BeginTime|1|multiplex:app=c\n\
                   44_[1-3]|0|4294901753|Priority|1|multiplex:app=d\n\
                   45|0|4294901752|Priority|1|(null)\n\
                   46|0|4294901751|Priority|1|multiplex:app=../x\n\
                   47|0|4294901750|ReqNodeNotAvail, May be reserved for other job|1|multiplex:app=e\n\
                   48|0|4294901749|Dependency|1|multiplex:app=f\n";
        let q = parse_queued(out).unwrap();
        assert_eq!(
            q.iter().map(|j| j.job_id).collect::<Vec<_>>(),
            [41, 42, 43, 45, 46, 47, 48]
        );
        assert!(
            q[5].startable,
            "waits for a node with a free slot: every such node is closed"
        );
        assert!(!q[6].startable);
        assert_eq!((q[1].nice, q[1].priority), (5, 4294901755));
        assert_eq!(q[1].spec.as_ref().unwrap().mem_mb, Some(2048));
        assert!(q[0].startable && q[1].startable && !q[2].startable);
        assert!(q[3].spec.is_none(), "not a multiplexed job");
        assert!(q[4].spec.is_none(), "a tag that does not parse names nothing");
        assert!(parse_queued("41|x|1|Priority|1|").unwrap_err().contains("nice"));
        assert!(parse_queued("41|0\n").unwrap_err().contains("not 6 fields"));
        assert!(q.iter().all(|j| j.requeue));
        assert!(!parse_queued("49|0|1|Priority|0|multiplex:app=g\n").unwrap()[0].requeue);
    }

    fn queued(job_id: u32, nice: i64, priority: u64, app: Option<&str>, startable: bool) -> Queued {
        Queued {
            job_id,
            nice,
            priority,
            startable,
            begin_time: false,
            requeue: true,
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
        let none = HashMap::new();
        let pick = |i: Option<usize>| {
            move |_: &[PendingJob]| {
                Ok(placement::Steering {
                    raise: i,
                    defer: vec![],
                    take: vec![],
                })
            }
        };
        let r = decide(&q, 3, &none, false, |p| {
            seen = p.iter().map(|j| (j.job_id, j.app.to_string())).collect();
            pick(Some(1))(p)
        })
        .unwrap()
        .raise;
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
        let raised = |q: &[Queued], k, i| decide(q, k, &none, false, pick(i)).unwrap().raise;
        assert_eq!(raised(&q, 3, None), None);
        assert_eq!(raised(&q, 3, Some(0)), None, "the first is first already");
        assert_eq!(raised(&q, 3, Some(7)), None, "out of range");
        assert_eq!(raised(&q[..2], 3, Some(1)), None, "one candidate: nothing to choose");
        assert!(decide(&q, 3, &none, false, |_| Err("history".into())).is_err());
        // Priorities at Slurm's floor of 1 (priority/multifactor with no weights): the nice
        // goes below the first's priority whatever the job's own.
        let floor = [queued(1, 0, 1, Some("a"), true), queued(2, 30, 1, Some("b"), true)];
        assert_eq!(raised(&floor, 2, Some(1)).map(|r| r.nice), Some(-2));
        let far = [
            queued(1, 0, u64::MAX, Some("a"), true),
            queued(2, 0, 5, Some("b"), true),
        ];
        assert_eq!(raised(&far, 2, Some(1)), None, "beyond Slurm's nice");
    }

    #[test]
    fn jobs_this_node_would_decline_are_deferred_and_its_own_deferrals_taken_back_when_it_would_take_them() {
        let mut q = [
            queued(1, 0, 100, Some("a"), true),
            queued(2, 0, 99, Some("b"), false),
            queued(3, 0, 98, Some("c"), false),
            queued(4, 0, 97, Some("d"), true),
        ];
        // 2 and 3 wait for a begin time: 2 for this node's deferral, 3 for someone else's.
        q[1].begin_time = true;
        q[2].begin_time = true;
        let ours = HashMap::from([(2, Instant::now())]);
        let mut seen = Vec::new();
        let d = decide(&q, 8, &ours, false, |p| {
            seen = p.iter().map(|j| j.job_id).collect();
            // This node would decline 1 (Slurm's first) and 4, and take 2 now.
            Ok(placement::Steering {
                raise: Some(1),
                defer: vec![0, 2],
                take: vec![1],
            })
        })
        .unwrap();
        assert_eq!(
            seen,
            [1, 2, 4],
            "its own deferred job is weighed again; another node's is not"
        );
        assert_eq!(d.defer, [1, 4]);
        assert_eq!(d.lift, [2]);
        assert_eq!(d.raise, None, "a job waiting for its begin time is not raised");
        // Still declined: kept deferred, not taken back.
        let d = decide(&q, 8, &ours, false, |_| {
            Ok(placement::Steering {
                raise: None,
                defer: vec![1],
                take: vec![],
            })
        })
        .unwrap();
        assert_eq!((d.defer, d.lift), (vec![2], vec![]));
    }

    /// An executable shell script `dir/name` with `body` after its `#!/bin/sh` line.
    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// A stand-in command that prints `out` and appends its arguments to `dir/calls`.
    fn fake(dir: &Path, name: &str, out: &str) -> PathBuf {
        let body = format!("echo \"{name} $*\" >>{}/calls\nprintf '{out}'\n", dir.display());
        script(dir, name, &body)
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
            node: "n1".into(),
            squeue,
            scontrol: fake(dir.path(), "scontrol", ""),
            sinfo: PathBuf::from("/nonexistent/sinfo"),
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
        import_pairs(&mut node, &[("x", "a", 0.3), ("x", "b", 0.9)]);
        place_x(&mut node, 7, false);
        node
    }

    /// Places job `job_id` of `app` on n1.
    fn place_x_app(node: &mut Node, job_id: u32, app: &str) {
        let placed = node.place(&multiplex_protocol::PlaceRequest::new(job_id, 0, app, "n1"));
        assert!(
            matches!(placed, Ok(multiplex_protocol::Response::Placed(_))),
            "{placed:?}"
        );
    }

    /// Places job `job_id` of `x` on n1 (`cannot_wait`: wherever it fits, whatever the pair).
    fn place_x(node: &mut Node, job_id: u32, cannot_wait: bool) {
        let placed = node.place(&multiplex_protocol::PlaceRequest {
            cannot_wait,
            ..multiplex_protocol::PlaceRequest::new(job_id, 0, "x", "n1")
        });
        assert!(
            matches!(placed, Ok(multiplex_protocol::Response::Placed(_))),
            "{placed:?}"
        );
    }

    /// One look at the queue with nothing anticipated before.
    fn look_once(
        node: &Mutex<Node>,
        s: &Steering,
        deferred: &mut HashMap<u32, Instant>,
        closed: &mut Option<Instant>,
        full: &mut bool,
        renew_before: Duration,
    ) -> Result<Option<Raise>, String> {
        let look = Looking {
            deferred,
            closed,
            full,
            anticipation: &mut None,
            lifting: &[],
            anticipated_for: None,
        };
        steer_once(node, s, look, renew_before)
    }

    /// Steering of n1 with `config`, through these commands (no sinfo).
    fn steering(config: SteerConfig, squeue: PathBuf, scontrol: PathBuf) -> Steering {
        Steering {
            config,
            node: "n1".into(),
            sinfo: PathBuf::from("/nonexistent/sinfo"),
            squeue,
            scontrol,
        }
    }

    #[test]
    fn a_node_that_would_decline_every_startable_job_closes_until_it_would_take_one() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // The queue is what the file `queue` says: `a` alone (startable, or waiting out a
        // decline), then `a` and `b`.
        let squeue = script(
            dir.path(),
            "squeue",
            &format!("case \"$*\" in *PENDING*) cat {d}/queue ;;\n*) printf '20|9\\n21|10\\n' ;; esac\n"),
        );
        // The first create finds an ended closure of the same name that slurmctld still keeps.
        let scontrol = script(
            dir.path(),
            "scontrol",
            &format!(
                "echo \"scontrol $*\" >>{d}/calls\n\
                 case \"$*\" in create*) [ -e {d}/kept ] || {{ touch {d}/kept; echo 'Error creating the reservation: Duplicate reservation name' >&2; exit 1; }} ;; esac\n"
            ),
        );
        let close = SteerConfig {
            lookahead: 8,
            close: true,
            ..SteerConfig::default()
        };
        let s = steering(close, squeue, scontrol);
        let node = Mutex::new(node_beside_x());
        let mut deferred = HashMap::new();
        let mut closed = None;
        let calls = || std::fs::read_to_string(dir.path().join("calls")).unwrap_or_default();
        let queue = |q: &str| std::fs::write(dir.path().join("queue"), q).unwrap();
        let look = |closed: &mut Option<Instant>, deferred: &mut HashMap<u32, Instant>, renew| {
            std::fs::write(dir.path().join("calls"), "").unwrap();
            look_once(&node, &s, deferred, closed, &mut false, renew).unwrap()
        };
        // Only a, which this node would decline beside x: it closes itself.
        queue("20|0|9|Resources|1|multiplex:app=a\n");
        assert_eq!(look(&mut closed, &mut deferred, HOUSEKEEPING), None);
        assert_eq!(
            calls(),
            "scontrol create reservation ReservationName=multiplex-n1 Nodes=n1 StartTime=now EndTime=now+60 Users=root Flags=IGNORE_JOBS\n\
             scontrol delete ReservationName=multiplex-n1\n\
             scontrol create reservation ReservationName=multiplex-n1 Nodes=n1 StartTime=now EndTime=now+60 Users=root Flags=IGNORE_JOBS\n"
        );
        assert!(closed.is_some());
        // a waiting out a decline still counts: the node stays closed, not renewed yet...
        queue("20|0|9|BeginTime|1|multiplex:app=a\n");
        look(&mut closed, &mut deferred, HOUSEKEEPING);
        assert_eq!(calls(), "");
        // ...and renewed once its closure is about to lapse.
        look(&mut closed, &mut deferred, Duration::from_secs(3600));
        assert_eq!(calls(), "scontrol update ReservationName=multiplex-n1 EndTime=now+60\n");
        // b, which pairs well with x, is listed: raised above a first, then the node opens.
        // Should Slurm start b on another node, it would offer this one a next, to be
        // declined: a is deferred before the node opens, until the daemon hears of b.
        queue("20|0|9|Resources|1|multiplex:app=a\n21|0|8|Priority|1|multiplex:app=b\n");
        let r = look(&mut closed, &mut deferred, HOUSEKEEPING).expect("b is raised");
        assert_eq!(r.job_id, 21);
        assert_eq!(
            calls(),
            "scontrol update JobId=21 Nice=-2\nscontrol update JobId=20 StartTime=now+60\n\
             scontrol delete ReservationName=multiplex-n1\n"
        );
        assert_eq!(closed, None);
        // A job this node would take but that waits for its begin time keeps it closed.
        queue("20|0|9|Resources|1|multiplex:app=a\n21|0|8|BeginTime|1|multiplex:app=b\n");
        look(&mut closed, &mut deferred, HOUSEKEEPING);
        assert!(calls().contains("create reservation"), "{}", calls());
        assert!(closed.is_some());
        // An empty queue says nothing of newcomers: open.
        queue("");
        look(&mut closed, &mut deferred, HOUSEKEEPING);
        assert_eq!(calls(), "scontrol delete ReservationName=multiplex-n1\n");
        assert_eq!(closed, None);
        // Full (a second x): closed ahead of a freed slot while a would be declined whichever
        // x ends, and opened again when b, which either freed slot would take, comes first.
        // x beside x was never seen: placed all the same.
        place_x(&mut node.lock().unwrap(), 8, true);
        let mut full = false;
        queue("20|0|9|Resources|1|multiplex:app=a\n");
        std::fs::write(dir.path().join("calls"), "").unwrap();
        look_once(&node, &s, &mut deferred, &mut closed, &mut full, HOUSEKEEPING).unwrap();
        assert!(full && closed.is_some(), "{}", calls());
        assert!(calls().contains("create reservation"), "{}", calls());
        // b behind a: a full node raises no one, and Slurm would still start a first.
        queue("20|0|9|Resources|1|multiplex:app=a\n21|0|8|Priority|1|multiplex:app=b\n");
        std::fs::write(dir.path().join("calls"), "").unwrap();
        look_once(&node, &s, &mut deferred, &mut closed, &mut full, HOUSEKEEPING).unwrap();
        assert_eq!(calls(), "");
        assert!(full && closed.is_some());
        // b first: opened for it.
        queue("21|0|9|Resources|1|multiplex:app=b\n20|0|8|Priority|1|multiplex:app=a\n");
        look_once(&node, &s, &mut deferred, &mut closed, &mut full, HOUSEKEEPING).unwrap();
        assert_eq!(calls(), "scontrol delete ReservationName=multiplex-n1\n");
        assert!(full && closed.is_none());
    }

    #[test]
    fn the_jobs_after_the_next_one_that_would_be_declined_then_are_named_up_to_the_first_taken() {
        let mut q = vec![
            queued(1, 0, 100, Some("a"), true),
            queued(2, 0, 99, Some("b"), true),
            queued(3, 0, 98, None, true),
            queued(4, 0, 97, Some("c"), false),
            queued(5, 0, 96, Some("d"), true),
            queued(6, 0, 95, Some("e"), true),
        ];
        // What the node is asked: the next job first, then those Slurm could start after it
        // (not 3, which is not multiplexed, nor 4, which waits for something else).
        let asked = |q: &[Queued], next, cap, lifting: &[u32], answer: Vec<usize>| {
            let mut seen = Vec::new();
            let got = anticipate(q, next, cap, lifting, |pending, later| {
                seen = pending.iter().map(|p| (p.job_id, later.to_vec())).collect();
                Ok(answer)
            })
            .unwrap();
            (seen.iter().map(|(id, _)| *id).collect::<Vec<u32>>(), got)
        };
        let (seen, got) = asked(&q, 2, 8, &[], vec![1, 2]);
        assert_eq!(seen, [2, 1, 5, 6]);
        assert_eq!(got, [1, 5]);
        // At most `cap` behind the next one.
        let (seen, _) = asked(&q, 2, 1, &[], vec![]);
        assert_eq!(seen, [2, 1]);
        // A job whose deferral is being taken back counts as one Slurm could start.
        let (seen, _) = asked(&q, 2, 8, &[4], vec![]);
        assert_eq!(seen, [2, 1, 4, 5, 6]);
        // Nothing when the next one is not one Slurm could start now (its pass is not now),
        // when it is not listed, or when nothing is behind it.
        assert_eq!(asked(&q, 4, 8, &[], vec![1]).1, Vec::<u32>::new());
        assert_eq!(asked(&q, 9, 8, &[], vec![1]).1, Vec::<u32>::new());
        q.truncate(1);
        assert_eq!(asked(&q, 1, 8, &[], vec![1]).1, Vec::<u32>::new());
    }

    /// Imports pairs seen 5 times, each the same speed both ways.
    fn import_pairs(node: &mut Node, pairs: &[(&str, &str, f64)]) {
        let row = |app: &str, other: &str, speed: f64| crate::history::PairRow {
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
            pairs: pairs
                .iter()
                .flat_map(|&(a, b, speed)| [row(a, b, speed), row(b, a, speed)])
                .collect(),
            memory: vec![],
        };
        node.import(&export).unwrap();
    }

    /// n1 with two GPUs of two slots and x on GPU 0; b pairs well with x, a with neither.
    fn node_of_two_gpus() -> Node {
        let config = crate::config::Config::parse("node = \"n1\"\ndatabase = \":memory:\"\n").unwrap();
        let gpus = (0..2)
            .map(|index| crate::config::GpuSpec {
                index,
                model: "v100".into(),
                memory_mb: 16384,
                uuid: None,
            })
            .collect();
        let mut node = Node::open(config, gpus, crate::node::wall_clock()).unwrap();
        import_pairs(
            &mut node,
            &[("x", "a", 0.3), ("x", "b", 0.9), ("a", "b", 0.3), ("a", "a", 0.3)],
        );
        place_x(&mut node, 7, false);
        node
    }

    #[test]
    fn a_node_opening_for_one_job_defers_first_those_it_would_decline_once_that_one_runs() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let squeue = script(dir.path(), "squeue", &format!("cat {d}/queue\n"));
        let scontrol = script(dir.path(), "scontrol", &format!("echo \"scontrol $*\" >>{d}/calls\n"));
        let close = SteerConfig {
            lookahead: 8,
            close: true,
            ..SteerConfig::default()
        };
        let s = steering(close.clone(), squeue.clone(), scontrol.clone());
        // Two a's are pending. Alone on the empty GPU 1 an a would run; beside x (or the
        // other a) it would not: the node takes the first a and would decline the second.
        // Slurm's pass that starts the first offers the three slots still free to the second:
        // deferred, in one call, before the node opens.
        let node = Mutex::new(node_of_two_gpus());
        let calls = || std::fs::read_to_string(dir.path().join("calls")).unwrap_or_default();
        let queue = |q: &str| std::fs::write(dir.path().join("queue"), q).unwrap();
        let mut deferred = HashMap::new();
        let mut closed = Some(Instant::now() + Duration::from_secs(60));
        let mut anticipation = None;
        queue(
            "20|0|9|Resources|1|multiplex:app=a\n21|0|8|Priority|1|multiplex:app=a\n\
             22|0|7|Priority|1|multiplex:app=b\n",
        );
        let look = Looking {
            deferred: &mut deferred,
            closed: &mut closed,
            full: &mut false,
            anticipation: &mut anticipation,
            lifting: &[],
            anticipated_for: None,
        };
        steer_once(&node, &s, look, HOUSEKEEPING).unwrap();
        // 21 is deferred, not 22: b would be taken beside x (Slurm's pass stops there).
        assert_eq!(
            calls(),
            "scontrol update JobId=21 StartTime=now+60\nscontrol delete ReservationName=multiplex-n1\n"
        );
        assert_eq!(closed, None);
        let a = anticipation.clone().expect("anticipated");
        assert_eq!((a.for_job, a.jobs.as_slice()), (20, &[21][..]));
        // Once 20 runs (on GPU 1), the look that comes before the deferral is taken back
        // closes the node: the next job, 21, would be declined.
        place_x_app(&mut node.lock().unwrap(), 20, "a");
        std::fs::write(dir.path().join("calls"), "").unwrap();
        queue("21|0|9|BeginTime|1|multiplex:app=a\n");
        let mut anticipation = None;
        let look = Looking {
            deferred: &mut deferred,
            closed: &mut closed,
            full: &mut false,
            anticipation: &mut anticipation,
            lifting: &a.jobs,
            anticipated_for: None,
        };
        steer_once(&node, &s, look, HOUSEKEEPING).unwrap();
        assert!(calls().starts_with("scontrol create reservation"), "{}", calls());
        assert!(closed.is_some() && anticipation.is_none());
        // A job anticipated once and never seen here (Slurm did not start it: it waits on
        // something else) is not anticipated again: the jobs behind it would be held back at
        // every look. The node just opens for it.
        let node = Mutex::new(node_of_two_gpus());
        queue("20|0|9|Resources|1|multiplex:app=a\n21|0|8|Priority|1|multiplex:app=a\n");
        std::fs::write(dir.path().join("calls"), "").unwrap();
        let mut anticipation = None;
        let look = Looking {
            deferred: &mut deferred,
            closed: &mut closed,
            full: &mut false,
            anticipation: &mut anticipation,
            lifting: &[],
            anticipated_for: Some(20),
        };
        steer_once(&node, &s, look, HOUSEKEEPING).unwrap();
        assert_eq!(calls(), "scontrol delete ReservationName=multiplex-n1\n");
        assert!(anticipation.is_none());
        // With anticipate = 0 the node just opens.
        let s0 = steering(SteerConfig { anticipate: 0, ..close }, squeue, scontrol);
        let node = Mutex::new(node_of_two_gpus());
        queue("20|0|9|Resources|1|multiplex:app=a\n21|0|8|Priority|1|multiplex:app=a\n");
        std::fs::write(dir.path().join("calls"), "").unwrap();
        let mut closed = Some(Instant::now() + Duration::from_secs(60));
        look_once(&node, &s0, &mut deferred, &mut closed, &mut false, HOUSEKEEPING).unwrap();
        assert_eq!(calls(), "scontrol delete ReservationName=multiplex-n1\n");
    }

    #[test]
    fn a_closing_node_stays_open_only_for_the_job_slurm_starts_next() {
        let q = [queued(1, 0, 100, Some("a"), true), queued(2, 0, 99, Some("b"), true)];
        let none = HashMap::new();
        let decided = |close, raise: Option<usize>, take: Vec<usize>| {
            decide(&q, 8, &none, close, move |_| {
                Ok(placement::Steering {
                    raise,
                    defer: vec![],
                    take,
                })
            })
            .unwrap()
        };
        // It would take the first: open.
        assert!(!decided(true, None, vec![0, 1]).close);
        // It would take only the second, and raises it: open, for the second.
        let d = decided(true, Some(1), vec![1]);
        assert!(!d.close && d.raise.is_some_and(|r| r.job_id == 2), "{d:?}");
        // It would take the second but does not raise it (passed over too often): Slurm
        // starts the first next, which it would decline: closed.
        assert!(decided(true, None, vec![1]).close);
        assert!(decided(true, None, vec![]).close);
        // Without `close`, never.
        assert!(!decided(false, None, vec![]).close);
        // A first that cannot be requeued is let through: declined, it fails with the reason
        // (as without closing) rather than wait for a node that stays closed to it.
        let mut q = q;
        q[0].requeue = false;
        let d = decide(&q, 8, &none, true, |_| Ok(placement::Steering::default())).unwrap();
        assert!(!d.close);
    }

    #[test]
    fn a_node_stays_open_for_a_declined_job_it_would_take_when_its_wait_ends() {
        // Job 6 was declined here (the node was full) and waits out its begin time; nothing
        // else is pending. The node emptied meanwhile.
        let mut q = [queued(6, 0, 100, Some("a"), false)];
        q[0].begin_time = true;
        let ours = HashMap::from([(6, Instant::now() + Duration::from_secs(5))]);
        let decided = |take: Vec<usize>, defer: Vec<usize>| {
            decide(&q, 8, &ours, true, move |_| {
                Ok(placement::Steering {
                    raise: None,
                    defer,
                    take,
                })
            })
            .unwrap()
        };
        // It would take the job when its wait ends: open.
        assert!(!decided(vec![0], vec![]).close);
        // It would still decline it: closed, so that Slurm does not start it here to be
        // declined again.
        assert!(decided(vec![], vec![0]).close);
        assert!(decided(vec![], vec![]).close);
    }

    #[test]
    fn a_job_this_node_would_decline_is_deferred_renewed_while_still_declined_and_freed_at_stop() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // a pairs badly with x (it would be declined), b well. The first look lists both as
        // startable; later looks list a as waiting for the begin time the deferral set.
        let squeue = script(
            dir.path(),
            "squeue",
            &format!(
                "echo \"squeue $*\" >>{d}/calls\nr=Resources; [ -e {d}/deferred ] && r=BeginTime\n\
                 case \"$*\" in *PENDING*) printf '20|0|9|%s|1|multiplex:app=a\\n21|0|8|Priority|1|multiplex:app=b\\n' $r ;;\n\
                 *) printf '20|9\\n21|10\\n' ;; esac\n"
            ),
        );
        let scontrol = script(
            dir.path(),
            "scontrol",
            &format!("echo \"scontrol $*\" >>{d}/calls\ncase \"$*\" in *StartTime=now+*) touch {d}/deferred ;; esac\n"),
        );
        // n1 (this node) and n2 each have a free shard at the same weight; n3 has none.
        let sinfo = fake(
            dir.path(),
            "sinfo",
            "n1|201|gpu:1,shard:2\\nn2|201|gpu:1,shard:2\\nn3|1|gpu:1\\n",
        );
        let s = Steering {
            config: SteerConfig {
                lookahead: 8,
                defer: true,
                ..SteerConfig::default()
            },
            node: "n1".into(),
            squeue,
            scontrol,
            sinfo,
        };
        let updates = || -> Vec<String> {
            let calls = std::fs::read_to_string(dir.path().join("calls")).unwrap_or_default();
            let out = calls
                .lines()
                .filter(|l| l.starts_with("scontrol"))
                .map(String::from)
                .collect();
            std::fs::write(dir.path().join("calls"), "").unwrap();
            out
        };
        let node = Mutex::new(node_beside_x());
        let mut deferred = HashMap::new();
        let renew = Duration::from_secs(15);
        // With a deferred, b is Slurm's first already: nothing to raise.
        assert_eq!(
            look_once(&node, &s, &mut deferred, &mut None, &mut false, renew).unwrap(),
            None
        );
        assert_eq!(updates(), ["scontrol update JobId=20 StartTime=now+60"]);
        assert!(deferred.contains_key(&20));
        // Looked at again well before it lapses: nothing to renew yet.
        look_once(&node, &s, &mut deferred, &mut None, &mut false, renew).unwrap();
        assert!(!updates().iter().any(|u| u.contains("JobId=20")));
        // About to lapse, and this node would still decline it: renewed.
        deferred.insert(20, Instant::now() + Duration::from_secs(5));
        look_once(&node, &s, &mut deferred, &mut None, &mut false, renew).unwrap();
        assert!(updates().contains(&"scontrol update JobId=20 StartTime=now+60".to_string()));
        assert!(deferred[&20] > Instant::now() + Duration::from_secs(50));
        // Another node with a free slot is lighter now: Slurm would offer a to it first, so n1
        // takes its renewed deferral back at once rather than hold a back from it.
        let lighter = fake(
            dir.path(),
            "sinfo-lighter",
            "n1|201|gpu:1,shard:2\\nn2|101|gpu:1,shard:2\\n",
        );
        let s2 = Steering { sinfo: lighter, ..s };
        deferred.insert(20, Instant::now() + Duration::from_secs(5));
        look_once(&node, &s2, &mut deferred, &mut None, &mut false, renew).unwrap();
        assert_eq!(
            updates(),
            [
                "scontrol update JobId=20 StartTime=now+60",
                "scontrol update JobId=20 StartTime=now"
            ]
        );
        assert!(deferred.is_empty());
        // n1 is among the first again, and a waits for a slot again: deferred anew.
        std::fs::remove_file(dir.path().join("deferred")).unwrap();
        let s = Steering {
            sinfo: s2.sinfo.with_file_name("sinfo"),
            ..s2
        };
        look_once(&node, &s, &mut deferred, &mut None, &mut false, renew).unwrap();
        assert_eq!(updates(), ["scontrol update JobId=20 StartTime=now+60"]);
        // The daemon stops: its deferral is taken back at once.
        lift_all(&s, &mut deferred);
        assert_eq!(updates(), ["scontrol update JobId=20 StartTime=now"]);
        assert!(deferred.is_empty());
    }

    #[test]
    fn the_nodes_slurm_offers_jobs_first_are_the_lightest_with_a_free_shard() {
        assert_eq!(gres_count("gpu:2,shard:4", "shard"), 4);
        assert_eq!(gres_count("gpu:0,shard:(null):3(IDX:0,2)", "shard"), 3);
        assert_eq!(gres_count("gpu:v100:2(S:0),shard:v100:4(S:0-1)", "shard"), 4);
        assert_eq!(gres_count("gpu:2", "shard"), 0);
        assert_eq!(gres_count("(null)", "shard"), 0);
        let nodes = "n1|101|gpu:2,shard:4\nn2|1|gpu:2,shard:4\nn3|101|gpu:2,shard:4\nn4|201|gpu:2,shard:4\n";
        let mut jobs = String::new();
        for (node, n) in [("n1", 3), ("n2", 4), ("n3", 2)] {
            for _ in 0..n {
                jobs.push_str(&format!("{node}|gres:shard:1\n"));
            }
        }
        // n2 is lightest but full: n1 and n3 are offered jobs first, not n4.
        let first = |n| parse_offered_first(nodes, &jobs, n).unwrap();
        assert!(first("n1") && first("n3"));
        assert!(!first("n4") && !first("n5"));
        // Asked by n2 itself, which has a free slot Slurm does not count yet: n2 is lightest.
        assert!(first("n2"));
        // Slurm 24.11 writes the jobs' shards as `gres/shard:N`.
        let newer = jobs.replace("gres:shard:1", "gres/shard:1");
        assert!(parse_offered_first(nodes, &newer, "n3").unwrap());
        // Two more shards taken on n3: it is full, and n1 alone is offered jobs first.
        let full = format!("{newer}n3|gres/shard:2\n");
        assert!(parse_offered_first(nodes, &full, "n1").unwrap());
        assert!(!parse_offered_first(nodes, &full, "n4").unwrap());
        assert!(parse_offered_first("n1|x|gpu:1\n", "", "n1")
            .unwrap_err()
            .contains("weight"));
        assert!(parse_offered_first("n1|1\n", "", "n1")
            .unwrap_err()
            .contains("not 3 fields"));
        assert!(parse_offered_first("", "n1\n", "n1")
            .unwrap_err()
            .contains("not 2 fields"));
        assert_eq!(sinfo_beside(Path::new("/usr/bin/squeue")), Path::new("/usr/bin/sinfo"));
        assert_eq!(sinfo_beside(Path::new("squeue")), Path::new("sinfo"));
    }

    #[test]
    fn a_raise_is_read_back_and_lowered_until_slurm_puts_the_job_first() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // Pending: a (first) and b, both at Slurm's floor of 1. Read back, b stays at 1 until
        // its nice is -8 or lower (priority/multifactor whose factors are all below 0).
        let squeue = script(
            dir.path(),
            "squeue",
            &format!(
                "echo \"squeue $*\" >>{d}/calls\n\
                 case \"$*\" in *PENDING*) printf '20|0|1|Resources|1|multiplex:app=a\\n21|0|1|Priority|1|multiplex:app=b\\n' ;;\n\
                 *) n=$(sed -n 's/.*Nice=//p' {d}/nice | tail -1); p=1; [ \"$n\" -le -8 ] && p=2; printf '20|1\\n21|%s\\n' $p ;; esac\n"
            ),
        );
        let scontrol = script(
            dir.path(),
            "scontrol",
            &format!("echo \"$*\" >>{d}/nice\necho \"scontrol $*\" >>{d}/calls\n"),
        );
        let steer = SteerConfig {
            lookahead: 8,
            ..SteerConfig::default()
        };
        let s = steering(steer, squeue, scontrol);
        let node = Mutex::new(node_beside_x());
        let mut deferred = HashMap::new();
        let r = look_once(&node, &s, &mut deferred, &mut None, &mut false, HOUSEKEEPING)
            .unwrap()
            .expect("b is raised");
        assert_eq!((r.job_id, r.before, r.own_nice, r.nice), (21, 20, 0, -8));
        let nices = std::fs::read_to_string(dir.path().join("nice")).unwrap();
        assert_eq!(nices, "update JobId=21 Nice=-2\nupdate JobId=21 Nice=-8\n");
        // Where Slurm's priority never follows the nice, the job's own comes back.
        std::fs::write(dir.path().join("nice"), "").unwrap();
        let stuck = script(
            dir.path(),
            "squeue-stuck",
            "case \"$*\" in *PENDING*) printf '20|0|1|Resources|1|multiplex:app=a\\n21|0|1|Priority|1|multiplex:app=b\\n' ;;\n*) printf '20|1\\n21|1\\n' ;; esac\n",
        );
        let s = Steering { squeue: stuck, ..s };
        let e = look_once(&node, &s, &mut deferred, &mut None, &mut false, HOUSEKEEPING).unwrap_err();
        assert!(e.contains("does not follow the nice"), "{e}");
        let nices = std::fs::read_to_string(dir.path().join("nice")).unwrap();
        assert!(nices.ends_with("update JobId=21 Nice=0\n"), "{nices}");
        // b is not taken when the first in Slurm's order pairs as well: nothing is raised.
        assert_eq!(
            decide(
                &[queued(1, 0, 5, Some("b"), true), queued(2, 0, 4, Some("b"), true)],
                8,
                &deferred,
                false,
                |p| { node.lock().unwrap().steer(p).map_err(|e| e.to_string()) }
            )
            .unwrap()
            .raise,
            None
        );
    }
}
