//! The daemon's Unix socket: one thread per connection, the peer's credentials checked on
//! every connection, and a bad message answered with an error without disturbing anyone else.

use crate::admission::{Admission, Complaints, Fault, Limits, Refusal, Ticket};
use crate::node::{Bound, Node, RequestError, Started};
use multiplex_protocol::wire::{self, FrameError, Request, Response, ResponseFrame, PROTOCOL_VERSION};
use std::io;
use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who may do what, and the Slurm the answers may ask.
#[derive(Clone)]
pub struct Access {
    /// Besides root, uids that may place and finish tasks (the Slurm user).
    pub privileged_uids: Vec<u32>,
    /// Slurm keeps jobs private (`PrivateData=jobs`): other users see only their own jobs in
    /// `status` and `explain`; root and the Slurm user see all. Shared with the thread that
    /// asks Slurm now and then.
    pub private_jobs: Arc<AtomicBool>,
    /// Slurm, to put back in the queue a job that ran out of memory beside a partner
    /// ([`crate::put_back`]); `None`: nothing is put back (tests of the socket alone).
    pub slurm: Option<Arc<dyn crate::slurm::Slurm>>,
}

impl Access {
    fn may_place(&self, uid: u32) -> bool {
        uid == 0 || self.privileged_uids.contains(&uid)
    }

    /// Whether `uid` may see the jobs of `owner` (unknown: only where jobs are not private).
    fn may_see(&self, uid: u32, owner: Option<u32>) -> bool {
        !self.private_jobs.load(Ordering::Relaxed) || self.may_place(uid) || owner == Some(uid)
    }
}

/// Credentials of a connected peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
}

/// Reads the peer's credentials (`SO_PEERCRED`), taken by the kernel at connect time.
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the fd is a live Unix socket owned by `stream`; cred and len are valid for writes
    // of the sizes given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
    })
}

/// Binds the socket at `path`: creates its directory, refuses if another daemon answers there,
/// removes a stale file, and makes the socket connectable by every user (what each may do is
/// decided per request from the peer's credentials).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("another multiplexd is already serving {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    // SAFETY: umask only changes this process's file-creation mask; restored right after bind.
    let old = unsafe { libc::umask(0o111) };
    let result = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    result
}

/// Serves until `shutdown` is set (the setter then connects once to wake the accept), with
/// the default [`Limits`] and each peer's credentials from the kernel.
pub fn run(listener: UnixListener, node: Arc<Mutex<Node>>, access: Access, shutdown: Arc<AtomicBool>) {
    run_with(listener, node, access, shutdown, Limits::default(), peer_cred);
}

/// [`run`] with these limits, and `creds` telling who each peer is (tests give peers the
/// credentials of users they are not).
pub fn run_with(
    listener: UnixListener,
    node: Arc<Mutex<Node>>,
    access: Access,
    shutdown: Arc<AtomicBool>,
    limits: Limits,
    creds: fn(&UnixStream) -> io::Result<PeerCred>,
) {
    let admission = Admission::new(limits);
    let complaints = Arc::new(Complaints::new(COMPLAINTS_WINDOW));
    let mut flushed = Instant::now();
    for conn in listener.incoming() {
        if shutdown.load(Ordering::SeqCst) {
            break;
        }
        if flushed.elapsed() >= Duration::from_secs(1) {
            complaints.flush();
            flushed = Instant::now();
        }
        let stream = match conn {
            Ok(stream) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: the limits keep this rare.
                complaints.note(NO_PEER, Fault::Refused, || format!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let cred = match creds(&stream) {
            Ok(c) => c,
            Err(e) => {
                complaints.note(NO_PEER, Fault::Refused, || format!("cannot read peer credentials: {e}"));
                continue;
            }
        };
        let ticket = match admission.admit(cred.uid, access.may_place(cred.uid)) {
            Ok(t) => t,
            Err(refusal) => {
                complaints.note(cred.uid, Fault::Refused, || refusal.to_string());
                refuse(stream, refusal);
                continue;
            }
        };
        let node = Arc::clone(&node);
        let access = access.clone();
        let c = Arc::clone(&complaints);
        let spawned = std::thread::Builder::new()
            .name("multiplexd-conn".into())
            .spawn(move || serve_connection(stream, cred, ticket, &node, &access, &c));
        if let Err(e) = spawned {
            complaints.note(cred.uid, Fault::Refused, || {
                format!("cannot start a connection thread: {e}")
            });
        }
    }
    complaints.flush();
}

/// What faults are counted under when no peer is known yet (a failed accept, credentials
/// that cannot be read).
const NO_PEER: u32 = u32::MAX;

/// How often each uid's faults of one kind may be logged.
const COMPLAINTS_WINDOW: Duration = Duration::from_secs(60);

/// Tells a refused peer why, if it can take the answer at once, and closes.
fn refuse(mut stream: UnixStream, refusal: Refusal) {
    if stream.set_nonblocking(true).is_ok() {
        let _ = wire::write_frame(
            &mut stream,
            &ResponseFrame {
                version: PROTOCOL_VERSION,
                response: Response::Error {
                    message: format!("{refusal}: try again later"),
                },
            },
        );
    }
}

/// A connection read at the pace the limits allow: the first byte of a request within
/// `limits.idle`, the rest of it within `limits.frame` of that byte. A read past either ends in
/// `TimedOut` (or `WouldBlock`); [`Self::began`] says which.
struct Paced<'a> {
    stream: &'a mut UnixStream,
    limits: &'a Limits,
    deadline: Option<Instant>,
}

impl Paced<'_> {
    /// Whether the current request had begun to arrive (a timeout is then a slow frame, not
    /// an idle connection).
    fn began(&self) -> bool {
        self.deadline.is_some()
    }
}

impl Read for Paced<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let wait = match self.deadline {
            None => self.limits.idle,
            Some(d) => d.saturating_duration_since(Instant::now()),
        };
        if wait.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(wait))?;
        let n = self.stream.read(buf)?;
        if n > 0 && self.deadline.is_none() {
            self.deadline = Some(Instant::now() + self.limits.frame);
        }
        Ok(n)
    }
}

/// Whether `e` is a read that ran out of time.
fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

fn serve_connection(
    mut stream: UnixStream,
    cred: PeerCred,
    ticket: Ticket,
    node: &Mutex<Node>,
    access: &Access,
    complaints: &Complaints,
) {
    let limits = ticket.limits().clone();
    let _ = stream.set_write_timeout(Some(limits.frame));
    loop {
        let mut paced = Paced {
            stream: &mut stream,
            limits: &limits,
            deadline: None,
        };
        let read = wire::read_frame_bytes(&mut paced);
        let began = paced.began();
        let body = match read {
            Ok(Some(b)) => b,
            Ok(None) => return,
            // Nothing came within the idle limit: closed without a word.
            Err(FrameError::Io(e)) if timed_out(&e) && !began => return,
            Err(FrameError::Io(e)) if timed_out(&e) => {
                complaints.note(cred.uid, Fault::TooSlow, || {
                    format!("a request took longer than {} s to arrive", limits.frame.as_secs())
                });
                return;
            }
            Err(FrameError::Io(e)) => {
                tracing::debug!(pid = cred.pid, "connection ended: {e}");
                return;
            }
            Err(e) => {
                // The stream may be out of step after a bad frame: answer, then close.
                complaints.note(cred.uid, Fault::BadFrame, || e.to_string());
                reply(&mut stream, Response::Error { message: e.to_string() });
                return;
            }
        };
        let response = match wire::decode_request(&body) {
            Ok(request) => match handle(request, cred, node, access) {
                Ok(r) => r,
                Err(message) => {
                    complaints.note(cred.uid, Fault::Failed, || message.clone());
                    Response::Error { message }
                }
            },
            Err(e) => {
                complaints.note(cred.uid, Fault::BadFrame, || e.to_string());
                Response::Error { message: e.to_string() }
            }
        };
        if !reply(&mut stream, response) {
            complaints.note(cred.uid, Fault::TooSlow, || "an answer was not taken in time".into());
            return;
        }
    }
}

/// Sends `response`; an answer too large for a frame becomes an error that says so. False when
/// the peer did not take it.
fn reply(stream: &mut UnixStream, response: Response) -> bool {
    let frame = ResponseFrame {
        version: PROTOCOL_VERSION,
        response,
    };
    match wire::write_frame(stream, &frame) {
        Ok(()) => true,
        Err(FrameError::TooLarge(n)) => {
            let error = ResponseFrame {
                version: PROTOCOL_VERSION,
                response: Response::Error {
                    message: format!(
                        "the answer is {n} bytes, more than a message may hold ({} bytes)",
                        wire::MAX_FRAME
                    ),
                },
            };
            wire::write_frame(stream, &error).is_ok()
        }
        Err(_) => false,
    }
}

/// Serves one request of `cred`'s; `Err` when the history failed it (the message is the
/// answer, and worth logging).
pub(crate) fn handle(
    request: Request,
    cred: PeerCred,
    node: &Mutex<Node>,
    access: &Access,
) -> Result<Response, String> {
    let denied = |what: &str| {
        Ok(Response::Error {
            message: format!("uid {} may not {what}: only root and the Slurm user may", cred.uid),
        })
    };
    let kind = match &request {
        Request::Start(_) => "start",
        Request::Finish(_) => "finish",
        Request::Status => "status",
        Request::Report(_) => "report",
        Request::Explain { .. } => "explain",
    };
    let start = std::time::Instant::now();
    // A panic in one request must not poison the node for everyone: recover the guard.
    let mut node = node.lock().unwrap_or_else(|p| p.into_inner());
    let result: Result<Response, RequestError> = match request {
        Request::Start(req) if access.may_place(cred.uid) => counted_start(&mut node, &req),
        Request::Start(_) => return denied("start tasks"),
        Request::Finish(req) if access.may_place(cred.uid) => node.finish(&req).map(|()| Response::Finished),
        Request::Finish(_) => return denied("finish tasks"),
        Request::Status => status_seen_by(&node, cred, access),
        Request::Report(req) => match node.report(&req, cred.uid, access.may_place(cred.uid)) {
            Ok((message, Some(oom))) => {
                // Slurm is asked outside the node's lock: a slow slurmctld delays this job only.
                drop(node);
                crate::metrics::global().request(kind, start.elapsed());
                return Ok(put_back(message, &oom, access));
            }
            other => other.map(|(message, _)| Response::Reported {
                message,
                put_back: false,
            }),
        },
        Request::Explain { job_id } => explained_to(&node, job_id, cred, access),
    };
    crate::metrics::global().request(kind, start.elapsed());
    match result {
        Ok(response) => Ok(response),
        // The history's failure is the daemon's: logged by the caller.
        Err(RequestError::History(e)) => Err(e.at(node.database()).to_string()),
        // The asker's: the answer says why.
        Err(e) => Ok(Response::Error { message: e.to_string() }),
    }
}

/// The answer to a report that a job ran out of memory beside partners (`said`): it is put
/// back in Slurm's queue where [`Access::slurm`] is given and Slurm lets it be, and the answer
/// says which, for the job's output.
fn put_back(said: String, oom: &crate::put_back::OutOfMemory, access: &Access) -> Response {
    let Some(slurm) = &access.slurm else {
        return Response::Reported {
            message: said,
            put_back: false,
        };
    };
    let (outcome, put_back) = match crate::put_back::put_back(slurm.as_ref(), oom) {
        Ok(done) => {
            tracing::info!(job = oom.job_id, beside = ?oom.beside, gpu = oom.gpu, "put back job={}: ran out of GPU memory beside a partner", oom.job_id);
            crate::metrics::global().put_back("requeued");
            (done, true)
        }
        Err(why) => {
            tracing::warn!(job = oom.job_id, "{why}");
            crate::metrics::global().put_back("refused");
            (why, false)
        }
    };
    Response::Reported {
        message: format!("{said}; {outcome}"),
        put_back,
    }
}

/// A start, counted in the metrics by how the job came by its GPU.
fn counted_start(node: &mut Node, req: &multiplex_protocol::StartRequest) -> Result<Response, RequestError> {
    let started = node.start(req);
    crate::metrics::global().start(match &started {
        Ok(Started::Placed { bound, .. }) => match bound {
            Bound::Claimed | Bound::NodeClaimed => "claimed",
            Bound::Unclaimed => "unclaimed",
            Bound::Joined => "joined",
        },
        Ok(Started::Refused { .. }) => "too_large",
        Err(_) => "error",
    });
    started.map(started_response)
}

/// The node's status with only the tasks `cred` may see.
fn status_seen_by(node: &Node, cred: PeerCred, access: &Access) -> Result<Response, RequestError> {
    let mut status = node.status().map_err(RequestError::History)?;
    for gpu in &mut status.gpus {
        gpu.tasks.retain(|t| access.may_see(cred.uid, Some(t.uid)));
    }
    Ok(Response::Status(status))
}

/// A job explained, where `cred` may see it; one it may not is as one this node never had.
fn explained_to(node: &Node, job_id: u32, cred: PeerCred, access: &Access) -> Result<Response, RequestError> {
    let found = crate::inspect::explained(node.history(), job_id).map_err(RequestError::History)?;
    Ok(match found {
        Some(e) if access.may_see(cred.uid, e.owner) => Response::Explained {
            text: e.text,
            json: e.json,
        },
        _ => Response::Explained {
            text: String::new(),
            json: serde_json::Value::Null,
        },
    })
}

/// A start's outcome on the wire.
pub fn started_response(started: Started) -> Response {
    match started {
        Started::Placed { placement, .. } => Response::Started(placement),
        Started::Refused { reason } => Response::Refused { reason },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, GpuSpec};
    use multiplex_protocol::{FinishRequest, StartRequest};

    fn node(dir: &Path) -> Mutex<Node> {
        let config = Config::parse(&format!("node = \"n1\"\ndatabase = \"{}/h.sqlite\"", dir.display())).unwrap();
        let gpus = vec![GpuSpec {
            index: 0,
            model: "v100".into(),
            memory_mb: 16384,
            uuid: None,
        }];
        Mutex::new(Node::open(config, gpus, crate::node::wall_clock()).unwrap())
    }

    fn start() -> Request {
        Request::Start(StartRequest::new(1, 1000, "a", "n1", 0))
    }

    #[test]
    fn a_job_out_of_memory_beside_a_partner_is_put_back_and_alone_it_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let node = node(dir.path());
        let running = |id| crate::slurm::Job::running_on_n1(id, "multiplex:app=b");
        let slurm = Arc::new(crate::slurm::Fake::new(crate::slurm::FakeState {
            jobs: vec![running(1), running(2)],
            ..Default::default()
        }));
        let access = Access {
            privileged_uids: vec![],
            private_jobs: Arc::new(AtomicBool::new(false)),
            slurm: Some(slurm.clone()),
        };
        let (root, user) = (PeerCred { pid: 1, uid: 0 }, PeerCred { pid: 1, uid: 1000 });
        let oom = |job_id| {
            Request::Report(multiplex_protocol::ReportRequest {
                job_id,
                kind: multiplex_protocol::ReportKind::OutOfMemory,
            })
        };
        // Job 1 alone on GPU 0: its own failure, recorded and not put back.
        handle(start(), root, &node, &access).unwrap();
        match handle(oom(1), user, &node, &access).unwrap() {
            Response::Reported { message, put_back } => {
                assert!(!put_back && !message.contains("put back"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // Job 2 joins it: out of memory beside job 1, it is put back in Slurm's queue.
        handle(
            Request::Start(StartRequest::new(2, 1000, "b", "n1", 0)),
            root,
            &node,
            &access,
        )
        .unwrap();
        match handle(oom(2), user, &node, &access).unwrap() {
            Response::Reported { message, put_back } => {
                assert!(put_back, "{message}");
                assert!(message.contains("job 2 is put back in the queue"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // Reported again in the same run, nothing more is asked of Slurm.
        let updates = slurm.state.lock().unwrap().updates;
        match handle(oom(2), user, &node, &access).unwrap() {
            Response::Reported { message, put_back } => {
                assert!(!put_back && message.contains("reported already"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let s = slurm.state.lock().unwrap();
        assert_eq!(s.updates, updates);
        assert!(s.jobs[1].pending && !s.jobs[0].pending, "{:?}", s.jobs);
        let comment = s.jobs[1].admin_comment.as_deref().unwrap();
        assert!(
            comment.contains("put back: ran out of GPU memory beside a on n1 GPU 0"),
            "{comment}"
        );
    }

    #[test]
    fn only_root_and_the_slurm_user_start_and_finish() {
        let dir = tempfile::tempdir().unwrap();
        let node = node(dir.path());
        let access = Access {
            privileged_uids: vec![64030],
            private_jobs: Arc::new(AtomicBool::new(false)),
            slurm: None,
        };
        let user = PeerCred { pid: 1, uid: 1000 };
        for request in [
            start(),
            Request::Finish(FinishRequest {
                job_id: 1,
                step_id: 0,
                exit_status: 0,
            }),
        ] {
            match handle(request, user, &node, &access).unwrap() {
                Response::Error { message } => assert!(message.contains("uid 1000 may not"), "{message}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            handle(Request::Status, user, &node, &access).unwrap(),
            Response::Status(_)
        ));
        let slurm = PeerCred { pid: 1, uid: 64030 };
        assert!(matches!(
            handle(start(), slurm, &node, &access).unwrap(),
            Response::Started(_)
        ));
        let root = PeerCred { pid: 1, uid: 0 };
        assert!(
            matches!(handle(start(), root, &node, &access).unwrap(), Response::Started(_)),
            "telling twice is idempotent"
        );
    }

    #[test]
    fn where_jobs_are_private_a_user_sees_only_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let node = node(dir.path());
        let access = Access {
            privileged_uids: vec![],
            private_jobs: Arc::new(AtomicBool::new(true)),
            slurm: None,
        };
        let root = PeerCred { pid: 1, uid: 0 };
        let placed = |job_id: u32, uid: u32| {
            let req = StartRequest::new(job_id, uid, "a", "n1", 0);
            assert!(matches!(
                handle(Request::Start(req), root, &node, &access).unwrap(),
                Response::Started(_)
            ));
        };
        placed(7, 1000);
        placed(8, 1001);
        let jobs_seen_by = |uid: u32| -> Vec<u32> {
            match handle(Request::Status, PeerCred { pid: 1, uid }, &node, &access).unwrap() {
                Response::Status(s) => s.gpus.iter().flat_map(|g| g.tasks.iter().map(|t| t.job_id)).collect(),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(jobs_seen_by(1000), [7]);
        assert_eq!(jobs_seen_by(1001), [8]);
        assert_eq!(jobs_seen_by(0), [7, 8]);
        let explained =
            |job_id: u32, uid: u32| match handle(Request::Explain { job_id }, PeerCred { pid: 1, uid }, &node, &access)
                .unwrap()
            {
                Response::Explained { json, .. } => !json.is_null(),
                other => panic!("{other:?}"),
            };
        assert!(explained(7, 1000) && explained(8, 0));
        assert!(!explained(8, 1000), "another user's job is as one never seen");
        assert!(!explained(9, 0), "a job never seen");
        // Where Slurm does not keep jobs private, everyone sees everything.
        let open = Access {
            private_jobs: Arc::new(AtomicBool::new(false)),
            ..access.clone()
        };
        match handle(Request::Status, PeerCred { pid: 1, uid: 1000 }, &node, &open).unwrap() {
            Response::Status(s) => assert_eq!(s.gpus[0].tasks.len(), 2),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_answer_too_large_for_a_frame_becomes_an_error_that_says_so() {
        let (mut daemon_end, mut client_end) = UnixStream::pair().unwrap();
        let big = Response::Reported {
            message: "x".repeat(wire::MAX_FRAME + 1),
            put_back: false,
        };
        let writer = std::thread::spawn(move || reply(&mut daemon_end, big));
        client_end.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let body = wire::read_frame_bytes(&mut client_end).unwrap().expect("an answer");
        assert!(writer.join().unwrap(), "the error answer was sent");
        match wire::decode_response(&body).unwrap() {
            Response::Error { message } => {
                assert!(message.contains("more than a message may hold"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }
}
