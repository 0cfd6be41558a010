"""State shared by the request routers and the ingress of one process, kept out of
``routing.prefix_router``: Serve can hold a second copy of that module's globals in the process
(measured: the router's module-level set and the one the ingress imported were two objects), while
this module, reached as an attribute of an imported module, is one object for both."""

from __future__ import annotations

import contextvars
import weakref

from engine.latency import E2E_BUCKETS, TTFT_BUCKETS, Histogram

ROUTERS: weakref.WeakSet = weakref.WeakSet()  # live PrefixAwareRequestRouter instances
# Replicas whose engine failed while their actor lives on: replica id -> time.monotonic() deadline.
FAILED: dict[str, float] = {}
# What this process's prefix routers decided, and the requests its ingress refused as overloaded,
# cumulative (routers come and go with their handles): sent to the metrics hub by the ingress heartbeat
ROUTED: dict[str, int] = {"router_affinity_hits": 0, "router_cold_routes": 0, "requests_overloaded": 0}
# When this process had the whole request now being served (a POST's last body byte, set by the
# ingress): the user's time to first token counts from here, the tokenizing and the wait for a replica
# included, which the replicas' own histogram (from the request's arrival there) leaves out
REQUEST_START: contextvars.ContextVar[float | None] = contextvars.ContextVar("radixserve_request_start", default=None)
# time to first token of each engine request (each choice) this process's ingress served, sent to the
# metrics hub by its heartbeat (the event loop observes, the heartbeat thread copies)
INGRESS_TTFT = Histogram(TTFT_BUCKETS)
# Per HTTP request the ingress serves: whether an engine answered it (its first token came), set by the
# handler; the in-flight middleware then times the request, from its last body byte to its last
# response byte, into INGRESS_E2E when it was answered in full with a 200 (a mutable cell: the handler's tasks
# see the middleware's context as copies, and the object is the same in each)
ENGINE_ANSWERED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("radixserve_engine_answered",
                                                                                    default=None)
INGRESS_E2E = Histogram(E2E_BUCKETS)
