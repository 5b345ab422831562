//! Single-key semantics: preconditions, expiry, generations, TTL changes, listing.

#![allow(clippy::unwrap_used)]

use super::*;

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

/// [`Store::now`] is the clock the store judges expiry by: a TTL counts from it (the expiry a write reports
/// lies between the clock read before and after the write, plus the TTL), a value reads absent once that
/// clock has passed its expiry, and the clock does not go back between two reads.
pub async fn clock_judges_expiry<S: Store>(s: &S) {
    let p = prefix("clock");
    let k = format!("{p}k");
    // Expiry instants are kept to the millisecond (Redis, SQLite, memory): allow that rounding either way.
    let ms = Duration::from_millis(1);
    let before = s.now().await.unwrap();
    ok_put(s, &k, "v", Precondition::Absent, Ttl::After(Duration::from_secs(1))).await;
    let after = s.now().await.unwrap();
    assert!(after + ms >= before, "the store's clock went back: {before:?} then {after:?}");
    let expires = s.get(&k).await.unwrap().unwrap().expires_at().expect("an expiry");
    let ttl = Duration::from_secs(1);
    assert!(
        expires + ms >= before + ttl && expires <= after + ttl + ms,
        "expiry {expires:?} is not the store's clock ({before:?}..{after:?}) plus 1 s"
    );
    // Once the store's clock has passed the expiry, the value is gone for every reader.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = s.now().await.unwrap();
        if now > expires + ms {
            assert!(s.get(&k).await.unwrap().is_none(), "the store's clock ({now:?}) is past the expiry {expires:?}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the store's clock did not reach the expiry within 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
