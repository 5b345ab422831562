//! The GET pages: overview, records, one record, webhook routes, runs, one job, one item, cron jobs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use askama::Template;
use axum::Extension;
use axum::extract::{Query, State};
use axum::response::Response;
use idem_runner::LedgerStatus;
use idem_store::Store;
use serde::Deserialize;

use super::{Nav, Session, error_page, render};
use crate::cron::CronJob;
use crate::records::{self, Detail, Filter, RecordPage, State as RecordState};
use crate::runs::{self, ItemDetail, ItemPage, ItemState, Job};
use crate::{Admin, Error};

pub(crate) use crate::PAGE;

type St<S> = State<Arc<Admin<S>>>;
type Ses = Extension<Session>;

#[derive(Template)]
#[template(path = "overview.html")]
struct Overview {
    nav: Nav,
    backend: String,
    namespace: String,
    reachable: bool,
    latency: String,
    scanned: usize,
    in_flight: usize,
    completed: usize,
    too_large: usize,
    unknown: usize,
    unknown_hour: usize,
    unknown_day: usize,
    resolved: usize,
    counters: Vec<(String, String)>,
    rates: Vec<crate::rates::Rate>,
}

pub(crate) async fn overview<S: Store>(State(admin): St<S>, Extension(session): Ses) -> Response {
    let started = Instant::now();
    let now = admin.store.now().await;
    let latency = started.elapsed();
    let counters = crate::metrics::totals(&admin.metrics_text());
    // Only where the pages read the process's counters (a proxy's admin listener): else there is nothing to rate.
    let rates = if counters.is_empty() { Vec::new() } else { admin.rates.observe(Instant::now(), &counters) };
    let mut page = Overview {
        nav: Nav::of(&session),
        backend: admin.info.backend.clone(),
        namespace: admin.info.namespace.clone(),
        reachable: now.is_ok(),
        latency: format!("{:.1} ms", latency.as_secs_f64() * 1000.0),
        scanned: 0,
        in_flight: 0,
        completed: 0,
        too_large: 0,
        unknown: 0,
        unknown_hour: 0,
        unknown_day: 0,
        resolved: 0,
        counters,
        rates,
    };
    if let Ok(now) = now {
        let now_ms = idem_store::system_time_to_millis(now);
        // One bounded read: the counts are of the first records the budget reaches, and say so.
        if let Ok(listed) =
            records::list(&admin.store, &admin.prefix, &Filter::default(), None, usize::MAX, now_ms).await
        {
            page.scanned = listed.scanned;
            for r in &listed.rows {
                match r.state {
                    RecordState::InFlight => page.in_flight += 1,
                    RecordState::Completed => page.completed += 1,
                    RecordState::TooLarge => page.too_large += 1,
                    RecordState::Unknown => {
                        page.unknown += 1;
                        let age = now_ms.saturating_sub(r.at_ms);
                        page.unknown_hour += usize::from(age <= 3_600_000);
                        page.unknown_day += usize::from(age <= 86_400_000);
                    }
                    RecordState::Resolved => page.resolved += 1,
                }
            }
        }
    }
    render(&page)
}

/// The records list's query, as the filter form sends it (empty fields are unset).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct RecordQuery {
    pub(crate) state: String,
    pub(crate) route: String,
    pub(crate) scope: String,
    pub(crate) prefix: String,
    pub(crate) older: String,
    pub(crate) newer: String,
    pub(crate) cursor: String,
}

impl RecordQuery {
    pub(crate) fn filter(&self) -> Result<Filter, Error> {
        let duration = |name: &str, s: &str| -> Result<Option<Duration>, Error> {
            if s.is_empty() {
                return Ok(None);
            }
            humantime::parse_duration(s).map(Some).map_err(|e| Error::BadRequest(format!("{name}: {e} (e.g. 90s, 1h)")))
        };
        Ok(Filter {
            state: (!self.state.is_empty()).then(|| RecordState::parse(&self.state)).transpose()?,
            route: match self.route.as_str() {
                "" => None,
                "-" => Some(String::new()),
                r => Some(r.to_owned()),
            },
            scope: (!self.scope.is_empty()).then(|| self.scope.clone()),
            key_prefix: self.prefix.clone(),
            older_than: duration("older", &self.older)?,
            newer_than: duration("newer", &self.newer)?,
        })
    }

    fn next_link(&self, cursor: &str) -> String {
        let pairs = [
            ("state", &self.state),
            ("route", &self.route),
            ("scope", &self.scope),
            ("prefix", &self.prefix),
            ("older", &self.older),
            ("newer", &self.newer),
        ];
        let mut out = String::from("/ui/records?");
        for (k, v) in pairs.iter().filter(|(_, v)| !v.is_empty()) {
            out.push_str(&format!("{k}={}&", crate::urlencode(v)));
        }
        out.push_str(&format!("cursor={cursor}"));
        out
    }
}

#[derive(Template)]
#[template(path = "records.html")]
struct Records {
    nav: Nav,
    q: RecordQuery,
    page: RecordPage,
    next_link: Option<String>,
}

pub(crate) async fn records<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<RecordQuery>,
) -> Response {
    let listed = async {
        let filter = q.filter()?;
        let now_ms = idem_store::system_time_to_millis(admin.store.now().await?);
        let cursor = (!q.cursor.is_empty()).then_some(q.cursor.as_str());
        records::list(&admin.store, &admin.prefix, &filter, cursor, PAGE, now_ms).await
    };
    match listed.await {
        Ok(page) => {
            let next_link = page.next_cursor.as_deref().map(|c| q.next_link(c));
            render(&Records { nav: Nav::of(&session), q, page, next_link })
        }
        Err(e) => error_page(&session, &e),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct RecordRef {
    pub(crate) k: String,
    #[serde(default)]
    body: Option<String>,
}

#[derive(Template)]
#[template(path = "record.html")]
struct RecordPageT {
    nav: Nav,
    d: Detail,
}

pub(crate) async fn record<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(r): Query<RecordRef>,
) -> Response {
    match records::detail(&admin.store, &admin.prefix, &r.k, r.body.is_some()).await {
        Ok(d) => render(&RecordPageT { nav: Nav::of(&session), d }),
        Err(e) => error_page(&session, &e),
    }
}

#[derive(Template)]
#[template(path = "routes.html")]
struct Routes {
    nav: Nav,
    counters: Vec<crate::metrics::RouteCounter>,
    recent: Vec<(String, RecordPage)>,
}

pub(crate) async fn routes<S: Store>(State(admin): St<S>, Extension(session): Ses) -> Response {
    let counters = crate::metrics::route_counters(&admin.metrics_text());
    let mut names: Vec<String> = counters.iter().map(|c| c.route.clone()).collect();
    names.dedup();
    let mut recent = Vec::new();
    let now_ms = match admin.store.now().await {
        Ok(t) => idem_store::system_time_to_millis(t),
        Err(e) => return error_page(&session, &Error::Store(e)),
    };
    for name in names {
        let filter = Filter { route: Some(name.clone()), ..Filter::default() };
        match records::list(&admin.store, &admin.prefix, &filter, None, 10, now_ms).await {
            Ok(page) => recent.push((name, page)),
            Err(e) => return error_page(&session, &e),
        }
    }
    render(&Routes { nav: Nav::of(&session), counters, recent })
}

#[derive(Template)]
#[template(path = "runs.html")]
struct Runs {
    nav: Nav,
    jobs: Vec<Job>,
}

pub(crate) async fn runs<S: Store>(State(admin): St<S>, Extension(session): Ses) -> Response {
    match runs::jobs(&admin.store).await {
        Ok(jobs) => render(&Runs { nav: Nav::of(&session), jobs }),
        Err(e) => error_page(&session, &e),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct JobQuery {
    name: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    cursor: String,
}

#[derive(Template)]
#[template(path = "run_job.html")]
struct RunJob {
    nav: Nav,
    name: String,
    state: String,
    status: LedgerStatus,
    page: ItemPage,
    next_link: Option<String>,
}

pub(crate) async fn run_job<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<JobQuery>,
) -> Response {
    let loaded = async {
        let state = (!q.state.is_empty()).then(|| ItemState::parse(&q.state)).transpose()?;
        let status = runs::status(&admin.store, &q.name).await?;
        let cursor = (!q.cursor.is_empty()).then_some(q.cursor.as_str());
        let page = runs::items(&admin.store, &q.name, state, cursor, PAGE).await?;
        Ok::<_, Error>((status, page))
    };
    match loaded.await {
        Ok((status, page)) => {
            let next_link = page
                .next_cursor
                .as_deref()
                .map(|c| format!("/ui/runs/job?name={}&state={}&cursor={c}", crate::urlencode(&q.name), q.state));
            render(&RunJob { nav: Nav::of(&session), name: q.name, state: q.state, status, page, next_link })
        }
        Err(e) => error_page(&session, &e),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct ItemQuery {
    pub(crate) name: String,
    pub(crate) id: String,
}

#[derive(Template)]
#[template(path = "run_item.html")]
struct RunItem {
    nav: Nav,
    entry_json: String,
    forgettable: bool,
    d: ItemDetail,
}

pub(crate) async fn run_item<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<ItemQuery>,
) -> Response {
    match runs::item(&admin.store, &q.name, &q.id).await {
        Ok(d) => {
            let entry_json = serde_json::to_string_pretty(&d.entry).unwrap_or_default();
            let forgettable = matches!(d.state, ItemState::Failed | ItemState::Poison);
            render(&RunItem { nav: Nav::of(&session), entry_json, forgettable, d })
        }
        Err(e) => error_page(&session, &e),
    }
}

#[derive(Template)]
#[template(path = "cron.html")]
struct Cron {
    nav: Nav,
    jobs: Vec<CronJob>,
}

pub(crate) async fn cron<S: Store>(State(admin): St<S>, Extension(session): Ses) -> Response {
    let loaded = async {
        let now_ms = idem_store::system_time_to_millis(admin.store.now().await?);
        let mut jobs = Vec::new();
        for name in crate::cron::names(&admin.store).await? {
            jobs.push(crate::cron::history(&admin.store, &name, now_ms).await?);
        }
        Ok::<_, Error>(jobs)
    };
    match loaded.await {
        Ok(jobs) => render(&Cron { nav: Nav::of(&session), jobs }),
        Err(e) => error_page(&session, &e),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct CronQuery {
    name: String,
}

#[derive(Template)]
#[template(path = "cron_job.html")]
struct CronJobT {
    nav: Nav,
    j: CronJob,
}

pub(crate) async fn cron_job<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<CronQuery>,
) -> Response {
    let loaded = async {
        let now_ms = idem_store::system_time_to_millis(admin.store.now().await?);
        crate::cron::history(&admin.store, &q.name, now_ms).await
    };
    match loaded.await {
        Ok(j) => render(&CronJobT { nav: Nav::of(&session), j }),
        Err(e) => error_page(&session, &e),
    }
}
