"""Security headers: no response may be framed, sniffed into another type or leak its URL to
other sites; the dashboard's pages also load nothing but their own files (a content security
policy; FastAPI's ``/docs`` page loads Swagger UI from a CDN, so it goes without)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .dashboard.routes import PREFIX

# Inline style attributes colour the dashboard's legends; scripts are all files of our own.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'self'; "
    "form-action 'self'; frame-ancestors 'none'"
)
HEADERS = (
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeaders:
    """ASGI middleware adding :data:`HEADERS` to every HTTP response, and :data:`CSP` to the
    dashboard's."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        headers = HEADERS
        if scope["path"].startswith(PREFIX):
            headers = ((b"content-security-policy", CSP.encode()), *HEADERS)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in headers if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)
