//! `idem check URL`: probes any HTTP API's `Idempotency-Key` handling (draft-ietf-httpapi-idempotency-key-header,
//! Stripe's documented behaviour) and prints a conformance report.
//!
//! It sends real writes, so it plans every request first: `--dry-run` lists them and sends nothing, and a run
//! prints how many it will send and asks (unless `--yes`). Every key carries a run prefix of its own, and
//! requests go only to the URLs the user names.

mod http;
mod probes;
mod report;
mod target;

use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reqwest::Method;
use reqwest::header::HeaderValue;

use crate::error::Error;
use http::{Exchange, Sender};
use probes::{ALL, Probe};
use report::{ProbeReport, Report, RequestReport, Verdict};
use target::{Planned, Target, header_flag, shown, variant_of};

const CHECK_AFTER_HELP: &str = "\
Probes (--only takes their names; each runs with keys of its own):
  missing-key   a request without a key: reported (judged with --key-required: 400)
  replay        the same key and body twice: the same status, body bytes, Location, Content-Type
  concurrent    --concurrency identical requests at once: one outcome, the rest 409 + Retry-After or it
  mismatch      the same key with another body: 422 (or Stripe's 400), never the first answer
  other-target  the same key with another method (and on --other-url): never the first answer
  malformed     empty, 256-character, tab-carrying and repeated keys: 400
  scope         the same key under --second-credential executes on its own; Set-Cookie never replayed
  in-flight     a duplicate while the first runs (--slow-url): 409 + Retry-After or the first answer
  errors        an error answer (--error-url): a 503 or 429 must not be pinned to the key
  expiry        after --retention-probe the key executes again

Every request is a real write to the URLs given. The plan (how many requests, to which URLs) is printed \
first and confirmed on the terminal unless --yes; --dry-run prints every request and sends none.

Exit status:
  0  no probe failed (WARN and N/A do not fail)
  1  a probe failed, or the API could not be reached
  2  bad usage, or the plan was not confirmed: nothing sent";

/// Flags of `idem check`.
#[derive(Debug, clap::Args)]
#[command(after_help = CHECK_AFTER_HELP)]
pub struct CheckArgs {
    /// The write endpoint to probe (it must accept the request: a 2xx); without a scheme, http://.
    url: String,
    /// The method of the write.
    #[arg(long, short = 'X', default_value = "POST")]
    method: String,
    /// The body as JSON, sent as application/json; @FILE reads a file, @- standard input. Default: {}.
    #[arg(long, conflicts_with = "data")]
    json: Option<String>,
    /// The body as bytes, sent with --content-type; @FILE reads a file, @- standard input.
    #[arg(long)]
    data: Option<String>,
    /// Content type of --data.
    #[arg(long, default_value = "application/octet-stream")]
    content_type: String,
    /// An extra request header, "Name: value" (repeatable), sent with every request.
    #[arg(long = "header", short = 'H', value_name = "Name: value")]
    headers: Vec<String>,
    /// The first caller's credential header, "Name: value" (e.g. 'Authorization: Bearer alice').
    #[arg(long, value_name = "Name: value")]
    credential: Option<String>,
    /// A second caller's credential header, sent instead of --credential by the scope probe.
    #[arg(long, value_name = "Name: value")]
    second_credential: Option<String>,
    /// A URL of the same API that takes the request and answers slowly (a second or more): the in-flight probe.
    #[arg(long, value_name = "URL")]
    slow_url: Option<String>,
    /// A URL of the same API that answers the request with a 5xx or 429: the errors probe.
    #[arg(long, value_name = "URL")]
    error_url: Option<String>,
    /// Another URL of the same API that takes the request: the same key on another path.
    #[arg(long, value_name = "URL")]
    other_url: Option<String>,
    /// Run only these probes (comma-separated names, listed below).
    // The names are listed once, below, with what each checks: clap's list of possible values would say it again.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "PROBE,…", hide_possible_values = true)]
    only: Vec<Probe>,
    /// The report: a table, or JSON for CI.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Send without asking.
    #[arg(long)]
    yes: bool,
    /// Print every request and send nothing.
    #[arg(long)]
    dry_run: bool,
    /// The API requires a key: a request without one must get 400.
    #[arg(long)]
    key_required: bool,
    /// The retention the API states, e.g. 10s (at most 1h): the expiry probe waits this long, then expects the
    /// key to execute again.
    #[arg(long, value_name = "DURATION")]
    retention_probe: Option<String>,
    /// Identical requests the concurrent probe sends at once (2..=64).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Time limit of each request, e.g. 30s.
    #[arg(long, default_value = "30s")]
    timeout: String,
    #[command(flatten)]
    tls: crate::client::TlsArgs,
}

/// The report's form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    /// A table for people.
    Table,
    /// JSON for CI.
    Json,
}

/// Longest `--retention-probe`: a check that waits longer is a job for a scheduler, not one process.
const MAX_RETENTION_PROBE: Duration = Duration::from_secs(3600);

/// Plans, confirms, probes and prints the report; returns the exit status (0 no probe failed, 1 one did).
///
/// # Errors
/// [`Error::Config`] for bad flags or an unconfirmed plan (nothing sent, exit 2); [`Error::Failed`] when no
/// request got an answer (exit 1).
pub async fn run(args: CheckArgs) -> Result<i32, Error> {
    let target = Arc::new(target(&args)?);
    // The TLS files are read before the plan is printed: a bad one is refused before any prompt or dry run.
    let timeout = parse_duration("--timeout", &args.timeout)?;
    let http = args
        .tls
        .config()?
        .apply(idem_client::client_builder())
        .timeout(timeout)
        // A redirect is an answer to report, not to follow.
        .redirect(reqwest::redirect::Policy::none())
        // Only the URLs the user names are contacted: an HTTP_PROXY or ALL_PROXY in the environment would send
        // every request, credentials included, to the proxy.
        .no_proxy()
        .build()
        .map_err(|e| Error::Config(format!("cannot build the HTTP client: {}", idem_store::error_chain(&e))))?;
    let selected: Vec<Probe> = ALL.into_iter().filter(|p| args.only.is_empty() || args.only.contains(p)).collect();
    let plans: Vec<(Probe, Result<Vec<Planned>, String>)> = selected.iter().map(|&p| (p, p.plan(&target))).collect();
    let total: usize = plans.iter().map(|(_, plan)| plan.as_ref().map_or(0, Vec::len)).sum();
    if args.dry_run {
        print_dry_run(&target, &plans, total, args.format)?;
        return Ok(0);
    }
    // Nobody to ask: refused before anything is printed or sent.
    if !args.yes && !std::io::stdin().is_terminal() {
        return Err(Error::Config(format!(
            "standard input is not a terminal: give --yes to send {}, or --dry-run to list them",
            requests(total)
        )));
    }
    crate::error::say(&plan_summary(&target, &plans, total));
    if !args.yes {
        confirm(total)?;
    }
    let sender = Sender::new(http, Arc::clone(&target));
    let mut reports = Vec::new();
    for (probe, plan) in &plans {
        let (verdict, requests) = match plan {
            Err(reason) => (Verdict::not_applicable(reason.clone()), Vec::new()),
            Ok(plan) => {
                let mut ex = Exchange::new(&sender, plan);
                let verdict = probe.run(&mut ex).await;
                let requests = plan.iter().zip(ex.log).map(|(p, logged)| RequestReport::new(p, logged)).collect();
                (verdict, requests)
            }
        };
        // Nothing answered at all: the URL is wrong or down, and every further probe would say the same.
        if let (sent @ 1.., 0) = sender.counts() {
            return Err(Error::Failed(format!(
                "no answer from {} ({sent} sent): {}",
                shown(&target.url),
                verdict.observed
            )));
        }
        reports.push(ProbeReport {
            probe: probe.name(),
            title: probe.title(),
            spec: probe.spec(),
            expected: probe.expected(&target),
            observed: verdict.observed,
            result: verdict.outcome,
            requests,
        });
    }
    let report = Report::new(&target, sender.counts(), reports);
    // A reader gone (`| head`) does not change what the probes found: the exit status still says it.
    match args.format {
        Format::Table => crate::error::out(&report.table())?,
        Format::Json => {
            crate::error::out(&format!("{}\n", serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?))?
        }
    }
    Ok(report.exit_status)
}

/// The flags, checked, as the request under test.
fn target(args: &CheckArgs) -> Result<Target, Error> {
    let method = Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
        .map_err(|_| Error::Config(format!("--method {:?} is not an HTTP method", args.method)))?;
    let url = api_url("URL", &args.url)?;
    let (body, content_type, json) = match (&args.json, &args.data) {
        (Some(json), _) => {
            let bytes = crate::key::payload(json)?;
            serde_json::from_slice::<serde_json::Value>(&bytes)
                .map_err(|e| Error::Config(format!("--json is not valid JSON: {e}")))?;
            (bytes, HeaderValue::from_static("application/json"), true)
        }
        (None, Some(data)) => {
            let ct = HeaderValue::from_str(&args.content_type)
                .map_err(|_| Error::Config(format!("--content-type {:?} is not a header value", args.content_type)))?;
            (crate::key::payload(data)?, ct, false)
        }
        (None, None) => (b"{}".to_vec(), HeaderValue::from_static("application/json"), true),
    };
    let headers = args.headers.iter().map(|h| header_flag("--header", h)).collect::<Result<Vec<_>, _>>()?;
    let credential = args.credential.as_deref().map(|c| header_flag("--credential", c)).transpose()?;
    let second_credential =
        args.second_credential.as_deref().map(|c| header_flag("--second-credential", c)).transpose()?;
    for (flag, given) in [("--credential", &credential), ("--second-credential", &second_credential)] {
        if let Some((name, _)) = given
            && headers.iter().any(|(h, _)| h == name)
        {
            return Err(Error::Config(format!(
                "{flag} names {name}, which --header sets too: give each caller's credential with its flag only"
            )));
        }
    }
    if second_credential.is_some() && second_credential == credential {
        return Err(Error::Config("--second-credential is the same as --credential: give another caller's".into()));
    }
    let optional_url = |flag: &str, given: &Option<String>| given.as_deref().map(|u| api_url(flag, u)).transpose();
    if !(2..=64).contains(&args.concurrency) {
        return Err(Error::Config(format!("--concurrency {} is outside 2..=64", args.concurrency)));
    }
    let retention = args.retention_probe.as_deref().map(|r| parse_duration("--retention-probe", r)).transpose()?;
    if let Some(r) = retention
        && r > MAX_RETENTION_PROBE
    {
        return Err(Error::Config(format!(
            "--retention-probe {} is over 1h: probe a longer retention by hand",
            humantime::format_duration(r)
        )));
    }
    parse_duration("--timeout", &args.timeout)?;
    let run = format!("idem-check-{:08x}", rand::random::<u32>());
    Ok(Target {
        method,
        url,
        variant: variant_of(&body, json, &run),
        body: Bytes::from(body),
        content_type,
        headers,
        credential,
        second_credential,
        slow_url: optional_url("--slow-url", &args.slow_url)?,
        error_url: optional_url("--error-url", &args.error_url)?,
        other_url: optional_url("--other-url", &args.other_url)?,
        concurrency: args.concurrency,
        key_required: args.key_required,
        retention,
        run,
    })
}

/// `given` (the value of `flag`) as the URL of an API to write to: a server URL as the clients take one, but
/// never a guess. A path (`/orders`), a bare word (`orders`, which would become the host `orders`), another
/// scheme written without `//` (`mailto:x@y`, which would become a user and a host) and port 0 are refused.
///
/// # Errors
/// [`Error::Config`]: one line naming `flag`, the value (password hidden) and what to give.
fn api_url(flag: &str, given: &str) -> Result<reqwest::Url, Error> {
    let shown = idem_core::redact_url(given);
    let refuse = |why: &str| {
        Error::Config(format!("{flag} {shown:?} {why}; give the API's full URL, e.g. http://HOST:PORT/orders"))
    };
    if !given.contains("://") {
        if given.starts_with('/') || given.starts_with('.') {
            return Err(refuse("is a relative URL"));
        }
        // `host:port…` has a port after the colon; `mailto:x@y` has a scheme.
        if let Some((scheme, rest)) = given.split_once(':')
            && !rest.starts_with(|c: char| c.is_ascii_digit())
            && scheme.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        {
            return Err(refuse(&format!("has the scheme {scheme}, not http or https")));
        }
        let host = given.split(['/', '?', '#']).next().unwrap_or_default();
        if !(host.contains(['.', ':']) || host == "localhost" || host.starts_with('[')) {
            return Err(refuse("is a relative URL (no host with a dot or a port)"));
        }
    }
    let url = crate::client::server_url(flag, given)?;
    if url.port() == Some(0) {
        return Err(refuse("has port 0"));
    }
    Ok(url)
}

/// A positive duration flag like `30s`.
fn parse_duration(flag: &str, given: &str) -> Result<Duration, Error> {
    let d = humantime::parse_duration(given)
        .map_err(|e| Error::Config(format!("{flag} {given:?} is not a duration like 30s: {e}")))?;
    if d.is_zero() {
        return Err(Error::Config(format!("{flag} must be more than 0s")));
    }
    Ok(d)
}

/// What a run will send, said before anything is: the count, and per method and URL how many.
fn plan_summary(target: &Target, plans: &[(Probe, Result<Vec<Planned>, String>)], total: usize) -> String {
    let mut per_url: Vec<(String, usize)> = Vec::new();
    for planned in plans.iter().filter_map(|(_, p)| p.as_ref().ok()).flatten() {
        let line = format!("{} {}", planned.method, shown(&planned.url));
        match per_url.iter_mut().find(|(l, _)| *l == line) {
            Some((_, n)) => *n += 1,
            None => per_url.push((line, 1)),
        }
    }
    let mut text = format!(
        "idem check: {}, up to {} (real writes), every key starting with {}-\n",
        crate::error::count(plans.len(), "probe", "probes"),
        requests(total),
        target.run
    );
    for (line, n) in per_url {
        text.push_str(&format!("  {n:>3} × {line}\n"));
    }
    text
}

/// `n requests`, `1 request`.
fn requests(n: usize) -> String {
    crate::error::count(n, "request", "requests")
}

/// Asks on the terminal whether to send the plan.
///
/// # Errors
/// [`Error::Config`] when the answer is not yes: nothing has been sent.
fn confirm(total: usize) -> Result<(), Error> {
    let these = if total == 1 { "this request".to_owned() } else { format!("these {total} requests") };
    crate::error::say(&format!("Send {these}? [y/N] "));
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    if matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
        Ok(())
    } else {
        Err(Error::Config("not confirmed: nothing sent".into()))
    }
}

/// `--dry-run`: every planned request (credential values hidden), nothing sent.
fn print_dry_run(
    target: &Target,
    plans: &[(Probe, Result<Vec<Planned>, String>)],
    total: usize,
    format: Format,
) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    if format == Format::Json {
        let probes: Vec<serde_json::Value> = plans
            .iter()
            .map(|(probe, plan)| match plan {
                Ok(plan) => serde_json::json!({
                    "probe": probe.name(),
                    "requests": plan.iter().map(|p| RequestReport::new(p, None)).collect::<Vec<_>>(),
                }),
                Err(reason) => serde_json::json!({ "probe": probe.name(), "requests": [], "not_probed": reason }),
            })
            .collect();
        let json = serde_json::json!({
            "dry_run": true,
            "target": format!("{} {}", target.method, shown(&target.url)),
            "key_prefix": format!("{}-", target.run),
            "requests_planned": total,
            "probes": probes,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&json).map_err(std::io::Error::other)?)?;
        return Ok(());
    }
    writeln!(out, "idem check --dry-run: {} planned, none sent; keys start with {}-", requests(total), target.run)?;
    for (probe, plan) in plans {
        match plan {
            Err(reason) => writeln!(out, "{:<12}  -    {reason}", probe.name())?,
            Ok(plan) => {
                for (i, planned) in plan.iter().enumerate() {
                    writeln!(out, "{:<12}  {:>2}/{:<2} {}", probe.name(), i + 1, plan.len(), target.describe(planned))?;
                }
            }
        }
    }
    Ok(())
}
