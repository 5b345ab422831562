//! The records list and the resolve action on every backend a server can use: SQLite, PostgreSQL and Redis
//! (the machine's servers, each run in a schema or key prefix of its own; skipped without their URLs unless
//! `IDEM_TEST_REQUIRE_BACKENDS` is set) and memory. The pages page through `Store::list` and `get_many`
//! (`idem_admin::scan`) and filter record by record, so each backend must answer a cursor-paged walk with every
//! record once, in key order, whatever the filter; and `resolve` must keep a record's expiry (`Ttl::Keep`)
//! where the backend stores it.

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use idem_admin::records::{self, Filter, State};
use idem_backends::{AnyStore, StoreUrl};
use idem_core::record::{Outcome, Record, StoredResponse};
use idem_core::{Fingerprint, Scope};
use idem_store::{Limits, Precondition, Store, Ttl};

const PREFIX: &str = "idempotency/";

/// The stores to check: (name, URL), each with a namespace of its own.
fn backends(dir: &std::path::Path) -> Vec<(&'static str, String)> {
    let mut out =
        vec![("memory", "memory:".to_owned()), ("sqlite", format!("sqlite:{}", dir.join("idem.db").display()))];
    for (name, var) in [("postgres", "IDEM_TEST_POSTGRES_URL"), ("redis", "IDEM_TEST_REDIS_URL")] {
        match std::env::var(var) {
            Ok(url) => out.push((name, url)),
            Err(_) => {
                assert!(std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(), "{var} is unset");
                eprintln!("skipped {name}: {var} is unset");
            }
        }
    }
    out
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_hex(&"ab".repeat(32)).unwrap()
}

fn finished(outcome: Outcome) -> Bytes {
    Record::Finished { fingerprint: fingerprint(), outcome, finished_at_ms: 1_000 }.encode()
}

/// 130 completed records `k-000`…`k-129`, 7 unknown outcomes `u-0`…`u-6` and 3 in flight `f-0`…`f-2` of no
/// route, and 20 completed deliveries `d-00`…`d-19` of route `hooks`: 160 in all.
async fn seed(store: &AnyStore) -> BTreeSet<String> {
    let response = StoredResponse { status: 201, headers: vec![], body: Bytes::from_static(b"{}") };
    let route_scope = Scope::from_credential(Some(b"route")).as_str().to_owned();
    let mut written = BTreeSet::new();
    let mut put = |key: String, value: Bytes| {
        written.insert(key.clone());
        (key, value)
    };
    let mut writes = Vec::new();
    for i in 0..130 {
        writes.push(put(format!("{PREFIX}anonymous/k-{i:03}"), finished(Outcome::Response(response.clone()))));
    }
    for i in 0..7 {
        writes.push(put(format!("{PREFIX}anonymous/u-{i}"), finished(Outcome::Unknown { reason: "reset".into() })));
    }
    for i in 0..3 {
        let record = Record::InProgress {
            fingerprint: fingerprint(),
            owner: format!("o-{i}"),
            started_at_ms: 1_000,
            lease_ms: 10_000,
        };
        writes.push(put(format!("{PREFIX}anonymous/f-{i}"), record.encode()));
    }
    for i in 0..20 {
        writes.push(put(
            format!("{PREFIX}route/hooks/{route_scope}/d-{i:02}"),
            finished(Outcome::Response(response.clone())),
        ));
    }
    for (key, value) in writes {
        store.put(&key, value, Precondition::Absent, Ttl::After(Duration::from_secs(3600))).await.unwrap();
    }
    written
}

/// Every page of the list under `filter`, 50 at a time: the store keys in the order listed.
async fn walk(store: &AnyStore, filter: &Filter) -> Vec<String> {
    let now_ms = idem_store::system_time_to_millis(store.now().await.unwrap());
    let (mut keys, mut cursor) = (Vec::new(), None::<String>);
    for _ in 0..100 {
        let page = records::list(store, PREFIX, filter, cursor.as_deref(), 50, now_ms).await.unwrap();
        assert!(page.rows.len() <= 50);
        keys.extend(page.rows.into_iter().map(|r| r.at.store_key));
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return keys,
        }
    }
    panic!("more than 100 pages");
}

fn count(keys: &[String], part: &str) -> usize {
    keys.iter().filter(|k| k.contains(part)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_page_and_filter_alike_and_resolve_keeps_the_expiry_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    for (name, url) in backends(dir.path()) {
        let namespace = format!("idem_admin_{:012x}", rand::random::<u64>() >> 16);
        let store = AnyStore::open(&StoreUrl::parse(&url).unwrap(), &namespace, Limits::default()).await.unwrap();
        let written = seed(&store).await;

        // All 160, each once, in key order.
        let all = walk(&store, &Filter::default()).await;
        assert_eq!(all.len(), 160, "{name}: 160 written, {} listed", all.len());
        assert_eq!(all.iter().cloned().collect::<BTreeSet<_>>(), written, "{name}: 0 lost, 0 duplicated");
        assert!(all.windows(2).all(|w| w[0] < w[1]), "{name}: in key order");

        let unknown = walk(&store, &Filter { state: Some(State::Unknown), ..Filter::default() }).await;
        assert_eq!((unknown.len(), count(&unknown, "/u-")), (7, 7), "{name}");
        let in_flight = walk(&store, &Filter { state: Some(State::InFlight), ..Filter::default() }).await;
        assert_eq!(in_flight.len(), 3, "{name}");
        let unrouted = walk(&store, &Filter { route: Some(String::new()), ..Filter::default() }).await;
        assert_eq!((unrouted.len(), count(&unrouted, "/route/")), (140, 0), "{name}");
        let hooks = walk(&store, &Filter { route: Some("hooks".into()), ..Filter::default() }).await;
        assert_eq!((hooks.len(), count(&hooks, "/route/hooks/")), (20, 20), "{name}");
        let prefixed = Filter { scope: Some("anonymous".into()), key_prefix: "k-1".into(), ..Filter::default() };
        assert_eq!(walk(&store, &prefixed).await.len(), 30, "{name}: k-100…k-129");

        // Resolve one unknown outcome: its state changes, its expiry stays, and it is resolved once.
        let key = format!("{PREFIX}anonymous/u-3");
        let before = store.get(&key).await.unwrap().unwrap();
        records::resolve(&store, PREFIX, &key, Some(before.generation().get()), "seen upstream", "test").await.unwrap();
        let after = store.get(&key).await.unwrap().unwrap();
        assert_eq!(after.expires_at().is_some(), before.expires_at().is_some(), "{name}");
        if let (Some(a), Some(b)) = (after.expires_at(), before.expires_at()) {
            let drift = a.duration_since(b).unwrap_or_else(|e| e.duration());
            assert!(drift < Duration::from_secs(2), "{name}: the expiry moved by {drift:?}");
        }
        let detail = records::detail(&store, PREFIX, &key, false).await.unwrap();
        assert_eq!(
            (detail.state, detail.resolved.unwrap().note),
            (State::Resolved, "seen upstream".to_owned()),
            "{name}"
        );
        let again = records::resolve(&store, PREFIX, &key, None, "again", "test").await;
        assert!(matches!(again, Err(idem_admin::Error::Conflict(_))), "{name}: {again:?}");
        let stale = records::resolve(&store, PREFIX, &format!("{PREFIX}anonymous/u-4"), Some(1), "x", "test").await;
        assert!(
            matches!(stale, Err(idem_admin::Error::Conflict(_))),
            "{name}: a generation not the record's: {stale:?}"
        );
        let resolved = walk(&store, &Filter { state: Some(State::Resolved), ..Filter::default() }).await;
        assert_eq!(resolved, std::slice::from_ref(&key), "{name}");

        for key in &written {
            store.delete(key, Precondition::Any).await.unwrap();
        }
        assert!(walk(&store, &Filter::default()).await.is_empty(), "{name}: cleaned up");
        store.close().await;
        if name == "postgres" {
            let (pg, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            pg.batch_execute(&format!("DROP SCHEMA IF EXISTS {namespace} CASCADE")).await.unwrap();
        }
    }
}
