use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::body::Body;
use http::Response;

/// The future of [`Idempotency`](crate::Idempotency): the stored, replayed or refused response.
pub struct ResponseFuture<E> {
    inner: Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(inner: impl Future<Output = Result<Response<Body>, E>> + Send + 'static) -> Self {
        Self { inner: Box::pin(inner) }
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<Body>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
