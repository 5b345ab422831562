//! `idem send`: one logical write with a derived Idempotency-Key, retried safely (curl-like, for scripts).

use idem_client::{Client, RetryPolicy, WriteRequest};
use reqwest::Method;
use reqwest::header::{HeaderName, HeaderValue};

use crate::error::Error;

/// Flags of `idem send`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("payload").args(["json", "data"])))]
#[command(group(clap::ArgGroup::new("keying").required(true).args(["key", "key_prefix"])))]
pub struct SendArgs {
    /// The method: POST, PATCH, PUT or DELETE (any method is sent as given); without --json or --data the
    /// request has no body (a DELETE, or a POST whose URL says it all).
    method: String,
    /// The URL to send to; without a scheme, http:// (as curl does: 127.0.0.1:8080/orders).
    url: String,
    /// The body as JSON, sent as application/json; @FILE reads a file, @- standard input.
    #[arg(long)]
    json: Option<String>,
    /// The body as bytes, sent with --content-type; @FILE reads a file, @- standard input.
    #[arg(long)]
    data: Option<String>,
    /// Content type of --data.
    #[arg(long, default_value = "application/octet-stream")]
    content_type: String,
    /// Derive the key as `idem key` does: PREFIX:ID:HASH of the canonical payload (needs --id).
    #[arg(long, requires = "id")]
    key_prefix: Option<String>,
    /// The stable id of the item the write is about.
    #[arg(long)]
    id: Option<String>,
    /// Use this key as it is instead of deriving one.
    #[arg(long, conflicts_with_all = ["key_prefix", "id"])]
    key: Option<String>,
    /// An extra request header, "Name: value" (repeatable), e.g. Authorization.
    #[arg(long = "header", short = 'H')]
    headers: Vec<String>,
    /// Attempts before giving up.
    #[arg(long, default_value_t = 8)]
    attempts: u32,
    /// Time limit of each attempt, e.g. 30s; an attempt that times out is retried (the key makes it safe).
    #[arg(long, default_value = "30s")]
    timeout: String,
    /// Print the key and exit without sending (store it beside the work item).
    #[arg(long)]
    print_key: bool,
    /// After a replayed 201, GET its Location and fail if the object is gone.
    #[arg(long)]
    read_back: bool,
    // Last: its `next_help_heading` ("Connection") would head every flag after it.
    #[command(flatten)]
    tls: crate::client::TlsArgs,
}

/// Sends the write and prints the response body; the replay status and attempts go to standard error.
///
/// # Errors
/// [`Error::Config`] for bad flags; [`Error::Send`] for a refused or failed write (its exit status says which).
pub async fn run(args: SendArgs) -> Result<(), Error> {
    // The content type is `None` without a body: nothing to describe, so no Content-Type is sent.
    let (body, content_type) = match (&args.json, &args.data) {
        (Some(json), _) => {
            let bytes = crate::key::payload(json)?;
            serde_json::from_slice::<serde_json::Value>(&bytes)
                .map_err(|e| Error::Config(format!("--json is not valid JSON: {e}")))?;
            (bytes, Some(HeaderValue::from_static("application/json")))
        }
        (None, Some(data)) => {
            let ct = HeaderValue::from_str(&args.content_type)
                .map_err(|_| Error::Config(format!("--content-type {:?} is not a header value", args.content_type)))?;
            (crate::key::payload(data)?, Some(ct))
        }
        (None, None) => (Vec::new(), None),
    };
    let key = match (&args.key, &args.key_prefix, &args.id) {
        (Some(key), _, _) => idem_client::IdempotencyKey::new(key.as_str()),
        (None, Some(prefix), Some(id)) => idem_client::derive_key(prefix, id, &body),
        _ => return Err(Error::Config("give --key, or --key-prefix with --id".into())),
    }
    .map_err(|e| Error::Config(format!("idempotency key: {e}")))?;
    if args.print_key {
        crate::error::out(&format!("{key}\n"))?;
        return Ok(());
    }
    let method = Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
        .map_err(|_| Error::Config(format!("{:?} is not an HTTP method", args.method)))?;
    let url = crate::client::server_url("URL", &args.url)?;
    let request = match content_type {
        Some(content_type) => WriteRequest::bytes(method, url.as_str(), key, content_type, body),
        None => WriteRequest::empty(method, url.as_str(), key),
    };
    let mut request = request.map_err(|e| Error::Config(e.to_string()))?;
    for header in &args.headers {
        let (name, value) = header
            .split_once(':')
            .ok_or_else(|| Error::Config(format!("--header {header:?} is not \"Name: value\"")))?;
        let name =
            HeaderName::try_from(name.trim()).map_err(|_| Error::Config(format!("bad header name in {header:?}")))?;
        // These idem send sets itself (or the HTTP library does); a second copy would contradict it.
        let reserved = ["idempotency-key", "content-type", "content-length", "transfer-encoding", "host"];
        if reserved.contains(&name.as_str()) {
            return Err(Error::Config(format!(
                "--header {name} is set by idem send itself (use --key, --content-type or the body flags)"
            )));
        }
        let value = HeaderValue::from_str(value.trim())
            .map_err(|_| Error::Config(format!("bad header value in {header:?}")))?;
        request = request.header(name, value);
    }
    if args.attempts == 0 {
        return Err(Error::Config("--attempts must be at least 1".into()));
    }
    let policy = RetryPolicy::new()
        .with_max_attempts(args.attempts)
        .with_base_delay(std::time::Duration::from_millis(100))
        .with_max_delay(std::time::Duration::from_secs(10));
    let timeout = humantime::parse_duration(&args.timeout)
        .map_err(|e| Error::Config(format!("--timeout {:?} is not a duration like 30s: {e}", args.timeout)))?;
    if timeout.is_zero() {
        return Err(Error::Config("--timeout must be more than 0s".into()));
    }
    let tls = args.tls.config()?;
    let client = Client::with_tls(timeout, &tls)
        .map_err(|e| Error::Config(e.to_string()))?
        .retry_policy(policy)
        .read_back(args.read_back);
    let response = client.send(&request).await.map_err(Error::Send)?;
    crate::error::sayln!(
        "idem send: {} after {}{} (key {})",
        response.status(),
        crate::error::count(response.attempts(), "attempt", "attempts"),
        if response.replayed() { ", replayed" } else { "" },
        request.key()
    );
    crate::error::out_bytes(response.body())?;
    Ok(())
}
