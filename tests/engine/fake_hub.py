"""A local HTTP server standing in for the Hugging Face Hub (`HF_ENDPOINT=http://127.0.0.1:PORT`), serving the
calls huggingface_hub makes to find and fetch a model's files (as its 2.x client makes them):

    GET  /api/models/ORG/NAME[/revision/REV]        model_info: the commit a revision is at, the files and sizes
    GET  /api/models/ORG/NAME/tree/REV[/PATH]       list_repo_tree (recursive): path, size, blob id of each file
    HEAD /ORG/NAME/resolve/REV/PATH                 a file's metadata (commit, ETag, size)
    GET  /ORG/NAME/resolve/REV/PATH                 the file

Errors answer as the Hub does, with `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound), which
huggingface_hub turns into its typed errors. Every request is recorded (`requests`), so a test can say which files
were fetched and which never were.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: tuple[str, ...] = ("main",)


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[tuple[str, str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def fetched(self) -> set[str]:
        """The files downloaded (GET of resolve/), by path in their repository."""
        return {
            path.split("/resolve/", 1)[1].split("/", 1)[1]
            for method, path in self.requests
            if method == "GET" and "/resolve/" in path
        }

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, head=True)

            def do_GET(self) -> None:
                hub.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    def answer(self, handler: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append(("HEAD" if head else "GET", path))
        if path.startswith("/api/models/"):
            self._api(handler, path[len("/api/models/") :])
            return
        repo_id, rest = _split_repo(path.lstrip("/"))
        repo = self.repos.get(repo_id)
        if repo is None or not rest.startswith("resolve/"):
            _error(handler, 404, "RepoNotFound")
            return
        revision, _, file = rest[len("resolve/") :].partition("/")
        if not self._knows(repo, revision):
            _error(handler, 404, "RevisionNotFound")
            return
        if file not in repo.files:
            _error(handler, 404, "EntryNotFound")
            return
        body = repo.files[file]
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", repo.commit)
        handler.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    def _api(self, handler: BaseHTTPRequestHandler, rest: str) -> None:
        repo_id, rest = _split_repo(rest)
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(handler, 404, "RepoNotFound")
            return
        kind, _, revision = rest.partition("/")
        revision, _, under = revision.partition("/")
        if not kind:  # /api/models/ORG/NAME: the default branch's info
            kind, revision = "revision", repo.branches[0]
        if not self._knows(repo, revision):
            _error(handler, 404, "RevisionNotFound")
            return
        if kind == "revision":
            body = {
                "id": repo_id,
                "sha": repo.commit,
                "siblings": [{"rfilename": name, "size": len(data)} for name, data in repo.files.items()],
            }
        elif kind == "tree":
            body = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in sorted(repo.files.items())
                if not under or name.startswith(under.rstrip("/") + "/")
            ]
        else:
            _error(handler, 404, "EntryNotFound")
            return
        data = json.dumps(body).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    @staticmethod
    def _knows(repo: FakeRepo, revision: str) -> bool:
        return revision in repo.branches or revision == repo.commit


def _split_repo(path: str) -> tuple[str, str]:
    org, _, rest = path.partition("/")
    name, _, rest = rest.partition("/")
    return f"{org}/{name}", rest


def _error(handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
    data = json.dumps({"error": code}).encode()
    handler.send_response(status)
    handler.send_header("X-Error-Code", code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


def folder_files(folder) -> dict[str, bytes]:
    """Every file under `folder`, by its path relative to it (a model written by deltafin.tiny, say)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
