/// Everything idem-core refuses: malformed idempotency keys and undecodable records.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key has no characters (draft §2: at least one).
    #[error("idempotency key is empty")]
    KeyEmpty,
    /// The key is longer than the limit, in bytes.
    #[error("idempotency key is {len} bytes long; at most {max} are allowed")]
    KeyTooLong {
        /// Length seen, in bytes.
        len: usize,
        /// The limit, in bytes.
        max: usize,
    },
    /// A byte outside printable ASCII (`0x20..=0x7E`): control characters, CR/LF, DEL or non-ASCII.
    #[error("idempotency key has byte 0x{byte:02x} at position {position}; only printable ASCII is allowed")]
    KeyInvalidCharacter {
        /// Zero-based byte offset.
        position: usize,
        /// The offending byte.
        byte: u8,
    },
    /// Not an sf-string (RFC 9651 §3.3.3) nor a bare key.
    #[error("idempotency key header is malformed: {reason}")]
    KeyMalformed {
        /// What the parser objected to.
        reason: String,
    },
    /// The request carries the header on more than one field line.
    #[error("the Idempotency-Key header appears more than once")]
    KeyRepeated,
    /// [`derive_key`](crate::derive_key) was given an empty prefix or one containing `:`.
    #[error("key prefix {prefix:?} must be non-empty and must not contain ':'")]
    DerivePrefix {
        /// The prefix given.
        prefix: String,
    },
    /// A stored record could not be decoded (written by another version, or not a record at all).
    #[error("stored idempotency record is not readable: {reason}")]
    RecordCorrupt {
        /// What was wrong.
        reason: String,
    },
}
