//! Test-only: the bugs `idem-verify` plants to show its checkers catch them (`IDEM_PLANTED_BUG`).

/// Whether `idem-verify` planted `bug` through `IDEM_PLANTED_BUG`. Compiled to `false` without debug
/// assertions, so a release build can never carry a planted bug.
#[cfg(debug_assertions)]
pub(crate) fn planted(bug: &str) -> bool {
    std::env::var("IDEM_PLANTED_BUG").is_ok_and(|v| v == bug)
}

/// Release builds: never.
#[cfg(not(debug_assertions))]
pub(crate) fn planted(_bug: &str) -> bool {
    false
}
