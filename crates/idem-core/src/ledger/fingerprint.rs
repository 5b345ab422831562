//! The error fingerprint that tells the same failure twice (poison) from two different ones.

/// The error fingerprint of a failed attempt: how it ended (`exit 3`, `signal 9`, `timeout`, or a
/// verification problem) plus the last non-empty line of its standard error with every run of decimal digits
/// replaced by `N` and every other run of hex digits that contains a digit or is 8 or more long by `H`, so the
/// same failure with a different timestamp, address or id still matches.
pub fn error_fingerprint(ending: &str, stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let last = text.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("");
    format!("{ending}: {}", normalise(last))
}

fn normalise(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        // A hex run stands for a number, address or id when it has a digit or is long; words like "bad" stay.
        if run.chars().all(|c| c.is_ascii_digit()) && !run.is_empty() {
            out.push('N');
        } else if run.len() >= 8 || run.chars().any(|c| c.is_ascii_digit()) {
            out.push('H');
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in line.chars() {
        if c.is_ascii_hexdigit() {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}
