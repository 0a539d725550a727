"""The chat page `serve` answers on `/`: three files of the package (page/), written here — no build step, no CDN,
no outside fonts, so it works offline — sent with a Content-Security-Policy that lets the page load and call only
this origin, so nothing a model writes can reach elsewhere even if it were rendered as markup (it is not: the
page builds DOM text nodes)."""

from __future__ import annotations

from importlib.resources import files

# path -> (file in page/, Content-Type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/page/app.css": ("app.css", "text/css; charset=utf-8"),
}
# pictures and sounds the person attaches are shown from data: URLs; everything else from this origin only
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; media-src 'self' data: "
    "blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def routes() -> list:
    """The page's routes: each file read once, at start, from the package."""
    from starlette.responses import Response
    from starlette.routing import Route

    def route(path: str, name: str, kind: str):
        body = files(__package__).joinpath("page", name).read_bytes()

        async def send(request):
            return Response(body, media_type=kind, headers=HEADERS)

        return Route(path, send, methods=["GET"])

    return [route(path, name, kind) for path, (name, kind) in FILES.items()]
