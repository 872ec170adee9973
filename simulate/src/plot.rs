//! `--plot FILE.svg`: the JCT distribution per policy, and the learned policy's gap to the
//! oracle as jobs accumulate. Plain SVG, no dependencies.

use super::Run;
use std::fmt::Write;

const COLOURS: [&str; 8] = [
    "#7f7f7f", "#d62728", "#ff7f0e", "#9467bd", "#1f77b4", "#2ca02c", "#8c564b", "#e377c2",
];
const W: f64 = 460.0;
const H: f64 = 300.0;
const LEFT: f64 = 60.0;
const TOP: f64 = 40.0;

/// The SVG text for `runs`; `heading` names the setup.
pub fn svg(runs: &[Run], heading: &str) -> String {
    let mut s = String::new();
    let total_w = 2.0 * W + 2.0 * LEFT + 60.0;
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{}" font-family="sans-serif" font-size="12">"#,
        H + TOP + 70.0
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(s, r#"<text x="10" y="18" font-size="14">{}</text>"#, escape(heading));
    cdf_panel(&mut s, runs, LEFT, TOP);
    gap_panel(&mut s, runs, 2.0 * LEFT + W + 20.0, TOP);
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn frame(s: &mut String, x0: f64, y0: f64, title: &str, xlabel: &str, ylabel: &str) {
    let _ = writeln!(
        s,
        r#"<rect x="{x0}" y="{y0}" width="{W}" height="{H}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(s, r#"<text x="{x0}" y="{}">{}</text>"#, y0 - 8.0, escape(title));
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        x0 + W / 2.0,
        y0 + H + 36.0,
        escape(xlabel)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">{}</text>"#,
        x0 - 45.0,
        y0 + H / 2.0,
        escape(ylabel)
    );
}

fn cdf_panel(s: &mut String, runs: &[Run], x0: f64, y0: f64) {
    frame(
        s,
        x0,
        y0,
        "JCT distribution per policy",
        "job completion time, hours (log scale)",
        "fraction of jobs",
    );
    let all = runs.iter().flat_map(|r| r.jct.iter().copied()).filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(l, h), v| (l.min(v), h.max(v)));
    if !(lo.is_finite() && hi > lo) {
        return;
    }
    let (llo, lhi) = (lo.ln(), hi.ln());
    let x = |v: f64| x0 + W * (v.max(lo).ln() - llo) / (lhi - llo);
    let y = |f: f64| y0 + H * (1.0 - f);
    for t in [0.25, 0.5, 0.75, 1.0] {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{t}</text>"#,
            x0 - 4.0,
            y(t) + 4.0
        );
    }
    hour_ticks(s, (lo, hi), &x, y0);
    for (k, r) in runs.iter().enumerate() {
        let mut v = r.jct.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        // At most ~400 points per curve.
        let step = (v.len() / 400).max(1);
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .filter(|(i, _)| i % step == 0 || *i + 1 == v.len())
            .map(|(i, &t)| format!("{:.1},{:.1}", x(t), y((i + 1) as f64 / n)))
            .collect();
        let c = COLOURS[k % COLOURS.len()];
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{}"/>"#,
            pts.join(" ")
        );
        let ly = y0 + 14.0 + 15.0 * k as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{0}" y1="{ly}" x2="{1}" y2="{ly}" stroke="{c}" stroke-width="2"/><text x="{2}" y="{3}">{4}</text>"#,
            x0 + W - 120.0,
            x0 + W - 100.0,
            x0 + W - 95.0,
            ly + 4.0,
            escape(&r.summary.policy)
        );
    }
}

/// Grid lines at 1, 2 and 5 times each power of ten hours between `lo` and `hi` seconds, on
/// the log axis `x` of a panel whose top is `y0`.
fn hour_ticks(s: &mut String, (lo, hi): (f64, f64), x: &dyn Fn(f64) -> f64, y0: f64) {
    let mut h = 10f64.powf((lo / 3600.0).log10().floor());
    while h * 3600.0 <= hi {
        for m in [1.0, 2.0, 5.0] {
            let v = h * m * 3600.0;
            if v >= lo && v <= hi {
                let _ = writeln!(
                    s,
                    r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#ddd"/><text x="{0}" y="{3}" text-anchor="middle">{4}</text>"##,
                    x(v),
                    y0,
                    y0 + H,
                    y0 + H + 16.0,
                    h * m
                );
            }
        }
        h *= 10.0;
    }
}

fn gap_panel(s: &mut String, runs: &[Run], x0: f64, y0: f64) {
    frame(
        s,
        x0,
        y0,
        "learned vs oracle: average JCT of the first n jobs",
        "jobs (in submit order)",
        "gap to oracle, %",
    );
    let find = |p: &str| runs.iter().find(|r| r.summary.policy == p);
    let (Some(l), Some(o)) = (find("learned"), find("oracle")) else {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">run with --policy learned --policy oracle to see this</text>"#,
            x0 + W / 2.0,
            y0 + H / 2.0
        );
        return;
    };
    let gaps = gap_series(l, o);
    let n = gaps.len().max(2) as f64;
    let (lo, hi) = gaps.iter().fold((0.0f64, 5.0f64), |(l, h), &g| (l.min(g), h.max(g)));
    let x = |i: f64| x0 + W * i / (n - 1.0);
    let y = |g: f64| y0 + H * (hi - g) / (hi - lo);
    for g in [lo, 0.0, 5.0, hi] {
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{0}" x2="{1}" y2="{0}" stroke="#ddd"/><text x="{2}" y="{3}" text-anchor="end">{g:.0}</text>"##,
            y(g),
            x0 + W,
            x0 - 4.0,
            y(g) + 4.0
        );
    }
    for t in [0.0, 0.5, 1.0] {
        let i = t * (n - 1.0);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{:.0}</text>"#,
            x(i),
            y0 + H + 16.0,
            i + 1.0
        );
    }
    let step = (gaps.len() / 500).max(1);
    let pts: Vec<String> = gaps
        .iter()
        .enumerate()
        .filter(|(i, _)| i % step == 0 || *i + 1 == gaps.len())
        .map(|(i, &g)| format!("{:.1},{:.1}", x(i as f64), y(g)))
        .collect();
    let _ = writeln!(
        s,
        r##"<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{}"/>"##,
        pts.join(" ")
    );
}

/// The learned policy's average JCT over the first n jobs against the oracle's, % above it,
/// for every n.
fn gap_series(learned: &Run, oracle: &Run) -> Vec<f64> {
    let (mut sl, mut so) = (0.0, 0.0);
    learned
        .jct
        .iter()
        .zip(&oracle.jct)
        .map(|(a, b)| {
            sl += a;
            so += b;
            100.0 * (sl / so - 1.0)
        })
        .collect()
}
