"""The status page in a real browser: Debian's headless Chromium driven by Selenium through
Debian's chromedriver (same build as the browser, so no version drift and nothing downloaded).

Two simulated pools behind the gateway; the page must list every pool and worker, show a worker
the test kills as unhealthy and one it drains through the admin API as draining, with live
in-flight streams, load and KV usage. The screenshot is saved under the test's tmp_path (printed);
`UPDATE_STATUS_SCREENSHOT=1` also copies it to docs/status-page.png for the README.
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth.keys import hash_key
from tests.support import REPO_ROOT, RunningGateway, RunningSim, pool

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver); "
           ".ci/run installs them")

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
PAGE_WAIT_S = 20.0  # probes every 0.5 s, 3 failures, then the page's next 2 s poll: ~4 s expected
PROSE = "The gateway routes each request to the cheapest pool whose context fits. " * 300  # ~6,000 tokens


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}",
                "--window-size=1200,560"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


ROWS_JS = """
return Array.from(document.querySelectorAll("tr[data-worker]"), (row) => ({
  id: row.dataset.worker, state: row.dataset.state, draining: row.dataset.draining,
  badge: row.querySelector("[data-field=state] .badge").textContent,
  in_flight: row.querySelector("[data-field=in-flight]").textContent}));
"""
# One script call reads the whole table at once: the page rebuilds it every 2 s, so element
# handles kept across calls go stale.


def rows(driver: Any) -> dict[str, dict[str, str]]:
    """Worker id → what the page shows of it: state, badge text, draining flag, in-flight."""
    return {row["id"]: row for row in driver.execute_script(ROWS_JS)}


def text_of(driver: Any, selector: str) -> list[str]:
    """The text of every element matching `selector`, read in one call."""
    return driver.execute_script("return Array.from(document.querySelectorAll(arguments[0]), e => e.textContent);",
                                 selector)


def wait_for(driver: Any, check: Callable[[Any], Any], what: str) -> Any:
    from selenium.webdriver.support.wait import WebDriverWait

    return WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2).until(check, message=f"page never showed {what}")


class Streams:
    """Streaming requests held open in background threads until `stop()` (bounded join)."""

    def __init__(self) -> None:
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.workers: list[str] = []

    def start(self, url: str, body: dict[str, Any]) -> None:
        def run() -> None:
            try:
                with httpx.stream("POST", url, json=body, timeout=30) as response:
                    self.workers.append(response.headers.get("x-kimi-gateway-worker", "?"))
                    for _ in response.iter_lines():
                        if self.stop_event.is_set():
                            break
            except httpx.HTTPError:
                pass  # the gateway stopping under a held stream ends it; nothing to report

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(10)


def test_status_page_shows_pools_workers_and_their_health(start_sim: StartSim, start_gateway: StartGateway,
                                                          browser: Any, tmp_path: Path) -> None:
    sim = {"kv_capacity_tokens": 16384, "tpot_s": 0.02}
    short = [start_sim("vllm", **sim), start_sim("vllm", **sim)]
    long = [start_sim("sglang", max_context_tokens=524288, **sim) for _ in range(2)]
    gw = start_gateway([pool("vllm-128k", "vllm", [s.url for s in short], 131072),
                        pool("sglang-512k", "sglang", [s.url for s in long], 524288)],
                       health={"interval": 0.5, "timeout": 1.0, "unhealthy_after": 3})
    chat = gw.v1 + "/chat/completions"
    for i in range(6):
        body = {"model": "kimi-k3", "messages": [{"role": "user", "content": f"question {i % 2}: {PROSE}"}],
                "max_tokens": 4, "stream": i >= 4}  # two streamed: TTFT
        assert httpx.post(chat, json=body, timeout=10).status_code == 200

    browser.get(gw.url + "/dashboard")
    expected = {"vllm-128k/0", "vllm-128k/1", "sglang-512k/0", "sglang-512k/1"}
    shown = wait_for(browser, lambda d: (r := rows(d)) and set(r) == expected and r, "every worker")
    assert all(w["state"] == "healthy" and w["badge"] == "healthy" for w in shown.values()), shown
    assert [h for h in text_of(browser, "section[data-pool] h2")] == ["vllm-128k", "sglang-512k"]
    decisions = text_of(browser, "section[data-pool] [data-field=decisions]")[0]
    assert "%" in decisions, decisions  # the decision mix of the 6 requests above

    short[1].server.stop()  # kill a worker: its probes fail
    wait_for(browser, lambda d: rows(d)["vllm-128k/1"]["state"] == "unhealthy", "vllm-128k/1 unhealthy")

    assert httpx.post(gw.url + "/admin/workers/sglang-512k/0/drain").json()["draining"] is True
    wait_for(browser, lambda d: rows(d)["sglang-512k/0"]["state"] == "draining", "sglang-512k/0 draining")
    final = rows(browser)
    assert final["sglang-512k/0"]["badge"] == "draining" and final["sglang-512k/0"]["draining"] == "true"
    assert final["vllm-128k/0"]["state"] == "healthy" and final["sglang-512k/1"]["state"] == "healthy"

    # Live load for the picture (and a check that in-flight reaches the page): two long streams.
    streams = Streams()
    try:
        streams.start(chat, {"model": "kimi-k3", "stream": True, "max_tokens": 2000,
                             "messages": [{"role": "user", "content": PROSE}]})
        streams.start(chat, {"model": "kimi-k3", "stream": True, "max_tokens": 200_000,  # only 512K fits
                             "messages": [{"role": "user", "content": "long: " + PROSE}]})
        wait_for(browser, lambda d: rows(d)["vllm-128k/0"]["in_flight"] == "1"
                 and rows(d)["sglang-512k/1"]["in_flight"] == "1", "the two open streams in flight")
        totals = text_of(browser, "#totals")[0]
        assert "requests/s" in totals and "affinity hits" in totals, totals
        height, chrome = browser.execute_script(
            "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight];")
        browser.set_window_size(1200, height + chrome + 8)  # the whole page, no scroll bar
        shot = tmp_path / "status-page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        streams.stop()
    print(f"status page screenshot: {shot}")
    if os.environ.get("UPDATE_STATUS_SCREENSHOT") == "1":
        target = REPO_ROOT / "docs" / "status-page.png"
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, target)


def test_status_page_with_auth_asks_for_the_admin_key(start_sim: StartSim, start_gateway: StartGateway,
                                                      browser: Any) -> None:
    from selenium.webdriver.common.by import By

    user_key, admin_key = "sk-user-" + secrets.token_hex(24), "sk-admin-" + secrets.token_hex(24)
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], auth={"enabled": True, "keys": [
        {"name": "app", "sha256": hash_key(user_key)},
        {"name": "ops", "sha256": hash_key(admin_key), "scopes": ["user", "admin"]}]})
    visible = "return !document.getElementById('auth').hidden;"

    def give_key(key: str) -> None:
        field = browser.find_element(By.ID, "key")
        field.send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#auth button").click()

    browser.get(gw.url + "/dashboard")
    wait_for(browser, lambda d: d.execute_script(visible), "the key form")
    assert rows(browser) == {}  # nothing without a key
    give_key(user_key)
    wait_for(browser, lambda d: d.execute_script(visible) and "admin" in text_of(d, "#auth-msg")[0],
             "the 403 message for a key without the admin scope")
    assert rows(browser) == {}
    give_key(admin_key)
    wait_for(browser, lambda d: set(rows(d)) == {"p/0"}, "the worker once the admin key is given")
    assert not browser.execute_script(visible)
    assert browser.execute_script("return sessionStorage.getItem('kimi-gateway-admin-key');") == admin_key
    assert admin_key not in browser.current_url

    browser.refresh()  # the key survives a reload of the tab
    wait_for(browser, lambda d: set(rows(d)) == {"p/0"}, "the worker after a reload")
    browser.find_element(By.ID, "forget").click()  # forgetting it brings the form back
    wait_for(browser, lambda d: d.execute_script(visible) and rows(d) == {}, "the key form after forget")
    assert browser.execute_script("return sessionStorage.getItem('kimi-gateway-admin-key');") is None
