"""serve --allow-remote-images, fenced: public addresses only (checked after resolution, on every redirect, and
connected to as checked), one deadline a fetch, a pool of its own, one error text whatever failed. Refusals are
tested with resolution stubbed and every connection forbidden: no test connects anywhere but its own loopback
server."""

from __future__ import annotations

import contextlib
import http.server
import re
import socket
import threading
import time

import pytest
from test_server import CHAT, assert_openai_error
from test_server_images import SMALL, ask, fake, remote, serving, text

from gemma_ane.errors import InputError
from gemma_ane.server import fetch
from gemma_ane.server.fetch import Allowlist, FetchError

REFUSED = ["10.0.0.1", "169.254.169.254", "::ffff:127.0.0.1", "0.0.0.0", "127.0.0.1", "::1", "192.168.1.20",
           "172.16.0.1", "100.64.0.1", "fc00::1", "fe80::1", "224.0.0.1", "::"]  # fmt: skip


def resolving_to(monkeypatch, *addresses):
    def getaddrinfo(host, port, *args, **kw):
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def no_connections(monkeypatch, allowed=()):
    """Any connection but to `allowed` (loopback addresses of the test's own server) fails the test."""
    real = socket.create_connection

    def create_connection(address, *args, **kw):
        if address[0] not in allowed:
            raise AssertionError(f"a connection was attempted to {address}")
        return real(address, *args, **kw)

    def connect(self, address):
        raise AssertionError(f"a connection was attempted to {address}")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    if not allowed:
        monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.mark.parametrize("address", REFUSED)
def test_a_non_public_address_is_refused_before_any_connection(monkeypatch, address):
    resolving_to(monkeypatch, address)
    no_connections(monkeypatch)
    with pytest.raises(FetchError, match="non-public address"):
        fetch.fetch("http://images.example/cat.png", 100, Allowlist(), time.monotonic() + 5)


def test_one_non_public_address_among_public_ones_is_refused(monkeypatch):
    resolving_to(monkeypatch, "93.184.216.34", "10.1.2.3")
    no_connections(monkeypatch)
    with pytest.raises(FetchError, match="10.1.2.3"):
        fetch.fetch("https://images.example/cat.png", 100, Allowlist(), time.monotonic() + 5)


def test_the_connection_goes_to_the_address_checked(monkeypatch):
    """A second lookup (DNS rebinding) cannot swap it: the connection names the checked address itself."""
    resolving_to(monkeypatch, "93.184.216.34")
    tried = []

    def create_connection(address, *args, **kw):
        tried.append(address)
        raise ConnectionRefusedError("no network in tests")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    with pytest.raises(FetchError):
        fetch.fetch("http://images.example:8080/cat.png", 100, Allowlist(), time.monotonic() + 5)
    assert tried == [("93.184.216.34", 8080)]


def test_the_allowlist_admits_named_hosts_and_networks(monkeypatch):
    allow = Allowlist(["10.0.0.0/8", "Intranet.Example", "::1"])
    import ipaddress

    assert allow.allows("x", ipaddress.ip_address("10.9.8.7")) and allow.allows("x", ipaddress.ip_address("::1"))
    assert allow.allows("intranet.example.", ipaddress.ip_address("192.168.0.1"))
    assert not allow.allows("x", ipaddress.ip_address("169.254.169.254"))
    for bad in ["", "a b", "http://x/"]:
        with pytest.raises(ValueError, match="allow_fetch_from"):
            Allowlist([bad])


@pytest.mark.parametrize(
    "entry, why",
    [
        ("0.0.0.0/0", "covers every address"),
        ("::/0", "covers every address"),
        ("0.0.0.0/1", "covers this machine's addresses"),  # half of IPv4, loopback included
        ("127.0.0.0/8", "covers this machine's addresses"),
        ("::ffff:0:0/96", "covers this machine's addresses"),  # every IPv4 address, mapped
        ("0.0.0.0", "covers this machine's addresses"),  # a connection to it reaches this machine
        ("128.0.0.0/1", "covers link-local addresses"),
        ("169.254.169.254", "covers link-local addresses"),  # the cloud's metadata service
        ("fe80::/10", "covers link-local addresses"),
        ("::ffff:169.254.169.254", "covers link-local addresses"),
        ("10.0.0.1/8", r"host bits set \(the network is 10.0.0.0/8\)"),
        ("300.1.1.1", "expected an address, a CIDR network or a host name"),
        ("127.1", "expected an address, a CIDR network or a host name"),  # inet_aton's 127.0.0.1
    ],
)
def test_the_allowlist_refuses_what_would_open_the_fence(entry, why):
    with pytest.raises(InputError, match=rf"^allow_fetch_from: {re.escape(repr(entry))}: {why}"):
        Allowlist([entry])


def test_the_allowlist_still_takes_one_loopback_address_and_private_networks():
    import ipaddress

    allow = Allowlist(["127.0.0.1", "::1", "192.168.0.0/16", "fd00::/8", "images.internal", "10.1.2.3/32"])
    assert allow.allows("x", ipaddress.ip_address("127.0.0.1")) and not allow.allows(
        "x", ipaddress.ip_address("127.0.0.2")
    )
    assert allow.allows("x", ipaddress.ip_address("192.168.4.5")) and allow.allows(
        "x", ipaddress.ip_address("10.1.2.3")
    )


@contextlib.contextmanager
def web(routes: dict):
    """A loopback server: each path maps to (status, headers, body, seconds between body bytes)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, headers, body, pause = routes.get(self.path, (404, {}, b"", 0))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for i in range(0, len(body), 1 if pause else len(body) or 1):
                    self.wfile.write(body[i : i + (1 if pause else len(body))])
                    self.wfile.flush()
                    time.sleep(pause)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 64  # the pool test's 45 connections at once

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_redirect_to_a_non_public_address_is_refused_before_connecting(monkeypatch):
    no_connections(monkeypatch, allowed=("127.0.0.1",))
    with web({"/go": (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b"", 0)}) as base:
        with pytest.raises(FetchError, match="non-public address 169.254.169.254"):
            fetch.fetch(f"{base}/go", 100, Allowlist(["127.0.0.1"]), time.monotonic() + 5)
        # the loopback server itself only through the allowlist
        with pytest.raises(FetchError, match="non-public address 127.0.0.1"):
            fetch.fetch(f"{base}/go", 100, Allowlist(), time.monotonic() + 5)


def test_a_trickling_server_is_cut_at_the_deadline():
    """One byte every 0.2 s: each wait is short, the fetch is not (the old timeout was per wait)."""
    with web({"/slow.png": (200, {}, SMALL[:100], 0.2)}) as base:
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="took longer than"):
            fetch.fetch(f"{base}/slow.png", 1000, Allowlist(["127.0.0.1"]), time.monotonic() + 1.0)
        assert time.monotonic() - t0 < 2.0


def test_every_failed_fetch_reads_the_same_to_the_client(monkeypatch):
    monkeypatch.setattr(fetch, "FETCH_SECONDS", 1.0)
    routes = {"/small.png": (200, {}, SMALL, 0), "/slow.png": (200, {}, SMALL[:50], 0.1)}
    with web(routes) as base:
        port = base.rsplit(":", 1)[1]
        cases = {
            "missing": f"{base}/nowhere.png",
            "slow": f"{base}/slow.png",
            "closed port": "http://127.0.0.1:9/x.png",
            "refused address": f"http://[::1]:{port}/small.png",  # loopback, but not on the allowlist
        }
        messages = {}
        with serving(fake(), remote_images=True, allow_fetch_from=["127.0.0.1"]) as http:
            assert ask(http, remote(f"{base}/small.png"), text("ok")).status_code == 200
            for why, url in cases.items():
                err = assert_openai_error(ask(http, remote(url)), 400, "messages[0].content[0].image_url")
                messages[why] = err["message"].replace(repr(url), "URL")
    assert len(set(messages.values())) == 1, messages
    assert messages["missing"] == "messages[0].content[0].image_url: " + fetch.failure("URL").replace("'URL'", "URL")


def test_slow_fetches_do_not_hold_the_threads_other_requests_need(monkeypatch):
    """45 requests whose image trickles in (more than Starlette's 40 worker threads): a text request is still
    answered at once."""
    import asyncio

    import httpx

    from gemma_ane.server.app import build_app

    monkeypatch.setattr(fetch, "FETCH_SECONDS", 4.0)
    app = build_app(fake(), model_name="fake", remote_images=True, allow_fetch_from=["127.0.0.1"])

    async def run(base):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            slow = [asyncio.ensure_future(ask_async(c, remote(f"{base}/slow.png?{i}"))) for i in range(45)]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
            took = time.monotonic() - t0
            statuses = await asyncio.gather(*slow)
        return r, took, statuses

    with web({"/slow.png": (200, {}, SMALL[:200], 0.05)}) as base:
        r, took, statuses = asyncio.run(run(base))
    assert r.status_code == 200 and took < 1.5, took
    assert statuses == [400] * 45  # each cut at its deadline


async def ask_async(c, *parts) -> int:
    return (await c.post(CHAT, json={"messages": [{"role": "user", "content": list(parts)}]})).status_code


def test_a_bad_allow_fetch_from_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    import gemma_ane.runtime.model
    from gemma_ane.server import app as server

    monkeypatch.setattr(gemma_ane.runtime.model, "load", lambda bundle, **kw: pytest.fail("loaded despite a bad flag"))
    assert server.main([str(tmp_path), "--allow-remote-images", "--allow-fetch-from", "not a host"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gemma-ane serve: error: --allow-fetch-from: 'not a host': expected an address")
    flags = ["--allow-fetch-from", "10.0.0.0/8", "--allow-fetch-from", "0.0.0.0/0"]  # the fence off: refused too
    assert server.main([str(tmp_path), "--allow-remote-images", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "gemma-ane serve: error: --allow-fetch-from: '0.0.0.0/0': covers every address (the fence would be off)"
    )
