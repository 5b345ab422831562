//! Items start in input order: each item spawned gets a [`Turn`], and it queues for a claim only in its turn.
//!
//! An item's first steps (its ledger read, its output's check) take as long as they take, so items spawned in
//! order would otherwise reach the claim in any order, and `--jobs 1` would run them shuffled (GNU parallel's
//! `-j1` runs them as they come, and so do cron wrappers that feed a queue of ordered steps). The turn is
//! passed once the item has its place in the queue for a claim, or when it leaves without one (done, waiting
//! for another runner's holder, failed): one item slow to judge holds back the claims of those after it, never
//! their judgement.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// The turns of one run: tickets in the order the items were spawned.
pub(super) struct Turns {
    state: Mutex<State>,
    /// The first ticket not yet passed.
    next: watch::Sender<u64>,
}

struct State {
    /// Tickets handed out.
    issued: u64,
    /// Tickets passed out of order (their items finished first), waiting for the ones before them.
    passed: BTreeSet<u64>,
}

/// One item's place in the order. Dropped, it lets the next item go.
pub(super) struct Turn {
    turns: Arc<Turns>,
    ticket: u64,
}

impl Turns {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self { state: Mutex::new(State { issued: 0, passed: BTreeSet::new() }), next: watch::channel(0).0 })
    }

    /// The next ticket; called in input order.
    pub(super) fn issue(self: &Arc<Self>) -> Turn {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = state.issued;
        state.issued += 1;
        Turn { turns: Arc::clone(self), ticket }
    }

    fn pass(&self, ticket: u64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.passed.insert(ticket);
        let mut next = *self.next.borrow();
        while state.passed.remove(&next) {
            next += 1;
        }
        self.next.send_replace(next);
    }
}

impl Turn {
    /// Waits until every item before this one has passed its turn.
    pub(super) async fn wait(&self) {
        let mut next = self.turns.next.subscribe();
        // The sender lives in `turns`, which this turn keeps alive: `wait_for` cannot fail.
        let _ = next.wait_for(|n| *n >= self.ticket).await;
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
}
