//! Keeping the history bounded and its writes off the request path: compaction of old jobs,
//! and WAL checkpoints from a thread of their own.

use super::{History, HistoryError, STATEMENT_CACHE};
use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};

/// How many old jobs one step of [`History::compact`] deletes.
const COMPACT_CHUNK: usize = 100;

/// Past this size of the WAL file, the background checkpoint waits for the writes to pause.
const WAL_LIMIT: u64 = 64 * 1024 * 1024;

impl History {
    /// Deletes the raw rows (job, steps,
    /// intervals, reports) of finished jobs beyond the latest
    /// `keep` of each application and GPU model: what they taught lives on in the solo
    /// runtimes and pair estimates, and learning only reads the latest jobs anyway. Intervals
    /// of kept jobs that shared with a deleted one keep its application. Returns how many
    /// jobs were deleted.
    ///
    /// The jobs to delete are found by a read, and deleted [`COMPACT_CHUNK`] at a time, giving
    /// way to the requests of this daemon between chunks.
    pub fn compact(&mut self, keep: i64) -> Result<usize, HistoryError> {
        let doomed: Vec<i64> = self
            .conn
            .prepare_cached(
                "SELECT id FROM (
                    SELECT id, row_number() OVER (PARTITION BY app_id, gpu_model ORDER BY finished_at DESC, id DESC) AS k
                    FROM jobs WHERE finished_at IS NOT NULL) WHERE k > ?1",
            )?
            .query_map([keep], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        if doomed.is_empty() {
            return Ok(0);
        }
        self.write_in_steps(|h| {
            h.conn.execute_batch(
                "CREATE TEMP TABLE IF NOT EXISTS doomed(id INTEGER PRIMARY KEY); DELETE FROM temp.doomed;",
            )?;
            for chunk in doomed.chunks(COMPACT_CHUNK) {
                h.let_requests_in()?;
                let mut doom = h.conn.prepare_cached("INSERT INTO temp.doomed(id) VALUES (?1)")?;
                for id in chunk {
                    doom.execute([id])?;
                }
                h.conn.execute_batch(
                    "UPDATE intervals SET partner_row = NULL WHERE partner_row IN (SELECT id FROM temp.doomed);
                     DELETE FROM intervals WHERE job_row IN (SELECT id FROM temp.doomed);
                     DELETE FROM steps WHERE job_row IN (SELECT id FROM temp.doomed);
                     DELETE FROM observations WHERE job_row IN (SELECT id FROM temp.doomed);
                     DELETE FROM job_telemetry WHERE job_row IN (SELECT id FROM temp.doomed);
                     DELETE FROM jobs WHERE id IN (SELECT id FROM temp.doomed);
                     DELETE FROM temp.doomed;",
                )?;
            }
            Ok(doomed.len())
        })
    }

    /// Moves WAL checkpoints (which write the database file and sync it) off the request path:
    /// this connection stops checkpointing on commit, and a thread of its own checkpoints
    /// every second until `shutdown`. If that thread cannot open the database, nothing changes.
    pub fn checkpoint_in_background(
        &self,
        path: &Path,
        shutdown: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<(), HistoryError> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| HistoryError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        let mut wal = path.as_os_str().to_owned();
        wal.push("-wal");
        let wal = PathBuf::from(wal);
        let mut trouble = crate::background::Trouble::default();
        crate::background::every("checkpoint", std::time::Duration::from_secs(1), shutdown, move || {
            // A passive checkpoint never waits for the daemon's writes, but under unbroken
            // load it never completes either and the WAL only grows: past WAL_LIMIT, one
            // checkpoint waits for a pause in the writes and truncates.
            let big = std::fs::metadata(&wal).is_ok_and(|m| m.len() > WAL_LIMIT);
            let sql = if big {
                "PRAGMA wal_checkpoint(TRUNCATE)"
            } else {
                "PRAGMA wal_checkpoint(PASSIVE)"
            };
            match conn.query_row(sql, [], |r| r.get::<_, i64>(0)) {
                Ok(_) => {
                    if trouble.recovered() {
                        tracing::info!("history checkpoints work again");
                    }
                }
                Err(e) => {
                    if trouble.failed(&e.to_string()) {
                        tracing::warn!(error = %e, "history checkpoint failed; retrying every second");
                    }
                }
            }
        })
        .map_err(|e| HistoryError::Thread(format!("checkpoint: {e}")))?;
        self.conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        Ok(())
    }
}
