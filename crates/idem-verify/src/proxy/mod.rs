//! The proxy workload: clients POST orders with `Idempotency-Key`s drawn from a small pool through
//! `idem serve --upstream` (one proxy on SQLite, two sharing the store on PostgreSQL and Redis) to an upstream
//! that logs every execution durably, retrying on timeouts, 409 and 5xx as a real client would, while the
//! nemesis injects faults; then [`check`] holds every answer against the execution log.

pub mod check;
pub mod upstream;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::backend::StoreEnv;
use crate::faultproxy::{FaultProxy, local};
use crate::faults::{self, Kind, Targets};
use crate::history::{Clock, Micros};
use crate::procs::Serve;
use crate::{Backend, Error, Options, Summary};

/// The lease the proxies hold a key under while its request runs; the pauses last longer.
pub const LEASE: Duration = Duration::from_secs(1);
/// The lease on a highly available backend: longer than a failover takes (up to about 10 s with the old Redis
/// master's restart and sync), so a holder keeps its key through the switch and an execution repeated across
/// it can only be a claim or an outcome the failover lost, which is what those runs measure. (A store outage
/// longer than the lease can cost a holder its key by design; the ordinary backends' runs test that.)
pub const HA_LEASE: Duration = Duration::from_secs(15);

/// The lease of a run on `backend`.
pub fn lease(backend: Backend) -> Duration {
    if backend.is_ha() { HA_LEASE } else { LEASE }
}
/// Every this long the clients move on to a fresh pool of keys (`o{round}-{i}`), so executions keep happening.
const ROUND: Duration = Duration::from_secs(4);
/// Keys in a pool.
const POOL: u64 = 3;

/// One attempt of a client.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Attempt {
    /// Its id in the history.
    pub id: u64,
    /// The client (`u32::MAX`: the final pass after every fault healed).
    pub client: u32,
    /// The idempotency key.
    pub key: String,
    /// Which proxy it went to.
    pub proxy: usize,
    /// When it was sent.
    pub invoke_us: Micros,
    /// When the answer came; `None` when none did.
    pub complete_us: Option<Micros>,
    /// The status.
    pub status: Option<u16>,
    /// `Idempotent-Replayed: true`.
    pub replayed: bool,
    /// The execution the body names (2xx only).
    pub exec: Option<u64>,
    /// The problem type of an error answer, or what went wrong without one.
    pub problem: Option<String>,
    /// A probe: the key sent once more with another body after it was answered 2xx. It must be refused
    /// (422 `idempotency-key-reused`, draft §2.7), never executed nor answered from the record.
    #[serde(default)]
    pub reused: bool,
}

struct Shared {
    proxies: Vec<String>,
    clock: Clock,
    attempts: Mutex<Vec<Attempt>>,
    next_id: AtomicU64,
}

/// Runs the proxy workload on `opts.backend` and checks it.
///
/// # Errors
/// When the store, the upstream or a proxy cannot be started.
pub async fn run(opts: &Options) -> Result<Summary, Error> {
    let clock = Clock::new();
    let store = StoreEnv::start(opts.backend, opts.faults, opts.durable, opts.lax).await?;
    let up = upstream::start(clock.clone(), &opts.out.join("upstream.jsonl")).await?;
    let link = Arc::new(FaultProxy::start(up.addr).await.map_err(|e| Error::io("upstream proxy", e))?);
    let count = if opts.backend == Backend::Sqlite { 1 } else { 2 };
    let mut serves = Vec::new();
    for i in 0..count {
        let args: Vec<String> = [
            "--upstream",
            &format!("http://{}", local(link.port)),
            "--store",
            &store.url("proxy"),
            "--lease",
            &format!("{}s", lease(opts.backend).as_secs()),
            "--upstream-timeout",
            "10s",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let log = opts.out.join(format!("idem-proxy-{i}.log"));
        serves.push(Serve::start(&opts.idem, &args, &crate::idem_env(opts), &log).await?);
    }
    let shared = Arc::new(Shared {
        proxies: serves.iter().map(|s| s.url.clone()).collect(),
        clock: clock.clone(),
        attempts: Mutex::default(),
        next_id: AtomicU64::new(1),
    });
    let tmpfs = store.tmpfs;
    let serves: Vec<_> = serves.into_iter().map(|s| Arc::new(tokio::sync::Mutex::new(s))).collect();
    let store = Arc::new(tokio::sync::Mutex::new(store));
    let kinds = if opts.faults { fault_kinds(opts.backend, tmpfs) } else { Vec::new() };
    let targets = Targets {
        serves: serves.clone(),
        store: Arc::clone(&store),
        upstream: Some(Arc::clone(&link)),
        runners: None,
        lease: lease(opts.backend),
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let gap = (Duration::from_millis(1000), Duration::from_millis(3000));
    let nemesis = faults::spawn(opts, kinds, targets, clock.clone(), gap, stopped)?;
    let begin = Instant::now();
    let clients: Vec<_> = (0..opts.clients)
        .map(|c| {
            let shared = Arc::clone(&shared);
            let rng = StdRng::seed_from_u64(opts.seed.wrapping_mul(77).wrapping_add(c as u64));
            tokio::spawn(client(shared, u32::try_from(c).unwrap_or(0), rng, (begin, begin + opts.duration)))
        })
        .collect();
    for c in clients {
        let _ = c.await;
    }
    let _ = stop.send(true);
    let _ = nemesis.await;
    final_pass(&shared).await;
    for s in &serves {
        s.lock().await.stop().await;
    }
    let attempts = std::mem::take(&mut *shared.attempts.lock().unwrap_or_else(|e| e.into_inner()));
    let executions = upstream::read_log(&up.log)?;
    Ok(check::summarize(opts, &clock, attempts, &executions))
}

fn fault_kinds(backend: Backend, tmpfs: bool) -> Vec<Kind> {
    let mut kinds =
        // Pauses beyond the lease test the fencing of the completion most: weighted up.
        vec![Kind::Kill9Serve, Kind::PauseServe, Kind::PauseServe, Kind::PauseServe, Kind::UpstreamNetDrop, Kind::UpstreamNetDelay];
    match backend {
        Backend::Sqlite if tmpfs => kinds.push(Kind::DiskFull),
        Backend::Sqlite => {}
        Backend::Postgres | Backend::Redis => {
            kinds.extend([Kind::StoreRestart, Kind::StoreNetDrop, Kind::StoreNetDelay])
        }
        // Their one fault is the failover (`faults::spawn`).
        Backend::PostgresHa | Backend::RedisSentinel | Backend::RedisCluster => {}
    }
    kinds
}

/// The body for `key`: the same bytes on every attempt (a different body would be a reused key), asking the
/// upstream to take 2 to 4 s, so executions overlap the pauses and outlast the lease.
fn body_for(key: &str) -> String {
    let h = key.bytes().fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    format!("{{\"delay_ms\": {}}}", 2000 + h % 2000)
}

/// One client: picks a key of the current pool and sends it until it gets an answer to keep.
async fn client(shared: Arc<Shared>, id: u32, mut rng: StdRng, (begin, deadline): (Instant, Instant)) {
    let Ok(http) = http_client() else { return };
    // Keys this client got an unknown outcome for: every retry would get the same answer.
    let mut settled = std::collections::HashSet::new();
    while Instant::now() < deadline {
        let round = begin.elapsed().as_secs() / ROUND.as_secs();
        let key = format!("o{round}-{}", rng.random_range(0..POOL));
        if !settled.contains(&key) {
            if !send_until_answered(&shared, &http, id, &key, &mut rng, deadline + Duration::from_secs(30)).await {
                settled.insert(key);
            } else if rng.random_bool(0.25) {
                // The same key with another body, once: a fingerprint that left the body out would execute it
                // or answer it from the record.
                let proxy = rng.random_range(0..shared.proxies.len());
                let body = body_for(&key).replace('}', ", \"reused\": true}");
                let mut a = attempt(&shared, &http, id, &key, proxy, body).await;
                a.reused = true;
                shared.attempts.lock().unwrap_or_else(|e| e.into_inner()).push(a);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..50))).await;
    }
}

fn http_client() -> reqwest::Result<reqwest::Client> {
    idem_client::client_builder().timeout(Duration::from_secs(8)).connect_timeout(Duration::from_millis(500)).build()
}

/// Sends `key` (to a random proxy each attempt) until a 2xx, an outcome-unknown answer or a final refusal, as a
/// client following the draft would: 409 waits for its `Retry-After`, timeouts and 5xx are retried shortly.
/// True for a 2xx.
async fn send_until_answered(
    shared: &Shared,
    http: &reqwest::Client,
    client: u32,
    key: &str,
    rng: &mut StdRng,
    give_up: Instant,
) -> bool {
    while Instant::now() < give_up {
        let proxy = rng.random_range(0..shared.proxies.len());
        let a = attempt(shared, http, client, key, proxy, body_for(key)).await;
        let status = a.status;
        let problem = a.problem.clone().unwrap_or_default();
        shared.attempts.lock().unwrap_or_else(|e| e.into_inner()).push(a);
        let wait = match status {
            Some(200..=299) => return true,
            Some(409) if problem.ends_with("request-in-flight") => Duration::from_secs(1),
            Some(502 | 504) if problem.ends_with("outcome-unknown") => return false,
            Some(409 | 422) | Some(400..=499) => return false,
            _ => Duration::from_millis(rng.random_range(100..400)),
        };
        tokio::time::sleep(wait).await;
    }
    false
}

async fn attempt(
    shared: &Shared,
    http: &reqwest::Client,
    client: u32,
    key: &str,
    proxy: usize,
    body: String,
) -> Attempt {
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let invoke_us = shared.clock.now();
    let sent = http
        .post(format!("{}/orders", shared.proxies[proxy]))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    let mut a = Attempt {
        id,
        client,
        key: key.to_owned(),
        proxy,
        invoke_us,
        complete_us: None,
        status: None,
        replayed: false,
        exec: None,
        problem: None,
        reused: false,
    };
    let response = match sent {
        Ok(r) => r,
        Err(e) => {
            a.problem = Some(if e.is_timeout() { "timeout".into() } else { "connection failed".into() });
            return a;
        }
    };
    let status = response.status().as_u16();
    a.replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let body = response.bytes().await.unwrap_or_default();
    a.complete_us = Some(shared.clock.now());
    a.status = Some(status);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if (200..300).contains(&status) {
        a.exec = json.get("exec").and_then(serde_json::Value::as_u64);
    } else {
        a.problem = json.get("type").and_then(serde_json::Value::as_str).map(str::to_owned);
    }
    a
}

/// After every fault healed: each key once more, until it is answered, so the history ends with what each
/// record holds.
async fn final_pass(shared: &Shared) {
    let Ok(http) = http_client() else { return };
    let keys: std::collections::BTreeSet<String> =
        shared.attempts.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|a| a.key.clone()).collect();
    let mut rng = StdRng::seed_from_u64(1);
    for key in keys {
        let _ = send_until_answered(shared, &http, u32::MAX, &key, &mut rng, Instant::now() + Duration::from_secs(30))
            .await;
    }
}

/// Counts answers by status and problem, for the summary.
fn answers(attempts: &[Attempt]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for a in attempts {
        let k = match (a.status, &a.problem) {
            (Some(s), Some(p)) => format!("{s} {}", p.rsplit(':').next().unwrap_or(p)),
            (Some(s), None) if a.replayed => format!("{s} replayed"),
            (Some(s), None) => s.to_string(),
            (None, p) => p.clone().unwrap_or_default(),
        };
        *out.entry(k).or_default() += 1;
    }
    out
}
