//! PEM files (certificate chains, private keys, trust anchors) and the platform's trust store, read with errors
//! that name the flag and the file; [`Identity`], a chain and its key.

use std::path::Path;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::Error;
use crate::describe::{self, Hints};

fn read(flag: &str, path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Read { flag: flag.to_owned(), path: path.to_owned(), source })
}

fn invalid(flag: &str, path: &Path, reason: impl Into<String>) -> Error {
    Error::Invalid { flag: flag.to_owned(), path: path.to_owned(), reason: reason.into() }
}

/// The certificates (PEM `CERTIFICATE` blocks, in file order) of the file `flag` names.
///
/// # Errors
/// [`Error::Read`]; [`Error::Invalid`] when a block is not valid PEM or there is none.
pub fn read_certificates(flag: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let bytes = read(flag, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(flag, path, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(flag, path, "holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
    }
    Ok(certs)
}

/// The private key (PEM: PKCS#8, PKCS#1 or SEC1; the first one) of the file `flag` names.
///
/// # Errors
/// [`Error::Read`]; [`Error::Invalid`] when the file holds no key, or only an encrypted one (idem has no
/// passphrase to give; the message says how to decrypt it).
pub fn read_private_key(flag: &str, path: &Path) -> Result<PrivateKeyDer<'static>, Error> {
    let bytes = read(flag, path)?;
    match PrivateKeyDer::from_pem_slice(&bytes) {
        Ok(key) => Ok(key),
        Err(_) if contains(&bytes, b"ENCRYPTED PRIVATE KEY") || contains(&bytes, b"Proc-Type: 4,ENCRYPTED") => {
            Err(invalid(
                flag,
                path,
                format!(
                    "the private key is encrypted; idem reads unencrypted keys only (decrypt it with `openssl pkey \
                     -in {0} -out {0}.plain` and keep that file readable by idem alone)",
                    path.display()
                ),
            ))
        }
        Err(rustls::pki_types::pem::Error::NoItemsFound) => {
            Err(invalid(flag, path, "holds no PEM private key (-----BEGIN PRIVATE KEY-----)"))
        }
        Err(e) => Err(invalid(flag, path, format!("not a PEM private key: {e}"))),
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Trust anchors from the CA certificates of the file `flag` names (curl's `--cacert`, libpq's
/// `sslrootcert`).
///
/// # Errors
/// [`Error::Read`]; [`Error::Invalid`] when the file holds no certificate or one that cannot be a trust anchor.
pub fn read_roots(flag: &str, path: &Path) -> Result<RootCertStore, Error> {
    let mut roots = RootCertStore::empty();
    for cert in read_certificates(flag, path)? {
        roots.add(cert).map_err(|e| invalid(flag, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// Trust anchors from the platform's store (rustls-native-certs: `SSL_CERT_FILE`/`SSL_CERT_DIR`, else
/// `/etc/ssl/certs` on Debian). Entries that cannot be parsed are skipped, as every TLS client does.
///
/// # Errors
/// [`Error::NoPlatformRoots`] when not one certificate could be read; its message names `flag`, the way to
/// give a CA file instead.
pub fn platform_roots(flag: &str) -> Result<RootCertStore, Error> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let _ = roots.add_parsable_certificates(found.certs);
    if roots.is_empty() {
        let detail = found.errors.first().map(|e| format!(": {e}")).unwrap_or_default();
        return Err(Error::NoPlatformRoots { flag: flag.to_owned(), detail });
    }
    Ok(roots)
}

/// The chain and key files of one TLS identity (a server certificate, or a client certificate), with the
/// flags that named them, for error messages.
#[derive(Clone, Debug)]
pub struct Identity<'a> {
    /// The flag of the chain file, e.g. `--tls-cert`.
    pub cert_flag: &'a str,
    /// The chain (PEM, this host's certificate first, then its intermediates).
    pub cert: &'a Path,
    /// The flag of the key file, e.g. `--tls-key`.
    pub key_flag: &'a str,
    /// The private key (PEM) of the chain's first certificate.
    pub key: &'a Path,
}

impl Identity<'_> {
    /// Reads both files.
    ///
    /// # Errors
    /// As [`read_certificates`] and [`read_private_key`].
    pub fn read(&self) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), Error> {
        Ok((read_certificates(self.cert_flag, self.cert)?, read_private_key(self.key_flag, self.key)?))
    }

    /// `e` from rustls when it was given this identity, in words: [`Error::KeyMismatch`] for a key that does
    /// not belong to the chain's first certificate (the chain in the wrong order, or the wrong key file).
    pub fn refused(&self, e: rustls::Error) -> Error {
        match e {
            rustls::Error::InconsistentKeys(_) => Error::KeyMismatch {
                cert_flag: self.cert_flag.to_owned(),
                cert: self.cert.to_owned(),
                key_flag: self.key_flag.to_owned(),
                key: self.key.to_owned(),
            },
            // rustls parses the certificate to match the key; webpki refuses an X.509 v1 one there.
            rustls::Error::InvalidCertificate(cert) => {
                let hints = Hints { peer: "host", trust: "", client_cert: "", plaintext: "" };
                let why = describe::certificate(&cert, hints);
                Error::Invalid { flag: self.cert_flag.to_owned(), path: self.cert.to_owned(), reason: why }
            }
            other => Error::Rustls(other),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn an_encrypted_key_is_named_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.pem");
        std::fs::write(&path, "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n")
            .unwrap();
        let e = read_private_key("--tls-key", &path).unwrap_err().to_string();
        assert!(e.starts_with("--tls-key "), "{e}");
        assert!(e.contains("the private key is encrypted; idem reads unencrypted keys only"), "{e}");
    }

    #[test]
    fn a_file_without_a_key_or_a_certificate_says_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.pem");
        std::fs::write(&path, "hello\n").unwrap();
        let e = read_private_key("--tls-key", &path).unwrap_err().to_string();
        assert!(e.ends_with("holds no PEM private key (-----BEGIN PRIVATE KEY-----)"), "{e}");
        let e = read_certificates("--tls-cert", &path).unwrap_err().to_string();
        assert!(e.ends_with("holds no PEM certificate (-----BEGIN CERTIFICATE-----)"), "{e}");
        let e = read_roots("--cacert", &dir.path().join("missing.pem")).unwrap_err().to_string();
        assert!(e.starts_with("cannot read --cacert "), "{e}");
    }
}
