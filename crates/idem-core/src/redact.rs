//! Secrets hidden in URLs before they are printed: the one function every message, log line and report that
//! shows a store, queue or upstream URL goes through.

/// Query parameters whose values are secrets in the URL forms idem accepts or names in its refusals (libpq's
/// `password` and `sslpassword`; `sentinel_password` of `redis+sentinel://` URLs; the usual token spellings of
/// HTTP APIs and brokers). Compared ignoring case.
const SECRET_PARAMS: &[&str] = &[
    "password",
    "sslpassword",
    "sentinel_password",
    "pass",
    "passwd",
    "pwd",
    "token",
    "auth_token",
    "access_token",
    "secret",
    "api_key",
    "apikey",
];

/// Schemes whose userinfo may be a bare secret (`nats://TOKEN@host`, `https://TOKEN@host`): there a userinfo
/// without a password is hidden whole. Elsewhere (`postgres://`, `redis://`, `amqp://`) a bare userinfo is a user
/// name and is shown.
const TOKEN_USERINFO_SCHEMES: &[&str] = &["nats", "tls", "ws", "wss", "http", "https"];

/// `url` with every secret in it replaced by `***`, for messages and logs:
///
/// - the password of the userinfo (`scheme://user:secret@host` → `scheme://user:***@host`; the last `@` of the
///   authority ends the userinfo, as passwords may contain `@`; several hosts, as in
///   `postgres://u:p@h1:5432,h2:5432/db`, are one authority);
/// - a userinfo without a password where the scheme uses it as a token (`nats://TOKEN@host`,
///   `https://TOKEN@host` → `nats://***@host`);
/// - the value of a query parameter named like a secret (`password=`, `sslpassword=`, `sentinel_password=`,
///   `token=`, `secret=`, …);
/// - in a libpq key/value connection string (no `://`: `host=db password=secret`), the `password` and
///   `sslpassword` values.
///
/// Anything else is returned unchanged, so the result still names the host, port, database and parameters the
/// reader needs to recognise the URL.
///
/// ```
/// use idem_core::redact_url;
///
/// assert_eq!(redact_url("postgres://idem:s3cret@db:5432/idem?sslmode=verify-full"),
///            "postgres://idem:***@db:5432/idem?sslmode=verify-full");
/// assert_eq!(redact_url("nats://s3cret@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// assert_eq!(redact_url("postgres://u@h/db?password=s3cret"), "postgres://u@h/db?password=***");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return redact_conninfo(url) };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None if TOKEN_USERINFO_SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) => format!("***@{host}"),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    format!("{scheme}://{authority}{}", redact_query(tail))
}

/// The path, query and fragment with secret query parameters hidden.
fn redact_query(tail: &str) -> String {
    let (before_fragment, fragment) = match tail.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (tail, None),
    };
    let mut out = match before_fragment.split_once('?') {
        Some((path, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if is_secret(k) => format!("{k}=***"),
                    _ => p.to_owned(),
                })
                .collect();
            format!("{path}?{}", params.join("&"))
        }
        None => before_fragment.to_owned(),
    };
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

/// A libpq key/value connection string (`host=db user=u password=secret`; spaces around `=` allowed) with its
/// secret values hidden. A quoted value (`password='a b'`) is hidden to its closing quote.
fn redact_conninfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let trimmed = rest.trim_start();
        out.push_str(&rest[..rest.len() - trimmed.len()]);
        rest = trimmed;
        if rest.is_empty() {
            return out;
        }
        let key_len = rest.find(|c: char| c == '=' || c.is_whitespace()).unwrap_or(rest.len());
        let key = &rest[..key_len];
        let Some(after_eq) = rest[key_len..].trim_start().strip_prefix('=') else {
            // Not `key = value` here: copy one word and go on (the word is not empty: `rest` starts with
            // neither whitespace nor, since this branch found no `=`, an `=`).
            out.push_str(key);
            rest = &rest[key_len..];
            continue;
        };
        let value = after_eq.trim_start();
        let value_len = match value.strip_prefix('\'') {
            Some(quoted) => quoted_len(quoted).map_or(value.len(), |n| n + 1),
            None => value.find(char::is_whitespace).unwrap_or(value.len()),
        };
        out.push_str(key);
        out.push('=');
        out.push_str(if is_secret(key) { "***" } else { &value[..value_len] });
        rest = &value[value_len..];
    }
}

/// The length of a single-quoted libpq value after its opening quote, through its closing quote (`\'` and `\\`
/// escape); `None` when it never closes.
fn quoted_len(quoted: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in quoted.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '\'' => return Some(i + 1),
            _ => {}
        }
    }
    None
}

fn is_secret(key: &str) -> bool {
    SECRET_PARAMS.iter().any(|s| s.eq_ignore_ascii_case(key.trim()))
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    /// Every URL form the stores, queues, upstreams and `idem check` accept, with and without secrets.
    #[test]
    fn every_accepted_url_form_prints_without_its_secrets() {
        let cases = [
            // Stores.
            ("memory:", "memory:"),
            ("sqlite:./idem-data/idem.db", "sqlite:./idem-data/idem.db"),
            ("postgres://postgres@127.0.0.1:5432/test", "postgres://postgres@127.0.0.1:5432/test"),
            ("postgres://idem:s3cret@db:5432/idem", "postgres://idem:***@db:5432/idem"),
            ("postgresql://idem:p@ss@word@db/idem", "postgresql://idem:***@db/idem"),
            (
                "postgres://u:s3cret@h1:5432,h2:5433/db?target_session_attrs=read-write",
                "postgres://u:***@h1:5432,h2:5433/db?target_session_attrs=read-write",
            ),
            ("postgres://u@h/db?password=s3cret&sslmode=require", "postgres://u@h/db?password=***&sslmode=require"),
            (
                "postgres://u@h/db?sslmode=verify-full&sslpassword=k3y",
                "postgres://u@h/db?sslmode=verify-full&sslpassword=***",
            ),
            ("postgres://u@h/db?PASSWORD=s3cret", "postgres://u@h/db?PASSWORD=***"),
            ("host=db user=idem password=s3cret dbname=idem", "host=db user=idem password=*** dbname=idem"),
            ("host=db password='s3 cr\\'et' dbname=idem", "host=db password=*** dbname=idem"),
            ("host=db password = s3cret", "host=db password=***"),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
            ("redis://default:s3cret@127.0.0.1:6379", "redis://default:***@127.0.0.1:6379"),
            ("rediss://:s3cret@cache:6380/0?cacert=/etc/ca.pem", "rediss://:***@cache:6380/0?cacert=/etc/ca.pem"),
            ("redis+sentinel://:s3cret@h1:26379,h2:26379/mymaster", "redis+sentinel://:***@h1:26379,h2:26379/mymaster"),
            ("redis+cluster://:s3cret@h1:7000,h2:7001", "redis+cluster://:***@h1:7000,h2:7001"),
            (
                "rediss+sentinel://u:s3cret@h1,h2/m/2?sentinel_username=s&sentinel_password=s3cret&wait_replicas=1",
                "rediss+sentinel://u:***@h1,h2/m/2?sentinel_username=s&sentinel_password=***&wait_replicas=1",
            ),
            (
                "rediss+cluster://h1:7000?wait_replicas=1&wait_timeout_ms=500",
                "rediss+cluster://h1:7000?wait_replicas=1&wait_timeout_ms=500",
            ),
            // Queues.
            ("amqp://guest:guest@127.0.0.1:5672/%2f?queue=jobs", "amqp://guest:***@127.0.0.1:5672/%2f?queue=jobs"),
            ("amqps://u:s3cret@mq:5671/v?queue=jobs&heartbeat=10", "amqps://u:***@mq:5671/v?queue=jobs&heartbeat=10"),
            ("nats://127.0.0.1:4222?stream=s&consumer=c", "nats://127.0.0.1:4222?stream=s&consumer=c"),
            ("nats://s3cret@127.0.0.1:4222?stream=s", "nats://***@127.0.0.1:4222?stream=s"),
            ("nats://u:s3cret@127.0.0.1:4222", "nats://u:***@127.0.0.1:4222"),
            ("tls://s3cret@nats:4222", "tls://***@nats:4222"),
            // Upstreams and `idem check` targets.
            ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
            ("https://u:s3cret@api.example.com/orders?x=1", "https://u:***@api.example.com/orders?x=1"),
            ("https://s3cret@api.example.com/", "https://***@api.example.com/"),
            ("https://api.example.com/v1?token=s3cret&page=2", "https://api.example.com/v1?token=***&page=2"),
            ("https://api.example.com/a@b?x=1", "https://api.example.com/a@b?x=1"),
            ("https://api.example.com/#token=x", "https://api.example.com/#token=x"),
            ("https://u:s3cret@api.example.com#frag", "https://u:***@api.example.com#frag"),
        ];
        for (given, shown) in cases {
            assert_eq!(redact_url(given), shown, "{given}");
            assert!(!redact_url(given).contains("s3cr"), "{given}");
        }
    }
}
