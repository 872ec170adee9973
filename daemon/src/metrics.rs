//! Prometheus metrics: counters and histograms kept as requests are served, gauges from a
//! [`Snapshot`] of the node that its caller takes when Prometheus scrapes, and a minimal HTTP endpoint (`[metrics] listen`, off by
//! default) that serves `GET /metrics` in the OpenMetrics text format. The exposition is the
//! `prometheus-client` crate's (the Prometheus project's own Rust client); the endpoint only
//! answers one GET at a time, with time limits, since its one client is a scraper.

use multiplex_protocol::NodeStatus;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Kind {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabel {
    pub gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AppLabel {
    pub app: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Everything the daemon counts, process-wide (one daemon per process).
pub struct Metrics {
    pub requests: HistogramFamily<Kind>,
    pub starts: Family<Outcome, Counter>,
    /// What the claimer did with pending jobs, by outcome (claimed, refused, too_late).
    claims: Family<Outcome, Counter>,
    pub oom_marks: Counter,
    pub client_faults: Family<Kind, Counter>,
    pub prediction_error: Histogram,
    /// Config re-reads on SIGHUP, by outcome (applied, failed).
    pub config_reloads: Family<Outcome, Counter>,
    /// Jobs given back to Slurm to run apart, by outcome (requeued, refused).
    separations: Family<Outcome, Counter>,
    put_backs: Family<Outcome, Counter>,
    slots_used: Family<GpuLabel, Gauge>,
    slots_per_gpu: Gauge,
    jobs_by_app: Family<AppLabel, Gauge>,
    history_jobs: Gauge,
    history_bytes: Gauge,
    scrape_errors: Counter,
    registry: Registry,
}

fn latency() -> Histogram {
    // 0.1 ms to about 3 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

fn speed_error() -> Histogram {
    Histogram::new([0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0])
}

impl Metrics {
    fn new() -> Metrics {
        let mut m = Metrics {
            requests: Family::new_with_constructor(latency as fn() -> Histogram),
            starts: Family::default(),
            claims: Family::default(),
            oom_marks: Counter::default(),
            client_faults: Family::default(),
            prediction_error: speed_error(),
            config_reloads: Family::default(),
            separations: Family::default(),
            put_backs: Family::default(),
            slots_used: Family::default(),
            slots_per_gpu: Gauge::default(),
            jobs_by_app: Family::default(),
            history_jobs: Gauge::default(),
            history_bytes: Gauge::default(),
            scrape_errors: Counter::default(),
            registry: Registry::with_prefix("multiplexd"),
        };
        m.register_work();
        m.register_state();
        m
    }

    /// The counters of what the daemon did: requests, starts, claims, failures.
    fn register_work(&mut self) {
        let r = &mut self.registry;
        r.register(
            "request_seconds",
            "Time to serve a request on the socket, by kind (start, finish, report, status, explain)",
            self.requests.clone(),
        );
        r.register(
            "starts",
            "Job steps recorded at launch: claimed (on the GPU, or the node, the claimer pinned its job to), unclaimed \
             (where Slurm put it on its own), joined (a later step of a job already here), too_large (fits no GPU \
             here: the step fails), error",
            self.starts.clone(),
        );
        r.register(
            "claims",
            "The claimer's work on pending jobs (on the daemon that runs it): claimed (pinned to a GPU), refused (no GPU \
             of the cluster could hold it), too_late (it left the queue first), failed (a look that could not read the queue or make a claim)",
            self.claims.clone(),
        );
        r.register(
            "oom_marks",
            "Jobs reported out of GPU memory beside their co-runners (the pair is never made again)",
            self.oom_marks.clone(),
        );
        r.register(
            "client_faults",
            "Requests refused or cut off: bad_frame, refused (connection limits), too_slow, failed (history error)",
            self.client_faults.clone(),
        );
        r.register(
            "prediction_error",
            "|predicted - observed| speed of jobs that ended beside others, where the application's solo runtime is known",
            self.prediction_error.clone(),
        );
    }

    /// The gauges and counters of the node's state and its history.
    fn register_state(&mut self) {
        let r = &mut self.registry;
        r.register(
            "config_reloads",
            "Config re-reads on SIGHUP: applied, or failed (the daemon runs on with the config it had)",
            self.config_reloads.clone(),
        );
        r.register(
            "separations",
            "Jobs measured to lose beside their partners and given back to Slurm: requeued, or refused (Slurm would not requeue it; it runs on)",
            self.separations.clone(),
        );
        r.register(
            "put_backs",
            "Jobs out of GPU memory beside a partner put back in Slurm's queue: requeued, or refused (it may not requeue, restarted too often, or Slurm failed; it ends failed)",
            self.put_backs.clone(),
        );
        r.register("slots_used", "Jobs on each shared GPU", self.slots_used.clone());
        r.register(
            "slots_per_gpu",
            "Jobs one GPU may hold (jobs_per_gpu)",
            self.slots_per_gpu.clone(),
        );
        r.register(
            "jobs_running",
            "Running jobs per application (only where Slurm does not keep jobs private)",
            self.jobs_by_app.clone(),
        );
        r.register(
            "history_jobs",
            "Job rows in the history database",
            self.history_jobs.clone(),
        );
        r.register(
            "history_bytes",
            "Size of the history database and its write-ahead log",
            self.history_bytes.clone(),
        );
        r.register(
            "scrape_errors",
            "Scrapes whose node gauges could not be read",
            self.scrape_errors.clone(),
        );
    }

    /// Counts one served request of `kind` that took `took`.
    pub fn request(&self, kind: &str, took: Duration) {
        self.requests
            .get_or_create(&Kind { kind: kind.into() })
            .observe(took.as_secs_f64());
    }

    pub fn start(&self, outcome: &str) {
        count(&self.starts, outcome);
    }

    pub fn claim(&self, outcome: &str, n: u64) {
        if n > 0 {
            self.claims
                .get_or_create(&Outcome {
                    outcome: outcome.into(),
                })
                .inc_by(n);
        }
    }

    pub fn config_reload(&self, outcome: &str) {
        count(&self.config_reloads, outcome);
    }

    pub fn separation(&self, outcome: &str) {
        count(&self.separations, outcome);
    }

    pub fn put_back(&self, outcome: &str) {
        count(&self.put_backs, outcome);
    }

    pub fn fault(&self, kind: &str) {
        self.client_faults.get_or_create(&Kind { kind: kind.into() }).inc();
    }

    /// Sets the gauges from `node` and encodes everything. `show_apps`: whether application
    /// names may be shown (Slurm does not keep jobs private).
    pub fn render(&self, node: &Snapshot, show_apps: bool) -> String {
        match &node.status {
            Some(status) => {
                self.slots_per_gpu.set(i64::from(status.jobs_per_gpu));
                self.slots_used.clear();
                self.jobs_by_app.clear();
                for gpu in &status.gpus {
                    let jobs: std::collections::BTreeSet<u32> = gpu.tasks.iter().map(|t| t.job_id).collect();
                    self.slots_used
                        .get_or_create(&GpuLabel {
                            gpu: gpu.index.to_string(),
                        })
                        .set(jobs.len() as i64);
                    if show_apps {
                        let mut seen = std::collections::BTreeSet::new();
                        for t in &gpu.tasks {
                            if seen.insert(t.job_id) {
                                self.jobs_by_app.get_or_create(&AppLabel { app: t.app.clone() }).inc();
                            }
                        }
                    }
                }
            }
            None => {
                self.scrape_errors.inc();
            }
        }
        match node.history_jobs {
            Some(n) => {
                self.history_jobs.set(n);
            }
            None => {
                self.scrape_errors.inc();
            }
        }
        let bytes: u64 = ["", "-wal"]
            .iter()
            .filter_map(|suffix| {
                let mut p = node.database.as_os_str().to_owned();
                p.push(suffix);
                std::fs::metadata(p).ok().map(|m| m.len())
            })
            .sum();
        self.history_bytes.set(bytes as i64);
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// What the gauges read of the node at a scrape (taken by the caller, under its lock).
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// What runs where; `None`: it could not be read (counted as a scrape error).
    pub status: Option<NodeStatus>,
    /// How many jobs the history holds; `None`: it could not be read.
    pub history_jobs: Option<i64>,
    /// The history's file (its size and its WAL's are read here).
    pub database: PathBuf,
}

/// Takes a [`Snapshot`] of the node.
pub type Snapshotter = Box<dyn Fn() -> Snapshot + Send>;

/// Whether an endpoint serves the metrics: what costs a query to measure (the prediction
/// error) is only measured then.
static SERVED: AtomicBool = AtomicBool::new(false);

pub fn served() -> bool {
    SERVED.load(Ordering::Relaxed)
}

fn count(family: &Family<Outcome, Counter>, outcome: &str) {
    family
        .get_or_create(&Outcome {
            outcome: outcome.into(),
        })
        .inc();
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// How long the endpoint waits for a request line, and to write its answer.
const IO_LIMIT: Duration = Duration::from_secs(5);

/// The most a request (line and headers) may hold before it is cut off.
const MAX_REQUEST: usize = 8192;

/// Serves `GET /metrics` on `listener` until `shutdown`, one connection at a time.
pub fn serve(listener: TcpListener, node: Snapshotter, private_jobs: Arc<AtomicBool>, shutdown: Arc<AtomicBool>) {
    SERVED.store(true, Ordering::Relaxed);
    let _ = listener.set_nonblocking(true);
    while !shutdown.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                if let Err(e) = answer(stream, &node, &private_jobs) {
                    tracing::debug!("metrics request: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => {
                tracing::warn!("metrics endpoint: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

fn answer(mut stream: TcpStream, node: &Snapshotter, private_jobs: &AtomicBool) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_LIMIT))?;
    stream.set_write_timeout(Some(IO_LIMIT))?;
    let deadline = Instant::now() + IO_LIMIT;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
        if buf.len() > MAX_REQUEST || Instant::now() > deadline {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "request too large\n",
            );
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf);
    let mut words = line.lines().next().unwrap_or("").split_whitespace();
    match (words.next(), words.next()) {
        (Some("GET"), Some("/metrics")) => {
            let body = global().render(&node(), !private_jobs.load(Ordering::Relaxed));
            respond(
                &mut stream,
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                &body,
            )
        }
        (Some("GET"), Some(_)) => respond(&mut stream, "404 Not Found", "text/plain", "only /metrics is here\n"),
        _ => respond(&mut stream, "405 Method Not Allowed", "text/plain", "GET /metrics\n"),
    }
}

fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

/// Binds the endpoint, saying which address could not be had.
pub fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr).map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::Node;
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    /// The metric names (`multiplexd_...`) a text mentions.
    fn names_in(text: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut rest = text;
        while let Some(i) = rest.find("multiplexd_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            out.insert(name.clone());
            rest = &rest[i + name.len()..];
        }
        out
    }

    #[test]
    fn the_dashboard_and_the_alerts_use_only_what_the_daemon_exports() {
        let m = Metrics::new();
        m.request("start", Duration::from_millis(1));
        m.start("claimed");
        m.claim("claimed", 1);
        m.fault("bad_frame");
        m.oom_marks.inc();
        m.config_reload("failed");
        m.prediction_error.observe(0.1);
        m.slots_used.get_or_create(&GpuLabel { gpu: "0".into() }).set(1);
        m.jobs_by_app.get_or_create(&AppLabel { app: "a".into() }).set(1);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &m.registry).unwrap();
        let exported: BTreeSet<String> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(String::from)
            .collect();
        assert!(exported.contains("multiplexd_starts_total"), "{exported:?}");
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/");
        for file in ["grafana/multiplexd-dashboard.json", "prometheus/multiplexd-alerts.yml"] {
            let used = names_in(&std::fs::read_to_string(format!("{root}{file}")).unwrap());
            assert!(!used.is_empty(), "{file}");
            let unknown: Vec<&String> = used.difference(&exported).collect();
            assert!(
                unknown.is_empty(),
                "{file} uses {unknown:?}, which the daemon does not export"
            );
        }
        // The dashboard is JSON that Grafana can import.
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{root}grafana/multiplexd-dashboard.json")).unwrap())
                .unwrap();
        assert!(dashboard["panels"].as_array().is_some_and(|p| p.len() >= 8));
    }

    #[test]
    fn the_endpoint_answers_get_metrics_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let config = crate::config::Config::parse(&format!(
            "node = \"n1\"\ndatabase = \"{}/h.sqlite\"\n[[gpu]]\nindex = 0\nmodel = \"v100\"\nmemory_mb = 16384\n",
            dir.path().display()
        ))
        .unwrap();
        let gpus = match &config.gpus {
            crate::config::GpuSource::Listed(g) => g.clone(),
            crate::config::GpuSource::Nvml => unreachable!(),
        };
        let node = Arc::new(Mutex::new(Node::open(config, gpus, crate::node::wall_clock()).unwrap()));
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = Arc::new(AtomicBool::new(false));
        let private = Arc::new(AtomicBool::new(true));
        let t = {
            let (node, shutdown) = (Arc::clone(&node), Arc::clone(&shutdown));
            let snapshot = move || node.lock().unwrap().metrics_snapshot();
            std::thread::spawn(move || serve(listener, Box::new(snapshot), private, shutdown))
        };
        let get = |request: &str| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(request.as_bytes()).unwrap();
            let mut text = String::new();
            s.read_to_string(&mut text).unwrap();
            text
        };
        let ok = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("multiplexd_slots_per_gpu 2"), "{ok}");
        assert!(ok.contains("multiplexd_slots_used{gpu=\"0\"} 0"), "{ok}");
        assert!(ok.trim_end().ends_with("# EOF"));
        assert!(get("GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        // Past the limit, and all read by the time the endpoint answers (no reset).
        let mut huge = String::from("GET /metrics HTTP/1.1\r\nX: ");
        huge.push_str(&"a".repeat(9000 - huge.len()));
        assert!(get(&huge).starts_with("HTTP/1.1 431"));
        shutdown.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }
}
