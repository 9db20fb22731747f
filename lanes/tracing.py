"""OpenTelemetry traces: off by default, and then nothing of OpenTelemetry is imported.

`LANES_TRACING=true` (with the `otel` extra: `pip install 'lanes[otel]'`) exports
spans over OTLP/HTTP, configured by the standard `OTEL_*` variables
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, ...).
Or hand a `Tracing` over any tracer provider to the SDK client and the serving app
(tests do, with the SDK's in-memory exporter). Context travels between processes as
W3C `traceparent`/`tracestate` headers.

Everywhere else lanes holds a `Tracing | None`: None is the off switch, checked once
per request, so tracing off costs an `is None`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from lanes.errors import LanesError
from lanes.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer, TracerProvider


class Tracing:
    """A tracer and W3C propagation; the one handle lanes' code traces through."""

    def __init__(self, provider: TracerProvider, name: str = "lanes") -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer(name)
        self.kinds = SpanKind
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_settings(cls, settings: Settings) -> Tracing | None:
        """None unless `settings.tracing`; then the process's tracer provider: the one
        the application set up (OpenTelemetry's global), else one lanes installs as the
        global, exporting over OTLP/HTTP as the `OTEL_*` variables say. One per
        process: a flow's shards and a server's requests share its exporter."""
        if not settings.tracing:
            return None
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise LanesError(
                f"LANES_TRACING=true needs OpenTelemetry's SDK and OTLP exporter ({e}): "
                "pip install 'lanes[otel]', or unset LANES_TRACING"
            ) from None
        if not isinstance(trace.get_tracer_provider(), TracerProvider):
            provider = TracerProvider(resource=Resource.create())
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            trace.set_tracer_provider(provider)  # a racing thread's may win: either serves
        return cls(trace.get_tracer_provider())

    def flush(self) -> None:
        """Export what is pending now (a worker process may exit next)."""
        force_flush = getattr(self.provider, "force_flush", None)
        if force_flush is not None:
            force_flush()

    # ---- context across the wire ----------------------------------------------------

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Write the current span's context into outgoing `headers` (traceparent)."""
        self._propagator.inject(headers)

    @staticmethod
    def failed(span: Span, description: str) -> None:
        """Mark `span` an error (a 5xx answer: no exception passed through it)."""
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, description))

    def extract(self, headers: Mapping[str, str]) -> Context:
        """The caller's context from incoming `headers` (empty when there is none)."""
        return self._propagator.extract(headers)

    def carrier(self) -> dict[str, str]:
        """The current context as headers, to hand to another process (a job's run)."""
        found: dict[str, str] = {}
        self.inject(found)
        return found

    # ---- spans ------------------------------------------------------------------------

    @contextmanager
    def span(
        self,
        name: str,
        kind: SpanKind | None = None,
        context: Context | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> Iterator[Span]:
        """A span around a block, current inside it; an exception is recorded on it."""
        with self.tracer.start_as_current_span(
            name,
            context=context,
            kind=kind if kind is not None else self.kinds.INTERNAL,
            attributes=dict(attributes or {}),
        ) as span:
            yield span

    def finished(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        parent: SpanContext | None = None,
        links: list[Link] | None = None,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> SpanContext:
        """Record a span that already happened (a queue wait, a batch run); its context.
        With `error`, its status is an error that `error` describes."""
        from opentelemetry import trace

        context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        span = self.tracer.start_span(
            name,
            context=context,
            links=links,
            start_time=start_ns,
            attributes=dict(attributes or {}),
        )
        if error is not None:
            self.failed(span, error)
        span.end(end_time=end_ns)
        return span.get_span_context()

    @staticmethod
    def link(to: SpanContext, **attributes: Any) -> Link:
        from opentelemetry.trace import Link

        return Link(to, attributes)

    @staticmethod
    def current() -> SpanContext | None:
        """The current span's context, if one is recording."""
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        return context if context.is_valid else None


def maybe_span(
    tracing: Tracing | None,
    name: str,
    attributes: Mapping[str, Any] | None = None,
    carrier: Mapping[str, str] | None = None,
) -> AbstractContextManager[object]:
    """A span (continuing `carrier`'s trace, when given) if tracing is on, else a
    block that costs nothing."""
    if tracing is None:
        return nullcontext()
    context = tracing.extract(carrier) if carrier else None
    return tracing.span(name, context=context, attributes=attributes)


class WallClock:
    """Maps times of a monotonic clock to the epoch nanoseconds spans are stamped with."""

    def __init__(self, clock_now: float) -> None:
        self._offset_ns = time.time_ns() - int(clock_now * 1e9)

    def ns(self, at: float) -> int:
        return self._offset_ns + int(at * 1e9)
