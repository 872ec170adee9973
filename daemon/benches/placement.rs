//! Benchmark: the daemon with a long history. Builds a history of 100,000 finished jobs over
//! 1,000 applications (written straight into the schema the daemon creates: jobs, who shared
//! with whom, solo baselines and pair estimates), starts the real `multiplexd serve` on it,
//! and drives place/finish cycles through its socket as slurmstepd does. Prints placement and
//! finish latency p50/p99 (a finish queues its learning to the daemon's learning thread), the
//! daemon's resident memory, and the database's size per 10,000 jobs. Targets: placement p99 under 1 ms, memory under 50 MB.
//!
//! cargo bench -p multiplexd --bench placement [-- JOBS APPS CYCLES]

use multiplex_protocol::client::call;
use multiplex_protocol::{FinishRequest, Request, Response, StartRequest};
use rusqlite::{params, Connection};
use std::path::Path;
use std::time::{Duration, Instant};

/// A small deterministic generator (xorshift), so every run builds the same history.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const GPUS: u32 = 4;
const SLOTS: u32 = 2;

fn config(dir: &Path) -> String {
    let mut c = format!(
        "node = \"n1\"\nsocket = \"{d}/d.sock\"\ndatabase = \"{d}/h.sqlite\"\njobs_per_gpu = {SLOTS}\nslurm_user = \"root\"\n\
         slurm_bin = \"{d}/no-slurm\"\n[reconcile]\ninterval_s = 0\n",
        d = dir.display()
    );
    for g in 0..GPUS {
        c.push_str(&format!("[[gpu]]\nindex = {g}\nmodel = \"v100\"\nmemory_mb = 16384\n"));
    }
    c
}

/// Writes `jobs` finished jobs of `apps` applications, in pairs on one GPU, into the database
/// the daemon created (so the schema is the daemon's own).
fn populate(db: &Path, jobs: u64, apps: u64, rng: &mut Rng) {
    let mut conn = Connection::open(db).unwrap();
    let tx = conn.transaction().unwrap();
    for a in 0..apps {
        tx.execute(
            "INSERT INTO applications(id, name) VALUES (?1, ?2)",
            params![a + 1, format!("app{a}")],
        )
        .unwrap();
        tx.execute(
            "INSERT INTO solo_baselines(gpu_model, app_id, runtime_s, observations) VALUES ('v100', ?1, ?2, 5)",
            params![a + 1, 600.0 + 3000.0 * rng.unit()],
        )
        .unwrap();
    }
    let mut t = 0.0;
    let mut job = 1u64;
    while job <= jobs {
        // Two jobs share a GPU for a while; each then runs alone to its end.
        let (a, b) = (rng.below(apps) + 1, rng.below(apps) + 1);
        let mut rows = [0i64; 2];
        for (k, app) in [a, b].into_iter().enumerate() {
            tx.execute(
                "INSERT INTO jobs(job_id, node, uid, app_id, gpu, gpu_model, mem_mb, owner_step, slurm_gpus, decision,
                                  predicted_speed, started_at, finished_at, exit_status)
                 VALUES (?1, 'n1', 1000, ?2, ?3, 'v100', NULL, 4294967291, '0', 'bench history', 0.7, ?4, ?5, 0)",
                params![job, app, job % GPUS as u64, t, t + 1000.0 + 100.0 * k as f64],
            )
            .unwrap();
            rows[k] = tx.last_insert_rowid();
            job += 1;
        }
        for k in 0..2 {
            let (me, other, other_app) = (rows[k], rows[1 - k], [b, a][k]);
            tx.execute(
                "INSERT INTO intervals(job_row, partner_row, partner_app_id, started_at, ended_at)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![me, other, other_app, t, t + 800.0],
            )
            .unwrap();
            tx.execute(
                "INSERT INTO intervals(job_row, partner_row, started_at, ended_at) VALUES (?1, NULL, ?2, ?3)",
                params![me, t + 800.0, t + 1000.0 + 100.0 * k as f64],
            )
            .unwrap();
            tx.execute(
                "INSERT INTO steps(job_row, step_id, started_at, finished_at, exit_status) VALUES (?1, 4294967291, ?2, ?3, 0)",
                params![me, t, t + 1000.0],
            )
            .unwrap();
        }
        let (s1, s2) = (0.3 + 0.7 * rng.unit(), 0.3 + 0.7 * rng.unit());
        for (x, y, sx, sy) in [(a, b, s1, s2), (b, a, s2, s1)] {
            tx.execute(
                "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations, variance)
                 VALUES ('v100', ?1, ?2, ?3, ?4, 1, 0.01)
                 ON CONFLICT DO UPDATE SET observations = observations + 1",
                params![x, y, sx, sy],
            )
            .unwrap();
        }
        t += 10.0;
    }
    tx.commit().unwrap();
    // What the daemon derives from those estimates as it learns them (each application's
    // record and what is known of it beside partners never seen), by the daemon's own code.
    multiplexd::history::History::open(db)
        .unwrap()
        .refit_effects(multiplexd::config::DEFAULT_UNKNOWN_PAIR_SPEED)
        .unwrap();
    conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); VACUUM;").unwrap();
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

fn main() {
    let nums: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let jobs = nums.first().copied().unwrap_or(100_000);
    let apps = nums.get(1).copied().unwrap_or(1_000);
    let cycles = nums.get(2).copied().unwrap_or(5_000);
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("multiplexd.toml");
    std::fs::write(&conf, config(dir.path())).unwrap();
    let bin = env!("CARGO_BIN_EXE_multiplexd");
    let socket = dir.path().join("d.sock");
    let db = dir.path().join("h.sqlite");
    let start = |log: &Path| {
        std::process::Command::new(bin)
            .args(["serve", "--config"])
            .arg(&conf)
            .env("MULTIPLEXD_LOG", "warn")
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap()
    };
    let wait_socket = || {
        let t = Instant::now();
        while !socket.exists() {
            assert!(t.elapsed() < Duration::from_secs(30), "multiplexd did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // A first start creates the schema; stop it, fill the history, start again.
    let mut d = start(&dir.path().join("first.log"));
    wait_socket();
    d.kill().unwrap();
    d.wait().unwrap();
    let _ = std::fs::remove_file(&socket);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let t = Instant::now();
    populate(&db, jobs, apps, &mut rng);
    let built = t.elapsed();
    let db_bytes = std::fs::metadata(&db).unwrap().len();
    let mut daemon = start(&dir.path().join("daemon.log"));
    wait_socket();

    let timeout = Duration::from_secs(5);
    let mut place_ms = Vec::new();
    let mut finish_ms = Vec::new();
    let mut running: std::collections::VecDeque<(u32, u32)> = Default::default();
    for i in 0..cycles {
        let job_id = 1_000_000 + i as u32;
        // Keep the node between half and fully busy, as a loaded node is.
        if running.len() as u32 >= GPUS * SLOTS - rng.below(u64::from(GPUS)) as u32 {
            let (old, _) = running.pop_front().unwrap();
            let t = Instant::now();
            let r = call(
                &socket,
                timeout,
                Request::Finish(FinishRequest {
                    job_id: old,
                    step_id: 0xffff_fffb,
                    exit_status: 0,
                }),
            )
            .unwrap();
            finish_ms.push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!(r, Response::Finished);
        }
        // Where Slurm bound it: a GPU with a free slot, as Slurm's books allow.
        let gpu = (0..GPUS)
            .map(|g| (g + job_id) % GPUS)
            .find(|&g| running.iter().filter(|&&(_, on)| on == g).count() < SLOTS as usize)
            .unwrap_or(0);
        let req = StartRequest {
            step_id: 0xffff_fffb,
            ..StartRequest::new(job_id, 1000, format!("app{}", rng.below(apps)), "n1", gpu)
        };
        let t = Instant::now();
        let r = call(&socket, timeout, Request::Start(req)).unwrap();
        place_ms.push(t.elapsed().as_secs_f64() * 1e3);
        match r {
            Response::Started(_) => running.push_back((job_id, gpu)),
            other => panic!("{other:?}"),
        }
    }
    let rss = rss_kib(daemon.id());
    daemon.kill().unwrap();
    daemon.wait().unwrap();
    let db_after = std::fs::metadata(&db).unwrap().len()
        + std::fs::metadata(dir.path().join("h.sqlite-wal")).map_or(0, |m| m.len());

    println!(
        "multiplexd with a history of {jobs} finished jobs over {apps} applications (built in {:.1} s)",
        built.as_secs_f64()
    );
    println!("node: {GPUS} GPUs x {SLOTS} slots, {cycles} job starts through the socket");
    println!(
        "start  (socket round trip): p50 {:.3} ms  p99 {:.3} ms   target p99 < 1 ms",
        pct(&mut place_ms, 0.5),
        pct(&mut place_ms, 0.99)
    );
    println!(
        "finish (learning queued):   p50 {:.3} ms  p99 {:.3} ms",
        pct(&mut finish_ms, 0.5),
        pct(&mut finish_ms, 0.99)
    );
    println!(
        "daemon resident memory:     {:.1} MB   target < 50 MB",
        rss as f64 / 1024.0
    );
    println!(
        "database: {:.1} MB for {jobs} jobs = {:.2} MB per 10,000 jobs ({:.1} MB after the run, WAL included)",
        db_bytes as f64 / 1e6,
        db_bytes as f64 / 1e6 / (jobs as f64 / 10_000.0),
        db_after as f64 / 1e6
    );
}
