//! The room a message of a queue takes while its item runs ([`Room`]), and the messages set aside while
//! another runner holds their items ([`Aside`]): below both the queue's consumer and the claim, which sets a
//! waiting message aside.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::OwnedSemaphorePermit;

/// The place one message takes among those the run holds (a permit of the feeder's room), until its task
/// ends or it is set aside.
pub(crate) struct Room {
    pub(super) permit: Option<OwnedSemaphorePermit>,
    pub(super) aside: Arc<Aside>,
    /// Counted in `aside.count` (given back on drop).
    pub(super) counted: bool,
}

/// Messages set aside: held (not yet acknowledged) while another runner holds their items, without taking
/// room; at most [`Aside::cap`] at once.
pub(crate) struct Aside {
    pub(super) count: AtomicUsize,
    pub(super) cap: usize,
    /// Wakes the feeder, which raises the broker's prefetch by the count.
    pub(super) changed: tokio::sync::Notify,
}

impl Room {
    /// The item's holder is another runner, and this message waits for it to finish or its lease to lapse (a
    /// killed consumer's messages are redelivered at once, their items still leased by the dead runner): it
    /// gives its room to another message, and the broker is asked to deliver one more (AMQP: the prefetch is
    /// raised by the messages set aside), so waiting messages do not hold up the rest. Up to [`Aside::cap`];
    /// past that a waiting message keeps its room.
    pub(crate) fn set_aside(&mut self) {
        if self.counted {
            return;
        }
        let taken = self
            .aside
            .count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < self.aside.cap).then_some(n + 1));
        if taken.is_ok() {
            self.counted = true;
            self.permit = None;
            self.aside.changed.notify_one();
        }
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if self.counted {
            self.aside.count.fetch_sub(1, Ordering::SeqCst);
            self.aside.changed.notify_one();
        }
    }
}
