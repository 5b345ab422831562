//! Random operation sequences checked against a `BTreeMap` model of the store.

#![allow(clippy::unwrap_used)]

use super::*;

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
