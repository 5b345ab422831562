//! What is checked of the command's program and of the machine before a run: the program found in `PATH`
//! once, `--jobs` within the open-file limit, and the owner token that names this process in the ledger.

use std::path::PathBuf;

use crate::error::Error;

/// A token unique to this process start: host, process id and 32 random bits.
pub fn owner_token() -> String {
    format!("{}-{}-{:08x}", host_name(), std::process::id(), rand::random::<u32>())
}

/// This machine's host name as the ledger records it (letters, digits and `-`, at most 32): `IDEM_HOST` when
/// set (for machines whose host names are not unique, e.g. containers), else the kernel's host name, `host`
/// when it cannot be read. A done entry names the host that recorded it: only that host can see its output.
pub(crate) fn host_name() -> String {
    let host = std::env::var("IDEM_HOST")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .unwrap_or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default());
    let host: String = host.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(32).collect();
    if host.is_empty() { "host".to_owned() } else { host }
}

/// The host an owner token ([`owner_token`]) names; `None` for another owner (`adopted`).
pub(crate) fn owner_host(owner: &str) -> Option<&str> {
    let mut parts = owner.rsplitn(3, '-');
    let (random, pid, host) = (parts.next()?, parts.next()?, parts.next()?);
    let hex = random.len() == 8 && random.bytes().all(|b| b.is_ascii_hexdigit());
    (hex && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()) && !host.is_empty()).then_some(host)
}

/// Looks a bare program name up in `PATH` once, as a shell does, instead of for every item: spawning by bare
/// name tries each `PATH` directory in turn in the child (`posix_spawnp`), nine failed `execve` calls per item
/// for `sh` with this machine's `PATH`.
///
/// `None` as well when `PATH` is not [`searchable`].
fn resolve_program(name: &str) -> Option<PathBuf> {
    if name.contains('/') || name.contains('{') || !searchable() {
        return None;
    }
    which::which(name).ok()
}

/// `PATH` is set, not empty, and has no entry starting with `~`, which `which` expands and `execvp` and the
/// shells do not: only then does a lookup here find what the spawn would.
fn searchable() -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        !path.is_empty()
            && !std::env::split_paths(&path).any(|dir| dir.as_os_str().as_encoded_bytes().starts_with(b"~"))
    })
}

/// Refuses a program that cannot start before anything runs: a typo in the command is the operator's error,
/// and as an item failure it would make the first items poison, for good. A name with a placeholder is
/// checked per item when it runs.
///
/// Returns the program found in `PATH` for a bare name ([`resolve_program`]: the run's one lookup), `None`
/// for a path, a name with a placeholder, or a `PATH` the lookup cannot read.
pub(crate) fn check_program(name: &str) -> Result<Option<PathBuf>, Error> {
    use std::os::unix::fs::PermissionsExt as _;
    if name.contains('{') {
        return Ok(None);
    }
    if !name.contains('/') {
        // Where the lookup cannot tell (an unusual PATH), the spawn decides.
        if !searchable() {
            return Ok(None);
        }
        return match resolve_program(name) {
            Some(path) => Ok(Some(path)),
            None => Err(Error::Config(format!("cannot start {name}: not found in PATH"))),
        };
    }
    match std::fs::metadata(name) {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Ok(None),
        Ok(_) => Err(Error::Config(format!("cannot start {name}: not an executable file"))),
        Err(e) => Err(Error::Config(format!("cannot start {name}: {e}"))),
    }
}

/// Descriptors the runner keeps for itself (ledger connections, runtime, watchdog, standard streams).
const RUNNER_FDS: u64 = 48;

/// Descriptors one running command can take at once: its pipes and pidfd, the spawn's own pipe, the output
/// opened to verify and fsync it, its directory.
const FDS_PER_JOB: u64 = 8;

/// `--jobs`, lowered (with a warning) to what the open-file limit (`ulimit -n`) leaves room for, as GNU
/// parallel does: past it, spawns, output checks and ledger reopenings fail with EMFILE, which must not be
/// blamed on items.
pub(crate) fn jobs_within_descriptor_limit(jobs: usize) -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX);
    let room = usize::try_from(limit.saturating_sub(RUNNER_FDS) / FDS_PER_JOB).unwrap_or(usize::MAX).max(1);
    if jobs > room {
        tracing::warn!(
            "only enough file descriptors (ulimit -n {limit}) for {room} command(s) at once: running {room}, \
             not {jobs}"
        );
        return room;
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_token_names_its_host() {
        assert_eq!(owner_host("web-1-4242-0a1b2c3d"), Some("web-1"));
        assert_eq!(owner_host(&owner_token()), Some(host_name().as_str()));
        assert_eq!(owner_host("adopted"), None);
        assert_eq!(owner_host("a-b-c"), None);
    }

    #[test]
    fn the_check_finds_a_bare_name_in_path_once_and_keeps_it() {
        if !searchable() {
            // A PATH the lookup cannot read (unset, or with a `~` entry) is left to the spawn: nothing to find.
            assert_eq!(check_program("sh").expect("left to the spawn"), None);
            return;
        }
        let sh = check_program("sh").expect("sh is in PATH").expect("found by the check");
        assert!(sh.is_absolute() && sh.ends_with("sh"), "{}", sh.display());
        // A placeholder is checked when it runs; a path is spawned as it is.
        assert_eq!(check_program("./{id}.sh").expect("not checked"), None);
        assert_eq!(check_program(&sh.display().to_string()).expect("executable"), None);
        let refused = check_program("idem-no-such-program").expect_err("refused");
        assert_eq!(refused.to_string(), "cannot start idem-no-such-program: not found in PATH");
    }
}
