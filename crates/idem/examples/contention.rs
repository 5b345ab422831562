//! 64 HTTP clients each append 100 unique items to ONE key of a running `idem serve`.
//!
//! With conditional PUTs (`If-Match` on the generation read, `If-None-Match: *` to create; re-read and retry on
//! 412 with jittered backoff) every item survives: exactly clients x items. With plain unconditional PUTs, the
//! same read-modify-write loses updates. Both counts are printed; the exit status is 1 if the conditional run
//! lost anything.
//!
//! `--url` takes a comma-separated list; clients are spread over the servers round-robin (several `idem serve`
//! processes sharing one PostgreSQL or Redis state).
//!
//! ```text
//! cargo run --release -p idem -- serve &
//! cargo run --release -p idem --example contention -- --url http://127.0.0.1:8080
//! ```

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use idem_store::RetryPolicy;
use reqwest::{StatusCode, header};

/// What to run: servers, clients, items per client.
pub struct Args {
    /// Base URLs of the servers; clients use them round-robin.
    pub urls: Vec<String>,
    /// Concurrent clients.
    pub clients: usize,
    /// Items each client appends.
    pub items: usize,
}

fn parse_args() -> Args {
    let mut a = Args { urls: vec!["http://127.0.0.1:8080".into()], clients: 64, items: 100 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => a.urls = val.split(',').map(|u| u.trim_end_matches('/').to_owned()).collect(),
            "--clients" => a.clients = val.parse().expect("--clients N"),
            "--items" => a.items = val.parse().expect("--items N"),
            other => panic!("unknown flag {other}; use --url, --clients, --items"),
        }
    }
    a
}

/// Appends `item` to the JSON list under `path`; returns how many attempts lost a race.
async fn append(http: &reqwest::Client, path: &str, item: String, conditional: bool) -> u64 {
    // Far more attempts than the library default: 64 clients on one key lose most races by design.
    let policy = RetryPolicy::default().with_max_attempts(10_000);
    for attempt in 1..=policy.max_attempts() {
        tokio::time::sleep(policy.backoff(attempt)).await;
        let resp = http.get(path).send().await.expect("GET");
        let (mut list, etag): (Vec<String>, Option<String>) = match resp.status() {
            StatusCode::NOT_FOUND => (Vec::new(), None),
            StatusCode::OK => {
                let etag = resp.headers()[header::ETAG].to_str().expect("etag").to_owned();
                (resp.json().await.expect("JSON list"), Some(etag))
            }
            s => panic!("GET answered {s}"),
        };
        list.push(item.clone());
        let mut put = http.put(path).json(&list);
        if conditional {
            put = match &etag {
                Some(e) => put.header(header::IF_MATCH, e),
                None => put.header(header::IF_NONE_MATCH, "*"),
            };
        }
        let status = put.send().await.expect("PUT").status();
        match status {
            StatusCode::OK | StatusCode::CREATED => return u64::from(attempt - 1),
            StatusCode::PRECONDITION_FAILED => continue,
            s => panic!("PUT answered {s}"),
        }
    }
    panic!("gave up on {item}")
}

/// Runs one pass; returns (distinct items present, retries after 412, seconds).
pub async fn run(args: &Args, conditional: bool) -> (usize, u64, f64) {
    let http = idem_client::client_builder().build().expect("HTTP client");
    let key = format!("contention-{}-{:x}", if conditional { "cas" } else { "plain" }, rand::random::<u32>());
    let paths: Vec<Arc<String>> = args.urls.iter().map(|u| Arc::new(format!("{u}/v1/kv/{key}"))).collect();
    let retries = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let path = paths[c % paths.len()].clone();
        let (http, retries, items) = (http.clone(), retries.clone(), args.items);
        tasks.push(tokio::spawn(async move {
            for i in 0..items {
                let lost = append(&http, &path, format!("c{c}-i{i}"), conditional).await;
                retries.fetch_add(lost, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let secs = started.elapsed().as_secs_f64();
    let list: Vec<String> = http.get(paths[0].as_str()).send().await.expect("GET").json().await.expect("list");
    let distinct: HashSet<&String> = list.iter().collect();
    assert_eq!(distinct.len(), list.len(), "duplicate items in the list");
    (distinct.len(), retries.load(Ordering::Relaxed), secs)
}

/// Runs both passes and prints the counts.
#[tokio::main]
pub async fn main() {
    let args = parse_args();
    let want = args.clients * args.items;
    println!("{} clients x {} items appended to one key via {}", args.clients, args.items, args.urls.join(", "));
    let (cas, retries, secs) = run(&args, true).await;
    println!(
        "conditional PUTs (If-Match, retry on 412): {cas} of {want} items present, {} lost, {retries} retries after 412, {secs:.1} s",
        want - cas
    );
    let (plain, _, secs) = run(&args, false).await;
    println!(
        "unconditional PUTs (last write wins):       {plain} of {want} items present, {} lost, {secs:.1} s",
        want - plain
    );
    if cas != want {
        eprintln!("FAILED: conditional PUTs lost {} updates", want - cas);
        std::process::exit(1);
    }
}
