"""A loopback stand-in for the Hugging Face Hub HTTP API, so publishing can be tested offline.

It answers what `HfApi.create_repo` + `HfApi.upload_folder` send (environment-facts §9): repo
creation, README metadata validation, preupload (every file "regular") and the NDJSON commit,
and keeps the committed files in memory. Use the `hub_stub` fixture, which also lifts
HF_HUB_OFFLINE for the test, or `serve_hub()` directly.
"""

import base64
import contextlib
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import huggingface_hub.constants
import pytest

_REPO_ROUTE = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/(?P<action>preupload|commit)/(?P<rev>[^/]+)$")


@dataclass
class HubStore:
    """What the stand-in received: `repos[repo_id][path] = bytes` of committed files, and
    `requests` as "METHOD /path" strings. Set `fail_status` to answer every request with it."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    fail_status: int | None = None


def _handler(store: HubStore):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        @property
        def _endpoint(self) -> str:
            return "http://%s:%d" % self.server.server_address[:2]

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_GET(self):
            store.requests.append(f"GET {self.path}")
            self._reply(store.fail_status or 404, {"error": "not found"})

        def do_POST(self):
            store.requests.append(f"POST {self.path}")
            body = self._body()
            path = unquote(urlsplit(self.path).path)
            if store.fail_status:
                return self._reply(store.fail_status, {"error": f"stub answers {store.fail_status}"})
            if path == "/api/repos/create":
                payload = json.loads(body)
                repo_id = "/".join(filter(None, (payload.get("organization"), payload["name"])))
                url = f"{self._endpoint}/{repo_id}"
                if repo_id in store.repos:  # the Hub's 409 also carries the url; exist_ok relies on it
                    return self._reply(409, {"error": "You already created this model repo", "url": url})
                store.repos[repo_id] = {}
                return self._reply(200, {"url": url, "name": repo_id})
            if path == "/api/validate-yaml":
                return self._reply(200, {"errors": [], "warnings": []})
            match = _REPO_ROUTE.match(path)
            if not match or match["repo"] not in store.repos:
                return self._reply(404, {"error": f"no route or repo for {path}"})
            if match["action"] == "preupload":
                files = json.loads(body)["files"]
                return self._reply(200, {"files": [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files
                ]})
            repo_files = store.repos[match["repo"]]
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    repo_files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            oid = hashlib.sha1(body).hexdigest()
            return self._reply(200, {
                "commitUrl": f"{self._endpoint}/{match['repo']}/commit/{oid}", "commitOid": oid, "success": True,
            })

    return Handler


@contextlib.contextmanager
def serve_hub():
    """Run the stand-in on a free loopback port; yield (endpoint_url, HubStore)."""
    store = HubStore()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(store))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "http://127.0.0.1:%d" % server.server_address[1], store
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def hub_stub(monkeypatch):
    """(endpoint_url, HubStore) of a running stand-in, with Hub offline mode lifted for the test
    (huggingface_hub reads HF_HUB_OFFLINE once, into `constants.HF_HUB_OFFLINE`)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with serve_hub() as running:
        yield running
