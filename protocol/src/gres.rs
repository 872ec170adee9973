//! What Slurm says of a job's GPUs, read alike by the SPANK plugin (from slurmctld's job
//! record) and by the daemon (from `scontrol show job -d`).

/// The index of the GPU an allocation's gres detail names, as `scontrol show job -d` prints
/// it after `GRES=`: `shard:1(IDX:1)`, `shard:v100_1:1(IDX:1)` (22.05), or per GPU the shards
/// taken of those it has, `shard:1(0/2,1/2)` (24.11): the first GPU it names.
pub fn gpu_of_detail(detail: &str) -> Option<u32> {
    let inside = detail.split_once('(')?.1.trim_end_matches(')');
    if let Some(idx) = inside.strip_prefix("IDX:") {
        return idx.split([',', '-']).next()?.parse().ok();
    }
    inside
        .split(',')
        .position(|used| {
            used.split('/')
                .next()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| n > 0)
        })
        .map(|i| i as u32)
}

/// The gres type that names GPU `index`, a `model`, to Slurm: `v100_1` (a Type per GPU in
/// gres.conf and slurm.conf, which the claimer pins a job to).
pub fn gpu_type(model: &str, index: u32) -> String {
    format!("{model}_{index}")
}

/// A GPU's gres type and its place in the model's naming: `v100_1` is GPU 1, a `v100`.
pub fn split_gpu_type(kind: &str) -> Option<(&str, u32)> {
    let (model, index) = kind.rsplit_once('_')?;
    let index = index.parse().ok()?;
    (!model.is_empty()).then_some((model, index))
}

/// The type of a gres request's first item, with or without Slurm's `gres:`/`gres/` prefix:
/// `v100_1` of `shard:v100_1:1` or `gres/shard:v100_1:1`; `None` for `shard:1`.
pub fn type_of(gres: &str) -> Option<&str> {
    let first = gres.split(',').next()?;
    let first = first
        .strip_prefix("gres:")
        .or_else(|| first.strip_prefix("gres/"))
        .unwrap_or(first);
    let mut parts = first.split(':');
    parts.next()?;
    let second = parts.next()?;
    parts.next().map(|_| second)
}

#[cfg(test)]
mod tests {
    use super::gpu_of_detail;

    #[test]
    fn the_gpu_of_either_releases_detail() {
        assert_eq!(gpu_of_detail("shard:1(IDX:1)"), Some(1));
        assert_eq!(gpu_of_detail("shard:v100_0:1(IDX:0)"), Some(0));
        assert_eq!(gpu_of_detail("shard:1(0/2,1/2)"), Some(1));
        assert_eq!(gpu_of_detail("shard:1(IDX:N/A)"), None);
        assert_eq!(gpu_of_detail("shard:1"), None);
    }
}
