//! The operator's record look-up (`GET`/`DELETE /v1/idempotency/{scope}/{key}`) finds the records a layer
//! wrote, whatever record prefix that layer was given.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use idem_server::{ServerConfig, app};
use idem_store::{MemoryStore, Store};
use idem_tower::IdempotencyLayer;
use tower::{Layer, ServiceExt};

async fn call(router: &Router, method: Method, uri: &str) -> (StatusCode, serde_json::Value) {
    let req = Request::builder().method(method).uri(uri).body(Body::empty()).unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null))
}

#[tokio::test]
async fn admin_look_up_uses_the_layers_record_prefix() {
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone()).record_prefix("tenant-7/records/");
    let upstream = Router::new().route("/orders", post(|| async { (StatusCode::CREATED, "made") }));
    let proxied = layer.layer(upstream);
    let req = Request::post("/orders").header("idempotency-key", "order-1").body(Body::from("{}")).unwrap();
    assert_eq!(proxied.oneshot(req).await.unwrap().status(), StatusCode::CREATED);
    // The record is where the layer was told to keep it, and nowhere else.
    assert!(store.get("tenant-7/records/anonymous/order-1").await.unwrap().is_some());
    assert!(store.list("idempotency/", None, 10).await.unwrap().items.is_empty());

    let admin = app(store.clone(), ServerConfig::new().with_record_prefix(layer.record_key_prefix()));
    let (status, view) = call(&admin, Method::GET, "/v1/idempotency/anonymous/order-1").await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!((view["state"].as_str(), view["status"].as_u64()), (Some("completed"), Some(201)));
    let (status, _) = call(&admin, Method::DELETE, "/v1/idempotency/anonymous/order-1").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(store.get("tenant-7/records/anonymous/order-1").await.unwrap().is_none());
    assert_eq!(call(&admin, Method::GET, "/v1/idempotency/anonymous/order-1").await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn admin_look_up_defaults_to_the_layers_default_prefix() {
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone());
    let upstream = Router::new().route("/orders", post(|| async { (StatusCode::CREATED, "made") }));
    let req = Request::post("/orders").header("idempotency-key", "order-2").body(Body::from("{}")).unwrap();
    assert_eq!(layer.layer(upstream).oneshot(req).await.unwrap().status(), StatusCode::CREATED);
    let admin = app(store, ServerConfig::default());
    let (status, view) = call(&admin, Method::GET, "/v1/idempotency/anonymous/order-2").await;
    assert_eq!((status, view["status"].as_u64()), (StatusCode::OK, Some(201)), "{view}");
}
