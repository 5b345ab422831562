//! The work ledger of `idem run` and its state machine: which items ran, who holds one now, and what each
//! attempt ended as.
//!
//! Each work item has two store keys:
//!
//! - its **entry**, `run/{job}/item/{id}`, kept without expiry: who ran it, how many attempts were claimed,
//!   the fingerprints of its failures and, once done, the SHA-256 of its output;
//! - its **lease**, `run/{job}/lease/{id}`, whose store TTL is the lease length.
//!
//! The lease is a separate key because a lapsed lease must disappear (the store's clock decides, a lapsed key
//! reads as absent and the next create takes it over) while the attempt count must survive a crashed holder:
//! attempts are counted just before the command starts ([`Held::count`]), so a runner killed mid-item still
//! used up one, and an item claimed ahead of a free slot and never started (the run stopped, or the store was
//! unreachable past the limit so the claim could not be given back) spent none: its lease simply lapses.
//!
//! ```text
//!            claim: create lease (Absent, TTL = lease); just before the command starts: count,
//!                   entry := Running{attempt + 1} (fenced on the entry read before the claim)
//!   absent | Failed | Running(lapsed) | Done(output gone) ──────────────────────────────▶ Running
//!                                                    Running ──done (fenced)──▶ Done{sha256}
//!                                                    Running ──failed (fenced)─▶ Failed{fingerprints}
//!                       Running, command never started ──unclaim (fenced)─▶ the entry before the claim
//!                          claimed, not counted, not started ──release the lease──▶ (entry untouched)
//!                     Running, command started, stopped ──interrupted (fenced)─▶ Interrupted{attempt}
//!                                                    lease ──renew (fenced on the lease generation)──▶ lease
//! ```
//!
//! Only an item without an entry may have a file at its final path **adopted** (recorded done without running):
//! every entry says that an attempt ran or may have run, and a command may write its final path itself, so a
//! file there after a crash (a lapsed `Running`), a failure (`Failed`) or an interruption (`Interrupted`) is
//! never taken for its output; the item runs again and its new, verified output replaces the file. That is why
//! an attempt whose command started is given back as [`Entry::Interrupted`], never by removing the entry.
//!
//! Every write after the claim is conditional: the entry on the generation the claim gave it (the **fencing
//! token**, handed to the command as `IDEM_FENCING_TOKEN`), the lease on its own last generation. A runner that
//! was taken over finds its writes refused. Nothing here performs I/O or reads the clock.
//!
//! In layers, each file using only those above it: the item's keys and stored entry ([`Entry`]), judging it
//! ([`plan`]) and the writes outside a claim, the claim and its fenced writes ([`Claim`], [`Held`]); and, on
//! its own, [`error_fingerprint`].

mod claim;
mod entry;
mod fingerprint;
mod plan;

pub use claim::{Claim, Failure, Held};
pub use entry::{Entry, Keys, entry_prefix};
pub use fingerprint::error_fingerprint;
pub use plan::{Plan, RetryLimit, adopt, plan, record_noted, uncount};

#[cfg(test)]
mod tests;
