use std::time::Duration;

use idem_store::{Generation, Precondition, Renewable, Ttl};

use super::*;
use crate::{Write, WriteOp};

#[test]
fn unclaim_puts_back_the_entry_it_replaced_fenced_on_the_claim() {
    let keys = Keys::new("job", "a");
    let fresh = Claim::new(keys.clone(), "o1", 1, Duration::from_secs(10), None)
        .acquired(Generation::new(5), Generation::new(6));
    let undo = fresh.unclaim().expect("counted");
    assert_eq!(undo.key, keys.entry());
    assert_eq!(undo.op, WriteOp::Delete, "a new item goes back to having no entry");
    assert_eq!(undo.precondition, Precondition::Generation(Generation::new(6)));
    let failed = Entry::Failed {
        attempts: 1,
        failures: vec!["exit 1".into()],
        last_error: "boom".into(),
        poison: false,
        finished_at_ms: 0,
        item_sha256: None,
    };
    let retry = Claim::new(keys, "o1", 1, Duration::from_secs(10), Some((Generation::new(3), failed.clone())))
        .acquired(Generation::new(7), Generation::new(8));
    assert_eq!(retry.attempt(), 2);
    let undo = retry.unclaim().expect("counted");
    assert_eq!(undo.op, WriteOp::Put { value: failed.encode(), ttl: Ttl::Clear }, "attempt 2 is not spent");
    assert_eq!(undo.precondition, Precondition::Generation(Generation::new(8)));
}

const LIMIT: RetryLimit = RetryLimit { max_attempts: 3 };

/// A claim made ahead of a free slot holds the lease only: until its count, nothing in the entry says an
/// attempt ran, so one given up (stopped, or the store unreachable past the limit) spends no attempt even
/// when nothing can be written to give it back.
#[test]
fn an_uncounted_claim_leaves_the_entry_as_it_was() {
    let failed = Entry::Failed {
        attempts: 1,
        failures: vec!["exit 1".into()],
        last_error: "boom".into(),
        poison: false,
        finished_at_ms: 0,
        item_sha256: None,
    };
    let once = RetryLimit { max_attempts: 2 };
    let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), Some((Generation::new(3), failed.clone())));
    let mut held = claim.clone().leased(Generation::new(4));
    assert_eq!(held.fencing_token(), None);
    assert!(!held.is_counted());
    assert_eq!(held.unclaim(), None, "nothing to undo in the entry");
    assert_eq!(held.reassert(), None, "a retaken lease is all there is to hold");
    // The entry as the next run reads it: still attempt 1 of 2, so the item runs again.
    assert_eq!(plan(Some(&failed), once), Plan::Retry { attempts: 1 });
    // The count is the claim's entry write, fenced on the entry read before the claim.
    let count = held.count();
    assert_eq!(count, claim.entry_write());
    assert_eq!(count.precondition, Precondition::Generation(Generation::new(3)));
    assert_eq!(decoded(&count).attempts(), 2);
    held.counted(Generation::new(5));
    assert_eq!(held.fencing_token(), Some(Generation::new(5)));
    assert_eq!(held.done("ab", 1, 2, 3).precondition, Precondition::Generation(Generation::new(5)));
    assert_eq!(held.unclaim().map(|w| w.precondition), Some(Precondition::Generation(Generation::new(5))));
    // Before the count, a write over the entry (an earlier holder's output adopted) is fenced on what was read.
    let fresh = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).leased(Generation::new(1));
    assert_eq!(fresh.done("ab", 1, 2, 3).precondition, Precondition::Absent);
}

fn keys() -> Keys {
    Keys::new("job1", "a")
}

#[test]
fn keys_are_namespaced_by_job() {
    assert_eq!(keys().entry(), "run/job1/item/a");
    assert_eq!(keys().lease(), "run/job1/lease/a");
    assert!(keys().entry().starts_with(&entry_prefix("job1")));
    assert_ne!(Keys::new("job2", "a").entry(), keys().entry());
}

#[test]
fn fingerprints_ignore_numbers_and_hex_runs() {
    let a = error_fingerprint("exit 1", b"starting\nerror at 12:00:01 id=deadbeef01 port 8080\n\n");
    let b = error_fingerprint("exit 1", b"error at 13:59:07 id=0badf00d99 port 9\n");
    assert_eq!(a, b);
    assert_eq!(a, "exit 1: error at N:N:N id=H port N");
    assert_ne!(a, error_fingerprint("exit 2", b"error at 13:59:07 id=0badf00d99 port 9"));
    assert_eq!(error_fingerprint("signal 9", b""), "signal 9: ");
    assert_eq!(error_fingerprint("exit 1", b"bad face"), "exit 1: bad face");
}

#[test]
fn attempts_are_counted_at_claim_and_carried_over_a_crash() {
    let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None);
    assert_eq!(claim.attempt(), 1);
    assert_eq!(claim.lease_write().precondition, Precondition::Absent);
    assert_eq!(claim.entry_write().precondition, Precondition::Absent);
    let WriteOp::Put { value, ttl } = claim.entry_write().op else { panic!("put") };
    assert_eq!(ttl, Ttl::Clear);
    let running = Entry::decode(&value).unwrap();
    assert_eq!(running.attempts(), 1);
    // The holder crashed: its lease lapsed but the entry still says attempt 1.
    assert_eq!(plan(Some(&running), LIMIT), Plan::Retry { attempts: 1 });
    let again = Claim::new(keys(), "o2", 2, Duration::from_secs(10), Some((Generation::new(7), running)));
    assert_eq!(again.attempt(), 2);
    assert_eq!(again.previous_attempt(), Some(("o1".to_owned(), 1)));
    assert_eq!(again.entry_write().precondition, Precondition::Generation(Generation::new(7)));
}

#[test]
fn every_write_after_the_claim_is_fenced() {
    let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None);
    let mut held = claim.acquired(Generation::new(3), Generation::new(4));
    assert_eq!(held.fencing_token(), Some(Generation::new(4)));
    assert_eq!(held.renewal().precondition, Precondition::Generation(Generation::new(3)));
    held.renewed(Generation::new(9));
    assert_eq!(held.renewal().precondition, Precondition::Generation(Generation::new(9)));
    assert_eq!(held.release().precondition, Precondition::Generation(Generation::new(9)));
    assert_eq!(held.release().op, WriteOp::Delete);
    let done = held.done("ab", 2, 5, 1);
    assert_eq!(done.precondition, Precondition::Generation(Generation::new(4)));
    assert_eq!(done.key, "run/job1/item/a");
    let (failed, _) = held.failed("exit 1: x", "x", 5, LIMIT);
    assert_eq!(failed.precondition, Precondition::Generation(Generation::new(4)));
}

#[test]
fn the_same_fingerprint_twice_is_poison() {
    let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None);
    let held = claim.acquired(Generation::new(1), Generation::new(2));
    let (w, verdict) = held.failed("exit 1: boom", "boom", 3, LIMIT);
    assert_eq!(verdict, Failure::Retry);
    let WriteOp::Put { value, .. } = w.op else { panic!("put") };
    let failed = Entry::decode(&value).unwrap();
    assert_eq!(plan(Some(&failed), LIMIT), Plan::Retry { attempts: 1 });
    let second = Claim::new(keys(), "o1", 4, Duration::from_secs(10), Some((Generation::new(5), failed)));
    let held = second.acquired(Generation::new(6), Generation::new(7));
    assert_eq!(held.attempt(), 2);
    let (w, verdict) = held.failed("exit 1: boom", "boom", 8, LIMIT);
    assert_eq!(verdict, Failure::Poison);
    let WriteOp::Put { value, .. } = w.op else { panic!("put") };
    let poisoned = Entry::decode(&value).unwrap();
    assert_eq!(plan(Some(&poisoned), LIMIT), Plan::Poison { last_error: "boom".into() });
}

#[test]
fn different_failures_exhaust_the_attempts() {
    let limit = RetryLimit { max_attempts: 2 };
    let mut prev = None;
    let mut verdicts = Vec::new();
    for (i, fp) in ["exit 1: a", "exit 1: b"].iter().enumerate() {
        let claim = Claim::new(keys(), "o", 0, Duration::from_secs(10), prev.take());
        let held = claim.acquired(Generation::new(1), Generation::new(2 + i as u64));
        let (w, verdict) = held.failed(fp, fp, 0, limit);
        verdicts.push(verdict);
        let WriteOp::Put { value, .. } = w.op else { panic!("put") };
        prev = Some((Generation::new(10 + i as u64), Entry::decode(&value).unwrap()));
    }
    assert_eq!(verdicts, [Failure::Retry, Failure::Exhausted]);
    let (_, last) = prev.unwrap();
    assert!(matches!(plan(Some(&last), limit), Plan::Exhausted { attempts: 2, .. }));
}

fn decoded(write: &Write) -> Entry {
    let WriteOp::Put { value, ttl } = &write.op else { panic!("put") };
    assert_eq!(*ttl, Ttl::Clear, "entries never expire");
    Entry::decode(value).unwrap()
}

#[test]
fn an_interrupted_attempt_is_not_counted_and_its_file_is_never_adopted() {
    // `--retries 0`: one attempt in all.
    let once = RetryLimit { max_attempts: 1 };
    let held =
        Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).acquired(Generation::new(3), Generation::new(4));
    let write = held.interrupted(9);
    assert_eq!(write.key, keys().entry());
    assert_eq!(write.precondition, Precondition::Generation(Generation::new(4)), "fenced on the claim");
    let entry = decoded(&write);
    assert_eq!(
        entry,
        Entry::Interrupted {
            owner: "o1".into(),
            attempt: 1,
            interrupted_at_ms: 9,
            failures: Vec::new(),
            last_error: None,
            item_sha256: None,
        }
    );
    assert_eq!(entry.attempts(), 0, "the interrupted attempt is not counted");
    // Not New (which may adopt a file at the final path) and not out of attempts: it runs again.
    assert_eq!(plan(Some(&entry), once), Plan::Retry { attempts: 0 });
    assert_eq!(Entry::decode(&entry.encode()).unwrap(), entry);

    // The next claim runs as the same attempt number and sweeps the interrupted attempt's temporary file.
    let next = Claim::new(keys(), "o2", 10, Duration::from_secs(10), Some((Generation::new(5), entry.clone())));
    assert_eq!(next.attempt(), 1);
    assert_eq!(next.previous_attempt(), Some(("o1".to_owned(), 1)));
    assert_eq!(next.entry_write().precondition, Precondition::Generation(Generation::new(5)));
    // If that claim's command never starts, undoing it keeps the mark.
    let undo = next.acquired(Generation::new(6), Generation::new(7)).unclaim().expect("counted");
    assert_eq!(decoded(&undo), entry);
    assert_eq!(undo.precondition, Precondition::Generation(Generation::new(7)));
}

#[test]
fn an_interrupted_retry_keeps_the_failures_before_it() {
    let failed = Entry::Failed {
        attempts: 1,
        failures: vec!["exit 1: boom".into()],
        last_error: "boom".into(),
        poison: false,
        finished_at_ms: 0,
        item_sha256: None,
    };
    let held = Claim::new(keys(), "o1", 1, Duration::from_secs(10), Some((Generation::new(2), failed)))
        .acquired(Generation::new(3), Generation::new(4));
    assert_eq!(held.attempt(), 2);
    let entry = decoded(&held.interrupted(5));
    assert_eq!(entry.attempts(), 1, "the earlier failure still counts, the interruption does not");
    assert_eq!(entry.last_error(), Some("boom"));
    assert_eq!(plan(Some(&entry), RetryLimit { max_attempts: 2 }), Plan::Retry { attempts: 1 });
    assert_eq!(
        plan(Some(&entry), RetryLimit { max_attempts: 1 }),
        Plan::Exhausted { attempts: 1, last_error: "boom".into() }
    );
    // The same failure after the interruption is still the second occurrence: poison.
    let again = Claim::new(keys(), "o2", 6, Duration::from_secs(10), Some((Generation::new(5), entry)))
        .acquired(Generation::new(6), Generation::new(7));
    assert_eq!(again.attempt(), 2);
    let (_, verdict) = again.failed("exit 1: boom", "boom", 8, LIMIT);
    assert_eq!(verdict, Failure::Poison);
}

/// Every way an attempt can end short of done, from an item with no entry: only a claim whose command never
/// started leaves no entry behind, so only then may a file found at the final path be adopted.
#[test]
fn only_an_attempt_that_never_started_leaves_the_item_adoptable() {
    let held =
        || Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).acquired(Generation::new(1), Generation::new(2));
    let running = decoded(&Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).entry_write());
    let endings: Vec<(&str, Entry)> = vec![
        // kill -9, a crash, a lost lease (taken over or the ledger unreachable): the claim's entry stays.
        ("crashed or lost its lease", running),
        // A failed command, a timeout, a spawn that failed for want of resources for 30 s.
        ("failed", decoded(&held().failed("timeout: ", "timeout", 3, LIMIT).0)),
        (
            "failed with no attempts left",
            decoded(&held().failed("timeout: ", "timeout", 3, RetryLimit { max_attempts: 1 }).0),
        ),
        // A second Ctrl-C or SIGTERM while the command ran.
        ("interrupted", decoded(&held().interrupted(3))),
    ];
    for (how, entry) in &endings {
        for limit in [RetryLimit { max_attempts: 1 }, LIMIT] {
            let plan = plan(Some(entry), limit);
            assert!(!matches!(plan, Plan::New | Plan::CheckDone { .. }), "{how}: {plan:?} may adopt a file");
        }
    }
    // Stopped before its command started: nothing ran, the item is as it was.
    assert_eq!(held().unclaim().expect("counted").op, WriteOp::Delete);
    assert_eq!(plan(None, LIMIT), Plan::New);
}

#[test]
fn done_items_are_checked_and_redone_from_attempt_one() {
    let done = Entry::Done {
        attempts: 2,
        sha256: "ff".into(),
        size: 1,
        owner: "o".into(),
        finished_at_ms: 0,
        duration_ms: 0,
        item_sha256: None,
    };
    assert_eq!(plan(Some(&done), LIMIT), Plan::CheckDone { sha256: "ff".into(), size: 1 });
    let redo = Claim::new(keys(), "o", 0, Duration::from_secs(10), Some((Generation::new(3), done)));
    assert_eq!(redo.attempt(), 1);
    // A redo interrupted does not put the old digest back: the file may be the interrupted command's.
    let interrupted = decoded(&redo.clone().acquired(Generation::new(4), Generation::new(5)).interrupted(6));
    assert_eq!(plan(Some(&interrupted), LIMIT), Plan::Retry { attempts: 0 });
    let adopt = adopt(&keys(), "ff", 1, 0, None);
    assert_eq!(adopt.precondition, Precondition::Absent);
}

#[test]
fn entries_written_before_the_item_text_was_recorded_decode_without_it_and_new_ones_carry_it() {
    let old = br#"{"state":"done","attempts":1,"sha256":"ab","size":2,"owner":"o","finished_at_ms":1,"duration_ms":0}"#;
    assert_eq!(Entry::decode(old).unwrap().item_sha256(), None);
    let held = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None)
        .with_item_sha256("cd")
        .acquired(Generation::new(3), Generation::new(4));
    assert_eq!(decoded(&held.done("ab", 2, 5, 1)).item_sha256(), Some("cd"));
    assert!(!String::from_utf8_lossy(&Entry::decode(old).unwrap().encode()).contains("item_sha256"));
}
