//! The pages under `/ui/`: rendered on the server with askama (every value HTML-escaped by the templates),
//! one stylesheet of our own, no script. [`crate::router`] mounts them.

mod actions;
mod cron_actions;
mod pages;

pub(crate) use pages::RecordQuery;

use std::sync::Arc;

use askama::Template;
use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::get;
use http::{StatusCode, header};
use idem_store::Store;

use crate::guard::Who;
use crate::{Admin, Error};

/// The session of a request under `/ui/`: its id (what its CSRF token is bound to) and who it acts as.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub(crate) id: String,
    pub(crate) who: Who,
}

/// What the layout shows on every page.
pub(crate) struct Nav {
    pub(crate) who: String,
}

impl Nav {
    fn of(session: &Session) -> Self {
        let who = match &session.who {
            Who::Admin(actor) => format!("acting as {actor}"),
            Who::Reader => "read-only: start idem serve with --admin-token-file to act".to_owned(),
            Who::Nobody => "not signed in".to_owned(),
        };
        Self { who }
    }
}

#[derive(Template)]
#[template(path = "message.html")]
struct Message<'a> {
    nav: Nav,
    heading: &'a str,
    class: &'a str,
    text: &'a str,
    back: Option<&'a str>,
}

/// A page with one message, answered with `status`.
pub(crate) fn message(
    session: &Session,
    status: StatusCode,
    heading: &str,
    text: &str,
    back: Option<&str>,
) -> Response {
    let class = if status.is_success() { "ok" } else { "error" };
    let page = Message { nav: Nav::of(session), heading, class, text, back };
    (status, render(&page)).into_response()
}

/// An error as a page.
pub(crate) fn error_page(session: &Session, e: &Error) -> Response {
    message(session, e.status(), "Could not do that", &e.to_string(), None)
}

/// Renders a template; a template that fails to render (it cannot, short of a bug) is a 500.
pub(crate) fn render(t: &impl Template) -> Response {
    match t.render() {
        Ok(html) => Html(html).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "admin page failed to render");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

/// A time in milliseconds since the Unix epoch, as RFC 3339 (seconds).
pub(crate) fn when(ms: &u64) -> String {
    humantime::format_rfc3339_seconds(idem_store::millis_to_system_time(*ms)).to_string()
}

/// An item state's name.
pub(crate) fn item_state(s: &crate::runs::ItemState) -> &'static str {
    use crate::runs::ItemState;
    match s {
        ItemState::Done => "done",
        ItemState::Running => "running",
        ItemState::Interrupted => "interrupted",
        ItemState::Failed => "failed",
        ItemState::Poison => "poison",
    }
}

/// A job's timeline of slots as inline SVG (its own template, so every title is escaped).
#[derive(Template)]
#[template(path = "timeline.html")]
pub(crate) struct Timeline {
    bars: Vec<crate::cron::Bar>,
    width: usize,
    name: String,
}

impl Timeline {
    pub(crate) fn new(job: &crate::cron::CronJob) -> Self {
        let bars = crate::cron::timeline(&job.history);
        let width = (bars.len() * crate::cron::BAR_STEP).max(crate::cron::BAR_STEP);
        Self { bars, width, name: job.history.name.clone() }
    }
}

/// The stylesheet: the pages' one asset, served from this listener (no CDN: air-gapped sites work).
const STYLE: &str = include_str!("../../static/style.css");

pub(crate) fn routes<S: Store>(admin: Arc<Admin<S>>) -> Router {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(pages::overview::<S>))
        .route("/ui/records", get(pages::records::<S>))
        .route("/ui/record", get(pages::record::<S>))
        .route("/ui/routes", get(pages::routes::<S>))
        .route("/ui/runs", get(pages::runs::<S>))
        .route("/ui/runs/job", get(pages::run_job::<S>))
        .route("/ui/runs/item", get(pages::run_item::<S>))
        .route("/ui/cron", get(pages::cron::<S>))
        .route("/ui/cron/job", get(pages::cron_job::<S>))
        .route("/ui/login", get(actions::login_page::<S>).post(actions::login::<S>))
        .route("/ui/logout", axum::routing::post(actions::logout::<S>))
        .route("/ui/record/release", get(actions::confirm_release::<S>).post(actions::release::<S>))
        .route("/ui/record/resolve", get(actions::confirm_resolve::<S>).post(actions::resolve::<S>))
        .route("/ui/runs/forget", get(actions::confirm_forget::<S>).post(actions::forget::<S>))
        .route("/ui/cron/pause", get(cron_actions::confirm_pause::<S>).post(cron_actions::pause::<S>))
        .route("/ui/cron/resume", get(cron_actions::confirm_resume::<S>).post(cron_actions::resume::<S>))
        .route("/ui/cron/trigger", get(cron_actions::confirm_trigger::<S>).post(cron_actions::trigger::<S>))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&admin), session::<S>))
        .route("/ui/static/style.css", get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE) }))
        .with_state(admin)
}

/// Gives every request a session (minting one, with its cookie, when it has none) and sends a request that
/// must sign in first to the sign-in page.
async fn session<S: Store>(State(admin): State<Arc<Admin<S>>>, mut req: Request, next: Next) -> Response {
    let found = admin.guard.session(req.headers());
    let (minted, id) = match &found {
        Some((id, _)) => (None, id.clone()),
        None => {
            let (id, cookie) = admin.guard.session_cookie("-");
            (Some(cookie), id)
        }
    };
    let who = admin.guard.who(found.as_ref());
    let signing_in = req.uri().path() == "/ui/login";
    let mut res = if who == Who::Nobody && !signing_in {
        Redirect::to("/ui/login").into_response()
    } else {
        req.extensions_mut().insert(Session { id, who });
        next.run(req).await
    };
    if let Some(cookie) = minted {
        res.headers_mut().append(header::SET_COOKIE, cookie);
    }
    res
}
