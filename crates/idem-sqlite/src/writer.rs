//! The writer thread: group commit of every write queued while the previous commit was fsyncing.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime};

use idem_store::{Generation, system_time_to_millis};
use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::oneshot;

/// Most writes folded into one transaction; bounds the latency a single huge batch adds to its first write.
const MAX_BATCH: usize = 1024;
/// How often expired values and dedupe ids are swept when the writer is otherwise idle or busy.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Rows deleted per sweep transaction, so a sweep never stalls writers for long.
const SWEEP_ROWS: i64 = 1000;
/// Sweep transactions per tick at most.
const SWEEP_BATCHES: usize = 20;

/// What a write sees while it runs inside the batch transaction.
pub(crate) struct Ctx<'a> {
    /// The writer's connection, inside the batch's `BEGIN IMMEDIATE` transaction.
    pub(crate) tx: &'a Connection,
    /// The store's clock for the whole batch, in milliseconds since the Unix epoch.
    pub(crate) now_ms: u64,
    last_generation: &'a mut u64,
}

impl Ctx<'_> {
    /// The next generation. Persisted with the batch; if the batch rolls back, the counter is rewound with it.
    pub(crate) fn next_generation(&mut self) -> Generation {
        *self.last_generation += 1;
        Generation::new(*self.last_generation)
    }
}

/// Sends a job's result once the batch's fate is known: `Ok` after COMMIT returned, `Err` if it rolled back.
pub(crate) type Finish = Box<dyn FnOnce(Result<(), Arc<rusqlite::Error>>) + Send>;
/// Applies one write inside the batch transaction and returns how to report it.
pub(crate) type Apply = Box<dyn FnOnce(&mut Ctx<'_>) -> Result<Finish, rusqlite::Error> + Send>;

pub(crate) enum Msg {
    Write(Apply),
    /// Finish what is queued, checkpoint the WAL, stop, then acknowledge.
    Close(oneshot::Sender<()>),
}

pub(crate) fn run(mut conn: Connection, mut last_generation: u64, rx: Receiver<Msg>) {
    let mut last_sweep = Instant::now();
    loop {
        let first = match rx.recv_timeout(SWEEP_EVERY) {
            Ok(m) => Some(m),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let mut batch = Vec::new();
        let mut close = None;
        let mut next = first;
        // Everything already queued joins this batch: those writers waited during the last fsync, and one
        // more fsync now serves them all.
        while let Some(msg) = next.take() {
            match msg {
                Msg::Write(apply) => batch.push(apply),
                Msg::Close(reply) => {
                    close = Some(reply);
                    break;
                }
            }
            if batch.len() >= MAX_BATCH {
                break;
            }
            next = rx.try_recv().ok();
        }
        if !batch.is_empty() {
            commit_batch(&conn, &mut last_generation, batch);
        }
        if last_sweep.elapsed() >= SWEEP_EVERY {
            last_sweep = Instant::now();
            // Several batches while a backlog lasts, so reclaiming keeps pace with expiring writes (up to
            // SWEEP_BATCHES x SWEEP_ROWS a second) without holding writers back for long at a time.
            for _ in 0..SWEEP_BATCHES {
                match sweep(&mut conn) {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "sweeping expired values failed; will retry");
                        break;
                    }
                }
            }
        }
        if let Some(reply) = close {
            if let Err(e) = conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);") {
                tracing::warn!(error = %e, "final WAL checkpoint failed; the WAL is replayed at next open");
            }
            let _ = reply.send(());
            return;
        }
    }
}

fn commit_batch(conn: &Connection, last_generation: &mut u64, batch: Vec<Apply>) {
    let size = batch.len();
    let started = Instant::now();
    let saved = *last_generation;
    let now_ms = system_time_to_millis(SystemTime::now());
    let mut finishers: Vec<Finish> = Vec::with_capacity(size);
    let result = (|| {
        // BEGIN and COMMIT as cached statements: `Connection::transaction` parses and prepares both for every
        // batch, which was a fifth of the instructions of a first execution through the proxy (two batches).
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        let applied = (|| {
            let mut ctx = Ctx { tx: conn, now_ms, last_generation: &mut *last_generation };
            for apply in batch {
                finishers.push(apply(&mut ctx)?);
            }
            if *last_generation != saved {
                let g = i64::try_from(*last_generation).unwrap_or(i64::MAX);
                conn.prepare_cached("UPDATE meta SET value = ?1 WHERE name = 'generation'")?.execute([g])?;
            }
            conn.prepare_cached("COMMIT")?.execute([]).map(|_| ())
        })();
        if applied.is_err() && !conn.is_autocommit() {
            // What `Transaction`'s drop did: nothing of a failed batch may stay.
            if let Err(e) = conn.execute_batch("ROLLBACK") {
                tracing::error!(error = %e, "rolling back a failed write batch failed");
            }
        }
        applied
    })();
    // Writes not yet applied when a statement failed are dropped with their reply channel; their callers see
    // the batch as abandoned.
    let outcome = match result {
        Ok(()) => Ok(()),
        Err(e) => {
            *last_generation = saved;
            tracing::error!(error = %e, size, "write batch rolled back");
            Err(Arc::new(e))
        }
    };
    metrics::histogram!("idem_sqlite_batch_size").record(size as f64);
    metrics::histogram!("idem_sqlite_commit_seconds").record(started.elapsed().as_secs_f64());
    for finish in finishers {
        finish(outcome.clone());
    }
}

/// One sweep transaction; true when it deleted a full batch, so more may be waiting.
fn sweep(conn: &mut Connection) -> Result<bool, rusqlite::Error> {
    let now = i64::try_from(system_time_to_millis(SystemTime::now())).unwrap_or(i64::MAX);
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let values = tx
        .prepare_cached("DELETE FROM kv WHERE rowid IN (SELECT rowid FROM kv WHERE expires_at <= ?1 LIMIT ?2)")?
        .execute((now, SWEEP_ROWS))?;
    let ids = tx
        .prepare_cached(
            "DELETE FROM counter_dedupe WHERE (key, dedupe_id) IN \
             (SELECT key, dedupe_id FROM counter_dedupe WHERE expires_at <= ?1 LIMIT ?2)",
        )?
        .execute((now, SWEEP_ROWS))?;
    let set_ids = tx
        .prepare_cached(
            "DELETE FROM set_dedupe WHERE (key, dedupe_id) IN \
             (SELECT key, dedupe_id FROM set_dedupe WHERE expires_at <= ?1 LIMIT ?2)",
        )?
        .execute((now, SWEEP_ROWS))?;
    tx.commit()?;
    if values + ids + set_ids > 0 {
        metrics::counter!("idem_sqlite_swept_total").increment((values + ids + set_ids) as u64);
        tracing::debug!(values, dedupe_ids = ids + set_ids, "swept expired rows");
    }
    let full = usize::try_from(SWEEP_ROWS).unwrap_or(usize::MAX);
    Ok(values >= full || ids >= full || set_ids >= full)
}
