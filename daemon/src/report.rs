//! What the history knows, for people and for other nodes: the pair estimates (`history`), why
//! a job got its GPU (`explain`), and `export`/`import` of what was learned, to seed a new
//! node from another.

use crate::history::{History, HistoryError};
use rusqlite::{params, OptionalExtension};
use serde::{Deserialize, Serialize};

/// One learned pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairRow {
    pub gpu_model: String,
    pub app: String,
    pub other: String,
    /// Speed of `app` beside `other`, relative to alone.
    pub speed: f64,
    /// Speed of `other` beside `app`.
    pub other_speed: f64,
    pub observations: u32,
    pub variance: Option<f64>,
    pub oom: bool,
}

/// One application's solo runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SoloRow {
    pub gpu_model: String,
    pub app: String,
    pub runtime_s: f64,
    pub runs: u32,
}

/// What `export` writes and `import` reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Export {
    /// Always [`EXPORT_FORMAT`].
    pub format: String,
    pub version: u32,
    pub solo: Vec<SoloRow>,
    pub pairs: Vec<PairRow>,
}

pub const EXPORT_FORMAT: &str = "multiplexd-history";
pub const EXPORT_VERSION: u32 = 1;

/// Who shared a job's GPU, and for how long.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Partner {
    pub job_id: u32,
    pub app: String,
    pub seconds: f64,
}

/// A job beside another, by Slurm job id and app (one whose record was compacted away is left
/// out).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Corunner {
    pub job_id: u32,
    pub app: String,
}

/// Why a job got its GPU and what came of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    pub job_id: u32,
    pub node: String,
    pub app: String,
    pub gpu: u32,
    pub gpu_model: String,
    pub decision: String,
    pub predicted_speed: f64,
    pub started_at: f64,
    pub finished_at: Option<f64>,
    pub exit_status: Option<i32>,
    pub seconds_alone: f64,
    pub partners: Vec<Partner>,
    /// The jobs beside which it reported running out of GPU memory (`multiplexd report
    /// --oom`), if it did; empty when it did not.
    pub out_of_memory_beside: Vec<Corunner>,
    /// Whether it reported running out of GPU memory.
    pub out_of_memory: bool,
    /// What the history now says of the job's application beside each partner's.
    pub learned: Vec<PairRow>,
    /// GPU telemetry (NVML), where the node has it: peak memory of the job's processes, MiB.
    pub gpu_mem_peak_mb: Option<u64>,
    /// Mean SM utilisation of the job's processes, percent.
    pub sm_util_mean_pct: Option<f64>,
}

/// What an import changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Imported {
    pub solo_added: usize,
    pub solo_replaced: usize,
    pub pairs_added: usize,
    pub pairs_replaced: usize,
    pub kept: usize,
}

fn pair_rows(history: &History, filter: &str, args: &[&dyn rusqlite::ToSql]) -> Result<Vec<PairRow>, HistoryError> {
    let sql = format!(
        "SELECT e.gpu_model, a.name, o.name, e.speed, e.other_speed, e.observations, e.variance, e.oom
         FROM pair_estimates e JOIN applications a ON a.id = e.app_id JOIN applications o ON o.id = e.other_id
         {filter} ORDER BY e.gpu_model, a.name, o.name"
    );
    let mut stmt = history.connection().prepare(&sql)?;
    let rows = stmt.query_map(args, |r| {
        Ok(PairRow {
            gpu_model: r.get(0)?,
            app: r.get(1)?,
            other: r.get(2)?,
            speed: r.get(3)?,
            other_speed: r.get(4)?,
            observations: r.get(5)?,
            variance: r.get(6)?,
            oom: r.get(7)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Every pair estimate.
pub fn pairs(history: &History) -> Result<Vec<PairRow>, HistoryError> {
    pair_rows(history, "", &[])
}

/// Every solo runtime.
pub fn solos(history: &History) -> Result<Vec<SoloRow>, HistoryError> {
    let mut stmt = history.connection().prepare(
        "SELECT s.gpu_model, a.name, s.runtime_s, s.observations FROM solo_baselines s
         JOIN applications a ON a.id = s.app_id ORDER BY s.gpu_model, a.name",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(SoloRow {
            gpu_model: r.get(0)?,
            app: r.get(1)?,
            runtime_s: r.get(2)?,
            runs: r.get(3)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Everything learned, for another node.
pub fn export(history: &History) -> Result<Export, HistoryError> {
    Ok(Export {
        format: EXPORT_FORMAT.into(),
        version: EXPORT_VERSION,
        solo: solos(history)?,
        pairs: pairs(history)?,
    })
}

/// The latest run of job `job_id` here, explained; `None` if the history has no such job.
pub fn explain(history: &History, job_id: u32) -> Result<Option<Explanation>, HistoryError> {
    let conn = history.connection();
    let row = conn
        .query_row(
            "SELECT j.id, j.node, a.name, j.gpu, j.gpu_model, j.decision, j.predicted_speed, j.started_at,
                    j.finished_at, j.exit_status, j.app_id
             FROM jobs j JOIN applications a ON a.id = j.app_id WHERE j.job_id = ?1 ORDER BY j.id DESC LIMIT 1",
            [job_id],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    Explanation {
                        job_id,
                        node: r.get(1)?,
                        app: r.get(2)?,
                        gpu: r.get(3)?,
                        gpu_model: r.get(4)?,
                        decision: r.get(5)?,
                        predicted_speed: r.get(6)?,
                        started_at: r.get(7)?,
                        finished_at: r.get(8)?,
                        exit_status: r.get(9)?,
                        seconds_alone: 0.0,
                        partners: Vec::new(),
                        out_of_memory_beside: Vec::new(),
                        out_of_memory: false,
                        learned: Vec::new(),
                        gpu_mem_peak_mb: None,
                        sm_util_mean_pct: None,
                    },
                    r.get::<_, i64>(10)?,
                ))
            },
        )
        .optional()?;
    let Some((row, mut e, app_id)) = row else {
        return Ok(None);
    };
    let end = e.finished_at;
    let mut stmt = conn.prepare(
        "SELECT p.job_id, a.name, i.started_at, i.ended_at FROM intervals i
         LEFT JOIN jobs p ON p.id = i.partner_row LEFT JOIN applications a ON a.id = i.partner_app_id
         WHERE i.job_row = ?1 ORDER BY i.started_at",
    )?;
    let rows = stmt.query_map([row], |r| {
        Ok((
            r.get::<_, Option<u32>>(0)?,
            r.get::<_, Option<String>>(1)?,
            r.get::<_, f64>(2)?,
            r.get::<_, Option<f64>>(3)?,
        ))
    })?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for r in rows {
        let (partner_job, partner_app, start, stop) = r?;
        let seconds = (stop.or(end).unwrap_or(now) - start).max(0.0);
        match partner_app {
            // job_id 0: a partner whose own record was compacted away.
            Some(a) => {
                let j = partner_job.unwrap_or(0);
                match e.partners.iter_mut().find(|p| p.job_id == j && p.app == a) {
                    Some(p) => p.seconds += seconds,
                    None => e.partners.push(Partner {
                        job_id: j,
                        app: a,
                        seconds,
                    }),
                }
            }
            None => e.seconds_alone += seconds,
        }
    }
    if let Some(rows) = conn
        .query_row(
            "SELECT partners FROM observations WHERE job_row = ?1 AND kind = 'oom' ORDER BY at DESC LIMIT 1",
            [row],
            |r| r.get::<_, String>(0),
        )
        .optional()?
    {
        e.out_of_memory = true;
        for partner in rows.split(',').filter_map(|p| p.trim().parse::<i64>().ok()) {
            let c = conn
                .query_row(
                    "SELECT j.job_id, a.name FROM jobs j JOIN applications a ON a.id = j.app_id WHERE j.id = ?1",
                    [partner],
                    |r| {
                        Ok(Corunner {
                            job_id: r.get(0)?,
                            app: r.get(1)?,
                        })
                    },
                )
                .optional()?;
            e.out_of_memory_beside.extend(c);
        }
    }
    if let Some((peak, sum, n)) = conn
        .query_row(
            "SELECT mem_peak_mb, sm_util_sum, sm_util_samples FROM job_telemetry WHERE job_row = ?1",
            [row],
            |r| Ok((r.get::<_, Option<u64>>(0)?, r.get::<_, f64>(1)?, r.get::<_, u32>(2)?)),
        )
        .optional()?
    {
        e.gpu_mem_peak_mb = peak;
        e.sm_util_mean_pct = (n > 0).then(|| sum / f64::from(n));
    }
    e.learned = pair_rows(
        history,
        "WHERE e.app_id = ?1 AND e.gpu_model = ?2",
        &[&app_id, &e.gpu_model],
    )?
    .into_iter()
    .filter(|p| e.partners.iter().any(|q| q.app == p.other))
    .collect();
    Ok(Some(e))
}

/// An [`Explanation`] as the text `multiplexd explain` prints.
pub struct ExplanationText<'a>(pub &'a Explanation);

impl std::fmt::Display for ExplanationText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = self.0;
        writeln!(
            f,
            "job {} ({}) on {} GPU {} ({})",
            e.job_id, e.app, e.node, e.gpu, e.gpu_model
        )?;
        writeln!(f, "decision: {}", e.decision)?;
        writeln!(f, "predicted speed: {:.2}", e.predicted_speed)?;
        let shared: f64 = e.partners.iter().map(|p| p.seconds).sum();
        // One precision for every duration of the job, so that the parts add up to the whole.
        let total = e.finished_at.map_or(e.seconds_alone + shared, |end| end - e.started_at);
        let secs = |x: f64| {
            if total < 100.0 {
                format!("{x:.1} s")
            } else {
                format!("{x:.0} s")
            }
        };
        let parts = format!("{} alone, {} beside others", secs(e.seconds_alone), secs(shared));
        match (e.finished_at, e.exit_status) {
            (None, _) => writeln!(f, "still running, for {} so far ({parts})", secs(total))?,
            (Some(_), Some(x)) => writeln!(f, "ended after {} with {} ({parts})", secs(total), exit_text(x))?,
            (Some(_), None) => writeln!(
                f,
                "ended after {} or less; its end was not reported ({parts})",
                secs(total)
            )?,
        }
        for p in &e.partners {
            let who = if p.job_id == 0 {
                "a job no longer in the history".to_string()
            } else {
                format!("job {}", p.job_id)
            };
            writeln!(f, "shared with {who} ({}) for {}", p.app, secs(p.seconds))?;
        }
        if e.out_of_memory {
            let beside: Vec<String> = e
                .out_of_memory_beside
                .iter()
                .map(|c| format!("{} (job {})", c.app, c.job_id))
                .collect();
            if beside.is_empty() {
                writeln!(f, "ran out of GPU memory")?;
            } else {
                writeln!(f, "ran out of GPU memory beside {}", beside.join(", "))?;
            }
        }
        if let Some(m) = e.gpu_mem_peak_mb {
            writeln!(f, "GPU memory peak: {m} MiB")?;
        }
        if let Some(u) = e.sm_util_mean_pct {
            writeln!(f, "mean SM utilisation: {u:.0}%")?;
        }
        for l in &e.learned {
            let what = if l.oom {
                "never again: they ran out of memory together".to_string()
            } else {
                format!(
                    "{:.2} (and {:.2} the other way), from {} observation{}",
                    l.speed,
                    l.other_speed,
                    l.observations,
                    if l.observations == 1 { "" } else { "s" }
                )
            };
            writeln!(f, "learned: {} beside {}: {what}", l.app, l.other)?;
        }
        Ok(())
    }
}

/// A step's wait status (as slurmstepd reports it) in words.
pub fn exit_text(status: i32) -> String {
    let signal = status & 0x7f;
    if status < 0 {
        format!("status {status}")
    } else if signal == 0 {
        format!("exit code {}", (status >> 8) & 0xff)
    } else {
        format!("killed by signal {signal}")
    }
}

/// The `NodeList` of `scontrol show job -o` output; `None` while the job has none.
pub fn node_list(scontrol: &str) -> Option<String> {
    let list = scontrol
        .split_whitespace()
        .find_map(|field| field.strip_prefix("NodeList="))?;
    (!list.is_empty() && list != "(null)").then(|| list.to_string())
}

/// Merges another node's export: a row is added when it is new here and replaces ours when it
/// rests on more observations; an out-of-memory mark is never dropped. What is known of each
/// application is then refitted, with `prior` (`policy.unknown_pair_speed`).
pub fn import(history: &mut History, data: &Export, prior: f64) -> Result<Imported, String> {
    if data.format != EXPORT_FORMAT {
        return Err(format!("not a multiplexd history export (format {:?})", data.format));
    }
    if data.version != EXPORT_VERSION {
        return Err(format!(
            "export version {} is not supported (this multiplexd reads version {EXPORT_VERSION})",
            data.version
        ));
    }
    for p in &data.pairs {
        let speed = |x: f64| x > 0.0 && x <= 1.0;
        if !speed(p.speed) || !speed(p.other_speed) {
            return Err(format!(
                "pair {} / {} on {}: speeds must be in (0, 1], not {} / {}; nothing was imported",
                p.app, p.other, p.gpu_model, p.speed, p.other_speed
            ));
        }
    }
    if let Some(s) = data.solo.iter().find(|s| s.runtime_s.is_nan() || s.runtime_s <= 0.0) {
        return Err(format!(
            "solo runtime of {} on {} must be positive, not {}; nothing was imported",
            s.app, s.gpu_model, s.runtime_s
        ));
    }
    let mut done = Imported::default();
    let sql = |e: rusqlite::Error| e.to_string();
    let tx = history.connection_mut().transaction().map_err(sql)?;
    let app = |tx: &rusqlite::Transaction, name: &str| -> rusqlite::Result<i64> {
        tx.execute(
            "INSERT INTO applications(name) VALUES (?1) ON CONFLICT(name) DO NOTHING",
            [name],
        )?;
        tx.query_row("SELECT id FROM applications WHERE name = ?1", [name], |r| r.get(0))
    };
    for s in &data.solo {
        let id = app(&tx, &s.app).map_err(sql)?;
        let have: Option<u32> = tx
            .query_row(
                "SELECT observations FROM solo_baselines WHERE gpu_model = ?1 AND app_id = ?2",
                params![s.gpu_model, id],
                |r| r.get(0),
            )
            .optional()
            .map_err(sql)?;
        match have {
            Some(n) if n >= s.runs => done.kept += 1,
            _ => {
                tx.execute(
                    "INSERT INTO solo_baselines(gpu_model, app_id, runtime_s, observations) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT(gpu_model, app_id) DO UPDATE SET runtime_s = ?3, observations = ?4",
                    params![s.gpu_model, id, s.runtime_s, s.runs],
                )
                .map_err(sql)?;
                if have.is_some() {
                    done.solo_replaced += 1;
                } else {
                    done.solo_added += 1;
                }
            }
        }
    }
    for p in &data.pairs {
        let (a, o) = (app(&tx, &p.app).map_err(sql)?, app(&tx, &p.other).map_err(sql)?);
        let have: Option<(u32, bool)> = tx
            .query_row(
                "SELECT observations, oom FROM pair_estimates WHERE gpu_model = ?1 AND app_id = ?2 AND other_id = ?3",
                params![p.gpu_model, a, o],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(sql)?;
        match have {
            Some((n, oom)) if n >= p.observations => {
                if p.oom && !oom {
                    tx.execute(
                        "UPDATE pair_estimates SET oom = 1 WHERE gpu_model = ?1 AND app_id = ?2 AND other_id = ?3",
                        params![p.gpu_model, a, o],
                    )
                    .map_err(sql)?;
                }
                done.kept += 1;
            }
            _ => {
                let oom = p.oom || have.is_some_and(|(_, oom)| oom);
                tx.execute(
                    "INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations, variance, oom)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT(gpu_model, app_id, other_id) DO UPDATE SET speed = ?4, other_speed = ?5,
                       observations = ?6, variance = ?7, oom = ?8",
                    params![p.gpu_model, a, o, p.speed, p.other_speed, p.observations, p.variance, oom],
                )
                .map_err(sql)?;
                if have.is_some() {
                    done.pairs_replaced += 1;
                } else {
                    done.pairs_added += 1;
                }
            }
        }
    }
    crate::history::refresh_app_means(&tx, None).map_err(sql)?;
    crate::history::refit_effects(&tx, prior).map_err(sql)?;
    tx.commit().map_err(sql)?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn explanation() -> Explanation {
        Explanation {
            job_id: 12,
            node: "n2".into(),
            app: "bert".into(),
            gpu: 1,
            gpu_model: "v100".into(),
            decision: "GPU 1: alone".into(),
            predicted_speed: 1.0,
            started_at: 1000.0,
            finished_at: Some(1028.0),
            exit_status: Some(256),
            seconds_alone: 27.6,
            partners: vec![Partner {
                job_id: 13,
                app: "resnet".into(),
                seconds: 0.4,
            }],
            out_of_memory_beside: vec![Corunner {
                job_id: 13,
                app: "resnet".into(),
            }],
            out_of_memory: true,
            learned: vec![PairRow {
                gpu_model: "v100".into(),
                app: "bert".into(),
                other: "resnet".into(),
                speed: 0.7,
                other_speed: 0.7,
                observations: 1,
                variance: None,
                oom: false,
            }],
            gpu_mem_peak_mb: None,
            sm_util_mean_pct: None,
        }
    }

    #[test]
    fn explain_says_what_happened_in_words_and_durations_that_add_up() {
        let text = ExplanationText(&explanation()).to_string();
        assert_eq!(
            text,
            "job 12 (bert) on n2 GPU 1 (v100)\n\
             decision: GPU 1: alone\n\
             predicted speed: 1.00\n\
             ended after 28.0 s with exit code 1 (27.6 s alone, 0.4 s beside others)\n\
             shared with job 13 (resnet) for 0.4 s\n\
             ran out of GPU memory beside resnet (job 13)\n\
             learned: bert beside resnet: 0.70 (and 0.70 the other way), from 1 observation\n"
        );
        let mut long = explanation();
        long.finished_at = None;
        long.out_of_memory = false;
        long.seconds_alone = 500.0;
        long.learned[0].observations = 3;
        long.learned[0].oom = true;
        let text = ExplanationText(&long).to_string();
        assert!(
            text.contains("still running, for 500 s so far (500 s alone, 0 s beside others)"),
            "{text}"
        );
        assert!(!text.contains("ran out of GPU memory beside"), "{text}");
        assert!(
            text.contains("learned: bert beside resnet: never again: they ran out of memory together"),
            "{text}"
        );
    }

    #[test]
    fn wait_statuses_and_node_lists_in_words() {
        assert_eq!(exit_text(0), "exit code 0");
        assert_eq!(exit_text(256), "exit code 1");
        assert_eq!(exit_text(9), "killed by signal 9");
        assert_eq!(exit_text(-1), "status -1");
        let out = "JobId=12 JobName=wrap UserId=root(0) NodeList=n2 BatchHost=n2 NumNodes=1\n";
        assert_eq!(node_list(out).as_deref(), Some("n2"));
        assert_eq!(node_list("JobId=12 NodeList=(null) ReqNodeList=(null)"), None);
        assert_eq!(node_list("JobId=12"), None);
    }
}
