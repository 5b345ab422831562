use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use idem_core::ProblemType;
use idem_store::Error as StoreError;

/// An RFC 9457 problem details response (`application/problem+json`) of the KV API, built by
/// [`idem_tower::Problem`] (the one builder of idem's problem bodies); this type adds the KV API's answers to
/// store errors and axum's `IntoResponse`.
///
/// `type` is a stable URN per kind of error ([`ProblemType`], `urn:idem:problem:<slug>`), so clients branch on
/// it rather than on the human-readable `title` and `detail`. Details never echo another caller's data. A 503
/// carries `Retry-After: 1`.
#[derive(Debug, Clone)]
// Boxed: handlers return `Result<_, Problem>`, and the builder (members, headers) would make every Ok large.
pub struct Problem(Box<idem_tower::Problem>);

impl Problem {
    /// A problem of kind `kind` (its type URI and title) with an HTTP status and a specific detail.
    pub fn new(status: StatusCode, kind: ProblemType, detail: impl Into<String>) -> Self {
        Self::from(idem_tower::Problem::new(status, kind, detail))
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.0.status()
    }

    /// The `detail` member: what went wrong with this request, in words.
    pub fn detail(&self) -> &str {
        self.0.detail()
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
        Self::from(
            idem_tower::Problem::new(
                StatusCode::UNAUTHORIZED,
                ProblemType::Unauthorized,
                // RFC 9457 §3.1.4: the detail helps the client correct the problem, so it says where the token
                // comes from and how idem's own client presents it.
                "this server requires Authorization: Bearer <token> (missing or wrong here), the token being the \
                 contents of the file its --auth-token-file names; `idem kv` sends it with --token-file FILE or \
                 IDEM_AUTH_TOKEN_FILE",
            )
            .header(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"idem\"")),
        )
    }

    pub(crate) fn bad_request(kind: ProblemType, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, kind, detail)
    }

    pub(crate) fn too_large(size: Option<u64>, max: usize) -> Self {
        let detail = match size {
            Some(n) => format!("the value is {n} bytes; the limit is {max} bytes"),
            None => format!("the value exceeds the limit of {max} bytes"),
        };
        Self::from(
            idem_tower::Problem::new(StatusCode::PAYLOAD_TOO_LARGE, ProblemType::ValueTooLarge, detail)
                .member("limit_bytes", max),
        )
    }
}

impl From<idem_tower::Problem> for Problem {
    fn from(p: idem_tower::Problem) -> Self {
        Self(Box::new(p))
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
                let p =
                    idem_tower::Problem::new(StatusCode::PRECONDITION_FAILED, ProblemType::PreconditionFailed, detail);
                Self::from(match current {
                    Some(g) => p.member("current_generation", g.get()).header(header::ETAG, crate::headers::etag(g)),
                    None => p,
                })
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
        let mut problem = *self.0;
        if problem.status() == StatusCode::SERVICE_UNAVAILABLE {
            problem = problem.header(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        problem.into_response()
    }
}
