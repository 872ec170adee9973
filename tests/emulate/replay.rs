//! `multiplex-emulate`: replays a job trace on the running local cluster with stand-in jobs
//! (`multiplex-standin`) and measures what users would: job completion times, makespan,
//! out-of-memory failures. `tests/emulate/run` calls it once with the daemons deciding and
//! once with Slurm's own shard placement, then `compare` prints both side by side.
//!
//! Each trace job is submitted at its (scaled) arrival time as
//! `sbatch --multiplex=app=NAME --gres=gpu:1`; one that dies of out-of-memory is submitted
//! again, as a user would, after the same wait as in `multiplex-simulate` (120 s, scaled).
//! Times are reported in the trace's seconds (real seconds x the time scale), so that they
//! compare with what `multiplex-simulate` predicts for the same trace.

use clap::{Parser, Subcommand};
use multiplex_simulate::input::{parse_trace, Table, TraceJob};
use multiplex_simulate::world::{Outcome, OOM_AFTER_S, OOM_REQUEUE_S};
use multiplex_simulate::{summarise, Summary};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Parser)]
#[command(
    name = "multiplex-emulate",
    about = "Replays a job trace on the local Slurm cluster with stand-in jobs"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the trace once on the cluster of $SLURM_CONF; write the results as JSON.
    Replay(ReplayArgs),
    /// Print the results of two replays side by side, with what `multiplex-simulate` predicts.
    Compare {
        /// Results of the replay with plain Slurm shard placement.
        plain: PathBuf,
        /// Results of the replay with the daemons deciding.
        daemons: PathBuf,
        /// `multiplex-simulate --format json` for the same trace and cluster.
        #[arg(long)]
        simulated: Option<PathBuf>,
        #[arg(long, default_value = "table")]
        format: String,
    },
}

#[derive(clap::Args)]
struct ReplayArgs {
    #[arg(long)]
    table: PathBuf,
    #[arg(long)]
    trace: PathBuf,
    /// Trace seconds per real second.
    #[arg(long, default_value_t = 500.0)]
    time_scale: f64,
    /// A name for this run (its results' label).
    #[arg(long)]
    label: String,
    /// The stand-in job's binary.
    #[arg(long)]
    standin: PathBuf,
    /// Where the jobs' outputs and outcome files go (emptied first).
    #[arg(long)]
    dir: PathBuf,
    /// Where to write the results (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Seconds between each job's progress reports, in trace seconds (0: none).
    #[arg(long, default_value_t = 900.0)]
    report_every: f64,
    /// Give up (cancelling what runs) after this many real seconds.
    #[arg(long, default_value_t = 1800.0)]
    timeout: f64,
    /// The cluster's log directory: the daemons' logs (`multiplexd-*.log`) say each time they
    /// claimed a pending job for a GPU or gave a running one back to run apart; counted at
    /// the end. Without it those counts read 0 (they are not seen from the jobs' side).
    #[arg(long)]
    daemon_logs: Option<PathBuf>,
}

/// What the daemons' logs under `dir` say they did: (claims, jobs given back to run apart),
/// each counted by the line its daemon logs for it (`tracing`'s message text).
fn actions_in_logs(dir: &Path) -> Result<(u64, u64), String> {
    let mut counts = (0, 0);
    let entries = fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("multiplexd-") && name.ends_with(".log")) {
            continue;
        }
        let text = fs::read_to_string(e.path()).map_err(|err| format!("{}: {err}", e.path().display()))?;
        for line in text.lines() {
            if line.contains("multiplexd::claimer: claimed job=") {
                counts.0 += 1;
            } else if line.contains(" requeued to run apart: ") {
                counts.1 += 1;
            }
        }
    }
    Ok(counts)
}

fn main() -> ExitCode {
    // Output cut short (`multiplex-emulate compare ... | head`) ends the tool quietly, as
    // multiplex-simulate does, instead of a panic on the closed pipe.
    // SAFETY: signal() with SIG_DFL only changes this process's disposition of SIGPIPE,
    // before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    let r = match cli.command {
        Cmd::Replay(a) => replay(&a),
        Cmd::Compare {
            plain,
            daemons,
            simulated,
            format,
        } => compare(&plain, &daemons, simulated.as_deref(), &format),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multiplex-emulate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn read(path: &Path) -> Result<String, String> {
    fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Quotes a word for the shell of `sbatch --wrap`.
fn sh(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// One submission of a trace job.
struct Attempt {
    slurm_id: u32,
    result: PathBuf,
    out: PathBuf,
    /// When squeue first no longer listed it while it had left no result.
    gone_since: Option<Instant>,
}

/// A finished attempt, from the stand-in's result file (times relative to the replay's start).
struct Ran {
    node_gpu: String,
    start: f64,
    end: f64,
}

struct Job {
    trace: TraceJob,
    /// Real seconds after the start when it is (next) due for submission.
    due: f64,
    attempts: u32,
    running: Option<Attempt>,
    /// (start, end) of the run that completed, real seconds after the start.
    done: Option<(f64, f64)>,
}

fn replay(a: &ReplayArgs) -> Result<(), String> {
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        return Err(format!("--time-scale {}: must be a positive number", a.time_scale));
    }
    let conf =
        std::env::var("SLURM_CONF").map_err(|_| "SLURM_CONF is not set: start the cluster (tests/cluster/up)")?;
    let state = Path::new(&conf)
        .parent()
        .and_then(Path::parent)
        .ok_or("SLURM_CONF is not <state>/etc/slurm.conf")?
        .to_path_buf();
    let table_text = read(&a.table)?;
    let table = Table::parse(&table_text, &a.table.display().to_string())?;
    let trace = parse_trace(&read(&a.trace)?, &a.trace.display().to_string(), &table)?;
    let table_abs = fs::canonicalize(&a.table).map_err(|e| format!("{}: {e}", a.table.display()))?;
    let standin = fs::canonicalize(&a.standin).map_err(|e| format!("{}: {e}", a.standin.display()))?;
    let dir = a.dir.clone();
    let _ = fs::remove_dir_all(&dir);
    let registry = state.join("emulate").join("registry");
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    fs::create_dir_all(&registry).map_err(|e| format!("cannot create {}: {e}", registry.display()))?;

    let scale = a.time_scale;
    let mut jobs: Vec<Job> = trace
        .into_iter()
        .map(|t| Job {
            due: t.submit_s / scale,
            trace: t,
            attempts: 0,
            running: None,
            done: None,
        })
        .collect();
    let started = Instant::now();
    let t0 = unix_now();
    let mut ooms = 0u64;
    let mut lost = Vec::new();
    let mut runs: Vec<Ran> = Vec::new();
    let mut last_poll = Instant::now() - Duration::from_secs(10);
    let mut squeued: HashSet<u32> = HashSet::new();
    eprintln!(
        "emulate {}: {} jobs, time scale {scale} (trace seconds per real second), results in {}",
        a.label,
        jobs.len(),
        dir.display()
    );
    loop {
        let now = started.elapsed().as_secs_f64();
        // Submit what is due.
        for j in jobs
            .iter_mut()
            .filter(|j| j.done.is_none() && j.running.is_none() && j.due <= now)
        {
            j.attempts += 1;
            let name = format!("{}.{}", j.trace.id, j.attempts);
            let result = dir.join(format!("{name}.json"));
            let out = dir.join(format!("{name}.out"));
            let app = &table.apps[j.trace.app];
            let wrap = format!(
                "exec {} --app {} --work {:.4} --table {} --registry {} --result {} --report-every {:.4} --oom-after {:.4}",
                sh(&standin.display().to_string()),
                sh(app),
                j.trace.solo_runtime_s / scale,
                sh(&table_abs.display().to_string()),
                sh(&registry.display().to_string()),
                sh(&result.display().to_string()),
                a.report_every / scale,
                OOM_AFTER_S / scale,
            );
            let output = Command::new("sbatch")
                .args(["--parsable", "--gres=gpu:1", "--open-mode=append"])
                .arg(format!("--multiplex=app={app}"))
                .arg(format!("--job-name=emu-{}", j.trace.id))
                .arg(format!("--output={}", out.display()))
                .arg("--wrap")
                .arg(&wrap)
                .output()
                .map_err(|e| format!("cannot run sbatch: {e}"))?;
            let text = String::from_utf8_lossy(&output.stdout);
            let id = text.trim().split(';').next().and_then(|s| s.parse::<u32>().ok());
            match id {
                Some(slurm_id) if output.status.success() => {
                    squeued.insert(slurm_id);
                    j.running = Some(Attempt {
                        slurm_id,
                        result,
                        out,
                        gone_since: None,
                    })
                }
                _ => {
                    return Err(format!(
                        "sbatch refused trace job {}: {}",
                        j.trace.id,
                        String::from_utf8_lossy(&output.stderr).trim()
                    ))
                }
            }
        }
        // Collect what ended.
        let poll_queue = last_poll.elapsed() >= Duration::from_secs(1);
        if poll_queue {
            last_poll = Instant::now();
            squeued = queued()?;
        }
        for j in jobs.iter_mut() {
            let Some(at) = &mut j.running else { continue };
            if at.result.exists() {
                let v: Value = serde_json::from_str(&read(&at.result)?)
                    .map_err(|e| format!("{}: not a stand-in result: {e}", at.result.display()))?;
                let field = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
                let ran = Ran {
                    node_gpu: format!(
                        "{}/{}",
                        v.get("node").and_then(Value::as_str).unwrap_or("?"),
                        v.get("gpu").and_then(Value::as_str).unwrap_or("?")
                    ),
                    start: field("start_unix") - t0,
                    end: field("end_unix") - t0,
                };
                if v.get("status").and_then(Value::as_str) == Some("ok") {
                    j.done = Some((ran.start, ran.end));
                } else {
                    ooms += 1;
                    j.due = started.elapsed().as_secs_f64() + OOM_REQUEUE_S / scale;
                }
                runs.push(ran);
                j.running = None;
            } else if poll_queue && !squeued.contains(&at.slurm_id) {
                // Gone from the queue without a result: give the file a moment, then call it lost.
                let since = *at.gone_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(5) {
                    let tail: String = fs::read_to_string(&at.out)
                        .unwrap_or_default()
                        .lines()
                        .rev()
                        .take(3)
                        .collect::<Vec<_>>()
                        .join(" | ");
                    lost.push(format!("trace job {} (Slurm job {}): {tail}", j.trace.id, at.slurm_id));
                    j.running = None;
                    j.due = started.elapsed().as_secs_f64() + OOM_REQUEUE_S / scale;
                    if j.attempts >= 5 {
                        return Err(format!("gave up: {}", lost.join("; ")));
                    }
                }
            }
        }
        if jobs.iter().all(|j| j.done.is_some()) {
            break;
        }
        if started.elapsed().as_secs_f64() > a.timeout {
            let ids: Vec<String> = jobs
                .iter()
                .filter_map(|j| j.running.as_ref().map(|r| r.slurm_id.to_string()))
                .collect();
            if !ids.is_empty() {
                let _ = Command::new("scancel").args(&ids).status();
            }
            return Err(format!(
                "timed out after {:.0} s with {} of {} jobs done",
                a.timeout,
                jobs.iter().filter(|j| j.done.is_some()).count(),
                jobs.len()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let wall_s = started.elapsed().as_secs_f64();

    // Busy time per GPU: the union of its runs (failed ones too); work done: every job's.
    let mut by_gpu: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
    for r in &runs {
        by_gpu.entry(&r.node_gpu).or_default().push((r.start, r.end));
    }
    let mut busy = 0.0;
    for spans in by_gpu.values_mut() {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut cur: Option<(f64, f64)> = None;
        for &(s, e) in spans.iter() {
            cur = match cur {
                Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
                Some((cs, ce)) => {
                    busy += ce - cs;
                    Some((s, e))
                }
                None => Some((s, e)),
            };
        }
        if let Some((cs, ce)) = cur {
            busy += ce - cs;
        }
    }
    // Not seen from the jobs' side: the daemons log each claim and each job given back.
    let (claims, separations) = match &a.daemon_logs {
        Some(dir) => actions_in_logs(dir)?,
        None => (0, 0),
    };
    let outcome = Outcome {
        jobs: jobs
            .iter()
            .map(|j| {
                let (s, e) = j.done.expect("every job is done");
                (j.trace.submit_s, s * scale, e * scale)
            })
            .collect(),
        oom_failures: ooms,
        separations,
        claims,
        speed_seconds: jobs.iter().map(|j| j.trace.solo_runtime_s).sum(),
        busy_seconds: busy * scale,
    };
    let run = summarise(&a.label, &outcome);
    let result = json!({
        "summary": run.summary,
        "time_scale": scale,
        "wall_s": wall_s,
        "lost": lost,
        "jct_s": run.jct,
    });
    fs::write(
        &a.out,
        serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("cannot write {}: {e}", a.out.display()))?;
    eprintln!(
        "emulate {}: {} jobs in {wall_s:.0} s; average JCT {:.0} s (trace seconds), {} out-of-memory failures, {} claims",
        a.label,
        jobs.len(),
        run.summary.avg_jct_s,
        ooms,
        claims
    );
    Ok(())
}

/// The job ids Slurm still knows as pending or running.
fn queued() -> Result<HashSet<u32>, String> {
    let out = Command::new("squeue")
        .args(["-h", "-o", "%i"])
        .output()
        .map_err(|e| format!("cannot run squeue: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "squeue failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect())
}

/// The comparison in one sentence a user reads at once.
fn verdict(p: &Summary, d: &Summary) -> String {
    let change = d.avg_jct_s / p.avg_jct_s - 1.0;
    let how = if change <= -0.005 {
        format!("finished {:.0}% sooner on average", -100.0 * change)
    } else if change >= 0.005 {
        format!("finished {:.0}% later on average", 100.0 * change)
    } else {
        "finished as soon on average".to_string()
    };
    let ran_out = |n: u64| match n {
        1 => "1 ran".to_string(),
        n => format!("{n} ran"),
    };
    format!(
        "With the daemons deciding, jobs {how} ({:.0} s against {:.0} s with plain Slurm shards) \
         and {} out of GPU memory, against {}.",
        d.avg_jct_s,
        p.avg_jct_s,
        ran_out(d.oom_failures),
        p.oom_failures
    )
}

fn summary_of(path: &Path) -> Result<(Summary, Value), String> {
    let v: Value = serde_json::from_str(&read(path)?).map_err(|e| format!("{}: {e}", path.display()))?;
    let s = v
        .get("summary")
        .ok_or_else(|| format!("{}: no summary", path.display()))?;
    let get = |k: &str| s.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    Ok((
        Summary {
            policy: s.get("policy").and_then(Value::as_str).unwrap_or("?").to_string(),
            jobs: get("jobs") as usize,
            avg_jct_s: get("avg_jct_s"),
            p50_jct_s: get("p50_jct_s"),
            p95_jct_s: get("p95_jct_s"),
            makespan_s: get("makespan_s"),
            avg_wait_s: get("avg_wait_s"),
            oom_failures: get("oom_failures") as u64,
            throughput_per_gpu: get("throughput_per_gpu"),
            last_fifth_avg_jct_s: get("last_fifth_avg_jct_s"),
            p99_wait_s: get("p99_wait_s"),
            separations: get("separations") as u64,
            claims: get("claims") as u64,
        },
        v,
    ))
}

fn compare(plain: &Path, daemons: &Path, simulated: Option<&Path>, format: &str) -> Result<(), String> {
    let (p, pv) = summary_of(plain)?;
    let (d, dv) = summary_of(daemons)?;
    let sim: Vec<Value> = match simulated {
        Some(path) => serde_json::from_str(&read(path)?).map_err(|e| format!("{}: {e}", path.display()))?,
        None => Vec::new(),
    };
    let sim_of = |policy: &str| {
        sim.iter()
            .find(|s| s.get("policy").and_then(Value::as_str) == Some(policy))
    };
    let (sp, sd) = (sim_of("first-fit"), sim_of("learned"));
    let ratio = d.avg_jct_s / p.avg_jct_s;
    let vs_sim = |run: &Summary, s: Option<&Value>| {
        s.and_then(|s| s.get("avg_jct_s"))
            .and_then(Value::as_f64)
            .map(|x| run.avg_jct_s / x - 1.0)
    };
    match format {
        "json" => {
            let out = json!({
                "plain": p,
                "daemons": d,
                "daemons_vs_plain_avg_jct": ratio,
                "simulated": { "first-fit": sp, "learned": sd },
                "plain_vs_simulated_avg_jct": vs_sim(&p, sp),
                "daemons_vs_simulated_avg_jct": vs_sim(&d, sd),
                "time_scale": dv.get("time_scale"),
                "wall_s": { "plain": pv.get("wall_s"), "daemons": dv.get("wall_s") },
            });
            println!("{}", serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?);
        }
        "table" => {
            let num = |v: Option<&Value>, k: &str| {
                v.and_then(|v| v.get(k))
                    .and_then(Value::as_f64)
                    .map_or("-".to_string(), |x| format!("{x:.0}"))
            };
            println!(
                "{:<24} {:>13} {:>10} {:>8}   {:>19} {:>17}",
                "trace seconds", "plain shards", "daemons", "ratio", "simulated first-fit", "simulated learned"
            );
            let rows: [(&str, f64, f64, &str); 5] = [
                ("average JCT", p.avg_jct_s, d.avg_jct_s, "avg_jct_s"),
                ("p50 JCT", p.p50_jct_s, d.p50_jct_s, "p50_jct_s"),
                ("p95 JCT", p.p95_jct_s, d.p95_jct_s, "p95_jct_s"),
                ("makespan", p.makespan_s, d.makespan_s, "makespan_s"),
                ("average wait", p.avg_wait_s, d.avg_wait_s, "avg_wait_s"),
            ];
            for (name, x, y, k) in rows {
                println!(
                    "{name:<24} {x:>13.0} {y:>10.0} {:>8.3}   {:>19} {:>17}",
                    y / x,
                    num(sp, k),
                    num(sd, k)
                );
            }
            println!(
                "{:<24} {:>13} {:>10} {:>8}   {:>19} {:>17}",
                "out-of-memory failures",
                p.oom_failures,
                d.oom_failures,
                "",
                num(sp, "oom_failures"),
                num(sd, "oom_failures")
            );
            println!(
                "{:<24} {:>13} {:>10} {:>8}   {:>19} {:>17}",
                "claims",
                p.claims,
                d.claims,
                "",
                num(sp, "claims"),
                num(sd, "claims")
            );
            println!(
                "{:<24} {:>13} {:>10} {:>8}   {:>19} {:>17}",
                "given back to run apart",
                p.separations,
                d.separations,
                "",
                num(sp, "separations"),
                num(sd, "separations")
            );
            println!("daemons vs plain shards: {:+.1}% average JCT", 100.0 * (ratio - 1.0));
            if let (Some(a), Some(b)) = (vs_sim(&p, sp), vs_sim(&d, sd)) {
                println!(
                    "emulated vs simulated average JCT: plain {:+.1}% (first-fit), daemons {:+.1}% (learned)",
                    100.0 * a,
                    100.0 * b
                );
            }
        }
        "csv" => {
            let sim = |v: Option<&Value>, k: &str| {
                v.and_then(|v| v.get(k))
                    .and_then(Value::as_f64)
                    .map_or(String::new(), |x| format!("{x:.1}"))
            };
            println!("plain_avg_jct_s,daemons_avg_jct_s,plain_p95_jct_s,daemons_p95_jct_s,plain_oom_failures,daemons_oom_failures,simulated_first_fit_avg_jct_s,simulated_learned_avg_jct_s,simulated_first_fit_oom_failures,simulated_learned_oom_failures,daemons_claims,daemons_separations");
            println!(
                "{:.1},{:.1},{:.1},{:.1},{},{},{},{},{},{},{},{}",
                p.avg_jct_s,
                d.avg_jct_s,
                p.p95_jct_s,
                d.p95_jct_s,
                p.oom_failures,
                d.oom_failures,
                sim(sp, "avg_jct_s"),
                sim(sd, "avg_jct_s"),
                sim(sp, "oom_failures"),
                sim(sd, "oom_failures"),
                d.claims,
                d.separations
            );
        }
        "words" => println!("{}", verdict(&p, &d)),
        other => return Err(format!("--format {other}: use table, json, csv or words")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::actions_in_logs;

    #[test]
    fn claims_and_separations_are_counted_from_the_lines_each_daemon_logs() {
        let dir = tempfile::tempdir().unwrap();
        let line =
            |target: &str, what: &str| format!("2026-11-25T04:04:44.650599Z  INFO multiplexd::{target}: {what}\n");
        let n1 = [
            line("claimer", "claimed job=25 node=n1 gpu=v100_0"),
            line("claimer", "claiming works again"),
            line("claimer", "claimed job=26 node=n2 gpu=v100_1"),
        ];
        let n2 = [
            line(
                "claimer",
                "refused: no GPU of the cluster could ever hold it job=7 reason=too big",
            ),
            line(
                "separate",
                "requeued to run apart: measured beside a (job 3) job=4 gpu=0",
            ),
        ];
        std::fs::write(dir.path().join("multiplexd-n1.log"), n1.concat()).unwrap();
        std::fs::write(dir.path().join("multiplexd-n2.log"), n2.concat()).unwrap();
        // Slurm's own logs beside them are not the daemons'.
        std::fs::write(
            dir.path().join("slurmctld.log"),
            line("claimer", "claimed job=1 node=n1 gpu=x"),
        )
        .unwrap();
        assert_eq!(actions_in_logs(dir.path()).unwrap(), (2, 1));
        let e = actions_in_logs(&dir.path().join("missing")).unwrap_err();
        assert!(e.contains("missing"), "{e}");
    }
}
