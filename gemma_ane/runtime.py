"""Load a bundle and generate: `load()`, `stream_generate()` (the loop everything wraps), `generate()`.

Torch-free: runs from a plain `pip install gemma-ane`. The backend is Core ML on macOS or the MIL
executor anywhere; the chunk I/O is read from the models themselves, so bundles converted
elsewhere (the seeds' published layout included) run too.
"""

from __future__ import annotations

import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from .bundle import BundleError, MILChunk, check_manifest, chunk_paths, load_host, prefill_paths
from .chat import ChatTemplate, OutputParser
from .engine import ContextOverflow, Engine
from .host import rope_tables, rotated_pairs
from .mil import read_json
from .sampling import Sampler, SamplingParams
from .spec import ModelSpec

STOP_IDS = (1, 106)  # <eos>, <turn|>


class CoreMLChunk:
    """The engine's backend over Core ML (macOS): one MLModel per function, one shared state."""

    UNITS = {"cpu_and_ne": "CPU_AND_NE", "cpu_only": "CPU_ONLY", "cpu_and_gpu": "CPU_AND_GPU", "all": "ALL"}

    def __init__(self, path: Path, compute_units: str = "cpu_and_ne"):
        import coremltools as ct

        if compute_units not in self.UNITS:
            raise BundleError(f"compute_units={compute_units!r}: choose one of {', '.join(self.UNITS)}")
        units = getattr(ct.ComputeUnit, self.UNITS[compute_units])
        self.path = Path(path)
        functions = self._functions(path)
        opener = ct.models.CompiledMLModel if self.path.suffix == ".mlmodelc" else ct.models.MLModel
        self.models = {f: opener(str(path), compute_units=units, function_name=f) for f in functions}
        first = self.models[functions[0]]
        self.interfaces = {f: _interface_of(m) for f, m in self.models.items()}
        self.state = first.make_state() if self.interfaces[functions[0]]["states"] else None

    @staticmethod
    def _functions(path: Path) -> list[str]:
        if path.suffix == ".mlpackage":
            from .mil import Package

            return Package.open(path).function_names
        # a compiled model: the published builds carry infer and prefill_b8
        return ["infer", "prefill_b8"] if "chunk_3" not in path.name else ["infer"]

    @property
    def functions(self) -> list[str]:
        return list(self.models)

    def reset_state(self) -> None:
        if self.state is not None:
            self.state = next(iter(self.models.values())).make_state()

    def predict(self, function: str, inputs: dict) -> dict:
        spec = self.interfaces[function]["inputs"]
        feed = {n: np.asarray(inputs[n]).astype(t["dtype"], copy=False) for n, t in spec.items()}
        return self.models[function].predict(feed, state=self.state) if self.state is not None \
            else self.models[function].predict(feed)


def _interface_of(mlmodel) -> dict:
    from .mil import _array_type

    spec = mlmodel.get_spec() if hasattr(mlmodel, "get_spec") else None
    if spec is None:
        return {"inputs": {}, "outputs": {}, "states": {}}
    desc = spec.description
    return {"inputs": {f.name: _array_type(f.type) for f in desc.input},
            "outputs": {f.name: _array_type(f.type) for f in desc.output},
            "states": {f.name: _array_type(f.type) for f in getattr(desc, "state", [])}}


@dataclass
class Result:
    text: str = ""
    reasoning: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    reused_tokens: int = 0
    time_to_first_token: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


@dataclass
class Event:
    """One streamed step: the token, the text it released (answer and/or reasoning), and, on the
    last event, why generation ended."""

    token: int | None = None
    text: str = ""
    reasoning: str = ""
    logprob: float | None = None
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


class Model:
    def __init__(self, root: Path, engine: Engine, tokenizer, template: ChatTemplate, generation: dict,
                 config: dict, backend: str, head: str):
        self.root, self.engine, self.tokenizer, self.template = root, engine, tokenizer, template
        self.generation, self.config, self.backend, self.head = generation, config, backend, head
        eos = generation.get("eos_token_id", [])
        eos = eos if isinstance(eos, list) else [eos]
        self.stop_ids = set(STOP_IDS) | {int(e) for e in eos} | {int(config.get("eos_token_id", 1))}
        self.cached: list[int] = []  # token ids whose K/V are in the caches, in order

    @property
    def context(self) -> int:
        return self.engine.context

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, prompt=None, messages=None, raw: bool = False, enable_thinking: bool = False,
                   system: str | None = None) -> list[int]:
        if messages is None:
            if prompt is None:
                raise ValueError("give a prompt or messages")
            if raw:
                if system:
                    raise ValueError("a raw prompt has no chat template, so it cannot take a system prompt")
                return [self.config.get("bos_token_id", 2)] + self.encode(prompt)
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode(self.template.render(messages, add_generation_prompt=True, enable_thinking=enable_thinking))

    def reset(self) -> None:
        self.engine.reset()
        self.cached = []

    def _prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Bring the caches to `ids` and return the last token's logits; reuses the longest exact
        cached prefix. A ring cache can be rewound only if nothing discarded had wrapped over a
        slot the kept prefix still needs (discarded positions all below the window), otherwise
        the run starts over."""
        common = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # the last prompt token must run to give logits
        # Keep only the steps a fresh run would also take: the same functions over the same
        # positions give bit-identical caches, while fp16 batched and single-step results differ.
        kept, p = 0, 0
        for (pos, function, T), (fresh_fn, fresh_T) in zip(self.engine.history, self.engine.plan(0, len(ids))):
            if pos != p or function != fresh_fn or T != fresh_T or p + T > common:
                break
            p += T
            kept = p
        common = kept
        # A discarded position q overwrote ring slot q - window, which the kept prefix still needs
        # when common < q < common + window: rewinding is exact only if nothing past `common` was
        # cached, or nothing cached had wrapped the ring yet.
        last = len(self.cached) - 1
        if last > common and last >= self.engine.window:
            common = 0
        if common == 0:
            self.engine.reset()
        self.engine.rewind(common)
        self.cached = []  # unknown until the feed completes: a failure midway must not be reused
        try:
            logits = self.engine.feed(ids[common:])[-1]
        except BaseException:
            self.reset()
            raise
        self.cached = list(ids)
        return logits, common

    def stream_generate(self, prompt=None, messages=None, *, max_tokens: int = 256, stop=None, raw: bool = False,
                        enable_thinking: bool = False, system: str | None = None, **sampling) -> Iterator[Event]:
        params = SamplingParams.from_generation_config(self.generation, **sampling)
        if self.head != "logits" and params.temperature != 0.0 and params.top_k != 1:
            raise ValueError("this bundle's chunk_3 returns only the argmax token (published layout): "
                             "sampling is not possible; use temperature=0")
        if isinstance(stop, str):
            stop = [stop]
        ids = self.prompt_ids(prompt, messages, raw=raw, enable_thinking=enable_thinking, system=system)
        if len(ids) > self.context:
            raise ContextOverflow(f"prompt of {len(ids)} tokens exceeds the context of {self.context}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens!r}: expected a non-negative integer")
        parser = OutputParser(self.tokenizer, stop)
        stats = self._stats = {"prompt_tokens": len(ids)}
        t0 = time.perf_counter()
        logits, stats["reused_tokens"] = self._prefill(ids)
        sampler = Sampler(params, history=ids)
        generated = 0
        finish = None
        t_first = None
        while max_tokens:
            token = self._pick(sampler, logits)
            if t_first is None:
                t_first = time.perf_counter()
                stats["ttft"] = t_first - t0
            # the published head returns the chosen id only: no distribution to report
            lp, top = (None, [])
            if self.head == "logits" and params.logprobs is not None:
                lp, top = sampler.logprobs(logits, token)
            generated += 1
            sampler.observe(token)
            if token in self.stop_ids:
                finish = "stop"
                delta = parser.finish()
                yield Event(token=token, text=delta.content, logprob=lp, top_logprobs=top)
                break
            delta = parser.add(token)
            yield Event(token=token, text=delta.content, reasoning=delta.reasoning, logprob=lp, top_logprobs=top)
            if parser.stopped:
                finish = "stop"
                break
            if generated >= max_tokens or self.engine.position >= self.context:
                finish = "length"  # no feed: chunk_3 runs only where a next token is needed
                break
            try:
                logits = self.engine.feed([token])[-1]
            except BaseException:
                self.reset()
                raise
            self.cached.append(token)
        finish = finish or "length"  # max_tokens=0
        end = time.perf_counter()
        tail = parser.finish() if finish == "length" else None
        stats["decode_s"] = end - (t_first or end)
        stats["generated"] = generated
        yield Event(text=tail.content if tail else "", finish_reason=finish)

    def _pick(self, sampler: Sampler, logits) -> int:
        if self.head != "logits":
            return int(logits[0])  # published head: chunk_3 already chose
        return sampler.sample(logits)

    def generate(self, prompt=None, messages=None, **kw) -> Result:
        r = Result()
        for ev in self.stream_generate(prompt, messages, **kw):
            r.text += ev.text
            r.reasoning += ev.reasoning
            if ev.token is not None:
                r.tokens.append(ev.token)
                r.logprobs.append(ev.logprob)
                r.top_logprobs.append(ev.top_logprobs)
            if ev.finish_reason:
                r.finish_reason = ev.finish_reason
        s = self._stats
        r.prompt_tokens, r.reused_tokens = s["prompt_tokens"], s["reused_tokens"]
        r.time_to_first_token = s.get("ttft", 0.0)
        new = s["prompt_tokens"] - s["reused_tokens"]
        r.prefill_tokens_per_s = new / r.time_to_first_token if r.time_to_first_token else 0.0
        r.decode_tokens_per_s = (s["generated"] - 1) / s["decode_s"] if s["generated"] > 1 and s["decode_s"] else 0.0
        return r


def generate(model: Model, prompt=None, messages=None, **kw) -> Result:
    return model.generate(prompt, messages, **kw)


def stream_generate(model: Model, prompt=None, messages=None, **kw) -> Iterator[Event]:
    return model.stream_generate(prompt, messages, **kw)


# -- loading ------------------------------------------------------------------------------------

REQUIRED = ("model_config.json", "embed_tokens_q8.bin", "embed_tokens_scales.bin", "embed_tokens_per_layer_q8.bin",
            "embed_tokens_per_layer_scales.bin", "hf_model/tokenizer.json")


def pick_backend(backend: str) -> str:
    if backend not in ("auto", "coreml", "mil"):
        raise BundleError(f"backend={backend!r}: choose auto, coreml or mil")
    if backend == "auto":
        backend = "coreml" if platform.system() == "Darwin" else "mil"
        print(f"backend: {backend} ({'Core ML' if backend == 'coreml' else 'MIL executor'})", file=sys.stderr)
    if backend == "coreml" and platform.system() != "Darwin":
        raise BundleError("backend=coreml: Core ML prediction needs macOS; use backend='mil' (the MIL executor)")
    return backend


def check_bundle(root: Path, sha256: bool = True) -> list[str]:
    """Every problem with a bundle, one line each: files missing or damaged."""
    root = Path(root)
    problems = [f"{root / f}: missing" for f in REQUIRED if not (root / f).is_file()]
    if (root / "manifest.json").exists():
        problems += check_manifest(root, sha256)
    try:
        chunk_paths(root)
    except BundleError as e:
        problems.append(str(e))
    return list(dict.fromkeys(problems))  # a file both required and in the manifest: report it once


def load(bundle, backend: str = "auto", compute_units: str = "cpu_and_ne", verify: bool = False,
         precision: str = "fp16", exact_rope: bool = True) -> Model:
    """Open and validate a bundle. `verify=True` also checks every file's sha256 against the manifest."""
    from tokenizers import Tokenizer

    root = Path(bundle)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    problems = check_bundle(root, sha256=verify)
    if problems:
        more = len(problems) - 1
        raise BundleError(problems[0] + (f" (and {more} more problem{'s' if more > 1 else ''}; see gemma-ane check)" if more else ""))
    backend = pick_backend(backend)
    config = read_json(root / "model_config.json")
    norm = root / "per_layer_norm_weight.bin"
    if norm.is_file() and norm.stat().st_size not in (2 * config["per_layer_dim"], 4 * config["per_layer_dim"]):
        # published builds store it as fp16 or fp32: tell the two apart by size, refuse anything else
        raise BundleError(f"{norm}: {norm.stat().st_size} bytes, expected {config['per_layer_dim']} fp16 or fp32 values")
    if backend == "mil":
        chunks = [MILChunk(p, precision) for p in chunk_paths(root)]
        interfaces = [{f: m.interface for f, m in c.models.items()} for c in chunks]
    else:
        chunks = [CoreMLChunk(p, compute_units) for p in chunk_paths(root)]
        interfaces = [c.interfaces for c in chunks]
    if len(chunks) != 3:
        raise BundleError(f"{root}: expected chunk_1..chunk_3, found {len(chunks)} chunks")
    first = interfaces[0]["infer"]["inputs"]
    context = first["causal_mask_full"]["shape"][-1]
    window = first["causal_mask_sliding"]["shape"][-1]
    head_outputs = interfaces[2]["infer"]["outputs"]
    head = "logits" if "logits" in head_outputs else "token_id"
    if head == "token_id":
        chunks[2] = _ArgmaxHead(chunks[2])
    host = load_host(root, config)
    _check_rope(root, host, context, exact_rope)
    engine = Engine(chunks, host, context=context, window=window, **prefill_paths(interfaces[0]))
    engine.logits_dtype = None  # the sampler reads fp16 logits directly
    tokenizer = Tokenizer.from_file(str(root / "hf_model" / "tokenizer.json"))
    template = _template(root / "hf_model")
    gen_path = root / "hf_model" / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else {}
    return Model(root, engine, tokenizer, template, generation, config, backend, head)


class _ArgmaxHead:
    """Adapts the published chunk_3 (token_id + token_logit) to the engine's logits interface:
    the 'logits' it returns is just the chosen id, which `Model._pick` takes as is."""

    def __init__(self, inner):
        self.inner = inner

    def reset_state(self):
        self.inner.reset_state()

    def predict(self, function, inputs):
        out = self.inner.predict(function, inputs)
        return {"logits": np.asarray(out["token_id"], np.float32).reshape(1, 1, 1)}


def _template(hf: Path) -> ChatTemplate:
    source = None
    if (hf / "chat_template.jinja").is_file():
        source = (hf / "chat_template.jinja").read_text()
    cfg = {}
    if (hf / "tokenizer_config.json").is_file():
        cfg = read_json(hf / "tokenizer_config.json")
        if source is None and isinstance(cfg.get("chat_template"), str):
            source = cfg["chat_template"]
    tok = lambda k, d: cfg.get(k) if isinstance(cfg.get(k), str) else d
    return ChatTemplate(source, bos_token=tok("bos_token", "<bos>"), eos_token=tok("eos_token", "<eos>"))


def _check_rope(root: Path, host, context: int, exact: bool) -> None:
    """The published full-layer tables rotate all pairs, transformers only partial_rotary_factor
    of them (SPEC §4): detect it, warn once, and use tables computed from the config."""
    cfg_path = root / "hf_model" / "config.json"
    if not cfg_path.is_file():
        return
    spec = ModelSpec.from_pretrained(cfg_path)
    for layer_type, (cos, sin) in list(host.rope.items()):
        allowed = spec.rope[layer_type].rotated_pairs
        if cos.shape[0] < context:
            raise BundleError(f"{root}: RoPE table for {layer_type} has {cos.shape[0]} rows, fewer than the context {context}")
        probe = [1, min(1000, cos.shape[0] - 1)]  # row 0 is position 0: nothing rotates there
        found = rotated_pairs(np.asarray(cos[probe]), np.asarray(sin[probe]))
        if found > allowed:
            warnings.warn(f"{root}: {layer_type} RoPE tables rotate {found} pairs but the config allows {allowed} "
                          f"(partial_rotary_factor); " + ("using exact tables computed from the config" if exact
                                                          else "using them as they are"), stacklevel=3)
            if exact:
                host.rope[layer_type] = rope_tables(spec, context)[layer_type]
