//! `multiplex-simulate`: a trace-driven comparison of placement policies on measured pair
//! speeds. The world (see [`world`]) plays Slurm and reality; the policies (see [`policy`])
//! play the node daemon, `learned` being the daemon's own code with its SQLite history.

mod books;
mod events;
pub mod grade;
pub mod input;
mod learned;
pub mod model;
mod oracle;
pub mod plot;
pub mod policy;
mod state;
mod watchdog;
pub mod world;

use input::{Rng, Table, TraceJob};
use serde::Serialize;
use world::{Outcome, Progress, Shape};

/// Everything one `simulate` run needs.
#[derive(Debug, Clone)]
pub struct Setup {
    pub table: Table,
    pub trace: Vec<TraceJob>,
    pub shape: Shape,
    pub policies: Vec<String>,
    pub seed: u64,
    pub progress: Progress,
    /// The daemon's settings for the learned policy and the oracle.
    pub options: policy::Options,
    /// What the learned policy's nodes start from, as `multiplexd import` of a site's earlier
    /// export gives them (None: an empty history, a site's first day).
    pub history: Option<multiplexd::history::Export>,
}

/// One policy's results. The field names are the JSON and CSV keys scripts rely on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub policy: String,
    pub jobs: usize,
    pub avg_jct_s: f64,
    pub p50_jct_s: f64,
    pub p95_jct_s: f64,
    pub makespan_s: f64,
    pub avg_wait_s: f64,
    /// Failures users saw: runs that died out of GPU memory beside a partner.
    pub oom_failures: u64,
    pub throughput_per_gpu: f64,
    /// Average JCT of the last fifth of the jobs in submit order: where a learning policy
    /// ends, once it has seen most of what it will see.
    pub last_fifth_avg_jct_s: f64,
    /// The 99th percentile of the wait from submission to the run that completed.
    pub p99_wait_s: f64,
    /// How many running jobs a policy gave back to Slurm (requeued) to run apart from
    /// partners they were measured to lose beside.
    pub separations: u64,
    /// How many claims the policy made: each one `scontrol update` of a pending job.
    pub claims: u64,
    /// Of the failures, how many killed the job that ran first (the resident).
    pub resident_failures: u64,
    /// The work the failed runs had done and lost, hours of work alone.
    pub lost_work_h: f64,
    /// Runs out of memory beside a partner that the daemon put back in the queue at once:
    /// failures no user saw (not in `oom_failures`; their work is in `lost_work_h`).
    pub put_back: u64,
}

/// One policy's results with every job's completion time, for plots.
#[derive(Debug, Clone)]
pub struct Run {
    pub summary: Summary,
    /// Per job in trace order: job completion time (completion - submit).
    pub jct: Vec<f64>,
    /// What the policy learned, graded against the table (learned policy only).
    pub grade: Option<String>,
    /// What the policy learned, as `multiplexd export` writes it (learned policy only).
    pub history: Option<multiplexd::history::Export>,
}

/// Checks what the command line cannot: the cluster, the policies.
pub fn check(shape: &Shape, policies: &[String]) -> Result<(), String> {
    if shape.nodes == 0 {
        return Err("--nodes must be at least 1".into());
    }
    if shape.gpus_per_node == 0 {
        return Err("--gpus-per-node must be at least 1".into());
    }
    if !(1..=16).contains(&shape.jobs_per_gpu) {
        return Err(format!(
            "--jobs-per-gpu {}: must be between 1 and 16",
            shape.jobs_per_gpu
        ));
    }
    for p in policies {
        if !policy::ALL.contains(&p.as_str()) {
            return Err(format!("unknown policy {p:?}: choose from {}", policy::ALL.join(", ")));
        }
    }
    Ok(())
}

/// Generates a trace for `setup`-like arguments (see [`input::generate`]).
pub fn generated_trace(
    table: &Table,
    jobs: usize,
    load: f64,
    shape: &Shape,
    seed: u64,
    same_app_sigma: f64,
) -> Result<Vec<TraceJob>, String> {
    if jobs == 0 {
        return Err("--jobs must be at least 1".into());
    }
    if !(load.is_finite() && load > 0.0) {
        return Err(format!("--load {load}: must be a positive number"));
    }
    if !(0.0..=1.0).contains(&same_app_sigma) {
        return Err(format!(
            "--same-app-runtime-sigma {same_app_sigma}: must be from 0 to 1"
        ));
    }
    Ok(input::generate(
        jobs,
        load,
        shape.nodes * shape.gpus_per_node,
        table,
        &mut Rng::new(seed),
        same_app_sigma,
    ))
}

/// Runs every policy of `setup`, on as many threads as the machine has cores; results in the
/// order the policies were asked for, the same for a seed whatever the thread count.
pub fn run(setup: &Setup) -> Result<Vec<Run>, String> {
    check(&setup.shape, &setup.policies)?;
    let min_gain = setup.options.min_gain;
    multiplexd::config::keys::MIN_GAIN
        .read(Some(min_gain))
        .map_err(|e| format!("--min-gain {min_gain}: {e}"))?;
    let share_queue = setup.options.share_queue;
    multiplexd::config::keys::SHARE_QUEUE
        .read(Some(share_queue))
        .map_err(|e| format!("--share-queue {share_queue}: {e}"))?;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(setup.policies.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut slots: Vec<Option<Result<Run, String>>> = vec![None; setup.policies.len()];
    let results = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(name) = setup.policies.get(k) else {
                    break;
                };
                let r = run_one(setup, name);
                results.lock().unwrap_or_else(|p| p.into_inner())[k] = Some(r);
            });
        }
    });
    slots
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err("a policy's thread died".into())))
        .collect()
}

fn run_one(setup: &Setup, name: &str) -> Result<Run, String> {
    let mut p = policy::make_from(
        name,
        &setup.table,
        setup.shape,
        setup.seed,
        setup.options,
        setup.history.as_ref(),
    )?;
    let outcome = world::run(
        &setup.table,
        &setup.trace,
        setup.shape,
        setup.progress,
        setup.seed,
        p.as_mut(),
    )
    .map_err(|e| format!("policy {name}: {e}"))?;
    let mut run = summarise(name, &outcome);
    p.settle()?;
    run.grade = p.grade();
    run.history = p.history().transpose()?;
    Ok(run)
}

/// The numbers of one policy's outcome.
pub fn summarise(name: &str, o: &Outcome) -> Run {
    let jct: Vec<f64> = o.jobs.iter().map(|&(submit, _, end)| end - submit).collect();
    let mut sorted = jct.clone();
    sorted.sort_by(f64::total_cmp);
    let n = jct.len().max(1) as f64;
    let tail = &jct[jct.len() - jct.len() / 5..];
    let mut waits: Vec<f64> = o.jobs.iter().map(|&(submit, start, _)| start - submit).collect();
    waits.sort_by(f64::total_cmp);
    let first = o.jobs.iter().map(|j| j.0).fold(f64::INFINITY, f64::min);
    let last = o.jobs.iter().map(|j| j.2).fold(f64::NEG_INFINITY, f64::max);
    Run {
        summary: Summary {
            policy: name.to_string(),
            jobs: jct.len(),
            avg_jct_s: jct.iter().sum::<f64>() / n,
            p50_jct_s: percentile(&sorted, 0.50),
            p95_jct_s: percentile(&sorted, 0.95),
            makespan_s: if jct.is_empty() { 0.0 } else { last - first },
            avg_wait_s: o.jobs.iter().map(|&(submit, start, _)| start - submit).sum::<f64>() / n,
            oom_failures: o.oom_failures,
            throughput_per_gpu: if o.busy_seconds > 0.0 {
                o.speed_seconds / o.busy_seconds
            } else {
                0.0
            },
            last_fifth_avg_jct_s: tail.iter().sum::<f64>() / tail.len().max(1) as f64,
            p99_wait_s: percentile(&waits, 0.99),
            separations: o.separations,
            claims: o.claims,
            resident_failures: o.resident_failures,
            lost_work_h: o.lost_work_s / 3600.0,
            put_back: o.put_back,
        },
        jct,
        grade: None,
        history: None,
    }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// The results as a table for people.
pub fn table(runs: &[Run], heading: &str) -> String {
    let mut out = format!("{heading}\n");
    // Slurm's best placement of shards (23.11's LL_SHARED_GRES) is the baseline.
    let base = runs
        .iter()
        .find(|r| r.summary.policy == "least-loaded")
        .map(|r| r.summary.avg_jct_s);
    out.push_str(&format!(
        "{:<13} {:>6} {:>10} {:>9} {:>10} {:>11} {:>9} {:>6} {:>8} {:>8} {:>8} {:>9} {:>12}\n",
        "policy",
        "jobs",
        "avg JCT s",
        "p50 s",
        "p95 s",
        "makespan s",
        "wait s",
        "OOM",
        "put back",
        "lost h",
        "claims",
        "thru/GPU",
        "vs least-ld"
    ));
    for r in runs {
        let s = &r.summary;
        let vs = base.map_or("-".to_string(), |b| format!("{:+.1}%", 100.0 * (s.avg_jct_s / b - 1.0)));
        out.push_str(&format!(
            "{:<13} {:>6} {:>10.0} {:>9.0} {:>10.0} {:>11.0} {:>9.0} {:>6} {:>8} {:>8.1} {:>8} {:>9.3} {:>12}\n",
            s.policy,
            s.jobs,
            s.avg_jct_s,
            s.p50_jct_s,
            s.p95_jct_s,
            s.makespan_s,
            s.avg_wait_s,
            s.oom_failures,
            s.put_back,
            s.lost_work_h,
            s.claims,
            s.throughput_per_gpu,
            vs
        ));
    }
    out.push_str(&learned_vs_oracle(runs));
    for r in runs {
        if let Some(g) = &r.grade {
            out.push_str(g);
            out.push('\n');
        }
    }
    out
}

/// The learned policy's gap to the oracle, over all jobs and over the last fifth of them (in
/// submit order): how far it is once it has learned. Empty unless both ran.
fn learned_vs_oracle(runs: &[Run]) -> String {
    let find = |p: &str| runs.iter().find(|r| r.summary.policy == p);
    let (Some(l), Some(o)) = (find("learned"), find("oracle")) else {
        return String::new();
    };
    let (l, o) = (&l.summary, &o.summary);
    format!(
        "learned vs oracle: {:+.1}% average JCT over all jobs, {:+.1}% over the last fifth\n",
        100.0 * (l.avg_jct_s / o.avg_jct_s - 1.0),
        100.0 * (l.last_fifth_avg_jct_s / o.last_fifth_avg_jct_s - 1.0)
    )
}

/// The results as CSV, with the JSON keys as the header.
pub fn csv(runs: &[Run]) -> String {
    let mut out = String::from(
        "policy,jobs,avg_jct_s,p50_jct_s,p95_jct_s,makespan_s,avg_wait_s,oom_failures,throughput_per_gpu,last_fifth_avg_jct_s,p99_wait_s,separations,claims,resident_failures,lost_work_h,put_back\n",
    );
    for r in runs {
        let s = &r.summary;
        out.push_str(&format!(
            "{},{},{:.1},{:.1},{:.1},{:.1},{:.1},{},{:.4},{:.1},{:.1},{},{},{},{:.2},{}\n",
            s.policy,
            s.jobs,
            s.avg_jct_s,
            s.p50_jct_s,
            s.p95_jct_s,
            s.makespan_s,
            s.avg_wait_s,
            s.oom_failures,
            s.throughput_per_gpu,
            s.last_fifth_avg_jct_s,
            s.p99_wait_s,
            s.separations,
            s.claims,
            s.resident_failures,
            s.lost_work_h,
            s.put_back
        ));
    }
    out
}

#[cfg(test)]
mod termination;
#[cfg(test)]
mod tests;
