"""A loopback Hugging Face hub: the endpoints `huggingface_hub` calls to list and download a model
repo (repo info, recursive tree, HEAD/GET `resolve` with byte ranges, the model search), serving
repos held in memory. The real client runs against it through `HF_ENDPOINT`.

`cut_once` names files whose first GET is cut off after half their bytes (the connection closed
mid-body, as a dropped link does); `requests` records (method, path, Range header) of every call.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.cut_once: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- routing

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        path, query = unquote(url.path), parse_qs(url.query)
        self.requests.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) == 2:
            return self.search(h, query)
        if parts[:2] == ["api", "models"] and len(parts) >= 5:
            repo = "/".join(parts[2:4])
            if repo not in self.repos:
                return self.not_found(h, "RepoNotFound")
            if parts[4] == "revision":
                return self.json(h, {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in self.repos[repo]]})
            if parts[4] == "tree":
                return self.json(h, self.tree(repo))
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            if repo not in self.repos:
                return self.not_found(h, "RepoNotFound")
            if name not in self.repos[repo]:
                return self.not_found(h, "EntryNotFound")
            return self.file(h, repo, name, head)
        return self.not_found(h, "")

    def tree(self, repo: str) -> list[dict]:
        files = self.repos[repo]
        folders = sorted({f.rsplit("/", 1)[0] for f in files if "/" in f})
        out = [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()} for d in folders]
        for name, data in sorted(files.items()):
            entry = {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            if name.endswith((".gguf", ".safetensors")):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
            out.append(entry)
        return out

    def search(self, h: BaseHTTPRequestHandler, query: dict[str, list[str]]) -> None:
        author, search = query.get("author", [""])[0], query.get("search", [""])[0].lower()
        found = [r for r in self.repos if r.startswith(author + "/") and search in r.lower()]
        self.json(h, [{"id": r, "modelId": r, "_id": r} for r in found])

    # -- answers

    def json(self, h: BaseHTTPRequestHandler, body: object) -> None:
        data = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def not_found(self, h: BaseHTTPRequestHandler, code: str) -> None:
        data = json.dumps({"error": code or "not found"}).encode()
        h.send_response(404)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def file(self, h: BaseHTTPRequestHandler, repo: str, name: str, head: bool) -> None:
        data = self.repos[repo][name]
        etag = hashlib.sha256(data).hexdigest() if name.endswith((".gguf", ".safetensors")) else hashlib.sha1(data).hexdigest()
        start = 0
        if (ranged := h.headers.get("Range")) and ranged.startswith("bytes="):
            start = int(ranged[6:].split("-")[0])
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        if name in self.cut_once and not start:
            self.cut_once.discard(name)
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(body)
