//! The cron jobs' actions on their page: pause, resume, trigger. Each a GET that shows what will happen and
//! a POST that does it, under the same checks as the other actions ([`super::actions::authorize`]).

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Form, Query, State};
use axum::response::Response;
use http::{HeaderMap, StatusCode};
use idem_store::Store;
use serde::Deserialize;

use super::actions::{Confirm, authorize};
use super::{Nav, Session, error_page, message, render};
use crate::Admin;

type St<S> = State<Arc<Admin<S>>>;
type Ses = Extension<Session>;

/// A cron action's query and form: the job, and for a pause its end and note, for a trigger its id.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct CronForm {
    #[serde(default)]
    csrf: String,
    name: String,
    #[serde(default)]
    until: String,
    #[serde(default)]
    note: String,
    #[serde(default)]
    id: String,
}

fn job_page(name: &str) -> String {
    format!("/ui/cron/job?name={}", crate::urlencode(name))
}

/// The confirmation page of a cron action on job `name`: what it does, its facts, its form's fields.
fn confirm<S: Store>(admin: &Admin<S>, session: &Session, name: &str, what: What<'_>) -> Response {
    render(&Confirm {
        nav: Nav::of(session),
        heading: what.heading,
        warning: what.warning,
        facts: what.facts,
        action: what.action,
        fields: what.fields,
        button: what.button,
        cancel: job_page(name),
        csrf: admin.guard.csrf(&session.id),
    })
}

/// What a confirmation page says and sends.
struct What<'a> {
    heading: &'a str,
    warning: &'a str,
    facts: Vec<(&'a str, String)>,
    action: &'a str,
    fields: Vec<(&'a str, String)>,
    button: &'a str,
}

/// The page after a cron action on job `name`: its message, or the error.
fn done(session: &Session, heading: &str, name: &str, result: Result<String, crate::Error>) -> Response {
    match result {
        Ok(text) => message(session, StatusCode::OK, heading, &text, Some(&job_page(name))),
        Err(e) => error_page(session, &e),
    }
}

pub(crate) async fn confirm_pause<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<CronForm>,
) -> Response {
    let until = if q.until.trim().is_empty() { "until resumed".to_owned() } else { q.until.clone() };
    let what = What {
        heading: "Pause this cron job?",
        warning: "Every invocation from now on records its slot paused and runs nothing, on every machine; a slot \
                  already running goes on.",
        facts: vec![("Job", q.name.clone()), ("Until", until), ("Note", q.note.clone())],
        action: "/ui/cron/pause",
        fields: vec![("name", q.name.clone()), ("until", q.until.clone()), ("note", q.note.clone())],
        button: "Pause",
    };
    confirm(&admin, &session, &q.name, what)
}

pub(crate) async fn pause<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<CronForm>,
) -> Response {
    let actor = match authorize(&admin, &session, &headers, &form.csrf) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    let paused = crate::cron::pause(&admin.store, &form.name, Some(&form.until), Some(&form.note), &actor).await;
    done(&session, "Paused", &form.name, paused.map(|view| format!("Job {} {}.", form.name, view.describe())))
}

pub(crate) async fn confirm_resume<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<CronForm>,
) -> Response {
    let what = What {
        heading: "Resume this cron job?",
        warning: "Its pause ends now: its next invocation, on any machine, runs its slot.",
        facts: vec![("Job", q.name.clone())],
        action: "/ui/cron/resume",
        fields: vec![("name", q.name.clone())],
        button: "Resume",
    };
    confirm(&admin, &session, &q.name, what)
}

pub(crate) async fn resume<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<CronForm>,
) -> Response {
    let actor = match authorize(&admin, &session, &headers, &form.csrf) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    let resumed = crate::cron::resume(&admin.store, &form.name, &actor).await.map(|resumed| {
        if resumed {
            format!("Job {} resumed: its next invocation runs its slot.", form.name)
        } else {
            format!("Job {} was not paused: nothing to resume.", form.name)
        }
    });
    done(&session, "Resumed", &form.name, resumed)
}

pub(crate) async fn confirm_trigger<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    Query(q): Query<CronForm>,
) -> Response {
    // The id is made here, with the form: the same form sent twice (a double click, a retried POST) is one run.
    let id = format!("ui-{:016x}", rand::random::<u64>());
    let what = What {
        heading: "Run this cron job now?",
        warning: "Its next invocation, on any machine, runs it once outside its schedule, after its own slot, \
                  paused or not.",
        facts: vec![("Job", q.name.clone()), ("Trigger id", id.clone())],
        action: "/ui/cron/trigger",
        fields: vec![("name", q.name.clone()), ("id", id)],
        button: "Trigger",
    };
    confirm(&admin, &session, &q.name, what)
}

pub(crate) async fn trigger<S: Store>(
    State(admin): St<S>,
    Extension(session): Ses,
    headers: HeaderMap,
    Form(form): Form<CronForm>,
) -> Response {
    let actor = match authorize(&admin, &session, &headers, &form.csrf) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    let triggered = crate::cron::trigger(&admin.store, &form.name, Some(&form.id), &actor).await.map(|t| {
        if t.new {
            format!("Requested a run of {} (trigger {}): its next invocation runs it once.", form.name, t.id)
        } else {
            format!("Trigger {} of {} was requested already (now {}): nothing more.", t.id, form.name, t.state)
        }
    });
    done(&session, "Triggered", &form.name, triggered)
}
