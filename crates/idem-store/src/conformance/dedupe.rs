//! Dedupe ids of counter adds and set changes (first outcome replayed, another payload refused), and the
//! input limits every backend enforces before touching storage.

#![allow(clippy::unwrap_used)]

use super::*;

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
