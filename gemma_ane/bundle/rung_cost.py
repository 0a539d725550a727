"""What each rung of a context ladder costs, from its plan: the bytes a decoded token reads, the state memory and the
weights wired with only that rung loaded (`plan` and `inspect` print it; bench/cost_model.py --ladder tabulates it).
Apart from ladder.py, which plan.py stands on, so that the two do not import each other."""

from __future__ import annotations

from .ladder import split_rung
from .plan import WIRED_PER_WEIGHT_BYTE, chunk_weight_bytes
from .spec import FULL, SLIDING, ModelSpec


def rung_costs(plan, bits: int) -> list[dict]:
    """Per rung of `plan` (a ChunkPlan; one rung if it has no ladder): the bytes one decoded token reads (every
    chunk's `infer` weights, the KV rows its static program reads, the caches chunks hand on), the state memory,
    and what the rung's functions wire with only that rung loaded (each loaded function its own copy of the
    weights: plan.WIRED_PER_WEIGHT_BYTE)."""
    spec = plan.spec
    weights = {c.name: chunk_weight_bytes(spec, c.layers, c.computes_ple, c.has_head, bits) for c in plan.chunks}
    out = []
    for context in plan.contexts or (plan.context,):
        kv = sum(
            kv_row_bytes(spec, i) * (context if not spec.is_sliding(i) else plan.ring) for i in range(spec.num_layers)
        )
        hand_off = sum(
            2 * _elements(t.shape)
            for c in plan.chunks
            for n, t in plan.rung_io(c, "infer", context)["outputs"].items()
            if n.startswith("kv")
        )
        states = sum(2 * _elements(t.shape) for c in plan.chunks for t in plan.rung_states(c, context).values())
        functions = {c.name: sum(1 for f in c.functions if _on_rung(f, context, plan.context)) for c in plan.chunks}
        wired = sum(weights[n] * k for n, k in functions.items()) * WIRED_PER_WEIGHT_BYTE
        out.append(
            {
                "context": context,
                "weight_bytes": sum(weights.values()),
                "kv_bytes": kv,
                "hand_off_bytes": hand_off,
                "bytes_per_token": sum(weights.values()) + kv + hand_off,
                "state_bytes": states,
                "wired_bytes": round(wired),
            }
        )
    return out


def kv_row_bytes(spec: ModelSpec, layer: int) -> int:
    """fp16 K and V of one position of the cache `layer` attends to (KV-shared layers read their producer's
    again: nothing that large stays on the Neural Engine between ops)."""
    t = SLIDING if spec.is_sliding(layer) else FULL
    return 2 * 2 * spec.kv_heads_of(t) * spec.head_dim_of(t)


def _on_rung(function: str, context: int, top: int) -> bool:
    rung, _ = split_rung(function)
    return (rung or top) == context


def _elements(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def format_rung_costs(costs: list[dict]) -> list[str]:
    """`rung_costs` as lines: a rung each."""
    lines = ["per rung (bytes one decoded token reads; state memory; wired with only that rung loaded):"]
    for r in costs:
        lines.append(
            f"  context {r['context']}: {r['bytes_per_token'] / 1e6:.1f} MB per token (weights "
            f"{r['weight_bytes'] / 1e6:.1f}, KV {r['kv_bytes'] / 1e6:.1f}, hand-offs {r['hand_off_bytes'] / 1e6:.1f}); "
            f"states {r['state_bytes'] / 1e6:.1f} MB; wired ~{r['wired_bytes'] / 1e6:.1f} MB"
        )
    return lines
