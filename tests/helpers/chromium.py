"""Headless Chromium driven over the DevTools protocol, for the tests that read a page as a browser draws it
(report.html, the docs site). Debian's `chromium`; .ci/run installs it, and the tests skip without it."""
import json
import os
import select
import shutil
import subprocess

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium); .ci/run installs it")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions"]


class DevTools:
    """Chromium over --remote-debugging-pipe: NUL-terminated DevTools JSON, commands on fd 3, answers on fd 4."""

    def __init__(self, profile):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds():  # the child reads commands on fd 3 and answers on fd 4
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)
            os.set_inheritable(3, True)  # dup2 onto itself would keep close-on-exec
            os.set_inheritable(4, True)

        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe"],
                                     preexec_fn=fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf, self._id, self.session = b"", 0, None

    def read(self, timeout=90):
        """The next message from the browser (an answer or an event)."""
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from_browser], [], [], timeout)
            assert ready, f"chromium did not answer within {timeout} s"
            chunk = os.read(self._from_browser, 1 << 20)
            assert chunk, "chromium closed its DevTools pipe"
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, **params):
        """Send one command (to the attached page's session, unless it is a Target command); its result."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        while (reply := self.read()).get("id") != self._id:
            pass
        assert "error" not in reply, reply
        return reply["result"]

    def js(self, expression):
        """Evaluate ``expression`` in the page (awaiting a promise); its value."""
        return self.call("Runtime.evaluate", expression=expression, awaitPromise=True,
                         returnByValue=True)["result"].get("value")

    def close(self):
        try:
            self.call("Browser.close")
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_browser)
        os.close(self._from_browser)
