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
//! - [`separations`]: the jobs given back to Slurm to run apart.
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
mod separations;
mod telemetry;
mod upkeep;

pub use equations::BUSY;
pub use exchange::{Export, Imported, Merger, PairRow, SoloRow, EXPORT_FORMAT, EXPORT_VERSION};
pub use explain::{Corunner, Explanation, Partner};
pub use jobs::{ActiveJob, NewJob};
pub use learning::{Learned, LEARN_ON_REPORTS_UNTIL, LEARN_WINDOW};

use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A history problem; the text says which file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("cannot open the history database {path}: {source}")]
    Open { path: PathBuf, source: rusqlite::Error },
    #[error("the history database {path} is corrupt ({detail}); it was left as is: move it away to start a new history, or restore a backup")]
    Corrupt { path: PathBuf, detail: String },
    #[error("the history database {path} has schema version {found}, newer than this multiplexd ({known}); it was left as is")]
    TooNew { path: PathBuf, found: i64, known: usize },
    #[error("the history database {path} cannot be written ({detail}): multiplexd must be able to write it, its -wal and -shm files and its directory (check their owner and permissions, and that the file system is not read-only); it was left as is")]
    NotWritable { path: PathBuf, detail: String },
    #[error(
        "the disk holding the history database {path} is full ({detail}): free some space there; nothing recorded so far was lost"
    )]
    DiskFull { path: PathBuf, detail: String },
    #[error("history database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("cannot start a history thread: {0}")]
    Thread(String),
}

impl HistoryError {
    /// An SQLite error met while serving a request, told as what it means for the database
    /// at `path`: a full disk or a file that cannot be written name the file and what to do.
    pub fn at(self, path: &Path) -> HistoryError {
        use rusqlite::ErrorCode;
        match &self {
            HistoryError::Sql(e) => match e.sqlite_error_code() {
                Some(ErrorCode::DiskFull) => HistoryError::DiskFull {
                    path: path.to_path_buf(),
                    detail: e.to_string(),
                },
                Some(ErrorCode::ReadOnly | ErrorCode::PermissionDenied) => HistoryError::NotWritable {
                    path: path.to_path_buf(),
                    detail: e.to_string(),
                },
                _ => self,
            },
            _ => self,
        }
    }

    /// The history refused a write for want of space or permission (the disk is full, the
    /// file or its file system became read-only): worth trying again later, unlike a bug.
    pub fn is_write_refused(&self) -> bool {
        use rusqlite::ErrorCode;
        match self {
            HistoryError::DiskFull { .. } | HistoryError::NotWritable { .. } => true,
            HistoryError::Sql(e) => matches!(
                e.sqlite_error_code(),
                Some(ErrorCode::DiskFull | ErrorCode::ReadOnly | ErrorCode::SystemIoFailure)
            ),
            _ => false,
        }
    }
}

/// How long a connection waits for another's write lock before it fails, in polls of
/// [`BUSY_POLL`]: about 5 s.
const BUSY_POLLS: i32 = 50_000;
const BUSY_POLL: std::time::Duration = std::time::Duration::from_micros(100);

/// How often [`History::wait_for_a_pause`] looks whether requests paused.
const PAUSE_POLL: Duration = Duration::from_millis(10);

/// SQLite's busy handler: poll every 0.1 ms. SQLite's own timeout sleeps 1, 2, 5, 10, ... ms
/// between tries, so a request that meets the learning thread's write of half a millisecond
/// would wait a millisecond or more, and far longer after a few tries.
fn wait_briefly(tries: i32) -> bool {
    if tries >= BUSY_POLLS {
        return false;
    }
    std::thread::sleep(BUSY_POLL);
    true
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

/// The tables whose changes each connection counts (SQLite's update hook), so that what was
/// read of them is read again from memory until one of them changes.
const COUNTED: [&str; 7] = [
    "jobs",
    "applications",
    "pair_estimates",
    "app_effects",
    "app_means",
    "solo_baselines",
    "app_memory",
];

/// The rows a connection changed in each of [`COUNTED`], and (last) in every other table.
#[derive(Debug, Default)]
struct Counts([AtomicU64; COUNTED.len() + 1]);

impl Counts {
    fn count(&self, table: &str) {
        let i = COUNTED.iter().position(|t| *t == table).unwrap_or(COUNTED.len());
        self.0[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// What a connection can know of the state of some tables: SQLite's count of the commits of
/// other connections (`PRAGMA data_version`), the rows this one changed in those tables, and
/// the rows it changed that the update hook did not see (SQLite empties a table at once, without
/// calling it, where no foreign key is to be checked). Equal twice, nothing in those tables
/// changed in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tables(i64, u64, u64);

impl History {
    /// The state of `tables` ([`COUNTED`] names) now; `None` inside a transaction, where what
    /// is read may yet be rolled back.
    fn tables(&self, tables: &[&str]) -> rusqlite::Result<Option<Tables>> {
        debug_assert!(tables.iter().all(|t| COUNTED.contains(t)), "{tables:?} not all counted");
        if !self.conn.is_autocommit() {
            return Ok(None);
        }
        let others: i64 = self
            .conn
            .prepare_cached("PRAGMA data_version")?
            .query_row([], |r| r.get(0))?;
        let count = |i: usize| self.counts.0[i].load(Ordering::Relaxed);
        let these = (COUNTED.iter().enumerate())
            .filter(|(_, t)| tables.contains(t))
            .map(|(i, _)| count(i))
            .sum();
        let seen: u64 = (0..=COUNTED.len()).map(count).sum();
        Ok(Some(Tables(
            others,
            these,
            self.conn.total_changes().wrapping_sub(seen),
        )))
    }

    /// The state of what [`History::export`] reads (`None` inside a transaction): equal to an
    /// earlier state, the export is the same as then.
    pub fn exported_state(&self) -> Result<Option<Tables>, HistoryError> {
        Ok(self.tables(&["applications", "pair_estimates", "solo_baselines", "app_memory"])?)
    }
}

/// How many prepared statements each connection keeps (rusqlite's default, 16, is fewer than
/// the history uses).
const STATEMENT_CACHE: usize = 64;

/// The open SQLite history.
pub struct History {
    conn: Connection,
    /// What the estimates read last, while the database is unchanged.
    memo: std::cell::RefCell<estimates::Memo>,
    /// The node's running jobs as last read, while the tables they are read from are unchanged.
    active: std::cell::RefCell<Option<(Tables, String, Vec<jobs::ActiveJob>)>>,
    /// How many rows this connection changed in each table.
    counts: Arc<Counts>,
    /// Shared by the connections of one daemon to one database.
    gate: Arc<Gate>,
}

/// Who goes first among one daemon's connections: a request waiting for the write lock is
/// counted here, and a long write on the learning thread commits what it has done and lets
/// it go first (see [`History::let_requests_in`]), so that a placement waits for one step of
/// learning at most, never for a whole job's.
#[derive(Debug)]
struct Gate {
    waiting: AtomicUsize,
    /// When the last request touched the history, in nanoseconds since `epoch`.
    last_request_ns: AtomicU64,
    epoch: Instant,
}

impl Default for Gate {
    fn default() -> Gate {
        Gate {
            waiting: AtomicUsize::new(0),
            last_request_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl History {
    /// Opens (creating if absent) and migrates the database at `path`.
    /// A new history and the directories made for it are its owner's alone (0600, 0700): it
    /// names every user's jobs.
    pub fn open(path: &Path) -> Result<History, HistoryError> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let cannot = |e: std::io::Error, what: &Path| HistoryError::Open {
            path: path.to_path_buf(),
            source: rusqlite::Error::InvalidPath(PathBuf::from(format!("{}: {e}", what.display()))),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.is_dir() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| cannot(e, dir))?;
            }
        }
        let existed = path.exists();
        let conn = connect(path, OpenFlags::SQLITE_OPEN_CREATE)?;
        if !existed && path.exists() {
            // Before the -wal and -shm files exist: SQLite gives them the database's mode.
            // (An in-memory database, as the simulator's, has no file.)
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| cannot(e, path))?;
        } else if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o004 != 0 {
                tracing::warn!(
                    "the history {} is readable by every user (mode {:o}): it names every user's jobs; chmod 600 it",
                    path.display(),
                    meta.permissions().mode() & 0o777
                );
            }
        }
        let opening = |e: rusqlite::Error| opening_failed(path, e);
        // A file that is not a database fails here, before anything is written to it.
        let check: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(opening)?;
        if check != "ok" {
            return Err(HistoryError::Corrupt {
                path: path.to_path_buf(),
                detail: check,
            });
        }
        // SQLite opens a file it may not write read-only rather than fail: every write would
        // fail later, one request at a time.
        if conn.is_readonly(c"main").map_err(opening)? {
            return Err(HistoryError::NotWritable {
                path: path.to_path_buf(),
                detail: "SQLite could open it for reading only".into(),
            });
        }
        let mut history = History::configured(conn, Arc::default()).map_err(|e| match e {
            HistoryError::Sql(e) => opening(e),
            other => other,
        })?;
        history.migrate(path).map_err(|e| match e {
            HistoryError::Sql(e) => opening(e),
            other => other,
        })?;
        Ok(history)
    }

    /// Opens a second connection to this history's database at `path`, for a thread of the
    /// same daemon: its long writes give way to this one's (see [`Gate`]). The file was
    /// checked and migrated when this history was opened.
    pub fn open_beside(&self, path: &Path) -> Result<History, HistoryError> {
        History::configured(connect(path, OpenFlags::empty())?, Arc::clone(&self.gate))
    }

    /// What every connection of the daemon's sets.
    fn configured(conn: Connection, gate: Arc<Gate>) -> Result<History, HistoryError> {
        conn.busy_handler(Some(wait_briefly))?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // NORMAL in WAL mode: a committed transaction survives a crash of the process.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let counts = Arc::new(Counts::default());
        let counting = Arc::clone(&counts);
        conn.update_hook(Some(move |_, _: &str, table: &str, _| counting.count(table)));
        Ok(History {
            conn,
            gate,
            memo: Default::default(),
            active: Default::default(),
            counts,
        })
    }
}

/// What an SQLite error met while opening the history at `path` means: a file that is not a
/// database, or is damaged, is corrupt; one that cannot be written, or a full disk, is not
/// (moving such a history away would throw a good one out).
fn opening_failed(path: &Path, e: rusqlite::Error) -> HistoryError {
    use rusqlite::ErrorCode;
    let path = path.to_path_buf();
    let detail = e.to_string();
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => HistoryError::Corrupt { path, detail },
        Some(ErrorCode::ReadOnly | ErrorCode::PermissionDenied | ErrorCode::CannotOpen) => {
            HistoryError::NotWritable { path, detail }
        }
        Some(ErrorCode::DiskFull) => HistoryError::DiskFull { path, detail },
        _ => HistoryError::Open { path, source: e },
    }
}

/// A read-write connection to the database at `path`, with `extra` flags.
fn connect(path: &Path, extra: OpenFlags) -> Result<Connection, HistoryError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX | extra;
    Connection::open_with_flags(path, flags).map_err(|source| HistoryError::Open {
        path: path.to_path_buf(),
        source,
    })
}

impl History {
    /// A write transaction that takes the write lock at once (waiting for it up to the busy
    /// timeout): the daemon writes through two connections (requests, learning), and a
    /// transaction that reads first and writes later would fail at once, not wait, if the
    /// other connection committed in between.
    fn write(&mut self) -> rusqlite::Result<rusqlite::Transaction<'_>> {
        self.gate.waiting.fetch_add(1, Ordering::SeqCst);
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate);
        self.gate.waiting.fetch_sub(1, Ordering::SeqCst);
        tx
    }

    /// Notes that a request is being served (see [`Self::wait_for_a_pause`]).
    pub fn request_seen(&self) {
        let ns = self.gate.epoch.elapsed().as_nanos() as u64;
        self.gate.last_request_ns.store(ns, Ordering::SeqCst);
    }

    /// For work that can wait (learning): returns once no request of this daemon was seen for
    /// `quiet`, or after `at_most`. A burst of requests (a job array's steps starting) is
    /// served first, and learning still goes on under any load.
    pub fn wait_for_a_pause(&self, quiet: Duration, at_most: Duration) {
        let start = Instant::now();
        loop {
            let last = Duration::from_nanos(self.gate.last_request_ns.load(Ordering::SeqCst));
            let since = self.gate.epoch.elapsed().saturating_sub(last);
            if since >= quiet || start.elapsed() >= at_most {
                return;
            }
            // Looked at every PAUSE_POLL at most: while requests flow, a waiting learner wakes
            // 100 times a second, not once per request.
            std::thread::sleep(
                (quiet - since)
                    .max(PAUSE_POLL)
                    .min(at_most.saturating_sub(start.elapsed())),
            );
        }
    }

    /// One statement that writes, outside any transaction, on the request path: counted as
    /// waiting for the write lock (see [`Gate`]) until it is done.
    fn write_one<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.gate.waiting.fetch_add(1, Ordering::SeqCst);
        let r = self.conn.exec(sql, params);
        self.gate.waiting.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// Runs `steps` as a write of the learning kind: in a transaction begun by hand, which
    /// [`Self::let_requests_in`] (called by `steps` between steps) may commit and begin again.
    /// On an error nothing of the step under way is kept.
    fn write_in_steps<T>(&mut self, steps: impl FnOnce(&History) -> rusqlite::Result<T>) -> Result<T, HistoryError> {
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        match steps(self) {
            Ok(v) => {
                self.conn.execute_batch("COMMIT")?;
                Ok(v)
            }
            Err(e) => {
                if !self.conn.is_autocommit() {
                    let _ = self.conn.execute_batch("ROLLBACK");
                }
                Err(e.into())
            }
        }
    }

    /// Between two steps of [`Self::write_in_steps`]: if a request of this daemon waits for
    /// the write lock, commits what is done, waits until no request waits, and begins again.
    fn let_requests_in(&self) -> rusqlite::Result<()> {
        if self.gate.waiting.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        self.conn.execute_batch("COMMIT")?;
        while self.gate.waiting.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(BUSY_POLL);
        }
        self.conn.execute_batch("BEGIN IMMEDIATE")
    }

    /// Limits this connection's page cache to about `kib` KiB (SQLite's default is 2 MiB).
    pub fn limit_cache(&self, kib: u32) -> Result<(), HistoryError> {
        self.conn.pragma_update(None, "cache_size", -i64::from(kib))?;
        Ok(())
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
