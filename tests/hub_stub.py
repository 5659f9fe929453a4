"""A loopback stand-in for the Hugging Face Hub HTTP API, so publishing can be tested offline.

It answers what the real `HfApi.create_repo` + `HfApi.upload_folder` send when `hf_xet` is not
used, as huggingface/huggingface_hub sends it from `hf_api.py` (`create_repo`, `create_commit`),
`_commit_api.py` (`_fetch_upload_modes`) and `lfs.py` (`post_lfs_batch_info`, `lfs_upload`). The
fixture switches Xet off so the HTTP/LFS path is always taken:

- `POST /api/repos/create`: records the repo and whether it was created private (the client sends
  `"visibility": "private" | "public"`; older clients sent `"private": bool`); 409 if it exists.
- `POST /api/validate-yaml`: README metadata, always valid.
- `POST /api/models/{repo}/preupload/{rev}`: answers `uploadMode` per file by the Hub's rule:
  "lfs" for files the default `.gitattributes` tracks with LFS (`*.safetensors`, `*.bin`, ...), for
  files above `HubStore.lfs_threshold` (10 MB, as on the Hub) and for binary samples; "regular"
  otherwise. `oid` is always null, so every push commits every file again.
- `POST /{repo}.git/info/lfs/objects/batch`: the git-LFS batch API (`{"operation": "upload",
  "transfers": [...], "objects": [{"oid", "size"}], "hash_algo": "sha256", "ref": {...}}`). An
  object already in storage gets no actions (the client skips it); otherwise an `upload` action
  whose href points back at the stand-in, plus a `verify` action. With
  `HubStore.multipart_chunk_size` set, objects larger than it get the HF multipart form instead:
  `header = {"chunk_size": N, "00001": part_url, ...}` and the href is the completion endpoint.
- storage: `PUT /_lfs/{oid}` (single part) or `PUT /_lfs/{oid}/part/{n}` (answered with an ETag)
  + `POST /_lfs/{oid}/complete` (`{"oid", "parts": [{"partNumber", "etag"}]}`); the object is
  stored only if its size and sha256 match the oid announced in the batch call (else 400).
- `POST /{repo}.git/info/lfs/objects/verify`: 404 unless the object (oid, size) is stored.
- `POST /api/models/{repo}/commit/{rev}`: the NDJSON commit. `file` lines carry base64 content
  and are refused (400) for a path preupload told to go through LFS; `lfsFile` lines are resolved
  to the stored object (400 if it was never uploaded).

Everything received is kept on a `HubStore` for tests to assert on. Use the `hub_stub` fixture,
which also lifts HF_HUB_OFFLINE for the test, or `serve_hub()` directly.
"""

import base64
import contextlib
import fnmatch
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
_LFS_API_ROUTE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)\.git/info/lfs/objects/(?P<action>batch|verify)$")
_STORAGE_ROUTE = re.compile(r"^/_lfs/(?P<oid>[0-9a-f]{64})(?:/part/(?P<part>\d+)|/(?P<complete>complete))?$")

# the patterns of the .gitattributes every new Hub repo starts with (filter=lfs), abridged
LFS_PATTERNS = ("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
                "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
                "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "*.tar.*", "*.tar", "*.tflite",
                "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*")


@dataclass
class Commit:
    """One commit the stand-in accepted: files sent inline (`regular`, path -> bytes) and
    through LFS (`lfs`, path -> sha256 oid, the bytes being `HubStore.lfs_objects[oid]`)."""

    repo: str
    summary: str
    regular: dict[str, bytes]
    lfs: dict[str, str]


@dataclass
class HubStore:
    """What the stand-in received.

    `repos[repo_id][path] = bytes`: committed files, LFS pointers resolved to the stored bytes.
    `private[repo_id]`: the visibility create_repo asked for when it created the repo.
    `create_payloads`: every create_repo JSON body, in order (also the 409 ones).
    `upload_modes[(repo_id, path)]`: what preupload answered.
    `commits`: every accepted `Commit`, in order.
    `lfs_batches`: every LFS batch request body, in order (with "repo" added).
    `lfs_objects[oid] = bytes`: storage, only objects whose sha256 matched their oid.
    `storage_puts`: (oid, part number or None, byte count) of every storage PUT.
    `lfs_verifies`: the oids the client asked to verify.
    `requests`: "METHOD /path" strings. Set `fail_status` to answer every request with it.
    `lfs_threshold`: files above this many bytes go through LFS (the Hub's 10 MB).
    `multipart_chunk_size`: when set, LFS objects larger than it are uploaded in parts of this size.
    `storage_fail_status`: when set, storage PUTs are answered with it (an expired or refused upload URL).
    """

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    private: dict[str, bool] = field(default_factory=dict)
    create_payloads: list[dict] = field(default_factory=list)
    upload_modes: dict[tuple[str, str], str] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    lfs_batches: list[dict] = field(default_factory=list)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)
    storage_puts: list[tuple[str, int | None, int]] = field(default_factory=list)
    lfs_verifies: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    fail_status: int | None = None
    lfs_threshold: int = 10 * 1000 * 1000
    multipart_chunk_size: int | None = None
    storage_fail_status: int | None = None
    # upload sessions: oid -> announced size; multipart parts received so far: oid -> {n: bytes}
    _pending: dict[str, int] = field(default_factory=dict, repr=False)
    _parts: dict[str, dict[int, bytes]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def upload_mode(self, path: str, size: int, sample: bytes) -> str:
        """The Hub's rule: LFS for .gitattributes patterns, files over 10 MB and binary files."""
        name = path.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(path, pattern) for pattern in LFS_PATTERNS):
            return "lfs"
        if size > self.lfs_threshold:
            return "lfs"
        try:
            sample.decode("utf-8")
        except UnicodeDecodeError:
            # the sample is the first 512 bytes: a multi-byte character may be cut at the end
            if len(sample) < 512 or not _utf8_but_cut(sample):
                return "lfs"
        return "lfs" if b"\x00" in sample else "regular"


def _utf8_but_cut(sample: bytes) -> bool:
    for cut in range(1, 4):
        try:
            sample[:-cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def _handler(store: HubStore):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _reply(self, status: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        @property
        def _endpoint(self) -> str:
            return "http://%s:%d" % self.server.server_address[:2]

        def _body(self) -> bytes:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()  # CRLF after each chunk
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _start(self, method: str) -> tuple[str, bytes] | None:
            """Log the request and read its body; None when `fail_status` already answered it."""
            with store._lock:
                store.requests.append(f"{method} {self.path}")
            body = self._body()
            if store.fail_status:
                self._reply(store.fail_status, {"error": f"stub answers {store.fail_status}"})
                return None
            return unquote(urlsplit(self.path).path), body

        def do_GET(self):
            if self._start("GET") is not None:
                self._reply(404, {"error": "not found"})

        def do_PUT(self):
            started = self._start("PUT")
            if started is None:
                return
            path, body = started
            match = _STORAGE_ROUTE.match(path)
            if not match or match["complete"]:
                return self._reply(404, {"error": f"no route for PUT {path}"})
            oid = match["oid"]
            part = int(match["part"]) if match["part"] else None
            with store._lock:
                store.storage_puts.append((oid, part, len(body)))
                if store.storage_fail_status:
                    return self._reply(store.storage_fail_status, {"error": "storage refuses the upload"})
                if oid not in store._pending:
                    return self._reply(403, {"error": f"no upload session for {oid} (call the batch API first)"})
                if part is not None:
                    store._parts.setdefault(oid, {})[part] = body
                    return self._reply(200, {}, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'})
                return self._store_object(oid, body)

        def _store_object(self, oid: str, data: bytes) -> None:
            """(lock held) keep `data` as object `oid` if size and sha256 match what was announced."""
            size = store._pending[oid]
            if len(data) != size:
                return self._reply(400, {"error": f"object {oid}: got {len(data)} bytes, announced {size}"})
            digest = hashlib.sha256(data).hexdigest()
            if digest != oid:
                return self._reply(400, {"error": f"object {oid}: uploaded bytes hash to {digest}"})
            store.lfs_objects[oid] = data
            del store._pending[oid]
            return self._reply(200, {})

        def do_POST(self):
            started = self._start("POST")
            if started is None:
                return
            path, body = started
            if path == "/api/repos/create":
                return self._create_repo(json.loads(body))
            if path == "/api/validate-yaml":
                return self._reply(200, {"errors": [], "warnings": []})
            match = _STORAGE_ROUTE.match(path)
            if match and match["complete"]:
                return self._complete_multipart(match["oid"], json.loads(body))
            match = _LFS_API_ROUTE.match(path)
            if match:
                if match["repo"] not in store.repos:
                    return self._reply(404, {"message": f"repository {match['repo']} not found"})
                payload = json.loads(body)
                if match["action"] == "batch":
                    return self._lfs_batch(match["repo"], payload)
                with store._lock:
                    store.lfs_verifies.append(payload.get("oid"))
                    stored = store.lfs_objects.get(payload.get("oid"))
                if stored is None or len(stored) != payload.get("size"):
                    return self._reply(404, {"message": f"object {payload.get('oid')} not found in storage"})
                return self._reply(200, {})
            match = _REPO_ROUTE.match(path)
            if not match or match["repo"] not in store.repos:
                return self._reply(404, {"error": f"no route or repo for {path}"})
            if match["action"] == "preupload":
                return self._preupload(match["repo"], json.loads(body)["files"])
            return self._commit(match["repo"], body)

        def _create_repo(self, payload: dict) -> None:
            repo_id = "/".join(filter(None, (payload.get("organization"), payload["name"])))
            url = f"{self._endpoint}/{repo_id}"
            with store._lock:
                store.create_payloads.append(payload)
                if repo_id in store.repos:  # the Hub's 409 also carries the url; exist_ok relies on it
                    return self._reply(409, {"error": "You already created this model repo", "url": url})
                if "visibility" in payload:
                    private = payload["visibility"] == "private"
                else:
                    private = bool(payload.get("private"))
                store.repos[repo_id] = {}
                store.private[repo_id] = private
            return self._reply(200, {"url": url, "name": repo_id})

        def _preupload(self, repo: str, files: list[dict]) -> None:
            answers = []
            with store._lock:
                for f in files:
                    mode = store.upload_mode(f["path"], int(f["size"]), base64.b64decode(f.get("sample") or ""))
                    store.upload_modes[(repo, f["path"])] = mode
                    answers.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": None})
            return self._reply(200, {"files": answers})

        def _lfs_batch(self, repo: str, payload: dict) -> None:
            if payload.get("operation") != "upload" or payload.get("hash_algo", "sha256") != "sha256":
                return self._reply(422, {"message": f"unsupported batch request {payload.get('operation')!r}"})
            chunk = store.multipart_chunk_size
            objects, transfer = [], "basic"
            with store._lock:
                store.lfs_batches.append({"repo": repo, **payload})
                for obj in payload["objects"]:
                    oid, size = obj["oid"], int(obj["size"])
                    answer = {"oid": oid, "size": size, "authenticated": True}
                    if not re.fullmatch(r"[0-9a-f]{64}", oid):
                        objects.append({**answer, "error": {"code": 422, "message": f"bad oid {oid!r}"}})
                        continue
                    if oid in store.lfs_objects:  # already in storage: no actions, the client skips it
                        objects.append(answer)
                        continue
                    store._pending[oid] = size
                    store._parts.pop(oid, None)
                    storage = f"{self._endpoint}/_lfs/{oid}"
                    if chunk and size > chunk and "multipart" in payload.get("transfers", []):
                        transfer = "multipart"
                        num_parts = -(-size // chunk)
                        header = {"chunk_size": str(chunk),
                                  **{f"{n:05d}": f"{storage}/part/{n}" for n in range(1, num_parts + 1)}}
                        upload = {"href": f"{storage}/complete", "header": header}
                    else:
                        upload = {"href": storage}
                    verify = {"href": f"{self._endpoint}/{repo}.git/info/lfs/objects/verify", "header": {}}
                    objects.append({**answer, "actions": {"upload": upload, "verify": verify}})
            return self._reply(200, {"transfer": transfer, "objects": objects, "hash_algo": "sha256"},
                               {"Content-Type": "application/vnd.git-lfs+json"})

        def _complete_multipart(self, oid: str, payload: dict) -> None:
            with store._lock:
                parts = store._parts.get(oid, {})
                if oid not in store._pending or payload.get("oid") != oid:
                    return self._reply(404, {"error": f"no multipart upload for {oid}"})
                listed = payload.get("parts") or []
                if [p.get("partNumber") for p in listed] != sorted(parts) or sorted(parts) != list(
                        range(1, len(parts) + 1)):
                    return self._reply(400, {"error": f"parts {listed} do not match uploaded parts {sorted(parts)}"})
                for p in listed:
                    if p.get("etag") != f'"{hashlib.md5(parts[p["partNumber"]]).hexdigest()}"':
                        return self._reply(400, {"error": f"bad etag for part {p['partNumber']}"})
                del store._parts[oid]
                return self._store_object(oid, b"".join(parts[n] for n in sorted(parts)))

        def _commit(self, repo: str, body: bytes) -> None:
            regular, lfs, summary = {}, {}, ""
            with store._lock:
                for line in body.splitlines():
                    item = json.loads(line)
                    value = item["value"]
                    if item["key"] == "header":
                        summary = value.get("summary", "")
                    elif item["key"] == "file":
                        if store.upload_modes.get((repo, value["path"])) == "lfs":
                            return self._reply(400, {"error": f"{value['path']}: must be uploaded with LFS"})
                        regular[value["path"]] = base64.b64decode(value["content"])
                    elif item["key"] == "lfsFile":
                        stored = store.lfs_objects.get(value["oid"])
                        if stored is None or ("size" in value and len(stored) != value["size"]):
                            return self._reply(400, {"error": f"{value['path']}: LFS object {value['oid']} "
                                                              "was not uploaded"})
                        lfs[value["path"]] = value["oid"]
                    else:
                        return self._reply(400, {"error": f"stub does not handle commit key {item['key']!r}"})
                store.commits.append(Commit(repo=repo, summary=summary, regular=regular, lfs=lfs))
                store.repos[repo].update(regular)
                store.repos[repo].update({path: store.lfs_objects[oid] for path, oid in lfs.items()})
            oid = hashlib.sha1(body).hexdigest()
            return self._reply(200, {
                "commitUrl": f"{self._endpoint}/{repo}/commit/{oid}", "commitOid": oid, "success": True,
            })

    return Handler


@contextlib.contextmanager
def serve_hub():
    """Run the stand-in on a free loopback port; yield (endpoint_url, HubStore)."""
    store = HubStore()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(store))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
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
    (huggingface_hub reads HF_HUB_OFFLINE once, into `constants.HF_HUB_OFFLINE`) and Xet storage
    switched off, so uploads take the HTTP regular/LFS path the stand-in serves even where hf_xet
    is installed."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    with serve_hub() as running:
        yield running
