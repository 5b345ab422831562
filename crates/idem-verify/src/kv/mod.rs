//! The KV workload: concurrent clients, each on its own connection, doing random get / put / compare-and-swap /
//! create-only put / delete / counter add on a few hot keys of one `idem serve`, while the nemesis injects
//! faults; then the history is checked for linearizability per key ([`check`]).

pub mod check;
pub mod model;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::backend::StoreEnv;
use crate::faults::{self, Kind, Targets};
use crate::history::{Clock, Micros};
use crate::procs::Serve;
use crate::{Anomaly, Backend, Error, Options, Summary};
use model::{Call, Pre, Ret};

/// How many hot keys the clients share at a time.
pub const KEYS: usize = 4;
/// Every this long the clients move on to a fresh set of hot keys (`e{epoch}-k{i}`): a key's history stays a
/// few thousand operations long however long the run, which keeps checking it cheap.
const EPOCH: Duration = Duration::from_secs(10);
/// How long a client waits for an answer before recording the operation as unknown: longer than any pause,
/// delay or restart the nemesis makes, so that only a kill -9 or a broken connection leaves one unanswered.
const TIMEOUT: Duration = Duration::from_secs(10);

/// One recorded operation.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KvOp {
    /// Its id in the history.
    pub id: u64,
    /// The client that sent it (`u32::MAX`: the final reads after every fault healed).
    pub client: u32,
    /// The key.
    pub key: String,
    /// The request.
    pub call: Call,
    /// The answer.
    pub ret: Ret,
    /// When it was sent (µs since the start).
    pub invoke_us: Micros,
    /// When the answer arrived; `None` when none did.
    pub complete_us: Option<Micros>,
    /// For an operation of unknown outcome: the instant by which it took effect or never will (see
    /// `bound_unknown`); `None`: any time until the end of the run.
    pub bound_us: Option<Micros>,
    /// The HTTP status, when one came.
    pub status: Option<u16>,
}

struct Shared {
    url: String,
    clock: Clock,
    ops: Mutex<Vec<KvOp>>,
    next_id: AtomicU64,
}

/// Runs the KV workload on `opts.backend` and checks it.
///
/// # Errors
/// When the store or `idem serve` cannot be started.
pub async fn run(opts: &Options) -> Result<Summary, Error> {
    let clock = Clock::new();
    let store = StoreEnv::start(opts.backend, opts.faults, opts.durable, opts.lax).await?;
    let args = vec!["--store".to_owned(), store.url("kv")];
    let serve = Serve::start(&opts.idem, &args, &crate::idem_env(opts), &opts.out.join("idem-serve.log")).await?;
    let shared = Arc::new(Shared {
        url: serve.url.clone(),
        clock: clock.clone(),
        ops: Mutex::default(),
        next_id: AtomicU64::new(1),
    });
    let tmpfs = store.tmpfs;
    let serve = Arc::new(tokio::sync::Mutex::new(serve));
    let store = Arc::new(tokio::sync::Mutex::new(store));
    let kinds = if opts.faults { fault_kinds(opts.backend, tmpfs) } else { Vec::new() };
    let targets = Targets {
        serves: vec![Arc::clone(&serve)],
        store: Arc::clone(&store),
        upstream: None,
        runners: None,
        lease: Duration::from_secs(1),
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let gap = (Duration::from_millis(500), Duration::from_millis(2500));
    let nemesis = faults::spawn(opts, kinds, targets, clock.clone(), gap, stopped)?;
    let begin = Instant::now();
    let deadline = begin + opts.duration;
    let clients: Vec<_> = (0..opts.clients)
        .map(|c| tokio::spawn(client(Arc::clone(&shared), u32::try_from(c).unwrap_or(0), opts.seed, (begin, deadline))))
        .collect();
    for c in clients {
        let _ = c.await;
    }
    let _ = stop.send(true);
    let _ = nemesis.await;
    final_reads(&shared).await;
    serve.lock().await.stop().await;
    let ops = std::mem::take(&mut *shared.ops.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(summarize(opts, &clock, ops))
}

/// The faults the KV workload suffers on `backend`.
fn fault_kinds(backend: Backend, tmpfs: bool) -> Vec<Kind> {
    let mut kinds = vec![Kind::Kill9Serve, Kind::PauseServe];
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

/// Checks the history, writes it, and sums it up.
fn summarize(opts: &Options, clock: &Clock, mut ops: Vec<KvOp>) -> Summary {
    ops.sort_by_key(|op| op.invoke_us);
    let faults = clock.faults();
    bound_unknown(&mut ops, &faults, opts.backend);
    let (histories, mut anomalies) = check::check(&ops);
    anomalies.extend(answers_in_doubt(&ops, &faults));
    anomalies.extend(no_recovery(&ops, &faults));
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    for op in &ops {
        let key = match (op.status, &op.ret) {
            (Some(s), _) => s.to_string(),
            (None, Ret::Unknown { why }) => why.clone(),
            (None, Ret::NotSent) => "not sent".into(),
            (None, _) => "none".into(),
        };
        *answers.entry(key).or_default() += 1;
    }
    let history = opts.out.join("history.jsonl");
    let timed: Vec<(Micros, &KvOp)> = ops.iter().map(|op| (op.invoke_us, op)).collect();
    if let Err(e) = crate::history::write_jsonl(&history, &timed, &faults) {
        eprintln!("idem-verify: cannot write {}: {e}", history.display());
    }
    let failure_page = anomalies.first().map(|a| crate::report::kv_page(opts, a, &ops, &faults));
    Summary {
        workload: opts.workload,
        backend: opts.backend,
        seed: opts.seed,
        operations: ops.len(),
        unknown: ops.iter().filter(|op| matches!(op.ret, Ret::Unknown { .. })).count(),
        answers,
        faults: clock.fault_counts(),
        histories,
        losses: kv_losses(opts, &faults, &anomalies),
        anomalies,
        notes: BTreeMap::new(),
        setting: None,
        seconds: 0.0,
        history,
        failure_page,
    }
}

/// On a highly available backend: the keys whose history no order explains after a failover (a write the old
/// primary acknowledged and the promoted one lacks makes a later read fit no order), counted as
/// `acknowledged writes missing`; each is an anomaly as well.
fn kv_losses(opts: &Options, faults: &[crate::history::Fault], anomalies: &[crate::Anomaly]) -> BTreeMap<String, u64> {
    let mut losses = BTreeMap::new();
    if opts.backend.is_ha() {
        let failover = faults.iter().any(|f| crate::HaFault::is_ha(&f.kind));
        let n = if failover { anomalies.iter().filter(|a| a.kind == "not linearizable").count() } else { 0 };
        losses.insert("acknowledged writes missing".to_owned(), n as u64);
    }
    losses
}

/// Sets, for each operation of unknown outcome, the instant by which it has taken effect or never will, so the
/// checker need not let it float to the end of the run (every such operation doubles the orders to try):
///
/// - answered with a 5xx: the answer, for SQLite (its writer answers a caller only after the batch holding the
///   write committed or rolled back); for PostgreSQL and Redis the answer plus [`REMOTE_SLACK`], since a
///   statement cut off on a broken or slowed link may still reach the server and run a moment later;
/// - not answered (the connection broke): the kill -9 of `idem serve` that broke it (plus the slack for a
///   remote store); a process that is gone writes nothing more;
/// - otherwise none: it may take effect until the end of the run.
fn bound_unknown(ops: &mut [KvOp], faults: &[crate::history::Fault], backend: Backend) {
    let slack = if backend == Backend::Sqlite { 0 } else { REMOTE_SLACK };
    for op in ops.iter_mut().filter(|op| matches!(op.ret, Ret::Unknown { .. })) {
        op.bound_us = match (op.status, op.complete_us) {
            (Some(_), Some(answered)) => Some(answered + slack),
            _ => faults
                .iter()
                .filter(|f| f.kind == "kill9" && f.target.starts_with("idem serve") && f.end_us >= op.invoke_us)
                .map(|f| f.end_us + slack)
                .min(),
        };
    }
}

/// How long after an answer a write cut off on its way to PostgreSQL or Redis may still run there: the longest
/// delay the nemesis puts on the link (0.4 s per chunk, a few chunks) and then some, in microseconds.
const REMOTE_SLACK: Micros = 3_000_000;

/// A disk-full fault after which no write succeeded within 10 s (while clients went on writing): the store did
/// not recover when space returned.
fn no_recovery(ops: &[KvOp], faults: &[crate::history::Fault]) -> Vec<Anomaly> {
    let last = ops.iter().map(|op| op.invoke_us).max().unwrap_or(0);
    faults
        .iter()
        .filter(|f| f.kind == "disk-full" && f.end_us + 10_000_000 < last)
        .filter(|f| {
            !ops.iter().any(|op| {
                op.invoke_us >= f.end_us
                    && op.invoke_us < f.end_us + 10_000_000
                    && matches!(op.ret, Ret::Written { .. } | Ret::Added { .. } | Ret::Deleted)
            })
        })
        .map(|f| Anomaly {
            kind: "no recovery".into(),
            subject: "store".into(),
            detail: format!("no write succeeded in the 10 s after the disk had space again ({} us)", f.end_us),
            at_us: Some(f.end_us),
            ops: Vec::new(),
        })
        .collect()
}

/// Answers the contract does not allow for the call (the harness sends only valid requests): anything but
/// 200/404 to a read, 200/201/412 to a put, 204/412 to a delete, 200 to a counter add, or 503
/// `store-unavailable` (a store idem cannot reach, or a full disk). A 404 to a write used to pass as an
/// unknown outcome, so an idem refusing a precondition on a missing key with 404 instead of 412 went
/// unnoticed (found by a break-it review).
fn answers_in_doubt(ops: &[KvOp], faults: &[crate::history::Fault]) -> Vec<Anomaly> {
    let mut out = Vec::new();
    for op in ops {
        let Some(status) = op.status else { continue };
        let allowed = status == 503
            || match op.call {
                Call::Get => matches!(status, 200 | 404),
                Call::Put { .. } => matches!(status, 200 | 201 | 412),
                Call::Delete { .. } => matches!(status, 204 | 412),
                Call::Add { .. } => status == 200,
                Call::Barrier { .. } => true,
            };
        if !allowed {
            let during: Vec<&str> = faults
                .iter()
                .filter(|f| f.start_us <= op.complete_us.unwrap_or(op.invoke_us) && f.end_us >= op.invoke_us)
                .map(|f| f.kind.as_str())
                .collect();
            out.push(Anomaly {
                kind: format!("answered {status}"),
                subject: op.key.clone(),
                detail: format!("op #{} {:?} got {status} ({:?}) during faults {during:?}", op.id, op.call, op.ret),
                at_us: op.complete_us,
                ops: vec![op.id],
            });
        }
    }
    out
}

/// One client: its own connection, random operations until the deadline.
async fn client(shared: Arc<Shared>, id: u32, seed: u64, (begin, deadline): (Instant, Instant)) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(u64::from(id)));
    let Ok(http) = idem_client::client_builder()
        .timeout(TIMEOUT)
        .connect_timeout(Duration::from_millis(500))
        .pool_max_idle_per_host(1)
        .build()
    else {
        return;
    };
    let mut seen: HashMap<String, u64> = HashMap::new();
    let mut seq = 0i64;
    while Instant::now() < deadline {
        let epoch = begin.elapsed().as_secs() / EPOCH.as_secs();
        let key = format!("e{epoch}-k{}", rng.random_range(0..KEYS));
        let key = key.as_str();
        seq += 1;
        let value = i64::from(id) * 1_000_000_000 + seq;
        let last = seen.get(key).copied();
        let call = match rng.random_range(0..100) {
            0..30 => Call::Get,
            30..45 => Call::Put { value, pre: Pre::Any },
            45..65 => Call::Put { value, pre: last.map_or(Pre::Absent, Pre::Gen) },
            65..73 => Call::Put { value, pre: Pre::Absent },
            73..76 => Call::Put { value, pre: Pre::Present },
            76..82 => Call::Delete { pre: Pre::Any },
            82..86 => Call::Delete { pre: last.map_or(Pre::Present, Pre::Gen) },
            _ => Call::Add { delta: rng.random_range(1..=5) },
        };
        let op = perform(&shared, &http, id, key, call).await;
        match op.ret {
            Ret::Value { generation, .. } | Ret::Written { generation, .. } | Ret::Added { generation, .. } => {
                seen.insert(key.to_owned(), generation);
            }
            Ret::Refused { current: Some(g) } => {
                seen.insert(key.to_owned(), g);
            }
            Ret::NotFound | Ret::Deleted | Ret::Refused { current: None } => {
                seen.remove(key);
            }
            Ret::Unknown { .. } | Ret::NotSent => {}
        }
        // A client backs off after a failure (idem's 503 says `Retry-After: 1`), as real ones do. Without it
        // a broken store link turned each client into hundreds of failed writes a second, each of unknown
        // outcome for seconds, and the checker's search over their orders ran out of memory.
        let pause = if matches!(op.ret, Ret::Unknown { .. }) { 300..=1000 } else { 2..=8 };
        shared.ops.lock().unwrap_or_else(|e| e.into_inner()).push(op);
        tokio::time::sleep(Duration::from_millis(rng.random_range(pause))).await;
    }
}

/// Sends one operation and records what came back.
async fn perform(shared: &Shared, http: &reqwest::Client, client: u32, key: &str, call: Call) -> KvOp {
    let url = format!("{}/v1/kv/{key}", shared.url);
    let request = match &call {
        Call::Get => http.get(&url),
        Call::Put { value, pre } => precondition(http.put(&url).body(value.to_string()), *pre),
        Call::Delete { pre } => precondition(http.delete(&url), *pre),
        Call::Add { delta } => http.post(format!("{url}/counter")).json(&serde_json::json!({ "delta": delta })),
        Call::Barrier { .. } => http.head(&url),
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let invoke_us = shared.clock.now();
    let answer = async {
        let response = request.send().await?;
        let status = response.status().as_u16();
        let etag = response.headers().get("etag").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let body = response.bytes().await?;
        Ok::<_, reqwest::Error>((status, etag, body))
    }
    .await;
    let complete_us = shared.clock.now();
    let (ret, status, complete_us) = match answer {
        // Refused at connect: the request was never sent.
        Err(e) if e.is_connect() => (Ret::NotSent, None, Some(complete_us)),
        Err(e) => {
            let why = if e.is_timeout() { "timeout" } else { "connection failed" };
            (Ret::Unknown { why: why.into() }, None, None)
        }
        Ok((status, etag, body)) => (interpret(&call, status, etag.as_deref(), &body), Some(status), Some(complete_us)),
    };
    KvOp { id, client, key: key.to_owned(), call, ret, invoke_us, complete_us, bound_us: None, status }
}

fn precondition(request: reqwest::RequestBuilder, pre: Pre) -> reqwest::RequestBuilder {
    match pre {
        Pre::Any => request,
        Pre::Absent => request.header("if-none-match", "*"),
        Pre::Present => request.header("if-match", "*"),
        Pre::Gen(g) => request.header("if-match", format!("\"{g}\"")),
    }
}

/// What an answer says, in the model's terms; anything it cannot read is an unknown outcome.
fn interpret(call: &Call, status: u16, etag: Option<&str>, body: &[u8]) -> Ret {
    let json = || serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    let number = |v: &serde_json::Value, field: &str| v.get(field).and_then(serde_json::Value::as_u64);
    let unknown = |why: String| Ret::Unknown { why };
    match (call, status) {
        (Call::Get, 200) => {
            let value = std::str::from_utf8(body).ok().and_then(|s| s.trim().parse().ok());
            let generation = etag.and_then(|t| t.trim_matches('"').parse().ok());
            match (value, generation) {
                (Some(value), Some(generation)) => Ret::Value { value, generation },
                _ => unknown(format!("unreadable 200: {}", String::from_utf8_lossy(body))),
            }
        }
        (Call::Get, 404) => Ret::NotFound,
        (Call::Put { .. }, 200 | 201) => match number(&json(), "generation") {
            Some(generation) => Ret::Written { generation, created: status == 201 },
            None => unknown("unreadable PUT answer".into()),
        },
        (Call::Delete { .. }, 204) => Ret::Deleted,
        (Call::Put { .. } | Call::Delete { .. }, 412) => {
            Ret::Refused { current: number(&json(), "current_generation") }
        }
        (Call::Add { .. }, 200) => {
            let v = json();
            match (v.get("value").and_then(serde_json::Value::as_i64), number(&v, "generation")) {
                (Some(value), Some(generation)) => Ret::Added { value, generation },
                _ => unknown("unreadable counter answer".into()),
            }
        }
        (_, s) => unknown(format!("answered {s}")),
    }
}

/// After every fault healed: one read of each key, retried until it is answered (within a minute), so the
/// history ends with what the store holds.
async fn final_reads(shared: &Shared) {
    let Ok(http) = idem_client::client_builder().timeout(Duration::from_secs(5)).build() else { return };
    let keys: std::collections::BTreeSet<String> =
        shared.ops.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|op| op.key.clone()).collect();
    for key in &keys {
        for _ in 0..60 {
            let op = perform(shared, &http, u32::MAX, key, Call::Get).await;
            let answered = !matches!(op.ret, Ret::Unknown { .. } | Ret::NotSent);
            shared.ops.lock().unwrap_or_else(|e| e.into_inner()).push(op);
            if answered {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(call: Call, status: u16) -> KvOp {
        let ret = Ret::Unknown { why: format!("answered {status}") };
        KvOp {
            id: 1,
            client: 0,
            key: "k".into(),
            call,
            ret,
            invoke_us: 0,
            complete_us: Some(1),
            bound_us: None,
            status: Some(status),
        }
    }

    #[test]
    fn a_404_is_an_answer_only_to_a_read() {
        assert!(answers_in_doubt(&[op(Call::Get, 404)], &[]).is_empty());
        assert!(answers_in_doubt(&[op(Call::Put { value: 1, pre: Pre::Present }, 503)], &[]).is_empty());
        for call in
            [Call::Put { value: 1, pre: Pre::Present }, Call::Delete { pre: Pre::Gen(3) }, Call::Add { delta: 1 }]
        {
            let found = answers_in_doubt(&[op(call.clone(), 404)], &[]);
            assert_eq!(found.len(), 1, "{call:?} answered 404 passed");
            assert_eq!(found[0].kind, "answered 404");
        }
        assert_eq!(answers_in_doubt(&[op(Call::Get, 500)], &[]).len(), 1);
    }
}
