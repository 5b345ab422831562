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
