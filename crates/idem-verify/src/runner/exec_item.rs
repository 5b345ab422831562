//! The command the runner workload's `idem run` processes run for each item: `idem-verify exec-item`. It logs
//! the execution durably (one JSON line appended and fsynced before anything else), takes its time, then
//! writes the item's output naming its fencing token, so the checker knows which holder wrote a final file.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One execution of an item's command, as logged.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ItemRun {
    /// The item id.
    pub id: String,
    /// `IDEM_FENCING_TOKEN`: larger for every new holder of the item.
    pub token: u64,
    /// `IDEM_ATTEMPT`.
    pub attempt: u64,
    /// The `idem run` process that ran it (the command's parent).
    pub runner: u32,
    /// When it started, in milliseconds since the Unix epoch.
    pub start_ms: u64,
}

/// What an output file holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Output {
    /// The item id.
    pub id: String,
    /// The fencing token of the holder whose command wrote it.
    pub token: u64,
    /// The `idem run` process.
    pub runner: u32,
}

/// `exec-item --log FILE --id ID --out PATH --ms N`; exit status 0, or 2 with a line on bad usage.
pub fn main(args: &[String]) -> std::process::ExitCode {
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem-verify exec-item: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let get = |flag: &str| {
        args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned().ok_or(format!("{flag} is missing"))
    };
    let (log, id, out) = (PathBuf::from(get("--log")?), get("--id")?, PathBuf::from(get("--out")?));
    let ms: u64 = get("--ms")?.parse().map_err(|e| format!("--ms: {e}"))?;
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let run = ItemRun {
        id: id.clone(),
        token: env("IDEM_FENCING_TOKEN"),
        attempt: env("IDEM_ATTEMPT"),
        runner: std::os::unix::process::parent_id(),
        start_ms: u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis())
            .unwrap_or(0),
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let line = serde_json::to_string(&run).map_err(|e| e.to_string())?;
    // One write of the whole line: appends from concurrent commands never interleave within a line.
    file.write_all(format!("{line}\n").as_bytes()).map_err(|e| e.to_string())?;
    file.sync_data().map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_millis(ms));
    let output = Output { id, token: run.token, runner: run.runner };
    std::fs::write(&out, serde_json::to_vec(&output).map_err(|e| e.to_string())?)
        .map_err(|e| format!("{}: {e}", out.display()))
}
