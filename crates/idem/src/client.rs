//! `idem kv`: a client for a running server's KV API.

use std::borrow::Cow;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use clap::Subcommand;
use idem_store::RetryPolicy;
use reqwest::{Method, StatusCode, header};

use crate::error::Error;

/// Connection flags shared by every `idem kv` command (listed after each command's own options).
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Connection")]
pub struct KvArgs {
    /// Base URL of the server; without a scheme, http:// (as curl does: 127.0.0.1:8080).
    #[arg(long, global = true, env = "IDEM_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// File holding the bearer token to present.
    #[arg(long, global = true, env = "IDEM_AUTH_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(subcommand)]
    command: KvCommand,
}

/// HTTPS flags of the clients (`idem kv`, `idem send`), named as curl names them. Certificate verification has
/// no off switch.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Connection")]
pub struct TlsArgs {
    /// For https:// URLs: trust only the CA certificates in this PEM file instead of the system's trust store.
    #[arg(long, global = true, env = "IDEM_CACERT", value_name = "FILE")]
    cacert: Option<PathBuf>,
    /// Client certificate (PEM) to present when the server asks for one (idem serve --tls-client-ca), with its
    /// private key in the same file or in --cert-key.
    // Ids of their own: `idem kv`'s commands have a positional `key`.
    #[arg(long = "cert", global = true, env = "IDEM_CERT", value_name = "FILE")]
    client_cert: Option<PathBuf>,
    /// Private key (PEM) of --cert (curl's --key; here `--key` is idem send's Idempotency-Key).
    #[arg(long = "cert-key", global = true, env = "IDEM_CERT_KEY", value_name = "FILE", requires = "client_cert")]
    client_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The client TLS settings these flags name.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file that cannot be read or holds no usable PEM.
    pub fn config(&self) -> Result<idem_client::TlsConfig, Error> {
        let mut tls = idem_client::TlsConfig::new();
        if let Some(ca) = &self.cacert {
            tls = tls.ca_file(ca).map_err(|e| Error::Config(e.to_string()))?;
        }
        if let Some(cert) = &self.client_cert {
            tls = tls.client_cert_files(cert, self.client_key.as_deref()).map_err(|e| Error::Config(e.to_string()))?;
        }
        Ok(tls)
    }
}

#[derive(Debug, Subcommand)]
enum KvCommand {
    /// Print the value under KEY to standard output (its generation goes to standard error).
    Get {
        /// The key (any UTF-8, 1..=1024 bytes, no NUL; sent percent-encoded).
        key: String,
    },
    /// Store VALUE (or standard input when VALUE is omitted or "-") under KEY; prints the new generation.
    Put {
        /// The key (any UTF-8, 1..=1024 bytes, no NUL; sent percent-encoded).
        key: String,
        /// The value's bytes as given; omitted or "-": read standard input to its end.
        value: Option<String>,
        /// Only if the current generation is G (compare-and-swap).
        #[arg(long, value_name = "G", conflicts_with = "if_absent")]
        if_match: Option<u64>,
        /// Only if the key is absent (create).
        #[arg(long)]
        if_absent: bool,
        /// Expiry: a duration like 30s or 1h, "none" to clear, "keep" (default) to keep the current one.
        #[arg(long)]
        ttl: Option<String>,
    },
    /// Delete KEY.
    Delete {
        /// The key to delete.
        key: String,
        /// Only if the current generation is G.
        #[arg(long, value_name = "G")]
        if_match: Option<u64>,
    },
    /// List keys with a prefix, one "KEY<TAB>GENERATION" line each, following every page.
    List {
        /// Only keys that start with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Keys per request (1..=1000).
        #[arg(long, default_value_t = 500)]
        page_size: usize,
    },
    /// Add DELTA to the counter under KEY in one atomic step on the server (a missing key counts from 0); prints
    /// the value after it (its generation goes to standard error).
    Counter {
        /// The counter's key.
        key: String,
        /// What to add: a signed 64-bit integer (negative to subtract); the result must stay in range.
        #[arg(allow_negative_numbers = true)]
        delta: i64,
        /// Applies the add at most once: a repeat under the same id (kept 24 h on the key) with the same DELTA
        /// changes nothing and prints the first result; another DELTA under it is refused (exit 1).
        #[arg(long, value_name = "ID")]
        dedupe_id: Option<String>,
    },
    /// Add and remove members of the set under KEY in one atomic step on the server (a JSON array of strings,
    /// kept sorted; a set left empty is deleted); prints its generation after the change (0: now empty).
    // One of --add and --remove (or both) is required: a group, so that usage and the error name both.
    #[command(group(clap::ArgGroup::new("change").required(true).multiple(true).args(["add", "remove"])))]
    Set {
        /// The set's key.
        key: String,
        /// A member to add (repeatable).
        #[arg(long, value_name = "MEMBER")]
        add: Vec<String>,
        /// A member to remove (repeatable).
        #[arg(long, value_name = "MEMBER")]
        remove: Vec<String>,
        /// Applies the change at most once: a repeat under the same id (kept 24 h on the key) with the same
        /// members changes nothing and prints the first result; another change under it is refused (exit 1).
        #[arg(long, value_name = "ID")]
        dedupe_id: Option<String>,
    },
    /// Read-modify-write KEY as a JSON array set: add ITEMs with a conditional PUT, re-reading and retrying on 412.
    Update {
        /// The key of the JSON array.
        key: String,
        /// Item to add (repeatable).
        #[arg(long = "set-add", value_name = "ITEM", required = true)]
        set_add: Vec<String>,
        /// Attempts before giving up.
        #[arg(long, default_value_t = 8)]
        max_attempts: u32,
    },
}

use idem_server::encode_key;

/// A server address as curl takes one: without `scheme://` it means `http://`, so `127.0.0.1:8080` and
/// `localhost:8080/api` work (parsed as they are, the first is a relative URL and the second has the scheme
/// `localhost`). A scheme is what RFC 3986 §3.1 allows before `://`: a letter, then letters, digits, `+-.`.
pub(crate) fn with_default_scheme(given: &str) -> Cow<'_, str> {
    let has_scheme = given.split_once("://").is_some_and(|(scheme, _)| {
        let mut chars = scheme.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    });
    if has_scheme { Cow::Borrowed(given) } else { Cow::Owned(format!("http://{given}")) }
}

/// `given` (the value of `flag`) as an HTTP server's URL: [`with_default_scheme`], then an `http` or `https` URL
/// with a host.
///
/// # Errors
/// [`Error::Config`]: one line naming `flag`, the value (password hidden) and the form to use.
pub(crate) fn server_url(flag: &str, given: &str) -> Result<reqwest::Url, Error> {
    let shown = idem_core::redact_url(given);
    let refuse = |why: String| Error::Config(format!("{flag} {shown:?} {why}; give http://HOST:PORT (or HOST:PORT)"));
    let url = reqwest::Url::parse(&with_default_scheme(given)).map_err(|e| refuse(format!("is not a URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(refuse(format!("has the scheme {}, not http or https", url.scheme())));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(refuse("names no host".into()));
    }
    Ok(url)
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

/// The whole cause chain, and a hint when nothing listens at the URL; a TLS failure as one line naming it.
fn failed(e: reqwest::Error) -> Error {
    if let Some(reason) = idem_client::tls_failure(&e) {
        return Error::Failed(format!("request failed: {reason}"));
    }
    let mut msg = format!("request failed: {}", idem_store::error_chain(&e));
    if e.is_connect() {
        msg.push_str(" (is `idem serve` running there? set --url or IDEM_URL)");
    }
    Error::Failed(msg)
}

/// Sends `request`, again (twice at most) when it failed before a byte of it was written: hyper says so
/// ("connection was not ready") when the connection ended right after it was made. That is how a TLS 1.3
/// server refuses a client certificate: its alert comes after the client's handshake is done, and hyper may
/// read it before or after handing the request over; a second try usually reads the alert and names it. Only
/// unsent requests are retried, so a `PUT` is never sent twice here.
async fn send(request: reqwest::RequestBuilder) -> Result<reqwest::Response, Error> {
    let mut attempts = 0;
    loop {
        let Some(this) = request.try_clone() else { return request.send().await.map_err(failed) };
        match this.send().await {
            Err(e) if attempts < 2 && never_sent(&e) => attempts += 1,
            other => return other.map_err(failed),
        }
    }
}

/// Whether hyper gave up on the request before writing it (its connection closed as it was made).
fn never_sent(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(h) = err.downcast_ref::<hyper::Error>()
            && h.is_canceled()
        {
            return true;
        }
        source = err.source();
    }
    false
}

impl Client {
    fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base.trim_end_matches('/')));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }
}

/// Turns a non-success answer into the matching error, with the problem's detail.
async fn check(resp: reqwest::Response, key: &str) -> Result<reqwest::Response, Error> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let etag = resp.headers().get(header::ETAG).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = resp.text().await.unwrap_or_default();
    let detail = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_owned))
        .unwrap_or(body);
    Err(match status {
        StatusCode::NOT_FOUND => Error::NotFound(key.to_owned()),
        StatusCode::PRECONDITION_FAILED => {
            Error::PreconditionFailed(format!("{key}: {detail} (ETag {})", etag.unwrap_or_else(|| "none".into())))
        }
        s => Error::Failed(format!("{s}: {detail}")),
    })
}

fn generation_of(resp: &reqwest::Response) -> Option<u64> {
    resp.headers().get(header::ETAG)?.to_str().ok()?.trim_matches('"').parse().ok()
}

/// What the server would refuse with 400 or 422 is bad usage here (exit 2), said before anything is sent.
fn check_usage(command: &KvCommand) -> Result<(), Error> {
    if let KvCommand::Get { key }
    | KvCommand::Put { key, .. }
    | KvCommand::Delete { key, .. }
    | KvCommand::Counter { key, .. }
    | KvCommand::Set { key, .. }
    | KvCommand::Update { key, .. } = command
        && (key == "." || key == "..")
    {
        // WHATWG URL parsing (which this client, like browsers, uses) treats "%2E" and "%2E%2E" as dot-segments
        // and removes them, so these two keys cannot be sent in a path from here.
        return Err(Error::Config(format!(
            "key {key:?} cannot travel in a URL path through this client (dot-segments are removed); \
             use curl --path-as-is with /v1/kv/%2E or choose another key"
        )));
    }
    let limits = idem_store::Limits::default();
    let checked = match command {
        KvCommand::Get { key } | KvCommand::Put { key, .. } | KvCommand::Delete { key, .. } => limits.check_key(key),
        // The array it keeps is the set `kv set` changes: its members take the same limits.
        KvCommand::Update { key, set_add, .. } => limits.check_set_change(
            key,
            &idem_store::SetChange { add: set_add.clone(), remove: Vec::new(), dedupe_id: None },
        ),
        KvCommand::Counter { key, dedupe_id, .. } => limits.check_counter(key, dedupe_id.as_deref()),
        KvCommand::Set { key, add, remove, dedupe_id } => limits.check_set_change(
            key,
            &idem_store::SetChange { add: add.clone(), remove: remove.clone(), dedupe_id: dedupe_id.clone() },
        ),
        KvCommand::List { .. } => Ok(()),
    };
    checked.map_err(|e| Error::Config(e.to_string()))?;
    Ok(())
}

/// Runs one `idem kv` command.
///
/// # Errors
/// [`Error::NotFound`] on 404, [`Error::PreconditionFailed`] on 412 (or when `update` exhausts its attempts),
/// [`Error::Failed`] for other answers and connection errors.
pub async fn run(args: KvArgs) -> Result<(), Error> {
    check_usage(&args.command)?;
    let base = server_url("--url", &args.url)?;
    let token = match &args.token_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| Error::Config(format!("cannot read --token-file {}: {e}", p.display())))?
                .trim()
                .to_owned(),
        ),
        None => None,
    };
    let http = args
        .tls
        .config()?
        .apply(idem_client::client_builder())
        .timeout(Duration::from_secs(60))
        .build()
        // Reached only through bad --cacert/--cert/--cert-key contents (a key that is not the certificate's, a
        // PEM block that is no certificate): bad usage, named with its cause, as `idem send` does.
        .map_err(|e| Error::Config(format!("cannot build the HTTP client: {}", idem_store::error_chain(&e))))?;
    let c = Client { http, base: base.into(), token };
    let mut out = std::io::stdout().lock();
    match args.command {
        KvCommand::Get { key } => {
            let resp =
                check(send(c.request(Method::GET, &format!("/v1/kv/{}", encode_key(&key)))).await?, &key).await?;
            if let Some(g) = generation_of(&resp) {
                crate::error::sayln!("generation: {g}");
            }
            let body = resp.bytes().await.map_err(failed)?;
            out.write_all(&body)?;
        }
        KvCommand::Put { key, value, if_match, if_absent, ttl } => {
            let body: Bytes = match value.as_deref() {
                None | Some("-") => {
                    let mut buf = Vec::new();
                    std::io::stdin().read_to_end(&mut buf)?;
                    buf.into()
                }
                Some(v) => Bytes::from(v.to_owned()),
            };
            let mut path = format!("/v1/kv/{}", encode_key(&key));
            if let Some(t) = ttl {
                path.push_str(&format!("?ttl={}", encode_key(&t)));
            }
            let mut req = c.request(Method::PUT, &path).body(body);
            if let Some(g) = if_match {
                req = req.header(header::IF_MATCH, format!("\"{g}\""));
            }
            if if_absent {
                req = req.header(header::IF_NONE_MATCH, "*");
            }
            let resp = check(send(req).await?, &key).await?;
            writeln!(out, "{}", generation_of(&resp).unwrap_or(0))?;
        }
        KvCommand::Delete { key, if_match } => {
            let mut req = c.request(Method::DELETE, &format!("/v1/kv/{}", encode_key(&key)));
            if let Some(g) = if_match {
                req = req.header(header::IF_MATCH, format!("\"{g}\""));
            }
            check(send(req).await?, &key).await?;
        }
        KvCommand::List { prefix, page_size } => {
            let mut cursor: Option<String> = None;
            loop {
                let mut q = vec![("prefix", prefix.clone()), ("limit", page_size.to_string())];
                if let Some(cur) = &cursor {
                    q.push(("cursor", cur.clone()));
                }
                let resp = check(send(c.request(Method::GET, "/v1/kv").query(&q)).await?, &prefix).await?;
                let page: serde_json::Value = resp.json().await.map_err(failed)?;
                for item in page["items"].as_array().into_iter().flatten() {
                    writeln!(out, "{}\t{}", item["key"].as_str().unwrap_or_default(), item["generation"])?;
                }
                match page["next_cursor"].as_str() {
                    Some(n) => cursor = Some(n.to_owned()),
                    None => break,
                }
            }
        }
        KvCommand::Counter { key, delta, dedupe_id } => {
            let outcome = kv_client(&c).counter_add(&key, delta, dedupe_id.as_deref()).await.map_err(client_error)?;
            crate::error::sayln!("generation: {}", outcome.generation);
            if !outcome.applied {
                crate::error::sayln!("not applied: dedupe id seen before; this is its first result");
            }
            writeln!(out, "{}", outcome.value)?;
        }
        KvCommand::Set { key, add, remove, dedupe_id } => {
            let change = idem_store::SetChange { add, remove, dedupe_id };
            let outcome = kv_client(&c).set_change(&key, &change).await.map_err(client_error)?;
            if !outcome.applied {
                crate::error::sayln!("not applied: dedupe id seen before; this is its first result");
            }
            crate::error::sayln!(
                "{} added, {} removed, {}",
                outcome.added,
                outcome.removed,
                crate::error::count(outcome.members, "member", "members")
            );
            writeln!(out, "{}", outcome.generation.map_or(0, idem_store::Generation::get))?;
        }
        KvCommand::Update { key, set_add, max_attempts } => {
            let (generation, attempts) = update_set(&c, &key, &set_add, max_attempts).await?;
            // 0: the key is absent and stays so (nothing to add).
            writeln!(out, "{}", generation.map_or(0, idem_store::Generation::get))?;
            if attempts > 1 {
                crate::error::sayln!("done after {attempts} attempts");
            }
        }
    }
    Ok(())
}

/// `idem-client`'s KV client on the same connection settings.
fn kv_client(c: &Client) -> idem_client::KvClient {
    let kv = idem_client::KvClient::new(c.http.clone(), c.base.as_str());
    match &c.token {
        Some(token) => kv.bearer_token(token.as_str()),
        None => kv,
    }
}

/// An error of `idem-client`'s KV client as `idem kv` reports it: a transport failure with its hint, a
/// refusal with its status and the problem's detail.
fn client_error(e: idem_client::Error) -> Error {
    match e {
        idem_client::Error::Transport(e) => failed(e),
        idem_client::Error::Status { status, detail, .. } => {
            let status = StatusCode::from_u16(status).map_or_else(|_| status.to_string(), |s| s.to_string());
            Error::Failed(format!("{status}: {detail}"))
        }
        e => Error::Failed(idem_store::error_chain(&e)),
    }
}

/// The read-modify-write loop over HTTP, from `idem-client`: GET, add the items, PUT with `If-Match` (or
/// `If-None-Match: *` when absent); on 412 back off with full jitter and start again from a fresh GET.
async fn update_set(
    c: &Client,
    key: &str,
    items: &[String],
    max_attempts: u32,
) -> Result<(Option<idem_store::Generation>, u32), Error> {
    let policy = RetryPolicy::default().with_max_attempts(max_attempts);
    let outcome = kv_client(c)
        .update(key, &policy, |current| {
            let mut set: Vec<String> = match current {
                Some(bytes) => serde_json::from_slice(bytes)?,
                None => Vec::new(),
            };
            let before = set.len();
            for i in items {
                if !set.contains(i) {
                    set.push(i.clone());
                }
            }
            // Nothing new and the set exists: leave it (and its generation) as it is.
            if set.len() == before && current.is_some() {
                return Ok(None);
            }
            Ok(Some(serde_json::to_vec(&set)?.into()))
        })
        .await;
    match outcome {
        Ok(done) => Ok(done),
        Err(idem_client::Error::AttemptsExhausted { .. }) => {
            let attempts = crate::error::count(max_attempts, "attempt", "attempts");
            Err(Error::PreconditionFailed(format!("{key}: gave up after {attempts} lost the race")))
        }
        Err(idem_client::Error::Json(_)) => {
            Err(Error::Failed(format!("the value under {key} is not a JSON array of strings")))
        }
        Err(idem_client::Error::Transport(e)) => Err(failed(e)),
        Err(e) => Err(Error::Failed(idem_store::error_chain(&e))),
    }
}
