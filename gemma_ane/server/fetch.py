"""Remote image URLs for `serve --allow-remote-images`: fetched for a client, so fenced in.

- Only public addresses: a host's addresses are resolved first and every one must be global unicast (no loopback,
  link-local such as 169.254.169.254, private, unspecified, multicast or reserved ranges, IPv4 mapped into IPv6
  included), unless `--allow-fetch-from` names the host or a network holding the address. The connection goes to
  the address that was checked, so a second DNS answer cannot swap it (rebinding); every redirect is checked again.
- One deadline per fetch (FETCH_SECONDS for the lookups, connections, redirects and every byte): when it passes,
  the socket is shut down, so a server trickling bytes cannot hold the fetch.
- A pool of FETCH_THREADS threads of its own: a slow fetch never occupies a thread other requests need.
- One error text for every failure: a client cannot tell a refused address from a closed port or a timeout (a
  port scanner); the reason goes to the server's log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from urllib.parse import urljoin, urlsplit

from ..errors import GemmaAneError, InputError

log = logging.getLogger("gemma_ane.server.app")

FETCH_SECONDS = 10.0  # one fetch, start to end: lookups, connections, redirects and the whole body
FETCH_THREADS = 4  # fetches running at once; more wait their turn (within their own deadline)
MAX_REDIRECTS = 5
_CHUNK = 65536
_REDIRECTS = (301, 302, 303, 307, 308)


class FetchError(GemmaAneError):
    """Why a fetch failed: for the log only (the client gets `failure`'s text). The request's fault, but
    not a ValueError: `fetch` turns the ValueErrors it meets into FetchErrors, never its own."""

    status = 400


def failure(url: str) -> str:
    """What a client is told about any failed fetch, whatever the reason."""
    return f"could not fetch {url[:80]!r} (only http(s) images on public addresses are fetched)"


# What no allowlist entry may open up. This machine: loopback, and the unspecified address (a connection to 0.0.0.0
# reaches it); a network of them is refused, one loopback address named alone is allowed (a local image server).
# Link-local (169.254.169.254 is the cloud's metadata service) never, not even one address. IPv4-mapped IPv6 forms too.
_THIS_MACHINE = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128", "::ffff:127.0.0.0/104")]
_UNSPECIFIED = [ipaddress.ip_network(n) for n in ("0.0.0.0/32", "::/128", "::ffff:0.0.0.0/128")]
_LINK_LOCAL = [ipaddress.ip_network(n) for n in ("169.254.0.0/16", "fe80::/10", "::ffff:169.254.0.0/112")]


def _network(entry: str):
    """The network an entry names, or None for a host name; refuses what would open the fence wide."""
    try:
        network = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None
    try:
        ipaddress.ip_network(entry)  # strict: 10.0.0.1/8 is a typo for an address or for the network holding it
    except ValueError:
        raise InputError(f"allow_fetch_from: {entry!r}: host bits set (the network is {network})") from None

    def overlaps(ranges) -> bool:
        return any(network.version == r.version and network.overlaps(r) for r in ranges)

    if network.prefixlen == 0:
        raise InputError(f"allow_fetch_from: {entry!r}: covers every address (the fence would be off)")
    if overlaps(_UNSPECIFIED) or (network.num_addresses > 1 and overlaps(_THIS_MACHINE)):
        raise InputError(
            f"allow_fetch_from: {entry!r}: covers this machine's addresses (name the one loopback "
            "address an image server listens on, e.g. 127.0.0.1)"
        )
    if overlaps(_LINK_LOCAL):
        raise InputError(
            f"allow_fetch_from: {entry!r}: covers link-local addresses (169.254.169.254 is the cloud's "
            "metadata service)"
        )
    return network


class Allowlist:
    """Hosts and networks a fetch may reach though their addresses are not public (serve --allow-fetch-from):
    each entry is an address or CIDR network (10.0.0.0/8, ::1), or a host name, matched exactly. A network that
    covers every address, a link-local one or this machine's, or one written with host bits set (10.0.0.1/8) is
    refused, as is a name no DNS can hold (all digits in its last label, such as 300.1.1.1)."""

    def __init__(self, entries=()):
        self.networks, self.hosts = [], set()
        for entry in entries:
            if not isinstance(entry, str) or not entry.strip():
                raise InputError(f"allow_fetch_from: {entry!r}: expected an address, a CIDR network or a host name")
            network = _network(entry.strip())
            if network is not None:
                self.networks.append(network)
                continue
            host = entry.strip().lower().rstrip(".")
            labels = host.split(".")
            if not all(part and part.replace("-", "").isalnum() for part in labels) or labels[-1].isdigit():
                raise InputError(
                    f"allow_fetch_from: {entry!r}: expected an address, a CIDR network or a host name"
                ) from None
            self.hosts.add(host)

    def allows(self, host: str, address) -> bool:
        return host.lower().rstrip(".") in self.hosts or any(address in n for n in self.networks)


def is_public(address) -> bool:
    """Whether an address is global unicast: one any client could name without reaching this server's networks."""
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    return address.is_global and not address.is_multicast


def resolve(host: str, port: int, allow: Allowlist) -> str:
    """The address to connect to: the first of the host's, once every one of them is public (or allowed)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise FetchError(f"{host}: no address ({e})") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    refused = [a for a in addresses if not (is_public(a) or allow.allows(host, a))]
    if not addresses or refused:
        raise FetchError(f"{host}: resolves to a non-public address {', '.join(map(str, refused))}")
    return str(addresses[0])


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to the checked address, whatever the name resolves to by now."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout)
        self.address, self.raw = address, None  # raw: the TCP socket, kept when the response takes over `sock`

    def connect(self):
        self.sock = self.raw = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    """HTTPS to the checked address; the certificate is verified for the URL's host name."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address, self.raw = address, None  # raw: the TCP socket, kept when the response takes over `sock`

    def connect(self):
        self.raw = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(self.raw, server_hostname=self.host)


def fetch(url: str, max_bytes: int, allow: Allowlist, deadline: float) -> bytes:
    """The file at `url`: at most max_bytes + 1 bytes (one more says it is too large), by `deadline`
    (time.monotonic()). Raises FetchError with the reason."""
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchError(f"not an http(s) URL: {url[:80]!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise FetchError(str(e)) from None
        if time.monotonic() >= deadline:  # e.g. it waited in the pool that long
            raise FetchError(f"took longer than {FETCH_SECONDS:g} s")
        address = resolve(parts.hostname, port, allow)
        left = deadline - time.monotonic()
        if left <= 0:
            raise FetchError(f"took longer than {FETCH_SECONDS:g} s")
        kind = _PinnedTLS if parts.scheme == "https" else _Pinned
        conn = kind(parts.hostname, port, address, timeout=left)
        # at the deadline the socket is shut down: any read or connect under way fails at once
        timer = threading.Timer(left, _shut, (conn,))
        timer.start()
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", path, headers={"User-Agent": "gemma-ane", "Accept": "image/*"})
            response = conn.getresponse()
            if response.status in _REDIRECTS:
                location = response.getheader("Location")
                if not location:
                    raise FetchError(f"HTTP {response.status} without a Location")
                url = urljoin(url, location)
                continue
            if response.status != 200:
                raise FetchError(f"HTTP {response.status} {response.reason}")
            data = bytearray()
            while len(data) <= max_bytes:
                chunk = response.read1(min(_CHUNK, max_bytes + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
            if time.monotonic() > deadline:
                raise FetchError(f"took longer than {FETCH_SECONDS:g} s")
            return bytes(data)
        except (OSError, ValueError, http.client.HTTPException) as e:
            late = time.monotonic() > deadline
            raise FetchError(f"took longer than {FETCH_SECONDS:g} s" if late else f"{type(e).__name__}: {e}") from None
        finally:
            timer.cancel()
            conn.close()
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


def _shut(conn) -> None:
    sock = conn.raw
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass


class Fetcher:
    """The server's fetches, on a bounded pool of their own; awaited on the event loop, so a waiting request holds
    no thread."""

    def __init__(self, allow: Allowlist, max_bytes: int, threads: int = FETCH_THREADS):
        self.allow, self.max_bytes = allow, max_bytes
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="gemma-ane-fetch")

    async def __call__(self, urls) -> dict[str, bytes | None]:
        """Each URL's file, or None when its fetch failed (the reason logged); all within one FETCH_SECONDS."""
        deadline = time.monotonic() + FETCH_SECONDS
        futures = {u: self.pool.submit(fetch, u, self.max_bytes, self.allow, deadline) for u in dict.fromkeys(urls)}
        out = {}
        for url, future in futures.items():
            try:
                out[url] = await asyncio.wait_for(
                    asyncio.wrap_future(future), max(0.0, deadline - time.monotonic()) + 0.5
                )
            except FetchError as e:
                log.info("fetching %r failed: %s", url[:200], e)
                out[url] = None
            except asyncio.TimeoutError:
                future.cancel()  # still queued: it never starts
                log.info("fetching %r failed: took longer than %g s", url[:200], FETCH_SECONDS)
                out[url] = None
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
