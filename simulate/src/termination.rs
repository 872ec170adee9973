//! Termination as a property of the world: over generated pair tables and traces chosen to be
//! hostile (most pairs cannot share, an application that cannot share even with itself,
//! speeds near 0 or near 2, bursts, identical submit times, one-second and day-long jobs),
//! every policy's run ends with every job finished; and the watchdog stops, with an error
//! that says where, a run that would not end.

use super::input::{Rng, Table, TraceJob};
use super::policy;
use super::world::{self, Cluster, JobRef, Outcome, Policy, Progress, Shape};

/// The kinds of pair table generated.
const TABLES: [&str; 6] = [
    "most pairs cannot share",
    "speeds near 0",
    "speeds near 2",
    "one application shares with nothing, not even itself",
    "mixed, applications that cannot share with themselves",
    "no pair can share",
];

fn table(kind: usize, rng: &mut Rng) -> Table {
    let apps = 2 + rng.below(6);
    let mut csv = String::from("gpu,job_a,job_b,speed_a,speed_b\n");
    for a in 0..apps {
        for b in a..apps {
            let cannot = match kind {
                0 => rng.uniform() < 0.7,
                3 => a == 0,
                4 => rng.uniform() < 0.3 || (a == b && rng.uniform() < 0.5),
                5 => true,
                _ => rng.uniform() < 0.1,
            };
            let mut speed = || match kind {
                1 => 0.05 + 0.1 * rng.uniform(),
                2 => 1.8 + 0.2 * rng.uniform(),
                _ => 0.01 + 1.2 * rng.uniform(),
            };
            let (sa, sb) = if cannot { (0.0, 0.0) } else { (speed(), speed()) };
            csv.push_str(&format!("g,app{a},app{b},{sa:.4},{sb:.4}\n"));
        }
    }
    Table::parse(&csv, TABLES[kind]).unwrap()
}

/// The kinds of trace generated.
const TRACES: [&str; 3] = [
    "Poisson arrivals at load 1.5",
    "one burst at time 0",
    "groups with identical submit times, 1 s to 4 h long",
];

fn trace(kind: usize, table: &Table, shape: &Shape, rng: &mut Rng) -> Vec<TraceJob> {
    let jobs = 10 + rng.below(14);
    if kind == 0 {
        return super::input::generate(jobs, 1.5, shape.nodes * shape.gpus_per_node, table, rng, 1.0);
    }
    (0..jobs)
        .map(|k| {
            let submit_s = if kind == 1 { 0.0 } else { 600.0 * (k / 5) as f64 };
            let solo_runtime_s = match rng.below(4) {
                0 => 1.0,
                1 => 60.0,
                2 => 3600.0,
                _ => 14_400.0,
            };
            TraceJob {
                id: (k + 1).to_string(),
                submit_s,
                app: rng.below(table.apps.len()),
                solo_runtime_s,
            }
        })
        .collect()
}

fn check_outcome(o: &Outcome, trace: &[TraceJob], shape: &Shape, what: &str) {
    // Nobody runs faster than 2 beside each partner: no job ends before this share of its work.
    let fastest = 2f64.powi(shape.jobs_per_gpu as i32 - 1);
    assert_eq!(o.jobs.len(), trace.len(), "{what}");
    for (k, &(submit, start, end)) in o.jobs.iter().enumerate() {
        assert!(
            end.is_finite() && submit <= start && start <= end,
            "{what}: job {} (submit {submit}, start {start}, end {end})",
            trace[k].id
        );
        assert!(
            end - start >= trace[k].solo_runtime_s / fastest - 1e-6,
            "{what}: job {}",
            trace[k].id
        );
    }
}

#[test]
fn every_policy_ends_every_run_on_hostile_tables_and_traces() {
    let mut rng = Rng::new(26);
    let mut runs = 0;
    for (table_kind, table_name) in TABLES.iter().enumerate() {
        let t = table(table_kind, &mut rng);
        for (trace_kind, trace_name) in TRACES.iter().enumerate() {
            for round in 0..2 {
                let shape = Shape {
                    nodes: 1 + rng.below(2),
                    gpus_per_node: 1 + rng.below(2),
                    jobs_per_gpu: 2 + rng.below(2) as u32,
                };
                let jobs = trace(trace_kind, &t, &shape, &mut rng);
                // Round 0: no signal but start and end times; round 1: reports and telemetry
                // (hourly: every 300 s made this test take four times as long).
                let progress = Progress {
                    every_s: if round == 0 { 0.0 } else { 900.0 },
                    noise: 0.05,
                    busy_every_s: if round == 0 { 0.0 } else { 3600.0 },
                    busy_noise: 0.1,
                    busy_bias: 0.2,
                    failures: crate::model::Failures::QUICK,
                };
                // The claimers also weigh a single pending job at a time, and share nothing
                // (round 1).
                let narrow = policy::Options {
                    lookahead: 1,
                    share_every_s: 0.0,
                    ..Default::default()
                };
                let claimers = ["learned", "oracle"].into_iter().filter(|_| round == 1);
                for (name, options) in policy::ALL
                    .iter()
                    .map(|&n| (n, policy::Options::default()))
                    .chain(claimers.map(|n| (n, narrow)))
                {
                    let what = format!(
                        "{name} on \"{table_name}\" ({} apps), \"{trace_name}\" ({} jobs), {shape:?}, {options:?}",
                        t.apps.len(),
                        jobs.len()
                    );
                    let mut p = policy::make_with(name, &t, shape, 7, options).unwrap();
                    let o =
                        world::run(&t, &jobs, shape, progress, 7, p.as_mut()).unwrap_or_else(|e| panic!("{what}: {e}"));
                    p.settle().unwrap_or_else(|e| panic!("{what}: {e}"));
                    check_outcome(&o, &jobs, &shape, &what);
                    runs += 1;
                }
            }
        }
    }
    assert_eq!(runs, TABLES.len() * TRACES.len() * (2 * policy::ALL.len() + 2));
}

#[test]
fn a_job_that_cannot_share_with_itself_does_not_doom_the_next_one_forever() {
    // The input that first exposed the endless run: an application that cannot share with
    // itself, four of its jobs, one GPU of two slots, first fit. Job 2 lands beside job 1 and is
    // doomed; job 1 ends before job 2 runs out of memory, so job 2 runs on (it was doomed for
    // good before, and each later job landed beside a doomed one, for ever).
    let t = Table::parse("gpu,job_a,job_b,speed_a,speed_b\ng,x,x,0,0\n", "self").unwrap();
    let shape = Shape {
        nodes: 1,
        gpus_per_node: 1,
        jobs_per_gpu: 2,
    };
    let job = |id: &str, submit_s: f64, solo_runtime_s: f64| TraceJob {
        id: id.into(),
        submit_s,
        app: 0,
        solo_runtime_s,
    };
    let jobs = [
        job("1", 0.0, 30.0),
        job("2", 10.0, 100.0),
        job("3", 20.0, 100.0),
        job("4", 50.0, 100.0),
    ];
    let mut p = policy::make("first-fit", &t, shape, 1).unwrap();
    let none = Progress {
        every_s: 0.0,
        noise: 0.0,
        busy_every_s: 0.0,
        busy_noise: 0.0,
        busy_bias: 0.0,
        failures: crate::model::Failures::QUICK,
    };
    let o = world::run(&t, &jobs, shape, none, 1, p.as_mut()).unwrap();
    check_outcome(&o, &jobs, &shape, "self-clashing first fit");
    // Job 2 was rescued at 30 (job 1 ended) and ran 30-130 alone but for doomed newcomers,
    // who do no work and slow no one.
    let (_, start, end) = o.jobs[1];
    assert_eq!((start, end), (10.0, 130.0), "{:?}", o.jobs);
    assert!(o.oom_failures >= 1, "{o:?}");
}

/// A claimer that claims nothing: its jobs wait for ever.
struct Never;

impl Policy for Never {
    fn claims(&self) -> bool {
        true
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// A claimer made to loop: it claims every job, then gives every running job back at every
/// round of telemetry, for ever. It keeps how many jobs the one GPU holds, as looks show it.
struct GivesBack(Vec<u32>, usize);

impl Policy for GivesBack {
    fn claims(&self) -> bool {
        true
    }
    fn claim_lookahead(&self) -> usize {
        8
    }
    fn claim(&mut self, _: f64, cluster: &Cluster, pending: &[JobRef]) -> Result<Vec<(usize, usize, usize)>, String> {
        if let Some((_, jobs)) = cluster.changed.iter().find(|(gi, _)| *gi == 0) {
            self.1 = jobs.len();
        }
        let free = 2 - self.1;
        Ok((0..pending.len().min(free)).map(|i| (i, 0, 0)).collect())
    }
    fn started(&mut self, _: f64, _: usize, job: JobRef, _: usize) -> Result<(), String> {
        self.0.push(job.id);
        Ok(())
    }
    fn separations(&mut self, _: f64, _: usize) -> Result<Vec<u32>, String> {
        Ok(std::mem::take(&mut self.0))
    }
    fn finished(&mut self, _: f64, _: usize, job: JobRef, _: bool) -> Result<(), String> {
        self.0.retain(|&j| j != job.id);
        Ok(())
    }
}

fn two_jobs() -> (Table, Vec<TraceJob>, Shape) {
    let t = Table::parse("gpu,job_a,job_b,speed_a,speed_b\ng,x,x,0.5,0.5\n", "one").unwrap();
    let jobs = vec![
        TraceJob {
            id: "first".into(),
            submit_s: 5.0,
            app: 0,
            solo_runtime_s: 100.0,
        },
        TraceJob {
            id: "second".into(),
            submit_s: 5.0,
            app: 0,
            solo_runtime_s: 100.0,
        },
    ];
    let shape = Shape {
        nodes: 1,
        gpus_per_node: 1,
        jobs_per_gpu: 2,
    };
    (t, jobs, shape)
}

#[test]
fn a_run_whose_jobs_are_never_claimed_says_which_never_finished() {
    let (t, jobs, shape) = two_jobs();
    let none = Progress {
        every_s: 0.0,
        noise: 0.0,
        busy_every_s: 0.0,
        busy_noise: 0.0,
        busy_bias: 0.0,
        failures: crate::model::Failures::QUICK,
    };
    let e = world::run(&t, &jobs, shape, none, 1, &mut Never).unwrap_err();
    assert_eq!(e, "job first never finished (no GPU would ever take it?)");
}

#[test]
fn the_watchdog_stops_a_policy_that_gives_jobs_back_for_ever() {
    let (t, jobs, shape) = two_jobs();
    let telemetry = Progress {
        every_s: 0.0,
        noise: 0.0,
        busy_every_s: 10.0,
        busy_noise: 0.0,
        busy_bias: 0.0,
        failures: crate::model::Failures::QUICK,
    };
    let e = world::run(&t, &jobs, shape, telemetry, 1, &mut GivesBack(Vec::new(), 0)).unwrap_err();
    assert!(
        e.starts_with("the simulation would not end: the run exceeded its budget"),
        "{e}"
    );
    assert!(
        e.contains("at simulated time ") && e.contains("the jobs going round: first, second"),
        "{e}"
    );
}

#[test]
fn the_watchdog_stops_a_clock_that_stands_still() {
    // Reports every 1e-300 s: the clock cannot move past them (the command line refuses this).
    let (t, jobs, shape) = two_jobs();
    let instant = Progress {
        every_s: 1e-300,
        noise: 0.0,
        busy_every_s: 0.0,
        busy_noise: 0.0,
        busy_bias: 0.0,
        failures: crate::model::Failures::QUICK,
    };
    let mut p = policy::make("first-fit", &t, shape, 1).unwrap();
    let e = world::run(&t, &jobs, shape, instant, 1, p.as_mut()).unwrap_err();
    assert!(
        e.contains("the simulated clock stopped advancing (at simulated time 5 s"),
        "{e}"
    );
    assert!(e.contains("the jobs going round: first, second"), "{e}");
}
