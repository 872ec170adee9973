//! Learning pairwise speeds from start and end times alone (design: "Learning interference
//! without touching the job"). Pure: the history feeds it equations, it returns estimates.
//!
//! A finished job of application A that ran `alone_s` seconds alone and `t_B` seconds beside
//! each partner application B did the work of one solo run of A, which takes `solo_s`:
//!
//! ```text
//!     alone_s + sum over B of t_B * s(A, B) = solo_s
//! ```
//!
//! A job that reports its progress gives one such equation per stretch between two reports
//! instead, with the work of that stretch (progress made, divided by the application's rate
//! alone) in place of `solo_s`: its total work need not be known, so jobs of one application
//! may differ in length.
//!
//! Many such equations give a least-squares problem for the speeds s(A, B). It is solved with a
//! small ridge term towards the prior, so that a partner seen in one mixed equation only gets a
//! sensible value instead of an arbitrary one, and speeds are kept in [`MIN_SPEED`, 1].

/// One equation: a finished job, or a stretch of one between two progress reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Equation {
    /// The work done, in seconds of running alone.
    pub work_s: f64,
    /// Seconds the job ran with its GPU to itself.
    pub alone_s: f64,
    /// Seconds it ran beside each partner application.
    pub shared: Vec<(String, f64)>,
}

/// A learned speed of the application beside one partner application.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    pub partner: String,
    /// Speed relative to running alone.
    pub speed: f64,
    /// Jobs whose equation involves this partner.
    pub observations: u32,
    /// A rough variance of the speed (residual variance over the partner's shared time).
    pub variance: f64,
}

/// No job slows down to less than this (a floor against noise and nonsense).
pub const MIN_SPEED: f64 = 0.05;

/// Relative weight of the prior (ridge term, scaled by the data).
const RIDGE: f64 = 1e-3;

/// Fits the speeds of an application from its jobs' equations.
///
/// Partners that never appear in one equation together do not interact, so the problem splits
/// into independent components (with two jobs per GPU, every partner is its own): each is
/// solved on its own, and with `only` just the components of those partners are (the others
/// cannot have changed when the solo runtime did not).
pub fn fit(equations: &[Equation], prior: f64, only: Option<&[String]>) -> Vec<Fit> {
    let mut partners: Vec<String> = equations
        .iter()
        .flat_map(|e| e.shared.iter().filter(|(_, t)| *t > 0.0).map(|(p, _)| p.clone()))
        .collect();
    partners.sort();
    partners.dedup();
    let n = partners.len();
    if n == 0 {
        return Vec::new();
    }
    let col = |p: &str| partners.binary_search_by(|q| q.as_str().cmp(p)).ok();
    let system = System::of(equations, n, &col);
    let lambda = RIDGE * (system.diag.iter().sum::<f64>() / n as f64).max(f64::MIN_POSITIVE);
    let (members, comp_rows) = system.components(n, only.map(|o| o.iter().filter_map(|p| col(p)).collect()));
    let mut fits = Vec::new();
    for (r, cols) in members {
        let these = comp_rows.get(&r).map(Vec::as_slice).unwrap_or(&[]);
        let (speeds, rss, dof) = system.solve_component(&cols, these, lambda, prior);
        for (li, &c) in cols.iter().enumerate() {
            fits.push(Fit {
                partner: partners[c].clone(),
                speed: speeds[li],
                observations: system.obs[c],
                variance: rss / dof / system.diag[c].max(f64::MIN_POSITIVE),
            });
        }
    }
    fits.sort_by(|a, b| a.partner.cmp(&b.partner));
    fits
}

/// Each component's columns, by its root column.
type Members = std::collections::BTreeMap<usize, Vec<usize>>;
/// Each component's rows (indices into [`System::rows`]), by its root column.
type RowsOf = std::collections::HashMap<usize, Vec<usize>>;

/// The jobs' equations by partner column: each as (column, seconds) pairs and its right-hand
/// side, with how many equations and how much squared time each column has.
struct System {
    rows: Vec<(Vec<(usize, f64)>, f64)>,
    obs: Vec<u32>,
    diag: Vec<f64>,
}

impl System {
    fn of(equations: &[Equation], n: usize, col: &dyn Fn(&str) -> Option<usize>) -> System {
        let mut rows: Vec<(Vec<(usize, f64)>, f64)> = Vec::new();
        let mut obs = vec![0u32; n];
        let mut diag = vec![0.0; n];
        for e in equations {
            let mut row: Vec<(usize, f64)> = Vec::new();
            for (p, t) in &e.shared {
                if *t > 0.0 {
                    let c = col(p).expect("collected above");
                    match row.iter_mut().find(|(k, _)| *k == c) {
                        Some((_, acc)) => *acc += t,
                        None => row.push((c, *t)),
                    }
                }
            }
            if row.is_empty() {
                continue;
            }
            for &(i, t) in &row {
                obs[i] += 1;
                diag[i] += t * t;
            }
            rows.push((row, e.work_s - e.alone_s));
        }
        System { rows, obs, diag }
    }

    /// Components of partners linked by shared equations (union-find): each component's
    /// columns (only those of the `wanted` columns' components, where given) and its rows.
    fn components(&self, n: usize, wanted: Option<Vec<usize>>) -> (Members, RowsOf) {
        let mut parent: Vec<usize> = (0..n).collect();
        fn root(parent: &mut [usize], mut x: usize) -> usize {
            while parent[x] != x {
                parent[x] = parent[parent[x]];
                x = parent[x];
            }
            x
        }
        for (row, _) in &self.rows {
            for w in row.windows(2) {
                let (a, b) = (root(&mut parent, w[0].0), root(&mut parent, w[1].0));
                parent[a] = b;
            }
        }
        let roots: Vec<usize> = (0..n).map(|c| root(&mut parent, c)).collect();
        let wanted: Option<std::collections::HashSet<usize>> =
            wanted.map(|w| w.into_iter().map(|c| roots[c]).collect());
        let mut members: Members = Default::default();
        for (c, &r) in roots.iter().enumerate() {
            if wanted.as_ref().is_none_or(|w| w.contains(&r)) {
                members.entry(r).or_default().push(c);
            }
        }
        let mut comp_rows: RowsOf = Default::default();
        for (k, (row, _)) in self.rows.iter().enumerate() {
            comp_rows.entry(roots[row[0].0]).or_default().push(k);
        }
        (members, comp_rows)
    }

    /// One component's speeds from its normal equations (A^T A + λI) s = A^T r + λ prior, its
    /// residual sum of squares, and its degrees of freedom.
    fn solve_component(&self, cols: &[usize], these: &[usize], lambda: f64, prior: f64) -> (Vec<f64>, f64, f64) {
        let k = cols.len();
        let local = |c: usize| cols.binary_search(&c).expect("a member");
        let mut m = vec![vec![0.0; k]; k];
        let mut v = vec![0.0; k];
        for &ri in these {
            let (row, rhs) = &self.rows[ri];
            for &(i, ti) in row {
                let li = local(i);
                v[li] += ti * rhs;
                for &(j, tj) in row {
                    m[li][local(j)] += ti * tj;
                }
            }
        }
        for i in 0..k {
            m[i][i] += lambda;
            v[i] += lambda * prior;
        }
        let speeds: Vec<f64> = solve(m, v)
            .unwrap_or_else(|| vec![prior; k])
            .into_iter()
            .map(|s| s.clamp(MIN_SPEED, 1.0))
            .collect();
        let dof = these.len().saturating_sub(k).max(1) as f64;
        let rss: f64 = these
            .iter()
            .map(|&ri| {
                let (row, rhs) = &self.rows[ri];
                let predicted: f64 = row.iter().map(|&(i, t)| t * speeds[local(i)]).sum();
                (predicted - rhs).powi(2)
            })
            .sum();
        (speeds, rss, dof)
    }
}

/// Solves `m x = v` by Gaussian elimination with partial pivoting; `None` if singular.
fn solve(mut m: Vec<Vec<f64>>, mut v: Vec<f64>) -> Option<Vec<f64>> {
    let n = v.len();
    for c in 0..n {
        let p = (c..n).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        if m[p][c].abs() < 1e-12 {
            return None;
        }
        m.swap(c, p);
        v.swap(c, p);
        for r in c + 1..n {
            let f = m[r][c] / m[c][c];
            if f != 0.0 {
                let (top, bottom) = m.split_at_mut(r);
                for (x, p) in bottom[0][c..].iter_mut().zip(&top[c][c..]) {
                    *x -= f * p;
                }
                v[r] -= f * v[c];
            }
        }
    }
    let mut x = vec![0.0; n];
    for c in (0..n).rev() {
        let s: f64 = (c + 1..n).map(|k| m[c][k] * x[k]).sum();
        x[c] = (v[c] - s) / m[c][c];
    }
    Some(x)
}

/// What is known of each application towards partners it was never seen with: a two-way
/// additive model of the learned speeds around the prior,
///
/// ```text
///     s(A beside B) ≈ prior + sensitivity(A) + impact(B)
/// ```
///
/// a ridge regression over every learned pair (each effect is pulled towards none with the
/// weight of [`EFFECT_RIDGE`] pairs), fitted jointly so that an application seen only beside
/// gentle partners is not taken for a gentle one itself: its partners' impacts are accounted
/// for. On the Gavel V100 table an additive model leaves a residual of 0.14 on a speed whose
/// spread is 0.24, and the daemon's placement given each application's true effects instead
/// of learned ones comes within 3.4% of the oracle at load 1.0 (`multiplex-simulate`, 10
/// seeds): what the daemon knows of applications, more than of pairs, decides how well it
/// places.
///
/// The history refits it whole where many estimates change at once (an import) and otherwise
/// takes [`effect`] steps for the applications whose estimates changed, which costs what their
/// own pairs cost, not what the whole history does.
#[derive(Debug, Clone, PartialEq)]
pub struct Effects {
    /// Per application: `prior + sensitivity`, its expected speed beside a typical partner,
    /// and how many learned pairs (this application's side) it rests on.
    pub base: Vec<(f64, u32)>,
    /// Per application: how much it changes its partners' speeds against their typical
    /// speed, and how many learned pairs (the partner's side) it rests on.
    pub impact: Vec<(f64, u32)>,
}

/// Pairs' worth of weight that pulls each effect towards none.
pub const EFFECT_RIDGE: f64 = 2.0;

/// One coordinate step of the fit: the effect that best explains what the rest of the model
/// leaves unexplained of `n` learned speeds (`residual_sum`), pulled towards none.
pub fn effect(residual_sum: f64, n: u32) -> f64 {
    residual_sum / (f64::from(n) + EFFECT_RIDGE)
}

/// Fits [`Effects`] for `apps` applications (indices `0..apps`) from learned speeds
/// `(application, partner, speed of the application beside the partner)`, by coordinate
/// descent to convergence (the problem is strictly convex).
pub fn fit_effects(apps: usize, speeds: &[(usize, usize, f64)], prior: f64) -> Effects {
    let mut base_n = vec![0u32; apps];
    let mut impact_n = vec![0u32; apps];
    for &(a, b, _) in speeds {
        base_n[a] += 1;
        impact_n[b] += 1;
    }
    let (mut sens, mut imp) = (vec![0.0; apps], vec![0.0; apps]);
    let mut sum = vec![0.0; apps];
    for _ in 0..500 {
        let mut moved: f64 = 0.0;
        let mut step = |effects: &mut [f64], counts: &[u32], sum: &[f64]| {
            for ((e, &n), &s) in effects.iter_mut().zip(counts).zip(sum) {
                let new = effect(s, n);
                moved = moved.max((new - *e).abs());
                *e = new;
            }
        };
        sum.fill(0.0);
        for &(a, b, y) in speeds {
            sum[a] += y - prior - imp[b];
        }
        step(&mut sens, &base_n, &sum);
        sum.fill(0.0);
        for &(a, b, y) in speeds {
            sum[b] += y - prior - sens[a];
        }
        step(&mut imp, &impact_n, &sum);
        if moved < 1e-9 {
            break;
        }
    }
    Effects {
        base: sens.iter().zip(base_n).map(|(s, n)| (prior + s, n)).collect(),
        impact: imp.into_iter().zip(impact_n).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eq(alone_s: f64, shared: &[(&str, f64)]) -> Equation {
        eq_work(100.0, alone_s, shared)
    }

    fn eq_work(work_s: f64, alone_s: f64, shared: &[(&str, f64)]) -> Equation {
        Equation {
            work_s,
            alone_s,
            shared: shared.iter().map(|(p, t)| (p.to_string(), *t)).collect(),
        }
    }

    #[test]
    fn one_job_beside_one_partner_by_hand() {
        // Solo 100 s. It ran 20 s alone and 100 s beside b: 20 + 100 s = 100, s = 0.8.
        let f = fit(&[eq(20.0, &[("b", 100.0)])], 0.7, None);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].partner.as_str(), f[0].observations), ("b", 1));
        assert!((f[0].speed - 0.8).abs() < 1e-3, "{f:?}");
    }

    #[test]
    fn several_partners_are_separated_by_least_squares() {
        // True speeds beside b, c, d: 0.9, 0.5, 0.65. Jobs mix them in different proportions.
        let truth = [("b", 0.9), ("c", 0.5), ("d", 0.65)];
        let solo = 3600.0;
        let mixes: [[f64; 3]; 5] = [
            [1.0, 0.0, 0.0],
            [0.3, 0.7, 0.0],
            [0.0, 0.4, 0.6],
            [0.2, 0.2, 0.6],
            [0.5, 0.0, 0.5],
        ];
        // A job runs alone for a while; the rest of its work (in solo seconds) is done beside
        // each partner in the mix's proportions, taking work / speed seconds there.
        let eqs: Vec<Equation> = mixes
            .iter()
            .enumerate()
            .map(|(k, mix)| {
                let alone = 100.0 * k as f64;
                let work = solo - alone;
                let shared: Vec<(&str, f64)> = mix.iter().zip(truth).map(|(w, (p, s))| (p, w * work / s)).collect();
                eq_work(solo, alone, &shared)
            })
            .collect();
        let f = fit(&eqs, 0.7, None);
        for ((p, s), got) in truth.iter().zip(&f) {
            assert_eq!(&got.partner, p);
            assert!((got.speed - s).abs() < 0.01, "{p}: {} vs {s}", got.speed);
        }
    }

    #[test]
    fn stretches_of_different_work_from_progress_reports() {
        // Two jobs of different lengths, each cut into stretches by its reports: the work of
        // a stretch is known (progress / rate alone), so lengths need not match. Beside b the
        // speed is 0.5, beside c 0.8.
        let eqs = [
            eq_work(300.0, 300.0, &[]),
            eq_work(300.0, 100.0, &[("b", 400.0)]),
            eq_work(160.0, 0.0, &[("c", 200.0)]),
            eq_work(1000.0, 200.0, &[("b", 800.0), ("c", 500.0)]),
        ];
        let f = fit(&eqs, 0.7, None);
        assert!(
            (f[0].speed - 0.5).abs() < 5e-3 && (f[1].speed - 0.8).abs() < 5e-3,
            "{f:?}"
        );
        assert_eq!((f[0].observations, f[1].observations), (2, 2));
    }

    #[test]
    fn independent_partners_are_solved_apart_and_only_on_request() {
        // b and c appear together; d alone. Asking for d solves only d's component.
        let eqs = [
            eq(0.0, &[("b", 50.0), ("c", 50.0)]),
            eq(0.0, &[("b", 100.0), ("c", 25.0)]),
            eq(50.0, &[("d", 100.0)]),
        ];
        let all = fit(&eqs, 0.7, None);
        assert_eq!(
            all.iter().map(|f| f.partner.as_str()).collect::<Vec<_>>(),
            ["b", "c", "d"]
        );
        let only_d = fit(&eqs, 0.7, Some(&["d".to_string()]));
        assert_eq!(only_d.len(), 1);
        assert_eq!(only_d[0], all[2]);
        assert!((only_d[0].speed - 0.5).abs() < 1e-3);
        // Components give the same answer as one joint solve would: b, c from two equations.
        // 50 b + 50 c = 100 and 100 b + 25 c = 100: b = 0.667, c = 1.333 -> clamped to 1.
        assert!((all[0].speed - 2.0 / 3.0).abs() < 0.01, "{all:?}");
    }

    #[test]
    fn underdetermined_and_degenerate_inputs_stay_sane() {
        // One equation, two partners: both get a value in range, not nonsense.
        let f = fit(&[eq(0.0, &[("b", 60.0), ("c", 60.0)])], 0.7, None);
        assert_eq!(f.len(), 2);
        assert!(f.iter().all(|x| (MIN_SPEED..=1.0).contains(&x.speed)), "{f:?}");
        // A job faster than solo beside a partner (noise): capped at 1.
        let f = fit(&[eq(0.0, &[("b", 50.0)])], 0.7, None);
        assert_eq!(f[0].speed, 1.0);
        // Nothing shared: nothing to learn.
        assert!(fit(&[eq(100.0, &[])], 0.7, None).is_empty());
        // No work seen beside a partner (a stalled stretch): the floor, not a negative speed.
        let f = fit(&[eq_work(0.0, 0.0, &[("b", 50.0)])], 0.7, None);
        assert_eq!(f[0].speed, MIN_SPEED);
    }

    #[test]
    fn effects_of_an_additive_table_are_recovered_and_shrunk_by_little_data() {
        // speed(a beside b) = 0.7 + sens[a] + imp[b] for every ordered pair of 4 applications,
        // 8 times over (as if many nodes had learned them): the fit gets close to the truth,
        // short of it by the ridge's pull (2 pairs' weight against 32).
        let (sens, imp) = ([0.2, 0.0, -0.1, -0.1], [0.1, -0.2, 0.05, 0.05]);
        let mut speeds = Vec::new();
        for _ in 0..8 {
            for (a, s) in sens.iter().enumerate() {
                for (b, i) in imp.iter().enumerate() {
                    speeds.push((a, b, 0.7 + s + i));
                }
            }
        }
        let e = fit_effects(4, &speeds, 0.7);
        for (a, s) in sens.iter().enumerate() {
            let (base, n) = e.base[a];
            assert!((base - (0.7 + s)).abs() < 0.02, "{a}: {base} vs {}", 0.7 + s);
            assert_eq!(n, 32);
        }
        for (b, i) in imp.iter().enumerate() {
            let (impact, n) = e.impact[b];
            assert!((impact - i).abs() < 0.02, "{b}: {impact} vs {i}");
            assert_eq!(n, 32);
        }
        // One pair learned: a is 0.3 beside b. Shrunk towards the prior 0.7, but the fit
        // explains it partly by a (slow beside others) and partly by b (slows others).
        let e = fit_effects(3, &[(0, 1, 0.3)], 0.7);
        let predicted = e.base[0].0 + e.impact[1].0;
        assert!(predicted > 0.3 && predicted < 0.7, "{e:?}");
        assert!(e.base[0].0 < 0.7 && e.impact[1].0 < 0.0, "{e:?}");
        // Application 2 was never seen: the prior, resting on nothing.
        assert_eq!((e.base[2], e.impact[2]), ((0.7, 0), (0.0, 0)));
    }

    #[test]
    fn an_application_seen_only_beside_a_gentle_partner_is_not_taken_for_a_gentle_one() {
        // g is gentle: y runs at 0.9 beside it but at 0.6 beside h, h at 0.95 beside it.
        // x was only ever seen beside g, at 0.9: the plain mean of x's speeds says 0.9
        // beside anyone; the joint fit puts part of that on g, so x beside h is expected lower.
        let (g, h, x, y) = (0, 1, 2, 3);
        let speeds = [(x, g, 0.9), (y, g, 0.9), (y, h, 0.6), (y, h, 0.6), (h, g, 0.95)];
        let e = fit_effects(4, &speeds, 0.7);
        assert!(e.impact[g].0 > 0.05, "{e:?}");
        let x_beside_h = e.base[x].0 + e.impact[h].0;
        assert!(x_beside_h < 0.8, "{x_beside_h}: {e:?}");
    }
}
