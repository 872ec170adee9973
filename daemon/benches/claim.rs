//! Benchmark: the claimer's own cost per look and per claim as the cluster grows. Builds
//! Slurm's books in memory (the unit tests' fake Slurm) for N nodes of 8 GPUs, 2 jobs per GPU,
//! and a history that knows every pair of 26 applications (a Node's SQLite history, in
//! memory), then times the daemon's own `Claimer::look` over them in two states:
//!
//!   burst  a quarter of the GPUs idle, 8 jobs waiting: each look claims all 8
//!   busy   every GPU holds a job whose pair with each waiting job gains too little: a look
//!          weighs every GPU for 8 jobs and claims none (the steady state of a loaded
//!          cluster, repeated every `look_ms`)
//!
//! Each look reads a fresh copy of the same books. Prints the median and 90th percentile time
//! per look, and per claim for the burst, at each size; the ratio 1,000 : 100 nodes says how
//! the cost grows with the cluster.
//!
//! cargo bench -p multiplexd --bench claim [-- ROUNDS]   (default 20 looks per size and state)

use multiplexd::claimer::Claimer;
use multiplexd::config::{ClaimConfig, Config, GpuSpec};
use multiplexd::history::{Export, PairRow, SoloRow, EXPORT_FORMAT, EXPORT_VERSION};
use multiplexd::node::Node;
use multiplexd::slurm::{Fake, FakeState, Job, NodeInfo};
use std::sync::Mutex;
use std::time::Instant;

const GPUS: u32 = 8;
const APPS: usize = 26;

fn app(i: usize) -> String {
    format!("app{i}")
}

/// A history that measured every pair: app i beside app j runs at 0.3 + 0.6 (i + j) / 2A (no
/// share gains enough for the first apps, pairs of the last ones gain).
fn history() -> Export {
    let speed = |i: usize, j: usize| 0.3 + 0.6 * (i + j) as f64 / (2 * APPS) as f64;
    let mut pairs = Vec::new();
    for i in 0..APPS {
        for j in 0..APPS {
            pairs.push(PairRow {
                gpu_model: "v100".into(),
                app: app(i),
                other: app(j),
                speed: speed(i, j),
                other_speed: speed(j, i),
                observations: 5,
                variance: None,
                oom: false,
            });
        }
    }
    let solo = (0..APPS)
        .map(|i| SoloRow {
            gpu_model: "v100".into(),
            app: app(i),
            runtime_s: 3600.0,
            runs: 5,
        })
        .collect();
    Export {
        format: EXPORT_FORMAT.into(),
        version: EXPORT_VERSION,
        solo,
        pairs,
        memory: vec![],
    }
}

fn daemon() -> Mutex<Node> {
    let config = Config::parse("node = \"n1\"\ndatabase = \":memory:\"\njobs_per_gpu = 2\n").unwrap();
    let gpus = (0..GPUS)
        .map(|index| GpuSpec {
            index,
            model: "v100".into(),
            memory_mb: 16384,
            uuid: None,
        })
        .collect();
    let mut node = Node::open(config, gpus, Box::new(|| 0.0)).unwrap();
    node.import(&history()).unwrap();
    Mutex::new(node)
}

fn job(id: u32, app: &str) -> Job {
    Job {
        id,
        pending: true,
        reason: "Licenses".into(),
        node: None,
        excluded: None,
        gres: "shard:1".into(),
        licenses: "multiplex:1".into(),
        admin_comment: Some(format!("multiplex:app={app}")),
    }
}

fn running(id: u32, app: &str, node: usize, gpu: u32) -> Job {
    Job {
        pending: false,
        reason: "None".into(),
        node: Some(format!("n{node}")),
        gres: format!("shard:v100_{gpu}:1"),
        licenses: String::new(),
        ..job(id, app)
    }
}

/// Slurm's books for `nodes` nodes: in `burst`, every fourth GPU idle and the rest holding a
/// job of a well-pairing application, 8 jobs of such applications waiting; otherwise every GPU
/// holding one job of app0 (which pairs poorly with everything) and 8 jobs of app0 waiting.
fn books(nodes: usize, burst: bool) -> FakeState {
    let mut jobs = Vec::new();
    let mut id = 1;
    for n in 0..nodes {
        for g in 0..GPUS {
            if burst && (n * GPUS as usize + g as usize) % 4 == 0 {
                continue;
            }
            let a = if burst { APPS - 1 - (id as usize % 3) } else { 0 };
            jobs.push(running(id, &app(a), n, g));
            id += 1;
        }
    }
    for k in 0..8 {
        let a = if burst { APPS - 1 - k % 3 } else { 0 };
        jobs.push(job(1_000_000 + k as u32, &app(a)));
    }
    let gres: Vec<String> = (0..GPUS)
        .map(|g| format!("gpu:v100_{g}:1"))
        .chain((0..GPUS).map(|g| format!("shard:v100_{g}:2")))
        .collect();
    FakeState {
        jobs,
        nodes: (0..nodes)
            .map(|n| NodeInfo {
                name: format!("n{n}"),
                state: "mixed".into(),
                gres: gres.join(","),
            })
            .collect(),
        licenses: 100_000,
        ..FakeState::default()
    }
}

/// Median and 90th percentile of `times`, ms.
fn quantiles(mut times: Vec<f64>) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.9))
}

/// `rounds` looks over fresh copies of the books: (median ms, p90 ms, claims per look).
fn measure(node: &Mutex<Node>, nodes: usize, burst: bool, rounds: usize) -> (f64, f64, usize) {
    let state = books(nodes, burst);
    let config = ClaimConfig {
        enabled: true,
        ..ClaimConfig::default()
    };
    let mut claims = 0;
    let mut times = Vec::new();
    // One claimer for every look, as on a cluster: its node list is read once.
    let mut claimer = Claimer::new(config, 100_000);
    for round in 0..=rounds {
        let slurm = Fake::new(state.clone());
        let start = Instant::now();
        let looked = claimer.look(&slurm, node, round as f64 * 1000.0).expect("a look");
        let ms = start.elapsed().as_secs_f64() * 1e3;
        // The first look also reads the node list and the history's memory: not counted.
        if round > 0 {
            times.push(ms);
            claims = looked.claimed.len();
        }
    }
    let (p50, p90) = quantiles(times);
    (p50, p90, claims)
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map_or(20, |a| a.parse().expect("ROUNDS must be a number"));
    let node = daemon();
    println!("claimer cost per look, {GPUS} GPUs per node, 2 jobs per GPU, 8 jobs waiting, {rounds} looks each");
    println!(
        "{:>6}  {:>6}  {:>10}  {:>10}  {:>7}  {:>12}",
        "nodes", "state", "p50 ms", "p90 ms", "claims", "ms per claim"
    );
    let mut p50s = Vec::new();
    for nodes in [100, 1000] {
        for burst in [true, false] {
            let (p50, p90, claims) = measure(&node, nodes, burst, rounds);
            let per = if claims > 0 {
                format!("{:.2}", p50 / claims as f64)
            } else {
                "-".into()
            };
            let state = if burst { "burst" } else { "busy" };
            println!("{nodes:>6}  {state:>6}  {p50:>10.2}  {p90:>10.2}  {claims:>7}  {per:>12}");
            p50s.push(p50);
        }
    }
    println!(
        "1,000 : 100 nodes: burst {:.1}x, busy {:.1}x (10x the GPUs)",
        p50s[2] / p50s[0],
        p50s[3] / p50s[1]
    );
}
