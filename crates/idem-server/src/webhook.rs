//! Webhook signature schemes and presets for routes of the proxy ([`RoutePolicy`](idem_tower::RoutePolicy)): a [`Verifier`]
//! checks HMAC-SHA256 signatures over the raw request bytes before anything is claimed, with every secret of
//! its [`Secrets`] (several during a rotation), and [`preset`] fills a route's key sources, ignores and scheme
//! for a known sender.
//!
//! Each comparison is `hmac`'s `verify_slice`, constant-time. Secrets are keyed into HMAC states once, when
//! they are loaded (and again when [`Verifier::replace_secrets`] swaps them, on SIGHUP in `idem serve`), and
//! never shown: [`Secrets`]' `Debug` prints only how many there are.

use std::str::FromStr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use bytes::Bytes;
use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use http::request::Parts;
use idem_tower::{Ignore, KeySource, MissingKey, Refusal, RefusalReason, RouteError, Verify};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Secrets are accepted with or without `=` padding, as the Standard Webhooks libraries accept them.
const SECRET_BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Secrets read from one file at most (one per non-empty line).
pub const MAX_SECRETS: usize = 16;

/// Presented signatures tried at most per request; a header with more is malformed.
pub const MAX_SIGNATURES: usize = 8;

/// The default tolerance of schemes with a timestamp: 5 minutes, as the senders' own libraries check.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// A signature scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Standard Webhooks (Svix and others): `webhook-signature: v1,<base64 HMAC(id.timestamp.body)>`, space
    /// separated during a rotation; `svix-*` headers accepted as well. Secret `whsec_` + base64 (the prefix is
    /// optional), decoded to the HMAC key. Timestamps more than the tolerance off, either way, are stale.
    StandardWebhooks,
    /// GitHub: `X-Hub-Signature-256: sha256=<hex HMAC(body)>`; the secret as written. No timestamp.
    Github,
    /// Stripe: `Stripe-Signature: t=<unix s>,v1=<hex HMAC(t.body)>[,v1=…]`; the `whsec_…` secret as written,
    /// not decoded. Only a timestamp older than the tolerance is stale (Stripe's libraries check no more).
    Stripe,
    /// Slack Events API: `X-Slack-Signature: v0=<hex HMAC("v0:" ts ":" body)>` with the timestamp in
    /// `X-Slack-Request-Timestamp`; the signing secret as written. Timestamps more than the tolerance off,
    /// either way, are stale (as `slack_sdk`'s `SignatureVerifier`).
    Slack,
    /// Shopify: `X-Shopify-Hmac-Sha256: <base64 HMAC(body)>`; the app's client secret as written. No timestamp.
    Shopify,
}

impl Scheme {
    /// The scheme's name in the configuration and in `WWW-Authenticate`.
    pub fn name(self) -> &'static str {
        match self {
            Self::StandardWebhooks => "standard-webhooks",
            Self::Github => "github",
            Self::Stripe => "stripe",
            Self::Slack => "slack",
            Self::Shopify => "shopify",
        }
    }

    /// Whether a signature of this scheme covers the key source part `part` (`header:NAME`, `json:/p`,
    /// `query:NAME`): every scheme signs the body; Standard Webhooks also the `webhook-id` / `svix-id` header
    /// (whichever is keyed is the one verified: a request carrying both with different values is refused);
    /// none signs a query or another header. An uncovered id can be made up and sent with a captured body.
    pub fn covers(self, part: &str) -> bool {
        part.starts_with("json:")
            || (self == Self::StandardWebhooks && matches!(part, "header:webhook-id" | "header:svix-id"))
    }

    /// Whether the scheme signs a timestamp (and so takes a tolerance).
    pub fn has_timestamp(self) -> bool {
        !matches!(self, Self::Github | Self::Shopify)
    }
}

impl FromStr for Scheme {
    type Err = RouteError;

    fn from_str(s: &str) -> Result<Self, RouteError> {
        match s {
            "standard-webhooks" => Ok(Self::StandardWebhooks),
            "github" => Ok(Self::Github),
            "stripe" => Ok(Self::Stripe),
            "slack" => Ok(Self::Slack),
            "shopify" => Ok(Self::Shopify),
            _ => Err(RouteError::Unknown {
                what: "signature scheme",
                expected: "standard-webhooks, github, stripe, slack, shopify or none",
            }),
        }
    }
}

/// The HMAC keys of one route, keyed once at load time and cloned per request.
#[derive(Clone)]
pub struct Secrets(Vec<HmacSha256>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} redacted)", self.0.len())
    }
}

impl Secrets {
    /// The secrets in `text`, one per non-empty line (surrounding whitespace and CR stripped), for `scheme`.
    ///
    /// # Errors
    /// [`RouteError::InvalidSecret`] for no secret, more than [`MAX_SECRETS`], or a Standard Webhooks secret
    /// that is not base64. The error never contains the secret.
    pub fn parse(scheme: Scheme, text: &str) -> Result<Self, RouteError> {
        let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        if lines.is_empty() {
            return Err(RouteError::InvalidSecret("no secret (one per non-empty line)".into()));
        }
        if lines.len() > MAX_SECRETS {
            return Err(RouteError::InvalidSecret(format!("{} secrets, at most {MAX_SECRETS}", lines.len())));
        }
        let mut keys = Vec::with_capacity(lines.len());
        for (i, line) in lines.iter().enumerate() {
            let bytes = match scheme {
                Scheme::StandardWebhooks => {
                    let encoded = line.strip_prefix("whsec_").unwrap_or(line);
                    SECRET_BASE64.decode(encoded).map_err(|_| {
                        RouteError::InvalidSecret(format!(
                            "secret {} is not base64 (a Standard Webhooks secret is whsec_ + base64)",
                            i + 1
                        ))
                    })?
                }
                Scheme::Github | Scheme::Stripe | Scheme::Slack | Scheme::Shopify => line.as_bytes().to_vec(),
            };
            let key = HmacSha256::new_from_slice(&bytes)
                .map_err(|_| RouteError::InvalidSecret(format!("secret {} cannot key HMAC-SHA256", i + 1)))?;
            keys.push(key);
        }
        Ok(Self(keys))
    }

    /// Whether any secret's HMAC over `parts` (concatenated) equals any of `signatures`, each compared in
    /// constant time.
    fn any_matches(&self, parts: &[&[u8]], signatures: &[Vec<u8>]) -> bool {
        self.0.iter().any(|key| {
            let mut mac = key.clone();
            for part in parts {
                mac.update(part);
            }
            signatures.iter().any(|signature| mac.clone().verify_slice(signature).is_ok())
        })
    }
}

/// A route's signature check: a scheme, its secrets (replaceable while serving) and the tolerance of its
/// timestamps.
#[derive(Debug)]
pub struct Verifier {
    scheme: Scheme,
    secrets: RwLock<Arc<Secrets>>,
    tolerance: Duration,
}

impl Verifier {
    /// A check of `scheme` signatures made with any of `secrets`, timestamps within `tolerance` of now.
    pub fn new(scheme: Scheme, secrets: Secrets, tolerance: Duration) -> Arc<Self> {
        Arc::new(Self { scheme, secrets: RwLock::new(Arc::new(secrets)), tolerance })
    }

    /// The scheme checked.
    pub fn scheme_of(&self) -> Scheme {
        self.scheme
    }

    /// Checks requests from now on with `secrets` instead (a rotation: the file re-read). A request being
    /// checked keeps the secrets it started with.
    pub fn replace_secrets(&self, secrets: Secrets) {
        *self.secrets.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(secrets);
    }
}

fn refuse(reason: RefusalReason, detail: impl Into<String>) -> Refusal {
    Refusal { reason, detail: detail.into() }
}

/// The single field line of `name`, as text.
fn header<'a>(headers: &'a HeaderMap, names: &[&str]) -> Result<Option<&'a str>, Refusal> {
    for name in names {
        let mut lines = headers.get_all(*name).iter();
        if let Some(first) = lines.next() {
            if lines.next().is_some() {
                return Err(refuse(RefusalReason::Malformed, format!("{name} is given more than once")));
            }
            let text =
                first.to_str().map_err(|_| refuse(RefusalReason::Malformed, format!("{name} is not visible ASCII")))?;
            return Ok(Some(text.trim()));
        }
    }
    Ok(None)
}

fn required<'a>(headers: &'a HeaderMap, names: &[&str]) -> Result<&'a str, Refusal> {
    header(headers, names)?.ok_or_else(|| refuse(RefusalReason::Missing, format!("no {} header", names[0])))
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

/// Seconds from `now` to `timestamp` (negative: in the past).
fn offset(timestamp: &str, now: SystemTime) -> Result<i64, Refusal> {
    let ts: i64 = timestamp
        .parse()
        .map_err(|_| refuse(RefusalReason::Malformed, "the timestamp is not a number of seconds since 1970"))?;
    let now = now.duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    Ok(ts.saturating_sub(now))
}

fn stale(offset: i64, tolerance: Duration) -> Refusal {
    refuse(
        RefusalReason::Stale,
        format!("the timestamp is {offset} s from now, outside the {} s tolerance", tolerance.as_secs()),
    )
}

impl Verify for Verifier {
    fn scheme(&self) -> &str {
        self.scheme.name()
    }

    fn verify(&self, parts: &Parts, body: &Bytes, now: SystemTime) -> Result<(), Refusal> {
        let headers = &parts.headers;
        let tolerance = i64::try_from(self.tolerance.as_secs()).unwrap_or(i64::MAX);
        let (signed, signatures): (Vec<&[u8]>, Vec<Vec<u8>>) = match self.scheme {
            Scheme::StandardWebhooks => {
                let id = required(headers, &["webhook-id", "svix-id"])?;
                // The signature covers the id it was checked with; a route may key on either header, so both
                // must say the same (break-it review: a genuine delivery resent with a made-up svix-id beside
                // its webhook-id executed once per made-up id on a route keyed on svix-id).
                if let (Some(a), Some(b)) = (header(headers, &["webhook-id"])?, header(headers, &["svix-id"])?)
                    && a != b
                {
                    return Err(refuse(RefusalReason::Malformed, "webhook-id and svix-id differ"));
                }
                let ts = required(headers, &["webhook-timestamp", "svix-timestamp"])?;
                let list = required(headers, &["webhook-signature", "svix-signature"])?;
                let off = offset(ts, now)?;
                // Saturating: a timestamp of i64::MIN would overflow `abs` (break-it review: a panic per request).
                if off.saturating_abs() > tolerance {
                    return Err(stale(off, self.tolerance));
                }
                let entries: Vec<&str> = list.split(' ').filter(|e| !e.is_empty()).collect();
                if entries.len() > MAX_SIGNATURES {
                    return Err(refuse(RefusalReason::Malformed, format!("over {MAX_SIGNATURES} signatures")));
                }
                // Other versions (`v1a,` asymmetric signatures) are not this scheme's: skipped, as the libraries do.
                let signatures: Vec<Vec<u8>> = entries
                    .iter()
                    .filter_map(|e| e.strip_prefix("v1,"))
                    .filter_map(|b64| STANDARD.decode(b64).ok())
                    .collect();
                if signatures.is_empty() {
                    return Err(refuse(RefusalReason::Malformed, "no v1,<base64> signature"));
                }
                (vec![id.as_bytes(), b".", ts.as_bytes(), b".", body], signatures)
            }
            Scheme::Github => {
                let value = required(headers, &["x-hub-signature-256"])?;
                let signature = value
                    .strip_prefix("sha256=")
                    .and_then(decode_hex)
                    .ok_or_else(|| refuse(RefusalReason::Malformed, "expected sha256=<64 hex digits>"))?;
                (vec![body], vec![signature])
            }
            Scheme::Stripe => {
                let value = required(headers, &["stripe-signature"])?;
                let mut ts = None;
                let mut signatures = Vec::new();
                for item in value.split(',') {
                    match item.trim().split_once('=') {
                        Some(("t", t)) => ts = Some(t),
                        Some(("v1", hex)) => signatures.push(hex),
                        _ => {}
                    }
                }
                let ts = ts.ok_or_else(|| refuse(RefusalReason::Malformed, "no t= timestamp"))?;
                if signatures.len() > MAX_SIGNATURES {
                    return Err(refuse(RefusalReason::Malformed, format!("over {MAX_SIGNATURES} signatures")));
                }
                let off = offset(ts, now)?;
                if off < -tolerance {
                    return Err(stale(off, self.tolerance));
                }
                let signatures: Vec<Vec<u8>> = signatures.into_iter().filter_map(decode_hex).collect();
                if signatures.is_empty() {
                    return Err(refuse(RefusalReason::Malformed, "no v1=<hex> signature"));
                }
                (vec![ts.as_bytes(), b".", body], signatures)
            }
            Scheme::Slack => {
                let ts = required(headers, &["x-slack-request-timestamp"])?;
                let value = required(headers, &["x-slack-signature"])?;
                let off = offset(ts, now)?;
                if off.saturating_abs() > tolerance {
                    return Err(stale(off, self.tolerance));
                }
                let signature = value
                    .strip_prefix("v0=")
                    .and_then(decode_hex)
                    .ok_or_else(|| refuse(RefusalReason::Malformed, "expected v0=<64 hex digits>"))?;
                (vec![b"v0:", ts.as_bytes(), b":", body], vec![signature])
            }
            Scheme::Shopify => {
                let value = required(headers, &["x-shopify-hmac-sha256"])?;
                let signature = STANDARD
                    .decode(value)
                    .map_err(|_| refuse(RefusalReason::Malformed, "expected the base64 of 32 bytes"))?;
                (vec![body], vec![signature])
            }
        };
        let secrets = Arc::clone(&self.secrets.read().unwrap_or_else(PoisonError::into_inner));
        if secrets.any_matches(&signed, &signatures) {
            Ok(())
        } else {
            Err(refuse(RefusalReason::Mismatch, "no signature matches a secret of this route"))
        }
    }
}

/// What a preset fills in: the key sources, the ignores, the scheme and what a request without a key does.
#[derive(Clone, Debug)]
pub struct Preset {
    /// The key sources, first present wins.
    pub key: Vec<KeySource>,
    /// Left out of the fingerprint.
    pub ignore: Vec<Ignore>,
    /// The signature scheme.
    pub scheme: Scheme,
    /// A signed request with none of the key sources: refused (400), or forwarded unprotected for senders that
    /// also send requests that are not deliveries (Slack's `url_verification` challenge has no `event_id`).
    pub missing_key: MissingKey,
}

/// The preset called `name`: `standard-webhooks` (key `webhook-id`, else `svix-id`), `github` (hook id and
/// delivery GUID joined: one delivery at two hooks is two keys), `stripe` (body `/id`, ignoring
/// `/pending_webhooks`, which changes between attempts), `slack` (body `/event_id`; a signed request without
/// one, such as the `url_verification` challenge, passes through) or `shopify` (`X-Shopify-Topic` joined
/// with `X-Shopify-Event-Id`, else `X-Shopify-Webhook-Id`).
///
/// `shopify` keys on the event, as Shopify's guide to ignoring duplicates says
/// (<https://shopify.dev/docs/apps/build/webhooks/ignore-duplicates>: the same `X-Shopify-Event-Id` on more
/// than one webhook indicates a duplicate), not on `X-Shopify-Webhook-Id`, which names one delivery: a copy
/// of the event under a new webhook id, such as the delivery to a second subscription of the same topic, is a
/// duplicate, replayed (or waited for while the first runs) and not executed, as long as it is sent to the
/// same path with a body that compares equal. Subscriptions asking for different fields send different bodies,
/// and the second gets 422; a route that must run once per subscription keys on
/// `header:x-shopify-webhook-id` itself. The topic is joined so that one event id under two topics would be
/// two deliveries, never a 422 that Shopify retries for hours; every duplicate Shopify describes has the same
/// topic. A delivery without the event id (from an integration older than the header, or a relay that drops
/// it) is keyed on its webhook id, as this preset keyed before, rather than refused: a 400 would be retried
/// until Shopify gave up on a subscription that worked, while the webhook id still makes its retries replays.
///
/// # Errors
/// [`RouteError::Unknown`] for another name.
pub fn preset(name: &str) -> Result<Preset, RouteError> {
    let mut missing_key = MissingKey::Refuse;
    let (key, ignore, scheme): (&[&str], &[&str], Scheme) = match name {
        "standard-webhooks" => (
            &["header:webhook-id", "header:svix-id"],
            &["header:webhook-timestamp", "header:webhook-signature", "header:svix-timestamp", "header:svix-signature"],
            Scheme::StandardWebhooks,
        ),
        "github" => (&["header:x-github-hook-id+header:x-github-delivery"], &[], Scheme::Github),
        "stripe" => (&["json:/id"], &["json:/pending_webhooks"], Scheme::Stripe),
        "slack" => {
            missing_key = MissingKey::Pass;
            (
                &["json:/event_id"],
                &[
                    "header:x-slack-retry-num",
                    "header:x-slack-retry-reason",
                    "header:x-slack-request-timestamp",
                    "header:x-slack-signature",
                ],
                Scheme::Slack,
            )
        }
        "shopify" => (
            &["header:x-shopify-topic+header:x-shopify-event-id", "header:x-shopify-webhook-id"],
            &["header:x-shopify-hmac-sha256"],
            Scheme::Shopify,
        ),
        _ => {
            return Err(RouteError::Unknown {
                what: "preset",
                expected: "standard-webhooks, github, stripe, slack or shopify",
            });
        }
    };
    Ok(Preset {
        key: key.iter().map(|s| s.parse()).collect::<Result<_, _>>()?,
        ignore: ignore.iter().map(|s| s.parse()).collect::<Result<_, _>>()?,
        scheme,
        missing_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> Parts {
        let mut builder = http::Request::post("/hooks");
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        builder.body(()).unwrap().into_parts().0
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    // The Standard Webhooks specification's test vector (standard-webhooks/standard-webhooks, spec and the
    // reference libraries' tests).
    const SW_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SW_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SW_TS: u64 = 1_614_265_330;
    const SW_BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SW_SIG: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn standard(secrets: &str) -> Arc<Verifier> {
        Verifier::new(
            Scheme::StandardWebhooks,
            Secrets::parse(Scheme::StandardWebhooks, secrets).unwrap(),
            DEFAULT_TOLERANCE,
        )
    }

    fn sw_check(v: &Verifier, signature: &str, now: u64) -> Result<(), RefusalReason> {
        let ts = SW_TS.to_string();
        let parts = request(&[("webhook-id", SW_ID), ("webhook-timestamp", &ts), ("webhook-signature", signature)]);
        v.verify(&parts, &Bytes::from_static(SW_BODY), at(now)).map_err(|r| r.reason)
    }

    #[test]
    fn standard_webhooks_spec_vector_verifies() {
        let v = standard(SW_SECRET);
        assert_eq!(sw_check(&v, SW_SIG, SW_TS), Ok(()));
        // Without the whsec_ prefix, and among other entries (a rotation, an asymmetric v1a signature).
        let v = standard("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
        assert_eq!(sw_check(&v, &format!("v1a,abc v1,AAAA {SW_SIG}"), SW_TS), Ok(()));
        // svix-* headers carry the same scheme.
        let ts = SW_TS.to_string();
        let parts = request(&[("svix-id", SW_ID), ("svix-timestamp", &ts), ("svix-signature", SW_SIG)]);
        assert!(v.verify(&parts, &Bytes::from_static(SW_BODY), at(SW_TS)).is_ok());
    }

    #[test]
    fn standard_webhooks_refusals_name_their_reason() {
        let v = standard(SW_SECRET);
        let forged = "v1,g1hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert_eq!(sw_check(&v, forged, SW_TS), Err(RefusalReason::Mismatch));
        assert_eq!(sw_check(&v, "v2,abc", SW_TS), Err(RefusalReason::Malformed));
        assert_eq!(sw_check(&v, "v1,not base64!", SW_TS), Err(RefusalReason::Malformed));
        let parts = request(&[("webhook-id", SW_ID)]);
        let refused = v.verify(&parts, &Bytes::from_static(SW_BODY), at(SW_TS)).unwrap_err();
        assert_eq!(refused.reason, RefusalReason::Missing);
        // Another body under the same signature.
        let ts = SW_TS.to_string();
        let parts = request(&[("webhook-id", SW_ID), ("webhook-timestamp", &ts), ("webhook-signature", SW_SIG)]);
        let refused = v.verify(&parts, &Bytes::from_static(br#"{"test": 1}"#), at(SW_TS)).unwrap_err();
        assert_eq!(refused.reason, RefusalReason::Mismatch);
    }

    #[test]
    fn standard_webhooks_tolerance_is_300_s_both_ways() {
        let v = standard(SW_SECRET);
        assert_eq!(sw_check(&v, SW_SIG, SW_TS + 300), Ok(()));
        assert_eq!(sw_check(&v, SW_SIG, SW_TS - 300), Ok(()));
        assert_eq!(sw_check(&v, SW_SIG, SW_TS + 301), Err(RefusalReason::Stale));
        assert_eq!(sw_check(&v, SW_SIG, SW_TS - 301), Err(RefusalReason::Stale));
        // The extremes are stale, not a panic (break-it review: i64::MIN overflowed `abs` in the request's task).
        for ts in [i64::MIN.to_string(), i64::MAX.to_string()] {
            let parts = request(&[("webhook-id", SW_ID), ("webhook-timestamp", &ts), ("webhook-signature", SW_SIG)]);
            let refused = v.verify(&parts, &Bytes::from_static(SW_BODY), at(SW_TS)).map_err(|r| r.reason);
            assert_eq!(refused, Err(RefusalReason::Stale), "{ts}");
        }
    }

    #[test]
    fn a_second_secret_is_accepted_during_a_rotation() {
        let v = standard(&format!("whsec_c2VjcmV0LW9uZQ==\r\n\n{SW_SECRET}\n"));
        assert_eq!(sw_check(&v, SW_SIG, SW_TS), Ok(()));
        let v = standard("whsec_c2VjcmV0LW9uZQ==");
        assert_eq!(sw_check(&v, SW_SIG, SW_TS), Err(RefusalReason::Mismatch));
    }

    #[test]
    fn replaced_secrets_apply_to_the_next_check() {
        let v = standard("whsec_c2VjcmV0LW9uZQ==");
        assert_eq!(sw_check(&v, SW_SIG, SW_TS), Err(RefusalReason::Mismatch));
        v.replace_secrets(Secrets::parse(Scheme::StandardWebhooks, SW_SECRET).unwrap());
        assert_eq!(sw_check(&v, SW_SIG, SW_TS), Ok(()));
    }

    #[test]
    fn secrets_are_checked_and_never_shown() {
        assert!(Secrets::parse(Scheme::StandardWebhooks, "whsec_***").is_err());
        // Unpadded base64, as the libraries accept it.
        assert!(Secrets::parse(Scheme::StandardWebhooks, "whsec_c2VjcmV0LW9uZQ").is_ok());
        assert!(Secrets::parse(Scheme::Github, " \n\n").is_err());
        assert!(Secrets::parse(Scheme::Github, &"s\n".repeat(MAX_SECRETS + 1)).is_err());
        let error = Secrets::parse(Scheme::StandardWebhooks, "whsec_hunter2!").unwrap_err().to_string();
        assert!(!error.contains("hunter2"), "{error}");
        let secrets = Secrets::parse(Scheme::Github, "hunter2").unwrap();
        assert_eq!(format!("{secrets:?}"), "Secrets(1 redacted)");
        let verifier = Verifier::new(Scheme::Github, secrets, DEFAULT_TOLERANCE);
        assert!(!format!("{verifier:?}").contains("hunter2"));
    }

    #[test]
    fn github_documented_vector_verifies() {
        // docs.github.com, "Validating webhook deliveries", "Testing the webhook payload validation".
        let secrets = Secrets::parse(Scheme::Github, "It's a Secret to Everybody").unwrap();
        let v = Verifier::new(Scheme::Github, secrets, DEFAULT_TOLERANCE);
        let good = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        let body = Bytes::from_static(b"Hello, World!");
        assert!(v.verify(&request(&[("x-hub-signature-256", good)]), &body, at(0)).is_ok());
        let bad = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e18";
        let refused = v.verify(&request(&[("x-hub-signature-256", bad)]), &body, at(0)).unwrap_err();
        assert_eq!(refused.reason, RefusalReason::Mismatch);
        for malformed in ["sha1=757107", "sha256=75710", "sha256=zz"] {
            let refused = v.verify(&request(&[("x-hub-signature-256", malformed)]), &body, at(0)).unwrap_err();
            assert_eq!(refused.reason, RefusalReason::Malformed, "{malformed}");
        }
    }

    #[test]
    fn stripe_signatures_use_the_secret_verbatim_and_refuse_only_old_timestamps() {
        let secret = "whsec_test_secret";
        let body = Bytes::from_static(br#"{"id":"evt_1","object":"event"}"#);
        let sign = |t: u64| {
            let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).unwrap();
            mac.update(format!("{t}.").as_bytes());
            mac.update(&body);
            let hex: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
            format!("t={t},v1={hex},v0=ignored")
        };
        let v = Verifier::new(Scheme::Stripe, Secrets::parse(Scheme::Stripe, secret).unwrap(), DEFAULT_TOLERANCE);
        let check = |header: &str, now: u64| {
            v.verify(&request(&[("stripe-signature", header)]), &body, at(now)).map_err(|r| r.reason)
        };
        assert_eq!(check(&sign(1000), 1300), Ok(()));
        assert_eq!(check(&sign(1000), 1301), Err(RefusalReason::Stale));
        assert_eq!(check(&sign(2000), 1000), Ok(()), "a future timestamp passes, as in Stripe's libraries");
        assert_eq!(check(&sign(1000).replace("t=1000", "t=1001"), 1000), Err(RefusalReason::Mismatch));
        assert_eq!(check("v1=00", 1000), Err(RefusalReason::Malformed));
        assert_eq!(check("t=1000,v1=0", 1000), Err(RefusalReason::Malformed));
    }

    #[test]
    fn presets_fill_key_ignore_and_scheme() {
        assert_eq!(preset("stripe").unwrap().scheme, Scheme::Stripe);
        assert_eq!(preset("github").unwrap().key.len(), 1);
        assert_eq!(preset("standard-webhooks").unwrap().key.len(), 2);
        let slack = preset("slack").unwrap();
        assert_eq!((slack.scheme, slack.missing_key), (Scheme::Slack, MissingKey::Pass));
        assert_eq!(slack.key[0].to_string(), "json:/event_id");
        let shopify = preset("shopify").unwrap();
        assert_eq!((shopify.scheme, shopify.missing_key), (Scheme::Shopify, MissingKey::Refuse));
        let keys: Vec<String> = shopify.key.iter().map(ToString::to_string).collect();
        assert_eq!(keys, ["header:x-shopify-topic+header:x-shopify-event-id", "header:x-shopify-webhook-id"]);
        assert!(preset("mux").is_err());
    }

    #[test]
    fn a_standard_webhooks_request_with_two_different_ids_is_refused() {
        // Break-it review: the key may come from either header, the signature covers the one checked.
        let v = standard(SW_SECRET);
        let ts = SW_TS.to_string();
        let both = |svix: &str| {
            let parts = request(&[
                ("webhook-id", SW_ID),
                ("svix-id", svix),
                ("webhook-timestamp", &ts),
                ("webhook-signature", SW_SIG),
            ]);
            v.verify(&parts, &Bytes::from_static(SW_BODY), at(SW_TS)).map_err(|r| r.reason)
        };
        assert_eq!(both(SW_ID), Ok(()));
        assert_eq!(both("made_up_1"), Err(RefusalReason::Malformed));
    }

    // Slack's documented example ("Verifying requests from Slack"): signing secret, timestamp, form body and
    // the signature Slack sent.
    const SLACK_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
    const SLACK_TS: u64 = 1_531_420_618;
    const SLACK_BODY: &[u8] = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
    const SLACK_SIG: &str = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";

    #[test]
    fn slack_documented_example_verifies_within_five_minutes_both_ways() {
        let v = Verifier::new(Scheme::Slack, Secrets::parse(Scheme::Slack, SLACK_SECRET).unwrap(), DEFAULT_TOLERANCE);
        let check = |signature: &str, now: u64| {
            let ts = SLACK_TS.to_string();
            let parts = request(&[("x-slack-request-timestamp", &ts), ("x-slack-signature", signature)]);
            v.verify(&parts, &Bytes::from_static(SLACK_BODY), at(now)).map_err(|r| r.reason)
        };
        assert_eq!(check(SLACK_SIG, SLACK_TS), Ok(()));
        assert_eq!(check(SLACK_SIG, SLACK_TS + 300), Ok(()));
        assert_eq!(check(SLACK_SIG, SLACK_TS + 301), Err(RefusalReason::Stale));
        assert_eq!(check(SLACK_SIG, SLACK_TS - 301), Err(RefusalReason::Stale));
        assert_eq!(check(&SLACK_SIG.replace("503", "504"), SLACK_TS), Err(RefusalReason::Mismatch));
        assert_eq!(check(&SLACK_SIG.replace("v0=", "v1="), SLACK_TS), Err(RefusalReason::Malformed));
        let parts = request(&[("x-slack-signature", SLACK_SIG)]);
        let refused = v.verify(&parts, &Bytes::from_static(SLACK_BODY), at(SLACK_TS)).unwrap_err();
        assert_eq!(refused.reason, RefusalReason::Missing);
    }

    #[test]
    fn shopify_signatures_are_base64_over_the_body() {
        let secret = "hush";
        let body = Bytes::from_static(br#"{"id":820982911946154508,"email":"jon@example.com"}"#);
        let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(&body);
        let good = STANDARD.encode(mac.finalize().into_bytes());
        let v = Verifier::new(Scheme::Shopify, Secrets::parse(Scheme::Shopify, secret).unwrap(), DEFAULT_TOLERANCE);
        let check = |signature: &str| {
            v.verify(&request(&[("x-shopify-hmac-sha256", signature)]), &body, at(0)).map_err(|r| r.reason)
        };
        assert_eq!(check(&good), Ok(()));
        assert_eq!(check(&good.replace(&good[..4], "AAAA")), Err(RefusalReason::Mismatch));
        assert_eq!(check("not base64!"), Err(RefusalReason::Malformed));
        assert!(!Scheme::Shopify.has_timestamp());
    }
}
