//! A job without `--multiplex` that asks for a GPU model (`--gres=gpu:v100:1`,
//! `--gpus=v100:1`) on nodes where each shared GPU has a gres Type of its own (`v100_0`,
//! `v100_1`: what a claim pins a job to). Slurm matches a requested type to a configured one
//! exactly, so it would refuse such a job ("Requested node configuration is not available").
//! job_submit asks for the same GPUs untyped instead, with the model as a node feature (which
//! `multiplexd node-config` gives each node), and tags the job; a step that asks for the model
//! again (srun in the job, or srun making the job) would find no GPU of type `v100` in its
//! job, so the SPANK plugin in srun asks for its GPUs untyped too.

/// The admin comment tag of a job whose GPU model job_submit turned into a node feature.
pub const TAG_PREFIX: &str = "multiplex-model:";

/// The SPANK job-environment variable by which srun making a job without `--multiplex` tells
/// job_submit the model it took off its GPU asks (the asks themselves stay, untyped).
pub const SRUN_MODEL_ENV: &str = "MULTIPLEX_SRUN_MODEL";

/// The tag of a job whose GPUs of `model` are asked for untyped.
pub fn tag(model: &str) -> String {
    format!("{TAG_PREFIX}{model}")
}

/// The model of a job tagged by [`tag`], from its admin comment (the tag comes first).
pub fn tagged(admin_comment: Option<&str>) -> Option<&str> {
    let rest = admin_comment?.trim_start().strip_prefix(TAG_PREFIX)?;
    rest.split_whitespace().next().filter(|m| !m.is_empty())
}

/// One GPU ask as srun's and sbatch's `--gpus*` options write it, `[MODEL:]COUNT`: its model
/// and count (`None` model: untyped). `None`: not that form.
pub fn split_ask(ask: &str) -> Option<(Option<&str>, &str)> {
    match ask.split(':').collect::<Vec<_>>()[..] {
        [count] if is_count(count) => Some((None, count)),
        [model, count] if !model.is_empty() && !is_count(model) && is_count(count) => Some((Some(model), count)),
        _ => None,
    }
}

fn is_count(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// A gres entry (`gpu:v100:2`, `gres:gpu:v100:2`, `gres/gpu:v100`) asking for GPUs of a
/// model: the model, and the entry without it (`gres:gpu:2`; a missing count is 1). `None`
/// for an untyped entry or one that is not a GPU.
pub fn untyped_entry(entry: &str) -> Option<(&str, String)> {
    let (prefix, rest) = ["gres:", "gres/"]
        .iter()
        .find_map(|p| entry.strip_prefix(p).map(|r| (*p, r)))
        .unwrap_or(("", entry));
    let rest = rest.strip_prefix("gpu:")?;
    let (model, count) = match rest.split(':').collect::<Vec<_>>()[..] {
        [model] if !is_count(model) => (model, "1"),
        [model, count] if !is_count(model) && is_count(count) => (model, count),
        _ => return None,
    };
    (!model.is_empty()).then(|| (model, format!("{prefix}gpu:{count}")))
}

/// srun's GPU options (the values of [`crate::srun::OPTIONS`], as `slurm_option_get` returns
/// them) with their one model taken off: the model, and each option to set again with its new
/// value (`gres` without its `gres:` prefixes, which srun adds itself). `None` where no option
/// names a model, or where they name several (left as given: job_submit says why).
pub fn untyped_asks(values: &[Option<String>; 7]) -> Option<(String, Vec<(&'static str, String)>)> {
    let names = &crate::srun::OPTIONS;
    let set = |i: usize| values[i].as_deref().map(str::trim).filter(|v| !v.is_empty());
    let mut models: Vec<&str> = Vec::new();
    let mut changes = Vec::new();
    if let Some(gres) = set(0) {
        let mut typed = false;
        let bare: Vec<String> = gres
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let e = e.strip_prefix("gres:").or_else(|| e.strip_prefix("gres/")).unwrap_or(e);
                match untyped_entry(e) {
                    Some((m, untyped)) => {
                        models.push(m);
                        typed = true;
                        untyped
                    }
                    None => e.to_string(),
                }
            })
            .collect();
        if typed {
            changes.push((names[0], bare.join(",")));
        }
    }
    // gpus, gpus-per-node, gpus-per-task, gpus-per-socket: `[MODEL:]COUNT`.
    for (i, name) in names.iter().enumerate().take(5).skip(1) {
        if let Some((Some(m), count)) = set(i).and_then(split_ask) {
            models.push(m);
            changes.push((*name, count.to_string()));
        }
    }
    models.sort_unstable();
    models.dedup();
    match models[..] {
        [m] => Some((m.to_string(), changes)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tag_names_the_model_and_nothing_else_passes_for_it() {
        assert_eq!(tagged(Some(&tag("v100"))), Some("v100"));
        assert_eq!(tagged(Some("multiplex-model:a100 admin text")), Some("a100"));
        assert_eq!(tagged(Some("multiplex:app=x")), None);
        assert_eq!(tagged(Some("note multiplex-model:v100")), None);
        assert_eq!(tagged(Some("multiplex-model:")), None);
        assert_eq!(tagged(None), None);
    }

    #[test]
    fn asks_and_entries_lose_their_model_and_keep_their_count() {
        assert_eq!(split_ask("v100:2"), Some((Some("v100"), "2")));
        assert_eq!(split_ask("2"), Some((None, "2")));
        assert_eq!(split_ask("v100"), None);
        assert_eq!(split_ask("v100:a:2"), None);
        assert_eq!(untyped_entry("gres:gpu:v100:2"), Some(("v100", "gres:gpu:2".into())));
        assert_eq!(untyped_entry("gres/gpu:v100"), Some(("v100", "gres/gpu:1".into())));
        assert_eq!(untyped_entry("gpu:a100:1"), Some(("a100", "gpu:1".into())));
        assert_eq!(untyped_entry("gres:gpu:2"), None);
        assert_eq!(untyped_entry("gres:shard:v100:1"), None);
        assert_eq!(untyped_entry("gres:gpu:v100:x"), None);
    }

    fn values(pairs: &[(&str, &str)]) -> [Option<String>; 7] {
        let mut v: [Option<String>; 7] = Default::default();
        for (name, value) in pairs {
            v[crate::srun::OPTIONS.iter().position(|o| o == name).unwrap()] = Some(value.to_string());
        }
        v
    }

    #[test]
    fn sruns_options_of_one_model_are_set_again_without_it() {
        let (m, changes) = untyped_asks(&values(&[
            ("gres", "gres:tmpdisk:10,gres:gpu:v100:2"),
            ("gpus-per-task", "v100:1"),
            ("cpus-per-gpu", "4"),
        ]))
        .unwrap();
        assert_eq!(m, "v100");
        assert_eq!(
            changes,
            [
                ("gres", "tmpdisk:10,gpu:2".to_string()),
                ("gpus-per-task", "1".to_string())
            ]
        );
        let (_, changes) = untyped_asks(&values(&[("gpus", "v100:1"), ("gpus-per-node", "2")])).unwrap();
        assert_eq!(changes, [("gpus", "1".to_string())]);
        // Untyped, none, or two models: left as given.
        assert_eq!(untyped_asks(&values(&[("gres", "gres/gpu:1"), ("gpus", "2")])), None);
        assert_eq!(untyped_asks(&values(&[])), None);
        assert_eq!(
            untyped_asks(&values(&[("gpus", "v100:1"), ("gres", "gres:gpu:a100:1")])),
            None
        );
    }
}
