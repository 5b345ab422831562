//! RFC 9457 problem details for the layer's own answers. Types are [`ProblemType`]s, the ones the KV API uses,
//! so clients branch on one namespace. Details never contain another request's data (docs/DESIGN.md
//! step 7).

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};
use idem_core::ProblemType;

pub(crate) fn problem(status: StatusCode, kind: ProblemType, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": kind.uri(),
        "title": kind.title(),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response
}
