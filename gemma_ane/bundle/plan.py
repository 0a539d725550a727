"""How the model is cut into Core ML chunks (ChunkPlan): each chunk's layers, states, functions and the
tensors it takes and hands on, for any number of chunks; and the boundaries a size budget chooses.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from .ladder import check_contexts, rung_function
from .spec import FULL, SLIDING, ConfigError, ModelSpec

F16, I32 = "float16", "int32"


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: str = F16

    def to_json(self):
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Chunk:
    name: str
    layers: tuple[int, ...]
    stateful: bool
    # cache-owning layers of this chunk by type, in layer order; slot 2j holds K and 2j+1 V of the j-th
    sliding_layers: tuple[int, ...]
    full_layers: tuple[int, ...]
    states: dict  # name -> Tensor
    # function name -> {"T": int, "inputs": {name: Tensor}, "outputs": {name: Tensor}}; a smaller rung's functions
    # (ladder.py: ctx{C}_...) also hold "states", their own
    functions: dict
    has_head: bool
    computes_ple: bool

    def slot(self, layer: int) -> tuple[str, int]:
        """(state name, K row) of a cache-owning layer of this chunk."""
        if layer in self.sliding_layers:
            return "kv_cache_sliding", 2 * self.sliding_layers.index(layer)
        return "kv_cache_full", 2 * self.full_layers.index(layer)

    def to_json(self):
        return {
            "name": self.name,
            "layers": list(self.layers),
            "states": {k: v.to_json() for k, v in self.states.items()},
            "functions": {
                f: {
                    "inputs": {k: v.to_json() for k, v in io["inputs"].items()},
                    "outputs": {k: v.to_json() for k, v in io["outputs"].items()},
                    **({"states": {k: v.to_json() for k, v in io["states"].items()}} if "states" in io else {}),
                }
                for f, io in self.functions.items()
            },
        }


def kv_name(layer: int, which: str) -> str:
    return f"kv{layer}_{which}"


@dataclass(frozen=True)
class ChunkPlan:
    spec: ModelSpec
    context: int
    prefill_batch: int
    split: tuple[int, ...]  # N-1 layer boundaries: chunk_{k+1} starts at split[k-1]
    chunks: tuple[Chunk, ...]
    draft_tokens: int = 0  # K: verify_b{K+1} checks K drafts (speculative decoding); 0 = no drafter
    contexts: tuple[int, ...] = ()  # the ladder's rungs, ascending, the last `context` (ladder.py); () = none

    @property
    def window(self) -> int:
        return min(self.spec.sliding_window, self.context)

    @property
    def ring(self) -> int:
        """Slots of the sliding caches (CONTRACT §3): the window, plus room for a verify batch's rows."""
        return ring_slots(self.spec.sliding_window, self.draft_tokens, self.kv_batches)

    @property
    def kv_batches(self) -> tuple[int, ...]:
        return tuple(int(f[len("prefill_kv_b") :]) for f in self.chunks[0].functions if f.startswith("prefill_kv_b"))

    def to_json(self):
        return {
            "context": self.context,
            "prefill_batch": self.prefill_batch,
            "split": list(self.split),
            "draft_tokens": self.draft_tokens,
            **({"contexts": list(self.contexts)} if self.contexts else {}),
            "chunks": [c.to_json() for c in self.chunks],
        }

    def rung_io(self, chunk: Chunk, function: str, context: int) -> dict:
        """`function` of `chunk` on the rung of `context` (the plan's own context: its plain-named functions)."""
        return chunk.functions[rung_function(function, context, self.context)]

    def rung_states(self, chunk: Chunk, context: int) -> dict:
        """The states `chunk` has on the rung of `context`."""
        return self.rung_io(chunk, "infer", context).get("states", chunk.states)

    def hands_on(self, chunk: Chunk) -> list[str]:
        """The producer caches a chunk returns for later chunks (kv{p}_k / kv{p}_v)."""
        return [n for n in chunk.functions["infer"]["outputs"] if n.startswith("kv")]

    def reads(self, chunk: Chunk) -> list[str]:
        """The producer caches a chunk takes from earlier chunks."""
        return [n for n in chunk.functions["infer"]["inputs"] if n.startswith("kv")]

    def describe(self, bits: int) -> list[dict]:
        """Each chunk's role as a runtime wires it: its layers, states, what it takes from and hands on to
        other chunks, whether it computes the PLE or holds the head, and its weights in MB at `bits`."""
        return [
            {
                "name": c.name,
                "layers": list(c.layers),
                "stateful": c.stateful,
                "states": sorted(c.states),
                "computes_ple": c.computes_ple,
                "reads": self.reads(c),
                "hands_on": self.hands_on(c),
                "head": c.has_head,
                "functions": list(c.functions),
                "weight_mb": round(chunk_weight_bytes(self.spec, c.layers, c.computes_ple, c.has_head, bits) / 1e6, 1),
            }
            for c in self.chunks
        ]

    def device_cost(self, bits: int) -> list[dict]:
        """Each chunk's weights and what its function set would wire on a device (`device_cost`), from the sizes
        `describe` estimates at `bits`."""
        roles = self.describe(bits)
        return device_cost(
            (r["name"], r["weight_mb"] * 1e6, dict.fromkeys(r["functions"], r["weight_mb"] * 1e6)) for r in roles
        )

    @staticmethod
    def default_split(spec: ModelSpec) -> tuple[int, int]:
        # The published layout's E2B split (0-7 / 8-24 / 25-34): halve the cache owners, halve the sharers.
        first = spec.first_shared_layer
        return math.ceil(first / 2), first + math.ceil(spec.num_kv_shared_layers / 2)

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        context: int = 2048,
        prefill_batch: int = 8,
        split: tuple[int, int] | None = None,
        head: str = "logits",
        kv_batches: tuple[int, ...] = (),
        draft_tokens: int = 0,
        functions: tuple[str, ...] | None = None,
        contexts: tuple[int, ...] | None = None,
    ) -> ChunkPlan:
        """split: the N-1 layer boundaries of N chunks (default: the published layout's three, `default_split`).
        head="logits" (ours) or "token_id" (the published layout's argmax head: greedy only).
        kv_batches: batch sizes of the KV-only prefill functions `prefill_kv_b{T}`.
        draft_tokens: K > 0 adds `verify_b{K+1}` to every chunk (the last token and K drafts in one call, logits for
        every row) and the last chunk's `final_hidden` output (what the drafter reads), and pads the rings
        (`ring_slots`).
        functions: the functions every chunk carries when it can (`select_functions`: names, kinds or a profile's
        list; None: all). A KV-only batch left out does not pad the ring; a verify function left out keeps the
        drafter's padding and outputs, so the bundle's layout does not depend on it.
        contexts: a ladder's rungs (ladder.py), ascending; `context` must be the largest. Every chunk then also
        carries each of its functions per smaller rung C, as ctx{C}_{function}, with states and hand-offs for C."""
        if contexts:
            contexts = check_contexts(spec, contexts)
            if context != contexts[-1]:
                raise ConfigError(f"context={context}: a ladder's context is its largest rung ({contexts[-1]})")
            options = (prefill_batch, split, head, kv_batches, draft_tokens, functions)
            top = cls.build(spec, context, *options)
            return top._with_rungs([cls.build(spec, c, *options) for c in contexts[:-1]], contexts)
        _check_options(spec, context, prefill_batch, head, kv_batches, draft_tokens)
        split = tuple(split) if split is not None else cls.default_split(spec)
        _check_split(spec, split)
        every = [
            "infer",
            f"prefill_b{prefill_batch}",
            *(f"prefill_kv_b{T}" for T in sorted(set(kv_batches), reverse=True)),
        ]
        every += [f"verify_b{draft_tokens + 1}"] * bool(draft_tokens)
        carried = select_functions(functions, every)
        kv_batches = tuple(T for T in kv_batches if f"prefill_kv_b{T}" in carried)
        R = ring_slots(spec.sliding_window, draft_tokens, kv_batches)
        bounds = [0, *split, spec.num_layers]
        io = _PlanIO(spec, context, R, head, draft_tokens > 0, tuple(zip(bounds, bounds[1:])))
        chunks = []
        for ci, (lo, hi) in enumerate(io.spans):
            layers = tuple(range(lo, hi))
            owners = [i for i in layers if spec.owns_cache(i)]
            sliding = tuple(i for i in owners if spec.is_sliding(i))
            full = tuple(i for i in owners if not spec.is_sliding(i))
            stateful = bool(owners)  # a chunk of KV-shared layers keeps nothing, so it never prefills
            functions = {"infer": io.step(ci, 1)}
            if stateful and f"prefill_b{prefill_batch}" in carried:
                functions[f"prefill_b{prefill_batch}"] = io.step(ci, prefill_batch)
            if stateful:
                for T in sorted(set(kv_batches), reverse=True):
                    functions[f"prefill_kv_b{T}"] = io.kv_only(ci, T)
            if draft_tokens and f"verify_b{draft_tokens + 1}" in carried:
                functions[f"verify_b{draft_tokens + 1}"] = io.step(ci, draft_tokens + 1, every_row=True)
            chunks.append(
                Chunk(
                    name=f"chunk_{ci + 1}",
                    layers=layers,
                    stateful=stateful,
                    sliding_layers=sliding,
                    full_layers=full,
                    states=_states(spec, context, R, sliding, full),
                    functions=functions,
                    has_head=ci == len(io.spans) - 1,
                    computes_ple=ci == 0,
                )
            )
        return cls(
            spec=spec,
            context=context,
            prefill_batch=prefill_batch,
            split=split,
            chunks=tuple(chunks),
            draft_tokens=draft_tokens,
        )

    def _with_rungs(self, lower: list[ChunkPlan], contexts: tuple[int, ...]) -> ChunkPlan:
        """This plan with the functions of the smaller rungs' plans added to each chunk under their rung's names."""
        chunks = []
        for ci, chunk in enumerate(self.chunks):
            functions = dict(chunk.functions)
            for rung in lower:
                own = rung.chunks[ci]
                for f, io in own.functions.items():
                    functions[rung_function(f, rung.context, self.context)] = {**io, "states": own.states}
            chunks.append(dataclasses.replace(chunk, functions=functions))
        return dataclasses.replace(self, chunks=tuple(chunks), contexts=contexts)


# -- which functions a chunk carries, and what they cost on a device ------------------------------------------

# The function kinds a chunk may carry; `infer` (T=1) is every chunk's, the only one that decodes.
FUNCTION_KINDS = {"infer": "infer", "prefill": "prefill_b", "prefill_kv": "prefill_kv_b", "verify": "verify_b"}
_FUNCTION_NAME = re.compile(r"infer|prefill_b\d+|prefill_kv_b\d+|verify_b\d+")
# Named function sets. phone: the iPhone's Neural Engine compiler has refused stateful multifunction functions with
# T > 1 (every prefill, KV-only prefill and verify function), and each function loaded wires its own copy of the
# weights, so a phone bundle carries infer alone; mac: everything the options make (None).
PROFILES = {"phone": ("infer",), "mac": None}
# What a loaded function wires, per byte of the chunk's weights: one measurement on an M-series Mac, a 0.69 GB
# chunk wiring +1.05 GB with one function loaded and +2.09 GB with two (each function its own copy).
WIRED_PER_WEIGHT_BYTE = 2.09 / 2 / 0.69
# Program sizes past which devices are reported to fail (MB of weights, 10^6 bytes): the iPhone's Neural Engine
# compiler accepts ~1 GB per program; ~1.1 GB and more has crashed the ANE service on recent Macs.
SIZE_LIMITS_MB = {"iPhone ANE compiler": 1000.0, "Mac ANE service": 1100.0}


def parse_functions(functions: str | None, profile: str | None) -> tuple[str, ...] | None:
    """--functions "infer,prefill_kv" or --profile NAME (not both) as the tuple `ChunkPlan.build` takes (None:
    every function). Names are checked against a plan in `select_functions`; here only their spelling."""
    if functions is not None and profile is not None:
        raise ConfigError("--functions and --profile: give one (a profile names a function list)")
    if profile is not None:
        if profile not in PROFILES:
            raise ConfigError(f"--profile {profile!r}: choose {' or '.join(PROFILES)}")
        return PROFILES[profile]
    if functions is None:
        return None
    names = tuple(dict.fromkeys(n.strip() for n in functions.split(",")))
    check_function_names(names)
    return names


def check_function_names(names) -> None:
    """Every entry a function kind (`FUNCTION_KINDS`) or a function's name, and `infer` among them."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"--functions {names!r}: expected a list of function names")
    text = ",".join(names)
    for n in names:
        if n not in FUNCTION_KINDS and not _FUNCTION_NAME.fullmatch(n):
            kinds = ", ".join(FUNCTION_KINDS)
            raise ConfigError(f"--functions {text}: unknown function {n!r} (kinds: {kinds}; or a name like prefill_b8)")
    if "infer" not in names:
        raise ConfigError(f"--functions {text}: every chunk needs infer (decoding runs only through it); add infer")


def select_functions(functions, every: list[str]) -> set[str]:
    """The functions of `every` (all a plan makes) that `functions` selects: by kind or by name; None: all. A name
    the plan does not make is refused, naming what it makes."""
    if functions is None:
        return set(every)
    check_function_names(functions)
    carried = set()
    for n in functions:
        if n in FUNCTION_KINDS:
            carried.update(
                f for f in every if f == n or f.startswith(FUNCTION_KINDS[n]) and f[len(FUNCTION_KINDS[n]) :].isdigit()
            )
        elif n in every:
            carried.add(n)
        else:
            raise ConfigError(
                f"--functions {','.join(functions)}: this plan makes no {n} (it makes {', '.join(every)})"
            )
    return carried


def device_cost(chunks) -> list[dict]:
    """For each (name, weight bytes of its program, {function: weight bytes it reads}): its weights, what its
    functions would wire if each loaded function wires its own copy (`WIRED_PER_WEIGHT_BYTE`), and a warning per
    chunk whose program exceeds a size limit, naming each it exceeds."""
    report = []
    for name, weight, functions in chunks:
        mb = weight / 1e6
        over = [f"{limit} (~{cap:g} MB)" for limit, cap in SIZE_LIMITS_MB.items() if mb > cap]
        warning = f"{name}: {mb:.1f} MB of weights exceeds the per-program limit of the {' and the '.join(over)}"
        report.append(
            {
                "name": name,
                "functions": list(functions),
                "weight_mb": round(mb, 1),
                "wired_mb": round(sum(functions.values()) * WIRED_PER_WEIGHT_BYTE / 1e6, 1),
                "warning": warning if over else None,
            }
        )
    return report


def format_device_cost(cost: list[dict]) -> list[str]:
    """The `device_cost` report as lines: a chunk each, then a warning line per chunk over a limit."""
    limits = ", ".join(f"{k} ~{v:g} MB" for k, v in SIZE_LIMITS_MB.items())
    lines = [f"device cost (each loaded function wires its own copy of the weights; limits per program: {limits}):"]
    for c in cost:
        n = len(c["functions"])
        lines.append(
            f"  {c['name']}: {c['weight_mb']} MB of weights, {n} function{'s' * (n != 1)} "
            f"({', '.join(c['functions'])}) wire ~{c['wired_mb']} MB"
        )
    total = sum(c["wired_mb"] for c in cost)
    lines.append(f"  all chunks: ~{total:.1f} MB wired with every function loaded")
    return lines + [f"warning: {c['warning']}" for c in cost if c["warning"]]


MAX_DRAFT_TOKENS = 31  # verify_b32: the rings' 32 extra slots hold one verify batch's rows (ring_slots)
KV_BATCHES = (64, 8)  # the KV-only prefill batches a bundle gets unless asked otherwise (default_kv_batches)


def default_kv_batches(spec: ModelSpec) -> tuple[int, ...]:
    """The KV-only prefill batch sizes `convert` builds (and `plan` shows) when none are given: those of KV_BATCHES
    that divide the sliding window (aligned batches must never wrap the ring: _check_options)."""
    return tuple(T for T in KV_BATCHES if spec.sliding_window % T == 0)


def ring_slots(window: int, draft_tokens: int = 0, kv_batches: tuple[int, ...] = ()) -> int:
    """Slots of a sliding cache. Without drafts: the window, as the published layout.

    A verify call writes its K+1 rows before knowing which drafts survive. In a ring of exactly W slots the rows of
    rejected drafts overwrite the oldest positions, which the next accepted position still attends to; with R >= W
    + K + 1 slots, a write at position q evicts q - R, older than anything a later query (or the drafter's W+1 rows)
    reads, so rejected rows only ever sit in slots the position masks hide until the accepted token overwrites
    them. The pad is a multiple of 32 (Core ML state dimensions, coremltools #2631) and of every KV-only prefill
    batch (an aligned batch must not wrap the ring); it also makes every `prefill_b{T}` with T <= pad + 1 exact
    past the first pass of the ring."""
    if not draft_tokens:
        return window
    step = math.lcm(32, *kv_batches)
    return window + step * math.ceil((draft_tokens + 1) / step)


# -- building a plan: one step of ChunkPlan.build each; ci is the chunk's index (0, 1, 2) ----------


def check_prefill_batch(spec: ModelSpec, prefill_batch) -> None:
    """The prefill_bT function's T: an integer in [1, the sliding window] (verify checks a bundle run's too)."""
    W = spec.sliding_window
    if isinstance(prefill_batch, bool) or not isinstance(prefill_batch, int) or not 1 <= prefill_batch <= W:
        raise ConfigError(f"prefill_batch={prefill_batch!r}: must be an integer in [1, sliding_window={W}]")


def _check_options(spec: ModelSpec, context, prefill_batch, head, kv_batches, draft_tokens) -> None:
    W = spec.sliding_window
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise ConfigError(f"context={context!r}: must be a positive integer")
    if context < W:
        raise ConfigError(f"context={context}: must be at least the sliding window ({W})")
    if context % 32:
        raise ConfigError(f"context={context}: must be a multiple of 32 (Core ML state dimensions)")
    if context > spec.max_position_embeddings:
        raise ConfigError(
            f"context={context}: exceeds the model's max_position_embeddings={spec.max_position_embeddings}"
        )
    for T in kv_batches:
        if isinstance(T, bool) or not isinstance(T, int) or T < 2 or W % T:
            raise ConfigError(
                f"kv prefill batch {T!r}: must be an integer >= 2 that divides the window "
                f"({W}), so aligned batches never wrap the ring"
            )
    if head not in ("logits", "token_id"):
        raise ConfigError(f"head={head!r}: choose logits or token_id")
    check_prefill_batch(spec, prefill_batch)
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"draft_tokens={draft_tokens!r}: must be an integer in [0, {MAX_DRAFT_TOKENS}]")
    if draft_tokens and head != "logits":
        raise ConfigError("draft_tokens: speculative decoding needs logits (head=logits)")
    if draft_tokens and draft_tokens + 1 >= context:
        raise ConfigError(f"draft_tokens={draft_tokens}: a verify batch must fit in the context ({context})")


def _check_split(spec: ModelSpec, split: tuple[int, ...]) -> None:
    """Boundaries in order inside the model, and the last chunk (the head) holding only KV-shared layers: it keeps
    no state, so every cache owner, producers included, must precede it. Every other cut is legal: a chunk hands
    the caches of the producers it owns to the later chunks (`_PlanIO`)."""
    L, first = spec.num_layers, spec.first_shared_layer
    text = ",".join(map(str, split))
    if not split:
        raise ConfigError("split: expected at least one layer boundary")
    for k, b in enumerate(split):
        # the last boundary may be L: a last chunk of the head alone
        if isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= L:
            raise ConfigError(f"split={text}: boundary {b!r} is outside 1..{L} (num_hidden_layers={L})")
        if k and b <= split[k - 1]:
            raise ConfigError(f"split={text}: boundary {b} does not come after {split[k - 1]}; boundaries ascend")
    last = split[-1]
    if last < first:
        owner = max(i for i in range(last, first) if spec.owns_cache(i))
        what = "a KV producer" if owner in spec.producers else "a cache owner"
        raise ConfigError(
            f"split={text}: layer {owner} is {what} and must precede the stateless last chunk, "
            f"which would start at boundary {last}; need the last boundary >= {first}"
        )


def _states(spec: ModelSpec, context: int, ring: int, sliding: tuple[int, ...], full: tuple[int, ...]) -> dict:
    """One state per attention type, K and V rows of each of the chunk's cache owners of that type."""
    D, states = spec.cache_width, {}
    if sliding:
        states["kv_cache_sliding"] = Tensor((2 * len(sliding), spec.kv_heads_of(SLIDING), ring, D))
    if full:
        states["kv_cache_full"] = Tensor((2 * len(full), spec.kv_heads_of(FULL), context, D))
    return states


@dataclass(frozen=True)
class _PlanIO:
    """The inputs and outputs of every function of a plan; ci is the chunk's index (0 .. N-1).

    A chunk that owns producers hands their whole caches on (outputs kv{p}_k / kv{p}_v) unless it is the last; a
    chunk holding KV-shared layers takes the caches of every producer owned by an earlier chunk. With the default
    split that is chunk_2 -> chunk_3, as the published layout wires it."""

    spec: ModelSpec
    context: int
    ring: int
    head: str
    drafter: bool  # the last chunk also returns the final-norm hidden states the drafter reads
    spans: tuple[tuple[int, int], ...]  # each chunk's layers [lo, hi)

    def hands_on(self, ci: int) -> list[int]:
        lo, hi = self.spans[ci]
        return [p for p in self.spec.producers if lo <= p < hi] if ci < len(self.spans) - 1 else []

    def takes(self, ci: int) -> list[int]:
        lo, hi = self.spans[ci]
        shares = any(not self.spec.owns_cache(i) for i in range(lo, hi))
        return [p for p in self.spec.producers if p < lo] if shares else []

    def step(self, ci: int, T: int, every_row: bool = False) -> dict:
        """`infer` (T=1), `prefill_b{T}` and `verify_b{T}` (every_row: the head returns each row's logits)."""
        spec = self.spec
        ins = self.host_inputs(ci, T, spec.per_layer_total, self.ring)
        outs = _hidden_outputs(spec, ci, T, spec.per_layer_total)
        outs.update({kv_name(p, w): self.cache_tensor(p) for p in self.hands_on(ci) for w in ("k", "v")})
        ins.update({kv_name(p, w): self.cache_tensor(p) for p in self.takes(ci) for w in ("k", "v")})
        if ci == len(self.spans) - 1:
            rows = T if every_row else 1
            if self.head == "logits":
                outs = {"logits": Tensor((1, rows, spec.vocab_size))}
                if self.drafter:
                    outs["final_hidden"] = Tensor((1, rows, spec.hidden_size))
            else:
                outs = {"token_id": Tensor((1,), I32), "token_logit": Tensor((1,))}
        return {"T": T, "inputs": ins, "outputs": outs, "every_row": every_row}

    def kv_only(self, ci: int, T: int) -> dict:
        """`prefill_kv_b{T}`: only the cache-owning layers run, so PLE covers only them; sliding layers
        attend over [ring as it was | the batch] before writing (CONTRACT §4 fixed)."""
        own = self.spec.first_shared_layer * self.spec.per_layer_dim
        ins = self.host_inputs(ci, T, own, self.ring + T)
        return {"T": T, "inputs": ins, "outputs": _hidden_outputs(self.spec, ci, T, own), "kv_only": True}

    def host_inputs(self, ci: int, T: int, ple_width: int, sliding_keys: int) -> dict:
        """What the host computes for T tokens: embeddings, masks, the PLE (raw into chunk_1, combined after),
        RoPE tables per attention type, and for the stateful chunks (those owning a cache) the positions."""
        spec = self.spec
        ins = {
            "hidden_states": Tensor((1, T, spec.hidden_size)),
            "causal_mask_full": Tensor((1, 1, T, self.context)),
            "causal_mask_sliding": Tensor((1, 1, T, sliding_keys)),
            "per_layer_raw" if ci == 0 else "per_layer_combined": Tensor((1, T, ple_width)),
        }
        if SLIDING in spec.layer_types:
            ins["cos_s"] = ins["sin_s"] = Tensor((1, 1, T, spec.head_dim_of(SLIDING)))
        ins["cos_f"] = ins["sin_f"] = Tensor((1, 1, T, spec.head_dim_of(FULL)))
        lo, hi = self.spans[ci]
        if any(spec.owns_cache(i) for i in range(lo, hi)):
            ins["current_pos"] = ins["ring_pos"] = Tensor((1,), I32)
        return ins

    def cache_tensor(self, layer: int) -> Tensor:
        """A producer's whole K (or V) cache as it passes to a later chunk: the ring, or the full context."""
        spec = self.spec
        if spec.is_sliding(layer):
            return Tensor((1, spec.kv_heads_of(SLIDING), self.ring, spec.head_dim_of(SLIDING)))
        return Tensor((1, spec.kv_heads_of(FULL), self.context, spec.head_dim_of(FULL)))


def _hidden_outputs(spec: ModelSpec, ci: int, T: int, ple_width: int) -> dict:
    outs = {"hidden_states_out": Tensor((1, T, spec.hidden_size))}
    if ci == 0:  # chunk_1 combines the PLE once for all chunks
        outs["per_layer_combined_out"] = Tensor((1, T, ple_width))
    return outs


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """--split "a,b,...": the N-1 layer boundaries of N chunks."""
    if text is None:
        return None
    try:
        split = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--split {text!r}: expected layer indices 'a,b[,c...]' (chunk_2 starts at a, chunk_3 at b, ...)"
        ) from None
    return split


# -- sizing chunks ---------------------------------------------------------------------------------------------


def _layer_params(spec: ModelSpec, i: int) -> tuple[int, int]:
    """(projection weights, other weights) of layer i: the projections are palettized, norms and scalars not."""
    H, D, nh, kvh, P = spec.hidden_size, spec.head_dims[i], spec.num_heads, spec.kv_heads[i], spec.per_layer_dim
    proj = 2 * H * nh * D + 3 * H * spec.intermediate_sizes[i] + 2 * H * P
    other = 5 * H + D + 1  # 5 layer norms of H, q_norm
    if spec.owns_cache(i):
        proj += H * kvh * D * (1 if spec.k_eq_v[i] else 2)
        other += D
    return proj, other


# the weights' widths convert builds (16: fp16, no palettization); sizes at any other are of no bundle
BITS = (4, 6, 8, 16)


def check_bits(bits: int) -> None:
    """A ConfigError naming --bits unless `bits` is one of BITS, in the words convert refuses the others with."""
    if bits not in BITS:
        raise ConfigError(f"--bits {bits}: choose 4, 6, 8 or 16 (16 = no palettization)")


def chunk_weight_bytes(spec: ModelSpec, layers, computes_ple: bool, has_head: bool, bits: int) -> int:
    """The weights a chunk stores: projections at `bits` (16: fp16), the rest fp16. Palettization's lookup tables
    (16 fp16 entries per group of 32 rows at 4 bits) are counted too, so this is within a few % of the package."""
    proj = other = 0
    for i in layers:
        p, o = _layer_params(spec, i)
        proj, other = proj + p, other + o
    if computes_ple:
        proj += spec.hidden_size * spec.per_layer_total
        other += spec.per_layer_dim
    if has_head:
        proj += spec.vocab_size * spec.hidden_size
        other += spec.hidden_size
    if bits >= 16:
        return 2 * (proj + other)
    lut = proj // spec.hidden_size // 32 * 2**bits * 2  # ~ one LUT of 2^bits fp16 per 32 output channels
    return proj * bits // 8 + lut + 2 * other


def split_for_budget(spec: ModelSpec, max_chunk_mb: float, bits: int) -> tuple[int, ...]:
    """The fewest chunks whose weights each fit `max_chunk_mb` (MB = 10^6 bytes) at `bits`, the largest chunk as
    small as it can then be, with the last chunk holding only KV-shared layers (`_check_split`). ConfigError names
    the layer that cannot fit."""
    numeric = isinstance(max_chunk_mb, (int, float)) and not isinstance(max_chunk_mb, bool)
    if not numeric or not 0 < max_chunk_mb < math.inf:  # NaN compares false, so it lands here too
        raise ConfigError(f"--max-chunk-mb {max_chunk_mb!r}: must be a finite number of MB > 0")
    L, first, budget = spec.num_layers, spec.first_shared_layer, max_chunk_mb * 1e6

    def size(lo: int, hi: int) -> int:
        return chunk_weight_bytes(spec, range(lo, hi), lo == 0, hi == L, bits)

    for i in range(L):
        alone = size(i, i + 1)
        if alone > budget:
            extra = " with the PLE projection" if i == 0 else " with the LM head" if i == L - 1 else ""
            raise ConfigError(
                f"--max-chunk-mb {max_chunk_mb:g}: layer {i}{extra} alone needs {alone / 1e6:.1f} MB at {bits} bits"
            )
    # best[hi] = (chunks, largest chunk, boundaries) covering layers [0, hi); the last chunk starts at >= first
    best: dict[int, tuple[int, int, tuple[int, ...]]] = {0: (0, 0, ())}
    for hi in range(1, L + 1):
        options = [
            (best[lo][0] + 1, max(best[lo][1], size(lo, hi)), best[lo][2] + ((lo,) if lo else ()))
            for lo in range(hi)
            if lo in best and size(lo, hi) <= budget and (hi < L or lo >= first)
        ]
        if options:
            best[hi] = min(options)
    if L not in best:  # a model without KV-shared layers: its last chunk would be the head alone
        raise ConfigError(
            f"--max-chunk-mb {max_chunk_mb:g}: no split fits; the last chunk keeps no state, and every layer "
            f"owns a KV cache (num_kv_shared_layers=0)"
        )
    return best[L][2]
