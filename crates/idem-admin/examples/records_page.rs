//! How long one page of the records list takes over a SQLite store holding many records (BENCHMARKS.md):
//! fills a fresh store in a temporary directory, then times the pages the records page asks for.
//!
//! `cargo run --release -p idem-admin --example records_page -- 1000000`

use std::time::{Duration, Instant};

use idem_admin::records::{self, Filter, State};
use idem_core::record::{Outcome, Record, StoredResponse};
use idem_core::{Fingerprint, Scope};
use idem_store::{Precondition, Store, Ttl};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(1_000_000);
    let dir = tempfile::tempdir()?;
    let store = idem_sqlite::SqliteStore::open(dir.path().join("idem.db"), idem_store::Limits::default())?;
    let fingerprint = Fingerprint::from_hex(&"ab".repeat(32))?;
    let scope = Scope::from_credential(Some(b"Bearer a-customer"));
    let now_ms = idem_store::system_time_to_millis(std::time::SystemTime::now());
    let started = Instant::now();
    // One record in a thousand has an unknown outcome: the rare state an operator filters for.
    let tasks: Vec<_> = (0..64)
        .map(|t| {
            let store = store.clone();
            let (fingerprint, scope) = (fingerprint, scope.clone());
            tokio::spawn(async move {
                for i in (t..n).step_by(64) {
                    let outcome = if i % 1000 == 7 {
                        Outcome::Unknown { reason: "upstream reset the connection".into() }
                    } else {
                        let headers = vec![("content-type".into(), "application/json".into())];
                        Outcome::Response(StoredResponse {
                            status: 201,
                            headers,
                            body: format!("{{\"order\":{i}}}").into(),
                        })
                    };
                    let record = Record::Finished { fingerprint, outcome, finished_at_ms: now_ms };
                    let key = format!("idempotency/{scope}/order-{i:07}");
                    store
                        .put(&key, record.encode(), Precondition::Any, Ttl::After(Duration::from_secs(86_400)))
                        .await?;
                }
                Ok::<_, idem_store::Error>(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    println!("filled {n} records in {:.1} s", started.elapsed().as_secs_f64());
    let prefix = "idempotency/";
    let cases: Vec<(&str, Filter)> = vec![
        ("no filter", Filter::default()),
        (
            "scope + key prefix order-05",
            Filter { scope: Some(scope.to_string()), key_prefix: "order-05".into(), ..Filter::default() },
        ),
        ("state completed", Filter { state: Some(State::Completed), ..Filter::default() }),
        ("state unknown (1 in 1000)", Filter { state: Some(State::Unknown), ..Filter::default() }),
    ];
    for (name, filter) in cases {
        let mut times = Vec::new();
        let mut shown = 0;
        let mut scanned = 0;
        for _ in 0..21 {
            let t = Instant::now();
            let page = records::list(&store, prefix, &filter, None, 50, now_ms).await?;
            times.push(t.elapsed());
            (shown, scanned) = (page.rows.len(), page.scanned);
        }
        times.sort();
        println!(
            "{name:<30} page of {shown:>2} ({scanned:>4} keys read): median {:.1} ms, max {:.1} ms",
            times[10].as_secs_f64() * 1000.0,
            times[20].as_secs_f64() * 1000.0
        );
    }
    // A page deep in the list: the cursor of the 900,000th key, not an offset.
    let cursor = idem_admin::scan::encode_cursor(&format!("idempotency/{scope}/order-{:07}", n * 9 / 10));
    let t = Instant::now();
    let page = records::list(&store, prefix, &Filter::default(), Some(&cursor), 50, now_ms).await?;
    println!(
        "page after the {}th record: {} rows in {:.1} ms",
        n * 9 / 10,
        page.rows.len(),
        t.elapsed().as_secs_f64() * 1000.0
    );
    store.close().await;
    Ok(())
}
