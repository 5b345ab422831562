//! The slots of `idem once` and their state machine: each scheduled run of a job happens once, whichever
//! machine invokes it.
//!
//! A job `NAME` has, in the store:
//!
//! - its **job record**, `once/NAME/job`: the schedule it was first invoked with (a later invocation with
//!   another is refused: two schedules would key the same run differently) and the latest slot any invocation
//!   has seen, from which the next invocation knows which slots passed unseen;
//! - per slot, its **entry**, `once/NAME/slot/T` (T: the slot's scheduled time in milliseconds since the Unix
//!   epoch, 13 digits, so keys sort by time), kept without expiry (the newest [`HISTORY`] are kept, older
//!   finished ones pruned), and its **lease**, `once/NAME/lease/T`, whose store TTL is the lease length;
//! - the set `once/NAME/ran-more-than-once` of slots whose command ran to a successful end twice (a holder
//!   whose lease was taken over found its success refused): it must stay empty.
//!
//! ```text
//!                          claim: create lease (Absent, TTL = lease), then entry := Running{attempt + 1}
//!   absent | Failed (attempts left) | Running (lease lapsed) | Interrupted ─────────────────────────▶ Running
//!                                                      Running ──done (fenced)──▶ Done
//!                                                      Running ──failed (fenced)─▶ Failed{attempts}
//!                                  Running, stopped by a signal ──failed (fenced)─▶ Failed{exit interrupted}
//!                          Running, its command never started ──given back (fenced)─▶ Interrupted
//!   absent, never started by --starting-deadline, or the slot passed unstarted ──missed (create-only)─▶ Missed
//!   any state but Done/Missed, in a slot older than the job record's newest ─────never claimed (Behind)
//!                                                        lease ──renew (fenced on the lease generation)──▶ lease
//! ```
//!
//! As in the work ledger ([`ledger::Claim`](crate::ledger::Claim)), the lease is a key of its own because it must vanish when
//! its holder dies (the store's clock decides) while the attempt count must survive: attempts are counted when
//! claimed, so a holder killed mid-command still used one. Every write after the claim is conditional on the
//! entry generation the claim wrote (the fencing token) or on the lease's last generation; a holder that was
//! taken over has them refused.
//!
//! The job record's `last_slot_ms` is a high-water mark: it only moves forward, and a slot older than it is
//! never claimed ([`Plan::Behind`]), whatever its entry says. Its time has passed for every invocation
//! whose clock agrees with the one that moved the mark, and its entry may be gone (the history keeps the
//! newest [`HISTORY`] slots, and a gap's older slots are only counted): without the rule an invocation
//! whose clock is behind would find no entry and run a slot that already ran, again on every invocation.
//! Nothing here performs I/O or reads the clock: times are arguments, in
//! milliseconds since the Unix epoch by the store's clock.
//!
//! In layers, each file using only those above it: the store keys and constants ([`Keys`]), the stored
//! records ([`Job`], [`Entry`]), judging a slot ([`plan`]) and the claim and its fenced writes ([`Claim`],
//! [`Held`]).

mod claim;
mod control;
mod entry;
mod keys;
mod plan;

pub use claim::{Claim, Failure, Held};
pub use control::{
    Overlap, OverlapPlan, Pause, Request, RequestKind, RequestPlan, TRIGGERED_AHEAD, is_trigger_id, overlap, pause_key,
    paused, request, request_key, requested, requested_prefix, stop_key, stop_prefix, trigger_lease_prefix,
    trigger_prefix,
};
pub use entry::{Ending, Entry, Job, MissedReason};
pub use keys::{
    FUTURE_TOLERANCE_MS, HISTORY, INTERRUPTED_EXIT, Keys, REPLACED_EXIT, behind_key, interrupted_key, job_key,
    lease_prefix, repeats_key, slot_of_key, slot_prefix, takeovers_key,
};
pub use plan::{Plan, is_kept_ahead, missed, plan, prune};

#[cfg(test)]
mod tests;
