//! The simulator's inputs: the pair table (the world's hidden truth) and the job trace, read
//! from CSV or generated from a seed.

use std::collections::HashMap;

/// The Gavel V100 table, embedded so that `multiplex-simulate` alone prints a comparison.
pub const GAVEL_V100: &str = include_str!("../data/gavel-v100.csv");

/// True pair speeds on one GPU model.
#[derive(Debug, Clone)]
pub struct Table {
    pub model: String,
    pub apps: Vec<String>,
    /// `speed[a][b]`: speed of app `a` beside app `b`; `None`: they cannot share.
    speed: Vec<Vec<Option<f64>>>,
    /// The GPU memory of each application and of the GPU, MiB, where the table has them
    /// ([`Table::with_memory`]): jobs whose memory together exceeds the GPU's cannot share.
    memory: Option<Memory>,
}

/// What each application's processes peak at on the GPU, and the GPU's memory (MiB).
#[derive(Debug, Clone)]
struct Memory {
    gpu_mb: u64,
    apps: Vec<u64>,
}

/// A table as its rows are read.
#[derive(Default)]
struct Rows {
    model: Option<String>,
    index: HashMap<String, usize>,
    apps: Vec<String>,
    /// Each listed order's speeds.
    pairs: HashMap<(usize, usize), (f64, f64)>,
}

impl Rows {
    /// Reads one row's fields; the error says what is wrong with it.
    fn add(&mut self, f: &[&str]) -> Result<(), String> {
        if f.len() != 5 {
            return Err(format!("expected 5 fields, found {}", f.len()));
        }
        match &self.model {
            None => {
                // The model names the GPUs' gres types (`v100_0`).
                multiplex_protocol::spec::parse_app(f[0])
                    .map_err(|_| format!("GPU model {:?}: use letters, digits, '.', '_' or '-'", f[0]))?;
                self.model = Some(f[0].to_string())
            }
            Some(m) if m != f[0] => return Err(format!("GPU model {} after {m}: give one GPU model per table", f[0])),
            Some(_) => {}
        }
        let (sa, sb) = (speed(f[3])?, speed(f[4])?);
        if (sa == 0.0) != (sb == 0.0) {
            return Err("a pair that cannot share has 0 for both speeds".into());
        }
        let (a, b) = (self.id(f[1])?, self.id(f[2])?);
        if self.pairs.insert((a, b), (sa, sb)).is_some() {
            return Err(format!("the pair {},{} is listed twice", f[1], f[2]));
        }
        Ok(())
    }

    /// An application's index, given at its first row.
    fn id(&mut self, app: &str) -> Result<usize, String> {
        if app.is_empty() {
            return Err("empty job name".into());
        }
        // A job's application travels in its tag, as `--multiplex app=NAME`.
        multiplex_protocol::spec::parse_app(app).map_err(|e| e.to_string())?;
        let apps = &mut self.apps;
        Ok(*self.index.entry(app.to_string()).or_insert_with(|| {
            apps.push(app.to_string());
            apps.len() - 1
        }))
    }

    /// A pair listed in both orders that cannot share in one and shares in the other: where
    /// two jobs' memory does not fit on one GPU, it does not whichever started first. Taken
    /// as it stands, the job of the order that shares would run beside a partner whose own
    /// row says it cannot, the partner unslowed (it has no speed beside it).
    fn contradiction(&self) -> Option<String> {
        let mut found: Vec<(usize, usize)> = (self.pairs.iter())
            .filter(|&(&(a, b), &(sa, _))| {
                a < b
                    && self
                        .pairs
                        .get(&(b, a))
                        .is_some_and(|&(sb, _)| (sa == 0.0) != (sb == 0.0))
            })
            .map(|(&k, _)| k)
            .collect();
        found.sort_unstable();
        let &(a, b) = found.first()?;
        let (x, y) = (&self.apps[a], &self.apps[b]);
        Some(format!(
            "the pair {x},{y} cannot share in one order (0,0) and shares in the other ({} such pairs): \
             whether two jobs fit in a GPU's memory does not depend on which started first; \
             give both orders 0,0 or neither",
            found.len()
        ))
    }

    /// The table the rows make; `None` without a row.
    fn into_table(self) -> Option<Table> {
        let n = self.apps.len();
        let mut speed = vec![vec![None; n]; n];
        for (a, row) in speed.iter_mut().enumerate() {
            for (b, cell) in row.iter_mut().enumerate() {
                // Each order's own row first; a pair listed in one order only serves both.
                let s = match (self.pairs.get(&(a, b)), self.pairs.get(&(b, a))) {
                    (Some(&(sa, _)), _) => sa,
                    (None, Some(&(_, sb))) => sb,
                    (None, None) => 0.0,
                };
                *cell = (s > 0.0).then_some(s);
            }
        }
        Some(Table {
            model: self.model?,
            apps: self.apps,
            speed,
            memory: None,
        })
    }
}

/// A pair's speed as a table writes it.
fn speed(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("speed {s:?} is not a number"))?;
    if !(0.0..=2.0).contains(&v) {
        return Err(format!("speed {v} is outside 0..2"));
    }
    // A job that crawls at a millionth of its speed never ends in simulated time.
    if v > 0.0 && v < MIN_SPEED {
        return Err(format!(
            "speed {v} is below {MIN_SPEED}: a pair that slow cannot share (write 0,0)"
        ));
    }
    Ok(v)
}

/// The lines of a CSV text after its header, each with its index among the text's lines
/// (blank lines left out); an error naming `name` unless the first is `header`.
fn after_header<'t>(text: &'t str, name: &str, header: &str) -> Result<impl Iterator<Item = (usize, &'t str)>, String> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let first = lines.next().map(|(_, l)| l.trim()).unwrap_or("");
    if first != header {
        return Err(format!(
            "{name}: the first line must be the header {header}, not {first:?}"
        ));
    }
    Ok(lines)
}

impl Table {
    /// Parses a table (`gpu,job_a,job_b,speed_a,speed_b`); `name` is used in errors.
    pub fn parse(text: &str, name: &str) -> Result<Table, String> {
        let lines = after_header(text, name, "gpu,job_a,job_b,speed_a,speed_b")?;
        let mut rows = Rows::default();
        for (n, line) in lines {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            rows.add(&f).map_err(|msg| format!("{name} line {}: {msg}", n + 1))?;
        }
        if let Some(msg) = rows.contradiction() {
            return Err(format!("{name}: {msg}"));
        }
        rows.into_table()
            .ok_or_else(|| format!("{name}: no pairs after the header"))
    }

    /// Adds each application's GPU memory (CSV `app,mem_mb`, every application of the table
    /// once) on GPUs of `gpu_mb` MiB: a pair whose memory together exceeds the GPU's cannot
    /// share, whatever its speeds say. This is the world where memory decides which pairs
    /// fit, as on real GPUs, and what NVML telemetry shows the daemon (`--busy-every`).
    pub fn with_memory(mut self, text: &str, name: &str, gpu_mb: u64) -> Result<Table, String> {
        let lines = after_header(text, name, "app,mem_mb")?;
        let mut mem: Vec<Option<u64>> = vec![None; self.apps.len()];
        for (n, line) in lines {
            let at = |msg: String| format!("{name} line {}: {msg}", n + 1);
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            let [app, mb] = f[..] else {
                return Err(at(format!("expected 2 fields, found {}", f.len())));
            };
            let i = self
                .app_index(app)
                .ok_or_else(|| at(format!("{app:?} is not an application of the pair table")))?;
            let mb: u64 = mb
                .parse()
                .map_err(|_| at(format!("memory {mb:?} is not a whole number of MiB")))?;
            if mb > gpu_mb {
                return Err(at(format!("{app} needs {mb} MiB, more than the GPU's {gpu_mb} MiB")));
            }
            if mem[i].replace(mb).is_some() {
                return Err(at(format!("{app} is listed twice")));
            }
        }
        let apps = mem
            .iter()
            .zip(&self.apps)
            .map(|(m, app)| m.ok_or_else(|| format!("{name}: no memory for {app}")))
            .collect::<Result<Vec<u64>, String>>()?;
        for (a, row) in self.speed.iter_mut().enumerate() {
            for (b, cell) in row.iter_mut().enumerate() {
                if apps[a] + apps[b] > gpu_mb {
                    *cell = None;
                }
            }
        }
        self.memory = Some(Memory { gpu_mb, apps });
        Ok(self)
    }

    /// The GPU memory of application `a`, MiB, where the table has memory.
    pub fn memory_of(&self, a: usize) -> Option<u64> {
        self.memory.as_ref().map(|m| m.apps[a])
    }

    /// The GPUs' memory, MiB, where the table has memory.
    pub fn gpu_memory(&self) -> Option<u64> {
        self.memory.as_ref().map(|m| m.gpu_mb)
    }

    /// Speed of `a` beside `b`, or `None` when they cannot share.
    pub fn speed(&self, a: usize, b: usize) -> Option<f64> {
        self.speed[a][b]
    }

    pub fn app_index(&self, name: &str) -> Option<usize> {
        self.apps.iter().position(|a| a == name)
    }
}

/// The least speed a pair table may give a job that shares (0 aside: cannot share).
pub const MIN_SPEED: f64 = 0.001;

/// One job of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceJob {
    pub id: String,
    pub submit_s: f64,
    pub app: usize,
    pub solo_runtime_s: f64,
}

/// Reads a trace (`job_id,submit_s,app,solo_runtime_s`), sorted by submit time (stable).
pub fn parse_trace(text: &str, name: &str, table: &Table) -> Result<Vec<TraceJob>, String> {
    let lines = after_header(text, name, "job_id,submit_s,app,solo_runtime_s")?;
    let mut jobs = Vec::new();
    for (n, line) in lines {
        let at = |msg: String| format!("{name} line {}: {msg}", n + 1);
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() != 4 {
            return Err(at(format!("expected 4 fields, found {}", f.len())));
        }
        let number = |what: &str, s: &str| -> Result<f64, String> {
            s.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| at(format!("{what} {s:?} is not a number")))
        };
        let submit_s = number("submit_s", f[1])?;
        if submit_s < 0.0 {
            return Err(at(format!("submit_s {submit_s} is negative")));
        }
        let solo_runtime_s = number("solo_runtime_s", f[3])?;
        if solo_runtime_s <= 0.0 {
            return Err(at(format!("solo_runtime_s {solo_runtime_s} must be positive")));
        }
        let app = table.app_index(f[2]).ok_or_else(|| {
            at(format!(
                "app {:?} is not in the pair table (it knows {})",
                f[2],
                table.apps.join(", ")
            ))
        })?;
        jobs.push(TraceJob {
            id: f[0].to_string(),
            submit_s,
            app,
            solo_runtime_s,
        });
    }
    if jobs.is_empty() {
        return Err(format!("{name}: no jobs after the header"));
    }
    jobs.sort_by(|a, b| a.submit_s.total_cmp(&b.submit_s));
    Ok(jobs)
}

/// A trace as CSV, in the format [`parse_trace`] reads (times to the millisecond).
pub fn trace_csv(trace: &[TraceJob], table: &Table) -> String {
    let mut out = String::from("job_id,submit_s,app,solo_runtime_s\n");
    for j in trace {
        out.push_str(&format!(
            "{},{:.3},{},{:.3}\n",
            j.id, j.submit_s, table.apps[j.app], j.solo_runtime_s
        ));
    }
    out
}

/// Median solo runtime of generated jobs, seconds.
pub const MEDIAN_RUNTIME_S: f64 = 3600.0;
/// Spread of generated runtimes: the standard deviation of their logarithm.
pub const RUNTIME_SIGMA: f64 = 1.0;

/// Generates `jobs` jobs: Poisson arrivals offering `load` times the work `gpus` GPUs do one
/// job each, applications drawn uniformly, log-normal solo runtimes (median one hour).
///
/// `same_app_sigma` (0 to 1) is how much of the runtimes' spread ([`RUNTIME_SIGMA`], of their
/// logarithm) lies between the jobs of one application: at 1 a job's length says nothing of its
/// application (the trace the simulator always made); below it, each application has a median
/// of its own, spread by the rest, and its jobs differ by `same_app_sigma` around it, as runs of
/// one training script with one configuration do. The total spread, and so the load, stay.
pub fn generate(
    jobs: usize,
    load: f64,
    gpus: usize,
    table: &Table,
    rng: &mut Rng,
    same_app_sigma: f64,
) -> Vec<TraceJob> {
    let mean_runtime = MEDIAN_RUNTIME_S * (RUNTIME_SIGMA * RUNTIME_SIGMA / 2.0).exp();
    let rate = load * gpus as f64 / mean_runtime;
    let within = same_app_sigma.clamp(0.0, 1.0);
    let between = (1.0 - within * within).sqrt();
    // The applications' medians from a stream of their own, so that the jobs' draws (and so
    // the trace at 1) are the same whatever `same_app_sigma` is.
    let mut apps = Rng::new(rng.clone().next_u64() ^ 0x0000_005e_ed0f_a995_u64);
    let medians: Vec<f64> = (0..table.apps.len())
        .map(|_| MEDIAN_RUNTIME_S * (RUNTIME_SIGMA * between * apps.normal()).exp())
        .collect();
    let mut t = 0.0;
    (0..jobs)
        .map(|k| {
            t += rng.exponential(rate);
            let app = rng.below(table.apps.len());
            TraceJob {
                id: (k + 1).to_string(),
                submit_s: t,
                app,
                solo_runtime_s: medians[app] * (RUNTIME_SIGMA * within * rng.normal()).exp(),
            }
        })
        .collect()
}

/// A small seeded generator (xoshiro256**, seeded through splitmix64): the same seed gives
/// the same trace on every machine and with every version of every crate.
#[derive(Debug, Clone)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.uniform() * n as f64) as usize).min(n.saturating_sub(1))
    }

    pub fn exponential(&mut self, rate: f64) -> f64 {
        -self.uniform().ln() / rate
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_table_reads() {
        let t = Table::parse(GAVEL_V100, "gavel").unwrap();
        assert_eq!((t.model.as_str(), t.apps.len()), ("v100", 26));
        let a3c = t.app_index("a3c").unwrap();
        let gan = t.app_index("cyclegan").unwrap();
        assert_eq!(t.speed(a3c, gan), Some(0.6358));
        assert_eq!(t.speed(gan, a3c), Some(0.7147));
        let infeasible = (0..26).flat_map(|a| (0..26).map(move |b| (a, b)));
        assert_eq!(infeasible.filter(|&(a, b)| t.speed(a, b).is_none()).count(), 40);
    }

    #[test]
    fn bad_tables_say_what_and_where() {
        let h = "gpu,job_a,job_b,speed_a,speed_b\n";
        let err = |text: &str| Table::parse(text, "t.csv").unwrap_err();
        assert!(err("a,b\n").contains("header"), "{}", err("a,b\n"));
        assert!(err(h).contains("no pairs"));
        assert!(err(&format!("{h}v100,a,b,0.5\n")).contains("line 2: expected 5 fields"));
        assert!(err(&format!("{h}v100,a,b,x,0.5\n")).contains("\"x\" is not a number"));
        assert!(err(&format!("{h}v100,a,b,0,0.5\n")).contains("0 for both"));
        assert!(err(&format!("{h}v100,a,b,0.5,0.5\na100,a,b,0.5,0.5\n")).contains("line 3: GPU model a100"));
        assert!(err(&format!("{h}v100,a,b,0.5,0.5\nv100,a,b,0.4,0.4\n")).contains("listed twice"));
        let e = err(&format!(
            "{h}v100,a,b,0.5,0.8\nv100,b,a,0,0\nv100,a,c,0,0\nv100,c,a,0.4,0.4\n"
        ));
        assert!(e.starts_with("t.csv: the pair a,b cannot share in one order"), "{e}");
        assert!(e.contains("(2 such pairs)"), "{e}");
        // Both orders, each with its own speeds, and both orders that cannot share: as listed.
        let t = Table::parse(
            &format!("{h}v100,a,b,0.5,0.8\nv100,b,a,0.7,0.6\nv100,a,c,0,0\nv100,c,a,0,0\n"),
            "t",
        )
        .unwrap();
        assert_eq!(
            (t.speed(0, 1), t.speed(1, 0), t.speed(0, 2), t.speed(2, 0)),
            (Some(0.5), Some(0.7), None, None)
        );
        // One order serves both; an absent pair cannot share.
        let t = Table::parse(&format!("{h}v100,a,b,0.5,0.8\nv100,c,c,0.6,0.6\n"), "t").unwrap();
        let (a, b, c) = (0, 1, 2);
        assert_eq!((t.speed(a, b), t.speed(b, a)), (Some(0.5), Some(0.8)));
        assert_eq!((t.speed(a, c), t.speed(a, a), t.speed(c, c)), (None, None, Some(0.6)));
    }

    #[test]
    fn memory_decides_which_pairs_fit() {
        let h = "gpu,job_a,job_b,speed_a,speed_b\n";
        let t = || {
            Table::parse(
                &format!("{h}v100,a,b,0.5,0.8\nv100,a,a,0.6,0.6\nv100,b,b,0.7,0.7\n"),
                "t",
            )
            .unwrap()
        };
        assert_eq!((t().memory_of(0), t().gpu_memory()), (None, None));
        let m = t().with_memory("app,mem_mb\na,6000\nb,11000\n", "m", 16000).unwrap();
        let (a, b) = (0, 1);
        assert_eq!(
            (m.memory_of(a), m.memory_of(b), m.gpu_memory()),
            (Some(6000), Some(11000), Some(16000))
        );
        // 6,000 + 6,000 and 6,000 + 11,000 MiB: the pair fits or not whatever its speeds say.
        assert_eq!(
            (m.speed(a, a), m.speed(a, b), m.speed(b, a), m.speed(b, b)),
            (Some(0.6), None, None, None)
        );
        let err = |text: &str| t().with_memory(text, "m.csv", 16000).unwrap_err();
        assert!(err("a,b\n").contains("header app,mem_mb"), "{}", err("a,b\n"));
        assert!(err("app,mem_mb\na,1,2\n").contains("m.csv line 2: expected 2 fields"));
        assert!(err("app,mem_mb\nc,1\n").contains("\"c\" is not an application"));
        assert!(err("app,mem_mb\na,lots\n").contains("not a whole number"));
        assert!(err("app,mem_mb\na,17000\n").contains("more than the GPU's 16000 MiB"));
        assert!(err("app,mem_mb\na,1\na,2\n").contains("listed twice"));
        assert!(err("app,mem_mb\na,1\n").contains("no memory for b"));
    }

    #[test]
    fn traces_are_checked_line_by_line() {
        let t = Table::parse(GAVEL_V100, "gavel").unwrap();
        let h = "job_id,submit_s,app,solo_runtime_s\n";
        let err = |text: &str| parse_trace(text, "trace.csv", &t).unwrap_err();
        let e = err(&format!("{h}1,0,a3c,100\n2,5,bert,100\n3,6,gpt,100\n"));
        assert!(
            e.starts_with("trace.csv line 3: app \"bert\" is not in the pair table"),
            "{e}"
        );
        assert!(err("id,t\n").contains("header"));
        assert!(err(h).contains("no jobs"));
        assert!(err(&format!("{h}1,0,a3c\n")).contains("line 2: expected 4 fields"));
        assert!(err(&format!("{h}1,soon,a3c,100\n")).contains("submit_s \"soon\" is not a number"));
        assert!(err(&format!("{h}1,-1,a3c,100\n")).contains("negative"));
        assert!(err(&format!("{h}1,0,a3c,0\n")).contains("must be positive"));
        assert!(err(&format!("{h}1,0,a3c,NaN\n")).contains("not a number"));
        let jobs = parse_trace(&format!("{h}b,10,a3c,100\na,5,cyclegan,50\n"), "x", &t).unwrap();
        assert_eq!(jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    }

    #[test]
    fn generated_traces_follow_the_seed_and_the_load() {
        let t = Table::parse(GAVEL_V100, "gavel").unwrap();
        let a = generate(5000, 0.5, 16, &t, &mut Rng::new(7), 1.0);
        assert_eq!(a, generate(5000, 0.5, 16, &t, &mut Rng::new(7), 1.0));
        assert_ne!(a, generate(5000, 0.5, 16, &t, &mut Rng::new(8), 1.0));
        // Offered work over the arrival span is about load x GPUs (within sampling noise).
        let work: f64 = a.iter().map(|j| j.solo_runtime_s).sum();
        let offered = work / a.last().unwrap().submit_s / 16.0;
        assert!((0.4..0.6).contains(&offered), "{offered}");
        let mut runtimes: Vec<f64> = a.iter().map(|j| j.solo_runtime_s).collect();
        runtimes.sort_by(f64::total_cmp);
        let median = runtimes[runtimes.len() / 2];
        assert!((3000.0..4300.0).contains(&median), "{median}");
    }

    #[test]
    fn runs_of_one_application_differ_by_what_is_asked_and_the_rest_lies_between_applications() {
        let t = Table::parse(GAVEL_V100, "gavel").unwrap();
        // The spread of the runtimes' logarithm within each application, and over all jobs.
        let spreads = |jobs: &[TraceJob]| {
            let sd = |x: &[f64]| {
                let m = x.iter().sum::<f64>() / x.len() as f64;
                (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64).sqrt()
            };
            let logs = |app: Option<usize>| -> Vec<f64> {
                jobs.iter()
                    .filter(|j| app.is_none_or(|a| j.app == a))
                    .map(|j| j.solo_runtime_s.ln())
                    .collect()
            };
            let within: f64 = (0..t.apps.len()).map(|a| sd(&logs(Some(a)))).sum::<f64>() / t.apps.len() as f64;
            (within, sd(&logs(None)))
        };
        let one = generate(20_000, 1.0, 16, &t, &mut Rng::new(3), 1.0);
        let (within, all) = spreads(&one);
        assert!(
            (0.9..1.1).contains(&within) && (0.9..1.1).contains(&all),
            "{within} {all}"
        );
        let tight = generate(20_000, 1.0, 16, &t, &mut Rng::new(3), 0.2);
        let (within, all) = spreads(&tight);
        // Between 26 applications' medians the spread is a sample of 26: loosely about 1.
        assert!(
            (0.18..0.22).contains(&within) && (0.6..1.4).contains(&all),
            "{within} {all}"
        );
        // The same arrivals and applications: only the lengths moved.
        assert!(one
            .iter()
            .zip(&tight)
            .all(|(a, b)| a.submit_s == b.submit_s && a.app == b.app));
    }
}
