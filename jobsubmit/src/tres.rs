//! Slurm's TRES strings (`gres:gpu:tesla:2,gres/shard:1`) as entries.

/// One entry of a TRES string such as `gres:gpu:tesla:2` or `gres/gpu:2`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TresEntry {
    /// `:` (22.05) or `/` (23.11+) after `gres`; `None` for entries that are not gres.
    pub(crate) sep: Option<char>,
    pub(crate) name: String,
    /// The type between the name and the count (`tesla` of `gres:gpu:tesla:2`).
    pub(crate) kind: Option<String>,
    /// The entry as written, for entries kept unchanged.
    pub(crate) text: String,
    pub(crate) count: u64,
}

/// The sum of `counts`, or `None` past `u64::MAX`.
pub(crate) fn checked_sum(counts: impl Iterator<Item = u64>) -> Option<u64> {
    counts.into_iter().try_fold(0u64, |total, n| total.checked_add(n))
}

pub(crate) fn parse_tres(s: &str) -> Vec<TresEntry> {
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
            let parts: Vec<&str> = rest.split(':').collect();
            let name = parts[0].to_string();
            let last = parts[parts.len() - 1];
            let count = if parts.len() > 1 { last.parse().unwrap_or(1) } else { 1 };
            // `gpu:tesla:2`, or `gpu:tesla` (a count of 1).
            let kind = match parts[..] {
                [_, k, _] => Some(k.to_string()),
                [_, k] if k.parse::<u64>().is_err() => Some(k.to_string()),
                _ => None,
            };
            TresEntry {
                sep,
                name,
                kind,
                text: e.to_string(),
                count,
            }
        })
        .collect()
}

pub(crate) fn join(entries: impl Iterator<Item = String>) -> Option<String> {
    let v: Vec<String> = entries.collect();
    if v.is_empty() {
        None
    } else {
        Some(v.join(","))
    }
}

pub(crate) fn is_gpu(e: &TresEntry) -> bool {
    e.sep.is_some() && e.name == "gpu"
}
