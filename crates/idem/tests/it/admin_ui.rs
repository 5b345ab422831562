//! The operator's pages (`/ui/`) in real headless Chromium: records made by real proxy traffic, an
//! `idem run` ledger with a poison item and an `idem once` job; filters and pagination; the release and
//! forget actions change what the next retry or run does; hostile keys, item ids and command output render as
//! text; actions without the admin token, or without the page's CSRF token, are refused.
//!
//! With `IDEM_UI_SCREENSHOTS=DIR` the tests save a PNG of each page there (the guide's operations chapter
//! shows them: `docs/guide/img/`).

use std::path::PathBuf;
use std::time::Duration;

use idem_testkit::browser::{Browser, CmdError, ErrorStatus, Locator};

use crate::common::{self, Server};

const TOKEN: &str = "admin-secret-token-of-the-test";
/// An Idempotency-Key that is markup.
const HOSTILE_KEY: &str = "<script>alert(1)</script>";
/// An item id that is markup (ids have no '/' or space).
const HOSTILE_ITEM: &str = "<b>bad&x\"'";

async fn shot(browser: &Browser, name: &str) {
    if let Some(dir) = std::env::var_os("IDEM_UI_SCREENSHOTS") {
        browser.screenshot(&PathBuf::from(dir).join(format!("ui-{name}.png"))).await;
    }
}

/// The text of the first element matching `css`, once there is one. An element found on the page a click is
/// leaving goes stale when the next page replaces it (the race CI met): then it is looked up again, on the
/// new page.
async fn text_of(browser: &Browser, css: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let el = browser.client.wait().at_most(Duration::from_secs(20)).for_element(Locator::Css(css)).await.unwrap();
        match el.text().await {
            Ok(text) => return text,
            // The page changed between finding the element and reading it (a navigation still loading):
            // Chromium says stale, or that the node does not belong to the document.
            Err(CmdError::Standard(e))
                if (e.error == ErrorStatus::StaleElementReference
                    || e.message.contains("does not belong to the document"))
                    && std::time::Instant::now() < deadline => {}
            Err(e) => panic!("the text of {css}: {e}"),
        }
    }
}

async fn open(browser: &Browser, url: &str) {
    browser.client.goto(url).await.unwrap();
}

/// No element the pages render ever is a script: markup from a request shows as text.
async fn assert_no_script(browser: &Browser) {
    let scripts = browser.client.find_all(Locator::Css("script")).await.unwrap();
    assert_eq!(scripts.len(), 0, "a <script> element reached the DOM");
}

async fn sign_in(browser: &Browser, admin: &str) {
    open(browser, &format!("{admin}/ui/")).await;
    // Not signed in: sent to the sign-in page.
    let field = browser.client.wait().for_element(Locator::Id("token")).await.unwrap();
    shot(browser, "login").await;
    field.send_keys(TOKEN).await.unwrap();
    browser.client.find(Locator::Id("sign-in")).await.unwrap().click().await.unwrap();
    // The click returns before the page it posts to has loaded: until then the sign-in page's own `.who`
    // ("not signed in") is the one read.
    let since = std::time::Instant::now();
    loop {
        let who = text_of(browser, ".who").await;
        if who.starts_with("acting as admin-token:") {
            break;
        }
        assert!(since.elapsed() < Duration::from_secs(10), "{who}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn post(client: &reqwest::Client, proxy: &str, key: &str) -> u16 {
    let res = client.post(format!("{proxy}/orders")).header("idempotency-key", key).body("{}").send().await.unwrap();
    res.status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_page_filters_pages_and_release_makes_the_key_execute_again() {
    let Some(browser) = Browser::start(1280, 900).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let (upstream, counts) = common::start_upstream().await;
    let server = common::proxy(&dir, &upstream, &["--admin-token-file", token.to_str().unwrap()]);
    let client = common::client();
    assert_eq!(post(&client, &server.url, "order-1").await, 201);
    assert_eq!(post(&client, &server.url, HOSTILE_KEY).await, 201);
    for i in 0..55 {
        assert_eq!(post(&client, &server.url, &format!("bulk-{i:02}")).await, 201);
    }
    // A retry replays: one execution.
    assert_eq!(post(&client, &server.url, "order-1").await, 201);
    assert_eq!(counts.executions_of("order-1"), 1);

    sign_in(&browser, &server.admin).await;
    shot(&browser, "overview").await;
    assert_eq!(text_of(&browser, "#count-completed").await, "57");
    // Rates since the server started (the pages' first sample): 58 requests and 57 executions, shown once the
    // window is at least a second long (`rates::SHORTEST`).
    let rate = |text: String| text.trim_end_matches("/s").parse::<f64>().unwrap();
    let since = std::time::Instant::now();
    let rates = loop {
        let rates = browser.client.find_all(Locator::Css("#rates dd")).await.unwrap();
        if !rates.is_empty() {
            break rates;
        }
        assert!(since.elapsed() < Duration::from_secs(10), "no rates on the overview");
        tokio::time::sleep(Duration::from_millis(200)).await;
        open(&browser, &format!("{}/ui/", server.admin)).await;
    };
    assert_eq!(rates.len(), 3);
    assert!(rate(rates[0].text().await.unwrap()) > 0.0 && rate(rates[1].text().await.unwrap()) > 0.0);

    // Filters: a key prefix, and pagination by cursor (50 a page).
    open(&browser, &format!("{}/ui/records?prefix=bulk-", server.admin)).await;
    let rows = browser.client.find_all(Locator::Css("#records tbody tr")).await.unwrap();
    assert_eq!(rows.len(), 50);
    browser.client.find(Locator::Id("next")).await.unwrap().click().await.unwrap();
    browser.client.wait().for_element(Locator::Css("#records")).await.unwrap();
    let rows = browser.client.find_all(Locator::Css("#records tbody tr")).await.unwrap();
    assert_eq!(rows.len(), 5);
    assert_eq!(rows[4].find(Locator::Css("a.key")).await.unwrap().text().await.unwrap(), "bulk-54");
    assert!(browser.client.find_all(Locator::Id("next")).await.unwrap().is_empty());

    // The hostile key is text in the list and on its page.
    open(&browser, &format!("{}/ui/records?prefix=%3Cscript", server.admin)).await;
    assert_eq!(text_of(&browser, "#records a.key").await, HOSTILE_KEY);
    assert_no_script(&browser).await;
    shot(&browser, "records").await;
    browser.client.find(Locator::Css("#records a.key")).await.unwrap().click().await.unwrap();
    assert_eq!(text_of(&browser, "#record-key").await, HOSTILE_KEY);
    assert_no_script(&browser).await;

    // order-1: its page, its body on request, then release with confirmation.
    open(&browser, &format!("{}/ui/records?prefix=order-", server.admin)).await;
    browser.client.find(Locator::Css("#records a.key")).await.unwrap().click().await.unwrap();
    assert_eq!(text_of(&browser, "#record-state").await, "completed");
    assert_eq!(text_of(&browser, "#record-status").await, "201");
    browser.client.find(Locator::Id("show-body")).await.unwrap().click().await.unwrap();
    assert!(text_of(&browser, "#record-body").await.contains("\"order\":1"));
    shot(&browser, "record").await;
    browser.client.find(Locator::Id("release")).await.unwrap().click().await.unwrap();
    let confirm = browser.client.wait().for_element(Locator::Id("confirm")).await.unwrap();
    shot(&browser, "release-confirm").await;
    confirm.click().await.unwrap();
    assert!(text_of(&browser, "#message").await.starts_with("Released idempotency/anonymous/order-1"));
    // The released key executes again.
    assert_eq!(post(&client, &server.url, "order-1").await, 201);
    assert_eq!(counts.executions_of("order-1"), 2);

    // Redirects are looked at, not followed.
    let client = idem_client::client_builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    refusals(&server, &client).await;
}

/// A request whose upstream answered after `--upstream-timeout` has an unknown outcome (504): retries get 502
/// `outcome-unknown` and are never sent. The operator finds the record (state filter), resolves it with a note
/// that is markup, and from then on a retry gets 409 `outcome-resolved` with the note, retry hints `false`, still
/// never executed; the overview counts it; resolving it again, or a completed record, is refused (409) and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolving_an_unknown_outcome_answers_its_retries_and_never_executes_them() {
    let Some(browser) = Browser::start(1280, 900).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let (upstream, counts) = common::start_upstream().await;
    let args = ["--admin-token-file", token.to_str().unwrap(), "--upstream-timeout", "300ms"];
    let server = common::proxy(&dir, &upstream, &args);
    let client = common::client();
    let charge = |client: &reqwest::Client| {
        client.post(format!("{}/slow/1500", server.url)).header("idempotency-key", "charge-1").body("{}").send()
    };
    let first = charge(&client).await.unwrap();
    assert_eq!(first.status(), 504);
    let retry = charge(&client).await.unwrap();
    assert_eq!(retry.status(), 502);
    assert!(retry.text().await.unwrap().contains("urn:idem:problem:outcome-unknown"));
    assert_eq!(post(&client, &server.url, "order-1").await, 201);

    sign_in(&browser, &server.admin).await;
    open(&browser, &format!("{}/ui/records?state=unknown", server.admin)).await;
    let rows = browser.client.find_all(Locator::Css("#records tbody tr")).await.unwrap();
    assert_eq!(rows.len(), 1, "one unknown outcome");
    browser.client.find(Locator::Css("#records a.key")).await.unwrap().click().await.unwrap();
    assert_eq!(text_of(&browser, "#record-state").await, "unknown");
    let note = "<img src=x onerror=alert(1)> charge ch_1 exists";
    browser.client.find(Locator::Id("resolve-note")).await.unwrap().send_keys(note).await.unwrap();
    browser.client.find(Locator::Id("resolve")).await.unwrap().click().await.unwrap();
    let confirm = browser.client.wait().for_element(Locator::Id("confirm")).await.unwrap();
    shot(&browser, "resolve-confirm").await;
    confirm.click().await.unwrap();
    assert!(text_of(&browser, "#message").await.starts_with("Resolved idempotency/anonymous/charge-1"));
    open(&browser, &format!("{}/ui/record?k=idempotency%2Fanonymous%2Fcharge-1", server.admin)).await;
    assert_eq!(text_of(&browser, "#record-state").await, "resolved");
    assert!(text_of(&browser, "#record-resolved").await.ends_with(note), "the note is text");
    assert!(browser.client.find_all(Locator::Css("img")).await.unwrap().is_empty(), "no markup from the note");
    assert!(browser.client.find_all(Locator::Id("resolve")).await.unwrap().is_empty(), "resolved once");
    open(&browser, &format!("{}/ui/", server.admin)).await;
    assert_eq!(text_of(&browser, "#count-resolved").await, "1");
    assert_eq!(text_of(&browser, "#count-unknown").await, "0");

    let retry = charge(&client).await.unwrap();
    assert_eq!(retry.status(), 409);
    assert_eq!(retry.headers()["stripe-should-retry"], "false");
    let body = retry.text().await.unwrap();
    assert!(body.contains("urn:idem:problem:outcome-resolved") && body.contains("ch_1 exists"), "{body}");
    assert_eq!(counts.executions(), 2, "the first charge and order-1: no retry executed");

    // Again through the JSON endpoint: resolved already, and a completed record, are refused with 409.
    let resolve = format!("{}/v1/admin/records/resolve", server.admin);
    for key in ["idempotency/anonymous/charge-1", "idempotency/anonymous/order-1"] {
        let res = client
            .post(&resolve)
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(serde_json::json!({ "key": key, "note": "again" }).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 409, "{key}");
    }
    assert_eq!(post(&client, &server.url, "order-1").await, 201, "order-1 still replays");
    assert_eq!(counts.executions(), 2);
}

/// The webhook routes page over real deliveries signed by the `standardwebhooks` Python package: two routes,
/// `orders` (three deliveries, one sent twice, one whose id is markup, and two refused: a forged signature and
/// none) and `refunds` (one). Each route's counters are its own (executions, duplicates replayed, signature
/// refusals by reason), its recent deliveries list its keys as text, and its "All records" link filters the
/// records page to that route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routes_page_counts_each_routes_deliveries_and_filters_its_records() {
    use crate::webhooks::{SECRET, now, python_peer, signed, signed_by_python};
    let Some(python) = python_peer() else { return };
    let Some(browser) = Browser::start(1280, 900).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let mut config = String::new();
    for (name, path) in [("orders", "/orders"), ("refunds", "/status")] {
        config.push_str(&format!(
            "[[route]]\npath = {path:?}\nname = {name:?}\npreset = \"standard-webhooks\"\nsecret_file = {secret:?}\n"
        ));
    }
    let config_file = dir.path().join("idem.toml");
    std::fs::write(&config_file, config).unwrap();
    let (upstream, counts) = common::start_upstream().await;
    let server = common::proxy(
        &dir,
        &upstream,
        &["--admin-token-file", token.to_str().unwrap(), "--config", config_file.to_str().unwrap()],
    );
    let client = common::client();
    let body = r#"{"type":"invoice.paid"}"#;
    let send = |path: &'static str, headers: Vec<(String, String)>| {
        let mut request = client.post(format!("{}{path}", server.url)).header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(name, value);
        }
        request.body(body).send()
    };
    let hostile = "msg_<i>x</i>";
    for id in ["msg_1", "msg_2", hostile, "msg_1"] {
        let answer = send("/orders", signed_by_python(&python, id, now(), body)).await.unwrap();
        assert_eq!(answer.status(), 201, "{id}");
    }
    let forged = signed("whsec_c2VjcmV0LW9uZS10d28tdGhyZWU=", "msg_3", now(), body);
    assert_eq!(send("/orders", forged).await.unwrap().status(), 401);
    assert_eq!(send("/orders", Vec::new()).await.unwrap().status(), 401);
    let refund = send("/status/201", signed_by_python(&python, "msg_r1", now(), body)).await.unwrap();
    assert_eq!(refund.status(), 201);
    assert_eq!(counts.executions(), 4, "3 orders and a refund, each once");

    sign_in(&browser, &server.admin).await;
    open(&browser, &format!("{}/ui/routes", server.admin)).await;
    shot(&browser, "routes").await;
    let mut counters = std::collections::BTreeMap::new();
    for row in browser.client.find_all(Locator::Css("#routes tbody tr")).await.unwrap() {
        let cells = row.find_all(Locator::Css("td")).await.unwrap();
        let mut text = Vec::new();
        for cell in cells {
            text.push(cell.text().await.unwrap());
        }
        counters.insert((text[0].clone(), text[1].clone(), text[2].clone()), text[3].clone());
    }
    let value = |route: &str, name: &str, labels: &str| {
        counters.get(&(route.to_owned(), format!("idem_route_{name}_total"), labels.to_owned())).cloned()
    };
    assert_eq!(value("orders", "executions", "").as_deref(), Some("3"), "{counters:?}");
    assert_eq!(value("orders", "duplicates_replayed", "").as_deref(), Some("1"));
    assert_eq!(value("orders", "signature_refusals", "reason=\"mismatch\"").as_deref(), Some("1"), "{counters:?}");
    assert_eq!(value("orders", "signature_refusals", "reason=\"missing\"").as_deref(), Some("1"));
    assert_eq!(value("refunds", "executions", "").as_deref(), Some("1"));
    assert_eq!(value("refunds", "signature_refusals", "reason=\"mismatch\"").as_deref(), Some("0"));
    let keys = browser.client.find_all(Locator::Css("table.deliveries[data-route='orders'] a.key")).await.unwrap();
    let mut shown = Vec::new();
    for key in keys {
        shown.push(key.text().await.unwrap());
    }
    shown.sort();
    assert_eq!(shown, ["msg_1", "msg_2", hostile], "the key that is markup is text");
    assert!(browser.client.find_all(Locator::Css("table.deliveries i")).await.unwrap().is_empty());
    browser.client.find(Locator::Css("a.all-records[data-route='refunds']")).await.unwrap().click().await.unwrap();
    assert_eq!(text_of(&browser, "#records a.key").await, "msg_r1");
    let rows = browser.client.find_all(Locator::Css("#records tbody tr")).await.unwrap();
    assert_eq!(rows.len(), 1, "only the refunds route's records");
}

const FORM: &str = "application/x-www-form-urlencoded";

/// An `application/x-www-form-urlencoded` body.
fn form_body(pairs: &[(&str, &str)]) -> String {
    let enc = |s: &str| {
        s.bytes()
            .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
            .collect::<String>()
    };
    pairs.iter().map(|(k, v)| format!("{}={}", enc(k), enc(v))).collect::<Vec<_>>().join("&")
}

/// The CSRF token of the first form on a page.
fn csrf_of(html: &str) -> String {
    let at = html.find(r#"name="csrf" value=""#).expect("a form with a CSRF token") + r#"name="csrf" value=""#.len();
    html[at..].split('"').next().unwrap().to_owned()
}

/// Actions without the admin token, or with a session's cookie but not its CSRF token or Origin, change
/// nothing.
async fn refusals(server: &Server, client: &reqwest::Client) {
    let release = format!("{}/v1/admin/records/release", server.admin);
    let body = r#"{"key":"idempotency/anonymous/bulk-00"}"#;
    let json = |r: reqwest::RequestBuilder| r.header("content-type", "application/json").body(body);
    let res = json(client.post(&release)).send().await.unwrap();
    assert_eq!(res.status(), 401);
    let res = json(client.post(&release)).bearer_auth("wrong").send().await.unwrap();
    assert_eq!(res.status(), 401);
    // A form post with the signed-in cookie of another page load but a forged CSRF token.
    let login = client.get(format!("{}/ui/login", server.admin)).send().await.unwrap();
    let cookie = login.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    let res = client
        .post(format!("{}/ui/record/release", server.admin))
        .header("cookie", &cookie)
        .header("origin", &server.admin)
        .header("content-type", FORM)
        .body(form_body(&[("k", "idempotency/anonymous/bulk-00"), ("csrf", "forged")]))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 303, "a session that has not signed in is sent to sign in");
    // Signed in (as a browser would: the sign-in form with its CSRF token), then a forged CSRF token, and the
    // right one from another origin.
    let page = client.get(format!("{}/ui/login", server.admin)).header("cookie", &cookie).send().await.unwrap();
    let csrf = csrf_of(&page.text().await.unwrap());
    let signed = client
        .post(format!("{}/ui/login", server.admin))
        .header("cookie", &cookie)
        .header("origin", &server.admin)
        .header("content-type", FORM)
        .body(form_body(&[("token", TOKEN), ("csrf", &csrf)]))
        .send()
        .await
        .unwrap();
    assert_eq!(signed.status(), 303);
    let admin_cookie = signed.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    let page = client.get(format!("{}/ui/", server.admin)).header("cookie", &admin_cookie).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let form = |csrf: &str, origin: &str| {
        client
            .post(format!("{}/ui/record/release", server.admin))
            .header("cookie", &admin_cookie)
            .header("origin", origin)
            .header("content-type", FORM)
            .body(form_body(&[("k", "idempotency/anonymous/bulk-00"), ("csrf", csrf)]))
    };
    let confirm = client
        .get(format!("{}/ui/record/release?k=idempotency%2Fanonymous%2Fbulk-00", server.admin))
        .header("cookie", &admin_cookie)
        .send()
        .await
        .unwrap();
    let csrf = csrf_of(&confirm.text().await.unwrap());
    assert_eq!(form("forged", &server.admin).send().await.unwrap().status(), 403);
    assert_eq!(form(&csrf, "http://evil.example").send().await.unwrap().status(), 403);
    let page = client.get(format!("{}/v1/admin/record?k=idempotency/anonymous/bulk-00", server.admin));
    assert_eq!(page.bearer_auth(TOKEN).send().await.unwrap().status(), 200, "the record is still there");
    // The token itself works.
    let res = json(client.post(&release)).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(res.status(), 204);
}

/// `idem run` with a poison item whose id is markup, and `idem once` whose output is markup, in `dir`'s
/// ledger: (exit status, standard error) of the run.
fn run_job(dir: &std::path::Path) -> (i32, String) {
    let store = format!("sqlite:{}", dir.join("ledger.db").display());
    let script = r#"echo "$1" >> log; case "$1" in "<b>"*) [ -e fixed ] || { echo "<script>alert(1)</script> boom" >&2; exit 2; };; esac"#;
    let out = std::process::Command::new(common::BIN)
        .args(["run", "--name", "import", "--store", &store, "--items", "items.jsonl", "--id-field", "id"])
        .args(["--on-poison", "skip", "--quiet", "--", "sh", "-c", script, "_", "{id}"])
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn runs_of(dir: &std::path::Path, id: &str) -> usize {
    std::fs::read_to_string(dir.join("log")).unwrap_or_default().lines().filter(|l| *l == id).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_and_cron_pages_show_the_ledgers_and_forget_makes_a_poison_item_run_again() {
    let Some(browser) = Browser::start(1280, 900).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let items = format!("{{\"id\":\"good-1\"}}\n{}\n", serde_json::json!({ "id": HOSTILE_ITEM }));
    std::fs::write(dir.path().join("items.jsonl"), items).unwrap();
    let (code, err) = run_job(dir.path());
    assert_eq!(code, 3, "{err}");
    assert_eq!(runs_of(dir.path(), HOSTILE_ITEM), 2, "poison after the same error twice");
    let store = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let (code, _, err) = common::idem(
        &["once", "--name", "nightly", "--store", &store, "--every", "1h", "--", "sh", "-c", "echo '<i>out</i>'"],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let token = dir.path().join("admin-token");
    std::fs::write(&token, TOKEN).unwrap();
    let server = Server::start(&["--store", &store, "--admin-token-file", token.to_str().unwrap()], &[]);

    sign_in(&browser, &server.url).await;
    open(&browser, &format!("{}/ui/runs", server.url)).await;
    shot(&browser, "runs").await;
    browser.client.find(Locator::LinkText("import")).await.unwrap().click().await.unwrap();
    assert_eq!(text_of(&browser, "#count-poison").await, "1");
    assert_eq!(text_of(&browser, "#count-done").await, "1");
    assert_no_script(&browser).await;
    shot(&browser, "run-job").await;
    browser.client.find(Locator::LinkText(HOSTILE_ITEM)).await.unwrap().click().await.unwrap();
    assert_eq!(text_of(&browser, "#item-id").await, HOSTILE_ITEM);
    assert_eq!(text_of(&browser, "#item-state").await, "poison");
    assert!(text_of(&browser, "#item-entry").await.contains("<script>alert(1)</script> boom"));
    assert_no_script(&browser).await;
    shot(&browser, "run-item").await;
    browser.client.find(Locator::Id("forget")).await.unwrap().click().await.unwrap();
    browser.client.wait().for_element(Locator::Id("confirm")).await.unwrap().click().await.unwrap();
    assert!(text_of(&browser, "#message").await.starts_with("Forgot item"));

    open(&browser, &format!("{}/ui/cron", server.url)).await;
    let bars = browser.client.find_all(Locator::Css("svg.timeline rect.done")).await.unwrap();
    assert_eq!(bars.len(), 1);
    shot(&browser, "cron").await;
    browser.client.find(Locator::LinkText("nightly")).await.unwrap().click().await.unwrap();
    assert_eq!(text_of(&browser, "#slots pre.output").await, "<i>out</i>");
    assert_no_script(&browser).await;
    shot(&browser, "cron-job").await;
    drop(server);

    // The forgotten item runs again (the cause fixed): once more, and done.
    std::fs::write(dir.path().join("fixed"), "").unwrap();
    let (code, err) = run_job(dir.path());
    assert_eq!(code, 0, "{err}");
    assert_eq!(runs_of(dir.path(), HOSTILE_ITEM), 3);
    assert_eq!(runs_of(dir.path(), "good-1"), 1, "the done item did not run again");
}

/// `idem once NAME --every 1s` in `dir`'s store: (exit status, standard error).
fn once_job(dir: &std::path::Path) -> (i32, String) {
    let store = format!("sqlite:{}", dir.join("ledger.db").display());
    let script = format!("echo ran >> '{}'", dir.join("log").display());
    let (code, _, err) = common::idem(
        &["once", "--name", "minutely", "--store", &store, "--every", "1s", "--", "sh", "-c", &script],
        &[],
    );
    (code, err)
}

/// The slot an invocation's message names (`idem once: NAME SLOT: …`).
fn slot_of(err: &str) -> String {
    err.split_whitespace().nth(3).unwrap_or_default().trim_end_matches(':').to_owned()
}

/// Invokes the job until an invocation is in a slot after `last`'s; that invocation's message first, then
/// the messages of those before it (still in `last`'s slot), which ran the triggered runs when they came
/// first.
fn once_in_a_new_slot(dir: &std::path::Path, last: &str) -> String {
    let mut earlier = String::new();
    loop {
        let (code, err) = once_job(dir);
        assert_eq!(code, 0, "{err}");
        if slot_of(&err) > slot_of(last) {
            return format!("{err}{earlier}");
        }
        earlier.push_str(&err);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The admin listener on `dir`'s SQLite store, signed in. `idem serve` holds a SQLite file while it runs, so
/// the invocations below run between two servers (a PostgreSQL or Redis store is shared while both run).
async fn serve_signed_in(browser: &Browser, dir: &std::path::Path) -> Server {
    let store = format!("sqlite:{}", dir.join("ledger.db").display());
    let token = dir.join("admin-token");
    std::fs::write(&token, TOKEN).unwrap();
    let server = Server::start(&["--store", &store, "--admin-token-file", token.to_str().unwrap()], &[]);
    sign_in(browser, &server.url).await;
    server
}

/// Clicks the element `id`, then the confirmation page's button; the message page's text.
async fn act(browser: &Browser, id: &str) -> String {
    browser.client.find(Locator::Id(id)).await.unwrap().click().await.unwrap();
    browser.client.wait().for_element(Locator::Id("confirm")).await.unwrap().click().await.unwrap();
    text_of(browser, "#message").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_actions_pause_trigger_and_resume_change_what_the_next_invocation_does() {
    let Some(browser) = Browser::start(1280, 900).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let runs = || std::fs::read_to_string(dir.path().join("log")).unwrap_or_default().lines().count();
    let (code, first) = once_job(dir.path());
    assert_eq!((code, runs()), (0, 1), "{first}");

    let server = serve_signed_in(&browser, dir.path()).await;
    // Without the token the JSON action is refused.
    let client = common::client();
    let trigger = format!("{}/v1/admin/cron/trigger", server.url);
    let body = serde_json::json!({ "name": "minutely", "id": "api-1" }).to_string();
    let res = client.post(&trigger).header("content-type", "application/json").body(body.clone()).send().await.unwrap();
    assert_eq!(res.status(), 401);
    open(&browser, &format!("{}/ui/cron/job?name=minutely", server.url)).await;
    browser.client.find(Locator::Id("pause-until")).await.unwrap().send_keys("1h").await.unwrap();
    browser.client.find(Locator::Id("pause-note")).await.unwrap().send_keys("<b>disk</b> full").await.unwrap();
    let said = act(&browser, "pause").await;
    assert!(said.starts_with("Job minutely paused by admin-token:") && said.contains("(<b>disk</b> full)"), "{said}");
    open(&browser, &format!("{}/ui/cron/job?name=minutely", server.url)).await;
    assert!(text_of(&browser, "#pause-state").await.contains("<b>disk</b> full"), "the note renders as text");
    assert_no_script(&browser).await;
    shot(&browser, "cron-job-paused").await;
    drop(server);
    let paused = once_in_a_new_slot(dir.path(), &first);
    assert!(paused.contains("the job is paused by admin-token:"), "{paused}");
    assert_eq!(runs(), 1, "nothing ran while paused");

    // Run now, from the page and from the JSON endpoint (the same id twice: one request): the next invocation
    // runs both once, paused or not.
    let server = serve_signed_in(&browser, dir.path()).await;
    open(&browser, &format!("{}/ui/cron/job?name=minutely", server.url)).await;
    assert!(act(&browser, "trigger").await.starts_with("Requested a run of minutely"));
    let trigger = format!("{}/v1/admin/cron/trigger", server.url);
    for new in [true, false] {
        let res = client
            .post(&trigger)
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let t: serde_json::Value = res.json().await.unwrap();
        assert_eq!(t["new"], new, "{t}");
    }
    drop(server);
    let triggered = once_in_a_new_slot(dir.path(), &paused);
    assert_eq!(triggered.matches(" trigger ").count(), 2, "the page's trigger and api-1: {triggered}");
    assert_eq!(runs(), 3, "two triggered runs, nothing else, while paused");

    let server = serve_signed_in(&browser, dir.path()).await;
    open(&browser, &format!("{}/ui/cron/job?name=minutely", server.url)).await;
    assert!(act(&browser, "resume").await.contains("resumed"));
    drop(server);
    let resumed = once_in_a_new_slot(dir.path(), &triggered);
    let newest = resumed.lines().next().unwrap_or_default();
    assert!(!newest.contains("paused"), "{resumed}");
    // The slot after the resume ran, and the one recorded paused before it too when an invocation came in its
    // time after the resume.
    let extra = usize::from(resumed.lines().skip(1).any(|l| l.contains(": done (attempt")));
    assert_eq!(runs(), 4 + extra, "{resumed}");
}
