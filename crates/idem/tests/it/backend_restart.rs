//! The database goes away under load: requests that need it get a clear 503 problem+json, and the server
//! recovers by itself once the database is back. Restarts the machine's real PostgreSQL and Redis, so it runs
//! only when `IDEM_TEST_RESTART_SERVICES=1` (as `.ci/run` sets) besides the URL variables.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::{Server, client};

fn sh(cmd: &str) -> bool {
    Command::new("sh").arg("-c").arg(cmd).status().map(|s| s.success()).unwrap_or(false)
}

const PG_CTL: &str = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main";
const REDIS_START: &str =
    "redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save '' --appendonly no >/dev/null";

/// Starts the service again whatever happens to the test, so later tests find it running.
struct Restart(&'static str);

impl Drop for Restart {
    fn drop(&mut self) {
        sh(self.0);
    }
}

#[derive(Default, Debug)]
struct Tally {
    ok: u64,
    unavailable: u64,
    other: Vec<String>,
}

/// Writes in a loop from 8 tasks until told to stop, classifying every answer.
async fn load(url: String, stop: Arc<AtomicBool>) -> Tally {
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (url, stop) = (url.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let http = client();
            let mut tally = Tally::default();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = http.put(format!("{url}/v1/kv/restart%2F{t}%2F{i}")).body("v").send().await;
                match r {
                    Ok(r) if r.status().is_success() => tally.ok += 1,
                    Ok(r) if r.status() == 503 => {
                        let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
                        let body: serde_json::Value = r.json().await.unwrap();
                        assert_eq!(ct, "application/problem+json");
                        assert_eq!(body["type"], "urn:idem:problem:store-unavailable");
                        tally.unavailable += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Ok(r) => tally.other.push(format!("{} {}", r.status(), r.text().await.unwrap_or_default())),
                    Err(e) => tally.other.push(format!("request error: {e}")),
                }
            }
            tally
        }));
    }
    let mut all = Tally::default();
    for t in tasks {
        let t = t.await.unwrap();
        all.ok += t.ok;
        all.unavailable += t.unavailable;
        all.other.extend(t.other);
    }
    all
}

/// Returns the namespace it used, for the caller to clean up.
async fn outage_under_load(store_url: &str, stop_cmd: &str, start_cmd: &'static str) -> String {
    let ns = format!("idem_test_{:012x}", rand::random::<u64>() >> 16);
    let server = Server::start(&["--store", store_url, "--namespace", &ns], &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let loader = tokio::spawn(load(server.url.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    {
        let _restart = Restart(start_cmd);
        assert!(sh(stop_cmd), "could not stop the database with: {stop_cmd}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    // Back up: writes must succeed again without restarting idem.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = client().put(format!("{}/v1/kv/restart%2Fprobe", server.url)).body("v").send().await.unwrap();
        if r.status().is_success() {
            break;
        }
        assert!(Instant::now() < deadline, "idem did not recover after the database came back: {}", r.status());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let tally = loader.await.unwrap();
    eprintln!(
        "{store_url}: {} writes ok, {} answered 503 during the outage, other: {:?}",
        tally.ok, tally.unavailable, tally.other
    );
    assert!(tally.unavailable > 0, "no request noticed the outage: the test proved nothing");
    assert!(tally.other.is_empty(), "answers other than 2xx/503: {:?}", tally.other);
    assert!(tally.ok > 0);
    ns
}

fn enabled(var: &str) -> Option<String> {
    let url = std::env::var(var).ok();
    let restart = std::env::var("IDEM_TEST_RESTART_SERVICES").is_ok_and(|v| v == "1");
    match (url, restart) {
        (Some(u), true) => Some(u),
        _ => {
            eprintln!("skipped: needs {var} and IDEM_TEST_RESTART_SERVICES=1 (this test restarts the server)");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_outage_gives_503_then_recovers() {
    let Some(url) = enabled("IDEM_TEST_POSTGRES_URL") else { return };
    let stop = format!("{PG_CTL} stop -m fast");
    let ns = outage_under_load(&url, &stop, "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start")
        .await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client.batch_execute(&format!("DROP SCHEMA IF EXISTS {ns} CASCADE")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_gives_503_then_recovers() {
    let Some(url) = enabled("IDEM_TEST_REDIS_URL") else { return };
    // Redis here keeps nothing on disk, so the restart also empties it: this test checks availability only.
    outage_under_load(&url, "redis-cli -h 127.0.0.1 -p 6379 shutdown nosave", REDIS_START).await;
}
