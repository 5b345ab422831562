//! How the runner shows ids and counts: ids (and host names) in natural order, runs of digits compared as
//! numbers, so `item-2` comes before `item-10` and `20` before `100`, as people number things; a count with
//! its noun in the singular for 1.

use std::cmp::Ordering;

/// Compares `a` and `b` in natural order: split into runs of ASCII digits and runs of anything else, digit
/// runs compare by their value (of any length; leading zeros do not count), other runs by their characters.
/// Strings equal so (`7` and `007`) are ordered as plain strings, so the order is total and agrees with `==`.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (a.as_bytes(), b.as_bytes());
    while !x.is_empty() && !y.is_empty() {
        let (run_x, rest_x) = split_run(x);
        let (run_y, rest_y) = split_run(y);
        let order = match (run_x[0].is_ascii_digit(), run_y[0].is_ascii_digit()) {
            (true, true) => {
                let (vx, vy) = (trim_zeros(run_x), trim_zeros(run_y));
                vx.len().cmp(&vy.len()).then_with(|| vx.cmp(vy))
            }
            _ => run_x.cmp(run_y),
        };
        if order != Ordering::Equal {
            return order;
        }
        (x, y) = (rest_x, rest_y);
    }
    x.len().cmp(&y.len()).then_with(|| a.cmp(b))
}

/// `n` and the noun for it: `1 item`, `0 items`, `2 items`.
pub(crate) fn count<N: std::fmt::Display + PartialEq + From<u8>>(n: N, one: &str, many: &str) -> String {
    let noun = if n == N::from(1) { one } else { many };
    format!("{n} {noun}")
}

/// The leading run of digits or of non-digits, and the rest. `s` is not empty.
fn split_run(s: &[u8]) -> (&[u8], &[u8]) {
    let digits = s[0].is_ascii_digit();
    let end = s.iter().position(|b| b.is_ascii_digit() != digits).unwrap_or(s.len());
    s.split_at(end)
}

fn trim_zeros(digits: &[u8]) -> &[u8] {
    let start = digits.iter().position(|&b| b != b'0').unwrap_or(digits.len());
    &digits[start..]
}

/// `line` with its control characters escaped (`\u{1b}`): a command's colour codes or a stray escape
/// sequence must not drive the reader's terminal. JSON keeps the line as it was.
pub(crate) fn printable(line: &str) -> String {
    line.chars().map(|c| if c.is_control() { c.escape_unicode().to_string() } else { c.to_string() }).collect()
}

#[cfg(test)]
mod tests {
    use super::{count, natural_cmp};

    #[test]
    fn one_is_singular() {
        assert_eq!(count(1u64, "item", "items"), "1 item");
        assert_eq!(count(0u64, "item", "items"), "0 items");
        assert_eq!(count(2u32, "attempt", "attempts"), "2 attempts");
    }

    #[test]
    fn numbers_in_ids_sort_by_value() {
        let mut ids =
            vec!["100", "20", "3", "item-10", "item-9", "item-9a", "a", "", "007", "7", "99999999999999999999999"];
        ids.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            ids,
            ["", "3", "007", "7", "20", "100", "99999999999999999999999", "a", "item-9", "item-9a", "item-10"]
        );
        assert_eq!(natural_cmp("x", "x"), std::cmp::Ordering::Equal);
    }
}
