//! Local users who mean harm, on a real Unix socket: connections held idle, sent a byte at a
//! time or with a large frame half sent, and floods of bad frames. What is checked: each
//! unprivileged uid holds a bounded number of connections and is told when it may not have
//! more, root is served throughout, slow frames are cut off, and the log stays short and
//! cannot be forged.
//!
//! In-process servers are told who each peer is by the path the test binds its end of the
//! connection to (`user-*` is uid 1001, anything else root), so that this runs as any user;
//! the log tests run the real `multiplexd serve`.

use multiplex_protocol::wire::{self, MAX_FRAME};
use multiplex_protocol::{client, FinishRequest, Request, Response, StartRequest};
use multiplexd::admission::Limits;
use multiplexd::config::{Config, GpuSpec};
use multiplexd::node::{wall_clock, Node};
use multiplexd::server::{self, Access, PeerCred};
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(5);

fn config_text(dir: &Path) -> String {
    format!(
        "node = \"n1\"\nsocket = \"{d}/d.sock\"\ndatabase = \"{d}/h.sqlite\"\njobs_per_gpu = 2\nslurm_user = \"root\"\n\
         slurm_bin = \"{d}/no-slurm\"\n[reconcile]\ninterval_s = 0\n[[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 16384\n",
        d = dir.display()
    )
}

/// Who a peer is, by the name of the path its end is bound to.
fn creds_by_name(stream: &UnixStream) -> std::io::Result<PeerCred> {
    let addr = stream.peer_addr()?;
    let user = addr
        .as_pathname()
        .and_then(Path::file_name)
        .is_some_and(|n| n.to_string_lossy().starts_with("user-"));
    Ok(PeerCred {
        pid: 0,
        uid: if user { 1001 } else { 0 },
    })
}

struct InProcess {
    dir: tempfile::TempDir,
    socket: PathBuf,
    shutdown: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcess {
    fn start(limits: Limits) -> InProcess {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::parse(&config_text(dir.path())).unwrap();
        let gpus = vec![GpuSpec {
            index: 0,
            model: "v100".into(),
            memory_mb: 16384,
            uuid: None,
        }];
        let socket = config.socket.clone();
        let listener = server::bind(&socket).unwrap();
        let node = Arc::new(Mutex::new(Node::open(config, gpus, wall_clock()).unwrap()));
        let shutdown = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&shutdown);
        let access = Access {
            privileged_uids: vec![],
            private_jobs: Arc::new(AtomicBool::new(false)),
            slurm: None,
        };
        let thread = std::thread::spawn(move || server::run_with(listener, node, access, s, limits, creds_by_name));
        InProcess {
            dir,
            socket,
            shutdown,
            thread: Some(thread),
        }
    }

    /// A connection whose end is bound to `name` in the test's directory.
    fn connect_as(&self, name: &str) -> UnixStream {
        let own = self.dir.path().join(name);
        // SAFETY: plain socket calls on a descriptor this function owns; the addresses are
        // sockaddr_un values filled within their size.
        unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let addr = |path: &Path| {
                let mut a: libc::sockaddr_un = std::mem::zeroed();
                a.sun_family = libc::AF_UNIX as libc::sa_family_t;
                let bytes = path.as_os_str().as_encoded_bytes();
                assert!(bytes.len() < a.sun_path.len(), "{}", path.display());
                for (d, s) in a.sun_path.iter_mut().zip(bytes) {
                    *d = *s as libc::c_char;
                }
                a
            };
            let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            let mine = addr(&own);
            assert_eq!(libc::bind(fd, (&mine as *const libc::sockaddr_un).cast(), len), 0);
            let theirs = addr(&self.socket);
            assert_eq!(
                libc::connect(fd, (&theirs as *const libc::sockaddr_un).cast(), len),
                0,
                "{}",
                std::io::Error::last_os_error()
            );
            UnixStream::from_raw_fd(fd)
        }
    }

    /// One request as `name`, on a connection of its own.
    fn call_as(&self, name: &str, request: Request) -> Response {
        let mut s = self.connect_as(name);
        s.set_read_timeout(Some(T)).unwrap();
        wire::write_frame(
            &mut s,
            &wire::RequestFrame {
                version: wire::PROTOCOL_VERSION,
                request,
            },
        )
        .unwrap();
        let body = wire::read_frame_bytes(&mut s).unwrap().expect("an answer");
        wire::decode_response(&body).unwrap()
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

fn place(job_id: u32) -> Request {
    Request::Start(StartRequest::new(job_id, 1000, "a", "n1", 0))
}

/// What the daemon sent on `s` within a short while: `Some(text)` of an error answer, `None`
/// if nothing came (the connection is held open).
fn answer_now(s: &mut UnixStream) -> Option<String> {
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    match wire::read_frame_bytes(s) {
        Ok(Some(body)) => match wire::decode_response(&body).unwrap() {
            Response::Error { message } => Some(message),
            other => panic!("{other:?}"),
        },
        Ok(None) => Some(String::new()),
        Err(wire::FrameError::Io(e))
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
        {
            None
        }
        // Closed on data it did not read: the answer may be lost with it.
        Err(_) => Some(String::new()),
    }
}

/// Whether the daemon has closed `s` (reads end, or fail, within `within`).
fn closed_within(s: &mut UnixStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn a_user_holds_a_few_connections_is_told_when_it_may_not_and_root_is_served_throughout() {
    let limits = Limits {
        per_uid: 8,
        unprivileged: 64,
        total: 100,
        idle: Duration::from_secs(30),
        // Longer than opening the 300 below takes (each held one waits 0.2 s for an answer).
        frame: Duration::from_secs(5),
    };
    let d = InProcess::start(limits);
    let opened = Instant::now();
    // 300 connections of one user: idle, a byte of a length prefix, or a large frame half sent.
    let mut held = Vec::new();
    let (mut refused, mut told) = (0, 0);
    for i in 0..300 {
        let mut s = d.connect_as(&format!("user-{i}"));
        match i % 3 {
            0 => {}
            1 => {
                let _ = s.write_all(&[0]);
            }
            _ => {
                let _ = s.write_all(&((MAX_FRAME - 1) as u32).to_be_bytes());
                // Into the socket buffer; the daemon reads what arrives, no more.
                let _ = s.write_all(&vec![b'x'; 64 * 1024]);
            }
        }
        match answer_now(&mut s) {
            Some(message) => {
                assert!(
                    message.is_empty() || message.contains("already holds 8 connections"),
                    "{message}"
                );
                refused += 1;
                told += usize::from(!message.is_empty());
            }
            None => held.push(s),
        }
    }
    assert_eq!((held.len(), refused), (8, 292), "8 held, the rest refused");
    // Those that sent nothing or a byte read why (a peer closed on unread data may not).
    assert!(told >= 190, "{told} refused peers were told why");
    // Root is served while they are held, and at once.
    let start = Instant::now();
    assert!(matches!(d.call_as("root-0", Request::Status), Response::Status(_)));
    assert!(matches!(d.call_as("root-1", place(1)), Response::Started(_)));
    let finish = Request::Finish(FinishRequest {
        job_id: 1,
        step_id: 0,
        exit_status: 0,
    });
    assert!(matches!(d.call_as("root-2", finish), Response::Finished));
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    // Frames begun and not finished within the deadline are cut off; idle ones stay until the
    // idle limit.
    std::thread::sleep(Duration::from_millis(5200).saturating_sub(opened.elapsed()));
    let mut cut = 0;
    for s in held.iter_mut() {
        if closed_within(s, Duration::from_millis(300)) {
            cut += 1;
        }
    }
    assert_eq!(cut, 5, "the 5 slow frames among the 8 held were cut off");
    // Their places are free again for the user.
    held.retain_mut(|s| !closed_within(s, Duration::from_millis(10)));
    assert_eq!(held.len(), 3);
    assert!(matches!(d.call_as("user-late", Request::Status), Response::Status(_)));
}

#[test]
fn a_frame_declared_large_takes_memory_only_as_it_arrives() {
    let d = InProcess::start(Limits {
        frame: Duration::from_millis(500),
        ..Limits::default()
    });
    // Declares 256 KiB - 1, sends 10 bytes: cut off at the deadline with nothing answered.
    let mut s = d.connect_as("user-big");
    s.write_all(&((MAX_FRAME - 1) as u32).to_be_bytes()).unwrap();
    s.write_all(b"0123456789").unwrap();
    assert!(answer_now(&mut s).is_none(), "held while it may still arrive");
    assert!(
        closed_within(&mut s, Duration::from_secs(2)),
        "cut off after the deadline"
    );
    // An oversized declaration is refused at once.
    let mut s = d.connect_as("user-huge");
    s.write_all(&u32::MAX.to_be_bytes()).unwrap();
    assert!(answer_now(&mut s).unwrap().contains("larger than"));
}

/// The real daemon with its log in `log`.
fn serve_logging(dir: &Path, log: &Path) -> std::process::Child {
    let config = dir.join("multiplexd.toml");
    std::fs::write(&config, config_text(dir)).unwrap();
    let socket = dir.join("d.sock");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("MULTIPLEXD_LOG", "info")
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    for _ in 0..200 {
        if client::call(&socket, T, Request::Status).is_ok() {
            return child;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("multiplexd did not come up");
}

fn frame(json: &str) -> Vec<u8> {
    let mut v = (json.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(json.as_bytes());
    v
}

#[test]
fn twenty_thousand_bad_frames_leave_a_few_log_lines_and_none_forged() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("daemon.log");
    let mut daemon = serve_logging(dir.path(), &log);
    let socket = dir.path().join("d.sock");
    let before = std::fs::metadata(&log).unwrap().len();
    // The first carries a line of its own to forge; the rest are garbage of every kind.
    let forged = frame(r#"{"version":2,"request":{"type":"x\nINFO multiplexd: forged line"}}"#);
    let kinds = [
        forged,
        frame("this is not json"),
        frame(r#"{"version":7,"request":{"type":"status"}}"#),
        u32::MAX.to_be_bytes().to_vec(),
        frame(r#"{"version":2,"request":{"type":"start","job_id":1}}"#),
    ];
    let start = Instant::now();
    let mut slowest_status = Duration::ZERO;
    for i in 0..20_000 {
        let mut s = UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.write_all(&kinds[i % kinds.len()]).unwrap();
        let _ = wire::read_frame_bytes(&mut s);
        if i % 1000 == 0 {
            let t = Instant::now();
            assert!(matches!(
                client::call(&socket, T, Request::Status),
                Ok(Response::Status(_))
            ));
            slowest_status = slowest_status.max(t.elapsed());
        }
    }
    let took = start.elapsed();
    // The daemon stops on SIGTERM, telling what it counted.
    // SAFETY: kill with the pid of this test's own child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    daemon.wait().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let added = std::fs::metadata(&log).unwrap().len() - before;
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("bad messages")).collect();
    assert!(
        !lines.is_empty() && lines.len() <= 3,
        "{} lines about bad messages:\n{text}",
        lines.len()
    );
    assert!(added < 4096, "{added} bytes of log added:\n{text}");
    assert!(
        text.lines().all(|l| !l.starts_with("INFO multiplexd: forged")),
        "a peer wrote a line of its own:\n{text}"
    );
    assert!(text.contains(r"x\nINFO multiplexd: forged line"), "{text}");
    println!("20,000 bad frames in {took:?}; slowest status meanwhile {slowest_status:?}; {added} bytes of log");
}
