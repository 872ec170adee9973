//! The decision job_submit makes, on plain Rust values: leave a job alone, rewrite its GPU
//! request into a shared-GPU one that waits for the claimer (a license of the gate), or reject
//! it with a sentence for the user.

use crate::plain::PlainGpus;
use crate::policy::Policy;
use crate::tres::{checked_sum, is_gpu, join, parse_tres, TresEntry};
pub(crate) use crate::view::refuse;
pub use crate::view::{JobView, RejectKind};
use multiplex_protocol::spec::{default_app, Spec, SPANK_ENV_VAR, TAG_PREFIX};
use multiplex_protocol::srun::{self, Field, GPU_REQUEST_ENV};

pub use multiplex_protocol::spec::GATE_LICENSE;

/// The job's licenses with the gate's one added (any the job named itself replaced).
pub fn with_gate(licenses: Option<&str>) -> String {
    let mut out: Vec<&str> = licenses
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|l| !l.is_empty() && l.split([':', '=']).next() != Some(GATE_LICENSE))
        .collect();
    let gate = format!("{GATE_LICENSE}:1");
    out.push(&gate);
    out.join(",")
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
    /// The job's CPUs at least (from --cpus-per-gpu).
    pub min_cpus: Option<u32>,
    /// The job's memory on its node, MiB (from --mem-per-gpu).
    pub mem_per_node_mb: Option<u64>,
    /// Its licenses: its own and the gate's.
    pub licenses: String,
    /// The application key the job was tagged with.
    pub app: String,
}

/// The outcome for one job.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Not a multiplexed job: nothing changes.
    Untouched,
    Rewrite(Box<Rewrite>),
    /// A job without --multiplex that asks for GPUs: kept off the shared nodes (its new
    /// `--exclude`), or its GPU model turned into a node feature ([`crate::plain`]), or both.
    Plain {
        exc_nodes: Option<String>,
        gpus: Option<Box<PlainGpus>>,
    },
    Reject {
        kind: RejectKind,
        message: String,
    },
}

/// Decides what happens to `job` under `policy`.
pub fn decide(job: &JobView, policy: &Policy) -> Outcome {
    let prefix = format!("{SPANK_ENV_VAR}=");
    let Some(value) = job.spank_env.iter().find_map(|e| e.strip_prefix(&prefix)) else {
        return plain(job, policy);
    };
    let spec = match Spec::parse(Some(value)) {
        Ok(s) => s,
        Err(e) => return reject(RejectKind::BadOption, format!("invalid --multiplex value: {e}")),
    };
    let merged;
    let (job, srun_made) = match with_srun_asks(job) {
        Ok(None) => (job, false),
        Ok(Some(m)) => {
            merged = m;
            (&merged, true)
        }
        Err(e) => return reject(RejectKind::BadOption, e),
    };
    match multiplexed(job, &spec, srun_made, policy) {
        Ok(rewrite) => Outcome::Rewrite(Box::new(rewrite)),
        Err((kind, message)) => Outcome::Reject { kind, message },
    }
}

/// A job without --multiplex: kept out of the shared partitions, and off shared nodes where
/// the site shares nodes with other partitions; a GPU model the site shares asked for untyped.
fn plain(job: &JobView, policy: &Policy) -> Outcome {
    if let Some(message) = unflagged_on_shared(job.partition.as_deref(), policy) {
        return reject(RejectKind::SharedPartition, message);
    }
    let changes =
        keep_off_shared_nodes(job, policy).and_then(|exc_nodes| Ok((exc_nodes, crate::plain::untyped(job, policy)?)));
    match changes {
        Ok((None, None)) => Outcome::Untouched,
        Ok((exc_nodes, gpus)) => Outcome::Plain {
            exc_nodes,
            gpus: gpus.map(Box::new),
        },
        Err((kind, message)) => Outcome::Reject { kind, message },
    }
}

/// A multiplexed job (`spec` its flag's value) rewritten to a slot of a shared GPU, or why
/// it cannot share.
fn multiplexed(job: &JobView, spec: &Spec, srun_made: bool, policy: &Policy) -> Result<Rewrite, (RejectKind, String)> {
    may_share(job, policy)?;
    let parsed: Vec<Vec<TresEntry>> = [
        &job.tres_per_node,
        &job.tres_per_job,
        &job.tres_per_task,
        &job.tres_per_socket,
    ]
    .iter()
    .map(|f| f.as_deref().map(parse_tres).unwrap_or_default())
    .collect();
    let gpus = gpu_count(job, &parsed, policy)?;
    let model = asked_model(&parsed, policy)?;
    let (cpus_per_tres, min_cpus) = per_gpu(&job.cpus_per_tres, "--cpus-per-gpu", gpus)?;
    let (mem_per_tres, mem_mb) = per_gpu(&job.mem_per_tres, "--mem-per-gpu", gpus)?;
    let min_cpus = min_cpus.map(u32::try_from).transpose().map_err(|_| {
        refuse(
            RejectKind::BadOption,
            "--cpus-per-gpu asks for more CPUs than can be counted".into(),
        )
    })?;
    let app = spec
        .app
        .clone()
        .unwrap_or_else(|| default_app(job.user_id, job.name.as_deref()));
    let keep = |i: usize| -> Vec<String> {
        parsed[i]
            .iter()
            .filter(|e| !is_gpu(e))
            .map(|e| e.text.clone())
            .collect()
    };
    Ok(Rewrite {
        partition: shared_partition(job.partition.as_deref(), policy),
        admin_comment: tag(job, spec, model, srun_made, &app),
        tres_per_node: join(
            keep(0)
                .into_iter()
                .chain(std::iter::once(shared_request(&parsed, gpus, policy))),
        ),
        tres_per_job: join(keep(1).into_iter()),
        tres_per_task: join(keep(2).into_iter()),
        tres_per_socket: join(keep(3).into_iter()),
        cpus_per_tres,
        mem_per_tres,
        min_cpus,
        mem_per_node_mb: mem_mb,
        licenses: with_gate(job.licenses.as_deref()),
        app,
    })
}

/// Whether the policy lets this job's user share, and the job is one that can: not
/// `--exclusive`, on one node.
fn may_share(job: &JobView, policy: &Policy) -> Result<(), (RejectKind, String)> {
    if let Some(message) = not_allowed(job, policy) {
        return Err(refuse(RejectKind::NotAllowed, message));
    }
    if job.exclusive {
        return Err(refuse(
            RejectKind::Exclusive,
            "--exclusive cannot be combined with --multiplex: a multiplexed job shares its GPU by design".into(),
        ));
    }
    let nodes = job
        .max_nodes
        .or(job.min_nodes)
        .unwrap_or(1)
        .max(job.min_nodes.unwrap_or(1));
    if nodes > 1 {
        return Err(refuse(
            RejectKind::TooManyNodes,
            format!("a multiplexed job runs on one node, this one asks for {nodes}: drop --multiplex or ask for -N 1"),
        ));
    }
    Ok(())
}

/// How many GPUs the job asks for in all (`parsed`: its four TRES fields), which must be 1
/// to the policy's most; a request for the shared gres itself is refused.
fn gpu_count(job: &JobView, parsed: &[Vec<TresEntry>], policy: &Policy) -> Result<u64, (RejectKind, String)> {
    let any_shared = parsed
        .iter()
        .flatten()
        .any(|e| e.sep.is_some() && e.name == policy.gres);
    if any_shared {
        let what = if parsed.iter().flatten().any(is_gpu) {
            "both gpu and "
        } else {
            ""
        };
        return Err(refuse(
            RejectKind::MixedGres,
            format!(
                "this job asks for {what}{g} directly: with --multiplex ask for GPUs (--gres=gpu:1) and the plugin chooses the {g}",
                g = policy.gres
            ),
        ));
    }
    // Counts are the user's numbers: summed without wrapping round (a sum past u64 is refused
    // as too many, never taken modulo 2^64).
    let gpus_of = |i: usize| checked_sum(parsed[i].iter().filter(|e| is_gpu(e)).map(|e| e.count));
    let tasks = u64::from(job.num_tasks.unwrap_or(1).max(1));
    let gpus = [
        gpus_of(0),
        gpus_of(1),
        gpus_of(2).and_then(|g| g.checked_mul(tasks)),
        gpus_of(3),
    ]
    .into_iter()
    .try_fold(0u64, |total, g| total.checked_add(g?));
    match gpus {
        None => Err(refuse(
            RejectKind::TooManyGpus,
            format!(
                "this job asks for more GPUs than can be counted; multiplexed jobs may use at most {} here",
                policy.max_gpus
            ),
        )),
        Some(0) => Err(refuse(
            RejectKind::NoGpu,
            "--multiplex needs a GPU request to share (e.g. --gres=gpu:1 or --gpus=1)".into(),
        )),
        Some(n) if n > u64::from(policy.max_gpus) => Err(refuse(
            RejectKind::TooManyGpus,
            format!(
                "this job asks for {n} GPUs; multiplexed jobs may use at most {} here: ask for fewer or drop --multiplex",
                policy.max_gpus
            ),
        )),
        Some(n) => Ok(n),
    }
}

/// The GPU model asked for (`--gres=gpu:v100:1`), one the site shares: the claimer pins the
/// job to a GPU of that model. The job waits on an untyped shard, which a claim turns into the
/// GPU's type.
fn asked_model(parsed: &[Vec<TresEntry>], policy: &Policy) -> Result<Option<String>, (RejectKind, String)> {
    let mut models: Vec<&str> = parsed
        .iter()
        .flatten()
        .filter(|e| is_gpu(e))
        .filter_map(|e| e.kind.as_deref())
        .collect();
    models.dedup();
    let model = match models[..] {
        [] => return Ok(None),
        [m] => m,
        _ => {
            return Err(refuse(
                RejectKind::UnknownModel,
                format!(
                    "this job asks for GPUs of {} models; a multiplexed job runs on one GPU of one model",
                    models.len()
                ),
            ))
        }
    };
    if !policy.models.is_empty() && !policy.models.iter().any(|p| p == model) {
        return Err(refuse(
            RejectKind::UnknownModel,
            format!(
                "no shared GPU here is a {model}; shared GPU models: {}",
                policy.models.join(", ")
            ),
        ));
    }
    Ok(Some(model.to_string()))
}

/// The shared gres for `gpus` GPUs, in the job's own spelling (`gres:` or `gres/`).
fn shared_request(parsed: &[Vec<TresEntry>], gpus: u64, policy: &Policy) -> String {
    let sep = parsed
        .iter()
        .flatten()
        .find(|e| is_gpu(e))
        .and_then(|e| e.sep)
        .unwrap_or(':');
    let units = gpus * u64::from(policy.gres_per_gpu);
    format!("gres{sep}{}:{units}", policy.gres)
}

/// A per-GPU amount (`--cpus-per-gpu`, `--mem-per-gpu`: `cpus_per_tres`, `mem_per_tres`)
/// turned into the job's own total for its `gpus`: Slurm takes them only beside a request for
/// gres "gpu" ("Requested cpus_per_tres=gres/shard:1 but did not request any GPU", 22.05 for
/// memory, 24.11 for both). The field's other entries are kept.
fn per_gpu(f: &Option<String>, option: &str, gpus: u64) -> Result<(Option<String>, Option<u64>), (RejectKind, String)> {
    let Some(s) = f.as_deref() else { return Ok((None, None)) };
    let bad = |message: String| refuse(RejectKind::BadOption, message);
    let (mut kept, mut total) = (Vec::new(), None::<u64>);
    for e in parse_tres(s) {
        if !is_gpu(&e) {
            kept.push(e.text);
            continue;
        }
        let value = e.text.rsplit(':').next().unwrap_or("");
        let n = value
            .parse::<u64>()
            .map_err(|_| bad(format!("{option}={value} is not a number")))?;
        let all = n
            .checked_mul(gpus)
            .and_then(|t| t.checked_add(total.unwrap_or(0)))
            .ok_or_else(|| bad(format!("{option}={n} for {gpus} GPUs is more than can be counted")))?;
        total = Some(all);
    }
    Ok((join(kept.into_iter()), total))
}

/// The job's admin comment with its tag first: its application resolved, what it asked for,
/// and whether srun made it (then it is claimed for a node only: srun asks for the step with
/// the job's allocated gres, a typed shard Slurm refuses for a step).
fn tag(job: &JobView, spec: &Spec, model: Option<String>, srun_made: bool, app: &str) -> String {
    let tag = Spec {
        app: Some(app.to_string()),
        mem_mb: spec.mem_mb,
        model,
        node_only: srun_made,
        // A list no tag could hold (Slurm would refuse it anyway) is not recorded.
        nodes: job
            .node_list
            .clone()
            .filter(|l| multiplex_protocol::spec::recordable_nodes(l)),
    }
    .tag();
    match job.admin_comment.as_deref().filter(|c| !c.is_empty()) {
        Some(existing) if existing.starts_with(TAG_PREFIX) => tag,
        Some(existing) => format!("{tag} {existing}"),
        None => tag,
    }
}

/// The job with the GPU asks srun took off its own options added to their fields
/// (`multiplex_protocol::srun`), or `None` when srun passed none.
fn with_srun_asks(job: &JobView) -> Result<Option<JobView>, String> {
    let prefix = format!("{GPU_REQUEST_ENV}=");
    let Some(carried) = job.spank_env.iter().find_map(|e| e.strip_prefix(&prefix)) else {
        return Ok(None);
    };
    let asks = srun::decode(carried).map_err(|e| format!("the GPU request srun passed on is unreadable: {e}"))?;
    let mut job = job.clone();
    // srun asks for its step's share with the job's request too: not the user's ask.
    job.tres_per_node = job.tres_per_node.as_deref().and_then(srun::without_step_share);
    for (field, value) in asks {
        let slot = match field {
            Field::TresPerNode => &mut job.tres_per_node,
            Field::TresPerJob => &mut job.tres_per_job,
            Field::TresPerTask => &mut job.tres_per_task,
            Field::TresPerSocket => &mut job.tres_per_socket,
            Field::CpusPerTres => &mut job.cpus_per_tres,
            Field::MemPerTres => &mut job.mem_per_tres,
        };
        *slot = Some(match slot.take().filter(|s| !s.is_empty()) {
            Some(s) => format!("{s},{value}"),
            None => value,
        });
    }
    Ok(Some(job))
}

fn reject(kind: RejectKind, message: String) -> Outcome {
    Outcome::Reject {
        kind,
        message: format!("multiplex: {message}"),
    }
}

pub(crate) fn partition_names(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim).filter(|p| !p.is_empty())
}

/// The partition(s) a multiplexed job runs in: the shared ones it asked for, else the
/// policy's first.
fn shared_partition(asked: Option<&str>, policy: &Policy) -> String {
    let kept: Vec<&str> = asked
        .map(|a| partition_names(a).filter(|p| policy.is_shared(p)).collect())
        .unwrap_or_default();
    if kept.is_empty() {
        policy.target_partition().to_string()
    } else {
        kept.join(",")
    }
}

/// The sentence for a job without --multiplex that asks for a shared partition, when the
/// policy keeps those partitions for multiplexed jobs.
pub(crate) fn unflagged_on_shared(asked: Option<&str>, policy: &Policy) -> Option<String> {
    if policy.unflagged_on_shared {
        return None;
    }
    let shared = partition_names(asked?).find(|p| policy.is_shared(p))?;
    Some(format!(
        "partition {shared} is for jobs that share GPUs: add --multiplex, or ask for another partition \
         (a job there without it could be given a GPU whole while others use slots of it)"
    ))
}

/// Whether any TRES field of `job` asks for GPUs or for the shared-GPU gres.
pub(crate) fn asks_gpus(job: &JobView, policy: &Policy) -> bool {
    [
        &job.tres_per_node,
        &job.tres_per_job,
        &job.tres_per_task,
        &job.tres_per_socket,
    ]
    .into_iter()
    .flatten()
    .flat_map(|f| parse_tres(f))
    .any(|e| e.sep.is_some() && (e.name == "gpu" || e.name == policy.gres))
}

/// A job without --multiplex that asks for GPUs, on a site whose shared-GPU nodes are also in
/// other partitions (the policy's `shared_nodes`): Slurm would hand it a GPU whole while
/// multiplexed jobs share it (22.05 does so even for the GPU a shard was taken from), so the
/// shared nodes are added to its `--exclude`, and naming one with `--nodelist` is refused.
/// `Ok(None)`: nothing to change.
fn keep_off_shared_nodes(job: &JobView, policy: &Policy) -> Result<Option<String>, (RejectKind, String)> {
    let Some(shared) = policy.shared_nodes.as_ref() else {
        return Ok(None);
    };
    if !asks_gpus(job, policy) {
        return Ok(None);
    }
    if let Some(node) = job.req_nodes.iter().find(|n| shared.hosts.contains(*n)) {
        return Err(refuse(
            RejectKind::SharedNode,
            format!(
                "{node} shares its GPUs among multiplexed jobs: a job without --multiplex cannot have GPUs there; \
                 add --multiplex, or leave {node} out of --nodelist"
            ),
        ));
    }
    Ok(Some(
        match job.exc_nodes.as_deref().map(str::trim).filter(|e| !e.is_empty()) {
            Some(existing) => format!("{existing},{}", shared.list),
            None => shared.list.clone(),
        },
    ))
}

/// The sentence for a user the policy does not let multiplex.
fn not_allowed(job: &JobView, policy: &Policy) -> Option<String> {
    let allowed = policy.allowed.as_ref()?;
    if allowed.uids.contains(&job.user_id) {
        return None;
    }
    if let Some(account) = job.account.as_deref() {
        if allowed.accounts.iter().any(|a| a == account) {
            return None;
        }
    }
    let mut who = Vec::new();
    if !allowed.user_names.is_empty() {
        who.push(format!("users {}", allowed.user_names.join(", ")));
    }
    if !allowed.accounts.is_empty() {
        who.push(format!("accounts {}", allowed.accounts.join(", ")));
    }
    let hint = match (allowed.accounts.first(), job.account.as_deref()) {
        (Some(a), None) => format!(": if you belong to one of those accounts, submit with --account={a}"),
        _ => String::new(),
    };
    Some(format!(
        "uid {}{} may not share GPUs here; GPU sharing is open to {}{hint}",
        job.user_id,
        job.account
            .as_deref()
            .map(|a| format!(" (account {a})"))
            .unwrap_or_default(),
        who.join(" and ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modify::{check_modify, ModifyOk};

    fn job(opt: Option<&str>, tres_per_node: Option<&str>) -> JobView {
        JobView {
            spank_env: opt.map(|v| vec![format!("{SPANK_ENV_VAR}={v}")]).unwrap_or_default(),
            user_id: 1000,
            name: Some("train".into()),
            tres_per_node: tres_per_node.map(String::from),
            ..JobView::default()
        }
    }

    fn policy() -> Policy {
        Policy::default()
    }

    fn rewrite(j: &JobView) -> Rewrite {
        match decide(j, &policy()) {
            Outcome::Rewrite(r) => *r,
            other => panic!("expected a rewrite, got {other:?}"),
        }
    }

    fn rejection(j: &JobView) -> (RejectKind, String) {
        match decide(j, &policy()) {
            Outcome::Reject { kind, message } => (kind, message),
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    #[test]
    fn jobs_without_the_flag_are_untouched() {
        for tres in [None, Some("gres:gpu:1"), Some("gres:gpu:8"), Some("gres:shard:1")] {
            let mut j = job(None, tres);
            j.spank_env = vec!["_SLURM_SPANK_OPTION_other_plugin_x=1".into()];
            assert_eq!(decide(&j, &policy()), Outcome::Untouched);
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
            ("node", "gres/gpu:v100", "gres/shard:1"),
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
            assert_eq!(r.licenses, "multiplex:1", "{field}={value}: it waits for a claim");
            assert_eq!(
                r.admin_comment.contains(",model=v100"),
                value.contains("v100"),
                "{}",
                r.admin_comment
            );
        }
    }

    #[test]
    fn a_model_asked_for_goes_into_the_tag_and_one_the_site_does_not_share_is_refused() {
        let site = Policy {
            models: vec!["v100".into(), "a100".into()],
            ..Policy::default()
        };
        let j = |tres: &str| job(Some("app=a"), Some(tres));
        let got = |tres: &str| match decide(&j(tres), &site) {
            Outcome::Rewrite(r) => (r.tres_per_node.unwrap(), r.admin_comment),
            other => panic!("{other:?}"),
        };
        assert_eq!(got("gres:gpu:1"), ("gres:shard:1".into(), "multiplex:app=a".into()));
        assert_eq!(
            got("gres:gpu:a100:1"),
            ("gres:shard:1".into(), "multiplex:app=a,model=a100".into())
        );
        // A model the site does not share, and two models at once.
        for (tres, policy, says) in [
            (
                "gres:gpu:k80:1",
                site.clone(),
                "no shared GPU here is a k80; shared GPU models: v100, a100",
            ),
            (
                "gres:gpu:v100:1,gres:gpu:a100:1",
                Policy {
                    max_gpus: 2,
                    ..site.clone()
                },
                "GPUs of 2 models",
            ),
        ] {
            match decide(&j(tres), &policy) {
                Outcome::Reject { kind, message } => {
                    assert_eq!(kind, RejectKind::UnknownModel);
                    assert!(message.contains(says), "{tres}: {message}");
                }
                other => panic!("{tres}: {other:?}"),
            }
        }
        // Without a list, any model goes.
        assert!(matches!(decide(&j("gres:gpu:k80:1"), &policy()), Outcome::Rewrite(_)));
    }

    #[test]
    fn the_gate_license_is_added_beside_the_jobs_own_and_a_users_update_keeps_it() {
        let mut j = job(Some("app=a"), Some("gres:gpu:1"));
        j.licenses = Some("matlab:2,multiplex:5".into());
        assert_eq!(rewrite(&j).licenses, "matlab:2,multiplex:1");
        let tag = Some("multiplex:app=a");
        let update = JobView {
            licenses: Some("matlab:1".into()),
            ..JobView::default()
        };
        assert_eq!(
            check_modify(&update, tag, &policy(), false),
            Ok(ModifyOk::Licenses("matlab:1,multiplex:1".into()))
        );
        let dropped = JobView {
            licenses: Some(String::new()),
            ..JobView::default()
        };
        assert_eq!(
            check_modify(&dropped, tag, &policy(), false),
            Ok(ModifyOk::Licenses("multiplex:1".into()))
        );
        // The claimer (root or the Slurm user) lets it through; a plain job's licenses are its own.
        assert_eq!(check_modify(&dropped, tag, &policy(), true), Ok(ModifyOk::AsAsked));
        assert_eq!(check_modify(&dropped, None, &policy(), false), Ok(ModifyOk::AsAsked));
    }

    #[test]
    fn other_tres_entries_are_kept_and_per_gpu_options_follow() {
        let mut j = job(Some("app=bert,mem=16G"), Some("gres:nic:1,gres:gpu:1"));
        j.cpus_per_tres = Some("gres:gpu:4".into());
        j.mem_per_tres = Some("gres:gpu:8192".into());
        let r = rewrite(&j);
        assert_eq!(r.tres_per_node.as_deref(), Some("gres:nic:1,gres:shard:1"));
        assert_eq!((r.cpus_per_tres, r.min_cpus), (None, Some(4)));
        assert_eq!((r.mem_per_tres, r.mem_per_node_mb), (None, Some(8192)));
        assert_eq!(r.admin_comment, "multiplex:app=bert,mem=16384M");
        assert_eq!(r.app, "bert");
    }

    #[test]
    fn gpu_asks_srun_took_off_its_options_count_as_the_jobs_own() {
        // srun --multiplex --gres=gpu:1 --cpus-per-gpu=4 alone: the job's fields hold no GPU.
        let mut j = job(Some("app=a"), None);
        j.spank_env.push(format!(
            "{GPU_REQUEST_ENV}=tres_per_node=gres:gpu:1;cpus_per_tres=gres:gpu:4"
        ));
        let r = rewrite(&j);
        assert_eq!(r.tres_per_node.as_deref(), Some("gres:shard:1"));
        assert_eq!((r.cpus_per_tres, r.min_cpus), (None, Some(4)));
        // Added to what the job asked, under the same policy.
        j.tres_per_node = Some("gres:nic:1".into());
        assert_eq!(rewrite(&j).tres_per_node.as_deref(), Some("gres:nic:1,gres:shard:1"));
        let mut two = job(Some("(null)"), None);
        two.spank_env.push(format!("{GPU_REQUEST_ENV}=tres_per_job=gres:gpu:2"));
        assert_eq!(rejection(&two).0, RejectKind::TooManyGpus);
        let mut bad = job(Some("(null)"), Some("gres:gpu:1"));
        bad.spank_env.push(format!("{GPU_REQUEST_ENV}=partition=debug"));
        let (kind, message) = rejection(&bad);
        assert_eq!(kind, RejectKind::BadOption);
        assert!(message.contains("unreadable"), "{message}");
        // Without --multiplex the envelope means nothing.
        let mut plain = job(None, Some("gres:gpu:1"));
        plain.spank_env = vec![format!("{GPU_REQUEST_ENV}=tres_per_job=gres:gpu:2")];
        assert_eq!(decide(&plain, &Policy::default()), Outcome::Untouched);
    }

    #[test]
    fn default_app_key_comes_from_user_and_job_name() {
        let r = rewrite(&job(Some("(null)"), Some("gres:gpu:1")));
        assert_eq!(r.app, "u1000-train");
        assert_eq!(r.admin_comment, "multiplex:app=u1000-train");
    }

    #[test]
    fn the_users_node_list_is_kept_in_the_tag_for_a_claim_again() {
        let mut j = job(Some("app=a"), Some("gres:gpu:1"));
        j.node_list = Some("n[1,3],n7".into());
        assert_eq!(rewrite(&j).admin_comment, "multiplex:app=a,nodes=n[1+3]+n7");
        // One no tag could hold is not recorded (Slurm refuses it anyway).
        j.node_list = Some("n1 n2".into());
        assert_eq!(rewrite(&j).admin_comment, "multiplex:app=a");
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
            (
                // 2^64 - 1 + 2 wraps round to 1 in unchecked arithmetic.
                job(Some("(null)"), Some("gres:gpu:18446744073709551615,gres:gpu:2")),
                RejectKind::TooManyGpus,
                "more GPUs than can be counted",
            ),
            (
                job(
                    Some("(null)"),
                    Some("gres:gpu:9223372036854775808,gres:gpu:9223372036854775808"),
                ),
                RejectKind::TooManyGpus,
                "more GPUs than can be counted",
            ),
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

    fn site() -> Policy {
        Policy {
            partitions: vec!["gpu-shared".into(), "gpu-shared-long".into()],
            gres: "mps".into(),
            gres_per_gpu: 50,
            max_gpus: 2,
            unflagged_on_shared: false,
            allowed: None,
            shared_nodes: None,
            models: vec![],
        }
    }

    /// `site()` whose nodes gpu01 and gpu02 are also in a partition that is not shared.
    fn mixed_site() -> Policy {
        Policy {
            shared_nodes: Some(Box::new(crate::policy::SharedNodes {
                list: "gpu[01-02]".into(),
                hosts: ["gpu01", "gpu02"].map(String::from).into(),
            })),
            ..site()
        }
    }

    #[test]
    fn plain_gpu_jobs_are_kept_off_shared_nodes_where_the_site_names_them() {
        let p = mixed_site();
        let mut plain = job(None, Some("gres:gpu:1"));
        plain.partition = Some("gpu".into());
        assert_eq!(
            decide(&plain, &p),
            Outcome::Plain {
                exc_nodes: Some("gpu[01-02]".into()),
                gpus: None
            }
        );
        plain.exc_nodes = Some("gpu07".into());
        assert_eq!(
            decide(&plain, &p),
            Outcome::Plain {
                exc_nodes: Some("gpu07,gpu[01-02]".into()),
                gpus: None
            }
        );
        // Every way of asking for GPUs, and the shared gres itself.
        for (field, value) in [("job", "gres/gpu:2"), ("task", "gres:gpu:1"), ("node", "gres:mps:50")] {
            let mut j = job(None, None);
            *match field {
                "job" => &mut j.tres_per_job,
                "task" => &mut j.tres_per_task,
                _ => &mut j.tres_per_node,
            } = Some(value.into());
            assert!(
                matches!(decide(&j, &p), Outcome::Plain { exc_nodes: Some(_), .. }),
                "{field}={value}"
            );
        }
        // Naming a shared node is refused with the reason.
        plain.req_nodes = vec!["gpu09".into(), "gpu02".into()];
        match decide(&plain, &p) {
            Outcome::Reject { kind, message } => {
                assert_eq!(kind, RejectKind::SharedNode);
                assert!(
                    message.contains("gpu02 shares its GPUs among multiplexed jobs"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        // Jobs without GPUs, multiplexed jobs, and sites that name no shared nodes: unchanged.
        let mut cpu_only = job(None, Some("gres:nic:1"));
        cpu_only.req_nodes = vec!["gpu01".into()];
        assert_eq!(decide(&cpu_only, &p), Outcome::Untouched);
        assert!(matches!(
            decide(&job(Some("(null)"), Some("gres:gpu:1")), &p),
            Outcome::Rewrite(_)
        ));
        assert_eq!(decide(&job(None, Some("gres:gpu:1")), &site()), Outcome::Untouched);
    }

    #[test]
    fn updates_cannot_bring_a_plain_job_back_onto_shared_nodes() {
        let p = mixed_site();
        let upd = |f: &dyn Fn(&mut JobView)| {
            let mut u = JobView::default();
            f(&mut u);
            u
        };
        assert_eq!(check_modify(&upd(&|_| {}), None, &p, false), Ok(ModifyOk::AsAsked));
        assert_eq!(
            check_modify(&upd(&|u| u.exc_nodes = Some("gpu05".into())), None, &p, false),
            Ok(ModifyOk::ExcNodes("gpu05,gpu[01-02]".into()))
        );
        assert_eq!(
            check_modify(&upd(&|u| u.exc_nodes = Some(String::new())), None, &p, false),
            Ok(ModifyOk::ExcNodes("gpu[01-02]".into()))
        );
        for (u, why) in [
            (upd(&|u| u.req_nodes = vec!["gpu01".into()]), "cannot be moved to gpu01"),
            (
                upd(&|u| u.tres_per_node = Some("gres:gpu:1".into())),
                "not by an update",
            ),
        ] {
            match check_modify(&u, None, &p, false) {
                Err((RejectKind::SharedNode, m)) => assert!(m.contains(why), "{m}"),
                other => panic!("{why}: {other:?}"),
            }
        }
        // Without shared_nodes, and for multiplexed jobs, these rules do not apply.
        let to_gpu01 = upd(&|u| u.req_nodes = vec!["gpu01".into()]);
        assert_eq!(check_modify(&to_gpu01, None, &site(), false), Ok(ModifyOk::AsAsked));
        assert_eq!(
            check_modify(&to_gpu01, Some("multiplex:app=a"), &p, false),
            Ok(ModifyOk::AsAsked)
        );
    }

    #[test]
    fn policy_limits_apply() {
        match decide(&job(Some("(null)"), Some("gres:gpu:2")), &site()) {
            Outcome::Rewrite(r) => {
                assert_eq!(r.tres_per_node.as_deref(), Some("gres:mps:100"));
                assert_eq!(r.partition, "gpu-shared");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decide(&job(Some("(null)"), Some("gres:gpu:3")), &site()),
            Outcome::Reject {
                kind: RejectKind::TooManyGpus,
                ..
            }
        ));
    }

    #[test]
    fn a_shared_partition_the_job_asked_for_is_kept() {
        for (asked, want) in [
            (None, "gpu-shared"),
            (Some("gpu"), "gpu-shared"),
            (Some("gpu-shared-long"), "gpu-shared-long"),
            (Some("gpu,gpu-shared-long"), "gpu-shared-long"),
            (Some("gpu-shared-long,gpu-shared"), "gpu-shared-long,gpu-shared"),
        ] {
            let mut j = job(Some("(null)"), Some("gres:gpu:1"));
            j.partition = asked.map(String::from);
            match decide(&j, &site()) {
                Outcome::Rewrite(r) => assert_eq!(r.partition, want, "{asked:?}"),
                other => panic!("{asked:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn per_gpu_options_become_the_jobs_own_cpus_and_memory() {
        let mut j = job(Some("(null)"), Some("gres:gpu:2"));
        j.cpus_per_tres = Some("gres:gpu:3".into());
        j.mem_per_tres = Some("gres:gpu:1000".into());
        match decide(&j, &site()) {
            Outcome::Rewrite(r) => {
                assert_eq!(r.tres_per_node.as_deref(), Some("gres:mps:100"));
                assert_eq!((r.cpus_per_tres, r.min_cpus), (None, Some(6)));
                assert_eq!((r.mem_per_tres, r.mem_per_node_mb), (None, Some(2000)));
            }
            other => panic!("{other:?}"),
        }
        for (cpus, mem, want) in [
            ("gres:gpu:x", "gres:gpu:1", "--cpus-per-gpu=x is not a number"),
            (
                "gres:gpu:1",
                "gres:gpu:18446744073709551615",
                "more than can be counted",
            ),
            ("gres:gpu:4294967295", "gres:gpu:1", "more CPUs than can be counted"),
        ] {
            j.cpus_per_tres = Some(cpus.into());
            j.mem_per_tres = Some(mem.into());
            match decide(&j, &site()) {
                Outcome::Reject { kind, message } => {
                    assert_eq!(kind, RejectKind::BadOption);
                    assert!(message.contains(want), "{message}");
                }
                other => panic!("{cpus} {mem}: {other:?}"),
            }
        }
    }

    #[test]
    fn plain_jobs_are_kept_out_of_the_shared_partitions_unless_the_site_allows_it() {
        let mut plain = job(None, Some("gres:gpu:1"));
        plain.partition = Some("debug,gpu-shared-long".into());
        match decide(&plain, &site()) {
            Outcome::Reject { kind, message } => {
                assert_eq!(kind, RejectKind::SharedPartition);
                assert!(
                    message.starts_with(
                        "multiplex: partition gpu-shared-long is for jobs that share GPUs: add --multiplex"
                    ),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        let open = Policy {
            unflagged_on_shared: true,
            ..site()
        };
        assert_eq!(decide(&plain, &open), Outcome::Untouched);
        plain.partition = Some("debug".into());
        assert_eq!(decide(&plain, &site()), Outcome::Untouched);
        plain.partition = None;
        assert_eq!(
            decide(&plain, &site()),
            Outcome::Untouched,
            "no partition asked: slurmctld's default"
        );
    }

    #[test]
    fn only_allowed_users_and_accounts_multiplex() {
        let policy = Policy {
            allowed: Some(crate::policy::Allowed {
                uids: [1001].into(),
                user_names: vec!["alice".into()],
                accounts: vec!["ml".into(), "vision".into()],
            }),
            ..policy()
        };
        let mut j = job(Some("(null)"), Some("gres:gpu:1"));
        j.user_id = 1001;
        assert!(matches!(decide(&j, &policy), Outcome::Rewrite(_)), "allowed user");
        j.user_id = 1002;
        j.account = Some("vision".into());
        assert!(matches!(decide(&j, &policy), Outcome::Rewrite(_)), "allowed account");
        j.account = None;
        match decide(&j, &policy) {
            Outcome::Reject { kind, message } => {
                assert_eq!(kind, RejectKind::NotAllowed);
                assert_eq!(
                    message,
                    "multiplex: uid 1002 may not share GPUs here; GPU sharing is open to users alice and accounts ml, vision: \
                     if you belong to one of those accounts, submit with --account=ml"
                );
            }
            other => panic!("{other:?}"),
        }
        j.account = Some("physics".into());
        match decide(&j, &policy) {
            Outcome::Reject { message, .. } => {
                assert!(message.contains("uid 1002 (account physics) may not"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        // Jobs without the flag are nobody's business here.
        assert_eq!(decide(&job(None, Some("gres:gpu:1")), &policy), Outcome::Untouched);
    }

    #[test]
    fn updates_of_a_multiplexed_job_stay_within_what_submission_allows() {
        let tag = Some("multiplex:app=bert");
        let update = |f: &dyn Fn(&mut JobView)| {
            let mut u = JobView::default();
            f(&mut u);
            u
        };
        let cases: Vec<(JobView, Option<&str>, Option<RejectKind>, &str)> = vec![
            (
                update(&|_| {}),
                tag,
                None,
                "a time limit or a name changes nothing here",
            ),
            (
                update(&|u| u.partition = Some("gpu-shared-long".into())),
                tag,
                None,
                "another shared partition",
            ),
            (
                update(&|u| u.tres_per_node = Some("gres:mps:100".into())),
                tag,
                None,
                "within max_gpus",
            ),
            (
                update(&|u| u.partition = Some("gpu".into())),
                tag,
                Some(RejectKind::SharedPartition),
                "stays in the shared partitions (gpu-shared, gpu-shared-long), not gpu",
            ),
            (
                update(&|u| u.tres_per_node = Some("gres:gpu:1".into())),
                tag,
                Some(RejectKind::MixedGres),
                "holds mps slots, not whole GPUs",
            ),
            (
                update(&|u| u.tres_per_job = Some("gres/mps:150".into())),
                tag,
                Some(RejectKind::TooManyGpus),
                "at most 100 mps here, not 150",
            ),
            (
                // 2^64 - 1 + 2 wraps round to 1 in unchecked arithmetic.
                update(&|u| u.tres_per_node = Some("gres/mps:18446744073709551615,gres/mps:2".into())),
                tag,
                Some(RejectKind::TooManyGpus),
                "not more than can be counted",
            ),
            (
                update(&|u| u.exclusive = true),
                tag,
                Some(RejectKind::Exclusive),
                "cannot be made --exclusive",
            ),
            (
                update(&|u| u.min_nodes = Some(2)),
                tag,
                Some(RejectKind::TooManyNodes),
                "cannot be given 2",
            ),
            (
                update(&|u| {
                    u.partition = Some("gpu".into());
                    u.admin_comment = Some("moved out by hand".into());
                }),
                tag,
                None,
                "an admin dropping the tag takes the job out of multiplexing",
            ),
            (
                update(&|u| u.partition = Some("gpu".into())),
                None,
                None,
                "a plain job moves where it likes",
            ),
            (
                update(&|u| u.partition = Some("gpu-shared".into())),
                Some("ticket 42"),
                Some(RejectKind::SharedPartition),
                "partition gpu-shared is for jobs that share GPUs",
            ),
        ];
        for (u, tag, want, why) in cases {
            match (check_modify(&u, tag, &site(), false), want) {
                (Ok(ModifyOk::AsAsked), None) => {}
                (Err((kind, message)), Some(k)) => {
                    assert_eq!(kind, k, "{message}");
                    assert!(
                        message.starts_with("multiplex: ") && message.contains(why),
                        "{message:?} lacks {why:?}"
                    );
                }
                (got, _) => panic!("{why}: got {got:?}, wanted {want:?}"),
            }
        }
    }
}
