"""Fuzzing the decoders of routing that crosses a process boundary: record files,
`ReplayBatch.from_bytes`, vLLM `.npy` payloads and SGLang base64 payloads.

Every mutation (each bit flip of one byte per position, seeded overwrites, every
truncation, crafted headers with maximal sizes) has one exact expected outcome:

* record files and `ReplayBatch` bytes carry checksums: the routing read back is identical
  to what was written, or the package's own error (RoutingFileError, RoutingMismatchError);
* vLLM and SGLang payloads carry none (a flipped expert id is another valid routing): the
  routing returned is exactly what an independent reader of the mutated bytes (numpy's
  `np.load`, `np.frombuffer`) finds in them, or RoutingMismatchError.

Any other exception (KeyError, TypeError, numpy's MemoryError, torch's RuntimeError...)
fails. The crafted-size cases run in a child process under an address-space cap
(RLIMIT_AS), their peak RSS measured. Seeds are fixed; the suite takes well under a
minute on 2 cores.
"""
from __future__ import annotations

import base64
import io
import json
import struct

import numpy as np
import pytest
import torch

from _capped import run_capped
from replay_ops.router_replay import files
from replay_ops.router_replay.adapters import (
    ModelShape,
    ReplayBatch,
    RoutingMismatchError,
    sglang_sequences,
    vllm_sequences,
)
from replay_ops.router_replay.files import RecordMeta, RoutingFileError, open_routing

E, K, MOE_IDS, H = 8, 2, (0, 2, 3), 4
L = len(MOE_IDS)
LAYOUT = ModelShape(num_experts=E, top_k=K, moe_layer_ids=MOE_IDS, num_hidden_layers=H)
SEED = 20261126


def routing(n: int, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    r = np.stack([[g.permutation(E)[:K] for _ in range(L)] for _ in range(n)])
    return torch.from_numpy(r.astype(np.int16).reshape(n, L, K))


def mutations(data: bytes, seed: int, overwrites: int = 64):
    """(name, mutated bytes): one flipped bit (seeded) per byte position, `overwrites`
    seeded overwrites of 1..16 random bytes, and every truncation."""
    rng = np.random.default_rng(seed)
    for i in range(len(data)):
        b = bytearray(data)
        b[i] ^= 1 << int(rng.integers(8))
        yield f"flip@{i}", bytes(b)
    for j in range(overwrites):
        b = bytearray(data)
        n = int(rng.integers(1, 17))
        at = int(rng.integers(0, max(len(data) - n, 1)))
        b[at:at + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        yield f"overwrite{j}@{at}+{n}", bytes(b)
    for n in range(len(data)):
        yield f"cut@{n}", data[:n]


def _outcome(fn, errors):
    """("ok", value) or ("refused", message); anything but `errors` propagates."""
    try:
        return "ok", fn()
    except errors as e:
        return "refused", str(e)


# ------------------------------------------------------------------ ReplayBatch bytes
def _batches():
    thd = ReplayBatch(routing(9, 1), torch.tensor([True] * 8 + [False]),
                      torch.tensor([0, 4, 4, 9]), ["moe", None, "absolute"])
    r = routing(8, 2)
    r[1, 2] = -1
    padded = ReplayBatch(r.reshape(2, 4, L, K), torch.tensor([[True, False] * 2] * 2))
    return {"thd": thd, "padded": padded}


def _same_batch(a: ReplayBatch, b: ReplayBatch) -> bool:
    return (a.indices.dtype == b.indices.dtype and torch.equal(a.indices, b.indices)
            and torch.equal(a.replay_mask, b.replay_mask)
            and (a.cu_seqlens is None) == (b.cu_seqlens is None)
            and (a.cu_seqlens is None or torch.equal(a.cu_seqlens, b.cu_seqlens))
            and a.mappings == b.mappings and a.layer_index == b.layer_index)


@pytest.mark.parametrize("kind", ["thd", "padded"])
def test_fuzz_replay_batch_bytes(kind):
    b = _batches()[kind]
    data = b.to_bytes(num_experts=E)
    counts = {"ok": 0, "refused": 0}
    for name, bad in mutations(data, SEED + len(kind)):
        got, value = _outcome(lambda: ReplayBatch.from_bytes(bad), RoutingMismatchError)
        if got == "ok":
            assert _same_batch(value, b), f"{name}: different routing without an error"
        counts[got] += 1
    # every truncation is refused; almost every flip is (the few accepted are identical)
    assert counts["refused"] >= 2 * len(data), counts


# ------------------------------------------------------------------ record files
_RECORDS = {}


def _record(tmp_path, encoding: str) -> tuple[bytes, torch.Tensor]:
    """A record file's bytes (written once per encoding) and its routing."""
    if encoding in _RECORDS:
        return _RECORDS[encoding]
    r = routing(12, 3)
    r[4] = -1
    p = tmp_path / f"src-{encoding}.safetensors"
    files.write_routing(p, r, RecordMeta(num_experts=E, top_k=K, moe_layer_ids=list(MOE_IDS),
                                         num_hidden_layers=H, model_name="fuzz"),
                        cu_seqlens=[0, 5, 5, 12], encoding=encoding)
    _RECORDS[encoding] = p.read_bytes(), r
    return _RECORDS[encoding]


def _read_record_bytes(data: bytes, d):
    p = d / "read.safetensors"
    p.write_bytes(data)
    return _read_record(p)


def _read_record(path):
    rf = open_routing(path)
    return (rf.indices(), rf.cu_seqlens, [rf.sequence(i) for i in range(rf.num_sequences)],
            rf.meta.shape, rf.raw())


@pytest.mark.parametrize("encoding", ["codec", "raw"])
def test_fuzz_record_files(tmp_path, encoding):
    data, r = _record(tmp_path, encoding)
    want_raw = torch.where(r < 0, 255, r).to(torch.uint8)
    p = tmp_path / "fuzzed.safetensors"
    counts = {"ok": 0, "refused": 0}
    for name, bad in mutations(data, SEED + len(encoding), overwrites=48):
        p.write_bytes(bad)
        got, value = _outcome(lambda: _read_record(p), RoutingFileError)
        if got == "ok":
            idx, cu, seqs, shape, raw = value
            assert torch.equal(idx, r) and cu.tolist() == [0, 5, 5, 12], name
            assert all(torch.equal(s, r[a:b]) for s, a, b in zip(seqs, [0, 5, 5], [5, 5, 12]))
            assert shape == LAYOUT and torch.equal(raw, want_raw), name
        counts[got] += 1
    assert counts["refused"] >= 2 * len(data) - 8, counts


# ------------------------------------------------------------------ vLLM payloads
def _vllm_rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((n, H, K), dtype=np.uint8)
    for t in range(n):
        for lid in MOE_IDS:
            out[t, lid] = rng.permutation(E)[:K]
    return out


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _numpy_reads(raw: bytes):
    """numpy's own reading of an .npy blob: the array, or None when numpy refuses it or it
    is not 3-D integer routing."""
    try:
        a = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception:  # noqa: BLE001 - numpy's refusal in any form
        return None
    return a if a.dtype.kind in "iu" and a.ndim == 3 else None


def test_fuzz_vllm_npy_payloads():
    a = _vllm_rows(6, 4)  # prompt 3 + response 4 - 1 rows
    raw = _npy(a)
    counts = {"ok": 0, "refused": 0}
    for name, bad in mutations(raw, SEED + 3):
        text = base64.b64encode(bad).decode()
        got, value = _outcome(lambda: vllm_sequences([text], [3], [4], LAYOUT)[0],
                              RoutingMismatchError)
        if got == "ok":
            ref = _numpy_reads(bad)
            assert ref is not None, f"{name}: numpy refuses the payload, the adapter read it"
            want = torch.from_numpy(ref[:, list(MOE_IDS)].astype(np.int16))
            assert torch.equal(value.indices[:-1], want), f"{name}: not the payload's routing"
        counts[got] += 1
    assert counts["refused"] > len(raw), counts


# ------------------------------------------------------------------ SGLang payloads
def test_fuzz_sglang_payloads():
    r = routing(6, 5).numpy().astype("<i4")
    raw = r.tobytes()
    counts = {"ok": 0, "refused": 0}
    cases = list(mutations(raw, SEED + 4))
    text = base64.b64encode(raw)
    rng = np.random.default_rng(SEED + 5)
    for i in range(0, len(text), 3):  # the base64 text itself, and its truncations
        t = bytearray(text)
        t[i] = int(rng.choice(list(b"A/+=*-_ \n\x00\xff")))
        cases.append((f"text@{i}", bytes(t)))
        cases.append((f"textcut@{i}", text[:i]))
    for name, bad in cases:
        payload = bad.decode("latin1") if name.startswith("text") else \
            base64.b64encode(bad).decode()
        got, value = _outcome(
            lambda: sglang_sequences([{"routed_experts": payload}], [7], LAYOUT,
                                     num_layers=L)[0], RoutingMismatchError)
        if got == "ok":
            back = base64.b64decode(payload, validate=True)
            want = torch.from_numpy(np.frombuffer(back, "<i4").reshape(6, L, K).astype(np.int16))
            assert torch.equal(value.indices[:-1], want), f"{name}: not the payload's routing"
        counts[got] += 1
    assert counts["refused"] > len(raw), counts


# ------------------------------------------------------------------ crafted maximal sizes
MAXIMAL = [2**31 - 1, 2**32, 2**63 - 1, 2**64 + 1, 10**40, -1]


def _batch_case(**change):
    def build():
        data = _batches()["thd"].to_bytes(num_experts=E)
        nh, nb = struct.unpack_from("<QQ", data, 12)
        head = json.loads(data[28:28 + nh])
        head.update(change)
        h = json.dumps(head).encode()
        body = struct.pack("<QQ", len(h), nb) + h + data[28 + nh:28 + nh + nb]
        import zlib

        out = b"RRBATCH1" + struct.pack("<I", zlib.crc32(body)) + body + data[28 + nh + nb:]
        return lambda: ReplayBatch.from_bytes(out)
    return build


def _batch_lengths_case(nh=None, nb=None):
    def build():
        data = bytearray(_batches()["thd"].to_bytes(num_experts=E))
        h0, b0 = struct.unpack_from("<QQ", data, 12)
        struct.pack_into("<QQ", data, 12, h0 if nh is None else nh, b0 if nb is None else nb)
        return lambda: ReplayBatch.from_bytes(bytes(data))
    return build


def _record_case(encoding, edit):
    def build():
        import pathlib
        import tempfile

        d = pathlib.Path(tempfile.mkdtemp(prefix="fuzz-"))
        data, _ = _record(d, encoding)
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        edit(header)
        header["__metadata__"]["header_checksum"] = files.header_digest(header)
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-(len(hb) + 8) % 8)
        p = d / "crafted.safetensors"
        p.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])

        def run():
            try:
                _read_record(p)
            finally:
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()
        return run
    return build


def _set_md(key, value):
    def edit(h):
        h["__metadata__"][key] = value
    return edit


def _set_tensor(name, key, value):
    def edit(h):
        h[name][key] = value
    return edit


def _npy_case(shape, descr="|u1"):
    def build():
        header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
        header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
        blob = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()
        text = base64.b64encode(blob + _vllm_rows(6, 4).tobytes()).decode()
        return lambda: vllm_sequences([text], [3], [4], LAYOUT)
    return build


def _sglang_case(nbytes):
    def build():
        text = base64.b64encode(bytes(nbytes)).decode()
        return lambda: sglang_sequences([{"routed_experts": text}], [7], LAYOUT, num_layers=L)
    return build


CAPPED_CASES = {}
for v in MAXIMAL:
    CAPPED_CASES[f"batch-N-{v}"] = _batch_case(indices_shape=[v, L, K], mask_shape=[v],
                                               cu_seqlens=None, mappings=[])
    CAPPED_CASES[f"batch-L-{v}"] = _batch_case(indices_shape=[9, v, K])
    CAPPED_CASES[f"batch-K-{v}"] = _batch_case(indices_shape=[9, L, v])
    CAPPED_CASES[f"batch-mask-{v}"] = _batch_case(mask_shape=[v])
    CAPPED_CASES[f"batch-cu-{v}"] = _batch_case(cu_seqlens=[0, 4, v, 9])
    CAPPED_CASES[f"batch-padded-{v}"] = _batch_case(indices_shape=[v, v, L, K],
                                                    mask_shape=[v, v], cu_seqlens=None,
                                                    mappings=[])
    if v >= 0:
        CAPPED_CASES[f"batch-nh-{v}"] = _batch_lengths_case(nh=v % 2**64)
        CAPPED_CASES[f"batch-nb-{v}"] = _batch_lengths_case(nb=v % 2**64)
    for key in ("num_experts", "top_k", "num_hidden_layers", "num_tokens", "num_sequences"):
        CAPPED_CASES[f"record-{key}-{v}"] = _record_case("codec", _set_md(key, str(v)))
    CAPPED_CASES[f"record-moe_ids-{v}"] = _record_case("codec", _set_md(
        "moe_layer_ids", json.dumps([0, 2, v])))
    CAPPED_CASES[f"record-shape-{v}"] = _record_case("codec", _set_md(
        "indices_shape", json.dumps([v, L, K])))
    CAPPED_CASES[f"record-rawshape-{v}"] = _record_case("raw", _set_tensor(
        "indices", "shape", [v, L, K]))
    CAPPED_CASES[f"record-cushape-{v}"] = _record_case("raw", _set_tensor(
        "cu_seqlens", "shape", [v]))
    CAPPED_CASES[f"record-offsets-{v}"] = _record_case("codec", _set_tensor(
        "indices_codec", "data_offsets", [32, v]))
    CAPPED_CASES[f"vllm-rows-{v}"] = _npy_case((v, H, K))
    CAPPED_CASES[f"vllm-layers-{v}"] = _npy_case((6, v, K))
    CAPPED_CASES[f"vllm-k-{v}"] = _npy_case((6, H, v), descr="<u2")
def _tiny_chunks_record_case():
    """A codec record file (every checksum right) whose blob is ~300 KB of chunks of no
    token, the last one's content checksum forged: refused, in bounded memory, each chunk
    costing a constant (tests/test_fuzz_codec.py bounds the CPU time of such blobs)."""
    def build():
        import pathlib
        import tempfile

        from _codec_forge import reseal, split
        from replay_ops.router_replay import codec

        d = pathlib.Path(tempfile.mkdtemp(prefix="fuzz-"))
        b = codec.encode(np.zeros((0, L, K), np.int64), num_experts=E, order="keep")
        v, head, ext, ch = split(b)
        n = 300_000 // (codec.CHUNK_HEADER_SIZE + 4)
        chunks = [ch[0]] * (n - 1) + [split(b)[3][0]]
        chunks[-1].fields[10] = 99
        p = d / "tiny.safetensors"
        m = RecordMeta(num_experts=E, top_k=K, moe_layer_ids=list(MOE_IDS),
                       num_hidden_layers=H)
        files._write(p, m, np.zeros(n + 1, np.int64), [], L, codec_blob=reseal(v, head,
                                                                             ext, chunks))

        def run():
            try:
                _read_record(p)
            finally:
                p.unlink()
                d.rmdir()
        return run
    return build


CAPPED_CASES["record-tiny-chunks"] = _tiny_chunks_record_case()
CAPPED_CASES["record-absolute-billion"] = _record_case("codec", lambda h: h["__metadata__"].update(
    num_hidden_layers=str(10**9), layer_index="absolute"))
CAPPED_CASES["sglang-200MiB"] = _sglang_case(200 << 20)
CAPPED_CASES["sglang-one-more-row"] = _sglang_case(4 * 7 * L * K)


def capped_warm_up() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        import pathlib

        for encoding in ("codec", "raw"):
            _read_record_bytes(_record(pathlib.Path(d), encoding)[0], pathlib.Path(d))
    for b in _batches().values():
        ReplayBatch.from_bytes(b.to_bytes(num_experts=E))
    vllm_sequences([base64.b64encode(_npy(_vllm_rows(6, 4))).decode()], [3], [4], LAYOUT)


@pytest.fixture(scope="module")
def capped():
    return run_capped(__name__, list(CAPPED_CASES), cap_mib=512, timeout=600)


ERRORS = {"batch": "RoutingMismatchError", "record": "RoutingFileError",
          "vllm": "RoutingMismatchError", "sglang": "RoutingMismatchError"}


def test_crafted_maximal_sizes_are_refused_in_bounded_memory(capped):
    """Every crafted size is refused with the package's error, under a 512 MiB cap on the
    child's address space, its peak RSS growing by less than 32 MiB."""
    bad = {name: r for name, r in capped.items()
           if r["outcome"] != "raised" or r["type"] != ERRORS[name.split("-")[0]]
           or not r["peak_mib"] < 32}
    assert set(capped) == set(CAPPED_CASES)
    assert not bad, json.dumps(bad, indent=1)[:4000]


# ------------------------------------------------------------------ masks versus empty rows
def _holey(rng, n: int) -> np.ndarray:
    """[n, L, K] routing with holes: tokens with no route at all (every slot -1), tokens
    with one MoE layer empty (every slot -1 there), tokens with one empty slot (still
    routed in that layer)."""
    r = routing(n, int(rng.integers(1 << 30))).numpy().astype(np.int32)
    for t in range(n):
        u = rng.random()
        if u < 0.15:
            r[t] = -1
        elif u < 0.25:
            r[t, rng.integers(L)] = -1
        elif u < 0.4:
            r[t, rng.integers(L), rng.integers(K)] = -1
    return r


def _rows_status(r: np.ndarray) -> list[str]:
    """Per token, independently of the package: "routed" (an expert in every layer),
    "none" (no slot holds an expert) or "partial"."""
    out = []
    for t in range(r.shape[0]):
        layers = [any(v >= 0 for v in r[t, j]) for j in range(r.shape[1])]
        out.append("routed" if all(layers) else "none" if not any(layers) else "partial")
    return out


def test_fuzz_engine_rows_with_empty_layers():
    """vLLM and SGLang payloads (one turn, or two) with holes: a token routed in every MoE
    layer is replayed, one with no route at all is not (replay_mask False, native top-k),
    and a token empty in some MoE layers but routed in others is refused (it was marked
    for replay: its MoE output in those layers was 0)."""
    from replay_ops.router_replay.adapters import (MultiTurnRouting, encode_sglang,
                                                    encode_vllm)

    rng = np.random.default_rng(SEED + 44)
    counts = {"refused": 0, "ok": 0}
    for case in range(60):
        n = int(rng.integers(1, 9))
        r = _holey(rng, n)
        status = _rows_status(r)
        calls = {
            "vllm": lambda: vllm_sequences([encode_vllm(r.astype(np.int16))], [1], [n],
                                           LAYOUT)[0],
            "sglang": lambda: sglang_sequences([{"routed_experts": encode_sglang(r)}],
                                               [n + 1], LAYOUT, num_layers=L)[0],
        }
        cut = int(rng.integers(0, n + 1))

        def two_turns():
            acc = MultiTurnRouting(LAYOUT)
            acc.add_turn(r[:cut], cut + 1)
            acc.add_turn(r[cut:], n + 1, cut)
            return acc.sequence(n + 1)

        calls["turns"] = two_turns
        for name, call in calls.items():
            got, value = _outcome(call, RoutingMismatchError)
            if "partial" in status:
                first = status.index("partial")
                assert got == "refused" and f"token {first} has no route" in value, \
                    (case, name, status, value)
                counts["refused"] += 1
                continue
            assert got == "ok", (case, name, value)
            assert value.mask.tolist() == [s == "routed" for s in status] + [False], \
                (case, name, status)
            assert torch.equal(value.indices[:-1], torch.from_numpy(r.astype(np.int16)))
            counts["ok"] += 1
    assert counts["refused"] > 20 and counts["ok"] > 20, counts


def _with_mask(data: bytes, mask: np.ndarray) -> bytes:
    """ReplayBatch bytes with another mask, its checksum recomputed (as a sender can)."""
    import zlib

    nh, nb = struct.unpack_from("<QQ", data, 12)
    bits = np.packbits(mask.astype(bool)).tobytes()
    assert len(bits) == nb
    body = data[12:28 + nh] + bits
    return b"RRBATCH1" + struct.pack("<I", zlib.crc32(body)) + body + data[28 + nh + nb:]


def test_fuzz_masks_versus_empty_rows():
    """Routing with holes under random masks, as ReplayBatch bytes (the mask's checksum
    recomputed) and as RouterReplay.set_routing with an explicit mask: refused exactly when
    a token marked for replay has a MoE layer with no route; otherwise taken as given."""
    from replay_ops.router_replay import RouterReplay, RouterReplayConfig
    from replay_ops.router_replay.replay import RouterReplayError

    rng = np.random.default_rng(SEED + 45)
    rr = RouterReplay(RouterReplayConfig(mode="R3"), shape=LAYOUT)
    counts = {"refused": 0, "ok": 0}
    for case in range(80):
        n = int(rng.integers(1, 10))
        r = _holey(rng, n)
        status = _rows_status(r)
        mask = rng.random(n) < 0.6
        bad = [t for t in range(n) if mask[t] and status[t] != "routed"]
        idx = torch.from_numpy(r.astype(np.int16))
        data = _with_mask(ReplayBatch(idx, torch.zeros(n, dtype=torch.bool)).to_bytes(
            num_experts=E), mask)
        got, value = _outcome(lambda: ReplayBatch.from_bytes(data), RoutingMismatchError)
        got2, value2 = _outcome(lambda: rr.set_routing(idx, torch.from_numpy(mask)),
                                RouterReplayError)
        got3, _ = _outcome(lambda: ReplayBatch(idx, torch.from_numpy(mask)).to_bytes(
            num_experts=E), RoutingMismatchError)
        if bad:
            assert got == got2 == got3 == "refused", (case, status, mask)
            assert f"token {bad[0]} is marked for replay" in value
            assert f"token {bad[0]} is marked for replay" in value2
            counts["refused"] += 1
        else:
            assert got == got2 == got3 == "ok", (case, value, value2)
            assert torch.equal(value.indices, idx) and value.replay_mask.tolist() == \
                mask.tolist()
            assert torch.equal(rr.replay_mask, torch.from_numpy(mask))
            counts["ok"] += 1
    assert counts["refused"] > 20 and counts["ok"] > 10, counts
