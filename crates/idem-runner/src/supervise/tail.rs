//! What is kept of a command's output: the last bytes of its standard error (`idem run`, for the error
//! fingerprint), or its last lines with both streams passed through to ours as they come (`idem once`, for
//! the status and cron's mail).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::task::JoinHandle;

/// How long a command's output pipes may stay open after it exited: a background process it started can hold
/// them for ever, and the runner must not wait on it outside its timeout and lease.
const OUTPUT_GRACE: Duration = Duration::from_millis(500);

/// Bytes of standard error kept: the last line is what the fingerprint needs.
const STDERR_TAIL: usize = 8 * 1024;

/// Lines of output kept per attempt (the last ones) by [`Lines`].
pub(crate) const TAIL_LINES: usize = 20;
/// The longest line [`Lines`] keeps, in bytes.
const LINE_BYTES: usize = 400;

/// The last bytes of a command's standard error, read by a task of its own (so they can be taken before EOF).
pub(crate) struct Bytes {
    tail: Arc<Mutex<Vec<u8>>>,
    task: Option<JoinHandle<()>>,
}

impl Bytes {
    /// Starts reading `stderr` (none: nothing to keep).
    pub(crate) fn read(stderr: Option<tokio::process::ChildStderr>) -> Self {
        let tail = Arc::new(Mutex::new(Vec::new()));
        let task = stderr.map(|s| tokio::spawn(read_bytes(s, Arc::clone(&tail))));
        Self { tail, task }
    }

    /// What was kept, once the stream ended or [`OUTPUT_GRACE`] passed.
    pub(crate) async fn take(self) -> Vec<u8> {
        if let Some(mut task) = self.task
            && tokio::time::timeout(OUTPUT_GRACE, &mut task).await.is_err()
        {
            task.abort();
        }
        std::mem::take(&mut *self.tail.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Keeps the last [`STDERR_TAIL`] bytes (at least) of `stderr` in `tail`.
async fn read_bytes(mut stderr: tokio::process::ChildStderr, tail: Arc<Mutex<Vec<u8>>>) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = stderr.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        tail.extend_from_slice(&buf[..n]);
        if tail.len() > 2 * STDERR_TAIL {
            let excess = tail.len() - STDERR_TAIL;
            tail.drain(..excess);
        }
    }
}

/// The last [`TAIL_LINES`] lines of a command's standard output and error, each cut to [`LINE_BYTES`], copied
/// to ours as they come.
#[derive(Default)]
pub(crate) struct Lines {
    kept: Arc<Mutex<Tail>>,
    copies: Vec<JoinHandle<()>>,
}

impl Lines {
    /// Starts copying the child's standard output and error to ours, keeping their last lines.
    pub(crate) fn copy(&mut self, child: &mut tokio::process::Child) {
        if let Some(out) = child.stdout.take() {
            self.copies.push(tokio::spawn(copy(out, tokio::io::stdout(), Arc::clone(&self.kept))));
        }
        if let Some(err) = child.stderr.take() {
            self.copies.push(tokio::spawn(copy(err, tokio::io::stderr(), Arc::clone(&self.kept))));
        }
    }

    /// Keeps `line` as a line of its own (the runner's own word, e.g. why the command could not start).
    pub(crate) fn push_line(&self, line: &str) {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).push_line(line.as_bytes());
    }

    /// The lines kept, once both streams ended or [`OUTPUT_GRACE`] passed for each.
    pub(crate) async fn take(self) -> Vec<String> {
        for mut copy in self.copies {
            if tokio::time::timeout(OUTPUT_GRACE, &mut copy).await.is_err() {
                copy.abort();
            }
        }
        take(&self.kept)
    }
}

#[derive(Default)]
struct Tail {
    lines: VecDeque<String>,
    /// A line not yet ended, per stream in turn (the two streams' partial lines are not told apart: a line
    /// is kept as the bytes came).
    partial: Vec<u8>,
}

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b == b'\n' {
                let line = std::mem::take(&mut self.partial);
                self.push_line(&line);
            } else if self.partial.len() < LINE_BYTES + 4 {
                self.partial.push(b);
            }
        }
    }

    fn push_line(&mut self, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end_matches('\r');
        let kept = &text[..text.floor_char_boundary(LINE_BYTES)];
        // A cut line says so: the status reader must not take a prefix for the whole line.
        let cut = if kept.len() < text.len() { " [cut]" } else { "" };
        self.lines.push_back(format!("{kept}{cut}"));
        if self.lines.len() > TAIL_LINES {
            self.lines.pop_front();
        }
    }
}

fn take(tail: &Mutex<Tail>) -> Vec<String> {
    let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
    if !tail.partial.is_empty() {
        let line = std::mem::take(&mut tail.partial);
        tail.push_line(&line);
    }
    tail.lines.drain(..).collect()
}

/// Copies a stream of the command to ours as it comes (so cron still mails it), keeping its last lines.
async fn copy(mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin, tail: Arc<Mutex<Tail>>) {
    let mut buf = [0u8; 8192];
    let mut passing = true;
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        tail.lock().unwrap_or_else(|p| p.into_inner()).push(&buf[..n]);
        // Our own output gone (a closed pipe) must not stop the command: keep reading, stop passing.
        if passing && (to.write_all(&buf[..n]).await.is_err() || to.flush().await.is_err()) {
            passing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_keeps_the_last_lines_whole_and_bounded() {
        let mut tail = Tail::default();
        for i in 0..30 {
            tail.push(format!("line {i}\n").as_bytes());
        }
        tail.push("é".repeat(300).as_bytes());
        let tail = Mutex::new(tail);
        let lines = take(&tail);
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines[0], "line 11");
        assert_eq!(
            lines[TAIL_LINES - 1],
            format!("{} [cut]", "é".repeat(LINE_BYTES / 2)),
            "cut on a character, marked"
        );
    }
}
