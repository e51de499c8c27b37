"""Fuzzing the routing codec's decoders (replay_ops.router_replay.codec) with hostile input:
bit flips, overwrites, every truncation, chunk swaps, duplicates and cross-blob splices,
crafted headers with maximal sizes, decompression bombs; on the numpy path and the Triton
path (TRITON_INTERPRET=1 without a GPU: small shapes). Every case asserts the exact
outcome: the routing that was encoded, or CodecError. Deterministic seeds; bounded in time.

The stated limit, tested in a child process under an address-space cap (RLIMIT_AS):
decoding any input costs at most MEM_FACTOR x the bytes of the output its validated header
allows, plus MEM_CONST; and time linear in its size."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from _codec_forge import empty_chunk, forge_header, reseal, split, with_rows
from replay_ops.router_replay import codec
from replay_ops.router_replay.codec import CodecError

MEM_FACTOR = 16          # x the decoded output's bytes (int16) ...
MEM_CONST = 96 << 20     # ... plus this (numpy/zstd scratch, the parser's tables)


def _expected(x, order):
    if order == "keep":
        return x
    s = np.where(x < 0, np.iinfo(np.int64).max, x)
    s = np.sort(s, axis=-1)
    return np.where(s == np.iinfo(np.int64).max, -1, s)


def _cases():
    """(name, routing, token ids or None, blob): zstd and raw chunks, relabelled chunks,
    token ids or not, appended turns, both orders."""
    rng = np.random.default_rng(34)
    out = []
    base = np.stack([rng.permutation(32)[:4] for _ in range(6)])
    x = base[rng.integers(0, 6, size=48 * 2)].reshape(48, 2, 4)
    x[3, 1, 2] = -1
    tok = rng.integers(0, 7, size=48)
    for order in codec.ORDERS:
        for with_tok in (False, True):
            t = tok if with_tok else None
            b = codec.encode(x, num_experts=32, order=order, token_ids=t,
                             seq_lens=[20, 16, 12], chunk_tokens=16)
            out.append((f"{order}_{'tok' if with_tok else 'notok'}", x, t, b))
    # relabelled keep chunks (T*K >= 16*E) and an incompressible (raw) chunk
    xr = np.stack([rng.permutation(6)[:3] for _ in range(64 * 2)]).reshape(64, 2, 3)
    xr[::3, :, 0] = 0
    out.append(("keep_relabel", xr, None, codec.encode(xr, num_experts=6, order="keep")))
    xw = rng.integers(0, 250, size=(12, 2, 4))
    out.append(("keep_raw", xw, None, codec.encode(xw, num_experts=250, order="keep")))
    # three appended turns of one sequence
    turns = [x[:10], x[10:25], x[25:]]
    b = codec.encode(turns[0], num_experts=32, order="keep", token_ids=tok[:10])
    b = codec.append(b, turns[1], token_ids=tok[10:25], continue_last=True)
    b = codec.append(b, turns[2], token_ids=tok[25:], continue_last=True)
    out.append(("keep_turns", x, tok, b))
    return out


CASES = _cases()


def _outcome(blob, tok, want, backend="numpy"):
    """"ok" when blob decodes to exactly `want`, "error" on CodecError; anything else (a
    wrong answer, another exception) fails the test."""
    try:
        got = codec.decode(blob, token_ids=tok, backend=backend)
    except CodecError:
        return "error"
    np.testing.assert_array_equal(got.numpy(), want)
    return "ok"


@pytest.mark.parametrize("name,x,tok,blob", CASES, ids=[c[0] for c in CASES])
def test_bit_flips_and_overwrites(name, x, tok, blob):
    rng = np.random.default_rng(len(blob))
    order = "set" if name.startswith("set") else "keep"
    want = _expected(x, order)
    assert _outcome(blob, tok, want) == "ok"
    nbits = 8 * len(blob)
    # every byte covered by a checksum: a flipped bit anywhere is refused
    for bit in rng.choice(nbits, size=min(nbits, 400), replace=False):
        b = bytearray(blob)
        b[bit // 8] ^= 1 << (bit % 8)
        assert _outcome(bytes(b), tok, want) == "error", (name, int(bit))
    for _ in range(150):
        b = bytearray(blob)
        at = int(rng.integers(0, len(b)))
        n = int(rng.integers(1, 9))
        new = rng.integers(0, 256, size=min(n, len(b) - at), dtype=np.uint8).tobytes()
        same = bytes(b[at:at + len(new)]) == new
        b[at:at + len(new)] = new
        assert _outcome(bytes(b), tok, want) == ("ok" if same else "error"), (name, at, n)


@pytest.mark.parametrize("name,x,tok,blob", CASES, ids=[c[0] for c in CASES])
def test_every_truncation_and_extension(name, x, tok, blob):
    order = "set" if name.startswith("set") else "keep"
    want = _expected(x, order)
    for n in range(len(blob)):
        assert _outcome(blob[:n], tok, want) == "error", (name, n)
    for tail in (b"\0", b"RRCK", blob[codec.BLOB_HEADER_SIZE:]):
        assert _outcome(blob + tail, tok, want) == "error"


def _chunks(blob):
    inf = codec.info(blob)
    return blob[:codec.BLOB_HEADER_SIZE], [
        bytes(blob[c.offset:c.payload_offset + c.payload_len]) for c in inf.chunks]


@pytest.mark.parametrize("name", ["keep_tok", "set_notok", "keep_turns"])
def test_chunk_swaps_duplicates_and_drops(name):
    """Every arrangement of a blob's chunks (each at most twice, up to 4) under its
    header: only the original decodes, to the original routing."""
    _, x, tok, blob = next(c for c in CASES if c[0] == name)
    order = "set" if name.startswith("set") else "keep"
    head, chunks = _chunks(blob)
    n = len(chunks)
    assert n == 3
    tried = 0
    pool = list(range(n)) * 2
    for k in range(0, 5):
        for arr in set(itertools.permutations(pool, k)):
            cand = head + b"".join(chunks[i] for i in arr)
            ids = None if tok is None else np.concatenate(
                [np.zeros(0, np.int64)] + [tok[codec.info(blob).chunks[i].token_start:
                                               codec.info(blob).chunks[i].token_start
                                               + codec.info(blob).chunks[i].num_tokens]
                                           for i in arr])
            outcome = _outcome(cand, ids, _expected(x, order))
            assert outcome == ("ok" if list(arr) == list(range(n)) else "error"), arr
            tried += 1
    assert tried == 91  # every sequence of 0..4 of the 3 chunks, each at most twice


def test_cross_blob_splices():
    """Two blobs of the same shape and token ids: every mix of their chunks under either
    header is refused, except each blob itself."""
    rng = np.random.default_rng(35)
    t = rng.integers(0, 5, size=30)
    xs = [rng.integers(-1, 16, size=(30, 2, 4)) for _ in range(2)]
    kw = dict(num_experts=16, order="keep", token_ids=t, seq_lens=[10, 10, 10],
              chunk_tokens=10)
    blobs = [codec.encode(x, **kw) for x in xs]
    parts = [_chunks(b) for b in blobs]
    for h in range(2):
        for pick in itertools.product(range(2), repeat=3):
            cand = parts[h][0] + b"".join(parts[p][1][i] for i, p in enumerate(pick))
            same = all(p == h for p in pick)
            assert _outcome(cand, t, xs[h]) == ("ok" if same else "error"), (h, pick)
    # the same with every checksum but the content's and the binding's recomputed per chunk
    # (payload crc32s right): still refused
    v, head, ext, ch0 = split(blobs[0])
    _, _, _, ch1 = split(blobs[1])
    spliced = codec.info(reseal(v, head, ext, [ch0[0], ch1[1], ch0[2]]), verify_payload=True)
    assert spliced.num_tokens == 30  # a forger who recomputes the chain is out of scope:
    # the binding is a checksum, no signature (docs/router_replay.md)


@pytest.mark.parametrize("name", ["keep_tok", "set_tok", "keep_relabel", "keep_turns"])
def test_triton_path_fuzz(name):
    """The Triton path (interpreted here) under the same attacks, on a sample: the same
    exact outcome as the numpy path."""
    _, x, tok, blob = next(c for c in CASES if c[0] == name)
    order = "set" if name.startswith("set") else "keep"
    want = _expected(x, order)
    rng = np.random.default_rng(36)
    assert _outcome(blob, tok, want, "triton") == "ok"
    for bit in rng.choice(8 * len(blob), size=12, replace=False):
        b = bytearray(blob)
        b[bit // 8] ^= 1 << (bit % 8)
        assert _outcome(bytes(b), tok, want, "triton") == "error"
    for n in rng.choice(len(blob), size=8, replace=False):
        assert _outcome(blob[:n], tok, want, "triton") == "error"
    head, chunks = _chunks(blob)
    if len(chunks) > 1:
        assert _outcome(head + chunks[1] + chunks[0] + b"".join(chunks[2:]), tok, want,
                        "triton") == "error"


# ---------------------------------------------------------------------------- crafted sizes
def _crafted():
    """Small blobs whose headers claim the largest sizes the bounds allow (or more)."""
    _, x, tok, blob = CASES[0]   # set, no token ids, 3 chunks
    v, head, ext, chunks = split(blob)
    out = {}
    for f, val in [("K", codec.MAX_TOP_K), ("K", codec.MAX_TOP_K + 1), ("K", 2**32 - 1),
                   ("L", codec.MAX_LAYERS), ("L", 2**32 - 1), ("num_tokens", 2**64 - 1),
                   ("num_chunks", 2**32 - 1), ("num_seqs", 2**32 - 1), ("E", 2**31 - 1)]:
        out[f"header_{f}_{val}"] = forge_header(blob, **{f: val})
    # a chunk that claims the most tokens, resealed (its checksums right)
    for T in (2**31, 2**40, 2**63):
        c = [split(blob)[3][0]]
        c[0].fields[7] = T
        c[0].lens = (T % 2**32,) if T < 2**32 else (2**32 - 1,)
        out[f"chunk_T_{T}"] = reseal(v, head, ext, c)
    # K and L at their bounds with a chunk whose zstd payload claims them all
    big = forge_header(blob, K=codec.MAX_TOP_K, L=codec.MAX_LAYERS)
    v2, head2, ext2, c2 = split(big)
    c2 = c2[:1]
    c2[0].fields[7] = 1 << 12
    c2[0].lens = (1 << 12,)
    out["chunk_max_K_L"] = reseal(v2, head2, ext2, c2)
    return out


def test_many_empty_sequences_parse_in_time_linear_in_the_blob():
    """A (valid) chunk with 200000 empty sequences: the parser's cost is the blob's size."""
    _, x, tok, blob = CASES[0]
    v, head, ext, chunks = split(blob)
    c = chunks[:1]
    c[0].lens = c[0].lens + (0,) * 200_000
    b = reseal(v, head, ext, c)
    t0 = time.process_time()
    np.testing.assert_array_equal(codec.decode(b).numpy(), _expected(x[:c[0].num_tokens], "set"))
    assert codec.decode_sequence(b, 200_000).shape[0] == 0
    assert time.process_time() - t0 < 2.0


def test_crafted_headers_are_refused_fast():
    for name, blob in _crafted().items():
        t0 = time.process_time()
        with pytest.raises(CodecError):
            codec.decode(blob)
        with pytest.raises(CodecError):
            codec.decode_sequence(blob, 0)
        dt = time.process_time() - t0
        assert dt < 1.0, (name, dt)


def _bomb(T, L=8, K=8, E=128, extra=b""):
    """A one-chunk keep blob whose zstd frame really expands to what its header claims
    (T*L*K zero ids, every checksum a sender can recompute right, the content crc not)."""
    import zstandard

    x = np.zeros((1, L, K), np.int64)
    x[0, :, :] = np.arange(K)
    blob = codec.encode(x, num_experts=E, order="set")
    v, head, ext, ch = split(blob)
    want = T * L * K * codec.id_width(E)
    ch[0].payload = zstandard.ZstdCompressor(level=19).compress(bytes(want)) + extra
    ch[0].fields[4], ch[0].fields[5] = 1, 0     # zstd, token-major
    ch[0].fields[7] = T
    ch[0].lens = (T,)
    return reseal(v, head, ext, ch)


def test_decompression_bombs():
    # a frame that expands as far as its header claims: decoded, refused by the content crc
    with pytest.raises(CodecError, match="content checksum mismatch"):
        codec.decode(_bomb(1 << 10))
    # bytes after the frame
    with pytest.raises(CodecError, match="bytes after the frame"):
        codec.decode(_bomb(1 << 10, extra=b"\0" * 3))
    # the frame declares more than the chunk: refused before decompressing
    b = _bomb(1 << 10)
    v, head, ext, ch = split(b)
    ch[0].fields[7], ch[0].lens = 1 << 9, (1 << 9,)
    with pytest.raises(CodecError, match="the zstd frame declares 65536 bytes, the chunk "
                                         "header implies 32768"):
        codec.decode(reseal(v, head, ext, ch))
    # the caller's own bound
    with pytest.raises(CodecError, match="decoded bytes=131072 .* above max_bytes=100000"):
        codec.decode(_bomb(1 << 10), max_bytes=100_000)


_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    import torch
    from replay_ops.router_replay import codec
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    codec.decode(codec.encode(np.zeros((4, 2, 2), np.int16), num_experts=2))  # warm up
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    rows = []
    for path, limit in json.loads(sys.argv[1]):
        blob = open(path, "rb").read()
        with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM)
            f.write("5")
        base_vm, base_rss = status("VmSize:"), status("VmHWM:")
        resource.setrlimit(resource.RLIMIT_AS, (base_vm + limit, hard))
        t0 = time.process_time()
        try:
            codec.decode(blob)
            outcome = "ok"
        except codec.CodecError as e:
            outcome = "CodecError: " + str(e)[:200]
        except BaseException as e:
            outcome = type(e).__name__ + ": " + str(e)[:200]
        cpu = time.process_time() - t0
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        rows.append(dict(outcome=outcome, cpu=cpu, peak=status("VmHWM:") - base_rss))
    print(json.dumps(rows))
""")


def _child(jobs: list, tmp_path) -> list:
    """Decode each (blob, limit) in one child process, each under RLIMIT_AS = its address
    space before + limit; returns the outcome, CPU seconds and peak resident growth."""
    args = []
    for i, (blob, limit) in enumerate(jobs):
        p = tmp_path / f"blob{i}.bin"
        p.write_bytes(blob)
        args.append((str(p), int(limit)))
    env = dict(os.environ, MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _allowed(blob: bytes) -> int:
    """What the validated header allows: the output's bytes (int16 or int32), 0 when the
    headers do not validate."""
    try:
        inf = codec.info(blob)
    except CodecError:
        return 0
    return inf.num_tokens * inf.num_layers * inf.top_k * codec.format._default_dtype(
        inf.num_experts).itemsize


def test_memory_and_time_of_decoding_crafted_input(tmp_path):
    """Decoding crafted input under an address-space cap of MEM_FACTOR x the output its
    header allows + MEM_CONST: CodecError (never MemoryError or torch's RuntimeError), the
    peak resident memory within the same bound, the CPU time linear in the input."""
    inputs = dict(_crafted())
    for T in (1 << 12, 1 << 15, 1 << 17):   # bombs of 0.5, 4 and 16 MiB of int16 output
        inputs[f"bomb_{T}"] = _bomb(T)
    names = list(inputs)
    limits = [MEM_FACTOR * _allowed(inputs[n]) + MEM_CONST for n in names]
    # and a bomb whose header allows more than its cap: CodecError too, not MemoryError
    names.append("bomb_over_cap")
    inputs["bomb_over_cap"] = _bomb(1 << 19)
    limits.append(8 << 20)
    rows = _child([(inputs[n], lim) for n, lim in zip(names, limits)], tmp_path)
    for name, limit, r in zip(names, limits, rows):
        blob = inputs[name]
        assert r["outcome"].startswith("CodecError"), (name, r)
        assert r["peak"] <= limit, (name, r, limit)
        # time linear in the size: 2 microseconds per input or output byte, + 0.5 s
        assert r["cpu"] <= 0.5 + 2e-6 * (len(blob) + _allowed(blob)), (name, r)


# ---------------------------------------------------------------------------- append histories
def _append_history(rng):
    """A random history of `encode` then `append`s (small shapes, both orders, token ids or
    not), with empty steps: an encode or append of no sequence (`seq_lens=[]`, also as a
    continued turn), sequences of 0 tokens, continued turns of 0 tokens. Yields (blob,
    expected rows per sequence, token ids) after each step."""
    E = int(rng.choice([8, 300]))
    L, K = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    order = str(rng.choice(codec.ORDERS))
    with_tok = bool(rng.integers(2))

    def rows(n):
        return rng.integers(-1, E, size=(n, L, K))

    def lens():
        kind = int(rng.integers(4))
        if kind == 0:
            return []  # no sequence at all
        return [int(v) for v in rng.integers(0, 5, size=int(rng.integers(1, 4)))]

    seqs, toks, blob = [], np.zeros(0, np.int64), None
    for step in range(int(rng.integers(3, 7))):
        ls = lens()
        cont = step > 0 and bool(seqs) and bool(rng.integers(2))  # of nothing, too
        x = rows(sum(ls))
        t = rng.integers(0, 6, size=x.shape[0])
        kw = dict(seq_lens=ls, token_ids=t if with_tok else None,
                  chunk_tokens=int(rng.integers(1, 7)))
        if blob is None:
            blob = codec.encode(x, num_experts=E, order=order, **kw)
        else:
            blob = codec.append(blob, x, continue_last=cont, **kw)
        toks = np.concatenate([toks, t])
        parts = np.split(_expected(x, order), np.cumsum(ls)[:-1]) if ls else []
        if cont and parts:
            seqs[-1] = np.concatenate([seqs[-1], parts[0]])
            parts = parts[1:]
        seqs.extend(parts)
        yield blob, list(seqs), (toks if with_tok else None)


def _check_sequences(blob, seqs, tok, backend="numpy"):
    """decode, and decode_sequence of every sequence into a tensor full of stale values,
    give exactly the rows of the history; nothing is left unwritten."""
    L, K = codec.info(blob).num_layers, codec.info(blob).top_k
    whole = np.concatenate(seqs) if seqs else np.zeros((0, L, K), np.int64)
    np.testing.assert_array_equal(codec.decode(blob, token_ids=tok, backend=backend).numpy(),
                                  whole)
    assert codec.info(blob).num_sequences == len(seqs)
    for i, want in enumerate(seqs):
        out = torch.full(want.shape, 77, dtype=torch.int16)
        got = codec.decode_sequence(blob, i, token_ids=tok, out=out, backend=backend)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"sequence {i}")


def test_appends_with_empty_steps_decode_every_sequence():
    """Random append histories with empty steps: every sequence decodes alone to exactly
    its rows (an append of no sequence once wrote a chunk whose first_seq broke the order
    decode_sequence searches, so a later continued turn decoded from rows never written),
    and no chunk without a sequence is written."""
    for seed in range(60):
        rng = np.random.default_rng(4400 + seed)
        for blob, seqs, tok in _append_history(rng):
            assert all(c.seq_lens for c in codec.info(blob).chunks), seed
            _check_sequences(blob, seqs, tok)


def test_empty_chunks_of_older_writers_do_not_move_a_sequence():
    """Blobs written before that fix may hold chunks of no sequence anywhere (an append of
    nothing, then a continued turn): they stay readable, and every sequence still decodes
    to its own rows, on every path."""
    n_checked = 0
    for seed in range(40):
        rng = np.random.default_rng(4500 + seed)
        for blob, seqs, tok in _append_history(rng):
            v, head, ext, chunks = split(blob)
            inf = codec.info(blob)
            th = codec.format._token_hash(np.zeros(0, np.int64)) if inf.has_token_ids else 0
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(0, len(chunks) + 1))
                chunks.insert(at, empty_chunk(codec.id_width(inf.num_experts), th))
            legacy = reseal(v, head, ext, chunks)
            assert sum(not c.seq_lens for c in codec.info(legacy).chunks) >= 1
            _check_sequences(legacy, seqs, tok)
            n_checked += 1
    assert n_checked > 100
    # and the Triton path, on the first few
    rng = np.random.default_rng(4600)
    for blob, seqs, tok in _append_history(rng):
        v, head, ext, chunks = split(blob)
        inf = codec.info(blob)
        th = codec.format._token_hash(np.zeros(0, np.int64)) if inf.has_token_ids else 0
        chunks.insert(len(chunks) // 2, empty_chunk(codec.id_width(inf.num_experts), th))
        _check_sequences(reseal(v, head, ext, chunks), seqs, tok, backend="triton")


# ---------------------------------------------------------------------------- forged "set" rows
def _decode_all_paths(blob):
    """{backend: the decoded routing, or "error"} for the numpy and Triton paths."""
    out = {}
    for backend in ("numpy", "triton"):
        try:
            out[backend] = codec.decode(blob, backend=backend).numpy()
        except CodecError:
            out[backend] = "error"
    return out


def _forged_rows(rng, order, E, L, K, T):
    """A one-chunk blob of `order` whose stored rows a forger chose (some sorted, some not,
    an empty slot anywhere), with every checksum a sender can compute recomputed: the
    content checksum of the rows as stored, of the rows sorted again, or ("keep") of the
    canonical form of the routing they decode to.
    Returns (blob, whether every stored row is canonical)."""
    from replay_ops.router_replay.codec import format as fm

    x = np.stack([rng.permutation(E)[:K] for _ in range(T * L)]).reshape(T, L, K)
    x[rng.random(x.shape) < 0.1] = -1
    blob = codec.encode(x, num_experts=E, order=order, level=3)
    v, head, ext, ch = split(blob)
    canon = codec.chunk._canonical(x, E).reshape(T * L, K)
    srt, code = codec.sort_rows(canon, order, E, v)
    ids = srt.copy()
    for r in rng.choice(T * L, min(T * L, int(rng.integers(0, 3))), replace=False):
        ids[r] = rng.permutation(ids[r])
    ids = ids.reshape(T, L, K)
    crc, how = None, int(rng.integers(3))
    if how == 1:  # the checksum of the rows sorted again
        crc = fm.Canonical(np.sort(ids, axis=-1), code).crc()
    elif how == 2 and order == "keep":  # that of the routing the rows and codes decode to
        back = codec.transform._unsort_np(ids.reshape(T * L, K), code, K, fm.as_format(v))
        crc = fm.Canonical(*codec.sort_rows(back, "keep", E, v)).crc()
    zstd = order == "keep" or bool(rng.integers(2))
    forged = with_rows(ch[0], ids, code, zstd=zstd, content_crc=crc)
    canonical = bool(np.all(np.diff(ids.astype(np.int64), axis=-1) >= 0))
    return reseal(v, head, ext, [forged]), canonical


@pytest.mark.parametrize("order", codec.ORDERS)
def test_forged_rows_decode_alike_on_every_path(order):
    """Stored rows out of canonical order (unsorted, an empty slot in the middle) with
    recomputed checksums: every decode path gives the same routing or the same refusal. A
    "set" row is refused unless it is canonical (its ids ascending, empty slots last): the
    numpy path once returned such rows as they were while the Triton path refused them."""
    rng = np.random.default_rng(4700 + len(order))
    seen = {"ok": 0, "error": 0}
    for i in range(16):
        E, L, K, T = int(rng.choice([8, 40, 300])), int(rng.integers(1, 3)), \
            int(rng.integers(2, 6)), int(rng.integers(1, 5))
        blob, canonical = _forged_rows(rng, order, E, L, K, T)
        got = _decode_all_paths(blob)
        a, b = got["numpy"], got["triton"]
        if isinstance(a, str) or isinstance(b, str):
            assert isinstance(a, str) and isinstance(b, str), (i, got)
            seen["error"] += 1
        else:
            np.testing.assert_array_equal(a, b)
            seen["ok"] += 1
            if order == "set":
                assert canonical, (i, a)
                np.testing.assert_array_equal(a, _expected(a.astype(np.int64), "set"))
        if order == "set" and not canonical:
            assert a == "error", (i, a)
    assert seen["ok"] and seen["error"], seen


def test_empty_chunks_are_checked_on_every_path():
    """A chunk of no token whose content checksum is not that of nothing is refused on every
    decode path (the Triton path once skipped such a chunk unchecked, and so returned what
    the numpy path refused)."""
    for order in codec.ORDERS:
        blob = codec.encode(np.zeros((0, 2, 3), np.int64), num_experts=8, order=order,
                            seq_lens=[0])
        got = _decode_all_paths(blob)
        assert [g.shape for g in got.values()] == [(0, 2, 3)] * 2, got
        v, head, ext, ch = split(blob)
        ch[0].fields[10] = 7  # the content checksum
        got = _decode_all_paths(reseal(v, head, ext, ch))
        assert [type(g).__name__ if not isinstance(g, str) else g for g in got.values()] \
            == ["error", "error"], (order, got)


# ---------------------------------------------------------------------------- many tiny chunks
def _tiny_chunks(kind: str, nbytes: int = 250_000) -> bytes:
    """Blobs of many tiny chunks, about `nbytes` long: chunks of no token (each a header and
    one sequence length, K = 20, the largest Lehmer code: every row transform costs the
    most numpy calls there), as format 3 and format 1, with a right or a forged content
    checksum; and valid blobs of one-token chunks."""
    if kind.startswith("one_token"):
        order = "set" if "set" in kind else "keep"
        L, K = (1, 20) if order == "keep" else (2, 8)
        per = codec.CHUNK_HEADER_SIZE + 4 + L * K
        n = nbytes // per
        x = np.random.default_rng(48).integers(-1, 32, size=(n, L, K))
        x = _expected(x, "set") if order == "set" else np.stack(
            [np.random.default_rng(t).permutation(32)[:K] for t in range(n * L)]).reshape(n, L, K)
        return codec.encode(x, num_experts=32, order=order, seq_lens=[1] * n, chunk_tokens=1)
    base = codec.encode(np.zeros((0, 1, 20), np.int64), num_experts=32, order="keep")
    v, head, ext, ch = split(base)
    one = ch[0]
    if "badcrc" in kind:
        one.fields[10] = 12345
    n = nbytes // (codec.CHUNK_HEADER_SIZE + 4)
    if kind.endswith("v1"):
        head = list(head)
        head[1] = 1
        return reseal(1, head, None, [one] * n)
    return reseal(v, head, ext, [one] * n)


TINY = ["empty_K20", "empty_K20_v1", "empty_K20_badcrc", "one_token_keep_K20",
        "one_token_set"]


def test_many_tiny_chunks_cost_time_in_proportion_to_their_bytes(tmp_path):
    """A blob of many tiny chunks (each a 56-byte header and length, or a token) decodes, or
    is refused, in CPU time linear in its bytes (the bound of the crafted inputs above:
    2 microseconds per input or output byte, + 0.5 s) and memory within MEM_CONST: each
    chunk once cost a fixed 0.5-1 ms (one numpy call per comparator and Lehmer digit), so
    250 KB of empty chunks took several seconds."""
    inputs = {k: _tiny_chunks(k) for k in TINY}
    rows = _child([(b, MEM_FACTOR * _allowed(b) + MEM_CONST) for b in inputs.values()],
                  tmp_path)
    for (name, blob), r in zip(inputs.items(), rows):
        assert len(codec.info(blob).chunks) > 3000
        want = "CodecError" if "badcrc" in name else "ok"
        assert r["outcome"].startswith(want), (name, r)
        assert r["peak"] <= MEM_FACTOR * _allowed(blob) + MEM_CONST, (name, r)
        assert r["cpu"] <= 0.5 + 2e-6 * (len(blob) + _allowed(blob)), (name, r)


def test_chunk_and_sequence_counts_are_bounded_by_the_bytes():
    """A format-3 header counting more chunks (or sequences) than its bytes can hold is
    refused before any chunk is read; a blob of the most chunks its bytes allow parses,
    and decode_sequence of its last sequence costs time linear in the blob."""
    blob = _tiny_chunks("empty_K20", 100_000)
    n = codec.info(blob).num_sequences
    room = len(blob) - codec.BLOB_HEADER_SIZE
    for field, v in (("num_chunks", room // codec.CHUNK_HEADER_SIZE + 1),
                     ("num_seqs", room // 4 + 1), ("num_chunks", 2**32 - 1)):
        with pytest.raises(CodecError, match=r"offset 44: truncated or corrupt: the blob "
                                             r"header counts"):
            codec.info(forge_header(blob, **{field: v}))
    t0 = time.process_time()
    assert codec.decode_sequence(blob, n - 1).shape == (0, 1, 20)
    assert time.process_time() - t0 < 0.5 + 2e-6 * len(blob)
