use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::{Problem, ServerConfig};

/// Checks `Authorization: Bearer <token>` (RFC 6750 §2.1) when a token is configured.
pub(crate) async fn require_token(State(config): State<ServerConfig>, req: Request, next: Next) -> Response {
    let Some(token) = &config.auth_token else {
        return next.run(req).await;
    };
    let presented = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        // Constant-time, so response timing does not reveal how much of a guessed token was right.
        Some(p) if constant_time_eq::constant_time_eq(p.as_bytes(), token.as_bytes()) => next.run(req).await,
        _ => Problem::unauthorized().into_response(),
    }
}
