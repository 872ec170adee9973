//! `multiplex-emulate compare`: two replays side by side (plain shards, the daemons), with
//! what `multiplex-simulate` predicts for the same trace, as a table, JSON, CSV or a sentence.

use super::read;
use multiplex_simulate::Summary;
use serde_json::{json, Value};
use std::path::Path;

/// The comparison in one sentence a user reads at once.
fn verdict(p: &Summary, d: &Summary) -> String {
    let change = d.avg_jct_s / p.avg_jct_s - 1.0;
    let how = if change <= -0.005 {
        format!("finished {:.0}% sooner on average", -100.0 * change)
    } else if change >= 0.005 {
        format!("finished {:.0}% later on average", 100.0 * change)
    } else {
        "finished as soon on average".to_string()
    };
    let ran_out = |n: u64| match n {
        1 => "1 ran".to_string(),
        n => format!("{n} ran"),
    };
    let put_back = match d.put_back {
        0 => String::new(),
        1 => "; 1 job that ran out of memory beside a partner was put back in the queue by its \
              daemon and ran again"
            .to_string(),
        n => format!(
            "; {n} jobs that ran out of memory beside a partner were put back in the queue by \
             their daemons and ran again"
        ),
    };
    format!(
        "With the daemons deciding, jobs {how} ({:.0} s against {:.0} s with plain Slurm shards) \
         and {} out of GPU memory as failures their users saw, against {}{put_back}.",
        d.avg_jct_s,
        p.avg_jct_s,
        ran_out(d.oom_failures),
        p.oom_failures
    )
}

fn summary_of(path: &Path) -> Result<(Summary, Value), String> {
    let v: Value = serde_json::from_str(&read(path)?).map_err(|e| format!("{}: {e}", path.display()))?;
    let s = v
        .get("summary")
        .ok_or_else(|| format!("{}: no summary", path.display()))?;
    let get = |k: &str| s.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    Ok((
        Summary {
            policy: s.get("policy").and_then(Value::as_str).unwrap_or("?").to_string(),
            jobs: get("jobs") as usize,
            avg_jct_s: get("avg_jct_s"),
            p50_jct_s: get("p50_jct_s"),
            p95_jct_s: get("p95_jct_s"),
            makespan_s: get("makespan_s"),
            avg_wait_s: get("avg_wait_s"),
            oom_failures: get("oom_failures") as u64,
            throughput_per_gpu: get("throughput_per_gpu"),
            last_fifth_avg_jct_s: get("last_fifth_avg_jct_s"),
            p99_wait_s: get("p99_wait_s"),
            separations: get("separations") as u64,
            claims: get("claims") as u64,
            resident_failures: get("resident_failures") as u64,
            lost_work_h: get("lost_work_h"),
            put_back: get("put_back").max(0.0) as u64,
        },
        v,
    ))
}

pub(crate) fn compare(plain: &Path, daemons: &Path, simulated: Option<&Path>, format: &str) -> Result<(), String> {
    let (p, pv) = summary_of(plain)?;
    let (d, dv) = summary_of(daemons)?;
    let sim: Vec<Value> = match simulated {
        Some(path) => serde_json::from_str(&read(path)?).map_err(|e| format!("{}: {e}", path.display()))?,
        None => Vec::new(),
    };
    let sim_of = |policy: &str| {
        sim.iter()
            .find(|s| s.get("policy").and_then(Value::as_str) == Some(policy))
    };
    // The plain cluster's placement as simulated: least-loaded where its Slurm has
    // LL_SHARED_GRES (23.11+), else first-fit (tests/emulate/run simulates the one it ran).
    let base = ["least-loaded", "first-fit"]
        .into_iter()
        .find(|p| sim_of(p).is_some())
        .unwrap_or("first-fit");
    let (sp, sd) = (sim_of(base), sim_of("learned"));
    let ratio = d.avg_jct_s / p.avg_jct_s;
    let vs_sim = |run: &Summary, s: Option<&Value>| {
        s.and_then(|s| s.get("avg_jct_s"))
            .and_then(Value::as_f64)
            .map(|x| run.avg_jct_s / x - 1.0)
    };
    match format {
        "json" => {
            let out = json!({
                "plain": p,
                "daemons": d,
                "daemons_vs_plain_avg_jct": ratio,
                "simulated": { base: sp, "learned": sd },
                "plain_vs_simulated_avg_jct": vs_sim(&p, sp),
                "daemons_vs_simulated_avg_jct": vs_sim(&d, sd),
                "time_scale": dv.get("time_scale"),
                "wall_s": { "plain": pv.get("wall_s"), "daemons": dv.get("wall_s") },
            });
            println!("{}", serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?);
        }
        "table" => print_table((&p, &d), (sp, sd), base),
        "csv" => print_csv((&p, &d), (sp, sd), base),
        "words" => println!("{}", verdict(&p, &d)),
        other => return Err(format!("--format {other}: use table, json, csv or words")),
    }
    Ok(())
}

/// The two replays side by side with the simulator's predictions, as a table.
fn print_table((p, d): (&Summary, &Summary), (sp, sd): (Option<&Value>, Option<&Value>), base: &str) {
    let ratio = d.avg_jct_s / p.avg_jct_s;
    let vs_sim = |run: &Summary, s: Option<&Value>| {
        s.and_then(|s| s.get("avg_jct_s"))
            .and_then(Value::as_f64)
            .map(|x| run.avg_jct_s / x - 1.0)
    };
    let num = |v: Option<&Value>, k: &str| {
        v.and_then(|v| v.get(k))
            .and_then(Value::as_f64)
            .map_or("-".to_string(), |x| format!("{x:.0}"))
    };
    println!(
        "{:<24} {:>13} {:>10} {:>8}   {:>19} {:>17}",
        "trace seconds",
        "plain shards",
        "daemons",
        "ratio",
        format!("simulated {base}"),
        "simulated learned"
    );
    let rows: [(&str, f64, f64, &str); 5] = [
        ("average JCT", p.avg_jct_s, d.avg_jct_s, "avg_jct_s"),
        ("p50 JCT", p.p50_jct_s, d.p50_jct_s, "p50_jct_s"),
        ("p95 JCT", p.p95_jct_s, d.p95_jct_s, "p95_jct_s"),
        ("makespan", p.makespan_s, d.makespan_s, "makespan_s"),
        ("average wait", p.avg_wait_s, d.avg_wait_s, "avg_wait_s"),
    ];
    for (name, x, y, k) in rows {
        println!(
            "{name:<24} {x:>13.0} {y:>10.0} {:>8.3}   {:>19} {:>17}",
            y / x,
            num(sp, k),
            num(sd, k)
        );
    }
    let counts = [
        ("out-of-memory failures", p.oom_failures, d.oom_failures, "oom_failures"),
        ("put back (out of memory)", p.put_back, d.put_back, "put_back"),
        ("claims", p.claims, d.claims, "claims"),
        ("given back to run apart", p.separations, d.separations, "separations"),
    ];
    for (name, x, y, k) in counts {
        println!(
            "{name:<24} {x:>13} {y:>10} {:>8}   {:>19} {:>17}",
            "",
            num(sp, k),
            num(sd, k)
        );
    }
    println!("daemons vs plain shards: {:+.1}% average JCT", 100.0 * (ratio - 1.0));
    if let (Some(a), Some(b)) = (vs_sim(p, sp), vs_sim(d, sd)) {
        println!(
            "emulated vs simulated average JCT: plain {:+.1}% ({base}), daemons {:+.1}% (learned)",
            100.0 * a,
            100.0 * b
        );
    }
}

/// The two replays' headline numbers and the simulator's, as one CSV row.
fn print_csv((p, d): (&Summary, &Summary), (sp, sd): (Option<&Value>, Option<&Value>), base: &str) {
    let sim = |v: Option<&Value>, k: &str| {
        v.and_then(|v| v.get(k))
            .and_then(Value::as_f64)
            .map_or(String::new(), |x| format!("{x:.1}"))
    };
    let b = base.replace('-', "_");
    println!("plain_avg_jct_s,daemons_avg_jct_s,plain_p95_jct_s,daemons_p95_jct_s,plain_oom_failures,daemons_oom_failures,simulated_{b}_avg_jct_s,simulated_learned_avg_jct_s,simulated_{b}_oom_failures,simulated_learned_oom_failures,daemons_claims,daemons_separations,daemons_put_back");
    println!(
        "{:.1},{:.1},{:.1},{:.1},{},{},{},{},{},{},{},{},{}",
        p.avg_jct_s,
        d.avg_jct_s,
        p.p95_jct_s,
        d.p95_jct_s,
        p.oom_failures,
        d.oom_failures,
        sim(sp, "avg_jct_s"),
        sim(sd, "avg_jct_s"),
        sim(sp, "oom_failures"),
        sim(sd, "oom_failures"),
        d.claims,
        d.separations,
        d.put_back
    );
}
