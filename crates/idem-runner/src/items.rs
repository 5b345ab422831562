//! Work items, streamed from a file one line at a time (never all held at once).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::Error;

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
    /// 1-based line number in the items file.
    pub line: u64,
    /// Its id: the `--id-field` value, a safe plain line as is, or a short hash of the canonical item.
    pub id: String,
    /// The line as read (without the newline): the item's JSON, or the plain text.
    pub raw: String,
}

/// Reads items from `path` lazily.
#[derive(Debug)]
pub struct ItemReader {
    path: PathBuf,
    lines: std::io::Lines<BufReader<File>>,
    line: u64,
    json: bool,
    id_field: Option<String>,
}

impl ItemReader {
    /// Opens `path` and decides its format.
    ///
    /// # Errors
    /// [`Error::ReadItems`] when the file cannot be opened or read; [`Error::Config`] when it is not a regular
    /// file (stdin, a FIFO).
    pub fn open(path: &Path, format: ItemFormat, id_field: Option<&str>) -> Result<Self, Error> {
        let read_err = |source| Error::ReadItems { path: path.to_owned(), source };
        // The file is read more than once (format, duplicate outputs, the run): a pipe would be empty by the
        // run, and its items silently lost.
        if !std::fs::metadata(path).map_err(read_err)?.is_file() {
            return Err(Error::Config(format!(
                "--items {} is not a regular file (a pipe or device is read more than once here); save the items \
                 to a file first",
                path.display()
            )));
        }
        let json = match format {
            ItemFormat::JsonLines => true,
            ItemFormat::Lines => false,
            ItemFormat::Auto => {
                let first = BufReader::new(File::open(path).map_err(read_err)?)
                    .lines()
                    .map_while(Result::ok)
                    .find(|l| !l.trim().is_empty());
                id_field.is_some()
                    || first.is_some_and(|l| {
                        l.trim_start().starts_with('{') && serde_json::from_str::<serde_json::Value>(&l).is_ok()
                    })
            }
        };
        let file = File::open(path).map_err(read_err)?;
        Ok(Self {
            path: path.to_owned(),
            lines: BufReader::with_capacity(256 * 1024, file).lines(),
            line: 0,
            json,
            id_field: id_field.map(str::to_owned),
        })
    }

    /// True when items are JSON values.
    pub fn is_json(&self) -> bool {
        self.json
    }

    fn bad(&self, reason: String) -> Error {
        Error::BadItem { path: self.path.clone(), line: self.line, reason }
    }

    fn parse(&self, raw: String) -> Result<Item, Error> {
        let id = if self.json {
            let value: serde_json::Value =
                serde_json::from_str(&raw).map_err(|e| self.bad(format!("not JSON: {e}")))?;
            match &self.id_field {
                Some(field) => {
                    let id = match value.get(field) {
                        Some(serde_json::Value::String(s)) => s.clone(),
                        Some(serde_json::Value::Number(n)) => n.to_string(),
                        Some(_) => return Err(self.bad(format!("field {field:?} is neither a string nor a number"))),
                        None => return Err(self.bad(format!("no field {field:?}"))),
                    };
                    check_id(&id).map_err(|r| self.bad(format!("id {id:?} {r}")))?;
                    id
                }
                None => short_hash(&idem_core::canonical_payload(raw.as_bytes())),
            }
        } else if check_id(&raw).is_ok() && raw.len() <= 100 {
            raw.clone()
        } else {
            short_hash(raw.as_bytes())
        };
        Ok(Item { line: self.line, id, raw })
    }
}

impl Iterator for ItemReader {
    type Item = Result<Item, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.line += 1;
            let raw = match self.lines.next()? {
                Ok(l) => l,
                Err(source) => return Some(Err(Error::ReadItems { path: self.path.clone(), source })),
            };
            let trimmed = raw.trim();
            if trimmed.is_empty() {
                continue;
            }
            let raw = if trimmed.len() == raw.len() { raw } else { trimmed.to_owned() };
            return Some(self.parse(raw));
        }
    }
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
}
