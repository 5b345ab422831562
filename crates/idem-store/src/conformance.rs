//! The behaviour every backend must show, as async checks that panic on a violation.
//!
//! Backends run all of them with [`conformance_tests!`](crate::conformance_tests). Every check works under its
//! own random key prefix, so several checks (and several test processes) can share one database.
//! Concurrency is real: checks that race spawn tasks on the caller's multi-threaded runtime and count exactly.

// Test-support code: a panic is how a check reports a violation.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;

use crate::{Decision, Error, Generation, Precondition, RetryPolicy, SetChange, Store, StoreExt, Ttl, Updated};

/// Expands to one `#[tokio::test]` per conformance check.
///
/// `$make` is an async closure returning `Option<(store, guard)>`: `None` skips the test (print the reason
/// first, e.g. an unset `IDEM_TEST_POSTGRES_URL`); the guard (a temporary directory, say) lives as long as the
/// test. The store must be `Clone` so checks can hand it to spawned tasks.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            preconditions_on_put, preconditions_on_delete, expired_keys_read_absent, generations_never_reused,
            ttl_keep_and_clear, list_pages_while_writing, update_under_contention, raw_cas_under_contention, counter_dedupe_under_contention,
            set_changes_under_contention, limits_refuse_bad_input, matches_btreemap_model, get_many_matches_get,
            counter_dedupe_refuses_another_delta, set_dedupe_replays_and_refuses, dedupe_reuse_under_contention,
            refusals_carry_the_generation_that_refused);
    };
    (@each $make:expr; $($check:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                let Some((store, _guard)) = ($make)().await else { return };
                $crate::conformance::$check(&store).await;
            }
        )*
    };
}

fn prefix(check: &str) -> String {
    format!("conformance/{check}/{:016x}/", rand::random::<u64>())
}

fn gen_of(e: Error) -> Option<Generation> {
    match e {
        Error::PreconditionFailed { current } => current,
        other => panic!("expected a failed precondition, got {other:?}"),
    }
}

async fn ok_put<S: Store>(s: &S, key: &str, v: &str, pre: Precondition, ttl: Ttl) -> Generation {
    s.put(key, Bytes::from(v.to_owned()), pre, ttl).await.expect("put").generation()
}

/// `get_many` answers what `get` answers for each key, in order: present, absent, repeated, none at all.
pub async fn get_many_matches_get<S: Store>(s: &S) {
    let p = prefix("get_many");
    let keys: Vec<String> = ["a", "b", "missing", "a", "c"].iter().map(|k| format!("{p}{k}")).collect();
    for k in ["a", "b", "c"] {
        ok_put(s, &format!("{p}{k}"), k, Precondition::Absent, Ttl::Keep).await;
    }
    s.delete(&format!("{p}c"), Precondition::Any).await.unwrap();
    let many = s.get_many(&keys).await.unwrap();
    let mut one_by_one = Vec::new();
    for k in &keys {
        one_by_one.push(s.get(k).await.unwrap());
    }
    assert_eq!(many, one_by_one);
    assert_eq!(many.iter().filter(|v| v.is_some()).count(), 3);
    assert!(s.get_many(&[]).await.unwrap().is_empty());
}

/// Each precondition on put, on a present and on an absent key; `created` tells a create from a replace.
pub async fn preconditions_on_put<S: Store>(s: &S) {
    let p = prefix("put");
    let k = format!("{p}k");
    let v = || Bytes::from_static(b"v");
    // Absent key.
    assert_eq!(gen_of(s.put(&k, v(), Precondition::Present, Ttl::Keep).await.unwrap_err()), None);
    assert_eq!(
        gen_of(s.put(&k, v(), Precondition::Generation(Generation::new(1)), Ttl::Keep).await.unwrap_err()),
        None
    );
    assert!(s.get(&k).await.unwrap().is_none(), "a failed precondition wrote something");
    let w1 = s.put(&k, v(), Precondition::Absent, Ttl::Keep).await.unwrap();
    assert!(w1.created());
    // Present key.
    let e = s.put(&k, v(), Precondition::Absent, Ttl::Keep).await.unwrap_err();
    assert_eq!(gen_of(e), Some(w1.generation()));
    let w2 = s.put(&k, Bytes::from_static(b"v2"), Precondition::Present, Ttl::Keep).await.unwrap();
    assert!(!w2.created());
    assert!(w2.generation() > w1.generation());
    let e = s.put(&k, v(), Precondition::Generation(w1.generation()), Ttl::Keep).await.unwrap_err();
    assert_eq!(gen_of(e), Some(w2.generation()));
    let w3 = s.put(&k, Bytes::from_static(b"v3"), Precondition::Generation(w2.generation()), Ttl::Keep).await.unwrap();
    assert!(w3.generation() > w2.generation());
    let w4 = s.put(&k, Bytes::from_static(b"v4"), Precondition::Any, Ttl::Keep).await.unwrap();
    assert!(!w4.created() && w4.generation() > w3.generation());
    let got = s.get(&k).await.unwrap().unwrap();
    assert_eq!((got.value().as_ref(), got.generation()), (&b"v4"[..], w4.generation()));
    let w5 = s.put(&format!("{p}any"), v(), Precondition::Any, Ttl::Keep).await.unwrap();
    assert!(w5.created());
}

/// Each precondition on delete, on a present and on an absent key.
pub async fn preconditions_on_delete<S: Store>(s: &S) {
    let p = prefix("delete");
    let k = format!("{p}k");
    assert_eq!(s.delete(&k, Precondition::Any).await.unwrap(), None);
    assert_eq!(s.delete(&k, Precondition::Absent).await.unwrap(), None);
    assert_eq!(gen_of(s.delete(&k, Precondition::Present).await.unwrap_err()), None);
    assert_eq!(gen_of(s.delete(&k, Precondition::Generation(Generation::new(7))).await.unwrap_err()), None);
    let g1 = ok_put(s, &k, "a", Precondition::Absent, Ttl::Keep).await;
    assert_eq!(gen_of(s.delete(&k, Precondition::Absent).await.unwrap_err()), Some(g1));
    let g2 = ok_put(s, &k, "b", Precondition::Any, Ttl::Keep).await;
    assert_eq!(gen_of(s.delete(&k, Precondition::Generation(g1)).await.unwrap_err()), Some(g2));
    assert!(s.get(&k).await.unwrap().is_some(), "a failed precondition deleted the value");
    assert_eq!(s.delete(&k, Precondition::Generation(g2)).await.unwrap(), Some(g2));
    assert!(s.get(&k).await.unwrap().is_none());
    let g3 = ok_put(s, &k, "c", Precondition::Absent, Ttl::Keep).await;
    assert_eq!(s.delete(&k, Precondition::Present).await.unwrap(), Some(g3));
    let g4 = ok_put(s, &k, "d", Precondition::Absent, Ttl::Keep).await;
    assert_eq!(s.delete(&k, Precondition::Any).await.unwrap(), Some(g4));
}

/// A value past its expiry reads absent, satisfies `Absent`, fails `Present`, is not listed, and a re-create
/// after it starts without the old expiry.
pub async fn expired_keys_read_absent<S: Store + Clone>(s: &S) {
    let p = prefix("expired");
    let keys: Vec<String> = (0..4).map(|i| format!("{p}{i}")).collect();
    let mut gens = Vec::new();
    for k in &keys {
        gens.push(ok_put(s, k, "short", Precondition::Absent, Ttl::After(Duration::from_secs(1))).await);
    }
    let stay =
        ok_put(s, &format!("{p}stay"), "long", Precondition::Absent, Ttl::After(Duration::from_secs(3600))).await;
    // Expiry is judged by the store's clock with millisecond resolution: wait past it with a margin.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(s.get(&keys[0]).await.unwrap().is_none(), "an expired value is still readable");
    // Put with Present fails and reports absence; Generation(old) fails too.
    assert_eq!(gen_of(s.put(&keys[0], "x".into(), Precondition::Present, Ttl::Keep).await.unwrap_err()), None);
    assert_eq!(
        gen_of(s.put(&keys[0], "x".into(), Precondition::Generation(gens[0]), Ttl::Keep).await.unwrap_err()),
        None
    );
    // Absent holds; the new value is a create with no expiry under Keep.
    let w = s.put(&keys[0], "new".into(), Precondition::Absent, Ttl::Keep).await.unwrap();
    assert!(w.created() && w.generation() > gens[0]);
    assert_eq!(s.get(&keys[0]).await.unwrap().unwrap().expires_at(), None);
    // Delete: Present fails, Any reports nothing deleted.
    assert_eq!(gen_of(s.delete(&keys[1], Precondition::Present).await.unwrap_err()), None);
    assert_eq!(gen_of(s.delete(&keys[1], Precondition::Generation(gens[1])).await.unwrap_err()), None);
    assert_eq!(s.delete(&keys[2], Precondition::Any).await.unwrap(), None);
    // A counter on an expired key starts from zero.
    let c = s.counter_add(&keys[3], 5, None).await.unwrap();
    assert_eq!(c.value, 5);
    // Listing shows only live keys.
    let page = s.list(&p, None, 100).await.unwrap();
    let listed: Vec<&str> = page.items.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(listed, vec![keys[0].as_str(), keys[3].as_str(), &format!("{p}stay")]);
    assert_eq!(page.items[2].generation, stay);
}

/// Generations strictly increase across the store and are never reused, under concurrent writers and across
/// delete and re-create (ABA): a write conditioned on a generation from before the delete fails.
pub async fn generations_never_reused<S: Store + Clone>(s: &S) {
    let p = prefix("generations");
    let k = format!("{p}aba");
    let g1 = ok_put(s, &k, "a", Precondition::Absent, Ttl::Keep).await;
    s.delete(&k, Precondition::Generation(g1)).await.unwrap();
    let g2 = ok_put(s, &k, "a", Precondition::Absent, Ttl::Keep).await;
    assert!(g2 > g1, "re-create reused or lowered the generation: {g1} then {g2}");
    assert_eq!(gen_of(s.put(&k, "b".into(), Precondition::Generation(g1), Ttl::Keep).await.unwrap_err()), Some(g2));
    assert_eq!(gen_of(s.delete(&k, Precondition::Generation(g1)).await.unwrap_err()), Some(g2));

    // 8 tasks x 100 writes over 10 shared keys, with deletes: every returned generation distinct, each task's
    // sequence strictly increasing.
    let mut tasks = Vec::new();
    for t in 0..8 {
        let s = s.clone();
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for i in 0..100 {
                let key = format!("{p}k{}", (t + i) % 10);
                if i % 7 == 3 {
                    let _ = s.delete(&key, Precondition::Any).await.unwrap();
                    continue;
                }
                seen.push(
                    s.put(&key, Bytes::from(format!("{t}-{i}")), Precondition::Any, Ttl::Keep)
                        .await
                        .unwrap()
                        .generation(),
                );
            }
            seen
        }));
    }
    let mut all = HashSet::new();
    let mut total = 0;
    for t in tasks {
        let seen = t.await.unwrap();
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "a task saw generations go backwards: {seen:?}");
        total += seen.len();
        all.extend(seen);
    }
    assert_eq!(all.len(), total, "{} generations were handed out twice", total - all.len());
    let after = ok_put(s, &k, "c", Precondition::Any, Ttl::Keep).await;
    assert!(all.iter().all(|g| *g < after) && after > g2);
}

/// `Ttl::After` sets an expiry, `Keep` keeps it (also through `update` and set/counter operations), `Clear`
/// removes it.
pub async fn ttl_keep_and_clear<S: Store>(s: &S) {
    let p = prefix("ttl");
    let k = format!("{p}k");
    ok_put(s, &k, "a", Precondition::Absent, Ttl::Keep).await;
    assert_eq!(s.get(&k).await.unwrap().unwrap().expires_at(), None, "Keep on create set an expiry");
    ok_put(s, &k, "b", Precondition::Any, Ttl::After(Duration::from_secs(600))).await;
    let e1 = s.get(&k).await.unwrap().unwrap().expires_at().expect("After set no expiry");
    let left = e1.duration_since(std::time::SystemTime::now()).unwrap_or_default();
    assert!(left > Duration::from_secs(590) && left <= Duration::from_secs(601), "expiry {left:?} from now");
    ok_put(s, &k, "c", Precondition::Present, Ttl::Keep).await;
    assert_eq!(s.get(&k).await.unwrap().unwrap().expires_at(), Some(e1), "Keep changed the expiry");
    s.update(&k, |_| Decision::<()>::Put("d".into()), &RetryPolicy::default()).await.unwrap();
    assert_eq!(s.get(&k).await.unwrap().unwrap().expires_at(), Some(e1), "update dropped the expiry");
    ok_put(s, &k, "e", Precondition::Any, Ttl::Clear).await;
    assert_eq!(s.get(&k).await.unwrap().unwrap().expires_at(), None, "Clear kept an expiry");

    let c = format!("{p}counter");
    ok_put(s, &c, "1", Precondition::Absent, Ttl::After(Duration::from_secs(600))).await;
    let ec = s.get(&c).await.unwrap().unwrap().expires_at();
    s.counter_add(&c, 1, None).await.unwrap();
    assert_eq!(s.get(&c).await.unwrap().unwrap().expires_at(), ec, "counter add dropped the expiry");
    let st = format!("{p}set");
    ok_put(s, &st, "[\"a\"]", Precondition::Absent, Ttl::After(Duration::from_secs(600))).await;
    let es = s.get(&st).await.unwrap().unwrap().expires_at();
    s.set_change(&st, SetChange { add: vec!["b".into()], ..SetChange::default() }).await.unwrap();
    assert_eq!(s.get(&st).await.unwrap().unwrap().expires_at(), es, "set change dropped the expiry");
}

/// Paging through a prefix with a cursor returns every key that stays live exactly once, in order, while other
/// tasks create and delete keys in between them; keys outside the prefix never appear.
pub async fn list_pages_while_writing<S: Store + Clone>(s: &S) {
    let p = prefix("list");
    let stable: BTreeSet<String> = (0..300).map(|i| format!("{p}{i:04}/stable")).collect();
    for k in &stable {
        ok_put(s, k, "s", Precondition::Absent, Ttl::Keep).await;
    }
    // Neighbours just outside the prefix on both sides.
    let outside_lo = p[..p.len() - 1].to_owned();
    let outside_hi = format!("{}0", &p[..p.len() - 1]);
    ok_put(s, &outside_lo, "x", Precondition::Any, Ttl::Keep).await;
    ok_put(s, &outside_hi, "x", Precondition::Any, Ttl::Keep).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut churners = Vec::new();
    for t in 0..4 {
        let (s, p, stop) = (s.clone(), p.clone(), stop.clone());
        churners.push(tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 5000 {
                let key = format!("{p}{:04}/churn{t}", (n * 37 + t * 11) % 300);
                s.put(&key, "c".into(), Precondition::Any, Ttl::Keep).await.unwrap();
                if n % 2 == 1 {
                    s.delete(&key, Precondition::Any).await.unwrap();
                }
                n += 1;
                tokio::task::yield_now().await;
            }
        }));
    }
    let mut seen: Vec<String> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = s.list(&p, cursor.as_deref(), 17).await.unwrap();
        assert!(page.items.len() <= 17);
        seen.extend(page.items.into_iter().map(|i| i.key));
        tokio::task::yield_now().await;
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in churners {
        c.await.unwrap();
    }
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "listing not strictly ascending (a key repeated?)");
    assert!(seen.iter().all(|k| k.starts_with(&p)), "a key outside the prefix was listed");
    let got: BTreeSet<String> = seen.into_iter().filter(|k| k.ends_with("/stable")).collect();
    let missing = stable.difference(&got).count();
    assert_eq!(missing, 0, "{missing} stable keys missing from the listing");
    assert_eq!(got.len(), 300);
}

/// 16 tasks x 200 `update` calls each append a unique item to one shared list: exactly 3,200 items at the end,
/// no duplicate, no error.
pub async fn update_under_contention<S: Store + Clone>(s: &S) {
    let p = prefix("update");
    let key = format!("{p}list");
    // The default policy: 8 attempts. In-process turn-taking after a lost race keeps 16 saturating writers
    // from starving one another (see RetryPolicy).
    let policy = RetryPolicy::default();
    let mut tasks = Vec::new();
    for t in 0..16 {
        let (s, key, policy) = (s.clone(), key.clone(), policy.clone());
        tasks.push(tokio::spawn(async move {
            let mut retries = 0;
            for i in 0..200 {
                let item = format!("{t}-{i}");
                let out = s
                    .update(
                        &key,
                        |cur| {
                            let mut list: Vec<String> =
                                cur.map(|v| serde_json::from_slice(v.value()).expect("list")).unwrap_or_default();
                            list.push(item.clone());
                            Decision::<()>::Put(serde_json::to_vec(&list).expect("json").into())
                        },
                        &policy,
                    )
                    .await
                    .unwrap_or_else(|e| panic!("update {t}-{i} failed: {e}"));
                if let Updated::Put { attempts, .. } = out {
                    retries += attempts - 1;
                }
            }
            retries
        }));
    }
    let mut retries = 0;
    for t in tasks {
        retries += t.await.unwrap();
    }
    let list: Vec<String> = serde_json::from_slice(s.get(&key).await.unwrap().unwrap().value()).unwrap();
    let distinct: HashSet<&String> = list.iter().collect();
    assert_eq!(list.len(), 3200, "lost or duplicated updates ({retries} retries)");
    eprintln!("update_under_contention: 3200 of 3200 items, 0 duplicates, {retries} lost races retried");
    assert_eq!(distinct.len(), 3200, "duplicate items");
}

/// 16 tasks append 50 unique items each to one list with their own compare-and-swap loop (read, put on the
/// generation read, on failure read again), without `update`'s turn-taking: every lost race is a real
/// precondition failure from the backend. Exactly 800 items at the end.
pub async fn raw_cas_under_contention<S: Store + Clone>(s: &S) {
    let p = prefix("cas");
    let key = format!("{p}list");
    let mut tasks = Vec::new();
    for t in 0..16 {
        let (s, key) = (s.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut lost = 0u32;
            for i in 0..50 {
                loop {
                    let cur = s.get(&key).await.unwrap();
                    let mut list: Vec<String> =
                        cur.as_ref().map(|v| serde_json::from_slice(v.value()).unwrap()).unwrap_or_default();
                    list.push(format!("{t}-{i}"));
                    let pre = cur.map_or(Precondition::Absent, |v| Precondition::Generation(v.generation()));
                    match s.put(&key, serde_json::to_vec(&list).unwrap().into(), pre, Ttl::Keep).await {
                        Ok(_) => break,
                        Err(e) if e.is_precondition_failed() => {
                            lost += 1;
                            tokio::time::sleep(Duration::from_micros(u64::from(rand::random::<u16>() % 2000))).await;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            lost
        }));
    }
    let mut lost = 0;
    for t in tasks {
        lost += t.await.unwrap();
    }
    let list: Vec<String> = serde_json::from_slice(s.get(&key).await.unwrap().unwrap().value()).unwrap();
    let distinct: HashSet<&String> = list.iter().collect();
    assert_eq!((list.len(), distinct.len()), (800, 800), "lost or duplicated updates ({lost} lost races)");
    assert!(lost > 0, "16 writers on one key never raced: the test proved nothing");
}

/// A refused write names the generation that made its precondition fail, taken atomically with the refusal:
/// a create-only put (`Absent`) is never refused with "absent", nor a `Present` one with a generation, however
/// creates and deletes race on the key (8 tasks x 300 writes on one key). Found by `idem-verify` on
/// PostgreSQL, whose refusal read the key again in a second statement.
pub async fn refusals_carry_the_generation_that_refused<S: Store + Clone>(s: &S) {
    let key = format!("{}k", prefix("refusals"));
    let mut tasks = Vec::new();
    for t in 0..8u32 {
        let (s, key) = (s.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let (mut refused, mut contradictions) = (0u32, Vec::new());
            for i in 0..300u32 {
                let pre = if (t + i) % 3 == 0 { Precondition::Present } else { Precondition::Absent };
                let outcome = if (t + i) % 2 == 0 {
                    s.put(&key, Bytes::from_static(b"v"), pre, Ttl::Keep).await.map(|_| ())
                } else {
                    s.delete(&key, if pre == Precondition::Absent { Precondition::Any } else { pre }).await.map(|_| ())
                };
                if let Err(e) = outcome {
                    let current = gen_of(e);
                    refused += 1;
                    if pre.check(current).is_ok() {
                        contradictions.push(format!("{pre:?} refused with current {current:?}"));
                    }
                }
            }
            (refused, contradictions)
        }));
    }
    let (mut refused, mut contradictions) = (0, Vec::new());
    for t in tasks {
        let (r, c) = t.await.unwrap();
        refused += r;
        contradictions.extend(c);
    }
    assert!(refused > 0, "no write was refused: the test proved nothing");
    assert_eq!(contradictions.len(), 0, "{refused} refusals, these name a generation that passes: {contradictions:?}");
}

/// 16 tasks x 200 counter adds with unique dedupe ids, every id sent twice (concurrently): exactly 3,200.
pub async fn counter_dedupe_under_contention<S: Store + Clone>(s: &S) {
    let p = prefix("counter");
    let key = format!("{p}c");
    let mut tasks = Vec::new();
    for t in 0..16 {
        let (s, key) = (s.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut applied = 0;
            for i in 0..200 {
                let id = format!("{t}-{i}");
                let (a, b) = tokio::join!(s.counter_add(&key, 1, Some(&id)), s.counter_add(&key, 1, Some(&id)));
                let (a, b) = (a.unwrap(), b.unwrap());
                assert!(a.applied != b.applied, "dedupe id {id} applied {} times", a.applied as u8 + b.applied as u8);
                assert_eq!(
                    (a.value, a.generation),
                    (b.value, b.generation),
                    "a repeat did not return the first result"
                );
                applied += 1;
            }
            applied
        }));
    }
    let mut applied = 0;
    for t in tasks {
        applied += t.await.unwrap();
    }
    assert_eq!(applied, 3200);
    let v = s.get(&key).await.unwrap().unwrap();
    assert_eq!(v.value().as_ref(), b"3200");
    let again = s.counter_add(&key, 1, Some("0-0")).await.unwrap();
    assert!(!again.applied);
    assert_eq!(s.counter_add(&key, -200, None).await.unwrap().value, 3000);
    let wrong = format!("{p}text");
    ok_put(s, &wrong, "not a number", Precondition::Absent, Ttl::Keep).await;
    assert!(matches!(s.counter_add(&wrong, 1, None).await, Err(Error::WrongType { .. })));
    ok_put(s, &wrong, &i64::MAX.to_string(), Precondition::Any, Ttl::Keep).await;
    assert!(matches!(s.counter_add(&wrong, 1, None).await, Err(Error::CounterOverflow)));
}

/// Set adds from 16 concurrent tasks all land; removes remove; an emptied set is deleted; a non-set is refused.
pub async fn set_changes_under_contention<S: Store + Clone>(s: &S) {
    let p = prefix("set");
    let key = format!("{p}s");
    let mut tasks = Vec::new();
    for t in 0..16 {
        let (s, key) = (s.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let out = s
                    .set_change(&key, SetChange { add: vec![format!("{t}-{i}")], ..SetChange::default() })
                    .await
                    .unwrap();
                assert_eq!(out.added, 1);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let members = crate::decode_set(s.get(&key).await.unwrap().unwrap().value()).unwrap();
    assert_eq!(members.len(), 400);
    let again = s.set_change(&key, SetChange { add: vec!["0-0".into()], ..SetChange::default() }).await.unwrap();
    assert_eq!((again.added, again.members), (0, 400));
    let all: Vec<String> = members.into_iter().collect();
    let gone = s.set_change(&key, SetChange { remove: all, ..SetChange::default() }).await.unwrap();
    assert_eq!((gone.removed, gone.members, gone.generation), (400, 0, None));
    assert!(s.get(&key).await.unwrap().is_none(), "an emptied set was not deleted");
    let wrong = format!("{p}text");
    ok_put(s, &wrong, "{}", Precondition::Absent, Ttl::Keep).await;
    let e = s.set_change(&wrong, SetChange { add: vec!["a".into()], ..SetChange::default() }).await;
    assert!(matches!(e, Err(Error::WrongType { .. })));
}

fn set_change(add: &[&str], remove: &[&str], id: &str) -> SetChange {
    SetChange {
        add: add.iter().map(|m| (*m).to_owned()).collect(),
        remove: remove.iter().map(|m| (*m).to_owned()).collect(),
        dedupe_id: Some(id.to_owned()),
    }
}

fn assert_reused<T: std::fmt::Debug>(r: Result<T, Error>, key: &str, id: &str) {
    match r {
        Err(Error::DedupeIdReused { key: k, dedupe_id }) => assert_eq!((k.as_str(), dedupe_id.as_str()), (key, id)),
        other => panic!("expected DedupeIdReused for {key:?}/{id:?}, got {other:?}"),
    }
}

/// The issue's case: `+5` under `pay-1`, then `+7` under `pay-1`. The same delta again replays the first result;
/// another delta is refused and changes nothing (value and generation stay), also after the refusal; the id is
/// scoped to its key, and a fresh id applies.
pub async fn counter_dedupe_refuses_another_delta<S: Store>(s: &S) {
    let p = prefix("counter_reuse");
    let key = format!("{p}balance");
    let first = s.counter_add(&key, 5, Some("pay-1")).await.unwrap();
    assert!(first.applied);
    assert_eq!(first.value, 5);
    let again = s.counter_add(&key, 5, Some("pay-1")).await.unwrap();
    assert_eq!((again.value, again.generation, again.applied), (5, first.generation, false));
    assert_reused(s.counter_add(&key, 7, Some("pay-1")).await, &key, "pay-1");
    assert_reused(s.counter_add(&key, -5, Some("pay-1")).await, &key, "pay-1");
    let v = s.get(&key).await.unwrap().unwrap();
    assert_eq!((v.value().as_ref(), v.generation()), (&b"5"[..], first.generation), "a refused add wrote");
    // The refusal forgot nothing: the first payload still replays.
    let still = s.counter_add(&key, 5, Some("pay-1")).await.unwrap();
    assert_eq!((still.value, still.generation, still.applied), (5, first.generation, false));
    // Other ids on this key, and this id on another key, are independent.
    let other = s.counter_add(&key, 7, Some("pay-2")).await.unwrap();
    assert!(other.applied && other.value == 12 && other.generation > first.generation);
    let elsewhere = s.counter_add(&format!("{p}other"), 7, Some("pay-1")).await.unwrap();
    assert!(elsewhere.applied && elsewhere.value == 7);
    // A replay after later adds still answers the first application's result, not the current value.
    let late = s.counter_add(&key, 5, Some("pay-1")).await.unwrap();
    assert_eq!((late.value, late.generation, late.applied), (5, first.generation, false));
    assert_eq!(s.get(&key).await.unwrap().unwrap().value().as_ref(), b"12");
}

/// Set changes under a dedupe id: the same change again (members reordered, repeated) replays the first outcome;
/// another change (other members, or the same adds with a remove) is refused and changes nothing; a change that
/// altered nothing and one that emptied the set replay as well.
pub async fn set_dedupe_replays_and_refuses<S: Store>(s: &S) {
    let p = prefix("set_reuse");
    let key = format!("{p}tags");
    let first = s.set_change(&key, set_change(&["b", "a", "a"], &[], "s-1")).await.unwrap();
    assert_eq!((first.members, first.added, first.removed, first.applied), (2, 2, 0, true));
    let g1 = first.generation.expect("a set with members has a generation");
    let again = s.set_change(&key, set_change(&["a", "b"], &[], "s-1")).await.unwrap();
    assert_eq!(again, crate::SetOutcome { applied: false, ..first }, "a reordered retry is not a replay");
    assert_reused(s.set_change(&key, set_change(&["c"], &[], "s-1")).await, &key, "s-1");
    assert_reused(s.set_change(&key, set_change(&["a", "b"], &["x"], "s-1")).await, &key, "s-1");
    assert_reused(s.set_change(&key, set_change(&[], &["a", "b"], "s-1")).await, &key, "s-1");
    let v = s.get(&key).await.unwrap().unwrap();
    assert_eq!((v.value().as_ref(), v.generation()), (&br#"["a","b"]"#[..], g1), "a refused change wrote");
    // Without an id the same change is applied normally (nothing new: applied, nothing added).
    let plain = s.set_change(&key, SetChange { add: vec!["a".into()], ..SetChange::default() }).await.unwrap();
    assert_eq!((plain.generation, plain.added, plain.applied), (Some(g1), 0, true));
    // A change that alters nothing is remembered too.
    let noop = s.set_change(&key, set_change(&[], &["zz"], "s-2")).await.unwrap();
    assert_eq!((noop.generation, noop.members, noop.removed, noop.applied), (Some(g1), 2, 0, true));
    let grown = s.set_change(&key, set_change(&["c"], &[], "s-3")).await.unwrap();
    let g3 = grown.generation.unwrap();
    assert!(g3 > g1 && grown.members == 3);
    let noop_again = s.set_change(&key, set_change(&[], &["zz", "zz"], "s-2")).await.unwrap();
    assert_eq!(noop_again, crate::SetOutcome { applied: false, ..noop }, "a replay must answer the first outcome");
    // Emptying the set under an id: the replay answers "absent" again and re-deletes nothing.
    let gone = s.set_change(&key, set_change(&[], &["c", "b", "a"], "s-4")).await.unwrap();
    assert_eq!((gone.generation, gone.members, gone.removed, gone.applied), (None, 0, 3, true));
    s.set_change(&key, set_change(&["new"], &[], "s-5")).await.unwrap();
    let gone_again = s.set_change(&key, set_change(&[], &["a", "b", "c"], "s-4")).await.unwrap();
    assert_eq!(gone_again, crate::SetOutcome { applied: false, ..gone });
    assert_eq!(s.get(&key).await.unwrap().unwrap().value().as_ref(), br#"["new"]"#, "a replay changed the set");
    // The id is scoped to its key.
    let elsewhere = s.set_change(&format!("{p}other"), set_change(&["c"], &[], "s-1")).await.unwrap();
    assert!(elsewhere.applied && elsewhere.added == 1);
}

/// 2 tasks send the same dedupe id with different payloads at the same time, 60 rounds for counters (on one
/// shared key and on fresh keys) and 60 for sets (fresh keys, one side a change that alters nothing, so no
/// value row is written to serialise on): in every round exactly one applies and the other is refused, and
/// the stored value is the winner's alone.
pub async fn dedupe_reuse_under_contention<S: Store + Clone>(s: &S) {
    let p = prefix("reuse_race");
    let shared = format!("{p}shared");
    let (mut applied, mut refused, mut sum) = (0, 0, 0i64);
    let mut fresh_sum = 0i64;
    for round in 0..60 {
        let key = if round % 2 == 0 { shared.clone() } else { format!("{p}fresh{round}") };
        let id = format!("r-{round}");
        let tasks: Vec<_> = [1i64, 2]
            .into_iter()
            .map(|delta| {
                let (s, key, id) = (s.clone(), key.clone(), id.clone());
                tokio::spawn(async move { (delta, s.counter_add(&key, delta, Some(&id)).await) })
            })
            .collect();
        let mut winner = None;
        for t in tasks {
            match t.await.unwrap() {
                (delta, Ok(out)) => {
                    assert!(out.applied, "round {round}: a different payload was answered as a replay");
                    assert!(winner.replace(delta).is_none(), "round {round}: both payloads applied");
                    applied += 1;
                }
                (_, e) => {
                    assert_reused(e, &key, &id);
                    refused += 1;
                }
            }
        }
        let delta = winner.unwrap_or_else(|| panic!("round {round}: neither payload applied"));
        if key == shared {
            sum += delta;
        } else {
            fresh_sum += delta;
            let v = s.get(&key).await.unwrap().unwrap();
            assert_eq!(v.value().as_ref(), delta.to_string().as_bytes());
        }
    }
    assert_eq!((applied, refused), (60, 60));
    assert_eq!(s.get(&shared).await.unwrap().unwrap().value().as_ref(), sum.to_string().as_bytes());
    assert!((30..=60).contains(&fresh_sum));

    let (mut applied, mut refused) = (0, 0);
    for round in 0..60 {
        let key = format!("{p}set{round}");
        let id = format!("s-{round}");
        let changes = [set_change(&["x"], &[], &id), set_change(&[], &["y"], &id)];
        let tasks: Vec<_> = changes
            .into_iter()
            .enumerate()
            .map(|(i, change)| {
                let (s, key) = (s.clone(), key.clone());
                tokio::spawn(async move { (i, s.set_change(&key, change).await) })
            })
            .collect();
        let mut winner = None;
        for t in tasks {
            match t.await.unwrap() {
                (i, Ok(out)) => {
                    assert!(out.applied, "round {round}: a different change was answered as a replay");
                    assert!(winner.replace(i).is_none(), "round {round}: both changes applied");
                    applied += 1;
                }
                (_, e) => {
                    assert_reused(e, &key, &id);
                    refused += 1;
                }
            }
        }
        let now = s.get(&key).await.unwrap();
        match winner {
            Some(0) => assert_eq!(now.unwrap().value().as_ref(), br#"["x"]"#, "round {round}"),
            Some(_) => assert!(now.is_none(), "round {round}: the refused add was written"),
            None => panic!("round {round}: neither change applied"),
        }
    }
    assert_eq!((applied, refused), (60, 60));
}

/// Bad keys, values, TTLs and arguments are refused with typed errors and change nothing.
pub async fn limits_refuse_bad_input<S: Store>(s: &S) {
    let p = prefix("limits");
    let long = format!("{p}{}", "k".repeat(1025));
    for key in ["", long.as_str(), "nul\0key"] {
        assert!(matches!(s.put(key, "v".into(), Precondition::Any, Ttl::Keep).await, Err(Error::InvalidKey { .. })));
        assert!(matches!(s.get(key).await, Err(Error::InvalidKey { .. })));
        assert!(matches!(s.delete(key, Precondition::Any).await, Err(Error::InvalidKey { .. })));
        assert!(matches!(s.counter_add(key, 1, None).await, Err(Error::InvalidKey { .. })));
    }
    let exact = "k".repeat(1024);
    let w = s.put(&exact, "v".into(), Precondition::Any, Ttl::Keep).await.unwrap();
    s.delete(&exact, Precondition::Generation(w.generation())).await.unwrap();
    let k = format!("{p}k");
    let max = s.limits().max_value_bytes();
    let big = Bytes::from(vec![b'x'; max + 1]);
    assert!(matches!(
        s.put(&k, big, Precondition::Any, Ttl::Keep).await,
        Err(Error::ValueTooLarge { size, max: m }) if size == max + 1 && m == max
    ));
    for ttl in [Duration::from_millis(999), Duration::ZERO, crate::MAX_TTL + Duration::from_secs(1)] {
        assert!(matches!(
            s.put(&k, "v".into(), Precondition::Any, Ttl::After(ttl)).await,
            Err(Error::InvalidTtl { .. })
        ));
    }
    assert!(s.get(&k).await.unwrap().is_none(), "a refused write stored something");
    ok_put(s, &k, "v", Precondition::Any, Ttl::After(crate::MAX_TTL)).await;
    ok_put(s, &k, "v", Precondition::Any, Ttl::After(crate::MIN_TTL)).await;
    assert!(matches!(s.counter_add(&k, 1, Some("")).await, Err(Error::InvalidArgument { .. })));
    for id in ["", "nul\0id"] {
        let change = SetChange { add: vec!["m".into()], dedupe_id: Some(id.to_owned()), ..SetChange::default() };
        assert!(matches!(s.set_change(&k, change).await, Err(Error::InvalidArgument { what: "dedupe id" })));
    }
    let long = SetChange { add: vec!["m".into()], dedupe_id: Some("i".repeat(256)), ..SetChange::default() };
    assert!(matches!(s.set_change(&k, long).await, Err(Error::InvalidArgument { what: "dedupe id" })));
    assert!(matches!(s.list(&p, None, 0).await, Err(Error::InvalidArgument { .. })));
    assert!(matches!(s.list(&p, None, 1001).await, Err(Error::InvalidArgument { .. })));
}

#[derive(Debug, Clone)]
enum Op {
    Put { key: u8, value: u8, pre: Pre },
    Delete { key: u8, pre: Pre },
    Get { key: u8 },
    List { page: u8 },
}

#[derive(Debug, Clone, Copy)]
enum Pre {
    Any,
    Absent,
    Present,
    Current,
    Stale,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let pre = prop_oneof![Just(Pre::Any), Just(Pre::Absent), Just(Pre::Present), Just(Pre::Current), Just(Pre::Stale)];
    prop_oneof![
        4 => (0..5u8, any::<u8>(), pre.clone()).prop_map(|(key, value, pre)| Op::Put { key, value, pre }),
        2 => (0..5u8, pre).prop_map(|(key, pre)| Op::Delete { key, pre }),
        2 => (0..5u8).prop_map(|key| Op::Get { key }),
        1 => (1..4u8).prop_map(|page| Op::List { page }),
    ]
}

/// Random sequences of put/delete/get/list with every kind of precondition, checked against a `BTreeMap` model:
/// same successes and failures, same values, generations increasing, failures reporting the model's generation.
pub async fn matches_btreemap_model<S: Store>(s: &S) {
    let handle = tokio::runtime::Handle::current();
    let config = ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    // proptest drives a synchronous closure; block_in_place lets it wait on the async store from a runtime worker.
    let result = tokio::task::block_in_place(|| {
        runner.run(&proptest::collection::vec(op_strategy(), 1..40), |ops| {
            handle.block_on(run_model_case(s, ops));
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("store diverged from the model: {e}");
    }
}

async fn run_model_case<S: Store>(s: &S, ops: Vec<Op>) {
    let p = prefix("model");
    let mut model: BTreeMap<String, (u8, Generation)> = BTreeMap::new();
    let mut last = Generation::new(0);
    let mut stale = Generation::new(0);
    for op in ops {
        match op {
            Op::Put { key, value, pre } => {
                let k = format!("{p}{key}");
                let cur = model.get(&k).map(|(_, g)| *g);
                let precondition = to_pre(pre, cur, stale);
                let r = s.put(&k, Bytes::from(vec![value]), precondition, Ttl::Keep).await;
                match (precondition.check(cur), r) {
                    (Ok(()), Ok(w)) => {
                        assert!(w.generation() > last, "generation did not increase");
                        assert_eq!(w.created(), cur.is_none());
                        if let Some(c) = cur {
                            stale = c;
                        }
                        last = w.generation();
                        model.insert(k, (value, last));
                    }
                    (Err(_), Err(e)) => assert_eq!(gen_of(e), cur),
                    (want, got) => panic!("put {k} with {precondition:?}: model {want:?}, store {got:?}"),
                }
            }
            Op::Delete { key, pre } => {
                let k = format!("{p}{key}");
                let cur = model.get(&k).map(|(_, g)| *g);
                let precondition = to_pre(pre, cur, stale);
                let r = s.delete(&k, precondition).await;
                match (precondition.check(cur), r) {
                    (Ok(()), Ok(deleted)) => {
                        assert_eq!(deleted, cur);
                        if let Some(c) = cur {
                            stale = c;
                        }
                        model.remove(&k);
                    }
                    (Err(_), Err(e)) => assert_eq!(gen_of(e), cur),
                    (want, got) => panic!("delete {k} with {precondition:?}: model {want:?}, store {got:?}"),
                }
            }
            Op::Get { key } => {
                let k = format!("{p}{key}");
                let got = s.get(&k).await.unwrap().map(|v| (v.value()[0], v.generation()));
                assert_eq!(got, model.get(&k).copied(), "get {k}");
            }
            Op::List { page } => {
                let mut keys = Vec::new();
                let mut cursor = None;
                loop {
                    let pg = s.list(&p, cursor.as_deref(), usize::from(page)).await.unwrap();
                    keys.extend(pg.items.into_iter().map(|i| (i.key, i.generation)));
                    match pg.next_cursor {
                        Some(c) => cursor = Some(c),
                        None => break,
                    }
                }
                let want: Vec<(String, Generation)> = model.iter().map(|(k, (_, g))| (k.clone(), *g)).collect();
                assert_eq!(keys, want, "list");
            }
        }
    }
}

fn to_pre(pre: Pre, cur: Option<Generation>, stale: Generation) -> Precondition {
    match pre {
        Pre::Any => Precondition::Any,
        Pre::Absent => Precondition::Absent,
        Pre::Present => Precondition::Present,
        Pre::Current => Precondition::Generation(cur.unwrap_or(stale)),
        Pre::Stale => Precondition::Generation(stale),
    }
}
