"""tools/check_native_build.py reads the CUDA fat binaries in a library without the
toolkit: plain cubins, and the zstd-compressed ones nvcc writes for large images."""
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import check_native_build as cnb  # noqa: E402

ELF = b"\x7fELF" + bytes(60)


def _entry(sm: int, payload: bytes, flags: int = 0x11, full: int = 0) -> bytes:
    head = struct.pack("<HHIQ", 2, 257, 64, len(payload))
    head += struct.pack("<IIHHI", 0, 0, 0, 0, sm)
    head += bytes(40 - len(head)) + struct.pack("<Q", flags)
    head += bytes(56 - len(head)) + struct.pack("<Q", full)
    return head + payload


def _library(tmp_path, *entries: bytes) -> str:
    body = b"".join(entries)
    blob = b"junk" * 5 + struct.pack("<IHHQ", cnb.FATBIN_MAGIC, 1, 16, len(body)) + body
    path = tmp_path / "_C.so"
    path.write_bytes(blob + b"tail")
    return str(path)


def test_plain_and_compressed_cubins(tmp_path):
    import zstandard as zstd  # a replay_ops requirement
    packed = zstd.ZstdCompressor().compress(ELF)
    lib = _library(tmp_path, _entry(80, ELF), _entry(90, packed, 0x8011, len(ELF)))
    assert cnb.fatbin_entries(lib) == [("cubin", 80), ("cubin", 90)]


@pytest.mark.parametrize("bad", ["not-zstd", "not-elf-inside", "plain-not-elf"])
def test_a_misread_cubin_fails(tmp_path, bad, capsys):
    import zstandard as zstd  # a replay_ops requirement
    if bad == "not-zstd":
        entry = _entry(90, b"abcd" + bytes(20), 0x8011, 24)
    elif bad == "not-elf-inside":
        junk = bytes(64)
        entry = _entry(90, zstd.ZstdCompressor().compress(junk), 0x8011, len(junk))
    else:
        entry = _entry(80, bytes(64))
    with pytest.raises(SystemExit):
        cnb.fatbin_entries(_library(tmp_path, entry))
    assert "sm_" in capsys.readouterr().out
