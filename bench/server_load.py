"""Load on the OpenAI-compatible server: short chat requests from concurrent clients over loopback.

    python bench/server_load.py BUNDLE [--requests 200] [--clients 4] [--max-tokens 8] [--backend auto]
    python bench/server_load.py --quick      # 20 requests; converts a tiny e2b-mini bundle if none is given

Starts `python -m gemma_ane.server.app` on a free loopback port, sends a fixed number of requests
(each with its own seed) from the clients, checks that every one answered 200 with a finish
reason and the asked-for usage, and prints p50/p99 latency and throughput. Latency includes the
wait in the server's queue: with one engine, clients share it. Appends the table to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, tiny_bundle  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen | None) -> None:
    """Stop a server start_server began (None: it never started): politely, then for good after 30 s."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(bundle: Path, backend: str, clients: int, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # the queue holds every client's request but the running one: none is refused
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gemma_ane.server.app",
            str(bundle),
            "--port",
            str(port),
            "--backend",
            backend,
            "--max-queue",
            str(clients),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not come up (see its log above)")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile: a latency some request actually had."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


async def load(url: str, requests: int, clients: int, max_tokens: int) -> tuple[list[float], list[str], int]:
    """(latencies in s, failures, completion tokens) for `requests` requests from `clients` clients."""
    latencies, failures, tokens = [], [], 0
    todo = iter(range(requests))

    async def client(c: httpx.AsyncClient):
        nonlocal tokens
        for i in todo:  # the shared iterator bounds the total
            body = {
                "messages": [{"role": "user", "content": f"request {i}: say something short"}],
                "max_tokens": max_tokens,
                "seed": i,
            }
            t = time.perf_counter()
            try:
                r = await c.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as e:
                failures.append(f"request {i}: {type(e).__name__}: {e}")
                continue
            latencies.append(time.perf_counter() - t)
            if r.status_code != 200:
                failures.append(f"request {i}: HTTP {r.status_code}: {r.text[:200]}")
                continue
            out = r.json()
            usage = out.get("usage", {})
            if (
                out["choices"][0].get("finish_reason") not in ("stop", "length")
                or not 0 < usage.get("completion_tokens", 0) <= max_tokens
            ):
                failures.append(f"request {i}: unexpected answer {str(out)[:200]}")
                continue
            tokens += usage["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await asyncio.gather(*(client(c) for _ in range(clients)))
    return latencies, failures, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?")
    p.add_argument("--requests", type=int)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--backend", default="auto", choices=["auto", "coreml", "mil"])
    p.add_argument("--quick", action="store_true", help="20 requests; a tiny bundle on the MIL backend if none given")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    if not a.bundle and not a.quick:
        p.error("give a BUNDLE, or --quick")
    requests = a.requests or (20 if a.quick else 200)
    if requests < 1 or a.clients < 1 or a.max_tokens < 1:
        p.error("--requests, --clients and --max-tokens must be >= 1")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bundle = Path(a.bundle) if a.bundle else tiny_bundle(tmp, bits=16)
        backend = "mil" if a.quick and not a.bundle else a.backend
        with open(tmp / "server.log", "wb") as log:
            proc, url = None, None
            try:
                proc, url = start_server(bundle, backend, a.clients, log)
                t0 = time.perf_counter()
                latencies, failures, tokens = asyncio.run(load(url, requests, a.clients, a.max_tokens))
                wall = time.perf_counter() - t0
            except RuntimeError as e:
                print((tmp / "server.log").read_text(errors="replace")[-3000:], file=sys.stderr)
                print(f"error: {e}", file=sys.stderr)
                return 1
            finally:
                stop_server(proc)

    lat = sorted(latencies)
    name = "e2b-mini (quick)" if a.quick and not a.bundle else bundle.name
    table = "\n".join(
        [
            f"bundle `{name}`, backend {backend}: {requests} chat requests of max_tokens={a.max_tokens} from "
            f"{a.clients} concurrent clients over loopback",
            "",
            "| requests ok | p50 latency | p99 latency | mean latency | requests/s | completion tokens/s |",
            "|---|---|---|---|---|---|",
            f"| {requests - len(failures)}/{requests} | {1000 * percentile(lat, 0.5):.0f} ms "
            f"| {1000 * percentile(lat, 0.99):.0f} ms "
            f"| {1000 * sum(lat) / len(lat):.0f} ms | {requests / wall:.1f} | {tokens / wall:.1f} |"
            if lat
            else f"| 0/{requests} | - | - | - | - | - |",
        ]
    )
    print(table)
    for f in failures[:10]:
        print(f, file=sys.stderr)
    if failures:
        print(f"FAILED: {len(failures)} of {requests} requests", file=sys.stderr)
        return 1
    if a.record:
        record("Server load (gemma-ane serve)", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
