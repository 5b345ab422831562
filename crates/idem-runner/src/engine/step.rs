//! The types the steps of an item pass between them: where it is ([`Step`]), its state across them
//! ([`ItemRun`]), and how one attempt ended ([`Attempt`]).

use std::path::PathBuf;

use idem_core::ledger::{Entry, Keys};
use idem_store::Generation;
use tokio::sync::SemaphorePermit;

use super::outcome::Final;
use super::room::Room;
use super::turns::Turn;
use crate::items::Item;
use crate::output::Digest256;

/// Where an item is between its steps, the way `idem_core::ledger::Plan` says what its ledger entry needs.
#[derive(Debug)]
pub(super) enum Step {
    /// Read its entry (again) and judge it: first, and after a write refused by its precondition, a lease
    /// lost, or a failure with attempts left.
    Judge,
    /// Another runner holds it: pause, then judge it again.
    WaitForHolder,
    /// It needs running: claim it over the entry it was judged on (with that entry's generation; `None` when
    /// it had none), wait for a slot, run one attempt and record it.
    Run(Option<(Generation, Entry)>),
    /// It ended in this run.
    End(Final),
}

/// An entry read ahead for an item: `Some(read)` saves the item its first ledger read.
pub(super) type Prefetched = Option<Option<idem_store::Versioned>>;

/// One item's state across its steps.
pub(super) struct ItemRun<'a> {
    /// The item.
    pub(super) item: &'a Item,
    /// Its ledger keys.
    pub(super) keys: Keys,
    /// Its final output path; `None` for a job without output files ([`crate::DoneBy`]), whose items no file
    /// handling ever reaches.
    pub(super) output: Option<PathBuf>,
    /// Its entry read ahead with its chunk, used by the first judgement.
    pub(super) prefetched: Prefetched,
    /// Counted in the progress's `waiting` (another runner holds it), until it is claimed or ends.
    pub(super) waiting: bool,
    /// The SHA-256 of its text ([`crate::items::text_sha256`]), recorded in its entries.
    pub(super) text_sha256: String,
    /// Its entry was already found recorded for another text, and said so (warned once per item).
    pub(super) text_warned: bool,
    /// Its slot, kept across a retry, so a failing item is retried (and found poison) before others start.
    pub(super) permit: Option<SemaphorePermit<'a>>,
    /// From a queue: the room its message takes among those the run holds, given up while another runner
    /// holds the item ([`Room::set_aside`]).
    pub(super) room: Option<Room>,
    /// Its place in the input order until it has queued for a claim ([`super::turns`]).
    pub(super) turn: Option<Turn>,
}

/// How one attempt ended.
pub(super) enum Attempt {
    Ok(Digest256),
    /// `--check` found the item's effect there before the command: no command ran; recorded done.
    AlreadyThere,
    Failed {
        ending: String,
        stderr: Vec<u8>,
        message: String,
    },
    Lost,
    /// The command was stopped for its lease and killed once the store stayed unavailable past the limit: the
    /// run ends, and the attempt counts (the ledger could not be told otherwise).
    Abandoned,
    /// The output is verified, but the store stayed unreachable past the limit before it could be renamed into
    /// place: it stays at its temporary path with a note of its digest, for the next holder.
    Unrecorded,
    /// The run stopped before the command could start: nothing ran.
    NotStarted,
    /// The command ran and was killed by a second Ctrl-C or SIGTERM: it may have written anything.
    Interrupted,
}

pub(super) fn failed(ending: impl Into<String>, stderr: Vec<u8>) -> Attempt {
    let ending = ending.into();
    let text = String::from_utf8_lossy(&stderr);
    let last = text.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("");
    let message = if last.is_empty() { ending.clone() } else { format!("{ending}: {last}") };
    Attempt::Failed { ending, stderr, message }
}

/// A command's ending in words: `exit N` or `signal N`.
pub(super) fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        (None, None) => "unknown ending".into(),
    }
}
