//! A job without `--multiplex` that asks for a GPU model the site shares (one of the policy's
//! `models`): each such GPU has a gres Type of its own (`v100_0`), which Slurm matches exactly,
//! so the job's GPUs are asked for untyped and the model becomes a node feature
//! (`multiplex_protocol::model`). Where srun making the job already took the model off its
//! asks (so that its step asks untyped as well), it says which in the job's SPANK environment:
//! the model becomes the feature as above, or, for a model the site does not share, goes back
//! into the job's request as given.

use crate::policy::Policy;
use crate::view::{refuse, JobView, RejectKind};
use multiplex_protocol::{model, srun};

/// The new values of the fields a job's GPU model changes.
#[derive(Debug, Clone, PartialEq)]
pub struct PlainGpus {
    pub tres_per_node: Option<String>,
    pub tres_per_job: Option<String>,
    pub tres_per_task: Option<String>,
    pub tres_per_socket: Option<String>,
    /// Its `--constraint` with the model's feature (`None`: unchanged).
    pub features: Option<String>,
    /// Its admin comment with the model's tag first (`None`: unchanged).
    pub admin_comment: Option<String>,
    /// The model asked for.
    pub model: String,
}

/// What changes in `job` (one without `--multiplex`) for the GPU model it asks for;
/// `Ok(None)`: nothing.
pub fn untyped(job: &JobView, policy: &Policy) -> Result<Option<PlainGpus>, (RejectKind, String)> {
    let prefix = format!("{}=", model::SRUN_MODEL_ENV);
    let from_srun = job.spank_env.iter().find_map(|e| e.strip_prefix(&prefix));
    if policy.models.is_empty() && from_srun.is_none() {
        return Ok(None);
    }
    let fields = [
        &job.tres_per_node,
        &job.tres_per_job,
        &job.tres_per_task,
        &job.tres_per_socket,
    ];
    let (untyped, mut models) = without_models(&fields);
    if let Some(m) = from_srun {
        if multiplex_protocol::spec::parse_app(m).is_err() {
            return Err(refuse(
                RejectKind::BadOption,
                format!("{:?} is not a GPU model srun could have passed on", srun::cut(m)),
            ));
        }
        models.push(m);
    }
    models.sort_unstable();
    models.dedup();
    let shared: Vec<&str> = models
        .iter()
        .copied()
        .filter(|m| policy.models.iter().any(|p| p == m))
        .collect();
    match (&shared[..], &models[..], from_srun) {
        ([], _, None) => Ok(None),
        // srun took off a model nobody shares: the job asks for it as the user wrote it.
        ([], [m], Some(_)) => Ok(Some(retyped(&fields, m))),
        ([m], [_], _) => Ok(Some(PlainGpus {
            tres_per_node: untyped[0].clone(),
            tres_per_job: untyped[1].clone(),
            tres_per_task: untyped[2].clone(),
            tres_per_socket: untyped[3].clone(),
            features: Some(with_feature(job.features.as_deref(), m)),
            admin_comment: Some(tagged(job.admin_comment.as_deref(), m)),
            model: m.to_string(),
        })),
        _ => Err(refuse(
            RejectKind::UnknownModel,
            format!(
                "this job asks for GPUs of {} models ({}); where GPUs are shared each has a gres type of its own, \
                 and a job without --multiplex asks for one model (submit one job per model)",
                models.len(),
                quoted(&models)
            ),
        )),
    }
}

/// The models a job named, for a sentence: the first four, each cut short (the user wrote them).
fn quoted(models: &[&str]) -> String {
    let mut named: Vec<String> = models.iter().take(4).map(|m| srun::cut(m)).collect();
    if models.len() > 4 {
        named.push("...".into());
    }
    named.join(", ")
}

/// The four TRES fields with the models taken off their GPU entries, and those models.
fn without_models<'a>(fields: &[&'a Option<String>; 4]) -> (Vec<Option<String>>, Vec<&'a str>) {
    let mut models: Vec<&str> = Vec::new();
    let untyped = fields
        .iter()
        .map(|f| {
            let entries = f.as_deref()?.split(',').map(str::trim).filter(|e| !e.is_empty());
            let out: Vec<String> = entries
                .map(|e| match model::untyped_entry(e) {
                    Some((m, bare)) => {
                        models.push(m);
                        bare
                    }
                    None => e.to_string(),
                })
                .collect();
            (!out.is_empty()).then(|| out.join(","))
        })
        .collect();
    (untyped, models)
}

/// `job` with `model` back on its untyped GPU entries (srun took it off for its step).
fn retyped(fields: &[&Option<String>; 4], model: &str) -> PlainGpus {
    let retype = |f: &Option<String>| -> Option<String> {
        let entries = f.as_deref()?.split(',').map(str::trim).filter(|e| !e.is_empty());
        let out: Vec<String> = entries
            .map(|e| {
                let count = ["gres:gpu:", "gres/gpu:", "gpu:"]
                    .iter()
                    .find_map(|p| e.strip_prefix(p).map(|c| (&e[..p.len()], c)));
                match count {
                    Some((prefix, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                        format!("{prefix}{model}:{n}")
                    }
                    _ => e.to_string(),
                }
            })
            .collect();
        (!out.is_empty()).then(|| out.join(","))
    };
    PlainGpus {
        tres_per_node: retype(fields[0]),
        tres_per_job: retype(fields[1]),
        tres_per_task: retype(fields[2]),
        tres_per_socket: retype(fields[3]),
        features: None,
        admin_comment: None,
        model: model.to_string(),
    }
}

/// A `--constraint` with `model` added: `model`, `A&B&model`, `(A|B)&model`.
fn with_feature(features: Option<&str>, model: &str) -> String {
    match features.map(str::trim).filter(|f| !f.is_empty()) {
        None => model.to_string(),
        Some(f) if f.contains('|') && !f.contains('[') => format!("({f})&{model}"),
        Some(f) => format!("{f}&{model}"),
    }
}

/// The admin comment with the model's tag first (an earlier tag replaced).
fn tagged(admin_comment: Option<&str>, model: &str) -> String {
    let tag = model::tag(model);
    match admin_comment.map(str::trim).filter(|c| !c.is_empty()) {
        Some(c) if c.starts_with(model::TAG_PREFIX) => match c.split_once(' ') {
            Some((_, rest)) => format!("{tag} {rest}"),
            None => tag,
        },
        Some(c) => format!("{tag} {c}"),
        None => tag,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::{decide, Outcome};

    fn site() -> Policy {
        Policy {
            models: vec!["v100".into()],
            ..Policy::default()
        }
    }

    fn gpus(j: &JobView, p: &Policy) -> PlainGpus {
        match decide(j, p) {
            Outcome::Plain {
                exc_nodes: None,
                gpus: Some(g),
            } => *g,
            other => panic!("{j:?}: {other:?}"),
        }
    }

    #[test]
    fn every_way_of_asking_for_a_shared_model_becomes_an_untyped_count_and_its_feature() {
        type Field = fn(&mut JobView) -> &mut Option<String>;
        let cases: [(Field, &str, &str); 5] = [
            (|j| &mut j.tres_per_node, "gres:gpu:v100:2", "gres:gpu:2"), // --gres, --gpus-per-node (22.05)
            (|j| &mut j.tres_per_job, "gres:gpu:v100:1", "gres:gpu:1"),  // --gpus
            (|j| &mut j.tres_per_task, "gres/gpu:v100:1", "gres/gpu:1"), // --gpus-per-task (24.11)
            (|j| &mut j.tres_per_socket, "gres:gpu:v100", "gres:gpu:1"), // a count of one left out
            (
                |j| &mut j.tres_per_node,
                "gres:tmpdisk:10,gres:gpu:v100:1",
                "gres:tmpdisk:10,gres:gpu:1",
            ),
        ];
        for (field, asked, untyped) in cases {
            let mut j = JobView::default();
            *field(&mut j) = Some(asked.into());
            let g = gpus(&j, &site());
            let mut got = JobView {
                tres_per_node: g.tres_per_node.clone(),
                tres_per_job: g.tres_per_job.clone(),
                tres_per_task: g.tres_per_task.clone(),
                tres_per_socket: g.tres_per_socket.clone(),
                ..JobView::default()
            };
            assert_eq!(field(&mut got).as_deref(), Some(untyped), "{asked}");
            assert_eq!(g.features.as_deref(), Some("v100"));
            assert_eq!(g.admin_comment.as_deref(), Some("multiplex-model:v100"));
            assert_eq!(
                multiplex_protocol::model::tagged(g.admin_comment.as_deref()),
                Some("v100")
            );
        }
    }

    #[test]
    fn the_users_constraint_and_admin_comment_are_kept() {
        let mut j = JobView {
            tres_per_job: Some("gres:gpu:v100:1".into()),
            features: Some("ib&avx512".into()),
            admin_comment: Some("set by an admin".into()),
            ..JobView::default()
        };
        let g = gpus(&j, &site());
        assert_eq!(g.features.as_deref(), Some("ib&avx512&v100"));
        assert_eq!(g.admin_comment.as_deref(), Some("multiplex-model:v100 set by an admin"));
        j.features = Some("ib|opa".into());
        j.admin_comment = Some("multiplex-model:a100 set by an admin".into());
        let g = gpus(&j, &site());
        assert_eq!(g.features.as_deref(), Some("(ib|opa)&v100"));
        assert_eq!(g.admin_comment.as_deref(), Some("multiplex-model:v100 set by an admin"));
        j.features = Some("[rack1|rack2]".into());
        assert_eq!(gpus(&j, &site()).features.as_deref(), Some("[rack1|rack2]&v100"));
    }

    #[test]
    fn models_the_site_does_not_share_and_untyped_asks_are_left_alone() {
        for (asked, policy) in [
            ("gres:gpu:a100:1", site()),
            ("gres:gpu:1", site()),
            ("gres:gpu:v100:1", Policy::default()), // no models named: none is typed per GPU
        ] {
            let j = JobView {
                tres_per_node: Some(asked.into()),
                ..JobView::default()
            };
            assert_eq!(decide(&j, &policy), Outcome::Untouched, "{asked}");
        }
    }

    #[test]
    fn two_models_at_once_are_refused_with_the_reason() {
        let j = JobView {
            tres_per_node: Some("gres:gpu:v100:1".into()),
            tres_per_job: Some("gres:gpu:a100:1".into()),
            ..JobView::default()
        };
        match decide(&j, &site()) {
            Outcome::Reject { kind, message } => {
                assert_eq!(kind, RejectKind::UnknownModel);
                assert!(message.contains("2 models (a100, v100)"), "{message}");
                assert!(message.contains("one job per model"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_model_srun_took_off_becomes_the_feature_or_goes_back_where_nobody_shares_it() {
        let srun = |model: &str| JobView {
            spank_env: vec![format!("{}={model}", model::SRUN_MODEL_ENV)],
            tres_per_job: Some("gres:gpu:2".into()),
            tres_per_task: Some("gres/gpu:1".into()),
            ..JobView::default()
        };
        let g = gpus(&srun("v100"), &site());
        assert_eq!(g.tres_per_job.as_deref(), Some("gres:gpu:2"));
        assert_eq!(g.features.as_deref(), Some("v100"));
        let g = gpus(&srun("a100"), &site());
        assert_eq!(g.tres_per_job.as_deref(), Some("gres:gpu:a100:2"));
        assert_eq!(g.tres_per_task.as_deref(), Some("gres/gpu:a100:1"));
        assert_eq!((g.features, g.admin_comment), (None, None));
        // Also where the site names no shared models at all.
        let g = gpus(&srun("a100"), &Policy::default());
        assert_eq!(g.tres_per_job.as_deref(), Some("gres:gpu:a100:2"));
        match decide(&srun("v100;x"), &site()) {
            Outcome::Reject { kind, .. } => assert_eq!(kind, RejectKind::BadOption),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_job_kept_off_shared_nodes_still_asks_for_its_model_untyped() {
        let p = Policy {
            shared_nodes: Some(Box::new(crate::policy::SharedNodes {
                list: "gpu01".into(),
                hosts: ["gpu01".to_string()].into_iter().collect(),
            })),
            ..site()
        };
        let j = JobView {
            tres_per_node: Some("gres:gpu:v100:1".into()),
            ..JobView::default()
        };
        match decide(&j, &p) {
            Outcome::Plain {
                exc_nodes: Some(e),
                gpus: Some(g),
            } => assert_eq!((e.as_str(), g.features.as_deref()), ("gpu01", Some("v100"))),
            other => panic!("{other:?}"),
        }
    }
}
