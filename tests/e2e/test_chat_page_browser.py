"""The chat page in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`) driven by
Selenium against a live server.

Pins: a message sent from the page gets its reply streamed in (the reply's text changes several times
before it is done) with the usage line under it (TTFT, tok/s); the stop button cancels a long reply, and
the server sees the request cancelled (a client disconnect) and has every block free again; with an API
key set, the page shows the key prompt, and once given the key it chats. The page fetches nothing from
anywhere but the server (Chromium's own log of the page's requests).

A machine without the browser skips these tests, except where `FERROX_REQUIRE_BROWSER=1` (CI sets it and
installs the browser first): there a missing browser fails them. Install it with
`apt-get install chromium chromium-driver`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
from server_helpers import DEADLINE, poll, served, stats

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
KEY = "page-test-key"
#: Seconds the page may take to do what a step asks (the machine may be loaded).
WAIT = 60

if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("FERROX_REQUIRE_BROWSER") == "1":
        pytest.fail("FERROX_REQUIRE_BROWSER=1 but chromium and chromedriver are not both installed", pytrace=False)
    pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True)

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def slow_batcher(model, seconds_per_token: float) -> ContinuousBatcher:
    """The tiny model, each token's text taking `seconds_per_token` to come: a reply long enough to stop."""
    def decode(ids: list[int]) -> bytes:
        time.sleep(seconds_per_token)
        return model.tokenizer.decode(ids)

    batcher = ContinuousBatcher.spawn_with_config(model.decoder, decode, BatcherConfig(kv_block_size=16, kv_blocks=256))
    batcher.tokenizer = model.tokenizer
    return batcher


@contextlib.contextmanager
def page(browser, base_url: str) -> Iterator[object]:
    browser.get_log("performance")  # drop what earlier pages logged
    browser.get(base_url + "/")
    yield browser
    requested = [json.loads(entry["message"])["message"] for entry in browser.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requested if m.get("method") == "Network.requestWillBeSent"]
    assert urls and all(url.startswith(base_url) for url in urls), urls


def wait(browser, condition, what: str):
    return WebDriverWait(browser, WAIT).until(lambda d: condition(d), message=what)


def set_field(browser, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def send(browser, text: str) -> object:
    """Type `text`, send it, and return the reply's bubble once it appears."""
    before = len(browser.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    set_field(browser, "prompt", text)
    browser.find_element(By.ID, "send").click()
    replies = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant")[before:] or False,
                   "the reply's bubble")
    return replies[0]


def watch_text(browser, element) -> None:
    """Count the changes of `element`'s text from now on, in `window.changes`."""
    browser.execute_script(
        "window.changes = 0; new MutationObserver(() => { window.changes += 1; })"
        ".observe(arguments[0], {childList: true, characterData: true, subtree: true});", element)


def test_a_reply_streams_in_with_its_timings(browser, tiny_batch_model):
    with served(slow_batcher(tiny_batch_model, 0.01)) as (base_url, _app), page(browser, base_url):
        wait(browser, lambda d: "tiny" in d.find_element(By.ID, "model").text, "the page to find the model")
        set_field(browser, "max-tokens", "24")
        set_field(browser, "system", "You are terse.")
        reply = send(browser, "Hello there")
        watch_text(browser, reply)
        wait(browser, lambda d: reply.get_attribute("data-state") == "done", "the reply to finish")
        assert reply.text.strip() and browser.execute_script("return window.changes") >= 2
        usage = browser.find_element(By.CSS_SELECTOR, ".message.assistant + .usage").text
        assert "TTFT" in usage and "tok/s" in usage and "completion tokens" in usage, usage
        second = send(browser, "And again")  # the conversation goes on: the first turn is in the prompt
        wait(browser, lambda d: second.get_attribute("data-state") == "done", "the second reply")


def test_stop_cancels_the_request_and_frees_its_blocks(browser, tiny_batch_model):
    with served(slow_batcher(tiny_batch_model, 0.05)) as (base_url, _app), page(browser, base_url):
        wait(browser, lambda d: "tiny" in d.find_element(By.ID, "model").text, "the page to find the model")
        set_field(browser, "max-tokens", "400")
        reply = send(browser, "Tell me a long story")
        wait(browser, lambda d: len(reply.text) > 0, "the first text")
        poll(lambda: stats(base_url)["kv_blocks_free"] < stats(base_url)["kv_blocks_total"], "blocks held")
        browser.find_element(By.ID, "stop").click()
        wait(browser, lambda d: reply.get_attribute("data-state") == "stopped", "the reply to stop")
        assert browser.find_element(By.ID, "send").is_enabled()
        poll(lambda: stats(base_url)["kv_blocks_free"] == stats(base_url)["kv_blocks_total"], "every block free")
        metrics = httpx.get(base_url + "/metrics", timeout=DEADLINE).text
        assert "ferrox_batch_client_disconnects_total 1.0" in metrics


def test_the_key_prompt_shows_when_the_server_needs_one(browser, tiny_batch_model):
    with served(slow_batcher(tiny_batch_model, 0.0), api_key=KEY) as (base_url, _app), page(browser, base_url):
        panel = browser.find_element(By.ID, "key-panel")
        wait(browser, lambda d: panel.is_displayed(), "the key prompt")
        assert "needs an API key" in panel.text and browser.find_element(By.ID, "model").text == "locked"
        set_field(browser, "api-key", "wrong")
        set_field(browser, "max-tokens", "8")
        set_field(browser, "prompt", "Hi")
        browser.find_element(By.ID, "send").click()
        wait(browser, lambda d: "Enter the API key" in d.find_element(By.ID, "status").text, "the wrong key refused")
        assert not browser.find_elements(By.CSS_SELECTOR, ".message") and panel.is_displayed()
        set_field(browser, "api-key", KEY)
        browser.find_element(By.ID, "prompt").click()  # leaving the key field makes the page connect
        wait(browser, lambda d: "tiny" in d.find_element(By.ID, "model").text, "the page to connect with the key")
        reply = send(browser, "Hi")
        wait(browser, lambda d: reply.get_attribute("data-state") == "done", "a reply with the key")
