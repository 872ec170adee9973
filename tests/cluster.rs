//! The thin path on a real local Slurm cluster: sbatch, srun and salloc with and without
//! --multiplex, through slurmctld's job_submit plugin, the claimer (n1's multiplexd), which
//! pins each pending multiplexed job to the GPU it chose before Slurm allocates, slurmstepd's
//! SPANK plugin and each node's multiplexd.
//!
//! These need the cluster that `tests/run` starts (`tests/cluster/up --lease 60`), hence
//! `#[ignore]`: `tests/run` runs them with `--ignored`. The cluster fences devices
//! (`task/cgroup`, `ConstrainDevices=yes`) and its fake GPUs are character devices of their
//! own: a job may open its GPU's file (no driver answers: ENXIO) and no other's (EPERM).

use multiplex_tests::{env_of, wait_until, Cluster};
use multiplexd::slurm::{Commands, Pin, Slurm};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);
const ENV_DUMP: &str =
    "env | grep -E '^(CUDA_|MULTIPLEX_|SLURM_JOB_GPUS|SLURM_STEP_GPUS|SLURM_SHARDS|SLURMD_NODENAME)' | sort";

/// A shell line that prints, from inside a job, slurmctld's detail of its allocation while it
/// runs (`detail= GRES=shard:1(IDX:1)`; `scontrol show job -d` shows it no longer once the
/// job ended).
const ALLOCATION: &str = "echo \"detail=$(scontrol show job -d $SLURM_JOB_ID | grep -o ' GRES=[^ ]*' | head -1)\"";

fn out_arg(c: &Cluster, tag: &str) -> String {
    format!("--output={}", c.output_path(tag).display())
}

/// The nodes whose daemon has a record of `job`.
fn daemons_that_recorded(c: &Cluster, job: u32) -> Vec<&'static str> {
    ["n1", "n2"]
        .into_iter()
        .filter(|node| {
            c.history(node)
                .query_row("SELECT count(*) FROM jobs WHERE job_id = ?1", [job], |r| {
                    r.get::<_, u32>(0)
                })
                .unwrap()
                > 0
        })
        .collect()
}

/// A shell line that prints, for each fake GPU of the job's node, what opening its device
/// file gives: `open<i>=ENXIO` (allowed: no driver answers), `open<i>=EPERM` (the job's device
/// cgroup denies it).
fn probe_devices(c: &Cluster) -> String {
    format!(
        "for d in {}/dev/$SLURMD_NODENAME/nvidia*; do i=${{d##*nvidia}}; e=$(cat $d 2>&1 </dev/null); \
         case $e in *'No such device or address'*) echo open$i=ENXIO ;; *'Operation not permitted'*) echo open$i=EPERM ;; *) echo \"open$i=$e\" ;; esac; done",
        c.path("").display()
    )
}

/// What a job that ran `probe_devices`, `ALLOCATION` and `ENV_DUMP` shows: it ran on the GPU
/// Slurm allocated it, which is the one the claimer chose, and could open no other.
fn assert_fenced_to_its_gpu(c: &Cluster, what: &str, job: u32, env: &HashMap<String, String>) {
    assert_fenced(c, what, job, env, true);
}

/// As [`assert_fenced_to_its_gpu`], for a job claimed by type (`typed`), or for its node only
/// (a job srun made: Slurm picks the GPU there).
fn assert_fenced(c: &Cluster, what: &str, job: u32, env: &HashMap<String, String>, typed: bool) {
    let rec = c.show_job(job);
    let gpu: u32 = env
        .get("MULTIPLEX_GPU")
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("{what}: no MULTIPLEX_GPU: {env:?}"));
    // Slurm's own books: the shard it allocated, and the type the claim named.
    let detail = env.get("detail").map(String::as_str).unwrap_or("");
    assert_eq!(
        multiplexd::slurm::parse_job_gpu(detail),
        Some(gpu),
        "{what}: scontrol show job -d names GPU {gpu}: {detail:?}"
    );
    let note = if typed {
        assert!(
            rec["TresPerNode"].contains(&format!("shard:v100_{gpu}:1")),
            "{what}: claimed for v100_{gpu}: {rec:?}"
        );
        format!(" | multiplex: claim node:{} gpu:v100_{gpu} ", rec["NodeList"])
    } else {
        format!(" | multiplex: claim node:{} gpu:any ", rec["NodeList"])
    };
    assert!(rec["AdminComment"].contains(&note), "{what}: {note:?} in {rec:?}");
    assert_eq!(rec["Restarts"], "0", "{what}: {rec:?}");
    assert_eq!(env.get("MULTIPLEX_NODE"), rec.get("NodeList"), "{what}: {env:?}");
    for i in 0..2 {
        let want = if i == gpu { "ENXIO" } else { "EPERM" };
        assert_eq!(
            env.get(&format!("open{i}")).map(String::as_str),
            Some(want),
            "{what}: GPU {i}'s device file, from a job on GPU {gpu}: {env:?}"
        );
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_multiplexed_job_runs_on_the_gpu_the_claimer_chose_and_can_open_no_other() {
    let c = Cluster::from_env();
    let job = c.submit(&[
        "--multiplex=app=itest-bert,mem=4G",
        "--gres=gpu:1",
        &out_arg(&c, "placed"),
        "--wrap",
        &format!("{ENV_DUMP}; {ALLOCATION}; {}", probe_devices(&c)),
    ]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    // job_submit rewrote the request and tagged the job; the claimer pinned it and took the
    // gate's license away, leaving its note after the tag.
    assert_eq!(rec["Partition"], "shared");
    assert!(
        rec["AdminComment"].starts_with("multiplex:app=itest-bert,mem=4096M | multiplex: claim node:"),
        "{rec:?}"
    );
    assert!(!rec.get("Licenses").is_some_and(|l| l.contains("multiplex")), "{rec:?}");
    let env = env_of(&c.output(&rec));
    assert_fenced_to_its_gpu(&c, "sbatch", job, &env);
    let gpu: u32 = env["MULTIPLEX_GPU"].parse().unwrap();
    // The plugin left Slurm's binding alone and said why the job is there.
    assert_eq!(env["SLURM_JOB_GPUS"], gpu.to_string(), "{env:?}");
    assert!(
        env["MULTIPLEX_DECISION"].contains(&format!(
            "GPU {gpu} (v100_{gpu}), claimed for it before Slurm allocated it"
        )),
        "{env:?}"
    );
    // The claim, read back by the one parser of its record: the node and GPU it ran on, and
    // the speed the job was told is the one the claim was made on.
    let claim = multiplex_protocol::Claim::from_comment(Some(&rec["AdminComment"]))
        .expect("a claim")
        .expect("a claim that reads");
    assert_eq!(claim.node, env["SLURMD_NODENAME"], "{rec:?}");
    assert_eq!(claim.gpu, Some(format!("v100_{gpu}")), "{rec:?}");
    let told: f64 = env["MULTIPLEX_PREDICTED_SPEED"].parse().expect("a speed");
    assert!((told - claim.predicted_speed).abs() < 1e-9, "{claim:?} {env:?}");
    // The daemon of that node recorded the job on that GPU, and its end.
    let node = &env["SLURMD_NODENAME"];
    let db = c.history(node);
    let (app, db_gpu, exit, finished): (String, u32, Option<i32>, Option<f64>) = db
        .query_row(
            "SELECT a.name, j.gpu, j.exit_status, j.finished_at FROM jobs j JOIN applications a ON a.id = j.app_id WHERE j.job_id = ?1",
            [job],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .expect("the daemon recorded the job");
    assert_eq!((app.as_str(), db_gpu, exit), ("itest-bert", gpu, Some(0)));
    assert!(finished.is_some(), "the step's end was reported");
    // It ran alone and succeeded: the daemon learned the application's solo runtime.
    let runs: i64 = db
        .query_row(
            "SELECT s.observations FROM solo_baselines s JOIN applications a ON a.id = s.app_id WHERE a.name = 'itest-bert'",
            [],
            |r| r.get(0),
        )
        .expect("a solo baseline for itest-bert");
    assert!(runs >= 1);
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn jobs_without_the_flag_are_left_alone() {
    let c = Cluster::from_env();
    let job = c.submit(&["--gres=gpu:1", &out_arg(&c, "plain"), "--wrap", ENV_DUMP]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    assert_eq!(rec["Partition"], "debug");
    assert_eq!(rec["TresPerNode"], c.tres_gres("gpu", 1));
    assert_eq!(
        rec.get("AdminComment").map(String::as_str).unwrap_or("(null)"),
        "(null)"
    );
    let env = env_of(&c.output(&rec));
    assert!(env.keys().all(|k| !k.starts_with("MULTIPLEX_")), "{env:?}");
    assert!(
        env.contains_key("CUDA_VISIBLE_DEVICES"),
        "Slurm's own GPU binding is there: {env:?}"
    );
    assert_eq!(
        daemons_that_recorded(&c, job),
        Vec::<&str>::new(),
        "no daemon traffic for a plain job"
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn what_cannot_share_is_rejected_with_a_sentence() {
    let c = Cluster::from_env();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--multiplex", "--wrap", "true"],
            "multiplex: --multiplex needs a GPU request to share",
        ),
        (
            &["--multiplex", "--gres=gpu:2", "--wrap", "true"],
            "multiplex: this job asks for 2 GPUs",
        ),
        (
            &["--multiplex", "--gres=gpu:1", "--exclusive", "--wrap", "true"],
            "multiplex: --exclusive cannot be combined",
        ),
        (
            &["--multiplex", "--gres=gpu:1", "-N", "2", "--wrap", "true"],
            "multiplex: a multiplexed job runs on one node",
        ),
        (
            &["--multiplex", "--gres=shard:1", "--wrap", "true"],
            "multiplex: this job asks for shard directly",
        ),
    ];
    for (args, sentence) in cases {
        let s = c.sbatch(args);
        assert!(!s.ok, "{args:?} was accepted");
        assert!(s.stderr.contains(sentence), "{args:?}: stderr was {:?}", s.stderr);
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn the_flag_is_in_the_help_of_sbatch_salloc_and_srun() {
    let _c = Cluster::from_env();
    for tool in ["sbatch", "salloc", "srun"] {
        let out = std::process::Command::new(tool).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        let at = help
            .find("--multiplex=[app=NAME,mem=SIZE]")
            .unwrap_or_else(|| panic!("{tool} --help lists --multiplex"));
        assert!(
            help[at..]
                .trim_start_matches(|c: char| c != '\n')
                .trim_start()
                .starts_with("[multiplex] Share a GPU"),
            "{tool} --help: {}",
            &help[at..]
        );
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_malformed_flag_stops_sbatch_before_submission() {
    let c = Cluster::from_env();
    for (value, bad_part) in [
        ("bogus", "'bogus' is not key=value"),
        ("app=a b", "app name 'a b'"),
        ("mem=lots", "mem size 'lots'"),
    ] {
        let s = c.sbatch(&[&format!("--multiplex={value}"), "--gres=gpu:1", "--wrap", "true"]);
        assert!(!s.ok && s.job_id.is_none(), "--multiplex={value} was submitted");
        assert!(s.stderr.contains(bad_part), "--multiplex={value}: {:?}", s.stderr);
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn with_the_daemon_down_the_job_runs_and_says_why() {
    let c = Cluster::from_env();
    let stopped = c.stop_daemon("n2");
    let job = c.submit(&[
        "--multiplex=app=itest-down",
        "--gres=gpu:1",
        "-w",
        "n2",
        &out_arg(&c, "down"),
        "--wrap",
        ENV_DUMP,
    ]);
    let rec = c.wait(job, WAIT);
    drop(stopped);

    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let out = c.output(&rec);
    let warnings: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("multiplex: not recorded, running where Slurm started it: cannot connect"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning line: {out}");
    assert!(warnings[0].contains("cannot connect to multiplexd"), "{out}");
    let env = env_of(&out);
    assert!(
        env.contains_key("CUDA_VISIBLE_DEVICES") && !env.contains_key("MULTIPLEX_GPU"),
        "{env:?}"
    );
    assert!(!c.node_state("n2").starts_with("drain"), "n2 not drained");
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn with_on_daemon_error_fail_the_job_fails_with_the_sentence_and_the_node_stays_up() {
    let c = Cluster::from_env();
    let socket = c.path("multiplexd/%n.sock");
    let _conf = c.plugstack_args(&format!(
        "socket={} timeout_ms=2000 on_daemon_error=fail",
        socket.display()
    ));
    let stopped = c.stop_daemon("n2");
    let job = c.submit(&[
        "--multiplex=app=itest-fail",
        "--gres=gpu:1",
        "-w",
        "n2",
        &out_arg(&c, "fail"),
        "--wrap",
        "echo the script ran",
    ]);
    let rec = c.wait(job, WAIT);
    drop(stopped);

    assert_eq!(rec["JobState"], "FAILED", "{rec:?}");
    let out = c.output(&rec);
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("multiplex: ")).collect();
    assert_eq!(lines.len(), 1, "one sentence: {out}");
    assert!(
        lines[0].contains("cannot record this step") && lines[0].contains("cannot connect to multiplexd"),
        "{out}"
    );
    assert!(!out.contains("the script ran"), "{out}");
    let state = c.node_state("n2");
    assert!(!state.starts_with("drain"), "n2 is {state}");
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_no_gpu_could_ever_hold_is_refused_by_the_claimer_and_fails_with_the_reason() {
    let c = Cluster::from_env();
    let job = c.submit(&[
        "--multiplex=app=itest-huge,mem=100G",
        "--gres=gpu:1",
        "-w",
        "n1",
        &out_arg(&c, "huge"),
        "--wrap",
        "echo the script ran",
    ]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "FAILED", "{rec:?}");
    assert_eq!(rec["Restarts"], "0", "not requeued: it can never fit");
    // The claimer let it through the gate unpinned, with the reason in its record.
    assert!(
        rec["AdminComment"].contains(" | multiplex: refused: it needs 102400 MiB of GPU memory"),
        "{rec:?}"
    );
    let out = c.output(&rec);
    assert!(
        out.lines().any(|l| l
            == "multiplex: this job cannot run on n1: it needs 102400 MiB of GPU memory and the largest GPU here has 16384 MiB"),
        "{out}"
    );
    assert!(!out.contains("the script ran"), "{out}");
    let state = c.node_state("n1");
    assert!(!state.starts_with("drain"), "n1 is {state}");
}

/// Submits `n` jobs (`args(i)` for the i-th) held, then releases them with one scontrol call:
/// slurmctld starts them within a second, before any daemon has looked at the queue or
/// published anything. They are cancelled when the second value drops.
fn submit_at_once(c: &Cluster, n: usize, args: impl Fn(usize) -> Vec<String>) -> (Vec<u32>, multiplex_tests::Cancel) {
    let jobs: Vec<u32> = (0..n)
        .map(|i| {
            let mut a = args(i);
            a.insert(0, "--hold".into());
            c.submit(&a.iter().map(String::as_str).collect::<Vec<_>>())
        })
        .collect();
    let cancel = multiplex_tests::Cancel(jobs.clone());
    let ids: Vec<String> = jobs.iter().map(u32::to_string).collect();
    c.scontrol(&["release", &ids.join(",")]).unwrap();
    (jobs, cancel)
}

/// Two 12 GiB jobs of `secs` seconds that take both 16 GiB GPUs of n1 memory-wise (Slurm still
/// has shards free there), once both run.
fn fill_the_memory_of_n1(c: &Cluster, tag: &str, secs: u32) -> Vec<u32> {
    let fillers: Vec<u32> = (0..2)
        .map(|i| {
            c.submit(&[
                &format!("--multiplex=app=itest-{tag}{i},mem=12G"),
                "--gres=gpu:1",
                "-w",
                "n1",
                &out_arg(c, tag),
                "--wrap",
                &format!("sleep {secs}"),
            ])
        })
        .collect();
    assert!(
        wait_until(WAIT, || fillers.iter().all(|&j| c.show_job(j)["JobState"] == "RUNNING")),
        "the fillers started"
    );
    fillers
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_that_fits_no_free_slot_waits_unclaimed_and_starts_once_where_one_frees() {
    let c = Cluster::from_env();
    let fillers = fill_the_memory_of_n1(&c, "waits-big", 12);
    let _cancel = multiplex_tests::Cancel(fillers.clone());
    // n1 has a free shard on each GPU, but no memory for 12 GiB more: the job waits behind the
    // gate, never started, never requeued.
    let job = c.submit(&[
        "--multiplex=app=itest-waits,mem=12G",
        "--gres=gpu:1",
        "-w",
        "n1",
        &out_arg(&c, "waits"),
        "--wrap",
        &format!("{ENV_DUMP}; {ALLOCATION}; {}", probe_devices(&c)),
    ]);
    std::thread::sleep(Duration::from_secs(5));
    let rec = c.show_job(job);
    assert_eq!(
        (
            rec["JobState"].as_str(),
            rec["Reason"].as_str(),
            rec["Restarts"].as_str()
        ),
        ("PENDING", "Licenses", "0"),
        "{rec:?}"
    );
    // The fillers end: it is claimed for the GPU that freed, and runs there once.
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let out = c.output(&rec);
    assert!(!out.contains("requeued"), "{out}");
    assert_fenced_to_its_gpu(&c, "the waiting job", job, &env_of(&out));
    for f in fillers {
        assert_eq!(c.wait(f, WAIT)["JobState"], "COMPLETED");
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn jobs_on_one_node_never_exceed_the_slots_of_a_gpu() {
    let c = Cluster::from_env();
    // Four jobs on one node with 2 GPUs x 2 slots: every slot taken at once.
    let jobs: Vec<u32> = (0..4)
        .map(|i| {
            c.submit(&[
                &format!("--multiplex=app=itest-fill{}", i % 2),
                "--gres=gpu:1",
                "-w",
                "n1",
                &out_arg(&c, "fill"),
                "--wrap",
                &format!("{ENV_DUMP}; sleep 3"),
            ])
        })
        .collect();
    let mut per_gpu = std::collections::HashMap::<String, Vec<u32>>::new();
    for &job in &jobs {
        let rec = c.wait(job, WAIT);
        assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
        let env = env_of(&c.output(&rec));
        per_gpu.entry(env["MULTIPLEX_GPU"].clone()).or_default().push(job);
    }
    // The daemon's intervals: at no time more than two jobs on one GPU.
    let db = c.history("n1");
    let max_partners: u32 = db
        .query_row(
            &format!(
                "SELECT coalesce(max(n), 0) FROM (SELECT job_row, started_at, count(partner_row) AS n FROM intervals
                 WHERE job_row IN (SELECT id FROM jobs WHERE job_id IN ({})) GROUP BY job_row, started_at)",
                jobs.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            ),
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(max_partners <= 1, "a job had {max_partners} partners at once");
    // And by the jobs' own times: when each started, at most one other ran on its GPU. (Slurm
    // may start the four one after the other, so a GPU can see three of them in turn.)
    let times: Vec<(u32, f64, f64)> = jobs
        .iter()
        .map(|&job| {
            db.query_row(
                "SELECT gpu, started_at, finished_at FROM jobs WHERE job_id = ?1",
                [job],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap()
        })
        .collect();
    for &(gpu, start, _) in &times {
        let at_once = times
            .iter()
            .filter(|&&(g, s, f)| g == gpu && s <= start && start < f)
            .count();
        assert!(
            at_once <= 2,
            "{at_once} jobs at once on GPU {gpu}: {times:?} ({per_gpu:?})"
        );
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn an_srun_step_inside_a_multiplexed_job_joins_its_gpu() {
    let c = Cluster::from_env();
    let script =
        "echo batch=$MULTIPLEX_GPU; srun bash -c 'echo step=$MULTIPLEX_GPU; echo decision=$MULTIPLEX_DECISION'";
    let job = c.submit(&[
        "--multiplex=app=itest-steps",
        "--gres=gpu:1",
        &out_arg(&c, "steps"),
        "--wrap",
        script,
    ]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let env = env_of(&c.output(&rec));
    assert_eq!(env["batch"], env["step"], "the step runs on the job's GPU");
    assert!(
        env["decision"].starts_with(&format!("step 0 joins GPU {} held by its job", env["batch"])),
        "{env:?}"
    );
    let node = rec["NodeList"].clone();
    let db = c.history(&node);
    let finished_steps = || -> u32 {
        db.query_row(
            "SELECT count(*) FROM steps s JOIN jobs j ON j.id = s.job_row WHERE j.job_id = ?1 AND s.finished_at IS NOT NULL",
            [job],
            |r| r.get(0),
        )
        .unwrap()
    };
    // slurmctld may call the job complete before the batch step's end has reached the daemon
    // (slurmstepd tells it on its way out).
    wait_until(Duration::from_secs(10), || finished_steps() == 2);
    assert_eq!(
        finished_steps(),
        2,
        "the batch step and the srun step were recorded and finished"
    );
    let jobs: u32 = db
        .query_row("SELECT count(*) FROM jobs WHERE job_id = ?1", [job], |r| r.get(0))
        .unwrap();
    assert_eq!(jobs, 1, "the step took no slot of its own");
}

/// Runs srun or salloc (`args`, the command last) in the state directory and returns its
/// exit status, stdout and stderr.
fn run_tool(c: &Cluster, tool: &str, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new("timeout")
        .arg("120")
        .arg(tool)
        .args(args)
        .current_dir(c.path(""))
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn srun_and_salloc_wait_at_the_terminal_until_claimed_and_run_on_that_gpu_alone() {
    let c = Cluster::from_env();
    let probe = format!(
        "echo job=$SLURM_JOB_ID; {ENV_DUMP}; {ALLOCATION}; {}",
        probe_devices(&c)
    );
    // srun making its own job asks for the job and its step with the same --gres/--gpus; the
    // step must take the job's shared GPU, not ask for a whole one.
    let ways: [(&str, Vec<&str>); 5] = [
        (
            "srun",
            vec!["--multiplex=app=itest-srun", "--gres=gpu:1", "bash", "-c", &probe],
        ),
        (
            "srun",
            vec![
                "--multiplex=app=itest-srun",
                "--gpus=1",
                "--cpus-per-gpu=1",
                "bash",
                "-c",
                &probe,
            ],
        ),
        (
            "salloc",
            vec![
                "--multiplex=app=itest-srun",
                "--gres=gpu:1",
                "srun",
                "bash",
                "-c",
                &probe,
            ],
        ),
        (
            "salloc",
            vec![
                "--multiplex=app=itest-srun",
                "--gres=gpu:1",
                "srun",
                "--gres=gpu:1",
                "bash",
                "-c",
                &probe,
            ],
        ),
        (
            "salloc",
            vec![
                "--multiplex=app=itest-srun",
                "--gpus=1",
                "srun",
                "--gpus=1",
                "bash",
                "-c",
                &probe,
            ],
        ),
    ];
    for (way, (tool, args)) in ways.iter().enumerate() {
        let what = format!("{tool} {}", args[..args.len() - 3].join(" "));
        let (ok, stdout, stderr) = run_tool(&c, tool, args);
        assert!(ok, "{what} failed: {stderr}");
        let env = env_of(&stdout);
        let job: u32 = env["job"].parse().unwrap();
        let rec = c.show_job(job);
        assert_eq!(rec["Partition"], "shared", "{what}: {rec:?}");
        assert!(!rec["TresPerNode"].contains("gpu"), "{what}: {rec:?}");
        // srun making its own job asks for its step with the job's allocated gres, a typed
        // shard Slurm refuses for a step: such a job is claimed for its node only.
        let srun_made = way < 2;
        assert_fenced(&c, &what, job, &env, !srun_made);
        assert_eq!(
            daemons_that_recorded(&c, job),
            [env["MULTIPLEX_NODE"].as_str()],
            "{what}"
        );
    }
    // srun --gres=gpu:1 inside a multiplexed batch job joins the job's GPU.
    let job = c.submit(&[
        "--multiplex=app=itest-srun",
        "--gres=gpu:1",
        &out_arg(&c, "srun-gres"),
        "--wrap",
        "echo batch=$MULTIPLEX_GPU; srun --gres=gpu:1 bash -c 'echo step=$MULTIPLEX_GPU'",
    ]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let env = env_of(&c.output(&rec));
    assert_eq!(env["batch"], env["step"], "{env:?}");
    // In a plain job the same srun keeps its GPU request (the option in the environment is
    // not slurmctld's tag): one of the job's two GPUs, not both.
    let (ok, stdout, stderr) = run_tool(
        &c,
        "salloc",
        &[
            "--gres=gpu:2",
            "bash",
            "-c",
            "SLURM_MULTIPLEX=app=x srun --gres=gpu:1 bash -c 'echo gpus=$SLURM_STEP_GPUS; echo gpu=$MULTIPLEX_GPU'",
        ],
    );
    assert!(ok, "{stderr}");
    let env = env_of(&stdout);
    assert_eq!(env["gpu"], "", "{stdout}");
    assert!(
        ["0", "1"].contains(&env["gpus"].as_str()),
        "the plain step asked for one GPU of its job's two: {stdout}"
    );
    // --cpus-per-gpu and --mem-per-gpu, which Slurm takes only beside whole GPUs, become the
    // job's own CPUs and memory.
    let rec = held(
        &c,
        &[
            "--multiplex=app=itest-srun",
            "--gres=gpu:1",
            "--cpus-per-gpu=2",
            "--mem-per-gpu=100",
        ],
    )
    .unwrap();
    assert_eq!(
        (rec["NumCPUs"].as_str(), rec["MinMemoryNode"].as_str()),
        ("2", "100M"),
        "{rec:?}"
    );
    // More than the site allows is refused with the policy's sentence, before anything runs.
    let (ok, _, stderr) = run_tool(&c, "srun", &["--multiplex", "--gres=gpu:2", "true"]);
    assert!(!ok);
    assert!(
        stderr.contains("this job asks for 2 GPUs; multiplexed jobs may use at most 1"),
        "{stderr}"
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn slurm_multiplex_in_the_environment_acts_as_the_flag_and_the_command_line_wins() {
    let c = Cluster::from_env();
    let run = |env: &[(&str, &str)], args: &[&str]| submit_with_env(&c, env, args);
    let out = out_arg(&c, "envflag");
    let rec = run(
        &[("SLURM_MULTIPLEX", "app=itest-env")],
        &["--gres=gpu:1", &out, "--wrap", "true"],
    );
    assert_eq!(
        (
            rec["Partition"].as_str(),
            rec["AdminComment"].split(" | ").next().unwrap()
        ),
        ("shared", "multiplex:app=itest-env")
    );
    let rec = run(
        &[("SLURM_MULTIPLEX", "app=itest-env")],
        &["--multiplex=app=itest-cli", "--gres=gpu:1", &out, "--wrap", "true"],
    );
    assert_eq!(
        rec["AdminComment"].split(" | ").next().unwrap(),
        "multiplex:app=itest-cli"
    );
    let bad = std::process::Command::new("sbatch")
        .args(["--gres=gpu:1", "--wrap", "true"])
        .env("SLURM_MULTIPLEX", "app=bad name")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("app name 'bad name' is invalid"));
}

/// Submits with `env` added to sbatch's environment (which the job inherits) and waits.
fn submit_with_env(c: &Cluster, env: &[(&str, &str)], args: &[&str]) -> std::collections::HashMap<String, String> {
    let out = std::process::Command::new("sbatch")
        .arg("--parsable")
        .args(args)
        .envs(env.iter().copied())
        .current_dir(c.path(""))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let job: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    c.wait(job, WAIT)
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn the_option_set_in_a_plain_jobs_environment_places_nothing() {
    // Slurm hands SPANK options to slurmstepd through the job's environment: a job that
    // job_submit never saw flagged (so never checked against the policy, never routed, never
    // tagged) sets the variable itself, for its batch step and for an srun step.
    let c = Cluster::from_env();
    let forged = (
        "SLURM_SPANK__SLURM_SPANK_OPTION_multiplex_multiplex",
        "app=itest-forged",
    );
    let script = format!(
        "echo batch=$MULTIPLEX_GPU; export {}={}; srun bash -c 'echo step=$MULTIPLEX_GPU'",
        forged.0, forged.1
    );
    // In the job's environment only: in sbatch's own, its SPANK plugin would take it for the flag
    // (as Slurm does with every SLURM_SPANK_ variable) and job_submit would check the job.
    let export = format!("--export=ALL,{}={}", forged.0, forged.1);
    let rec = submit_with_env(
        &c,
        &[],
        &["--gres=gpu:1", &export, &out_arg(&c, "forged"), "--wrap", &script],
    );
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    assert_eq!(
        rec["Partition"], "debug",
        "job_submit did not take it for a multiplexed job"
    );
    let job: u32 = rec["JobId"].parse().unwrap();
    let output = c.output(&rec);
    let env = env_of(&output);
    assert_eq!((env["batch"].as_str(), env["step"].as_str()), ("", ""), "{output}");
    assert!(
        output.contains(&format!("job {job} was not submitted with --multiplex")),
        "the job is told why: {output}"
    );
    assert_eq!(
        daemons_that_recorded(&c, job),
        Vec::<&str>::new(),
        "no daemon placed it"
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_node_name_in_the_jobs_environment_does_not_choose_the_daemon() {
    // The node's name is part of the daemon's socket path: slurmstepd's own, never the job's.
    let c = Cluster::from_env();
    let fake = ("SLURMD_NODENAME", "../../tmp/itest-fake");
    let script = format!(
        "echo batch=$MULTIPLEX_NODE; SLURMD_NODENAME={} srun bash -c 'echo step=$MULTIPLEX_NODE'",
        fake.1
    );
    let rec = submit_with_env(
        &c,
        &[fake],
        &[
            "--multiplex=app=itest-nodename",
            "--gres=gpu:1",
            &out_arg(&c, "nodename"),
            "--wrap",
            &script,
        ],
    );
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let env = env_of(&c.output(&rec));
    assert_eq!(env["batch"], rec["NodeList"], "{env:?}");
    assert_eq!(env["step"], rec["NodeList"], "{env:?}");
}

/// Submits a held job (so that it never runs) and returns its record; the job is cancelled.
fn held(c: &Cluster, args: &[&str]) -> Result<std::collections::HashMap<String, String>, String> {
    let mut all = vec!["-H", "--output=/dev/null"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--wrap", "true"]);
    let s = c.sbatch(&all);
    match s.job_id {
        Some(job) if s.ok => {
            let rec = c.show_job(job);
            std::process::Command::new("scancel")
                .arg(job.to_string())
                .status()
                .unwrap();
            Ok(rec)
        }
        _ => Err(s.stderr),
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_plain_job_aimed_at_the_shared_partition_is_rejected() {
    let c = Cluster::from_env();
    for partition in ["shared", "debug,shared"] {
        let err = held(&c, &["-p", partition, "--gres=gpu:1"]).unwrap_err();
        assert!(
            err.contains("sbatch: error: multiplex: partition shared is for jobs that share GPUs: add --multiplex"),
            "-p {partition}: {err}"
        );
    }
    assert_eq!(
        held(&c, &["-p", "debug", "--gres=gpu:1"]).unwrap()["Partition"],
        "debug"
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_changed_policy_applies_and_a_broken_one_keeps_the_last_good() {
    let c = Cluster::from_env();
    let two = ["--multiplex=app=itest-policy", "--gres=gpu:2"];
    assert!(held(&c, &two).unwrap_err().contains("at most 1 here"));

    let _policy = c.policy("max_gpus = 2\n");
    assert_eq!(
        held(&c, &two).unwrap()["TresPerNode"],
        c.tres_gres("shard", 2),
        "the new policy is in force"
    );

    let path = c.path("etc/job_submit_multiplex.toml");
    std::fs::write(&path, "# a typo\nmax_gpus = two\n").unwrap();
    std::thread::sleep(multiplex_tests::POLICY_SETTLE);
    for _ in 0..3 {
        assert_eq!(
            held(&c, &two).unwrap()["TresPerNode"],
            c.tres_gres("shard", 2),
            "the last good policy stays"
        );
    }
    c.scontrol(&["ping"]).expect("slurmctld is up");
    let reports = c.ctld_log_lines(&format!(
        "job_submit/multiplex: {}: line 2, column 12: ",
        path.display()
    ));
    assert_eq!(reports.len(), 1, "reported once: {reports:?}");
    assert!(reports[0].contains("keeping the previous policy"), "{reports:?}");
}

/// A Slurm host list's hosts, sorted (Slurm writes `n[1-2]` or keeps `n2,n1` as given).
fn hosts(c: &Cluster, list: &str) -> Vec<String> {
    let text = c.scontrol(&["show", "hostnames", list]).unwrap();
    let mut hosts: Vec<String> = text.split_whitespace().map(String::from).collect();
    hosts.sort();
    hosts
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn plain_gpu_jobs_are_kept_off_nodes_whose_gpus_are_shared() {
    let c = Cluster::from_env();
    // This cluster's nodes are in the default partition too: the layout of issue 27, where
    // Slurm gave a plain job the very GPU a multiplexed job held a shard of. With n1 named as
    // shared, plain GPU jobs go elsewhere.
    let _policy = c.policy("shared_nodes = \"n1\"\n");
    let rec = held(&c, &["-p", "debug", "--gres=gpu:1"]).unwrap();
    assert_eq!(rec["ExcNodeList"], "n1", "{rec:?}");
    let rec = held(&c, &["-p", "debug", "--gpus=1", "--exclude=n2"]).unwrap();
    assert_eq!(
        hosts(&c, &rec["ExcNodeList"]),
        ["n1", "n2"],
        "kept with the user's own: {rec:?}"
    );
    let refused = held(&c, &["-p", "debug", "--gres=gpu:1", "-w", "n1"]).unwrap_err();
    assert!(
        refused.contains("n1 shares its GPUs among multiplexed jobs"),
        "{refused}"
    );
    // No GPU, no change; multiplexed jobs still go to n1.
    let rec = held(&c, &["-p", "debug", "-w", "n1"]).unwrap();
    assert_eq!(rec["ExcNodeList"], "(null)", "{rec:?}");
    let rec = held(&c, &["--multiplex=app=itest-nodes", "--gres=gpu:1", "-w", "n1"]).unwrap();
    assert_eq!(rec["Partition"], "shared");
    // A pending plain job cannot be moved onto n1 or given a GPU by an update, and a new
    // exclusion keeps n1 in it.
    // (scontrol shows the plugin's sentence from 23.02 on; 22.05 shows Slurm's code and the
    // sentence is in slurmctld's log.)
    let job = c.submit(&["-H", "-p", "debug", "--output=/dev/null", "--wrap", "true"]);
    let id = format!("JobId={job}");
    for (change, says) in [
        ("ReqNodeList=n1", "cannot be moved to n1"),
        ("TresPerNode=gres:gpu:1", "not by an update"),
    ] {
        let err = c.scontrol(&["update", &id, change]).unwrap_err();
        assert!(err.contains("Invalid node name"), "{change}: {err}");
        let logged = c.ctld_log_lines(&format!("refused to update job {job} for uid 0: multiplex: "));
        assert!(logged.iter().any(|l| l.contains(says)), "{change}: {logged:?}");
    }
    c.scontrol(&["update", &id, "ExcNodeList=n2"]).unwrap();
    assert_eq!(hosts(&c, &c.show_job(job)["ExcNodeList"]), ["n1", "n2"]);
    std::process::Command::new("scancel")
        .arg(job.to_string())
        .status()
        .unwrap();
    // And a plain GPU job runs, on n2, while a multiplexed job holds n1's GPU 0.
    let mx = c.submit(&[
        "--multiplex=app=itest-nodes",
        "--gres=gpu:1",
        "-w",
        "n1",
        "--output=/dev/null",
        "--wrap",
        "sleep 20",
    ]);
    let plain = c.submit(&["-p", "debug", "--gres=gpu:2", "--output=/dev/null", "--wrap", "true"]);
    let rec = c.wait(plain, WAIT);
    assert_eq!(
        (rec["JobState"].as_str(), rec["NodeList"].as_str()),
        ("COMPLETED", "n2"),
        "{rec:?}"
    );
    std::process::Command::new("scancel")
        .arg(mx.to_string())
        .status()
        .unwrap();
}

/// What a job that ran `probe_devices` and `ALLOCATION` shows of a GPU it holds whole: Slurm
/// allocated it one GPU of its node whole (`gpu`, where given), typed `v100_<index>`, and it
/// could open no other. Returns that GPU.
fn assert_whole_gpu(what: &str, env: &HashMap<String, String>, gpu: Option<u32>) -> u32 {
    let detail = env.get("detail").map(String::as_str).unwrap_or("");
    let whole: Vec<u32> = (0..2)
        .filter(|i| detail.contains(&format!("gpu:v100_{i}:1(IDX:{i})")))
        .collect();
    assert!(
        whole.len() == 1 && gpu.is_none_or(|g| whole == [g]) && !detail.contains("shard"),
        "{what}: one GPU whole ({gpu:?}): {detail:?}"
    );
    for i in 0..2 {
        let want = if i == whole[0] { "ENXIO" } else { "EPERM" };
        assert_eq!(
            env.get(&format!("open{i}")).map(String::as_str),
            Some(want),
            "{what}: {env:?}"
        );
    }
    whole[0]
}

/// A plain job that asks for the GPU model from sbatch, with a step inside that asks for it
/// too, on `node` (`None`: anywhere): it is held until `RUNNING`, and its id returned.
fn plain_model_job(c: &Cluster, node: Option<&str>, probe: &str) -> u32 {
    let mut args = vec!["-p", "debug", "--gres=gpu:v100:1"];
    args.extend(node.map(|n| ["-w", n]).into_iter().flatten());
    let out = out_arg(c, "model-sbatch");
    let wrap = format!("{probe}; srun --gres=gpu:v100:1 echo step=ran; sleep 15");
    args.extend([out.as_str(), "--wrap", &wrap]);
    let job = c.submit(&args);
    assert!(
        wait_until(WAIT, || c.show_job(job)["JobState"] == "RUNNING"),
        "{:?}",
        c.show_job(job)
    );
    let rec = c.show_job(job);
    // job_submit asked for the GPU untyped, with the model as a feature, and tagged the job
    // (the SPANK plugin then asks for the step's GPU untyped).
    assert_eq!(rec["Features"], "v100", "{rec:?}");
    assert_eq!(rec["TresPerNode"], c.tres_gres("gpu", 1), "{rec:?}");
    assert!(rec["AdminComment"].starts_with("multiplex-model:v100"), "{rec:?}");
    job
}

/// A multiplexed job on n1 that sleeps `secs`, once it runs.
fn multiplexed_on_n1(c: &Cluster, secs: u32) -> u32 {
    let wrap = format!("sleep {secs}");
    let job = c.submit(&[
        "--multiplex=app=itest-mixed",
        "--gres=gpu:1",
        "-w",
        "n1",
        "--output=/dev/null",
        "--wrap",
        &wrap,
    ]);
    assert!(
        wait_until(WAIT, || c.show_job(job)["JobState"] == "RUNNING"),
        "{:?}",
        c.show_job(job)
    );
    job
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn plain_jobs_asking_for_the_gpu_model_run_whole_beside_multiplexed_ones() {
    let c = Cluster::from_env();
    let probe = format!("{ENV_DUMP}; {ALLOCATION}; {}", probe_devices(&c));
    // 22.05 gives a GPU whole while a job still holds a shard of it (check-config says so):
    // there the site names its shared nodes and plain GPU jobs run elsewhere.
    let apart = c.keeps_whole_and_shards_apart();
    let policy = std::fs::read_to_string(c.path("etc/job_submit_multiplex.toml")).unwrap();
    let _policy = (!apart).then(|| c.policy(&format!("{policy}shared_nodes = \"n1\"\n")));
    let mut both_ways = Vec::new();
    let mx = multiplexed_on_n1(&c, 60);
    let shared = c.job_gpu(mx).expect("the multiplexed job's GPU");
    // On n1's other GPU where Slurm keeps whole GPUs and shards apart; on n2 where not.
    let (node, whole) = if apart { ("n1", Some(1 - shared)) } else { ("n2", None) };
    let plain = plain_model_job(&c, apart.then_some("n1"), &probe);
    both_ways.extend(c.held_both_ways());
    // A multiplexed job submitted meanwhile is claimed beside the first where the plain job
    // holds n1's other GPU whole: never onto a GPU held whole.
    let mx2 = multiplexed_on_n1(&c, 5);
    both_ways.extend(c.held_both_ways());
    let rec = c.wait(mx2, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    if apart {
        assert!(rec["AdminComment"].contains(&format!(" gpu:v100_{shared} ")), "{rec:?}");
    }
    let rec = c.wait(plain, WAIT);
    assert_eq!(
        (rec["JobState"].as_str(), rec["NodeList"].as_str()),
        ("COMPLETED", node),
        "{rec:?}"
    );
    let env = env_of(&c.output(&rec));
    assert_whole_gpu("sbatch --gres=gpu:v100:1", &env, whole);
    assert_eq!(env.get("step").map(String::as_str), Some("ran"), "{env:?}");
    // srun making its own job asks for the model for the job and its step alike.
    let (ok, out, err) = run_tool(
        &c,
        "srun",
        &["-p", "debug", "--gpus=v100:1", "-w", node, "bash", "-c", &probe],
    );
    assert!(ok, "srun --gpus=v100:1: {err}");
    assert_whole_gpu("srun --gpus=v100:1", &env_of(&out), whole);
    if !apart {
        let (ok, _, err) = run_tool(&c, "srun", &["-p", "debug", "--gpus=v100:1", "-w", "n1", "true"]);
        assert!(
            !ok && err.contains("n1 shares its GPUs among multiplexed jobs"),
            "{err}"
        );
    }
    both_ways.extend(c.held_both_ways());
    assert!(both_ways.is_empty(), "held whole and as shards at once: {both_ways:?}");
    std::process::Command::new("scancel")
        .arg(mx.to_string())
        .status()
        .unwrap();
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn only_the_users_and_accounts_of_the_policy_multiplex() {
    let c = Cluster::from_env();
    let _policy = c.policy("users = [\"nobody\"]\naccounts = [\"ml\"]\n");
    let err = held(&c, &["--multiplex", "--gres=gpu:1"]).unwrap_err();
    assert!(
        err.contains("multiplex: uid 0 may not share GPUs here; GPU sharing is open to users nobody and accounts ml"),
        "{err}"
    );
    let rec = held(&c, &["--multiplex", "--account=ml", "--gres=gpu:1"]).unwrap();
    assert_eq!(rec["Partition"], "shared");
    // Jobs without the flag are not the policy's business.
    assert_eq!(held(&c, &["--gres=gpu:1"]).unwrap()["Partition"], "debug");
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_multiplexed_job_cannot_be_updated_into_what_submission_rejects() {
    let c = Cluster::from_env();
    let job = c.submit(&[
        "-H",
        "--multiplex=app=itest-update",
        "--gres=gpu:1",
        "--output=/dev/null",
        "--wrap",
        "true",
    ]);
    let id = job.to_string();
    let refused = [
        ("Partition=debug", "Invalid partition name", "not debug"),
        ("TresPerNode=gres:gpu:1", "Invalid generic resource", "not whole GPUs"),
        (
            "TresPerNode=gres:shard:2",
            "Invalid generic resource",
            "at most 1 shard here, not 2",
        ),
    ];
    for (change, scontrol_says, log_says) in refused {
        let err = c.scontrol(&["update", "job", &id, change]).unwrap_err();
        assert!(err.contains(scontrol_says), "{change}: {err}");
        let logged = c.ctld_log_lines(&format!(
            "job_submit/multiplex: refused to update job {id} for uid 0: multiplex: "
        ));
        assert!(logged.iter().any(|l| l.contains(log_says)), "{change}: {logged:?}");
    }
    c.scontrol(&["update", "job", &id, "TimeLimit=7"])
        .expect("other updates pass");
    let rec = c.show_job(job);
    assert_eq!(
        (
            rec["Partition"].as_str(),
            rec["TresPerNode"].clone(),
            rec["TimeLimit"].as_str()
        ),
        ("shared", c.tres_gres("shard", 1), "00:07:00")
    );
    std::process::Command::new("scancel").arg(&id).status().unwrap();

    let plain = c.submit(&["-H", "--gres=gpu:1", "--output=/dev/null", "--wrap", "true"]);
    let err = c
        .scontrol(&["update", "job", &plain.to_string(), "Partition=shared"])
        .unwrap_err();
    assert!(err.contains("Invalid partition name"), "{err}");
    std::process::Command::new("scancel")
        .arg(plain.to_string())
        .status()
        .unwrap();
}

/// A claim made by hand, through the same adapter and the same updates as the claimer's:
/// pins pending `job` to GPU `kind` of `node`; it keeps the gate's license while `gated`.
fn claim_by_hand(
    c: &Cluster,
    job: u32,
    node: &str,
    kind: &str,
    gated: bool,
) -> Result<(), multiplexd::slurm::SlurmError> {
    let rec = c.show_job(job);
    let comment = format!("{} | itest: claimed by hand for {node} GPU {kind}", rec["AdminComment"]);
    Commands::new(std::path::Path::new("")).claim(&Pin {
        job,
        node: node.into(),
        gres: Some(format!("shard:{kind}:1")),
        untyped: !rec["TresPerNode"].contains(":v100_"),
        licenses: if gated { "multiplex:1".into() } else { String::new() },
        admin_comment: comment,
        start_now: false,
    })
}

/// The claimer's lease in this cluster (`claim.lease_s` in n1's configuration; the daemon's
/// default, 300 s, where it sets none).
fn lease(c: &Cluster) -> Duration {
    let text = std::fs::read_to_string(c.path("multiplexd/n1/multiplexd.toml")).unwrap();
    let s = text
        .lines()
        .find_map(|l| l.strip_prefix("lease_s = "))
        .map_or(300, |v| v.trim().parse().unwrap());
    Duration::from_secs(s)
}

/// Waits until slurmctld counts no shard allocated: every job of the test ended and no claim
/// left one behind.
fn assert_no_shard_leaked(c: &Cluster) {
    assert!(
        wait_until(Duration::from_secs(30), || c.shards_in_use() == 0),
        "slurmctld still counts {} shards allocated: {}",
        c.shards_in_use(),
        String::from_utf8_lossy(
            &std::process::Command::new("sinfo")
                .args(["-N", "-O", "NodeHost,GresUsed:200"])
                .output()
                .unwrap()
                .stdout
        )
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_burst_is_claimed_one_job_per_gpu_before_any_gpu_gets_two() {
    let c = Cluster::from_env();
    assert_no_shard_leaked(&c);
    // 2 x N jobs for N nodes x 2 GPUs, held and then released by one scontrol call: they wait
    // behind the gate together, and one look of the claimer pins them.
    let nodes = ["n1", "n2"];
    let (jobs, cancel) = submit_at_once(&c, 2 * nodes.len(), |i| {
        vec![
            format!("--multiplex=app=itest-burst{i}"),
            "--gres=gpu:1".into(),
            out_arg(&c, "burst"),
            "--wrap".into(),
            format!("{ENV_DUMP}; {ALLOCATION}; {}; sleep 60", probe_devices(&c)),
        ]
    });
    let mut gpus = std::collections::BTreeMap::new();
    for &job in &jobs {
        assert!(
            wait_until(WAIT, || {
                let rec = c.show_job(job);
                rec["JobState"] == "RUNNING" && env_of(&c.output_so_far(&rec)).contains_key("open1")
            }),
            "job {job} runs: {:?}",
            c.show_job(job)
        );
        let rec = c.show_job(job);
        let env = env_of(&c.output(&rec));
        assert_fenced_to_its_gpu(&c, "a burst's job", job, &env);
        gpus.insert(job, (rec["NodeList"].clone(), env["MULTIPLEX_GPU"].clone()));
    }
    drop(cancel);
    let distinct: std::collections::BTreeSet<_> = gpus.values().collect();
    assert_eq!(distinct.len(), jobs.len(), "one job per GPU: {gpus:?}");
    assert_no_shard_leaked(&c);
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn two_claims_for_one_job_leave_it_on_one_gpu_and_nothing_allocated_twice() {
    let c = Cluster::from_env();
    assert_no_shard_leaked(&c);
    let claimer = c.stop_daemon("n1");
    let job = c.submit(&[
        "--multiplex=app=itest-twice",
        "--gres=gpu:1",
        &out_arg(&c, "twice"),
        "--wrap",
        &format!("{ENV_DUMP}; {ALLOCATION}; {}", probe_devices(&c)),
    ]);
    let _cancel = multiplex_tests::Cancel(vec![job]);
    assert!(
        wait_until(WAIT, || c.show_job(job)["Reason"] == "Licenses"),
        "it waits behind the gate: {:?}",
        c.show_job(job)
    );
    // A first claim, still gated (as one whose second update has not come yet), then the
    // claimer's own: the last one wins.
    claim_by_hand(&c, job, "n2", "v100_1", true).expect("the first claim");
    assert!(
        c.show_job(job)["TresPerNode"].contains("shard:v100_1:1"),
        "{:?}",
        c.show_job(job)
    );
    drop(claimer);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    assert_fenced_to_its_gpu(&c, "the job claimed twice", job, &env_of(&c.output(&rec)));
    assert_no_shard_leaked(&c);
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_slurm_starts_before_its_claim_runs_where_slurm_put_it_and_the_claim_is_refused() {
    let c = Cluster::from_env();
    let claimer = c.stop_daemon("n1");
    let job = c.submit(&[
        "--multiplex=app=itest-race",
        "--gres=gpu:1",
        // Where a daemon runs: n1's is the claimer, stopped.
        "-w",
        "n2",
        &out_arg(&c, "race"),
        "--wrap",
        &format!("{ENV_DUMP}; {ALLOCATION}; {}; sleep 5", probe_devices(&c)),
    ]);
    let _cancel = multiplex_tests::Cancel(vec![job]);
    assert!(
        wait_until(WAIT, || c.show_job(job)["Reason"] == "Licenses"),
        "{:?}",
        c.show_job(job)
    );
    // Slurm wins the race: the gate goes (as when its lease lapses) and Slurm starts the job
    // on its own choice.
    c.scontrol(&["delete", "reservation", "multiplex-gate"])
        .expect("delete the gate");
    assert!(
        wait_until(WAIT, || c.show_job(job)["JobState"] == "RUNNING"),
        "{:?}",
        c.show_job(job)
    );
    // A claim that arrives now is refused by slurmctld and changes nothing.
    let late = claim_by_hand(&c, job, "n2", "v100_1", false);
    assert!(
        matches!(late, Err(multiplexd::slurm::SlurmError::NotPending(j)) if j == job),
        "{late:?}"
    );
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let env = env_of(&c.output(&rec));
    // Recorded where Slurm put it, fenced there all the same.
    let gpu: u32 = env["MULTIPLEX_GPU"].parse().unwrap();
    assert_eq!(multiplexd::slurm::parse_job_gpu(&env["detail"]), Some(gpu), "{env:?}");
    assert!(
        env["MULTIPLEX_DECISION"].contains("where Slurm bound it on its own choice (not claimed)"),
        "{env:?}"
    );
    for i in 0..2 {
        let want = if i == gpu { "ENXIO" } else { "EPERM" };
        assert_eq!(env[&format!("open{i}")], want, "{env:?}");
    }
    // The claimer, back, closes the gate again.
    drop(claimer);
    assert!(
        wait_until(WAIT, || c.scontrol(&["show", "reservation", "multiplex-gate"]).is_ok()),
        "the gate is back"
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn with_every_daemon_down_a_multiplexed_job_starts_once_the_gates_lease_lapses() {
    let c = Cluster::from_env();
    let bound = lease(&c) + Duration::from_secs(15);
    let stopped = [c.stop_daemon("n1"), c.stop_daemon("n2")];
    let down = Instant::now();
    let job = c.submit(&[
        "--multiplex=app=itest-failopen",
        "--gres=gpu:1",
        &out_arg(&c, "failopen"),
        "--wrap",
        ENV_DUMP,
    ]);
    let _cancel = multiplex_tests::Cancel(vec![job]);
    assert!(
        wait_until(bound, || c.show_job(job)["JobState"] != "PENDING"),
        "the job still waits {:?} after every daemon stopped (bound: the lease and a pass, {bound:?}): {:?}",
        down.elapsed(),
        c.show_job(job)
    );
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let out = c.output(&rec);
    assert!(
        out.contains("multiplex: not recorded, running where Slurm started it: cannot connect"),
        "the job says why: {out}"
    );
    drop(stopped);
    // Back: the next job is claimed again.
    let job = c.submit(&[
        "--multiplex=app=itest-failopen",
        "--gres=gpu:1",
        "--output=/dev/null",
        "--wrap",
        "true",
    ]);
    let rec = c.wait(job, WAIT);
    assert!(rec["AdminComment"].contains(" | multiplex: claim node:"), "{rec:?}");
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_pinned_to_a_slot_taken_meanwhile_is_claimed_again_where_one_is_free() {
    let c = Cluster::from_env();
    let claimer = c.stop_daemon("n1");
    // Two jobs fill n1's GPU 1, pinned there by hand.
    let sub = |app: &str, script: &str| {
        c.submit(&[
            &format!("--multiplex=app={app}"),
            "--gres=gpu:1",
            &out_arg(&c, "taken"),
            "--wrap",
            script,
        ])
    };
    let fillers = [sub("itest-taken-f", "sleep 300"), sub("itest-taken-f", "sleep 300")];
    let mut cancel = multiplex_tests::Cancel(fillers.to_vec());
    for f in fillers {
        assert!(
            wait_until(WAIT, || c.show_job(f)["Reason"] == "Licenses"),
            "{:?}",
            c.show_job(f)
        );
        claim_by_hand(&c, f, "n1", "v100_1", false).unwrap();
    }
    assert!(
        wait_until(WAIT, || fillers.iter().all(|&f| c.show_job(f)["JobState"] == "RUNNING")),
        "{:?}",
        fillers.map(|f| c.show_job(f))
    );
    // A third job pinned to the same, full GPU: its slot was taken before Slurm could start it.
    let job = sub(
        "itest-taken",
        &format!("{ENV_DUMP}; {ALLOCATION}; {}", probe_devices(&c)),
    );
    cancel.0.push(job);
    assert!(
        wait_until(WAIT, || c.show_job(job)["Reason"] == "Licenses"),
        "{:?}",
        c.show_job(job)
    );
    claim_by_hand(&c, job, "n1", "v100_1", false).unwrap();
    assert!(
        wait_until(WAIT, || c.show_job(job)["Reason"] == "Resources"),
        "{:?}",
        c.show_job(job)
    );
    // The claimer, back, sees a pin that has not started for its grace period, and claims the
    // job again for a free GPU (where Slurm before 23.02.6 merges gres updates, one of the same
    // index: n2's GPU 1).
    let back = Instant::now();
    drop(claimer);
    let rec = c.wait(job, WAIT + multiplexd::claimer::PIN_GRACE);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    assert!(
        back.elapsed() >= multiplexd::claimer::PIN_GRACE,
        "it waited for the pin's grace period"
    );
    let env = env_of(&c.output(&rec));
    assert_fenced_to_its_gpu(&c, "the job claimed again", job, &env);
    assert_ne!(
        (rec["NodeList"].as_str(), env["MULTIPLEX_GPU"].as_str()),
        ("n1", "1"),
        "{rec:?}"
    );
    drop(cancel);
    assert_no_shard_leaked(&c);
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_claimer_killed_amid_a_burst_claims_every_job_once_it_is_back() {
    let c = Cluster::from_env();
    assert_no_shard_leaked(&c);
    // On n2: n1's daemon, the claimer, also records n1's jobs, and a job that starts there
    // while it is down runs unrecorded (as it should).
    let (jobs, cancel) = submit_at_once(&c, 4, |i| {
        vec![
            format!("--multiplex=app=itest-killed{i}"),
            "--gres=gpu:1".into(),
            "-w".into(),
            "n2".into(),
            out_arg(&c, "killed"),
            "--wrap".into(),
            format!("{ENV_DUMP}; {ALLOCATION}; {}; sleep 10", probe_devices(&c)),
        ]
    });
    // SIGKILL while the claimer looks at the burst: some jobs may be claimed, one perhaps half
    // (on 22.05 a claim is two updates), the others not yet.
    std::thread::sleep(Duration::from_millis(300));
    let killed = c.kill_daemon("n1");
    std::thread::sleep(Duration::from_secs(2));
    drop(killed);
    let mut per_gpu = std::collections::BTreeMap::<String, u32>::new();
    for &job in &jobs {
        let rec = c.wait(job, WAIT);
        assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
        let env = env_of(&c.output(&rec));
        assert_fenced_to_its_gpu(&c, "a job of the burst", job, &env);
        *per_gpu.entry(env["MULTIPLEX_GPU"].clone()).or_default() += 1;
    }
    // n2's two GPUs, two slots each: every slot claimed once.
    assert_eq!(per_gpu.values().copied().collect::<Vec<_>>(), [2, 2], "{per_gpu:?}");
    drop(cancel);
    assert_no_shard_leaked(&c);
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_that_ends_while_its_daemon_is_down_frees_its_slot_later() {
    let c = Cluster::from_env();
    let job = c.submit(&[
        "--multiplex=app=itest-missed",
        "--gres=gpu:1",
        "-w",
        "n1",
        "--output=/dev/null",
        "--wrap",
        "sleep 3",
    ]);
    let recorded = |c: &Cluster| -> Option<Option<f64>> {
        c.history("n1")
            .query_row("SELECT finished_at FROM jobs WHERE job_id = ?1", [job], |r| r.get(0))
            .ok()
    };
    assert!(wait_until(WAIT, || recorded(&c).is_some()), "the daemon placed the job");
    let stopped = c.stop_daemon("n1");
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    assert_eq!(recorded(&c), Some(None), "its end was missed");
    drop(stopped);
    // The restarted daemon asks Slurm (squeue) and frees the slot.
    assert!(
        wait_until(Duration::from_secs(30), || matches!(recorded(&c), Some(Some(_)))),
        "the slot was freed"
    );
    let log = std::fs::read_to_string(c.path("log/multiplexd-n1.log")).unwrap();
    assert!(
        log.lines()
            .any(|l| l.contains(&format!("job={job}")) && l.contains("its end was never reported")),
        "the daemon said why"
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_reports_its_progress_and_running_out_of_memory_from_inside() {
    let c = Cluster::from_env();
    let tool = c.path("plugins/multiplexd");
    let script = format!(
        "echo socket=$MULTIPLEX_SOCKET; {t} report --progress 120 && {t} report --oom; {t} report --job 1 --progress 1 2>&1 | sed 's/^/other: /'",
        t = tool.display()
    );
    let job = c.submit(&[
        "--multiplex=app=itest-report",
        "--gres=gpu:1",
        "-w",
        "n2",
        &out_arg(&c, "report"),
        "--wrap",
        &script,
    ]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let out = c.output(&rec);
    assert!(
        out.contains(&format!("socket={}", c.path("multiplexd/n2.sock").display())),
        "{out}"
    );
    assert!(out.contains(&format!("progress of job {job} recorded: 120")), "{out}");
    assert!(
        out.contains(&format!("job {job} ran out of memory alone on GPU")),
        "{out}"
    );
    // Alone, running out of memory is the job's own failure: it is not put back.
    assert!(!out.contains("put back"), "{out}");
    assert_eq!(rec["Restarts"], "0", "{rec:?}");
    assert!(
        out.contains("other: multiplexd: job 1 is not running on node n2"),
        "{out}"
    );
    let kinds: Vec<String> = c
        .history("n2")
        .prepare("SELECT o.kind FROM observations o JOIN jobs j ON j.id = o.job_row WHERE j.job_id = ?1 ORDER BY o.id")
        .unwrap()
        .query_map([job], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(kinds, ["progress", "oom"]);
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn without_a_gpu_driver_the_daemon_says_so_once_per_start() {
    let c = Cluster::from_env();
    for node in ["n1", "n2"] {
        let counts = || {
            let log = std::fs::read_to_string(c.path(&format!("log/multiplexd-{node}.log"))).unwrap();
            let starts = log.lines().filter(|l| l.contains("multiplexd serving")).count();
            let said = log
                .lines()
                .filter(|l| l.contains("no GPU telemetry: NVML is unavailable"))
                .count();
            (starts, said)
        };
        // A daemon restarted by the test before may not have said it yet.
        wait_until(Duration::from_secs(5), || {
            let (starts, said) = counts();
            starts == said
        });
        let (starts, said) = counts();
        assert!(starts >= 1, "{node} started");
        assert_eq!(said, starts, "{node}: once per start");
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn what_one_node_learns_the_other_knows_soon() {
    let c = Cluster::from_env();
    let app = "itest-shared-lesson";
    let job = c.submit(&[
        &format!("--multiplex=app={app}"),
        "--gres=gpu:1",
        "-w",
        "n1",
        "--output=/dev/null",
        "--wrap",
        "sleep 1",
    ]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let solo_on = |node: &str| -> Option<f64> {
        c.history(node)
            .query_row(
                "SELECT s.runtime_s FROM solo_baselines s JOIN applications a ON a.id = s.app_id WHERE a.name = ?1",
                [app],
                |r| r.get(0),
            )
            .ok()
    };
    assert!(
        wait_until(WAIT, || solo_on("n1").is_some()),
        "n1 learned the solo runtime"
    );
    // The daemons exchange through the cluster's share directory every 5 s.
    assert!(
        wait_until(Duration::from_secs(30), || solo_on("n2").is_some()),
        "n2 knows it from n1's file"
    );
    assert_eq!(solo_on("n2"), solo_on("n1"));
    for node in ["n1", "n2"] {
        assert!(c.path(&format!("share/{node}.json")).exists(), "{node} wrote its file");
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn check_config_says_what_disagrees_with_slurm() {
    let c = Cluster::from_env();
    let check = |config: &std::path::Path| {
        let out = std::process::Command::new(c.path("plugins/multiplexd"))
            .args(["check-config", "--config"])
            .arg(config)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let good = c.path("multiplexd/n1/multiplexd.toml");
    // This cluster's nodes are in the default partition too, whose GPU jobs may be given n1's
    // GPUs whole: fine where Slurm keeps whole GPUs and shards apart; on 22.05 an error until
    // the policy's shared_nodes names n1.
    let (code, text) = check(&good);
    if c.keeps_whole_and_shards_apart() {
        assert_eq!(code, Some(0), "{text}");
        assert!(
            text.contains("ok: jobs without --multiplex of partition debug may hold n1's GPUs whole"),
            "{text}"
        );
    } else {
        assert_eq!(code, Some(1), "{text}");
        assert!(
            text.contains(&format!(
                "error: jobs without --multiplex of partition debug can be given n1's GPUs whole, and {} does so",
                c.slurm_version()
            )),
            "{text}"
        );
    }
    let policy = std::fs::read_to_string(c.path("etc/job_submit_multiplex.toml")).unwrap();
    let named = c.policy(&format!("{policy}shared_nodes = \"n1\"\n"));
    let (code, text) = check(&good);
    drop(named);
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("error:"), "{text}");
    for want in [
        "ok: GPUs 0, 1 of multiplexd.toml are in gres.conf",
        "ok: each GPU's gpu and shard lines in gres.conf carry its own Type",
        "ok: cgroup.conf has ConstrainDevices=yes",
        "ok: slurmctld has 100000 of the gate's license multiplex",
        "ok: slurmctld gives n1 gpu:2,shard:4",
        "ok: plugstack.conf's socket is",
        "ok: partitions of n1: debug, shared",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    // The same node, described wrongly: each disagreement is named and the exit status says so.
    let wrong = c.path("multiplexd/n1-wrong.toml");
    let text = std::fs::read_to_string(&good)
        .unwrap()
        .replace("jobs_per_gpu = 2", "jobs_per_gpu = 3")
        .replace("n1.sock", "n1-old.sock")
        + "\n[[gpu]]\nindex = 5\nmodel = \"v100\"\nmemory_mb = 16384\n";
    std::fs::write(&wrong, text).unwrap();
    let (code, text) = check(&wrong);
    std::fs::remove_file(&wrong).unwrap();
    assert_eq!(code, Some(1), "{text}");
    for want in [
        "error: multiplexd.toml lists GPU 5 that gres.conf does not give node n1",
        "error: the claimer cannot name this node's GPUs to Slurm: GPU 5's gpu line has Type=none, not v100_5",
        "error: jobs_per_gpu = 3 but gres.conf's shards disagree",
        "wants shard:6",
        "error: plugstack.conf sends this node's jobs to",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
}

/// An HTTP GET on loopback; the body, when the answer is 200.
fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    (head.split_whitespace().nth(1) == Some("200")).then(|| body.to_string())
}

/// A Prometheus server started by hand for one test, stopped by its pid on drop.
struct Prometheus(std::process::Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value of a PromQL query that yields one number, through Prometheus's HTTP API.
fn promql(port: u16, query: &str) -> Option<f64> {
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let body = http_get(port, &format!("/api/v1/query?query={encoded}"))?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}
#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_real_prometheus_scrapes_what_the_daemons_count() {
    let c = Cluster::from_env();
    // Each daemon's endpoint, from its own config.
    let targets: Vec<String> = ["n1", "n2"]
        .iter()
        .map(|n| {
            let text = std::fs::read_to_string(c.path(&format!("multiplexd/{n}/multiplexd.toml"))).unwrap();
            let line = text
                .lines()
                .find(|l| l.starts_with("listen = "))
                .expect("a [metrics] listen");
            line.trim_start_matches("listen = ").trim_matches('"').to_string()
        })
        .collect();
    // The exposition itself, as a scraper reads it.
    let port_of = |t: &str| t.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let text = http_get(port_of(&targets[0]), "/metrics").expect("GET /metrics answers 200");
    for name in [
        "multiplexd_slots_per_gpu 2",
        "# TYPE multiplexd_starts counter",
        "# TYPE multiplexd_claims counter",
        "multiplexd_history_jobs",
    ] {
        assert!(text.contains(name), "{name:?} not in:\n{text}");
    }
    assert!(text.trim_end().ends_with("# EOF"), "OpenMetrics ends with # EOF");
    assert_eq!(http_get(port_of(&targets[0]), "/"), None, "only /metrics is served");

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = c.path("prometheus");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: ['{}']\nscrape_configs:\n  - job_name: multiplexd\n    static_configs:\n      - targets: [{}]\n",
            ALERTS,
            targets.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(", ")
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let _prometheus = Prometheus(
        std::process::Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("run prometheus (Debian's package; tests/cluster/packages --tests installs it)"),
    );
    // Both daemons are up for Prometheus.
    assert!(
        wait_until(WAIT, || promql(port, "sum(up{job=\"multiplexd\"})") == Some(2.0)),
        "both targets up: {:?}",
        std::fs::read_to_string(dir.join("prometheus.log"))
    );
    let placed = || promql(port, "sum(multiplexd_starts_total{outcome=\"claimed\"})").unwrap_or(0.0);
    let claims = || promql(port, "sum(multiplexd_claims_total{outcome=\"claimed\"})").unwrap_or(0.0);
    let claimed_before = claims();
    let before = placed();
    let job = c.submit(&[
        "--multiplex=app=itest-metrics",
        "--gres=gpu:1",
        "--output=/dev/null",
        "--wrap",
        "true",
    ]);
    assert_eq!(c.wait(job, WAIT)["JobState"], "COMPLETED");
    assert!(
        wait_until(WAIT, || placed() > before),
        "the claimed start reached Prometheus: {before} -> {}",
        placed()
    );
    assert!(
        claims() > claimed_before,
        "the claim is counted: {claimed_before} -> {}",
        claims()
    );
    let served = promql(port, "sum(multiplexd_request_seconds_count{kind=\"start\"})").unwrap_or(0.0);
    assert!(served >= 1.0, "start latency is recorded: {served}");
    assert_eq!(promql(port, "max(multiplexd_slots_per_gpu)"), Some(2.0));
    // The shipped alerting rules load and evaluate against these metrics.
    let rules_healthy = || {
        let Some(body) = http_get(port, "/api/v1/rules") else {
            return false;
        };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let rules: Vec<&serde_json::Value> = v["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        rules.len() >= 6 && rules.iter().all(|r| r["health"] == "ok")
    };
    assert!(
        wait_until(WAIT, rules_healthy),
        "alert rules: {:?}",
        http_get(port, "/api/v1/rules")
    );
    let check = std::process::Command::new("promtool")
        .args(["check", "rules", ALERTS])
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
}

/// The alerting rules the project ships.
const ALERTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/prometheus/multiplexd-alerts.yml");

#[test]
#[ignore = "needs the local Slurm cluster with its accounting database: run tests/run (tests/cluster/up --accounting)"]
fn accounting_sacct_shows_where_a_multiplexed_job_ran_after_it_ended() {
    let c = Cluster::from_env();
    let job = c.submit(&[
        "--multiplex=app=itest-sacct",
        "--gres=gpu:1",
        &out_arg(&c, "sacct"),
        "--wrap",
        ENV_DUMP,
    ]);
    let rec = c.wait(job, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    let env = env_of(&c.output(&rec));
    // The tag job_submit wrote, the claimer's note, and the GPU Slurm allocated: slurmdbd's
    // record, as sacct reads it from MariaDB once the job has ended.
    let gpu = &env["MULTIPLEX_GPU"];
    let want = format!(
        "{job}|COMPLETED|multiplex:app=itest-sacct | multiplex: claim node:{} gpu:v100_{gpu} ",
        rec["NodeList"]
    );
    let sacct = || {
        let out = std::process::Command::new("sacct")
            .args([
                "-j",
                &job.to_string(),
                "-X",
                "-n",
                "-P",
                "-o",
                "JobID,State,AdminComment",
            ])
            .output()
            .expect("sacct runs");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    assert!(
        wait_until(Duration::from_secs(30), || sacct().starts_with(&want)),
        "{want:?}: sacct said {:?}",
        sacct()
    );
}

/// Every slot of both nodes runs a job of `x` (`sleep_s` long), the last one until the
/// returned file appears; returns once all run, with the jobs (that one last) to cancel.
fn fill_every_slot(c: &Cluster, x: &str, tag: &str, sleep_s: u32) -> (multiplex_tests::Cancel, std::path::PathBuf) {
    let release = c.path(&format!("{tag}-release"));
    let _ = std::fs::remove_file(&release);
    let wait_for_release = format!("while [ ! -e {} ]; do sleep 0.2; done", release.display());
    let mut jobs = Vec::new();
    for i in 0..8 {
        let script = if i == 7 {
            wait_for_release.clone()
        } else {
            format!("sleep {sleep_s}")
        };
        jobs.push(c.submit(&[
            &format!("--multiplex=app={x}"),
            "--gres=gpu:1",
            &out_arg(c, tag),
            "--wrap",
            &script,
        ]));
    }
    let cancel = multiplex_tests::Cancel(jobs.clone());
    assert!(
        wait_until(WAIT, || jobs.iter().all(|&j| c.show_job(j)["JobState"] == "RUNNING")),
        "every slot runs an x: {:?}",
        jobs.iter()
            .map(|&j| c.show_job(j)["JobState"].clone())
            .collect::<Vec<_>>()
    );
    (cancel, release)
}

/// Teaches both daemons a history through `multiplexd import`: `pairs` are (app, other,
/// speed of app, speed of other), each seen 5 times.
fn import_pairs(c: &Cluster, pairs: &[(&str, &str, f64, f64)]) {
    let rows: Vec<String> = pairs
        .iter()
        .flat_map(|&(a, b, sa, sb)| [(a, b, sa, sb), (b, a, sb, sa)])
        .map(|(a, b, sa, sb)| {
            format!(
                r#"{{"gpu_model":"v100","app":"{a}","other":"{b}","speed":{sa},"other_speed":{sb},"observations":5,"variance":0.001,"oom":false}}"#
            )
        })
        .collect();
    let file = c.path("itest-history.json");
    std::fs::write(
        &file,
        format!(
            r#"{{"format":"multiplexd-history","version":1,"solo":[],"pairs":[{}]}}"#,
            rows.join(",")
        ),
    )
    .unwrap();
    for node in ["n1", "n2"] {
        let out = std::process::Command::new(c.path("plugins/multiplexd"))
            .arg("import")
            .arg("--config")
            .arg(c.path(&format!("multiplexd/{node}/multiplexd.toml")))
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_freed_slot_goes_to_the_pending_job_that_pairs_best_and_a_losing_one_waits_unstarted() {
    let c = Cluster::from_env();
    // Beside x, a loses (0.3 each: never worth a claim) and b gains (0.9 each).
    let (x, a, b) = ("itest-pair-x", "itest-pair-a", "itest-pair-b");
    import_pairs(&c, &[(x, x, 0.8, 0.8), (x, a, 0.3, 0.3), (x, b, 0.9, 0.9)]);
    let (mut cancel, release) = fill_every_slot(&c, x, "pair", 120);
    // a first in Slurm's order, then b: both wait behind the gate.
    let pending: Vec<u32> = [a, b]
        .iter()
        .map(|app| {
            c.submit(&[
                &format!("--multiplex=app={app}"),
                "--gres=gpu:1",
                &out_arg(&c, "pair"),
                "--wrap",
                "sleep 30",
            ])
        })
        .collect();
    cancel.0.extend(&pending);
    let (ja, jb) = (pending[0], pending[1]);
    assert!(
        wait_until(WAIT, || [ja, jb].iter().all(|&j| c.show_job(j)["Reason"] == "Licenses")),
        "a and b wait for a claim: {:?} {:?}",
        c.show_job(ja),
        c.show_job(jb)
    );
    // The short x ends: its slot goes to b, which pairs well with the x left there, ahead of
    // a; a is never started to find out.
    std::fs::write(&release, "").unwrap();
    assert!(
        wait_until(WAIT, || c.show_job(jb)["JobState"] == "RUNNING"),
        "b takes the freed slot: {:?}",
        c.show_job(jb)
    );
    std::thread::sleep(Duration::from_secs(3));
    let (ra, rb) = (c.show_job(ja), c.show_job(jb));
    let claim = multiplex_protocol::Claim::from_comment(Some(&rb["AdminComment"]));
    assert!(
        claim.is_some_and(|c| c.is_ok_and(|c| !c.partners.is_empty())),
        "b was claimed beside a job: {rb:?}"
    );
    assert_eq!(
        (ra["JobState"].as_str(), ra["Reason"].as_str(), ra["Restarts"].as_str()),
        ("PENDING", "Licenses", "0"),
        "{ra:?}"
    );
    let claimed: Vec<String> = std::fs::read_to_string(c.path("log/multiplexd-n1.log"))
        .unwrap()
        .lines()
        .filter(|l| l.contains(" claimed ") && l.contains(&format!("job={jb} ")))
        .map(String::from)
        .collect();
    assert_eq!(claimed.len(), 1, "n1's daemon says it claimed b once: {claimed:?}");
}

/// A job script that "trains" at `speed` of 100 iterations a second for 3 s, reports its
/// progress to the node's daemon as a job that opts in does, then runs `rest` seconds more.
fn training(c: &Cluster, speed: f64, rest: u32) -> String {
    format!(
        "t0=$(date +%s.%N); sleep 3; done=$(awk -v a=$t0 -v b=$(date +%s.%N) 'BEGIN {{ print int(100 * {speed} * (b - a)) }}'); \
         {tool} report --progress $done; sleep {rest}",
        tool = c.path("plugins/multiplexd").display()
    )
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_measured_to_lose_beside_its_partner_is_given_back_and_claimed_again_apart() {
    let c = Cluster::from_env();
    let submit = |app: &str, mem: &str, script: String| {
        c.submit(&[
            &format!("--multiplex=app={app},mem={mem}"),
            "--gres=gpu:1",
            "-w",
            "n1",
            &out_arg(&c, "apart"),
            "--wrap",
            &script,
        ])
    };
    let running = |j: u32| c.show_job(j)["JobState"] == "RUNNING";
    // Each application alone first: its rate alone (100 it/s) is then known.
    let solo = [
        submit("itest-apart-x", "4G", training(&c, 1.0, 0)),
        submit("itest-apart-y", "4G", training(&c, 1.0, 0)),
    ];
    for j in solo {
        assert_eq!(c.wait(j, WAIT)["JobState"], "COMPLETED");
    }
    // A filler takes 12 GiB of one GPU, x the other; y (5 GiB) then fits only beside x, a pair
    // never seen, which placement tries.
    let filler = submit("itest-apart-filler", "12G", "sleep 45".into());
    assert!(wait_until(WAIT, || running(filler)), "{:?}", c.show_job(filler));
    let x = submit("itest-apart-x", "4G", training(&c, 0.3, 90));
    assert!(wait_until(WAIT, || running(x)), "{:?}", c.show_job(x));
    let y = submit("itest-apart-y", "5G", training(&c, 0.1, 90));
    let _cancel = multiplex_tests::Cancel(vec![filler, x, y]);
    // Both report after 3 s: 0.3 + 0.1 of a GPU, worse than taking turns. n1's daemon gives y
    // back to Slurm (scontrol requeue) within its separate_look_ms.
    assert!(
        wait_until(WAIT, || c.show_job(y)["Restarts"] != "0"),
        "y was requeued: {:?}",
        c.show_job(y)
    );
    // The daemon says so once scontrol returned.
    let said = || -> Vec<String> {
        std::fs::read_to_string(c.path("log/multiplexd-n1.log"))
            .unwrap()
            .lines()
            .filter(|l| l.contains("requeued to run apart: ") && l.contains(&format!("job={y} ")))
            .map(str::to_string)
            .collect()
    };
    assert!(wait_until(Duration::from_secs(10), || !said().is_empty()));
    let said = said();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains(&format!("beside itest-apart-x (job {x}) on GPU ")),
        "{}",
        said[0]
    );
    // x runs on; why y was given back is in n1's history.
    assert!(running(x), "{:?}", c.show_job(x));
    let (ok, text, err) = run_tool(
        &c,
        c.path("plugins/multiplexd").to_str().unwrap(),
        &[
            "explain",
            &y.to_string(),
            "--config",
            c.path("multiplexd/n1/multiplexd.toml").to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}{err}");
    assert!(text.contains("requeued to run apart"), "{text}");
    // Requeued, y waits for its pin to go stale (the claimer's grace period) and for a slot
    // on n1 apart from x (the filler's, within 45 s), not for Slurm's own requeue delay
    // (121 s): the claimer claims it again there, on the node its user asked for (-w n1,
    // which its tag keeps: the first claim replaced the job's own node list), though n2 is
    // idle, and lets it start at once.
    let given_back = Instant::now();
    assert!(
        wait_until(WAIT + multiplexd::claimer::PIN_GRACE, || c.show_job(y)["JobState"]
            == "RUNNING"),
        "y runs again: {:?}",
        c.show_job(y)
    );
    assert!(
        given_back.elapsed() < Duration::from_secs(100),
        "{:?}",
        given_back.elapsed()
    );
    let ry = c.show_job(y);
    let gpu_x = c.job_gpu(x);
    assert_eq!(ry["NodeList"], "n1", "y runs on the node its user asked for: {ry:?}");
    assert!(
        c.job_gpu(y) != gpu_x,
        "y runs apart from x: {ry:?} (x on n1 GPU {gpu_x:?})"
    );
    let state = c.node_state("n1");
    assert!(!state.starts_with("drain"), "n1 is {state}");
}

/// A batch script that, on its first run, says it ran out of GPU memory as a training script
/// that catches CUDA's error would (`multiplexd report --oom`) and fails; run again (Slurm's
/// `SLURM_RESTART_COUNT`), it succeeds.
fn out_of_memory_once(c: &Cluster, hold_s: u32) -> String {
    format!(
        "if [ \"${{SLURM_RESTART_COUNT:-0}}\" = 0 ]; then sleep 2; {tool} report --oom; exit 1; fi; echo second run; sleep {hold_s}",
        tool = c.path("plugins/multiplexd").display()
    )
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_job_out_of_memory_beside_a_partner_is_put_back_and_runs_again_apart_and_one_that_may_not_requeue_fails() {
    let c = Cluster::from_env();
    let submit = |app: &str, mem: &str, node: &str, extra: &[&str], script: String| {
        let mut args = vec![
            format!("--multiplex=app={app},mem={mem}"),
            "--gres=gpu:1".into(),
            "-w".into(),
            node.into(),
            out_arg(&c, "putback"),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(["--wrap".to_string(), script]);
        c.submit(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let running = |j: u32| c.show_job(j)["JobState"] == "RUNNING";
    // On n1 a filler takes 12 GiB of one GPU for 20 s, x 4 GiB of the other for 45 s; y (5
    // GiB) then fits only beside x, a pair the history holds as a good one (so that what
    // earlier tests taught the model's typical pair does not keep y waiting). On n2 the same
    // with z, which may not be requeued.
    import_pairs(
        &c,
        &[
            ("itest-pb-y", "itest-pb-x", 0.9, 0.9),
            ("itest-pb-z", "itest-pb-x2", 0.9, 0.9),
        ],
    );
    let filler = submit("itest-pb-filler", "12G", "n1", &[], "sleep 20".into());
    let filler2 = submit("itest-pb-filler", "12G", "n2", &[], "sleep 20".into());
    let x = submit("itest-pb-x", "4G", "n1", &[], "sleep 45".into());
    let x2 = submit("itest-pb-x2", "4G", "n2", &[], "sleep 45".into());
    let _cancel = multiplex_tests::Cancel(vec![filler, filler2, x, x2]);
    for j in [filler, filler2, x, x2] {
        assert!(wait_until(WAIT, || running(j)), "{:?}", c.show_job(j));
    }
    let y = submit("itest-pb-y", "5G", "n1", &[], out_of_memory_once(&c, 10));
    let z = submit("itest-pb-z", "5G", "n2", &["--no-requeue"], out_of_memory_once(&c, 1));
    let _cancel_yz = multiplex_tests::Cancel(vec![y, z]);
    // y ran out of memory beside x: its daemon put it back in the queue (one restart), with
    // why in its admin comment.
    assert!(
        wait_until(WAIT, || c.show_job(y)["Restarts"] != "0"),
        "y was put back: {:?}",
        c.show_job(y)
    );
    // Its second run is claimed apart from x (the pair never again): on the filler's GPU once
    // free where Slurm lets a claim change a pending job's GPU type (23.02.6 on), else on its
    // own GPU once x has left (22.05 keeps a requeued job on its GPU index).
    assert!(
        wait_until(WAIT + Duration::from_secs(45), || running(y)),
        "y runs again: {:?}",
        c.show_job(y)
    );
    let gpu_y = c.job_gpu(y);
    assert!(
        !running(x) || c.job_gpu(x) != gpu_y,
        "y runs beside x again: {:?}",
        c.show_job(y)
    );
    let ry = c.wait(y, WAIT);
    assert_eq!(ry["JobState"], "COMPLETED", "not failed: it ran again {ry:?}");
    assert_eq!(ry["Restarts"], "1", "{ry:?}");
    assert!(
        ry["AdminComment"].contains(" | multiplex: put back: ran out of GPU memory beside itest-pb-x on n1 GPU "),
        "{ry:?}"
    );
    // Its output says why it ran twice.
    let out = c.output(&ry);
    assert!(
        out.lines()
            .any(|l| l
                .starts_with("multiplex: this job was put back: ran out of GPU memory beside itest-pb-x on n1 GPU ")),
        "{out}"
    );
    assert!(out.contains("second run"), "{out}");
    // z may not be requeued: it fails, as its user asked, and says why it was not put back.
    let rz = c.wait(z, WAIT);
    assert_eq!(rz["JobState"], "FAILED", "{rz:?}");
    assert_eq!(rz["Restarts"], "0", "{rz:?}");
    let said = std::fs::read_to_string(c.path("log/multiplexd-n2.log")).unwrap();
    assert!(
        said.lines().any(|l| l.contains(&format!(
            "job {z} is not put back in the queue: it may not be requeued (--no-requeue)"
        ))),
        "{said}"
    );
    for n in ["n1", "n2"] {
        let state = c.node_state(n);
        assert!(!state.starts_with("drain"), "{n} is {state}");
    }
}

/// Runs `multiplexd gate ARGS` as the admin would, with n1's config; its output.
fn gate(c: &Cluster, args: &[&str]) -> String {
    let out = std::process::Command::new(c.path("plugins/multiplexd"))
        .arg("gate")
        .args(args)
        .arg("--config")
        .arg(c.path("multiplexd/n1/multiplexd.toml"))
        .output()
        .expect("run multiplexd gate");
    assert!(out.status.success(), "multiplexd gate {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Switches the gate on again when the test ends, passed or failed.
struct GateOn<'a>(&'a Cluster);

impl Drop for GateOn<'_> {
    fn drop(&mut self) {
        gate(self.0, &["on"]);
    }
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn the_off_switch_lets_every_gated_job_go_at_once_and_keeps_the_claimer_from_gating_until_on() {
    let c = Cluster::from_env();
    // Twenty jobs wait at the gate while the claimer is stopped (its lease holds the gate).
    let claimer = c.stop_daemon("n1");
    let submit = |tag: &str| {
        c.submit(&[
            &format!("--multiplex=app=itest-{tag}"),
            "--gres=gpu:1",
            &out_arg(&c, tag),
            "--wrap",
            "sleep 2",
        ])
    };
    let jobs: Vec<u32> = (0..20).map(|_| submit("off")).collect();
    let _cancel = multiplex_tests::Cancel(jobs.clone());
    let gated = |j: &u32| {
        let rec = c.show_job(*j);
        rec["JobState"] == "PENDING" && rec["Reason"] == "Licenses"
    };
    assert!(
        wait_until(WAIT, || jobs.iter().all(gated)),
        "not every job waits at the gate"
    );
    let on = GateOn(&c);
    let said = gate(&c, &["off"]);
    assert!(said.starts_with("switched off:"), "{said}");
    // All at once: none waits for the gate a pass later, every one runs to its end.
    assert!(
        wait_until(Duration::from_secs(10), || !jobs.iter().any(gated)),
        "jobs still wait at the gate after it was switched off"
    );
    for &j in &jobs {
        let rec = c.wait(j, WAIT);
        assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
        assert!(!rec["AdminComment"].contains("multiplex: claim "), "{rec:?}");
    }
    assert!(gate(&c, &[]).starts_with("off:"));
    // A claimer that starts while the gate is off neither makes the gate nor claims.
    drop(on);
    drop(claimer);
    gate(&c, &["off"]);
    let _on = GateOn(&c);
    let log = c.path("log/multiplexd-n1.log");
    let says_off = || std::fs::read_to_string(&log).is_ok_and(|l| l.contains("the gate is switched off"));
    assert!(
        wait_until(Duration::from_secs(15), says_off),
        "the claimer did not see the switch"
    );
    let unclaimed = submit("off-running");
    let rec = c.wait(unclaimed, WAIT);
    assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
    assert!(!rec["AdminComment"].contains("multiplex: claim "), "{rec:?}");
    assert!(
        !multiplex_tests::gate_held(),
        "the claimer made the gate while it was off"
    );
    // Switched on, the claimer gates and claims within seconds.
    let said = gate(&c, &["on"]);
    assert!(said.starts_with("switched on:"), "{said}");
    assert!(
        wait_until(Duration::from_secs(15), multiplex_tests::gate_held),
        "no gate after on"
    );
    let claimed = submit("on-again");
    let rec = c.wait(claimed, WAIT);
    assert!(rec["AdminComment"].contains("multiplex: claim "), "{rec:?}");
    assert!(gate(&c, &[]).starts_with("on: the claimer holds the gate until"));
}

/// The daemon holding the claimers' lease (its active `multiplex-claimer-NODE`), if one does.
fn lease_holder() -> Option<String> {
    let out = std::process::Command::new("scontrol")
        .args(["-o", "show", "reservation"])
        .output()
        .expect("run scontrol");
    let all = multiplexd::slurm::parse_reservations(&String::from_utf8_lossy(&out.stdout));
    let mut active = all.into_iter().filter(|r| r.active).filter_map(|r| {
        r.name
            .strip_prefix(multiplexd::claimer::LEASE_PREFIX)
            .map(str::to_string)
    });
    let holder = active.next();
    assert_eq!(active.next(), None, "two claimers' leases in force at once");
    holder
}

/// Gives n2's daemon `[claim] enabled` too (n1's lease length), until the guard is dropped;
/// waits until it stands by.
fn n2_stands_by(c: &Cluster) -> multiplex_tests::DaemonConfig {
    let section = format!("\n[claim]\nenabled = true\nlease_s = {}\n", lease(c).as_secs());
    let log = c.path("log/multiplexd-n2.log");
    let said = || std::fs::read_to_string(&log).map_or(0, |l| l.matches("standing by: another daemon holds").count());
    let before = said();
    let guard = c.daemon_config("n2", |text| format!("{text}{section}"));
    assert!(
        wait_until(Duration::from_secs(15), || said() > before),
        "n2 does not stand by"
    );
    guard
}

/// The daemons whose logs say they claimed `job`.
fn claimed_by(c: &Cluster, job: u32) -> Vec<&'static str> {
    ["n1", "n2"]
        .into_iter()
        .filter(|n| {
            std::fs::read_to_string(c.path(&format!("log/multiplexd-{n}.log")))
                .is_ok_and(|l| l.contains(&format!(" claimed job={job} ")))
        })
        .collect()
}

/// After a test that moved the lease: n1 holds it again before the next test.
fn n1_leads_again() {
    assert!(
        wait_until(Duration::from_secs(40), || lease_holder().as_deref() == Some("n1")),
        "n1 did not take the claimers' lease back: {:?}",
        lease_holder()
    );
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn a_claimer_killed_amid_a_burst_is_replaced_by_a_standby_and_every_job_is_claimed_and_started() {
    let c = Cluster::from_env();
    assert_eq!(lease_holder().as_deref(), Some("n1"));
    let standby = n2_stands_by(&c);
    let submit = |i: usize| {
        c.submit(&[
            &format!("--multiplex=app=itest-ha{i}"),
            "--gres=gpu:1",
            &out_arg(&c, "ha"),
            "--wrap",
            "sleep 2",
        ])
    };
    let mut jobs: Vec<u32> = (0..4).map(submit).collect();
    let killed = c.kill_daemon("n1");
    jobs.extend((4..8).map(submit));
    let _cancel = multiplex_tests::Cancel(jobs.clone());
    for &j in &jobs {
        let rec = c.wait(j, WAIT);
        assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
        // Claimed, not let through by a lapsed gate, and started within 30 s of submission.
        assert!(rec["AdminComment"].contains("multiplex: claim node:"), "{rec:?}");
        let t = |k: &str| epoch_seconds(&rec[k]);
        assert!(
            t("StartTime") - t("SubmitTime") <= 30,
            "job {j} waited too long: {rec:?}"
        );
    }
    assert_eq!(lease_holder().as_deref(), Some("n2"));
    for &j in &jobs[4..] {
        assert_eq!(claimed_by(&c, j), ["n2"], "job {j}");
    }
    drop(killed);
    drop(standby);
    n1_leads_again();
}

#[test]
#[ignore = "needs the local Slurm cluster: run tests/run"]
fn two_claimers_started_at_once_one_holds_the_lease_and_only_it_pins() {
    let c = Cluster::from_env();
    let standby = n2_stands_by(&c);
    let stopped = [c.stop_daemon("n1"), c.stop_daemon("n2")];
    drop(stopped);
    let jobs: Vec<u32> = (0..6)
        .map(|i| {
            c.submit(&[
                &format!("--multiplex=app=itest-race{i}"),
                "--gres=gpu:1",
                &out_arg(&c, "race2"),
                "--wrap",
                "sleep 1",
            ])
        })
        .collect();
    let _cancel = multiplex_tests::Cancel(jobs.clone());
    let holder = {
        assert!(
            wait_until(WAIT, || lease_holder().is_some()),
            "no daemon took the lease"
        );
        lease_holder().unwrap()
    };
    for &j in &jobs {
        let rec = c.wait(j, WAIT);
        assert_eq!(rec["JobState"], "COMPLETED", "{rec:?}");
        assert_eq!(
            rec["AdminComment"].matches("multiplex: claim node:").count(),
            1,
            "{rec:?}"
        );
        assert_eq!(claimed_by(&c, j), [holder.as_str()], "job {j}");
    }
    drop(standby);
    n1_leads_again();
}

/// Seconds since the epoch of slurmctld's local time stamp (`2026-11-28T08:45:44`), by
/// `date`, for differences only.
fn epoch_seconds(stamp: &str) -> i64 {
    let out = std::process::Command::new("date")
        .args(["-d", stamp, "+%s"])
        .output()
        .expect("run date");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a time stamp date reads")
}
