use axum::Json;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use idem_core::ProblemType;
use idem_store::{Error as StoreError, Generation};
use serde::Serialize;

/// An RFC 9457 problem details response (`application/problem+json`).
///
/// `type` is a stable URN per kind of error ([`ProblemType`], `urn:idem:problem:<slug>`), so clients branch on
/// it rather than on the human-readable `title` and `detail`. Details never echo another caller's data.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    kind: &'static str,
    title: &'static str,
    status: u16,
    detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_generation: Option<Generation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit_bytes: Option<usize>,
    #[serde(skip)]
    www_authenticate: bool,
}

impl Problem {
    /// A problem of kind `kind` (its type URI and title) with an HTTP status and a specific detail.
    pub fn new(status: StatusCode, kind: ProblemType, detail: impl Into<String>) -> Self {
        Self {
            kind: kind.uri(),
            title: kind.title(),
            status: status.as_u16(),
            detail: detail.into(),
            current_generation: None,
            limit_bytes: None,
            www_authenticate: false,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    pub(crate) fn not_found_route() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ProblemType::UnknownRoute,
            "no such route; the KV API lives under /v1/kv/{key}",
        )
    }

    pub(crate) fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, ProblemType::MethodNotAllowed, "this route does not take that method")
    }

    pub(crate) fn not_found_key() -> Self {
        Self::new(StatusCode::NOT_FOUND, ProblemType::NotFound, "no live value under this key")
    }

    pub(crate) fn unauthorized() -> Self {
        let mut p = Self::new(
            StatusCode::UNAUTHORIZED,
            ProblemType::Unauthorized,
            // RFC 9457 §3.1.4: the detail helps the client correct the problem, so it says where the token
            // comes from and how idem's own client presents it.
            "this server requires Authorization: Bearer <token> (missing or wrong here), the token being the \
             contents of the file its --auth-token-file names; `idem kv` sends it with --token-file FILE or \
             IDEM_AUTH_TOKEN_FILE",
        );
        p.www_authenticate = true;
        p
    }

    pub(crate) fn bad_request(kind: ProblemType, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, kind, detail)
    }

    pub(crate) fn too_large(size: Option<u64>, max: usize) -> Self {
        let detail = match size {
            Some(n) => format!("the value is {n} bytes; the limit is {max} bytes"),
            None => format!("the value exceeds the limit of {max} bytes"),
        };
        let mut p = Self::new(StatusCode::PAYLOAD_TOO_LARGE, ProblemType::ValueTooLarge, detail);
        p.limit_bytes = Some(max);
        p
    }
}

impl From<StoreError> for Problem {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::PreconditionFailed { current } => {
                let detail = match current {
                    Some(g) => format!("the current generation is {g}"),
                    None => "the key is absent".to_owned(),
                };
                let mut p = Self::new(StatusCode::PRECONDITION_FAILED, ProblemType::PreconditionFailed, detail);
                p.current_generation = current;
                p
            }
            StoreError::InvalidKey { problem } => Self::bad_request(ProblemType::InvalidKey, problem.to_string()),
            StoreError::ValueTooLarge { size, max } => Self::too_large(Some(size as u64), max),
            e @ StoreError::InvalidTtl { .. } => Self::bad_request(ProblemType::InvalidTtl, e.to_string()),
            e @ StoreError::InvalidArgument { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, ProblemType::InvalidArgument, e.to_string())
            }
            // Like the layer's 422 for a reused Idempotency-Key (draft §2.7): the request is well-formed but
            // conflicts with what the id already stands for. Only this caller's own key and id are named.
            StoreError::DedupeIdReused { key, dedupe_id } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ProblemType::DedupeIdReused,
                format!(
                    "dedupe id {dedupe_id:?} was already used on key {key:?} for a different payload; the same \
                     payload again gets the first result, a new payload needs a new dedupe id"
                ),
            ),
            e @ StoreError::WrongType { .. } => Self::new(StatusCode::CONFLICT, ProblemType::WrongType, e.to_string()),
            e @ StoreError::CounterOverflow => {
                Self::new(StatusCode::CONFLICT, ProblemType::CounterOverflow, e.to_string())
            }
            e @ StoreError::UpdateExhausted { .. } => {
                Self::new(StatusCode::CONFLICT, ProblemType::UpdateExhausted, e.to_string())
            }
            e @ (StoreError::Unavailable { .. } | StoreError::Closed) => {
                tracing::warn!(error = %e, source = ?std::error::Error::source(&e), "store unavailable");
                Self::new(StatusCode::SERVICE_UNAVAILABLE, ProblemType::StoreUnavailable, e.to_string())
            }
            e => {
                tracing::error!(error = %e, source = ?std::error::Error::source(&e), "store failed");
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::StoreFailed, e.to_string())
            }
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status();
        let etag = self.current_generation.map(crate::headers::etag);
        let www = self.www_authenticate;
        let mut resp = (status, Json(self)).into_response();
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(etag) = etag {
            h.insert(header::ETAG, etag);
        }
        if www {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"idem\""));
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}
