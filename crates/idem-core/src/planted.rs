//! Test-only: the bugs `idem-verify` plants (through `IDEM_PLANTED_BUG`) to show that its checkers catch them.
//! One switch for the server, the layer and the runner.

/// The environment variable naming the planted bug.
const VAR: &str = "IDEM_PLANTED_BUG";

/// Whether `idem-verify` planted `bug` (`kv-precondition`, `proxy-completion`, `proxy-fingerprint`, `runner-fence`). Compiled to
/// `false` without debug assertions, so a release build can never carry a planted bug.
#[doc(hidden)]
#[cfg(debug_assertions)]
pub fn planted(bug: &str) -> bool {
    std::env::var(VAR).is_ok_and(|v| v == bug)
}

/// Release builds: never.
#[doc(hidden)]
#[cfg(not(debug_assertions))]
pub fn planted(_bug: &str) -> bool {
    let _ = VAR;
    false
}
