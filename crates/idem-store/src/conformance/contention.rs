//! Real concurrency on one key: read-modify-write, raw compare-and-swap, counters and sets, counted exactly.

#![allow(clippy::unwrap_used)]

use super::*;

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
    // A counter is its canonical decimal form only, on every backend (Redis's HINCRBY takes nothing else).
    for odd in [" 12 ", "12\n", "+12", "012", "-0", "1e3"] {
        ok_put(s, &wrong, odd, Precondition::Any, Ttl::Keep).await;
        let e = s.counter_add(&wrong, 1, None).await;
        assert!(matches!(e, Err(Error::WrongType { .. })), "{odd:?} taken as a counter: {e:?}");
        assert_eq!(s.get(&wrong).await.unwrap().unwrap().value().as_ref(), odd.as_bytes(), "{odd:?} changed");
    }
    ok_put(s, &wrong, "-12", Precondition::Any, Ttl::Keep).await;
    assert_eq!(s.counter_add(&wrong, 1, None).await.unwrap().value, -11);
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
    let members = crate::backend::decode_set(s.get(&key).await.unwrap().unwrap().value()).unwrap();
    assert_eq!(members.len(), 400);
    let again = s.set_change(&key, SetChange { add: vec!["0-0".into()], ..SetChange::default() }).await.unwrap();
    assert_eq!((again.added, again.members), (0, 400));
    let all: Vec<String> = members.into_iter().collect();
    let gone = s.set_change(&key, SetChange { remove: all, ..SetChange::default() }).await.unwrap();
    assert_eq!((gone.removed, gone.members, gone.generation), (400, 0, None));
    assert!(s.get(&key).await.unwrap().is_none(), "an emptied set was not deleted");
    // A member both added and removed in one change: the adds apply first, then the removes.
    let both = SetChange { add: vec!["x".into(), "y".into()], remove: vec!["x".into()], ..SetChange::default() };
    let out = s.set_change(&key, both).await.unwrap();
    assert_eq!((out.added, out.removed, out.members), (2, 1, 1));
    assert_eq!(s.get(&key).await.unwrap().unwrap().value().as_ref(), b"[\"y\"]");
    let wrong = format!("{p}text");
    ok_put(s, &wrong, "{}", Precondition::Absent, Ttl::Keep).await;
    let e = s.set_change(&wrong, SetChange { add: vec!["a".into()], ..SetChange::default() }).await;
    assert!(matches!(e, Err(Error::WrongType { .. })));
    // A set is a JSON array from its first byte on every backend (Redis's script looks at that byte).
    for odd in [" [\"a\"]", "\n[]", "[1]", "[\"a\",null]", "\"a\""] {
        ok_put(s, &wrong, odd, Precondition::Any, Ttl::Keep).await;
        let e = s.set_change(&wrong, SetChange { add: vec!["b".into()], ..SetChange::default() }).await;
        assert!(matches!(e, Err(Error::WrongType { .. })), "{odd:?} taken as a set: {e:?}");
        assert_eq!(s.get(&wrong).await.unwrap().unwrap().value().as_ref(), odd.as_bytes(), "{odd:?} changed");
    }
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
