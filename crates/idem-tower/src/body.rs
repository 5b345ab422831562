//! [`Body`], the one body type of the layer: what it hands its inner service and what it answers with. Plain
//! `http-body`, so the layer serves hyper, tonic and axum stacks alike.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use tower::BoxError;

/// A request or response body of any kind, boxed: bytes frames, errors as [`BoxError`].
///
/// The layer's inner service receives `Request<Body>` (axum's `Router`, hyper's and tonic's services accept
/// any `http_body::Body`), and the layer answers `Response<Body>`.
#[derive(Debug)]
pub struct Body(UnsyncBoxBody<Bytes, BoxError>);

impl Body {
    /// Boxes `body` (no copy of its data); a `Body` is returned as it is, not boxed a second time.
    pub fn new<B>(body: B) -> Self
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        // Layers re-wrap what they pass on (`request.map(Body::new)`); each box is an allocation per request
        // and a virtual call per frame, so a body that already is one is taken as it is (axum's `Body::new`
        // does the same).
        let mut slot = Some(body);
        if let Some(already) = (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<Body>>()
            && let Some(body) = already.take()
        {
            return body;
        }
        match slot {
            Some(body) => Self(body.map_err(Into::into).boxed_unsync()),
            None => Self::empty(),
        }
    }

    /// A body with no data.
    pub fn empty() -> Self {
        Self(Empty::<Bytes>::new().map_err(Into::<BoxError>::into).boxed_unsync())
    }
}

impl Default for Body {
    fn default() -> Self {
        Self::empty()
    }
}

impl From<Bytes> for Body {
    fn from(bytes: Bytes) -> Self {
        Self::new(Full::new(bytes))
    }
}

impl From<String> for Body {
    fn from(text: String) -> Self {
        Self::from(Bytes::from(text))
    }
}

impl From<&'static str> for Body {
    fn from(text: &'static str) -> Self {
        Self::from(Bytes::from_static(text.as_bytes()))
    }
}

impl From<Vec<u8>> for Body {
    fn from(bytes: Vec<u8>) -> Self {
        Self::from(Bytes::from(bytes))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;

    #[tokio::test]
    async fn a_body_wrapped_again_keeps_its_data_and_length() {
        let body = Body::new(Body::from("twelve bytes"));
        assert_eq!(body.size_hint().exact(), Some(12));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "twelve bytes");
        assert!(Body::new(Body::empty()).is_end_stream());
    }
}
