//! The real daemon on a real Unix socket with a temporary SQLite history: bad clients,
//! concurrent clients, and kill -9 with a restart.

use multiplex_protocol::wire::{self, RequestFrame, PROTOCOL_VERSION};
use multiplex_protocol::{client, FinishRequest, Request, Response, StartRequest};
use multiplexd::config::{Config, GpuSpec};
use multiplexd::node::{wall_clock, Node};
use multiplexd::server::{self, Access};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(5);

fn config_text(dir: &Path, slots: u32) -> String {
    format!(
        "node = \"n1\"\nsocket = \"{d}/d.sock\"\ndatabase = \"{d}/h.sqlite\"\njobs_per_gpu = {slots}\nslurm_user = \"root\"\n\
         slurm_bin = \"{d}/no-slurm\"\n[reconcile]\ninterval_s = 0\n[[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 16384\n[[gpu]]\nindex = 1\nmodel = \"v100\"\nmemory_mb = 16384\n",
        d = dir.display()
    )
}

/// A daemon served from a thread of this test, stopped on drop.
struct InProcess {
    socket: PathBuf,
    shutdown: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcess {
    fn start(dir: &Path, slots: u32) -> InProcess {
        let config = Config::parse(&config_text(dir, slots)).unwrap();
        let gpus = vec![
            GpuSpec {
                index: 0,
                model: "v100".into(),
                memory_mb: 16384,
                uuid: None,
            },
            GpuSpec {
                index: 1,
                model: "v100".into(),
                memory_mb: 16384,
                uuid: None,
            },
        ];
        let socket = config.socket.clone();
        let listener = server::bind(&socket).unwrap();
        let node = Arc::new(Mutex::new(Node::open(config, gpus, wall_clock()).unwrap()));
        let shutdown = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&shutdown);
        let thread = std::thread::spawn(move || {
            server::run(
                listener,
                node,
                Access {
                    privileged_uids: vec![],
                    private_jobs: Arc::new(AtomicBool::new(false)),
                    slurm: None,
                },
                s,
            )
        });
        InProcess {
            socket,
            shutdown,
            thread: Some(thread),
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        let _ = UnixStream::connect(&self.socket);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

/// Step 0 of `job_id` started where Slurm bound it: GPU 0 or 1, by the job id's parity.
fn start(job_id: u32, app: &str) -> Request {
    Request::Start(StartRequest::new(job_id, 1000, app, "n1", job_id % 2))
}

fn finish(job_id: u32) -> Request {
    Request::Finish(FinishRequest {
        job_id,
        step_id: 0,
        exit_status: 0,
    })
}

fn status_jobs(socket: &Path) -> Vec<(u32, u32)> {
    match client::call(socket, T, Request::Status).unwrap() {
        Response::Status(s) => s
            .gpus
            .iter()
            .flat_map(|g| g.tasks.iter().map(move |t| (t.job_id, g.index)))
            .collect(),
        other => panic!("{other:?}"),
    }
}

fn raw_exchange(socket: &Path, bytes: &[u8]) -> Option<Response> {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(bytes).unwrap();
    let _ = s.shutdown(std::net::Shutdown::Write);
    let body = wire::read_frame_bytes(&mut s).ok()??;
    wire::decode_response(&body).ok()
}

fn frame(json: &str) -> Vec<u8> {
    let mut v = (json.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(json.as_bytes());
    v
}

#[test]
fn bad_clients_get_an_error_and_everyone_else_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let d = InProcess::start(dir.path(), 2);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("oversized", (u32::MAX).to_be_bytes().to_vec(), "larger than"),
        ("garbage", frame("this is not json"), "malformed"),
        (
            "unknown request",
            frame(r#"{"version":2,"request":{"type":"launch_missiles"}}"#),
            "malformed",
        ),
        (
            "missing fields",
            frame(r#"{"version":2,"request":{"type":"start","job_id":1}}"#),
            "malformed",
        ),
        (
            "wrong version",
            frame(r#"{"version":7,"request":{"type":"status"}}"#),
            "version 7",
        ),
        (
            "truncated",
            {
                let mut f = frame(r#"{"version":2,"request":{"type":"status"}}"#);
                f.truncate(10);
                f
            },
            "truncated",
        ),
    ];
    for (what, bytes, want) in cases {
        match raw_exchange(&d.socket, &bytes) {
            Some(Response::Error { message }) => assert!(message.contains(want), "{what}: {message}"),
            other => panic!("{what}: {other:?}"),
        }
        // The daemon still answers a well-behaved client.
        assert!(
            matches!(client::call(&d.socket, T, Request::Status), Ok(Response::Status(_))),
            "after {what}"
        );
    }
    // A client that connects and says nothing does not block others.
    let _idle = UnixStream::connect(&d.socket).unwrap();
    assert!(matches!(
        client::call(&d.socket, T, start(1, "a")),
        Ok(Response::Started(_))
    ));
}

#[test]
fn concurrent_clients_lose_and_double_no_record() {
    let dir = tempfile::tempdir().unwrap();
    let d = InProcess::start(dir.path(), 2);
    let socket = d.socket.clone();
    let placed = Arc::new(Mutex::new(0u32));
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let socket = socket.clone();
            let placed = Arc::clone(&placed);
            std::thread::spawn(move || {
                for i in 0..25u32 {
                    let job = 1000 * (t + 1) + i;
                    match client::call(&socket, T, start(job, &format!("app{}", t % 3))).unwrap() {
                        Response::Started(p) => {
                            assert_eq!(p.gpu, job % 2, "job {job} recorded where Slurm bound it: {p:?}");
                            *placed.lock().unwrap() += 1;
                            assert_eq!(client::call(&socket, T, finish(job)).unwrap(), Response::Finished);
                        }
                        other => panic!("{other:?}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(*placed.lock().unwrap(), 8 * 25, "every start recorded");
    assert!(status_jobs(&socket).is_empty(), "every finished job released its slot");
    drop(d);
    let db = rusqlite_count(&dir.path().join("h.sqlite"));
    assert_eq!(db, *placed.lock().unwrap() as i64);
}

fn rusqlite_count(path: &Path) -> i64 {
    let h = multiplexd::history::History::open(path).unwrap();
    h.connection()
        .query_row("SELECT count(*) FROM jobs WHERE finished_at IS NOT NULL", [], |r| {
            r.get(0)
        })
        .unwrap()
}

/// The real `multiplexd serve` on `config`, once it answers.
fn serve(config: &Path, socket: &Path) -> std::process::Child {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(["serve", "--config"])
        .arg(config)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..200 {
        if client::call(socket, T, Request::Status).is_ok() {
            return child;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("multiplexd did not come up");
}

/// A real `multiplexd serve` in a temporary directory of its own, `slots` jobs per GPU.
fn served(slots: u32) -> (tempfile::TempDir, PathBuf, std::process::Child) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("multiplexd.toml");
    std::fs::write(&config, config_text(dir.path(), slots)).unwrap();
    let socket = dir.path().join("d.sock");
    let daemon = serve(&config, &socket);
    (dir, socket, daemon)
}

#[test]
fn kill_9_loses_nothing_and_the_restart_never_double_books() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("multiplexd.toml");
    std::fs::write(&config, config_text(dir.path(), 1)).unwrap();
    let socket = dir.path().join("d.sock");
    let launch = || serve(&config, &socket);
    let mut first = launch();
    let gpu_of = |r: Response| match r {
        Response::Started(p) => p.gpu,
        other => panic!("{other:?}"),
    };
    let a = gpu_of(client::call(&socket, T, start(1, "a")).unwrap());
    let b = gpu_of(client::call(&socket, T, start(2, "b")).unwrap());
    assert_eq!((a, b), (1, 0), "where Slurm bound them");
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();

    // The stale socket file is replaced; the history is where it was.
    let mut second = launch();
    let mut jobs = status_jobs(&socket);
    jobs.sort();
    assert_eq!(jobs, vec![(1, a), (2, b)]);
    // A step of a running job still joins its GPU, whatever it says of its binding.
    let step = Request::Start(StartRequest {
        step_id: 4,
        ..StartRequest::new(1, 1000, "a", "n1", 0)
    });
    assert_eq!(gpu_of(client::call(&socket, T, step).unwrap()), a);
    assert_eq!(client::call(&socket, T, finish(1)).unwrap(), Response::Finished);
    assert_eq!(gpu_of(client::call(&socket, T, start(3, "c")).unwrap()), a);
    second.kill().unwrap();
    second.wait().unwrap();
}

#[test]
fn a_second_daemon_on_the_same_socket_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = InProcess::start(dir.path(), 2);
    let err = server::bind(&d.socket).unwrap_err();
    assert!(
        err.to_string().contains("another multiplexd is already serving"),
        "{err}"
    );
    let mut buf = Vec::new();
    let mut s = UnixStream::connect(&d.socket).unwrap();
    wire::write_frame(
        &mut s,
        &RequestFrame {
            version: PROTOCOL_VERSION,
            request: Request::Status,
        },
    )
    .unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    buf.resize(u32::from_be_bytes(len) as usize, 0);
    s.read_exact(&mut buf).unwrap();
    assert!(matches!(wire::decode_response(&buf).unwrap(), Response::Status(_)));
}

#[test]
fn a_history_that_cannot_be_read_fails_the_start_instead_of_guessing() {
    let (dir, socket, mut daemon) = served(2);
    for (job, app) in [(1, "a"), (2, "b")] {
        assert!(matches!(
            client::call(&socket, T, start(job, app)).unwrap(),
            Response::Started(_)
        ));
    }
    // Both GPUs now have a resident, so the next start must read what is known of the
    // applications to predict its speed, and that table is gone.
    rusqlite::Connection::open(dir.path().join("h.sqlite"))
        .unwrap()
        .execute_batch("DROP TABLE app_effects")
        .unwrap();
    match client::call(&socket, T, start(3, "c")).unwrap() {
        Response::Error { message } => assert!(message.contains("no such table: app_effects"), "{message}"),
        other => panic!("a start without its estimates must fail, not guess: {other:?}"),
    }
    let mut jobs = status_jobs(&socket);
    jobs.sort();
    assert_eq!(
        jobs.iter().map(|j| j.0).collect::<Vec<_>>(),
        vec![1, 2],
        "job 3 was not recorded"
    );
    daemon.kill().unwrap();
    daemon.wait().unwrap();
}

#[test]
fn a_finish_answers_before_learning_and_a_stopping_daemon_learns_what_is_queued() {
    let (dir, socket, mut daemon) = served(2);
    assert!(matches!(
        client::call(&socket, T, start(1, "a")).unwrap(),
        Response::Started(_)
    ));
    assert_eq!(client::call(&socket, T, finish(1)).unwrap(), Response::Finished);
    // The end is committed when the finish answers: the slot is free at once.
    assert!(status_jobs(&socket).is_empty());
    // SIGTERM right away: whatever the learning thread has not done yet is done before exit.
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) }, 0);
    assert!(daemon.wait().unwrap().success());
    let h = multiplexd::history::History::open(&dir.path().join("h.sqlite")).unwrap();
    let runs: i64 = h
        .connection()
        .query_row(
            "SELECT observations FROM solo_baselines s JOIN applications a ON a.id = s.app_id WHERE a.name = 'a'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(runs, 1, "the solo run of job 1 was learned");
}

#[test]
fn ten_kill_9_restarts_under_load_lose_no_acknowledged_job_and_leak_no_slot() {
    let (dir, socket, first) = served(2);
    let config = dir.path().join("multiplexd.toml");
    let mut daemon = first;
    let (mut placed, mut finished) = (Vec::new(), Vec::new());
    // Jobs still running when a daemon was killed: their ends come in the next round.
    let mut running = std::collections::VecDeque::new();
    let mut next = 100u32;
    for round in 0..10u64 {
        if round > 0 {
            daemon = serve(&config, &socket);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (s, sock, first_job) = (Arc::clone(&stop), socket.clone(), next);
        // Placements of this round so far: the kill waits for a few, so that it always lands
        // mid-stream, however slowly this machine starts the daemon.
        let placed_now = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&placed_now);
        let mut carried = std::mem::take(&mut running);
        // slurmstepd's traffic: place, and finish the oldest once both GPUs' slots are full.
        let worker = std::thread::spawn(move || {
            let (mut placed, mut finished) = (Vec::new(), Vec::new());
            let mut job = first_job;
            while !s.load(Ordering::SeqCst) {
                if carried.len() >= 4 {
                    let (old, acknowledged) = carried.pop_front().unwrap();
                    match client::call(&sock, T, finish(old)) {
                        Ok(Response::Finished) if acknowledged => finished.push(old),
                        Ok(Response::Finished) => {}
                        _ => {
                            carried.push_front((old, acknowledged));
                            break;
                        }
                    }
                }
                // An application per job: compaction at each start (which keeps the latest
                // jobs of each application) then deletes nothing this test counts.
                match client::call(&sock, T, start(job, &format!("app{job}"))) {
                    Ok(Response::Started(_)) => {
                        placed.push(job);
                        carried.push_back((job, true));
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(_) => {}
                    // Killed mid-request: the daemon may have placed the job without saying so.
                    // slurmstepd ends every step it started, so its end comes later all the same
                    // (without it, such jobs would hold the node's slots in this test for good).
                    Err(_) => {
                        carried.push_back((job, false));
                        break;
                    }
                }
                job += 1;
            }
            (placed, finished, job, carried)
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while placed_now.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(37 * round));
        daemon.kill().unwrap(); // SIGKILL, mid-stream
        daemon.wait().unwrap();
        stop.store(true, Ordering::SeqCst);
        let (p, f, j, r) = worker.join().unwrap();
        placed.extend(p);
        finished.extend(f);
        running = r;
        next = j + 1;
    }
    assert!(
        placed.len() >= 30,
        "load ran in every round (at least 3 placements each): {} placements",
        placed.len()
    );
    let mut last = serve(&config, &socket);
    let running: Vec<u32> = status_jobs(&socket).into_iter().map(|(job, _)| job).collect();
    last.kill().unwrap();
    last.wait().unwrap();
    let h = multiplexd::history::History::open(&dir.path().join("h.sqlite")).unwrap();
    let count = |sql: &str, job: u32| -> i64 { h.connection().query_row(sql, [job], |r| r.get(0)).unwrap() };
    for &job in &placed {
        assert_eq!(
            count("SELECT count(*) FROM jobs WHERE job_id = ?1", job),
            1,
            "placement of {job} lost"
        );
    }
    for &job in &finished {
        assert_eq!(
            count(
                "SELECT count(*) FROM jobs WHERE job_id = ?1 AND finished_at IS NOT NULL",
                job
            ),
            1,
            "end of {job} lost"
        );
        assert!(!running.contains(&job), "job {job} ended but holds a slot");
    }
    let integrity: String = h
        .connection()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
}

/// A tmpfs of `size` mounted on a new directory, unmounted (and removed) on drop.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(dir.path())
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount a tmpfs on {}", dir.path().display());
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.0.path()).status();
    }
}

/// Writes zeros into `path` until the file system is full.
fn fill(path: &Path) -> std::fs::File {
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![0u8; 64 * 1024];
    loop {
        match f.write(&block) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    // Whatever a last short write could still take.
    while let Ok(n) = f.write(&[0u8; 512]) {
        if n == 0 {
            break;
        }
    }
    f
}

#[test]
fn a_full_disk_frees_ended_jobs_slots_says_so_and_records_their_ends_when_space_returns() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipped: mounting a tmpfs needs root (tests/run runs this as root)");
        return;
    }
    let disk = Tmpfs::mount("2m");
    let dir = tempfile::tempdir().unwrap();
    // The history on the small tmpfs, the socket and config beside the test.
    let config = dir.path().join("multiplexd.toml");
    let text = config_text(dir.path(), 1).replace(
        &format!("{}/h.sqlite", dir.path().display()),
        &format!("{}/h.sqlite", disk.0.path().display()),
    );
    std::fs::write(&config, text).unwrap();
    let socket = dir.path().join("d.sock");
    let mut daemon = Stopped(serve(&config, &socket));
    for job in [1, 2] {
        assert!(matches!(
            client::call(&socket, T, start(job, "a")).unwrap(),
            Response::Started(_)
        ));
    }
    let filler = disk.0.path().join("filler");
    let f = fill(&filler);
    // Jobs end and start until a write no longer fits (the history's log may still hold a
    // few): every end is answered and frees its slot, recorded or not.
    assert_eq!(client::call(&socket, T, finish(1)).unwrap(), Response::Finished);
    let mut refused = None;
    for job in 3..40 {
        match client::call(&socket, T, start(job, "b")).unwrap() {
            Response::Error { message } => {
                refused = Some(message);
                break;
            }
            Response::Started(_) => {
                assert_eq!(client::call(&socket, T, finish(job)).unwrap(), Response::Finished);
            }
            other => panic!("job {job}: {other:?}"),
        }
    }
    // A newcomer that cannot be recorded is refused with the reason, naming the file.
    let message = refused.expect("a full disk refused some placement");
    assert!(
        message.contains("is full") && message.contains("h.sqlite") && message.contains("free some space"),
        "{message}"
    );
    assert_eq!(
        status_jobs(&socket).iter().map(|(j, _)| *j).collect::<Vec<_>>(),
        [2],
        "no slot leaked"
    );
    // Space returns: the next request records the ends it could not, and placing works again.
    drop(f);
    std::fs::remove_file(&filler).unwrap();
    assert!(matches!(
        client::call(&socket, T, start(50, "c")).unwrap(),
        Response::Started(_)
    ));
    let db = disk.0.path().join("h.sqlite");
    let h = multiplexd::history::History::open(&db).unwrap();
    let running: Vec<u32> = h
        .connection()
        .prepare("SELECT job_id FROM jobs WHERE finished_at IS NULL ORDER BY job_id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(running, [2, 50], "every end was recorded once there was room");
    assert!(daemon.0.try_wait().unwrap().is_none(), "the daemon kept running");
    // Full again, with an end it could not record: SIGTERM still stops it (the end is lost
    // with the daemon; reconcile frees such a job after a restart).
    let _f = fill(&filler);
    assert_eq!(client::call(&socket, T, finish(50)).unwrap(), Response::Finished);
    // SAFETY: kill(2) on the daemon this test started.
    unsafe { libc::kill(daemon.0.id() as i32, libc::SIGTERM) };
    let start = std::time::Instant::now();
    while daemon.0.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "SIGTERM did not stop the daemon"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A daemon killed on drop, so that a failing test leaves none behind.
struct Stopped(std::process::Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
