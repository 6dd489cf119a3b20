"""A headless Chromium driven over the DevTools protocol, for the tests that check a page as
a reader's browser renders it.

The protocol runs over a pipe (``--remote-debugging-pipe``: commands on the browser's fd 3,
answers and events on its fd 4, each message JSON ended by a NUL byte), so no port, no
WebDriver and no Python package beyond the standard library are needed. Chromium is Debian's
``chromium`` package; :func:`find_chromium` says where it is, or None.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV_VAR = "DISTCONFORM_CHROMIUM"
_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """``$DISTCONFORM_CHROMIUM``, else the first Chromium on the PATH."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return shutil.which(explicit) or explicit
    return next((found for name in _NAMES if (found := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class Page:
    """One tab: load a file, evaluate JavaScript, click, and the console errors seen."""

    def __init__(self, browser: Browser, session: str) -> None:
        self._browser = browser
        self._session = session
        self.console_errors: list[str] = []

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        return self._browser.send(method, params, session=self._session, page=self)

    def load(self, path: Path, timeout: float = 30.0) -> None:
        self.send("Page.navigate", url=path.resolve().as_uri())
        self._browser.wait_for("Page.loadEventFired", self._session, self, timeout)

    def evaluate(self, expression: str) -> Any:
        answer = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in answer:
            raise BrowserError(f"{expression!r} raised: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) in the middle of the element."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            "return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def observe(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.console_errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.console_errors.append(json.dumps(params.get("args", []))[:500])
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.console_errors.append(f"{entry.get('source')}: {entry.get('text')}")


class Browser:
    def __init__(self, commands: int, answers: int) -> None:
        self._commands = commands
        self._answers = answers
        self._buffer = b""
        self._next_id = 0

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session: str | None = None,
        page: Page | None = None,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if page is not None and reply.get("sessionId") == session:
                page.observe(reply)

    def wait_for(self, event: str, session: str, page: Page, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, event)
            if reply.get("sessionId") == session:
                page.observe(reply)
                if reply.get("method") == event:
                    return

    def _read(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError(f"no answer from Chromium for {waiting_for}")
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                raise BrowserError(f"Chromium closed the pipe while waiting for {waiting_for}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def new_page(self, width: int = 1280, height: int = 900) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log"):
            page.send(f"{domain}.enable")
        page.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return page


@contextmanager
def chromium(executable: str) -> Iterator[Browser]:
    """A headless Chromium for the duration of the block, with a throw-away profile."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # The browser's ends move above every fd the file actions write, so that placing one on
    # 3 or 4 cannot close the other first.
    high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 64)
    high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 64)
    for fd in (to_browser_r, from_browser_w):
        os.close(fd)
    with tempfile.TemporaryDirectory(prefix="distconform-chromium-") as profile:
        arguments = [
            executable,
            "--headless=new",
            "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        pid = os.posix_spawn(
            executable,
            arguments,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_DUP2, high_r, 3),
                (os.POSIX_SPAWN_DUP2, high_w, 4),
            ],
        )
        os.close(high_r)
        os.close(high_w)
        try:
            yield Browser(to_browser_w, from_browser_r)
        finally:
            os.close(to_browser_w)
            os.close(from_browser_r)
            _stop(pid)


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
