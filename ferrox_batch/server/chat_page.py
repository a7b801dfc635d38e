"""The chat page `GET /` serves: one static HTML file shipped in the package (`server/ui/chat.html`).

A person who starts `ferrox-batch serve` gets something to look at: a conversation streamed over the same
`/v1/chat/completions` server-sent events any client uses, with a stop button that cancels the request,
the sampling settings, and each reply's timings. The page is the same bytes for everyone and holds no
data, so loading it needs no API key (a browser cannot send one when it navigates); it asks for the key
when the API answers 401, and everything it does goes through the API under that key, the Host check and
the CORS rules. Its Content-Security-Policy lets it run its own inline script and talk to this server
only: nothing is fetched from elsewhere, and it cannot be framed.
"""

from __future__ import annotations

from importlib import resources

from starlette.responses import Response

#: The page's path.
PAGE_PATH = "/"
_SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class ChatPage:
    """The page's bytes, read once from the package, and its endpoint."""

    __slots__ = ("html",)

    def __init__(self) -> None:
        self.html = resources.files("ferrox_batch.server").joinpath("ui/chat.html").read_bytes()

    async def get(self) -> Response:
        return Response(self.html, media_type="text/html; charset=utf-8", headers=_SECURITY_HEADERS)
