//! Progress on standard error: an indicatif bar on a terminal, a plain line every few seconds otherwise.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::ProgressMode;

/// Live counts shared by the item tasks and the display.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Items finished by running them (for a dry run: items listed).
    pub done: AtomicU64,
    /// Items already done or adopted.
    pub skipped: AtomicU64,
    /// Items that ended failed or poison.
    pub failed: AtomicU64,
    /// Commands running now.
    pub running: AtomicU64,
    /// Items waiting on another runner's lease.
    pub waiting: AtomicU64,
    /// Attempts that failed (each may be retried).
    pub attempts_failed: AtomicU64,
    /// Commands stopped (SIGSTOP) because no lease renewal was accepted in time.
    pub stopped: AtomicU64,
}

impl Counters {
    fn finished(&self) -> u64 {
        self.done.load(Ordering::Relaxed) + self.skipped.load(Ordering::Relaxed) + self.failed.load(Ordering::Relaxed)
    }

    fn line(&self) -> String {
        format!(
            "done {}, skipped {}, running {}, failed {}{}",
            self.done.load(Ordering::Relaxed),
            self.skipped.load(Ordering::Relaxed),
            self.running.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            match self.waiting.load(Ordering::Relaxed) {
                0 => String::new(),
                n => format!(", waiting on other runners {n}"),
            }
        )
    }
}

/// The display task; [`Progress::finish`] stops it.
pub(crate) struct Progress {
    task: Option<(tokio::task::JoinHandle<()>, tokio::sync::oneshot::Sender<()>)>,
}

/// How often the plain (non-terminal) progress line is printed.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

impl Progress {
    /// Starts the display; `total` is `None` when it is not known ahead (a stream or a queue).
    pub(crate) fn start(mode: ProgressMode, total: Option<u64>, counters: Arc<Counters>, dry_run: bool) -> Self {
        if mode == ProgressMode::Off || dry_run {
            return Self { task: None };
        }
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let terminal = std::io::stderr().is_terminal();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let bar = terminal.then(|| {
                let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
                let template = match total {
                    Some(_) => "{bar:30.cyan/blue} {pos}/{len} {msg} · {per_sec} · ETA {eta}",
                    None => "{spinner} {pos} {msg} · {per_sec}",
                };
                let style = ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
                bar.set_style(style);
                bar
            });
            let tick = if terminal { Duration::from_millis(200) } else { PLAIN_EVERY };
            loop {
                tokio::select! {
                    () = tokio::time::sleep(tick) => {}
                    _ = &mut rx => break,
                }
                let finished = counters.finished();
                match &bar {
                    Some(bar) => {
                        bar.set_position(finished);
                        bar.set_message(counters.line());
                    }
                    None => {
                        let secs = started.elapsed().as_secs_f64().max(0.001);
                        let of = total.map(|t| format!("/{t}")).unwrap_or_default();
                        // Not eprintln!, which panics on a closed standard error (`2>&1 | head -1`): the
                        // line is dropped and the run goes on.
                        let line = format!(
                            "idem run: {finished}{of} finished ({}), {:.1} items/s\n",
                            counters.line(),
                            finished as f64 / secs
                        );
                        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
                    }
                }
            }
            if let Some(bar) = bar {
                bar.set_position(counters.finished());
                bar.finish_and_clear();
            }
        });
        Self { task: Some((task, tx)) }
    }

    pub(crate) async fn finish(self) {
        if let Some((task, tx)) = self.task {
            let _ = tx.send(());
            let _ = task.await;
        }
    }
}
