//! Output files: where they go, how they are checked, and how they are put in place.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// What an output must satisfy besides existing and being non-empty.
#[derive(Clone, Debug, Default)]
pub struct Checks {
    /// Parse as JSON (outputs whose path ends in `.json`).
    pub json: bool,
    /// Top-level fields a JSON object output must have.
    pub expect_fields: Vec<String>,
}

/// A verified output's digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digest256 {
    /// Lowercase hex SHA-256.
    pub sha256: String,
    /// Length in bytes.
    pub size: u64,
}

impl Digest256 {
    /// What a job without output files records as an item's output: the SHA-256 of nothing, 0 bytes.
    pub fn nothing() -> Self {
        use sha2::Digest as _;
        Self { sha256: hex::encode(sha2::Sha256::digest(b"")), size: 0 }
    }
}

/// Why an output does not verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// No file.
    Missing,
    /// Zero bytes.
    Empty,
    /// Not JSON (truncated or garbled).
    NotJson,
    /// JSON without a field `--expect-fields` names.
    MissingField(String),
    /// Could not be read.
    Unreadable(String),
    /// Not what the ledger recorded as done (another length or digest).
    Changed(String),
}

impl Invalid {
    /// What the command's author can do about it, in one clause (for an attempt's error; `{out}` is the
    /// placeholder of the temporary path in the command).
    pub fn remedy(&self) -> &'static str {
        match self {
            Invalid::Missing => {
                "the command must write its result to {out} (also in $IDEM_OUTPUT), the temporary path; its \
                 standard output is discarded"
            }
            Invalid::Empty => "the command must write its result to {out}; an empty file does not count",
            Invalid::NotJson => "an --output ending in .json must hold JSON: write JSON to {out}, or name it otherwise",
            Invalid::MissingField(_) => "write the field, or leave it out of --expect-fields",
            Invalid::Unreadable(_) => "the runner must be able to read what the command writes to {out}",
            Invalid::Changed(_) => "the item runs again",
        }
    }
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Missing => f.write_str("no output"),
            Invalid::Empty => f.write_str("empty output"),
            Invalid::NotJson => f.write_str("output is not valid JSON"),
            Invalid::MissingField(name) => write!(f, "output lacks field {name:?}"),
            Invalid::Unreadable(e) => write!(f, "output unreadable: {e}"),
            Invalid::Changed(how) => f.write_str(how),
        }
    }
}

/// Reads `path` whole and checks it (blocking I/O): returns its SHA-256 and length when it verifies.
///
/// # Errors
/// The [`Invalid`] reason: missing, empty, not JSON, a field missing, unreadable.
pub fn verify(path: &Path, checks: &Checks) -> Result<Digest256, Invalid> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Invalid::Missing),
        Err(e) => return Err(Invalid::Unreadable(e.to_string())),
    };
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(|e| Invalid::Unreadable(e.to_string()))?;
    if bytes.is_empty() {
        return Err(Invalid::Empty);
    }
    if checks.json || !checks.expect_fields.is_empty() {
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|_| Invalid::NotJson)?;
        for field in &checks.expect_fields {
            if value.get(field).is_none() {
                return Err(Invalid::MissingField(field.clone()));
            }
        }
    }
    Ok(digest(&bytes))
}

/// Whether `path` still holds exactly the output the ledger recorded (blocking I/O). Cheaper than
/// [`verify`]: the content was verified when it was recorded, so an equal length and digest are enough.
///
/// # Errors
/// The [`Invalid`] reason: missing, unreadable, or changed (another length or digest).
pub fn matches(path: &Path, expected: &Digest256) -> Result<(), Invalid> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Invalid::Missing),
        Err(e) => return Err(Invalid::Unreadable(e.to_string())),
    };
    if meta.len() != expected.size {
        return Err(Invalid::Changed(format!("length {} instead of the {} recorded", meta.len(), expected.size)));
    }
    let bytes = std::fs::read(path).map_err(|e| Invalid::Unreadable(e.to_string()))?;
    if digest(&bytes).sha256 != expected.sha256 {
        return Err(Invalid::Changed("content differs from the recorded SHA-256".into()));
    }
    Ok(())
}

fn digest(bytes: &[u8]) -> Digest256 {
    Digest256 { sha256: hex::encode(Sha256::digest(bytes)), size: bytes.len() as u64 }
}

/// The temporary path one attempt writes: hidden, in the output's directory (so the rename stays on one file
/// system), and unique per owner and attempt, so two holders never share one.
pub fn temp_path(output: &Path, owner: &str, attempt: u32) -> PathBuf {
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    output.with_file_name(format!(".{name}.{owner}.{attempt}.idem-tmp"))
}

/// The note a runner leaves beside `output` when attempt `attempt` of `owner` put it in place but the store stayed
/// unavailable until the run gave up, so the done write never landed: the output's digest. The next holder of
/// the item finds it beside an entry still saying that attempt runs, and records the item done if the output
/// still has the digest, instead of running it again.
pub fn unrecorded_path(output: &Path, owner: &str, attempt: u32) -> PathBuf {
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    output.with_file_name(format!(".{name}.{owner}.{attempt}.idem-unrecorded"))
}

/// Writes the note of [`unrecorded_path`] (`SHA256 SIZE`), fsynced with its directory, so it survives a crash
/// as the output does (blocking I/O).
///
/// # Errors
/// The I/O error of the write or an fsync.
pub fn write_unrecorded(note: &Path, digest: &Digest256) -> std::io::Result<()> {
    write_note(note, format!("{} {}\n", digest.sha256, digest.size).as_bytes())
}

/// Writes `contents` to `note` and fsyncs it and its directory, so a note survives a crash as the output does.
fn write_note(note: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::File::create(note)?;
    file.write_all(contents)?;
    file.sync_all()?;
    match note.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// Reads the note of [`unrecorded_path`]: `None` when there is none or it does not parse (blocking I/O).
pub fn read_unrecorded(note: &Path) -> Option<Digest256> {
    let text = std::fs::read_to_string(note).ok()?;
    let (sha256, size) = text.trim().split_once(' ')?;
    let well_formed = sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit());
    well_formed.then(|| Some(Digest256 { sha256: sha256.to_owned(), size: size.parse().ok()? }))?
}

/// The note an attempt leaves beside its output when its count went unanswered as the run gave up (the store
/// unavailable past the limit, or the operator's stop), its command never started:
/// `.<file name>.idem-uncounted`, holding the attempt's owner and number and the entry the count replaced. A
/// count may land long after its answer was given up (a stopped server answers once it is continued); the
/// next run that finds the entry counted by that very attempt, its holder gone, puts the entry back.
pub fn uncounted_path(output: &Path) -> PathBuf {
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    output.with_file_name(format!(".{name}.idem-uncounted"))
}

/// What a note of [`uncounted_path`] says.
#[derive(Debug, Clone, PartialEq)]
pub struct Uncounted {
    /// The owner token of the attempt whose count went unanswered.
    pub owner: String,
    /// Its number.
    pub attempt: u32,
    /// The entry its count replaced (`None`: there was none).
    pub prior: Option<idem_core::ledger::Entry>,
}

/// Writes the note of [`uncounted_path`] (`OWNER ATTEMPT`, then the prior entry's JSON or `absent`), fsynced
/// with its directory (blocking I/O).
///
/// # Errors
/// The I/O error of the write or an fsync.
pub fn write_uncounted(note: &Path, uncounted: &Uncounted) -> std::io::Result<()> {
    let mut contents = format!("{} {}\n", uncounted.owner, uncounted.attempt).into_bytes();
    match &uncounted.prior {
        Some(prior) => contents.extend_from_slice(&prior.encode()),
        None => contents.extend_from_slice(b"absent"),
    }
    write_note(note, &contents)
}

/// Reads the note of [`uncounted_path`]: `None` when there is none or it does not parse (blocking I/O).
pub fn read_uncounted(note: &Path) -> Option<Uncounted> {
    let text = std::fs::read_to_string(note).ok()?;
    let (head, prior) = text.split_once('\n')?;
    let (owner, attempt) = head.split_once(' ')?;
    let prior = match prior.trim() {
        "absent" => None,
        json => Some(idem_core::ledger::Entry::decode(json.as_bytes()).ok()?),
    };
    Some(Uncounted { owner: owner.to_owned(), attempt: attempt.parse().ok()?, prior })
}

/// Makes the contents of `temp` durable (fsync) before it is renamed into place (blocking I/O).
///
/// # Errors
/// The I/O error of the open or fsync.
pub fn sync_file(temp: &Path) -> std::io::Result<()> {
    std::fs::File::open(temp)?.sync_all()
}

/// Renames outputs into place and makes the renames durable, sharing directory fsyncs between renames into the
/// same directory (group commit): a rename is durable once an fsync of its directory that *started after it*
/// returned, so one fsync serves every rename finished before it began. With eight commands finishing into one
/// directory, one fsync per rename was a journal commit per item.
#[derive(Debug, Default)]
pub struct Renamer {
    dirs: Mutex<HashMap<PathBuf, Arc<DirSync>>>,
}

#[derive(Debug, Default)]
struct DirSync {
    /// Renames into the directory finished so far.
    renamed: AtomicU64,
    /// How many of them the last finished fsync covers; held while an fsync runs.
    synced: Mutex<u64>,
}

impl Renamer {
    /// Renames `temp` over `output` and returns once the directory entry is durable (blocking I/O).
    ///
    /// # Errors
    /// The I/O error of the rename or of the directory's open or fsync.
    pub fn rename_into_place(&self, temp: &Path, output: &Path) -> std::io::Result<()> {
        let dir = match output.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let state = Arc::clone(lock(&self.dirs).entry(dir.to_owned()).or_default());
        let result = Self::rename_and_sync(&state, dir, temp, output);
        // Forget the directory once nobody else is using it: one output directory per item must not grow the
        // map with the item count. Clones are only taken under the map's lock, so the count is exact here.
        let mut dirs = lock(&self.dirs);
        if Arc::strong_count(&state) == 2 {
            dirs.remove(dir);
        }
        result
    }

    fn rename_and_sync(state: &DirSync, dir: &Path, temp: &Path, output: &Path) -> std::io::Result<()> {
        std::fs::rename(temp, output)?;
        let mine = state.renamed.fetch_add(1, Ordering::SeqCst) + 1;
        let mut synced = lock(&state.synced);
        if *synced >= mine {
            return Ok(());
        }
        let upto = state.renamed.load(Ordering::SeqCst);
        std::fs::File::open(dir)?.sync_all()?;
        *synced = upto;
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn concurrent_renames_into_one_directory_all_land_and_the_directory_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let renamer = Arc::new(Renamer::default());
        let threads: Vec<_> = (0..16)
            .map(|t| {
                let (renamer, root) = (Arc::clone(&renamer), dir.path().to_owned());
                std::thread::spawn(move || {
                    for i in 0..50 {
                        let out = root.join(format!("{t}-{i}.json"));
                        let temp = temp_path(&out, "o", 1);
                        std::fs::write(&temp, b"{}").unwrap();
                        renamer.rename_into_place(&temp, &out).unwrap();
                        assert!(out.exists() && !temp.exists());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 16 * 50);
        assert!(lock(&renamer.dirs).is_empty(), "a directory nobody renames into any more is still tracked");
        let missing = dir.path().join("nope.json");
        assert!(renamer.rename_into_place(&temp_path(&missing, "o", 1), &missing).is_err());
        assert!(lock(&renamer.dirs).is_empty());
    }

    #[test]
    fn verification_finds_partial_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        let json = Checks { json: true, expect_fields: vec!["x".into()] };
        assert_eq!(verify(&p, &json), Err(Invalid::Missing));
        std::fs::write(&p, "").unwrap();
        assert_eq!(verify(&p, &json), Err(Invalid::Empty));
        std::fs::write(&p, "{\"x\": [1, 2").unwrap();
        assert_eq!(verify(&p, &json), Err(Invalid::NotJson));
        std::fs::write(&p, "{\"y\": 1}").unwrap();
        assert_eq!(verify(&p, &json), Err(Invalid::MissingField("x".into())));
        std::fs::write(&p, "{\"x\": 1}").unwrap();
        let d = verify(&p, &json).unwrap();
        assert_eq!(d.size, 8);
        assert_eq!(matches(&p, &d), Ok(()));
        std::fs::write(&p, "{\"x\": 2}").unwrap();
        assert!(matches(&p, &d).is_err());
        assert_eq!(temp_path(&p, "o1", 3), dir.path().join(".a.json.o1.3.idem-tmp"));
    }
}
