//! `LeaseKeeper` driven through `FaultyStore` on paused time: when it renews, what it does with a failing,
//! hanging or answer-losing store, and when it says the lease is lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_store::testing::{Fault, FaultyStore, OpKind};
use idem_store::{
    Generation, LeaseKeeper, Lost, MemoryStore, Precondition, Renewable, Store, Ttl, Versioned, Write, WriteOp,
};
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(3);
const KEY: &str = "lease/item";

/// The simplest lease: the owner's name under `KEY`, with the lease as TTL.
struct TestLease {
    owner: &'static str,
    generation: Generation,
}

impl Renewable for TestLease {
    fn length(&self) -> Duration {
        LEASE
    }
    fn renewal(&self) -> Write {
        Write {
            key: KEY.to_owned(),
            op: WriteOp::Put { value: Bytes::from(self.owner), ttl: Ttl::After(LEASE) },
            precondition: Precondition::Generation(self.generation),
        }
    }
    fn renewed(&mut self, generation: Generation) {
        self.generation = generation;
    }
    fn is_mine(&self, current: &Versioned) -> bool {
        current.value().as_ref() == self.owner.as_bytes()
    }
}

/// A store whose puts on `KEY` the test can make fail (`faults` counts how many more), and the lease claimed.
async fn claimed(owner: &'static str) -> (FaultyStore<MemoryStore>, TestLease, Arc<AtomicU32>) {
    let store = FaultyStore::new(MemoryStore::with_tokio_clock(), |_| None);
    let written = store.put(KEY, Bytes::from(owner), Precondition::Absent, Ttl::After(LEASE)).await.unwrap();
    (store, TestLease { owner, generation: written.generation() }, Arc::default())
}

/// Counts the puts on `KEY` (renewals) and answers each with what `fault` says.
fn count_puts(
    store: &FaultyStore<MemoryStore>,
    puts: &Arc<AtomicU32>,
    fault: impl Fn(u32) -> Option<Fault> + Send + 'static,
) {
    let puts = Arc::clone(puts);
    store.set_rule(move |op| {
        if op.kind != OpKind::Put {
            return None;
        }
        let n = puts.fetch_add(1, Ordering::SeqCst) + 1;
        fault(n)
    });
}

#[tokio::test(start_paused = true)]
async fn renews_every_third_of_the_lease_and_keeps_the_lease_alive() {
    let (store, mut lease, puts) = claimed("a").await;
    count_puts(&store, &puts, |_| None);
    let mut keeper = LeaseKeeper::new(&store, LEASE, Instant::now());
    // Ten leases of work: without renewals the record would have expired after the first.
    let work = tokio::time::sleep(LEASE * 10);
    keeper.during(&mut lease, work, |lost| panic!("lost: {lost:?}")).await;
    // A renewal at 1 s, 2 s, ... 30 s: the one due exactly at the end may or may not have been sent.
    let n = puts.load(Ordering::SeqCst);
    assert!((29..=30).contains(&n), "{n} renewals in 30 s");
    let current = store.inner().get(KEY).await.unwrap().expect("the lease is still there");
    assert_eq!(current.generation(), lease.generation, "every accepted renewal moved the token");
}

#[tokio::test(start_paused = true)]
async fn a_refused_renewal_is_lost_at_once() {
    let (store, mut lease, _) = claimed("a").await;
    let mut keeper = LeaseKeeper::new(&store, LEASE, Instant::now());
    // Another holder overwrites the lease (as after a lapse and a takeover).
    store.inner().put(KEY, Bytes::from("b"), Precondition::Any, Ttl::After(LEASE)).await.unwrap();
    let start = Instant::now();
    assert_eq!(keeper.until_lost(&mut lease).await, Lost::Refused);
    assert_eq!(start.elapsed(), LEASE / 3, "found at the first renewal");
    assert_eq!(keeper.lost(), Some(Lost::Refused));
    assert!(!keeper.fence(&mut lease).await, "a lost lease never fences");
}

#[tokio::test(start_paused = true)]
async fn failing_renewals_are_retried_while_the_lease_lasts() {
    let (store, mut lease, puts) = claimed("a").await;
    // The first three renewals fail; the fourth (a retry 200 ms after the third) is accepted.
    count_puts(&store, &puts, |n| (n <= 3).then_some(Fault::Fail));
    let mut keeper = LeaseKeeper::new(&store, LEASE, Instant::now());
    keeper.during(&mut lease, tokio::time::sleep(Duration::from_millis(1_700)), |lost| panic!("lost: {lost:?}")).await;
    // 1.0 s fails, retried at 1.2 and 1.4 (fail), 1.6 accepted.
    assert_eq!(puts.load(Ordering::SeqCst), 4);
    assert_eq!(store.inner().get(KEY).await.unwrap().unwrap().generation(), lease.generation);
}

#[tokio::test(start_paused = true)]
async fn a_store_that_never_answers_loses_the_lease_when_it_lapses() {
    let (store, mut lease, puts) = claimed("a").await;
    count_puts(&store, &puts, |_| Some(Fault::Hang));
    let claimed_at = Instant::now();
    let mut keeper = LeaseKeeper::new(&store, LEASE, claimed_at);
    assert_eq!(keeper.until_lost(&mut lease).await, Lost::Lapsed);
    // Not a moment later than the lease: past it, another holder may have claimed the item.
    assert_eq!(claimed_at.elapsed(), LEASE);
    assert_eq!(puts.load(Ordering::SeqCst), 1, "the hanging renewal was dropped, not sent again");
}

#[tokio::test(start_paused = true)]
async fn a_store_that_keeps_failing_loses_the_lease_after_a_whole_lease() {
    let (store, mut lease, puts) = claimed("a").await;
    count_puts(&store, &puts, |_| Some(Fault::Fail));
    let claimed_at = Instant::now();
    let mut keeper = LeaseKeeper::new(&store, LEASE, claimed_at);
    assert_eq!(keeper.until_lost(&mut lease).await, Lost::Lapsed);
    let elapsed = claimed_at.elapsed();
    assert!(elapsed >= LEASE && elapsed <= LEASE + Duration::from_millis(200), "{elapsed:?}");
}

#[tokio::test(start_paused = true)]
async fn a_renewal_whose_answer_was_lost_is_adopted_not_taken_for_a_takeover() {
    let (store, mut lease, puts) = claimed("a").await;
    // The first renewal lands but its caller is told the store failed: the token moved past what it knows.
    count_puts(&store, &puts, |n| (n == 1).then_some(Fault::LoseAnswer));
    let mut keeper = LeaseKeeper::new(&store, LEASE, Instant::now());
    keeper.during(&mut lease, tokio::time::sleep(LEASE * 3), |lost| panic!("lost its own lease: {lost:?}")).await;
    assert_eq!(keeper.lost(), None);
    let current = store.inner().get(KEY).await.unwrap().unwrap();
    assert_eq!(current.value().as_ref(), b"a");
    assert_eq!(current.generation(), lease.generation, "the token is the store's again");
}

#[tokio::test(start_paused = true)]
async fn another_holders_lease_is_never_adopted() {
    let (store, mut lease, puts) = claimed("a").await;
    count_puts(&store, &puts, |_| None);
    let mut keeper = LeaseKeeper::new(&store, LEASE, Instant::now());
    // The lease lapses unrenewed (the holder was paused), and "b" claims it.
    tokio::time::advance(LEASE + Duration::from_millis(1)).await;
    store.inner().put(KEY, Bytes::from("b"), Precondition::Absent, Ttl::After(LEASE)).await.unwrap();
    assert!(!keeper.fence(&mut lease).await);
    assert_eq!(keeper.lost(), Some(Lost::Refused));
    assert_eq!(store.inner().get(KEY).await.unwrap().unwrap().value().as_ref(), b"b", "b's lease stands");
}

#[tokio::test(start_paused = true)]
async fn fence_renews_only_a_lease_set_more_than_a_third_ago() {
    let (store, mut lease, puts) = claimed("a").await;
    count_puts(&store, &puts, |_| None);
    let mut keeper = LeaseKeeper::new(&store, LEASE, Instant::now());
    assert!(keeper.fence(&mut lease).await);
    assert_eq!(puts.load(Ordering::SeqCst), 0, "fresh: no write");
    tokio::time::advance(LEASE / 3).await;
    assert!(keeper.fence(&mut lease).await);
    assert_eq!(puts.load(Ordering::SeqCst), 1, "a third old: renewed first");
    assert_eq!(keeper.sent(), Instant::now());
}

#[tokio::test(start_paused = true)]
async fn the_work_goes_on_after_a_loss_and_the_owner_is_told_once() {
    let (store, mut lease, _) = claimed("a").await;
    let mut keeper = LeaseKeeper::new(&store, LEASE, Instant::now());
    store.inner().put(KEY, Bytes::from("b"), Precondition::Any, Ttl::After(LEASE)).await.unwrap();
    let told = AtomicU32::new(0);
    let out = keeper
        .during(
            &mut lease,
            async {
                tokio::time::sleep(LEASE * 2).await;
                7
            },
            |lost| {
                assert_eq!(lost, Lost::Refused);
                told.fetch_add(1, Ordering::SeqCst);
            },
        )
        .await;
    assert_eq!(out, 7, "the work ran to its end");
    assert_eq!(told.load(Ordering::SeqCst), 1);
}
