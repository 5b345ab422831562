//! Kill -9 the server at a random moment while clients write; every acknowledged write must survive and the
//! generation sequence must not go backwards.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{Server, client};
use rand::Rng;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_writes_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    // key -> (value, generation) for every write the server acknowledged with 2xx.
    let acked: Arc<Mutex<HashMap<String, (String, u64)>>> = Arc::default();
    // key -> the value of the write in flight when the server died, which may have committed unacknowledged.
    let in_flight: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let mut highest_acked = 0u64;
    for round in 0..3 {
        let server = Server::sqlite(&db);
        let url = server.url.clone();
        // The server restarted on the same file: generations continue above everything acknowledged before.
        let probe = client().put(format!("{url}/v1/kv/probe-{round}")).body("p").send().await.unwrap();
        let g: u64 = probe.headers()["etag"].to_str().unwrap().trim_matches('"').parse().unwrap();
        assert!(g > highest_acked, "generation went backwards after restart: {g} <= {highest_acked}");
        let mut tasks = Vec::new();
        for t in 0..16 {
            let (url, acked, in_flight) = (url.clone(), acked.clone(), in_flight.clone());
            tasks.push(tokio::spawn(async move {
                let http = client();
                let mut last_gen: Option<u64> = None;
                for i in 0.. {
                    // Half the writers create fresh keys, half keep compare-and-swapping one key of their own.
                    let (key, req) = if t % 2 == 0 {
                        let key = format!("r{round}/t{t}/{i}");
                        let req = http.put(format!("{url}/v1/kv/r{round}%2Ft{t}%2F{i}")).header("if-none-match", "*");
                        (key, req)
                    } else {
                        let key = format!("cas/t{t}");
                        let mut req = http.put(format!("{url}/v1/kv/cas%2Ft{t}"));
                        req = match last_gen {
                            Some(g) => req.header("if-match", format!("\"{g}\"")),
                            None => req,
                        };
                        (key, req)
                    };
                    let value = format!("{round}-{t}-{i}");
                    in_flight.lock().unwrap().insert(key.clone(), value.clone());
                    let Ok(resp) = req.body(value.clone()).send().await else { return };
                    if !resp.status().is_success() {
                        panic!("write refused before the kill: {}", resp.status());
                    }
                    let g: u64 = resp.headers()["etag"].to_str().unwrap().trim_matches('"').parse().unwrap();
                    last_gen = Some(g);
                    acked.lock().unwrap().insert(key, (value, g));
                }
            }));
        }
        let wait = rand::rng().random_range(300..1500);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        server.kill9();
        for t in tasks {
            t.await.unwrap();
        }
        highest_acked = acked.lock().unwrap().values().map(|(_, g)| *g).max().unwrap_or(0);
        assert!(acked.lock().unwrap().len() > 16, "round {round}: too few writes before the kill to prove anything");
    }
    // Reopen and check every acknowledged write, exactly.
    let server = Server::sqlite(&db);
    let http = client();
    let acked = acked.lock().unwrap().clone();
    let mut present = 0;
    for (key, (value, g)) in &acked {
        let enc: String = key.replace('/', "%2F");
        let resp = http.get(format!("{}/v1/kv/{enc}", server.url)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "acknowledged write {key} lost");
        let got_g: u64 = resp.headers()["etag"].to_str().unwrap().trim_matches('"').parse().unwrap();
        let got = resp.text().await.unwrap();
        // Either the acknowledged write, or the one write sent after it that committed before the kill
        // landed but whose answer never reached the client. Never anything older.
        let later = in_flight.lock().unwrap().get(key).cloned();
        let ok = (got_g == *g && got == *value) || (got_g > *g && Some(&got) == later.as_ref());
        assert!(ok, "{key}: acknowledged {value:?} at {g}, found {got:?} at {got_g}");
        present += 1;
    }
    assert_eq!(present, acked.len());
    let probe = http.put(format!("{}/v1/kv/final", server.url)).body("p").send().await.unwrap();
    let g: u64 = probe.headers()["etag"].to_str().unwrap().trim_matches('"').parse().unwrap();
    assert!(g > highest_acked);
    eprintln!("{} acknowledged writes over 3 kill -9 rounds: {} present, 0 lost", acked.len(), present);
}
