//! rustls's errors in words a user can act on. rustls prints many of them in `Debug` form
//! (`Other(OtherError(UnsupportedCertVersion))`, `InconsistentKeys(KeyMismatch)`) and times as UNIX seconds.

use std::error::Error as StdError;
use std::time::{Duration, SystemTime};

use rustls::pki_types::UnixTime;
use rustls::{AlertDescription, CertificateError};

/// How to name the other side and the settings that fix a failure, in the words of the caller's interface.
#[derive(Clone, Copy, Debug)]
pub struct Hints<'a> {
    /// The other side: `server`, `upstream`, `PostgreSQL server`, `client`.
    pub peer: &'a str,
    /// How to trust a private CA, e.g. `--cacert FILE`.
    pub trust: &'a str,
    /// How to present a client certificate, e.g. `--cert FILE --cert-key FILE`.
    pub client_cert: &'a str,
    /// What to do when the other side does not speak TLS, e.g. `is it plain HTTP? then use http://`.
    pub plaintext: &'a str,
}

/// The rustls error in `e`'s chain of sources, looking inside `std::io::Error`s (whose `source` skips the
/// error they wrap) and `Arc`-shared errors, if there is one.
pub fn rustls_error_in<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut source: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        // An error kept in an `Arc` (the redis crate keeps its I/O errors so) is stepped into the same way: the
        // `Arc`'s `source` is its content's, which skips the content itself.
        if let Some(shared) = err.downcast_ref::<std::sync::Arc<dyn StdError + Send + Sync>>() {
            source = Some(&**shared as &(dyn StdError + 'static));
            continue;
        }
        source = match err.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => err.source(),
        };
    }
    None
}

/// One line saying what failed in a TLS handshake: `certificate verify failed: …` for a certificate that was
/// refused (unknown issuer, expired with its date, host name mismatch with the names it has, X.509 v1, a CA
/// certificate presented as a host's), or `TLS handshake failed: …` with what to change.
pub fn describe(e: &rustls::Error, hints: Hints<'_>) -> String {
    let peer = hints.peer;
    match e {
        rustls::Error::InvalidCertificate(cert) => format!("certificate verify failed: {}", certificate(cert, hints)),
        rustls::Error::InvalidMessage(_)
        | rustls::Error::InappropriateMessage { .. }
        | rustls::Error::InappropriateHandshakeMessage { .. } => {
            format!("TLS handshake failed: the {peer} did not answer in TLS ({})", hints.plaintext)
        }
        rustls::Error::AlertReceived(AlertDescription::CertificateRequired) => {
            format!("TLS handshake failed: the {peer} requires a client certificate ({})", hints.client_cert)
        }
        rustls::Error::AlertReceived(
            alert @ (AlertDescription::UnknownCA
            | AlertDescription::BadCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::CertificateRevoked
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::AccessDenied),
        ) => format!("TLS handshake failed: the {peer} refused the client certificate: {}", client_refusal(*alert)),
        rustls::Error::AlertReceived(AlertDescription::HandshakeFailure | AlertDescription::ProtocolVersion)
        | rustls::Error::PeerIncompatible(_) => {
            format!("TLS handshake failed: the {peer} and idem share no TLS version or cipher suite ({e})")
        }
        rustls::Error::NoCertificatesPresented => {
            format!("TLS handshake failed: the {peer} presented no certificate")
        }
        other => format!("TLS handshake failed: {other}"),
    }
}

/// Why a server refused a client certificate, from its alert (RFC 8446 §6.2).
fn client_refusal(alert: AlertDescription) -> &'static str {
    match alert {
        AlertDescription::UnknownCA => "it is not issued by a CA the server trusts (its --tls-client-ca)",
        AlertDescription::CertificateExpired => "it has expired, or is not valid yet",
        AlertDescription::CertificateRevoked => "it has been revoked",
        AlertDescription::UnsupportedCertificate => {
            "it is not a client certificate (its extendedKeyUsage lacks clientAuth)"
        }
        AlertDescription::AccessDenied => "the certificate is valid but this client is not allowed",
        _ => "the server found it invalid",
    }
}

/// `other.example` for webpki's `DnsName("other.example")`, `127.0.0.1` for `IpAddress(127.0.0.1)`.
fn plain_name(presented: &str) -> &str {
    presented
        .strip_prefix("DnsName(\"")
        .and_then(|n| n.strip_suffix("\")"))
        .or_else(|| presented.strip_prefix("IpAddress(").and_then(|n| n.strip_suffix(')')))
        .unwrap_or(presented)
}

fn date(t: &UnixTime) -> String {
    humantime::format_rfc3339_seconds(SystemTime::UNIX_EPOCH + Duration::from_secs(t.as_secs())).to_string()
}

pub(crate) fn certificate(e: &CertificateError, hints: Hints<'_>) -> String {
    let peer = hints.peer;
    match e {
        CertificateError::UnknownIssuer => format!(
            "unknown issuer: the {peer}'s certificate is not signed by a trusted CA ({} names the CA to trust), or \
             the {peer} sends it without its intermediate CA certificates (its certificate file must hold the chain)",
            hints.trust
        ),
        CertificateError::ExpiredContext { time, not_after } => {
            format!("expired: the {peer}'s certificate was valid until {}, it is now {}", date(not_after), date(time))
        }
        CertificateError::Expired => format!("expired: the {peer}'s certificate is past its validity period"),
        CertificateError::NotValidYetContext { time, not_before } => format!(
            "not yet valid: the {peer}'s certificate is valid from {}, it is now {} (is a clock wrong?)",
            date(not_before),
            date(time)
        ),
        CertificateError::NotValidYet => format!("not yet valid: the {peer}'s certificate is not valid yet"),
        CertificateError::NotValidForNameContext { expected, presented } => {
            if presented.is_empty() {
                return format!(
                    "host name mismatch: the {peer}'s certificate names no host (it has no subjectAltName), so it \
                     is not valid for {}",
                    expected.to_str()
                );
            }
            let names: Vec<&str> = presented.iter().map(|n| plain_name(n)).collect();
            format!(
                "host name mismatch: the {peer}'s certificate is for {}, not {}",
                names.join(", "),
                expected.to_str()
            )
        }
        CertificateError::NotValidForName => {
            format!("host name mismatch: the {peer}'s certificate is not valid for this host name")
        }
        // A trusted CA with the issuer's name but another key: most often the CA was made again under the same
        // name, and the file trusted is the new one while the certificate was signed by the old one.
        CertificateError::BadSignature => format!(
            "bad signature: the {peer}'s certificate names a trusted CA as its issuer but was not signed by that CA's \
             key (was the CA made again under the same name? {} must be the CA that signed it)",
            hints.trust
        ),
        #[allow(deprecated)] // still produced by verifiers built on older webpki
        CertificateError::UnsupportedSignatureAlgorithm
        | CertificateError::UnsupportedSignatureAlgorithmContext { .. }
        | CertificateError::UnsupportedSignatureAlgorithmForPublicKeyContext { .. } => format!(
            "bad signature: the {peer}'s certificate is signed with an algorithm that does not fit the key of the \
             trusted CA of that name (was the CA made again under the same name, with another key type? {} must be \
             the CA that signed it)",
            hints.trust
        ),
        CertificateError::Revoked => format!("revoked: the {peer}'s certificate has been revoked"),
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
            format!("the {peer}'s certificate is not for this use (its extendedKeyUsage): {e}")
        }
        CertificateError::Other(other) => match other.0.downcast_ref::<webpki::Error>() {
            Some(webpki::Error::UnsupportedCertVersion) => format!(
                "the {peer}'s certificate is X.509 v1; only v3 certificates are accepted (issue it with \
                 extensions: subjectAltName and basicConstraints)"
            ),
            Some(webpki::Error::CaUsedAsEndEntity) => format!(
                "the {peer} presents a CA certificate (basicConstraints CA:TRUE) as its own; it must present a \
                 certificate signed by that CA"
            ),
            Some(webpki::Error::EndEntityUsedAsCa) => format!(
                "the {peer}'s chain has a certificate signed by one that is not a CA (basicConstraints CA:FALSE)"
            ),
            Some(webpki::Error::UnsupportedCriticalExtension) => {
                format!("the {peer}'s certificate has a critical extension that is not supported")
            }
            _ => other.to_string(),
        },
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use super::*;

    const HINTS: Hints<'static> =
        Hints { peer: "server", trust: "--cacert FILE", client_cert: "--cert FILE", plaintext: "use http://" };

    #[test]
    fn dates_and_names_are_said_as_people_write_them() {
        let expired = rustls::Error::InvalidCertificate(CertificateError::ExpiredContext {
            time: UnixTime::since_unix_epoch(Duration::from_secs(1_796_083_200)),
            not_after: UnixTime::since_unix_epoch(Duration::from_secs(978_307_200)),
        });
        assert_eq!(
            describe(&expired, HINTS),
            "certificate verify failed: expired: the server's certificate was valid until 2001-01-01T00:00:00Z, \
             it is now 2026-12-01T00:00:00Z"
        );
        let name = rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext {
            expected: rustls::pki_types::ServerName::try_from("localhost").unwrap().to_owned(),
            presented: vec!["DnsName(\"other.example\")".to_owned(), "IpAddress(10.0.0.1)".to_owned()],
        });
        assert_eq!(
            describe(&name, HINTS),
            "certificate verify failed: host name mismatch: the server's certificate is for other.example, \
             10.0.0.1, not localhost"
        );
        let v1 = rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(
            webpki::Error::UnsupportedCertVersion,
        ))));
        assert!(describe(&v1, HINTS).contains("certificate is X.509 v1; only v3"), "{}", describe(&v1, HINTS));
    }

    #[test]
    fn a_rustls_error_is_found_inside_io_errors() {
        let inner = std::io::Error::other(rustls::Error::NoCertificatesPresented);
        let outer = std::io::Error::other(inner);
        assert!(matches!(rustls_error_in(&outer), Some(rustls::Error::NoCertificatesPresented)));
        let shared: Arc<dyn StdError + Send + Sync> = Arc::new(outer);
        let held = std::io::Error::other(shared);
        assert!(matches!(rustls_error_in(&held), Some(rustls::Error::NoCertificatesPresented)));
    }
}
