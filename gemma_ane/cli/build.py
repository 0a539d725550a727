"""Commands that plan, build and inspect a bundle: `plan`, `tiny`, `convert`, `inspect`, `check`."""

from __future__ import annotations

import argparse
import json
import sys

from ..bundle.ladder import parse_contexts
from ..bundle.plan import (
    PROFILES,
    ChunkPlan,
    check_bits,
    default_kv_batches,
    format_device_cost,
    parse_functions,
    parse_split,
    split_for_budget,
)
from ..bundle.rung_cost import format_rung_costs, rung_costs
from ..bundle.spec import ConfigError, ModelSpec
from ..errors import ConversionError
from ..files import write_json
from .steps import add_quiet, shown, step, writable


def _plan_table(plan: ChunkPlan, bits: int) -> str:
    rungs = f" (a ladder: {', '.join(map(str, plan.contexts))})" if plan.contexts else ""
    head = f"context {plan.context}{rungs}, window {plan.window}, prefill batch {plan.prefill_batch}"
    lines = [f"{head}, split {','.join(map(str, plan.split))}"]
    for c, role in zip(plan.chunks, plan.describe(bits)):
        layers = f"layers {c.layers[0]}-{c.layers[-1]}" if c.layers else "no layers"
        lines.append(
            f"\n{c.name}: {layers}, {role['weight_mb']} MB at {bits} bits"
            + ("" if c.stateful else ", stateless")
            + ("  (+ final norm, LM head, softcap)" if c.has_head else "")
        )
        if role["reads"] or role["hands_on"]:
            lines.append(f"  takes {', '.join(role['reads']) or '-'}; hands on {', '.join(role['hands_on']) or '-'}")
        for name, t in c.states.items():
            lines.append(f"  state  {name:<24} {str(list(t.shape)):<22} {t.dtype}")
        for fname, io in c.functions.items():
            lines.append(f"  {fname}")
            for kind in ("inputs", "outputs"):
                for name, t in io[kind].items():
                    lines.append(f"    {kind[:-1]:<6} {name:<24} {str(list(t.shape)):<22} {t.dtype}")
    return "\n".join(lines)


def _split_of(a, spec: ModelSpec) -> tuple[int, ...] | None:
    """--split, or the boundaries --max-chunk-mb chooses at --bits (ConfigError names what cannot fit)."""
    if a.max_chunk_mb is None:
        return parse_split(a.split)
    if a.split is not None:
        raise ConfigError("--split and --max-chunk-mb: give one (the budget chooses the boundaries)")
    return split_for_budget(spec, a.max_chunk_mb, a.bits)


def cmd_plan(a):
    check_bits(a.bits)
    spec = ModelSpec.from_pretrained(a.src)
    functions = parse_functions(a.functions, a.profile)
    kv = _batches(a.kv_prefill_batches)
    if kv is None:  # what convert builds by default
        kv = default_kv_batches(spec)
    contexts = parse_contexts(a.contexts)
    plan = ChunkPlan.build(
        spec,
        contexts[-1] if contexts else a.context,
        a.prefill_batch,
        _split_of(a, spec),
        kv_batches=kv,
        functions=functions,
        contexts=contexts,
    )
    if a.json:  # the plan, each chunk's role and weights at --bits, and what its functions would wire
        roles = {r["name"]: r for r in plan.describe(a.bits)}
        data = plan.to_json()
        data["bits"] = a.bits
        data["chunks"] = [{**roles[c["name"]], **c} for c in data["chunks"]]
        data["device_cost"] = plan.device_cost(a.bits)
        if plan.contexts:
            data["rungs"] = rung_costs(plan, a.bits)
        print(json.dumps(data, indent=2))
    else:
        print(_plan_table(plan, a.bits))
        print("\n" + "\n".join(format_device_cost(plan.device_cost(a.bits))))
        if plan.contexts:
            print("\n" + "\n".join(format_rung_costs(rung_costs(plan, a.bits))))


def cmd_tiny(a):
    from ..oracle.tiny import write_tiny

    with step(a, f"writing the {a.preset} checkpoint" + (" (training it: minutes)" if a.train else "")):
        out = write_tiny(
            a.out,
            preset=a.preset,
            seed=a.seed,
            dtype=a.dtype,
            shards=a.shards,
            force=a.force,
            assistant=a.assistant,
            train=a.train,
        )
    drafter = f", its assistant to {a.assistant}" if a.assistant else ""
    print(f"wrote {a.preset} (seed {a.seed}, {a.dtype}) to {out}{drafter}")


def _batches(text):
    """--kv-prefill-batches: None when not given, () when empty (none); an empty item (`8,,64`, `,`) is a slip."""
    if text is None:
        return None
    if not text.strip():
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--kv-prefill-batches {text!r}: expected comma-separated batch sizes, e.g. 64,8") from None


def cmd_convert(a):
    from ..convert import ConvertOptions, StageTimer, convert, resolve_source

    if a.draft_tokens is not None and not a.assistant:
        raise ConversionError("--draft-tokens: needs --assistant (the drafter whose tokens the verify calls check)")
    if a.stats:
        writable(a.stats, "--stats")
    # the budget's boundaries are chosen before anything is written; the manifest records them as the split
    split = (
        parse_split(a.split)
        if a.max_chunk_mb is None
        else _split_of(a, ModelSpec.from_pretrained(resolve_source(a.src)))
    )
    opts = ConvertOptions(
        context=a.context,
        bits=a.bits,
        group_size=a.group_size,
        prefill_batch=a.prefill_batch,
        split=split,
        compile=a.compile,
        force=a.force,
        layout=a.layout,
        kv_prefill_batches=_batches(a.kv_prefill_batches),
        assistant=a.assistant,
        draft_tokens=3 if a.draft_tokens is None else a.draft_tokens,
        vision=a.vision,
        image_tokens=a.image_tokens,
        vision_bits=a.vision_bits,
        quant=a.quant,
        keep=tuple(a.keep),
        audio=a.audio,
        audio_bits=a.audio_bits,
        functions=tuple(n.strip() for n in a.functions.split(",")) if a.functions is not None else None,
        profile=a.profile,
        contexts=parse_contexts(a.contexts),
    )
    timer = StageTimer()
    seconds = convert(a.src, a.out, opts, progress=shown(a), timer=timer)
    total = sum(seconds.values())
    print("  ".join(f"{k} {v:.1f}s" for k, v in seconds.items()) + f"  total {total:.1f}s")
    if timer.peak_rss:
        print("peak memory: " + "  ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in timer.peak_rss.items()))
    if a.stats:
        write_json(a.stats, {"seconds": seconds, "peak_rss_bytes": timer.peak_rss})
    print(f"wrote {a.out}")


def cmd_inspect(a):
    from ..bundle import ONE_FUNCTION_MODELS, inspect_bundle

    if a.ane:
        from ..runtime.audit import audit_bundle, format_audit

        with step(a, f"auditing every model in {a.bundle} against the Neural Engine's rules"):
            audit = audit_bundle(a.bundle)
        print(json.dumps(audit, indent=2) if a.json else format_audit(audit))
        return 0 if audit["verdict"] == "pass" else 1
    with step(a, f"reading {a.bundle}'s programs" + ("" if a.no_sha else " and hashing its files")):
        report = inspect_bundle(a.bundle, sha256=not a.no_sha)
    if a.json:
        print(json.dumps(report, indent=2))
        return 0 if report["manifest"]["verified"] else 1
    for c in [*report["chunks"], *(report[name] for name in ONE_FUNCTION_MODELS if name in report)]:
        layers = f"layers {c['layers'][0]}-{c['layers'][-1]}, " if "layers" in c else ""
        print(f"{c['name']} ({c['path']}): {layers}{c['size_bytes'] / 1e6:.2f} MB on disk")
        if "weights" in c:  # a compiled model cannot be read back
            w = c["weights"]
            kinds = ", ".join(f"{n} {kind}" for kind, n in w["formats"].items())
            kept = f"; fp16 (>= 2048 values): {', '.join(w['fp16'])}" if w["fp16"] else ""
            print(f"  linear weights: {kinds}{kept}")
        for name, t in c["states"].items():
            print(f"  state  {name:<24} {str(t['shape']):<22} {t['dtype']}")
        per = "image" if c["name"] == "vision" else "token"  # encode's cost is one image's
        for fname, f in c["functions"].items():
            costs = (
                "costs unknown (compiled)"
                if f["macs_per_token"] is None
                else f"weights {f['weight_bytes'] / 1e6:.2f} MB, {f['macs_per_token'] / 1e6:.2f} M MACs/{per}"
            )
            print(f"  {fname}: T={f['tokens_per_call']}, {costs}")
            for kind in ("inputs", "outputs"):
                for name, t in f[kind].items():
                    print(f"    {kind[:-1]:<6} {name:<24} {str(t['shape']):<22} {t['dtype']}")
    for name, path in report["prompt_paths"].items():
        print(
            f"prompt path {name}: {path['macs_per_prompt_token'] / 1e6:.2f} M MACs and "
            f"{path['weight_bytes_per_prompt_token'] / 1e6:.2f} MB of weights per prompt token"
        )
    print("\n".join(format_device_cost(report["device_cost"])))
    if "rungs" in report and all(r["weight_bytes"] is not None for r in report["rungs"]):
        print("\n".join(format_rung_costs(report["rungs"])))
    m = report["manifest"]
    print("manifest: " + ("verified" if m["verified"] else "; ".join(m["problems"])))
    return 0 if m["verified"] else 1


def cmd_check(a):
    from ..bundle import check_bundle, converted_elsewhere, is_published

    problems = check_bundle(a.bundle, sha256=True)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    if converted_elsewhere(a.bundle):  # check_bundle lets only such a bundle go without a manifest
        who = "the published layout" if is_published(a.bundle) else "a bundle of CoreML-LLM's model config"
        print(f"{a.bundle}: not verifiable: no manifest ({who} has none); required files present")
        return 3
    print(f"{a.bundle}: ok (the manifest lists every file; sizes and sha256 match)")
    return 0


CONTEXT_HELP = "positions the caches hold, prompt and answer together (a multiple of 32, at least the window)"
CONTEXTS_HELP = (
    "a context ladder, e.g. 2048,8192,32768: every chunk's functions once per context (ascending, each as --context "
    "requires); a session runs on the smallest that holds it and climbs when it grows; overrides --context"
)


def _add_split(s):
    s.add_argument("--split", help="a,b[,c...]: chunk_2 starts at layer a, chunk_3 at b, ... (N-1 boundaries)")
    s.add_argument(
        "--max-chunk-mb",
        type=float,
        metavar="MB",
        help="choose the boundaries so every chunk's weights at --bits fit MB (instead of --split)",
    )


def _add_functions(s):
    s.add_argument(
        "--functions",
        metavar="LIST",
        help="the functions every chunk carries: names (infer,prefill_b8,prefill_kv_b64,verify_b4) or kinds "
        "(infer, prefill, prefill_kv, verify); infer is required (default: all)",
    )
    s.add_argument(
        "--profile",
        metavar="NAME",
        help="a named function set: phone (infer only: the iPhone compiler has refused stateful T > 1 "
        f"functions), mac (all); one of {', '.join(PROFILES)}",
    )


def add_commands(sub) -> None:
    s = sub.add_parser("plan", help="show how the model splits into Core ML chunks")
    s.add_argument("src", help="config.json or checkpoint directory")
    s.add_argument("--context", type=int, default=2048, help=CONTEXT_HELP)
    s.add_argument("--contexts", metavar="LIST", help=CONTEXTS_HELP)
    s.add_argument("--prefill-batch", type=int, default=8, help="tokens a prefill call takes (the prefill_bT function)")
    _add_split(s)
    s.add_argument("--bits", type=int, default=4, help="the weights' bits, for the sizes (16: fp16)")
    s.add_argument(
        "--kv-prefill-batches",
        help="KV-only prefill batch sizes to plan, e.g. 64,8 (default: convert's, those of 64,8 that divide the "
        "window; empty: none)",
    )
    _add_functions(s)
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.set_defaults(fn=cmd_plan)

    from ..oracle.tiny import PRESETS  # the table itself, so the choices listed are the presets that exist

    s = sub.add_parser(
        "tiny", help="write a tiny Gemma 4 checkpoint: random, or trained to answer (--preset demo; needs transformers)"
    )
    s.add_argument("out", help="checkpoint directory to create")
    s.add_argument("--preset", default="e2b-mini", choices=list(PRESETS), help="which tiny model (see README)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights (the same seed, the same bytes)")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the weights' dtype on disk")
    s.add_argument("--shards", type=int, default=1, help="safetensors files to spread the weights over")
    s.add_argument("--assistant", metavar="DIR", help="also write a matched drafter (Gemma4AssistantForCausalLM) here")
    s.add_argument(
        "--train",
        action="store_true",
        help="demo: train it now from --seed (minutes; the bytes depend on the CPU) instead of its shipped weights",
    )
    s.add_argument("--force", action="store_true", help="replace an existing OUT")
    add_quiet(s)
    s.set_defaults(fn=cmd_tiny)

    s = sub.add_parser("convert", help="convert a checkpoint into the Core ML bundle")
    s.add_argument("src", help="Hugging Face checkpoint directory (or Hub id, when online)")
    s.add_argument("out", help="bundle directory to create")
    s.add_argument("--context", type=int, default=2048, help=CONTEXT_HELP)
    s.add_argument("--contexts", metavar="LIST", help=CONTEXTS_HELP)
    s.add_argument("--bits", type=int, default=4, help="4, 6, 8, or 16 for no palettization")
    s.add_argument(
        "--group-size",
        type=int,
        default=32,
        help="lut: output channels per LUT; block: input channels per scale (default 32, q4_0's block)",
    )
    s.add_argument(
        "--quant",
        default="lut",
        choices=["lut", "block"],
        help="lut: k-means LUT palettization (default); block: int4/int8 with one scale per --group-size inputs, "
        "exact for a checkpoint trained onto q4_0's grid (e.g. gemma-4-E2B-it-qat-q4_0-unquantized)",
    )
    s.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave linear weights at fp16 where this regular expression is found in their name, as the checkpoint "
        "spells it (layers.0.self_attn.o_proj) or as inspect shows it (layers_0_self_attn_o_proj); repeatable",
    )
    s.add_argument("--prefill-batch", type=int, default=8, help="tokens a prefill call takes (the prefill_bT function)")
    _add_split(s)
    s.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile to .mlmodelc (default: on macOS only)",
    )
    s.add_argument("--force", action="store_true", help="replace an existing OUT")
    s.add_argument("--quiet", action="store_true", help="no progress bar (shown only on a terminal)")
    s.add_argument("--stats", help="also write {seconds, peak_rss_bytes} per stage to this JSON file")
    s.add_argument(
        "--kv-prefill-batches",
        help="KV-only prefill batch sizes, e.g. 64,8 (default: those of 64,8 that divide the window; empty disables)",
    )
    s.add_argument(
        "--layout",
        default="ours",
        choices=["ours", "published"],
        help="published: reproduce the published layout (argmax head, fp32 norm file, all-pairs RoPE)",
    )
    s.add_argument(
        "--assistant",
        metavar="DIR",
        help="also convert this Gemma 4 drafter (Gemma4AssistantForCausalLM) for speculative decoding",
    )
    s.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="with --assistant: drafts checked per verify call (verify_b{K+1} functions; default 3)",
    )
    s.add_argument(
        "--vision",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="convert the checkpoint's vision tower to vision.mlpackage, when it has one (default: yes)",
    )
    s.add_argument(
        "--image-tokens",
        type=int,
        default=280,
        metavar="N",
        help="soft tokens per image, one of 70, 140, 280, 560, 1120 (default 280, E2B's own)",
    )
    s.add_argument(
        "--vision-bits",
        type=int,
        default=None,
        help="the vision model's weights: 4, 6, 8 or 16 (default: 8, or --bits when that is higher)",
    )
    s.add_argument(
        "--audio",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="convert the checkpoint's audio tower to audio.mlpackage, when it has one (default: yes)",
    )
    s.add_argument("--audio-bits", type=int, default=8, help="the audio model's weights: 4, 6, 8 or 16 (default 8)")
    _add_functions(s)
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("inspect", help="functions, I/O, states, sizes and costs of a converted bundle")
    s.add_argument("bundle", help="bundle directory")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--no-sha", action="store_true", help="check manifest sizes only, not sha256")
    s.add_argument(
        "--ane",
        action="store_true",
        help="audit each program against the Neural Engine's published rules (exit 1 unless it passes)",
    )
    add_quiet(s)
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser(
        "check", help="validate a bundle: every file listed, sizes and sha256 (exit 1: problems, 3: no manifest)"
    )
    s.add_argument("bundle", help="bundle directory")
    s.set_defaults(fn=cmd_check)
