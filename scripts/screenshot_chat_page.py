#!/usr/bin/env python3
"""The README's picture of the chat page: `ferrox-batch serve` on a model, a question asked from the page in
headless Chromium, the streamed reply awaited, and the window saved as a PNG.

Needs Debian's `chromium` and `chromium-driver` and the test extra's `selenium` (as the browser tests do).

    python scripts/screenshot_chat_page.py --out docs/images/chat-page.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferrox_batch.bench.batcher import default_model  # noqa: E402

QUESTION = "Explain continuous batching in two sentences."
SYSTEM = "You are a concise assistant."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, patience: float = 300) -> None:
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not start in time")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(os.environ))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "chat-page.png")
    p.add_argument("--question", default=QUESTION)
    args = p.parse_args()
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "ferrox_batch.cli", "serve", "--model", args.model,
                               "--port", str(port)], cwd=ROOT)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,760",
                 "--hide-scrollbars"):
        options.add_argument(flag)
    driver = None
    try:
        wait_ready(url, server)
        driver = webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")), options=options)
        driver.get(url + "/")
        wait = WebDriverWait(driver, 120)
        wait.until(lambda d: "max_model_len" not in d.find_element(By.ID, "model").text
                   and "connecting" not in d.find_element(By.ID, "model").text)
        driver.find_element(By.ID, "system").send_keys(SYSTEM)
        max_tokens = driver.find_element(By.ID, "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("160")
        driver.find_element(By.ID, "prompt").send_keys(args.question)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".usage"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
        print(f"# wrote {args.out}")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
