//! The daemon's Unix socket: one thread per connection, the peer's credentials checked on
//! every connection, and a bad message answered with an error without disturbing anyone else.

use crate::node::Node;
use multiplex_protocol::wire::{self, FrameError, Request, Response, ResponseFrame, PROTOCOL_VERSION};
use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Who may do what.
#[derive(Debug, Clone)]
pub struct Access {
    /// Besides root, uids that may place and finish tasks (the Slurm user).
    pub privileged_uids: Vec<u32>,
}

impl Access {
    fn may_place(&self, uid: u32) -> bool {
        uid == 0 || self.privileged_uids.contains(&uid)
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

/// Serves until `shutdown` is set (the setter then connects once to wake the accept).
pub fn run(listener: UnixListener, node: Arc<Mutex<Node>>, access: Access, shutdown: Arc<AtomicBool>) {
    for conn in listener.incoming() {
        if shutdown.load(Ordering::SeqCst) {
            break;
        }
        match conn {
            Ok(stream) => {
                let node = Arc::clone(&node);
                let access = access.clone();
                let spawned = std::thread::Builder::new()
                    .name("multiplexd-conn".into())
                    .spawn(move || serve_connection(stream, &node, &access));
                if let Err(e) = spawned {
                    tracing::error!("cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// How long a connection may sit idle between requests.
const IDLE: Duration = Duration::from_secs(30);

fn serve_connection(mut stream: UnixStream, node: &Mutex<Node>, access: &Access) {
    let cred = match peer_cred(&stream) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("cannot read peer credentials, closing: {e}");
            return;
        }
    };
    let _ = stream.set_read_timeout(Some(IDLE));
    let _ = stream.set_write_timeout(Some(IDLE));
    loop {
        let body = match wire::read_frame_bytes(&mut stream) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(FrameError::Io(e)) => {
                tracing::debug!(pid = cred.pid, "connection ended: {e}");
                return;
            }
            Err(e) => {
                // The stream may be out of step after a bad frame: answer, then close.
                tracing::warn!(pid = cred.pid, uid = cred.uid, "bad frame: {e}");
                reply(&mut stream, Response::Error { message: e.to_string() });
                return;
            }
        };
        let response = match wire::decode_request(&body) {
            Ok(request) => handle(request, cred, node, access),
            Err(e) => {
                tracing::warn!(pid = cred.pid, uid = cred.uid, "bad request: {e}");
                Response::Error { message: e.to_string() }
            }
        };
        if !reply(&mut stream, response) {
            return;
        }
    }
}

fn reply(stream: &mut UnixStream, response: Response) -> bool {
    let frame = ResponseFrame {
        version: PROTOCOL_VERSION,
        response,
    };
    wire::write_frame(stream, &frame).is_ok()
}

pub(crate) fn handle(request: Request, cred: PeerCred, node: &Mutex<Node>, access: &Access) -> Response {
    let denied = |what: &str| Response::Error {
        message: format!("uid {} may not {what}: only root and the Slurm user may", cred.uid),
    };
    // A panic in one request must not poison the node for everyone: recover the guard.
    let mut node = node.lock().unwrap_or_else(|p| p.into_inner());
    let result = match request {
        Request::Place(req) if access.may_place(cred.uid) => node.place(&req),
        Request::Place(_) => return denied("place tasks"),
        Request::Finish(req) if access.may_place(cred.uid) => node.finish(&req),
        Request::Finish(_) => return denied("finish tasks"),
        Request::Status => node.status().map(Response::Status),
        Request::Report(req) => node.report(&req, cred.uid, access.may_place(cred.uid)),
    };
    result.unwrap_or_else(|e| {
        tracing::error!("{e}");
        Response::Error { message: e.to_string() }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, GpuSpec};
    use multiplex_protocol::{FinishRequest, PlaceRequest};

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

    fn place() -> Request {
        Request::Place(PlaceRequest {
            job_id: 1,
            step_id: 0,
            uid: 1000,
            app: "a".into(),
            mem_mb: None,
            node: "n1".into(),
            slurm_cuda_visible_devices: None,
            slurm_job_gpus: None,
            slurm_shards_on_node: None,
            restarts: 0,
            cannot_wait: false,
        })
    }

    #[test]
    fn only_root_and_the_slurm_user_place_and_finish() {
        let dir = tempfile::tempdir().unwrap();
        let node = node(dir.path());
        let access = Access {
            privileged_uids: vec![64030],
        };
        let user = PeerCred { pid: 1, uid: 1000 };
        for request in [
            place(),
            Request::Finish(FinishRequest {
                job_id: 1,
                step_id: 0,
                exit_status: 0,
            }),
        ] {
            match handle(request, user, &node, &access) {
                Response::Error { message } => assert!(message.contains("uid 1000 may not"), "{message}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            handle(Request::Status, user, &node, &access),
            Response::Status(_)
        ));
        let slurm = PeerCred { pid: 1, uid: 64030 };
        assert!(matches!(handle(place(), slurm, &node, &access), Response::Placed(_)));
        let root = PeerCred { pid: 1, uid: 0 };
        assert!(
            matches!(handle(place(), root, &node, &access), Response::Placed(_)),
            "asking twice is idempotent"
        );
    }
}
