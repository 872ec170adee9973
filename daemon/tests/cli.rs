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
    let b = config(dir.path(), "b");
    drop(multiplexd::history::History::open(&dir.path().join("b.sqlite")).unwrap());
    let (ok, _, err) = multiplexd(&["import", file.to_str().unwrap(), "--config", &b]);
    assert!(ok && err.contains("pair speeds 1 added"), "{err}");
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
