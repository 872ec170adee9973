//! Sharing what was learned between the nodes' daemons, through a directory every node can
//! read and write (a shared filesystem): every `every_s`, each daemon writes its export there
//! as `<node>.json` (written beside and renamed into place, so a reader never sees half a
//! file) and merges every other node's file that changed into its history with the same rules
//! as `multiplexd import` (an estimate resting on more observations wins, whichever order the
//! files are merged in; out-of-memory marks are kept): merged in memory, then imported in one
//! transaction with one refit, however many nodes wrote. No network protocol and no SQLite
//! file shared over NFS: whole JSON files, replaced atomically. A file that cannot be read or
//! merged is named in the log and skipped; nothing of this node's history is lost by it.
//!
//! Why: each node alone sees few of the pairs its applications form; in `multiplex-simulate`
//! (4 nodes x 4 GPUs, 1,000 jobs, load 1.0, 30 seeds) merging every 10 minutes cut the
//! learned policy's average JCT by a further 6% (7,357 s to 6,890 s) and by 36% at load 1.5
//! (see docs/notebook/2026-11-results.md, "Pooled histories").

use crate::background::Trouble;
pub use crate::config::ShareConfig;
use crate::history::{Export, Merger};
use crate::node::Node;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// What one exchange did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exchanged {
    /// Other nodes' files merged (changed since the last exchange).
    pub merged: Vec<String>,
    /// Pair estimates those files added or replaced here.
    pub pairs_changed: usize,
    /// Files that could not be read or merged, each with why.
    pub problems: Vec<String>,
}

/// The state kept between exchanges: each file's modification time and size when last merged,
/// so that unchanged files are not merged again, and what this node last wrote, so that an
/// unchanged history is not written again (every other node would merge it again).
#[derive(Debug, Default)]
pub struct Sharer {
    seen: HashMap<PathBuf, (SystemTime, u64)>,
    written: Option<String>,
}

impl Sharer {
    /// One exchange: write this node's export into `dir`, merge the others'. Fails only when
    /// this node's own file cannot be written; other nodes' files that are broken are listed in
    /// [`Exchanged::problems`].
    pub fn exchange(&mut self, node: &Mutex<Node>, dir: &Path) -> Result<Exchanged, String> {
        let (name, data) = {
            let node = node.lock().unwrap_or_else(|p| p.into_inner());
            let data = node
                .history()
                .export()
                .map_err(|e| format!("cannot export the history: {e}"))?;
            (node.name().to_string(), data)
        };
        let own = dir.join(format!("{name}.json"));
        let text = serde_json::to_string(&data).map_err(|e| e.to_string())? + "\n";
        if self.written.as_deref() != Some(text.as_str()) || !own.exists() {
            write_atomically(&own, &text)?;
            self.written = Some(text);
        }
        let mut done = Exchanged::default();
        let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json") && *p != own)
            .collect();
        files.sort();
        // Every changed file merged in memory, then imported at once: one refit per exchange
        // however many nodes wrote.
        let mut merger = Merger::default();
        let mut read = Vec::new();
        for path in files {
            let Ok(meta) = std::fs::metadata(&path) else {
                continue; // gone since it was listed
            };
            let stamp = (meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), meta.len());
            if self.seen.get(&path) == Some(&stamp) {
                continue;
            }
            match read_export(&path).and_then(|data| merger.add(&data)) {
                Ok(()) => read.push((path, stamp)),
                Err(e) => done.problems.push(format!("{}: {e}", path.display())),
            }
        }
        if read.is_empty() {
            return Ok(done);
        }
        let imported = node.lock().unwrap_or_else(|p| p.into_inner()).import(&merger.finish());
        match imported {
            Ok(changed) => {
                done.pairs_changed = changed.pairs_added + changed.pairs_replaced;
                for (path, stamp) in read {
                    done.merged.push(path.display().to_string());
                    self.seen.insert(path, stamp);
                }
            }
            // Nothing was written (one transaction): each file is tried again next exchange.
            Err(e) => done
                .problems
                .extend(read.iter().map(|(path, _)| format!("{}: {e}", path.display()))),
        }
        Ok(done)
    }
}

/// Writes `text` to `path` beside it (`<path>.partial`, a name the other nodes' daemons skip)
/// and renames it into place: a reader never sees half a file, a failed write leaves none.
pub fn write_atomically(path: &Path, text: &str) -> Result<(), String> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Another node's file, parsed.
fn read_export(path: &Path) -> Result<Export, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("not a multiplexd history export: {e}"))
}

/// Exchanges at start and every `every_s` until `shutdown`, when a directory is configured.
/// Failures are logged once per distinct message and change nothing here.
pub fn spawn(node: Arc<Mutex<Node>>, config: ShareConfig, shutdown: Arc<AtomicBool>) {
    let Some(dir) = config.dir else {
        tracing::info!("not sharing the history with other nodes (share.dir is not set)");
        return;
    };
    tracing::info!(dir = %dir.display(), every_s = config.every_s, "sharing the history with other nodes");
    let mut sharer = Sharer::default();
    let mut trouble = Trouble::default();
    let mut bad_files = Trouble::default();
    let every = Duration::from_secs(config.every_s);
    let started = crate::background::every("share", every, shutdown, move || match sharer.exchange(&node, &dir) {
        Ok(done) => {
            if trouble.recovered() {
                tracing::info!(dir = %dir.display(), "sharing the history works again");
            }
            if !done.merged.is_empty() {
                tracing::info!(
                    files = done.merged.len(),
                    pairs_changed = done.pairs_changed,
                    "merged other nodes' histories"
                );
            }
            if done.problems.is_empty() {
                bad_files.recovered();
            } else if bad_files.failed(&done.problems.join("; ")) {
                tracing::warn!(problems = %done.problems.join("; "), "skipped other nodes' history files");
            }
        }
        Err(e) => {
            if trouble.failed(&e) {
                tracing::warn!(error = %e, "cannot share the history; this node goes on learning alone");
            }
        }
    });
    if let Err(e) = started {
        tracing::error!("cannot start the history sharing thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    /// Exports travel as JSON; a learned speed must come back to the last bit, or the nodes
    /// would each hold a slightly different copy of one lesson. serde_json parses this value
    /// one unit in the last place off unless its `float_roundtrip` feature is on (seen between
    /// two daemons of the test cluster).
    #[test]
    fn a_speed_survives_json_to_the_last_bit() {
        for x in [1.0188817977905273f64, 2.0 / 3.0, 0.1, 1e-300, 0.05] {
            let back: f64 = serde_json::from_str(&serde_json::to_string(&x).unwrap()).unwrap();
            assert_eq!(back.to_bits(), x.to_bits(), "{x:e} came back as {back:e}");
        }
    }
}
