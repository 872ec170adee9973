//! The node's interference history in SQLite (WAL, versioned migrations): the one owner of the
//! database. Jobs placed on a GPU, the steps that ran in them, the intervals during which each
//! job shared its GPU with whom, what was learned from them, and the snapshot of estimates
//! placement reads. A database that cannot be opened, is corrupt, or is newer than this program
//! is an error: it is never replaced.
//!
//! - [`schema`]: the migrations.
//! - [`jobs`]: recording placements, steps, ends and reports.
//! - [`learning`] and [`equations`]: what finished and running jobs teach.
//! - [`effects`]: what is known of each application beside partners never seen.
//! - [`estimates`]: the snapshot one placement decision reads.
//! - [`telemetry`]: GPU memory and utilisation per job.
//! - [`upkeep`]: compaction and checkpoints.
//! - [`exchange`] and [`explain`]: export, import and explanations, for tools and other nodes.

mod effects;
mod equations;
mod estimates;
pub mod exchange;
pub mod explain;
mod jobs;
mod learning;
mod schema;
mod telemetry;
mod upkeep;

pub use exchange::{Export, Imported, PairRow, SoloRow, EXPORT_FORMAT, EXPORT_VERSION};
pub use explain::{Corunner, Explanation, Partner};
pub use jobs::{ActiveJob, NewJob};
pub use learning::{Learned, LEARN_ON_REPORTS_UNTIL, LEARN_WINDOW};

use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};

/// A history problem; the text says which file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("cannot open the history database {path}: {source}")]
    Open { path: PathBuf, source: rusqlite::Error },
    #[error("the history database {path} is corrupt ({detail}); it was left as is: move it away to start a new history, or restore a backup")]
    Corrupt { path: PathBuf, detail: String },
    #[error("the history database {path} has schema version {found}, newer than this multiplexd ({known}); it was left as is")]
    TooNew { path: PathBuf, found: i64, known: usize },
    #[error("history database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("cannot start a history thread: {0}")]
    Thread(String),
}

/// `execute` and `query_row` through the connection's statement cache: the history runs the
/// same few statements for every request, and parsing them each time cost more than running
/// them.
trait Cached {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn row<T, P: rusqlite::Params, F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>>(
        &self,
        sql: &str,
        params: P,
        f: F,
    ) -> rusqlite::Result<T>;
}

impl Cached for Connection {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }
    fn row<T, P: rusqlite::Params, F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>>(
        &self,
        sql: &str,
        params: P,
        f: F,
    ) -> rusqlite::Result<T> {
        self.prepare_cached(sql)?.query_row(params, f)
    }
}

/// How many prepared statements each connection keeps (rusqlite's default, 16, is fewer than
/// the history uses).
const STATEMENT_CACHE: usize = 64;

/// The open SQLite history.
pub struct History {
    conn: Connection,
}

impl History {
    /// Opens (creating if absent) and migrates the database at `path`.
    pub fn open(path: &Path) -> Result<History, HistoryError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| HistoryError::Open {
                path: path.to_path_buf(),
                source: rusqlite::Error::InvalidPath(PathBuf::from(format!("{}: {e}", dir.display()))),
            })?;
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags).map_err(|source| HistoryError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let corrupt = |detail: String| HistoryError::Corrupt {
            path: path.to_path_buf(),
            detail,
        };
        // A file that is not a database fails here, before anything is written to it.
        let check: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| corrupt(e.to_string()))?;
        if check != "ok" {
            return Err(corrupt(check));
        }
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // NORMAL in WAL mode: a committed transaction survives a crash of the process.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let mut history = History { conn };
        history.migrate(path)?;
        Ok(history)
    }
}

impl History {
    /// A write transaction that takes the write lock at once (waiting for it up to the busy
    /// timeout): the daemon writes through two connections (requests, learning), and a
    /// transaction that reads first and writes later would fail at once, not wait, if the
    /// other connection committed in between.
    fn write(&mut self) -> rusqlite::Result<rusqlite::Transaction<'_>> {
        self.conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
    }

    /// The schema version in use.
    pub fn schema_version(&self) -> Result<i64, HistoryError> {
        Ok(self.conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    /// The connection, for read-only queries by tools and tests.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

#[cfg(test)]
mod tests;
