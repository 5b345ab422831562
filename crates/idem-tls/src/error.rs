//! [`Error`]: why TLS files or settings could not be used.

use std::path::PathBuf;

/// Why TLS files or settings could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file named by `flag` cannot be read.
    #[error("cannot read {flag} {}: {source}", path.display())]
    Read {
        /// The flag or URL parameter that named the file, e.g. `--cacert` or `sslrootcert`.
        flag: String,
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A file was read but does not hold what `flag` needs (no certificate, no key, an encrypted key, not a CA).
    #[error("{flag} {}: {reason}", path.display())]
    Invalid {
        /// The flag or URL parameter that named the file.
        flag: String,
        /// The file.
        path: PathBuf,
        /// What is wrong with it, and what to do.
        reason: String,
    },
    /// No certificate could be read from the platform's trust store (on Debian `/etc/ssl/certs`, package
    /// `ca-certificates`).
    #[error("the platform's trust store holds no certificate{detail}: name the CA to trust with {flag} FILE")]
    NoPlatformRoots {
        /// The flag that names a CA file instead.
        flag: String,
        /// `: ` and the first error met while reading the store, or empty.
        detail: String,
    },
    /// The private key does not belong to the first certificate of the chain.
    #[error(
        "the private key in {key_flag} {} does not belong to the first certificate in {cert_flag} {}: the file \
         must start with this host's own certificate, then its intermediates",
        key.display(), cert.display()
    )]
    KeyMismatch {
        /// The flag of the certificate chain.
        cert_flag: String,
        /// The certificate chain file.
        cert: PathBuf,
        /// The flag of the key.
        key_flag: String,
        /// The key file.
        key: PathBuf,
    },
    /// rustls refused a configuration (a protocol version or key type it does not support).
    #[error("TLS: {0}")]
    Rustls(#[source] rustls::Error),
}
