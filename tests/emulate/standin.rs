//! `multiplex-standin`: a stand-in training job for the local test cluster, whose fake GPUs
//! otherwise let jobs share for free. It "trains" in short ticks at the speed a pair table
//! gives for whoever shares its GPU now (1.0 alone), so that sharing a GPU costs what it cost
//! on the real GPU the table was measured on, and the daemons have something real to learn.
//!
//! Its GPU is the node (`SLURMD_NODENAME`) and the GPU Slurm allocated (`SLURM_JOB_GPUS`, the
//! node's own index: inside the job's device cgroup `CUDA_VISIBLE_DEVICES` counts from 0). Jobs on one GPU find each other in a registry directory:
//! one file per running job, held under an exclusive `flock` for the job's life, so a job
//! killed mid-run (scancel, a crash) stops counting at once and its file is cleared by the
//! next job that looks. The emulated world is the one of `multiplex-simulate`: speed beside
//! several partners is the product of the pair speeds; a newcomer beside a partner the table
//! says it cannot share with does no work, slows no one, and fails after `--oom-after`
//! seconds with a CUDA-style out-of-memory message (the incumbent keeps running), unless
//! every job it cannot share with has left by then: then it runs on. Doomed jobs hold no
//! memory for good, so they doom no newcomer.
//!
//! Like a real job that opts in, it reports its progress (and its out-of-memory failure) to
//! the node's daemon over `MULTIPLEX_SOCKET` when that is set.

use clap::Parser;
use multiplex_protocol::{client, ReportKind, ReportRequest, Request, Response};
use multiplex_simulate::input::Table;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Parser)]
#[command(
    name = "multiplex-standin",
    about = "A stand-in training job whose speed follows a pair table"
)]
struct Args {
    /// The application it stands in for (a name of the pair table).
    #[arg(long)]
    app: String,
    /// Its work, in seconds it would take alone.
    #[arg(long)]
    work: f64,
    /// Pair table, CSV `gpu,job_a,job_b,speed_a,speed_b`.
    #[arg(long)]
    table: PathBuf,
    /// The registry of running stand-in jobs (one per cluster, under its state directory).
    #[arg(long)]
    registry: PathBuf,
    /// Where to write the outcome (JSON), for the runner.
    #[arg(long)]
    result: Option<PathBuf>,
    /// Seconds between progress reports to the daemon (0: none).
    #[arg(long, default_value_t = 0.0)]
    report_every: f64,
    /// Seconds after its start a job that cannot share with its partner fails.
    #[arg(long, default_value_t = 3.0)]
    oom_after: f64,
    /// Length of one training tick, milliseconds.
    #[arg(long, default_value_t = 20)]
    tick_ms: u64,
    /// The node (default: $SLURMD_NODENAME).
    #[arg(long)]
    node: Option<String>,
    /// The GPU (default: the first of $SLURM_JOB_GPUS).
    #[arg(long)]
    gpu: Option<String>,
    /// The job id (default: $SLURM_JOB_ID).
    #[arg(long)]
    job: Option<u32>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("multiplex-standin: {e}");
            ExitCode::from(2)
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn run(a: &Args) -> Result<ExitCode, String> {
    if !(a.work.is_finite() && a.work > 0.0) {
        return Err(format!("--work {}: must be a positive number of seconds", a.work));
    }
    let (table, me) = table_and_app(a)?;
    let (node, gpu, job) = whereabouts(a)?;
    let dir = a.registry.join(&node).join(format!("gpu{gpu}"));
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;

    let (entry, doomed, first_partners) = join(&dir, job, (&table, me), &a.app)?;
    let started = Instant::now();
    let start_unix = unix_now();
    let names = |ps: &[Resident]| {
        ps.iter()
            .map(|p| format!("{}({})", p.job, p.app))
            .collect::<Vec<_>>()
            .join(",")
    };
    println!(
        "standin: job {job} app {} on {node} GPU {gpu}, {:.1} s of work, beside [{}]",
        a.app,
        a.work,
        names(&first_partners)
    );
    if let Some(why) = env("MULTIPLEX_DECISION") {
        println!("standin: decision: {why}");
    }
    let doomed = doomed && !wait_for_rescue(&dir, job, &table, me, &entry, &a.app, a.oom_after, tick(a))?;
    let outcome = live(
        a,
        (&dir, job, &gpu),
        (&table, me),
        doomed,
        &names(&first_partners),
        started,
    );
    let end_unix = unix_now();
    drop(entry);
    // Put back, Slurm ends this run as requeued: the next run writes the result.
    if let Some(path) = a.result.as_ref().filter(|_| outcome != "put-back") {
        let result = serde_json::json!({
            "job_id": job,
            "app": a.app,
            "node": node,
            "gpu": gpu,
            "status": outcome,
            "start_unix": start_unix,
            "end_unix": end_unix,
            "partners_at_start": first_partners.iter().map(|p| p.job).collect::<Vec<_>>(),
        });
        write_atomically(path, &result.to_string())?;
    }
    Ok(if outcome == "ok" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The pair table, and the index of the job's application in it.
fn table_and_app(a: &Args) -> Result<(Table, usize), String> {
    let text = fs::read_to_string(&a.table).map_err(|e| format!("cannot read {}: {e}", a.table.display()))?;
    let table = Table::parse(&text, &a.table.display().to_string())?;
    let me = table
        .app_index(&a.app)
        .ok_or_else(|| format!("app {:?} is not in the pair table {}", a.app, a.table.display()))?;
    Ok((table, me))
}

/// Joins the GPU whose registry is `dir`: looks at who is there and registers, under the
/// GPU's lock, so that of two jobs starting together exactly one is the newcomer. Its entry,
/// whether it is doomed (beside a partner it cannot share with), and who was there.
fn join(dir: &Path, job: u32, (table, me): (&Table, usize), app: &str) -> Result<(Entry, bool, Vec<Resident>), String> {
    let _gpu_lock = Locked::exclusive(&dir.join(".lock"))?;
    let partners = residents(dir, job);
    let doomed = clashes(table, me, &partners);
    Ok((Entry::register(dir, job, app, doomed)?, doomed, partners))
}

/// One tick of training.
fn tick(a: &Args) -> Duration {
    Duration::from_millis(a.tick_ms.max(1))
}

/// The job's life once it joined its GPU: `doomed` (beside a partner it cannot share with,
/// `partners`, and not rescued), it fails out of memory at once; else it trains (`started`:
/// when it joined). Its status: `ok`, `oom`, or `put-back` (the daemon put it back in the
/// queue: it runs again).
fn live(
    a: &Args,
    (dir, job, gpu): (&Path, u32, &str),
    (table, me): (&Table, usize),
    doomed: bool,
    partners: &str,
    started: Instant,
) -> &'static str {
    let mut reporter = Reporter {
        socket: env("MULTIPLEX_SOCKET").map(PathBuf::from),
        job,
        errors: 0,
    };
    if doomed {
        eprintln!(
            "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU {gpu}; {} beside [{partners}] does not fit) [emulated by multiplex-standin]",
            a.app,
        );
        // As a training script that catches CUDA's error would: tell the daemon, and say
        // what it answered. Put back in the queue, the job runs again: no result yet.
        return match reporter.send(ReportKind::OutOfMemory) {
            Some(Response::Reported { message, put_back }) => {
                eprintln!("multiplexd: {message}");
                if put_back {
                    "put-back"
                } else {
                    "oom"
                }
            }
            _ => "oom",
        };
    }
    let speeds = train(a, (dir, job), (table, me), tick(a), &mut reporter);
    println!(
        "standin: done in {:.2} s ({:.2} alone), speeds {:?}",
        started.elapsed().as_secs_f64(),
        a.work,
        speeds
    );
    "ok"
}

/// The node, the GPU and the job: given, or as Slurm sets them for the job.
fn whereabouts(a: &Args) -> Result<(String, String, u32), String> {
    let node = a
        .node
        .clone()
        .or_else(|| env("SLURMD_NODENAME"))
        .ok_or("no --node given and SLURMD_NODENAME is not set: run this as a Slurm job")?;
    let gpu = a
        .gpu
        .clone()
        .or_else(|| env("SLURM_JOB_GPUS").map(|v| v.split(',').next().unwrap_or("").to_string()))
        .filter(|g| !g.is_empty() && g.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        .ok_or("no GPU: SLURM_JOB_GPUS is unset or not a device list, and no --gpu given")?;
    let job = a
        .job
        .or_else(|| env("SLURM_JOB_ID").and_then(|v| v.parse().ok()))
        .ok_or("no --job given and SLURM_JOB_ID is not set")?;
    Ok((node, gpu, job))
}

/// Reports to the node's daemon, where `MULTIPLEX_SOCKET` names it; says the first failure.
struct Reporter {
    socket: Option<PathBuf>,
    job: u32,
    errors: u32,
}

impl Reporter {
    /// Sends one report; the daemon's answer, if it gave one. An out-of-memory report waits
    /// longer: the daemon asks slurmctld to put the job back before it answers.
    fn send(&mut self, kind: ReportKind) -> Option<Response> {
        let s = self.socket.as_ref()?;
        let wait = match kind {
            ReportKind::OutOfMemory => Duration::from_secs(30),
            _ => Duration::from_secs(2),
        };
        let request = Request::Report(ReportRequest { job_id: self.job, kind });
        match client::call(s, wait, request) {
            Ok(answer) => Some(answer),
            Err(e) => {
                if self.errors == 0 {
                    eprintln!("standin: cannot report to the daemon at {}: {e}", s.display());
                }
                self.errors += 1;
                None
            }
        }
    }
}

/// Does the job's work, tick by tick at the speed beside whoever shares its GPU now (doomed
/// newcomers do no work and slow no one), reporting progress every `--report-every`; the
/// speeds it ran at, in order.
fn train(
    a: &Args,
    (dir, job): (&Path, u32),
    (table, me): (&Table, usize),
    tick: Duration,
    reporter: &mut Reporter,
) -> Vec<f64> {
    let mut done = 0.0;
    let mut last = Instant::now();
    let mut last_report = Instant::now();
    let mut speeds = Vec::new();
    while done < a.work {
        std::thread::sleep(tick);
        let now = Instant::now();
        let dt = now.duration_since(last).as_secs_f64();
        last = now;
        let speed: f64 = residents(dir, job)
            .iter()
            .filter(|p| !p.doomed)
            .filter_map(|p| table.app_index(&p.app))
            .map(|o| table.speed(me, o).unwrap_or(1.0))
            .product();
        if speeds.last() != Some(&speed) {
            speeds.push(speed);
        }
        done += dt * speed;
        if a.report_every > 0.0 && now.duration_since(last_report).as_secs_f64() >= a.report_every {
            last_report = now;
            reporter.send(ReportKind::Progress { done: done.min(a.work) });
        }
    }
    speeds
}

/// Whether app `me` cannot share with one of `partners` that keeps its memory (is not doomed).
fn clashes(table: &Table, me: usize, partners: &[Resident]) -> bool {
    partners
        .iter()
        .filter(|p| !p.doomed)
        .filter_map(|p| table.app_index(&p.app))
        .any(|o| table.speed(me, o).is_none())
}

/// A doomed job waits out `oom_after` seconds; if every job it cannot share with leaves
/// before then, it is rescued (its entry says so, under the GPU's lock) and runs on.
#[allow(clippy::too_many_arguments)]
fn wait_for_rescue(
    dir: &Path,
    job: u32,
    table: &Table,
    me: usize,
    entry: &Entry,
    app: &str,
    oom_after: f64,
    tick: Duration,
) -> Result<bool, String> {
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < oom_after {
        std::thread::sleep(tick);
        let _gpu_lock = Locked::exclusive(&dir.join(".lock"))?;
        if !clashes(table, me, &residents(dir, job)) {
            entry.mark_rescued(app)?;
            println!(
                "standin: rescued after {:.2} s: the jobs it could not share with have left",
                started.elapsed().as_secs_f64()
            );
            return Ok(true);
        }
    }
    Ok(false)
}

/// Writes `text` to `path` so that a reader sees all of it or nothing.
fn write_atomically(path: &Path, text: &str) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// A file held under `flock` until dropped.
struct Locked(File);

impl Locked {
    fn exclusive(path: &Path) -> Result<Locked, String> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(format!(
                "cannot lock {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
        Ok(Locked(f))
    }
}

/// This job's registry file: `<job>` holding `app doomed`, locked while the job lives.
struct Entry {
    path: PathBuf,
    lock: Locked,
}

impl Entry {
    fn register(dir: &Path, job: u32, app: &str, doomed: bool) -> Result<Entry, String> {
        // Locked under a hidden name first, then renamed: a reader never sees it unlocked.
        let tmp = dir.join(format!(".{job}.new"));
        let lock = Locked::exclusive(&tmp)?;
        (&lock.0)
            .write_all(format!("{app} {}\n", u8::from(doomed)).as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        let path = dir.join(job.to_string());
        fs::rename(&tmp, &path).map_err(|e| format!("cannot register in {}: {e}", dir.display()))?;
        Ok(Entry { path, lock })
    }

    /// No longer doomed: rewrites the flag in place (one write of the same length, so a
    /// reader sees the old line or the new one).
    fn mark_rescued(&self, app: &str) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        self.lock
            .0
            .write_all_at(format!("{app} 0\n").as_bytes(), 0)
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Another job on the same GPU.
struct Resident {
    job: u32,
    app: String,
    doomed: bool,
}

/// The live jobs registered on the GPU of `dir` other than `me`; files of jobs that died
/// without unregistering (nobody holds their lock) are removed.
fn residents(dir: &Path, me: u32) -> Vec<Resident> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(job) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if job == me {
            continue;
        }
        let Ok(f) = File::open(e.path()) else { continue };
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            // Nobody holds it: its job is gone.
            let _ = fs::remove_file(e.path());
            continue;
        }
        let text = fs::read_to_string(e.path()).unwrap_or_default();
        let mut fields = text.split_whitespace();
        if let (Some(app), Some(doomed)) = (fields.next(), fields.next()) {
            out.push(Resident {
                job,
                app: app.to_string(),
                doomed: doomed == "1",
            });
        }
    }
    out.sort_by_key(|r| r.job);
    out
}
