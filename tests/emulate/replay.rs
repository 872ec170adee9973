//! `multiplex-emulate`: replays a job trace on the running local cluster with stand-in jobs
//! (`multiplex-standin`) and measures what users would: job completion times, makespan,
//! out-of-memory failures. `tests/emulate/run` calls it once with the daemons deciding and
//! once with Slurm's own shard placement, then `compare` prints both side by side.
//!
//! Each trace job is submitted at its (scaled) arrival time as
//! `sbatch --multiplex=app=NAME --gres=gpu:1`; one that dies of out-of-memory is submitted
//! again two minutes (scaled) later, as `multiplex-simulate --resubmit-after 120` does.
//! Times are reported in the trace's seconds (real seconds x the time scale), so that they
//! compare with what `multiplex-simulate` predicts for the same trace.

use clap::{Parser, Subcommand};
use compare::compare;
use multiplex_simulate::input::{parse_trace, Table, TraceJob};
use multiplex_simulate::summarise;
use multiplex_simulate::world::{Failures, Outcome, OOM_AFTER_S};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod compare;

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

/// What the daemons' logs under `dir` say they did: (claims, jobs given back to run apart,
/// jobs put back after running out of memory beside a partner), each counted by the line its
/// daemon logs for it (`tracing`'s message text).
fn actions_in_logs(dir: &Path) -> Result<(u64, u64, u64), String> {
    let mut counts = (0, 0, 0);
    let entries = fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("multiplexd-") && name.ends_with(".log")) {
            continue;
        }
        let text = fs::read_to_string(e.path()).map_err(|err| format!("{}: {err}", e.path().display()))?;
        for line in text.lines() {
            // The claimer's thread logs it (`multiplexd::claimer::thread`).
            if line.contains(" multiplexd::claimer") && line.contains(": claimed job=") {
                counts.0 += 1;
            } else if line.contains(" requeued to run apart: ") {
                counts.1 += 1;
            } else if line.contains(" multiplexd::server") && line.contains(": put back job=") {
                counts.2 += 1;
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
    let mut r = Replay::new(a)?;
    eprintln!(
        "emulate {}: {} jobs, time scale {} (trace seconds per real second), results in {}",
        a.label,
        r.jobs.len(),
        a.time_scale,
        a.dir.display()
    );
    let mut last_poll = Instant::now() - Duration::from_secs(10);
    loop {
        r.submit_due()?;
        // Collect what ended; the queue is read once a second.
        let poll_queue = last_poll.elapsed() >= Duration::from_secs(1);
        if poll_queue {
            last_poll = Instant::now();
            r.squeued = queued()?;
        }
        r.collect(poll_queue)?;
        if r.jobs.iter().all(|j| j.done.is_some()) {
            break;
        }
        if r.started.elapsed().as_secs_f64() > a.timeout {
            return Err(r.give_up());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    r.write_results()
}

/// One replay under way.
struct Replay<'a> {
    a: &'a ReplayArgs,
    table: Table,
    /// The table, the stand-in and the stand-ins' registry, as absolute paths.
    table_abs: PathBuf,
    standin: PathBuf,
    registry: PathBuf,
    jobs: Vec<Job>,
    started: Instant,
    /// The Unix time of `started`.
    t0: f64,
    ooms: u64,
    lost: Vec<String>,
    runs: Vec<Ran>,
    /// The jobs squeue last listed.
    squeued: HashSet<u32>,
}

impl<'a> Replay<'a> {
    /// Reads the table and trace, and empties the results' folder.
    fn new(a: &'a ReplayArgs) -> Result<Replay<'a>, String> {
        let conf =
            std::env::var("SLURM_CONF").map_err(|_| "SLURM_CONF is not set: start the cluster (tests/cluster/up)")?;
        let state = Path::new(&conf)
            .parent()
            .and_then(Path::parent)
            .ok_or("SLURM_CONF is not <state>/etc/slurm.conf")?
            .to_path_buf();
        let table = Table::parse(&read(&a.table)?, &a.table.display().to_string())?;
        let trace = parse_trace(&read(&a.trace)?, &a.trace.display().to_string(), &table)?;
        let absolute = |p: &Path| fs::canonicalize(p).map_err(|e| format!("{}: {e}", p.display()));
        let registry = state.join("emulate").join("registry");
        let _ = fs::remove_dir_all(&a.dir);
        for dir in [&a.dir, &registry] {
            fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let jobs = trace
            .into_iter()
            .map(|t| Job {
                due: t.submit_s / a.time_scale,
                trace: t,
                attempts: 0,
                running: None,
                done: None,
            })
            .collect();
        Ok(Replay {
            a,
            table_abs: absolute(&a.table)?,
            standin: absolute(&a.standin)?,
            table,
            registry,
            jobs,
            started: Instant::now(),
            t0: unix_now(),
            ooms: 0,
            lost: Vec::new(),
            runs: Vec::new(),
            squeued: HashSet::new(),
        })
    }

    /// Real seconds since the start.
    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Submits every job that is due.
    fn submit_due(&mut self) -> Result<(), String> {
        let now = self.now();
        for k in 0..self.jobs.len() {
            let j = &self.jobs[k];
            if j.done.is_none() && j.running.is_none() && j.due <= now {
                let attempt = self.submit(k)?;
                self.squeued.insert(attempt.slurm_id);
                self.jobs[k].running = Some(attempt);
            }
        }
        Ok(())
    }

    /// Submits job `k` again (its next attempt), as its user would: `sbatch --multiplex`.
    fn submit(&mut self, k: usize) -> Result<Attempt, String> {
        let (a, scale) = (self.a, self.a.time_scale);
        let j = &mut self.jobs[k];
        j.attempts += 1;
        let name = format!("{}.{}", j.trace.id, j.attempts);
        let result = a.dir.join(format!("{name}.json"));
        let out = a.dir.join(format!("{name}.out"));
        let app = &self.table.apps[j.trace.app];
        let wrap = format!(
            "exec {} --app {} --work {:.4} --table {} --registry {} --result {} --report-every {:.4} --oom-after {:.4}",
            sh(&self.standin.display().to_string()),
            sh(app),
            j.trace.solo_runtime_s / scale,
            sh(&self.table_abs.display().to_string()),
            sh(&self.registry.display().to_string()),
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
        match text.trim().split(';').next().and_then(|s| s.parse::<u32>().ok()) {
            Some(slurm_id) if output.status.success() => Ok(Attempt {
                slurm_id,
                result,
                out,
                gone_since: None,
            }),
            _ => Err(format!(
                "sbatch refused trace job {}: {}",
                j.trace.id,
                String::from_utf8_lossy(&output.stderr).trim()
            )),
        }
    }

    /// Takes in what ended: a stand-in's result, or (where the queue was just read) a job
    /// gone from the queue without one for 5 s, which is lost and submitted again.
    fn collect(&mut self, poll_queue: bool) -> Result<(), String> {
        let requeue_s = Failures::QUICK.resubmit_after_s / self.a.time_scale;
        for k in 0..self.jobs.len() {
            let Some(at) = &self.jobs[k].running else { continue };
            if at.result.exists() {
                let (ran, ok) = self.result_of(at)?;
                let now = self.now();
                let j = &mut self.jobs[k];
                if ok {
                    j.done = Some((ran.start, ran.end));
                } else {
                    self.ooms += 1;
                    j.due = now + requeue_s;
                }
                self.runs.push(ran);
                j.running = None;
            } else if poll_queue && !self.squeued.contains(&at.slurm_id) {
                // Gone from the queue without a result: give the file a moment, then call it lost.
                let now = self.now();
                let j = &mut self.jobs[k];
                let Some(at) = j.running.as_mut() else { continue };
                let since = *at.gone_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(5) {
                    let tail: String = fs::read_to_string(&at.out)
                        .unwrap_or_default()
                        .lines()
                        .rev()
                        .take(3)
                        .collect::<Vec<_>>()
                        .join(" | ");
                    self.lost
                        .push(format!("trace job {} (Slurm job {}): {tail}", j.trace.id, at.slurm_id));
                    j.running = None;
                    j.due = now + requeue_s;
                    if j.attempts >= 5 {
                        return Err(format!("gave up: {}", self.lost.join("; ")));
                    }
                }
            }
        }
        Ok(())
    }

    /// A finished attempt's run, from its stand-in's result file, and whether it completed.
    fn result_of(&self, at: &Attempt) -> Result<(Ran, bool), String> {
        let v: Value = serde_json::from_str(&read(&at.result)?)
            .map_err(|e| format!("{}: not a stand-in result: {e}", at.result.display()))?;
        let field = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let text = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
        let ran = Ran {
            node_gpu: format!("{}/{}", text("node"), text("gpu")),
            start: field("start_unix") - self.t0,
            end: field("end_unix") - self.t0,
        };
        Ok((ran, v.get("status").and_then(Value::as_str) == Some("ok")))
    }

    /// Cancels what runs after the timeout; the error says how far it got.
    fn give_up(&self) -> String {
        let ids: Vec<String> = (self.jobs.iter())
            .filter_map(|j| j.running.as_ref().map(|r| r.slurm_id.to_string()))
            .collect();
        if !ids.is_empty() {
            let _ = Command::new("scancel").args(&ids).status();
        }
        format!(
            "timed out after {:.0} s with {} of {} jobs done",
            self.a.timeout,
            self.jobs.iter().filter(|j| j.done.is_some()).count(),
            self.jobs.len()
        )
    }

    /// Writes the replay's results (JSON) and says them in one line.
    fn write_results(&self) -> Result<(), String> {
        let (a, scale) = (self.a, self.a.time_scale);
        let wall_s = self.now();
        // Not seen from the jobs' side: the daemons log each claim and each job given back.
        let (claims, separations, put_back) = match &a.daemon_logs {
            Some(dir) => actions_in_logs(dir)?,
            None => (0, 0, 0),
        };
        let outcome = Outcome {
            jobs: (self.jobs.iter())
                .map(|j| {
                    let (s, e) = j.done.expect("every job is done");
                    (j.trace.submit_s, s * scale, e * scale)
                })
                .collect(),
            oom_failures: self.ooms,
            // The stand-in fails the newcomer, which has done no work yet: no resident dies.
            resident_failures: 0,
            lost_work_s: 0.0,
            put_back,
            separations,
            claims,
            speed_seconds: self.jobs.iter().map(|j| j.trace.solo_runtime_s).sum(),
            busy_seconds: busy_seconds(&self.runs) * scale,
        };
        let run = summarise(&a.label, &outcome);
        let result = json!({
            "summary": run.summary,
            "time_scale": scale,
            "wall_s": wall_s,
            "lost": self.lost,
            "jct_s": run.jct,
        });
        fs::write(
            &a.out,
            serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("cannot write {}: {e}", a.out.display()))?;
        eprintln!(
            "emulate {}: {} jobs in {wall_s:.0} s; average JCT {:.0} s (trace seconds), {} out-of-memory failures, {} put back, {} claims",
            a.label,
            self.jobs.len(),
            run.summary.avg_jct_s,
            self.ooms,
            put_back,
            claims
        );
        Ok(())
    }
}

/// Busy time over every GPU, real seconds: the union of each GPU's runs (failed ones too).
fn busy_seconds(runs: &[Ran]) -> f64 {
    let mut by_gpu: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
    for r in runs {
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
    busy
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

#[cfg(test)]
mod tests {
    use super::actions_in_logs;

    #[test]
    fn claims_separations_and_put_backs_are_counted_from_the_lines_each_daemon_logs() {
        let dir = tempfile::tempdir().unwrap();
        let line =
            |target: &str, what: &str| format!("2026-11-25T04:04:44.650599Z  INFO multiplexd::{target}: {what}\n");
        let n1 = [
            line("claimer::thread", "claimed job=25 node=n1 gpu=v100_0"),
            line("claimer::thread", "claiming works again"),
            line("claimer::thread", "claimed job=26 node=n2 gpu=v100_1"),
        ];
        let n2 = [
            line(
                "claimer::thread",
                "refused: no GPU of the cluster could ever hold it job=7 reason=too big",
            ),
            line(
                "separate",
                "requeued to run apart: measured beside a (job 3) job=4 gpu=0",
            ),
            line(
                "server",
                "put back job=9: ran out of GPU memory beside a partner job=9 beside=[\"a\"] gpu=1",
            ),
            line(
                "server",
                "job 10 is not put back in the queue: it may not be requeued (--no-requeue)",
            ),
        ];
        std::fs::write(dir.path().join("multiplexd-n1.log"), n1.concat()).unwrap();
        std::fs::write(dir.path().join("multiplexd-n2.log"), n2.concat()).unwrap();
        // Slurm's own logs beside them are not the daemons'.
        std::fs::write(
            dir.path().join("slurmctld.log"),
            line("claimer::thread", "claimed job=1 node=n1 gpu=x"),
        )
        .unwrap();
        assert_eq!(actions_in_logs(dir.path()).unwrap(), (2, 1, 1));
        let e = actions_in_logs(&dir.path().join("missing")).unwrap_err();
        assert!(e.contains("missing"), "{e}");
    }
}
