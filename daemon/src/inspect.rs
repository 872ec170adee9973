//! What the daemon and its history know, in words for people: the text of `multiplexd
//! status`, `history` and `explain`, and wait statuses. (The queries are the history's: see
//! [`crate::history::exchange`] and [`crate::history::explain`].)

use crate::history::{Explanation, Export, History, HistoryError};
use multiplex_protocol::NodeStatus;

/// A node's [`NodeStatus`] as the text `multiplexd status` prints: one line per GPU.
pub struct StatusText<'a>(pub &'a NodeStatus);

impl std::fmt::Display for StatusText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let status = self.0;
        writeln!(f, "node {} ({} jobs per GPU)", status.node, status.jobs_per_gpu)?;
        writeln!(f, "{:<4} {:<16} {:>11}  jobs", "GPU", "model", "memory")?;
        for g in &status.gpus {
            let jobs: Vec<String> = g.tasks.iter().map(|t| format!("{} ({})", t.job_id, t.app)).collect();
            let jobs = if jobs.is_empty() {
                "-".to_string()
            } else {
                jobs.join(", ")
            };
            writeln!(f, "{:<4} {:<16} {:>7} MiB  {}", g.index, g.model, g.memory_mb, jobs)?;
        }
        Ok(())
    }
}

/// What a history learned ([`Export`]) as the text `multiplexd history` prints: solo runtimes,
/// then pair speeds.
pub struct HistoryText<'a>(pub &'a Export);

impl std::fmt::Display for HistoryText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let data = self.0;
        writeln!(f, "solo runtimes ({})", data.solo.len())?;
        writeln!(f, "{:<10} {:<32} {:>12} {:>6}", "model", "app", "runtime s", "runs")?;
        for s in &data.solo {
            writeln!(
                f,
                "{:<10} {:<32} {:>12.1} {:>6}",
                s.gpu_model, s.app, s.runtime_s, s.runs
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "pair speeds ({}): APP's speed beside OTHER, and OTHER's beside APP",
            data.pairs.len()
        )?;
        writeln!(
            f,
            "{:<10} {:<24} {:<24} {:>6} {:>6} {:>5} {:>4}",
            "model", "app", "other", "speed", "other", "obs", "oom"
        )?;
        for p in &data.pairs {
            writeln!(
                f,
                "{:<10} {:<24} {:<24} {:>6.2} {:>6.2} {:>5} {:>4}",
                p.gpu_model,
                p.app,
                p.other,
                p.speed,
                p.other_speed,
                p.observations,
                if p.oom { "yes" } else { "" }
            )?;
        }
        Ok(())
    }
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
        if let Some(m) = e.mem_mb {
            writeln!(f, "GPU memory it asked for: {m} MiB")?;
        }
        self.times(f)?;
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

impl ExplanationText<'_> {
    /// How long the job ran, how it ended, and whom it shared with for how long.
    fn times(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = self.0;
        let shared: f64 = e.partners.iter().map(|p| p.seconds).sum();
        // One precision for every duration of the job, so that the parts add up to the whole.
        let total = e.finished_at.map_or(e.seconds_alone + shared, |end| end - e.started_at);
        let secs = |x: f64| {
            // Never "-0.0 s": a sum of no f64 is -0.0, and clocks may step back a little.
            let x = x.max(0.0) + 0.0;
            if total < 100.0 {
                format!("{x:.1} s")
            } else {
                format!("{x:.0} s")
            }
        };
        let parts = format!("{} alone, {} beside others", secs(e.seconds_alone), secs(shared));
        match (e.finished_at, e.exit_status) {
            (None, _) => writeln!(f, "still running, for {} so far ({parts})", secs(total))?,
            (Some(_), Some(x)) => {
                let how = exit_text(x);
                let with = if how.starts_with("killed") { "," } else { " with" };
                writeln!(f, "ended after {}{with} {how} ({parts})", secs(total))?
            }
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

/// A job as the history explains it: for the tools and for the daemon's `Explain` answer.
pub struct Explained {
    /// The job's user, where the history recorded one.
    pub owner: Option<u32>,
    pub text: String,
    pub json: serde_json::Value,
}

/// What the history says of job `job_id`: why it ran where it did; `None` when the history
/// has nothing on it.
pub fn explained(h: &History, job_id: u32) -> Result<Option<Explained>, HistoryError> {
    let to_json = |v: Result<serde_json::Value, serde_json::Error>| {
        v.unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }))
    };
    let Some(e) = h.explain(job_id)? else {
        return Ok(None);
    };
    Ok(Some(Explained {
        owner: h.job_owner(job_id)?,
        text: ExplanationText(&e).to_string(),
        json: to_json(serde_json::to_value(&e)),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Corunner, PairRow, Partner};

    fn explanation() -> Explanation {
        Explanation {
            job_id: 12,
            node: "n2".into(),
            app: "bert".into(),
            gpu: 1,
            gpu_model: "v100".into(),
            decision: "GPU 1: alone".into(),
            predicted_speed: 1.0,
            mem_mb: None,
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
        long.mem_mb = Some(12288);
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
        assert!(text.contains("\nGPU memory it asked for: 12288 MiB\n"), "{text}");
        // Alone all along: no partner's seconds to add up (a sum of none is -0.0 in Rust).
        let mut alone = explanation();
        alone.partners.clear();
        alone.seconds_alone = 28.0;
        alone.exit_status = Some(0);
        let text = ExplanationText(&alone).to_string();
        assert!(
            text.contains("ended after 28.0 s with exit code 0 (28.0 s alone, 0.0 s beside others)"),
            "{text}"
        );
    }

    #[test]
    fn wait_statuses_in_words() {
        assert_eq!(exit_text(0), "exit code 0");
        assert_eq!(exit_text(256), "exit code 1");
        assert_eq!(exit_text(9), "killed by signal 9");
        assert_eq!(exit_text(-1), "status -1");
    }
}
