"""A local stand-in for the Hugging Face Hub, so that download tests never reach huggingface.co.

It answers the requests huggingface_hub (2.x) makes for `HfApi.model_info` and `snapshot_download`:

    GET       /api/models/ORG/NAME                    model info: the commit sha and the files ("siblings")
    GET       /api/models/ORG/NAME/revision/REV       the same, for a revision (snapshot_download's repo_info)
    GET       /api/models/ORG/NAME/tree/REV           the file listing (one page: no Link header)
    HEAD, GET /ORG/NAME/resolve/REV/PATH              a file, with X-Repo-Commit, ETag and Content-Length

Point huggingface_hub at it with HF_ENDPOINT=mirror.url (read when huggingface_hub is imported). Errors come
the Hub's way, with X-Error-Code (RepoNotFound, GatedRepo, EntryNotFound), which huggingface_hub turns into its
exception classes. Every request is recorded in `requests` ("GET /path").
"""

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(/revision/[^/]+)?")
TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/[^/]+")
FILE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/[^/]+/(?P<path>.+)")


def folder_files(folder: Path) -> dict[str, bytes]:
    """The files under `folder`, by their path relative to it, for a mirrored repository."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class HubMirror:
    """Serves repositories (dicts of path -> bytes) on 127.0.0.1 at a free port, in a thread; a context manager.

    `fail[repo] = (status, error_code)` answers every request for that repository with that error, and
    `on_file(path)`, if set, is called before a file GET is answered and may return a status to answer instead;
    `delay` holds every answer back that many seconds.
    """

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.fail: dict[str, tuple[int, str]] = {}
        self.on_file: Callable[[str], int | None] | None = None
        self.delay = 0.0  # seconds before each answer
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def commit(self, repo: str) -> str:
        """The repository's commit sha: 40 hex digits that change with its content."""
        digest = hashlib.sha1()
        for path, data in sorted(self.repos[repo].items()):
            digest.update(path.encode() + b"\0" + hashlib.sha1(data).digest())
        return digest.hexdigest()

    def answer(self, method: str, url: str) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for a request, the Hub's way."""
        self.requests.append(f"{method} {url}")
        time.sleep(self.delay)
        path = unquote(urlsplit(url).path)
        routes = {"info": INFO.fullmatch(path), "tree": TREE.fullmatch(path), "file": FILE.fullmatch(path)}
        kind, match = next(((kind, match) for kind, match in routes.items() if match), (None, None))
        if match is None:
            return 404, {}, b"Not Found"
        repo = match["repo"]
        if repo in self.fail:
            status, code = self.fail[repo]
            return status, {"X-Error-Code": code, "X-Error-Message": f"{code} (mirror)"}, b""
        if repo not in self.repos:
            return 404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b""
        files, sha = self.repos[repo], self.commit(repo)
        if kind == "info":
            siblings = [{"rfilename": f} for f in files]
            return _json({"id": repo, "modelId": repo, "sha": sha, "private": False, "siblings": siblings})
        if kind == "tree":
            return _json([
                {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for f, data in files.items()
            ])  # fmt: skip
        if match["path"] not in files:
            return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, b""
        if method == "GET" and self.on_file and (status := self.on_file(match["path"])):
            return status, {}, b""
        data = files[match["path"]]
        etag = hashlib.sha256(data).hexdigest()
        return 200, {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}, data


def _json(value) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(value).encode()


def _handler(mirror: HubMirror) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self._reply(*mirror.answer("GET", self.path))

        def do_HEAD(self):
            self._reply(*mirror.answer("HEAD", self.path), body=False)

        def _reply(self, status, headers, data, body=True):
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, *args):  # quiet: the requests are in mirror.requests
            pass

    return Handler
