"""Benchmarks write BENCHMARKS.md only when asked: a README command must not change a tracked file."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import common  # noqa: E402  (bench/common.py, as the scripts import it)


def test_publish_records_only_with_record_and_never_in_quick_mode(monkeypatch, capsys):
    written = []
    monkeypatch.setattr(common, "record", lambda title, body: written.append(title))
    for record, quick in ((False, False), (True, True), (False, True)):
        common.publish("t", "figures", argparse.Namespace(record=record, quick=quick))
    assert written == [] and capsys.readouterr().out.count("figures") == 3
    common.publish("t", "figures", argparse.Namespace(record=True, quick=False))
    assert written == ["t"]


def test_every_script_offers_record_and_none_offers_no_record():
    for script in (Path(common.__file__).parent).glob("*.py"):
        text = script.read_text()
        assert "--no-record" not in text, script.name
        if "publish(" in text or "record(" in text.replace("def record(", ""):
            assert '"--record"' in text or script.name == "common.py", script.name
