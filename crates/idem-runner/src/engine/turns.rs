//! Items start in input order: each item spawned gets a [`Turn`], and it queues for a claim only in its turn.
//!
//! An item's first steps (its ledger read, its output's check) take as long as they take, so items spawned in
//! order would otherwise reach the claim in any order, and `--jobs 1` would run them shuffled (GNU parallel's
//! `-j1` runs them as they come, and so do cron wrappers that feed a queue of ordered steps). The turn is
//! passed once the item has its place in the queue for a claim, or when it leaves without one (done, waiting
//! for another runner's holder, failed): one item slow to judge holds back the claims of those after it, never
//! their judgement.
//!
//! Each waiting item is woken once, when its own turn comes: a pass wakes at most the one item whose turn it
//! opens. (One watch channel for all of them woke every waiting item on every pass, up to the 256 items in
//! flight each time: a dry run over 200,000 items spent two thirds of its time in those wake-ups.)

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// The turns of one run: tickets in the order the items were spawned.
pub(super) struct Turns {
    state: Mutex<State>,
}

struct State {
    /// Tickets handed out.
    issued: u64,
    /// The first ticket not yet passed.
    next: u64,
    /// Tickets passed out of order (their items finished first), waiting for the ones before them.
    passed: BTreeSet<u64>,
    /// The items waiting for their turn, by ticket: each is told once, when `next` reaches it.
    waiting: BTreeMap<u64, oneshot::Sender<()>>,
}

/// One item's place in the order. Dropped, it lets the next item go.
pub(super) struct Turn {
    turns: Arc<Turns>,
    ticket: u64,
}

impl Turns {
    pub(super) fn new() -> Arc<Self> {
        let state = State { issued: 0, next: 0, passed: BTreeSet::new(), waiting: BTreeMap::new() };
        Arc::new(Self { state: Mutex::new(state) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next ticket; called in input order.
    pub(super) fn issue(self: &Arc<Self>) -> Turn {
        let mut state = self.state();
        let ticket = state.issued;
        state.issued += 1;
        Turn { turns: Arc::clone(self), ticket }
    }

    fn pass(&self, ticket: u64) {
        let mut state = self.state();
        // A wait of this turn's that was given up (its future dropped) left its sender behind.
        state.waiting.remove(&ticket);
        if ticket != state.next {
            state.passed.insert(ticket);
            return;
        }
        let mut next = ticket + 1;
        while state.passed.remove(&next) {
            next += 1;
        }
        state.next = next;
        // Tickets before `next` have all passed, so only the item holding `next` can be waiting for this.
        if let Some(tell) = state.waiting.remove(&next) {
            let _ = tell.send(());
        }
    }
}

impl Turn {
    /// True when every item before this one has passed its turn already: [`Turn::wait`] would not wait.
    pub(super) fn is_now(&self) -> bool {
        self.turns.state().next >= self.ticket
    }

    /// Waits until every item before this one has passed its turn.
    pub(super) async fn wait(&self) {
        loop {
            let told = {
                let mut state = self.turns.state();
                if state.next >= self.ticket {
                    return;
                }
                let (tell, told) = oneshot::channel();
                state.waiting.insert(self.ticket, tell);
                told
            };
            // Told, or its sender dropped unsent by another wait of this turn that took its place: look again.
            let _ = told.await;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.turns.pass(self.ticket);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use futures_util::FutureExt;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Wake, Waker};

    #[test]
    fn a_turn_comes_only_after_every_earlier_one_passed_in_whatever_order() {
        let turns = Turns::new();
        let [a, b, c] = [turns.issue(), turns.issue(), turns.issue()];
        assert!(a.wait().now_or_never().is_some());
        assert!(c.wait().now_or_never().is_none());
        drop(b);
        assert!(c.wait().now_or_never().is_none(), "a has not passed");
        drop(a);
        assert!(c.wait().now_or_never().is_some());
        let d = turns.issue();
        assert!(d.wait().now_or_never().is_none());
        drop(c);
        assert!(d.wait().now_or_never().is_some());
    }

    /// Counts the wake-ups of one task.
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn each_waiting_item_is_woken_once_when_its_turn_comes() {
        // As in a run: 256 items in flight, every one waiting for its turn while the earliest pass theirs one by
        // one, and polled again whenever woken. One watch for all of them woke every waiting item on every
        // pass: 32,640 wake-ups here, where 255 do.
        const ITEMS: usize = 256;
        let turns = Turns::new();
        let held: Vec<Arc<Turn>> = (0..ITEMS).map(|_| Arc::new(turns.issue())).collect();
        let mut items: Vec<_> = held
            .iter()
            .map(|turn| {
                let turn = Arc::clone(turn);
                let item: Pin<Box<dyn Future<Output = ()>>> = Box::pin(async move { turn.wait().await });
                Item { future: Some(item), wakes: Arc::new(Wakes(AtomicUsize::new(0))), seen: 0 }
            })
            .collect();
        poll(&mut items, true);
        for (k, turn) in held.into_iter().enumerate() {
            assert!(items[k].future.is_none(), "item {k} has its turn once every earlier one passed");
            assert!(items.get(k + 1).is_none_or(|item| item.future.is_some()), "item {} waits for {k}", k + 1);
            drop(turn);
            poll(&mut items, false);
        }
        let wakes = items.iter().map(|item| item.wakes.0.load(Ordering::Relaxed)).sum::<usize>();
        assert_eq!(wakes, ITEMS - 1, "wake-ups");
    }

    /// An item of the test's executor: its future (until it is ready), its wake-ups, those it was polled for.
    struct Item {
        future: Option<Pin<Box<dyn Future<Output = ()>>>>,
        wakes: Arc<Wakes>,
        seen: usize,
    }

    /// Polls every item woken since its last poll (every item if `all`), as an executor would.
    fn poll(items: &mut [Item], all: bool) {
        for item in items {
            let woken = item.wakes.0.load(Ordering::Relaxed);
            if let Some(future) = item.future.as_mut().filter(|_| all || woken > item.seen) {
                item.seen = woken;
                let waker = Waker::from(Arc::clone(&item.wakes));
                if future.as_mut().poll(&mut Context::from_waker(&waker)).is_ready() {
                    item.future = None;
                }
            }
        }
    }
}
