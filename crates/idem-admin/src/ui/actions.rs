//! Sign-in and the actions: each a GET that shows what will happen (the confirmation) and a POST that does
//! it, refused without an actor, a CSRF token of this session, or an `Origin` of this listener.

use std::sync::Arc;

use askama::Template;
use axum::Extension;
use axum::extract::{Form, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use http::{HeaderMap, StatusCode, header};
use idem_store::Store;
use serde::Deserialize;

use super::pages::ItemQuery;
use super::{Nav, Session, error_page, message, render};
use crate::guard::{self, Who};
use crate::{Admin, records, runs};

type St<S> = State<Arc<Admin<S>>>;
type Ses = Extension<Session>;

#[derive(Template)]
#[template(path = "login.html")]
struct Login {
    nav: Nav,
    csrf: String,
    failed: bool,
}

pub(crate) async fn login_page<S: Store>(State(admin): St<S>, Extension(session): Ses) -> Response {
    if !admin.guard.has_token() {
        return message(&session, StatusCode::NOT_FOUND, "Sign in", "This listener has no admin token.", Some("/ui/"));
    }
    render(&Login { nav: Nav::of(&session), csrf: admin.guard.csrf(&session.id), failed: false })
}

#[derive(Deserialize)]
pub(crate) struct LoginForm {
    csrf: String,
    token: String,
}

pub(crate) async fn login<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    if !guard::same_origin(&headers) || !admin.guard.check_csrf(&session.id, &form.csrf) {
        return refused(&session, "the form did not come from this page (CSRF token or Origin wrong)");
    }
    match admin.guard.check_token(&form.token) {
        Some(actor) => {
            tracing::info!(actor, "admin: signed in");
            let (_, cookie) = admin.guard.session_cookie(&actor);
            let mut res = Redirect::to("/ui/").into_response();
            res.headers_mut().append(header::SET_COOKIE, cookie);
            res
        }
        None => {
            tracing::warn!("admin: sign-in with a wrong token");
            let page = Login { nav: Nav::of(&session), csrf: admin.guard.csrf(&session.id), failed: true };
            (StatusCode::UNAUTHORIZED, render(&page)).into_response()
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct CsrfOnly {
    csrf: String,
}

pub(crate) async fn logout<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<CsrfOnly>,
) -> Response {
    if !guard::same_origin(&headers) || !admin.guard.check_csrf(&session.id, &form.csrf) {
        return refused(&session, "the form did not come from this page (CSRF token or Origin wrong)");
    }
    let (_, cookie) = admin.guard.session_cookie("-");
    let mut res = Redirect::to("/ui/").into_response();
    res.headers_mut().append(header::SET_COOKIE, cookie);
    res
}

pub(super) fn refused(session: &Session, why: &str) -> Response {
    tracing::warn!(why, "admin: action refused");
    message(session, StatusCode::FORBIDDEN, "Refused", why, Some("/ui/"))
}

/// The actor of a POST, after its checks; the refusal page otherwise.
pub(super) fn authorize<S: Store>(
    admin: &Admin<S>,
    session: &Session,
    headers: &HeaderMap,
    csrf: &str,
) -> Result<String, Box<Response>> {
    let Who::Admin(actor) = &session.who else {
        return Err(Box::new(refused(
            session,
            "actions need the admin token (--admin-token-file) or a client certificate (--tls-client-ca)",
        )));
    };
    if !guard::same_origin(headers) {
        return Err(Box::new(refused(session, "the request's Origin is not this listener")));
    }
    if !admin.guard.check_csrf(&session.id, csrf) {
        return Err(Box::new(refused(session, "the form's CSRF token is not this session's: reload the page")));
    }
    Ok(actor.clone())
}

/// A confirmation page: what will happen, the facts, and the form that does it (its fields hidden).
#[derive(Template)]
#[template(path = "confirm.html")]
pub(super) struct Confirm<'a> {
    pub(super) nav: Nav,
    pub(super) heading: &'a str,
    pub(super) warning: &'a str,
    pub(super) facts: Vec<(&'a str, String)>,
    pub(super) action: &'a str,
    pub(super) fields: Vec<(&'a str, String)>,
    pub(super) button: &'a str,
    pub(super) cancel: String,
    pub(super) csrf: String,
}

#[derive(Deserialize)]
pub(crate) struct ReleaseQuery {
    k: String,
    #[serde(default)]
    g: Option<u64>,
}

pub(crate) async fn confirm_release<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<ReleaseQuery>,
) -> Response {
    let d = match records::detail(&admin.store, &admin.prefix, &q.k, false).await {
        Ok(d) => d,
        Err(e) => return error_page(&session, &e),
    };
    let generation = q.g.unwrap_or(d.generation);
    render(&Confirm {
        nav: Nav::of(&session),
        heading: "Release this record?",
        warning: "The record is deleted: the next request with this key executes again. If the first request \
                  took effect, it takes effect twice.",
        facts: vec![
            ("Key", d.at.key.clone()),
            ("Scope", d.at.scope.clone()),
            ("State", d.state.as_str().to_owned()),
            ("Generation", generation.to_string()),
        ],
        action: "/ui/record/release",
        fields: vec![("k", d.at.store_key.clone()), ("g", generation.to_string())],
        button: "Release",
        cancel: format!("/ui/record?k={}", crate::urlencode(&d.at.store_key)),
        csrf: admin.guard.csrf(&session.id),
    })
}

#[derive(Deserialize)]
pub(crate) struct ReleaseForm {
    csrf: String,
    k: String,
    #[serde(default)]
    g: Option<u64>,
}

pub(crate) async fn release<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<ReleaseForm>,
) -> Response {
    let actor = match authorize(&admin, &session, &headers, &form.csrf) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    match records::release(&admin.store, &admin.prefix, &form.k, form.g, &actor).await {
        Ok(()) => message(
            &session,
            StatusCode::OK,
            "Released",
            &format!("Released {}: the next request with this key executes again.", form.k),
            Some("/ui/records"),
        ),
        Err(e) => error_page(&session, &e),
    }
}

#[derive(Deserialize)]
pub(crate) struct ResolveForm {
    #[serde(default)]
    csrf: String,
    k: String,
    #[serde(default)]
    g: Option<u64>,
    #[serde(default)]
    note: String,
}

pub(crate) async fn confirm_resolve<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<ResolveForm>,
) -> Response {
    let d = match records::detail(&admin.store, &admin.prefix, &q.k, false).await {
        Ok(d) => d,
        Err(e) => return error_page(&session, &e),
    };
    let generation = q.g.unwrap_or(d.generation);
    render(&Confirm {
        nav: Nav::of(&session),
        heading: "Resolve this unknown outcome?",
        warning: "Say this only once you found that the request took effect (in the upstream's own records): every \
                  retry with this key is then answered 409 outcome-resolved with your note and never executed. If \
                  it did not take effect, release the record instead.",
        facts: vec![
            ("Key", d.at.key.clone()),
            ("Scope", d.at.scope.clone()),
            ("State", d.state.as_str().to_owned()),
            ("Why unknown", d.reason.clone().unwrap_or_default()),
            ("Generation", generation.to_string()),
            ("Note", q.note.clone()),
        ],
        action: "/ui/record/resolve",
        fields: vec![("k", d.at.store_key.clone()), ("g", generation.to_string()), ("note", q.note.clone())],
        button: "Resolve: it took effect",
        cancel: format!("/ui/record?k={}", crate::urlencode(&d.at.store_key)),
        csrf: admin.guard.csrf(&session.id),
    })
}

pub(crate) async fn resolve<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<ResolveForm>,
) -> Response {
    let actor = match authorize(&admin, &session, &headers, &form.csrf) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    match records::resolve(&admin.store, &admin.prefix, &form.k, form.g, &form.note, &actor).await {
        Ok(()) => message(
            &session,
            StatusCode::OK,
            "Resolved",
            &format!("Resolved {}: a retry with this key is told it took effect, and never executes.", form.k),
            Some(&format!("/ui/record?k={}", crate::urlencode(&form.k))),
        ),
        Err(e) => error_page(&session, &e),
    }
}

pub(crate) async fn confirm_forget<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<ItemQuery>,
) -> Response {
    let d = match runs::item(&admin.store, &q.name, &q.id).await {
        Ok(d) => d,
        Err(e) => return error_page(&session, &e),
    };
    render(&Confirm {
        nav: Nav::of(&session),
        heading: "Forget this item?",
        warning: "Its ledger entry is deleted: the next run of the job claims and runs it as new.",
        facts: vec![
            ("Job", d.job.clone()),
            ("Item", d.id.clone()),
            ("State", super::item_state(&d.state).to_owned()),
            ("Last error", d.entry.last_error().unwrap_or("").to_owned()),
        ],
        action: "/ui/runs/forget",
        fields: vec![("name", d.job.clone()), ("id", d.id.clone())],
        button: "Forget",
        cancel: format!("/ui/runs/item?name={}&id={}", crate::urlencode(&d.job), crate::urlencode(&d.id)),
        csrf: admin.guard.csrf(&session.id),
    })
}

#[derive(Deserialize)]
pub(crate) struct ForgetForm {
    csrf: String,
    name: String,
    id: String,
}

pub(crate) async fn forget<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<ForgetForm>,
) -> Response {
    let actor = match authorize(&admin, &session, &headers, &form.csrf) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    match runs::forget(&admin.store, &form.name, &form.id, &actor).await {
        Ok(()) => message(
            &session,
            StatusCode::OK,
            "Forgotten",
            &format!("Forgot item {} of {}: the next run retries it.", form.id, form.name),
            Some("/ui/runs"),
        ),
        Err(e) => error_page(&session, &e),
    }
}
