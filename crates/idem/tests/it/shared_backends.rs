//! Several `idem serve` processes sharing one PostgreSQL or Redis state: the 64-client contention example
//! split across two servers must end with exactly 6,400 items. Skips with a printed reason when
//! `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_REDIS_URL` are unset.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use crate::common;

#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/contention.rs"]
mod contention;

use crate::common::Server;

/// Two proxies on one shared store: 100 concurrent identical requests spread over both execute once, and
/// both replay the stored answer.
async fn idempotency_across_two_proxies(url: &str) {
    let ns = format!("idem_test_{:012x}", rand::random::<u64>() >> 16);
    let (up, counts) = common::start_upstream().await;
    let args = ["--store", url, "--namespace", &ns, "--upstream", &up, "--admin-listen", "127.0.0.1:0"];
    let a = Server::start(&args, &[]);
    let b = Server::start(&args, &[]);
    let mut tasks = Vec::new();
    for i in 0..100 {
        let target = if i % 2 == 0 { a.url.clone() } else { b.url.clone() };
        tasks.push(tokio::spawn(async move {
            let resp = common::client()
                .post(format!("{target}/slow/300"))
                .header("idempotency-key", "shared")
                .body("{}")
                .send()
                .await
                .unwrap();
            resp.status().as_u16()
        }));
    }
    for task in tasks {
        let status = task.await.unwrap();
        assert!(status == 201 || status == 409, "unexpected {status}");
    }
    assert_eq!(counts.executions(), 1, "two proxies on {url} executed one key twice");
    for server in [&a, &b] {
        let replay = common::client()
            .post(format!("{}/slow/300", server.url))
            .header("idempotency-key", "shared")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(replay.status(), 201);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
    }
    assert_eq!(counts.executions(), 1);
    cleanup(url, &ns).await;
}

async fn contention_across_two_servers(url: &str) {
    // A namespace of our own, so parallel tests never see each other's keys; removed by the caller.
    let ns = format!("idem_test_{:012x}", rand::random::<u64>() >> 16);
    let a = Server::start(&["--store", url, "--namespace", &ns], &[]);
    let b = Server::start(&["--store", url, "--namespace", &ns], &[]);
    let args = contention::Args { urls: vec![a.url.clone(), b.url.clone()], clients: 64, items: 100 };
    let (present, retries, secs) = contention::run(&args, true).await;
    eprintln!("{url}: 64 clients over 2 servers: {present} of 6400 items, {retries} retries after 412, {secs:.1} s");
    assert_eq!(present, 6400, "lost updates across two servers sharing {url}");
    cleanup(url, &ns).await;
}

pub(crate) async fn cleanup(url: &str, ns: &str) {
    if url.starts_with("postgres") {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        client.batch_execute(&format!("DROP SCHEMA IF EXISTS {ns} CASCADE")).await.unwrap();
    } else {
        let mut conn = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{ns}:*")).query_async(&mut conn).await.unwrap();
        for chunk in keys.chunks(500) {
            let _: () = redis::cmd("DEL").arg(chunk).query_async(&mut conn).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_servers_on_one_postgres_lose_nothing() {
    let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
        assert!(
            std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
            "IDEM_TEST_POSTGRES_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
        );
        eprintln!("skipped: IDEM_TEST_POSTGRES_URL is unset");
        return;
    };
    contention_across_two_servers(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_servers_on_one_redis_lose_nothing() {
    let Ok(url) = std::env::var("IDEM_TEST_REDIS_URL") else {
        assert!(
            std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
            "IDEM_TEST_REDIS_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
        );
        eprintln!("skipped: IDEM_TEST_REDIS_URL is unset");
        return;
    };
    contention_across_two_servers(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_proxies_on_one_postgres_execute_a_key_once() {
    let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
        assert!(std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(), "IDEM_TEST_POSTGRES_URL is unset");
        eprintln!("skipped: IDEM_TEST_POSTGRES_URL is unset");
        return;
    };
    idempotency_across_two_proxies(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_proxies_on_one_redis_execute_a_key_once() {
    let Ok(url) = std::env::var("IDEM_TEST_REDIS_URL") else {
        assert!(std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(), "IDEM_TEST_REDIS_URL is unset");
        eprintln!("skipped: IDEM_TEST_REDIS_URL is unset");
        return;
    };
    idempotency_across_two_proxies(&url).await;
}

/// A server started on a PostgreSQL schema that is there already (every start but the first) logs no
/// "already exists, skipping" notices of its `CREATE … IF NOT EXISTS`: they were logged at INFO on every start.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_on_postgres_logs_no_already_exists_notices() {
    let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
        assert!(std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(), "IDEM_TEST_POSTGRES_URL is unset");
        eprintln!("skipped: IDEM_TEST_POSTGRES_URL is unset");
        return;
    };
    let ns = format!("idem_test_{:012x}", rand::random::<u64>() >> 16);
    for start in ["first", "second"] {
        let server = Server::start(&["--store", &url, "--namespace", &ns], &[]);
        let term = std::process::Command::new("kill").args(["-TERM", &server.pid().to_string()]).status().unwrap();
        assert!(term.success());
        let log = server.wait_for_log("bye", 1, std::time::Duration::from_secs(10));
        assert!(server.terminate_wait().success());
        assert!(!log.contains("already exists") && !log.contains("NOTICE"), "{start} start:\n{log}");
    }
    cleanup(&url, &ns).await;
}
