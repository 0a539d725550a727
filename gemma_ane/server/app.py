"""`gemma-ane serve`: an OpenAI-compatible HTTP server over one loaded bundle; this module holds the app, its routes
and the command line, along seams of its own: server_request (parsing and checking a request, its images),
server_worker (the queue and the thread that owns the model), server_response (OpenAI's objects, whole and
streamed) and fetch (remote images).

One engine per process: the caches hold one conversation, so a single worker thread runs the
generations one at a time, in arrival order, from a bounded queue (a full queue answers 429), and
the model's prefix reuse carries from one request to the next. A body is parsed once into the runtime's
GenerationRequest (server_request.parse_request); once the queue has room for it, Model.prepare checks it,
renders it and compiles its grammar (server_request.prepare), so a bad one fails at once instead of after waiting
its turn, and the worker only runs the Prepared it made (each of n choices from the one Prepared).

Images come as OpenAI's image_url parts holding data: URLs; the server decodes the base64 once and checks each
file's size and its header's pixel count (Pillow, the `vision` extra) before the request queues. Started with
--allow-remote-images it also fetches http(s) image URLs, on public addresses only unless --allow-fetch-from names
others (gemma_ane.server.fetch); without it, it fetches nothing for a client.

A browser page cannot use the server unless --allow-origin names its origin (Origins: CORS, every other Origin
refused with 403), and a JSON endpoint refuses a body sent as anything but JSON (415): no page the user visits can
make the model generate.

Starlette and uvicorn (the `serve` extra) are imported only when an app is built, so the CLI can
register `serve` and the runtime stays usable without them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path

from ..errors import GemmaAneError, InputError, as_typed, option_strings
from ..runtime.device import BACKENDS
from . import fetch, page
from .errors import APIError
from .media import TEXT_BODY, ImageLimits, remote_urls
from .request import decode_media, parse_request, prepare
from .response import Generation, Render, Vocab, send_json
from .worker import Job, Worker

log = logging.getLogger("gemma_ane.server.app")

API_KEY_ENV = "GEMMA_ANE_API_KEY"
__all__ = ["APIError", "ImageLimits", "Job", "Vocab", "Worker", "build_app", "main", "parse_request", "serve"]


def _image_url_chars(body: dict) -> int:
    """The characters of a chat request's image_url URLs and input_audio data: what the media allowance is for."""
    messages = body.get("messages")
    total = 0
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                total += len(url) if isinstance(url, str) else 0
            elif isinstance(part, dict) and part.get("type") == "input_audio":  # the audio allowance is for these
                clip = part.get("input_audio")
                data = clip.get("data") if isinstance(clip, dict) else None
                total += len(data) if isinstance(data, str) else 0
    return total


async def _read_json(request, max_body: int, text_body: int) -> dict:
    """The body as a JSON object, of at most max_body bytes, of which at most text_body outside image_url URLs (a
    vision bundle's allowance for images is no allowance for text: stop strings, prompts, tools)."""
    from starlette.requests import ClientDisconnect

    too_big = APIError(413, f"the request body is larger than {max_body} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body:
        raise too_big
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_body:
                raise too_big
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    if len(data) > text_body:
        text = len(data) - _image_url_chars(body)
        if text > text_body:
            message = f"the request body holds {text} bytes besides its images, more than {text_body}"
            raise APIError(413, message, code="request_too_large")
    return body


def _check_content_type(request) -> None:
    """A body sent as anything but JSON is refused (415): a web page can send text/plain or a form to any
    address without asking (a CORS "simple request"), JSON only after a preflight that Origins answers."""
    given = request.headers.get("content-type")
    if given is None:  # no browser sends a body without one; curl and scripts may
        return
    media = given.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(
            415, f"Content-Type {given!r}: expected application/json", param=None, code="unsupported_media_type"
        )


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")


def check_origins(origins) -> tuple[str, ...]:
    """serve --allow-origin's values: "*" or origins as browsers send them (scheme://host[:port], no path)."""
    out = tuple(origins)
    for o in out:
        if o != "*" and not _ORIGIN.fullmatch(o):
            raise InputError(f"--allow-origin {o!r}: expected '*' or an origin such as https://example.com:8443")
    return out


class Origins:
    """CORS as a local server needs it: a request from a browser page (it carries Origin) is served only if
    its origin is allowed, with Access-Control-Allow-Origin; any other gets 403, so a page the user visits
    cannot make the model generate. Preflights (OPTIONS with Access-Control-Request-Method) of allowed
    origins are answered here. Requests without Origin (clients, scripts, curl) pass as before, and so do the
    server's own chat page's (_same_origin)."""

    METHODS = "GET, POST, OPTIONS"

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get(b"origin")
        if origin is None or _same_origin(origin, scope.get("scheme", "http"), headers.get(b"host", "")):
            return await self.app(scope, receive, send)
        if "*" not in self.allowed and origin not in self.allowed:
            message = f"Origin {origin!r} is not allowed (serve --allow-origin ORIGIN opens the server to a page)"
            return await send_json(send, 403, APIError(403, message, code="origin_not_allowed").body())
        cors = {"Access-Control-Allow-Origin": "*" if "*" in self.allowed else origin, "Vary": "Origin"}
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            asked = headers.get(b"access-control-request-headers", "authorization, content-type")
            cors |= {
                "Access-Control-Allow-Methods": self.METHODS,
                "Access-Control-Allow-Headers": asked,
                "Access-Control-Max-Age": "600",
            }
            await send({"type": "http.response.start", "status": 204, "headers": _raw(cors)})
            return await send({"type": "http.response.body", "body": b""})

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + _raw(cors)}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _same_origin(origin: str, scheme: str, host: str) -> bool:
    """A request from a page this server sent (the chat page): its Origin is the address the browser asked. Only
    an address by IP or `localhost` counts: a name could be a DNS-rebinding attacker's own, resolving here."""
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.find("]")]
    try:
        ipaddress.ip_address(name)
    except ValueError:
        if name != "localhost":
            return False
    return origin == f"{scheme}://{host}"


def _raw(headers: dict) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]


def capabilities(model) -> dict:
    """What the served bundle can do (the model card's `capabilities`)."""
    return {
        "thinking": True,  # Gemma 4's template opens a thought on request
        "tools": True,  # calls are parsed from the text the model writes
        "vision": getattr(model, "images", None) is not None,
        "audio": getattr(model, "audio", None) is not None,
        "drafter": getattr(model, "max_draft_tokens", 0) > 0,
        "sampling": model.head == "logits",  # the published layout's argmax head: greedy only
    }


def build_app(
    model,
    *,
    model_name: str,
    api_key: str | None = None,
    max_queue: int = 16,
    max_body: int | None = None,
    max_image_bytes: int = ImageLimits.max_image_bytes,
    max_image_pixels: int = ImageLimits.max_image_pixels,
    max_images: int = ImageLimits.max_images,
    remote_images: bool = False,
    allow_fetch_from=(),
    allow_origins=(),
    webui: bool = True,
):
    """The Starlette app serving `model` (anything with `stream_generate`, `prompt_ids` (given `tools=` only
    when a request has tools), `context`, `generation`, `config` (its `vocab_size`) and `tokenizer`, as
    `gemma_ane.load` returns; `images`, its image encoder or None). `max_body` defaults to 1 MB, plus room for
    `max_images` base64 images of `max_image_bytes` when the model takes images (in their image_url parts only);
    `remote_images`: fetch http(s) image URLs on public addresses and those `allow_fetch_from` names (off:
    refused); `allow_origins`: the browser origins whose pages may call it (CORS; "*" any), every other Origin
    refused; `webui`: the chat page on `/` (page.py)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    if max_queue < 0:
        raise InputError(f"max_queue={max_queue}: must be >= 0")
    limits = ImageLimits(max_image_bytes, max_image_pixels, max_images, remote_images, tuple(allow_fetch_from))
    allow_origins = check_origins(allow_origins)
    # the image allowance counts only inside image_url parts; a max_body given is the limit of both
    text_body = TEXT_BODY if max_body is None else max_body
    max_body = limits.max_body(model) if max_body is None else max_body
    worker = Worker(model, max_queue)
    fetcher = fetch.Fetcher(fetch.Allowlist(limits.allow_fetch_from), max_image_bytes) if remote_images else None
    vocab = Vocab(model.tokenizer, model.stop_ids)
    started = int(time.time())

    def authorize(request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401, "missing or incorrect API key (send 'Authorization: Bearer KEY')", code="invalid_api_key"
            )

    async def health(request):
        return JSONResponse(
            {"status": "ok", "model": model_name, "generating": worker.current is not None, "waiting": worker.waiting}
        )

    def model_card() -> dict:
        # OpenAI's four fields, then what the bundle can do, for a client (the chat page) to offer only that
        return {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "gemma-ane",
            "context_length": model.context,
            "capabilities": capabilities(model),
        }

    async def models(request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request):
        authorize(request)
        if request.path_params["name"] != model_name:
            raise APIError(
                404, f"The model `{request.path_params['name']}` does not exist", param="model", code="model_not_found"
            )
        return JSONResponse(model_card())

    def queue_full() -> APIError:
        return APIError(
            429,
            f"the queue is full ({max_queue} requests waiting); retry shortly",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )

    def endpoint(kind: str, prefix: str):
        async def generate(request):
            authorize(request)
            _check_content_type(request)
            body = await _read_json(request, max_body, text_body)
            # remote images are fetched on a pool of their own, awaited here: a slow one holds no shared thread
            urls = remote_urls(body, model, limits) if fetcher is not None and kind == "chat" else []
            fetched = await fetcher(urls) if urls else {}
            req = await run_in_threadpool(parse_request, body, kind, model, model_name, limits, fetched)
            # the queue before any work per request: a full one refuses it before its prompt is rendered
            if not worker.admit():
                raise queue_full()
            try:
                await run_in_threadpool(prepare, model, req)
                # clips are decoded only for a request that fits the context and holds its place in the queue
                await run_in_threadpool(decode_media, model, req)
            except BaseException:
                worker.release()
                raise
            rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
            score = (req.prompt_ids, req.logprobs) if req.echo and req.logprobs is not None else None
            job = Job(rid, req.prepared, asyncio.get_running_loop(), req.n, score)
            worker.run(job)
            return Generation(job, Render(req, rid, model_name, vocab))

        return generate

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request, exc):
        code = "not_found" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            APIError(exc.status_code, message, code=code).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def server_error(request, exc):
        # the traceback goes to the server's log (Starlette re-raises after this), never to the client
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(worker.stop)
        if fetcher is not None:
            fetcher.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", one_model, methods=["GET"]),
            Route("/v1/chat/completions", endpoint("chat", "chatcmpl"), methods=["POST"]),
            Route("/v1/completions", endpoint("completion", "cmpl"), methods=["POST"]),
            *(page.routes() if webui else []),
        ],
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
        middleware=[Middleware(Origins, allowed=allow_origins)],
    )
    app.state.worker = worker
    return app


def serve(
    bundle,
    host: str = "127.0.0.1",
    port: int = 8080,
    backend: str = "auto",
    api_key: str | None = None,
    max_queue: int = 16,
    prompt_cache: str | None = None,
    allow_special_tokens: bool = False,
    draft_tokens: int = 0,
    max_image_bytes: int = ImageLimits.max_image_bytes,
    max_image_pixels: int = ImageLimits.max_image_pixels,
    max_images: int = ImageLimits.max_images,
    remote_images: bool = False,
    allow_fetch_from=(),
    allow_origins=(),
    webui: bool = True,
    served_model_name: str | None = None,
) -> None:
    """Load `bundle` and serve it until interrupted; `prompt_cache`: start from the caches in this
    file (made by `generate`/`chat --prompt-cache`), so a shared system prompt is not processed again;
    `max_image_*`, `max_images`, `remote_images`: what one request's images may be (see ImageLimits)."""
    import uvicorn

    from ..runtime.model import load

    if not 0 <= port <= 65535:
        raise InputError(f"port={port}: expected 0..65535")
    if max_queue < 0:
        raise InputError(f"max_queue={max_queue}: must be >= 0")
    # checked before loading
    if served_model_name is not None and not (0 < len(served_model_name) <= 256 and served_model_name.isprintable()):
        raise InputError(f"--served-model-name {served_model_name!r:.60}: expected 1 to 256 printable characters")
    limits = ImageLimits(max_image_bytes, max_image_pixels, max_images, remote_images, tuple(allow_fetch_from))
    allow_origins = check_origins(allow_origins)
    _check_listen(host, port)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use the model", host)
    if remote_images:
        log.warning("--allow-remote-images: requests may make this server fetch http(s) URLs on public addresses")
    model = load(bundle, backend=backend, max_image_pixels=max_image_pixels)  # the runtime checks it again
    model.allow_special_tokens = allow_special_tokens
    model.use_drafts(draft_tokens)
    if prompt_cache:
        log.info("prompt cache %s: %d tokens", prompt_cache, model.load_prompt_cache(prompt_cache))
    app = build_app(
        model,
        model_name=served_model_name or Path(bundle).resolve().name,
        api_key=api_key,
        max_queue=max_queue,
        allow_origins=allow_origins,
        webui=webui,
        **dataclasses.asdict(limits),
    )
    # a stream still open at shutdown is cut after 5 s rather than holding the process
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


def _check_listen(host: str, port: int) -> None:
    """Refuse an address this process cannot listen on (a port in use, a host that is none of this machine's)
    before the model loads: uvicorn would say so only after the load, in its startup log. A probe bound and closed
    as uvicorn binds (SO_REUSEADDR): a port taken in between still fails there."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise InputError(f"host={host}: not an address of this machine ({e})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:  # a real address, but another machine's
                raise InputError(f"host={host}: not an address of this machine ({e.strerror})") from None
            raise InputError(f"port={port}: cannot listen on {host} ({e.strerror or e})") from None


# -- command line ---------------------------------------------------------------------------------


def _cmd_serve(a) -> int:
    serve(
        a.bundle,
        host=a.host,
        port=a.port,
        backend=a.backend,
        api_key=a.api_key or os.environ.get(API_KEY_ENV),
        max_queue=a.max_queue,
        prompt_cache=a.prompt_cache,
        allow_special_tokens=a.allow_special_tokens,
        draft_tokens=a.draft,
        max_image_bytes=a.max_image_bytes,
        max_image_pixels=a.max_image_pixels,
        max_images=a.max_images,
        remote_images=a.allow_remote_images,
        allow_fetch_from=a.allow_fetch_from,
        allow_origins=a.allow_origin,
        webui=not a.no_webui,
        served_model_name=a.served_model_name,
    )
    return 0


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port to listen on")
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="coreml: Core ML (macOS); mil: our MIL executor (any OS, slower); auto: coreml where it runs, else mil",
    )
    p.add_argument(
        "--served-model-name", metavar="NAME", help="the model id clients see and send (default: the bundle's folder)"
    )
    p.add_argument("--no-webui", action="store_true", help="no chat page on / (then / is 404)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait behind the running one; more get 429 (default 16)",
    )
    p.add_argument("--prompt-cache", metavar="FILE", help="start from the caches saved in FILE (see generate)")
    p.add_argument(
        "--allow-special-tokens",
        action="store_true",
        help="let user and tool text spell control tokens (default: it stays text, so no one can forge a turn)",
    )
    p.add_argument(
        "--draft",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding for every request: the bundle's drafter proposes K tokens a verify call",
    )
    limits = ImageLimits()
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=limits.max_image_bytes,
        metavar="N",
        help=f"largest image file a request may send, decoded from base64 (default {limits.max_image_bytes})",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=limits.max_image_pixels,
        metavar="N",
        help=f"largest width*height of an image (default {limits.max_image_pixels})",
    )
    p.add_argument(
        "--max-images",
        type=int,
        default=limits.max_images,
        metavar="N",
        help=f"most images in one request (default {limits.max_images})",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image URLs a request names, on public addresses only (default: only data: URLs; the "
        f"server fetches nothing); {fetch.FETCH_SECONDS:g} s a fetch",
    )
    p.add_argument(
        "--allow-fetch-from",
        action="append",
        default=[],
        metavar="CIDR_OR_HOST",
        help="with --allow-remote-images, also fetch from this address, network or host though it is not public "
        "(loopback, private, link-local); repeatable",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from this origin (e.g. http://localhost:3000; '*' any) call the server from a browser; "
        "repeatable (default: none, a request carrying an Origin header is refused)",
    )
    p.set_defaults(fn=_cmd_serve)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `gemma-ane serve` on the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)")
    _arguments(p)
    return p


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemma_ane.server.app", description="OpenAI-compatible HTTP server")
    _arguments(p)
    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except (GemmaAneError, ValueError, OSError) as e:  # one line and the class's exit code, as the CLI does
        print(f"gemma-ane serve: error: {as_typed(str(e), option_strings(p))}", file=sys.stderr)
        return e.exit_code if isinstance(e, GemmaAneError) else 2


if __name__ == "__main__":
    sys.exit(main())
