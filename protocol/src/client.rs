//! A blocking client with timeouts, for code running inside Slurm processes (no threads, no
//! runtime): connect, send one request, read one response.

use crate::wire::{self, FrameError, Request, RequestFrame, Response, PROTOCOL_VERSION};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

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

    /// Sends `request` and waits for the answer.
    pub fn call(&mut self, request: Request) -> Result<Response, ClientError> {
        let frame = RequestFrame {
            version: PROTOCOL_VERSION,
            request,
        };
        wire::write_frame(&mut self.stream, &frame).map_err(|e| self.error(e))?;
        let body = wire::read_frame_bytes(&mut self.stream)
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

/// Connects, asks once, and returns the answer.
pub fn call(path: &Path, timeout: Duration, request: Request) -> Result<Response, ClientError> {
    Client::connect(path, timeout)?.call(request)
}
