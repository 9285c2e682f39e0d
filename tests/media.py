"""Media files built for tests (no fixtures on disk)."""

from __future__ import annotations


def wav_bytes(seconds: float, rate: int = 16000, channels: int = 1, sample_width: int = 2,
              info_chunk: bytes = b"") -> bytes:
    """A PCM WAV file of silence, with an optional LIST chunk before `data` (as many encoders write)."""
    data_size = int(seconds * rate) * channels * sample_width
    fmt = (b"fmt " + (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + channels.to_bytes(2, "little")
           + rate.to_bytes(4, "little") + (rate * channels * sample_width).to_bytes(4, "little")
           + (channels * sample_width).to_bytes(2, "little") + (8 * sample_width).to_bytes(2, "little"))
    extra = b"LIST" + len(info_chunk).to_bytes(4, "little") + info_chunk if info_chunk else b""
    body = b"WAVE" + fmt + extra + b"data" + data_size.to_bytes(4, "little") + bytes(data_size)
    return b"RIFF" + len(body).to_bytes(4, "little") + body
