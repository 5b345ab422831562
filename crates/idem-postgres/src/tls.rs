//! TLS to PostgreSQL as libpq does it (<https://www.postgresql.org/docs/15/libpq-ssl.html>), over rustls.
//!
//! tokio-postgres's URL parser knows `sslmode=disable|prefer|require` only and no `sslrootcert`, so both are
//! taken out of the URL here, the rest is left to tokio-postgres, and its `ssl_mode` is set from ours (the
//! `verify-*` modes are `require` to it: TLS or nothing). What each mode checks is the rustls verifier chosen
//! here:
//!
//! | `sslmode` | TLS | chain | host name |
//! | --- | --- | --- | --- |
//! | `disable` | never | | |
//! | `prefer` (default) | if the server offers it | only with `sslrootcert` | no |
//! | `require` | always | only with `sslrootcert` (libpq: "same as `verify-ca`" when a root file exists) | no |
//! | `verify-ca` | always | yes | no |
//! | `verify-full` | always | yes | yes |
//!
//! Roots: the PEM file `sslrootcert=PATH`, or the platform's store (`/etc/ssl/certs`) when it is absent or
//! `system` (libpq 16's spelling). libpq would instead read `~/.postgresql/root.crt` and refuse `verify-*`
//! without it; a server certificate from a public CA is the common case for idem's deployments.
//! Unlike libpq, `prefer` with `sslrootcert` does not fall back to plain text after a failed verification:
//! a certificate that does not check out is an error, never a reason to send the data unencrypted.

use std::path::PathBuf;
use std::sync::Arc;

use percent_encoding::percent_decode_str;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::Error;

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }
}

/// A URL's TLS parameters, and the URL without them for tokio-postgres.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) url: String,
    pub(crate) mode: SslMode,
    pub(crate) root_cert: Option<PathBuf>,
    /// `synchronous_standbys=all`: every standby must acknowledge each commit ([`crate::replication`]).
    pub(crate) synchronous_all: bool,
}

/// Takes `sslmode`, `sslrootcert` and idem's `synchronous_standbys` out of a `postgres://` URL's query string (the last of each wins, as in
/// libpq), percent-decoded, and refuses a `target_session_attrs` other than `read-write`.
///
/// # Errors
/// [`Error::InvalidSslMode`] for a mode libpq does not know (`allow` is refused too: it prefers plain text);
/// [`Error::TargetSessionAttrs`]; [`Error::InvalidSynchronous`].
pub(crate) fn parse(url: &str) -> Result<Parsed, Error> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => {
            return Ok(Parsed { url: url.to_owned(), mode: SslMode::Prefer, root_cert: None, synchronous_all: false });
        }
    };
    let (mut mode, mut root_cert, mut synchronous_all) = (SslMode::Prefer, None, false);
    let mut rest = Vec::new();
    for param in query.split('&') {
        let (k, v) = param.split_once('=').unwrap_or((param, ""));
        let value = || percent_decode_str(v).decode_utf8_lossy().into_owned();
        match k {
            "sslmode" => mode = SslMode::parse(&value()).ok_or_else(|| Error::InvalidSslMode(value()))?,
            "sslrootcert" => root_cert = Some(value()),
            "sslcert" | "sslkey" | "sslpassword" => return Err(Error::ClientCertificate(k.to_owned())),
            "target_session_attrs" if value() != "read-write" => return Err(Error::TargetSessionAttrs(value())),
            // idem's own: tokio-postgres would refuse a parameter it does not know.
            "synchronous_standbys" if value() == "all" => synchronous_all = true,
            "synchronous_standbys" => return Err(Error::InvalidSynchronous(value())),
            _ => rest.push(param),
        }
    }
    let url = if rest.is_empty() { base.to_owned() } else { format!("{base}?{}", rest.join("&")) };
    let root_cert = root_cert.filter(|r| r != "system").map(PathBuf::from);
    Ok(Parsed { url, mode, root_cert, synchronous_all })
}

impl Parsed {
    /// The mode tokio-postgres enforces: whether TLS is tried and whether it is required.
    pub(crate) fn tokio_mode(&self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as T;
        match self.mode {
            SslMode::Disable => T::Disable,
            SslMode::Prefer => T::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => T::Require,
        }
    }

    /// The connector for this mode (unused under `disable`, but the pool wants one type).
    ///
    /// # Errors
    /// [`Error::TlsFiles`] when `sslrootcert` cannot be read or holds no certificate, or when the
    /// platform store cannot be read for a mode that verifies.
    pub(crate) fn connector(&self) -> Result<MakeRustlsConnect, Error> {
        let provider = idem_tls::provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Tls(e.to_string()))?;
        let verifies = match self.mode {
            SslMode::Disable => false,
            SslMode::Prefer | SslMode::Require => self.root_cert.is_some(),
            SslMode::VerifyCa | SslMode::VerifyFull => true,
        };
        let config = if !verifies {
            let algorithms = provider.signature_verification_algorithms;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Unverified { algorithms }))
                .with_no_client_auth()
        } else {
            let roots = Arc::new(match &self.root_cert {
                Some(path) => idem_tls::read_roots("sslrootcert", path).map_err(Error::TlsFiles)?,
                None => idem_tls::platform_roots("sslrootcert=").map_err(Error::TlsFiles)?,
            });
            if self.mode == SslMode::VerifyFull {
                builder.with_root_certificates(roots).with_no_client_auth()
            } else {
                let inner = WebPkiServerVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|e| Error::Tls(e.to_string()))?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly { inner }))
                    .with_no_client_auth()
            }
        };
        Ok(MakeRustlsConnect::new(config))
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the name in it is not compared with the host.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            // webpki checks the chain (signatures, validity, key usage) before the name, so a name error
            // means everything else passed.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// `prefer`/`require` without a root file: encrypted, the certificate taken as it comes (libpq's documented
/// behaviour: protection against eavesdropping, not against a man in the middle). The handshake's own
/// signatures are still checked, so the peer holds the key of the certificate it sent.
#[derive(Debug)]
struct Unverified {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libpq_parameters_are_taken_out_and_the_rest_kept() {
        let p =
            parse("postgres://u:p@h:5/db?application_name=x&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem").unwrap();
        assert_eq!(p.url, "postgres://u:p@h:5/db?application_name=x");
        assert_eq!(p.mode, SslMode::VerifyFull);
        assert_eq!(p.root_cert, Some(PathBuf::from("/tmp/ca.pem")));
        let p = parse("postgres://h/db?sslmode=require&sslrootcert=system").unwrap();
        assert_eq!((p.url.as_str(), p.mode, p.root_cert), ("postgres://h/db", SslMode::Require, None));
        let p = parse("postgres://h/db").unwrap();
        assert_eq!((p.url.as_str(), p.mode), ("postgres://h/db", SslMode::Prefer));
        assert!(matches!(parse("postgres://h/db?sslmode=allow"), Err(Error::InvalidSslMode(m)) if m == "allow"));
        let p = parse("postgres://h1:1,h2:2/db?target_session_attrs=read-write&connect_timeout=2").unwrap();
        assert_eq!(p.url, "postgres://h1:1,h2:2/db?target_session_attrs=read-write&connect_timeout=2");
        for refused in ["any", "read-only", "prefer-standby"] {
            let e = parse(&format!("postgres://h1,h2/db?target_session_attrs={refused}")).unwrap_err();
            assert!(matches!(&e, Error::TargetSessionAttrs(v) if v == refused), "{e}");
        }
    }
}
