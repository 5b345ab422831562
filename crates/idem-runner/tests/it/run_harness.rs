//! The harness of the `run_*` tests: a job in a temporary directory, run in this process on a [`MemoryStore`]
//! whose entry writes are kept ([`Watched`]), so a test reads an item's ledger history (each attempt's claim,
//! failure, done) and waits for a write instead of sleeping.
//!
//! Every command appends its item's id to the file `log` (O_APPEND, `>>`) before anything else, so
//! executions are counted exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use idem_core::ledger::{Entry, Keys};
use idem_runner::{ItemFormat, ProgressMode, RunConfig, Stop, Summary, run_checked};
use idem_store::{
    CounterOutcome, Error, Generation, Limits, MemoryStore, Page, Precondition, SetChange, SetOutcome, Store, Ttl,
    Versioned, Written,
};
use tokio::sync::watch;

/// One write of an item's ledger entry, as the store accepted it.
#[derive(Clone, Debug)]
pub struct EntryWrite {
    /// The entry's store key (`run/JOB/item/ID`).
    pub key: String,
    pub entry: Entry,
    /// The generation the write got: for a claim's count ([`Entry::Running`]), the attempt's fencing token.
    pub generation: Generation,
    /// When, by tokio's clock (paused in the tests of delays).
    pub at: tokio::time::Instant,
}

/// A store that keeps every accepted write of a ledger entry and says when one came.
#[derive(Clone)]
pub struct Watched<S = MemoryStore> {
    pub inner: S,
    writes: Arc<Mutex<Vec<EntryWrite>>>,
    changed: Arc<watch::Sender<usize>>,
}

impl<S> Watched<S> {
    pub fn new(inner: S) -> Self {
        Watched { inner, writes: Arc::default(), changed: Arc::new(watch::Sender::new(0)) }
    }

    /// The writes of `key`'s entry so far, oldest first.
    pub fn history(&self, key: &str) -> Vec<EntryWrite> {
        self.writes.lock().unwrap().iter().filter(|w| w.key == key).cloned().collect()
    }

    /// Waits (no timer: a paused clock does not move for it) for an accepted entry write that `wanted` picks,
    /// made before the call or after; returns it.
    pub async fn write_of(&self, mut wanted: impl FnMut(&EntryWrite) -> bool) -> EntryWrite {
        let mut changed = self.changed.subscribe();
        loop {
            if let Some(found) = self.writes.lock().unwrap().iter().find(|w| wanted(w)) {
                return found.clone();
            }
            changed.changed().await.unwrap();
        }
    }
}

impl<S: Store> Store for Watched<S> {
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    async fn get(&self, key: &str) -> Result<Option<Versioned>, Error> {
        self.inner.get(key).await
    }
    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, Error> {
        self.inner.get_many(keys).await
    }
    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, Error> {
        let written = self.inner.put(key, value.clone(), precondition, ttl).await?;
        if key.starts_with("run/")
            && key.contains("/item/")
            && let Ok(entry) = Entry::decode(&value)
        {
            let at = tokio::time::Instant::now();
            let write = EntryWrite { key: key.to_owned(), entry, generation: written.generation(), at };
            self.writes.lock().unwrap().push(write);
            self.changed.send_modify(|n| *n += 1);
        }
        Ok(written)
    }
    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, Error> {
        self.inner.delete(key, precondition).await
    }
    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, Error> {
        self.inner.list(prefix, cursor, limit).await
    }
    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, Error> {
        self.inner.set_change(key, change).await
    }
    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, Error> {
        self.inner.counter_add(key, delta, dedupe_id).await
    }
    async fn now(&self) -> Result<std::time::SystemTime, Error> {
        // The memory store's clock may be tokio's (`MemoryStore::with_tokio_clock`): its leases lapse by it.
        self.inner.now().await
    }
}

/// The longest a run of these tests may take before it counts as hung (real time).
pub const RUN_DEADLINE: Duration = Duration::from_secs(120);

/// A job in a temporary directory: items `items.jsonl` (JSON Lines, ids in the field `id`), the command a
/// shell script run in that directory with the item's id as `$1` and, with an output, the temporary output as
/// `$2`; a report in `report.json`.
pub struct Job {
    pub dir: tempfile::TempDir,
    pub cfg: RunConfig,
    pub store: Watched,
}

impl Job {
    /// A job writing `out/{id}.json` per item, on a fresh [`MemoryStore`] on the system clock.
    pub fn new(ids: &[&str], script: &str) -> Job {
        Job::on(MemoryStore::new(), ids, script, true)
    }

    /// A job without output files, named `name` (its items are done once their commands exit 0, or by
    /// `--check`).
    pub fn named(name: &str, ids: &[&str], script: &str) -> Job {
        Job::named_on(MemoryStore::new(), name, ids, script)
    }

    /// [`Job::named`] on `store` (e.g. [`MemoryStore::with_tokio_clock`]).
    pub fn named_on(store: MemoryStore, name: &str, ids: &[&str], script: &str) -> Job {
        let mut job = Job::on(store, ids, script, false);
        job.cfg.name = Some(name.to_owned());
        job
    }

    /// A job on `store`, with or without output files (without, it needs a name).
    pub fn on(store: MemoryStore, ids: &[&str], script: &str, output: bool) -> Job {
        let dir = tempfile::tempdir().unwrap();
        let (output, args) = match output {
            true => (dir.path().join("out/{id}.json").display().to_string(), &["{id}", "{out}"][..]),
            false => (String::new(), &["{id}"][..]),
        };
        let script = format!("cd '{}' || exit 99\necho \"$1\" >> log\n{script}", dir.path().display());
        let mut command = vec!["sh".to_owned(), "-c".to_owned(), script, "sh".to_owned()];
        command.extend(args.iter().map(|a| (*a).to_owned()));
        let mut cfg = RunConfig::new(dir.path().join("items.jsonl"), output, command);
        cfg.format = ItemFormat::JsonLines;
        cfg.id_field = Some("id".into());
        cfg.progress = ProgressMode::Off;
        cfg.report = Some(dir.path().join("report.json"));
        let job = Job { dir, cfg, store: Watched::new(store) };
        job.write_items(ids);
        job
    }

    /// Replaces the items file with one item per id, each line `{"id":"ID"}`.
    pub fn write_items(&self, ids: &[&str]) {
        std::fs::write(self.path("items.jsonl"), ids.iter().map(|id| line(id)).collect::<String>()).unwrap();
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// The job's name in the ledger.
    pub fn job(&self) -> String {
        self.cfg.job()
    }

    /// The store key of item `id`'s entry.
    pub fn key(&self, id: &str) -> String {
        Keys::new(&self.job(), id).entry().to_owned()
    }

    /// Runs the job to its end with its configuration (the report rewritten).
    pub async fn run(&self) -> Summary {
        self.run_with(self.cfg.clone(), Stop::new()).await
    }

    /// Runs `cfg` on this job's store until it ends, within [`RUN_DEADLINE`] of real time.
    pub async fn run_with(&self, cfg: RunConfig, stop: Stop) -> Summary {
        let run = start(self.store.clone(), cfg, stop);
        finished(run).await
    }

    /// Item `id`'s entry now.
    pub async fn entry(&self, id: &str) -> Option<Entry> {
        let stored = self.store.inner.get(&self.key(id)).await.unwrap()?;
        Some(Entry::decode(stored.value()).unwrap())
    }

    /// The writes of item `id`'s entry so far, oldest first.
    pub fn history(&self, id: &str) -> Vec<Entry> {
        self.store.history(&self.key(id)).into_iter().map(|w| w.entry).collect()
    }

    /// The ids the commands logged, one per execution, in the order they started.
    pub fn log(&self) -> Vec<String> {
        std::fs::read_to_string(self.path("log")).unwrap_or_default().lines().map(str::to_owned).collect()
    }

    /// Executions per item id.
    pub fn executions(&self) -> BTreeMap<String, usize> {
        let mut per = BTreeMap::new();
        for id in self.log() {
            *per.entry(id).or_default() += 1;
        }
        per
    }

    /// Every file under `out/` (names only).
    pub fn out_files(&self) -> BTreeSet<String> {
        match std::fs::read_dir(self.path("out")) {
            Ok(dir) => dir.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
            Err(_) => BTreeSet::new(),
        }
    }

    /// The report of the last run.
    pub fn report(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.cfg.report.as_ref().unwrap()).unwrap()).unwrap()
    }

    /// Item `id`'s line of the last run's report.
    pub fn reported(&self, id: &str) -> serde_json::Value {
        let report = self.report();
        let items = report["items"].as_array().unwrap();
        items.iter().find(|i| i["id"] == id).unwrap_or_else(|| panic!("{id} is not in {report}")).clone()
    }

    /// Item `id`'s status in the last run's report.
    pub fn status_of(&self, id: &str) -> String {
        self.reported(id)["status"].as_str().unwrap().to_owned()
    }
}

/// The items file's line of `id`.
pub fn line(id: &str) -> String {
    format!("{{\"id\":\"{id}\"}}\n")
}

/// `n` ids, `item-00000` on.
pub fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("item-{i:05}")).collect()
}

/// `ids` as the `&str`s [`Job::new`] takes.
pub fn strs(ids: &[String]) -> Vec<&str> {
    ids.iter().map(String::as_str).collect()
}

/// Starts a run of `cfg` on `store` in a task of its own. The configuration is checked in this task first
/// ([`RunConfig::checked`] reads the items file), so it works on a current-thread runtime, which a paused
/// clock needs ([`idem_runner::run`] checks in `block_in_place`, a multi-thread runtime's).
pub fn start<S: Store + Clone>(
    store: S,
    cfg: RunConfig,
    stop: Stop,
) -> tokio::task::JoinHandle<Result<Summary, idem_runner::Error>> {
    let checked = cfg.checked();
    tokio::spawn(async move { run_checked(store, checked?, stop).await })
}

/// The summary of a started run, once it ends (within [`RUN_DEADLINE`] of real time).
pub async fn finished(run: tokio::task::JoinHandle<Result<Summary, idem_runner::Error>>) -> Summary {
    within("the run to end", run).await.unwrap().unwrap()
}

/// `fut`'s output, once it is ready within [`RUN_DEADLINE`] of real time. The deadline is a thread's sleep, not
/// a timer of tokio's: a paused clock jumps ahead while the runtime waits for a command, and would run such a
/// timer out at once.
pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    let (late, deadline) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        std::thread::sleep(RUN_DEADLINE);
        let _ = late.send(());
    });
    tokio::select! {
        out = fut => out,
        _ = deadline => panic!("timed out waiting for {what} ({RUN_DEADLINE:?})"),
    }
}

/// Writes a valid JSON output (`$2`) naming its item.
pub const WRITE_JSON: &str = r#"printf '{"id": "%s", "ok": true}' "$1" > "$2""#;
