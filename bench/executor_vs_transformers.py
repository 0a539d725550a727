"""Decode and prefill speed of our MIL executor against transformers on CPU, same checkpoint.

    python bench/executor_vs_transformers.py CKPT --bundle4 B4 [--bundle16 B16] [--rounds 2]
    python bench/executor_vs_transformers.py CKPT --bundle4 B4 --quick     # tiny, for the test suite

Every measurement runs in its own child process, in alternating rounds (executor 4-bit, executor
16-bit, transformers bf16, transformers fp32, then again), so a noisy neighbour or a warm page
cache does not favour one side; peak RSS is the child's ru_maxrss. The same random prompt of
`--prompt` tokens, then `--tokens` greedy decode steps:

- executor: the runtime's engine with the bundle's own prompt schedule (KV-only prefill where the
  bundle has it), argmax decode: the runtime's path minus sampling (bench/host_overhead.py);
- transformers: `generate(do_sample=False)` on the checkpoint loaded by transformers'
  `from_pretrained`; a streamer timestamps the first token (prefill) and the rest (decode). fp32 runs
  only when it fits in the memory available.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

GiB = 2**30


# -- workers (each in its own process) -------------------------------------------------------------


def prompt_ids(vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(0)
    return [2] + rng.integers(min(1000, vocab // 2), min(vocab, 200000), n - 1).tolist()  # <bos> + ordinary tokens


def run_executor(bundle: str, n_prompt: int, n_decode: int) -> dict:
    from gemma_ane.bundle import open_bundle
    from gemma_ane.runtime.backend import open_engine
    from gemma_ane.runtime.device import Device

    t = time.perf_counter()
    engine = open_engine(open_bundle(bundle, check=False), Device.of("mil"))
    load = time.perf_counter() - t
    vocab = json.loads((Path(bundle) / "model_config.json").read_text())["vocab_size"]
    ids = prompt_ids(vocab, n_prompt)
    t = time.perf_counter()
    logits = engine.feed(ids)[-1]
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_decode):
        logits = engine.feed([int(np.argmax(logits))])[-1]
    decode = time.perf_counter() - t
    schedule = sorted({f for _, f, _ in engine.history[:-n_decode]})
    return {
        "load_s": load,
        "prefill_tok_s": n_prompt / prefill,
        "decode_tok_s": n_decode / decode,
        "prefill_functions": schedule,
    }


def load_transformers(ckpt: str, dtype: str):
    """transformers' own loader on the multimodal checkpoint. It holds the text tower only, so the
    small vision and audio towers get random weights (they are never run on a text prompt)."""
    import torch
    from transformers import Gemma4ForConditionalGeneration
    from transformers.utils import logging

    logging.set_verbosity_error()  # the towers' "newly initialized" weights are expected
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch_dtype).eval()


class Stamps:
    """A generate() streamer that timestamps every put(): the prompt, then each new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_transformers(ckpt: str, dtype: str, n_prompt: int, n_decode: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    t = time.perf_counter()
    model = load_transformers(ckpt, dtype)
    load = time.perf_counter() - t
    ids = torch.tensor([prompt_ids(model.config.text_config.vocab_size, n_prompt)])
    stamps = Stamps()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            max_new_tokens=n_decode + 1,
            min_new_tokens=n_decode + 1,
            do_sample=False,
            streamer=stamps,
            attention_mask=torch.ones_like(ids),
        )
    # times[0]: the prompt was handed over; times[1]: first new token; then one per decode step
    first, rest = stamps.times[1] - t0, stamps.times[-1] - stamps.times[1]
    return {"load_s": load, "prefill_tok_s": n_prompt / first, "decode_tok_s": n_decode / rest}


def main_worker(a) -> None:
    if a.worker == "executor":
        result = run_executor(a.target, a.prompt, a.tokens)
    else:
        result = run_transformers(a.target, a.worker.split("-")[1], a.prompt, a.tokens)
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver ------------------------------------------------------------------------------------


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def checkpoint_bytes(ckpt: str) -> int:
    return sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))


def spawn(worker: str, target: str, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", worker, target, "--prompt", str(a.prompt), "--tokens", str(a.tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {worker} on {target} failed (exit {os.waitstatus_to_exitcode(status)})")
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT ") :]), "peak_rss": usage.ru_maxrss * 1024}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", help="checkpoint directory (a bundle, with --worker executor)")
    p.add_argument("--worker", choices=["executor", "transformers-bf16", "transformers-fp32"], help=argparse.SUPPRESS)
    p.add_argument("--bundle4")
    p.add_argument("--bundle16")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--tokens", type=int, default=16, help="decode steps timed (default 16)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one short round, not recorded (for the test suite)")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    if a.worker:
        return main_worker(a)
    if not a.bundle4:
        p.error("--bundle4 is required")
    if a.quick:
        a.rounds, a.prompt, a.tokens = 1, 12, 4
    runs = [("executor, 4-bit bundle", "executor", a.bundle4)]
    if a.bundle16:
        runs.append(("executor, 16-bit bundle", "executor", a.bundle16))
    runs.append(("transformers bf16", "transformers-bf16", a.target))
    fp32_need = 2 * checkpoint_bytes(a.target) * 1.25  # bf16 -> fp32, plus activations and the runtime
    fp32_note = ""
    if mem_available() > fp32_need:
        runs.append(("transformers fp32", "transformers-fp32", a.target))
    else:
        fp32_note = (
            f"transformers fp32 skipped: needs ~{fp32_need / GiB:.1f} GiB, {mem_available() / GiB:.1f} GiB available"
        )
    results = {label: [] for label, _, _ in runs}
    for r in range(a.rounds):
        for label, worker, target in runs:
            res = spawn(worker, target, a)
            print(
                f"round {r + 1}: {label}: prefill {res['prefill_tok_s']:.2f} tok/s, "
                f"decode {res['decode_tok_s']:.2f} tok/s, "
                f"peak RSS {res['peak_rss'] / GiB:.2f} GiB",
                flush=True,
            )
            results[label].append(res)
    lines = [
        f"Prompt {a.prompt} tokens, {a.tokens} greedy decode steps, {a.rounds} alternating round(s); "
        "median over rounds.",
        "",
        "| run | prefill tok/s | decode tok/s | load s | peak RSS |",
        "|---|---:|---:|---:|---:|",
    ]

    def med(label, k):
        return float(np.median([x[k] for x in results[label]]))

    for label in results:
        lines.append(
            f"| {label} | {med(label, 'prefill_tok_s'):.2f} | {med(label, 'decode_tok_s'):.2f} | "
            f"{med(label, 'load_s'):.0f} | {max(x['peak_rss'] for x in results[label]) / GiB:.2f} GiB |"
        )
    if fp32_note:
        lines += ["", fp32_note]
    ours, theirs = med("executor, 4-bit bundle", "decode_tok_s"), med("transformers bf16", "decode_tok_s")
    lines += [
        "",
        f"- executor 4-bit decode / transformers bf16 decode: **{ours / theirs:.2f}×** "
        f"(target >= 1: {'met' if ours >= theirs else 'missed'})",
    ]
    sched = results["executor, 4-bit bundle"][0]["prefill_functions"]
    lines.append(f"- executor prompt schedule used: {', '.join(sched)}")
    publish("MIL executor vs transformers (CPU)", "\n".join(lines), a)


if __name__ == "__main__":
    main()
