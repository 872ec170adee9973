//! The `multiplex-simulate` command line: every policy on a generated trace, a table and a
//! trace from files, and the errors a user meets.

use std::process::Command;

fn simulate(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_multiplex-simulate"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn simulate_compares_every_policy_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("jct.svg");
    let (ok, out, err) = simulate(&[
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
            "separations",
            "claims",
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
    let (ok, out, err) = simulate(&[
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
    let cases: [(Vec<&str>, &str); 7] = [
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
        (
            vec!["--policy", "first-fit", "--history", "/nonexistent/h.json"],
            "--history: only the learned policy starts from a history; add --policy learned",
        ),
        (
            vec!["--policy", "oracle", "--write-history", "/nonexistent/h.json"],
            "--write-history: writes what the learned policy learned; add --policy learned",
        ),
    ];
    for (args, expect) in cases {
        let (ok, out, err) = simulate(&args);
        assert!(!ok && out.is_empty() && err.contains(expect), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}
