//! Output files: where they go, how they are checked, and how they are put in place.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// What an output must satisfy besides existing and being non-empty.
#[derive(Clone, Debug, Default)]
pub struct Checks {
    /// Parse as JSON (outputs whose path ends in `.json`).
    pub json: bool,
    /// Top-level fields a JSON object output must have.
    pub expect_fields: Vec<String>,
}

/// A verified output's digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digest256 {
    /// Lowercase hex SHA-256.
    pub sha256: String,
    /// Length in bytes.
    pub size: u64,
}

/// Why an output does not verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// No file.
    Missing,
    /// Zero bytes.
    Empty,
    /// Not JSON (truncated or garbled).
    NotJson,
    /// JSON without a field `--expect-fields` names.
    MissingField(String),
    /// Could not be read.
    Unreadable(String),
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Missing => f.write_str("no output"),
            Invalid::Empty => f.write_str("empty output"),
            Invalid::NotJson => f.write_str("output is not valid JSON"),
            Invalid::MissingField(name) => write!(f, "output lacks field {name:?}"),
            Invalid::Unreadable(e) => write!(f, "output unreadable: {e}"),
        }
    }
}

/// Reads `path` whole and checks it (blocking I/O): returns its SHA-256 and length when it verifies.
///
/// # Errors
/// The [`Invalid`] reason: missing, empty, not JSON, a field missing, unreadable.
pub fn verify(path: &Path, checks: &Checks) -> Result<Digest256, Invalid> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Invalid::Missing),
        Err(e) => return Err(Invalid::Unreadable(e.to_string())),
    };
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(|e| Invalid::Unreadable(e.to_string()))?;
    if bytes.is_empty() {
        return Err(Invalid::Empty);
    }
    if checks.json || !checks.expect_fields.is_empty() {
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|_| Invalid::NotJson)?;
        for field in &checks.expect_fields {
            if value.get(field).is_none() {
                return Err(Invalid::MissingField(field.clone()));
            }
        }
    }
    Ok(digest(&bytes))
}

/// Whether `path` still holds exactly the output the ledger recorded (blocking I/O). Cheaper than
/// [`verify`]: the content was verified when it was recorded, so an equal length and digest are enough.
///
/// # Errors
/// The [`Invalid`] reason: missing, unreadable, or another length or digest.
pub fn matches(path: &Path, expected: &Digest256) -> Result<(), Invalid> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Invalid::Missing),
        Err(e) => return Err(Invalid::Unreadable(e.to_string())),
    };
    if meta.len() != expected.size {
        return Err(Invalid::Unreadable(format!("length {} instead of {}", meta.len(), expected.size)));
    }
    let bytes = std::fs::read(path).map_err(|e| Invalid::Unreadable(e.to_string()))?;
    if digest(&bytes).sha256 != expected.sha256 {
        return Err(Invalid::Unreadable("content differs from the recorded SHA-256".into()));
    }
    Ok(())
}

fn digest(bytes: &[u8]) -> Digest256 {
    Digest256 { sha256: hex::encode(Sha256::digest(bytes)), size: bytes.len() as u64 }
}

/// The temporary path one attempt writes: hidden, in the output's directory (so the rename stays on one file
/// system), and unique per owner and attempt, so two holders never share one.
pub fn temp_path(output: &Path, owner: &str, attempt: u32) -> PathBuf {
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    output.with_file_name(format!(".{name}.{owner}.{attempt}.idem-tmp"))
}

/// Makes the contents of `temp` durable (fsync) before it is renamed into place (blocking I/O).
///
/// # Errors
/// The I/O error of the open or fsync.
pub fn sync_file(temp: &Path) -> std::io::Result<()> {
    std::fs::File::open(temp)?.sync_all()
}

/// Renames `temp` over `output` and fsyncs the directory, so the new name survives a crash (blocking I/O).
///
/// # Errors
/// The I/O error of the rename or fsync.
pub fn rename_into_place(temp: &Path, output: &Path) -> std::io::Result<()> {
    std::fs::rename(temp, output)?;
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn verification_finds_partial_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        let json = Checks { json: true, expect_fields: vec!["x".into()] };
        assert_eq!(verify(&p, &json), Err(Invalid::Missing));
        std::fs::write(&p, "").unwrap();
        assert_eq!(verify(&p, &json), Err(Invalid::Empty));
        std::fs::write(&p, "{\"x\": [1, 2").unwrap();
        assert_eq!(verify(&p, &json), Err(Invalid::NotJson));
        std::fs::write(&p, "{\"y\": 1}").unwrap();
        assert_eq!(verify(&p, &json), Err(Invalid::MissingField("x".into())));
        std::fs::write(&p, "{\"x\": 1}").unwrap();
        let d = verify(&p, &json).unwrap();
        assert_eq!(d.size, 8);
        assert_eq!(matches(&p, &d), Ok(()));
        std::fs::write(&p, "{\"x\": 2}").unwrap();
        assert!(matches(&p, &d).is_err());
        assert_eq!(temp_path(&p, "o1", 3), dir.path().join(".a.json.o1.3.idem-tmp"));
    }
}
