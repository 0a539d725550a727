"""The README's picture of the chat page: `serve` on a bundle (default demo/bundle, which scripts/demo.sh builds),
two questions asked in headless Chromium, the page saved as docs/chat-page.png.

    python scripts/screenshot.py [BUNDLE] [--out docs/chat-page.png]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?", default="demo/bundle")
    p.add_argument("--out", default="docs/chat-page.png")
    a = p.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("screenshot: no chromium on PATH (apt-get install chromium)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "gemma_ane", "serve", a.bundle, "--port", str(port), "--backend", "mil"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            if server.poll() is not None:
                sys.exit(f"screenshot: serve {a.bundle} exited ({server.returncode})")
            time.sleep(0.2)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1000, "height": 640}, bypass_csp=True)
            page.goto(url)
            page.wait_for_function("document.getElementById('model-name').textContent !== '…'")
            page.click("#toggle-settings")
            page.fill("#temperature", "0")
            for question, thinking in (("What is 7 + 8?", True), ("What is the capital of France?", False)):
                page.locator("#thinking").set_checked(thinking)
                page.fill("#input", question)
                page.press("#input", "Enter")
                page.wait_for_selector("#send:not([disabled])", timeout=120_000)
            page.click("#toggle-settings")
            page.locator("details.reasoning").first.evaluate("d => d.open = true")
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=a.out)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"screenshot: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
