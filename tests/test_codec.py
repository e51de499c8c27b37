"""The routing codec (replay_ops.router_replay.codec): exact round trips in both modes,
checks of every blob byte, token ids as side information, chunks, appends."""
from __future__ import annotations

import itertools
import math
import struct
import zlib

import numpy as np
import pytest
import torch

from replay_ops.router_replay import codec
from replay_ops.router_replay.codec import CodecError

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NP_DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64]
EXPERTS = [1, 2, 7, 128, 255, 256, 300, 32767, 32768, 70000]


def ref_set(x: np.ndarray) -> np.ndarray:
    """Each row sorted ascending, -1 last (written without the codec's sorting network)."""
    out = np.empty(x.shape, np.int64)
    flat, o = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        o[r] = sorted((int(v) for v in flat[r]), key=lambda v: (v < 0, v))
    return out


def expected(x, order):
    x = np.asarray(x).astype(np.int64)
    return ref_set(x) if order == "set" else x


@st.composite
def routing_case(draw):
    E = draw(st.sampled_from(EXPERTS))
    K = draw(st.integers(1, min(E, 10)))
    L = draw(st.integers(1, 3))
    T = draw(st.integers(0, 24))
    fits = [d for d in NP_DTYPES
            if np.iinfo(d).max >= E - 1]
    dt = draw(st.sampled_from(fits))
    signed = np.iinfo(dt).min < 0
    style = draw(st.sampled_from(["distinct", "dups", "empty", "mixed"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if style == "distinct":
        x = np.stack([rng.permutation(E)[:K] for _ in range(T * L)]) if T else np.zeros((0, K))
    else:
        x = rng.integers(0, E, size=(T * L, K))
        if style == "dups":
            x[:, -1] = x[:, 0]
    x = np.asarray(x, np.int64).reshape(T, L, K)
    if signed and style in ("empty", "mixed"):
        x = np.where(rng.random(x.shape) < (0.9 if style == "empty" else 0.2), -1, x)
        if T and style == "empty":
            x[0] = -1  # an all -1 token
    edge = draw(st.booleans())
    if edge and T:
        x.reshape(-1)[0] = E - 1
    order = draw(st.sampled_from(codec.ORDERS))
    with_tok = draw(st.booleans())
    # token ids: few distinct, 16-bit (radix-sorted), wide, and negative (other sort paths)
    lo, hi = draw(st.sampled_from([(0, 3), (0, 50000), (0, 1 << 20), (-7, 7)]))
    tok = rng.integers(lo, hi, size=T) if with_tok else None
    cuts = sorted(draw(st.lists(st.integers(0, T), max_size=4)))
    lens = np.diff([0] + cuts + [T]).tolist()
    chunk = draw(st.sampled_from([1, 5, 16384]))
    level = draw(st.sampled_from([-1, 1, 3, 9]))
    as_torch = draw(st.booleans())
    arr = x.astype(dt)
    return dict(E=E, x=x, arr=torch.from_numpy(arr) if as_torch and dt != np.uint16 else arr,
                order=order, tok=tok, lens=lens, chunk=chunk, level=level)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_case())
def test_round_trip_property(case):
    blob = codec.encode(case["arr"], num_experts=case["E"], order=case["order"],
                        token_ids=case["tok"], seq_lens=case["lens"], level=case["level"],
                        chunk_tokens=case["chunk"])
    out = codec.decode(blob, token_ids=case["tok"])
    want_dt = torch.int16 if case["E"] <= 32767 else torch.int32
    assert out.dtype == want_dt
    ref = expected(case["x"], case["order"])
    assert out.shape == ref.shape
    np.testing.assert_array_equal(out.numpy().astype(np.int64), ref)
    # every sequence alone, with the whole blob's token ids
    cu = np.concatenate([[0], np.cumsum(case["lens"])]).astype(int)
    inf = codec.info(blob, verify_payload=True)
    assert list(inf.seq_lens) == case["lens"]
    for i in range(len(case["lens"])):
        seq = codec.decode_sequence(blob, i, token_ids=case["tok"])
        np.testing.assert_array_equal(seq.numpy().astype(np.int64), ref[cu[i]:cu[i + 1]])


@pytest.mark.parametrize("order", codec.ORDERS)
@pytest.mark.parametrize("E", [128, 256, 40000, 2**31 - 1])
def test_large_ids_and_output_options(order, E):
    rng = np.random.default_rng(1)
    x = rng.integers(0, E, size=(33, 3, 4)).astype(np.int64)
    x[3, 1, 2] = -1
    x[4] = -1
    x[5, 0, 0] = E - 1
    blob = codec.encode(x, num_experts=E, order=order)
    ref = expected(x, order)
    out = codec.decode(blob, dtype=torch.int64)
    np.testing.assert_array_equal(out.numpy(), ref)
    # out=: a non-contiguous destination, filled in place
    big = torch.full((33, 3, 8), 7, dtype=torch.int64)
    dst = big[:, :, ::2]
    assert codec.decode(blob, out=dst) is dst
    np.testing.assert_array_equal(dst.numpy(), ref)
    assert torch.all(big[:, :, 1::2] == 7)
    if E > 32767:
        with pytest.raises(CodecError, match="cannot hold ids"):
            codec.decode(blob, dtype=torch.int16)
    with pytest.raises(CodecError, match="cannot hold ids"):
        codec.decode(blob, dtype=torch.uint8)
    with pytest.raises(CodecError, match="shape"):
        codec.decode(blob, out=torch.empty(2, 3, 4, dtype=torch.int64))


def test_wide_k_uses_slot_permutation():
    K = 23  # > 20: slots stored instead of a Lehmer code
    rng = np.random.default_rng(2)
    x = np.stack([rng.permutation(64)[:K] for _ in range(40)]).reshape(20, 2, K)
    blob = codec.encode(x, num_experts=64, order="keep")
    np.testing.assert_array_equal(codec.decode(blob).numpy(), x)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("version", codec.READ_VERSIONS)
def test_lehmer_code_is_the_lexicographic_rank(K, version):
    """The permutation code of a row is the rank among all K! permutations in lexicographic
    order (itertools' order) of its sorting permutation p (format 1: p[j] = the slot of the
    j-th smallest id) or of its inverse q (format 2: q[s] = the rank of slot s's id): codes
    are 0..K!-1, one each."""
    perms = list(itertools.permutations(range(K)))
    rows = np.zeros((len(perms), K), np.uint8)
    for r, q in enumerate(perms):
        for j, v in enumerate(q):
            if version == 1:
                rows[r, v] = 10 + j  # the j-th smallest id sits in slot q[j]
            else:
                rows[r, j] = 10 + v  # slot j holds the id of rank q[j]
    srt, code = codec.sort_rows(rows, "keep", 128, version)
    assert np.all(srt == np.arange(10, 10 + K))
    w = codec.lehmer_width(K)
    got = (np.ascontiguousarray(code).view(f"<u{w}").reshape(-1) if w else
           np.zeros(len(perms), int))
    np.testing.assert_array_equal(got, np.arange(math.factorial(K)))


def test_sort_rows_matches_numpy_sort():
    rng = np.random.default_rng(3)
    for K in range(1, 18):
        x = rng.integers(0, 300, size=(200, K)).astype(np.uint16)
        srt, _ = codec.sort_rows(x.copy(), "set", 300)
        np.testing.assert_array_equal(srt, np.sort(x, axis=1))
        srt2, _ = codec.sort_rows(x.copy(), "keep", 300)
        np.testing.assert_array_equal(srt2, np.sort(x, axis=1))


@pytest.mark.parametrize("version", codec.READ_VERSIONS)
def test_few_rows_transform_to_the_same_bytes_as_many(version):
    """A chunk of at most `transform._SMALL_ROWS` rows is transformed (and inverted) by a
    fixed number of vectorised calls instead of one per comparator or digit: the same sorted
    ids, permutation codes and decoded rows as the per-column path of a large chunk, for
    every K (ties, empty slots, K above the Lehmer limit), and the same refusal of a code
    not below K!."""
    from replay_ops.router_replay.codec import transform

    rng = np.random.default_rng(44)
    small = transform._SMALL_ROWS
    fmt = codec.format.as_format(version)
    for K in list(range(0, 23)) + [40, 257]:
        E = 300 if K > 200 else 6 if K < 6 else K + 3  # small E: many ties
        nd = np.uint16 if E > 255 else np.uint8
        for n in (0, 1, 7, small):
            x = rng.integers(0, E + 1, size=(n, K)).astype(nd)  # E: the empty sentinel
            big = np.concatenate([x, np.tile(x[:1] if n else np.zeros((1, K), nd),
                                             (small + 1, 1))])
            for order in codec.ORDERS:
                srt, code = codec.sort_rows(x.copy(), order, E, version)
                srt_b, code_b = codec.sort_rows(big.copy(), order, E, version)
                np.testing.assert_array_equal(srt, srt_b[:n])
                assert srt.dtype == srt_b.dtype
                if order == "set":
                    assert code is None and code_b is None
                    continue
                np.testing.assert_array_equal(code, code_b[:n])
                assert code.dtype == code_b.dtype and code.shape[1] == code_b.shape[1]
                back = transform._unsort_np(srt, code, K, fmt)
                back_b = transform._unsort_np(srt_b, code_b, K, fmt)
                np.testing.assert_array_equal(back, x)
                np.testing.assert_array_equal(back_b[:n], x)
    for K in (2, 5, 20):  # a code not below K! is refused on both paths
        bad = np.array([math.factorial(K)], np.uint64)
        for n in (1, transform._SMALL_ROWS + 1):
            with pytest.raises(CodecError, match=f"not below {K}!"):
                codec.lehmer_digits(np.repeat(bad, n), K)
        ok = np.arange(min(math.factorial(K), 50), dtype=np.uint64)
        np.testing.assert_array_equal(
            codec.lehmer_digits(ok, K),
            codec.lehmer_digits(np.concatenate([ok, np.zeros(small, np.uint64)]), K)[:len(ok)])


def test_set_rows_out_of_canonical_order_are_found_for_every_k():
    """The check of a "set" chunk's canonical order (one flat comparison, the bytes across
    rows masked out as words) finds exactly the rows an independent row-by-row comparison
    finds, for every K (periods of one word or several), both id widths, any row count."""
    rng = np.random.default_rng(46)
    ch = codec.ChunkInfo(60, 0, (1,), False, 1, 0, 1, 1, 112, 0, 0, 0, 0, 0)
    for K in list(range(1, 26)) + [40, 256]:
        for trial in range(12):
            n = int(rng.integers(1, 300))
            dt = np.uint8 if trial % 2 else np.uint16
            ids = np.sort(rng.integers(0, 6 if trial % 3 else 300, size=(n, 1, K)),
                          axis=-1).astype(dt)
            if trial % 4 and K > 1:
                r = int(rng.integers(n))
                ids[r, 0] = rng.permutation(ids[r, 0])
            bad = [t for t in range(n) if np.any(np.diff(ids[t, 0].astype(int)) < 0)]
            if bad:
                with pytest.raises(CodecError, match=f"holds row {bad[0]} .* out of canonical"):
                    codec.format._check_set_rows(ch, ids)
            else:
                codec.format._check_set_rows(ch, ids)


def test_a_decode_that_does_not_cover_its_output_is_refused(monkeypatch):
    """The coverage check behind every decode that fills an output: chunks that do not add
    up to the rows asked for (a bug in finding a sequence's chunks, headers that disagree)
    raise instead of returning rows never written (stale `out=` rows, uninitialised
    memory)."""
    import dataclasses

    x = np.random.default_rng(45).integers(-1, 16, size=(12, 2, 3))
    blob = codec.encode(x, num_experts=16, seq_lens=[3, 5, 4], chunk_tokens=4)
    assert len(codec.info(blob).chunks) == 3
    real_chunks, real_info = codec._sequence_chunks, codec.info
    monkeypatch.setattr(codec, "_sequence_chunks", lambda inf, i: real_chunks(inf, i)[:-1])
    out = torch.full((5, 2, 3), 77, dtype=torch.int16)
    with pytest.raises(CodecError, match=r"decode_sequence\(1\): the blob's chunks hold 0 of "
                                         r"the 5 tokens"):
        codec.decode_sequence(blob, 1, out=out)
    monkeypatch.setattr(codec, "_sequence_chunks", real_chunks)
    monkeypatch.setattr(codec, "info", lambda *a, **k: dataclasses.replace(
        real_info(*a, **k), chunks=real_info(*a, **k).chunks[:-1]))
    with pytest.raises(CodecError, match=r"decode: the blob's chunks hold 8 of the 12 tokens"):
        codec.decode(blob, out=torch.full((12, 2, 3), 77, dtype=torch.int16))


def test_input_is_not_modified():
    x = np.random.default_rng(4).integers(0, 128, size=(50, 2, 8)).astype(np.uint8)
    keep = x.copy()
    for order in codec.ORDERS:
        codec.encode(x, num_experts=128, order=order)
        np.testing.assert_array_equal(x, keep)


def test_empty_and_degenerate():
    for shape in [(0, 2, 8), (5, 0, 8), (0, 0, 1)]:
        x = np.zeros(shape, np.int16)
        for order in codec.ORDERS:
            out = codec.decode(codec.encode(x, num_experts=8, order=order))
            assert tuple(out.shape) == shape
    x = np.full((4, 2, 3), -1, np.int32)
    for order in codec.ORDERS:
        np.testing.assert_array_equal(codec.decode(codec.encode(x, num_experts=8,
                                                                order=order)).numpy(), x)


@pytest.mark.parametrize("bad,msg", [
    (np.array([[[0, 8]]]), r"routing\[0, 0, 1\] = 8 is out of range for num_experts=8"),
    (np.array([[[0, 1]], [[-2, 1]]]), r"routing\[1, 0, 0\] = -2"),
    (np.array([[[255, 1]]], np.uint8), r"= 255 is out of range"),
])
def test_bad_values_are_refused(bad, msg):
    with pytest.raises(CodecError, match=msg):
        codec.encode(bad, num_experts=8)


def test_bad_arguments():
    x = np.zeros((3, 1, 2), np.int16)
    with pytest.raises(CodecError, match="order must be"):
        codec.encode(x, num_experts=8, order="sorted")
    with pytest.raises(CodecError, match="integers"):
        codec.encode(x.astype(np.float32), num_experts=8)
    with pytest.raises(CodecError, match=r"\[T, L, K\]"):
        codec.encode(x[0], num_experts=8)
    with pytest.raises(CodecError, match="seq_lens"):
        codec.encode(x, num_experts=8, seq_lens=[1, 1])
    with pytest.raises(CodecError, match="token_ids has 2 entries"):
        codec.encode(x, num_experts=8, token_ids=[1, 2])
    with pytest.raises(CodecError, match="num_experts"):
        codec.encode(x, num_experts=0)
    with pytest.raises(CodecError, match="level"):
        codec.encode(x, num_experts=8, level=99)


def _small_blob(order="keep", tok=True):
    rng = np.random.default_rng(5)
    x = np.stack([rng.permutation(16)[:4] for _ in range(30 * 2)]).reshape(30, 2, 4)
    t = rng.integers(0, 6, size=30) if tok else None
    return x, t, codec.encode(x, num_experts=16, order=order, token_ids=t, seq_lens=[10, 20],
                              chunk_tokens=10)


@pytest.mark.parametrize("order", codec.ORDERS)
def test_every_flipped_byte_is_refused(order):
    x, t, blob = _small_blob(order)
    for i in range(len(blob)):
        b = bytearray(blob)
        b[i] ^= 0x5A
        with pytest.raises(CodecError, match=r"offset \d+"):
            codec.decode(bytes(b), token_ids=t)


def test_every_truncation_is_refused():
    """Format 3: every cut raises, a cut exactly between chunks too (the blob header counts
    the chunks)."""
    x, t, blob = _small_blob()
    inf = codec.info(blob)
    assert inf.version == 3 and len(inf.chunks) == 2
    for n in range(len(blob)):
        with pytest.raises(CodecError, match=r"offset \d+: (truncated|not a routing)"):
            codec.decode(blob[:n], token_ids=t)


def test_older_formats_cut_between_chunks_decode_shorter():
    """Formats 1 and 2 count nothing in their header: a cut exactly between chunks is a
    valid shorter blob (fewer tokens; documented), every other cut raises."""
    f = np.load(FIXTURE_V1)
    blob, tok = f["keep_tok"].tobytes(), f["token_ids"]
    inf = codec.info(blob)
    ends = {c.payload_offset + c.payload_len for c in inf.chunks}
    for n in range(0, len(blob), 7):
        if n in ends or n == codec.BLOB_HEADER_SIZE_V2:
            continue
        with pytest.raises(CodecError, match=r"offset \d+: (truncated|not a routing)"):
            codec.decode(blob[:n], token_ids=tok)
    shorter = [n for n in sorted(ends | {codec.BLOB_HEADER_SIZE_V2}) if n < len(blob)]
    assert len(shorter) == 2
    for n in shorter:
        out = codec.decode(blob[:n], token_ids=tok[:codec.info(blob[:n]).num_tokens])
        assert out.shape[0] < inf.num_tokens


def test_foreign_and_newer_blobs():
    with pytest.raises(CodecError, match="offset 0: not a routing codec blob"):
        codec.decode(b"PK\x03\x04 not ours")
    with pytest.raises(CodecError, match="offset 0: not a routing codec blob"):
        codec.decode(b"")
    x, t, blob = _small_blob()
    b = bytearray(blob)
    b[8:10] = struct.pack("<H", 99)
    b[codec.BLOB_HEADER_SIZE - 4:codec.BLOB_HEADER_SIZE] = struct.pack(
        "<I", zlib.crc32(bytes(b[:codec.BLOB_HEADER_SIZE - 4])))
    with pytest.raises(CodecError, match="offset 8: format version 99 is not supported"):
        codec.decode(bytes(b), token_ids=t)
    with pytest.raises(CodecError, match="offset .*: not a chunk header"):
        codec.decode(blob + b"garbage-garbage-garbage-garbage-garbage-garbage-garbage-garbage",
                     token_ids=t)


def test_content_checksum_catches_a_wrong_decode(monkeypatch):
    """A decoder bug (here: a wrong permutation) is caught by the checksum of the decoded
    routing, not returned."""
    x, t, blob = _small_blob("keep")
    real = codec.transform._perm_decode

    def broken(code, k):
        p = real(code, k)
        p[0], p[1] = p[1], p[0]
        return p

    monkeypatch.setattr(codec.transform, "_perm_decode", broken)
    with pytest.raises(CodecError, match="decoded content checksum mismatch"):
        codec.decode(blob, token_ids=t)


def test_token_ids_are_required_and_checked():
    x, t, blob = _small_blob("set")
    with pytest.raises(CodecError, match="encoded with token_ids"):
        codec.decode(blob)
    t2 = t.copy()
    t2[3] += 1
    with pytest.raises(CodecError, match="token_ids differ"):
        codec.decode(blob, token_ids=t2)
    with pytest.raises(CodecError, match="token_ids has 29 entries"):
        codec.decode(blob, token_ids=t[:29])
    # one sequence: the whole blob's ids, or its own when its chunks hold it alone
    np.testing.assert_array_equal(codec.decode_sequence(blob, 0, token_ids=t[:10]).numpy(),
                                  ref_set(x[:10]))
    np.testing.assert_array_equal(codec.decode_sequence(blob, 1, token_ids=t).numpy(),
                                  ref_set(x[10:]))
    with pytest.raises(IndexError):
        codec.decode_sequence(blob, 2, token_ids=t)


def test_shared_chunk_needs_all_token_ids():
    rng = np.random.default_rng(6)
    x = rng.integers(0, 16, size=(12, 1, 2))
    t = rng.integers(0, 5, size=12)
    blob = codec.encode(x, num_experts=16, token_ids=t, seq_lens=[4, 8])  # one chunk
    with pytest.raises(CodecError, match="shares the chunk"):
        codec.decode_sequence(blob, 0, token_ids=t[:4])
    np.testing.assert_array_equal(codec.decode_sequence(blob, 0, token_ids=t).numpy(), x[:4])


@pytest.mark.parametrize("order", codec.ORDERS)
@pytest.mark.parametrize("with_tok", [False, True])
def test_append_turns(order, with_tok):
    rng = np.random.default_rng(7)
    E, L, K = 300, 2, 3
    turns = [rng.integers(-1, E, size=(n, L, K)) for n in (5, 3, 4)]
    toks = [rng.integers(0, 9, size=t.shape[0]) for t in turns]
    other = rng.integers(0, E, size=(6, L, K))
    other_t = rng.integers(0, 9, size=6)
    tk = (lambda v: v) if with_tok else (lambda v: None)
    blob = codec.encode(turns[0], num_experts=E, order=order, token_ids=tk(toks[0]))
    blob = codec.append(blob, turns[1], token_ids=tk(toks[1]), continue_last=True)
    blob = codec.append(blob, other, token_ids=tk(other_t))  # a new sequence
    with pytest.raises(CodecError, match="L=2, K=3"):
        codec.append(blob, np.zeros((2, 1, 3), int), token_ids=tk(np.zeros(2, int)))
    all_x = np.concatenate(turns[:2] + [other])
    all_t = np.concatenate(toks[:2] + [other_t])
    inf = codec.info(blob)
    assert inf.seq_lens == (8, 6)
    np.testing.assert_array_equal(codec.decode(blob, token_ids=tk(all_t)).numpy(),
                                  expected(all_x, order))
    seq0_t = np.concatenate(toks[:2])
    np.testing.assert_array_equal(codec.decode_sequence(blob, 0, token_ids=tk(seq0_t)).numpy(),
                                  expected(np.concatenate(turns[:2]), order))
    if with_tok:
        with pytest.raises(CodecError, match="pass the token ids"):
            codec.append(blob, turns[2])
    else:
        with pytest.raises(CodecError, match="without token_ids"):
            codec.append(blob, turns[2], token_ids=toks[2])


def test_append_refuses_a_corrupt_blob():
    x, t, blob = _small_blob()
    b = bytearray(blob)
    b[-1] ^= 1
    with pytest.raises(CodecError, match="payload checksum mismatch"):
        codec.append(bytes(b), x[:2], token_ids=t[:2])


def test_uniform_random_is_never_larger_than_uint8():
    """Routing that does not compress is stored raw: at most the uint8 bytes plus headers."""
    rng = np.random.default_rng(8)
    T, L, K, E = 4096, 4, 8, 256
    x = rng.integers(0, E - 1, size=(T, L, K))  # ids 0..254 with repeats: incompressible
    for order in codec.ORDERS:
        blob = codec.encode(x, num_experts=E - 1, order=order)
        assert len(blob) <= 1.01 * T * L * K
        np.testing.assert_array_equal(codec.decode(blob).numpy(), expected(x, order))
    assert codec.info(codec.encode(x, num_experts=E - 1)).chunks[0].method == 0


def test_decoding_is_deterministic_and_blobs_are_reproducible():
    x, t, blob = _small_blob("keep")
    assert codec.encode(x, num_experts=16, order="keep", token_ids=t, seq_lens=[10, 20],
                        chunk_tokens=10) == blob
    assert torch.equal(codec.decode(blob, token_ids=t), codec.decode(blob, token_ids=t))


def test_corpus_round_trip_and_ratio():
    """The dev corpus (bench/data) round-trips in both modes; the set mode with token ids is
    several times smaller than int16 (the full figures: bench/bench_codec.py)."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "data",
                        "dev_qwen3moe_e128_k8_l8.npz")
    d = np.load(path)
    r, tok, lens = d["routing_trained"][:4096], d["token_ids"][:4096], d["seq_lens"][:8]
    for order in codec.ORDERS:
        blob = codec.encode(r, num_experts=128, order=order, token_ids=tok, seq_lens=lens)
        np.testing.assert_array_equal(codec.decode(blob, token_ids=tok).numpy(),
                                      expected(r, order))
        ratio = r.size * 2 / len(blob)
        assert ratio > (6.0 if order == "set" else 3.5), ratio


# ------------------------------------------------------------------ the Triton transform
# (TRITON_INTERPRET=1 on a machine without a GPU: tests/conftest.py; small shapes)
TRITON_CASES = [(16, 4, 9), (128, 8, 6), (300, 3, 5), (40000, 2, 4), (64, 1, 4), (40, 13, 4)]


@pytest.mark.parametrize("E,K,N", TRITON_CASES)
@pytest.mark.parametrize("order", codec.ORDERS)
@pytest.mark.parametrize("version", codec.READ_VERSIONS)
def test_triton_transform_is_bitwise_the_numpy_one(E, K, N, order, version):
    from replay_ops.triton_kernels import codec as tk

    rng = np.random.default_rng(E + K)
    x = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int64)
    x[1, 0] = -1
    x[2] = -1
    if K > 1:
        x[3, 1] = x[3, 0]  # a repeated id
    canon = np.where(x < 0, E, x).astype(codec.format._NARROW[codec.id_width(E)])
    ref_srt, ref_code = codec.sort_rows(canon.copy(), order, E, version)
    inverse = codec.format.as_format(version).inverse_code(K)
    out_srt, out_code = tk.sort_rows(torch.from_numpy(x).t().contiguous().t(), E, order,
                                     inverse=inverse)
    np.testing.assert_array_equal(out_srt.numpy().astype(np.int64), ref_srt.astype(np.int64))
    if order == "keep" and K > 1:
        w = codec.lehmer_width(K)
        want = np.ascontiguousarray(ref_code).view(f"<u{w}").reshape(-1).astype(np.int64)
        np.testing.assert_array_equal(out_code.numpy(), want)
    else:
        assert out_code is None
    # the inverse, into a strided int32 destination
    big = torch.full((N, 2 * K), 5, dtype=torch.int32)
    dst = big[:, ::2]
    digits = (None if out_code is None else
              torch.from_numpy(codec.lehmer_digits(out_code.numpy(), K)))
    tk.unsort_rows(out_srt, digits, E, dst, inverse=inverse)
    np.testing.assert_array_equal(dst.numpy(), expected(x[:, None, :], order)[:, 0])
    assert torch.all(big[:, 1::2] == 5)


@pytest.mark.parametrize("order", codec.ORDERS)
@pytest.mark.parametrize("with_tok", [False, True])
@pytest.mark.parametrize("E,K", [(16, 4), (300, 3), (40000, 2)])
def test_triton_backend_blobs_and_decodes_match_numpy(order, with_tok, E, K):
    rng = np.random.default_rng(9)
    x = np.stack([rng.permutation(E)[:K] for _ in range(40)]).reshape(20, 2, K)
    x[3, 0, 0] = -1
    x[7] = -1
    tok = rng.integers(0, 5, 20) if with_tok else None
    kw = dict(num_experts=E, order=order, token_ids=tok, seq_lens=[5, 15], chunk_tokens=5)
    blob = codec.encode(x, **kw)
    assert codec.encode(torch.from_numpy(x), backend="triton", **kw) == blob
    ref = expected(x, order)
    dst = torch.full((20, 2, 2 * K), 7, dtype=torch.int32)[:, :, ::2]
    codec.decode(blob, token_ids=tok, out=dst, backend="triton")
    np.testing.assert_array_equal(dst.numpy(), ref)
    seq = codec.decode_sequence(blob, 1, token_ids=tok, backend="triton")
    np.testing.assert_array_equal(seq.numpy(), ref[5:])


def test_triton_backend_checks_what_it_wrote(monkeypatch):
    from replay_ops.triton_kernels import codec as tk

    x, t, blob = _small_blob("keep")
    real = tk.unsort_rows

    def broken(srt, code, E, out, **kw):
        real(srt, code, E, out, **kw)
        out[0, 0], out[0, 1] = out[0, 1].clone(), out[0, 0].clone()
        return out

    monkeypatch.setattr(tk, "unsort_rows", broken)
    with pytest.raises(CodecError, match="device transform check failed"):
        codec.decode(blob, token_ids=t, backend="triton")
    with pytest.raises(CodecError, match="backend must be one of"):
        codec.decode(blob, token_ids=t, backend="cuda")


def test_group_order_is_the_stable_order_on_every_path():
    rng = np.random.default_rng(10)
    for lo, hi in [(0, 5), (0, 60000), (0, 1 << 40), (-(1 << 40), 5)]:
        t = rng.integers(lo, hi, size=300)
        t[::7] = t[0]
        np.testing.assert_array_equal(codec.transform._group_order(t), np.argsort(t, kind="stable"))


# ---------------------------------------------------------------------------- older formats
FIXTURE_V1 = __import__("pathlib").Path(__file__).parent / "data" / "codec_v1_blobs.npz"


@pytest.mark.parametrize("name", ["keep_tok", "keep_notok", "set_tok", "set_notok"])
def test_format_1_blobs_still_decode(name):
    """Blobs written by the format-1 encoder (record files of format 3 may hold them): the
    routing they were made from (with empty slots and repeated ids) comes back exactly."""
    f = np.load(FIXTURE_V1)
    r, tok, lens = f["routing"], f["token_ids"], f["seq_lens"]
    blob = f[name].tobytes()
    order = name.split("_")[0]
    ids = tok if name.endswith("_tok") else None
    inf = codec.info(blob, verify_payload=True)
    assert inf.version == 1 and inf.order == order and len(inf.chunks) == 2
    want = expected(r, order)
    np.testing.assert_array_equal(codec.decode(blob, token_ids=ids).numpy(), want)
    cu = np.concatenate([[0], np.cumsum(lens)])
    for i in range(len(lens)):
        got = codec.decode_sequence(blob, i, token_ids=ids).numpy()
        np.testing.assert_array_equal(got, want[cu[i]:cu[i + 1]])
    # a damaged format-1 blob is still refused
    bad = bytearray(blob)
    bad[inf.chunks[1].payload_offset + 7] ^= 0x10
    with pytest.raises(CodecError):
        codec.decode(bytes(bad), token_ids=ids)


def test_format_1_raw_chunk_and_append_still_decode():
    f = np.load(FIXTURE_V1)
    blob = f["keep_raw_append"].tobytes()
    inf = codec.info(blob)
    assert inf.version == 1 and [c.method for c in inf.chunks] == [0, 1]
    np.testing.assert_array_equal(codec.decode(blob).numpy(), f["routing_raw_append"])


@pytest.mark.parametrize("name", ["keep_tok", "keep_notok", "set_tok"])
def test_appending_to_a_format_1_blob_stays_format_1(name):
    """A record file's blob keeps its format: appended chunks are written in the blob's
    version, and the whole blob decodes."""
    f = np.load(FIXTURE_V1)
    r, tok = f["routing"], f["token_ids"]
    blob = f[name].tobytes()
    order, ids = name.split("_")[0], (tok if name.endswith("_tok") else None)
    more = r[100:300]
    more_ids = None if ids is None else tok[100:300]
    out = codec.append(blob, more, token_ids=more_ids, seq_lens=[150, 50])
    assert out[:len(blob)] == blob and codec.info(out).version == 1
    all_ids = None if ids is None else np.concatenate([ids, more_ids])
    np.testing.assert_array_equal(codec.decode(out, token_ids=all_ids).numpy(),
                                  expected(np.concatenate([r, more]), order))
    # the same routing encoded now is format 3, and decodes to the same
    new = codec.encode(np.concatenate([r, more]), num_experts=128, order=order,
                       token_ids=all_ids)
    assert codec.info(new).version == codec.FORMAT_VERSION == 3
    np.testing.assert_array_equal(codec.decode(new, token_ids=all_ids).numpy(),
                                  expected(np.concatenate([r, more]), order))


# ---------------------------------------------------------------------------- relabelling
def _relabel_case(E=6, K=3, T=64, seed=11):
    """keep routing where some experts usually take the first slots (the relabelling's
    case), with empty slots and repeated ids."""
    rng = np.random.default_rng(seed)
    x = np.stack([rng.permutation(E)[:K] for _ in range(T * 2)]).reshape(T, 2, K)
    x[::3, :, 0] = 0          # expert 0 often in slot 0
    x[::3, :, 1:] = rng.integers(1, E, size=(len(x[::3]), 2, K - 1))
    x[5, 1, 2] = -1
    x[6, 0] = -1
    x[7, 1] = [2, 2, 2][:K]
    return x


def _rewrite_payload(blob: bytes, ci: int, raw: bytes) -> bytes:
    """blob with chunk ci's payload replaced by zstd(raw), every checksum but the content's
    made right again (a forged chunk that only the decoder's own checks can refuse)."""
    import zstandard

    from _codec_forge import reseal, split

    version, head, ext, chunks = split(blob)
    chunks[ci].payload = zstandard.ZstdCompressor(level=3).compress(raw)
    return reseal(version, head, ext, chunks)


@pytest.mark.parametrize("with_tok", [False, True])
def test_keep_chunks_relabel_and_round_trip(with_tok):
    x = _relabel_case()
    tok = np.arange(64) % 5 if with_tok else None
    blob = codec.encode(x, num_experts=6, order="keep", token_ids=tok, seq_lens=[40, 24],
                        chunk_tokens=40)
    inf = codec.info(blob)
    # 40 * 3 ids >= 16 * 6 experts: relabelled; 24 * 3 < 96: not
    assert [bool(c.transform & codec.format._TRANSFORM_RELABEL) for c in inf.chunks] == [True, False]
    np.testing.assert_array_equal(codec.decode(blob, token_ids=tok).numpy(), x)
    np.testing.assert_array_equal(codec.decode_sequence(blob, 0, token_ids=tok).numpy(),
                                  x[:40])
    # "set" never relabels
    s = codec.encode(x, num_experts=6, order="set", token_ids=tok)
    assert not any(c.transform & codec.format._TRANSFORM_RELABEL for c in codec.info(s).chunks)


def test_relabel_table_orders_experts_by_mean_slot():
    x = _relabel_case()
    canon = np.where(x < 0, 6, x).astype(np.uint8)
    lab = codec.transform._relabel_table(canon, 6)
    for l in range(2):
        assert sorted(lab[l]) == list(range(6))
        slots = {e: [] for e in range(6)}
        for row in canon[:, l]:
            for j, e in enumerate(row):
                if e < 6:
                    slots[int(e)].append(j)
        mean = {e: (np.mean(v) if v else 3.0) for e, v in slots.items()}
        want = sorted(range(6), key=lambda e: (mean[e], e))
        assert [int(np.flatnonzero(lab[l] == i)[0]) for i in range(6)] == want
    assert lab[0, 0] == 0  # expert 0 leads slot 0 most often


def test_a_relabelled_chunk_with_a_bad_table_is_refused():
    x = _relabel_case()
    blob = codec.encode(x, num_experts=6, order="keep")
    ch = codec.info(blob).chunks[0]
    assert ch.transform & codec.format._TRANSFORM_RELABEL
    import zstandard

    raw = bytearray(zstandard.ZstdDecompressor().decompress(
        blob[ch.payload_offset:ch.payload_offset + ch.payload_len]))
    n_ids = x.size
    tab = n_ids  # the table follows the ids (L * E one-byte labels)
    bad = bytearray(raw)
    bad[tab + 1] = bad[tab]  # two experts of layer 0 share a label
    with pytest.raises(CodecError, match="relabelling table is not a permutation"):
        codec.decode(_rewrite_payload(blob, 0, bytes(bad)))
    bad = bytearray(raw)
    bad[tab], bad[tab + 1] = bad[tab + 1], bad[tab]  # a valid but wrong table
    with pytest.raises(CodecError, match="decoded content checksum mismatch"):
        codec.decode(_rewrite_payload(blob, 0, bytes(bad)))
    # untouched, the rewritten blob decodes: the forgery helper itself is right
    np.testing.assert_array_equal(codec.decode(_rewrite_payload(blob, 0, bytes(raw))).numpy(),
                                  x)


def test_chunk_info_layout_is_the_deprecated_transform():
    blob = codec.encode(_relabel_case(T=40), num_experts=6, order="keep")
    ch = codec.info(blob).chunks[0]
    assert ch.transform & codec.format._TRANSFORM_RELABEL
    with pytest.warns(DeprecationWarning, match="use ChunkInfo.transform"):
        assert ch.layout == ch.transform


def test_relabelled_chunks_refuse_every_flipped_byte():
    x = _relabel_case(T=40)
    blob = codec.encode(x, num_experts=6, order="keep")
    for i in range(len(blob)):
        b = bytearray(blob)
        b[i] ^= 0x04
        with pytest.raises(CodecError):
            codec.decode(bytes(b))


@pytest.mark.parametrize("with_tok", [False, True])
def test_triton_backend_relabelled_blobs_match_numpy(with_tok):
    x = _relabel_case()
    tok = np.arange(64) % 7 if with_tok else None
    kw = dict(num_experts=6, order="keep", token_ids=tok, seq_lens=[40, 24], chunk_tokens=40)
    blob = codec.encode(x, **kw)
    assert codec.info(blob).chunks[0].transform & codec.format._TRANSFORM_RELABEL
    assert codec.encode(torch.from_numpy(x), backend="triton", **kw) == blob
    dst = torch.full((64, 2, 6), 7, dtype=torch.int32)[:, :, ::2]
    codec.decode(blob, token_ids=tok, out=dst, backend="triton")
    np.testing.assert_array_equal(dst.numpy(), x)


def test_relabel_table_is_the_same_for_many_experts():
    """The table's two counting paths (one count of (slot, layer, id), or a count per slot
    when that would take more than 2**20 bins) both order the experts by mean slot."""
    rng = np.random.default_rng(12)
    E = 50000
    x = rng.integers(0, E, size=(500, 3, 8)).astype(np.uint16)
    x[:, :, 0] = rng.integers(0, 50, size=(500, 3))  # low ids lead

    def want(y):
        K = y.shape[2]
        s_ = np.zeros((3, E))
        c_ = np.zeros((3, E))
        for l in range(3):
            np.add.at(s_[l], y[:, l].astype(np.int64), np.broadcast_to(np.arange(K), (500, K)))
            np.add.at(c_[l], y[:, l].astype(np.int64), 1)
        mean = np.where(c_ > 0, s_ / np.maximum(c_, 1), float(K))
        return np.argsort(np.argsort(mean, axis=1, kind="stable"), axis=1, kind="stable")

    for y in (x, np.ascontiguousarray(x[:, :, :4])):  # 8 * 3 * 50001 > 2**20 > 4 * 3 * 50001
        np.testing.assert_array_equal(codec.transform._relabel_table(y, E), want(y))
    blob = codec.encode(x, num_experts=E, order="keep", chunk_tokens=1 << 20)
    assert not codec.info(blob).chunks[0].transform & codec.format._TRANSFORM_RELABEL  # too few ids


# ---------------------------------------------------------------------------- hostile input
# (format 3: every case here decodes without error, or to wrong routing, on format 2)
FIXTURE_V2 = __import__("pathlib").Path(__file__).parent / "data" / "codec_v2_blobs.npz"


def _turns_blob(order="keep", tok=True, seed=40, E=16):
    """Three turns of one conversation, appended one by one: a chunk each."""
    rng = np.random.default_rng(seed)
    turns = [rng.integers(-1, E, size=(n, 2, 4)) for n in (6, 5, 7)]
    toks = [rng.integers(0, 9, size=t.shape[0]) for t in turns]
    ids = (lambda i: toks[i]) if tok else (lambda i: None)
    blob = codec.encode(turns[0], num_experts=E, order=order, token_ids=ids(0))
    for i in (1, 2):
        blob = codec.append(blob, turns[i], token_ids=ids(i), continue_last=True)
    return turns, toks, blob


def _chunk_bytes(blob):
    inf = codec.info(blob)
    return [bytes(blob[c.offset:c.payload_offset + c.payload_len]) for c in inf.chunks]


@pytest.mark.parametrize("tok", [False, True])
def test_swapped_and_duplicated_turns_are_refused(tok):
    turns, toks, blob = _turns_blob(tok=tok)
    c = _chunk_bytes(blob)
    head = blob[:codec.BLOB_HEADER_SIZE]
    ids = np.concatenate(toks) if tok else None
    np.testing.assert_array_equal(codec.decode(blob, token_ids=ids).numpy(),
                                  np.concatenate(turns))
    swapped = head + c[0] + c[2] + c[1]
    ids_sw = np.concatenate([toks[0], toks[2], toks[1]]) if tok else None
    with pytest.raises(CodecError, match="chunk header checksum mismatch"):
        codec.decode(swapped, token_ids=ids_sw)
    dup = blob + c[2]  # the last append's bytes written twice (a retried write)
    ids_dup = np.concatenate(toks + [toks[2]]) if tok else None
    with pytest.raises(CodecError, match="not a chunk header"):
        codec.decode(dup, token_ids=ids_dup)
    # a whole appended blob re-sent after the first (its own header included)
    with pytest.raises(CodecError):
        codec.decode(blob + blob, token_ids=ids)


def test_a_chunk_of_another_blob_is_refused():
    """Same token ids, same shape, same position: only the binding tells the chunks apart."""
    rng = np.random.default_rng(41)
    t = rng.integers(0, 9, size=20)
    a, b = (rng.integers(0, 16, size=(20, 2, 4)) for _ in range(2))
    kw = dict(num_experts=16, order="keep", token_ids=t, seq_lens=[10, 10], chunk_tokens=10)
    ba, bb = codec.encode(a, **kw), codec.encode(b, **kw)
    ca, cb = _chunk_bytes(ba), _chunk_bytes(bb)
    for i in range(2):
        parts = list(ca)
        parts[i] = cb[i]
        spliced = ba[:codec.BLOB_HEADER_SIZE] + b"".join(parts)
        with pytest.raises(CodecError, match="checksum mismatch|does not match its chunks"):
            codec.decode(spliced, token_ids=t)
    # blob b's header on blob a's chunks
    with pytest.raises(CodecError):
        codec.decode(bb[:codec.BLOB_HEADER_SIZE] + b"".join(ca), token_ids=t)


def test_every_cut_of_an_appended_blob_is_refused():
    turns, toks, blob = _turns_blob()
    ids = np.concatenate(toks)
    for n in range(len(blob)):
        with pytest.raises(CodecError, match=r"offset \d+: (truncated|not a routing)"):
            codec.decode(blob[:n], token_ids=ids)


@pytest.mark.parametrize("backend", ["numpy", "triton"])
def test_every_decode_path_checks_the_content_checksum(backend):
    """A forged "keep" chunk (every checksum a sender can recompute made right, another
    valid permutation code in a row) is refused on the numpy and the Triton path alike."""
    import zstandard

    rng = np.random.default_rng(42)
    base = np.stack([rng.permutation(32)[:4] for _ in range(4)])
    x = base[rng.integers(0, 4, size=64 * 2)].reshape(64, 2, 4)  # compressible: zstd
    blob = codec.encode(x, num_experts=32, order="keep")
    ch = codec.info(blob).chunks[0]
    assert ch.method == 1 and not ch.transform & codec.format._TRANSFORM_RELABEL
    raw = bytearray(zstandard.ZstdDecompressor().decompress(
        blob[ch.payload_offset:ch.payload_offset + ch.payload_len]))
    code_at = x.size  # the code bytes follow the ids (1 byte per row at K = 4)
    raw[code_at] = (raw[code_at] + 1) % 24  # row 0 in another (valid) slot order
    forged = _rewrite_payload(blob, 0, bytes(raw))
    np.testing.assert_array_equal(codec.decode(_rewrite_payload(blob, 0, bytes(
        zstandard.ZstdDecompressor().decompress(blob[ch.payload_offset:ch.payload_offset
                                                     + ch.payload_len]))),
        backend=backend).numpy(), x)
    with pytest.raises(CodecError, match="content checksum mismatch"):
        codec.decode(forged, backend=backend)
    with pytest.raises(CodecError, match="content checksum mismatch"):
        codec.decode_sequence(forged, 0, backend=backend)


def test_out_with_overlapping_elements_is_refused():
    x, t, blob = _small_blob()
    for out in (torch.empty(1, 1, 1, dtype=torch.int16).expand(30, 2, 4),
                torch.empty(30, 1, 4, dtype=torch.int16).expand(30, 2, 4),
                torch.empty(30 * 2 + 3, dtype=torch.int16).as_strided((30, 2, 4), (2, 1, 1))):
        with pytest.raises(CodecError, match="overlapping elements"):
            codec.decode(blob, token_ids=t, out=out)
    with pytest.raises(CodecError, match="overlapping elements"):
        codec.decode_sequence(blob, 0, token_ids=t,
                              out=torch.empty(10, 2, 1, dtype=torch.int32).expand(10, 2, 4))
    # distinct elements in any order are fine: a transposed and a sliced view
    out = torch.empty(4, 2, 30, dtype=torch.int32).permute(2, 1, 0)
    codec.decode(blob, token_ids=t, out=out)
    np.testing.assert_array_equal(out.numpy(), x)


@pytest.mark.parametrize("backend", ["numpy", "triton"])
def test_token_ids_for_a_blob_without_them_are_refused(backend):
    x, _, blob = _small_blob(tok=False)
    t = np.arange(30)
    for call in (lambda: codec.decode(blob, token_ids=t, backend=backend),
                 lambda: codec.decode_sequence(blob, 1, token_ids=t, backend=backend),
                 lambda: codec.append(blob, x[:2], token_ids=t[:2])):
        with pytest.raises(CodecError, match="encoded without token_ids"):
            call()


def test_header_sizes_are_bounded_before_allocation():
    from _codec_forge import forge_header

    x, t, blob = _small_blob()
    for field, value, msg in [("K", 10**6, "top_k=1000000 is above"),
                              ("L", 10**6, "num_layers=1000000 is above"),
                              ("num_tokens", 2**50, f"num_tokens={2**50} is above"),
                              ("num_tokens", 2**34, f"T\\*L\\*K={2**37} is above")]:
        with pytest.raises(CodecError, match=msg):
            codec.decode(forge_header(blob, **{field: value}), token_ids=t)
    # the header's counts must match the chunks: a header that understates the tokens
    # does not get them past max_tokens
    with pytest.raises(CodecError, match="does not match its chunks"):
        codec.decode(forge_header(blob, num_tokens=31), token_ids=t)
    with pytest.raises(CodecError, match="does not match its chunks"):
        codec.decode(forge_header(blob, num_tokens=5), token_ids=t, max_tokens=5)
    with pytest.raises(CodecError, match="does not match its chunks"):
        codec.decode(forge_header(blob, num_seqs=1), token_ids=t)
    with pytest.raises(CodecError, match="not a chunk header"):
        codec.decode(forge_header(blob, num_chunks=1), token_ids=t)
    with pytest.raises(CodecError, match="top_k=300 is above"):
        codec.encode(np.zeros((2, 1, 300), np.int16), num_experts=512)


@pytest.mark.parametrize("call", ["decode", "decode_sequence", "info", "append"])
def test_max_tokens_and_max_bytes(call):
    x, t, blob = _small_blob()  # 30 tokens, [30, 2, 4] int16: 480 bytes

    def run(**kw):
        if call == "decode":
            return codec.decode(blob, token_ids=t, **kw)
        if call == "decode_sequence":
            return codec.decode_sequence(blob, 1, token_ids=t, **kw)
        if call == "info":
            return codec.info(blob, **kw)
        return codec.append(blob, x[:2], token_ids=t[:2], **kw)

    run(max_tokens=30, max_bytes=480)
    run(max_tokens=None, max_bytes=None)
    with pytest.raises(CodecError, match="num_tokens=30 is above max_tokens=29"):
        run(max_tokens=29)
    with pytest.raises(CodecError, match="decoded bytes=480 .* is above max_bytes=479"):
        run(max_bytes=479)
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(CodecError, match="max_tokens must be"):
            run(max_tokens=bad)
    if call == "decode":  # counted in the output's dtype
        with pytest.raises(CodecError, match="decoded bytes=960"):
            codec.decode(blob, token_ids=t, dtype=torch.int32, max_bytes=959)


def test_older_formats_honour_the_limits_too():
    f = np.load(FIXTURE_V2)
    blob, tok = f["keep_tok"].tobytes(), f["token_ids"]
    with pytest.raises(CodecError, match="num_tokens=500 is above max_tokens=499"):
        codec.decode(blob, token_ids=tok, max_tokens=499)
    with pytest.raises(CodecError, match="is above max_bytes"):
        codec.info(blob, max_bytes=500 * 64 * 2 - 1)


def _zstd_chunk_blob():
    rng = np.random.default_rng(43)
    base = np.stack([rng.permutation(32)[:4] for _ in range(4)])
    x = base[rng.integers(0, 4, size=64 * 2)].reshape(64, 2, 4)
    blob = codec.encode(x, num_experts=32, order="set")
    ch = codec.info(blob).chunks[0]
    assert ch.method == 1
    return x, blob, ch


def test_zstd_frames_are_checked_before_decompressing():
    import zstandard
    from _codec_forge import reseal, split

    x, blob, ch = _zstd_chunk_blob()
    payload = blob[ch.payload_offset:ch.payload_offset + ch.payload_len]
    raw = zstandard.ZstdDecompressor().decompress(payload)
    version, head, ext, chunks = split(blob)

    def with_payload(p):
        chunks[0].payload = p
        return reseal(version, head, ext, chunks)

    # bytes after the frame, a second frame, a frame that declares more or less, none
    for p, msg in [(payload + b"\0" * 5, "bytes after the frame"),
                   (payload + payload, "bytes after the frame"),
                   (zstandard.ZstdCompressor().compress(raw + b"\0" * 1000), "declares 1512"),
                   (zstandard.ZstdCompressor().compress(raw[:-1]), "declares 511"),
                   (zstandard.ZstdCompressor(write_content_size=False).compress(raw),
                    "declares -1")]:
        with pytest.raises(CodecError, match=msg):
            codec.decode(with_payload(p))
    # a header that claims more than a frame of its size can hold is refused unread
    chunks[0].payload = payload
    chunks[0].fields[7] = 10**7  # tokens
    chunks[0].lens = (10**7,)
    with pytest.raises(CodecError, match="more than a zstd frame can hold"):
        codec.info(reseal(version, head, ext, chunks))


def test_large_k():
    # a vectorised sort above K = 20: no sorting network is built for K = 64
    rng = np.random.default_rng(44)
    x = np.stack([rng.permutation(200)[:64] for _ in range(30)]).reshape(15, 2, 64)
    for order in codec.ORDERS:
        blob = codec.encode(x, num_experts=200, order=order)
        np.testing.assert_array_equal(codec.decode(blob).numpy(), expected(x, order))
        # the Triton path decodes "keep" blobs with K > 20 too (on the host, then copied)
        np.testing.assert_array_equal(codec.decode(blob, backend="triton").numpy(),
                                      expected(x, order))
    assert max(codec.transform._NETWORKS, default=0) <= 20
    # empty routing with K > 20, both orders
    for order in codec.ORDERS:
        e = codec.encode(np.zeros((0, 3, 23), np.int16), num_experts=64, order=order)
        assert tuple(codec.decode(e).shape) == (0, 3, 23)
        assert tuple(codec.decode(e, backend="triton").shape) == (0, 3, 23)


def test_info_and_decode_sequence_are_linear_in_chunks():
    """20000 one-token sequences, a chunk each: finding the last one parses the headers once
    (format 2 summed every sequence length again per chunk: quadratic, seconds)."""
    import time

    def cpu(n):
        b = codec.encode(np.zeros((n, 1, 2), np.int16), num_experts=8, seq_lens=[1] * n,
                         chunk_tokens=1)
        best = float("inf")
        for _ in range(3):  # the least CPU time of three: a shared machine adds, never takes
            t0 = time.process_time()
            np.testing.assert_array_equal(codec.decode_sequence(b, n - 1).numpy(), 0)
            best = min(best, time.process_time() - t0)
        return best

    t_small, t_big = cpu(5000), cpu(20000)
    assert t_big < 2.0, t_big
    assert t_big < 8 * max(t_small, 0.01), (t_small, t_big)  # quadratic would be 16x


# ---------------------------------------------------------------------------- format 2
@pytest.mark.parametrize("name", ["keep_tok", "keep_notok", "set_tok", "set_notok"])
def test_format_2_blobs_still_decode_and_append_in_format_2(name):
    """Blobs of the format-2 encoder (tests/data/codec_v2_blobs.npz, written at 641b54d;
    record files hold them): they decode exactly, on both paths, and `append` extends
    them in format 2 (unbound chunks: see docs/router_replay.md)."""
    f = np.load(FIXTURE_V2)
    r, tok, lens = f["routing"], f["token_ids"], f["seq_lens"]
    blob = f[name].tobytes()
    order = name.split("_")[0]
    ids = tok if name.endswith("_tok") else None
    inf = codec.info(blob, verify_payload=True)
    assert inf.version == 2 and len(inf.chunks) == 2
    if order == "keep":
        assert inf.chunks[0].transform & codec.format._TRANSFORM_RELABEL
    want = expected(r, order)
    np.testing.assert_array_equal(codec.decode(blob, token_ids=ids).numpy(), want)
    if name == "keep_notok":  # the Triton path (interpreted here: one chunk)
        np.testing.assert_array_equal(
            codec.decode_sequence(blob, 2, token_ids=ids, backend="triton").numpy(),
            want[450:])
    cu = np.concatenate([[0], np.cumsum(lens)])
    for i in range(len(lens)):
        got = codec.decode_sequence(blob, i, token_ids=ids).numpy()
        np.testing.assert_array_equal(got, want[cu[i]:cu[i + 1]])
    more = r[:40]
    out = codec.append(blob, more, token_ids=None if ids is None else tok[:40],
                       continue_last=True)
    assert out[:len(blob)] == blob and codec.info(out).version == 2
    all_ids = None if ids is None else np.concatenate([tok, tok[:40]])
    np.testing.assert_array_equal(codec.decode(out, token_ids=all_ids).numpy(),
                                  expected(np.concatenate([r, more]), order))
