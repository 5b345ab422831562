//! `[[route]]` tables of the `idem serve` configuration file: per-path policies for webhook deliveries
//! (signed or not, keyed by a header, a JSON field or the body), checked at start-up into [`RoutePolicy`]s.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idem_server::webhook::{self, DEFAULT_TOLERANCE, Scheme, Secrets, Verifier};
use idem_tower::{
    Ignore, InFlight, KeySource, MissingKey, OnFailure, RoutePolicy, UnknownOutcome, WEBHOOK_IN_FLIGHT_WAIT,
};
use serde::Deserialize;

use crate::error::Error;

/// One `[[route]]` table as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteFile {
    path: String,
    name: Option<String>,
    preset: Option<String>,
    key: Option<Vec<String>>,
    missing_key: Option<String>,
    ignore: Option<Vec<String>>,
    signature: Option<String>,
    secret_file: Option<PathBuf>,
    tolerance: Option<String>,
    on_failure: Option<String>,
    on_unknown: Option<String>,
    in_flight_wait: Option<String>,
    retention: Option<String>,
}

/// A webhook route's records are kept at least this long unless the route says otherwise: Stripe redelivers
/// for up to 3 days, GitHub lets a delivery be redelivered for 3 days, Svix for about 28 h.
const WEBHOOK_RETENTION: Duration = Duration::from_secs(3 * 24 * 3600);

/// A route's secret file, re-read on SIGHUP into its verifier.
#[derive(Debug)]
pub(super) struct SecretFile {
    route: String,
    path: PathBuf,
    verifier: Arc<Verifier>,
}

/// Re-reads every route's secret file on each SIGHUP. A file that cannot be read or holds no usable secret
/// leaves that route's previous secrets in place, and the error names the file, never its content.
pub(super) fn reload_secrets_on_sighup(
    files: Vec<SecretFile>,
) -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    Ok(async move {
        while hup.recv().await.is_some() {
            for file in &files {
                let read = std::fs::read_to_string(&file.path)
                    .map_err(|e| e.to_string())
                    .and_then(|text| Secrets::parse(file.verifier.scheme_of(), &text).map_err(|e| e.to_string()));
                match read {
                    Ok(secrets) => {
                        // Replaced before the line is logged: whoever reads the log may rely on the new secrets.
                        file.verifier.replace_secrets(secrets);
                        tracing::info!(route = %file.route, file = %file.path.display(), "webhook secrets reloaded");
                    }
                    Err(e) => tracing::error!(
                        route = %file.route,
                        file = %file.path.display(),
                        error = %e,
                        "webhook secret reload failed; the route keeps its previous secrets"
                    ),
                }
            }
        }
    })
}

/// Checked routes, their secret files, and what start-up should warn about.
pub(super) struct Routes {
    pub(super) routes: Vec<RoutePolicy>,
    pub(super) secret_files: Vec<SecretFile>,
    pub(super) warnings: Vec<String>,
}

/// Checks every route table; a path or a name given twice is refused.
pub(super) fn resolve_routes(files: Vec<RouteFile>, retention: Duration) -> Result<Routes, Error> {
    let mut routes: Vec<RoutePolicy> = Vec::with_capacity(files.len());
    let mut secret_files = Vec::new();
    let mut warnings = Vec::new();
    for file in files {
        let path = file.path.clone();
        let (route, secret) =
            resolve(file, retention).map_err(|e| Error::Config(format!("[[route]] path = {path:?}: {e}")))?;
        if let Some(twin) = routes.iter().find(|r| r.path() == route.path() || r.name() == route.name()) {
            return Err(Error::Config(format!(
                "[[route]] path = {path:?}: route {:?} at {:?} has the same path or name",
                twin.name(),
                twin.path()
            )));
        }
        if let Some((path, verifier)) = secret {
            let scheme = verifier.scheme_of();
            for source in route.key_sources() {
                let source = source.to_string();
                // Every part named (break-it review: GitHub's joined source named only the hook id).
                let uncovered: Vec<&str> = source.split('+').filter(|part| !scheme.covers(part)).collect();
                if !uncovered.is_empty() {
                    warnings.push(format!(
                        "route {:?}: its {} signature does not cover key source part{} {}: a captured genuine \
                         body resent under a made-up id executes once more",
                        route.name(),
                        scheme.name(),
                        if uncovered.len() > 1 { "s" } else { "" },
                        uncovered.join(" and ")
                    ));
                }
            }
            if world_readable(&path) {
                warnings.push(format!(
                    "route {:?}: secret_file {} is readable by every user of this machine",
                    route.name(),
                    path.display()
                ));
            }
            secret_files.push(SecretFile { route: route.name().to_owned(), path, verifier });
        }
        routes.push(route);
    }
    Ok(Routes { routes, secret_files, warnings })
}

fn world_readable(path: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o004 != 0)
}

/// A checked route, and its secret file with the verifier that file feeds.
type Resolved = (RoutePolicy, Option<(PathBuf, Arc<Verifier>)>);

fn resolve(file: RouteFile, retention: Duration) -> Result<Resolved, String> {
    let preset = file.preset.as_deref().map(webhook::preset).transpose().map_err(|e| e.to_string())?;
    let name = match (&file.name, &file.preset) {
        (Some(name), _) => name.clone(),
        (None, Some(preset)) => preset.clone(),
        (None, None) => file.path.rsplit('/').find(|s| !s.is_empty()).unwrap_or("root").to_ascii_lowercase(),
    };
    let key = match (file.key, &preset) {
        (Some(sources), _) => {
            sources.iter().map(|s| s.parse::<KeySource>()).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?
        }
        (None, Some(p)) => p.key.clone(),
        (None, None) => return Err("no key: give key = [...] or a preset".into()),
    };
    let ignore = match (file.ignore, &preset) {
        (Some(entries), _) => {
            entries.iter().map(|s| s.parse::<Ignore>()).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?
        }
        (None, Some(p)) => p.ignore.clone(),
        (None, None) => Vec::new(),
    };
    let scheme = match (file.signature.as_deref(), &preset) {
        (Some("none"), _) => None,
        (Some(s), _) => Some(s.parse::<Scheme>().map_err(|e| e.to_string())?),
        (None, Some(p)) => Some(p.scheme),
        (None, None) => None,
    };
    let mut route = RoutePolicy::new(&name, &file.path, key).map_err(|e| e.to_string())?.ignore(ignore);
    let webhook = scheme.is_some() || preset.is_some();
    let mut secret = None;
    match (scheme, file.secret_file) {
        (Some(scheme), Some(secret_file)) => {
            let tolerance = match file.tolerance {
                Some(_) if !scheme.has_timestamp() => {
                    return Err(format!("tolerance: {} signatures carry no timestamp", scheme.name()));
                }
                // Values are not echoed in route errors: a secret pasted into the wrong field would be printed.
                Some(t) => humantime::parse_duration(&t).map_err(|e| format!("tolerance: {e}"))?,
                None => DEFAULT_TOLERANCE,
            };
            if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&tolerance) {
                return Err("tolerance must be within 1s..=1h".into());
            }
            // The file's content never reaches a message: only its name and what is wrong.
            // Nor its name when it cannot be read: a secret pasted where the file name belongs would be echoed.
            let text =
                std::fs::read_to_string(&secret_file).map_err(|e| format!("its secret_file cannot be read: {e}"))?;
            let secrets =
                Secrets::parse(scheme, &text).map_err(|e| format!("secret_file {}: {e}", secret_file.display()))?;
            let verifier = Verifier::new(scheme, secrets, tolerance);
            route = route.verifier(Arc::clone(&verifier) as Arc<dyn idem_tower::Verify>);
            secret = Some((secret_file, verifier));
        }
        (Some(scheme), None) => return Err(format!("{} signatures need secret_file", scheme.name())),
        (None, Some(_)) => return Err("secret_file without a signature scheme (signature or preset)".into()),
        (None, None) if file.tolerance.is_some() => return Err("tolerance without a signature scheme".into()),
        (None, None) => {}
    }
    route = route.missing_key(match file.missing_key.as_deref() {
        None => preset.as_ref().map_or(MissingKey::Refuse, |p| p.missing_key),
        Some("refuse") => MissingKey::Refuse,
        Some("pass") => MissingKey::Pass,
        Some(_) => return Err("missing_key: expected refuse or pass".into()),
    });
    route = route.on_failure(match file.on_failure.as_deref() {
        None if webhook => OnFailure::Release,
        None | Some("store") => OnFailure::Store,
        Some("release") => OnFailure::Release,
        Some(_) => return Err("on_failure: expected release or store".into()),
    });
    // A webhook sender redelivers for days: an outcome kept unknown would answer every redelivery 502 until the
    // record expires, and the event would never be processed; released, the redelivery executes (once more,
    // if the first did run). Other routes keep the proxy's --release-unknown policy.
    match file.on_unknown.as_deref() {
        None if webhook => route = route.unknown_outcome(UnknownOutcome::Release),
        None => {}
        Some("release") => route = route.unknown_outcome(UnknownOutcome::Release),
        Some("keep") => route = route.unknown_outcome(UnknownOutcome::Keep),
        Some(_) => return Err("on_unknown: expected release or keep".into()),
    }
    match file.retention {
        Some(r) => {
            let r = humantime::parse_duration(&r).map_err(|e| format!("retention: {e}"))?;
            if !(idem_store::MIN_TTL..=idem_store::MAX_TTL).contains(&r) {
                return Err("retention must be within 1s..=365d".into());
            }
            route = route.retention(r);
        }
        None if webhook => route = route.retention(retention.max(WEBHOOK_RETENTION)),
        None => {}
    }
    let wait = match file.in_flight_wait {
        Some(w) => Some(humantime::parse_duration(&w).map_err(|e| format!("in_flight_wait: {e}"))?),
        None if webhook => Some(WEBHOOK_IN_FLIGHT_WAIT),
        None => None,
    };
    if let Some(wait) = wait {
        route = route.in_flight(if wait.is_zero() { InFlight::Reject } else { InFlight::Wait(wait) });
    }
    Ok((route, secret))
}
