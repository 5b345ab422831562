use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use crate::Error;

/// Newest schema version this build writes.
pub(crate) const SCHEMA_VERSION: i64 = 2;

/// Expiry times and the generation counter are plain integers: milliseconds since the Unix epoch and the last
/// generation handed out. The counter lives in `meta` and is written in the same transaction as the values it
/// numbers, so after a crash it can never be behind a value on disk (generations never go backwards).
const SCHEMA_V1: &str = "
CREATE TABLE IF NOT EXISTS kv (
    key TEXT NOT NULL PRIMARY KEY,
    value BLOB NOT NULL,
    generation INTEGER NOT NULL,
    expires_at INTEGER
);
CREATE INDEX IF NOT EXISTS kv_expires_at ON kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS counter_dedupe (
    key TEXT NOT NULL,
    dedupe_id TEXT NOT NULL,
    value INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (key, dedupe_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS counter_dedupe_expires_at ON counter_dedupe (expires_at);
CREATE TABLE IF NOT EXISTS meta (name TEXT NOT NULL PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO meta (name, value) VALUES ('generation', 0), ('schema_version', 1);
";

/// Version 2: dedupe records remember their payload, so an id reused with another payload is refused
/// (`Error::DedupeIdReused`). `counter_dedupe.delta` is the add's delta; rows from version 1 keep NULL there and
/// are taken as matching any delta, which is what version 1 answered. `set_dedupe` holds set changes under a
/// dedupe id: the change's fingerprint (`SetChange::fingerprint`) and its outcome (`generation` NULL when the
/// change left no set). Applied in one transaction with the version bump, so a crash leaves version 1 intact.
const MIGRATE_V1_TO_V2: &str = "
ALTER TABLE counter_dedupe ADD COLUMN delta INTEGER;
CREATE TABLE set_dedupe (
    key TEXT NOT NULL,
    dedupe_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    generation INTEGER,
    members INTEGER NOT NULL,
    added INTEGER NOT NULL,
    removed INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (key, dedupe_id)
) WITHOUT ROWID;
CREATE INDEX set_dedupe_expires_at ON set_dedupe (expires_at);
UPDATE meta SET value = 2 WHERE name = 'schema_version';
";

fn open_err(path: &Path) -> impl FnOnce(rusqlite::Error) -> Error + '_ {
    move |source| Error::Open { path: path.to_owned(), source }
}

/// Opens the write connection, creating and migrating the schema. Returns it with the last generation.
pub(crate) fn open_writer(path: &Path) -> Result<(Connection, u64), Error> {
    let conn = Connection::open(path).map_err(open_err(path))?;
    // WAL lets readers proceed during a commit; FULL makes COMMIT fsync the WAL, which is what "acknowledged
    // means durable" rests on.
    conn.pragma_update(None, "journal_mode", "WAL").map_err(open_err(path))?;
    conn.pragma_update(None, "synchronous", "FULL").map_err(open_err(path))?;
    conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(open_err(path))?;
    conn.execute_batch(SCHEMA_V1).map_err(open_err(path))?;
    let version: i64 = conn
        .query_row("SELECT value FROM meta WHERE name = 'schema_version'", [], |r| r.get(0))
        .map_err(open_err(path))?;
    if version > SCHEMA_VERSION {
        return Err(Error::SchemaTooNew { path: path.to_owned(), found: version, known: SCHEMA_VERSION });
    }
    if version < 2 {
        let tx = conn.unchecked_transaction().map_err(open_err(path))?;
        tx.execute_batch(MIGRATE_V1_TO_V2).map_err(open_err(path))?;
        tx.commit().map_err(open_err(path))?;
        tracing::info!(path = %path.display(), "migrated the database to schema version 2");
    }
    // Never start below a generation already on disk, whatever `meta` says: every table holding generations
    // counts.
    let generation: i64 = conn
        .query_row(
            "SELECT max((SELECT value FROM meta WHERE name = 'generation'), \
             coalesce((SELECT max(generation) FROM kv), 0), coalesce((SELECT max(generation) FROM counter_dedupe), 0), \
             coalesce((SELECT max(generation) FROM set_dedupe), 0))",
            [],
            |r| r.get(0),
        )
        .map_err(open_err(path))?;
    Ok((conn, u64::try_from(generation).unwrap_or(0)))
}

/// Opens a read-only connection; it sees every transaction committed before each statement starts.
pub(crate) fn open_reader(path: &Path) -> Result<Connection, Error> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
    let conn = Connection::open_with_flags(path, flags).map_err(open_err(path))?;
    conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(open_err(path))?;
    Ok(conn)
}
