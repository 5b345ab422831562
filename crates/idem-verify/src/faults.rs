//! The nemesis: faults on a random schedule drawn from the run's seed, each recorded in the history with when
//! it began and ended. Every fault heals before the next one starts, and the last one heals before the run
//! stops, so the final reads see the store after every fault.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;

use crate::backend::StoreEnv;
use crate::faultproxy::{FaultProxy, Mode};
use crate::hafaults::Plan;
use crate::history::{Clock, Fault};
use crate::procs::{Serve, signal};
use crate::{Error, FaultClass, HaFault};
use idem_testkit::ClusterFailover;

/// A kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// kill -9 of an `idem serve`, then a restart on the same ports.
    Kill9Serve,
    /// SIGSTOP of an `idem serve` for longer than its lease, then SIGCONT.
    PauseServe,
    /// kill -9 of an `idem run` (the workload starts another).
    Kill9Runner,
    /// SIGSTOP of an `idem run` for longer than its lease, then SIGCONT.
    PauseRunner,
    /// Crash and restart of the PostgreSQL or Redis server.
    StoreRestart,
    /// The store out for seconds: the PostgreSQL server stopped (SIGQUIT) or the Redis server killed (SIGKILL)
    /// and started again 1-4 s later; on SQLite the ledger file locked (an exclusive transaction held) for
    /// 2-12 s, past the store's 10 s busy timeout at times.
    StoreOutage,
    /// Every connection between idem and its store reset, and new ones refused for a while.
    StoreNetDrop,
    /// Every chunk between idem and its store delayed for a while.
    StoreNetDelay,
    /// Every connection between the proxy and its upstream reset, new ones refused for a while.
    UpstreamNetDrop,
    /// Every chunk between the proxy and its upstream delayed for a while.
    UpstreamNetDelay,
    /// The SQLite tmpfs filled to the last byte for a while.
    DiskFull,
}

impl Kind {
    /// The name in the history and the report: its class's.
    pub fn name(self) -> &'static str {
        self.class().name()
    }

    /// Its class (`--faults`).
    pub fn class(self) -> FaultClass {
        match self {
            Kind::Kill9Serve | Kind::Kill9Runner => FaultClass::Kill9,
            Kind::PauseServe | Kind::PauseRunner => FaultClass::Pause,
            Kind::StoreRestart => FaultClass::StoreRestart,
            Kind::StoreOutage => FaultClass::StoreOutage,
            Kind::StoreNetDrop | Kind::UpstreamNetDrop => FaultClass::NetDrop,
            Kind::StoreNetDelay | Kind::UpstreamNetDelay => FaultClass::NetDelay,
            Kind::DiskFull => FaultClass::DiskFull,
        }
    }
}

/// The `idem run` processes alive now (a label and the process id each), and the execution log of the batch
/// they work on.
#[derive(Debug, Default)]
pub struct RunnerSet {
    /// Label and process id of each runner alive.
    pub alive: Vec<(String, u32)>,
    /// The batch the runners work on (its namespace `b{batch}` is the hash tag of its keys on a Cluster).
    pub batch: usize,
    /// The batch's execution log (`exec-item` lines).
    pub log: Option<std::path::PathBuf>,
}

/// Shared between the runner workload and the nemesis.
pub type Runners = Arc<std::sync::Mutex<RunnerSet>>;

/// The runner whose command started last (from the batch's execution log), if it is alive: pausing it mid-
/// command, with the command's output still to come, is the case the fence before the rename is for.
fn busiest_runner(set: &RunnerSet) -> Option<(String, u32)> {
    let text = std::fs::read_to_string(set.log.as_ref()?).ok()?;
    text.lines().rev().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).find_map(|v| {
        let pid = u32::try_from(v.get("runner")?.as_u64()?).ok()?;
        set.alive.iter().find(|(_, p)| *p == pid).cloned()
    })
}

/// What the nemesis may act on.
pub struct Targets {
    /// The `idem serve` processes.
    pub serves: Vec<Arc<Mutex<Serve>>>,
    /// The store.
    pub store: Arc<Mutex<StoreEnv>>,
    /// The link from the proxy to its upstream.
    pub upstream: Option<Arc<FaultProxy>>,
    /// The runners alive.
    pub runners: Option<Runners>,
    /// The lease idem was given: pauses last longer.
    pub lease: Duration,
}

/// Runs faults drawn from `seed` among `kinds`, one at a time with a pause of `gap` (1..=3 s by default)
/// before each, until `stop` is set; returns once the fault in progress has healed.
pub async fn nemesis(
    seed: u64,
    kinds: Vec<Kind>,
    targets: Targets,
    clock: Clock,
    gap: (Duration, Duration),
    stop: tokio::sync::watch::Receiver<bool>,
) {
    if kinds.is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6e656d65_73697300);
    let mut stop = stop;
    loop {
        let wait = rng.random_range(gap.0..=gap.1);
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let kind = kinds[rng.random_range(0..kinds.len())];
        let start = clock.now();
        let Some((target, detail)) = inject(kind, &targets, &mut rng).await else { continue };
        clock.fault(Fault { kind: kind.name().into(), target, start_us: start, end_us: clock.now(), detail });
    }
}

/// The one fault of a run on a highly available backend: `plan`'s kind at `at`, or at an instant drawn from
/// `seed` between a quarter and half of `duration`, unless `stop` is set first; returns once it has healed (a
/// promoted primary serves, and the others are its replicas or standbys again).
pub async fn ha_fault_once(
    seed: u64,
    at: Option<Duration>,
    duration: Duration,
    plan: Plan,
    targets: Targets,
    clock: Clock,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6661_696c_6f76_6572);
    let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    let wait = at.unwrap_or_else(|| between(&mut rng, ms / 4, ms / 2));
    let mut stop = stop;
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        _ = stop.wait_for(|s| *s) => return,
    }
    // On a Cluster the master acted on is the one serving the workload's keys: their hash tag is the
    // namespace (the runner's batch `b{n}`, idem serve's default `idem`).
    let tag = match &targets.runners {
        Some(r) => format!("{{b{}:}}", r.lock().unwrap_or_else(|e| e.into_inner()).batch),
        None => "{idem:}".to_owned(),
    };
    let start = clock.now();
    let mut store = targets.store.lock().await;
    let detail = match store.ha_fault(&tag, plan).await {
        None => return,
        Some(Ok(detail)) => detail,
        Some(Err(why)) => {
            eprintln!("idem-verify: the {} failed: {why}", plan.kind.name());
            format!("failed: {why}")
        }
    };
    clock.fault(Fault {
        kind: plan.kind.name().into(),
        target: "store primary".into(),
        start_us: start,
        end_us: clock.now(),
        detail,
    });
}

/// The fault of a run on a highly available backend: `forced`, or drawn from `seed` and the workload (so the
/// three workloads of one seed meet different faults), with its numbers.
pub fn ha_plan(seed: u64, opts: &crate::Options) -> Plan {
    let salt = match opts.workload {
        crate::Workload::Kv => 1,
        crate::Workload::Proxy => 2,
        crate::Workload::Runner => 3,
        crate::Workload::Once => 4,
    };
    let backend = opts.backend as u64;
    let mut rng = StdRng::seed_from_u64(splitmix64(seed ^ 0x6861_6661_756c_7400 ^ (salt << 8) ^ (backend << 16)));
    let kinds = HaFault::ALL;
    // The kind from a hash of its own: seeds that differ in a few bits drew the first kind in 7 of 9 runs.
    let pick = splitmix64(seed.wrapping_add(salt.wrapping_mul(0x9e37_79b9)).wrapping_add(backend << 32));
    let drawn = kinds[usize::try_from(pick % kinds.len() as u64).unwrap_or(0)];
    let cluster =
        [ClusterFailover::Coordinated, ClusterFailover::Force, ClusterFailover::Takeover][rng.random_range(0..3)];
    Plan {
        kind: opts.ha_fault.unwrap_or(drawn),
        replica: rng.random_range(0..2),
        lag_ms: rng.random_range(1500..=4000),
        hold_ms: rng.random_range(1000..=3000),
        cluster,
    }
}

/// The nemesis of a run: on a highly available backend its one fault ([`ha_fault_once`]), elsewhere
/// [`nemesis`] with `kinds` (those of `opts.only_faults`' classes, when it names any); nothing without
/// `opts.faults`.
///
/// # Errors
/// [`Error::Usage`] when `opts.only_faults` names none of the classes the workload injects (`crate::run`
/// refuses it on a highly available backend before anything starts).
pub fn spawn(
    opts: &crate::Options,
    kinds: Vec<Kind>,
    targets: Targets,
    clock: Clock,
    gap: (Duration, Duration),
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let kinds = if opts.only_faults.is_empty() {
        kinds
    } else {
        let chosen: Vec<Kind> = kinds.iter().copied().filter(|k| opts.only_faults.contains(&k.class())).collect();
        if opts.faults && chosen.is_empty() {
            let mut offered: Vec<FaultClass> = Vec::new();
            for class in kinds.iter().map(|k| k.class()) {
                if !offered.contains(&class) {
                    offered.push(class);
                }
            }
            return Err(Error::Usage(format!(
                "--faults {}: the {} workload on {} injects none of them (it injects {})",
                FaultClass::names(&opts.only_faults),
                opts.workload.name(),
                opts.backend.name(),
                FaultClass::names(&offered)
            )));
        }
        chosen
    };
    if !opts.faults {
        return Ok(tokio::spawn(async {}));
    }
    Ok(if opts.backend.is_ha() {
        let plan = ha_plan(opts.seed, opts);
        tokio::spawn(ha_fault_once(opts.seed, opts.failover_at, opts.duration, plan, targets, clock, stop))
    } else {
        tokio::spawn(nemesis(opts.seed, kinds, targets, clock, gap, stop))
    })
}

/// SplitMix64's finaliser: every bit of `x` moves every bit of the result.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn between(rng: &mut StdRng, lo_ms: u64, hi_ms: u64) -> Duration {
    Duration::from_millis(rng.random_range(lo_ms..=hi_ms))
}

/// Injects one fault and heals it; the target and the numbers, or `None` when there was nothing to act on.
async fn inject(kind: Kind, t: &Targets, rng: &mut StdRng) -> Option<(String, String)> {
    let lease_ms = u64::try_from(t.lease.as_millis()).unwrap_or(1000);
    match kind {
        Kind::Kill9Serve => {
            let i = rng.random_range(0..t.serves.len());
            let down = between(rng, 0, 300);
            let mut serve = t.serves[i].lock().await;
            serve.kill9().await;
            tokio::time::sleep(down).await;
            if let Err(e) = serve.restart().await {
                eprintln!("idem-verify: idem serve #{i} did not restart: {e}");
            }
            Some((format!("idem serve #{i}"), format!("down {} ms", down.as_millis())))
        }
        Kind::PauseServe => {
            let i = rng.random_range(0..t.serves.len());
            let pause = between(rng, lease_ms * 3 / 2, lease_ms * 5 / 2);
            let pid = t.serves[i].lock().await.pid()?;
            signal(pid, "STOP").await;
            tokio::time::sleep(pause).await;
            signal(pid, "CONT").await;
            Some((format!("idem serve #{i}"), format!("stopped {} ms", pause.as_millis())))
        }
        Kind::Kill9Runner | Kind::PauseRunner => {
            let (label, pid) = {
                let set = t.runners.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
                if set.alive.is_empty() {
                    return None;
                }
                let random = set.alive[rng.random_range(0..set.alive.len())].clone();
                // Half the pauses go to the runner that started a command last.
                let targeted =
                    (kind == Kind::PauseRunner && rng.random_bool(0.5)).then(|| busiest_runner(&set)).flatten();
                targeted.unwrap_or(random)
            };
            if kind == Kind::Kill9Runner {
                signal(pid, "KILL").await;
                Some((label, "killed".into()))
            } else {
                // Long enough for another runner to take the item over and finish it meanwhile.
                let pause = between(rng, lease_ms * 4, lease_ms * 7);
                signal(pid, "STOP").await;
                tokio::time::sleep(pause).await;
                signal(pid, "CONT").await;
                Some((label, format!("stopped {} ms", pause.as_millis())))
            }
        }
        Kind::StoreRestart => {
            let mut store = t.store.lock().await;
            store.restart().await;
            Some(("store server".into(), String::new()))
        }
        Kind::StoreOutage => {
            let mut store = t.store.lock().await;
            let down = if store.restartable() { between(rng, 1000, 4000) } else { between(rng, 2000, 12_000) };
            let detail = store.outage(down).await?;
            let target = if store.restartable() { "store server" } else { "sqlite ledger" };
            Some((target.into(), detail))
        }
        Kind::StoreNetDrop | Kind::UpstreamNetDrop | Kind::StoreNetDelay | Kind::UpstreamNetDelay => {
            let store = t.store.lock().await;
            let (link, target) = match kind {
                Kind::StoreNetDrop | Kind::StoreNetDelay => (store.link.as_ref()?, "store link"),
                _ => (t.upstream.as_deref()?, "upstream link"),
            };
            if matches!(kind, Kind::StoreNetDrop | Kind::UpstreamNetDrop) {
                let down = between(rng, 200, 1500);
                link.set(Mode::Refuse);
                link.reset_all();
                tokio::time::sleep(down).await;
                link.set(Mode::Pass);
                Some((target.into(), format!("refused {} ms", down.as_millis())))
            } else {
                let delay = between(rng, 20, 400);
                let span = between(rng, 1000, 3000);
                link.set(Mode::Delay(delay));
                tokio::time::sleep(span).await;
                link.set(Mode::Pass);
                Some((target.into(), format!("{} ms per chunk for {} ms", delay.as_millis(), span.as_millis())))
            }
        }
        Kind::DiskFull => {
            let store = t.store.lock().await;
            let filler = store.fill_disk().ok()?;
            let span = between(rng, 1000, 2500);
            // SQLite rewrites its write-ahead log in place after each checkpoint, so a full disk bites only
            // when the files must grow: a few large values make them, as growing data would.
            let url = t.serves[0].lock().await.url.clone();
            let ballast = async {
                let Ok(http) = idem_client::client_builder().timeout(Duration::from_secs(5)).build() else { return };
                for i in 0..4 {
                    let body = vec![b'x'; 1 << 20];
                    let _ = http.put(format!("{url}/v1/kv/ballast-{i}")).body(body).send().await;
                }
            };
            let _ = tokio::join!(ballast, tokio::time::sleep(span));
            let _ = std::fs::remove_file(&filler);
            Some(("sqlite tmpfs".into(), format!("full for {} ms", span.as_millis())))
        }
    }
}
