//! idem's verification harness: random concurrent clients drive real `idem` processes (`idem serve`, the
//! proxy, `idem run`) over HTTP and the command line while a nemesis injects faults (kill -9, SIGSTOP beyond
//! the lease, store restarts, network drops and delays, a full disk); every operation is recorded with its
//! invocation and completion instants and its result, and the history is checked afterwards: linearizability
//! per key for the KV store, exactly-once for the proxy and the runner, each cron slot once for `idem once`
//! (its status and exit statuses too). Each checker is shown to fail on a bug
//! planted on purpose (`IDEM_PLANTED_BUG`, in builds of idem with its `planted-bugs` feature).

pub mod backend;
pub mod faultproxy;
pub mod faults;
pub mod hafaults;
pub mod history;
pub mod kv;
pub mod once;
pub mod procs;
pub mod proxy;
pub mod report;
pub mod runner;
mod tally;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

/// The backend under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// The embedded SQLite store (a file, on a small tmpfs where the machine allows).
    Sqlite,
    /// A throw-away PostgreSQL cluster the harness starts.
    Postgres,
    /// A throw-away Redis server the harness starts (append-only file, fsync always).
    Redis,
    /// A throw-away PostgreSQL primary with a streaming standby (a multi-host URL); its fault is a failover.
    PostgresHa,
    /// A throw-away Redis primary and replica watched by three Sentinels (`redis+sentinel://`); its fault is a
    /// failover.
    RedisSentinel,
    /// A throw-away six-node Redis Cluster (`redis+cluster://`); its fault is a failover of a master.
    RedisCluster,
}

impl Backend {
    /// The name on the command line and in the report (`postgres-ha`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::Redis => "redis",
            Backend::PostgresHa => "postgres-ha",
            Backend::RedisSentinel => "redis-sentinel",
            Backend::RedisCluster => "redis-cluster",
        }
    }

    /// Whether it is a highly available setup, whose one fault is one of [`HaFault`].
    pub fn is_ha(self) -> bool {
        matches!(self, Backend::PostgresHa | Backend::RedisSentinel | Backend::RedisCluster)
    }
}

/// A fault of a highly available backend (one a run, drawn from the seed unless `--ha-fault` names it). None
/// excuses anything: a write acknowledged and then missing, or an execution repeated, is an anomaly and a
/// counted loss of the replication setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum HaFault {
    /// The primary killed (SIGKILL) and a replica or standby promoted in its place.
    Failover,
    /// A switchover by command with the old primary alive: `SENTINEL FAILOVER`, `CLUSTER FAILOVER`
    /// (coordinated, `FORCE` or `TAKEOVER`), `pg_ctl promote` of a standby with the old primary stopped after
    /// a while.
    Switchover,
    /// A replica or standby frozen (SIGSTOP) for a while, then the primary killed and the other promoted.
    ReplicaLag,
    /// A replica or standby stopped for a while, then a switchover to the other.
    ReplicaStop,
    /// The old primary and one replica or standby cut off from the other (and the Sentinels, or on a Cluster
    /// the other masters: bus and replication) while idem still reaches them; the other promoted (on a Cluster
    /// by the majority on its own, after the node timeout); healed after a while (PostgreSQL: the old primary
    /// stopped).
    Partition,
}

impl HaFault {
    /// The name in the history and the report.
    pub fn name(self) -> &'static str {
        match self {
            HaFault::Failover => "failover",
            HaFault::Switchover => "switchover",
            HaFault::ReplicaLag => "replica-lag",
            HaFault::ReplicaStop => "replica-stop",
            HaFault::Partition => "partition",
        }
    }

    /// Every one, in the order the seed draws from.
    pub const ALL: [HaFault; 5] =
        [HaFault::Failover, HaFault::Switchover, HaFault::ReplicaLag, HaFault::ReplicaStop, HaFault::Partition];

    /// Whether `kind` (a fault's name in a history) is one of these.
    pub fn is_ha(kind: &str) -> bool {
        Self::ALL.iter().any(|f| f.name() == kind)
    }
}

/// A class of faults of the backends that are not highly available, as a report names it (`--faults`
/// chooses among them; each workload injects the classes that apply to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FaultClass {
    /// kill -9 of an `idem serve` or an `idem run`.
    Kill9,
    /// SIGSTOP of an `idem serve` or an `idem run` past its lease, then SIGCONT.
    Pause,
    /// A crash and restart of the PostgreSQL or Redis server.
    StoreRestart,
    /// The store out for seconds (a SQLite ledger locked).
    StoreOutage,
    /// Connections to the store or the upstream reset and refused for a while.
    NetDrop,
    /// Connections to the store or the upstream delayed for a while.
    NetDelay,
    /// The SQLite tmpfs full for a while.
    DiskFull,
}

impl FaultClass {
    /// The name in the history, the report and `--faults`.
    pub fn name(self) -> &'static str {
        match self {
            FaultClass::Kill9 => "kill9",
            FaultClass::Pause => "pause",
            FaultClass::StoreRestart => "store-restart",
            FaultClass::StoreOutage => "store-outage",
            FaultClass::NetDrop => "net-drop",
            FaultClass::NetDelay => "net-delay",
            FaultClass::DiskFull => "disk-full",
        }
    }

    /// `classes` by name, as `--faults` takes them: "kill9, pause".
    pub fn names(classes: &[FaultClass]) -> String {
        classes.iter().map(|c| c.name()).collect::<Vec<_>>().join(", ")
    }
}

/// The replication setting of a highly available backend without the durable one (`--no-durable`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Lax {
    /// One replica or standby: Redis `wait_replicas=1`, PostgreSQL `synchronous_standby_names = '*'` (FIRST 1).
    #[default]
    One,
    /// None: no `wait_replicas`, asynchronous PostgreSQL replication.
    None,
}

/// The workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Get / put / conditional put / delete / counter add on a few hot keys; checked for linearizability.
    Kv,
    /// POSTs with Idempotency-Keys through `idem serve --upstream`; checked for exactly-once execution.
    Proxy,
    /// Overlapping `idem run` processes on one item list; checked for one valid output per item.
    Runner,
    /// Concurrent `idem once` invocations of a few cron jobs, with pauses, triggers and backfills; checked for
    /// each slot run once, no overlap where the policy forbids it, and a status that tells the history.
    Once,
}

impl Workload {
    /// The name on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Kv => "kv",
            Workload::Proxy => "proxy",
            Workload::Runner => "runner",
            Workload::Once => "once",
        }
    }
}

/// What one run does.
#[derive(Clone, Debug)]
pub struct Options {
    /// The backend.
    pub backend: Backend,
    /// The workload.
    pub workload: Workload,
    /// Seeds the clients' choices and the fault schedule.
    pub seed: u64,
    /// How long the clients run.
    pub duration: Duration,
    /// Whether to inject faults.
    pub faults: bool,
    /// The `idem` binary.
    pub idem: PathBuf,
    /// The `idem-verify` binary: the runner workload's item command is `idem-verify exec-item …`, the once
    /// workload's `idem-verify exec-slot …` (a test binary cannot stand in for it).
    pub harness: PathBuf,
    /// Where the history, the logs and a failure page go.
    pub out: PathBuf,
    /// `IDEM_PLANTED_BUG` for the idem processes (idem built with the feature planted-bugs only).
    pub planted_bug: Option<String>,
    /// Concurrent clients (KV, proxy), items (runner) or jobs (once).
    pub clients: usize,
    /// On the highly available backends, the durable setting: every standby synchronous (PostgreSQL `ANY 2
    /// (…)` with `synchronous_standbys=all`) or `wait_replicas=all` (Redis). Without it ([`Options::lax`]) a
    /// write the old primary acknowledged may be lost in a failover; the report counts such losses (as
    /// anomalies, and on a line of their own). Ignored on the others.
    pub durable: bool,
    /// Without `durable`: which weaker setting.
    pub lax: Lax,
    /// On the highly available backends, the fault; `None`: drawn from the seed (and the workload).
    pub ha_fault: Option<HaFault>,
    /// Which classes of fault the nemesis draws from (off the highly available backends); empty: every class
    /// the workload injects. A class the workload never injects is refused ([`Error::Usage`]).
    pub only_faults: Vec<FaultClass>,
    /// On the highly available backends, when the failover starts (from the start of the run); `None`: drawn
    /// from the seed between a quarter and half of `duration`.
    pub failover_at: Option<Duration>,
}

/// Something the checker found that the contract forbids.
#[derive(Clone, Debug, Serialize)]
pub struct Anomaly {
    /// What kind (`not linearizable`, `executed twice`, ...).
    pub kind: String,
    /// The key or item.
    pub subject: String,
    /// What happened, in words.
    pub detail: String,
    /// When (microseconds since the start), where one instant says it.
    pub at_us: Option<u64>,
    /// The operations involved (their ids in the history).
    pub ops: Vec<u64>,
}

/// The outcome of one run.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// The workload.
    pub workload: Workload,
    /// The backend.
    pub backend: Backend,
    /// The seed.
    pub seed: u64,
    /// Operations recorded.
    pub operations: usize,
    /// Of which with an unknown outcome.
    pub unknown: usize,
    /// Answers by kind (HTTP status, or `timeout`), for the record.
    pub answers: BTreeMap<String, usize>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, usize>,
    /// Histories checked (keys, idempotency keys, items).
    pub histories: usize,
    /// What the checker found.
    pub anomalies: Vec<Anomaly>,
    /// Other figures of the workload (executions, takeovers...).
    pub notes: BTreeMap<String, u64>,
    /// On a highly available backend, its replication setting (`synchronous replication`, `wait_replicas=1`,
    /// or the asynchronous ones) as the report names it.
    pub setting: Option<String>,
    /// On a highly available backend, what the failover lost, by kind (`executions repeated`, ...): each also
    /// an anomaly, counted here so a run without the durable setting measures the trade-off.
    pub losses: BTreeMap<String, u64>,
    /// Seconds the run took, checking included.
    pub seconds: f64,
    /// The history file.
    pub history: PathBuf,
    /// The failure page, when something was found.
    pub failure_page: Option<PathBuf>,
}

impl Summary {
    /// One line: what ran, the figures, and what was found.
    pub fn line(&self) -> String {
        let faults: Vec<String> = self.faults.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let ha = match &self.setting {
            Some(setting) => {
                let losses: Vec<String> = self.losses.iter().map(|(k, n)| format!("{k} {n}")).collect();
                let total: u64 = self.losses.values().sum();
                format!(" [{setting}]; losses {total} [{}]", losses.join(", "))
            }
            None => String::new(),
        };
        format!(
            "{:?}/{}{ha} seed {}: {} operations ({} unknown), faults [{}], {} histories checked, {} anomalies, {:.1} s",
            self.workload,
            self.backend.name(),
            self.seed,
            self.operations,
            self.unknown,
            faults.join(", "),
            self.histories,
            self.anomalies.len(),
            self.seconds
        )
        .to_lowercase()
    }
}

/// The harness's errors: it could not set a run up (the verdict on idem is in [`Summary::anomalies`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The `idem` binary is not where it was looked for.
    #[error("no idem binary at {}: build it first (cargo build -p idem --bin idem --features planted-bugs; scripts/verify.sh does)", path.display())]
    NoIdem {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// `idem serve` or `idem run` did not start.
    #[error("{0}")]
    Start(String),
    /// The options ask for something the run cannot do.
    #[error("{0}")]
    Usage(String),
    /// The backend could not be set up (missing programs, no port).
    #[error("cannot set up the backend: {0}")]
    Setup(String),
}

impl Error {
    /// An I/O error with what was being done.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }
}

/// Runs one workload on one backend and checks its history; writes the history (and, when something is found,
/// the failure page) under `opts.out`.
///
/// # Errors
/// When the run cannot be set up, or `opts` asks for what it cannot do ([`Error::Usage`]); what the checker finds is
/// in the summary.
pub async fn run(opts: &Options) -> Result<Summary, Error> {
    if opts.backend.is_ha() && !opts.only_faults.is_empty() {
        return Err(Error::Usage(format!(
            "--faults {} does not apply to {}: its one fault is --ha-fault's",
            FaultClass::names(&opts.only_faults),
            opts.backend.name()
        )));
    }
    // A directory of an earlier run (it has a summary) is replaced: its logs must not mix with this run's.
    if opts.out.join("summary.json").is_file() {
        std::fs::remove_dir_all(&opts.out).map_err(|e| Error::io(format!("clearing {}", opts.out.display()), e))?;
    }
    std::fs::create_dir_all(&opts.out).map_err(|e| Error::io(format!("creating {}", opts.out.display()), e))?;
    let started = std::time::Instant::now();
    let mut summary = match opts.workload {
        Workload::Kv => kv::run(opts).await?,
        Workload::Proxy => proxy::run(opts).await?,
        Workload::Runner => runner::run(opts).await?,
        Workload::Once => once::run(opts).await?,
    };
    summary.seconds = started.elapsed().as_secs_f64();
    if opts.backend.is_ha() {
        summary.setting = Some(backend::setting(opts.backend, opts.durable, opts.lax).to_owned());
    }
    let json = serde_json::to_string_pretty(&summary).unwrap_or_default();
    let _ = std::fs::write(opts.out.join("summary.json"), json);
    Ok(summary)
}

/// The environment of the idem processes of a run: the planted bug, when one is asked for.
pub fn idem_env(opts: &Options) -> Vec<(String, String)> {
    opts.planted_bug.iter().map(|b| (procs::PLANTED_BUG_VAR.to_owned(), b.clone())).collect()
}
