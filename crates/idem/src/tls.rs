//! `idem serve --tls-cert/--tls-key/--tls-client-ca`: the PEM files read into a rustls `ServerConfig`, and
//! re-read on SIGHUP.

use std::path::PathBuf;
use std::sync::Arc;

use crate::error::Error;

/// The TLS files of a server, as given.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// Certificate chain (PEM, leaf first).
    pub cert: PathBuf,
    /// Private key of the leaf (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates (PEM) that client certificates must chain to; `None`: no client certificates asked.
    pub client_ca: Option<PathBuf>,
}

fn config_error(e: idem_tls::Error) -> Error {
    Error::Config(e.to_string())
}

impl TlsFiles {
    /// Reads the files and builds the configuration: TLS 1.2 and 1.3 on the ring provider, ALPN `h2` and
    /// `http/1.1`, and with `client_ca` a client certificate required (RFC 8446 §4.3.2) and checked against it.
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag and the file that cannot be read, holds no certificate or key, or whose
    /// key does not match the certificate.
    pub fn load(&self) -> Result<Arc<rustls::ServerConfig>, Error> {
        let identity =
            idem_tls::Identity { cert_flag: "--tls-cert", cert: &self.cert, key_flag: "--tls-key", key: &self.key };
        let (chain, key) = identity.read().map_err(config_error)?;
        // Looked at before rustls takes the chain; said only once the configuration is good (an error then
        // stays the one line that matters).
        let warnings = idem_tls::check_own_certificate("--tls-cert", &self.cert, &chain);
        let provider = idem_tls::provider();
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| config_error(idem_tls::Error::Rustls(e)))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = idem_tls::read_roots("--tls-client-ca", ca).map_err(config_error)?;
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| Error::Config(format!("--tls-client-ca {}: {e}", ca.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|e| config_error(identity.refused(e)))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        // Served as given, but clients will refuse it: say so once, here, rather than in every client's error.
        for warning in warnings {
            tracing::warn!("{warning}");
        }
        Ok(Arc::new(config))
    }

    /// Listens for SIGHUP now (so a SIGHUP right after start-up cannot end the process, SIGHUP's default), and
    /// returns the task that, on every SIGHUP, re-reads the files and puts the new configuration in `slot` for
    /// new handshakes; open connections keep theirs. Files that fail to load leave the previous configuration
    /// serving, with an error logged that names the file.
    ///
    /// # Errors
    /// [`Error::Io`] when the signal handler cannot be installed.
    pub fn reload_on_sighup(
        self,
        slot: idem_server::TlsConfigSlot,
    ) -> Result<impl std::future::Future<Output = ()> + Send + 'static, Error> {
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        Ok(async move {
            while hup.recv().await.is_some() {
                match self.load() {
                    Ok(config) => {
                        slot.replace(config);
                        tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded for new connections");
                    }
                    Err(e) => tracing::error!(error = %e, "TLS reload failed; still serving the previous certificate"),
                }
            }
        })
    }
}

/// The TLS client files of an `https` upstream (`idem serve --upstream https://…`), as given.
#[derive(Clone, Debug, Default)]
pub struct UpstreamTlsFiles {
    /// `--upstream-cacert`: trust only the CA certificates (PEM) in this file instead of the platform's store.
    pub cacert: Option<PathBuf>,
    /// `--upstream-cert` / `--upstream-cert-key`: a client certificate chain (PEM, leaf first) and its key,
    /// presented when the upstream asks for one (RFC 8446 §4.3.2).
    pub client: Option<(PathBuf, PathBuf)>,
}

impl UpstreamTlsFiles {
    /// Reads the files into a client configuration on the ring provider (TLS 1.2 and 1.3); `None` when no file
    /// was given (the proxy then uses the platform's trust store).
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag and the file that cannot be read, holds no certificate or key, or whose
    /// key does not match the certificate.
    pub fn load(&self) -> Result<Option<Arc<rustls::ClientConfig>>, Error> {
        if self.cacert.is_none() && self.client.is_none() {
            return Ok(None);
        }
        let roots = match &self.cacert {
            Some(ca) => idem_tls::read_roots("--upstream-cacert", ca),
            None => idem_tls::platform_roots("--upstream-cacert"),
        }
        .map_err(config_error)?;
        let builder = rustls::ClientConfig::builder_with_provider(idem_tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| config_error(idem_tls::Error::Rustls(e)))?
            .with_root_certificates(roots);
        let config = match &self.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let identity =
                    idem_tls::Identity { cert_flag: "--upstream-cert", cert, key_flag: "--upstream-cert-key", key };
                let (chain, key_der) = identity.read().map_err(config_error)?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| config_error(identity.refused(e)))?
            }
        };
        Ok(Some(Arc::new(config)))
    }
}
