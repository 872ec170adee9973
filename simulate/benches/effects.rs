//! Benchmark: how well the daemon's model of applications (`learn::fit_effects`) can predict
//! pairs never seen, as a function of how many pairs were seen, on a measured pair table.
//!
//! Each draw picks `k` pairs that can share at random and hands the fit both sides' exact
//! speeds (no noise, so this is what the model could do at best with that many pairs); the
//! error is the mean absolute difference from the table over every side not drawn. Printed
//! beside two references: the prior alone (what a node knows before any pair) and the model
//! fitted on every pair (the additive model's own floor, reached only with everything known).
//! A node of `multiplex-simulate` prints the error of its real estimates on its unseen pairs
//! at the end of a run (the `learned:` line), with the number of sides it learned: compare it
//! with the row of about half that many pairs.
//!
//! cargo bench -p multiplex-simulate --bench effects [-- TABLE.csv]

use multiplex_simulate::input::{Rng, Table, GAVEL_V100};
use multiplexd::config::DEFAULT_UNKNOWN_PAIR_SPEED;
use multiplexd::learn::{fit_effects, MIN_SPEED};

/// Draws per row.
const DRAWS: usize = 50;

fn main() {
    // `cargo bench` passes `--bench`; a table is the first argument that is not a flag.
    let path = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let table = match &path {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| format!("{p}: {e}"))
            .and_then(|t| Table::parse(&t, p)),
        None => Table::parse(GAVEL_V100, "gavel-v100 (embedded)"),
    }
    .unwrap_or_else(|e| {
        eprintln!("effects: {e}");
        std::process::exit(2)
    });
    let n = table.apps.len();
    let prior = DEFAULT_UNKNOWN_PAIR_SPEED;
    // Unordered pairs that can share, each with both sides.
    let pairs: Vec<(usize, usize)> = (0..n)
        .flat_map(|a| (a..n).map(move |b| (a, b)))
        .filter(|&(a, b)| table.speed(a, b).is_some() && table.speed(b, a).is_some())
        .collect();
    let sides = |chosen: &[(usize, usize)]| -> Vec<(usize, usize, f64)> {
        let mut v = Vec::new();
        for &(a, b) in chosen {
            v.push((a, b, table.speed(a, b).expect("can share")));
            if a != b {
                v.push((b, a, table.speed(b, a).expect("can share")));
            }
        }
        v
    };
    let all = sides(&pairs);
    // Mean absolute error of the fit on `seen` over the sides not in it, or over every side
    // with `over_seen` (the in-sample error of the fit on everything).
    let error = |seen: &[(usize, usize, f64)], over_seen: bool| -> f64 {
        let fit = fit_effects(n, seen, prior);
        let known: std::collections::HashSet<(usize, usize)> = seen.iter().map(|&(a, b, _)| (a, b)).collect();
        let (mut sum, mut count) = (0.0, 0usize);
        for &(a, b, truth) in &all {
            if over_seen || !known.contains(&(a, b)) {
                let predicted = (fit.base[a].0 + fit.impact[b].0).clamp(MIN_SPEED, 1.0);
                sum += (predicted - truth).abs();
                count += 1;
            }
        }
        sum / count.max(1) as f64
    };
    let prior_only = all.iter().map(|&(_, _, s)| (prior - s).abs()).sum::<f64>() / all.len() as f64;
    println!(
        "{}: {} applications, {} pairs that can share ({} sides); prior {prior}",
        table.model,
        n,
        pairs.len(),
        all.len()
    );
    println!("prior alone (no pair seen): mean error {prior_only:.3}");
    println!(
        "additive model fitted on every pair (its floor): mean error {:.3}",
        error(&all, true)
    );
    println!("{:>10} {:>8} {:>22}", "pairs seen", "sides", "error on unseen sides");
    let mut rng = Rng::new(1);
    let steps = [10, 20, 40, 80, 120, 160, 240];
    for &k in steps.iter().filter(|&&k| k < pairs.len()) {
        let (mut total, mut sides_seen) = (0.0, 0usize);
        for _ in 0..DRAWS {
            // A partial Fisher-Yates shuffle: the first k of a random permutation.
            let mut order: Vec<usize> = (0..pairs.len()).collect();
            for i in 0..k {
                let j = i + rng.below(pairs.len() - i);
                order.swap(i, j);
            }
            let chosen: Vec<(usize, usize)> = order[..k].iter().map(|&i| pairs[i]).collect();
            let seen = sides(&chosen);
            sides_seen += seen.len();
            total += error(&seen, false);
        }
        println!(
            "{k:>10} {:>8.0} {:>22.3}",
            sides_seen as f64 / DRAWS as f64,
            total / DRAWS as f64
        );
    }
}
