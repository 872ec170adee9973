//! The site's multiplexing policy, a TOML file read when slurmctld loads the plugin.

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Where the policy is read from unless `MULTIPLEX_JOB_SUBMIT_CONF` names another file.
pub const DEFAULT_PATH: &str = "/etc/slurm/job_submit_multiplex.toml";

/// The variable (in slurmctld's environment) that overrides [`DEFAULT_PATH`].
pub const PATH_ENV: &str = "MULTIPLEX_JOB_SUBMIT_CONF";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    partition: Option<String>,
    gres: Option<String>,
    max_gpus: Option<u32>,
}

/// What the rewrite needs to know about the site.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// The partition of shared GPUs multiplexed jobs go to.
    pub partition: String,
    /// The gres that stands for one slot of a shared GPU.
    pub gres: String,
    /// Most GPUs a multiplexed job may ask for.
    pub max_gpus: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            partition: "shared".into(),
            gres: "shard".into(),
            max_gpus: 1,
        }
    }
}

impl Policy {
    /// Parses policy text; the error carries TOML's line and column.
    pub fn parse(text: &str) -> Result<Policy, String> {
        let raw: RawPolicy = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        let d = Policy::default();
        let policy = Policy {
            partition: raw.partition.unwrap_or(d.partition),
            gres: raw.gres.unwrap_or(d.gres),
            max_gpus: raw.max_gpus.unwrap_or(d.max_gpus),
        };
        if policy.partition.is_empty() || policy.partition.contains(',') {
            return Err(format!(
                "partition = {:?}: must be one partition name",
                policy.partition
            ));
        }
        if policy.gres.is_empty() || policy.gres.contains([':', ',', '/']) {
            return Err(format!(
                "gres = {:?}: must be a gres name such as \"shard\"",
                policy.gres
            ));
        }
        if policy.max_gpus == 0 {
            return Err("max_gpus = 0: must be at least 1".into());
        }
        Ok(policy)
    }

    /// The policy file's path: `MULTIPLEX_JOB_SUBMIT_CONF` or [`DEFAULT_PATH`].
    pub fn path() -> PathBuf {
        std::env::var_os(PATH_ENV).map_or_else(|| PathBuf::from(DEFAULT_PATH), PathBuf::from)
    }

    /// Reads the policy at `path`. A missing file means the defaults (`Ok(None)` tells the
    /// caller to say so); an unreadable or invalid one is an error naming the file.
    pub fn load(path: &Path) -> Result<Option<Policy>, String> {
        match std::fs::read_to_string(path) {
            Ok(text) => Policy::parse(&text)
                .map(Some)
                .map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_file_parses() {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/job_submit_multiplex.toml")).unwrap();
        assert_eq!(Policy::parse(&text).unwrap(), Policy::default());
    }

    #[test]
    fn bad_policies_are_named() {
        for (text, want) in [
            ("partitions = \"x\"", "unknown field `partitions`"),
            ("partition = \"a,b\"", "one partition name"),
            ("gres = \"gpu:1\"", "gres name"),
            ("max_gpus = 0", "at least 1"),
            ("max_gpus = -1", "invalid value"),
            ("\n\nmax_gpus = ", "line 3"),
        ] {
            let err = Policy::parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }

    #[test]
    fn missing_file_means_defaults() {
        assert_eq!(Policy::load(Path::new("/nonexistent/policy.toml")), Ok(None));
    }
}
