//! `idem bench`: durable conditional updates per second through the embedded store, against the
//! one-fsync-per-write ceiling measured in the same run on the same disk.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_store::{Decision, Limits, Precondition, RetryPolicy, Store, StoreExt, Ttl};

use crate::error::Error;
use idem_backends::{AnyStore, StoreUrl};
use idem_core::redact_url as redact;

/// Flags of `idem bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Directory for the benchmark's files (on the disk you want measured); removed afterwards.
    #[arg(long, default_value = "./idem-bench")]
    dir: PathBuf,
    /// Seconds per case.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Concurrent writer counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    writers: Vec<usize>,
    /// Bytes per value (and per record in the fsync loop).
    #[arg(long, default_value_t = 128)]
    value_bytes: usize,
    /// Measure this store instead of a fresh SQLite file per case: postgres://… or redis://… (each case then
    /// uses keys of its own).
    #[arg(long)]
    store: Option<String>,
    /// PostgreSQL schema / Redis key prefix for --store.
    #[arg(long, default_value = "idem_bench")]
    namespace: String,
}

/// Writes one record and fsyncs it, over and over: what a store that fsyncs every write could reach at best.
fn fsync_ceiling(dir: &Path, value_bytes: usize, secs: Duration) -> Result<f64, Error> {
    let path = dir.join("fsync-ceiling.dat");
    let mut f = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
    let record = vec![b'x'; value_bytes];
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < secs {
        f.write_all(&record)?;
        f.sync_all()?;
        n += 1;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    std::fs::remove_file(&path)?;
    Ok(rate)
}

#[derive(Clone, Copy, Debug)]
enum Keys {
    Distinct,
    Hot,
}

/// Successful compare-and-swap writes per second, and how many attempts lost a race.
async fn store_case(
    store: &AnyStore,
    keys: Keys,
    writers: usize,
    value_bytes: usize,
    secs: Duration,
) -> Result<(f64, u64), Error> {
    // Keys of this case only, so cases sharing a database never see each other's values.
    let case = format!("bench/{keys:?}-{writers}-{:08x}", rand::random::<u32>());
    let value = Bytes::from(vec![b'v'; value_bytes]);
    let done = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + secs;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (store, value, done, conflicts, case) =
            (store.clone(), value.clone(), done.clone(), conflicts.clone(), case.clone());
        tasks.push(tokio::spawn(async move {
            match keys {
                Keys::Distinct => {
                    let key = format!("{case}/{w}");
                    let mut g = store.put(&key, value.clone(), Precondition::Absent, Ttl::Keep).await?.generation();
                    while Instant::now() < deadline {
                        g = store.put(&key, value.clone(), Precondition::Generation(g), Ttl::Keep).await?.generation();
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Keys::Hot => {
                    let policy =
                        RetryPolicy::default().with_max_attempts(10_000).with_base_delay(Duration::from_micros(200));
                    while Instant::now() < deadline {
                        let out = store
                            .update(&format!("{case}/hot"), |_| Decision::<()>::Put(value.clone()), &policy)
                            .await?;
                        if let idem_store::Updated::Put { attempts, .. } = out {
                            conflicts.fetch_add(u64::from(attempts - 1), Ordering::Relaxed);
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Ok::<(), idem_store::Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| Error::Failed(e.to_string()))??;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    Ok((rate, conflicts.load(Ordering::Relaxed)))
}

/// Runs the benchmark and prints a Markdown table.
///
/// # Errors
/// [`Error::Io`] for the benchmark directory; store errors.
pub async fn run(args: BenchArgs) -> Result<(), Error> {
    let secs = Duration::from_secs_f64(args.seconds);
    crate::error::out("| case | writers | updates/s | x baseline | lost races |\n|---|---:|---:|---:|---:|\n")?;
    let ceiling = match &args.store {
        None => {
            std::fs::create_dir_all(&args.dir)?;
            let c = fsync_ceiling(&args.dir, args.value_bytes, secs)?;
            crate::error::out(&format!("| write+fsync loop (baseline) | 1 | {c:.0} | 1.00 | - |\n"))?;
            Some(c)
        }
        Some(_) => None,
    };
    for keys in [Keys::Distinct, Keys::Hot] {
        for &w in &args.writers {
            // The embedded store gets a fresh file per case; a shared database, fresh keys per case.
            let (store, file) = match &args.store {
                None => {
                    let path = args.dir.join(format!("bench-{keys:?}-{w}.db"));
                    let url = StoreUrl::Sqlite(path.clone());
                    (AnyStore::open(&url, &args.namespace, Limits::default()).await?, Some(path))
                }
                Some(url) => (AnyStore::open(&StoreUrl::parse(url)?, &args.namespace, Limits::default()).await?, None),
            };
            let (rate, conflicts) = store_case(&store, keys, w, args.value_bytes, secs).await?;
            store.close().await;
            drop(store);
            if let Some(path) = file {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
            }
            let name = match keys {
                Keys::Distinct => "CAS put, distinct keys",
                Keys::Hot => "update(), one hot key",
            };
            let ratio = ceiling.map_or_else(|| "-".to_owned(), |c| format!("{:.2}", rate / c));
            crate::error::out(&format!("| {name} | {w} | {rate:.0} | {ratio} | {conflicts} |\n"))?;
        }
    }
    let store = args.store.as_deref().map_or_else(|| format!("sqlite in {}", args.dir.display()), redact);
    crate::error::out(&format!(
        "\ndurable conditional updates/s through {store} ({} B values, {:.1} s per case)\n",
        args.value_bytes, args.seconds
    ))?;
    if args.store.is_none() {
        let _ = std::fs::remove_dir(&args.dir);
    }
    Ok(())
}
