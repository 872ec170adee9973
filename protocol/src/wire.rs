//! Messages on `multiplexd`'s Unix socket.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of JSON. Every frame
//! carries the protocol version; a peer that speaks another version gets an error reply, not
//! a guess. One request and one response per round trip; a connection may carry several.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// The protocol version both ends must speak. 2: a step's start is recorded where Slurm put
/// it (`start`); the daemon no longer chooses a GPU at launch (`place`, version 1).
pub const PROTOCOL_VERSION: u32 = 2;

/// Largest frame either side accepts (bytes of JSON).
pub const MAX_FRAME: usize = 256 * 1024;

/// Slurm's reserved step ids (slurm.h; the same in 22.05 and 24.11, checked against the headers
/// by the SPANK plugin's tests).
pub const BATCH_STEP: u32 = 0xffff_fffb;
pub const EXTERN_STEP: u32 = 0xffff_fffc;
pub const INTERACTIVE_STEP: u32 = 0xffff_fffa;

/// A job step id as people read it: `batch`, `extern`, `interactive`, or the number.
pub fn step_label(step_id: u32) -> String {
    match step_id {
        BATCH_STEP => "batch".into(),
        EXTERN_STEP => "extern".into(),
        INTERACTIVE_STEP => "interactive".into(),
        n => n.to_string(),
    }
}

/// A request with its version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestFrame {
    pub version: u32,
    pub request: Request,
}

/// A response with its version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseFrame {
    pub version: u32,
    pub response: Response,
}

/// What a client asks of the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    /// This job step started where Slurm put it: record it there. (root or the Slurm user only)
    Start(StartRequest),
    /// This job step ended. (root or the Slurm user only)
    Finish(FinishRequest),
    /// What runs where on this node.
    Status,
    /// Something a running job says about itself. (root, the Slurm user, or the job's user)
    Report(ReportRequest),
    /// Where a job ran and beside whom, what was predicted and learned: `multiplexd explain`
    /// for users who may not read the history file. (Where Slurm keeps jobs private, the job's
    /// own user, root and the Slurm user only.)
    Explain { job_id: u32 },
}

/// A running job's report about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportRequest {
    pub job_id: u32,
    pub kind: ReportKind,
}

/// What a job reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ReportKind {
    /// Work done so far, in the job's own unit (iterations, samples), counted from its start.
    Progress { done: f64 },
    /// The job ran out of GPU memory beside its current co-runners.
    OutOfMemory,
}

/// A job step that started, with what Slurm allocated to it and what slurmctld says of the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartRequest {
    pub job_id: u32,
    pub step_id: u32,
    pub uid: u32,
    /// The application key the history is kept under.
    pub app: String,
    /// The user's estimate of peak GPU memory, MiB.
    pub mem_mb: Option<u64>,
    /// The Slurm node name (several may share one host).
    pub node: String,
    /// The job's gres per node as slurmctld holds it (`shard:v100_1:1`, `gres/shard:1`): a
    /// claimed job's names its GPU by type.
    pub slurm_gres: Option<String>,
    /// The node's index of the GPU Slurm allocated the job, from slurmctld's detail of its
    /// allocation (what `scontrol show job -d` shows; never the job's environment).
    pub slurm_job_gpus: Option<String>,
    /// The job's admin comment as slurmstepd read it from slurmctld (job_submit's tag first,
    /// then the claimer's note).
    pub admin_comment: Option<String>,
}

impl StartRequest {
    /// Step 0 of job `job_id` of `app`, by `uid`, on `node`, bound to GPU `gpu`, with nothing
    /// else known: what the simulator says, and the base of tests' requests.
    pub fn new(job_id: u32, uid: u32, app: impl Into<String>, node: impl Into<String>, gpu: u32) -> Self {
        StartRequest {
            job_id,
            step_id: 0,
            uid,
            app: app.into(),
            mem_mb: None,
            node: node.into(),
            slurm_gres: None,
            slurm_job_gpus: Some(gpu.to_string()),
            admin_comment: None,
        }
    }
}

/// A job step's end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinishRequest {
    pub job_id: u32,
    pub step_id: u32,
    /// The worst wait status of the step's tasks on this node.
    pub exit_status: i32,
}

/// What the daemon answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    /// Recorded on the GPU Slurm bound it to: what its tasks should know.
    Started(Placement),
    /// No GPU of this node could ever hold the job (it needs more memory than the largest
    /// has): the step fails with this reason.
    Refused {
        reason: String,
    },
    Finished,
    Status(NodeStatus),
    /// The report was recorded; the text says what follows from it.
    Reported {
        message: String,
        /// The job ran out of memory beside a partner and the daemon put it back in Slurm's
        /// queue: it runs again from the start, and should exit without counting as failed.
        #[serde(default)]
        put_back: bool,
    },
    /// A job explained: the text for people, and the same as JSON (`null`, with no text,
    /// when the node's history has nothing on the job).
    Explained {
        text: String,
        json: serde_json::Value,
    },
    Error {
        message: String,
    },
}

/// Where a job step runs, as the daemon recorded it, and what it predicts of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// The node's index of the GPU Slurm bound the job to.
    pub gpu: u32,
    /// Job ids of the tasks already sharing that GPU.
    pub corunners: Vec<u32>,
    /// Predicted speed of this job relative to running alone (1.0 = no slowdown).
    pub predicted_speed: f64,
    /// One line saying how the job came to this GPU, and what its partners predict.
    pub reason: String,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, when the site uses MPS.
    pub mps_thread_percentage: Option<u32>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in MiB, when the site uses MPS.
    pub mps_mem_limit_mb: Option<u64>,
}

impl Placement {
    /// The environment variables the SPANK plugin sets in every task of the step. Never
    /// `CUDA_VISIBLE_DEVICES`: Slurm's own (its device cgroup's view) stands.
    pub fn environment(&self) -> Vec<(String, String)> {
        let mut env = vec![
            ("MULTIPLEX_GPU".to_string(), self.gpu.to_string()),
            (
                "MULTIPLEX_CORUNNERS".to_string(),
                self.corunners.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            ),
            (
                "MULTIPLEX_PREDICTED_SPEED".to_string(),
                format!("{:.3}", self.predicted_speed),
            ),
            ("MULTIPLEX_DECISION".to_string(), self.reason.clone()),
        ];
        if let Some(p) = self.mps_thread_percentage {
            env.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_string(), p.to_string()));
        }
        // The one GPU the job sees is its device 0, whatever the node calls it.
        if let Some(m) = self.mps_mem_limit_mb {
            env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(), format!("0={m}M")));
        }
        env
    }
}

/// What `status` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    pub jobs_per_gpu: u32,
    pub gpus: Vec<GpuStatus>,
}

/// One shared GPU and who runs on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub model: String,
    pub memory_mb: u64,
    pub tasks: Vec<TaskStatus>,
}

/// One placed job on a GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskStatus {
    pub job_id: u32,
    pub app: String,
    pub uid: u32,
    pub since_unix_s: i64,
}

/// Framing and decoding failures.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("frame of {0} bytes is larger than the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("protocol version {got} is not supported (this side speaks {PROTOCOL_VERSION})")]
    Version { got: u32 },
}

/// Writes one frame holding `msg` as JSON.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    let body = serde_json::to_vec(msg).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame's bytes. `Ok(None)` when the peer closed cleanly before a new frame. The
/// body grows with what arrives, never with the length the prefix declares (a peer that
/// declares 256 KiB and sends 10 bytes costs 10 bytes).
pub fn read_frame_bytes(r: &mut impl Read) -> Result<Option<Vec<u8>>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(FrameError::Malformed(
                    "connection closed inside the length prefix".into(),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    let mut body = Vec::new();
    r.take(n as u64).read_to_end(&mut body)?;
    if body.len() < n {
        return Err(FrameError::Malformed(format!("truncated frame: expected {n} bytes")));
    }
    Ok(Some(body))
}

/// Decodes a request frame, checking its version.
pub fn decode_request(body: &[u8]) -> Result<Request, FrameError> {
    decode_versioned(body, |f: RequestFrame| (f.version, f.request))
}

/// Decodes a response frame, checking its version.
pub fn decode_response(body: &[u8]) -> Result<Response, FrameError> {
    decode_versioned(body, |f: ResponseFrame| (f.version, f.response))
}

fn decode_versioned<F: serde::de::DeserializeOwned, T>(
    body: &[u8],
    split: impl FnOnce(F) -> (u32, T),
) -> Result<T, FrameError> {
    // Look at the version first, so a newer peer gets "version" rather than "malformed".
    #[derive(Deserialize)]
    struct VersionOnly {
        version: u32,
    }
    let v: VersionOnly = serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if v.version != PROTOCOL_VERSION {
        return Err(FrameError::Version { got: v.version });
    }
    let frame: F = serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))?;
    Ok(split(frame).1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start() -> Request {
        Request::Start(StartRequest {
            mem_mb: Some(16384),
            slurm_gres: Some("shard:v100_1:1".into()),
            admin_comment: Some("multiplex:app=bert".into()),
            ..StartRequest::new(7, 1000, "bert", "n1", 1)
        })
    }

    #[test]
    fn request_round_trips_through_a_frame() {
        let mut buf = Vec::new();
        let frame = RequestFrame {
            version: PROTOCOL_VERSION,
            request: start(),
        };
        write_frame(&mut buf, &frame).unwrap();
        let body = read_frame_bytes(&mut buf.as_slice()).unwrap().unwrap();
        assert_eq!(decode_request(&body).unwrap(), start());
    }

    #[test]
    fn bad_frames_are_errors_not_panics() {
        // Length prefix larger than the limit.
        let big = ((MAX_FRAME + 1) as u32).to_be_bytes();
        assert!(matches!(read_frame_bytes(&mut &big[..]), Err(FrameError::TooLarge(_))));
        // Truncated body.
        let mut short = 10u32.to_be_bytes().to_vec();
        short.extend_from_slice(b"{\"a\"");
        assert!(matches!(
            read_frame_bytes(&mut short.as_slice()),
            Err(FrameError::Malformed(_))
        ));
        // Truncated length.
        assert!(matches!(
            read_frame_bytes(&mut &[0u8, 1][..]),
            Err(FrameError::Malformed(_))
        ));
        // Clean close.
        assert!(read_frame_bytes(&mut &[][..]).unwrap().is_none());
        // Not JSON, wrong shape, wrong version.
        assert!(matches!(decode_request(b"garbage"), Err(FrameError::Malformed(_))));
        assert!(matches!(
            decode_request(br#"{"version":2,"request":{"type":"fly"}}"#),
            Err(FrameError::Malformed(_))
        ));
        // A plugin of version 1 (which asked where to run) is told the version, not misread.
        assert!(matches!(
            decode_request(br#"{"version":1,"request":{"type":"place","job_id":1}}"#),
            Err(FrameError::Version { got: 1 })
        ));
        assert!(matches!(
            decode_request(br#"{"version":99,"request":{"type":"status"}}"#),
            Err(FrameError::Version { got: 99 })
        ));
    }

    #[test]
    fn placement_environment_leaves_slurms_gpu_alone() {
        let p = Placement {
            gpu: 1,
            corunners: vec![12, 13],
            predicted_speed: 0.8123,
            reason: "r".into(),
            mps_thread_percentage: Some(50),
            mps_mem_limit_mb: Some(8192),
        };
        let env: std::collections::HashMap<_, _> = p.environment().into_iter().collect();
        assert!(!env.contains_key("CUDA_VISIBLE_DEVICES"), "{env:?}");
        assert_eq!(env["MULTIPLEX_GPU"], "1");
        assert_eq!(env["MULTIPLEX_CORUNNERS"], "12,13");
        assert_eq!(env["MULTIPLEX_PREDICTED_SPEED"], "0.812");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
        // The job sees its one GPU as device 0.
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M");
    }
}
