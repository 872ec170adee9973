use super::input::{Table, TraceJob, GAVEL_V100};
use super::world::{self, Progress, Shape};
use super::*;

fn small_table() -> Table {
    // a beside b: 0.5, b beside a: 0.8; c cannot share with a.
    Table::parse(
        "gpu,job_a,job_b,speed_a,speed_b\n\
         v100,a,b,0.5,0.8\nv100,a,a,0.6,0.6\nv100,b,b,0.6,0.6\nv100,a,c,0,0\nv100,b,c,0.9,0.9\nv100,c,c,0.9,0.9\n",
        "small",
    )
    .unwrap()
}

fn job(t: &Table, id: &str, submit_s: f64, app: &str, solo_runtime_s: f64) -> TraceJob {
    TraceJob {
        id: id.into(),
        submit_s,
        app: t.app_index(app).unwrap(),
        solo_runtime_s,
    }
}

/// The emulated runs' cluster: 2 nodes x 2 GPUs x 2 jobs per GPU.
const TWO_BY_TWO: Shape = Shape {
    nodes: 2,
    gpus_per_node: 2,
    jobs_per_gpu: 2,
};
const ONE_GPU: Shape = Shape {
    nodes: 1,
    gpus_per_node: 1,
    jobs_per_gpu: 2,
};
const NO_REPORTS: Progress = Progress {
    every_s: 0.0,
    noise: 0.0,
    busy_every_s: 0.0,
    busy_noise: 0.0,
    busy_bias: 0.0,
    failures: crate::model::Failures::QUICK,
};

fn simulate(t: &Table, trace: &[TraceJob], shape: Shape, policy: &str) -> Run {
    let mut p = policy::make(policy, t, shape, 1).unwrap();
    let o = world::run(t, trace, shape, NO_REPORTS, 1, p.as_mut()).unwrap();
    summarise(policy, &o)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn two_jobs_sharing_one_gpu_by_hand() {
    // a (100 s of work) arrives at 0, b (100 s) at 20. a runs alone to 20 (20 done). Together
    // a runs at 0.5 and b at 0.8: b ends at 20 + 100/0.8 = 145, when a has done
    // 20 + 125 * 0.5 = 82.5; a ends alone at 145 + 17.5 = 162.5.
    let t = small_table();
    let trace = [job(&t, "1", 0.0, "a", 100.0), job(&t, "2", 20.0, "b", 100.0)];
    let r = simulate(&t, &trace, ONE_GPU, "first-fit");
    assert!(close(r.jct[0], 162.5) && close(r.jct[1], 125.0), "{:?}", r.jct);
    let s = &r.summary;
    assert!(close(s.avg_jct_s, 143.75) && close(s.makespan_s, 162.5) && close(s.avg_wait_s, 0.0));
    assert_eq!((s.p50_jct_s, s.p95_jct_s), (125.0, 162.5));
    // Normalised throughput: 20 s at 1, 125 s at 0.5 + 0.8, 17.5 s at 1, over 162.5 busy s.
    assert!(close(s.throughput_per_gpu, 200.0 / 162.5), "{}", s.throughput_per_gpu);
    // Exclusive: b waits for a: ends at 200, waited 80.
    let r = simulate(&t, &trace, ONE_GPU, "exclusive");
    assert!(
        close(r.jct[1], 180.0) && close(r.summary.avg_wait_s, 40.0),
        "{:?}",
        r.jct
    );
    assert!(close(r.summary.throughput_per_gpu, 1.0));
}

#[test]
fn a_pair_that_cannot_share_fails_the_newcomer_and_requeues_it() {
    // c arrives at 10 beside a: it fails at 70, is eligible again at 190, when a (ended at
    // 100, unslowed) has left: c runs alone 190-240.
    let t = small_table();
    let trace = [job(&t, "1", 0.0, "a", 100.0), job(&t, "2", 10.0, "c", 50.0)];
    let r = simulate(&t, &trace, ONE_GPU, "first-fit");
    assert!(close(r.jct[0], 100.0) && close(r.jct[1], 230.0), "{:?}", r.jct);
    assert_eq!(r.summary.oom_failures, 1);
    assert!(close(r.summary.avg_wait_s, 90.0), "{}", r.summary.avg_wait_s);
}

/// A pair that does not fit, one GPU, first-fit, with failures priced as given.
fn priced(resident_dies: f64, newcomer_work: f64) -> world::Outcome {
    let t = small_table();
    let trace = [job(&t, "1", 0.0, "a", 100.0), job(&t, "2", 10.0, "c", newcomer_work)];
    let progress = Progress {
        failures: world::Failures {
            resubmit_after_s: 1800.0,
            resident_dies,
        },
        ..NO_REPORTS
    };
    let mut p = policy::make("first-fit", &t, ONE_GPU, 1).unwrap();
    world::run(&t, &trace, ONE_GPU, progress, 1, p.as_mut()).unwrap()
}

#[test]
fn a_failure_costs_its_user_the_resubmission_delay_and_the_work_done() {
    // The newcomer dies: c fails at 70 having done nothing, and is back at 1870, alone.
    let o = priced(0.0, 100.0);
    assert_eq!((o.oom_failures, o.resident_failures), (1, 0));
    assert!(close(o.lost_work_s, 0.0), "{}", o.lost_work_s);
    assert!(close(o.jobs[0].2, 100.0), "{:?}", o.jobs);
    assert!(close(o.jobs[1].1, 1870.0) && close(o.jobs[1].2, 1970.0), "{:?}", o.jobs);
    // The resident dies as it grows: a has done 10 s of its work when c arrives, does no more
    // and fails at 70 (losing the 10 s); c runs alone 10-110 (slowed by no one), and a comes
    // back at 1870 to run its 100 s again.
    let o = priced(1.0, 100.0);
    assert_eq!((o.oom_failures, o.resident_failures), (1, 1));
    assert!(close(o.lost_work_s, 10.0), "{}", o.lost_work_s);
    assert!(close(o.jobs[1].2, 110.0), "{:?}", o.jobs);
    assert!(close(o.jobs[0].1, 1870.0) && close(o.jobs[0].2, 1970.0), "{:?}", o.jobs);
    // A newcomer that leaves before the resident would have failed (c, 50 s, ends at 60)
    // leaves it its memory: a runs on from 60 with its 10 s done, to 150.
    let o = priced(1.0, 50.0);
    assert_eq!((o.oom_failures, o.resident_failures), (0, 0));
    assert!(close(o.jobs[0].2, 150.0), "{:?}", o.jobs);
}

#[test]
fn the_daemon_never_repeats_a_pair_that_ran_out_of_memory() {
    // a runs 0-1000; c jobs keep arriving beside it. Slurm's first fit hands each c the slot
    // beside a again and again; the claimer lets one fail, then claims none beside a until a
    // has left.
    let t = small_table();
    let trace = [
        job(&t, "1", 0.0, "a", 1000.0),
        job(&t, "2", 10.0, "c", 50.0),
        job(&t, "3", 300.0, "c", 50.0),
    ];
    let ff = simulate(&t, &trace, ONE_GPU, "first-fit");
    let learned = simulate(&t, &trace, ONE_GPU, "learned");
    let oracle = simulate(&t, &trace, ONE_GPU, "oracle");
    assert!(ff.summary.oom_failures >= 5, "{:?}", ff.summary);
    // The one run that ran out of memory was put back by its daemon: no user saw it fail.
    assert_eq!(ff.summary.put_back, 0, "Slurm's own placement puts nothing back");
    assert_eq!(
        (learned.summary.oom_failures, learned.summary.put_back),
        (0, 1),
        "{:?}",
        learned.summary
    );
    // One claim per run: three jobs, one of them run twice.
    assert_eq!(learned.summary.claims, 4, "{:?}", learned.summary);
    assert_eq!(oracle.summary.oom_failures, 0);
    assert_eq!(oracle.summary.claims, 3);
    // Every job still ends, after a.
    assert!(learned.jct[1] > 990.0 && learned.jct[2] > 700.0, "{:?}", learned.jct);
}

#[test]
fn a_burst_in_one_pass_gets_one_job_per_gpu_before_any_gpu_gets_two() {
    // Four jobs at one instant on 2 nodes x 2 GPUs x 2 slots. Slurm's LLN spreads them over
    // the nodes by its own count (two each), and its first fit pairs them on each node's first
    // GPU; one look of the claimer pins each to a GPU of its own.
    let t = small_table();
    let trace: Vec<TraceJob> = (0..4)
        .map(|i| job(&t, &i.to_string(), 0.0, if i % 2 == 0 { "a" } else { "b" }, 100.0))
        .collect();
    let ff = simulate(&t, &trace, TWO_BY_TWO, "first-fit");
    assert!(
        ff.jct.iter().all(|&j| j > 101.0),
        "first fit pairs every job: {:?}",
        ff.jct
    );
    for p in ["learned", "oracle"] {
        let r = simulate(&t, &trace, TWO_BY_TWO, p);
        // Each waits for the look and Slurm's pass after the claim, then runs alone.
        let wait = world::LOOK_S + world::PASS_S;
        assert!(r.jct.iter().all(|&j| close(j, 100.0 + wait)), "{p}: {:?}", r.jct);
        assert_eq!(r.summary.claims, 4, "one update per job");
    }
}

fn generated_setup(seed: u64, policies: &[&str]) -> Setup {
    let table = Table::parse(GAVEL_V100, "gavel").unwrap();
    let trace = generated_trace(&table, 150, 1.0, &TWO_BY_TWO, seed, 1.0).unwrap();
    Setup {
        table,
        trace,
        shape: TWO_BY_TWO,
        policies: policies.iter().map(|p| p.to_string()).collect(),
        seed,
        progress: Progress {
            every_s: 600.0,
            noise: 0.05,
            ..NO_REPORTS
        },
        options: policy::Options::default(),
        history: None,
    }
}

#[test]
fn the_same_seed_gives_the_same_results() {
    let a = run(&generated_setup(3, &policy::ALL)).unwrap();
    let b = run(&generated_setup(3, &policy::ALL)).unwrap();
    let c = run(&generated_setup(4, &policy::ALL)).unwrap();
    let summaries = |r: &[Run]| r.iter().map(|r| r.summary.clone()).collect::<Vec<_>>();
    assert_eq!(summaries(&a), summaries(&b));
    assert_ne!(summaries(&a), summaries(&c));
    assert_eq!(
        a.iter().map(|r| r.summary.policy.as_str()).collect::<Vec<_>>(),
        policy::ALL
    );
    // Output forms carry every policy.
    assert_eq!(csv(&a).lines().count(), 7);
    assert!(table(&a, "x").contains("learned"));
    assert!(plot::svg(&a, "x").contains("<polyline"));
}

#[test]
fn bad_setups_are_refused_clearly() {
    let s = |nodes, gpus_per_node, jobs_per_gpu| Shape {
        nodes,
        gpus_per_node,
        jobs_per_gpu,
    };
    let p = vec!["first-fit".to_string()];
    assert_eq!(check(&s(0, 4, 2), &p).unwrap_err(), "--nodes must be at least 1");
    assert_eq!(
        check(&s(1, 0, 2), &p).unwrap_err(),
        "--gpus-per-node must be at least 1"
    );
    assert!(check(&s(1, 1, 0), &p).unwrap_err().contains("--jobs-per-gpu 0"));
    let e = check(&s(1, 1, 2), &["best".to_string()]).unwrap_err();
    assert!(
        e.starts_with("unknown policy \"best\": choose from exclusive, first-fit"),
        "{e}"
    );
    let t = small_table();
    assert!(generated_trace(&t, 0, 1.0, &s(1, 1, 2), 1, 1.0)
        .unwrap_err()
        .contains("--jobs"));
    assert!(generated_trace(&t, 10, 0.0, &s(1, 1, 2), 1, 1.0)
        .unwrap_err()
        .contains("--load 0"));
    assert!(generated_trace(&t, 10, f64::NAN, &s(1, 1, 2), 1, 1.0)
        .unwrap_err()
        .contains("--load"));
}

#[test]
fn a_written_trace_reads_back_as_the_same_trace() {
    let t = Table::parse(GAVEL_V100, "gavel").unwrap();
    let trace = generated_trace(&t, 25, 1.0, &TWO_BY_TWO, 7, 1.0).unwrap();
    let back = input::parse_trace(&input::trace_csv(&trace, &t), "written", &t).unwrap();
    assert_eq!(back.len(), trace.len());
    for (a, b) in trace.iter().zip(&back) {
        assert_eq!((&a.id, a.app), (&b.id, b.app));
        assert!((a.submit_s - b.submit_s).abs() <= 0.0005 && (a.solo_runtime_s - b.solo_runtime_s).abs() <= 0.0005);
    }
}

#[test]
fn the_demo_trace_is_the_generators_seed_1() {
    // tests/demo says its trace is `--seed 1 --jobs 20 --load 1.0 --nodes 2 --gpus-per-node 2`
    // of this generator: a changed generator or an edited file must not make that untrue.
    let table = Table::parse(GAVEL_V100, "gavel").unwrap();
    let trace = generated_trace(&table, 20, 1.0, &TWO_BY_TWO, 1, 1.0).unwrap();
    let file = include_str!("../../tests/emulate/gavel-20.csv");
    assert_eq!(input::trace_csv(&trace, &table), file);
}

#[test]
fn a_freed_slot_goes_to_the_pending_job_that_pairs_best() {
    // Two c jobs share the GPU; a (cannot share with c) and then b (0.9 beside c) wait. When
    // the short c ends, the claimer passes over a (no slot for it beside c) and claims b for
    // the freed slot; a runs once the long c ends.
    let t = small_table();
    let trace = [
        job(&t, "1", 0.0, "c", 1000.0),
        job(&t, "2", 0.0, "c", 100.0),
        job(&t, "3", 1.0, "a", 100.0),
        job(&t, "4", 2.0, "b", 2000.0),
    ];
    let mut p = policy::make("oracle", &t, ONE_GPU, 1).unwrap();
    let o = world::run(&t, &trace, ONE_GPU, NO_REPORTS, 1, p.as_mut()).unwrap();
    assert_eq!((o.oom_failures, o.claims), (0, 4), "{o:?}");
    // b starts at the look after the short c ended, and the pass after its claim.
    let wait = world::LOOK_S + world::PASS_S;
    assert!(close(o.jobs[3].1, o.jobs[1].2 + wait), "{:?}", o.jobs);
    // a waits for the long c to end: beside b then, never beside c.
    assert!(o.jobs[2].1 >= 1000.0, "{:?}", o.jobs);
}

#[test]
fn a_share_waits_for_a_queue_long_enough_to_pay_for_it() {
    // 16 r jobs fill 4 x 4 GPUs until 1000 s; then a jobs arrive (0.7 beside r, r 0.7 beside
    // them: a gain of 0.4). A share takes more than 0.25 x 16 x 0.6 = 2.4 jobs waiting
    // (`policy.share_queue`'s default), the job shared counted: of 2 none shares, of 3 the
    // first, of 5 the first three, and the rest wait for the r jobs to end; with the knob at
    // 0, one shares at once.
    let t = Table::parse(
        "gpu,job_a,job_b,speed_a,speed_b\nv100,a,r,0.7,0.7\nv100,a,a,0.7,0.7\nv100,r,r,0.7,0.7\n",
        "queue",
    )
    .unwrap();
    let shape = Shape {
        nodes: 4,
        gpus_per_node: 4,
        jobs_per_gpu: 2,
    };
    let starts = |waiting: usize, share_queue: f64| -> Vec<f64> {
        let mut trace: Vec<TraceJob> = (0..16).map(|i| job(&t, &format!("r{i}"), 0.0, "r", 1000.0)).collect();
        trace.extend((0..waiting).map(|i| job(&t, &format!("a{i}"), 100.0, "a", 50.0)));
        let options = policy::Options {
            share_queue,
            ..policy::Options::default()
        };
        let mut p = policy::make_with("oracle", &t, shape, 1, options).unwrap();
        let o = world::run(&t, &trace, shape, NO_REPORTS, 1, p.as_mut()).unwrap();
        o.jobs[16..].iter().map(|j| j.1).collect()
    };
    let shared = 100.0 + world::LOOK_S + world::PASS_S;
    let count = |starts: &[f64]| {
        assert!(starts.iter().all(|&s| close(s, shared) || s > 1000.0), "{starts:?}");
        starts.iter().filter(|&&s| close(s, shared)).count()
    };
    assert_eq!(count(&starts(2, 0.25)), 0);
    assert_eq!(count(&starts(3, 0.25)), 1);
    assert_eq!(count(&starts(5, 0.25)), 3);
    assert_eq!(count(&starts(1, 0.0)), 1);
}

/// A claimer that claims job 1, and job 2 in its first 20 s, onto GPU 0 of node 0 and nothing
/// else, and keeps, at each look, when it looked, how many jobs the world said wait and how
/// many it listed.
struct Counts(Vec<(f64, usize, usize)>);

impl crate::model::Policy for Counts {
    fn claims(&self) -> bool {
        true
    }
    fn claim_lookahead(&self) -> usize {
        1
    }
    fn claim(
        &mut self,
        now: f64,
        cluster: &crate::model::Cluster,
        pending: &[crate::model::JobRef],
    ) -> Result<Vec<(usize, usize, usize)>, String> {
        self.0.push((now, cluster.waiting, pending.len()));
        let wanted = |j: &crate::model::JobRef| j.id == 1 || (j.id == 2 && now < 20.0);
        Ok((pending.iter().enumerate())
            .filter(|(_, j)| wanted(j))
            .map(|(i, _)| (i, 0, 0))
            .collect())
    }
    fn finished(&mut self, _: f64, _: usize, _: crate::model::JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn the_jobs_a_look_says_wait_are_those_eligible_listed_or_not() {
    // x runs from 0; y, claimed beside it at 11, cannot share with it and fails 60 s after
    // its start, back 120 s later (its user's resubmission, the world before failures were
    // priced). Meanwhile a second x arrives: at its look only it waits, y's wait not over;
    // once y is back both wait, and the look lists the first (a lookahead of 1).
    let t = Table::parse(
        "gpu,job_a,job_b,speed_a,speed_b\nv100,x,y,0,0\nv100,x,x,0.5,0.5\nv100,y,y,0.5,0.5\n",
        "xy",
    )
    .unwrap();
    let trace = [
        job(&t, "1", 0.0, "x", 10_000.0),
        job(&t, "2", 10.0, "y", 100.0),
        job(&t, "3", 80.0, "x", 100.0),
    ];
    let mut p = Counts(Vec::new());
    let never = world::run(&t, &trace, ONE_GPU, NO_REPORTS, 1, &mut p).unwrap_err();
    assert!(never.contains("never finished"), "{never}");
    let at = |when: f64| p.0.iter().find(|l| close(l.0, when)).map(|l| (l.1, l.2));
    // y claimed at 11, started at 12, failed at 72, back at 192.
    assert_eq!(at(11.0), Some((1, 1)), "{:?}", p.0);
    assert_eq!(at(81.0), Some((1, 1)), "{:?}", p.0);
    assert_eq!(at(193.0), Some((2, 1)), "{:?}", p.0);
}

#[test]
fn a_job_passed_over_too_often_still_never_takes_a_losing_share_and_starts_when_a_gpu_frees() {
    // r runs 3000 s; x pairs poorly with r (0.3 and 0.3, a loss) while y jobs (0.95 beside r)
    // keep arriving and are claimed before it, more than `Bypasses::MAX` of them. Starved, x
    // still never joins r: it starts the look after r ends.
    let t = Table::parse(
        "gpu,job_a,job_b,speed_a,speed_b\nv100,x,r,0.3,0.3\nv100,y,r,0.95,0.95\nv100,x,y,0.9,0.9\n\
         v100,x,x,0.9,0.9\nv100,y,y,0.9,0.9\nv100,r,r,0.9,0.9\n",
        "starve",
    )
    .unwrap();
    let mut trace = vec![job(&t, "1", 0.0, "r", 3000.0), job(&t, "2", 10.0, "x", 100.0)];
    for k in 0..8 {
        trace.push(job(&t, &format!("{}", 3 + k), 11.0 + 300.0 * k as f64, "y", 200.0));
    }
    const { assert!(8 > multiplexd::claim::Bypasses::MAX) };
    let r = simulate(&t, &trace, ONE_GPU, "oracle");
    // x (arrived at 10 s, 100 s of work alone) ends 100 s after r's end and a look and a pass.
    let x_end = r.jct[1] + 10.0;
    let r_end = r.jct[0];
    let wait = world::LOOK_S + world::PASS_S;
    assert!(
        x_end >= r_end + 100.0 && x_end <= r_end + 100.0 + wait + 1.0,
        "{:?}",
        r.jct
    );
}

/// x beside y runs at 0.3 and y beside x at 0.1: worse than taking turns.
fn losing_pair() -> Table {
    Table::parse(
        "gpu,job_a,job_b,speed_a,speed_b\nv100,x,y,0.3,0.1\nv100,x,x,0.5,0.5\nv100,y,y,0.5,0.5\n",
        "losing",
    )
    .unwrap()
}

/// The learned policy's run of `trace` on one GPU, with `progress` and the daemon's
/// `policy.separate_below`.
fn learned_on_one_gpu(t: &Table, trace: &[TraceJob], progress: Progress, separate_below: f64) -> world::Outcome {
    let options = policy::Options {
        separate_below,
        ..Default::default()
    };
    let mut p = policy::make_with("learned", t, ONE_GPU, 1, options).unwrap();
    let o = world::run(t, trace, ONE_GPU, progress, 1, p.as_mut()).unwrap();
    p.settle().unwrap();
    o
}

#[test]
fn a_pair_measured_to_lose_is_separated_and_both_finish_sooner() {
    // x beside y runs at 0.3 and y beside x at 0.1: worse than taking turns. Each ran alone
    // once (so its rate alone is known); the long ones then arrive together and share, the
    // pair being new. Reports every 100 s measure the pair; the daemon gives y back, and
    // declines it beside x until x ends.
    let t = losing_pair();
    let trace = [
        job(&t, "1", 0.0, "x", 300.0),
        job(&t, "2", 300.0, "y", 300.0),
        job(&t, "3", 1000.0, "x", 10_000.0),
        job(&t, "4", 1000.0, "y", 10_000.0),
    ];
    let reports = Progress {
        every_s: 100.0,
        ..NO_REPORTS
    };
    let run = |separate_below| learned_on_one_gpu(&t, &trace, reports, separate_below);
    let (kept, separated) = (run(0.0), run(multiplexd::config::keys::SEPARATE_BELOW.default));
    assert_eq!(kept.separations, 0);
    assert_eq!(separated.separations, 1, "{separated:?}");
    let jct = |o: &world::Outcome| o.jobs[2..].iter().map(|j| j.2 - j.0).sum::<f64>();
    // Kept together: x needs 33,333 s; y does 3,333 s of work by then, then 6,667 s alone.
    assert!(jct(&kept) > 70_000.0, "{kept:?}");
    // Apart: x alone from a few hundred seconds on, then y (its work so far lost).
    assert!(jct(&separated) < 0.5 * jct(&kept), "{separated:?}\n{kept:?}");
    assert!(
        separated.jobs[3].1 >= separated.jobs[2].2 - 1.0,
        "y restarts once x ended: {separated:?}"
    );
}

/// The learned policy's runs of `trace` on one GPU without reports: without GPU telemetry, and
/// with a round every 100 s.
fn blind_and_measured(t: &Table, trace: &[TraceJob], separate_below: f64) -> (world::Outcome, world::Outcome) {
    let run = |busy_every_s| {
        let progress = Progress {
            busy_every_s,
            ..NO_REPORTS
        };
        learned_on_one_gpu(t, trace, progress, separate_below)
    };
    (run(0.0), run(100.0))
}

#[test]
fn busy_gpu_time_measures_a_pair_whose_jobs_report_nothing() {
    // As above, without reports: x beside y runs at 0.3 and y beside x at 0.1. Each ran alone
    // once, long enough for the daemon to record its busy time alone. With GPU telemetry the
    // daemon measures the pair from the jobs' busy time and gives y back; without, it knows
    // nothing of the pair until a job of it ends, and splits nothing.
    let t = losing_pair();
    let trace = [
        job(&t, "1", 0.0, "x", 1000.0),
        job(&t, "2", 1000.0, "y", 1000.0),
        job(&t, "3", 2500.0, "x", 10_000.0),
        job(&t, "4", 2500.0, "y", 10_000.0),
    ];
    let (blind, measured) = blind_and_measured(&t, &trace, multiplexd::config::keys::SEPARATE_BELOW.default);
    assert_eq!(blind.separations, 0, "{blind:?}");
    assert_eq!(measured.separations, 1, "{measured:?}");
    // Given back within a few records of the pair's start, not after x's 33,000 s.
    assert!(measured.jobs[2].2 < 15_000.0, "{measured:?}");
}

#[test]
fn memory_that_fits_pair_by_pair_may_not_fit_three_together() {
    // Jobs of 6,000 MiB fit two by two (12,000 of 16,384) but not three together (18,000).
    // First-fit puts all three on the GPU; the third fails.
    let t = Table::parse("gpu,job_a,job_b,speed_a,speed_b\nv100,s,s,0.5,0.5\n", "s")
        .unwrap()
        .with_memory("app,mem_mb\ns,6000\n", "s", 16_384)
        .unwrap();
    let shape = Shape {
        jobs_per_gpu: 3,
        ..ONE_GPU
    };
    let trace = [
        job(&t, "1", 0.0, "s", 100.0),
        job(&t, "2", 0.0, "s", 100.0),
        job(&t, "3", 0.0, "s", 100.0),
    ];
    let first_fit = |trace: &[TraceJob]| {
        let mut p = policy::make("first-fit", &t, shape, 1).unwrap();
        world::run(&t, trace, shape, NO_REPORTS, 1, p.as_mut()).unwrap()
    };
    let (three, two) = (first_fit(&trace), first_fit(&trace[..2]));
    assert_eq!(three.oom_failures, 1, "{three:?}");
    assert_eq!(two.oom_failures, 0, "{two:?}");
}

#[test]
fn gpu_telemetry_shows_the_daemon_what_memory_a_job_needs() {
    // A big ran alone; two more arrive together. With telemetry the daemon measured the first
    // one's memory, so it keeps the second beside nothing but a small (here: waits for the
    // GPU); without, the pair is never tried and looks like any other, and one of them fails.
    // `big` needs 10,000 MiB and `small` 5,000 on GPUs of 16,384: two bigs do not fit
    // together; every other pair does, at 0.8 each side.
    let t = Table::parse(
        "gpu,job_a,job_b,speed_a,speed_b\nv100,big,big,0.8,0.8\nv100,big,small,0.8,0.8\nv100,small,small,0.8,0.8\n",
        "memory",
    )
    .unwrap()
    .with_memory("app,mem_mb\nbig,10000\nsmall,5000\n", "memory", 16_384)
    .unwrap();
    let trace = [
        job(&t, "1", 0.0, "big", 1000.0),
        job(&t, "2", 1500.0, "big", 1000.0),
        job(&t, "3", 1500.0, "big", 1000.0),
    ];
    let (blind, measured) = blind_and_measured(&t, &trace, 0.0);
    // Put back by its daemon, the failed run is no failure its user sees.
    assert_eq!((blind.oom_failures, blind.put_back), (0, 1), "{blind:?}");
    assert_eq!((measured.oom_failures, measured.put_back), (0, 0), "{measured:?}");
}

#[test]
fn a_sites_history_carries_what_it_learned_into_a_later_trace() {
    // A first trace (450 jobs) teaches the nodes, the pairs that ran out of memory among them.
    let mut setup = generated_setup(3, &["learned"]);
    setup.trace = generated_trace(&setup.table, 450, 1.0, &TWO_BY_TWO, 3, 1.0).unwrap();
    let first = run(&setup).unwrap().remove(0);
    let history = first.history.expect("the learned policy hands back what it learned");
    assert!(!history.pairs.is_empty() && history.pairs.iter().any(|p| p.oom));
    // Other traces, once from empty histories and once from the first one's: starting from
    // what was learned, fewer jobs run out of memory beside partners known not to fit (over
    // three traces: one of 150 jobs fails a handful either way).
    let later = |seed, history| {
        let setup = Setup {
            history,
            ..generated_setup(seed, &["learned"])
        };
        run(&setup).unwrap().remove(0)
    };
    let (mut cold_ooms, mut warm_ooms, mut warm) = (0, 0, None);
    for seed in 5..=7 {
        // Every run out of memory: those its users saw and those put back.
        let ran_out = |s: &crate::Summary| s.oom_failures + s.put_back;
        cold_ooms += ran_out(&later(seed, None).summary);
        let w = later(seed, Some(history.clone()));
        warm_ooms += ran_out(&w.summary);
        warm.get_or_insert(w);
    }
    let warm = warm.unwrap();
    assert!(
        warm_ooms < cold_ooms,
        "from the history {warm_ooms} out-of-memory failures, from nothing {cold_ooms}"
    );
    // And what it learns adds to what it started from.
    let after = warm.history.unwrap();
    assert!(after.pairs.len() >= history.pairs.len());
    for p in history.pairs.iter().filter(|p| p.oom) {
        assert!(
            after
                .pairs
                .iter()
                .any(|q| q.app == p.app && q.other == p.other && q.oom),
            "{p:?}"
        );
    }
    // Other policies learn nothing to hand on.
    let ff = run(&generated_setup(3, &["first-fit"])).unwrap().remove(0);
    assert!(ff.history.is_none());
}

#[test]
fn a_history_is_graded_pair_by_pair_and_by_the_partner_it_chooses() {
    use multiplexd::history::{Export, PairRow};
    // b pairs best with c (1.8 together); a with b is measured wrong (0.9 each, truly 0.5):
    // a newcomer b then joins a, which truly adds nothing.
    let t = Table::parse(
        "gpu,job_a,job_b,speed_a,speed_b\n\
         g,a,a,0.5,0.5\ng,a,b,0.5,0.5\ng,a,c,0.6,0.6\ng,b,b,0.5,0.5\ng,b,c,0.9,0.9\ng,c,c,0,0\n",
        "t",
    )
    .unwrap();
    let pair = |app: &str, other: &str, speed: f64, observations: u32| PairRow {
        gpu_model: "g".into(),
        app: app.into(),
        other: other.into(),
        speed,
        other_speed: speed,
        observations,
        variance: None,
        oom: false,
    };
    let export = Export {
        format: multiplexd::history::EXPORT_FORMAT.into(),
        version: multiplexd::history::EXPORT_VERSION,
        solo: Vec::new(),
        pairs: vec![
            pair("a", "b", 0.9, 3),
            pair("b", "a", 0.9, 3),
            pair("b", "c", 0.85, 2),
            pair("c", "b", 0.85, 2),
        ],
        memory: Vec::new(),
    };
    let g = grade::grade(&t, &export, grade::knobs(2, 0.25, 0.9), 16384).unwrap();
    let (err, n) = g.measured_error();
    assert_eq!(n, 4, "a-b both ways, b-c both ways");
    assert!(close(err, (0.4 + 0.4 + 0.05 + 0.05) / 4.0), "{err}");
    let b = g.choices.iter().find(|c| c.app == "b").unwrap();
    assert_eq!(b.chosen.as_deref(), Some("a"), "{b:?}");
    assert_eq!(b.best, Some(("c".to_string(), 0.8)));
    assert!(close(b.regret(), 0.8), "{}", b.regret());
    let text = g.text();
    assert!(
        text.contains("learning: 4 of 9 pairs measured on g, mean error 0.225"),
        "{text}"
    );
    assert!(text.contains("choices: "), "{text}");
    // A history of another GPU model knows nothing of this table's.
    let other = Export {
        pairs: export
            .pairs
            .iter()
            .map(|p| PairRow {
                gpu_model: "h".into(),
                ..p.clone()
            })
            .collect(),
        ..export.clone()
    };
    assert_eq!(
        grade::grade(&t, &other, grade::knobs(2, 0.25, 0.9), 16384)
            .unwrap()
            .measured_error()
            .1,
        0
    );
}

/// The learned policy's exchanges: a node asked nothing since the last exchange neither exports
/// nor imports then (it imports the pool when next asked), nor does a node export whose export
/// would be the last pool. Every node doing its part at every exchange leaves the same world
/// and the same history on every node.
#[test]
fn nodes_with_nothing_new_leave_out_of_an_exchange_what_changes_nothing() {
    let t = Table::parse(GAVEL_V100, "gavel-v100").unwrap();
    let shape = Shape {
        nodes: 12,
        gpus_per_node: 2,
        jobs_per_gpu: 2,
    };
    let trace = generated_trace(&t, 400, 1.5, &shape, 3, 0.0).unwrap();
    let progress = Progress {
        every_s: 300.0,
        noise: 0.05,
        ..NO_REPORTS
    };
    let options = learned::Options {
        share_every_s: 900.0,
        ..learned::Options::default()
    };
    let mut seen = Vec::new();
    let mut left_out = 0;
    for every_node_shares in [false, true] {
        let mut p = learned::Learned::new(&t, shape, options).unwrap();
        p.every_node_shares = every_node_shares;
        let o = world::run(&t, &trace, shape, progress, 3, &mut p).unwrap();
        let jcts: Vec<[u64; 3]> = o
            .jobs
            .iter()
            .map(|&(submit, start, end)| [submit.to_bits(), start.to_bits(), end.to_bits()])
            .collect();
        left_out += p.left_out;
        seen.push((jcts, p.exports()));
    }
    // The run left nodes out of some exchange, and several nodes learned pairs.
    assert!(left_out > 0);
    assert!(seen[0].1.iter().filter(|e| !e.pairs.is_empty()).count() > 1);
    assert_eq!(seen[0].0, seen[1].0, "the jobs' completion times");
    assert_eq!(seen[0].1, seen[1].1, "what each node holds");
}
