use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use idem_store::backend::{apply_counter, apply_set};
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, ListItem, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written, millis_to_system_time, system_time_to_millis,
};
use rusqlite::{Connection, OptionalExtension};
use tokio::sync::oneshot;

use crate::Error;
use crate::lockfile::{self, lock_exclusively};
use crate::schema::{open_reader, open_writer};
use crate::writer::{self, Ctx, Finish, Msg};

/// Read-only connections; reads are short, so a few cover many concurrent requests on 2-8 cores.
const READERS: usize = 4;

/// The embedded SQLite store. Cheap to clone: clones share the file, the writer thread and the readers.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    limits: Limits,
    sender: Sender<Msg>,
    closed: AtomicBool,
    readers: Vec<Mutex<Connection>>,
    next_reader: AtomicUsize,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Held (OS advisory lock on `<db>.lock`) for as long as the store is open; the OS releases it when the
    /// process dies, so a crash never leaves the file locked. It names its holder ([`lockfile`]).
    lock: std::fs::File,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.inner.path).finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    system_time_to_millis(SystemTime::now())
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn to_usize(n: i64) -> usize {
    usize::try_from(n).unwrap_or(0)
}

fn sql_err(e: rusqlite::Error) -> StoreError {
    if for_now(&e) { StoreError::unavailable(e) } else { StoreError::backend(e) }
}

/// SQLITE_FULL: the disk (or the file system's quota) is full; SQLITE_BUSY or SQLITE_LOCKED: another
/// connection held the file past the busy timeout. The batch rolled back and nothing was written; the same
/// write succeeds once space returns or the lock is given up, so callers get [`StoreError::Unavailable`] (HTTP
/// 503 with `Retry-After`; the runner waits), not a failure a retry cannot fix.
fn for_now(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked, DiskFull};
    matches!(e.sqlite_error_code(), Some(DiskFull | DatabaseBusy | DatabaseLocked))
}

/// The error a write gets when its batch rolled back.
fn batch_err(e: Arc<rusqlite::Error>) -> StoreError {
    if for_now(&e) { StoreError::unavailable(e) } else { StoreError::backend(e) }
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`, creating its directory, and starts the writer thread.
    ///
    /// # Errors
    /// [`Error::CreateDir`], [`Error::Open`] when SQLite refuses the file, [`Error::SchemaTooNew`],
    /// [`Error::Thread`].
    pub fn open(path: impl AsRef<Path>, limits: Limits) -> Result<Self, Error> {
        let path = path.as_ref().to_owned();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| Error::CreateDir { path: dir.to_owned(), source })?;
        }
        let lock = lock_exclusively(&path)?;
        let (conn, last_generation) = open_writer(&path)?;
        let readers = (0..READERS).map(|_| open_reader(&path).map(Mutex::new)).collect::<Result<Vec<_>, _>>()?;
        let (sender, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("idem-sqlite-writer".into())
            .spawn(move || writer::run(conn, last_generation, rx))
            .map_err(Error::Thread)?;
        Ok(Self {
            inner: Arc::new(Inner {
                path,
                limits,
                sender,
                closed: AtomicBool::new(false),
                readers,
                next_reader: AtomicUsize::new(0),
                writer: Mutex::new(Some(handle)),
                lock,
            }),
        })
    }

    /// Says in the lock file that this store is held by a process that takes turns with others
    /// ([`crate::SharedSqlite`]), so a process waiting for it keeps waiting.
    pub(crate) fn mark_shared(&self) {
        lockfile::mark(&self.inner.lock, lockfile::SHARED);
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Stops accepting operations, waits for queued writes to commit, checkpoints the WAL into the main file and
    /// stops the writer thread. Operations afterwards fail with [`idem_store::Error::Closed`]. Idempotent.
    pub async fn close(&self) {
        if self.inner.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let (tx, rx) = oneshot::channel();
        if self.inner.sender.send(Msg::Close(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Runs `apply` in the next group-commit batch and returns its result once the batch is durable.
    async fn write<T, F>(&self, apply: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Ctx<'_>) -> Result<Result<T, StoreError>, rusqlite::Error> + Send + 'static,
    {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(StoreError::Closed);
        }
        let (tx, rx) = oneshot::channel::<Result<T, StoreError>>();
        let job: writer::Apply = Box::new(move |ctx| {
            let result = apply(ctx)?;
            let finish: Finish = Box::new(move |batch| {
                let _ = tx.send(batch.map_err(batch_err).and(result));
            });
            Ok(finish)
        });
        self.inner.sender.send(Msg::Write(job)).map_err(|_| StoreError::Closed)?;
        rx.await.unwrap_or_else(|_| Err(StoreError::backend("write abandoned: its batch failed or the store closed")))
    }

    /// Runs a read on one of the read-only connections, off the async threads.
    /// A point read: run on the calling thread when a reader connection is free, since one indexed lookup
    /// costs less than the two thread hand-offs of the blocking pool (the proxy's replay path doubled its
    /// throughput this way); queued on the blocking pool otherwise.
    async fn point_read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, rusqlite::Error> + Send + 'static,
    {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(StoreError::Closed);
        }
        if let Some(guard) = self.inner.readers.iter().find_map(|m| m.try_lock().ok()) {
            return f(&guard).map_err(sql_err);
        }
        self.read(f).await
    }

    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, rusqlite::Error> + Send + 'static,
    {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(StoreError::Closed);
        }
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            // Take a free reader if there is one; otherwise queue on one in turn.
            let guard = inner.readers.iter().find_map(|m| m.try_lock().ok()).unwrap_or_else(|| {
                let i = inner.next_reader.fetch_add(1, Ordering::Relaxed) % inner.readers.len();
                // A reader connection holds no state between statements, so a poisoned lock is still usable.
                inner.readers[i].lock().unwrap_or_else(|p| p.into_inner())
            });
            f(&guard).map_err(sql_err)
        })
        .await
        .map_err(StoreError::backend)?
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.closed.swap(true, Ordering::SeqCst) {
            let (tx, _rx) = oneshot::channel();
            let _ = self.sender.send(Msg::Close(tx));
        }
        let handle = self.writer.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// The live row under `key` inside the write transaction: (generation, expires_at).
fn live_meta(ctx: &Ctx<'_>, key: &str) -> Result<Option<(Generation, Option<u64>)>, rusqlite::Error> {
    ctx.tx
        .prepare_cached(
            "SELECT generation, expires_at FROM kv WHERE key = ?1 AND (expires_at IS NULL OR expires_at > ?2)",
        )?
        .query_row((key, to_i64(ctx.now_ms)), |r| {
            Ok((Generation::new(to_u64(r.get(0)?)), r.get::<_, Option<i64>>(1)?.map(to_u64)))
        })
        .optional()
}

/// A live row read inside the write transaction.
struct Live {
    value: Vec<u8>,
    generation: Generation,
    expires_at: Option<u64>,
}

/// The live row under `key` with its value.
fn live_row(ctx: &Ctx<'_>, key: &str) -> Result<Option<Live>, rusqlite::Error> {
    ctx.tx
        .prepare_cached(
            "SELECT value, generation, expires_at FROM kv \
             WHERE key = ?1 AND (expires_at IS NULL OR expires_at > ?2)",
        )?
        .query_row((key, to_i64(ctx.now_ms)), |r| {
            Ok(Live {
                value: r.get(0)?,
                generation: Generation::new(to_u64(r.get(1)?)),
                expires_at: r.get::<_, Option<i64>>(2)?.map(to_u64),
            })
        })
        .optional()
}

fn upsert(ctx: &Ctx<'_>, key: &str, value: &[u8], g: Generation, expires_at: Option<u64>) -> rusqlite::Result<()> {
    ctx.tx
        .prepare_cached(
            "INSERT INTO kv (key, value, generation, expires_at) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT (key) DO UPDATE SET value = excluded.value, generation = excluded.generation, \
             expires_at = excluded.expires_at",
        )?
        .execute((key, value, to_i64(g.get()), expires_at.map(to_i64)))?;
    Ok(())
}

fn remove(ctx: &Ctx<'_>, key: &str) -> rusqlite::Result<()> {
    ctx.tx.prepare_cached("DELETE FROM kv WHERE key = ?1")?.execute([key])?;
    Ok(())
}

impl Store for SqliteStore {
    fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        self.inner.limits.check_key(key)?;
        let key = key.to_owned();
        self.point_read(move |c| {
            c.prepare_cached(
                "SELECT value, generation, expires_at FROM kv \
                 WHERE key = ?1 AND (expires_at IS NULL OR expires_at > ?2)",
            )?
            .query_row((key, to_i64(now_ms())), |r| {
                Ok(Versioned::new(
                    Bytes::from(r.get::<_, Vec<u8>>(0)?),
                    Generation::new(to_u64(r.get(1)?)),
                    r.get::<_, Option<i64>>(2)?.map(|e| millis_to_system_time(to_u64(e))),
                ))
            })
            .optional()
        })
        .await
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, StoreError> {
        for key in keys {
            self.inner.limits.check_key(key)?;
        }
        let keys = keys.to_vec();
        // One trip to the blocking pool for the whole batch: per-key trips cost more in thread wake-ups than
        // the point reads themselves.
        self.read(move |c| {
            let now = to_i64(now_ms());
            let mut stmt = c.prepare_cached(
                "SELECT value, generation, expires_at FROM kv \
                 WHERE key = ?1 AND (expires_at IS NULL OR expires_at > ?2)",
            )?;
            keys.iter()
                .map(|key| {
                    stmt.query_row((key, now), |r| {
                        Ok(Versioned::new(
                            Bytes::from(r.get::<_, Vec<u8>>(0)?),
                            Generation::new(to_u64(r.get(1)?)),
                            r.get::<_, Option<i64>>(2)?.map(|e| millis_to_system_time(to_u64(e))),
                        ))
                    })
                    .optional()
                })
                .collect()
        })
        .await
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, StoreError> {
        self.inner.limits.check_put(key, &value, &ttl)?;
        let key = key.to_owned();
        self.write(move |ctx| {
            let current = live_meta(ctx, &key)?;
            if let Err(e) = precondition.check(current.map(|c| c.0)) {
                return Ok(Err(e));
            }
            let expires_at = ttl.expiry_millis(ctx.now_ms, current.and_then(|c| c.1));
            let g = ctx.next_generation();
            upsert(ctx, &key, &value, g, expires_at)?;
            Ok(Ok(Written::new(g, current.is_none())))
        })
        .await
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, StoreError> {
        self.inner.limits.check_key(key)?;
        let key = key.to_owned();
        self.write(move |ctx| {
            let current = live_meta(ctx, &key)?.map(|c| c.0);
            if let Err(e) = precondition.check(current) {
                return Ok(Err(e));
            }
            if current.is_some() {
                remove(ctx, &key)?;
            }
            Ok(Ok(current))
        })
        .await
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, StoreError> {
        if !(1..=1000).contains(&limit) {
            return Err(StoreError::InvalidArgument { what: "limit" });
        }
        let prefix = prefix.to_owned();
        // Keys sort bytewise (SQLite's BINARY collation), so the keys with the prefix are one contiguous run
        // starting at the prefix itself: scan from max(prefix, after cursor) and stop at the first key without it.
        let after = cursor.filter(|c| *c >= prefix.as_str()).map(str::to_owned);
        let items = self
            .read(move |c| {
                let now = to_i64(now_ms());
                // One lower bound per statement, so SQLite seeks the key index straight to it (an `OR` of two
                // bounds made it scan from the prefix and slowed every page by the pages before it).
                let (sql, from) = match &after {
                    Some(a) => (
                        "SELECT key, generation, expires_at FROM kv WHERE key > ?1 \
                                 AND (expires_at IS NULL OR expires_at > ?2) ORDER BY key LIMIT ?3",
                        a,
                    ),
                    None => (
                        "SELECT key, generation, expires_at FROM kv WHERE key >= ?1 \
                              AND (expires_at IS NULL OR expires_at > ?2) ORDER BY key LIMIT ?3",
                        &prefix,
                    ),
                };
                let mut stmt = c.prepare_cached(sql)?;
                let rows = stmt.query_map((from, now, to_i64(limit as u64 + 1)), |r| {
                    Ok(ListItem {
                        key: r.get(0)?,
                        generation: Generation::new(to_u64(r.get(1)?)),
                        expires_at_ms: r.get::<_, Option<i64>>(2)?.map(to_u64),
                    })
                })?;
                let mut out = Vec::new();
                for row in rows {
                    let item = row?;
                    if !item.key.starts_with(&prefix) {
                        break;
                    }
                    out.push(item);
                }
                Ok(out)
            })
            .await?;
        Ok(Page::from_fetched(items, limit))
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_set_change(key, &change)?;
        let key = key.to_owned();
        let fingerprint = change.dedupe_id.as_ref().map(|_| change.fingerprint());
        self.write(move |ctx| {
            if let (Some(id), Some(fingerprint)) = (&change.dedupe_id, &fingerprint) {
                let seen = ctx
                    .tx
                    .prepare_cached(
                        "SELECT fingerprint, generation, members, added, removed FROM set_dedupe \
                         WHERE key = ?1 AND dedupe_id = ?2 AND expires_at > ?3",
                    )?
                    .query_row((&key, id, to_i64(ctx.now_ms)), |r| {
                        Ok((
                            r.get::<_, String>(0)?,
                            SetOutcome {
                                generation: r.get::<_, Option<i64>>(1)?.map(|g| Generation::new(to_u64(g))),
                                members: to_usize(r.get(2)?),
                                added: to_usize(r.get(3)?),
                                removed: to_usize(r.get(4)?),
                                applied: false,
                            },
                        ))
                    })
                    .optional()?;
                match seen {
                    Some((seen, first)) if seen == *fingerprint => return Ok(Ok(first)),
                    Some(_) => return Ok(Err(StoreError::DedupeIdReused { key, dedupe_id: id.clone() })),
                    None => {}
                }
            }
            let current = live_row(ctx, &key)?;
            let applied = match apply_set(current.as_ref().map(|c| c.value.as_slice()), &change) {
                Ok(a) => a,
                Err(e) => return Ok(Err(e)),
            };
            let mut generation = current.as_ref().map(|c| c.generation);
            if applied.changed {
                match &applied.value {
                    Some(value) => {
                        if let Err(e) = limits.check_value(value) {
                            return Ok(Err(e));
                        }
                        let g = ctx.next_generation();
                        upsert(ctx, &key, value, g, current.and_then(|c| c.expires_at))?;
                        generation = Some(g);
                    }
                    None => {
                        remove(ctx, &key)?;
                        generation = None;
                    }
                }
            }
            let outcome = SetOutcome {
                generation,
                members: applied.members,
                added: applied.added,
                removed: applied.removed,
                applied: true,
            };
            if let (Some(id), Some(fingerprint)) = (&change.dedupe_id, &fingerprint) {
                let until = ctx.now_ms.saturating_add(limits.dedupe_retention().as_millis() as u64);
                // Replaces only an expired record (the lookup above found no live one).
                ctx.tx
                    .prepare_cached(
                        "INSERT OR REPLACE INTO set_dedupe \
                         (key, dedupe_id, fingerprint, generation, members, added, removed, expires_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                    )?
                    .execute((
                        &key,
                        id,
                        fingerprint,
                        generation.map(|g| to_i64(g.get())),
                        to_i64(outcome.members as u64),
                        to_i64(outcome.added as u64),
                        to_i64(outcome.removed as u64),
                        to_i64(until),
                    ))?;
            }
            Ok(Ok(outcome))
        })
        .await
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_counter(key, dedupe_id)?;
        let key = key.to_owned();
        let dedupe_id = dedupe_id.map(str::to_owned);
        self.write(move |ctx| {
            if let Some(id) = &dedupe_id {
                let seen = ctx
                    .tx
                    .prepare_cached(
                        "SELECT value, generation, delta FROM counter_dedupe \
                         WHERE key = ?1 AND dedupe_id = ?2 AND expires_at > ?3",
                    )?
                    .query_row((&key, id, to_i64(ctx.now_ms)), |r| {
                        Ok((
                            CounterOutcome {
                                value: r.get(0)?,
                                generation: Generation::new(to_u64(r.get(1)?)),
                                applied: false,
                            },
                            r.get::<_, Option<i64>>(2)?,
                        ))
                    })
                    .optional()?;
                match seen {
                    // A NULL delta is a record written by schema version 1, which kept no payload: it matches
                    // any delta, as version 1 answered (such records are gone 24 h after the upgrade).
                    Some((first, None)) => return Ok(Ok(first)),
                    Some((first, Some(seen))) if seen == delta => return Ok(Ok(first)),
                    Some(_) => return Ok(Err(StoreError::DedupeIdReused { key, dedupe_id: id.clone() })),
                    None => {}
                }
            }
            let current = live_row(ctx, &key)?;
            let applied = match apply_counter(current.as_ref().map(|c| c.value.as_slice()), delta) {
                Ok(a) => a,
                Err(e) => return Ok(Err(e)),
            };
            let g = ctx.next_generation();
            upsert(ctx, &key, &applied.encode(), g, current.and_then(|c| c.expires_at))?;
            if let Some(id) = &dedupe_id {
                let until = ctx.now_ms.saturating_add(limits.dedupe_retention().as_millis() as u64);
                ctx.tx
                    .prepare_cached(
                        "INSERT INTO counter_dedupe (key, dedupe_id, value, generation, expires_at, delta) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (key, dedupe_id) DO UPDATE SET \
                         value = excluded.value, generation = excluded.generation, \
                         expires_at = excluded.expires_at, delta = excluded.delta",
                    )?
                    .execute((&key, id, applied.value, to_i64(g.get()), to_i64(until), delta))?;
            }
            Ok(Ok(CounterOutcome { value: applied.value, generation: g, applied: true }))
        })
        .await
    }
}
