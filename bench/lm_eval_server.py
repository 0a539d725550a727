"""lm-evaluation-harness against `gemma-ane serve`: one loglikelihood task through its `local-completions` model
(echo and prompt logprobs on /v1/completions) and one generation task through `local-chat-completions`.

    python bench/lm_eval_server.py BUNDLE [--limit 8] [--backend auto] [--record]
    python bench/lm_eval_server.py --quick      # converts a tiny e2b-mini bundle (MIL backend) if none is given

Needs lm-eval with its API models (`pip install 'lm-eval[api]'`; not a dependency of the package). Offline: both
tasks are custom YAML with a local JSONL dataset written into a temporary directory (the `json` builder of
`datasets`, no download), the tokenizer lm-eval needs for context lengths is the bundle's own (hf_model/), and
HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set. The server listens on loopback only. Prints lm-eval's figures per
task; with --record appends them to BENCHMARKS.md. A random tiny bundle scores at chance: the run checks the
plumbing (every request answered, none refused), not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, tiny_bundle  # noqa: E402
from server_load import start_server, stop_server  # noqa: E402

# a multiple-choice task lm-eval scores by the loglikelihood of each choice after the question
CHOICE = [
    {"question": "The sky on a clear day is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " seven", " purple"], "answer": 0},
    {"question": "Water freezes into", "choices": [" steam", " ice", " sand"], "answer": 1},
    {"question": "A cat says", "choices": [" woof", " moo", " meow"], "answer": 2},
    {"question": "The opposite of hot is", "choices": [" cold", " tall", " fast"], "answer": 0},
    {"question": "Bees make", "choices": [" milk", " honey", " silk"], "answer": 1},
    {"question": "The sun rises in the", "choices": [" west", " north", " east"], "answer": 2},
    {"question": "Ice is", "choices": [" cold", " hot", " loud"], "answer": 0},
]
# a short-answer task: generated until a newline, scored by exact match
GENERATE = [
    {"question": "Q: What color is the sky?\nA:", "answer": "blue"},
    {"question": "Q: What is two plus two?\nA:", "answer": "four"},
    {"question": "Q: What does a cat say?\nA:", "answer": "meow"},
    {"question": "Q: What do bees make?\nA:", "answer": "honey"},
    {"question": "Q: Where does the sun rise?\nA:", "answer": "east"},
    {"question": "Q: What is frozen water?\nA:", "answer": "ice"},
    {"question": "Q: What is the opposite of hot?\nA:", "answer": "cold"},
    {"question": "Q: How many legs has a dog?\nA:", "answer": "four"},
]


def write_tasks(tmp: Path) -> Path:
    """Two task YAMLs and their JSONL data in tmp/tasks; returns that directory (lm-eval's include_path)."""
    tasks = tmp / "tasks"
    tasks.mkdir()
    for name, rows in (("choice", CHOICE), ("generate", GENERATE)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / name}.jsonl\n"  # noqa: E731
    (tasks / "gemma_ane_choice.yaml").write_text(
        "task: gemma_ane_choice\n"
        + data("choice")
        + "test_split: test\noutput_type: multiple_choice\n"
        + 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        + "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (tasks / "gemma_ane_generate.yaml").write_text(
        "task: gemma_ane_generate\n"
        + data("generate")
        + "test_split: test\noutput_type: generate_until\n"
        + 'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        + "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        + "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        + "    ignore_case: true\n    ignore_punctuation: true\n"
    )
    return tasks


def evaluate(url: str, bundle: Path, tasks: Path, limit: int) -> list[tuple[str, str, dict, int]]:
    """(task, lm-eval model, its metrics, samples) for the two tasks, run by lm-eval in this process."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks))
    runs = [
        (
            "gemma_ane_choice",
            "local-completions",
            f"model={bundle.name},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={bundle / 'hf_model'},tokenized_requests=False,num_concurrent=1,max_retries=1",
            False,
        ),
        (
            "gemma_ane_generate",
            "local-chat-completions",
            f"model={bundle.name},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1",
            True,
        ),
    ]
    out = []
    for task, model, args, chat in runs:
        results = lm_eval.simple_evaluate(
            model=model,
            model_args=args,
            tasks=[task],
            task_manager=manager,
            limit=limit,
            apply_chat_template=chat,
            log_samples=False,
        )
        # "acc,none", "acc_stderr,none": a metric under its filter; the other keys are the task's name and size
        metrics = {k.split(",")[0]: v for k, v in results["results"][task].items() if "," in k}
        out.append((task, model, metrics, results["n-samples"][task]["effective"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?")
    p.add_argument("--limit", type=int, default=8, help="samples per task (default 8: all of them)")
    p.add_argument("--backend", default="auto", choices=["auto", "coreml", "mil"])
    p.add_argument("--quick", action="store_true", help="a tiny bundle on the MIL backend if none given")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    if not a.bundle and not a.quick:
        p.error("give a BUNDLE, or --quick")
    if a.limit < 1:
        p.error("--limit must be >= 1")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        p.error("needs lm-evaluation-harness: pip install 'lm-eval[api]'")
    # nothing leaves this machine: lm-eval's datasets and tokenizer are local files
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bundle = Path(a.bundle).resolve() if a.bundle else tiny_bundle(tmp, bits=16)
        backend = "mil" if a.quick and not a.bundle else a.backend
        tasks = write_tasks(tmp)
        with open(tmp / "server.log", "wb") as log:
            proc = None
            try:
                proc, url = start_server(bundle, backend, 4, log)
                t0 = time.perf_counter()
                runs = evaluate(url, bundle, tasks, a.limit)
                wall = time.perf_counter() - t0
            except Exception as e:
                print((tmp / "server.log").read_text(errors="replace")[-3000:], file=sys.stderr)
                print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
                return 1
            finally:
                stop_server(proc)
            # uvicorn's access log: a request the server answered with an error
            log_lines = (tmp / "server.log").read_text(errors="replace").splitlines()
            refused = [line for line in log_lines if 'HTTP/1.1" 4' in line or 'HTTP/1.1" 5' in line]

    name = "e2b-mini (quick)" if a.quick and not a.bundle else bundle.name
    lines = [
        f"bundle `{name}`, backend {backend}: lm-evaluation-harness {version()} against `gemma-ane serve` on "
        f"loopback, local tasks, limit {a.limit}, {wall:.0f} s",
        "",
        "| task | lm-eval model | samples | metrics |",
        "|---|---|---|---|",
    ]
    for task, model, metrics, n in runs:
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(metrics.items()))
        lines.append(f"| {task} | {model} | {n} | {shown} |")
    table = "\n".join(lines)
    print(table)
    if refused:
        print("\n".join(refused[:10]), file=sys.stderr)
        print(f"FAILED: the server refused {len(refused)} requests", file=sys.stderr)
        return 1
    if a.record:
        record("lm-evaluation-harness through the server", table)
    return 0


def version() -> str:
    from importlib.metadata import version as of

    return of("lm-eval")


if __name__ == "__main__":
    sys.exit(main())
