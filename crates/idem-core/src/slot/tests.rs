use std::time::Duration;

use idem_store::{Generation, Precondition, Renewable, Ttl};

use super::*;
use crate::ledger::RetryLimit;
use crate::{Write, WriteOp};

const LIMIT: RetryLimit = RetryLimit { max_attempts: 3 };
const LEASE: Duration = Duration::from_secs(10);

fn keys() -> Keys {
    Keys::new("nightly", 1_700_000_000_000)
}

fn ending(exit: &str) -> Ending {
    Ending { exit: exit.into(), code: Some(0), duration_ms: 5, finished_at_ms: 9, output: vec!["ok".into()] }
}

fn decoded(write: &Write) -> Entry {
    let WriteOp::Put { value, ttl } = &write.op else { panic!("put") };
    assert_eq!(*ttl, Ttl::Clear, "entries never expire");
    Entry::decode(value).unwrap()
}

#[test]
fn keys_sort_by_slot_time_and_name_the_job() {
    assert_eq!(keys().entry(), "once/nightly/slot/1700000000000");
    assert_eq!(keys().lease(), "once/nightly/lease/1700000000000");
    assert!(Keys::new("nightly", 999).entry() < Keys::new("nightly", 1_000).entry());
    assert_eq!(slot_of_key(keys().entry()), Some(1_700_000_000_000));
    assert_eq!(slot_of_key(Keys::new("a", 7).lease()), Some(7));
    assert!(keys().entry().starts_with(&slot_prefix("nightly")));
    assert_ne!(Keys::new("other", 1).entry(), Keys::new("nightly", 1).entry());
    let (key, change) = keys().ran_again("o1");
    assert_eq!(key, "once/nightly/ran-more-than-once");
    assert_eq!(change.add, ["1700000000000"]);
}

#[test]
fn the_plan_follows_the_entry_the_lease_and_the_deadline() {
    assert_eq!(plan(None, false, LIMIT, false, false), Plan::Run { attempt: 1 });
    assert_eq!(plan(None, true, LIMIT, false, false), Plan::Held, "a claim is being made");
    assert_eq!(plan(None, false, LIMIT, true, false), Plan::RecordMissed);
    let done =
        Entry::Done { attempts: 1, owner: "o".into(), host: "h".into(), started_at_ms: 1, ending: ending("exit 0") };
    assert_eq!(plan(Some(&done), false, LIMIT, true, false), Plan::Done);
    let missed = Entry::Missed { reason: MissedReason::NoInvocation, recorded_at_ms: 1 };
    assert_eq!(plan(Some(&missed), false, LIMIT, false, false), Plan::Missed);
    let running = Entry::Running { owner: "o".into(), host: "h".into(), attempt: 1, started_at_ms: 1, last: None };
    assert_eq!(plan(Some(&running), true, LIMIT, false, false), Plan::Held);
    // Its holder crashed: the lease lapsed. A started slot is retried past the deadline too.
    assert_eq!(plan(Some(&running), false, LIMIT, true, false), Plan::Run { attempt: 2 });
    let last = Entry::Running { owner: "o".into(), host: "h".into(), attempt: 3, started_at_ms: 1, last: None };
    assert_eq!(plan(Some(&last), false, LIMIT, false, false), Plan::FailedForGood, "its last attempt crashed");
    let failed = Entry::Failed { attempts: 2, host: "h".into(), started_at_ms: 1, ending: ending("exit 1") };
    assert_eq!(plan(Some(&failed), false, LIMIT, false, false), Plan::Run { attempt: 3 });
    assert_eq!(plan(Some(&failed), false, RetryLimit { max_attempts: 2 }, false, false), Plan::FailedForGood);
    assert_eq!(plan(Some(&failed), true, RetryLimit { max_attempts: 2 }, false, false), Plan::FailedForGood);
    // Older than the job's newest slot: never claimed nor recorded, whatever its entry (or its absence) says.
    assert_eq!(plan(None, false, LIMIT, false, true), Plan::Behind, "a pruned or unlisted slot");
    assert_eq!(plan(None, false, LIMIT, true, true), Plan::Behind);
    assert_eq!(plan(Some(&failed), false, LIMIT, false, true), Plan::Behind);
    assert_eq!(plan(Some(&running), false, LIMIT, false, true), Plan::Behind);
    assert_eq!(plan(Some(&done), false, LIMIT, false, true), Plan::Done);
    assert_eq!(plan(Some(&missed), false, LIMIT, false, true), Plan::Missed);
}

#[test]
fn attempts_are_counted_at_claim_and_every_later_write_is_fenced() {
    let claim = Claim::new(keys(), "o1", "host-a", 100, LEASE, None);
    assert_eq!(claim.attempt(), 1);
    assert_eq!(claim.lease_write().precondition, Precondition::Absent);
    assert_eq!(claim.entry_write().precondition, Precondition::Absent);
    let running = decoded(&claim.entry_write());
    assert_eq!(running.attempts(), 1);
    let mut held = claim.acquired(Generation::new(3), Generation::new(4));
    assert_eq!(held.fencing_token(), Generation::new(4));
    assert_eq!(held.renewal().precondition, Precondition::Generation(Generation::new(3)));
    held.renewed(Generation::new(9));
    assert_eq!(held.release().precondition, Precondition::Generation(Generation::new(9)));
    let done = held.done(ending("exit 0"));
    assert_eq!(done.precondition, Precondition::Generation(Generation::new(4)));
    assert!(matches!(decoded(&done), Entry::Done { attempts: 1, ref host, .. } if host == "host-a"));
    // The holder crashed instead: the next claim counts attempt 2 and is conditional on the entry it read.
    let again = Claim::new(keys(), "o2", "host-b", 200, LEASE, Some((Generation::new(4), running)));
    assert_eq!(again.attempt(), 2);
    assert_eq!(again.entry_write().precondition, Precondition::Generation(Generation::new(4)));
}

#[test]
fn failures_are_retried_until_the_attempts_run_out() {
    let mut prev = None;
    let mut verdicts = Vec::new();
    for i in 0..3u64 {
        let held =
            Claim::new(keys(), "o", "h", i, LEASE, prev.take()).acquired(Generation::new(1), Generation::new(2 + i));
        let (write, verdict) = held.failed(ending("exit 3"), LIMIT);
        verdicts.push(verdict);
        let entry = decoded(&write);
        prev = Some((Generation::new(10 + i), entry));
    }
    assert_eq!(verdicts, [Failure::Retry, Failure::Retry, Failure::Exhausted]);
    let (_, last) = prev.unwrap();
    assert_eq!(last.attempts(), 3);
    assert_eq!(last.last_ending().unwrap().exit, "exit 3");
    assert_eq!(plan(Some(&last), false, LIMIT, false, false), Plan::FailedForGood);
}

#[test]
fn an_interrupted_attempt_is_not_counted_and_keeps_the_failure_before_it() {
    let failed = Entry::Failed { attempts: 1, host: "h".into(), started_at_ms: 1, ending: ending("exit 1") };
    let held = Claim::new(keys(), "o", "h", 5, LEASE, Some((Generation::new(2), failed)))
        .acquired(Generation::new(3), Generation::new(4));
    assert_eq!(held.attempt(), 2);
    let interrupted = decoded(&held.interrupted(6));
    assert_eq!(interrupted.attempts(), 1);
    assert_eq!(interrupted.last_ending().unwrap().exit, "exit 1");
    assert_eq!(plan(Some(&interrupted), false, RetryLimit { max_attempts: 2 }, true, false), Plan::Run { attempt: 2 });
    assert_eq!(Entry::decode(&interrupted.encode()).unwrap(), interrupted);
}

#[test]
fn missed_is_create_only_and_pruning_keeps_the_newest_and_the_running() {
    let write = missed(&keys(), MissedReason::PastDeadline { came_at_ms: 7 }, 8);
    assert_eq!(write.precondition, Precondition::Absent);
    let entry = decoded(&write);
    assert_eq!(entry, Entry::Missed { reason: MissedReason::PastDeadline { came_at_ms: 7 }, recorded_at_ms: 8 });
    assert!(entry.is_final());
    let text = String::from_utf8(entry.encode().to_vec()).unwrap();
    assert!(text.contains(r#""why":"past_deadline""#), "{text}");
    let running = Entry::Running { owner: "o".into(), host: "h".into(), attempt: 1, started_at_ms: 1, last: None };
    let listed: Vec<(String, Generation, Entry)> = (0..5u64)
        .map(|i| {
            let e = if i == 1 { running.clone() } else { entry.clone() };
            (Keys::new("j", i).entry().to_owned(), Generation::new(i + 1), e)
        })
        .collect();
    let deletes = prune(&listed, 2);
    let keys: Vec<&str> = deletes.iter().map(|w| w.key.as_str()).collect();
    assert_eq!(keys, [Keys::new("j", 0).entry(), Keys::new("j", 2).entry()]);
    assert_eq!(deletes[1].precondition, Precondition::Generation(Generation::new(3)));
    assert!(prune(&listed, 5).is_empty());
}

/// A slot that ran stays while fewer than `keep` entries other than missed ones are newer: missed entries ahead
/// of it are pruned first (they can be deleted again when a clock that ran ahead recorded them), so a claim of
/// a pruned slot always finds `keep` such entries newer. Fails with the prune of the oldest entries whatever
/// they are.
#[test]
fn a_slot_that_ran_outlives_the_missed_entries_ahead_of_it() {
    let ending = Ending { exit: "exit 0".into(), code: Some(0), duration_ms: 1, finished_at_ms: 1, output: vec![] };
    let done = Entry::Done { attempts: 1, owner: "o".into(), host: "h".into(), started_at_ms: 1, ending };
    let missed = Entry::Missed { reason: MissedReason::NoInvocation, recorded_at_ms: 1 };
    let listed: Vec<(String, Generation, Entry)> = (0..6u64)
        .map(|i| {
            let e = if i == 0 || i == 5 { done.clone() } else { missed.clone() };
            (Keys::new("j", i).entry().to_owned(), Generation::new(i + 1), e)
        })
        .collect();
    let keys = |d: Vec<Write>| d.into_iter().map(|w| w.key).collect::<Vec<_>>();
    let entry = |i: u64| Keys::new("j", i).entry().to_owned();
    assert_eq!(keys(prune(&listed, 2)), [entry(1), entry(2), entry(3)], "the done slot 0 stays");
    assert_eq!(keys(prune(&listed, 1)), [entry(0), entry(1), entry(2), entry(3), entry(4)], "one done is newer");
}

#[test]
fn the_job_record_only_moves_forward() {
    let job = Job { schedule: "every 60s".into(), last_slot_ms: 120_000, missed_unlisted: 0, ..Job::default() };
    assert_eq!(job.advanced(60_000, 0).last_slot_ms, 120_000);
    let later = job.advanced(600_000, 3);
    assert_eq!((later.last_slot_ms, later.missed_unlisted), (600_000, 3));
    assert_eq!(Job::decode(&later.encode()).unwrap(), later);
    assert!(Job::decode(b"{}").is_err());
}

#[test]
fn the_counted_sets_leave_no_dedupe_records() {
    // Adding a member twice leaves one member: a dedupe id adds nothing but a record that outlives `forget`
    // (the store keeps it for its dedupe retention, 24 h).
    assert_eq!(keys().ran_again("o1").1.dedupe_id, None);
    assert_eq!(keys().took_over("o1").1.dedupe_id, None);
}

#[test]
fn only_earlier_slots_stop_one_under_each_overlap_policy() {
    use super::{Overlap, OverlapPlan, overlap};
    for policy in Overlap::ALL {
        assert_eq!(overlap(policy, &[]), OverlapPlan::Run, "{policy:?}: nothing ahead");
        assert_eq!(Overlap::parse(policy.name()), Some(policy));
    }
    assert_eq!(Overlap::parse("replace"), None);
    assert_eq!(overlap(Overlap::Allow, &[1, 2]), OverlapPlan::Run);
    assert_eq!(overlap(Overlap::Skip, &[1, 2]), OverlapPlan::GiveBack { earlier_ms: 1 });
    assert_eq!(overlap(Overlap::BufferOne, &[1]), OverlapPlan::Wait { earlier_ms: 1 });
    assert_eq!(overlap(Overlap::BufferOne, &[1, 2]), OverlapPlan::RecordSkipped { earlier_ms: 2 });
    assert_eq!(overlap(Overlap::BufferAll, &[1, 2, 3]), OverlapPlan::Wait { earlier_ms: 3 });
    assert_eq!(overlap(Overlap::CancelOther, &[1, 2]), OverlapPlan::Replace { earlier_ms: 2 });
    assert_eq!(overlap(Overlap::TerminateOther, &[1]), OverlapPlan::Replace { earlier_ms: 1 });
}

#[test]
fn a_pause_holds_until_its_end_and_a_resume_ends_it() {
    use super::Pause;
    let pause = Pause {
        by: "ops@a".into(),
        note: Some("incident".into()),
        since_ms: 100,
        until_ms: Some(500),
        resumed_by: None,
    };
    assert!(pause.holds_at(100) && pause.holds_at(499));
    assert!(!pause.holds_at(500), "it ends by itself at --until");
    let open = Pause { until_ms: None, ..pause.clone() };
    assert!(open.holds_at(u64::MAX - 1));
    let resumed = open.resumed("ops@b", 300);
    assert!(!resumed.holds_at(300) && resumed.holds_at(299));
    assert_eq!(resumed.resumed_by.as_deref(), Some("ops@b"));
    assert_eq!(pause.resumed("x", 900).until_ms, Some(500), "a resume after the end keeps the end");
    assert_eq!(Pause::decode(&resumed.encode()).unwrap(), resumed);
}

#[test]
fn paused_skipped_and_requested_entries_are_judged_without_running() {
    use super::{Pause, paused, requested};
    let limit = RetryLimit { max_attempts: 2 };
    let p = Entry::Paused { by: "u@h".into(), note: None, recorded_at_ms: 1 };
    let s = Entry::Skipped { policy: "buffer-one".into(), earlier_ms: 1, recorded_at_ms: 2 };
    // A paused slot is run by a later invocation in its time once the pause ended (the caller keeps it
    // paused while the pause holds); past its deadline, or behind, it stays paused.
    assert_eq!(plan(Some(&p), false, limit, false, false), Plan::Run { attempt: 1 });
    assert_eq!(plan(Some(&p), true, limit, false, false), Plan::Held);
    assert_eq!(plan(Some(&p), false, limit, true, false), Plan::Paused);
    assert_eq!(plan(Some(&p), false, limit, false, true), Plan::Paused);
    assert_eq!(plan(Some(&s), false, limit, false, false), Plan::Skipped);
    let skip = Entry::Skipped { policy: "skip".into(), earlier_ms: 1, recorded_at_ms: 2 };
    assert_eq!(plan(Some(&skip), false, limit, false, false), Plan::Run { attempt: 1 });
    assert_eq!(plan(Some(&skip), false, limit, true, false), Plan::Skipped);
    assert!(p.is_final() && s.is_final());
    // A request, or a waiter whose lease lapsed, is claimed as a first attempt.
    let r = Entry::Requested { by: "u@h".into(), at_ms: 1 };
    let w = Entry::Waiting { owner: "o".into(), host: "h".into(), since_ms: 1 };
    assert_eq!(plan(Some(&r), false, limit, false, false), Plan::Run { attempt: 1 });
    assert_eq!(plan(Some(&w), false, limit, false, false), Plan::Run { attempt: 1 });
    assert_eq!(plan(Some(&w), true, limit, false, false), Plan::Held);
    let pause = Pause { by: "u@h".into(), note: None, since_ms: 0, until_ms: None, resumed_by: None };
    assert_eq!(paused(&keys(), &pause, 5).precondition, Precondition::Absent);
    let t = Keys::trigger("j", "abc", 7);
    assert_eq!((t.entry(), t.lease()), ("once/j/trigger/abc", "once/j/trigger-lease/abc"));
    assert_eq!(requested(&t, "u@h", 7).precondition, Precondition::Absent);
    assert!(super::is_trigger_id("a-1.b_2") && !super::is_trigger_id("") && !super::is_trigger_id("a/b"));
}

#[test]
fn a_waiting_claim_runs_from_its_waiting_entry() {
    let claim = Claim::new(keys(), "o1", "h1", 1_000, Duration::from_secs(10), None);
    assert_eq!(claim.waiting_write().precondition, Precondition::Absent);
    let go = claim.after_wait(Generation::new(4), 9_000);
    assert_eq!(go.entry_write().precondition, Precondition::Generation(Generation::new(4)));
    assert_eq!(go.attempt(), 1);
    assert!(!go.takes_over(), "a waiter's entry is no started attempt");
    assert_eq!(
        claim.skipped(Generation::new(4), "buffer-one", 1, 2).precondition,
        Precondition::Generation(Generation::new(4))
    );
}
