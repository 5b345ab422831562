//! Races between invocations of `idem once` in neighbouring slots, forced with [`FaultyStore`] delays over one
//! [`MemoryStore`] on the system clock (one wrapper per invocation: each its own "machine").

use std::path::Path;
use std::time::Duration;

use idem_runner::once::{OnceConfig, Overlap, Schedule, once};
use idem_store::testing::{Fault, FaultyStore, OpKind, Operation};
use idem_store::{MemoryStore, Precondition};

const PERIOD_MS: u64 = 4000;

/// Sleeps until the system clock is `from_ms`..`from_ms + 200` into a slot; returns that slot's time.
async fn into_slot(from_ms: u64) -> u64 {
    loop {
        let now = now_ms();
        let into = now % PERIOD_MS;
        if (from_ms..from_ms + 200).contains(&into) {
            return now - into;
        }
        tokio::time::sleep(Duration::from_millis(((from_ms + PERIOD_MS - into) % PERIOD_MS).max(1))).await;
    }
}

async fn sleep_until(at_ms: u64) {
    tokio::time::sleep(Duration::from_millis(at_ms.saturating_sub(now_ms()))).await;
}

fn now_ms() -> u64 {
    u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// Every execution's slot, start and end (ms), from the lines the command appends to `runs`.
fn runs(dir: &Path) -> Vec<(String, u64, u64)> {
    let text = std::fs::read_to_string(dir.join("runs")).unwrap_or_default();
    let mut starts = std::collections::BTreeMap::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split(' ').collect();
        let (what, slot, at) = (parts[0], parts[1].to_owned(), parts[2].parse::<u64>().unwrap() / 1_000_000);
        if what == "start" {
            starts.insert(slot, at);
        } else if let Some(start) = starts.remove(&slot) {
            out.push((slot, start, at));
        }
    }
    out
}

/// Delay the `n`-th (from 1) operation that matches by this long.
type Rule = (usize, Duration, fn(&Operation<'_>) -> bool);

/// A store whose rules delay operations of the invocation that uses it.
fn delaying(inner: &MemoryStore, rules: Vec<Rule>) -> FaultyStore<MemoryStore> {
    let mut seen = vec![0usize; rules.len()];
    FaultyStore::new(inner.clone(), move |op| {
        let mut fault = None;
        for (i, (nth, delay, matching)) in rules.iter().enumerate() {
            if matching(op) {
                seen[i] += 1;
                if seen[i] == *nth {
                    fault = Some(Fault::Delay(*delay));
                }
            }
        }
        fault
    })
}

fn job_put(op: &Operation<'_>) -> bool {
    op.kind == OpKind::Put && op.key.ends_with("/job")
}

fn waiting_put(op: &Operation<'_>) -> bool {
    op.kind == OpKind::Put && op.value.is_some_and(|v| v.windows(9).any(|w| w == b"\"waiting\""))
}

fn lease_claim(op: &Operation<'_>) -> bool {
    op.kind == OpKind::Put && op.key.contains("/lease/") && op.precondition == Some(Precondition::Absent)
}

/// Under `buffer-all` (and likewise `skip`, `buffer-one`) two slots must never run at once. Slot E's
/// invocation reads the job record (newest slot D) at the end of E; slot L's (the next) reads it too (still D)
/// and, with `--catchup-window`, requests E as a slot that passed unseen (its entry `requested`); E's
/// invocation moves the record to E first, so L's moves it on to L after reading it again. E's invocation,
/// judging E as its current slot by its first read (not behind, no entry), takes E's lease, finds the entry
/// changed (requested), gives the lease back, reads it again and claims it by the path of a retry of a started
/// slot, which looks only for *earlier* slots running (`record::running_before`), not at L, which L's
/// invocation started in the moment E's lease was given back. Found by the once workload of `idem-verify`
/// (SQLite, seed 1, slots :40 and :42 of `buffer-all` run side by side for 1.3 s). Fixed: under a policy other
/// than `allow` that claim takes its lease, then looks at every other live lease of the job (`claim_slot`'s
/// `alone`), so of two that look at once neither misses the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_a_later_invocation_requested_does_not_run_beside_the_later_slot() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "cd '{}' && echo \"start $IDEM_SLOT $(date +%s%N)\" >> runs && sleep 3 && echo \"end $IDEM_SLOT $(date +%s%N)\" >> runs",
        dir.path().display()
    );
    let mut cfg = OnceConfig::new(
        "race",
        Schedule::every(Duration::from_millis(PERIOD_MS)).unwrap(),
        vec!["sh".into(), "-c".into(), script],
    );
    cfg.lease = Duration::from_secs(3);
    cfg.overlap = Overlap::BufferAll;
    cfg.catchup_window = Some(Duration::from_secs(10));
    let memory = MemoryStore::new();
    // Slot D runs (its command takes 3 s, within D): the job's newest slot is D.
    let d = into_slot(100).await;
    once(&memory, &cfg, std::future::pending()).await.unwrap();
    // E's invocation at E + 3.0 s: its record move lands 2 s later (L + 1.0 s); its first entry write (the
    // waiting one, refused) 1.5 s after its lease; its second lease claim 1.5 s late.
    let e = d + PERIOD_MS;
    sleep_until(e + 3000).await;
    let store_e = delaying(
        &memory,
        vec![
            (1, Duration::from_millis(2000), job_put),
            (1, Duration::from_millis(1500), waiting_put),
            (2, Duration::from_millis(1500), lease_claim),
        ],
    );
    let (cfg_e, cfg_l) = (cfg.clone(), cfg.clone());
    let first = tokio::spawn(async move { once(&store_e, &cfg_e, std::future::pending()).await.unwrap() });
    // L's invocation at L + 0.3 s: it reads the record before E's move lands, and its own lands after.
    sleep_until(e + PERIOD_MS + 300).await;
    let store_l = delaying(&memory, vec![(1, Duration::from_millis(1200), job_put)]);
    let second = tokio::spawn(async move { once(&store_l, &cfg_l, std::future::pending()).await.unwrap() });
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    let ran = runs(dir.path());
    for (i, a) in ran.iter().enumerate() {
        for b in &ran[i + 1..] {
            assert!(
                a.2 <= b.1 || b.2 <= a.1,
                "under --overlap buffer-all slots {} ({}..{}) and {} ({}..{}) ran at once\n{}\n{}",
                a.0,
                a.1,
                a.2,
                b.0,
                b.1,
                b.2,
                first.render(),
                second.render()
            );
        }
    }
}
