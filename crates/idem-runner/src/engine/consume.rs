//! Items from a message queue: a feeder task takes messages while the run has room (at most twice `--jobs` in
//! flight: `--jobs` commands running and as many claimed ahead, as with a file), each becomes an item task,
//! and the task settles its message by how the item ended ([`disposition`]).
//!
//! A message is acknowledged only after the item's output is durable and the ledger says done (or the ledger
//! says it was done already: a redelivery). A message whose item another consumer is running waits in its
//! task until that holder finishes (then it is done, and acknowledged) or its lease lapses (then it runs
//! here): it is neither run twice nor handed back to be redelivered in a loop. Retries happen in place
//! (`--retries`, the same slot, as with a file), never by requeueing, so the ledger counts every attempt and a
//! poison item is recognised by its second identical failure.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_store::Store;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;

use super::ctx::Ctx;
use super::outcome::{Final, ItemTask, record};
use super::process::process;
use super::room::{Aside, Room};
use super::turns::Turn;
use crate::error::{Error, ItemError};
use crate::items::Item;
use crate::queue::{Ack, Delivery, Disposition, Next, QueueUrl, Source};
use crate::summary::Summary;

/// What the feeder hands the run.
enum Fed {
    /// A message, with the room it takes until its task ends.
    Message(Delivery, OwnedSemaphorePermit),
    /// `--until-empty`: nothing left.
    Drained,
}

/// How a message is settled once its item ended.
pub(super) fn disposition(result: &Result<Final, ItemError>) -> Disposition {
    match result {
        Ok(
            Final::Done { .. }
            | Final::Skipped { .. }
            | Final::Checked
            | Final::Adopted { .. }
            | Final::DoneElsewhere { .. },
        ) => Disposition::Ack,
        Ok(Final::Poison { .. } | Final::Failed { .. } | Final::Malformed { .. }) => Disposition::DeadLetter,
        Ok(Final::NotDone { .. } | Final::Unretried { .. } | Final::WouldRun | Final::Error { .. }) | Err(_) => {
            Disposition::Requeue
        }
    }
}

/// How long a message whose item the ledger could not judge or record waits before it is handed back: a
/// ledger that is down must not turn the queue into a busy loop of redeliveries.
const LEDGER_FAILED_PAUSE: Duration = Duration::from_secs(1);

/// Takes messages while the run has room; hands each over with its share of the room. Returns the source
/// when told to stop, so the run can close it after the last acknowledgement.
async fn feed(
    mut source: Source,
    room: Arc<Semaphore>,
    limit: usize,
    aside: Arc<Aside>,
    tx: mpsc::Sender<Fed>,
    mut shutdown: oneshot::Receiver<()>,
) -> Source {
    let mut permit = None;
    let mut prefetch = limit;
    loop {
        let held = match permit.take() {
            Some(p) => p,
            None => tokio::select! {
                p = Arc::clone(&room).acquire_owned() => match p { Ok(p) => p, Err(_) => return source },
                // A message set aside (or back from aside): the prefetch follows.
                () = aside.changed.notified() => {
                    prefetch = follow_aside(&mut source, limit, &aside, prefetch).await;
                    continue;
                }
                _ = &mut shutdown => return source,
            },
        };
        prefetch = follow_aside(&mut source, limit, &aside, prefetch).await;
        let free = room.available_permits() + 1;
        // Nothing of the run in flight (every permit free but this one, none set aside): an empty queue means
        // drained.
        let idle = free == limit && aside.count.load(Ordering::SeqCst) == 0;
        let next = tokio::select! {
            next = source.next(free, idle) => next,
            // A message set aside while this waits for a delivery: the broker may be waiting for a raised
            // prefetch to deliver one.
            () = aside.changed.notified() => {
                permit = Some(held);
                continue;
            }
            _ = &mut shutdown => return source,
        };
        let fed = match next {
            Next::Message(delivery) => Fed::Message(delivery, held),
            Next::Drained => Fed::Drained,
            Next::Idle => {
                permit = Some(held);
                continue;
            }
        };
        let drained = matches!(fed, Fed::Drained);
        if tx.send(fed).await.is_err() || drained {
            let _ = shutdown.await;
            return source;
        }
    }
}

/// Sets the broker's prefetch to `limit` plus the messages set aside, if that changed from `current`; returns
/// the prefetch now.
async fn follow_aside(source: &mut Source, limit: usize, aside: &Aside, current: usize) -> usize {
    let want = limit + aside.count.load(Ordering::SeqCst);
    if want != current {
        source.set_prefetch(want).await;
    }
    want
}

/// Runs `work`, telling the broker every `every` that the message is still being worked on.
async fn keeping_alive<T>(work: impl Future<Output = T>, ack: &Ack, every: Option<Duration>) -> T {
    let Some(every) = every else { return work.await };
    tokio::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => return out,
            () = tokio::time::sleep(every) => ack.in_progress().await,
        }
    }
}

/// One message's task: its item run to its end, then the message settled.
async fn handle<S: Store>(ctx: Arc<Ctx<S>>, delivery: Delivery, number: u64, room: Room, turn: Turn) -> ItemTask {
    let Delivery { item, ack, keep_alive } = delivery;
    let (item, result) = match item {
        Ok(item) => {
            let result = keeping_alive(process(&ctx, &item, None, Some(room), turn), &ack, keep_alive).await;
            (item, result)
        }
        Err(reason) => {
            tracing::warn!("message {number} is no item ({reason}): rejected without requeue");
            (
                Item { line: number, id: format!("message-{number}"), raw: String::new() },
                Ok(Final::Malformed { reason }),
            )
        }
    };
    let disposition = disposition(&result);
    if result.is_err() {
        tokio::time::sleep(LEDGER_FAILED_PAUSE).await;
    }
    tracing::debug!(item = %item.id, "message settled: {disposition:?}");
    if let Err(e) = ack.settle(disposition).await {
        // The connection it came on is gone, and the broker with it took the message back: it comes again,
        // and the ledger judges it (done: acknowledged without running).
        tracing::debug!(item = %item.id, "settling the message ({disposition:?}) failed: {e}; it will be redelivered");
    }
    (item, result)
}

/// Runs the items of a queue until it is drained (`--until-empty`), the run is stopped or halted; returns
/// how many messages were taken. Messages taken but not started are handed back.
pub(super) async fn run_queue<S: Store + Clone + 'static>(
    ctx: &Arc<Ctx<S>>,
    url: &QueueUrl,
    source: Option<Source>,
    summary: &mut Summary,
    set: &mut JoinSet<ItemTask>,
) -> Result<u64, Error> {
    let limit = ctx.cfg.jobs.saturating_mul(2);
    let source = match source {
        Some(connected) => connected,
        None => Source::connect(url, ctx.cfg.source_config()).await?,
    };
    let room = Arc::new(Semaphore::new(limit));
    // Up to eight times the run's own room of messages set aside: a few killed consumers' worth.
    let aside = Arc::new(Aside {
        count: AtomicUsize::new(0),
        cap: limit.saturating_mul(8),
        changed: tokio::sync::Notify::new(),
    });
    let (tx, mut rx) = mpsc::channel(limit);
    let (shutdown, shutdown_rx) = oneshot::channel();
    let feeder = tokio::spawn(feed(source, Arc::clone(&room), limit, Arc::clone(&aside), tx, shutdown_rx));
    let mut taken = 0u64;
    while !ctx.stopping() {
        tokio::select! {
            biased;
            Some(joined) = set.join_next(), if !set.is_empty() => record(ctx, summary, joined)?,
            () = ctx.stop.reached(1) => break,
            fed = rx.recv() => match fed {
                Some(Fed::Message(delivery, permit)) => {
                    taken += 1;
                    let ctx = Arc::clone(ctx);
                    let room = Room { permit: Some(permit), aside: Arc::clone(&aside), counted: false };
                    let turn = ctx.turns.issue();
                    set.spawn(handle(ctx, delivery, taken, room, turn));
                }
                Some(Fed::Drained) | None => break,
            },
        }
    }
    // Stop taking messages; those taken but not started go back at once.
    let _ = shutdown.send(());
    let source = feeder.await.map_err(|e| Error::Queue(format!("the consumer task failed: {e}")))?;
    rx.close();
    while let Some(fed) = rx.recv().await {
        if let Fed::Message(delivery, _) = fed {
            let _ = delivery.ack.settle(Disposition::Requeue).await;
        }
    }
    // Running items finish and settle their messages while the connection is still open.
    while let Some(joined) = set.join_next().await {
        record(ctx, summary, joined)?;
    }
    source.close().await;
    Ok(taken)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::Digest256;

    #[test]
    fn only_done_items_are_acknowledged_and_only_stops_and_ledger_failures_hand_messages_back() {
        let digest = || Digest256 { sha256: "ab".repeat(32), size: 2 };
        let cases = [
            (Ok(Final::Done { attempts: 1, digest: digest(), duration: Duration::ZERO }), Disposition::Ack),
            (Ok(Final::Skipped { digest: digest() }), Disposition::Ack),
            (Ok(Final::Adopted { digest: digest() }), Disposition::Ack),
            (Ok(Final::Poison { attempts: 2, error: "e".into() }), Disposition::DeadLetter),
            (Ok(Final::Failed { attempts: 4, error: "e".into() }), Disposition::DeadLetter),
            (Ok(Final::Malformed { reason: "r".into() }), Disposition::DeadLetter),
            (Ok(Final::NotDone { reason: "interrupted" }), Disposition::Requeue),
            (Err(ItemError::NoGeneration), Disposition::Requeue),
        ];
        for (result, expected) in cases {
            assert_eq!(disposition(&result), expected, "{result:?}");
        }
    }
}
