//! The shell examples of README.md and of every chapter of the user guide (docs/guide/, in the order of its
//! SUMMARY.md), run as a reader runs them (issue 19, issue 31): every ```` ```sh ```` block of a file in order,
//! in one `bash` per file, with `idem` and the example programs `upstream` and `queue` of this build on the
//! PATH. (trycmd runs one command at a time without background processes, and these examples start servers,
//! so bash runs them.) One test per file; a block of another shell (```` ```bash ````, ```` ```console ````, …)
//! is refused, so that nothing shell-like escapes the run: write ```` ```sh ```` or ```` ```text ````.
//!
//! Conventions in the files, kept visible to their readers:
//! - an HTML comment on the line before a block's fence: `<!-- not tested: REASON -->` (the block is skipped),
//!   `<!-- tested when VAR is set -->` (run only when the environment variable `VAR` is set, and the block must
//!   name its value; like the backend tests, it skips with a printed reason unless
//!   `IDEM_TEST_REQUIRE_BACKENDS` is set), `<!-- continues the block above -->` (runs where the block above
//!   left off; every other block starts in the directory a reader starts in, their checkout);
//! - a comment ending in `=> TEXT`: a line of the block's output (standard output and error, interleaved as a
//!   terminal shows them) equals `TEXT`, runs of white space compared as one space and `…` standing for any
//!   text; the lines must appear in the order the comments are written.
//!
//! What is checked besides: each block exits 0 under `set -euo pipefail` (so an unexpected failure anywhere
//! counts), stops every background process it started within 10 s of its end, finishes within
//! [`BLOCK_LIMIT`], uses loopback ports no other block of its file uses, and writes nothing into the directory
//! it starts in (a stand-in for the reader's checkout). The ports are fixed, so the files, and two runs on one
//! machine, take turns through a lock file. `guide_summary_lists_every_chapter` keeps the list of tested
//! chapters below equal to SUMMARY.md's, so a new chapter cannot go untested.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::BIN;

/// The checkout's root, which the files' names in messages are relative to.
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
/// The guide's directory, relative to [`ROOT`].
const GUIDE: &str = "docs/guide";
/// Longest one block may run; the slowest (the `idem run` walk-through) takes about 6 s.
const BLOCK_LIMIT: Duration = Duration::from_secs(60);
/// Printed by the script before each block (with its number) and after the last one.
const MARK: &str = "@@idem-readme-block";
/// Printed by the script when a block left a background process running.
const LEFT_RUNNING: &str = "@@idem-readme-left-running";

#[test]
fn readme_shell_blocks_run_as_written() {
    run_file("README.md");
}

/// One test per chapter of the guide, in SUMMARY.md's order; [`CHAPTERS`] lists the files.
macro_rules! chapters {
    ($($test:ident => $file:literal,)*) => {
        /// The guide's chapters, as SUMMARY.md lists them.
        const CHAPTERS: &[&str] = &[$($file),*];
        $(
            #[test]
            fn $test() {
                run_file(&format!("{GUIDE}/{}", $file));
            }
        )*
    };
}

chapters! {
    guide_introduction => "introduction.md",
    guide_kv_store => "kv-store.md",
    guide_proxy => "proxy.md",
    guide_check => "check.md",
    guide_retry => "retry.md",
    guide_run => "run.md",
    guide_queues => "queues.md",
    guide_once => "once.md",
    guide_webhooks => "webhooks.md",
    guide_several_machines => "several-machines.md",
    guide_tls => "tls.md",
    guide_library => "library.md",
    guide_configuration => "configuration.md",
    guide_operations => "operations.md",
    guide_verification => "verification.md",
    guide_development => "development.md",
}

/// SUMMARY.md links exactly the chapters tested above, in the same order, and every Markdown file of the guide
/// is one of them: a chapter added to the book is run by this test, or this test fails.
#[test]
fn guide_summary_lists_every_chapter() {
    let summary = std::fs::read_to_string(format!("{ROOT}/{GUIDE}/SUMMARY.md")).unwrap();
    let linked: Vec<&str> = summary
        .lines()
        .filter_map(|l| l.split_once("](").and_then(|(_, rest)| rest.split_once(')')).map(|(target, _)| target))
        .collect();
    assert_eq!(linked, CHAPTERS, "SUMMARY.md's chapters, in order, and the tests in readme/mod.rs differ");
    let mut files: Vec<String> = std::fs::read_dir(format!("{ROOT}/{GUIDE}"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md") && n != "SUMMARY.md")
        .collect();
    files.sort();
    let mut chapters: Vec<String> = CHAPTERS.iter().map(|c| (*c).to_owned()).collect();
    chapters.sort();
    assert_eq!(files, chapters, "a Markdown file in {GUIDE} is not a chapter of SUMMARY.md (or one is missing)");
}

/// Runs the ```` ```sh ```` blocks of `name` (relative to the checkout's root) as the module doc says.
fn run_file(name: &str) {
    let doc = std::fs::read_to_string(format!("{ROOT}/{name}")).unwrap();
    let all = blocks(name, &doc);
    let mut run = Vec::new();
    for block in &all {
        match &block.when {
            When::Always => run.push(block),
            When::Never(reason) => eprintln!("{name} line {}: not tested: {reason}", block.line),
            When::VarSet(var) => match std::env::var(var) {
                Ok(value) => {
                    assert!(
                        block.text.contains(&value),
                        "{name} line {}: {var} is {value:?}, but the block does not use it; the block runs only \
                         against the server it names",
                        block.line
                    );
                    run.push(block);
                }
                Err(_) => {
                    assert!(
                        std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
                        "{var} is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
                    );
                    eprintln!("{name} line {}: skipped: {var} is unset", block.line);
                }
            },
        }
    }
    if run.is_empty() {
        // A chapter of prose and reference tables; the README always has blocks to run.
        assert!(name != "README.md", "no ```sh block of README.md would run");
        eprintln!("{name}: no block to run");
        return;
    }

    // Fixed ports: take turns with another run of this test on the machine, then make sure they are free.
    let lock = std::fs::File::create(std::env::temp_dir().join("idem-readme-test.lock")).unwrap();
    lock.lock().unwrap();
    check_ports(name, &run);

    let dir = tempfile::tempdir().unwrap();
    let checkout = dir.path().join("checkout");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&checkout).unwrap();
    std::fs::create_dir(&tmp).unwrap();
    let script = dir.path().join("blocks.sh");
    std::fs::write(&script, script_of(&run, &checkout)).unwrap();

    let bin_dir = Path::new(BIN).parent().unwrap();
    let path =
        format!("{}:{}:{}", bin_dir.display(), upstream_dir().display(), std::env::var("PATH").unwrap_or_default());
    let (reader, writer) = std::io::pipe().unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .current_dir(&checkout)
        .env("PATH", path)
        .env("TMPDIR", &tmp)
        .stdin(Stdio::null())
        .stdout(writer.try_clone().unwrap())
        .stderr(writer);
    // The reader's own settings would change what the examples do (IDEM_URL above all).
    for (name, _) in std::env::vars() {
        if name.starts_with("IDEM_") && !name.starts_with("IDEM_TEST_") {
            cmd.env_remove(&name);
        }
    }
    // A group of its own, so that a block that hangs can be stopped with everything it started.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut bash = cmd.spawn().unwrap();
    drop(cmd); // closes this process's copies of the pipe's writing end, so the reader sees its end

    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    let mut output: Vec<(Instant, String)> = Vec::new();
    let mut started = Instant::now();
    let mut timed_out = false;
    let status = loop {
        while let Ok((at, line)) = rx.recv_timeout(Duration::from_millis(100)) {
            if line.starts_with(MARK) {
                started = at;
            }
            output.push((at, line));
        }
        if let Some(status) = bash.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > BLOCK_LIMIT {
            // bash is alive (not yet reaped), so its process group id is still its own.
            let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", bash.id())]).status();
            timed_out = true;
        }
    };
    // What the last processes printed; a process that outlived bash (ignored SIGTERM) must not hang the test.
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        output.push(line);
    }

    let segments = segments(&output);
    for (n, segment) in segments.iter().enumerate() {
        if let (Some(start), Some(end)) = (segment.first(), segments.get(n + 1).and_then(|s| s.first())) {
            eprintln!("{name} line {}: {:.1} s", run[n].line, (end.0 - start.0).as_secs_f64());
        }
    }
    let finished = output.iter().any(|(_, l)| *l == format!("{MARK} end"));
    if !finished || !status.success() {
        let all = output.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n");
        let Some(n) = segments.len().checked_sub(1).map(|n| n.min(run.len() - 1)) else {
            panic!("the script of {name} failed before its first block ({status}):\n{all}");
        };
        let why = if timed_out {
            format!("did not finish within {BLOCK_LIMIT:?}")
        } else if output.iter().any(|(_, l)| l.starts_with(LEFT_RUNNING)) {
            "left a background process running (stop what the block starts, by its PID)".to_owned()
        } else {
            format!("failed ({status}; the script runs under `set -euo pipefail`)")
        };
        panic!("the block of {name} at line {} {why}; its output:\n{}", run[n].line, text(&segments[n]));
    }
    let mut failures = Vec::new();
    for (block, segment) in run.iter().zip(&segments) {
        let mut from = 0;
        for (line, expected) in &block.expected {
            match segment[from..].iter().position(|(_, l)| line_matches(l, expected)) {
                Some(at) => from += at + 1,
                None => failures.push(format!(
                    "{name} line {line}: no line `{expected}` in the output of the block at line {} (after \
                     the line matched before it); the output:\n{}",
                    block.line,
                    text(segment)
                )),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    let left: Vec<_> = std::fs::read_dir(&checkout).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(
        left.is_empty(),
        "the blocks of {name} wrote {left:?} into the directory they started in (a reader's checkout): start \
         a walk-through with `cd \"$(mktemp -d)\"`"
    );
}

/// One ```` ```sh ```` block of a file.
struct Block {
    /// Line number (1-based) of its opening fence.
    line: usize,
    text: String,
    when: When,
    /// Runs in the directory the block above ended in, instead of the reader's checkout.
    continues: bool,
    /// (line number in the file, expected output line), in order.
    expected: Vec<(usize, String)>,
}

enum When {
    Always,
    Never(String),
    VarSet(String),
}

/// Info strings of shell blocks the run would skip: refused, so that every shell example is run or says why not.
const OTHER_SHELLS: &[&str] = &["bash", "shell", "console", "zsh", "shell-session", "sh-session"];

/// The ```` ```sh ```` blocks of the file `name`, with the marker on the line before each and its expected lines.
fn blocks(name: &str, doc: &str) -> Vec<Block> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].strip_prefix("```") else {
            i += 1;
            continue;
        };
        let open = i;
        let close = (open + 1..lines.len())
            .find(|&j| lines[j].starts_with("```"))
            .unwrap_or_else(|| panic!("{name} line {}: the code block never closes", open + 1));
        i = close + 1;
        let info = info.trim();
        assert!(
            !OTHER_SHELLS.contains(&info),
            "{name} line {}: a ```{info} block is not run by the docs test: write ```sh (run) or ```text",
            open + 1
        );
        if info != "sh" {
            continue;
        }
        let mut block = Block {
            line: open + 1,
            text: lines[open + 1..close].join("\n"),
            when: When::Always,
            continues: false,
            expected: Vec::new(),
        };
        let marker = lines[..open].iter().rev().map(|l| l.trim()).find(|l| !l.is_empty());
        if let Some(comment) = marker.and_then(|l| l.strip_prefix("<!--")).and_then(|l| l.strip_suffix("-->")) {
            let comment = comment.trim();
            if let Some(reason) = comment.strip_prefix("not tested:") {
                assert!(!reason.trim().is_empty(), "{name} line {open}: say why the block is not tested");
                block.when = When::Never(reason.trim().to_owned());
            } else if let Some(var) = comment.strip_prefix("tested when ").and_then(|c| c.strip_suffix(" is set")) {
                block.when = When::VarSet(var.to_owned());
            } else if comment == "continues the block above" {
                block.continues = true;
            } else {
                panic!("{name} line {open}: unknown marker `{comment}` before a ```sh block");
            }
        }
        for (j, line) in lines[open + 1..close].iter().enumerate() {
            if let Some(expected) = expectation(line) {
                block.expected.push((open + 2 + j, expected.to_owned()));
            }
        }
        blocks.push(block);
    }
    blocks
}

/// The `TEXT` of a shell line whose comment ends in `=> TEXT`.
fn expectation(line: &str) -> Option<&str> {
    let trimmed = line.trim_start();
    let comment = if trimmed.starts_with('#') { trimmed } else { &line[line.find(" #")? + 1..] };
    let at = comment.find("=> ")?;
    Some(comment[at + 3..].trim()).filter(|e| !e.is_empty())
}

/// Whether an output line is the expected one: runs of white space compare as one space, `…` matches any text.
fn line_matches(line: &str, expected: &str) -> bool {
    let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let (line, expected) = (words(line), words(expected));
    let parts: Vec<&str> = expected.split('…').collect();
    let [first, middle @ .., last] = parts.as_slice() else { return line == expected };
    if !line.starts_with(first) || !line.ends_with(last) || line.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &line[first.len()..line.len() - last.len()];
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// The script: the blocks in order, each after its marker line and followed by the check that it stopped
/// what it started.
fn script_of(blocks: &[&Block], checkout: &Path) -> String {
    // On a failure (`set -e`), the trap stops what the failing block had started.
    let mut script = String::from("set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n");
    for (n, block) in blocks.iter().enumerate() {
        script.push_str(&format!("printf '\\n{MARK} {n}\\n'\n"));
        if !block.continues {
            script.push_str(&format!("cd '{}'\n", checkout.display()));
        }
        script.push_str(&block.text);
        script.push_str(&format!(
            "\nfor _ in $(seq 100); do [ -z \"$(jobs -pr)\" ] && break; sleep 0.1; done\n\
             if [ -n \"$(jobs -pr)\" ]; then echo \"{LEFT_RUNNING}: $(jobs -r)\"; exit 97; fi\n"
        ));
    }
    script.push_str(&format!("printf '\\n{MARK} end\\n'\n"));
    script
}

/// The output of each block that started, from its marker line to the next; the last segment starts with the
/// end marker when the script finished. A block's trailing output (a server logging its shutdown) can land in
/// the next segment; it is never expected, so the split need not be exact.
fn segments(output: &[(Instant, String)]) -> Vec<Vec<(Instant, String)>> {
    let mut segments: Vec<Vec<(Instant, String)>> = Vec::new();
    for (at, line) in output {
        if line.starts_with(MARK) {
            segments.push(vec![(*at, line.clone())]);
        } else if let Some(segment) = segments.last_mut() {
            segment.push((*at, line.clone()));
        }
    }
    segments
}

fn text(segment: &[(Instant, String)]) -> String {
    segment.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
}

/// Each loopback port a block serves on appears in that block only (of its file), and is free before the run.
fn check_ports(name: &str, blocks: &[&Block]) {
    let mut ports: BTreeMap<u16, usize> = BTreeMap::new();
    for block in blocks {
        for (at, _) in block.text.match_indices("127.0.0.1:") {
            // `user@127.0.0.1:5432`, `nats://127.0.0.1:4222`: a server the block uses, not one it starts.
            if block.text[..at].ends_with('@') || block.text[..at].ends_with("nats://") {
                continue;
            }
            let digits: String = block.text[at + 10..].chars().take_while(char::is_ascii_digit).collect();
            let Ok(port) = digits.parse::<u16>() else { continue };
            if let Some(other) = ports.insert(port, block.line)
                && other != block.line
            {
                panic!(
                    "port {port} appears in the blocks of {name} at lines {other} and {}: each example needs ports \
                     of its own, so that it runs after the others and on its own",
                    block.line
                );
            }
        }
    }
    for (port, line) in ports {
        if let Err(e) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            panic!(
                "port {port}, used by the block of {name} at line {line}, is taken ({e}); the examples need it free"
            );
        }
    }
}

/// The directory holding the examples `upstream` and `queue` of this build ([`idem_testkit::example`]: built
/// now if missing or stale).
fn upstream_dir() -> PathBuf {
    idem_testkit::example("idem", "queue");
    let upstream = idem_testkit::example("idem", "upstream");
    upstream.parent().unwrap().to_owned()
}
