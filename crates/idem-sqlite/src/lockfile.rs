//! The lock file beside a database, `<db>.lock`: an OS advisory lock one process holds while it has the store
//! open, and one line saying who holds it (`exclusive PID` for a store kept open, such as `idem serve`'s;
//! `shared PID` for a [`crate::SharedSqlite`] that gives it up between bursts), so a process waiting for its
//! turn can tell a holder that will never give it up and say so instead of waiting for ever.

use std::io::{Seek, Write};
use std::path::{Path, PathBuf};

use crate::Error;

/// The mark of a holder that keeps the store open until it closes.
pub(crate) const EXCLUSIVE: &str = "exclusive";
/// The mark of a holder that takes turns.
pub(crate) const SHARED: &str = "shared";

/// Takes the exclusive lock on `<path>.lock` and marks it [`EXCLUSIVE`] with this process's id. The writer
/// keeps the next generation in memory, so a second process writing the same file would hand out generations
/// already used: refuse it instead.
///
/// The lock is named after the file's canonical path, so a symlink to the same database (or a path through a
/// symlinked directory) takes the same lock; a hard link to it is not recognised.
pub(crate) fn lock_exclusively(path: &Path) -> Result<std::fs::File, Error> {
    let lock = lock_path(path);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(|source| Error::Lock { lock: lock.clone(), source })?;
    match file.try_lock() {
        Ok(()) => {
            mark(&file, EXCLUSIVE);
            Ok(file)
        }
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::InUse { path: path.to_owned(), lock }),
        Err(std::fs::TryLockError::Error(source)) => Err(Error::Lock { lock, source }),
    }
}

/// `<path>.lock`, after the database's canonical path.
fn lock_path(path: &Path) -> PathBuf {
    let canonical = std::fs::canonicalize(path).ok().or_else(|| {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        Some(std::fs::canonicalize(dir).ok()?.join(path.file_name()?))
    });
    let mut name = canonical.as_deref().unwrap_or(path).as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Writes `KIND PID` into the held lock file. Best effort: a mark that cannot be written only makes a
/// waiter wait as for a holder that takes turns.
pub(crate) fn mark(mut file: &std::fs::File, kind: &str) {
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = writeln!(file, "{kind} {}", std::process::id());
}

/// Who holds `lock` as its mark says (`exclusive 1234`), if it says.
pub(crate) fn holder(lock: &Path) -> Option<String> {
    let text = std::fs::read_to_string(lock).ok()?;
    let line = text.lines().next()?.trim();
    (!line.is_empty()).then(|| line.to_owned())
}
