use super::equations::{equation, intervals_of};
use super::schema::MIGRATIONS;
use super::*;
use crate::types::{AppProfile, PairEstimate, Wanted};

fn known(h: &History, model: &str, app: &str) -> AppProfile {
    h.app(model, app).unwrap()
}

fn pair(h: &History, model: &str, app: &str, other: &str) -> Option<PairEstimate> {
    h.pair(model, app, other).unwrap()
}

fn job<'a>(job_id: u32, app: &'a str, gpu: u32, now: f64) -> NewJob<'a> {
    NewJob {
        job_id,
        node: "n1",
        uid: 0,
        app,
        gpu,
        gpu_model: "v100",
        mem_mb: Some(100),
        owner_step: 0,
        slurm_gpus: Some("0"),
        decision: "test",
        predicted_speed: 1.0,
        now,
    }
}

#[test]
fn a_history_from_before_app_effects_gets_them_fitted_when_opened() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    {
        // What schema 6 held: learned speeds, both sides of a pair and an unlearned side, and
        // a job that ended.
        let h = History::open(&path).unwrap();
        h.connection()
            .execute_batch(
                "ALTER TABLE jobs DROP COLUMN learned;
                 ALTER TABLE jobs DROP COLUMN separated;
                 INSERT INTO applications(id, name) VALUES (1, 'a'), (2, 'b'), (3, 'c');
                 INSERT INTO jobs(job_id, node, uid, app_id, gpu, gpu_model, owner_step, decision,
                                  predicted_speed, started_at, finished_at, exit_status)
                 VALUES (1, 'n1', 0, 1, 0, 'v100', 0, 'x', 1.0, 0, 10, 0);
                 INSERT INTO pair_estimates(gpu_model, app_id, other_id, speed, other_speed, observations)
                 VALUES ('v100', 1, 2, 0.5, 0.9, 2), ('v100', 2, 1, 0.9, 0.5, 1),
                        ('v100', 3, 1, 0.7, 0.4, 0);
                 DROP TABLE app_effects;
                 PRAGMA user_version = 6;",
            )
            .unwrap();
    }
    let h = History::open(&path).unwrap();
    assert_eq!(h.schema_version().unwrap(), MIGRATIONS.len() as i64);
    let speeds = [(0, 1, 0.5), (1, 0, 0.9)];
    let want = crate::learn::fit_effects(2, &speeds, crate::config::DEFAULT_UNKNOWN_PAIR_SPEED);
    assert_eq!(known(&h, "v100", "a").base, Some(want.base[0]));
    assert_eq!(known(&h, "v100", "b").impact, Some(want.impact[1]));
    // c's only row was never learned: nothing is known of it.
    assert_eq!(known(&h, "v100", "c").base, None);
    assert_eq!(known(&h, "a100", "a").base, None);
    // Jobs from before schema 8 were learned from when they ended.
    assert!(h.unlearned_jobs("n1").unwrap().is_empty());
    // Schema 9's declines went with the step-launch placement that wrote them.
    let declines: i64 = h
        .connection()
        .query_row("SELECT count(*) FROM sqlite_master WHERE name = 'declines'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(declines, 0);
}

#[test]
fn an_export_of_an_older_daemon_has_no_memory_and_still_reads() {
    let old: Export =
        serde_json::from_str(r#"{"format":"multiplexd-history","version":1,"solo":[],"pairs":[]}"#).unwrap();
    assert!(old.memory.is_empty());
    let dir = tempfile::tempdir().unwrap();
    let mut h = History::open(&dir.path().join("h.sqlite")).unwrap();
    assert_eq!(h.import(&old, 0.7).unwrap(), Imported::default());
}

#[test]
fn memory_a_history_kept_as_zero_becomes_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    let version = {
        // Schema 10 kept a job whose driver reported no memory at 0 MiB; job 2's 3,000 stands.
        let mut h = History::open(&path).unwrap();
        let a = h.record_placement(&job(1, "bert", 0, 0.0), &[]).unwrap();
        let b = h.record_placement(&job(2, "resnet", 0, 0.0), &[]).unwrap();
        h.connection()
            .execute_batch(&format!(
                "INSERT INTO job_telemetry(job_row, samples, mem_peak_mb, sm_util_sum, sm_util_samples)
                 VALUES ({a}, 1, 0, 50, 1), ({b}, 1, 3000, 50, 1);
                 INSERT INTO app_memory(app_id, peak_mb)
                 SELECT id, CASE name WHEN 'bert' THEN 0 ELSE 3000 END FROM applications;
                 PRAGMA user_version = 10;"
            ))
            .unwrap();
        h.schema_version().unwrap()
    };
    assert_eq!(version, 10);
    let h = History::open(&path).unwrap();
    assert_eq!(h.schema_version().unwrap(), MIGRATIONS.len() as i64);
    assert_eq!(h.app_mem_peak("bert").unwrap(), None);
    assert_eq!(h.app_mem_peak("resnet").unwrap(), Some(3000));
}

#[test]
fn placement_finish_and_intervals() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    let mut h = History::open(&path).unwrap();
    assert_eq!(h.schema_version().unwrap(), MIGRATIONS.len() as i64);
    let a = h.record_placement(&job(10, "bert", 0, 100.0), &[]).unwrap();
    let b = h.record_placement(&job(11, "resnet", 0, 150.0), &[a]).unwrap();
    h.record_finish(b, 0, 0, true, &[a], 200.0).unwrap();
    let active = h.active_jobs("n1").unwrap();
    assert_eq!(active.len(), 1);
    assert_eq!(active[0].job_id, 10);
    // a: alone 100-150, with b 150-200, alone from 200 (open). b: with a 150-200.
    let rows: Vec<(i64, Option<i64>, f64, Option<f64>)> = h
        .connection()
        .prepare("SELECT job_row, partner_row, started_at, ended_at FROM intervals ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        rows,
        vec![
            (a, None, 100.0, Some(150.0)),
            (a, Some(b), 150.0, Some(200.0)),
            (b, Some(a), 150.0, Some(200.0)),
            (a, None, 200.0, None),
        ]
    );
    // Reopening keeps everything.
    drop(h);
    let h = History::open(&path).unwrap();
    assert_eq!(h.active_jobs("n1").unwrap().len(), 1);
}

#[test]
fn equations_from_intervals() {
    let row = |a: f64, b: Option<f64>, p: Option<&str>| (a, b, p.map(String::from));
    // Alone 0-10, beside b 10-40, an instant beside c, alone 40-50.
    let eq = equation(
        [
            row(0.0, Some(10.0), None),
            row(10.0, Some(40.0), Some("b")),
            row(40.0, Some(40.0), Some("c")),
            row(40.0, Some(50.0), None),
        ]
        .into_iter(),
    )
    .unwrap();
    assert_eq!(eq.alone_s, 20.0);
    assert_eq!(eq.shared, vec![("b".to_string(), 30.0)]);
    // Two partners at once: the linear model does not hold, no equation.
    assert!(equation([row(0.0, Some(5.0), Some("b")), row(0.0, Some(5.0), Some("c"))].into_iter()).is_none());
    // Still open: no equation.
    assert!(equation([row(0.0, None, None)].into_iter()).is_none());
}

#[test]
fn progress_reports_teach_speeds_whatever_the_jobs_lengths() {
    // Application `a` does 2 iterations per second alone and 1 beside `b` (speed 0.5).
    // Its jobs differ in length, so their start and end times alone would mislead; their
    // reports do not. Job 1: alone 0-100 (200 it), beside b 100-300 (200 more).
    let dir = tempfile::tempdir().unwrap();
    let mut h = History::open(&dir.path().join("h.sqlite")).unwrap();
    let a = h.record_placement(&job(1, "a", 0, 0.0), &[]).unwrap();
    h.record_report(a, "progress", Some(100.0), &[], 0.7, 50.0).unwrap();
    h.record_report(a, "progress", Some(200.0), &[], 0.7, 100.0).unwrap();
    let b = h.record_placement(&job(2, "b", 0, 100.0), &[a]).unwrap();
    h.record_report(a, "progress", Some(300.0), &[b], 0.7, 200.0).unwrap();
    h.record_report(a, "progress", Some(400.0), &[b], 0.7, 300.0).unwrap();
    h.record_finish(b, 0, 0, true, &[a], 300.0).unwrap();
    // The last stretch (300-350, alone) ends without a report: its work is unknown.
    h.record_finish(a, 0, 0, true, &[], 350.0).unwrap();
    let learned = h.learn_from(a, 0.7).unwrap();
    let Learned::Shared { fits } = learned else {
        panic!("{learned:?}")
    };
    assert_eq!(fits.len(), 1);
    assert!((fits[0].speed - 0.5).abs() < 1e-3, "{fits:?}");
    // A later, much longer job of `a` beside b (3 it/s would be wrong: it is 1 it/s)
    // keeps the estimate where it is, though its runtime is nothing like the first's.
    let a2 = h.record_placement(&job(3, "a", 0, 1000.0), &[]).unwrap();
    let b2 = h.record_placement(&job(4, "b", 0, 1000.0), &[a2]).unwrap();
    h.record_report(a2, "progress", Some(2000.0), &[b2], 0.7, 3000.0)
        .unwrap();
    h.record_finish(b2, 0, 0, true, &[a2], 3000.0).unwrap();
    h.record_finish(a2, 0, 0, true, &[], 3100.0).unwrap();
    h.learn_from(a2, 0.7).unwrap();
    let e = pair(&h, "v100", "a", "b").unwrap();
    assert!((e.speed - 0.5).abs() < 1e-3 && e.observations == 3, "{e:?}");
}

#[test]
fn a_stretch_shared_for_a_few_seconds_teaches_nothing_of_the_pair() {
    // `a` does 1 it/s alone (0-900). `b` arrives 4 s before a's next report, which is 5 it
    // short of 900 (an error of half a percent of the stretch): read as a pair speed, 4 s
    // shared would say 0.05 where the truth is 0.5.
    let dir = tempfile::tempdir().unwrap();
    let mut h = History::open(&dir.path().join("h.sqlite")).unwrap();
    let a = h.record_placement(&job(1, "a", 0, 0.0), &[]).unwrap();
    h.record_report(a, "progress", Some(900.0), &[], 0.7, 900.0).unwrap();
    let b = h.record_placement(&job(2, "b", 0, 1796.0), &[a]).unwrap();
    h.record_report(a, "progress", Some(1795.0), &[b], 0.7, 1800.0).unwrap();
    let learned = h.learn_from_progress(a, 0.7).unwrap();
    assert!(
        matches!(&learned, Learned::Shared { fits } if fits.is_empty()),
        "{learned:?}"
    );
    assert!(pair(&h, "v100", "a", "b").is_none_or(|e| e.observations == 0));
    // The next stretch, shared throughout at 0.5, is what teaches it.
    h.record_report(a, "progress", Some(2245.0), &[b], 0.7, 2700.0).unwrap();
    h.learn_from_progress(a, 0.7).unwrap();
    let e = pair(&h, "v100", "a", "b").unwrap();
    assert!((e.speed - 0.5).abs() < 1e-3 && e.observations == 1, "{e:?}");
}

#[test]
fn compaction_keeps_the_latest_jobs_and_what_they_shared_with() {
    let dir = tempfile::tempdir().unwrap();
    let mut h = History::open(&dir.path().join("h.sqlite")).unwrap();
    // Five rounds: an `a` job shares with a `b` job that ends first; `a` ends later.
    // Round k: a from 100k to 100k+60, b from 100k to 100k+40.
    let mut last_a = 0;
    for k in 0..5u32 {
        let t = 100.0 * f64::from(k);
        let a = h.record_placement(&job(10 + k, "a", 0, t), &[]).unwrap();
        let b = h.record_placement(&job(20 + k, "b", 0, t + 1.0), &[a]).unwrap();
        h.record_finish(b, 0, 0, true, &[a], t + 40.0).unwrap();
        h.record_finish(a, 0, 0, true, &[], t + 60.0).unwrap();
        last_a = a;
    }
    let before = equation(
        intervals_of(&h.conn.transaction().unwrap(), last_a)
            .unwrap()
            .into_iter(),
    );
    // Keep 2 of each: `b` finishes first in each round, so the newest `a` may outlive its
    // partner's record only through the interval's own application column.
    assert_eq!(h.compact(2).unwrap(), 6);
    let count = |app: &str| -> i64 {
        h.conn
            .query_row(
                "SELECT count(*) FROM jobs j JOIN applications a ON a.id = j.app_id WHERE a.name = ?1",
                [app],
                |r| r.get(0),
            )
            .unwrap()
    };
    assert_eq!((count("a"), count("b")), (2, 2));
    let after = equation(
        intervals_of(&h.conn.transaction().unwrap(), last_a)
            .unwrap()
            .into_iter(),
    );
    assert_eq!(before, after, "the kept job's equation is unchanged");
    assert_eq!(after.unwrap().shared[0].0, "b");
    let orphans: i64 = h
        .conn
        .query_row(
            "SELECT count(*) FROM intervals WHERE job_row NOT IN (SELECT id FROM jobs)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(orphans, 0);
    assert_eq!(h.compact(2).unwrap(), 0, "nothing more to do");
    // Running jobs are never compacted.
    h.record_placement(&job(99, "a", 1, 1000.0), &[]).unwrap();
    assert_eq!(h.compact(0).unwrap(), 4);
    assert_eq!(h.active_jobs("n1").unwrap().len(), 1);
}

#[test]
fn corrupt_database_is_reported_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    let junk = b"this is not a database, but someone's precious file".repeat(100);
    std::fs::write(&path, &junk).unwrap();
    let err = History::open(&path).err().expect("must fail");
    let text = err.to_string();
    assert!(text.contains("corrupt") && text.contains("left as is"), "{text}");
    assert_eq!(std::fs::read(&path).unwrap(), junk);
}

#[test]
fn a_history_that_cannot_be_written_is_not_called_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    drop(History::open(&path).unwrap());
    // What SQLite says when the file cannot be written (root writes through permissions, so
    // the error is made with a read-only connection).
    let ro = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let e = ro
        .execute("INSERT INTO applications(name) VALUES ('x')", [])
        .unwrap_err();
    let text = super::opening_failed(&path, e).to_string();
    assert!(
        text.contains("cannot be written") && text.contains("permissions") && !text.contains("corrupt"),
        "{text}"
    );
    // And as a user, a history made read-only by its permissions.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
        let text = History::open(&path).err().expect("must fail").to_string();
        assert!(
            text.contains("cannot be written") && !text.contains("corrupt"),
            "{text}"
        );
    }
}

#[test]
fn newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    drop(History::open(&path).unwrap());
    Connection::open(&path)
        .unwrap()
        .pragma_update(None, "user_version", 99)
        .unwrap();
    let err = History::open(&path).err().expect("must fail");
    assert!(matches!(err, HistoryError::TooNew { found: 99, .. }), "{err}");
}

#[test]
fn estimates_are_read_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let h = History::open(&dir.path().join("h.sqlite")).unwrap();
    h.connection()
        .execute_batch(
            "INSERT INTO applications(id, name) VALUES (1, 'a'), (2, 'b');
             INSERT INTO pair_estimates VALUES ('v100', 1, 2, 0.8, 0.6, 4, 0.01, 0);",
        )
        .unwrap();
    let e = pair(&h, "v100", "a", "b").unwrap();
    assert_eq!((e.speed, e.other_speed, e.observations, e.oom), (0.8, 0.6, 4, false));
    assert!(pair(&h, "a100", "a", "b").is_none());
    assert!(pair(&h, "v100", "b", "a").is_none());
}

#[test]
fn a_long_write_of_the_learning_kind_lets_a_waiting_request_in() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    let mut h = History::open(&path).unwrap();
    let mut learner = h.open_beside(&path).unwrap();
    let inside = std::sync::Arc::new(std::sync::Barrier::new(2));
    let (steps, step) = (400, std::time::Duration::from_millis(5));
    std::thread::scope(|s| {
        let inside_too = std::sync::Arc::clone(&inside);
        let long = s.spawn(move || {
            learner
                .write_in_steps(|l| {
                    for i in 0..steps {
                        l.let_requests_in()?;
                        l.conn
                            .exec("INSERT INTO applications(name) VALUES (?1)", [format!("x{i}")])?;
                        if i == 0 {
                            inside_too.wait();
                        }
                        std::thread::sleep(step);
                    }
                    Ok(())
                })
                .unwrap()
        });
        // The learning kind of write holds the lock now, for about 2 s in all; a request's
        // write gets in at its next step instead of after all of them.
        inside.wait();
        let t = std::time::Instant::now();
        h.record_placement(&job(1, "a", 0, 1.0), &[]).unwrap();
        let waited = t.elapsed();
        long.join().unwrap();
        assert!(
            waited < step * steps / 4,
            "the request waited {waited:?}, as long as the whole write"
        );
    });
    let apps: i64 = h
        .connection()
        .query_row("SELECT count(*) FROM applications", [], |r| r.get(0))
        .unwrap();
    assert_eq!(apps, steps as i64 + 1, "both writes are whole");
}

#[test]
fn a_new_history_and_its_directory_are_not_readable_by_other_users() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lib/multiplexd/h.sqlite");
    drop(History::open(&path).unwrap());
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(path.parent().unwrap()), 0o700);
    assert_eq!(mode(&dir.path().join("lib")), 0o700);
    for extra in ["h.sqlite-wal", "h.sqlite-shm"] {
        let p = path.with_file_name(extra);
        if p.exists() {
            assert_eq!(mode(&p) & 0o077, 0, "{extra}");
        }
    }
}

#[test]
fn busy_gpu_time_measures_a_job_that_reports_nothing_and_a_count_begun_again_starts_anew() {
    use crate::history::BUSY;
    // `a` is busy 0.8 s a second alone (0-600 s), then shares with `b`. The daemon restarted
    // at 900 s and began a's count again at 0; from there a is busy 0.4 s a second: speed 0.5.
    let dir = tempfile::tempdir().unwrap();
    let mut h = History::open(&dir.path().join("h.sqlite")).unwrap();
    let a = h.record_placement(&job(1, "a", 0, 0.0), &[]).unwrap();
    for (busy, at) in [(0.0, 0.0), (240.0, 300.0), (480.0, 600.0)] {
        h.record_report(a, BUSY, Some(busy), &[], 0.7, at).unwrap();
    }
    let b = h.record_placement(&job(2, "b", 0, 600.0), &[a]).unwrap();
    h.record_report(a, BUSY, Some(0.0), &[b], 0.7, 900.0).unwrap();
    // The stretch 600-900 s has no measure (the count went back): read as one, a would
    // have done negative work beside b.
    let learned = h.learn_from_progress(a, 0.7).unwrap();
    assert!(
        pair(&h, "v100", "a", "b").is_none_or(|e| e.observations == 0),
        "{learned:?}"
    );
    h.record_report(a, BUSY, Some(120.0), &[b], 0.7, 1200.0).unwrap();
    h.learn_from_progress(a, 0.7).unwrap();
    let e = pair(&h, "v100", "a", "b").unwrap();
    assert!((e.speed - 0.5).abs() < 1e-3 && e.observations == 1, "{e:?}");
    // Its progress reports, where a job sends them, are what measures it: here they say 0.25.
    let a2 = h.record_placement(&job(3, "a", 0, 2000.0), &[]).unwrap();
    h.record_report(a2, "progress", Some(100.0), &[], 0.7, 2100.0).unwrap();
    h.record_report(a2, BUSY, Some(0.0), &[], 0.7, 2000.0).unwrap();
    h.record_report(a2, BUSY, Some(80.0), &[], 0.7, 2100.0).unwrap();
    let b2 = h.record_placement(&job(4, "b", 0, 2100.0), &[a2]).unwrap();
    h.record_report(a2, "progress", Some(125.0), &[b2], 0.7, 2200.0)
        .unwrap();
    h.record_report(a2, BUSY, Some(120.0), &[b2], 0.7, 2200.0).unwrap();
    let Learned::Shared { fits } = h.learn_from_progress(a2, 0.7).unwrap() else {
        panic!("nothing learned")
    };
    let f = fits.iter().find(|f| f.partner == "b").unwrap();
    // 300 s at 0.5 from a's busy time and 100 s at 0.25 from a2's reports: below 0.5. Had
    // a2's busy time counted instead (0.4 a second beside b), both would say 0.5.
    assert!(f.speed > 0.3 && f.speed < 0.49, "{fits:?}");
}

/// Exports drawn to overlap: three applications, pairs with repeated observation counts (ties),
/// some marked out of memory, solo runs and memories that differ.
fn drawn_exports(seed: u64, count: usize) -> Vec<Export> {
    let mut x = seed;
    let mut draw = |n: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    let apps = ["a", "b", "c"];
    (0..count)
        .map(|_| {
            let mut e = export_of(Vec::new());
            for app in apps {
                if draw(2) == 0 {
                    e.solo.push(exchange::SoloRow {
                        gpu_model: "v100".into(),
                        app: app.into(),
                        runtime_s: 10.0 + draw(50) as f64,
                        runs: draw(4) as u32 + 1,
                    });
                }
                if draw(2) == 0 {
                    e.memory.push(exchange::MemoryRow {
                        app: app.into(),
                        peak_mb: 1000 + draw(5) * 1000,
                    });
                }
                for other in apps {
                    if draw(3) == 0 {
                        continue;
                    }
                    e.pairs.push(PairRow {
                        gpu_model: "v100".into(),
                        app: app.into(),
                        other: other.into(),
                        speed: 0.1 + draw(9) as f64 / 10.0,
                        other_speed: 0.1 + draw(9) as f64 / 10.0,
                        observations: draw(3) as u32,
                        variance: None,
                        oom: draw(4) == 0,
                    });
                }
            }
            e
        })
        .collect()
}

#[test]
fn exports_merged_in_memory_and_imported_once_leave_what_importing_each_in_turn_leaves() {
    let dir = tempfile::tempdir().unwrap();
    for seed in 0..40 {
        let exports = drawn_exports(seed, 5);
        // Each history starts from what this node learned itself: the first export.
        let mut one_by_one = History::open(&dir.path().join(format!("each-{seed}.sqlite"))).unwrap();
        let mut at_once = History::open(&dir.path().join(format!("once-{seed}.sqlite"))).unwrap();
        one_by_one.import(&exports[0], 0.7).unwrap();
        at_once.import(&exports[0], 0.7).unwrap();
        let mut merger = Merger::default();
        for e in &exports[1..] {
            one_by_one.import(e, 0.7).unwrap();
            merger.add(e).unwrap();
        }
        at_once.import(&merger.finish(), 0.7).unwrap();
        assert_eq!(one_by_one.export().unwrap(), at_once.export().unwrap(), "seed {seed}");
        for app in ["a", "b", "c"] {
            assert_eq!(
                known(&one_by_one, "v100", app),
                known(&at_once, "v100", app),
                "seed {seed}, {app}"
            );
        }
    }
}

/// Nodes that merged the same exports hold the same rows, whatever order each merged them in:
/// estimates on as many observations as ours that differ from ours (drawn here often) are
/// ranked by their values, not by which came first.
#[test]
fn the_order_of_merging_does_not_change_what_a_node_holds() {
    for seed in 0..40 {
        let exports = drawn_exports(seed, 5);
        let orders: [Vec<usize>; 3] = [vec![0, 1, 2, 3, 4], vec![4, 3, 2, 1, 0], vec![2, 0, 4, 1, 3]];
        let held: Vec<Export> = orders
            .iter()
            .map(|order| {
                let mut h = History::open(Path::new(":memory:")).unwrap();
                for &i in order {
                    h.import(&exports[i], 0.7).unwrap();
                }
                h.export().unwrap()
            })
            .collect();
        let merged: Vec<Export> = orders
            .iter()
            .map(|order| {
                let mut merger = Merger::default();
                for &i in order {
                    merger.add(&exports[i]).unwrap();
                }
                merger.finish()
            })
            .collect();
        for k in 1..orders.len() {
            assert_eq!(held[0], held[k], "seed {seed}, order {:?}", orders[k]);
            assert_eq!(merged[0], merged[k], "seed {seed}, order {:?}", orders[k]);
        }
        // What a node holds after merging everything is what the merger made of everything.
        assert_eq!(held[0], merged[0], "seed {seed}");
    }
}

#[test]
fn a_merger_refuses_an_export_import_would_refuse_and_keeps_what_it_had() {
    let mut merger = Merger::default();
    let good = drawn_exports(7, 1).remove(0);
    merger.add(&good).unwrap();
    let mut bad = good.clone();
    bad.pairs[0].speed = 1.5;
    assert!(merger.add(&bad).unwrap_err().contains("speeds must be in (0, 1]"));
    assert_eq!(merger.finish(), good);
}

/// An import makes again the means of only the applications whose pairs it changed, and fits
/// the effects from the pairs it merged, writing only what changed: both stay what making
/// everything again from the table gives, whatever effects were held before (learning steps
/// them, it does not fit them).
#[test]
fn an_import_leaves_the_means_and_effects_a_whole_refit_would() {
    let means = |h: &History| -> Vec<(String, i64, f64, i64, i64)> {
        let mut stmt = h
            .conn
            .prepare("SELECT gpu_model, app_id, mean, pairs, ooms FROM app_means ORDER BY gpu_model, app_id")
            .unwrap();
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
            .unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    };
    let effects = |h: &History| -> Vec<(String, i64, f64, i64, f64, i64)> {
        let mut stmt = h
            .conn
            .prepare("SELECT * FROM app_effects ORDER BY gpu_model, app_id")
            .unwrap();
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
            })
            .unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    };
    for seed in 0..40 {
        let mut h = History::open(Path::new(":memory:")).unwrap();
        for (i, e) in drawn_exports(seed, 5).iter().enumerate() {
            // Effects that are not the fit: moved, and one of a model with no pairs at all.
            h.conn
                .execute_batch(
                    "UPDATE app_effects SET base = base + 0.125 WHERE app_id % 2 = 0;
                     INSERT OR REPLACE INTO app_effects SELECT 'p100', id, 0.5, 3, 0.0, 3 FROM applications;",
                )
                .unwrap();
            h.import(e, 0.7).unwrap();
            let imported = (means(&h), effects(&h));
            assert!(!imported.0.is_empty(), "seed {seed}, export {i}");
            assert!(imported.1.iter().all(|e| e.0 == "v100"), "seed {seed}, export {i}");
            h.refit_effects(0.7).unwrap();
            assert_eq!(imported, (means(&h), effects(&h)), "seed {seed}, export {i}");
        }
    }
}

fn pair_row(speed: f64, observations: u32) -> PairRow {
    PairRow {
        gpu_model: "v100".into(),
        app: "a".into(),
        other: "b".into(),
        speed,
        other_speed: speed,
        observations,
        variance: None,
        oom: false,
    }
}

/// An export holding `pairs` and nothing else.
fn export_of(pairs: Vec<PairRow>) -> Export {
    Export {
        format: EXPORT_FORMAT.into(),
        version: EXPORT_VERSION,
        solo: Vec::new(),
        pairs,
        memory: Vec::new(),
    }
}

/// The estimates are read from memory while nothing they are read from changed: a change this
/// connection makes, one another connection commits, a table emptied and a transaction rolled
/// back are each read again.
#[test]
fn what_the_estimates_keep_in_memory_is_bounded_however_many_names_are_asked() {
    // Names nobody ran: the history does not change, and each is kept as having no row.
    let h = History::open(Path::new(":memory:")).unwrap();
    let mut many = Wanted::default();
    for i in 0..=estimates::Memo::MAX {
        many.pair("v100", "a", &format!("b{i}"));
    }
    h.estimates(&many).unwrap();
    assert!(h.memo.borrow().len() > estimates::Memo::MAX);
    let mut one = Wanted::default();
    one.pair("v100", "a", "b0");
    h.estimates(&one).unwrap();
    // Afresh: what a new history keeps after the same one read.
    let fresh = History::open(Path::new(":memory:")).unwrap();
    fresh.estimates(&one).unwrap();
    assert_eq!(h.memo.borrow().len(), fresh.memo.borrow().len());
}

#[test]
fn estimates_are_read_again_once_anything_they_were_read_from_changed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    let mut h = History::open(&path).unwrap();
    let mut other = h.open_beside(&path).unwrap();
    let speed = |h: &History| pair(h, "v100", "a", "b").map(|p| p.speed);
    h.import(&export_of(vec![pair_row(0.5, 1)]), 0.7).unwrap();
    assert_eq!(speed(&h), Some(0.5));
    h.import(&export_of(vec![pair_row(0.625, 2)]), 0.7).unwrap();
    assert_eq!(speed(&h), Some(0.625));
    other.import(&export_of(vec![pair_row(0.75, 3)]), 0.7).unwrap();
    assert_eq!(speed(&h), Some(0.75));
    h.conn.execute("DELETE FROM pair_estimates", []).unwrap();
    assert_eq!(speed(&h), None);
    h.import(&export_of(vec![pair_row(0.5, 1)]), 0.7).unwrap();
    assert_eq!(speed(&h), Some(0.5));
    h.conn
        .execute_batch("BEGIN; UPDATE pair_estimates SET speed = 0.875;")
        .unwrap();
    assert_eq!(speed(&h), Some(0.875));
    h.conn.execute_batch("ROLLBACK").unwrap();
    assert_eq!(speed(&h), Some(0.5));
}

/// A running job's partners are read from memory while the node's jobs are unchanged: they
/// follow each job placed beside it or ended, here or through another connection.
#[test]
fn a_running_jobs_partners_follow_what_runs_on_its_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sqlite");
    let mut h = History::open(&path).unwrap();
    let mut other = h.open_beside(&path).unwrap();
    let partners = |h: &History, job_id: u32| h.running_job("n1", job_id).unwrap().map(|(_, p)| p);
    let a = h.record_placement(&job(1, "a", 0, 0.0), &[]).unwrap();
    assert_eq!(partners(&h, 1), Some(vec![]));
    let b = h.record_placement(&job(2, "b", 0, 10.0), &[a]).unwrap();
    h.record_placement(&job(3, "c", 1, 10.0), &[]).unwrap();
    assert_eq!(partners(&h, 1), Some(vec![b]));
    assert_eq!(partners(&h, 2), Some(vec![a]));
    h.record_report(a, "progress", Some(1.0), &[b], 0.7, 20.0).unwrap();
    assert_eq!(partners(&h, 1), Some(vec![b]));
    h.record_finish(b, 0, 0, true, &[a], 30.0).unwrap();
    assert_eq!(partners(&h, 1), Some(vec![]));
    assert_eq!(partners(&h, 2), None);
    let d = other.record_placement(&job(4, "d", 0, 40.0), &[a]).unwrap();
    assert_eq!(partners(&h, 1), Some(vec![d]));
    assert_eq!(h.running_job("n1", 4).unwrap().unwrap().0.app, "d");
}
