//! Items from a file or a stream (`-`, a pipe, a FIFO), read in chunks of [`CHUNK`]: a chunk's done items (and
//! in a dry run its new ones) are judged at once ([`judge_done`]), the others become item tasks, at most a
//! window of them at a time.
//!
//! A regular file was checked whole before the run ([`RunConfig::checked`](crate::RunConfig::checked)): ids, and no two items
//! with one output path. A stream can be read only once, so a thread reads it beside the run and checks each
//! item as it arrives; a repeated output path is refused as soon as it is seen, from a set of 64 bits per item
//! (the first 8 bytes of the SHA-256 of its output path), not the items: about 16 MiB for a million lines.
//! (The ledger cannot answer that question alone: an item an earlier run finished leaves no trace of having
//! been seen in this run unless every skipped item were written to the ledger, which would make a resume pass
//! cost a write per item.)

use std::collections::HashSet;
use std::sync::Arc;

use idem_store::Store;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::ctx::Ctx;
use super::judge::{CHUNK, Judged, judge_done, say_dry};
use super::outcome::{Final, ItemTask, record, record_final};
use super::process::process;
use crate::error::Error;
use crate::items::{Item, ItemReader};
use crate::summary::Summary;

/// Where the items come from.
enum Lines {
    /// A regular file checked before the run, read inline: the reader refills a 256 KiB buffer once per few
    /// thousand items, far cheaper than handing this thread's work elsewhere for every line.
    File(ItemReader),
    /// A stream, read and checked by a thread of its own (a pipe may block for as long as its writer likes).
    Stream(mpsc::Receiver<Result<Item, Error>>),
}

/// Items a stream's reader thread may have read ahead of the run: its memory stays bounded whatever the
/// stream's length.
const READ_AHEAD: usize = 2 * CHUNK;

/// Reads a stream on a thread of its own, checking each item's output path against those seen before it.
fn read_stream(ctx: &Ctx<impl Store>) -> mpsc::Receiver<Result<Item, Error>> {
    let (tx, rx) = mpsc::channel(READ_AHEAD);
    let cfg = ctx.cfg.clone();
    std::thread::spawn(move || {
        let reader = match ItemReader::open(&cfg.items, cfg.format, cfg.id_field.as_deref()) {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        let mut seen: HashSet<u64> = HashSet::new();
        for item in reader {
            let item = item.and_then(|item| {
                let output = cfg.unique_path(&item.id);
                if seen.insert(output_hash(&output)) {
                    Ok(item)
                } else {
                    Err(Error::RepeatedOutput {
                        path: cfg.items.clone(),
                        line: item.line,
                        output: output.display().to_string(),
                    })
                }
            });
            let failed = item.is_err();
            // The run has ended (stopped, or refused an item): nobody reads any more.
            if tx.blocking_send(item).is_err() || failed {
                return;
            }
        }
    });
    rx
}

/// 64 bits of the SHA-256 of an output path. Two paths of a million colliding by chance: about 1 in 36
/// million runs; a collision would refuse a valid item (never let a duplicate through).
pub(super) fn output_hash(output: &std::path::Path) -> u64 {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(output.as_os_str().as_encoded_bytes());
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(key)
}

impl Lines {
    /// Fills `chunk` with up to [`CHUNK`] items: `Ok(false)` once the input is over (or the run stops while
    /// a stream keeps it waiting).
    async fn fill<S>(&mut self, ctx: &Ctx<S>, chunk: &mut Vec<Item>) -> Result<bool, Error> {
        match self {
            Lines::File(reader) => {
                while chunk.len() < CHUNK {
                    match reader.next() {
                        Some(item) => chunk.push(item?),
                        None => return Ok(false),
                    }
                }
                Ok(true)
            }
            Lines::Stream(rx) => {
                // Wait for the first item (a pipe's writer may be slow); take what else is there at once.
                let first = tokio::select! {
                    first = rx.recv() => first,
                    () = ctx.stop.reached(1) => return Ok(false),
                };
                let Some(first) = first else { return Ok(false) };
                chunk.push(first?);
                while chunk.len() < CHUNK {
                    match rx.try_recv() {
                        Ok(item) => chunk.push(item?),
                        Err(mpsc::error::TryRecvError::Empty) => return Ok(true),
                        Err(mpsc::error::TryRecvError::Disconnected) => return Ok(false),
                    }
                }
                Ok(true)
            }
        }
    }
}

/// Runs every item of the file or stream; returns how many items were seen. A stream's bad item (malformed,
/// or a repeated output path) ends the reading: the items before it finish, and the summary says why it
/// stopped ([`Summary::refused`]).
pub(super) async fn run_lines<S: Store + Clone>(
    ctx: &Arc<Ctx<S>>,
    summary: &mut Summary,
    set: &mut JoinSet<ItemTask>,
    streamed: bool,
) -> Result<u64, Error> {
    // Enough items in flight to keep the ledger busy while `jobs` commands run, few enough to stay small.
    let window = (ctx.cfg.jobs * 4).max(256);
    let mut lines = if streamed {
        Lines::Stream(read_stream(ctx))
    } else {
        Lines::File(ItemReader::open(&ctx.cfg.items, ctx.cfg.format, ctx.cfg.id_field.as_deref())?)
    };
    let mut seen = 0u64;
    let mut chunk: Vec<Item> = Vec::with_capacity(CHUNK);
    let mut more = true;
    while more && !ctx.stopping() {
        match lines.fill(ctx, &mut chunk).await {
            Ok(m) => more = m,
            Err(e) if streamed => {
                // Items already read run; nothing after the bad one is read.
                summary.refused = Some(e.to_string());
                more = false;
            }
            Err(e) => return Err(e),
        }
        seen += chunk.len() as u64;
        let judged = judge_done(ctx, &chunk).await;
        for (item, judged) in chunk.drain(..).zip(judged) {
            let prefetched = match judged {
                Judged::Done(digest) => {
                    record_final(ctx, summary, &item, Final::Skipped { digest })?;
                    continue;
                }
                Judged::DryNew => None,
                Judged::Open(prefetched) => Some(prefetched),
            };
            let turn = ctx.turns.issue();
            if prefetched.is_none() && turn.is_now() {
                // A dry run's new item whose turn has come: listed here, no task. One that must wait for the
                // items before it waits in a task of its own, so that a slow item never holds back the judging
                // of those after it (the reading loop would).
                say_dry(ctx, Some(&turn), &item.id, "new").await;
                record_final(ctx, summary, &item, Final::WouldRun)?;
                continue;
            }
            while set.len() >= window {
                if let Some(joined) = set.join_next().await {
                    record(ctx, summary, joined)?;
                }
            }
            let ctx = ctx.clone();
            set.spawn(async move {
                let result = match prefetched {
                    Some(prefetched) => process(&ctx, &item, prefetched, None, turn).await,
                    None => {
                        say_dry(&ctx, Some(&turn), &item.id, "new").await;
                        Ok(Final::WouldRun)
                    }
                };
                (item, result)
            });
        }
    }
    // The reader thread drops its sender only at the stream's end (or a bad item): a stop that finds it still
    // open, or items still queued, cut the stream short, and a wrapper must not read "every item done" (exit 0)
    // from it (found by a break-it review).
    if let Lines::Stream(rx) = &lines
        && ctx.stopping()
        && summary.refused.is_none()
        && (!rx.is_closed() || !rx.is_empty())
    {
        summary.stream_cut = true;
    }
    Ok(seen)
}
