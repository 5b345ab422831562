//! `idem key`: the deterministic idempotency key of one logical write.

use std::io::Read;

use crate::error::Error;

/// Flags of `idem key`. The key is `PREFIX:ID:HASH`: prefix and id are printable ASCII (255 bytes in all with
/// the 18 of the hash); send it quoted (`--header`) when the id has spaces.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("payload").required(true).args(["json", "data", "no_payload"])))]
pub struct KeyArgs {
    /// Readable prefix naming the kind of write, e.g. orders (no ':').
    #[arg(long)]
    prefix: String,
    /// The stable id of the item the write is about, e.g. 123.
    #[arg(long)]
    id: String,
    /// The payload as JSON (canonicalised with RFC 8785, so key order and whitespace do not matter; must
    /// parse); @FILE reads a file, @- standard input.
    #[arg(long)]
    json: Option<String>,
    /// The payload as bytes: canonicalised like --json when it happens to parse as JSON, else hashed as
    /// given; @FILE reads a file, @- standard input.
    #[arg(long)]
    data: Option<String>,
    /// The write has no payload (the key then depends on prefix and id only).
    #[arg(long)]
    no_payload: bool,
    /// Print the key as an sf-string field value, ready for an `Idempotency-Key:` header.
    #[arg(long)]
    header: bool,
}

/// A flag's bytes: the text itself, `@FILE` a file's contents, `@-` standard input.
pub(crate) fn payload(arg: &str) -> Result<Vec<u8>, Error> {
    match arg.strip_prefix('@') {
        Some("-") => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            Ok(buf)
        }
        Some(path) => std::fs::read(path).map_err(|e| Error::Config(format!("cannot read {path}: {e}"))),
        None => Ok(arg.as_bytes().to_vec()),
    }
}

/// Prints `PREFIX:ID:HASH` (HASH: 16 hex digits of the SHA-256 of the canonical payload).
///
/// # Errors
/// [`Error::Config`] for invalid JSON, a prefix with `:`, a key over 255 bytes or non-printable characters.
pub fn run(args: KeyArgs) -> Result<(), Error> {
    let bytes = match (&args.json, &args.data) {
        (Some(json), _) => {
            let bytes = payload(json)?;
            serde_json::from_slice::<serde_json::Value>(&bytes)
                .map_err(|e| Error::Config(format!("--json is not valid JSON: {e}")))?;
            bytes
        }
        (None, Some(data)) => payload(data)?,
        (None, None) => Vec::new(),
    };
    let key = idem_core::derive_key(&args.prefix, &args.id, &bytes)
        .map_err(|e| Error::Config(format!("--prefix {:?} / --id {:?}: {e}", args.prefix, args.id)))?;
    let line = if args.header { key.to_field_value() } else { key.to_string() };
    crate::error::out(&format!("{line}\n"))
}
