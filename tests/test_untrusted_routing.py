"""Routing from another process is untrusted input: crafted `ReplayBatch` headers, record
file headers, vLLM `.npy` and SGLang payloads are refused with the package's own error
naming the field, before anything of the claimed size is allocated (the crafted-size cases
run in a child process under a memory cap, their peak memory measured); writers and
appenders of one record file serialise (processes); another host's temporary files are
left alone; a uint8 record file reads back as uint8 whichever encoding stored it."""
from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import re
import socket
import stat
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import torch

from replay_ops import _atomic
from replay_ops.router_replay import files
from replay_ops.router_replay.adapters import (
    ModelShape,
    ReplayBatch,
    RoutingMismatchError,
    decode_vllm,
    encode_sglang,
    encode_vllm,
    sglang_sequences,
    vllm_sequences,
)
from replay_ops.router_replay.files import (
    RecordMeta,
    RoutingFileError,
    append_routing,
    open_routing,
    write_routing,
)

from _capped import run_capped

E, K, MOE_IDS, H = 8, 2, (0, 2, 3), 4
LAYOUT = ModelShape(num_experts=E, top_k=K, moe_layer_ids=MOE_IDS, num_hidden_layers=H)
META = RecordMeta(num_experts=E, top_k=K, moe_layer_ids=list(MOE_IDS), num_hidden_layers=H,
                  model_name="tiny")


def routing(n: int, L: int = 3, seed: int = 0, E: int = E) -> torch.Tensor:
    """[n, L, K] int16, K distinct ids in 0..E-1 per (token, layer)."""
    g = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([[g.permutation(E)[:K] for _ in range(L)]
                                      for _ in range(n)]).astype(np.int16).reshape(n, L, K))


def batch(kind: str = "thd", dtype=torch.int16) -> ReplayBatch:
    r = routing(9, seed=1)
    if kind == "thd":
        return ReplayBatch(r.to(dtype), torch.ones(9, dtype=torch.bool),
                           torch.tensor([0, 4, 4, 9]), ["moe", None, "moe"])
    return ReplayBatch(r[:8].reshape(2, 4, 3, K).to(dtype), torch.ones(2, 4, dtype=torch.bool),
                       None, ["moe", "moe"])


def split_batch(data: bytes):
    """(the JSON header, the mask bits, the codec blob) of ReplayBatch bytes."""
    nh, nb = struct.unpack_from("<QQ", data, 12)
    return json.loads(data[28:28 + nh]), data[28 + nh:28 + nh + nb], data[28 + nh + nb:]


def craft_batch(head, bits: bytes, blob: bytes) -> bytes:
    """ReplayBatch bytes with any header (bytes or a dict), the checksum recomputed as a
    sender would (it protects against corruption, not against the sender)."""
    h = head if isinstance(head, bytes) else json.dumps(head).encode()
    body = struct.pack("<QQ", len(h), len(bits)) + h + bits
    return b"RRBATCH1" + struct.pack("<I", zlib.crc32(body)) + body + blob


# ------------------------------------------------------------------ ReplayBatch.from_bytes
@pytest.mark.parametrize("kind", ["thd", "padded"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64])
def test_every_batch_dtype_round_trips(kind, dtype):
    b = batch(kind, dtype)
    back = ReplayBatch.from_bytes(b.to_bytes())
    assert back.indices.dtype == dtype and torch.equal(back.indices, b.indices)
    assert torch.equal(back.replay_mask, b.replay_mask) and back.mappings == b.mappings


def test_uint8_batch_with_expert_255_round_trips():
    r = torch.full((3, 2, 2), 255, dtype=torch.uint8)
    r[:, :, 1] = 7
    b = ReplayBatch(r, torch.ones(3, dtype=torch.bool))
    back = ReplayBatch.from_bytes(b.to_bytes())
    assert back.indices.dtype == torch.uint8 and torch.equal(back.indices, r)


def test_to_bytes_refuses_what_from_bytes_would_refuse():
    b = batch()
    for bad, match in [
        (dict(cu_seqlens=torch.tensor([1, 4, 9])), "cu_seqlens"),
        (dict(mappings=["moe"]), "mappings"),
        (dict(layer_index="dense"), "layer_index"),
        (dict(replay_mask=torch.ones(8, dtype=torch.bool)), "mask_shape"),
        (dict(indices=b.indices.to(torch.uint16)), "indices_dtype"),
    ]:
        kw = dict(indices=b.indices, replay_mask=b.replay_mask, cu_seqlens=b.cu_seqlens,
                  mappings=b.mappings, layer_index=b.layer_index)
        kw.update(bad)
        with pytest.raises(RoutingMismatchError, match=f"ReplayBatch.to_bytes: {match}"):
            ReplayBatch(**kw).to_bytes()


def _crafted_headers():
    head, bits, blob = split_batch(batch().to_bytes())
    cases = []

    def case(name, match, **change):
        h = dict(head, **change)
        cases.append(pytest.param(h, bits, blob, match, id=name))

    case("dtype-attribute", "indices_dtype 'Tensor' is not one of", indices_dtype="Tensor")
    case("dtype-float", "indices_dtype 'float32'", indices_dtype="float32")
    case("dtype-list", "indices_dtype", indices_dtype=["int16"])
    case("shape-float", "indices_shape", indices_shape=[9.0, 3, 2])
    case("shape-bool", "indices_shape", indices_shape=[9, True, 2])
    case("shape-2d", "indices_shape", indices_shape=[9, 6])
    case("shape-negative", "indices_shape", indices_shape=[-9, 3, 2])
    case("L-huge", r"L=1048576, K=2 is outside", indices_shape=[9, 2**20, 2])
    case("K-huge", r"L=3, K=100000 is outside", indices_shape=[9, 3, 100000])
    case("L-blob", r"the routing blob holds .* the header says", indices_shape=[9, 4, 2])
    case("mask-shape", "mask_shape", mask_shape=[10])
    case("mask-shape-str", "mask_shape", mask_shape="9")
    case("cu-blob", r"the routing blob holds .*\[4, 0, 5\].*\[4, 1, 4\]",
         cu_seqlens=[0, 4, 5, 9])
    case("cu-start", "cu_seqlens", cu_seqlens=[1, 4, 4, 9])
    case("cu-decreasing", "cu_seqlens", cu_seqlens=[0, 5, 4, 9])
    case("cu-end", "cu_seqlens", cu_seqlens=[0, 4, 4, 8])
    case("cu-float", "cu_seqlens", cu_seqlens=[0, 4.0, 4, 9])
    case("cu-padded", "padded", indices_shape=[1, 9, 3, 2], mask_shape=[1, 9])
    case("mappings-dict", "mappings", mappings={"a": 1})
    case("mappings-value", "mappings", mappings=["moe", "dense", "moe"])
    case("mappings-length", "mappings", mappings=["moe"])
    case("layer-index", "layer_index", layer_index="absolute2")
    case("layer-index-list", "layer_index", layer_index=["moe"])
    h = dict(head)
    del h["mappings"]
    cases.append(pytest.param(h, bits, blob, "exactly the fields", id="missing-key"))
    cases.append(pytest.param(dict(head, extra=1), bits, blob, "exactly the fields",
                              id="extra-key"))
    cases.append(pytest.param([1, 2], bits, blob, "exactly the fields", id="not-a-dict"))
    cases.append(pytest.param(b"\xff\xfe{", bits, blob, "does not parse", id="not-utf8"))
    cases.append(pytest.param(b"[" * 100000, bits, blob, "does not parse", id="deep"))
    cases.append(pytest.param(head, bits + b"\x00", blob, "mask bits", id="mask-bytes"))
    cases.append(pytest.param(head, bits[:-1] + bytes([bits[-1] | 1]), blob, "padding bits",
                              id="mask-padding"))
    return cases


@pytest.mark.parametrize("head, bits, blob, match", _crafted_headers())
def test_crafted_batch_headers_are_refused_naming_the_field(head, bits, blob, match):
    with pytest.raises(RoutingMismatchError, match=match):
        ReplayBatch.from_bytes(craft_batch(head, bits, blob))


def test_empty_slots_under_an_unsigned_dtype_are_refused():
    """A header claiming uint8 for a blob with empty slots (-1) would wrap them to expert
    255."""
    r = routing(4, seed=5)
    r[1, 0, 1] = -1
    data = ReplayBatch(r, torch.ones(4, dtype=torch.bool)).to_bytes()
    head, bits, blob = split_batch(data)
    with pytest.raises(RoutingMismatchError, match=r"indices_dtype 'uint8' but the blob holds "
                                                   r"empty slots \(-1\)"):
        ReplayBatch.from_bytes(craft_batch(dict(head, indices_dtype="uint8"), bits, blob))


def test_a_batch_cut_at_a_chunk_boundary_is_refused():
    """The codec blob cut after whole chunks still parses; the header's token count and
    sequences do not match it."""
    r = routing(40, seed=2)
    b = ReplayBatch(r, torch.ones(40, dtype=torch.bool), torch.arange(0, 41, 10))
    data = b.to_bytes()
    from replay_ops.router_replay import codec

    head, bits, blob = split_batch(data)
    prefix = len(data) - len(blob)
    chunks = codec.info(blob).chunks
    assert len(chunks) >= 1
    for ch in chunks[1:] + (None,):
        cut = len(blob) if ch is None else ch.offset
        if ch is None:
            continue
        with pytest.raises(RoutingMismatchError, match="ReplayBatch.from_bytes"):
            ReplayBatch.from_bytes(data[:prefix + cut])
    # a blob of fewer tokens under the same header
    short = ReplayBatch(r[:30], torch.ones(30, dtype=torch.bool),
                        torch.arange(0, 31, 10)).to_bytes()
    with pytest.raises(RoutingMismatchError, match=r"the routing blob holds"):
        ReplayBatch.from_bytes(craft_batch(head, bits, split_batch(short)[2]))


def test_from_bytes_limits_and_wrong_types():
    data = batch().to_bytes()
    assert ReplayBatch.from_bytes(data, max_tokens=9, max_bytes=9 * 3 * K * 2).indices.shape[0] == 9
    with pytest.raises(RoutingMismatchError, match="exceeds max_tokens=8"):
        ReplayBatch.from_bytes(data, max_tokens=8)
    with pytest.raises(RoutingMismatchError, match="more than max_bytes=100"):
        ReplayBatch.from_bytes(data, max_bytes=100)
    with pytest.raises(RoutingMismatchError, match="expected bytes, got str"):
        ReplayBatch.from_bytes("RRBATCH1")
    with pytest.raises(RoutingMismatchError, match="not a ReplayBatch payload"):
        ReplayBatch.from_bytes(b"")


# ------------------------------------------------------------------ record file headers
def record_bytes(tmp_path, encoding="codec", layer_index="moe") -> bytes:
    p = tmp_path / f"src-{encoding}-{layer_index}.safetensors"
    r = routing(12, L=3 if layer_index == "moe" else H, seed=3)
    if layer_index == "absolute":
        r[:, 1] = -1  # the dense layer
    m = RecordMeta(num_experts=E, top_k=K, moe_layer_ids=list(MOE_IDS), num_hidden_layers=H,
                   layer_index=layer_index, model_name="tiny")
    write_routing(p, r, m, cu_seqlens=[0, 5, 12], encoding=encoding)
    return p.read_bytes()


def rewrite_header(data: bytes, edit) -> bytes:
    """The record file with `edit(header)` applied and both checksums recomputed, as a
    crafted (not a corrupted) file would have them."""
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    edit(header)
    md = header.get("__metadata__")
    if isinstance(md, dict) and md.get("format_version") != "1":
        md["header_checksum"] = files.header_digest(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _md(key, value):
    def edit(h):
        h["__metadata__"][key] = value
    return edit


def _tensor(name, key, value):
    def edit(h):
        h[name][key] = value
    return edit


RECORD_CASES = [
    ("codec", _md("moe_layer_ids", "[" * 50000 + "]" * 50000), "moe_layer_ids is not valid JSON"),
    ("codec", _md("moe_layer_ids", json.dumps(list(range(2000)))), "moe_layer_ids"),
    ("codec", _md("moe_layer_ids", "[0, 2.5, 3]"), "moe_layer_ids"),
    ("codec", _md("moe_layer_ids", "[0, true, 3]"), "moe_layer_ids"),
    ("codec", _md("moe_layer_ids", "{}"), "moe_layer_ids"),
    ("codec", _md("num_experts", "40000"), "num_experts='40000' is not an integer in 1..32767"),
    ("raw", _md("num_experts", "40000"), "num_experts='40000' is not an integer in 1..32767"),
    ("codec", _md("num_experts", 8), "num_experts is 8, not a string"),
    ("codec", _md("num_experts", "8_0"), "num_experts"),
    ("codec", _md("top_k", "9" * 30), "top_k"),
    ("codec", _md("num_hidden_layers", "1000000000"), "num_hidden_layers='1000000000'"),
    ("codec", _md("num_hidden_layers", ["4"]), "num_hidden_layers"),
    ("codec", _md("layer_index", ["moe"]), "layer_index"),
    ("codec", _md("model_name", {"a": 1}), "model_name"),
    ("codec", _md("indices_shape", "[" * 50000), "indices_shape is not valid JSON"),
    ("codec", _md("indices_shape", "[12.0, 3, 2]"), r"indices_shape \[12.0, 3, 2\] is not"),
    ("codec", _md("indices_shape", '["12", 3, 2]'), "indices_shape"),
    ("codec", _md("indices_shape", "[12, 3]"), "indices_shape"),
    ("raw", _tensor("indices", "shape", [2**62, 4, 1]), "offsets"),
    ("raw", _tensor("indices", "shape", [2**70, 3, 2]), "offsets"),
    ("raw", _tensor("indices", "shape", [12, 6]), "bad shape/offsets for 'indices'"),
    ("raw", _tensor("indices", "shape", [12, True, 6]), "bad shape/offsets"),
    ("raw", _tensor("cu_seqlens", "shape", [1, 3]), "bad shape/offsets for 'cu_seqlens'"),
    ("raw", _tensor("indices", "dtype", ["U8"]), "tensor 'indices' missing"),
]


@pytest.mark.parametrize("encoding, edit, match", RECORD_CASES,
                         ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(RECORD_CASES)])
def test_crafted_record_headers_are_refused_naming_the_field(tmp_path, encoding, edit, match):
    p = tmp_path / "crafted.safetensors"
    p.write_bytes(rewrite_header(record_bytes(tmp_path, encoding), edit))
    with pytest.raises(RoutingFileError, match=match):
        rf = open_routing(p)
        rf.indices()


def test_deeply_nested_record_header_is_refused(tmp_path):
    p = tmp_path / "deep.safetensors"
    head = b'{"a":' * 30000 + b"1" + b"}" * 30000
    head += b" " * (-(len(head) + 8) % 8)
    p.write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(RoutingFileError, match="not valid JSON"):
        open_routing(p)


@pytest.mark.parametrize("encoding", ["codec", "raw"])
@pytest.mark.parametrize("E_", [8, 255, 256])
def test_record_file_reads_back_in_the_type_it_was_written_with(tmp_path, encoding, E_):
    """uint8 ids (255 = empty) for a model of at most 255 experts, int16 (-1) above, from
    raw() and dtype/empty_value, whichever encoding stored them; indices() is int16 with
    -1 for both."""
    r = routing(6, seed=4, E=E_).to(torch.int32)
    r[2] = -1
    m = RecordMeta(num_experts=E_, top_k=K, moe_layer_ids=list(MOE_IDS), num_hidden_layers=H)
    p = tmp_path / f"{encoding}.safetensors"
    write_routing(p, r, m, encoding=encoding)
    rf = open_routing(p)
    u8 = E_ <= 255
    assert rf.dtype == np.dtype(np.uint8 if u8 else np.int16)
    assert rf.empty_value == (255 if u8 else -1)
    raw = rf.raw()
    assert raw.dtype == (torch.uint8 if u8 else torch.int16)
    assert torch.equal(raw.to(torch.int32), torch.where(r < 0, rf.empty_value, r))
    assert rf.indices().dtype == torch.int16 and torch.equal(rf.indices().to(torch.int32), r)
    if u8:  # written from uint8 routing (no empty slot: uint8 has no -1)
        u = r[:2].to(torch.uint8)
        write_routing(p, u, m, encoding=encoding)
        assert torch.equal(open_routing(p).raw(), u)


# ------------------------------------------------------------------ concurrent writers
def _context():
    """Processes forked from one server that imported the package once (a spawned child
    would import torch again, seconds each)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "replay_ops.router_replay.files"])
    return ctx


def _slow_appender(path, ready, go_on):
    """Append one sequence, pausing between reading the old file and writing the new one
    until the parent says so."""
    real = files._write

    def slow(*a, **kw):
        ready.set()
        go_on.wait(10)  # the writer in the other process tries to write meanwhile
        return real(*a, **kw)

    files._write = slow
    append_routing(path, routing(2, seed=7), META)


def _writer(path, started, done):
    started.set()
    write_routing(path, routing(3, seed=8), META)
    done.set()


def test_a_write_is_never_lost_to_a_concurrent_append(tmp_path):
    """Lost update: an appender reads the file, a writer replaces it and returns, the
    appender then replaces it with (old + appended). The writer must wait for the
    appender's lock, and its file is the final one."""
    p = str(tmp_path / "r.safetensors")
    write_routing(p, routing(4, seed=6), META)
    ctx = _context()
    ready, go_on, started, done = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    app = ctx.Process(target=_slow_appender, args=(p, ready, go_on))
    wri = ctx.Process(target=_writer, args=(p, started, done))
    app.start()
    try:
        assert ready.wait(60), "the appender did not start"
        wri.start()
        assert started.wait(60), "the writer did not start"
        # the writer must block on the appender's lock (unblocked, it writes in far less)
        blocked = not done.wait(3)
        go_on.set()
        app.join(60)
        wri.join(60)
    finally:
        go_on.set()
        for proc in (app, wri):
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    assert app.exitcode == 0 and wri.exitcode == 0
    assert blocked, "write_routing returned while an append held the file"
    got = open_routing(p).indices()
    assert torch.equal(got, routing(3, seed=8)), "the returned write was lost"


def _appender_loop(path, seed, n):
    for j in range(n):
        append_routing(path, routing(1, seed=1000 * seed + j), META)


def test_concurrent_appenders_lose_nothing(tmp_path):
    """Two processes appending one token at a time: every append is in the file, once."""
    p = str(tmp_path / "r.safetensors")
    write_routing(p, routing(1, seed=5), META)
    ctx = _context()
    procs = [ctx.Process(target=_appender_loop, args=(p, s, 12)) for s in (1, 2)]
    for q in procs:
        q.start()
    for q in procs:
        q.join(120)
    assert all(q.exitcode == 0 for q in procs)
    got = open_routing(p).indices()
    want = {tuple(routing(1, seed=1000 * s + j).flatten().tolist()) for s in (1, 2)
            for j in range(12)}
    rows = [tuple(got[i].flatten().tolist()) for i in range(1, got.shape[0])]
    assert got.shape[0] == 25 and set(rows) == want and len(set(rows)) == 24


# ------------------------------------------------------------------ temporary files
def test_temporary_file_names_the_host(tmp_path, monkeypatch):
    p = tmp_path / "r.safetensors"
    seen = []
    monkeypatch.setattr(files, "_chunk_hook", lambda: seen.extend(os.listdir(tmp_path)))
    write_routing(p, routing(3), META, encoding="raw")
    temps = [f for f in seen if ".tmp-" in f]
    assert temps and all(f.startswith(f".r.safetensors.tmp-{_atomic._host()}-{os.getpid()}-")
                         for f in temps)
    name = socket.gethostname()
    if re.fullmatch(r"[A-Za-z0-9.-]{1,64}", name):  # '-' separates the name's fields
        assert _atomic._host() == name.replace("-", "_")


def _dead_pid() -> int:
    pid = 4_000_000
    while _atomic._pid_alive(pid):
        pid -= 1
    return pid


def test_another_hosts_temporary_is_kept_until_it_is_old(tmp_path):
    p = tmp_path / "r.safetensors"
    dead = _dead_pid()
    other = tmp_path / f".r.safetensors.tmp-otherhost-{dead}-abc123"
    legacy = tmp_path / f".r.safetensors.tmp-{dead}-abc123"  # an older writer's: no host
    mine = tmp_path / f".r.safetensors.tmp-{_atomic._host()}-{dead}-abc123"
    old_other = tmp_path / f".r.safetensors.tmp-otherhost-{dead}-old999"
    for f in (other, legacy, mine, old_other):
        f.write_bytes(b"partial")
    t = time.time() - _atomic.STALE_SECONDS - 60
    os.utime(old_other, (t, t))
    write_routing(p, routing(2), META)
    left = set(os.listdir(tmp_path))
    assert other.name in left and legacy.name in left, "another host's write in progress"
    assert mine.name not in left, "this host's dead writer's temporary is removed"
    assert old_other.name not in left, "a temporary untouched for STALE_SECONDS is removed"


# ------------------------------------------------------------------ engine payloads
def vllm_rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((n, H, K), dtype=np.uint8)
    for t in range(n):
        for lid in MOE_IDS:
            out[t, lid] = rng.permutation(E)[:K]
    return out


def npy_with_shape(shape, data: bytes = b"", descr="|u1") -> str:
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple(shape)}, }}"
    header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
    blob = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + data
    return base64.b64encode(blob).decode()


def test_vllm_npy_header_is_checked_before_allocating():
    good = vllm_rows(5, 1)
    assert np.array_equal(decode_vllm(encode_vllm(good), max_rows=5), good)
    with pytest.raises(RoutingMismatchError, match=r"declares shape \(6, 4, 2\), 6 token rows, "
                                                   r"more than the request's 5"):
        decode_vllm(encode_vllm(vllm_rows(6, 1)), max_rows=5)
    with pytest.raises(RoutingMismatchError, match=r"declares shape \(1099511627776, 61, 8\)"):
        decode_vllm(npy_with_shape((2**40, 61, 8), good.tobytes()))
    with pytest.raises(RoutingMismatchError, match=r"declares shape \(6, 4, 2\) of uint8 \(48 "
                                                   r"bytes\) but 40 bytes"):
        decode_vllm(npy_with_shape((6, 4, 2), good.tobytes()))
    big = npy_with_shape((5, 4, 2), good.astype(">u2").tobytes(), descr=">u2")
    out = decode_vllm(big)
    assert out.dtype == np.uint16 and out.dtype.isnative and np.array_equal(out, good)
    # in a request: the row bound is the turn's token count
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: the \.npy header declares "
                                                   r"shape \(1099511627776, 4, 2\)"):
        vllm_sequences([npy_with_shape((2**40, H, K))], [3], [3], LAYOUT)


def test_multi_turn_vllm_row_count_error_names_the_turn():
    t0 = vllm_rows(4, 2)  # turn 0: seq_len 5, rows 0..3
    t1 = vllm_rows(3, 3)  # turn 1: seq_len 9, start 4: rows 4..7, one of them missing
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 1: vLLM routed_experts has "
                                                   r"3 token rows but seq_len - 1 - prompt_start "
                                                   r"= 4 \(seq_len=9, prompt_start=4\)"):
        vllm_sequences([[(t0, 5), (t1, 9, 4)]], [5], [4], LAYOUT)
    ok = vllm_sequences([[(t0, 5), (vllm_rows(4, 3), 9, 4)]], [5], [4], LAYOUT)
    assert ok[0].num_tokens == 9


def test_sglang_payload_longer_than_the_request_is_refused_before_decoding():
    r = np.asarray(routing(4, seed=9), dtype=np.int32)
    ok = sglang_sequences([{"routed_experts": encode_sglang(r)}], [5], LAYOUT, num_layers=3)
    assert torch.equal(ok[0].indices[:4], torch.from_numpy(r).to(torch.int16))
    huge = "AAAA" * 10000
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: routed_experts is 40000 "
                                                   r"base64 characters, far more than the"):
        sglang_sequences([{"routed_experts": huge}], [5], LAYOUT, num_layers=3)


# ------------------------------------------------------------------ crafted sizes, capped
def _batch_parts():
    return split_batch(batch().to_bytes())


def _case_batch_mask_shape():
    head, bits, blob = _batch_parts()
    data = craft_batch(dict(head, mask_shape=[2**40]), bits, blob)
    return lambda: ReplayBatch.from_bytes(data)


def _case_batch_huge_tokens():
    head, bits, blob = _batch_parts()
    data = craft_batch(dict(head, indices_shape=[2**40, 3, 2], mask_shape=[2**40],
                            cu_seqlens=None), bits, blob)
    return lambda: ReplayBatch.from_bytes(data)


def _case_batch_max_bytes():
    """A legitimate batch of 2M tokens without routes (compresses to almost nothing),
    taken with a max_bytes far below its 24 MiB."""
    n = 1 << 21
    b = ReplayBatch(torch.full((n, 3, 2), -1, dtype=torch.int16), torch.zeros(n, dtype=torch.bool))
    data = b.to_bytes()
    del b
    return lambda: ReplayBatch.from_bytes(data, max_bytes=1 << 20)


def _record_case(encoding, edit, layer_index="moe"):
    import pathlib
    import tempfile

    d = pathlib.Path(tempfile.mkdtemp(prefix="capped-"))
    p = d / "crafted.safetensors"
    p.write_bytes(rewrite_header(record_bytes(d, encoding, layer_index), edit))

    def run():
        try:
            open_routing(p).indices()
        finally:
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    return run


def _case_record_billion_layers():
    return _record_case("codec", _md("num_hidden_layers", "1000000000"), "absolute")


def _case_record_overflow_shape():
    return _record_case("raw", _tensor("indices", "shape", [2**62, 4, 1]))


def _case_vllm_absurd_shape():
    payload = npy_with_shape((2**40, 61, 8), vllm_rows(5, 1).tobytes())
    return lambda: decode_vllm(payload)


def _case_vllm_large_shape():
    """A shape numpy could allocate (3 GB) but the payload does not hold."""
    payload = npy_with_shape((2**24, 61, 3), vllm_rows(5, 1).tobytes())
    return lambda: decode_vllm(payload)


def _case_sglang_long_payload():
    payload = base64.b64encode(bytes(200 << 20)).decode()
    return lambda: sglang_sequences([{"routed_experts": payload}], [5], LAYOUT, num_layers=3)


CAPPED_CASES = {
    "batch-mask-shape": _case_batch_mask_shape,
    "batch-huge-tokens": _case_batch_huge_tokens,
    "batch-max-bytes": _case_batch_max_bytes,
    "record-billion-layers": _case_record_billion_layers,
    "record-overflow-shape": _case_record_overflow_shape,
    "vllm-absurd-shape": _case_vllm_absurd_shape,
    "vllm-large-shape": _case_vllm_large_shape,
    "sglang-long-payload": _case_sglang_long_payload,
}
CAPPED_ERRORS = {
    "batch": "RoutingMismatchError", "record": "RoutingFileError",
    "vllm": "RoutingMismatchError", "sglang": "RoutingMismatchError",
}


def capped_warm_up() -> None:
    ReplayBatch.from_bytes(batch().to_bytes())
    decode_vllm(encode_vllm(vllm_rows(2, 0)))


@pytest.fixture(scope="module")
def capped_results():
    return run_capped(__name__, list(CAPPED_CASES), cap_mib=512, timeout=300)


@pytest.mark.parametrize("name", list(CAPPED_CASES))
def test_crafted_sizes_cost_bounded_memory(capped_results, name):
    """Each crafted size is refused with the package's error, under a 512 MiB cap on the
    address space, its peak RSS growing by less than 64 MiB."""
    r = capped_results[name]
    assert r["outcome"] == "raised", r
    assert r["type"] == CAPPED_ERRORS[name.split("-")[0]], r
    assert r["peak_mib"] < 64, r


# ------------------------------------------------------------------ files changed in place
def _pair(tmp_path, encoding: str, E_: int):
    """Two record files of the same shape, different routing: (path A, B's bytes cut or
    padded to A's size, A's routing)."""
    m = RecordMeta(num_experts=E_, top_k=K, moe_layer_ids=list(MOE_IDS), num_hidden_layers=H)
    a, b = routing(24, seed=60, E=E_), routing(24, seed=61, E=E_)
    pa, pb = tmp_path / f"a-{encoding}-{E_}", tmp_path / f"b-{encoding}-{E_}"
    write_routing(pa, a, m, cu_seqlens=[0, 10, 24], encoding=encoding)
    write_routing(pb, b, m, cu_seqlens=[0, 10, 24], encoding=encoding)
    size = pa.stat().st_size
    return pa, pb.read_bytes()[:size].ljust(size, b"\0"), a


@pytest.mark.parametrize("encoding", files.ENCODINGS)
@pytest.mark.parametrize("E_", [E, 300])
def test_a_file_rewritten_in_place_after_it_was_verified_changes_nothing(tmp_path, encoding,
                                                                         E_):
    """`cp` or `rsync --inplace` over a record file after it was opened and verified (or
    loaded for replay): the routing read is still the routing verified, to the last bit
    (the data is read once into private memory; a map would show the new bytes)."""
    from replay_ops.router_replay import RouterReplay, RouterReplayConfig

    pa, other, a = _pair(tmp_path, encoding, E_)
    rf = open_routing(pa)
    rr = RouterReplay(RouterReplayConfig(mode="R2"), num_experts=E_, top_k=K,
                      moe_layer_ids=MOE_IDS, num_hidden_layers=H)
    rr.load(pa)
    with open(pa, "r+b") as f:  # in place: the same inode, the same size
        f.write(other)
    assert torch.equal(rf.indices(), a)
    assert torch.equal(rf.sequence(1), a[10:])
    assert torch.equal(rf.raw().to(torch.int16).masked_fill(rf.raw() == 255, -1)
                       if E_ <= 255 else rf.raw(), a)
    rf.verify()  # the copy read is the copy verified
    for n, lid in enumerate(MOE_IDS):
        assert torch.equal(rr.routing_for(lid).to(torch.int16), a[:, n])


_TRUNCATE_AFTER_LOAD = """
import os, sys, torch
from replay_ops.router_replay import RouterReplay, RouterReplayConfig
from replay_ops.router_replay.files import open_routing
path = sys.argv[1]
rr = RouterReplay(RouterReplayConfig(mode="R2"), num_experts=300, top_k=2,
                  moe_layer_ids=[0, 2, 3], num_hidden_layers=4)
rr.load(path)
rf = open_routing(path)
os.truncate(path, 0)  # another process truncates the file in place
print(int(rr.routing_for(3).sum()), int(rf.indices().sum()), flush=True)
"""


def test_a_file_truncated_after_it_was_read_is_no_crash(tmp_path):
    """Truncating a raw int16 record file that was loaded (its rows views, no copy) once
    killed the reader with SIGBUS at the next touch of the map; now the reader keeps what
    it read."""
    pa, _, a = _pair(tmp_path, "raw", 300)
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_AFTER_LOAD, str(pa)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == [str(int(a[:, 2].sum())), str(int(a.sum()))]


@pytest.mark.parametrize("encoding", files.ENCODINGS)
def test_a_file_truncated_while_being_read_is_refused(tmp_path, monkeypatch, encoding):
    """The file is truncated in place between the header's checks and the read of its data:
    a RoutingFileError naming the file, not numpy's or mmap's error (or SIGBUS)."""
    pa, _, _ = _pair(tmp_path, encoding, 300)
    original = files._check_layout

    def truncate_then(path, header, data_len):
        original(path, header, data_len)
        os.truncate(pa, os.path.getsize(pa) - 7)

    monkeypatch.setattr(files, "_check_layout", truncate_then)
    with pytest.raises(RoutingFileError, match=r"a-.*truncated while being read: .* of the "
                                               r"\d+ data bytes"):
        open_routing(pa)


# ------------------------------------------------------------------ not a regular file
_NOT_REGULAR = """
import os, sys, torch
from replay_ops.router_replay import RouterReplay, RouterReplayConfig
from replay_ops.router_replay.files import (RecordMeta, RoutingFileError, append_routing,
                                            open_routing, write_routing)
meta = RecordMeta(num_experts=8, top_k=2, moe_layer_ids=[0, 2, 3], num_hidden_layers=4)
r = torch.tensor([[[0, 1], [2, 3], [4, 5]]])
rr = RouterReplay(RouterReplayConfig(mode="R2"), num_experts=8, top_k=2,
                  moe_layer_ids=[0, 2, 3], num_hidden_layers=4)
for path in sys.argv[1:]:
    for name, call in (("open", lambda: open_routing(path)),
                       ("open-unverified", lambda: open_routing(path, verify=False)),
                       ("append", lambda: append_routing(path, r, meta)),
                       ("write", lambda: write_routing(path, r, meta)),
                       ("load", lambda: rr.load(path))):
        try:
            call()
            print(name, "ACCEPTED", flush=True)
        except RoutingFileError as e:
            print(name, e, flush=True)
"""


def test_a_fifo_or_a_directory_is_refused_without_blocking(tmp_path):
    """A FIFO at a record file's path once blocked open_routing and append_routing forever
    (opening it waits for a writer); it, and a directory, are refused at once, named, and
    left as they were."""
    fifo, folder = tmp_path / "routing.fifo", tmp_path / "routing.dir"
    os.mkfifo(fifo)
    folder.mkdir()
    r = subprocess.run([sys.executable, "-c", _NOT_REGULAR, str(fifo), str(folder)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 10, r.stdout
    for line, what in zip(lines, ["a FIFO"] * 5 + ["a directory"] * 5):
        assert "ACCEPTED" not in line and f"not a regular file ({what})" in line, line
        assert ("routing.fifo" if what == "a FIFO" else "routing.dir") in line, line
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and folder.is_dir()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


# ------------------------------------------------------------------ symbolic links
def test_writes_through_a_symlink_keep_the_link(tmp_path):
    """Writing or appending through a symbolic link updates the file it points to: the link
    stays a link (it once became a regular file of its own, and the two names then lost
    each other's appends); the lock, the temporary and the rename are all beside the target."""
    real_dir, link_dir = tmp_path / "data", tmp_path / "links"
    real_dir.mkdir()
    link_dir.mkdir()
    real, link = real_dir / "r.safetensors", link_dir / "r.safetensors"
    link.symlink_to(os.path.relpath(real, link_dir))  # dangling: the first write creates it
    write_routing(link, routing(3, seed=70), META)
    append_routing(link, routing(2, seed=71), META)
    append_routing(real, routing(4, seed=72), META)
    append_routing(link, routing(1, seed=73), META, encoding="raw")
    assert link.is_symlink() and real.is_file() and not real.is_symlink()
    want = torch.cat([routing(3, seed=70), routing(2, seed=71), routing(4, seed=72),
                      routing(1, seed=73)])
    for p in (real, link):
        assert torch.equal(open_routing(p).indices(), want)
    assert os.listdir(link_dir) == ["r.safetensors"]  # no lock, no temporary beside the link
    assert sorted(os.listdir(real_dir)) == [".r.safetensors.lock", "r.safetensors"]
    # the one atomic writer (benchmark results, the demo's outputs) follows a link too
    out, out_link = real_dir / "result.md", link_dir / "result.md"
    out_link.symlink_to(out)
    _atomic.atomic_write(out_link, "first")
    _atomic.atomic_write(out_link, "second")
    assert out_link.is_symlink() and out.read_text() == "second"


def _append_through(path, seed, n):
    for j in range(n):
        append_routing(path, routing(1, seed=1000 * seed + j), META)


def test_appenders_through_a_link_and_the_target_lose_nothing(tmp_path):
    """Two processes append, one through a symbolic link, one through the file's own name:
    both take the same lock (the resolved path's), so every append is in the file, once."""
    real = tmp_path / "r.safetensors"
    link = tmp_path / "alias.safetensors"
    write_routing(real, routing(1, seed=5), META)
    link.symlink_to(real.name)
    ctx = _context()
    procs = [ctx.Process(target=_append_through, args=(str(p), s, 8))
             for p, s in ((link, 1), (real, 2))]
    for q in procs:
        q.start()
    for q in procs:
        q.join(120)
    assert all(q.exitcode == 0 for q in procs)
    assert link.is_symlink()
    got = open_routing(real).indices()
    want = {tuple(routing(1, seed=1000 * s + j).flatten().tolist()) for s in (1, 2)
            for j in range(8)}
    rows = [tuple(got[i].flatten().tolist()) for i in range(1, got.shape[0])]
    assert got.shape[0] == 17 and set(rows) == want


# ------------------------------------------------------------------ OpenAI choice indices
def _openai(choices, payload):
    return {"choices": choices, "sglext": {"routed_experts": payload}}


@pytest.mark.parametrize("choices, match", [
    ([{"index": 0}, {"index": 0}], r"choices\[0\] and choices\[1\] both have index 0"),
    ([{"index": 1}, {"text": ""}], r"choices\[1\] has no 'index'"),
    ([{"index": 0.0}], r"choices\[0\] has index 0.0; a choice index is a non-negative"),
    ([{"index": "0"}], r"choices\[0\] has index '0'"),
    ([{"index": None}], r"choices\[0\] has index None"),
    ([{"index": True}], r"choices\[0\] has index True"),
    ([{"index": [0]}], r"choices\[0\] has index \[0\]"),
    ([{"index": -1}, {"index": 0}], r"choices\[0\] has index -1"),
    ([{"index": 0}, "text"], r"choices\[1\] is str, not a choice object"),
])
def test_openai_choice_indices_are_checked(choices, match):
    """The OpenAI form matches payloads to choices by their `index`: a missing,
    non-integer, negative or repeated one is refused naming the choice (a non-integer once
    raised a bare TypeError, and two choices with index 0 both took choice 0's routing)."""
    from replay_ops.router_replay.adapters.sglang import openai_meta_infos

    payload = encode_sglang(routing(4).numpy().astype(np.int32))
    with pytest.raises(RoutingMismatchError, match=match):
        openai_meta_infos(_openai(choices, payload), allow_missing=True)
    ok = openai_meta_infos(_openai([{"index": 1}, {"index": np.int64(0)}], payload),
                           allow_missing=True)
    assert ok[0] == {"routed_experts": payload} and ok[1] is None
