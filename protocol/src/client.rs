//! A blocking client with timeouts, for code running inside Slurm processes (no threads, no
//! runtime): connect, send one request, read one response.

use crate::wire::{self, FrameError, Request, RequestFrame, Response, PROTOCOL_VERSION};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Why the daemon could not be asked; the text is shown to users as is.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to multiplexd at {path}: {source}")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("multiplexd at {path} did not answer within {timeout_ms} ms")]
    Timeout { path: PathBuf, timeout_ms: u64 },
    #[error("talking to multiplexd at {path}: {source}")]
    Frame { path: PathBuf, source: FrameError },
    #[error("multiplexd at {path} closed the connection without answering")]
    Closed { path: PathBuf },
}

/// One connection to a daemon.
pub struct Client {
    path: PathBuf,
    stream: UnixStream,
    timeout: Duration,
}

impl Client {
    /// Connects with read and write timeouts of `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        let set = |r: std::io::Result<()>| {
            r.map_err(|source| ClientError::Connect {
                path: path.to_path_buf(),
                source,
            })
        };
        set(stream.set_read_timeout(Some(timeout)))?;
        set(stream.set_write_timeout(Some(timeout)))?;
        Ok(Client {
            path: path.to_path_buf(),
            stream,
            timeout,
        })
    }

    /// Sends `request` and waits for the answer: `timeout` bounds the whole exchange, so a
    /// daemon that trickles its answer byte by byte cannot hold the caller longer.
    pub fn call(&mut self, request: Request) -> Result<Response, ClientError> {
        let frame = RequestFrame {
            version: PROTOCOL_VERSION,
            request,
        };
        let mut io = Deadline {
            stream: &self.stream,
            until: Instant::now() + self.timeout,
        };
        wire::write_frame(&mut io, &frame).map_err(|e| self.error(e))?;
        let body = wire::read_frame_bytes(&mut io)
            .map_err(|e| self.error(e))?
            .ok_or_else(|| ClientError::Closed {
                path: self.path.clone(),
            })?;
        wire::decode_response(&body).map_err(|e| self.error(e))
    }

    fn error(&self, e: FrameError) -> ClientError {
        match e {
            FrameError::Io(io)
                if matches!(io.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
            {
                ClientError::Timeout {
                    path: self.path.clone(),
                    timeout_ms: self.timeout.as_millis() as u64,
                }
            }
            other => ClientError::Frame {
                path: self.path.clone(),
                source: other,
            },
        }
    }
}

/// The stream with one deadline for every read and write: each call gets the time left.
struct Deadline<'a> {
    stream: &'a UnixStream,
    until: Instant,
}

impl Deadline<'_> {
    fn arm(&self, set: impl Fn(&UnixStream, Option<Duration>) -> std::io::Result<()>) -> std::io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        set(self.stream, Some(left))
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.arm(UnixStream::set_read_timeout)?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.arm(UnixStream::set_write_timeout)?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Connects, asks once, and returns the answer.
pub fn call(path: &Path, timeout: Duration, request: Request) -> Result<Response, ClientError> {
    Client::connect(path, timeout)?.call(request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A daemon that behaves as `serve` says, on a socket of its own in a directory that is
    /// removed when the returned guard drops.
    fn fake_daemon(
        name: &str,
        serve: impl FnOnce(UnixStream) + Send + 'static,
    ) -> (tempfile::TempDir, PathBuf, std::thread::JoinHandle<()>) {
        let dir = tempfile::Builder::new()
            .prefix(&format!("multiplex-client-{name}-"))
            .tempdir()
            .unwrap();
        let path = dir.path().join("d.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let handle = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            serve(stream);
        });
        (dir, path, handle)
    }

    fn ask(path: &Path, timeout_ms: u64) -> (Result<Response, ClientError>, Duration) {
        let start = Instant::now();
        let r = call(path, Duration::from_millis(timeout_ms), Request::Status);
        (r, start.elapsed())
    }

    #[test]
    fn a_silent_daemon_is_a_timeout() {
        let (_dir, path, _h) = fake_daemon("silent", |s| {
            std::thread::sleep(Duration::from_secs(3));
            drop(s);
        });
        let (r, took) = ask(&path, 200);
        assert!(matches!(r, Err(ClientError::Timeout { timeout_ms: 200, .. })), "{r:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn a_daemon_trickling_bytes_cannot_stretch_the_timeout() {
        let (_dir, path, _h) = fake_daemon("trickle", |mut s| {
            // A length prefix of 1000 bytes, then one byte every 50 ms, for 3 s.
            let _ = s.write_all(&1000u32.to_be_bytes());
            for _ in 0..60 {
                if s.write_all(b" ").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (r, took) = ask(&path, 300);
        assert!(matches!(r, Err(ClientError::Timeout { .. })), "{r:?}");
        assert!(
            took < Duration::from_secs(2),
            "one deadline for the whole answer: {took:?}"
        );
    }

    #[test]
    fn garbage_is_an_error_that_says_so() {
        // Each answers after reading the request, as a server does: answering before would
        // race the client's write against the hang-up (a broken pipe, not the garbage).
        let (_dir, path, h) = fake_daemon("garbage", |mut s| {
            let _ = wire::read_frame_bytes(&mut s);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nhello");
        });
        let (r, _) = ask(&path, 1000);
        h.join().unwrap();
        let e = r.unwrap_err();
        assert!(matches!(e, ClientError::Frame { .. }), "{e:?}");
        assert!(e.to_string().contains("larger than"), "{e}");

        let (_dir, path, h) = fake_daemon("json-garbage", |mut s| {
            let _ = wire::read_frame_bytes(&mut s);
            let body = br#"{"version":2,"nonsense":true}"#;
            let _ = s.write_all(&(body.len() as u32).to_be_bytes());
            let _ = s.write_all(body);
        });
        let (r, _) = ask(&path, 1000);
        h.join().unwrap();
        let e = r.unwrap_err();
        assert!(e.to_string().contains("malformed message"), "{e}");
    }

    #[test]
    fn a_daemon_that_hangs_up_is_an_error() {
        let (_dir, path, h) = fake_daemon("hangup", drop);
        let (r, _) = ask(&path, 1000);
        h.join().unwrap();
        assert!(r.is_err(), "{r:?}");
    }
}
