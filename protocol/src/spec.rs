//! `--multiplex[=SPEC]`: SPEC is empty or a comma-separated list of `key=value`.
//!
//! Keys: `app=NAME` (the application key the interference history is kept under) and
//! `mem=SIZE` (the user's estimate of the job's peak GPU memory: a number with an optional
//! K/M/G/T suffix, binary units, MiB when bare). job_submit's tag adds what it read from the
//! job: `model=` (the GPU model asked for), `pin=node` (a job srun made) and `nodes=` (its
//! `--nodelist`).

use std::fmt;

/// The SPANK option's name; Slurm passes it to job_submit as this variable in `spank_job_env`.
pub const SPANK_ENV_VAR: &str = "_SLURM_SPANK_OPTION_multiplex_multiplex";

/// Longest application key accepted.
pub const MAX_APP_LEN: usize = 64;

/// Longest `nodes=` host list accepted.
pub const MAX_NODES_LEN: usize = 1024;

/// A parsed `--multiplex` value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spec {
    /// `app=NAME`, if given.
    pub app: Option<String>,
    /// `mem=SIZE` in MiB, if given.
    pub mem_mb: Option<u64>,
    /// `model=NAME`: the GPU model asked for (job_submit writes it from `--gres=gpu:MODEL:N`).
    pub model: Option<String>,
    /// `pin=node`: claim the job for a node only and let Slurm pick its GPU there. job_submit
    /// writes it for a job srun makes itself: srun asks for that job's step with the job's
    /// allocated gres, and Slurm (22.05, 24.11) refuses a step that asks for a typed shard.
    pub node_only: bool,
    /// `nodes=LIST`: the nodes the job's user asked for (`--nodelist`, a Slurm host list),
    /// which job_submit records because a claim replaces the job's own node list: a job
    /// requeued after its claim is claimed again within them. In the tag a host list's commas
    /// are written `+` (the SPEC's items are comma-separated); here it reads as Slurm writes it.
    pub nodes: Option<String>,
}

/// Why a SPEC was refused; the message names the bad part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("'{0}' is not key=value (expected e.g. --multiplex=app=bert,mem=16G)")]
    NotKeyValue(String),
    #[error("unknown key '{0}' (known keys: app, mem, model, pin, nodes)")]
    UnknownKey(String),
    #[error("key '{0}' is given twice")]
    Duplicate(String),
    #[error("app name '{0}' is invalid: use 1 to {MAX_APP_LEN} letters, digits, '.', '_' or '-'")]
    BadApp(String),
    #[error("mem size '{0}' is invalid: use a positive number with an optional K, M, G or T suffix, e.g. 16G")]
    BadMem(String),
    #[error("GPU model '{0}' is invalid: use 1 to {MAX_APP_LEN} letters, digits, '.', '_' or '-'")]
    BadModel(String),
    #[error("pin '{0}' is invalid: the only value is pin=node")]
    BadPin(String),
    #[error(
        "node list '{0}' is invalid: use a Slurm host list of letters, digits, '.', '_', '-', '[', ']' and '+' for ','"
    )]
    BadNodes(String),
}

impl Spec {
    /// Parses a SPEC. An absent value (a bare flag, which Slurm passes as NULL or the text
    /// `(null)`) and an empty one mean "no keys".
    pub fn parse(value: Option<&str>) -> Result<Spec, SpecError> {
        let mut spec = Spec::default();
        let text = match value {
            None | Some("(null)") => return Ok(spec),
            Some(t) => t.trim(),
        };
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, val) = part
                .split_once('=')
                .ok_or_else(|| SpecError::NotKeyValue(part.to_string()))?;
            match key.trim() {
                "app" => {
                    if spec.app.is_some() {
                        return Err(SpecError::Duplicate("app".into()));
                    }
                    spec.app = Some(parse_app(val.trim())?);
                }
                "mem" => {
                    if spec.mem_mb.is_some() {
                        return Err(SpecError::Duplicate("mem".into()));
                    }
                    spec.mem_mb = Some(parse_mem_mb(val.trim())?);
                }
                "model" => {
                    if spec.model.is_some() {
                        return Err(SpecError::Duplicate("model".into()));
                    }
                    let model = val.trim();
                    spec.model = Some(parse_app(model).map_err(|_| SpecError::BadModel(model.to_string()))?);
                }
                "pin" => {
                    if spec.node_only {
                        return Err(SpecError::Duplicate("pin".into()));
                    }
                    if val.trim() != "node" {
                        return Err(SpecError::BadPin(val.trim().to_string()));
                    }
                    spec.node_only = true;
                }
                "nodes" => {
                    if spec.nodes.is_some() {
                        return Err(SpecError::Duplicate("nodes".into()));
                    }
                    let list = val.trim().replace('+', ",");
                    if !recordable_nodes(&list) {
                        return Err(SpecError::BadNodes(val.trim().to_string()));
                    }
                    spec.nodes = Some(list);
                }
                other => return Err(SpecError::UnknownKey(other.to_string())),
            }
        }
        Ok(spec)
    }
}

/// Whether a Slurm host list can be recorded in a tag (`nodes=`): 1 to [`MAX_NODES_LEN`]
/// letters, digits, `.`, `_`, `-`, `[`, `]` and `,`.
pub fn recordable_nodes(list: &str) -> bool {
    let fits = |c: char| c.is_ascii_alphanumeric() || "._-[],".contains(c);
    !list.is_empty() && list.len() <= MAX_NODES_LEN && list.chars().all(fits)
}

/// The license every multiplexed job holds one of until the claimer pins it to a GPU
/// (slurm.conf `Licenses=multiplex:N`): job_submit adds it, the claimer reserves them all while
/// it runs and takes a job's away when it claims the job.
pub const GATE_LICENSE: &str = "multiplex";

/// The partition of shared GPUs where a site names none: job_submit's default `partitions`
/// and the claimer's default `claim.partition`.
pub const DEFAULT_PARTITION: &str = "shared";

/// What job_submit writes at the start of a multiplexed job's admin comment, followed by the
/// job's SPEC (its application resolved): a field the job's user cannot set, so the one fact
/// slurmstepd trusts about whether and how a job is multiplexed.
pub const TAG_PREFIX: &str = "multiplex:";

impl Spec {
    /// The admin comment tag of a job submitted with this SPEC.
    pub fn tag(&self) -> String {
        format!("{TAG_PREFIX}{self}")
    }

    /// The SPEC a job was tagged with, read from its admin comment: `None` when the job has
    /// no tag (it was not submitted with `--multiplex`); an error for a tag that does not
    /// parse (job_submit writes none such: somebody edited it).
    pub fn from_tag(admin_comment: Option<&str>) -> Option<Result<Spec, SpecError>> {
        let rest = admin_comment?.trim_start().strip_prefix(TAG_PREFIX)?;
        Some(Spec::parse(Some(rest.split_whitespace().next().unwrap_or(""))))
    }
}

/// What separates the daemon's note (where the job runs, or why it waits) from the rest of a
/// job's admin comment.
pub const NOTE: &str = " | multiplex: ";

/// A multiplexed job's admin comment with `note` added: it replaces an earlier note of the
/// same kind (its first word: "requeued", "runs"), so the comment holds the tag and any
/// admin's text, then at most the latest decline and where the job runs. `scontrol show job`
/// and `sacct -o AdminComment` thus show why the job waited (also after the rerun that
/// truncated its output) and where it ran.
pub fn with_note(admin_comment: &str, note: &str) -> String {
    let note: String = note.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let kind = |n: &str| n.split([' ', ',']).next().unwrap_or("").to_string();
    let mut parts = admin_comment.split(NOTE);
    let base = parts.next().unwrap_or("").trim_end();
    let mut out = base.to_string();
    for old in parts.filter(|old| kind(old) != kind(&note)) {
        out.push_str(NOTE);
        out.push_str(old.trim_end());
    }
    out.push_str(NOTE);
    out.push_str(&note);
    out
}

/// The first words of the note a node's daemon adds to a job it put back in the queue after
/// the job ran out of GPU memory beside a partner ([`put_back_note`]).
pub const PUT_BACK: &str = "put back:";

/// The note of a job put back after running out of GPU memory beside `beside` (its partners'
/// applications) on GPU `gpu` of `node`: what the claimer reads to claim it again only
/// alone or beside a partner known to fit, and what the job's next run prints.
pub fn put_back_note(beside: &str, node: &str, gpu: &str) -> String {
    format!(
        "{PUT_BACK} ran out of GPU memory beside {beside} on {node} GPU {gpu}; runs again alone \
         or beside a partner known to fit"
    )
}

/// Where a job's admin comment has a put-back note ([`put_back_note`]), the applications it
/// names as the partners the job ran out of memory beside.
pub fn put_back_beside(admin_comment: Option<&str>) -> Option<Vec<String>> {
    let note = put_back(admin_comment)?;
    let beside = note.split_once(" beside ").map_or("", |(_, rest)| rest);
    let apps = beside.split_once(" on ").map_or("", |(apps, _)| apps);
    Some(apps.split(", ").filter(|a| !a.is_empty()).map(str::to_string).collect())
}

/// Whether a job's admin comment says it was put back after its last claim: its put-back
/// note is the last one (a claim's note comes after it once the job is claimed again).
pub fn put_back_since_claim(admin_comment: Option<&str>) -> bool {
    admin_comment
        .filter(|c| c.contains(NOTE))
        .and_then(|c| c.rsplit(NOTE).next())
        .is_some_and(|last| last.trim().starts_with(PUT_BACK))
}

/// The put-back note of a job's admin comment, if it has one ([`put_back_note`]).
pub fn put_back(admin_comment: Option<&str>) -> Option<&str> {
    admin_comment?
        .split(NOTE)
        .skip(1)
        .map(str::trim)
        .find(|n| n.starts_with(PUT_BACK))
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(app) = &self.app {
            parts.push(format!("app={app}"));
        }
        if let Some(mem) = self.mem_mb {
            parts.push(format!("mem={mem}M"));
        }
        if let Some(model) = &self.model {
            parts.push(format!("model={model}"));
        }
        if self.node_only {
            parts.push("pin=node".to_string());
        }
        if let Some(nodes) = &self.nodes {
            parts.push(format!("nodes={}", nodes.replace(',', "+")));
        }
        f.write_str(&parts.join(","))
    }
}

/// The application key of a job that gave no `app=`: stable across resubmissions of the same
/// job by the same user, and the same in job_submit and on the node. Characters outside the
/// key alphabet become `_`.
pub fn default_app(uid: u32, job_name: Option<&str>) -> String {
    let name: String = job_name
        .unwrap_or("job")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = if name.is_empty() { "job".to_string() } else { name };
    let mut key = format!("u{uid}-{name}");
    key.truncate(MAX_APP_LEN);
    key
}

/// Checks an application key: 1..=64 of `[A-Za-z0-9._-]`.
pub fn parse_app(s: &str) -> Result<String, SpecError> {
    let ok = !s.is_empty()
        && s.len() <= MAX_APP_LEN
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(s.to_string())
    } else {
        Err(SpecError::BadApp(s.to_string()))
    }
}

/// Parses a memory size into MiB: `512` (MiB), `512M`, `16G`, `1T`, `1048576K`.
pub fn parse_mem_mb(s: &str) -> Result<u64, SpecError> {
    let bad = || SpecError::BadMem(s.to_string());
    let upper = s.to_ascii_uppercase();
    let trimmed = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (digits, mult_kib): (&str, u64) = match trimmed.chars().last() {
        Some('K') => (&trimmed[..trimmed.len() - 1], 1),
        Some('M') => (&trimmed[..trimmed.len() - 1], 1024),
        Some('G') => (&trimmed[..trimmed.len() - 1], 1024 * 1024),
        Some('T') => (&trimmed[..trimmed.len() - 1], 1024 * 1024 * 1024),
        _ => (trimmed, 1024),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let kib = n.checked_mul(mult_kib).ok_or_else(bad)?;
    let mb = kib.div_ceil(1024);
    if mb == 0 {
        return Err(bad());
    }
    Ok(mb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_put_back_note_is_found_among_the_others_and_a_later_claim_keeps_it() {
        let put = with_note("multiplex:app=a", &put_back_note("b, c", "n1", "0"));
        let claimed = with_note(&put, "claim node:n2 gpu:v100_1 beside: speed:1.000");
        for comment in [&put, &claimed] {
            let note = put_back(Some(comment)).unwrap();
            assert!(
                note.starts_with("put back: ran out of GPU memory beside b, c on n1 GPU 0;"),
                "{note}"
            );
        }
        assert!(
            claimed.ends_with("claim node:n2 gpu:v100_1 beside: speed:1.000"),
            "{claimed}"
        );
        assert_eq!(
            put_back_beside(Some(&claimed)),
            Some(vec!["b".to_string(), "c".to_string()])
        );
        assert!(put_back_since_claim(Some(&put)) && !put_back_since_claim(Some(&claimed)));
        assert!(!put_back_since_claim(Some("put back: x")) && !put_back_since_claim(None));
        assert_eq!(put_back(Some("multiplex:app=a | multiplex: claim node:n1")), None);
        assert_eq!(put_back_beside(Some("multiplex:app=a")), None);
        // The user's own text before the tag cannot forge it: only a note after the tag counts.
        assert_eq!(put_back(Some("put back: x")), None);
    }

    #[test]
    fn a_note_replaces_the_last_one_of_its_kind_and_keeps_the_tag_first() {
        let tag = "multiplex:app=a ticket 42";
        let once = with_note(tag, "requeued, waiting 60 s: no GPU on n1");
        assert_eq!(
            once,
            "multiplex:app=a ticket 42 | multiplex: requeued, waiting 60 s: no GPU on n1"
        );
        let twice = with_note(&once, "requeued, waiting 120 s:\nno GPU on n2");
        assert_eq!(
            twice,
            "multiplex:app=a ticket 42 | multiplex: requeued, waiting 120 s: no GPU on n2"
        );
        let ran = with_note(&twice, "runs on GPU 1 alone");
        assert_eq!(
            ran,
            "multiplex:app=a ticket 42 | multiplex: requeued, waiting 120 s: no GPU on n2 | multiplex: runs on GPU 1 alone"
        );
        let requeued_again = with_note(&ran, "requeued, waiting 5 s: x");
        assert_eq!(
            requeued_again,
            "multiplex:app=a ticket 42 | multiplex: runs on GPU 1 alone | multiplex: requeued, waiting 5 s: x"
        );
        assert_eq!(Spec::from_tag(Some(&ran)).unwrap().unwrap().app.as_deref(), Some("a"));
    }

    #[test]
    fn the_users_node_list_survives_the_tag_commas_and_all() {
        let spec = Spec {
            app: Some("bert".into()),
            nodes: Some("n[1,3-4],gpu7".into()),
            ..Spec::default()
        };
        assert_eq!(spec.tag(), "multiplex:app=bert,nodes=n[1+3-4]+gpu7");
        assert_eq!(Spec::from_tag(Some(&spec.tag())), Some(Ok(spec)));
        for bad in ["nodes=", "nodes=n1;rm", "nodes=n 1"] {
            assert!(
                matches!(
                    Spec::parse(Some(bad)),
                    Err(SpecError::BadNodes(_) | SpecError::NotKeyValue(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(
            Spec::parse(Some("nodes=a,nodes=b")),
            Err(SpecError::Duplicate("nodes".into()))
        );
    }

    #[test]
    fn a_job_srun_made_is_tagged_to_be_claimed_for_a_node_only() {
        let spec = Spec {
            app: Some("bert".into()),
            node_only: true,
            nodes: None,
            ..Spec::default()
        };
        assert_eq!(spec.tag(), "multiplex:app=bert,pin=node");
        assert_eq!(Spec::from_tag(Some(&spec.tag())), Some(Ok(spec)));
        assert_eq!(Spec::parse(Some("pin=gpu")), Err(SpecError::BadPin("gpu".into())));
    }

    #[test]
    fn a_tag_gives_back_the_spec_it_was_written_from() {
        let spec = Spec {
            app: Some("bert".into()),
            mem_mb: Some(16384),
            model: None,
            node_only: false,
            nodes: None,
        };
        assert_eq!(spec.tag(), "multiplex:app=bert,mem=16384M");
        assert_eq!(Spec::from_tag(Some(&spec.tag())), Some(Ok(spec.clone())));
        // An admin's own comment after the tag stays out of it.
        assert_eq!(
            Spec::from_tag(Some("multiplex:app=bert,mem=16384M  checked by ops")),
            Some(Ok(spec))
        );
        // No tag: not submitted with --multiplex, whatever the job's environment says.
        for comment in [None, Some(""), Some("ops: app=bert"), Some("xmultiplex:app=bert")] {
            assert_eq!(Spec::from_tag(comment), None, "{comment:?}");
        }
        assert!(matches!(
            Spec::from_tag(Some("multiplex:app=../x")),
            Some(Err(SpecError::BadApp(_)))
        ));
    }

    #[test]
    fn accepted_specs() {
        let cases: &[(Option<&str>, Spec)] = &[
            (None, Spec::default()),
            (Some("(null)"), Spec::default()),
            (Some(""), Spec::default()),
            (
                Some("app=bert"),
                Spec {
                    app: Some("bert".into()),
                    mem_mb: None,
                    model: None,
                    node_only: false,
                    nodes: None,
                },
            ),
            (
                Some("mem=16G"),
                Spec {
                    app: None,
                    mem_mb: Some(16384),
                    model: None,
                    node_only: false,
                    nodes: None,
                },
            ),
            (
                Some("app=resnet50-bs64, mem=512"),
                Spec {
                    app: Some("resnet50-bs64".into()),
                    mem_mb: Some(512),
                    model: None,
                    node_only: false,
                    nodes: None,
                },
            ),
            (
                Some("mem=1T,app=a.b_c"),
                Spec {
                    app: Some("a.b_c".into()),
                    mem_mb: Some(1024 * 1024),
                    model: None,
                    node_only: false,
                    nodes: None,
                },
            ),
            (
                Some("mem=1536K"),
                Spec {
                    app: None,
                    mem_mb: Some(2),
                    model: None,
                    node_only: false,
                    nodes: None,
                },
            ),
            (
                Some("mem=16GiB"),
                Spec {
                    app: None,
                    mem_mb: Some(16384),
                    model: None,
                    node_only: false,
                    nodes: None,
                },
            ),
        ];
        for (input, want) in cases {
            assert_eq!(&Spec::parse(*input).unwrap(), want, "input {input:?}");
        }
    }

    #[test]
    fn rejected_specs_name_the_bad_part() {
        let cases: &[(&str, &str)] = &[
            ("bert", "'bert' is not key=value"),
            ("app=bert,gpus=2", "unknown key 'gpus'"),
            ("app=a,app=b", "key 'app' is given twice"),
            ("app=", "app name '' is invalid"),
            ("app=has space", "app name 'has space' is invalid"),
            ("app=a/b", "app name 'a/b' is invalid"),
            ("mem=lots", "mem size 'lots' is invalid"),
            ("mem=0", "mem size '0' is invalid"),
            ("mem=-1G", "mem size '-1G' is invalid"),
            ("mem=99999999999999999T", "mem size '99999999999999999T' is invalid"),
        ];
        for (input, want) in cases {
            let err = Spec::parse(Some(input)).unwrap_err().to_string();
            assert!(err.contains(want), "input {input:?}: got {err:?}, want {want:?}");
        }
        let long = format!("app={}", "x".repeat(MAX_APP_LEN + 1));
        assert!(matches!(Spec::parse(Some(&long)), Err(SpecError::BadApp(_))));
    }

    #[test]
    fn default_app_is_a_valid_stable_key() {
        assert_eq!(default_app(1000, Some("train bert")), "u1000-train_bert");
        assert_eq!(default_app(0, None), "u0-job");
        assert_eq!(default_app(0, Some("")), "u0-job");
        let long = default_app(5, Some(&"é".repeat(100)));
        assert!(parse_app(&long).is_ok(), "{long}");
    }

    #[test]
    fn display_round_trips() {
        let s = Spec::parse(Some("app=bert,mem=16G")).unwrap();
        assert_eq!(Spec::parse(Some(&s.to_string())).unwrap(), s);
    }
}
