//! Benchmark: the daemon against a hostile local user, at full size. Runs the real
//! `multiplexd serve` under `ulimit -n 1024` and prints, for each abuse, what root (slurmstepd)
//! still got and what the daemon paid:
//!
//! 1. malformed frames from an unprivileged uid, while root places and finishes jobs: crashes,
//!    log lines and bytes added, root's place+finish p99;
//! 2. hostile connections from an unprivileged uid (idle, a byte of a frame, 256 KiB frames half
//!    sent), held while root places and finishes: root's requests refused or timed out, the
//!    daemon's resident memory during and after;
//! 3. kill -9 restarts under load: acknowledged jobs lost, slots leaked, integrity.
//!
//! Targets (issue 22): 1,000,000 frames: 0 crashes, at most 100 log lines and 1 MB of log,
//! p99 at most 20 ms; 10,000 connections: nothing of root's refused or timed out, at most 64 MB
//! during and 20 MB after; 100 restarts: nothing lost or leaked, integrity ok.
//!
//! Needs root (the hostile client runs as nobody, uid 65534).
//!
//! cargo bench -p multiplexd --bench hostile [-- FRAMES CONNECTIONS RESTARTS]

use multiplex_protocol::wire::{self, MAX_FRAME};
use multiplex_protocol::{client, FinishRequest, Request, Response, StartRequest};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// slurmstepd's wait for the daemon (the SPANK plugin's default `timeout_ms`).
const STEPD_WAIT: Duration = Duration::from_secs(2);
const NOBODY: u32 = 65534;
const GPUS: u32 = 4;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    if args.first().map(String::as_str) == Some("--client") {
        return hostile_client(&args[1..]);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("hostile: needs root, to run the hostile client as another user");
        std::process::exit(1);
    }
    let num = |i: usize, default: u64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (frames, conns, restarts) = (num(0, 1_000_000), num(1, 10_000), num(2, 100));
    let dir = tempfile::tempdir().unwrap();
    // Others (the hostile client) may reach the socket.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let d = Daemon::new(dir.path());

    println!("multiplexd under ulimit -n 1024, hostile client uid {NOBODY}");
    // 1. Malformed frames.
    let mut daemon = d.start();
    let log_before = std::fs::metadata(&d.log).map(|m| m.len()).unwrap_or(0);
    let lines_before = std::fs::read_to_string(&d.log).unwrap_or_default().lines().count();
    let started = Instant::now();
    let mut client = d.client(&["frames", &frames.to_string()], 0);
    let load = d.load_while(|| client.try_wait().unwrap().is_none());
    let took = started.elapsed();
    let crashed = daemon.try_wait().unwrap().is_some();
    let text = std::fs::read_to_string(&d.log).unwrap_or_default();
    // What the abuse added (warnings and errors), apart from the info lines of root's jobs.
    let added: Vec<&str> = text.lines().skip(lines_before).collect();
    let abuse: Vec<&&str> = added
        .iter()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    println!(
        "{frames} malformed frames in {:.0} s: daemon {}, log +{} lines +{} bytes about them (besides {} info \
         lines of root's jobs, {} bytes in all); root place+finish p99 {:.2} ms ({} pairs, {} failed)   \
         targets: 0 crashes, <= 100 lines, <= 1 MB, p99 <= 20 ms",
        took.as_secs_f64(),
        if crashed { "CRASHED" } else { "up" },
        abuse.len(),
        abuse.iter().map(|l| l.len() + 1).sum::<usize>(),
        added.len() - abuse.len(),
        std::fs::metadata(&d.log)
            .map(|m| m.len())
            .unwrap_or(0)
            .saturating_sub(log_before),
        load.p99_ms(),
        load.done,
        load.failed
    );

    // 2. Hostile connections, held for 20 s while root works.
    let rss_idle = rss_mb(daemon.id());
    let mut client = d.client(&["conns", &conns.to_string(), "20"], conns + 64);
    let peak = Arc::new(std::sync::Mutex::new(0.0f64));
    let pid = daemon.id();
    let p = Arc::clone(&peak);
    let load = d.load_while(|| {
        let mut m = p.lock().unwrap();
        *m = m.max(rss_mb(pid));
        client.try_wait().unwrap().is_none()
    });
    std::thread::sleep(Duration::from_secs(3));
    let crashed = daemon.try_wait().unwrap().is_some();
    println!(
        "{conns} hostile connections held 20 s: daemon {}; root: {} place+finish pairs, {} refused or timed out, p99 {:.2} ms; \
         resident memory {:.1} MB before, {:.1} MB peak, {:.1} MB after   targets: 0 refused, <= 64 MB, <= 20 MB after",
        if crashed { "CRASHED" } else { "up" },
        load.done,
        load.failed,
        load.p99_ms(),
        rss_idle,
        *peak.lock().unwrap(),
        rss_mb(pid)
    );
    let _ = daemon.kill();
    let _ = daemon.wait();

    // 3. kill -9 under load.
    let mut placed = std::collections::BTreeSet::new();
    let mut finished = std::collections::BTreeSet::new();
    let mut next_job = 1_000_000u32;
    // Jobs still running when a daemon was killed: their ends come in the next round.
    let mut running = std::collections::VecDeque::new();
    let mut rng = 0x9e37_79b9_u64;
    for _ in 0..restarts {
        let mut daemon = d.start();
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let socket = d.socket.clone();
        let first = next_job;
        let mut carried = std::mem::take(&mut running);
        let worker = std::thread::spawn(move || {
            let (mut placed, mut finished) = (Vec::new(), Vec::new());
            let mut job = first;
            while !s.load(Ordering::SeqCst) {
                if carried.len() >= (GPUS * 2) as usize {
                    let old = carried.pop_front().unwrap();
                    match client::call(&socket, STEPD_WAIT, finish(old)) {
                        Ok(Response::Finished) => finished.push(old),
                        _ => {
                            carried.push_front(old);
                            break;
                        }
                    }
                }
                match client::call(&socket, STEPD_WAIT, place(job)) {
                    Ok(Response::Started(_)) => {
                        placed.push(job);
                        carried.push_back(job);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
                job += 1;
            }
            (placed, finished, job, carried)
        });
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(100 + rng % 200));
        let _ = daemon.kill(); // SIGKILL
        let _ = daemon.wait();
        stop.store(true, Ordering::SeqCst);
        let (p, f, j, r) = worker.join().unwrap();
        placed.extend(p);
        finished.extend(f);
        running = r;
        next_job = j + 1;
    }
    // Every acknowledged job is in the history; no job whose end was acknowledged holds a slot.
    let mut daemon = d.start();
    let holding: std::collections::BTreeSet<u32> = match client::call(&d.socket, STEPD_WAIT, Request::Status) {
        Ok(Response::Status(s)) => s.gpus.iter().flat_map(|g| g.tasks.iter().map(|t| t.job_id)).collect(),
        other => panic!("{other:?}"),
    };
    let _ = daemon.kill();
    let _ = daemon.wait();
    let db = rusqlite::Connection::open(d.dir.join("h.sqlite")).unwrap();
    let recorded = |job: u32, ended: bool| -> bool {
        let sql = if ended {
            "SELECT count(*) FROM jobs WHERE job_id = ?1 AND finished_at IS NOT NULL"
        } else {
            "SELECT count(*) FROM jobs WHERE job_id = ?1"
        };
        db.query_row(sql, [job], |r| r.get::<_, i64>(0)).unwrap() > 0
    };
    let lost = placed.iter().filter(|&&j| !recorded(j, false)).count()
        + finished.iter().filter(|&&j| !recorded(j, true)).count();
    let leaked = holding.iter().filter(|j| finished.contains(j)).count();
    let integrity: String = db.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    println!(
        "{restarts} kill -9 restarts under load: {} placements and {} ends acknowledged, {lost} lost, {leaked} slots leaked, \
         integrity {integrity}   targets: 0 lost, 0 leaked, ok",
        placed.len(),
        finished.len()
    );
}

struct Daemon {
    dir: PathBuf,
    config: PathBuf,
    socket: PathBuf,
    log: PathBuf,
}

impl Daemon {
    fn new(dir: &Path) -> Daemon {
        let config = dir.join("multiplexd.toml");
        let mut text = format!(
            "node = \"n1\"\nsocket = \"{d}/d.sock\"\ndatabase = \"{d}/h.sqlite\"\njobs_per_gpu = 2\nslurm_user = \"root\"\n\
             slurm_bin = \"{d}/no-slurm\"\n[reconcile]\ninterval_s = 0\n",
            d = dir.display()
        );
        for g in 0..GPUS {
            text.push_str(&format!("[[gpu]]\nindex = {g}\nmodel = \"v100\"\nmemory_mb = 16384\n"));
        }
        std::fs::write(&config, text).unwrap();
        Daemon {
            dir: dir.to_path_buf(),
            config,
            socket: dir.join("d.sock"),
            log: dir.join("daemon.log"),
        }
    }

    /// `multiplexd serve` with a hard limit of 1,024 open files, once it answers.
    fn start(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_multiplexd"));
        cmd.args(["serve", "--config"]).arg(&self.config).stderr(log);
        // SAFETY: setrlimit is async-signal-safe; the struct lives across the call.
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 1024,
                    rlim_max: 1024,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        for _ in 0..400 {
            if client::call(&self.socket, STEPD_WAIT, Request::Status).is_ok() {
                return child;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("multiplexd did not come up");
    }

    /// This benchmark as the hostile client, as nobody, with `files` open files allowed.
    fn client(&self, args: &[&str], files: u64) -> Child {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.arg("--client").args(args).arg(&self.socket);
        if files > 0 {
            // SAFETY: as in `start`; root raises the limit before the child drops to nobody.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: files,
                        rlim_max: files,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd.uid(NOBODY).gid(NOBODY).spawn().unwrap()
    }

    /// Places and finishes jobs as root, as slurmstepd would, while `go()`.
    fn load_while(&self, mut go: impl FnMut() -> bool) -> Load {
        let mut load = Load::default();
        let mut job = 1u32;
        while go() {
            let t = Instant::now();
            let ok = matches!(
                client::call(&self.socket, STEPD_WAIT, place(job)),
                Ok(Response::Started(_))
            ) && matches!(
                client::call(&self.socket, STEPD_WAIT, finish(job)),
                Ok(Response::Finished)
            );
            if ok {
                load.ms.push(t.elapsed().as_secs_f64() * 1e3);
                load.done += 1;
            } else {
                load.failed += 1;
            }
            job += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        load
    }
}

#[derive(Default)]
struct Load {
    ms: Vec<f64>,
    done: u64,
    failed: u64,
}

impl Load {
    fn p99_ms(&self) -> f64 {
        let mut v = self.ms.clone();
        if v.is_empty() {
            return f64::NAN;
        }
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 * 0.99) as usize).min(v.len() - 1)]
    }
}

fn place(job_id: u32) -> Request {
    // An application per job: the restarts' compaction (which keeps each application's
    // latest jobs) then deletes no job the restart check counts.
    Request::Start(StartRequest {
        step_id: 0xffff_fffb,
        ..StartRequest::new(job_id, 1000, format!("app{job_id}"), "n1", job_id % 2)
    })
}

fn finish(job_id: u32) -> Request {
    Request::Finish(FinishRequest {
        job_id,
        step_id: 0xffff_fffb,
        exit_status: 0,
    })
}

fn rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The hostile side: `frames N SOCKET` or `conns N HOLD_S SOCKET`.
fn hostile_client(args: &[String]) {
    let frame = |json: &str| {
        let mut v = (json.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v
    };
    match args {
        [mode, n, socket] if mode == "frames" => {
            let kinds = [
                frame(r#"{"version":2,"request":{"type":"x\nINFO multiplexd: forged"}}"#),
                frame("this is not json"),
                frame(r#"{"version":7,"request":{"type":"status"}}"#),
                u32::MAX.to_be_bytes().to_vec(),
                vec![0, 0],
            ];
            for i in 0..n.parse::<usize>().unwrap() {
                let Ok(mut s) = UnixStream::connect(socket) else {
                    continue;
                };
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = s.write_all(&kinds[i % kinds.len()]);
                let _ = s.shutdown(std::net::Shutdown::Write);
                let _ = wire::read_frame_bytes(&mut s);
            }
        }
        [mode, n, hold, socket] if mode == "conns" => {
            let mut held = Vec::new();
            for i in 0..n.parse::<usize>().unwrap() {
                let Ok(mut s) = UnixStream::connect(socket) else {
                    continue;
                };
                let _ = s.set_nonblocking(true);
                match i % 3 {
                    0 => {}
                    1 => {
                        let _ = s.write_all(&[0]);
                    }
                    _ => {
                        let _ = s.write_all(&((MAX_FRAME - 1) as u32).to_be_bytes());
                        let _ = s.write_all(&vec![b'x'; 128 * 1024]);
                    }
                }
                held.push(s);
            }
            std::thread::sleep(Duration::from_secs(hold.parse().unwrap()));
        }
        _ => {
            eprintln!("hostile client: frames N SOCKET | conns N HOLD_S SOCKET");
            std::process::exit(2);
        }
    }
}
