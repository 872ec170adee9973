//! Every key of `multiplexd.toml`, defined once: its type, default, range, whether a reload
//! applies it, and what it does. A numeric key is a [`Bounded`], a text, path or switch with a
//! default a [`Plain`]: the parser takes its default (and a number's range error) from it
//! ([`Bounded::read`], [`Plain::text`]), and the key table shows both from it. A key whose
//! default is not a value (the host name, unset) says it in words.
//! `etc/multiplexd.toml` and the key table of `docs/admin.md` are rendered from [`KEYS`]
//! ([`example_toml`], [`markdown_table`]), and the tests fail when the parser, the file or the
//! guide differ from it, or a numeric key allows other values than its range (`BLESS=1 cargo
//! test -p multiplexd keys` rewrites the file and the table).

pub use super::values::{Bounded, Num, Plain, Shown};

/// Whether a changed key applies on `systemctl reload` (SIGHUP) or needs a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    AtOnce,
    Restart,
}

/// One key.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// `table.key` (`key` at the top).
    pub name: &'static str,
    pub kind: &'static str,
    /// The default in words where it is not a value (the host name, unset); a key with a
    /// value for its default has its definition in `value`.
    pub default_text: &'static str,
    pub range: &'static str,
    pub reload: Reload,
    pub doc: &'static str,
    /// The value `etc/multiplexd.toml` sets (a site's example); `None`: shown commented out at
    /// its default.
    pub example: Option<&'static str>,
    /// Another valid value, and one the parser must refuse (for the tests).
    pub other: Option<&'static str>,
    pub bad: Option<&'static str>,
    /// A numeric or plain key's default and range, from its one definition.
    pub value: Option<&'static dyn Shown>,
}

pub const DATABASE: Plain<&str> = Plain {
    name: "database",
    default: "/var/lib/multiplexd/history.sqlite",
    range: "a path",
};
pub const SLURM_USER: Plain<&str> = Plain {
    name: "slurm_user",
    default: "slurm",
    range: "a user name",
};
/// Empty: Slurm's commands are found on PATH.
pub const SLURM_BIN: Plain<&str> = Plain {
    name: "slurm_bin",
    default: "",
    range: "a directory",
};
pub const MPS: Plain<bool> = Plain {
    name: "mps",
    default: false,
    range: "",
};
pub const PUT_BACK: Plain<bool> = Plain {
    name: "policy.put_back",
    default: true,
    range: "",
};
pub const CLAIM_ENABLED: Plain<bool> = Plain {
    name: "claim.enabled",
    default: false,
    range: "",
};
/// job_submit's default shared partition.
pub const CLAIM_PARTITION: Plain<&str> = Plain {
    name: "claim.partition",
    default: multiplex_protocol::spec::DEFAULT_PARTITION,
    range: "one partition",
};

pub const JOBS_PER_GPU: Bounded<u32> = Bounded::new("jobs_per_gpu", 2, 1, Some(16));
pub const TELEMETRY_INTERVAL_S: Bounded<u64> = Bounded::new("telemetry_interval_s", 10, 0, None).meaning_at_min("none");
/// Every 5 minutes each running job's busy GPU time is recorded: a job that reports nothing is
/// measured within minutes of a new pair. Not under MPS.
pub const BUSY_RECORD_S: Bounded<u64> = Bounded::new("busy_record_s", 300, 0, None).meaning_at_min("never");
/// The prior speed of each side of a pair never seen.
pub const UNKNOWN_PAIR_SPEED: Bounded<f64> = Bounded::new("policy.unknown_pair_speed", 0.7, 0.0, Some(1.0)).above_min();
/// A job is not claimed for a share that adds less than a quarter of a GPU's throughput.
pub const MIN_GAIN: Bounded<f64> = Bounded::new("policy.min_gain", 0.25, 0.0, Some(1.0)).below_max();
/// A GPU is shared only while more jobs wait than a quarter of the claimer's GPUs times what the
/// share loses against a job alone: with fewer waiting, a GPU frees for each of them sooner than
/// sharing pays ([`crate::claim`]'s `queue_pays_for`).
pub const SHARE_QUEUE: Bounded<f64> =
    Bounded::new("policy.share_queue", 0.25, 0.0, Some(4.0)).meaning_at_min("any queue");
/// A GPU whose jobs deliver together less than 0.9 of what they would without the newest
/// gives that job back (the margin below 1 pays for the work it loses and its wait).
pub const SEPARATE_BELOW: Bounded<f64> =
    Bounded::new("policy.separate_below", 0.9, 0.0, Some(2.0)).meaning_at_min("never");
/// The bounds of the claimer's looks ([`LOOK_MS`]).
pub const SEPARATE_LOOK_MS: Bounded<u64> = Bounded::new("policy.separate_look_ms", 5000, 100, Some(60_000));
pub const RECONCILE_INTERVAL_S: Bounded<u64> =
    Bounded::new("reconcile.interval_s", 60, 0, None).meaning_at_min("never");
/// At most a day: `inf` would keep the slots of jobs that ended while the daemon was down.
pub const RECONCILE_GRACE_S: Bounded<f64> = Bounded::new("reconcile.grace_s", 30.0, 1.0, Some(86_400.0));
pub const SHARE_EVERY_S: Bounded<u64> = Bounded::new("share.every_s", 600, 1, None);
pub const LOOKAHEAD: Bounded<usize> = Bounded::new("claim.lookahead", 8, 1, Some(64));
/// Looks below 100 ms would load slurmctld (the claimer reads the queue each time); above a
/// minute a free GPU would idle that long.
pub const LOOK_MS: Bounded<u64> = Bounded::new("claim.look_ms", 1000, 100, Some(60_000));
/// A read of the job table costs slurmctld in proportion to the whole table: at 1% the
/// claimer's reads stay within a hundredth of its time however long the queue grows (100%:
/// a read every look).
pub const SLURMCTLD_PERCENT: Bounded<f64> = Bounded::new("claim.slurmctld_percent", 1.0, 0.0, Some(100.0)).above_min();
/// A lease shorter than a minute would lapse over one slow slurmctld answer; longer than an
/// hour, a cluster whose claimer died would hold its waiting jobs that long.
pub const LEASE_S: Bounded<u64> = Bounded::new("claim.lease_s", 300, 60, Some(3600));

const fn key(name: &'static str, kind: &'static str, range: &'static str, doc: &'static str) -> Key {
    Key {
        name,
        kind,
        default_text: "",
        range,
        reload: Reload::Restart,
        doc,
        example: None,
        other: None,
        bad: None,
        value: None,
    }
}

/// A numeric key of the table, from its definition.
const fn bounded<T: Num>(b: &'static Bounded<T>, doc: &'static str) -> Key {
    Key {
        value: Some(b),
        ..key(b.name, T::KIND, "", doc)
    }
}

/// A text or path key of the table (`kind`), from its definition.
const fn text(p: &'static Plain<&'static str>, kind: &'static str, doc: &'static str) -> Key {
    Key {
        value: Some(p),
        ..key(p.name, kind, "", doc)
    }
}

/// A switch of the table, from its definition.
const fn switch(p: &'static Plain<bool>, doc: &'static str) -> Key {
    Key {
        value: Some(p),
        ..key(p.name, "bool", "", doc)
    }
}

impl Key {
    const fn unset(self, text: &'static str) -> Key {
        Key {
            default_text: text,
            ..self
        }
    }
    const fn at_once(self) -> Key {
        Key {
            reload: Reload::AtOnce,
            ..self
        }
    }
    const fn example(self, v: &'static str) -> Key {
        Key {
            example: Some(v),
            ..self
        }
    }
    const fn test(self, other: &'static str, bad: Option<&'static str>) -> Key {
        Key {
            other: Some(other),
            bad,
            ..self
        }
    }
    /// The table (`""` at the top) and the key's own name.
    pub fn split(&self) -> (&'static str, &'static str) {
        self.name.split_once('.').unwrap_or(("", self.name))
    }
    /// The default as a file writes it; `None` where it is not a value.
    pub fn default_value(&self) -> Option<String> {
        self.value.map(|v| v.default_text())
    }
    /// The default as the guide shows it.
    pub fn default_shown(&self) -> String {
        match self.default_value() {
            Some(v) => format!("`{v}`"),
            None => self.default_text.to_string(),
        }
    }
    /// The values the key allows, in words.
    pub fn range_shown(&self) -> String {
        match self.value {
            Some(b) => b.range(),
            None => self.range.to_string(),
        }
    }
}

/// The tables, in the file's order, with what each is for.
pub const TABLES: &[(&str, &str)] = &[
    ("", "The node, its socket and history, and how it watches its GPUs."),
    (
        "gpu",
        "The node's shared GPUs, one [[gpu]] each; none listed: found through NVML. Slurm knows each by the gres Type MODEL_INDEX.",
    ),
    ("policy", "Which pairs share a GPU."),
    ("reconcile", "Freeing the slots of jobs whose end was never heard of."),
    ("share", "Pooling what the nodes learn through a shared directory."),
    ("claim", "The cluster's claimer: of the daemons with it enabled, the one holding the claimers' lease claims, the others stand by (slurm.conf's multiplex-claimer license)."),
    ("metrics", "The Prometheus endpoint."),
];

/// Every key, in the file's order.
pub const KEYS: &[Key] = &[
    key("node", "string", "a Slurm node name", "The Slurm node this daemon serves.")
        .unset("the host name")
        .example("\"gpu01\"")
        .test("\"gpu02\"", Some("\"\"")),
    key(
        "socket",
        "path",
        "a path",
        "The Unix socket the SPANK plugin connects to; plugstack.conf's socket= must name it.",
    )
    .unset("`/run/multiplexd/NODE.sock`")
    .example("\"/run/multiplexd/gpu01.sock\"")
    .test("\"/run/x.sock\"", None),
    text(
        &DATABASE,
        "path",
        "The SQLite interference history; never replaced when it cannot be opened.",
    )
    .test("\"/tmp/other.sqlite\"", None),
    bounded(
        &JOBS_PER_GPU,
        "Jobs that may share one GPU: gres.conf's shards per GPU.",
    )
    .test("3", Some("0")),
    bounded(
        &TELEMETRY_INTERVAL_S,
        "Seconds between GPU telemetry rounds through NVML, where a driver exists; 0: no telemetry, the daemon learns from start and end times and reports only.",
    )
    .test("5", None),
    bounded(
        &BUSY_RECORD_S,
        "Seconds between records of each job's busy GPU time, which measure its speed beside its partners without reports (time-sliced GPUs only).",
    )
    .test("60", None),
    text(
        &SLURM_USER,
        "string",
        "Besides root, the user that may start and finish tasks (SlurmUser).",
    )
    .test("\"other\"", None),
    text(
        &SLURM_BIN,
        "path",
        "The directory of scontrol, squeue and sinfo; empty: found on PATH.",
    )
    .test("\"/opt/slurm/bin\"", None),
    switch(
        &MPS,
        "Whether the site runs the CUDA MPS control daemon: each step then gets MPS limits from the predicted slowdowns.",
    )
    .test("true", None),
    key("gpu.index", "integer", "0 or more, once each", "The GPU's number as nvidia-smi counts it (/dev/nvidiaN).")
        .unset("required in each [[gpu]]"),
    key(
        "gpu.model",
        "string",
        "1 to 64 letters, digits, `.` `_` `-`",
        "The GPU model's name; with the index it names the gres Type (`v100_0`). One name per model on every node.",
    )
    .unset("required in each [[gpu]]"),
    key("gpu.memory_mb", "integer", "more than 0", "The GPU's memory, against which memory hints are checked.")
        .unset("required in each [[gpu]]"),
    key("gpu.uuid", "string", "`GPU-...` or `MIG-...`", "NVML's UUID (nvidia-smi -L), by which telemetry matches the GPU.")
        .unset("unset"),
    bounded(
        &UNKNOWN_PAIR_SPEED,
        "Assumed speed of each side of a pair never seen, until the model's learned pairs take over.",
    )
    .test("0.6", Some("0")),
    bounded(
        &MIN_GAIN,
        "The least throughput (jobs' worth) a share must add for the claimer to make it; a pair never tried is tried for any gain.",
    )
    .at_once()
    .test("0.1", Some("1")),
    bounded(
        &SHARE_QUEUE,
        "A share is made only while more jobs wait than this times the GPUs the claimer places on times what the share loses against one job alone (1 - its gain): with fewer waiting, a GPU frees for them sooner than sharing pays.",
    )
    .at_once()
    .test("0.5", Some("5")),
    bounded(
        &SEPARATE_BELOW,
        "A GPU delivering less than this times what it would without its newest job gives that job back to Slurm, once measured.",
    )
    .at_once()
    .test("0.8", Some("3")),
    bounded(
        &SEPARATE_LOOK_MS,
        "Milliseconds between looks for jobs to give back.",
    )
    .test("1000", Some("10")),
    switch(
        &PUT_BACK,
        "Whether a job that reports running out of GPU memory beside a partner is put back in Slurm's queue (requeued, its AdminComment saying why) instead of failing.",
    )
    .test("false", None),
    bounded(
        &RECONCILE_INTERVAL_S,
        "Seconds between asking slurmd which jobs run here (no slurmctld RPC), to free the slots of jobs whose end was never reported.",
    )
    .test("30", None),
    bounded(
        &RECONCILE_GRACE_S,
        "Jobs that started less than this many seconds ago are left alone.",
    )
    .test("10.0", Some("0.5")),
    key(
        "share.dir",
        "path",
        "an absolute path",
        "A directory every node reads and writes, where each writes what it learned as NODE.json and merges the others'.",
    )
    .unset("unset: the node learns alone")
    .test("\"/shared/slurm/multiplexd\"", Some("\"relative\"")),
    bounded(
        &SHARE_EVERY_S,
        "Seconds between two exchanges through the directory.",
    )
    .test("60", Some("0")),
    switch(
        &CLAIM_ENABLED,
        "Whether this daemon may be the cluster's claimer: it claims while it holds the claimers' lease and stands by otherwise (needs root or SlurmUser, Slurm's commands and [share] dir).",
    )
    .test("true", None),
    text(
        &CLAIM_PARTITION,
        "string",
        "The partition where multiplexed jobs wait (job_submit's first shared partition).",
    )
    .test("\"gpu-shared\"", Some("\"a,b\"")),
    bounded(
        &LOOKAHEAD,
        "How many of the first waiting jobs in Slurm's order one look weighs; none is passed over more than 4 times.",
    )
    .test("4", Some("0")),
    bounded(
        &LOOK_MS,
        "Milliseconds between looks; each reads the partition's queue once.",
    )
    .test("500", Some("50")),
    bounded(
        &SLURMCTLD_PERCENT,
        "At most this share of slurmctld's time (sdiag) goes to the claimer's reads of the queue: a look reads it only once the reads' mean cost over this share has passed since the last (at least once a minute).",
    )
    .test("2.5", Some("0")),
    bounded(
        &LEASE_S,
        "How far ahead the gate is held: with the claimer gone, waiting jobs start where Slurm puts them within this long.",
    )
    .test("120", Some("30")),
    key(
        "metrics.listen",
        "address",
        "an address and port",
        "Serve Prometheus metrics at http://LISTEN/metrics; bind to loopback or a management network.",
    )
    .unset("unset: no endpoint")
    .test("\"127.0.0.1:9822\"", Some("\"nowhere\"")),
];

/// The key table of `docs/admin.md`.
pub fn markdown_table() -> String {
    let mut s = String::from("| key | type | default | range | reload | what it does |\n|---|---|---|---|---|---|\n");
    for k in KEYS {
        let (table, leaf) = k.split();
        let name = if table.is_empty() {
            format!("`{leaf}`")
        } else if table == "gpu" {
            format!("`[[gpu]] {leaf}`")
        } else {
            format!("`[{table}] {leaf}`")
        };
        s.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} |\n",
            k.kind,
            k.default_shown(),
            if k.range_shown().is_empty() {
                "-".to_string()
            } else {
                k.range_shown()
            },
            match k.reload {
                Reload::AtOnce => "at once",
                Reload::Restart => "restart",
            },
            k.doc
        ));
    }
    s
}

/// `text` as TOML comment lines of at most 96 characters.
fn comment(text: &str) -> String {
    let mut out = String::new();
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > 96 && line.len() > 1 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// `etc/multiplexd.toml`: every key with its line of doc, set where a site sets it (an example
/// node, gpu01 of etc/slurm.conf.example with four V100s), else commented out at its default.
pub fn example_toml() -> String {
    let mut s = String::from(
        "# multiplexd configuration, one file per GPU node (default path /etc/slurm/multiplexd.toml, or\n\
         # `multiplexd serve --config FILE`). Unknown keys are errors. Every key, its default, range and\n\
         # whether `systemctl reload` applies it: docs/admin.md, \"Configuration keys\". This file is\n\
         # rendered from daemon/src/config/keys.rs.\n",
    );
    for (table, about) in TABLES {
        s.push('\n');
        if *table == "gpu" {
            s.push_str(&comment(&format!(
                "{about} Here gpu01 of etc/slurm.conf.example (Gres=gpu:v100_0:1,...) and etc/gres.conf.example."
            )));
            for i in 0..4 {
                s.push_str(&format!("[[gpu]]\nindex = {i}\nmodel = \"v100\"\nmemory_mb = 16384\n"));
                if i == 0 {
                    s.push_str("# uuid = \"GPU-...\"\n");
                }
                if i < 3 {
                    s.push('\n');
                }
            }
            continue;
        }
        if !table.is_empty() {
            s.push_str(&format!("[{table}]\n"));
        }
        s.push_str(&comment(about));
        for k in KEYS.iter().filter(|k| k.split().0 == *table) {
            let leaf = k.split().1;
            let range = match k.kind {
                "integer" | "number" => format!(" Range: {}.", k.range_shown()),
                _ => String::new(),
            };
            s.push_str(&comment(&format!("{}{range}", k.doc)));
            match (k.example, k.default_value()) {
                (Some(v), _) => s.push_str(&format!("{leaf} = {v}\n")),
                (None, Some(d)) => s.push_str(&format!("# {leaf} = {d}\n")),
                (None, None) => match k.other {
                    Some(o) => s.push_str(&format!("# {leaf} = {o}    # {}\n", k.default_text)),
                    None => s.push_str(&format!("# {leaf}: {}\n", k.default_text)),
                },
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::collections::BTreeSet;

    /// `key = value` in its table, as a file would say it.
    fn snippet(k: &Key, value: &str) -> String {
        match k.split() {
            ("", leaf) => format!("{leaf} = {value}\n"),
            ("gpu", leaf) => {
                let mut g = vec![("index", "0"), ("model", "\"v100\""), ("memory_mb", "16384")];
                g.retain(|(l, _)| *l != leaf);
                let rest: String = g.iter().map(|(l, v)| format!("{l} = {v}\n")).collect();
                format!("[[gpu]]\n{rest}{leaf} = {value}\n")
            }
            (table, leaf) => format!("[{table}]\n{leaf} = {value}\n"),
        }
    }

    /// The keys serde's refusal of an unknown one lists for `table`.
    fn parser_keys(table: &str) -> BTreeSet<String> {
        let text = match table {
            "" => "no_such_key = 1\n".to_string(),
            "gpu" => "[[gpu]]\nno_such_key = 1\n".to_string(),
            t => format!("[{t}]\nno_such_key = 1\n"),
        };
        let err = Config::parse(&text).unwrap_err();
        // serde lists them after `expected` (one of ..., or `a` or `b`, or `a`).
        let list = err
            .split("no_such_key`, expected")
            .nth(1)
            .unwrap_or_else(|| panic!("{err}"));
        list.split('`').skip(1).step_by(2).map(str::to_string).collect()
    }

    #[test]
    fn the_parser_reads_exactly_the_defined_keys() {
        for (table, _) in TABLES {
            let mut want: BTreeSet<String> = KEYS
                .iter()
                .filter(|k| k.split().0 == *table)
                .map(|k| k.split().1.to_string())
                .collect();
            if table.is_empty() {
                want.extend(TABLES.iter().filter(|t| !t.0.is_empty()).map(|t| t.0.to_string()));
            }
            assert_eq!(parser_keys(table), want, "[{table}]: the parser and KEYS differ");
        }
    }

    #[test]
    fn each_defined_default_is_the_parsers() {
        let base = Config::parse("").unwrap();
        for k in KEYS.iter().filter(|k| k.split().0 != "gpu") {
            if let Some(d) = k.default_value() {
                let c = Config::parse(&snippet(k, &d)).unwrap_or_else(|e| panic!("{}: {e}", k.name));
                assert_eq!(c, base, "{} = {d} is not the parser's default", k.name);
            }
        }
    }

    #[test]
    fn each_key_reloads_as_defined_and_refuses_what_its_range_refuses() {
        for k in KEYS {
            let (table, leaf) = k.split();
            let base = if table == "gpu" {
                let fits = match leaf {
                    "uuid" => "\"GPU-1\"",
                    "model" => "\"a100\"",
                    _ => "1",
                };
                Config::parse(&snippet(k, fits)).unwrap()
            } else {
                Config::parse("").unwrap()
            };
            if let Some(other) = k.other {
                let changed = Config::parse(&snippet(k, other)).unwrap_or_else(|e| panic!("{}: {e}", k.name));
                let r = base.reload(&changed).unwrap();
                match k.reload {
                    Reload::AtOnce => assert!(
                        r.applied.iter().any(|a| a.starts_with(k.name)) && r.needs_restart.is_empty(),
                        "{} applies at once: {r:?}",
                        k.name
                    ),
                    Reload::Restart => assert!(
                        r.applied.is_empty() && r.needs_restart.iter().any(|n| *n == k.name || *n == table),
                        "{} takes a restart: {r:?}",
                        k.name
                    ),
                }
            }
            if let Some(bad) = k.bad {
                let e = Config::parse(&snippet(k, bad)).expect_err(k.name);
                assert!(e.contains(leaf), "{} = {bad}: the refusal names the key: {e}", k.name);
            }
        }
    }

    #[test]
    fn each_defined_key_allows_exactly_its_range() {
        let mut checked = 0;
        for k in KEYS {
            let Some(b) = k.value else { continue };
            for (value, allowed) in b.edges() {
                let parsed = Config::parse(&snippet(k, &value));
                match (parsed, allowed) {
                    (Ok(_), true) => {}
                    (Err(e), false) => {
                        let want = format!("{} = ", k.name);
                        assert!(e.contains(&want) && e.contains(&b.range()), "{}: {e}", k.name)
                    }
                    (r, _) => panic!("{} = {value} ({}): {r:?}", k.name, b.range()),
                }
                checked += 1;
            }
        }
        assert!(checked > 30, "{checked} values checked");
    }

    /// `path`'s text must be `want`; with BLESS=1 in the environment it is written instead.
    fn rendered(path: &str, text: &str, want: &str) {
        if text != want {
            if std::env::var_os("BLESS").is_some() {
                std::fs::write(path, want).unwrap();
                return;
            }
            panic!("{path} is not what daemon/src/config/keys.rs renders (BLESS=1 cargo test -p multiplexd keys rewrites it):\n{want}");
        }
    }

    #[test]
    fn the_example_config_is_rendered_from_the_keys() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/multiplexd.toml");
        let text = std::fs::read_to_string(path).unwrap();
        rendered(path, &text, &example_toml());
        Config::parse(&example_toml()).unwrap();
    }

    #[test]
    fn the_admin_guides_key_table_is_rendered_from_the_keys() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/admin.md");
        let text = std::fs::read_to_string(path).unwrap();
        let (begin, end) = (
            "<!-- keys: rendered from daemon/src/config/keys.rs -->\n",
            "<!-- /keys -->",
        );
        let a = text
            .find(begin)
            .expect("docs/admin.md has the key table's begin marker")
            + begin.len();
        let b = a + text[a..].find(end).expect("and its end marker");
        let want = format!("{}{}{}", &text[..a], markdown_table(), &text[b..]);
        rendered(path, &text, &want);
    }
}
