"""A stand-in of the Hugging Face hub on 127.0.0.1, serving one repository with one LFS file.

It answers exactly what huggingface_hub 2.4.0 asks when ``fetch_model`` downloads a file:

- ``GET /api/models/{repo}/revision/{revision}?blobs=True`` (``HfApi.model_info`` with
  ``files_metadata=True``): the commit's ``sha`` and ``siblings`` with each file's ``lfs.sha256``;
- ``HEAD /{repo}/resolve/{revision}/{filename}`` (``get_hf_file_metadata``): ``X-Repo-Commit``,
  ``X-Linked-Etag`` / ``ETag`` (the announced sha256, quoted), ``X-Linked-Size``,
  ``Content-Length``; the real hub answers an LFS file with a redirect to its CDN carrying the
  same headers, which huggingface_hub reads from the redirect itself;
- ``GET`` of the same URL (``http_get``): the bytes, or from ``Range: bytes=N-`` on with 206
  and ``Content-Range``.

Unknown repositories, revisions and files get 404 with the ``X-Error-Code`` the hub sends
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``). Knobs, set before or between
requests: ``announced_sha256`` (announce a checksum the bytes do not have), ``status`` (answer
every request with it, e.g. 500), ``drop_after_bytes`` (cut the connection once, that far into
the next download). Every request is recorded in ``requests``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from aiohttp import web

from server.testkit.loopback import LoopbackServer

__all__ = ["HubStandin", "SeenRequest"]

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    range: str | None
    """The ``Range`` header, when one was sent."""


class HubStandin(LoopbackServer):
    """``async with HubStandin(repo_id, filename, content, commit) as hub:`` then point
    huggingface_hub at ``hub.endpoint``. ``commit`` (40 hex digits) is the only revision served,
    besides ``main`` which resolves to it."""

    def __init__(self, repo_id: str, filename: str, content: bytes, commit: str) -> None:
        super().__init__()
        self.repo_id = repo_id
        self.filename = filename
        self.content = content
        self.commit = commit
        self.sha256 = hashlib.sha256(content).hexdigest()
        """The content's real sha256."""
        self.announced_sha256 = self.sha256
        self.status: int | None = None
        self.drop_after_bytes: int | None = None
        self.requests: list[SeenRequest] = []

    @property
    def endpoint(self) -> str:
        return self.origin

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/api/models/{repo:.+}/revision/{revision}", self._model_info)
        app.router.add_get("/{repo:.+}/resolve/{revision}/{filename:.+}", self._resolve)

    def downloads(self) -> list[SeenRequest]:
        """The GET requests of the file's bytes, in arrival order."""
        return [seen for seen in self.requests if seen.method == "GET" and "/resolve/" in seen.path]

    def _record(self, request: web.Request) -> None:
        self.requests.append(
            SeenRequest(request.method, request.path, request.headers.get("Range"))
        )

    def _refusal(self, request: web.Request) -> web.Response | None:
        """The error this request gets, if any: the forced status, else a 404 for what the
        stand-in does not serve."""
        if self.status is not None:
            return web.Response(status=self.status, text=f"forced {self.status}")
        if request.match_info["repo"] != self.repo_id:
            return _not_found("RepoNotFound", "Repository not found")
        if request.match_info["revision"] not in (self.commit, "main"):
            return _not_found("RevisionNotFound", "Invalid rev id", commit=None)
        if request.match_info.get("filename", self.filename) != self.filename:
            return _not_found("EntryNotFound", "Entry not found", commit=self.commit)
        return None

    async def _model_info(self, request: web.Request) -> web.Response:
        self._record(request)
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        sibling = {
            "rfilename": self.filename,
            "size": len(self.content),
            "blobId": hashlib.sha1(self.content).hexdigest(),
            "lfs": {"sha256": self.announced_sha256, "size": len(self.content), "pointerSize": 135},
        }
        body = {
            "_id": "0" * 24,
            "id": self.repo_id,
            "sha": self.commit,
            "private": False,
            "siblings": [{"rfilename": "README.md", "size": 12, "blobId": "1" * 40}, sibling],
        }
        return web.Response(text=json.dumps(body), content_type="application/json")

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        size = len(self.content)
        headers = {
            "X-Repo-Commit": self.commit,
            "X-Linked-Etag": f'"{self.announced_sha256}"',
            "ETag": f'"{self.announced_sha256}"',
            "X-Linked-Size": str(size),
            "Accept-Ranges": "bytes",
        }
        if request.method == "HEAD":
            headers["Content-Length"] = str(size)
            return web.Response(status=200, headers=headers)
        start = 0
        wanted = request.headers.get("Range")
        if wanted is not None:
            match = _RANGE.match(wanted)
            if match is None or int(match.group(1)) >= size:
                return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else size - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        else:
            end = size - 1
        body = self.content[start : end + 1]
        response = web.StreamResponse(status=206 if wanted else 200, headers=headers)
        response.content_length = len(body)
        await response.prepare(request)
        cut = self.drop_after_bytes
        if cut is not None and cut < len(body):
            self.drop_after_bytes = None
            await response.write(body[:cut])
            # Mid-body, as a dying connection would: the client sees fewer bytes than announced.
            transport = request.transport
            assert transport is not None
            transport.close()
            return response
        await response.write(body)
        await response.write_eof()
        return response


def _not_found(code: str, message: str, commit: str | None = None) -> web.Response:
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    if commit is not None:
        headers["X-Repo-Commit"] = commit
    return web.Response(status=404, text=json.dumps({"error": message}), headers=headers)
