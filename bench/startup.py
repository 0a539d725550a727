"""Start-up on the runtime path: `import gemma_ane`, `load` a bundle and generate one token, in a fresh process.

    python bench/startup.py BUNDLE [--backend mil] [--runs 3] [--record]
    python bench/startup.py --quick      # one run; converts a tiny e2b-mini bundle if none is given

Each run is a new interpreter under `python -X importtime`, so nothing is cached in memory: it prints the seconds
to import gemma_ane, to load the bundle, to the first token, and in all, and which of torch, transformers,
scikit-learn and the coremltools package the runtime path imported (it needs none of them) with their cumulative
import time. The median run is shown. Appends the table to BENCHMARKS.md only with --record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, tiny_bundle  # noqa: E402

# modules the runtime path must not need; their top-level import names as importtime prints them
# (the coremltools package: its __init__ is what drags the others in; its generated protobuf modules are read alone)
BANNED = {"torch": "torch", "transformers": "transformers", "sklearn": "scikit-learn", "coremltools": "coremltools"}

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import gemma_ane
t1 = time.perf_counter()
model = gemma_ane.load(sys.argv[1], backend=sys.argv[2])
t2 = time.perf_counter()
model.generate(prompt="Hi", max_tokens=1)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "token": t3 - t2, "total": t3 - t0}))
"""


def banned_imports(importtime: str) -> dict[str, float]:
    """{banned module: cumulative import seconds} from `-X importtime`'s stderr (top-level entries only)."""
    found = {}
    for line in importtime.splitlines():
        if not line.startswith("import time:"):
            continue
        _, cumulative, name = (x.strip() for x in line[len("import time:") :].split("|"))
        if name in BANNED and cumulative.isdigit():
            found[BANNED[name]] = max(found.get(BANNED[name], 0.0), int(cumulative) / 1e6)
    return found


def run_once(bundle: Path, backend: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", CHILD, str(bundle), backend], capture_output=True, text=True
    )
    if r.returncode != 0:
        tail = [line for line in r.stderr.splitlines() if not line.startswith("import time:")][-5:]
        sys.exit(f"startup: the run failed (exit {r.returncode}): {' / '.join(tail)}")
    times = json.loads(r.stdout.strip().splitlines()[-1])
    times["banned"] = banned_imports(r.stderr)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?", type=Path, help="the bundle to load (--quick: a tiny one if none)")
    p.add_argument("--backend", default="mil", choices=["auto", "coreml", "mil"], help="(default: mil)")
    p.add_argument("--runs", type=int, default=3, help="fresh processes, the median shown (default: 3)")
    p.add_argument("--quick", action="store_true", help="one run on a tiny bundle; never recorded")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md")
    args = p.parse_args()
    if args.bundle is None and not args.quick:
        p.error("give a BUNDLE, or --quick")
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle or tiny_bundle(Path(tmp), bits=16)
        runs = [run_once(bundle, args.backend) for _ in range(1 if args.quick else args.runs)]
    median = {k: statistics.median(r[k] for r in runs) for k in ("import", "load", "token", "total")}
    banned = runs[len(runs) // 2]["banned"]
    imported = ", ".join(f"{m} ({s:.1f} s cumulative)" for m, s in sorted(banned.items())) or "none"
    body = (
        f"bundle `{bundle.name if args.bundle is None else args.bundle}`, backend {args.backend}, "
        f"median of {len(runs)} fresh process(es)\n\n"
        "| import gemma_ane | load | first token | in all |\n|---|---|---|---|\n"
        f"| {median['import']:.2f} s | {median['load']:.2f} s | {median['token']:.2f} s | {median['total']:.2f} s |\n\n"
        f"torch, transformers, scikit-learn or the coremltools package imported on the way: {imported}"
    )
    publish("Start-up: import, load and one token", body, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
