//! GPU telemetry through NVML (loaded at run time): per-GPU utilisation and memory, and each
//! GPU process's memory and SM utilisation, mapped to its Slurm job through the process's
//! cgroup (or, failing that, its environment). The daemon keeps per job the peak GPU memory
//! and the mean SM utilisation of its processes. Without a GPU driver the daemon says so once
//! and learns from the other signals (start and end times, job reports).

use crate::background::Trouble;
pub use crate::gpus::{GpuSample, ProcSample};
use crate::node::Node;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where samples come from: NVML on a GPU node, a fake in tests.
pub trait Probe: Send {
    fn sample(&mut self) -> Result<Vec<GpuSample>, String>;
}

/// NVML, for the node's shared GPUs.
pub struct NvmlProbe {
    nvml: nvml_wrapper::Nvml,
    indices: Vec<u32>,
    /// NVML's timestamp of the last process utilisation sample seen, per GPU.
    last_seen: Vec<u64>,
}

impl NvmlProbe {
    /// Loads NVML; an error says why (no driver, no library).
    pub fn open(indices: Vec<u32>) -> Result<NvmlProbe, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| e.to_string())?;
        let last_seen = vec![0; indices.len()];
        Ok(NvmlProbe {
            nvml,
            indices,
            last_seen,
        })
    }
}

impl Probe for NvmlProbe {
    fn sample(&mut self) -> Result<Vec<GpuSample>, String> {
        let mut out = Vec::with_capacity(self.indices.len());
        for (k, &index) in self.indices.iter().enumerate() {
            let dev = self
                .nvml
                .device_by_index(index)
                .map_err(|e| format!("GPU {index}: {e}"))?;
            let mut processes: Vec<ProcSample> = dev
                .running_compute_processes()
                .map_err(|e| format!("GPU {index}: {e}"))?
                .into_iter()
                .map(|p| ProcSample {
                    pid: p.pid,
                    mem_mb: match p.used_gpu_memory {
                        nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b / (1024 * 1024)),
                        nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                    },
                    sm_util_pct: None,
                })
                .collect();
            // Per-process utilisation is not supported everywhere (pre-Maxwell, some vGPU):
            // then processes carry memory only.
            // NVML keeps a sample per process and sampling period since `last_seen`: a
            // process's utilisation is their mean, so that the daemon's count of its busy time
            // covers the whole interval, not the latest instant.
            if let Ok(stats) = dev.process_utilization_stats(self.last_seen[k]) {
                let mut sums: std::collections::HashMap<u32, (u64, u64)> = Default::default();
                for s in stats {
                    self.last_seen[k] = self.last_seen[k].max(s.timestamp);
                    let e = sums.entry(s.pid).or_default();
                    *e = (e.0 + u64::from(s.sm_util), e.1 + 1);
                }
                for p in &mut processes {
                    if let Some(&(sum, n)) = sums.get(&p.pid) {
                        p.sm_util_pct = Some((sum as f64 / n as f64).round() as u32);
                    }
                }
            }
            out.push(GpuSample { index, processes });
        }
        Ok(out)
    }
}

/// The Slurm job a process claims and the uid it runs as: the job from its cgroup path
/// (`.../job_1234/step_0/...`, cgroup v1 and v2 alike) or else its environment
/// (`SLURM_JOB_ID`), the uid from `/proc/PID/status`. Neither names the job on Slurm's word
/// alone (a user may name a cgroup of their own `job_N`, or set `SLURM_JOB_ID` in any
/// process), so [`Node::record_telemetry`] counts a process for a job only where it runs as
/// the job's user: a user's processes can only ever be counted for that user's own jobs.
pub fn job_of_pid(pid: u32) -> Option<(u32, u32)> {
    let job = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()
        .and_then(|c| job_from_cgroup(&c))
        .or_else(|| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .ok()
                .and_then(|e| job_from_environ(&e))
        })?;
    let uid = uid_from_status(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)?;
    Some((job, uid))
}

/// The real uid in a `/proc/PID/status` text.
pub fn uid_from_status(text: &str) -> Option<u32> {
    text.lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The job id in a `/proc/PID/cgroup` text, if Slurm put the process in a job cgroup.
pub fn job_from_cgroup(text: &str) -> Option<u32> {
    text.lines()
        .flat_map(|l| l.split('/'))
        .find_map(|seg| seg.strip_prefix("job_").and_then(|id| id.parse().ok()))
}

/// `SLURM_JOB_ID` in a `/proc/PID/environ` block.
pub fn job_from_environ(environ: &[u8]) -> Option<u32> {
    environ
        .split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"SLURM_JOB_ID="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// Samples every `interval` until `shutdown`, recording into the node. Failures are logged
/// once per distinct error.
pub fn spawn(node: Arc<Mutex<Node>>, mut probe: Box<dyn Probe>, interval: Duration, shutdown: Arc<AtomicBool>) {
    let mut trouble = Trouble::default();
    let started = crate::background::every("telemetry", interval, shutdown, move || {
        // NVML is asked outside the node's lock: placements never wait for the driver.
        match probe.sample() {
            Ok(samples) => {
                if trouble.recovered() {
                    tracing::info!("GPU telemetry works again");
                }
                let mut node = node.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(e) = node.record_telemetry(&samples, &job_of_pid) {
                    tracing::warn!(error = %e, "cannot record GPU telemetry");
                }
            }
            Err(e) => {
                if trouble.failed(&e) {
                    tracing::warn!(error = %e, "GPU telemetry failed; trying again every interval");
                }
            }
        }
    });
    if let Err(e) = started {
        tracing::error!("cannot start the telemetry thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_from_cgroups_of_both_versions_and_from_the_environment() {
        let v2 = "0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n";
        let v1 = "12:memory:/slurm/uid_1000/job_77/step_batch/task_0\n11:cpuset:/slurm/uid_1000/job_77/step_batch\n";
        let none = "0::/user.slice/user-1000.slice/session-3.scope\n";
        assert_eq!(job_from_cgroup(v2), Some(1234));
        assert_eq!(job_from_cgroup(v1), Some(77));
        assert_eq!(job_from_cgroup(none), None);
        assert_eq!(job_from_environ(b"HOME=/root\0SLURM_JOB_ID=42\0X=1\0"), Some(42));
        assert_eq!(job_from_environ(b"SLURM_JOB_ID=x\0"), None);
        assert_eq!(job_from_environ(b""), None);
    }

    #[test]
    fn the_uid_a_process_runs_as() {
        let status = "Name:\tpython3\nUmask:\t0022\nState:\tR (running)\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\t100\t100\t100\n";
        assert_eq!(uid_from_status(status), Some(1000));
        assert_eq!(uid_from_status("Name:\tx\n"), None);
        // This process, through the real file.
        let mine = job_of_pid(std::process::id());
        let uid = uid_from_status(&std::fs::read_to_string("/proc/self/status").unwrap()).unwrap();
        assert!(mine.is_none_or(|(_, u)| u == uid), "{mine:?}");
    }
}
