//! The decision job_submit makes, on plain Rust values: leave a job alone, rewrite its GPU
//! request into a shared-GPU one, or reject it with a sentence for the user.

use crate::policy::Policy;
use multiplex_protocol::spec::{default_app, Spec, SPANK_ENV_VAR};

/// The fields of a job description the rewrite reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobView {
    /// `spank_job_env` entries (`NAME=VALUE`).
    pub spank_env: Vec<String>,
    pub user_id: u32,
    pub name: Option<String>,
    pub partition: Option<String>,
    pub admin_comment: Option<String>,
    pub tres_per_node: Option<String>,
    pub tres_per_job: Option<String>,
    pub tres_per_task: Option<String>,
    pub tres_per_socket: Option<String>,
    pub cpus_per_tres: Option<String>,
    pub mem_per_tres: Option<String>,
    /// `--exclusive` (job_desc `shared == 0`).
    pub exclusive: bool,
    /// Requested node counts; `None` when unset.
    pub min_nodes: Option<u32>,
    pub max_nodes: Option<u32>,
    /// Requested task count; `None` when unset.
    pub num_tasks: Option<u32>,
}

/// The new values of the fields a rewrite changes (`None` = cleared).
#[derive(Debug, Clone, PartialEq)]
pub struct Rewrite {
    pub partition: String,
    pub admin_comment: String,
    pub tres_per_node: Option<String>,
    pub tres_per_job: Option<String>,
    pub tres_per_task: Option<String>,
    pub tres_per_socket: Option<String>,
    pub cpus_per_tres: Option<String>,
    pub mem_per_tres: Option<String>,
    /// The application key the job was tagged with.
    pub app: String,
}

/// Why a job cannot share; maps to one `ESLURM_*` code each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    BadOption,
    NoGpu,
    TooManyGpus,
    TooManyNodes,
    Exclusive,
    MixedGres,
}

/// The outcome for one job.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Not a multiplexed job: nothing changes.
    Untouched,
    Rewrite(Rewrite),
    Reject {
        kind: RejectKind,
        message: String,
    },
}

/// One entry of a TRES string such as `gres:gpu:tesla:2` or `gres/gpu:2`.
#[derive(Debug, Clone, PartialEq)]
struct TresEntry {
    /// `:` (22.05) or `/` (23.11+) after `gres`; `None` for entries that are not gres.
    sep: Option<char>,
    name: String,
    /// The entry as written, for entries kept unchanged.
    text: String,
    count: u64,
}

fn parse_tres(s: &str) -> Vec<TresEntry> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (sep, rest) = if let Some(r) = e.strip_prefix("gres:") {
                (Some(':'), r)
            } else if let Some(r) = e.strip_prefix("gres/") {
                (Some('/'), r)
            } else {
                (None, e)
            };
            let mut parts = rest.split(':');
            let name = parts.next().unwrap_or("").to_string();
            let last = rest.rsplit(':').next().unwrap_or("");
            let count = if rest.contains(':') {
                last.parse().unwrap_or(1)
            } else {
                1
            };
            TresEntry {
                sep,
                name,
                text: e.to_string(),
                count,
            }
        })
        .collect()
}

fn join(entries: impl Iterator<Item = String>) -> Option<String> {
    let v: Vec<String> = entries.collect();
    if v.is_empty() {
        None
    } else {
        Some(v.join(","))
    }
}

fn is_gpu(e: &TresEntry) -> bool {
    e.sep.is_some() && e.name == "gpu"
}

/// Decides what happens to `job` under `policy`.
pub fn decide(job: &JobView, policy: &Policy) -> Outcome {
    let prefix = format!("{SPANK_ENV_VAR}=");
    let Some(value) = job.spank_env.iter().find_map(|e| e.strip_prefix(&prefix)) else {
        return Outcome::Untouched;
    };
    let reject = |kind, message: String| Outcome::Reject {
        kind,
        message: format!("multiplex: {message}"),
    };
    let spec = match Spec::parse(Some(value)) {
        Ok(s) => s,
        Err(e) => return reject(RejectKind::BadOption, format!("invalid --multiplex value: {e}")),
    };
    if job.exclusive {
        return reject(
            RejectKind::Exclusive,
            "--exclusive cannot be combined with --multiplex: a multiplexed job shares its GPU by design".into(),
        );
    }
    let nodes = job
        .max_nodes
        .or(job.min_nodes)
        .unwrap_or(1)
        .max(job.min_nodes.unwrap_or(1));
    if nodes > 1 {
        return reject(
            RejectKind::TooManyNodes,
            format!("a multiplexed job runs on one node, this one asks for {nodes}: drop --multiplex or ask for -N 1"),
        );
    }

    let fields = [
        &job.tres_per_node,
        &job.tres_per_job,
        &job.tres_per_task,
        &job.tres_per_socket,
    ];
    let parsed: Vec<Vec<TresEntry>> = fields
        .iter()
        .map(|f| f.as_deref().map(parse_tres).unwrap_or_default())
        .collect();
    let any_shared = parsed
        .iter()
        .flatten()
        .any(|e| e.sep.is_some() && e.name == policy.gres);
    let any_gpu = parsed.iter().flatten().any(is_gpu);
    if any_shared {
        let what = if any_gpu { "both gpu and " } else { "" };
        return reject(
            RejectKind::MixedGres,
            format!(
                "this job asks for {what}{g} directly: with --multiplex ask for GPUs (--gres=gpu:1) and the plugin chooses the {g}",
                g = policy.gres
            ),
        );
    }
    let gpus_of = |i: usize| parsed[i].iter().filter(|e| is_gpu(e)).map(|e| e.count).sum::<u64>();
    let tasks = u64::from(job.num_tasks.unwrap_or(1).max(1));
    let gpus = gpus_of(0) + gpus_of(1) + gpus_of(2) * tasks + gpus_of(3);
    if gpus == 0 {
        return reject(
            RejectKind::NoGpu,
            "--multiplex needs a GPU request to share (e.g. --gres=gpu:1 or --gpus=1)".into(),
        );
    }
    if gpus > u64::from(policy.max_gpus) {
        return reject(
            RejectKind::TooManyGpus,
            format!(
                "this job asks for {gpus} GPUs; multiplexed jobs may use at most {} here: ask for fewer or drop --multiplex",
                policy.max_gpus
            ),
        );
    }

    // The job's own spelling (gres: or gres/) is kept for the shared-GPU request.
    let sep = parsed
        .iter()
        .flatten()
        .find(|e| is_gpu(e))
        .and_then(|e| e.sep)
        .unwrap_or(':');
    let shared = format!("gres{sep}{}:{gpus}", policy.gres);
    let keep = |i: usize| {
        parsed[i]
            .iter()
            .filter(|e| !is_gpu(e))
            .map(|e| e.text.clone())
            .collect::<Vec<_>>()
    };
    let tres_per_node = join(keep(0).into_iter().chain(std::iter::once(shared)));
    let per_gpu = |f: &Option<String>| {
        f.as_deref().and_then(|s| {
            join(parse_tres(s).into_iter().map(|e| {
                if is_gpu(&e) {
                    format!(
                        "gres{}{}:{}",
                        e.sep.unwrap_or(':'),
                        policy.gres,
                        e.text.rsplit(':').next().unwrap_or("0")
                    )
                } else {
                    e.text
                }
            }))
        })
    };
    let app = spec
        .app
        .clone()
        .unwrap_or_else(|| default_app(job.user_id, job.name.as_deref()));
    let mut tag = format!("multiplex:app={app}");
    if let Some(mem) = spec.mem_mb {
        tag.push_str(&format!(",mem={mem}M"));
    }
    let admin_comment = match job.admin_comment.as_deref().filter(|c| !c.is_empty()) {
        Some(existing) if existing.starts_with("multiplex:") => tag,
        Some(existing) => format!("{tag} {existing}"),
        None => tag,
    };
    Outcome::Rewrite(Rewrite {
        partition: policy.partition.clone(),
        admin_comment,
        tres_per_node,
        tres_per_job: join(keep(1).into_iter()),
        tres_per_task: join(keep(2).into_iter()),
        tres_per_socket: join(keep(3).into_iter()),
        cpus_per_tres: per_gpu(&job.cpus_per_tres),
        mem_per_tres: per_gpu(&job.mem_per_tres),
        app,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(opt: Option<&str>, tres_per_node: Option<&str>) -> JobView {
        JobView {
            spank_env: opt.map(|v| vec![format!("{SPANK_ENV_VAR}={v}")]).unwrap_or_default(),
            user_id: 1000,
            name: Some("train".into()),
            tres_per_node: tres_per_node.map(String::from),
            ..JobView::default()
        }
    }

    fn rewrite(j: &JobView) -> Rewrite {
        match decide(j, &Policy::default()) {
            Outcome::Rewrite(r) => r,
            other => panic!("expected a rewrite, got {other:?}"),
        }
    }

    fn rejection(j: &JobView) -> (RejectKind, String) {
        match decide(j, &Policy::default()) {
            Outcome::Reject { kind, message } => (kind, message),
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    #[test]
    fn jobs_without_the_flag_are_untouched() {
        for tres in [None, Some("gres:gpu:1"), Some("gres:gpu:8"), Some("gres:shard:1")] {
            let mut j = job(None, tres);
            j.spank_env = vec!["_SLURM_SPANK_OPTION_other_plugin_x=1".into()];
            assert_eq!(decide(&j, &Policy::default()), Outcome::Untouched);
        }
    }

    #[test]
    fn every_gpu_request_form_becomes_one_shard() {
        // (field, value) pairs: --gres in both spellings, with a type, --gpus, --gpus-per-task.
        let forms: &[(&str, &str, &str)] = &[
            ("node", "gres:gpu:1", "gres:shard:1"),
            ("node", "gres/gpu:1", "gres/shard:1"),
            ("node", "gres:gpu", "gres:shard:1"),
            ("node", "gres:gpu:v100:1", "gres:shard:1"),
            ("node", "gres/gpu:v100:1", "gres/shard:1"),
            ("job", "gres:gpu:1", "gres:shard:1"),
            ("job", "gres/gpu:1", "gres/shard:1"),
            ("task", "gres:gpu:1", "gres:shard:1"),
            ("socket", "gres:gpu:1", "gres:shard:1"),
        ];
        for (field, value, want) in forms {
            let mut j = job(Some("(null)"), None);
            let slot = match *field {
                "node" => &mut j.tres_per_node,
                "job" => &mut j.tres_per_job,
                "task" => &mut j.tres_per_task,
                _ => &mut j.tres_per_socket,
            };
            *slot = Some(value.to_string());
            let r = rewrite(&j);
            assert_eq!(r.tres_per_node.as_deref(), Some(*want), "{field}={value}");
            assert_eq!(
                (r.tres_per_job, r.tres_per_task, r.tres_per_socket),
                (None, None, None),
                "{field}={value}"
            );
            assert_eq!(r.partition, "shared");
        }
    }

    #[test]
    fn other_tres_entries_are_kept_and_per_gpu_options_follow() {
        let mut j = job(Some("app=bert,mem=16G"), Some("gres:nic:1,gres:gpu:1"));
        j.cpus_per_tres = Some("gres:gpu:4".into());
        j.mem_per_tres = Some("gres:gpu:8192".into());
        let r = rewrite(&j);
        assert_eq!(r.tres_per_node.as_deref(), Some("gres:nic:1,gres:shard:1"));
        assert_eq!(r.cpus_per_tres.as_deref(), Some("gres:shard:4"));
        assert_eq!(r.mem_per_tres.as_deref(), Some("gres:shard:8192"));
        assert_eq!(r.admin_comment, "multiplex:app=bert,mem=16384M");
        assert_eq!(r.app, "bert");
    }

    #[test]
    fn default_app_key_comes_from_user_and_job_name() {
        let r = rewrite(&job(Some("(null)"), Some("gres:gpu:1")));
        assert_eq!(r.app, "u1000-train");
        assert_eq!(r.admin_comment, "multiplex:app=u1000-train");
    }

    #[test]
    fn an_admin_comment_is_kept_and_a_stale_tag_replaced() {
        let mut j = job(Some("app=a"), Some("gres:gpu:1"));
        j.admin_comment = Some("ticket 42".into());
        assert_eq!(rewrite(&j).admin_comment, "multiplex:app=a ticket 42");
        j.admin_comment = Some("multiplex:app=old".into());
        assert_eq!(rewrite(&j).admin_comment, "multiplex:app=a");
    }

    #[test]
    fn every_rejection_has_its_kind_and_sentence() {
        let mut exclusive = job(Some("(null)"), Some("gres:gpu:1"));
        exclusive.exclusive = true;
        let mut two_nodes = job(Some("(null)"), Some("gres:gpu:1"));
        two_nodes.min_nodes = Some(2);
        let mut gpus_per_task = job(Some("(null)"), None);
        gpus_per_task.tres_per_task = Some("gres:gpu:1".into());
        gpus_per_task.num_tasks = Some(2);
        let mut mixed = job(Some("(null)"), Some("gres:gpu:1"));
        mixed.tres_per_job = Some("gres:shard:1".into());
        let cases: Vec<(JobView, RejectKind, &str)> = vec![
            (
                job(Some("app=has space"), Some("gres:gpu:1")),
                RejectKind::BadOption,
                "invalid --multiplex value: app name 'has space'",
            ),
            (
                job(Some("gpus=2"), Some("gres:gpu:1")),
                RejectKind::BadOption,
                "unknown key 'gpus'",
            ),
            (job(Some("(null)"), None), RejectKind::NoGpu, "needs a GPU request"),
            (
                job(Some("(null)"), Some("gres:nic:1")),
                RejectKind::NoGpu,
                "needs a GPU request",
            ),
            (
                job(Some("(null)"), Some("gres:gpu:2")),
                RejectKind::TooManyGpus,
                "asks for 2 GPUs; multiplexed jobs may use at most 1",
            ),
            (gpus_per_task, RejectKind::TooManyGpus, "asks for 2 GPUs"),
            (exclusive, RejectKind::Exclusive, "--exclusive cannot be combined"),
            (two_nodes, RejectKind::TooManyNodes, "asks for 2"),
            (mixed, RejectKind::MixedGres, "both gpu and shard"),
            (
                job(Some("(null)"), Some("gres:shard:1")),
                RejectKind::MixedGres,
                "asks for shard directly",
            ),
        ];
        for (j, kind, want) in cases {
            let (k, msg) = rejection(&j);
            assert_eq!(k, kind, "{msg}");
            assert!(
                msg.starts_with("multiplex: ") && msg.contains(want),
                "{msg:?} lacks {want:?}"
            );
        }
    }

    #[test]
    fn policy_limits_apply() {
        let policy = Policy {
            partition: "gpu-shared".into(),
            gres: "mps".into(),
            max_gpus: 2,
        };
        match decide(&job(Some("(null)"), Some("gres:gpu:2")), &policy) {
            Outcome::Rewrite(r) => {
                assert_eq!(r.tres_per_node.as_deref(), Some("gres:mps:2"));
                assert_eq!(r.partition, "gpu-shared");
            }
            other => panic!("{other:?}"),
        }
    }
}
