"""A real `specexport serve` in a subprocess on a free loopback port, for the server's tests: its URL, its log lines,
its stop by a signal. Every request the tests send goes to 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SPECEXPORT = Path(sys.executable).parent / "specexport"


class Served:
    def __init__(self, bundle, *options, command=None, env=None, start_timeout=180.0, port=0):
        argv = command or [str(SPECEXPORT)]
        self.process = subprocess.Popen([*argv, "serve", str(bundle), "--port", str(port), *map(str, options)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + start_timeout
        while not self._ready.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("the server did not start:\n" + "\n".join(self.lines))

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.url is None and line.startswith("serving ") and " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                self._ready.set()

    @property
    def pid(self) -> int:
        return self.process.pid

    def access_log(self) -> list[dict]:
        """The access log's JSON lines so far."""
        return [json.loads(line) for line in self.lines if line.startswith('{"request_id"')]

    def stop(self, sig=signal.SIGTERM, timeout=60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
