"""`serve`'s manners (issue 47): the model id a client sees is --served-model-name's, and each answered choice is one
line in the server's log (prompt, reused, generated tokens and both speeds)."""

from __future__ import annotations

import time

import httpx
import pytest
from test_webui import serving

from gemma_ane.cli import main

pytestmark = pytest.mark.slow


def test_a_served_model_name_and_a_log_line_a_request(demo_bundle16):
    with serving(demo_bundle16, "--served-model-name", "gemma-demo") as (url, log):
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["gemma-demo"]
        body = {"model": "gemma-demo", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "gemma-demo"
        usage = r.json()["usage"]
        for _ in range(100):  # the worker logs once the generation has closed: a moment after the answer went out
            lines = [x for x in log.read_text().splitlines() if ": choice 0: prompt " in x]
            if lines:
                break
            time.sleep(0.1)
        line = lines[0]
    assert f"prompt {usage['prompt_tokens']} tokens ({usage['prompt_tokens_details']['cached_tokens']} reused" in line
    assert f"generated {usage['completion_tokens']} (" in line and line.endswith("finish stop")


def test_a_served_model_name_that_is_no_name_is_refused(capsys, demo_bundle16):
    assert main(["serve", str(demo_bundle16), "--served-model-name", "a\nb"]) == 2
    assert "--served-model-name 'a\\nb': expected 1 to 256 printable characters" in capsys.readouterr().err
