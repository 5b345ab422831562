//! The workspace's example programs, as tests run them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

/// The example `name` of the workspace package `package`, in the target directory and profile of the test
/// binary running (`<target>/<profile>/examples/<name>`), built first with `cargo build -p PACKAGE --example
/// NAME` (the cargo running the tests, `$CARGO`) when it is missing or older than a source of the workspace
/// (a file under a crate's `src/` or `examples/`, a `Cargo.toml`, `Cargo.lock`).
///
/// `cargo test` builds every example with the tests, so that build is normally skipped; `cargo test --test it`
/// builds none. It is not run every time because it is no no-op: cargo resolves the features of `-p PACKAGE`
/// alone, not those of the `cargo test --workspace` that built the tests, and built dependencies and the
/// package again (about 160 s of CPU in the middle of a test run from a fresh checkout).
///
/// # Panics
/// When the build fails or leaves no such file.
pub fn example(package: &str, name: &str) -> PathBuf {
    // <target>/<profile>/deps/it-HASH -> <target>/<profile>
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("a target directory").to_owned();
    let path = profile_dir.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
    if built.is_some_and(|built| newest_source().is_some_and(|newest| newest <= built)) {
        return path;
    }
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(other) => other.to_owned(),
    };
    let target_dir = profile_dir.parent().expect("a target directory");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "-p", package, "--example", name, "--profile", &profile])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(workspace_root())
        .status()
        .expect("running cargo build");
    assert!(status.success() && path.is_file(), "cannot build the example {name} of {package} ({status})");
    path
}

fn workspace_root() -> PathBuf {
    // This crate is <root>/crates/idem-testkit.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// When a source an example may be built from last changed; `None` when the workspace cannot be read.
fn newest_source() -> Option<SystemTime> {
    let root = workspace_root();
    let mut newest = modified(&root.join("Cargo.lock"))?.max(modified(&root.join("Cargo.toml"))?);
    for krate in std::fs::read_dir(root.join("crates")).ok()?.flatten() {
        let dir = krate.path();
        newest = newest.max(modified(&dir.join("Cargo.toml")).unwrap_or(SystemTime::UNIX_EPOCH));
        for sub in ["src", "examples"] {
            newest = newest.max(newest_under(&dir.join(sub)));
        }
    }
    Some(newest)
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn newest_under(dir: &Path) -> SystemTime {
    let mut newest = SystemTime::UNIX_EPOCH;
    let Ok(entries) = std::fs::read_dir(dir) else { return newest };
    for entry in entries.flatten() {
        let path = entry.path();
        let time = if path.is_dir() { newest_under(&path) } else { modified(&path).unwrap_or(newest) };
        newest = newest.max(time);
    }
    newest
}
