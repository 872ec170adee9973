//! The learning equations of jobs, from their sharing intervals and progress reports.

use super::Cached;
use rusqlite::{params, OptionalExtension};

/// How many of an application's latest finished jobs its speeds are fitted from (and how
/// many [`History::compact`] keeps, at least).
pub const LEARN_WINDOW: i64 = 200;

/// One interval of a job: start, end (`None` while open), partner application (`None`: alone).
type IntervalRow = (f64, Option<f64>, Option<String>);

/// The intervals of the job `job_row`, in time order.
pub(super) fn intervals_of(tx: &rusqlite::Transaction, job_row: i64) -> rusqlite::Result<Vec<IntervalRow>> {
    let mut stmt = tx.prepare_cached(
        "SELECT i.started_at, i.ended_at, a.name FROM intervals i
         LEFT JOIN applications a ON a.id = i.partner_app_id
         WHERE i.job_row = ?1 ORDER BY i.started_at",
    )?;
    let rows = stmt.query_map([job_row], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    rows.collect()
}

/// A stretch between two reports teaches a pair's speed only if it was shared for at least
/// this share of its length. A report is off by some share of the stretch it covers (the
/// progress a job counts, the instant it is sent), and that error, divided by the seconds
/// shared, is the error of the speed: a partner that arrived 4 s before a 900 s stretch ended
/// made a pair of true speeds 0.46 read 0.05, and the separation look requeued a job for it.
/// At a quarter, an error of 5% of the stretch moves the speed by at most 0.2; the pair is
/// learned from the next stretch instead, one report later.
pub const MIN_SHARED_SHARE: f64 = 0.25;

/// The kind of observation that holds a job's GPU time busy, in seconds from the first such
/// record of its count (which is 0): what NVML's per-process SM utilisation adds up to while
/// the job runs, recorded by the daemon itself ([`crate::node::Node::record_telemetry`]). On
/// a time-sliced GPU a job runs only in its own slices, so its busy time grows with the work
/// it does and measures its speed where it reports no progress.
pub const BUSY: &str = "busy";

/// The equations of a job's stretches between progress reports (`(at, done)` in time order;
/// the job's start counts as done 0 when `from_start`, else the first report starts the count):
/// the progress made in each, and the time alone and beside each partner within it (`work_s`
/// is left for the caller, who knows the rate alone). Stretches with several partners at once,
/// or shared for less than [`MIN_SHARED_SHARE`] of their length, are left out. Where a count
/// that does not start at the job's start goes back (the daemon's, begun again), a new count
/// starts there.
fn progress_stretches(
    intervals: &[IntervalRow],
    reports: &[(i64, f64, f64)],
    from_start: bool,
) -> Vec<(f64, crate::learn::Equation)> {
    let Some(&(start, _, _)) = intervals.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut reports = reports.iter().map(|&(_, t, d)| (t, d));
    let Some((mut t0, mut d0)) = (if from_start { Some((start, 0.0)) } else { reports.next() }) else {
        return Vec::new();
    };
    for (t1, d1) in reports {
        if t1 <= t0 {
            continue;
        }
        // A count of the daemon's own never goes back but where it began again (it
        // restarted). A job's reports may: a noisy report below the last one is an error the
        // next stretch makes up for, and dropping only those would make the job look faster.
        if !from_start && d1 < d0 {
            (t0, d0) = (t1, d1);
            continue;
        }
        let clipped = intervals.iter().filter_map(|(s, e, p)| {
            // An interval still open (a running job's) lasts at least to this report.
            let (s, e) = ((*s).max(t0), e.map_or(t1, |e| e.min(t1)));
            (e > s).then(|| (s, Some(e), p.clone()))
        });
        if let Some(eq) = equation(clipped) {
            let shared: f64 = eq.shared.iter().map(|(_, t)| t).sum();
            if shared == 0.0 || shared >= MIN_SHARED_SHARE * (eq.alone_s + shared) {
                out.push((d1 - d0, eq));
            }
        }
        (t0, d0) = (t1, d1);
    }
    out
}

/// Each stretch's progress in seconds of work alone, by the rate alone its own stretches
/// alone give (none: no stretch ran alone, and none of them teaches).
fn at_rate_alone(stretches: Vec<(f64, crate::learn::Equation)>) -> Vec<crate::learn::Equation> {
    let (done_alone, secs_alone) = stretches
        .iter()
        .filter(|(_, e)| e.shared.is_empty() && e.alone_s > 0.0)
        .fold((0.0, 0.0), |(d, t), (done, e)| (d + done, t + e.alone_s));
    if secs_alone <= 0.0 || done_alone <= 0.0 {
        return Vec::new();
    }
    let rate = done_alone / secs_alone;
    stretches
        .into_iter()
        .map(|(done, mut e)| {
            e.work_s = done / rate;
            e
        })
        .collect()
}

/// The learning equations of application `app_id` on `model` from its latest jobs (finished
/// and completed, or still running), and whether the job `job_row` was measured while it ran
/// (it reported progress, or the daemon recorded its busy GPU time); `None` when there is
/// nothing to measure work by yet (no solo runtime, no stretch run alone).
pub(super) fn equations_of(
    tx: &rusqlite::Transaction,
    app_id: i64,
    model: &str,
    job_row: i64,
    solo: Option<f64>,
) -> rusqlite::Result<Option<(Vec<crate::learn::Equation>, bool)>> {
    // The solo runtime the caller just computed, else the stored one.
    let baseline = match solo {
        Some(s) => Some(s),
        None => stored_solo(tx, model, app_id)?,
    };
    let (rows, reports) = latest_runs(tx, app_id, model)?;
    let of = |job: i64, busy: bool| -> Vec<(i64, f64, f64)> {
        let from = reports.partition_point(|r| (r.0, r.1) < (job, busy));
        let to = reports.partition_point(|r| (r.0, r.1) <= (job, busy));
        reports[from..to].iter().map(|r| (r.0, r.2, r.3)).collect()
    };
    // Jobs that report progress give one equation per stretch between reports (their
    // total work need not be the solo runtime); jobs that do not, one per stretch between the
    // daemon's records of their busy GPU time, where it has them; the others one each.
    let mut whole: Vec<crate::learn::Equation> = Vec::new();
    let mut stretches: Vec<(f64, crate::learn::Equation)> = Vec::new();
    let mut busy: Vec<(f64, crate::learn::Equation)> = Vec::new();
    for job in rows.chunk_by(|a, b| a.0 == b.0) {
        let intervals: Vec<IntervalRow> = job.iter().map(|(_, _, r)| r.clone()).collect();
        let progress = of(job[0].0, false);
        let measured = of(job[0].0, true);
        if !progress.is_empty() {
            stretches.extend(progress_stretches(&intervals, &progress, true));
        } else if measured.len() > 1 {
            busy.extend(progress_stretches(&intervals, &measured, false));
        } else {
            // A job given back to Slurm did not do its whole work: only its reports teach.
            if job[0].1 {
                continue;
            }
            if let (Some(solo), Some(mut eq)) = (baseline, equation(intervals.into_iter())) {
                eq.work_s = solo;
                whole.push(eq);
            }
        }
    }
    let mut equations = whole;
    equations.extend(at_rate_alone(stretches));
    equations.extend(at_rate_alone(busy));
    if baseline.is_none() && equations.is_empty() {
        return Ok(None);
    }
    let reported = !of(job_row, false).is_empty() || of(job_row, true).len() > 1;
    Ok(Some((equations, reported)))
}

/// Intervals: (job row, given back, the interval).
type RunRows = Vec<(i64, bool, IntervalRow)>;
/// Reports: (job row, busy time rather than progress, at, value).
type Reports = Vec<(i64, bool, f64, f64)>;

/// The application's stored solo runtime on `model`.
fn stored_solo(tx: &rusqlite::Transaction, model: &str, app_id: i64) -> rusqlite::Result<Option<f64>> {
    tx.row(
        "SELECT runtime_s FROM solo_baselines WHERE gpu_model = ?1 AND app_id = ?2",
        params![model, app_id],
        |r| r.get(0),
    )
    .optional()
}

/// Each interval of the application's latest jobs, with its job's row and whether that job
/// was given back to Slurm, and each job's progress reports and busy-time records (a flag:
/// busy), each in time order.
fn latest_runs(tx: &rusqlite::Transaction, app_id: i64, model: &str) -> rusqlite::Result<(RunRows, Reports)> {
    // Every interval and progress report of the application's latest jobs, in two queries.
    // Running jobs come first: only their stretches between reports count. (The window is
    // written into the SQL, not bound: SQLite re-prepares a statement each time a LIMIT
    // parameter is bound, which cost a sixth of a large simulation's time.)
    let window = format!(
        "SELECT id FROM jobs WHERE app_id = ?1 AND gpu_model = ?2
         AND (finished_at IS NULL OR exit_status = 0 OR separated = 1)
         ORDER BY finished_at IS NULL DESC, finished_at DESC LIMIT {LEARN_WINDOW}"
    );
    // Each interval with its job's row and whether that job was given back to Slurm.
    let rows: RunRows = tx
        .prepare_cached(&format!(
            "SELECT i.job_row, j.separated = 1, i.started_at, i.ended_at, a.name FROM intervals i
             JOIN jobs j ON j.id = i.job_row
             LEFT JOIN applications a ON a.id = i.partner_app_id
             WHERE i.job_row IN ({window}) ORDER BY i.job_row, i.started_at"
        ))?
        .query_map(params![app_id, model], |r| {
            Ok((r.get(0)?, r.get(1)?, (r.get(2)?, r.get(3)?, r.get(4)?)))
        })?
        .collect::<Result<_, _>>()?;
    // Each job's progress reports, and the GPU time NVML measured it busy ([`BUSY`]: the daemon
    // records it itself where MPS is off), each in time order.
    let reports: Reports = tx
        .prepare_cached(&format!(
            "SELECT job_row, kind = '{BUSY}', at, value FROM observations
             WHERE kind IN ('progress', '{BUSY}') AND value IS NOT NULL AND job_row IN ({window})
             ORDER BY job_row, kind = '{BUSY}', at"
        ))?
        .query_map(params![app_id, model], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })?
        .collect::<Result<_, _>>()?;
    Ok((rows, reports))
}

/// The learning equation of a finished job from its intervals in time order: seconds alone
/// and seconds beside each partner application; `None` when a stretch had several partners at
/// once (the linear model does not hold there) or an interval is still open.
pub(super) fn equation(rows: impl Iterator<Item = IntervalRow>) -> Option<crate::learn::Equation> {
    let mut eq = crate::learn::Equation {
        work_s: 0.0,
        alone_s: 0.0,
        shared: Vec::new(),
    };
    // Partner rows of one stretch share its start: two of them mean two partners at once.
    let mut last_partner_start = f64::NAN;
    for (start, end, partner) in rows {
        let end = end?;
        if end <= start {
            continue; // membership changed twice at one instant
        }
        if partner.is_some() {
            if start == last_partner_start {
                return None;
            }
            last_partner_start = start;
        }
        let t = end - start;
        match partner {
            None => eq.alone_s += t,
            Some(p) => match eq.shared.iter_mut().find(|(q, _)| *q == p) {
                Some((_, acc)) => *acc += t,
                None => eq.shared.push((p, t)),
            },
        }
    }
    Some(eq)
}
