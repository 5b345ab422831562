//! HTTPS for the clients: rustls on the ring provider, the platform's trust store by default, `--cacert` (curl's
//! name) to trust only a private CA, and an optional client certificate. Nothing here can switch certificate
//! verification off.

use std::path::Path;

use crate::Error;

/// Installs rustls's ring provider as the process default, once. reqwest (built with `rustls-no-provider`, so
/// that aws-lc-rs and its C build stay out) takes the process default and panics when there is none; every
/// constructor in this crate calls this first. When the application installed a provider of its own, that one
/// stays (the `Err` of a second install is the expected outcome, not a failure).
pub fn install_crypto_provider() {
    idem_tls::install_default_provider();
}

/// A `reqwest::ClientBuilder` that can build (the crypto provider installed) and speaks HTTP/1.1 over TLS too.
pub fn client_builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder()
}

/// Whom a client trusts and which certificate it presents.
///
/// The default trusts the platform's store (on Debian `/etc/ssl/certs`, through `rustls-platform-verifier`) and
/// presents none. [`TlsConfig::ca_file`] replaces that store with the CAs of one PEM file, as curl's `--cacert`
/// does; [`TlsConfig::client_cert_files`] adds a client certificate for servers that ask for one (`idem serve
/// --tls-client-ca`).
#[derive(Clone, Debug, Default)]
pub struct TlsConfig {
    roots: Option<Vec<reqwest::Certificate>>,
    identity: Option<reqwest::Identity>,
}

/// Reads `path` for `flag`, naming both on failure.
fn read(flag: &str, path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|e| Error::TlsFiles { reason: format!("cannot read {flag} {}: {e}", path.display()) })
}

impl TlsConfig {
    /// The platform's trust store, no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts only the CA certificates in the PEM file at `path` (one or more `CERTIFICATE` blocks), instead of
    /// the platform's store.
    ///
    /// # Errors
    /// [`Error::TlsFiles`] when the file cannot be read or holds no PEM certificate; the message names the file
    /// and `--cacert`.
    pub fn ca_file(mut self, path: &Path) -> Result<Self, Error> {
        let pem = read("--cacert", path)?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| Error::TlsFiles {
            reason: format!("--cacert {}: not PEM certificates: {e}", path.display()),
        })?;
        if certs.is_empty() {
            return Err(Error::TlsFiles {
                reason: format!("--cacert {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display()),
            });
        }
        self.roots = Some(certs);
        Ok(self)
    }

    /// Presents the certificate chain in the PEM file `cert` with the private key in the PEM file `key` (PKCS#8,
    /// PKCS#1 or SEC1; `None`: in `cert` too, as curl's `--cert` allows) when the server asks for a client
    /// certificate.
    ///
    /// # Errors
    /// [`Error::TlsFiles`] when a file cannot be read, or they hold no certificate or no key; the message names
    /// the files and `--cert`/`--cert-key`.
    pub fn client_cert_files(mut self, cert: &Path, key: Option<&Path>) -> Result<Self, Error> {
        let refused = |e: idem_tls::Error| Error::TlsFiles { reason: e.to_string() };
        let chain = idem_tls::read_certificates("--cert", cert).map_err(refused)?;
        let (key_flag, key_path) = match key {
            Some(key) => ("--cert-key", key),
            None => ("--cert", cert),
        };
        let key_der = idem_tls::read_private_key(key_flag, key_path).map_err(|e| match (key, e) {
            // curl's habit of one file for both is allowed, so say where else the key may be given.
            (None, idem_tls::Error::Invalid { flag, path, reason })
                if reason.starts_with("holds no PEM private key") =>
            {
                Error::TlsFiles {
                    reason: format!("{flag} {}: {reason}; give its key with --cert-key FILE", path.display()),
                }
            }
            (_, e) => refused(e),
        })?;
        // Checked here, as the server checks its own: a key that does not belong to the certificate is a
        // mistake in the files, said once with both names, not a failed handshake later.
        let identity = idem_tls::Identity { cert_flag: "--cert", cert, key_flag, key: key_path };
        rustls::ClientConfig::builder_with_provider(idem_tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| refused(idem_tls::Error::Rustls(e)))?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_client_auth_cert(chain, key_der)
            .map_err(|e| refused(identity.refused(e)))?;
        let mut pem = read("--cert", cert)?;
        if let Some(key) = key {
            pem.push(b'\n');
            pem.extend(read("--cert-key", key)?);
        }
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| Error::TlsFiles {
            reason: format!(
                "--cert {}: not a PEM certificate and private key: {}",
                cert.display(),
                idem_store::error_chain(&e)
            ),
        })?;
        self.identity = Some(identity);
        Ok(self)
    }

    /// `builder` with these settings, the crypto provider installed. Only the roots and the identity change;
    /// verification stays on (there is no switch for it).
    pub fn apply(&self, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        install_crypto_provider();
        let mut builder = builder;
        if let Some(roots) = &self.roots {
            builder = builder.tls_certs_only(roots.iter().cloned());
        }
        if let Some(identity) = &self.identity {
            builder = builder.identity(identity.clone());
        }
        builder
    }
}

/// When `e` failed in the TLS layer, what went wrong, on one line: `certificate verify failed: …` for a server
/// certificate the client refused (unknown issuer, expired, not valid for the host name), or the handshake's
/// failure with a hint (a plaintext server, a server demanding a client certificate). `None` for other errors.
pub fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let hints = idem_tls::Hints {
        peer: "server",
        trust: "--cacert FILE",
        client_cert: "--cert FILE --cert-key FILE",
        plaintext: "is it plain HTTP? then use http://",
    };
    idem_tls::rustls_error_in(e).map(|tls| idem_tls::describe(tls, hints))
}
