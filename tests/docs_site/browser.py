"""A headless Chromium driven over the Chrome DevTools protocol, for the site's tests.

Chromium comes from the distribution's packages (``apt-get install chromium``); the protocol is
spoken over a websocket (websocket-client, pinned in constraints.txt). The browser runs in a
process group of its own, so that closing it ends its helper processes too, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 30.0
INSTALL_TIMEOUT_S = 600
# The machine's network is closed: without these Chromium keeps trying to reach Google's
# services (updates, sync, field trials, QUIC) and floods the log with refused connections.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)


def find_or_install_chromium() -> tuple[str | None, str]:
    """The browser's path, or None and why there is none.

    As root with apt-get at hand (CI runs as root), a missing Chromium is installed from the
    distribution's packages first."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path, ""
    if not shutil.which("apt-get"):
        return None, f"none of {BROWSERS} is installed and there is no apt-get to install one"
    if os.geteuid() != 0:
        return None, f"none of {BROWSERS} is installed; as root: apt-get install -y chromium"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium"]
    result = subprocess.run(
        install, capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S
    )
    if result.returncode != 0:  # an image whose package lists were never fetched
        subprocess.run(
            ["apt-get", "update", "-q"], capture_output=True, env=env, timeout=INSTALL_TIMEOUT_S
        )
        result = subprocess.run(
            install, capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S
        )
    path = shutil.which("chromium")
    if path is None:
        return (
            None,
            f"apt-get install chromium failed (exit {result.returncode}): {result.stderr[-800:]}",
        )
    return path, ""


@dataclass
class PageVisit:
    """What a page showed once loaded: its title, first heading, links, assets and errors."""

    url: str
    title: str
    heading: str
    links: list[str]  # <a href>, absolute
    assets: list[str]  # what the page itself loads: stylesheets, scripts, images
    errors: list[str] = field(default_factory=list)


class Browser:
    """One headless Chromium and one tab, driven over the DevTools protocol."""

    def __init__(self, executable: str, user_data_dir: Path) -> None:
        self._process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: close() ends its helpers too
        )
        try:
            port = self._wait_for_port(user_data_dir / "DevToolsActivePort")
            # Imported here: where websocket-client is missing, the test skips before this.
            import websocket

            self._socket = websocket.create_connection(
                self._page_socket_url(port), timeout=CALL_TIMEOUT_S, suppress_origin=True
            )
        except BaseException:
            self.close()
            raise
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _wait_for_port(self, port_file: Path) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                stderr = (
                    self._process.stderr.read().decode(errors="replace")
                    if self._process.stderr
                    else ""
                )
                raise RuntimeError(
                    f"Chromium exited with {self._process.returncode} before it opened its "
                    f"DevTools port: {stderr[-2000:]}"
                )
            lines = port_file.read_text().splitlines() if port_file.exists() else []
            if lines and lines[0].isdigit():
                return int(lines[0])
            time.sleep(0.05)  # polling a file Chromium writes once it listens
        raise TimeoutError(f"Chromium did not write {port_file} within {START_TIMEOUT_S} s")

    @staticmethod
    def _page_socket_url(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            targets = json.load(reply)
        pages = [t for t in targets if t.get("type") == "page"]
        if not pages:
            raise RuntimeError(f"Chromium has no page to drive: {targets}")
        return pages[0]["webSocketDebuggerUrl"]

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        number = self._next_id
        self._socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv())
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}({params}) failed: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self._events.append(message)

    def _wait_for_event(self, method: str) -> dict[str, Any]:
        for index, event in enumerate(self._events):
            if event["method"] == method:
                return self._events.pop(index)
        while True:  # the socket's timeout bounds each wait
            message = json.loads(self._socket.recv())
            if message.get("method") == method:
                return message
            if "method" in message:
                self._events.append(message)

    def visit(self, url: str) -> PageVisit:
        """Load ``url``, wait for its load event, and read what the page shows."""
        self._events.clear()
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            return PageVisit(url, "", "", [], [], [f"navigation failed: {result['errorText']}"])
        self._wait_for_event("Page.loadEventFired")
        state = self.call(
            "Runtime.evaluate",
            expression="""JSON.stringify({
                title: document.title,
                heading: (document.querySelector("article h1") || {}).textContent || "",
                links: [...document.querySelectorAll("a[href]")].map(a => a.href),
                assets: [...document.querySelectorAll("link[href]")].map(l => l.href).concat(
                    [...document.querySelectorAll("script[src], img[src]")].map(s => s.src)),
            })""",
            returnByValue=True,
        )
        shown = json.loads(state["result"]["value"])
        return PageVisit(
            url, shown["title"], shown["heading"], shown["links"], shown["assets"], self._errors()
        )

    def _errors(self) -> list[str]:
        errors = []
        for event in self._events:
            params = event.get("params", {})
            if event["method"] == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                thrown = details.get("exception", {}).get("description") or details.get("text")
                errors.append(f"exception: {thrown}")
            elif event["method"] == "Runtime.consoleAPICalled" and params.get("type") in (
                "error",
                "assert",
            ):
                texts = [
                    str(arg.get("value", arg.get("description", "")))
                    for arg in params.get("args", [])
                ]
                errors.append(f"console.{params['type']}: {' '.join(texts)}")
            elif (
                event["method"] == "Log.entryAdded"
                and params.get("entry", {}).get("level") == "error"
            ):
                entry = params["entry"]
                errors.append(
                    f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
                )
        return errors

    def close(self) -> None:
        """End the browser and its helpers: the process group it leads, which we started."""
        socket = getattr(self, "_socket", None)
        if socket is not None:
            socket.close()
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(timeout=10)
        else:  # the leader is gone; its helpers may not be
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._process.stderr is not None:
            self._process.stderr.close()
