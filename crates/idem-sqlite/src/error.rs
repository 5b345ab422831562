use std::path::PathBuf;

/// Errors opening the database. Operations on an open store return [`idem_store::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The directory for the database file could not be created.
    #[error("cannot create directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// SQLite refused to open or set up the file.
    #[error("cannot open sqlite database {path}")]
    Open {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        #[source]
        source: rusqlite::Error,
    },
    /// The file was written by a newer idem with a schema this version does not know.
    #[error("database {path} has schema version {found}; this idem knows up to {known}")]
    SchemaTooNew {
        /// The database file.
        path: PathBuf,
        /// The schema version in the file.
        found: i64,
        /// The newest schema version this build knows.
        known: i64,
    },
    /// Another process has the database open: two writers on one file would hand out the same generations.
    #[error("database {path} is in use by another process (lock file {lock} is held)")]
    InUse {
        /// The database file.
        path: PathBuf,
        /// The lock file next to it.
        lock: PathBuf,
    },
    /// A process waiting for its turn on the database ([`crate::SharedSqlite`]) found it kept open by a
    /// process that never takes turns (its lock file says `exclusive`: `idem serve`, or another program with
    /// a [`crate::SqliteStore`] open) for two seconds.
    #[error(
        "database {path} is kept open by another process ({holder}) that does not share it: `idem serve` keeps its \
         database to itself, so give this command another file (or the server's URL)"
    )]
    HeldElsewhere {
        /// The database file.
        path: PathBuf,
        /// The lock file's mark: `exclusive PID`.
        holder: String,
    },
    /// A process waiting for its turn on the database ([`crate::SharedSqlite`]) was not given it for
    /// `waited_s` seconds: the holder may be stopped (SIGSTOP), hung, or one of very many.
    #[error(
        "database {path} was not given up for {waited_s} s by the process holding it ({holder}): it may be stopped or hung"
    )]
    WaitedTooLong {
        /// The database file.
        path: PathBuf,
        /// The lock file's mark (`shared PID`), or `unknown`.
        holder: String,
        /// How long it waited, in seconds.
        waited_s: u64,
    },
    /// The lock file next to the database could not be created or locked.
    #[error("cannot lock {lock}")]
    Lock {
        /// The lock file.
        lock: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The writer thread could not be started.
    #[error("cannot start the writer thread")]
    Thread(#[source] std::io::Error),
    /// An operation on the open store failed.
    #[error(transparent)]
    Store(#[from] idem_store::Error),
}

impl Error {
    /// True when opening again later may succeed: the file kept by another process ([`Error::HeldElsewhere`],
    /// [`Error::WaitedTooLong`]), or held locked by another connection past SQLite's busy timeout (a backup, a
    /// `sqlite3` shell, a transaction left open), or an operation that failed for now.
    pub fn is_unavailable(&self) -> bool {
        use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked};
        match self {
            Error::HeldElsewhere { .. } | Error::WaitedTooLong { .. } => true,
            Error::Open { source, .. } => matches!(source.sqlite_error_code(), Some(DatabaseBusy | DatabaseLocked)),
            Error::Store(e) => e.is_unavailable(),
            _ => false,
        }
    }
}
