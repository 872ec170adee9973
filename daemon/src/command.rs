//! Running Slurm's commands (scontrol, squeue) from the daemon's background threads, with a
//! time limit: a hung slurmctld must not hang the daemon's threads forever.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Runs `program args`, returning its stdout, or a sentence saying what went wrong (its
/// stderr, its exit status, or that it was killed after `timeout`).
pub fn run(program: &Path, args: &[String], timeout: Duration) -> Result<String, String> {
    let name = program.display();
    let mut child = spawn(program, args).map_err(|e| format!("cannot run {name}: {e}"))?;
    // Read both pipes while waiting, so that a chatty child never blocks on a full pipe.
    let readers: Vec<std::thread::JoinHandle<String>> = [
        child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
        child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|mut pipe| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        })
    })
    .collect();
    let status = wait(&mut child, timeout).map_err(|e| format!("{name} {e}"));
    let mut out: Vec<String> = readers.into_iter().map(|r| r.join().unwrap_or_default()).collect();
    let stderr = if out.len() > 1 {
        out.pop().unwrap_or_default()
    } else {
        String::new()
    };
    let stdout = out.pop().unwrap_or_default();
    match status? {
        s if s.success() => Ok(stdout),
        s => Err(format!("{name} exited with {s}: {}", stderr.trim())),
    }
}

/// Starts `program` with its output piped, in a process group of its own, so that a timeout
/// kills whatever it started too (which would otherwise keep the pipes open).
fn spawn(program: &Path, args: &[String]) -> std::io::Result<Child> {
    let spawn = || {
        Command::new(program)
            .args(args)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
    };
    // ETXTBSY: the program was just written (a wrapper replaced in place, a test's stand-in)
    // and another thread's child still held it open for writing between its fork and exec.
    let mut tries = 0;
    loop {
        match spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 10 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Waits for `child` at most `timeout`, then kills its process group; the error completes a
/// sentence that starts with the program's name.
fn wait(child: &mut Child, timeout: Duration) -> Result<ExitStatus, String> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if start.elapsed() > timeout => {
                // SAFETY: kill(2) on the process group spawn() created.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                return Err(format!("did not finish within {} s", timeout.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("could not be waited for: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_errors_and_timeouts() {
        let sh = Path::new("/bin/sh");
        let arg = |s: &str| vec!["-c".to_string(), s.to_string()];
        assert_eq!(run(sh, &arg("echo hi"), Duration::from_secs(5)).unwrap(), "hi\n");
        let e = run(sh, &arg("echo nope >&2; exit 3"), Duration::from_secs(5)).unwrap_err();
        assert!(e.contains("exit status: 3") && e.contains("nope"), "{e}");
        let start = Instant::now();
        let e = run(sh, &arg("sleep 5"), Duration::from_millis(200)).unwrap_err();
        assert!(e.contains("did not finish"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(3));
        let big = run(sh, &arg("head -c 300000 /dev/zero"), Duration::from_secs(5)).unwrap();
        assert_eq!(big.len(), 300000, "a full pipe does not block");
        assert!(run(Path::new("/nonexistent/x"), &[], Duration::from_secs(1))
            .unwrap_err()
            .starts_with("cannot run"));
    }
}
