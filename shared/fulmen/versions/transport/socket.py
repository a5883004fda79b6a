"""Reading a model version's chunks on a socket of its own, straight into the blob.

`ChunkSocket.open` gives None where it cannot connect as the client does; the caller then keeps
redis-py. Why: docs/design/model-versions.md.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any, Protocol

from redis.exceptions import ResponseError

from fulmen.errors import RecordError

READ_BYTES = 64 << 10  # what one recv takes when a reply's framing (not a chunk's bytes) is wanted
CONNECT_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 120.0  # a page of chunks comes within this, or the server is gone

class Assembly(Protocol):
    """Where chunks go (`fulmen.versions.transport.stream._Assembly`)."""

    def place(self, m: bytes, length: int) -> memoryview: ...  # RecordError if not the next chunk

    def commit(self) -> None: ...

    def add(self, m: bytes, data: bytes | None) -> None: ...


class ChunkSocket:
    """A blocking connection that sends XRANGEs and parses their replies itself (one thread at a time)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()  # received and not parsed yet

    @classmethod
    def open(cls, client: Any) -> ChunkSocket | None:
        """A connection like ``client``'s (an asyncio redis-py client to one server), logged in; None
        where that cannot be done the same way."""
        from redis.asyncio.connection import Connection, UnixDomainSocketConnection

        pool = getattr(client, "connection_pool", None)
        kind = getattr(pool, "connection_class", None)
        kwargs: dict[str, Any] = getattr(pool, "connection_kwargs", {})
        if kind not in (Connection, UnixDomainSocketConnection) or kwargs.get("credential_provider") is not None \
                or str(kwargs.get("protocol") or 2) != "2":
            return None
        try:
            if kind is UnixDomainSocketConnection:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(CONNECT_TIMEOUT_S)
                    sock.connect(kwargs["path"])
                except OSError:
                    sock.close()
                    raise
            else:  # resolves the host as redis-py does (IPv4 or IPv6); closes the socket if it fails
                sock = socket.create_connection((kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))),
                                                CONNECT_TIMEOUT_S)
        except OSError:
            return None
        reader = cls(sock)
        try:
            if kind is not UnixDomainSocketConnection:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(IO_TIMEOUT_S)
            username, password = kwargs.get("username"), kwargs.get("password")
            if username or password:  # as redis-py logs in
                reader.call("AUTH", *([username] if username else []), password or "")
            if int(kwargs.get("db") or 0):
                reader.call("SELECT", int(kwargs["db"]))
        except (OSError, ResponseError, RecordError):
            reader.close()
            return None
        return reader

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        self.sock.close()

    # --- requests ------------------------------------------------------------------------------

    def send(self, *args: str | int | bytes) -> None:
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            raw = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
        self.sock.sendall(b"".join(parts))

    def call(self, *args: str | int | bytes) -> bytes:
        """Send a command whose reply is a status line; that line."""
        self.send(*args)
        line = self._line()
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        return line[1:]

    def entries(self, into: Assembly) -> int:
        """Read the reply to an XRANGE: each entry's ``d`` field received at ``into.place(m, length)``
        (its ``m`` field comes first, as writers put it), else the entry handed to ``into.add(m, d)``
        (``d`` None: the bytes are inside the record, as older writers put them); how many entries."""
        count = self._size(b"*")
        for _ in range(max(0, count)):
            if self._size(b"*") != 2:
                raise RecordError("a stream entry that is not [id, fields]")
            self._bulk()  # the entry's id
            m: bytes | None = None
            d: bytes | None = None
            placed = False
            for _ in range(self._size(b"*") // 2):
                name = self._bulk()
                length = self._size(b"$")
                if name == b"d" and m is not None and length >= 0:
                    self._into(into.place(m, length))
                    into.commit()
                    placed = True
                    continue
                value = self._exactly(length)
                if name == b"m":
                    m = value
                elif name == b"d":
                    d = value
            if m is None:
                raise RecordError("a weights chunk without its record")
            if not placed:
                into.add(m, d)
        return max(0, count)

    # --- RESP ----------------------------------------------------------------------------------

    def _fill(self) -> None:
        data = self.sock.recv(READ_BYTES)
        if not data:
            raise ConnectionError("the weights' Redis closed the connection")
        self.pending += data

    def _line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def _size(self, kind: bytes) -> int:
        line = self._line()
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        try:
            if line[:1] == kind:
                return int(line[1:])
        except ValueError:
            pass
        raise RecordError(f"unexpected reply from the weights' Redis: {line[:40]!r}")

    def _bulk(self) -> bytes:
        return self._exactly(self._size(b"$"))

    def _exactly(self, length: int) -> bytes:
        if length < 0:
            raise RecordError("a nil where a stream entry's field was expected")
        while len(self.pending) < length + 2:
            self._fill()
        value = bytes(self.pending[:length])
        self._crlf(length)
        return value

    def _into(self, target: memoryview) -> None:
        """A bulk string's bytes (its length is ``len(target)``) received into ``target``, which is
        released after (a view left in a traceback would keep a memory map from closing)."""
        with target:
            have = min(len(self.pending), len(target))
            target[:have] = self.pending[:have]
            del self.pending[:have]
            done = have
            while done < len(target):
                got = self.sock.recv_into(target[done:])
                if not got:
                    raise ConnectionError("the weights' Redis closed the connection")
                done += got
        while len(self.pending) < 2:
            self._fill()
        self._crlf(0)

    def _crlf(self, at: int) -> None:
        if self.pending[at : at + 2] != b"\r\n":
            raise RecordError("a reply from the weights' Redis that does not end its string")
        del self.pending[: at + 2]
