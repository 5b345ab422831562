//! The command the once workload's `idem once` invocations run: `idem-verify exec-slot`. It appends one line
//! when it starts, one every [`TICK`] while it runs and one when it ends to the executions log, naming the job,
//! the slot (`IDEM_SLOT`) or triggered run (`IDEM_TRIGGER_ID`), its invocation (the parent process) and the
//! time. Times are read from `/proc/uptime`, the system's clock since boot: an invocation run under
//! libfaketime (clock skew) passes its fake wall clock to its command, and the checker compares executions of
//! different invocations, so their times must come from one clock no invocation can skew.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How often a running command says it is still alive: a command killed (with its invocation, by the
/// watchdog, by a later slot's stop request) was alive at least until its last line.
pub const TICK: Duration = Duration::from_millis(100);

/// One line of the executions log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecLine {
    /// `start`, `tick` or `end`.
    pub ev: String,
    /// The job (`--job`).
    pub job: String,
    /// `IDEM_SLOT`: the slot's time (for a triggered run, the time it was requested).
    pub slot: String,
    /// `IDEM_TRIGGER_ID`, for a triggered run.
    pub trigger: Option<String>,
    /// `IDEM_ATTEMPT`.
    pub attempt: u64,
    /// `IDEM_FENCING_TOKEN`.
    pub token: u64,
    /// The `idem once` process that ran it (the command's parent); named `runner` as the runner workload's
    /// lines, so the nemesis's choice of the holder that started a command last reads both logs alike.
    pub runner: u32,
    /// This command's own process id: the lines of one execution.
    pub pid: u32,
    /// Microseconds since boot (`/proc/uptime`).
    pub t_us: u64,
}

impl ExecLine {
    /// The run this execution belongs to: `trigger ID` for a triggered run, else `slot TIME`.
    pub fn run_key(&self) -> String {
        match &self.trigger {
            Some(id) => format!("trigger {id}"),
            None => format!("slot {}", self.slot),
        }
    }
}

/// Microseconds since boot, from `/proc/uptime` (hundredths of a second; `None` where it cannot be read).
pub fn uptime_us() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/uptime").ok()?;
    let first = text.split_whitespace().next()?;
    let (secs, frac) = first.split_once('.').unwrap_or((first, "0"));
    let frac: String = frac.chars().chain(std::iter::repeat('0')).take(6).collect();
    Some(secs.parse::<u64>().ok()? * 1_000_000 + frac.parse::<u64>().ok()?)
}

/// How long the command for `run` (a slot or a trigger id) of `job` takes, in milliseconds: drawn from a hash
/// of the seed, the job and the run, so every execution of one run takes the same time, between `min` and `max`.
pub fn duration_ms(seed: u64, job: &str, run: &str, min: u64, max: u64) -> u64 {
    // FNV-1a: stable across builds and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in job.bytes().chain([0]).chain(run.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    min + h % (max.saturating_sub(min) + 1)
}

/// `exec-slot --log FILE --job J --seed N --min MS --max MS`; exit status 0, or 2 with a line on bad usage.
pub fn main(args: &[String]) -> std::process::ExitCode {
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem-verify exec-slot: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let get = |flag: &str| {
        args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned().ok_or(format!("{flag} is missing"))
    };
    let num = |flag: &str| get(flag)?.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
    let (log, job) = (PathBuf::from(get("--log")?), get("--job")?);
    let (seed, min, max) = (num("--seed")?, num("--min")?, num("--max")?);
    let env_u64 = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let mut line = ExecLine {
        ev: "start".into(),
        job: job.clone(),
        slot: std::env::var("IDEM_SLOT").unwrap_or_default(),
        // Set, empty, for a slot's run.
        trigger: std::env::var("IDEM_TRIGGER_ID").ok().filter(|id| !id.is_empty()),
        attempt: env_u64("IDEM_ATTEMPT"),
        token: env_u64("IDEM_FENCING_TOKEN"),
        runner: std::os::unix::process::parent_id(),
        pid: std::process::id(),
        t_us: uptime_us().ok_or("cannot read /proc/uptime")?,
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut append = |line: &ExecLine| -> Result<(), String> {
        let text = serde_json::to_string(line).map_err(|e| e.to_string())?;
        // One write of the whole line: appends from concurrent commands never interleave within a line.
        file.write_all(format!("{text}\n").as_bytes()).map_err(|e| e.to_string())
    };
    append(&line)?;
    let started = std::time::Instant::now();
    let length = Duration::from_millis(duration_ms(seed, &job, &line.run_key(), min, max));
    while started.elapsed() < length {
        std::thread::sleep(TICK.min(length.saturating_sub(started.elapsed())));
        line.ev = "tick".into();
        line.t_us = uptime_us().unwrap_or(line.t_us);
        append(&line)?;
    }
    line.ev = "end".into();
    line.t_us = uptime_us().unwrap_or(line.t_us);
    append(&line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_takes_the_same_time_in_every_execution_within_the_bounds() {
        let a = duration_ms(7, "j0", "slot 2026-12-05T18:00:00Z", 300, 3000);
        assert_eq!(a, duration_ms(7, "j0", "slot 2026-12-05T18:00:00Z", 300, 3000));
        assert!((300..=3000).contains(&a));
        let spread: std::collections::BTreeSet<u64> =
            (0..50).map(|i| duration_ms(7, "j0", &format!("slot {i}"), 300, 3000) / 500).collect();
        assert!(spread.len() >= 4, "durations spread over the range: {spread:?}");
    }

    #[test]
    fn uptime_is_read_in_microseconds() {
        let a = uptime_us().unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let b = uptime_us().unwrap();
        assert!(b >= a + 10_000 && b < a + 5_000_000, "{a} {b}");
    }
}
