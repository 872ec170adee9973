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
fn simulate_compares_every_policy_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("jct.svg");
    let (ok, out, err) = multiplexd(&[
        "simulate",
        "--jobs",
        "150",
        "--nodes",
        "2",
        "--format",
        "json",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let runs: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["exclusive", "first-fit", "least-loaded", "random", "learned", "oracle"]
    );
    for r in &runs {
        for key in [
            "jobs",
            "avg_jct_s",
            "p50_jct_s",
            "p95_jct_s",
            "makespan_s",
            "avg_wait_s",
            "oom_failures",
            "declines",
            "throughput_per_gpu",
        ] {
            assert!(r[key].is_number(), "{key} in {r}");
        }
        assert_eq!(r["jobs"], 150);
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("learned vs oracle"), "{svg}");

    // A trace and a table from files; CSV out.
    let table = dir.path().join("t.csv");
    std::fs::write(&table, "gpu,job_a,job_b,speed_a,speed_b\nv100,a,b,0.5,0.8\n").unwrap();
    let trace = dir.path().join("trace.csv");
    std::fs::write(&trace, "job_id,submit_s,app,solo_runtime_s\nx,0,a,100\ny,20,b,100\n").unwrap();
    let (ok, out, err) = multiplexd(&[
        "simulate",
        "--table",
        table.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--policy",
        "first-fit",
        "--format",
        "csv",
    ]);
    assert!(ok, "{err}");
    // The hand-computed case of the unit tests, end to end: average JCT (162.5 + 125) / 2.
    assert!(out.lines().nth(1).unwrap().starts_with("first-fit,2,143.8,"), "{out}");

    // Bad input: one clear line each, exit status 1.
    std::fs::write(&trace, "job_id,submit_s,app,solo_runtime_s\nx,0,a,100\ny,5,gpt,100\n").unwrap();
    let bad_trace = ["--table", table.to_str().unwrap(), "--trace", trace.to_str().unwrap()];
    let cases: [(Vec<&str>, &str); 5] = [
        (bad_trace.to_vec(), "line 3: app \"gpt\" is not in the pair table"),
        (vec!["--nodes", "0"], "--nodes must be at least 1"),
        (vec!["--policy", "best"], "unknown policy \"best\""),
        (
            vec!["--table", trace.to_str().unwrap()],
            "the first line must be the header gpu,job_a,job_b",
        ),
        (
            vec!["--trace", "/nonexistent/trace.csv"],
            "cannot read /nonexistent/trace.csv",
        ),
    ];
    for (args, expect) in cases {
        let mut all = vec!["simulate"];
        all.extend(args);
        let (ok, out, err) = multiplexd(&all);
        assert!(!ok && out.is_empty() && err.contains(expect), "{all:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}
