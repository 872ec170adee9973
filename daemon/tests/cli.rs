//! The `multiplexd` command line tools on a real history file: history, explain, export and
//! import, including the errors a user meets.

use std::path::Path;
use std::process::Command;

fn multiplexd(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn config(dir: &Path, name: &str) -> String {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "node = \"n1\"\nsocket = \"{d}/{name}.sock\"\ndatabase = \"{d}/{name}.sqlite\"\n\
             [[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 16384\n",
            d = dir.display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

#[test]
fn history_tools_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let a = config(dir.path(), "a");
    // No database yet: an error that names the path, and no empty database made.
    let (ok, _, err) = multiplexd(&["history", "--config", &a]);
    assert!(
        !ok && err.contains("no history database at") && err.contains("a.sqlite"),
        "{err}"
    );
    assert!(!dir.path().join("a.sqlite").exists());

    // A history with one learned pair, written the way the daemon writes it.
    {
        let h = multiplexd::history::History::open(&dir.path().join("a.sqlite")).unwrap();
        h.connection()
            .execute_batch(
                "INSERT INTO applications(id, name) VALUES (1, 'bert'), (2, 'resnet');
                 INSERT INTO solo_baselines VALUES ('v100', 1, 100.0, 3);
                 INSERT INTO pair_estimates VALUES ('v100', 1, 2, 0.66, 0.8, 4, 0.01, 0);",
            )
            .unwrap();
    }
    let (ok, out, err) = multiplexd(&["history", "--config", &a]);
    assert!(ok, "{err}");
    assert!(
        out.contains("bert") && out.contains("resnet") && out.contains("0.66"),
        "{out}"
    );
    let (ok, out, _) = multiplexd(&["history", "--config", &a, "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["pairs"][0]["observations"], 4);

    let (ok, _, err) = multiplexd(&["explain", "77", "--config", &a]);
    assert!(!ok && err.contains("job 77 is not in the history of n1"), "{err}");

    // Where a user stands: the config named once in the environment.
    let out = Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(["history"])
        .env("MULTIPLEXD_CONFIG", &a)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("bert"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(["history"])
        .env("MULTIPLEXD_CONFIG", dir.path().join("missing.toml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("missing.toml") && err.contains("MULTIPLEXD_CONFIG=FILE"),
        "{err}"
    );

    // Export from a, import into b.
    let file = dir.path().join("seed.json");
    let (ok, _, err) = multiplexd(&["export", file.to_str().unwrap(), "--config", &a]);
    assert!(
        ok && err.contains("exported 1 solo runtimes and 1 pair speeds"),
        "{err}"
    );
    // A new node with no history yet: import makes it, as its daemon would, and seeds it.
    let b = config(dir.path(), "b");
    let (ok, _, err) = multiplexd(&["import", file.to_str().unwrap(), "--config", &b]);
    assert!(
        ok && err.contains("created the history") && err.contains("pair speeds 1 added"),
        "{err}"
    );
    let (ok, _, err) = multiplexd(&["import", file.to_str().unwrap(), "--config", &b]);
    assert!(ok && !err.contains("created") && err.contains("2 kept"), "{err}");
    let (_, out, _) = multiplexd(&["history", "--config", &b]);
    assert!(out.contains("0.66"), "{out}");

    // Garbage is refused with a sentence.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "{\"hello\": 1}").unwrap();
    let (ok, _, err) = multiplexd(&["import", junk.to_str().unwrap(), "--config", &b]);
    assert!(!ok && err.contains("not a multiplexd history export"), "{err}");
}

#[test]
fn a_tool_whose_reader_went_away_ends_quietly() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let dir = tempfile::tempdir().unwrap();
    let a = config(dir.path(), "a");
    drop(multiplexd::history::History::open(&dir.path().join("a.sqlite")).unwrap());
    // `multiplexd export - | true`: the reading end is closed before the tool writes.
    let mut fds = [0; 2];
    // SAFETY: pipe writes two new descriptors into fds; each is owned once below.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: as above.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    let out = Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(["export", "-", "--config", &a])
        .stdout(std::process::Stdio::from(write))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.is_empty(), "nothing said on stderr: {err}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}", out.status);
}

#[test]
fn a_user_who_may_not_read_the_history_asks_the_daemon_about_their_own_jobs() {
    use multiplex_protocol::{client, Request, Response, StartRequest};
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: placing jobs for other users needs root (tests/run runs as root)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The history in a directory the daemon makes (0700); Slurm's PrivateData cannot be asked
    // (no Slurm commands), so jobs are private.
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        format!(
            "node = \"n1\"\nsocket = \"{d}/run/d.sock\"\ndatabase = \"{d}/lib/h.sqlite\"\nslurm_user = \"root\"\n\
             slurm_bin = \"{d}/no-slurm\"\n[reconcile]\ninterval_s = 0\n\
             [[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 16384\n",
            d = dir.path().display()
        ),
    )
    .unwrap();
    // Others may reach the socket's directory (it is the daemon's to make world-usable).
    std::fs::create_dir(dir.path().join("run")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    for p in [dir.path(), &dir.path().join("run")] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let socket = dir.path().join("run/d.sock");
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(["serve", "--config"])
        .arg(&config)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = std::time::Duration::from_secs(5);
    let mut up = false;
    for _ in 0..200 {
        if client::call(&socket, t, Request::Status).is_ok() {
            up = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    assert!(up, "multiplexd did not come up");
    for (job_id, uid) in [(7, 65534), (8, 1000)] {
        let req = StartRequest::new(job_id, uid, "bert", "n1", 0);
        assert!(matches!(
            client::call(&socket, t, Request::Start(req)),
            Ok(Response::Started(_))
        ));
    }
    // A copy of the tool nobody can reach (the build's own may sit under a private home).
    let tool = dir.path().join("multiplexd");
    std::fs::copy(env!("CARGO_BIN_EXE_multiplexd"), &tool).unwrap();
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = |args: &[&str]| {
        // The copy was just written: a test forking on another thread meanwhile holds it open
        // for writing for a moment, and exec says "Text file busy" (ETXTBSY) until it lets go.
        let out = (0..100)
            .find_map(|_| {
                match Command::new(&tool)
                    .args(args)
                    .arg("--config")
                    .arg(&config)
                    .uid(65534)
                    .gid(65534)
                    .output()
                {
                    Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        None
                    }
                    other => Some(other.unwrap()),
                }
            })
            .expect("the copy of the tool stayed busy for 2 s");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // The file itself is out of reach...
    let (ok, _, err) = as_nobody(&["history"]);
    assert!(
        !ok && err.contains("readable by root and the daemon's user only"),
        "{err}"
    );
    // ...but the daemon explains the user's own job,
    let (ok, out, err) = as_nobody(&["explain", "7"]);
    assert!(ok && out.contains("bert"), "{out}{err}");
    // and not another user's, which reads as a job this node never had.
    let (ok, _, err) = as_nobody(&["explain", "8"]);
    assert!(!ok && err.contains("job 8 is not in the history of n1"), "{err}");
    let (ok, out, _) = as_nobody(&["status", "--json"]);
    assert!(
        ok && out.contains("\"job_id\": 7") && !out.contains("\"job_id\": 8"),
        "{out}"
    );
    let _ = daemon.kill();
    let _ = daemon.wait();
}

#[test]
fn the_systemd_unit_verifies_clean() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../etc/systemd/multiplexd.service"
    ))
    .unwrap();
    assert!(unit.contains("ExecStart=/usr/sbin/multiplexd serve --config /etc/slurm/multiplexd.toml"));
    // The same unit, run from this build (verify checks that ExecStart can be executed).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("multiplexd.service");
    std::fs::write(
        &path,
        unit.replace("/usr/sbin/multiplexd", env!("CARGO_BIN_EXE_multiplexd")),
    )
    .unwrap();
    // The manual page it names comes with the package (packaging/build-deb), not this build.
    assert!(unit.contains("Documentation=man:multiplexd(8)"));
    let out = match std::process::Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()
    {
        Ok(out) => out,
        Err(e) => panic!("cannot run systemd-analyze ({e}): install systemd (tests/cluster/packages --tests does)"),
    };
    let said = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    // It warns about unknown keys and bad values on stderr and still exits 0: nothing at all
    // may be said.
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
}

#[test]
fn sighup_rereads_the_config_and_a_broken_one_changes_nothing() {
    use multiplex_protocol::{client, Request};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    let text = |min_gain: &str, jobs_per_gpu: u32| {
        format!(
            "node = \"n1\"\nsocket = \"{d}/d.sock\"\ndatabase = \"{d}/h.sqlite\"\n\
             jobs_per_gpu = {jobs_per_gpu}\nslurm_bin = \"{d}/no-slurm\"\ntelemetry_interval_s = 0\n\
             [reconcile]\ninterval_s = 0\n[policy]\nmin_gain = {min_gain}\n\
             [[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 16384\n",
            d = dir.path().display()
        )
    };
    std::fs::write(&config, text("0.25", 2)).unwrap();
    let log = dir.path().join("log");
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_multiplexd"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("MULTIPLEXD_LOG", "info")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let socket = dir.path().join("d.sock");
    let t = std::time::Duration::from_secs(5);
    let answers = || client::call(&socket, t, Request::Status).is_ok();
    let wait_for = |what: &str| {
        for _ in 0..200 {
            let said = std::fs::read_to_string(&log).unwrap();
            if said.contains(what) {
                return said;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        panic!(
            "the log never said {what:?}: {}",
            std::fs::read_to_string(&log).unwrap()
        );
    };
    wait_for("multiplexd serving");
    // telemetry_interval_s = 0 is no telemetry, said so (not a round every second).
    wait_for("no GPU telemetry (telemetry_interval_s = 0)");
    let hup = || {
        // SAFETY: kill with a child's pid and a valid signal.
        assert_eq!(unsafe { libc::kill(daemon.id() as i32, libc::SIGHUP) }, 0);
    };

    std::fs::write(&config, text("0.1", 3)).unwrap();
    hup();
    let said = wait_for("config reloaded");
    assert!(said.contains("policy.min_gain: 0.25 -> 0.1"), "{said}");
    let said = wait_for("read only at start");
    assert!(said.contains("keys=jobs_per_gpu"), "{said}");
    assert!(answers(), "the daemon stopped answering after a reload");

    std::fs::write(&config, "node = [").unwrap();
    hup();
    let said = wait_for("config not reloaded");
    assert!(said.contains("the daemon runs on with the config it had"), "{said}");
    assert!(answers(), "a broken config stopped the daemon");

    // SAFETY: as above; SIGTERM still stops it.
    assert_eq!(unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) }, 0);
    let status = daemon.wait().unwrap();
    assert!(status.success(), "{status}: {}", std::fs::read_to_string(&log).unwrap());
}
