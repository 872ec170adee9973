//! The site's multiplexing policy: a TOML file read when slurmctld loads the plugin and again
//! whenever the file changes (see [`Watcher`]).

use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// Where the policy is read from unless `MULTIPLEX_JOB_SUBMIT_CONF` names another file.
pub const DEFAULT_PATH: &str = "/etc/slurm/job_submit_multiplex.toml";

/// The variable (in slurmctld's environment) that overrides [`DEFAULT_PATH`].
pub const PATH_ENV: &str = "MULTIPLEX_JOB_SUBMIT_CONF";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    partitions: Option<Vec<String>>,
    gres: Option<String>,
    gres_per_gpu: Option<u32>,
    max_gpus: Option<u32>,
    unflagged_on_shared: Option<bool>,
    users: Option<Vec<String>>,
    accounts: Option<Vec<String>>,
    shared_nodes: Option<String>,
    models: Option<Vec<String>>,
}

/// What the rewrite needs to know about the site.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// The partitions of shared GPUs. Multiplexed jobs go to the first, or stay in another of
    /// these when they asked for it.
    pub partitions: Vec<String>,
    /// The gres that stands for a slot of a shared GPU.
    pub gres: String,
    /// How many units of `gres` a multiplexed job takes for each GPU it asks for.
    pub gres_per_gpu: u32,
    /// Most GPUs a multiplexed job may ask for.
    pub max_gpus: u32,
    /// Whether jobs without --multiplex may run in the shared partitions.
    pub unflagged_on_shared: bool,
    /// Who may multiplex: `None` = everybody; otherwise users (by uid) and accounts.
    pub allowed: Option<Allowed>,
    /// The nodes whose GPUs multiplexed jobs share, where those nodes are also in partitions
    /// that are not shared: jobs without --multiplex that ask for GPUs are kept off them.
    pub shared_nodes: Option<Box<SharedNodes>>,
    /// The models of the shared GPUs, each GPU's gres type in Slurm being `MODEL_INDEX`
    /// (`v100_0`): a job that asks for another model is rejected (empty: any model).
    pub models: Vec<String>,
}

/// `shared_nodes` as written (a Slurm host list) and expanded.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedNodes {
    pub list: String,
    pub hosts: HashSet<String>,
}

/// The users and accounts allowed to multiplex (a job needs to match either).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Allowed {
    pub uids: HashSet<u32>,
    /// User names as written, for messages.
    pub user_names: Vec<String>,
    pub accounts: Vec<String>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            partitions: vec![multiplex_protocol::spec::DEFAULT_PARTITION.into()],
            gres: "shard".into(),
            gres_per_gpu: 1,
            max_gpus: 1,
            unflagged_on_shared: false,
            allowed: None,
            shared_nodes: None,
            models: Vec::new(),
        }
    }
}

/// What reading a policy looks up: user names (`None`: no such user) and Slurm host lists
/// (`None`: not a host list Slurm can read).
#[derive(Clone, Copy)]
pub struct Lookups<'a> {
    pub user: &'a dyn Fn(&str) -> Option<u32>,
    pub hosts: &'a dyn Fn(&str) -> Option<Vec<String>>,
}

/// The most hosts `shared_nodes` may name.
pub const MAX_SHARED_NODES: usize = 65_536;

/// The system's user database and slurmctld's own host-list parser.
pub const SYSTEM: Lookups<'static> = Lookups {
    user: &system_user,
    hosts: &system_hosts,
};

impl Policy {
    /// Parses policy text. Errors carry TOML's line and column; the warnings are for user
    /// names that do not resolve (they are left out, the rest of the policy stands).
    pub fn parse(text: &str, lookup: Lookups) -> Result<(Policy, Vec<String>), String> {
        let raw: RawPolicy = toml::from_str(text).map_err(|e| one_line(&e))?;
        let d = Policy::default();
        let partitions = raw.partitions.unwrap_or(d.partitions);
        if partitions.is_empty() {
            return Err("partitions = []: name at least one partition".into());
        }
        if let Some(p) = partitions.iter().find(|p| p.is_empty() || p.contains([',', ' '])) {
            return Err(format!(
                "partitions: {p:?} is not a partition name (one name per list entry)"
            ));
        }
        let gres = raw.gres.unwrap_or(d.gres);
        if gres.is_empty() || gres.contains([':', ',', '/']) || gres == "gpu" {
            return Err(format!(
                "gres = {gres:?}: must be the shared-GPU gres name, such as \"shard\""
            ));
        }
        let gres_per_gpu = raw.gres_per_gpu.unwrap_or(d.gres_per_gpu);
        if gres_per_gpu == 0 {
            return Err("gres_per_gpu = 0: must be at least 1".into());
        }
        let max_gpus = raw.max_gpus.unwrap_or(d.max_gpus);
        if max_gpus == 0 {
            return Err("max_gpus = 0: must be at least 1".into());
        }
        let mut warnings = Vec::new();
        let allowed = allowed(
            raw.users.unwrap_or_default(),
            raw.accounts.unwrap_or_default(),
            &lookup,
            &mut warnings,
        );
        let shared_nodes = shared_nodes(raw.shared_nodes, &lookup)?;
        let models = raw.models.unwrap_or_default();
        if let Some(m) = models.iter().find(|m| multiplex_protocol::spec::parse_app(m).is_err()) {
            return Err(format!(
                "models: {m:?} is not a GPU model name (letters, digits, '.', '_' or '-'; each GPU's gres type is MODEL_INDEX)"
            ));
        }
        let policy = Policy {
            partitions,
            gres,
            gres_per_gpu,
            max_gpus,
            unflagged_on_shared: raw.unflagged_on_shared.unwrap_or(d.unflagged_on_shared),
            allowed,
            shared_nodes,
            models,
        };
        Ok((policy, warnings))
    }

    /// The partition multiplexed jobs are moved to.
    pub fn target_partition(&self) -> &str {
        &self.partitions[0]
    }

    /// Whether `partition` (one name) is a shared partition.
    pub fn is_shared(&self, partition: &str) -> bool {
        self.partitions.iter().any(|p| p == partition)
    }

    /// A one-line summary for the log.
    pub fn summary(&self) -> String {
        let who = match &self.allowed {
            None => "everybody".to_string(),
            Some(a) => format!("users {:?} accounts {:?}", a.user_names, a.accounts),
        };
        format!(
            "partitions={} gres={} gres_per_gpu={} max_gpus={} unflagged_on_shared={} shared_nodes={} may multiplex: {who}",
            self.partitions.join(","),
            self.gres,
            self.gres_per_gpu,
            self.max_gpus,
            self.unflagged_on_shared,
            self.shared_nodes.as_ref().map_or("", |n| n.list.as_str())
        )
    }

    /// The policy file's path: `MULTIPLEX_JOB_SUBMIT_CONF` or [`DEFAULT_PATH`].
    pub fn path() -> PathBuf {
        std::env::var_os(PATH_ENV).map_or_else(|| PathBuf::from(DEFAULT_PATH), PathBuf::from)
    }

    /// Reads the policy at `path`. A missing file means the defaults (`Ok(None)` tells the
    /// caller to say so); an unreadable or invalid one is an error naming the file.
    pub fn load(path: &Path, lookup: Lookups) -> Result<Option<(Policy, Vec<String>)>, String> {
        match std::fs::read_to_string(path) {
            Ok(text) => Policy::parse(&text, lookup)
                .map(Some)
                .map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }
}

/// A TOML error on one log line: `line L, column C: what` (TOML's own text draws the line
/// with a caret over several lines).
fn one_line(e: &toml::de::Error) -> String {
    let what = e.message().split_whitespace().collect::<Vec<_>>().join(" ");
    match e.span() {
        Some(span) => {
            let rendered = e.to_string();
            // The rendered error starts "TOML parse error at line L, column C".
            let at = rendered
                .lines()
                .next()
                .and_then(|l| l.strip_prefix("TOML parse error at "))
                .map(str::to_string)
                .unwrap_or_else(|| format!("byte {}", span.start));
            format!("{at}: {what}")
        }
        None => what,
    }
}

/// The system's user database, for [`Policy::parse`].
pub fn system_user(name: &str) -> Option<u32> {
    multiplex_protocol::user::uid(name)
}

/// Slurm's host-list parser (in slurmctld), for [`Policy::parse`].
pub fn system_hosts(list: &str) -> Option<Vec<String>> {
    slurm_ffi::host::hostlist_expand(list, MAX_SHARED_NODES)
}

/// What a look at the policy file found.
#[derive(Debug, PartialEq)]
pub enum Change {
    /// Same file as last time (or not looked at: too soon).
    Unchanged,
    /// A new valid policy (`None` = the file is gone: the defaults), with its warnings.
    Loaded(Option<(Policy, Vec<String>)>),
    /// The file changed and is broken; reported once per change.
    Broken(String),
}

/// Notices changes of the policy file, looking at most once per `every` (a `stat`, so that
/// job_submit under slurmctld's locks never reads a file it has read before).
#[derive(Debug)]
pub struct Watcher {
    path: PathBuf,
    every: Duration,
    last_look: Option<Instant>,
    seen: Option<Stamp>,
}

/// What identifies one version of the file: modification time, size and inode (an editor
/// that renames a new file into place changes the inode within the same second).
#[derive(Debug, Clone, PartialEq)]
enum Stamp {
    Missing,
    File {
        mtime: Option<SystemTime>,
        len: u64,
        ino: u64,
    },
    Unreadable(String),
}

impl Watcher {
    pub fn new(path: PathBuf, every: Duration) -> Watcher {
        Watcher {
            path,
            every,
            last_look: None,
            seen: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Looks at the file if `every` has passed since the last look (or always when `force`),
    /// and reads it only when it changed.
    pub fn poll(&mut self, now: Instant, force: bool, lookup: Lookups) -> Change {
        if !force && self.last_look.is_some_and(|t| now.duration_since(t) < self.every) {
            return Change::Unchanged;
        }
        self.last_look = Some(now);
        let stamp = match std::fs::metadata(&self.path) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt;
                Stamp::File {
                    mtime: m.modified().ok(),
                    len: m.len(),
                    ino: m.ino(),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Stamp::Missing,
            Err(e) => Stamp::Unreadable(e.to_string()),
        };
        if !force && self.seen.as_ref() == Some(&stamp) {
            return Change::Unchanged;
        }
        self.seen = Some(stamp);
        match Policy::load(&self.path, lookup) {
            Ok(p) => Change::Loaded(p),
            Err(e) => Change::Broken(e),
        }
    }
}

/// Who may multiplex (`users`, `accounts`); `None`: everyone. A user name that does not
/// resolve is left out, with a warning.
fn allowed(users: Vec<String>, accounts: Vec<String>, lookup: &Lookups, warnings: &mut Vec<String>) -> Option<Allowed> {
    if users.is_empty() && accounts.is_empty() {
        return None;
    }
    let mut uids = HashSet::new();
    for u in &users {
        match u.parse::<u32>().ok().or_else(|| (lookup.user)(u)) {
            Some(uid) => {
                uids.insert(uid);
            }
            None => warnings.push(format!("users: no user named {u:?}; left out")),
        }
    }
    Some(Allowed {
        uids,
        user_names: users,
        accounts,
    })
}

/// `shared_nodes`, expanded; `None` for none or an empty list.
fn shared_nodes(list: Option<String>, lookup: &Lookups) -> Result<Option<Box<SharedNodes>>, String> {
    let list = match list.map(|l| l.trim().to_string()) {
        None => return Ok(None),
        Some(l) if l.is_empty() => return Ok(None),
        Some(list) => list,
    };
    let hosts = (lookup.hosts)(&list).filter(|h| !h.is_empty()).ok_or_else(|| {
        format!(
            "shared_nodes = {list:?}: not a Slurm host list (such as \"gpu[01-04]\") of at most {MAX_SHARED_NODES} nodes"
        )
    })?;
    Ok(Some(Box::new(SharedNodes {
        list,
        hosts: hosts.into_iter().collect(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key names of the admin guide's job_submit table (docs/admin.md).
    fn guide_keys() -> Vec<String> {
        let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/admin.md")).unwrap();
        let table = guide
            .split("### job_submit/multiplex")
            .nth(1)
            .expect("docs/admin.md has a job_submit/multiplex section")
            .split("\n\n| key |")
            .nth(1)
            .expect("with a key table")
            .split("\n\n")
            .next()
            .unwrap();
        table
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next().map(str::to_string))
            .collect()
    }

    #[test]
    fn the_admin_guide_lists_exactly_the_keys_the_parser_reads() {
        let err = Policy::parse("no_such_key = 1", TEST).unwrap_err();
        let list = err
            .split("no_such_key`, expected")
            .nth(1)
            .unwrap_or_else(|| panic!("{err}"));
        let mut parser: Vec<String> = list.split('`').skip(1).step_by(2).map(str::to_string).collect();
        let mut guide = guide_keys();
        parser.sort();
        guide.sort();
        assert_eq!(guide, parser, "docs/admin.md's job_submit table and the parser differ");
    }

    fn users(name: &str) -> Option<u32> {
        match name {
            "alice" => Some(1001),
            "bob" => Some(1002),
            _ => None,
        }
    }

    /// Enough of Slurm's host lists for the tests: `a,b` and one `[x-y]` range.
    fn hosts(list: &str) -> Option<Vec<String>> {
        let mut out = Vec::new();
        for part in list.split(',') {
            match part.split_once('[') {
                None if !part.is_empty() && !part.contains(']') => out.push(part.to_string()),
                None => return None,
                Some((stem, rest)) => {
                    let (a, b) = rest.strip_suffix(']')?.split_once('-')?;
                    let (lo, hi) = (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?);
                    out.extend((lo..=hi).map(|i| format!("{stem}{i:0w$}", w = a.len())));
                }
            }
        }
        Some(out)
    }

    const TEST: Lookups<'static> = Lookups {
        user: &users,
        hosts: &hosts,
    };

    fn parse(text: &str) -> Result<(Policy, Vec<String>), String> {
        Policy::parse(text, TEST)
    }

    #[test]
    fn example_file_parses_to_the_defaults() {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/job_submit_multiplex.toml")).unwrap();
        assert_eq!(parse(&text).unwrap(), (Policy::default(), vec![]));
    }

    #[test]
    fn a_full_policy() {
        let (p, warnings) = parse(
            r#"
            partitions = ["gpu-shared", "gpu-shared-long"]
            gres = "mps"
            gres_per_gpu = 50
            max_gpus = 2
            unflagged_on_shared = true
            users = ["alice", "2000", "nobody-here"]
            accounts = ["ml"]
            shared_nodes = "gpu[01-02],big"
            "#,
        )
        .unwrap();
        assert_eq!(p.target_partition(), "gpu-shared");
        assert!(p.is_shared("gpu-shared-long") && !p.is_shared("gpu"));
        assert_eq!((p.gres.as_str(), p.gres_per_gpu, p.max_gpus), ("mps", 50, 2));
        assert!(p.unflagged_on_shared);
        let a = p.allowed.unwrap();
        assert_eq!(a.uids, HashSet::from([1001, 2000]));
        assert_eq!(a.accounts, vec!["ml".to_string()]);
        let n = p.shared_nodes.unwrap();
        assert_eq!(n.list, "gpu[01-02],big");
        assert_eq!(n.hosts, HashSet::from(["gpu01", "gpu02", "big"].map(String::from)));
        assert_eq!(
            warnings,
            vec!["users: no user named \"nobody-here\"; left out".to_string()]
        );
    }

    #[test]
    fn bad_policies_are_named() {
        for (text, want) in [
            ("partition = \"x\"", "unknown field `partition`"),
            ("partitions = []", "at least one partition"),
            ("partitions = [\"a,b\"]", "\"a,b\" is not a partition name"),
            ("partitions = \"a\"", "invalid type"),
            ("gres = \"gpu:1\"", "shared-GPU gres name"),
            ("gres = \"gpu\"", "shared-GPU gres name"),
            ("gres_per_gpu = 0", "at least 1"),
            ("max_gpus = 0", "at least 1"),
            ("max_gpus = -1", "invalid value"),
            ("unflagged_on_shared = \"no\"", "invalid type"),
            ("shared_nodes = \"gpu[01-\"", "not a Slurm host list"),
            ("shared_nodes = [\"gpu01\"]", "invalid type"),
            ("\n\nmax_gpus = ", "line 3, column 12: "),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(!err.contains('\n'), "one log line: {err:?}");
        }
    }

    #[test]
    fn missing_file_means_defaults() {
        assert_eq!(Policy::load(Path::new("/nonexistent/policy.toml"), TEST), Ok(None));
    }

    #[test]
    fn root_resolves_on_this_system() {
        assert_eq!(system_user("root"), Some(0));
    }

    #[test]
    fn the_watcher_reads_only_changes_and_not_too_often() {
        let dir = std::env::temp_dir().join(format!("js-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("policy.toml");
        let _ = std::fs::remove_file(&path);
        let mut w = Watcher::new(path.clone(), Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(w.poll(t0, false, TEST), Change::Loaded(None), "no file: defaults");
        std::fs::write(&path, "max_gpus = 2\n").unwrap();
        assert_eq!(w.poll(t0, false, TEST), Change::Unchanged, "too soon to look");
        let t1 = t0 + Duration::from_secs(2);
        match w.poll(t1, false, TEST) {
            Change::Loaded(Some((p, _))) => assert_eq!(p.max_gpus, 2),
            other => panic!("{other:?}"),
        }
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(w.poll(t2, false, TEST), Change::Unchanged, "same file");
        std::fs::write(&path, "max_gpus = oops\n").unwrap();
        let t3 = t2 + Duration::from_secs(2);
        match w.poll(t3, false, TEST) {
            Change::Broken(e) => assert!(e.contains("policy.toml") && e.contains("line 1"), "{e}"),
            other => panic!("{other:?}"),
        }
        let t4 = t3 + Duration::from_secs(2);
        assert_eq!(
            w.poll(t4, false, TEST),
            Change::Unchanged,
            "a broken file is reported once"
        );
        assert!(
            matches!(w.poll(t4, true, TEST), Change::Broken(_)),
            "forced: read again"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
