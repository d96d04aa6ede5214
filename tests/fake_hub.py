"""A local stand-in for a Hugging Face-compatible hub (http.server on 127.0.0.1), told to misbehave.

It serves what `strata-jax pull` reads of the real one: `/api/models/{repo}/revision/{rev}?blobs=true`
(the commit and every file's size and LFS sha256) and `/{repo}/resolve/{rev}/{path}`, which redirects
LFS files to a "CDN" on another origin (`http://localhost:PORT/cdn/...?sig=...`) as the hub does, with range requests there. Raw sockets
and hand-written headers, so each fault is exactly the bytes a broken server would send:

  no_length      the reply carries no Content-Length and the body stops early (the connection closes)
  misaligned     a range request gets a 206 whose Content-Range starts 1000 bytes before the asked offset
                 (with as many bytes as asked: a file of the right length and the wrong bytes)
  ignore_range   a range request gets 200 and the whole file
  drop           the body is cut mid-way with the connection (Content-Length promised the rest)
  flip           one byte of the body is flipped
  truncate       Content-Length and body both stop at half the file
  die            the server stops (closes its socket) mid-body; `FakeHub.restart()` brings it back

A fault fires on the first `times` file replies (then the server behaves), or every time (times=None).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import re
import socket
import threading
import urllib.parse


@dataclasses.dataclass
class HubFile:
    data: bytes
    publish_sha: bool = True  # False: a non-LFS file, whose listing carries no sha256
    lfs: bool = True  # redirected to the CDN path


class FakeHub:
    def __init__(self, repo: str, files: dict[str, HubFile], commit: str = "c0ffee" * 6 + "beef"):
        self.repo, self.files, self.commit = repo, files, commit
        self.fault: str | None = None
        self.times: int | None = 1
        self.requests: list[dict] = []  # every file request: path, Range, Authorization, status
        self.die_event = threading.Event()
        self._port = 0
        self._start()

    # --- lifecycle -----------------------------------------------------------------------------------
    def _start(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                hub._handle(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self.server.daemon_threads = True
        self._port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def restart(self):
        """The server back on the same port (after `die`), behaving."""
        self.fault = None
        self._start()

    def set_fault(self, fault: str | None, times: int | None = 1):
        self.fault, self.times = fault, times

    def file_requests(self) -> list[dict]:
        return [r for r in self.requests if r["cdn"] or not self.files[r["path"]].lfs]

    # --- replies -------------------------------------------------------------------------------------
    def _handle(self, h: http.server.BaseHTTPRequestHandler):
        u = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(u.path)
        if path.startswith(f"/api/models/{self.repo}/revision/"):
            body = json.dumps({"id": self.repo, "sha": self.commit, "siblings": [
                {"rfilename": name, "size": len(f.data),
                 **({"lfs": {"sha256": hashlib.sha256(f.data).hexdigest(), "size": len(f.data),
                             "pointerSize": 134}} if f.publish_sha else {"blobId": "0" * 40})}
                for name, f in self.files.items()]}).encode()
            return self._reply(h, 200, {"Content-Type": "application/json"}, body)
        m = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/([^/]+)/(.+)", path)
        if m and m[2] in self.files:
            f = self.files[m[2]]
            if f.lfs:
                self.requests.append({"path": m[2], "cdn": False, "range": h.headers.get("Range"),
                                      "auth": h.headers.get("Authorization")})
                # another origin (localhost, not 127.0.0.1), as the hub's CDN is another host
                cdn = f"http://localhost:{self._port}/cdn/{urllib.parse.quote(m[2])}?sig=abc"
                return self._reply(h, 302, {"Location": cdn}, b"")
            return self._file(h, m[2], cdn=False)
        m = re.fullmatch(r"/cdn/(.+)", path)
        if m and m[1] in self.files:
            return self._file(h, m[1], cdn=True)
        return self._reply(h, 404, {"Content-Type": "application/json"}, b'{"error": "Entry not found"}')

    def _reply(self, h, status, headers, body, length=True, close=False):
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if length:
            h.send_header("Content-Length", str(len(body)))
        if close or not length:
            h.send_header("Connection", "close")
            h.close_connection = True
        h.end_headers()
        h.wfile.write(body)
        h.wfile.flush()

    def _file(self, h, name: str, cdn: bool):
        data = self.files[name].data
        rng = h.headers.get("Range")
        fault = self.fault
        if fault is not None and self.times is not None:
            if self.times <= 0:
                fault = None
            else:
                self.times -= 1
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", rng or "")
        if m:
            start = int(m[1])
        self.requests.append({"path": name, "cdn": cdn, "range": rng, "auth": h.headers.get("Authorization"),
                              "fault": fault})
        if rng and fault == "ignore_range":
            return self._reply(h, 200, {}, data)
        if rng and fault == "misaligned":  # as many bytes as asked for, from the wrong place
            s = max(start - 1000, 0)
            n = len(data) - start
            return self._reply(h, 206, {"Content-Range": f"bytes {s}-{s + n - 1}/{len(data)}"}, data[s:s + n])
        status, headers = (206, {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}) if m else (200, {})
        body = data[start:]
        if fault == "flip":
            i = len(body) // 3
            body = body[:i] + bytes([body[i] ^ 0x01]) + body[i + 1:]
        if fault == "no_length":
            return self._reply(h, status, headers, body[: len(body) * 2 // 3], length=False)
        if fault == "truncate":
            return self._reply(h, status, headers, body[: len(body) // 2], close=True)
        if fault in ("drop", "die"):
            h.send_response(status)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            if fault == "die":  # the whole server goes away, not just this connection
                threading.Thread(target=self.stop, daemon=True).start()
                self.die_event.set()
            with _suppress():
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        return self._reply(h, status, headers, body)


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)
