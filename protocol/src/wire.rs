//! Messages on `multiplexd`'s Unix socket.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of JSON. Every frame
//! carries the protocol version; a peer that speaks another version gets an error reply, not
//! a guess. One request and one response per round trip; a connection may carry several.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// The protocol version both ends must speak.
pub const PROTOCOL_VERSION: u32 = 1;

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
    /// Where should this job step run? (root or the Slurm user only)
    Place(PlaceRequest),
    /// This job step ended. (root or the Slurm user only)
    Finish(FinishRequest),
    /// What runs where on this node.
    Status,
    /// Something a running job says about itself. (root, the Slurm user, or the job's user)
    Report(ReportRequest),
    /// Why a job got its GPU or was declined, who shared it, what was learned: `multiplexd
    /// explain` for users who may not read the history file. (Where Slurm keeps jobs private,
    /// the job's own user, root and the Slurm user only.)
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

/// A job step asking for its GPU, with what Slurm allocated to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlaceRequest {
    pub job_id: u32,
    pub step_id: u32,
    pub uid: u32,
    /// The application key the history is kept under.
    pub app: String,
    /// The user's estimate of peak GPU memory, MiB.
    pub mem_mb: Option<u64>,
    /// The Slurm node name (several may share one host).
    pub node: String,
    /// `CUDA_VISIBLE_DEVICES` as Slurm set it.
    pub slurm_cuda_visible_devices: Option<String>,
    /// `SLURM_JOB_GPUS` as Slurm set it.
    pub slurm_job_gpus: Option<String>,
    /// `SLURM_SHARDS_ON_NODE` as Slurm set it.
    pub slurm_shards_on_node: Option<String>,
    /// How many times Slurm has requeued the job so far (slurmstepd's own count: declines and
    /// failures alike), by which the daemon backs off and bounds its declines. Absent from an
    /// older plugin: 0.
    #[serde(default)]
    pub restarts: u32,
    /// The step cannot wait to be started again: it is not a batch script, or requeueing its
    /// job failed (`--no-requeue`, `JobRequeue=0`). It takes any GPU where it fits rather than
    /// be declined for a poor partner. Absent from an older plugin: false.
    #[serde(default)]
    pub cannot_wait: bool,
    /// The job's admin comment as slurmstepd read it from slurmctld (job_submit's tag first):
    /// the daemon adds where the job runs after it, keeping the rest. Absent from an older
    /// plugin: nothing is added.
    #[serde(default)]
    pub admin_comment: Option<String>,
}

impl PlaceRequest {
    /// Step 0 of job `job_id` of `app`, by `uid`, on `node`, with nothing else known: no
    /// memory hint, no GPU Slurm bound, no restarts, no admin comment. What the simulator
    /// asks, and the base of tests' requests (`PlaceRequest { cannot_wait: true,
    /// ..PlaceRequest::new(..) }`).
    pub fn new(job_id: u32, uid: u32, app: impl Into<String>, node: impl Into<String>) -> Self {
        PlaceRequest {
            job_id,
            step_id: 0,
            uid,
            app: app.into(),
            mem_mb: None,
            node: node.into(),
            slurm_cuda_visible_devices: None,
            slurm_job_gpus: None,
            slurm_shards_on_node: None,
            restarts: 0,
            cannot_wait: false,
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
    Placed(Placement),
    /// No GPU of this node can take the step safely: try again after `retry_after_s`
    /// seconds, or, when it is 0, never here (the job cannot fit on this node at all).
    Declined {
        reason: String,
        retry_after_s: u32,
    },
    Finished,
    Status(NodeStatus),
    /// The report was recorded; the text says what follows from it.
    Reported {
        message: String,
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

/// The daemon's decision for one job step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// Index of the chosen GPU on the node (as CUDA numbers it).
    pub gpu: u32,
    /// Job ids of the tasks already sharing that GPU.
    pub corunners: Vec<u32>,
    /// Predicted speed of this job relative to running alone (1.0 = no slowdown).
    pub predicted_speed: f64,
    /// One line saying why this GPU.
    pub reason: String,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, when the site uses MPS.
    pub mps_thread_percentage: Option<u32>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in MiB, when the site uses MPS.
    pub mps_mem_limit_mb: Option<u64>,
    /// The chosen GPU's UUID, where the daemon knows it (NVML): `CUDA_VISIBLE_DEVICES` names
    /// the GPU by it, since NVML's index (`gpu`) and CUDA's differ unless
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`. Absent from daemons that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_uuid: Option<String>,
}

impl Placement {
    /// The environment variables the SPANK plugin sets in every task of the step.
    pub fn environment(&self) -> Vec<(String, String)> {
        let mut env = vec![
            (
                "CUDA_VISIBLE_DEVICES".to_string(),
                self.gpu_uuid.clone().unwrap_or_else(|| self.gpu.to_string()),
            ),
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
        if let Some(m) = self.mps_mem_limit_mb {
            env.push((
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(),
                format!("{}={m}M", self.gpu),
            ));
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

    fn place() -> Request {
        Request::Place(PlaceRequest {
            job_id: 7,
            step_id: 0,
            uid: 1000,
            app: "bert".into(),
            mem_mb: Some(16384),
            node: "n1".into(),
            slurm_cuda_visible_devices: Some("1".into()),
            slurm_job_gpus: Some("1".into()),
            slurm_shards_on_node: Some("1".into()),
            restarts: 0,
            cannot_wait: false,
            admin_comment: None,
        })
    }

    #[test]
    fn request_round_trips_through_a_frame() {
        let mut buf = Vec::new();
        let frame = RequestFrame {
            version: PROTOCOL_VERSION,
            request: place(),
        };
        write_frame(&mut buf, &frame).unwrap();
        let body = read_frame_bytes(&mut buf.as_slice()).unwrap().unwrap();
        assert_eq!(decode_request(&body).unwrap(), place());
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
            decode_request(br#"{"version":1,"request":{"type":"fly"}}"#),
            Err(FrameError::Malformed(_))
        ));
        assert!(matches!(
            decode_request(br#"{"version":99,"request":{"type":"status"}}"#),
            Err(FrameError::Version { got: 99 })
        ));
    }

    #[test]
    fn placement_environment() {
        let p = Placement {
            gpu: 1,
            corunners: vec![12, 13],
            predicted_speed: 0.8123,
            reason: "r".into(),
            mps_thread_percentage: Some(50),
            mps_mem_limit_mb: Some(8192),
            gpu_uuid: None,
        };
        let env: std::collections::HashMap<_, _> = p.environment().into_iter().collect();
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "1");
        assert_eq!(env["MULTIPLEX_CORUNNERS"], "12,13");
        assert_eq!(env["MULTIPLEX_PREDICTED_SPEED"], "0.812");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "1=8192M");
        // Where NVML gave the GPU's UUID, CUDA is told the GPU by it; scripts still get the index.
        let p = Placement {
            gpu_uuid: Some("GPU-5a1c0e2e-7b1f-4f0e-9d1e-0c3e1b2a4d5f".into()),
            ..p
        };
        let env: std::collections::HashMap<_, _> = p.environment().into_iter().collect();
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-5a1c0e2e-7b1f-4f0e-9d1e-0c3e1b2a4d5f");
        assert_eq!(env["MULTIPLEX_GPU"], "1");
        // A daemon from before the UUID: the field is absent, and the index is used.
        let old = r#"{"gpu":2,"corunners":[],"predicted_speed":1.0,"reason":"r","mps_thread_percentage":null,"mps_mem_limit_mb":null}"#;
        let p: Placement = serde_json::from_str(old).unwrap();
        assert_eq!(p.gpu_uuid, None);
        assert!(!serde_json::to_string(&p).unwrap().contains("gpu_uuid"));
    }
}
