//! `idem run` reading its items from a pipe, standard input or a FIFO: read once, every item run, a repeated
//! output path refused as soon as it is seen, memory bounded over 100,000 lines.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::BIN;

/// `idem run --items - --output DIR/o/{id}.txt -- sh -c 'echo … >> log; echo $1 > $2'` with `input` on its
/// standard input: (exit status, stderr). Every execution appends its id to `log`.
fn run_from_stdin(dir: &Path, input: &[u8], extra: &[&str]) -> (i32, String) {
    let script = format!("echo \"$1\" >> {}; echo \"$1\" > \"$2\"", dir.join("log").display());
    let output = dir.join("o/{id}.txt").display().to_string();
    let mut child = Command::new(BIN)
        .args(["run", "--items", "-", "--quiet", "--output", &output])
        .args(extra)
        .args(["--", "sh", "-c", &script, "sh", "{id}", "{out}"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The items whose command ran, sorted: items run concurrently (`--jobs` defaults to the cores), so the log's
/// order is the order they finished in, which no test may depend on.
fn executed(dir: &Path) -> Vec<String> {
    let mut ran: Vec<String> =
        std::fs::read_to_string(dir.join("log")).unwrap_or_default().lines().map(str::to_owned).collect();
    ran.sort();
    ran
}

#[test]
fn a_repeated_output_path_in_a_pipe_stops_the_reading_there_and_the_items_before_it_run() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_from_stdin(dir.path(), b"a\nb\n\na\nc\n", &[]);
    assert_eq!(code, 2, "{err}");
    let line = format!(
        "idem: -:4: writes {}, as an earlier item did (two items with one output path)",
        dir.path().join("o/a.txt").display()
    );
    assert!(err.lines().any(|l| l == line), "{err}");
    assert!(err.contains("2 items in "), "{err}");
    assert!(err.contains("exit status 2 (a bad item in the stream)"), "{err}");
    assert_eq!(executed(dir.path()), ["a", "b"], "c comes after the refused line and is never read");
}

#[test]
fn a_malformed_item_in_a_pipe_stops_the_reading_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_from_stdin(dir.path(), b"{\"id\":\"x\"}\nnot json\n{\"id\":\"y\"}\n", &["--id-field", "id"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.lines().any(|l| l.starts_with("idem: -:2: not JSON: ")), "{err}");
    assert_eq!(executed(dir.path()), ["x"]);
}

/// A line that is not UTF-8 is a bad item named by its line (it was "cannot read items from -", no line, no
/// reason).
#[test]
fn a_line_that_is_not_utf8_in_a_pipe_stops_the_reading_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_from_stdin(dir.path(), b"u1\nu2\n\xff\xfe\nu4\n", &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.lines().any(|l| l.starts_with("idem: -:3: not UTF-8 text")), "{err}");
    assert_eq!(executed(dir.path()), ["u1", "u2"]);
}

#[test]
fn items_from_a_fifo_are_run_and_a_second_pass_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("items.fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let script = format!("echo \"$1\" >> {}; echo \"$1\" > \"$2\"", dir.path().join("log").display());
    let output = dir.path().join("o/{id}.txt").display().to_string();
    for pass in 1..=2 {
        let writer = {
            let fifo = fifo.clone();
            // Opening a FIFO for writing waits for its reader, as `seq 50 > fifo` would.
            std::thread::spawn(move || {
                let mut f = std::fs::OpenOptions::new().write(true).open(fifo).unwrap();
                for i in 1..=50 {
                    writeln!(f, "item-{i}").unwrap();
                }
            })
        };
        let out = Command::new(BIN)
            .args(["run", "--items", &fifo.display().to_string(), "--quiet", "--jobs", "4", "--output", &output])
            .args(["--", "sh", "-c", &script, "sh", "{id}", "{out}"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        writer.join().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "pass {pass}: {err}");
        if pass == 2 {
            assert!(err.contains("nothing to do: all 50 items already done (0 adopted), ran 0 commands"), "{err}");
        }
    }
    let ran = executed(dir.path());
    assert_eq!(ran.len(), 50, "each item once over both passes");
    assert_eq!(ran.iter().collect::<std::collections::BTreeSet<_>>().len(), 50);
}

/// The peak resident memory (`Maximum resident set size`, KiB) GNU time reports.
fn max_rss_kib(time_output: &str) -> u64 {
    let line = time_output.lines().find(|l| l.contains("Maximum resident set size")).expect("GNU time's report");
    line.rsplit(':').next().unwrap().trim().parse().unwrap()
}

/// A piped stream is never held: 20,000 items run once each in a bounded resident size. (100,000 items, the
/// figure in BENCHMARKS.md, took six minutes of a debug build's CI time for the same claim: what grows per
/// item is 8 bytes, and a task held per item would be a few KiB each, 60 MiB and more here.)
#[test]
fn twenty_thousand_items_from_seq_all_run_once_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("src"), "x\n").unwrap();
    // `cp`, not a shell: one exec per item keeps this within a minute or two in a debug build.
    let cmd = format!(
        "seq 20000 | /usr/bin/time -v {BIN} run --items - --jobs 4 --quiet --output 'o/{{id}}.txt' -- cp src '{{out}}'"
    );
    let out = Command::new("sh").arg("-c").arg(&cmd).current_dir(dir.path()).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("20000 items in ")
            && err.contains(
                ": 20000 done now, 0 already done, 0 adopted, 0 failed, 0 poison, 0 not done; 20000 commands ran"
            ),
        "{err}"
    );
    let outputs = std::fs::read_dir(dir.path().join("o")).unwrap().filter(|e| {
        let e = e.as_ref().unwrap();
        e.file_name() != ".idem" && std::fs::read(e.path()).unwrap() == b"x\n"
    });
    assert_eq!(outputs.count(), 20_000);
    // Measured at 21 MiB for 20,000 items and 30 MiB for 100,000 (debug build, 2 cores): the items are never
    // held, only 8 bytes per output path seen, and the SQLite ledger's page caches fill up to their caps.
    // The bound is about twice that.
    let rss = max_rss_kib(&err);
    eprintln!("seq 20000 | idem run: max RSS {rss} KiB");
    assert!(rss < 40 * 1024, "max RSS {rss} KiB for 20,000 piped items");
}

/// Ctrl-C while the stream's writer still has it open: the items read finish, and the run says it was
/// interrupted (exit 130), since more may have followed; it said "every item done" (exit 0).
#[test]
fn ctrl_c_on_a_stream_still_open_is_an_interruption_not_every_item_done() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!("echo \"$1\" >> {}; echo \"$1\" > \"$2\"", dir.path().join("log").display());
    let output = dir.path().join("o/{id}.txt").display().to_string();
    let mut child = Command::new(BIN)
        .args(["run", "--items", "-", "--output", &output])
        .args(["--", "sh", "-c", &script, "sh", "{id}", "{out}"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"g1\n").unwrap();
    stdin.flush().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while executed(dir.path()).is_empty() {
        assert!(std::time::Instant::now() < deadline, "g1 never ran");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    drop(stdin);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert_eq!(executed(dir.path()), ["g1"]);
}
