//! The operator's stop requests (Ctrl-C, SIGTERM) as the run sees them.

use std::sync::Arc;

use tokio::sync::watch;

/// Asks a running [`run`](crate::run) to stop: the first request stops claiming (running items finish), the
/// second kills the children and releases their leases. Cheap to clone; all clones share one state.
///
/// The run reads the level where it waits: at level 1 nothing new is read, claimed or started (items waiting
/// for a slot or for another runner end not done), at level 2 running commands are killed (their attempts
/// recorded as interrupted, not counted).
#[derive(Clone, Debug)]
pub struct Stop {
    /// The level requested so far (0 none, 1 drain, 2 abort), watched by every wait that a stop ends.
    tx: Arc<watch::Sender<u8>>,
}

impl Default for Stop {
    fn default() -> Self {
        Self::new()
    }
}

impl Stop {
    /// A stop that has not been requested.
    pub fn new() -> Self {
        Self { tx: Arc::new(watch::Sender::new(0)) }
    }

    /// Requests the next stop level and returns it (1: drain, 2: abort).
    pub fn request(&self) -> u8 {
        let mut level = 0;
        self.tx.send_modify(|l| {
            *l = l.saturating_add(1).min(2);
            level = *l;
        });
        level
    }

    /// The level requested so far (0: none).
    pub fn level(&self) -> u8 {
        *self.tx.borrow()
    }

    pub(super) fn subscribe(&self) -> watch::Receiver<u8> {
        self.tx.subscribe()
    }
}

/// Resolves once the stop level reaches `level` (never, if the stop handle is gone).
pub(super) async fn stopped(rx: &mut watch::Receiver<u8>, level: u8) {
    if rx.wait_for(|l| *l >= level).await.is_err() {
        std::future::pending::<()>().await;
    }
}
