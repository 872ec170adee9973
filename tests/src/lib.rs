//! Helpers for tests that drive the local Slurm cluster the way a user does: sbatch, scontrol,
//! job output files, and the daemons' SQLite histories.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The running test cluster, found through `SLURM_CONF` (as `tests/run` sets it).
pub struct Cluster {
    pub state: PathBuf,
}

/// What sbatch said.
pub struct Submitted {
    pub ok: bool,
    pub job_id: Option<u32>,
    pub stderr: String,
}

impl Cluster {
    /// The cluster named by `SLURM_CONF`; panics with what to do when there is none.
    pub fn from_env() -> Cluster {
        let conf = std::env::var("SLURM_CONF").expect(
            "SLURM_CONF is not set: start the cluster with `export $(tests/cluster/up | tail -1)` or run tests/run",
        );
        let state = PathBuf::from(conf)
            .parent()
            .and_then(|p| p.parent())
            .expect("SLURM_CONF=<state>/etc/slurm.conf")
            .to_path_buf();
        assert!(
            state.join("run/slurmctld.pid").exists(),
            "no cluster running under {}",
            state.display()
        );
        Cluster { state }
    }

    /// What `scontrol --version` says (`slurm 22.05.8`).
    pub fn slurm_version(&self) -> String {
        let out = Command::new("scontrol")
            .arg("--version")
            .output()
            .expect("run scontrol --version");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Whether this cluster's Slurm keeps a GPU from being held whole and as shards at once
    /// (23.11 on): where it does not, plain GPU jobs are kept off the shared nodes.
    pub fn keeps_whole_and_shards_apart(&self) -> bool {
        multiplexd::slurm::keeps_whole_and_shards_apart(&self.slurm_version())
    }

    /// `TresPerNode` of a job asking `count` of gres `name`, as this cluster's Slurm writes it:
    /// `gres:NAME:N` up to 22.05, `gres/NAME:N` from 23.02 (what `scontrol --version` says).
    pub fn tres_gres(&self, name: &str, count: u32) -> String {
        let version = multiplexd::slurm::release_numbers(&self.slurm_version());
        let sep = if version.as_slice() >= [23, 2].as_slice() {
            '/'
        } else {
            ':'
        };
        format!("gres{sep}{name}:{count}")
    }

    /// A fresh output path for a job, under the state directory.
    pub fn output_path(&self, tag: &str) -> PathBuf {
        let dir = self.state.join("test-output");
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(format!("{tag}-%j.out"))
    }

    /// Runs `sbatch --parsable ARGS`.
    pub fn sbatch(&self, args: &[&str]) -> Submitted {
        let out = Command::new("sbatch")
            .arg("--parsable")
            .args(args)
            .current_dir(&self.state)
            .output()
            .expect("run sbatch");
        let stdout = String::from_utf8_lossy(&out.stdout);
        Submitted {
            ok: out.status.success(),
            job_id: stdout.trim().split(';').next().and_then(|s| s.parse().ok()),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Submits and expects success.
    pub fn submit(&self, args: &[&str]) -> u32 {
        let s = self.sbatch(args);
        assert!(s.ok, "sbatch {args:?} failed: {}", s.stderr);
        s.job_id.expect("sbatch printed a job id")
    }

    /// `scontrol show job -o ID` as key=value pairs.
    pub fn show_job(&self, job: u32) -> HashMap<String, String> {
        let out = Command::new("scontrol")
            .args(["show", "job", "-o", &job.to_string()])
            .output()
            .expect("run scontrol");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        parse_show(&text)
    }

    /// Waits until the job has ended and returns its final record.
    pub fn wait(&self, job: u32, timeout: Duration) -> HashMap<String, String> {
        let start = Instant::now();
        loop {
            let rec = self.show_job(job);
            let state = rec.get("JobState").cloned().unwrap_or_default();
            if [
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
                "BOOT_FAIL",
            ]
            .contains(&state.as_str())
            {
                return rec;
            }
            assert!(
                start.elapsed() < timeout,
                "job {job} still {state} after {timeout:?}: {rec:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The job's output file (StdOut of its record).
    pub fn output(&self, rec: &HashMap<String, String>) -> String {
        let path = rec.get("StdOut").expect("StdOut in job record");
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"))
    }

    /// The output of a job that may have just started: empty until slurmstepd made the file
    /// (Slurm 24.11 may call a job RUNNING before that).
    pub fn output_so_far(&self, rec: &HashMap<String, String>) -> String {
        rec.get("StdOut")
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default()
    }

    /// The history database of node `node`.
    pub fn history(&self, node: &str) -> rusqlite::Connection {
        let path = self.state.join(format!("multiplexd/{node}/history.sqlite"));
        rusqlite::Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open history")
    }

    /// Path of a file in the state directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.state.join(rel)
    }

    /// Stops node `node`'s multiplexd (SIGTERM, by its pid file) until the guard is dropped,
    /// which starts it again the way tests/cluster/up does.
    pub fn stop_daemon(&self, node: &str) -> DaemonStopped {
        stop_daemon(&self.state, node)
    }

    /// Kills node `node`'s multiplexd with SIGKILL (by its pid file), as a crash or the OOM
    /// killer would: it leaves its socket file behind. Dropping the guard starts it again.
    pub fn kill_daemon(&self, node: &str) -> DaemonStopped {
        let pid = std::fs::read_to_string(self.state.join(format!("run/multiplexd-{node}.pid")))
            .expect("multiplexd pid file");
        let pid: libc::pid_t = pid.trim().parse().expect("a pid in the pid file");
        // SAFETY: kill(2) with a pid read from the daemon's own pid file and a plain signal.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(
            rc,
            0,
            "kill -9 multiplexd {node} ({pid}): {}",
            std::io::Error::last_os_error()
        );
        assert!(
            wait_until(Duration::from_secs(10), || exited(pid)),
            "multiplexd {node} ({pid}) died"
        );
        DaemonStopped {
            state: self.state.clone(),
            node: node.to_string(),
        }
    }

    /// The index of the GPU whose shard Slurm allocated to `job`, from `scontrol show job -d`
    /// (its allocation's detail); `None` while it has none.
    pub fn job_gpu(&self, job: u32) -> Option<u32> {
        let out = Command::new("scontrol")
            .args(["show", "job", "-d", "-o", &job.to_string()])
            .output()
            .expect("run scontrol");
        multiplexd::slurm::parse_job_gpu(&String::from_utf8_lossy(&out.stdout))
    }

    /// How many shards slurmctld counts as allocated on the cluster's nodes (`sinfo -O
    /// GresUsed`): 0 once every job ended, unless a claim leaked one.
    pub fn shards_in_use(&self) -> u32 {
        let out = Command::new("sinfo")
            .args(["-h", "-N", "-O", "GresUsed:200"])
            .output()
            .expect("run sinfo");
        let text = String::from_utf8_lossy(&out.stdout);
        // Entries such as shard:v100_0:1(IDX:0) or shard:v100_1:0(0/2).
        text.split(|c: char| c == ',' || c.is_whitespace())
            .filter_map(|e| e.strip_prefix("shard:"))
            .filter_map(|e| {
                let before = e.split('(').next().unwrap_or("");
                before.rsplit(':').next().and_then(|n| n.parse::<u32>().ok())
            })
            .sum()
    }

    /// The GPUs slurmctld counts as held both whole and as shards at once (`NODE:TYPE`, from
    /// `sinfo -O GresUsed`): empty, always, or a plain job shares a GPU it was given whole.
    pub fn held_both_ways(&self) -> Vec<String> {
        let out = Command::new("sinfo")
            .args(["-h", "-N", "-O", "NodeList:0|,GresUsed:0"])
            .output()
            .expect("run sinfo");
        let text = String::from_utf8_lossy(&out.stdout);
        let shards = multiplexd::slurm::parse_in_use(&text, "shard");
        multiplexd::slurm::parse_in_use(&text, "gpu")
            .into_iter()
            .filter(|g| shards.contains(g))
            .map(|(node, kind)| format!("{node}:{kind}"))
            .collect()
    }

    /// Runs node `node`'s multiplexd with the configuration `edit` makes of its own until the
    /// guard is dropped, which runs it with its own again. Panics if `edit` changes nothing:
    /// a test would otherwise pass on a configuration it did not mean.
    pub fn daemon_config(&self, node: &str, edit: impl FnOnce(&str) -> String) -> DaemonConfig {
        let path = config_path(&self.state, node);
        let original = std::fs::read_to_string(&path).expect("read the daemon's configuration");
        let changed = edit(&original);
        assert_ne!(changed, original, "the edit changes {}", path.display());
        let stopped = self.stop_daemon(node);
        std::fs::write(&path, changed).expect("write the daemon's configuration");
        drop(stopped);
        DaemonConfig {
            state: self.state.clone(),
            node: node.to_string(),
            original,
        }
    }

    /// Makes the nodes' epilog (tests/cluster/up's) take `seconds` until the guard is dropped:
    /// a job's end, and so a requeue, then completes that much later in slurmctld.
    pub fn epilog_seconds(&self, seconds: u32) -> Restore {
        let path = self.path("etc/epilog-seconds");
        let original = std::fs::read_to_string(&path).expect("read etc/epilog-seconds");
        std::fs::write(&path, format!("{seconds}\n")).expect("write etc/epilog-seconds");
        Restore {
            path,
            original,
            settle: Duration::ZERO,
        }
    }

    /// Replaces the arguments of the plugin's line in plugstack.conf until the guard is dropped.
    /// slurmstepd reads the file for every step, so new jobs see the change at once.
    pub fn plugstack_args(&self, args: &str) -> Restore {
        let path = self.path("etc/plugstack.conf");
        let original = std::fs::read_to_string(&path).expect("read plugstack.conf");
        let line = original.lines().next().expect("plugstack.conf has the plugin's line");
        let mut words = line.split_whitespace();
        let (kind, so) = (words.next().unwrap(), words.next().unwrap());
        std::fs::write(&path, format!("{kind} {so} {args}\n")).expect("write plugstack.conf");
        Restore {
            path,
            original,
            settle: Duration::ZERO,
        }
    }

    /// Replaces job_submit/multiplex's policy file until the guard is dropped. The plugin looks
    /// for changes once a second, so this (and the drop) waits until the change is in force.
    pub fn policy(&self, text: &str) -> Restore {
        let path = self.path("etc/job_submit_multiplex.toml");
        let original = std::fs::read_to_string(&path).expect("read the policy file");
        std::fs::write(&path, text).expect("write the policy file");
        std::thread::sleep(POLICY_SETTLE);
        Restore {
            path,
            original,
            settle: POLICY_SETTLE,
        }
    }

    /// Lines of slurmctld's log that contain `needle`.
    pub fn ctld_log_lines(&self, needle: &str) -> Vec<String> {
        std::fs::read_to_string(self.path("log/slurmctld.log"))
            .expect("read slurmctld.log")
            .lines()
            .filter(|l| l.contains(needle))
            .map(String::from)
            .collect()
    }

    /// Runs `scontrol ARGS`; Ok(stdout) or Err(stderr).
    pub fn scontrol(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("scontrol").args(args).output().expect("run scontrol");
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// The state of node `node` as `sinfo` prints it (`idle`, `mix`, `drain`, ...).
    pub fn node_state(&self, node: &str) -> String {
        let out = Command::new("sinfo")
            .args(["-h", "-N", "-n", node, "-o", "%t"])
            .output()
            .expect("run sinfo");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    }
}

/// Polls `f` every 50 ms until it holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether process `pid` is gone (one this process started and never waited for stays a
/// zombie: that counts as gone).
fn exited(pid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true)
}

/// Node `node`'s multiplexd configuration in the cluster in `state`, as tests/cluster/up writes it.
fn config_path(state: &Path, node: &str) -> PathBuf {
    state.join(format!("multiplexd/{node}/multiplexd.toml"))
}

/// Stops node `node`'s multiplexd of the cluster in `state` (SIGTERM, by its pid file).
fn stop_daemon(state: &Path, node: &str) -> DaemonStopped {
    let pid_file = state.join(format!("run/multiplexd-{node}.pid"));
    let pid = std::fs::read_to_string(&pid_file).expect("multiplexd pid file");
    let pid: libc::pid_t = pid.trim().parse().expect("a pid in the pid file");
    // Not the kill(1) binary: a minimal Debian has no procps.
    // SAFETY: kill(2) with a pid read from the daemon's own pid file and a plain signal.
    let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(
        rc,
        0,
        "kill multiplexd {node} ({pid}): {}",
        std::io::Error::last_os_error()
    );
    let socket = state.join(format!("multiplexd/{node}.sock"));
    assert!(
        wait_until(Duration::from_secs(5), || !socket.exists()),
        "multiplexd {node} removed its socket on SIGTERM"
    );
    // It holds its metrics port until it exits: a daemon started again before then cannot
    // listen there, and stops.
    assert!(
        wait_until(Duration::from_secs(10), || exited(pid)),
        "multiplexd {node} ({pid}) exited after SIGTERM"
    );
    DaemonStopped {
        state: state.to_path_buf(),
        node: node.to_string(),
    }
}

/// A multiplexd running with a configuration changed for a test; dropping this runs it with
/// its own again.
pub struct DaemonConfig {
    state: PathBuf,
    node: String,
    original: String,
}

impl Drop for DaemonConfig {
    fn drop(&mut self) {
        let stopped = stop_daemon(&self.state, &self.node);
        let path = config_path(&self.state, &self.node);
        if let Err(e) = std::fs::write(&path, &self.original) {
            eprintln!("could not restore {}: {e}", path.display());
        }
        drop(stopped);
    }
}

/// A stopped multiplexd; dropping this starts it again (and waits for its socket).
pub struct DaemonStopped {
    state: PathBuf,
    node: String,
}

impl Drop for DaemonStopped {
    fn drop(&mut self) {
        let node = &self.node;
        // As tests/cluster/up started it: as the cluster's SlurmUser, its pid in its pid file.
        let started = Command::new(self.state.join("multiplexd/start"))
            .arg(node)
            .status()
            .expect("run multiplexd/start");
        assert!(
            started.success() || std::thread::panicking(),
            "multiplexd/start {node}: {started}"
        );
        // Listening, not merely there: a killed daemon left its socket file behind.
        let socket = self.state.join(format!("multiplexd/{node}.sock"));
        let listening = || std::os::unix::net::UnixStream::connect(&socket).is_ok();
        if !wait_until(Duration::from_secs(5), listening) && !std::thread::panicking() {
            panic!("multiplexd {node} did not come back");
        }
        // The cluster's claimer, back after its gate lapsed, makes it again on its first look:
        // until then a job submitted starts where Slurm puts it, unclaimed.
        let claims = std::fs::read_to_string(config_path(&self.state, node))
            .is_ok_and(|c| c.contains("\n[claim]\nenabled = true\n"));
        if claims && !wait_until(Duration::from_secs(15), gate_held) && !std::thread::panicking() {
            panic!("multiplexd {node}, the claimer, did not hold the gate again within 15 s");
        }
    }
}

/// Whether the claimer's gate (its reservation of every `multiplex` license) is in force.
pub fn gate_held() -> bool {
    Command::new("scontrol")
        .args(["show", "reservation", "multiplex-gate"])
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("State=ACTIVE"))
}

/// Jobs to cancel when the test ends, whether it passes or fails, so that a failed test
/// leaves no job holding the slots the next test needs.
pub struct Cancel(pub Vec<u32>);

impl Drop for Cancel {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let ids: Vec<String> = self.0.iter().map(u32::to_string).collect();
            let _ = Command::new("scancel").args(&ids).status();
        }
    }
}

/// How long a change of the policy file takes to be in force: job_submit/multiplex looks at
/// the file at most once a second.
pub const POLICY_SETTLE: Duration = Duration::from_millis(1300);

/// A file changed for a test; dropping this puts the original back (and waits `settle`).
pub struct Restore {
    path: PathBuf,
    original: String,
    settle: Duration,
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(&self.path, &self.original) {
            eprintln!("could not restore {}: {e}", self.path.display());
        }
        std::thread::sleep(self.settle);
    }
}

/// Parses `scontrol show -o` output (`Key=Value` pairs separated by spaces).
pub fn parse_show(text: &str) -> HashMap<String, String> {
    let mut map = HashMap::new();
    let mut key: Option<String> = None;
    for word in text.split_whitespace() {
        match word.split_once('=') {
            Some((k, v)) if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == ':' || c == '/') => {
                map.insert(k.to_string(), v.to_string());
                key = Some(k.to_string());
            }
            // A value with spaces (AdminComment, Command) continues the previous key.
            _ => {
                if let Some(k) = &key {
                    let v = map.get_mut(k).unwrap();
                    v.push(' ');
                    v.push_str(word);
                }
            }
        }
    }
    map
}

/// The `KEY=value` lines of an `env` dump.
pub fn env_of(output: &str) -> HashMap<String, String> {
    output
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_scontrol_lines() {
        let m = parse_show(
            "JobId=5 JobName=wrap Partition=shared AdminComment=multiplex:app=a ticket 42 TresPerNode=gres:shard:1",
        );
        assert_eq!(m["JobId"], "5");
        assert_eq!(m["AdminComment"], "multiplex:app=a ticket 42");
        assert_eq!(m["TresPerNode"], "gres:shard:1");
    }
}
