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


def specexport(*args, timeout: float = 900) -> str:
    """`specexport ARGS...`'s stdout; where it fails, the test fails with the command's last lines of stderr (a
    fixture's build that fails on a full disk says so, not only its exit status)."""
    import pytest

    done = subprocess.run([SPECEXPORT, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        pytest.fail(f"specexport {' '.join(map(str, args))} exited {done.returncode}:\n{tail}", pytrace=False)
    return done.stdout

# `specexport serve` with every request's text held at its first piece while a gate file exists (until the request
# is cancelled): the scheduler's thread waits there, so what a request does next waits for the test (a disconnect, a
# signal, more clients), not for how fast this machine generates. At most 120 s, then it goes on.
GATED = """
import os, sys, time
from specexport.cli import main
from specexport.runtime import scheduler

gate, submit = os.environ["SPECEXPORT_TEST_GATE"], scheduler.Scheduler.submit


def gated_submit(self, *args, on_text=None, **kwargs):
    box = []

    def held(piece):  # (box: the request, once submit has returned it)
        deadline = time.monotonic() + 120
        while (not box or os.path.exists(gate) and not box[0].cancelled) and time.monotonic() < deadline:
            time.sleep(0.005)
        (on_text or box[0]._text)(piece)

    box.append(submit(self, *args, on_text=held, **kwargs))
    return box[0]


scheduler.Scheduler.submit = gated_submit
sys.argv[0] = "specexport"
sys.exit(main())
"""


class Gate:
    """The file a server started with `Served(..., gate=Gate(path))` holds its generations on: `hold()` creates it
    (requests submitted stop at their first piece of text, each until it is cancelled), `release()` removes it."""

    def __init__(self, path):
        self.path = Path(path)

    def hold(self) -> None:
        self.path.touch()

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def wait_for(condition, what: str, timeout: float = 60.0, every: float = 0.01):
    """Poll `condition()` until it returns something true (returned), or fail after `timeout` seconds: a bound on a
    hang, never a guess at how long something takes."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout} s for {what}")
        time.sleep(every)
    return value


class Served:
    def __init__(self, bundle, *options, command=None, env=None, start_timeout=180.0, port=0, gate: Gate | None = None):
        if gate is not None:  # held by the gate's file (GATED)
            command, env = [sys.executable, "-c", GATED], {**(env or {}), "SPECEXPORT_TEST_GATE": str(gate.path)}
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
