"""A pipelined RESP2 client for the remote tier's two hot paths, on one plain socket per thread.

redis-py turns every GET reply into a bytes object (hiredis parses it into a fresh buffer) that
the tier then copies into the RAM slot, and packs every SET in Python. Here a pipeline of GETs
reads each value straight into its slot (``recv_into``: no reply object, no copy) and a
pipeline of SETs hands the slots' memoryviews to ``sendmsg`` as they are. A value may be
several buffers (a page's header and its payload travel as one value without being joined),
and each value's work is done as it goes: a SET's value may be computed just before it is
sent, a GET's value handed to a callback as soon as it landed, so hashing a page overlaps the
server's work on the next one and reads the page while it is still in the CPU's caches.
Everything else (existence checks, deletes, scans, clusters, TLS) stays with redis-py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

IOV_MAX = 1000          # buffers per sendmsg (the kernel's limit is 1024)
READ_AHEAD = 1024 * 1024    # the receive buffer: small values and header lines come through it
DIRECT_BYTES = 16 * 1024   # a value's rest at least this large goes from the socket into its slot
SEND_BYTES = 256 * 1024    # a pipeline of SETs goes out in sends of about this much

Buffers = object | tuple    # one buffer, or several sent (or filled) one after the other as one value


class RespError(Exception):
    """The server answered an error (``-OOM ...``, ``-NOAUTH ...``): the connection is fine."""


def raw_eligible(url: str) -> bool:
    """Plain TCP or a unix socket to one node: what this client speaks."""
    parts = urlsplit(url)
    return parts.scheme in ("redis", "unix") and "cluster=" not in (parts.query or "")


class _Connection:
    def __init__(self, url: str, timeout_s: float):
        parts = urlsplit(url)
        if parts.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            self.sock.connect(parts.path)
        else:
            self.sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(READ_AHEAD)     # replies' header lines land here; values mostly not
        self.view = memoryview(self.buf)
        self.pos = self.end = 0
        setup = []
        if parts.password is not None:
            setup.append([b"AUTH"] + ([unquote(parts.username).encode()] if parts.username else [])
                         + [unquote(parts.password).encode()])
        query = dict(parse_qsl(parts.query))
        db = query.get("db") or ((parts.path or "/").strip("/") if parts.scheme != "unix" else "")
        if db and db != "0":
            setup.append([b"SELECT", db.encode()])
        if setup:
            commands = [_plain(args) for args in setup]
            self.send(commands, [len(c) for c in commands])
            try:
                for _ in setup:
                    self.reply()
            except RespError as e:           # a wrong password is an outage, not a bad reply
                self.close()
                raise ConnectionError(f"the server refused the connection's set-up: {e}") from None

    def send(self, buffers: list, sizes: list[int]) -> None:
        """Send the buffers (``sizes``: their byte counts), as few ``sendmsg`` calls as the
        kernel allows; a buffer is sliced only where a call stopped inside it."""
        at = 0                                 # the first buffer not wholly sent
        while at < len(buffers):
            sent = self.sock.sendmsg(buffers[at:at + IOV_MAX])
            while sent:
                if sent >= sizes[at]:
                    sent -= sizes[at]
                    at += 1
                else:
                    buffers[at] = memoryview(buffers[at]).cast("B")[sent:]
                    sizes[at] -= sent
                    sent = 0

    def _fill(self) -> None:
        """Read more into the buffer, keeping what is not consumed yet at its front."""
        if self.pos:
            left = self.end - self.pos
            self.buf[:left] = self.buf[self.pos:self.end]
            self.pos, self.end = 0, left
        if self.end == len(self.buf):         # one line longer than the buffer: grow it
            self.buf += bytearray(len(self.buf))
            self.view = memoryview(self.buf)
        n = self.sock.recv_into(self.view[self.end:])
        if not n:
            raise ConnectionError("the server closed the connection")
        self.end += n

    def line(self) -> bytes:
        while True:
            at = self.buf.find(b"\r\n", self.pos, self.end)
            if at >= 0:
                out = bytes(self.view[self.pos:at])
                self.pos = at + 2
                return out
            self._fill()

    def read_into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes: what is buffered first; then a large rest straight from
        the socket into ``view``, a small one through the buffer (one ``recv`` then serves
        many small values: syscalls, not copies, are what small values cost)."""
        got = 0
        while True:
            have = min(len(view) - got, self.end - self.pos)
            view[got:got + have] = self.view[self.pos:self.pos + have]
            self.pos += have
            got += have
            if got == len(view):
                return
            if len(view) - got >= DIRECT_BYTES:
                n = self.sock.recv_into(view[got:])
                if not n:
                    raise ConnectionError("the server closed the connection")
                got += n
            else:
                self._fill()

    def skip_crlf(self) -> None:
        while self.end - self.pos < 2:
            self._fill()
        self.pos += 2

    def reply(self):
        """One simple reply: status or integer as bytes, bulk as bytes (None if nil)."""
        head = self.line()
        kind, rest = head[:1], head[1:]
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind in (b"+", b":"):
            return rest
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n + 2)
            self.read_into(memoryview(out))
            return bytes(out[:n])
        raise ConnectionError(f"unexpected reply {head[:40]!r}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _parts(value: Buffers) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _command(args: Sequence[Buffers]) -> tuple[list, list[int]]:
    """RESP framing of one command as few buffers, and their sizes: ``bytes`` arguments are
    joined with the framing, any other buffer (a slot's payload) is sent as it is, never
    copied. An argument given as a tuple of buffers is one value made of them."""
    buffers, sizes, joined = [], [], [b"*%d\r\n" % len(args)]
    for arg in args:
        pieces = _parts(arg)
        lengths = [len(p) if type(p) is bytes else memoryview(p).nbytes for p in pieces]
        joined.append(b"$%d\r\n" % sum(lengths))
        for piece, n in zip(pieces, lengths, strict=True):
            if type(piece) is bytes:
                joined.append(piece)
            elif n:
                text = b"".join(joined)
                buffers += [text, piece]
                sizes += [len(text), n]
                joined = []
        joined.append(b"\r\n")
    text = b"".join(joined)
    return buffers + [text], sizes + [len(text)]


def _plain(args: Sequence[bytes]) -> bytes:
    """A command of small arguments as one bytes object."""
    return b"".join(_command(args)[0])


class RawClient:
    """One connection per calling thread; any socket error drops it (the next call reconnects)
    and propagates as ``OSError`` for the tier's outage handling."""

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self._local = threading.local()
        self._all: list[_Connection] = []
        self._lock = threading.Lock()

    def _conn(self) -> tuple[_Connection, bool]:
        """This thread's connection, and whether it was used before."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = self._local.conn = _Connection(self.url, self.timeout_s)
        with self._lock:
            self._all.append(conn)
        return conn, False

    def _run(self, fn):
        """``fn(connection)``; a connection that had been idle and broke (the server restarted
        meanwhile) is replaced once; GETs and SETs are safe to repeat. Any other exception
        (one raised by a caller's callback mid-pipeline) drops the connection too: replies
        left unread would answer the next pipeline's commands."""
        conn, reused = self._conn()
        try:
            return fn(conn)
        except (OSError, ValueError):        # a broken stream is never reused
            self._drop(conn)
            if not reused:
                raise
        except BaseException:
            self._drop(conn)
            raise
        conn, _ = self._conn()
        try:
            return fn(conn)
        except BaseException:
            self._drop(conn)
            raise

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._local.conn = None

    def get_into(self, names: Sequence[str], sinks: Sequence[memoryview | tuple | None],
                 landed: Callable[[int], None] | None = None) -> list:
        """GET each name; a value whose length is its sink's goes into the sink (True; a tuple
        of views is filled in order) and ``landed(i)`` runs at once, any other value comes
        back as bytes, a missing key as None."""
        sizes = [None if s is None else sum(len(p) for p in _parts(s)) for s in sinks]

        def run(conn: _Connection) -> list:
            request = b"".join([_plain([b"GET", name.encode()]) for name in names])
            conn.send([request], [len(request)])
            out, error = [], None
            for index, sink in enumerate(sinks):      # every reply is read: the stream stays in step
                head = conn.line()
                if head[:1] == b"-":
                    error = error or RespError(head[1:].decode(errors="replace"))
                    out.append(None)
                    continue
                n = int(head[1:])
                if n < 0:
                    out.append(None)
                    continue
                if n == sizes[index]:
                    for part in _parts(sink):
                        conn.read_into(part)
                    value = True
                else:
                    value = bytearray(n)
                    conn.read_into(memoryview(value))
                conn.skip_crlf()                                   # the value's CRLF
                out.append(value if value is True else bytes(value))
                if value is True and landed is not None:
                    landed(index)
            if error is not None:
                raise error
            return out
        return self._run(run)

    def set_many(self, items: Sequence[tuple[str, Buffers | Callable[[], Buffers]]], px: int | None = None) -> None:
        """SET every (name, value) in one pipeline, sent about ``SEND_BYTES`` at a time; a value
        given as a function is made just before it is sent. Raises ``RespError`` with the first
        error reply after reading them all (the connection stays in step)."""
        tail = [b"PX", str(px).encode()] if px else []

        def run(conn: _Connection) -> None:
            buffers, sizes, size = [], [], 0
            for name, value in items:
                command, lengths = _command([b"SET", name.encode(), value() if callable(value) else value, *tail])
                buffers += command
                sizes += lengths
                size += sum(lengths)
                if size >= SEND_BYTES:
                    conn.send(buffers, sizes)
                    buffers, sizes, size = [], [], 0
            conn.send(buffers, sizes)
            error = None
            for _ in items:
                try:
                    conn.reply()
                except RespError as e:
                    error = error or e
            if error is not None:
                raise error
        self._run(run)

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
