//! `idem bench`: durable conditional updates per second through the embedded store, against the
//! one-fsync-per-write ceiling measured in the same run on the same disk.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_sqlite::SqliteStore;
use idem_store::{Decision, Limits, Precondition, RetryPolicy, Store, StoreExt, Ttl};

use crate::error::Error;

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
    dir: &Path,
    keys: Keys,
    writers: usize,
    value_bytes: usize,
    secs: Duration,
) -> Result<(f64, u64), Error> {
    let path = dir.join(format!("bench-{keys:?}-{writers}.db"));
    let store = SqliteStore::open(&path, Limits::default()).map_err(|e| Error::Failed(e.to_string()))?;
    let value = Bytes::from(vec![b'v'; value_bytes]);
    let done = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + secs;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (store, value, done, conflicts) = (store.clone(), value.clone(), done.clone(), conflicts.clone());
        tasks.push(tokio::spawn(async move {
            match keys {
                Keys::Distinct => {
                    let key = format!("bench/{w}");
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
                        let out = store.update("bench/hot", |_| Decision::<()>::Put(value.clone()), &policy).await?;
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
    store.close().await;
    drop(store);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok((rate, conflicts.load(Ordering::Relaxed)))
}

/// Runs the benchmark and prints a Markdown table.
///
/// # Errors
/// [`Error::Io`] for the benchmark directory; store errors.
pub async fn run(args: BenchArgs) -> Result<(), Error> {
    std::fs::create_dir_all(&args.dir)?;
    let secs = Duration::from_secs_f64(args.seconds);
    let ceiling = fsync_ceiling(&args.dir, args.value_bytes, secs)?;
    println!(
        "durable conditional updates/s through idem-sqlite ({} B values, {:.1} s per case, dir {})",
        args.value_bytes,
        args.seconds,
        args.dir.display()
    );
    println!();
    println!("| case | writers | updates/s | x fsync ceiling | lost races |");
    println!("|---|---:|---:|---:|---:|");
    println!("| write+fsync loop (ceiling) | 1 | {ceiling:.0} | 1.00 | - |");
    for keys in [Keys::Distinct, Keys::Hot] {
        for &w in &args.writers {
            let (rate, conflicts) = store_case(&args.dir, keys, w, args.value_bytes, secs).await?;
            let name = match keys {
                Keys::Distinct => "CAS put, distinct keys",
                Keys::Hot => "update(), one hot key",
            };
            println!("| {name} | {w} | {rate:.0} | {:.2} | {conflicts} |", rate / ceiling);
        }
    }
    let _ = std::fs::remove_dir(&args.dir);
    Ok(())
}
