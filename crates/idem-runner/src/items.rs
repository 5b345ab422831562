//! Work items, streamed one line at a time (never all held at once) from a regular file, a pipe (`-` for
//! standard input) or a FIFO; [`parse_item`] makes an item of one line or one queue message.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::Error;

/// How the items file is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemFormat {
    /// JSON Lines when the first non-empty line is a JSON object, else plain lines.
    Auto,
    /// One JSON value per line.
    JsonLines,
    /// One item per line, taken as text.
    Lines,
}

/// One work item.
#[derive(Clone, Debug)]
pub struct Item {
    /// 1-based line number in the items file (for a queue: the message's number in this run).
    pub line: u64,
    /// Its id: the `--id-field` value, a safe plain line as is, or a short hash of the canonical item.
    pub id: String,
    /// The line as read (without the newline): the item's JSON, or the plain text.
    pub raw: String,
}

/// True when `path` names a stream that can be read only once: `-` (standard input), a pipe, a FIFO or a
/// device. A regular file is read twice (checked whole before anything runs, then streamed).
pub fn is_stream(path: &Path) -> bool {
    path == Path::new("-") || std::fs::metadata(path).is_ok_and(|m| !m.is_file())
}

/// Reads items from a file or a stream lazily.
pub struct ItemReader {
    path: PathBuf,
    lines: std::io::Lines<Box<dyn BufRead + Send>>,
    /// The first non-empty line and its number, read ahead to decide the format.
    first: Option<(u64, String)>,
    line: u64,
    json: bool,
    id_field: Option<String>,
}

impl std::fmt::Debug for ItemReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ItemReader").field("path", &self.path).field("line", &self.line).finish_non_exhaustive()
    }
}

impl ItemReader {
    /// Opens `path` (`-`: standard input) and decides its format from its first non-empty line, which is
    /// read ahead and kept, so a pipe loses nothing.
    ///
    /// # Errors
    /// [`Error::ReadItems`] when it cannot be opened or read.
    pub fn open(path: &Path, format: ItemFormat, id_field: Option<&str>) -> Result<Self, Error> {
        let read_err = |source| Error::ReadItems { path: path.to_owned(), source };
        let input: Box<dyn BufRead + Send> = if path == Path::new("-") {
            Box::new(BufReader::with_capacity(256 * 1024, std::io::stdin()))
        } else {
            Box::new(BufReader::with_capacity(256 * 1024, File::open(path).map_err(read_err)?))
        };
        let mut lines = input.lines();
        let mut line = 0;
        let first = loop {
            match lines.next() {
                None => break None,
                Some(Err(e)) => return Err(read_err(e)),
                Some(Ok(l)) => {
                    line += 1;
                    if !l.trim().is_empty() {
                        break Some((line, l));
                    }
                }
            }
        };
        let json = match format {
            ItemFormat::JsonLines => true,
            ItemFormat::Lines => false,
            ItemFormat::Auto => id_field.is_some() || first.as_ref().is_some_and(|(_, l)| looks_like_json(l)),
        };
        Ok(Self { path: path.to_owned(), lines, first, line, json, id_field: id_field.map(str::to_owned) })
    }

    /// True when items are JSON values.
    pub fn is_json(&self) -> bool {
        self.json
    }

    fn item(&self, line: u64, raw: String) -> Result<Item, Error> {
        let id = item_id(&raw, self.json, self.id_field.as_deref()).map_err(|reason| Error::BadItem {
            path: self.path.clone(),
            line,
            reason,
        })?;
        Ok(Item { line, id, raw })
    }
}

/// A JSON object on one line (what `--format auto` takes for JSON Lines).
fn looks_like_json(line: &str) -> bool {
    line.trim_start().starts_with('{') && serde_json::from_str::<serde_json::Value>(line).is_ok()
}

/// The id of one item: the `--id-field` member of a JSON item, the hash of its canonical form without one;
/// for a plain line the line itself when it is a safe id of at most 100 characters, else its hash.
fn item_id(raw: &str, json: bool, id_field: Option<&str>) -> Result<String, String> {
    if !json {
        return Ok(if check_id(raw).is_ok() && raw.len() <= 100 { raw.to_owned() } else { short_hash(raw.as_bytes()) });
    }
    let value: serde_json::Value = serde_json::from_str(raw).map_err(|e| format!("not JSON: {e}"))?;
    match id_field {
        Some(field) => {
            let id = match value.get(field) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Number(n)) => n.to_string(),
                Some(_) => return Err(format!("field {field:?} is neither a string nor a number")),
                None => return Err(format!("no field {field:?}")),
            };
            check_id(&id).map_err(|r| format!("id {id:?} {r}"))?;
            Ok(id)
        }
        None => Ok(short_hash(&idem_core::canonical_payload(raw.as_bytes()))),
    }
}

/// The item a queue message carries: `body` (trimmed) is the item; its id is the `--id-field` member when that
/// is given, else the message's own id (`message_id`, hashed when it is no safe id), else what a line of the
/// same text would get. `Err` says why the message cannot be an item.
#[cfg_attr(not(any(feature = "amqp", feature = "nats")), allow(dead_code))]
pub(crate) fn parse_item(
    number: u64,
    body: &[u8],
    message_id: Option<&str>,
    format: ItemFormat,
    id_field: Option<&str>,
) -> Result<Item, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the message body is not UTF-8".to_owned())?;
    let raw = text.trim().to_owned();
    if raw.is_empty() {
        return Err("the message body is empty".into());
    }
    let json = match format {
        ItemFormat::JsonLines => true,
        ItemFormat::Lines => false,
        ItemFormat::Auto => id_field.is_some() || looks_like_json(&raw),
    };
    let id = match (id_field, message_id.filter(|m| !m.is_empty())) {
        (None, Some(m)) if check_id(m).is_ok() => m.to_owned(),
        (None, Some(m)) => short_hash(m.as_bytes()),
        _ => item_id(&raw, json, id_field)?,
    };
    Ok(Item { line: number, id, raw })
}

impl Iterator for ItemReader {
    type Item = Result<Item, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some((line, raw)) = self.first.take() {
            let raw = raw.trim().to_owned();
            return Some(self.item(line, raw));
        }
        loop {
            self.line += 1;
            let raw = match self.lines.next()? {
                Ok(l) => l,
                // `lines()` fails a line that is not UTF-8 as `InvalidData`: that is a bad item, named by its
                // line like the others, not a failure to read.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    let reason = "not UTF-8 text (items are UTF-8 lines)".to_owned();
                    return Some(Err(Error::BadItem { path: self.path.clone(), line: self.line, reason }));
                }
                Err(source) => return Some(Err(Error::ReadItems { path: self.path.clone(), source })),
            };
            let trimmed = raw.trim();
            if trimmed.is_empty() {
                continue;
            }
            let raw = if trimmed.len() == raw.len() { raw } else { trimmed.to_owned() };
            return Some(self.item(self.line, raw));
        }
    }
}

/// The SHA-256 (lowercase hex) of an item's text as read, recorded in its ledger entries: a later item under
/// the same id with another text is told apart by it.
pub(crate) fn text_sha256(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The first 16 hex digits (64 bits) of the SHA-256 of `bytes`.
pub fn short_hash(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    hex::encode(&digest[..8])
}

/// An id must be usable as a file name and in a store key: 1..=200 printable ASCII characters without spaces,
/// `/` or `\`, not starting with `.`.
fn check_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() || id.len() > 200 {
        return Err("must be 1 to 200 characters long");
    }
    if id.starts_with('.') {
        return Err("must not start with '.'");
    }
    if id.bytes().any(|b| !(0x21..=0x7e).contains(&b) || b == b'/' || b == b'\\') {
        return Err("must be printable ASCII without spaces, '/' or '\\'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn read(text: &str, format: ItemFormat, id_field: Option<&str>) -> Vec<Result<Item, Error>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("items");
        std::fs::write(&path, text).unwrap();
        ItemReader::open(&path, format, id_field).unwrap().collect()
    }

    #[test]
    fn json_ids_come_from_the_field_or_the_canonical_hash() {
        let items = read("{\"id\":\"a\",\"x\":1}\n\n{\"id\":7}\n", ItemFormat::Auto, Some("id"));
        let ids: Vec<_> = items.into_iter().map(|i| i.unwrap().id).collect();
        assert_eq!(ids, ["a", "7"]);
        let items = read("{\"b\":1,\"a\":2}\n{ \"a\": 2, \"b\": 1 }\n", ItemFormat::Auto, None);
        let items: Vec<_> = items.into_iter().map(Result::unwrap).collect();
        assert_eq!(items[0].id, items[1].id);
        assert_eq!(items[0].id.len(), 16);
        assert_eq!(items[1].line, 2);
    }

    #[test]
    fn plain_lines_keep_safe_ids() {
        let items = read("photo-1.jpg\nhas space\n../up\n", ItemFormat::Auto, None);
        let items: Vec<_> = items.into_iter().map(Result::unwrap).collect();
        assert_eq!(items[0].id, "photo-1.jpg");
        assert_eq!(items[1].id.len(), 16);
        assert_eq!(items[2].id.len(), 16);
        assert_eq!(items[1].raw, "has space");
    }

    #[test]
    fn bad_ids_and_json_are_refused_with_the_line() {
        let items = read("{\"id\":\"a/b\"}\n", ItemFormat::JsonLines, Some("id"));
        assert!(matches!(&items[0], Err(Error::BadItem { line: 1, .. })));
        let items = read("{\"id\":1}\nnot json\n", ItemFormat::JsonLines, None);
        assert!(matches!(&items[1], Err(Error::BadItem { line: 2, .. })));
    }

    #[test]
    fn a_message_takes_its_id_from_the_field_then_the_message_id_then_its_body() {
        let item = parse_item(7, b" 42\n", Some("order-42"), ItemFormat::Auto, None).unwrap();
        assert_eq!((item.line, item.id.as_str(), item.raw.as_str()), (7, "order-42", "42"));
        // A message id that is no safe file name is hashed, never used as a path.
        let item = parse_item(1, b"x", Some("../etc"), ItemFormat::Auto, None).unwrap();
        assert_eq!(item.id, short_hash(b"../etc"));
        // Without one: what a line of the same text would get.
        assert_eq!(parse_item(1, b"photo-1.jpg", None, ItemFormat::Auto, None).unwrap().id, "photo-1.jpg");
        let json = parse_item(1, br#"{"b":1,"a":2}"#, None, ItemFormat::Auto, None).unwrap();
        assert_eq!(json.id, short_hash(&idem_core::canonical_payload(br#"{"a":2,"b":1}"#)));
        // --id-field wins over the message id.
        let field = parse_item(1, br#"{"id":"k","x":1}"#, Some("m-1"), ItemFormat::Auto, Some("id")).unwrap();
        assert_eq!(field.id, "k");
    }

    #[test]
    fn a_message_that_is_no_item_says_why() {
        assert_eq!(parse_item(1, b" \n", None, ItemFormat::Auto, None).unwrap_err(), "the message body is empty");
        assert_eq!(
            parse_item(1, &[0xff, 0xfe], None, ItemFormat::Auto, None).unwrap_err(),
            "the message body is not UTF-8"
        );
        let e = parse_item(1, b"not json", None, ItemFormat::Auto, Some("id")).unwrap_err();
        assert!(e.starts_with("not JSON: "), "{e}");
        assert_eq!(parse_item(1, br#"{"x":1}"#, None, ItemFormat::Auto, Some("id")).unwrap_err(), "no field \"id\"");
    }

    #[test]
    fn a_fifo_is_a_stream_read_once_with_its_format_decided_by_the_line_read_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("items");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        assert!(is_stream(&fifo) && is_stream(Path::new("-")));
        let file = dir.path().join("file");
        std::fs::write(&file, "a\n").unwrap();
        assert!(!is_stream(&file));
        let writer = std::thread::spawn({
            let fifo = fifo.clone();
            move || std::fs::write(fifo, "\n{\"id\":\"a\"}\n{\"id\":\"b\"}\n").unwrap()
        });
        let items: Vec<Item> =
            ItemReader::open(&fifo, ItemFormat::Auto, Some("id")).unwrap().map(Result::unwrap).collect();
        writer.join().unwrap();
        let got: Vec<(u64, &str)> = items.iter().map(|i| (i.line, i.id.as_str())).collect();
        assert_eq!(got, [(2, "a"), (3, "b")], "the blank first line counted, the line read ahead kept");
    }
}
