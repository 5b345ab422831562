//! Who may look and who may act: the admin token, sessions, CSRF tokens, the `Origin` check and the
//! security headers every page carries.
//!
//! - **Sessions** are stateless: the cookie is `{id}.{actor}.{mac}`, the MAC an HMAC-SHA256 under a key drawn
//!   at start-up, so only this process mints them and a restart ends them. `HttpOnly`, `SameSite=Strict`,
//!   `Secure` over TLS, `Path=/ui/`.
//! - **Acting** takes an admin token (`--admin-token-file`: a browser signs in with it once; the JSON
//!   endpoints send it as `Authorization: Bearer`, compared in constant time) or, with `--tls-client-ca`, the
//!   client certificate every connection already presented. With neither, the pages are read-only.
//! - **CSRF**: every form carries the HMAC of the session id (checked in constant time), and a POST must come
//!   with an `Origin` (or, failing it, `Referer`) naming this listener (OWASP's "verifying origin with standard
//!   headers"). The JSON endpoints take no cookie and only `application/json`, which a cross-site form cannot
//!   send without a preflight this server never answers.

use std::sync::Arc;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use hmac::{KeyInit, Mac};
use http::{HeaderMap, HeaderValue, header};
use sha2::Digest;

/// The session cookie's name.
pub const COOKIE: &str = "idem_admin";

/// The Content-Security-Policy of every page: nothing but this listener, no inline script or style, never
/// framed, forms only back here.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                       form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// How the listener authenticates admins.
#[derive(Clone)]
pub struct Guard {
    token: Option<Arc<str>>,
    client_cert: bool,
    tls: bool,
    key: Arc<[u8; 32]>,
}

impl std::fmt::Debug for Guard {
    // Never the token or the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").field("token", &self.token.is_some()).field("client_cert", &self.client_cert).finish()
    }
}

/// Who a request acts as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Who {
    /// May act, named as logged (`admin-token:3f2a…`, `client-certificate`).
    Admin(String),
    /// May read (a listener without a token), not act.
    Reader,
    /// Must sign in first (a token is configured and this session has not presented it).
    Nobody,
}

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

impl Guard {
    /// `token`: the admin token, if any; `client_cert`: every connection presented a client certificate the
    /// listener trusts (`--tls-client-ca`); `tls`: the listener serves HTTPS (cookies get `Secure`).
    pub fn new(token: Option<Arc<str>>, client_cert: bool, tls: bool) -> Self {
        let key: [u8; 32] = rand::random();
        Self { token, client_cert, tls, key: Arc::new(key) }
    }

    /// Whether a token is configured (pages need a signed-in session then).
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Whether anything lets a request act (a token or client certificates).
    pub fn can_act(&self) -> bool {
        self.token.is_some() || self.client_cert
    }

    /// The id a token is logged as: the first 8 hex digits of its SHA-256, never the token.
    fn token_id(token: &str) -> String {
        format!("admin-token:{}", &hex::encode(sha2::Sha256::digest(token.as_bytes()))[..8])
    }

    fn mac(&self, parts: &[&str]) -> String {
        // HMAC takes a key of any length; this one is 32 bytes.
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.key[..]).unwrap_or_else(|_| unreachable!());
        for p in parts {
            mac.update(p.as_bytes());
            mac.update(b"\0");
        }
        hex::encode(mac.finalize().into_bytes())
    }

    /// Checks a presented admin token in constant time; the actor it names.
    pub fn check_token(&self, presented: &str) -> Option<String> {
        let token = self.token.as_deref()?;
        constant_time_eq::constant_time_eq(presented.trim().as_bytes(), token.as_bytes()).then(|| Self::token_id(token))
    }

    /// A new session cookie for `actor` (`-` for a session that has not signed in).
    pub fn session_cookie(&self, actor: &str) -> (String, HeaderValue) {
        let id = hex::encode(rand::random::<[u8; 16]>());
        let mac = self.mac(&["session", &id, actor]);
        let secure = if self.tls { "; Secure" } else { "" };
        let cookie = format!("{COOKIE}={id}.{actor}.{mac}; Path=/ui/; HttpOnly; SameSite=Strict{secure}");
        // Hex, an actor of `[a-z0-9:-]` and fixed text: always a valid header value.
        (id, HeaderValue::from_str(&cookie).unwrap_or_else(|_| HeaderValue::from_static("")))
    }

    /// The session this request presents: its id and actor, when the cookie is one this process minted.
    pub fn session(&self, headers: &HeaderMap) -> Option<(String, String)> {
        let cookies = headers.get_all(header::COOKIE);
        let value = cookies
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))?;
        let mut parts = value.splitn(3, '.');
        let (id, actor, mac) = (parts.next()?, parts.next()?, parts.next()?);
        let expected = self.mac(&["session", id, actor]);
        constant_time_eq::constant_time_eq(mac.as_bytes(), expected.as_bytes())
            .then(|| (id.to_owned(), actor.to_owned()))
    }

    /// Who the session acts as.
    pub fn who(&self, session: Option<&(String, String)>) -> Who {
        if self.token.is_some() {
            return match session {
                Some((_, actor)) if actor != "-" => Who::Admin(actor.clone()),
                _ => Who::Nobody,
            };
        }
        if self.client_cert { Who::Admin("client-certificate".into()) } else { Who::Reader }
    }

    /// The CSRF token of session `id`.
    pub fn csrf(&self, id: &str) -> String {
        self.mac(&["csrf", id])
    }

    /// Checks a form's CSRF token against session `id`, in constant time.
    pub fn check_csrf(&self, id: &str, presented: &str) -> bool {
        constant_time_eq::constant_time_eq(presented.as_bytes(), self.csrf(id).as_bytes())
    }

    /// Who a JSON request acts as: its bearer token, or the client certificate; `None` when neither.
    pub fn api_actor(&self, headers: &HeaderMap) -> Option<String> {
        let bearer =
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        match (&self.token, bearer) {
            (Some(_), Some(b)) => self.check_token(b),
            (Some(_), None) => None,
            (None, _) => self.client_cert.then(|| "client-certificate".to_owned()),
        }
    }
}

/// Whether a state-changing request comes from a page of this listener: its `Origin` (or, without one, its
/// `Referer`) must name the host the request was sent to. A request with neither is refused: every browser
/// that runs these pages sends `Origin` on a POST.
pub fn same_origin(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else { return false };
    let origin = match headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        Some(o) => o.to_owned(),
        None => match headers.get(header::REFERER).and_then(|v| v.to_str().ok()) {
            // scheme://host[:port]/path…: keep what precedes the path.
            Some(r) => r.splitn(4, '/').take(3).collect::<Vec<_>>().join("/"),
            None => return false,
        },
    };
    origin == format!("http://{host}") || origin == format!("https://{host}")
}

/// Adds the security headers to every answer under `/ui/` and `/v1/admin/`.
pub async fn headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}
