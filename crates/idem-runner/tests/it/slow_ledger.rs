//! The runner against a ledger that does not answer a lease renewal: the command's exit, `--timeout` and a
//! second Ctrl-C must still be acted on at once, and a refused renewal must still stop the command.
//!
//! The ledger is a [`MemoryStore`] whose renewals of one item's lease wait at a gate the test opens, the way
//! they would on a paused PostgreSQL or a partitioned Redis; everything else answers at once. Nothing sleeps to
//! wait for a race: each step waits (with a deadline) for the event it needs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::ledger::{self, Entry};
use idem_runner::{ItemFormat, ProgressMode, RunConfig, RunStatus, Stop, Summary, job_id, run};
use idem_store::{
    CounterOutcome, Error, Generation, Limits, MemoryStore, Page, Precondition, SetChange, SetOutcome, Store, Ttl,
    Versioned, Written,
};
use tokio::sync::watch;

/// A [`MemoryStore`] whose renewals (fenced puts) of one item's lease wait until `open` turns true.
///
/// Like the shared SQLite ledger of `idem run` (`crates/idem/src/shared_sqlite.rs`), every operation holds a
/// read guard of `lock` while it runs, a waiting renewal too; that ledger takes the write guard to give the
/// file to another process, and [`Job::take_turn`] does the same.
#[derive(Clone)]
struct GatedRenewals {
    inner: MemoryStore,
    lock: Arc<tokio::sync::RwLock<()>>,
    job: String,
    /// The item whose lease renewals wait: this one, or (`None`) the one whose id is in the file `first`.
    gated: Option<String>,
    first: PathBuf,
    open: watch::Receiver<bool>,
    /// Renewals that reached the gate.
    arrived: Arc<AtomicUsize>,
}

impl GatedRenewals {
    fn gated_key(&self) -> String {
        let id = match &self.gated {
            Some(id) => id.clone(),
            None => std::fs::read_to_string(&self.first).unwrap_or_default().trim().to_owned(),
        };
        ledger::Keys::new(&self.job, &id).lease().to_owned()
    }
}

impl Store for GatedRenewals {
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    async fn get(&self, key: &str) -> Result<Option<Versioned>, Error> {
        let _turn = self.lock.read().await;
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, Error> {
        let _turn = self.lock.read().await;
        if matches!(precondition, Precondition::Generation(_)) && key == self.gated_key() {
            self.arrived.fetch_add(1, Ordering::SeqCst);
            let _ = self.open.clone().wait_for(|open| *open).await;
        }
        self.inner.put(key, value, precondition, ttl).await
    }
    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, Error> {
        let _turn = self.lock.read().await;
        self.inner.delete(key, precondition).await
    }
    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, Error> {
        let _turn = self.lock.read().await;
        self.inner.list(prefix, cursor, limit).await
    }
    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, Error> {
        let _turn = self.lock.read().await;
        self.inner.set_change(key, change).await
    }
    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, Error> {
        let _turn = self.lock.read().await;
        self.inner.counter_add(key, delta, dedupe_id).await
    }
}

/// Lease of every test: its first renewal is due after 2 s, it lapses 6 s after the claim.
const LEASE: Duration = Duration::from_secs(6);

/// A job in a temporary directory whose items are `ids` and whose command is the shell `script` (`$1` the id,
/// `$2` the temporary output), run in that directory; renewals of `gated`'s lease (`None`: of the item whose id
/// the commands wrote to the file `first`) wait for [`Job::open`].
struct Job {
    dir: tempfile::TempDir,
    cfg: RunConfig,
    store: GatedRenewals,
    open: watch::Sender<bool>,
    stop: Stop,
}

impl Job {
    fn new(ids: &[&str], gated: Option<&str>, script: &str) -> Job {
        let dir = tempfile::tempdir().unwrap();
        let items: String = ids.iter().map(|id| format!("{{\"id\":\"{id}\"}}\n")).collect();
        std::fs::write(dir.path().join("items.jsonl"), items).unwrap();
        let output = dir.path().join("out/{id}.json").display().to_string();
        let script = format!("cd {}\n{script}", dir.path().display());
        let command = ["sh", "-c", &script, "sh", "{id}", "{out}"].map(String::from).to_vec();
        let mut cfg = RunConfig::new(dir.path().join("items.jsonl"), output.clone(), command);
        cfg.format = ItemFormat::JsonLines;
        cfg.id_field = Some("id".into());
        cfg.lease = LEASE;
        cfg.progress = ProgressMode::Off;
        cfg.report = Some(dir.path().join("report.json"));
        let (open, rx) = watch::channel(false);
        let store = GatedRenewals {
            inner: MemoryStore::new(),
            lock: Arc::default(),
            job: job_id(&output),
            gated: gated.map(str::to_owned),
            first: dir.path().join("first"),
            open: rx,
            arrived: Arc::default(),
        };
        Job { dir, cfg, store, open, stop: Stop::new() }
    }

    fn path(&self, p: &str) -> std::path::PathBuf {
        self.dir.path().join(p)
    }

    fn start(&self) -> tokio::task::JoinHandle<Result<Summary, idem_runner::Error>> {
        tokio::spawn(run(self.store.clone(), self.cfg.clone(), self.stop.clone()))
    }

    /// Waits until a renewal of the gated lease is held at the gate.
    async fn renewal_held(&self) {
        wait_for("a renewal to reach the gate", Duration::from_secs(20), || {
            self.store.arrived.load(Ordering::SeqCst) > 0
        })
        .await;
    }

    /// Takes the ledger's write guard once and lets it go, as the shared SQLite ledger does to give the file to
    /// another process: from now on every operation waits behind it until it has had its turn.
    fn take_turn(&self) -> tokio::task::JoinHandle<()> {
        let lock = Arc::clone(&self.store.lock);
        tokio::spawn(async move { drop(lock.write().await) })
    }

    fn arrived(&self) -> usize {
        self.store.arrived.load(Ordering::SeqCst)
    }

    fn open(&self) {
        self.open.send_replace(true);
    }

    fn last_error(&self, id: &str) -> serde_json::Value {
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.path("report.json")).unwrap()).unwrap();
        let item = report["items"].as_array().unwrap().iter().find(|i| i["id"] == id).unwrap().clone();
        item["last_error"].clone()
    }

    async fn entry(&self, id: &str) -> Entry {
        let key = ledger::Keys::new(&job_id(&self.cfg.output), id).entry().to_owned();
        Entry::decode(self.store.inner.get(&key).await.unwrap().unwrap().value()).unwrap()
    }
}

async fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The pid a command wrote to `file` once it exists.
async fn pid_in(file: &Path) -> u32 {
    wait_for("the command to start", Duration::from_secs(20), || {
        std::fs::read_to_string(file).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    std::fs::read_to_string(file).unwrap().trim().parse().unwrap()
}

/// Whether a process exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
}

/// Well inside the lease's lapse (6 s after the claim, 4 s after the renewal is held): what must happen at once
/// must have happened by then, so it is not the lapse that did it.
const AT_ONCE: Duration = Duration::from_millis(2500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_exits_frees_its_slot_while_its_lease_renewal_hangs() {
    // One slot. The first command outlives its first renewal and exits while that renewal hangs; the other
    // (its renewals unhindered) can only start once that exit is noticed and the slot given back.
    let job = Job::new(
        &["a", "b"],
        None,
        r#"if mkdir first.d 2>/dev/null; then echo "$1" > first; echo "$1" >> started; sleep 3; else echo "$1" >> started; fi
echo "{\"id\": \"$1\"}" > "$2""#,
    );
    let started = || std::fs::read_to_string(job.path("started")).unwrap_or_default().lines().count();
    let run = job.start();
    job.renewal_held().await;
    assert_eq!(started(), 1);
    // The first command exits about 1 s after its renewal went out: then the second starts, the renewal still
    // unanswered.
    wait_for(
        "the second command to start while the first one's renewal hangs",
        Duration::from_secs(1) + AT_ONCE,
        || started() == 2,
    )
    .await;
    job.open();
    let summary = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap().unwrap();
    assert_eq!((summary.done, summary.executions, summary.status()), (2, 2, RunStatus::AllDone));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_is_kept_while_a_lease_renewal_hangs() {
    let mut job = Job::new(&["a"], Some("a"), r#"echo $$ > pid.tmp; mv pid.tmp pid; exec sleep 30"#);
    job.cfg.timeout = Some(Duration::from_secs(3));
    job.cfg.retries = 0;
    let run = job.start();
    let pid = pid_in(&job.path("pid")).await;
    job.renewal_held().await;
    // The timeout is due about 1 s after the renewal went out.
    wait_for("the timeout to kill the command", Duration::from_secs(1) + AT_ONCE, || !alive(pid)).await;
    let summary = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap().unwrap();
    job.open();
    assert_eq!((summary.failed, summary.executions, summary.status()), (1, 1, RunStatus::Failed));
    assert_eq!(job.last_error("a"), "timeout", "the attempt did not end by its timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_is_kept_while_a_lease_renewal_hangs() {
    let job = Job::new(&["a"], Some("a"), r#"echo $$ > pid.tmp; mv pid.tmp pid; exec sleep 30"#);
    let run = job.start();
    let pid = pid_in(&job.path("pid")).await;
    job.renewal_held().await;
    job.stop.request();
    job.stop.request();
    wait_for("the second Ctrl-C to kill the command", AT_ONCE, || !alive(pid)).await;
    let summary = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap().unwrap();
    job.open();
    assert_eq!((summary.not_done, summary.executions, summary.status()), (1, 1, RunStatus::Interrupted));
    assert!(matches!(job.entry("a").await, Entry::Interrupted { attempt: 1, .. }), "{:?}", job.entry("a").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_renewal_still_stops_the_command() {
    let job = Job::new(&["a"], Some("a"), r#"echo $$ > pid.tmp; mv pid.tmp pid; exec sleep 30"#);
    let run = job.start();
    let pid = pid_in(&job.path("pid")).await;
    job.renewal_held().await;
    // Another runner takes the item over while the renewal is on its way: the renewal is refused. A takeover
    // is the other runner's lease and then its count, which moves the entry on (a foreign lease alone, without
    // the count, is waited for: it may be a claim made on a stale view, given back at once).
    let lease = job.store.gated_key();
    job.store.inner.delete(&lease, Precondition::Any).await.unwrap();
    job.store.inner.put(&lease, Bytes::from("another runner"), Precondition::Absent, Ttl::After(LEASE)).await.unwrap();
    let entry = ledger::Keys::new(&job_id(&job.cfg.output), "a").entry().to_owned();
    let counted = job.store.inner.get(&entry).await.unwrap().expect("the entry of the running attempt");
    job.store.inner.put(&entry, counted.value().clone(), Precondition::Any, Ttl::Clear).await.unwrap();
    job.open();
    wait_for("the refused renewal to kill the command", AT_ONCE, || !alive(pid)).await;
    // It waits for the other runner now; stop it there.
    job.stop.request();
    let summary = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap().unwrap();
    assert_eq!((summary.done, summary.executions, summary.status()), (0, 1, RunStatus::Interrupted));
}

/// A lease another runner holds without having counted an attempt (a claim made on a stale view of the entry,
/// given back a moment later) takes nothing over: the holder, whose renewal that lease refused, waits for the
/// entry to move or the lease to go, takes its lease again, and its command runs to the end, once. Before, it
/// counted as taken over at once: the command was killed and the item ran a second time (seen after a SQLite
/// ledger was locked longer than a lease, when claims queued behind the lock landed on lapsed leases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_lease_without_a_count_takes_nothing_over() {
    let job = Job::new(&["a"], Some("a"), r#"echo "$1" >> started; sleep 2; echo "{\"id\": \"$1\"}" > "$2""#);
    let run = job.start();
    job.renewal_held().await;
    let lease = job.store.gated_key();
    job.store.inner.delete(&lease, Precondition::Any).await.unwrap();
    job.store.inner.put(&lease, Bytes::from("another runner"), Precondition::Absent, Ttl::After(LEASE)).await.unwrap();
    job.open();
    // The other runner finds the entry changed since its judgement and gives its lease back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    job.store.inner.delete(&lease, Precondition::Any).await.unwrap();
    let summary = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap().unwrap();
    let started = std::fs::read_to_string(job.path("started")).unwrap_or_default();
    assert_eq!(started.lines().count(), 1, "the command ran again: {started:?}");
    assert_eq!((summary.done, summary.executions, summary.status()), (1, 1, RunStatus::AllDone));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_unanswered_at_the_lapse_is_waited_for_and_holds_nothing_the_ledger_needs() {
    // The first attempt times out while its renewal hangs holding the ledger's read guard, with the ledger's
    // turn taking queued behind it. The renewal is kept past the lapse (`keeping_late_answers`: conditional, so
    // an acceptance means nobody took over) and the runner waits for its answer before any other ledger
    // operation of the item. Left in flight unpolled while the runner recorded the timeout behind the queued
    // turn it would be a deadlock (seen with the shared SQLite ledger); waited for, it is not: once the store
    // answers, the turn comes, the timeout is recorded and the retry renews its own lease.
    let mut job = Job::new(&["a"], Some("a"), r#"echo $$ > pid.tmp; mv pid.tmp pid; exec sleep 30"#);
    job.cfg.timeout = Some(Duration::from_secs(3));
    job.cfg.retries = 1;
    let run = job.start();
    let pid = pid_in(&job.path("pid")).await;
    job.renewal_held().await;
    let turn = job.take_turn();
    // The timeout is acted on while the renewal still waits.
    wait_for("the timeout to kill the command", Duration::from_secs(10), || !alive(pid)).await;
    assert_eq!(job.arrived(), 1);
    job.open();
    wait_for("the retry's renewal", Duration::from_secs(20), || job.arrived() >= 2).await;
    assert!(turn.is_finished(), "the ledger's turn never came");
    assert!(matches!(job.entry("a").await, Entry::Running { attempt: 2, .. }), "{:?}", job.entry("a").await);
    job.stop.request();
    job.stop.request();
    let summary = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap().unwrap();
    assert_eq!((summary.executions, summary.status()), (2, RunStatus::Interrupted));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_lease_never_stops_the_command() {
    // Every renewal is answered at once: the command must never be stopped for its lease. The guard once read
    // the deadline of the lease as it was at the start of a turn of its wait, which renewals (accepted inside
    // that turn) had moved: it stopped the command once per renewal period, a margin before the stale lapse.
    let mut job = Job::new(&["a"], Some("none"), r#"sleep 4; echo "{\"id\": \"$1\"}" > "$2""#);
    job.cfg.lease = Duration::from_secs(1);
    job.open();
    let run = job.start();
    let summary = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap().unwrap();
    assert_eq!((summary.done, summary.executions, summary.status()), (1, 1, RunStatus::AllDone));
    assert_eq!(summary.stopped, 0, "a command whose lease was renewed in time was stopped");
}
