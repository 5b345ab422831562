//! An order service in axum behind the idempotency layer, with a durable store and a drained shutdown.
//!
//! ```text
//! cargo run -p idem-tower --example axum_orders -- sqlite:./orders.db 127.0.0.1:3000
//! cargo run -p idem-tower --example axum_orders -- postgres://postgres@127.0.0.1:5432/test 127.0.0.1:3000
//!
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: "order-1"' -d '{"item":"book"}'
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: "order-1"' -d '{"item":"book"}'   # a replay
//! ```
//!
//! The first request under a key executes the handler once; a retry with the same key and body gets the stored
//! answer with `Idempotent-Replayed: true` (also after a restart: the records are in the store), the same key
//! with another body gets 422, and a retry while the first is still running gets 409 with `Retry-After`.
//!
//! On SIGTERM (or Ctrl-C) the server stops accepting connections and finishes the requests it has; then
//! [`IdempotencyLayer::drain`] waits for executions whose client hung up, so their outcomes are recorded
//! before the process exits (else a retry after the restart would execute them again).
//!
//! Dependencies of a program of its own: `axum`, `tokio` (features `macros`, `rt-multi-thread`, `signal`),
//! `idem-tower`, `idem-store` and `idem-backends` (or one backend crate: `idem-sqlite`, `idem-postgres`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem_backends::{AnyStore, StoreUrl};
use idem_store::Limits;
use idem_tower::{IdempotencyLayer, KeyPolicy};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let store_url = args.next().unwrap_or_else(|| "sqlite:./orders.db".to_owned());
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:3000".to_owned());

    // `sqlite:PATH` (one file, fsynced before each answer) or `postgres://…` (several servers sharing it).
    let store = AnyStore::open(&StoreUrl::parse(&store_url)?, "idem", Limits::default()).await?;
    // Every POST must carry a key: an order placed without one could not be retried safely.
    let idempotency = IdempotencyLayer::new(store.clone()).key_policy(KeyPolicy::Required);

    let app = Router::new()
        .route("/orders", post(place_order))
        .with_state(Arc::new(AtomicU64::new(0)))
        .layer(idempotency.clone());

    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).with_graceful_shutdown(terminated()).await?;

    // No new requests from here; wait for executions still running detached from their (gone) clients.
    idempotency.drain().await;
    store.close().await;
    println!("drained, exiting");
    Ok(())
}

/// The side effect the layer runs once per key: here a number handed out, in a real service a row written or
/// a payment made.
async fn place_order(State(orders): State<Arc<AtomicU64>>, body: String) -> (StatusCode, Json<serde_json::Value>) {
    let number = orders.fetch_add(1, Ordering::SeqCst) + 1;
    println!("executed order {number}");
    (StatusCode::CREATED, Json(serde_json::json!({ "order": number, "request": body })))
}

/// Resolves on SIGTERM (what a service manager or Kubernetes sends) or Ctrl-C.
async fn terminated() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
            let _ = ctrl_c.await;
            return;
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
