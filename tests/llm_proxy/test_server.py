"""How the proxy's HTTP server writes responses (`fulmen_llm_proxy.server`)."""

from __future__ import annotations

from fulmen_llm_proxy.server import _OneWrite


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


def test_a_response_with_a_length_is_one_write() -> None:
    """The head waits for the body; both leave in one write; later writes go straight out."""
    transport = _Recorder()
    out = _OneWrite(transport)  # type: ignore[arg-type]
    out.write(HEAD)
    assert transport.writes == []
    out.write(b"{}")
    assert transport.writes == [HEAD + b"{}"]
    out.write(b"more")
    assert transport.writes[-1] == b"more"


def test_a_stream_head_and_100_continue_go_out_at_once() -> None:
    """A head without a length (a stream) is not held, nor is an interim "100 Continue"."""
    transport = _Recorder()
    out = _OneWrite(transport)  # type: ignore[arg-type]
    out.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    out.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    assert len(transport.writes) == 2
    assert not out.is_closing()


def test_closing_sends_a_held_head_first() -> None:
    """A held head is written before the connection closes."""
    transport = _Recorder()
    out = _OneWrite(transport)  # type: ignore[arg-type]
    out.write(HEAD)
    out.close()
    assert transport.writes == [HEAD] and transport.closed
