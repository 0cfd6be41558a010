"""CORS for browser front-ends on another origin (TGI's ``--cors-allow-origin``): off unless origins
are set. Starlette's own middleware does the work; this wrapper lets the ingress set the origins when
it starts (the app and its middleware stack are built at import, before any settings exist)."""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware


class Cors:
    origins: tuple[str, ...] = ()  # set by the ingress from its settings (one ingress per process)

    def __init__(self, asgi_app):
        self.app = asgi_app
        self._cors: CORSMiddleware | None = None
        self._built_for: tuple[str, ...] = ()

    async def __call__(self, scope, receive, send):
        if not Cors.origins or scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._built_for != Cors.origins:
            # no credentials: the API takes no cookies, and "*" with credentials is not allowed
            self._cors = CORSMiddleware(self.app, allow_origins=list(Cors.origins), allow_methods=["GET", "HEAD", "POST"],
                                        allow_headers=["*"], expose_headers=["x-radixserve-replica"], max_age=600)
            self._built_for = Cors.origins
        return await self._cors(scope, receive, send)
