//! A look at a host's own certificate when it is loaded. rustls serves whatever it is given; the failure then
//! shows only on the clients' side, one handshake at a time. A warning at start-up (and at each SIGHUP
//! reload) names it once, where the operator looks.

use std::path::Path;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;
use x509_parser::prelude::{FromDer, X509Certificate};

/// What clients will refuse in `chain`'s first certificate (the host's own, read from the file `flag` names
/// at `path`), one sentence each: expired or not yet valid (with the date), X.509 v1 (refused by rustls and
/// other webpki clients), a CA certificate (basicConstraints CA:TRUE), no subjectAltName (host names are
/// checked against it only, RFC 6125 §6.4.4). Empty when nothing is wrong, or when the certificate cannot be
/// parsed (rustls then says so itself).
pub fn check_own_certificate(flag: &str, path: &Path, chain: &[CertificateDer<'_>]) -> Vec<String> {
    let Some(first) = chain.first() else { return Vec::new() };
    let Ok((_, cert)) = X509Certificate::from_der(first.as_ref()) else { return Vec::new() };
    let file = format!("{flag} {}", path.display());
    let mut found = Vec::new();
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let validity = cert.validity();
    let (not_before, not_after) = (validity.not_before.timestamp(), validity.not_after.timestamp());
    if i64::try_from(now).is_ok_and(|now| now > not_after) {
        found.push(format!("{file}: the certificate expired on {}; clients will refuse it", date(not_after)));
    } else if i64::try_from(now).is_ok_and(|now| now < not_before) {
        found.push(format!(
            "{file}: the certificate is valid only from {}; clients will refuse it until then",
            date(not_before)
        ));
    }
    if cert.version().0 < 2 {
        found.push(format!(
            "{file}: the certificate is X.509 v{}; rustls and other webpki clients accept only v3 (issue it with \
             extensions: subjectAltName and basicConstraints)",
            cert.version().0 + 1
        ));
    }
    if cert.is_ca() {
        found.push(format!(
            "{file}: the first certificate is a CA certificate (basicConstraints CA:TRUE); it must be this \
             host's own certificate, signed by the CA"
        ));
    }
    if matches!(cert.subject_alternative_name(), Ok(None)) {
        found.push(format!(
            "{file}: the certificate has no subjectAltName; clients check host names against it only, so they \
             will refuse it"
        ));
    }
    found
}

fn date(unix: i64) -> String {
    let t = SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(unix).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn cert(edit: impl FnOnce(&mut rcgen::CertificateParams)) -> CertificateDer<'static> {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        edit(&mut params);
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn a_good_certificate_has_nothing_to_say() {
        let good = cert(|_| {});
        assert_eq!(check_own_certificate("--tls-cert", Path::new("c.pem"), &[good]), Vec::<String>::new());
    }

    #[test]
    fn expired_ca_and_nameless_certificates_are_named() {
        let expired = cert(|p| {
            p.not_before = rcgen::date_time_ymd(2000, 1, 1);
            p.not_after = rcgen::date_time_ymd(2001, 1, 1);
        });
        let said = check_own_certificate("--tls-cert", Path::new("c.pem"), &[expired]);
        assert_eq!(
            said,
            vec!["--tls-cert c.pem: the certificate expired on 2001-01-01T00:00:00Z; clients will refuse it"]
        );
        let ca = cert(|p| p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained));
        let said = check_own_certificate("--tls-cert", Path::new("c.pem"), &[ca]);
        assert!(said[0].contains("is a CA certificate (basicConstraints CA:TRUE)"), "{said:?}");
        let nameless = cert(|p| p.subject_alt_names.clear());
        let said = check_own_certificate("--tls-cert", Path::new("c.pem"), &[nameless]);
        assert!(said[0].contains("has no subjectAltName"), "{said:?}");
    }
}
