"""The codec's row transforms, all invertible and all in numpy: each row of K ids sorted
(by a sorting network up to K = 20) with its order kept as a Lehmer code, the per-layer
relabelling of "keep" chunks, the regrouping of a chunk's rows by token id, and the byte
planes that the chunk stage compresses. What each transform stores is specified in
docs/codec_format.md ("Row transforms"); the Triton versions of the sort and its inverse
are in replay_ops/triton_kernels/codec.py and give the same bytes.
"""
from __future__ import annotations


import numpy as np

from .format import (CURRENT, MAX_LEHMER_K, _NARROW, CodecError, Format, as_format,
                     lehmer_width)

# Rows are sorted by a sorting network (one numpy call per comparator) up to this K, by
# np.sort above it.
_NETWORK_MAX_K = 20
# Up to this many rows, each transform is a few vectorised calls over [N, K] (or [N, K, K])
# arrays instead of one call per comparator, column or Lehmer digit: a chunk's fixed cost
# then does not grow with K, so a blob of many tiny chunks costs time in proportion to its
# bytes. Both forms give the same bytes (tests/test_codec.py).
_SMALL_ROWS = 64


def _network(k: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort for k inputs (the network of the next power of two,
    comparators touching an index >= k dropped: those inputs act as +inf)."""
    n = 1
    while n < k:
        n *= 2
    pairs: list[tuple[int, int]] = []

    def merge(lo, m, r):
        step = r * 2
        if step < m:
            merge(lo, m, step)
            merge(lo + r, m, step)
            pairs.extend((i, i + r) for i in range(lo + r, lo + m - r, step))
        else:
            pairs.append((lo, lo + r))

    def sort(lo, m):
        if m > 1:
            h = m // 2
            sort(lo, h)
            sort(lo + h, h)
            merge(lo, m, 1)

    sort(0, n)
    return [(i, j) for i, j in pairs if j < k]


_NETWORKS: dict[int, list] = {}


def _sort_columns(cols: list[np.ndarray]) -> list[np.ndarray]:
    """Sort across the K column arrays, element by element (each row ascending). The arrays
    must be the caller's own: they are overwritten."""
    k = len(cols)
    if k > _NETWORK_MAX_K:  # a vectorised sort: a network costs one call per comparator
        m = np.sort(np.stack(cols, axis=1), axis=1)
        return [m[:, j] for j in range(k)]
    if k not in _NETWORKS:
        _NETWORKS[k] = _network(k)
    cols = list(cols)
    for i, j in _NETWORKS[k]:
        lo = np.minimum(cols[i], cols[j])
        np.maximum(cols[i], cols[j], out=cols[j])
        cols[i] = lo
    return cols


def _key_dtype(num_experts: int, k: int):
    top = (num_experts + 1) * _slot_mult(k)
    for dt in (np.uint16, np.uint32, np.uint64):
        if top <= np.iinfo(dt).max + 1:
            return dt
    raise CodecError(f"num_experts={num_experts} with top_k={k} is too large")


def _slot_mult(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


def sort_rows(canon: np.ndarray, order: str, num_experts: int,
              version: Format | int = CURRENT):
    """The per-row transform. `canon` [N, K] holds ids with -1 already mapped to the sentinel
    num_experts (any unsigned narrow dtype). Returns (sorted [N, K] in canon's dtype,
    perm_code [N, lehmer_width(K)] uint8 bytes or None for "set"). The code is that of
    format `version` (a `Format` or its number: `Format.inverse_code`)."""
    fmt = as_format(version)
    n, k = canon.shape
    if n <= _SMALL_ROWS:
        return _sort_rows_small(canon, order, fmt)
    if order == "keep" and fmt.inverse_code(k):
        cols = [canon[:, j].copy() for j in range(k)]  # the network overwrites them
        code = _lehmer_of_slots(cols, k)
        srt = np.stack(_sort_columns(cols), axis=1)
        return srt, code
    if order == "set" or k <= 1:
        cols = _sort_columns([np.ascontiguousarray(canon[:, j]) for j in range(k)])
        out = np.stack(cols, axis=1) if k else canon.copy()
        return out, (None if order == "set" else np.zeros((n, lehmer_width(k)), np.uint8))
    kd = _key_dtype(num_experts, k)
    mult = _slot_mult(k)
    shift = mult.bit_length() - 1
    keys = [(canon[:, j].astype(kd) << kd(shift)) | kd(j) for j in range(k)]
    keys = _sort_columns(keys)
    srt = np.stack([(c >> kd(shift)).astype(canon.dtype) for c in keys], axis=1)
    perm = [(c & kd(mult - 1)).astype(np.uint8 if k <= 256 else np.uint16) for c in keys]
    return srt, _perm_encode(perm, k)


def _sort_rows_small(canon: np.ndarray, order: str, fmt: Format):
    """`sort_rows` of a few rows, in a fixed number of numpy calls: the same bytes (ties in
    the slot order keep their slot order, as the (id, slot) keys of the network give)."""
    n, k = canon.shape
    srt = np.sort(canon, axis=1)
    if order == "set":
        return srt, None
    if k <= 1:
        return srt, np.zeros((n, lehmer_width(k)), np.uint8)
    if fmt.inverse_code(k):
        return srt, _lehmer_rows(canon, k)
    perm = np.argsort(canon, axis=1, kind="stable")
    srt = np.take_along_axis(canon, perm, axis=1)
    if k > MAX_LEHMER_K:
        p = np.ascontiguousarray(perm.astype(np.uint8 if k <= 256 else np.uint16))
        return srt, p.view(np.uint8).reshape(n, k * p.itemsize)
    return srt, _lehmer_rows(perm, k)


_PLACES: dict[int, tuple] = {}


def _lehmer_place(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For K = k (cached): the place value of each Lehmer digit (uint64 [k]; digit j in radix
    k - j, digit 0 most significant; the last digit, always 0, gets 1), the radices
    (uint64 [k]) and the pairs i > j (bool [k, k])."""
    if k not in _PLACES:
        w = np.ones(k, np.uint64)
        for j in range(k - 3, -1, -1):
            w[j] = w[j + 1] * np.uint64(k - j - 1)
        _PLACES[k] = (w, (k - np.arange(k)).astype(np.uint64),
                      np.triu(np.ones((k, k), bool), 1))
    return _PLACES[k]


def _lehmer_rows(a: np.ndarray, k: int) -> np.ndarray:
    """`_lehmer_bytes` of the rows of a [N, k] array (k <= MAX_LEHMER_K), vectorised over
    [N, k, k]: digit j = #{i > j : a[i] < a[j]}."""
    n = a.shape[0]
    w = lehmer_width(k)
    place, _, later = _lehmer_place(k)
    lt = (a[:, None, :] < a[:, :, None]) & later
    code = (lt.sum(axis=2, dtype=np.uint64) * place).sum(axis=1, dtype=np.uint64)
    return np.ascontiguousarray(code.astype(f"<u{w}")).view(np.uint8).reshape(n, w)


def _lehmer_bytes(cols: list[np.ndarray], k: int) -> np.ndarray:
    """The Lehmer code of each row of the columns `cols` (K arrays of N values), as
    [N, lehmer_width(k)] little-endian bytes: digit j = #{i > j : cols[i] < cols[j]} in
    radix k - j, column 0's digit most significant."""
    n = cols[0].shape[0]
    w = lehmer_width(k)
    if w == 0:
        return np.zeros((n, 0), np.uint8)
    code = np.zeros(n, np.uint64)
    for j in range(k - 1):
        c = np.zeros(n, np.uint8)
        cj = cols[j]
        for i in range(j + 1, k):
            c += cols[i] < cj
        code *= np.uint64(k - j)
        code += c
    return np.ascontiguousarray(code.astype(f"<u{w}")).view(np.uint8).reshape(n, w)


def _lehmer_of_slots(cols: list[np.ndarray], k: int) -> np.ndarray:
    """The Lehmer code of each row's slot order: q[s] = the rank of slot s's id in the row
    (equal ids ranked by slot), digit s = #{s' > s : q[s'] < q[s]} = #{s' > s : id[s'] <
    id[s]}, slot 0's digit most significant. Equal to `_perm_encode` of the inverse
    permutation."""
    return _lehmer_bytes(cols, k)


def _perm_encode(perm: list[np.ndarray], k: int) -> np.ndarray:
    """perm[j][r] = the original slot of row r's j-th smallest key -> [N, width] bytes."""
    n = perm[0].shape[0]
    if k > MAX_LEHMER_K:
        p = np.ascontiguousarray(np.stack(perm, axis=1))
        return p.view(np.uint8).reshape(n, k * p.itemsize)
    return _lehmer_bytes(perm, k)


def lehmer_digits(code: np.ndarray, k: int) -> np.ndarray:
    """Lehmer codes [N] (below k!) -> their digits [N, k] uint8: c_j = #{i > j : p[i] < p[j]}
    (digit j in radix k - j). A code not below k! raises CodecError."""
    code = np.asarray(code).astype(np.uint64)
    n = code.shape[0]
    if 1 < k and n <= _SMALL_ROWS:  # every digit at once
        place, radix, _ = _lehmer_place(k)
        over = code // place[0] >= np.uint64(k)  # code >= k!
        if np.any(over):
            bad = int(np.flatnonzero(over)[0])
            raise CodecError(f"permutation code of row {bad} is not below {k}! (corrupt)")
        return ((code[:, None] // place[None, :]) % radix[None, :]).astype(np.uint8)
    digits = np.zeros((n, k), np.uint8)
    for j in range(k - 2, -1, -1):
        radix = np.uint64(k - j)
        digits[:, j] = code % radix
        code = code // radix
    if np.any(code):
        bad = int(np.flatnonzero(code)[0])
        raise CodecError(f"permutation code of row {bad} is not below {k}! (corrupt)")
    return digits


def _perm_decode(code_bytes: np.ndarray, k: int) -> list[np.ndarray]:
    """Inverse of `_perm_encode`: [N, width] bytes -> perm[j] arrays."""
    n = code_bytes.shape[0]
    if k > MAX_LEHMER_K:
        dt = np.uint8 if k <= 256 else np.dtype("<u2")
        p = np.ascontiguousarray(code_bytes).view(dt).reshape(n, k)
        return [p[:, j] for j in range(k)]
    w = lehmer_width(k)
    code = (np.ascontiguousarray(code_bytes).view(f"<u{w}").reshape(n)
            if w else np.zeros(n, np.uint64))
    d = lehmer_digits(code, k)
    if n <= _SMALL_ROWS:  # one call per digit, over the digits after it
        for j in range(k - 2, -1, -1):
            d[:, j + 1:] += d[:, j + 1:] >= d[:, j:j + 1]
        return [d[:, j] for j in range(k)]
    p = [d[:, j] for j in range(k)]
    for j in range(k - 2, -1, -1):
        pj = p[j]
        for i in range(j + 1, k):
            p[i] = p[i] + (p[i] >= pj)
    return p


def _relabel_table(canon: np.ndarray, E: int) -> np.ndarray:
    """[L, E] new labels (each row a permutation of 0..E-1): per layer, the experts by their
    mean slot over the chunk's rows (the slot order is the score order, so experts that
    usually score high get small labels; unused experts last; ties by id). Relabelled, the
    slot order of a row is close to its ascending order, so its Lehmer code is small and
    compresses (bench/results/codec_choices.md). The sentinel E keeps its label."""
    T, L, K = canon.shape
    E1 = E + 1
    # one count of (slot, layer, id) triples when the bins are few, else a count per slot
    # (bench/results/codec_choices.md)
    it = np.int32 if K * L * E1 < 2**31 else np.int64
    if K * L * E1 <= 1 << 20:
        off = ((np.arange(L, dtype=it) * E1)[None, :, None]
               + (np.arange(K, dtype=it) * (L * E1))[None, None, :])
        per = np.bincount((canon + off).reshape(-1), minlength=K * L * E1).reshape(K, L, E1)
        cnt = per.sum(axis=0)[:, :E]
        tot = np.tensordot(np.arange(K, dtype=np.int64), per, axes=1)[:, :E]
    else:  # a count per slot: L * E bins at a time
        off = (np.arange(L, dtype=it) * E1)[None, :]
        cnt = np.zeros(L * E1, np.int64)
        tot = np.zeros(L * E1, np.int64)
        for j in range(K):
            c = np.bincount((canon[:, :, j] + off).reshape(-1), minlength=L * E1)
            cnt += c
            tot += j * c
        cnt, tot = cnt.reshape(L, E1)[:, :E], tot.reshape(L, E1)[:, :E]
    mean = np.where(cnt > 0, tot / np.maximum(cnt, 1), float(K))
    order = np.argsort(mean, axis=1, kind="stable")
    lab = np.empty((L, E), np.int64)
    np.put_along_axis(lab, order, np.arange(E, dtype=np.int64)[None, :], axis=1)
    return lab


def _apply_labels(canon: np.ndarray, lab: np.ndarray, E: int) -> np.ndarray:
    """[T, L, K] ids -> the labels lab[l, id] (the sentinel E stays E), canon's dtype."""
    L = lab.shape[0]
    # one gather from a flat [L, stride] table, indexed by layer * stride + id, with 16-bit
    # indices when E < 256 and L <= 256 (bench/results/codec_choices.md)
    stride = 256 if E < 256 and L <= 256 else E + 1
    it = np.uint16 if stride == 256 else np.uint32 if L * stride < 2**32 else np.int64
    ext = np.zeros((L, stride), canon.dtype)
    ext[:, :E] = lab
    ext[:, E] = E
    idx = canon.astype(it)
    idx += (np.arange(L, dtype=it) * it(stride))[None, :, None]
    return np.take(ext.reshape(-1), idx)


def _group_order(tok: np.ndarray) -> np.ndarray:
    """The stable order of the tokens by id (a token's occurrences in order): one sort of
    (id << bits | position) keys, or numpy's radix sort for ids below 2**16
    (bench/results/codec_choices.md)."""
    T = tok.shape[0]
    bits = max(1, int(T).bit_length())
    lo, hi = (int(tok.min()), int(tok.max())) if T else (0, 0)
    if lo >= 0 and hi <= 0xFFFF:
        # numpy's stable sort of 16-bit keys is a radix sort
        return np.argsort(tok.astype(np.uint16), kind="stable")
    if lo >= 0 and hi < (1 << (62 - bits)):
        keys = np.sort((tok.astype(np.int64) << bits) | np.arange(T, dtype=np.int64))
        return keys & ((1 << bits) - 1)
    return np.argsort(tok, kind="stable")


_ROW_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _rows(a: np.ndarray) -> np.ndarray:
    """A contiguous [A, B, C] array as [A, B] rows of one item each (moving a row is one
    copy: an unsigned integer when the row is 1, 2, 4 or 8 bytes, else an opaque item)."""
    A, B, C = a.shape
    nb = C * a.itemsize
    return np.ascontiguousarray(a).view(_ROW_UINT.get(nb, np.dtype((np.void, nb)))).reshape(A, B)


def _to_grouped(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """[T, L, C] token order -> [L, T, C] layer-major, tokens in order g."""
    T, L, C = a.shape
    return np.ascontiguousarray(_rows(a)[g].T).view(a.dtype).reshape(L, T, C)


def _from_grouped(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Inverse of `_to_grouped`: [L, T, C] -> [T, L, C] contiguous."""
    L, T, C = a.shape
    ginv = np.empty_like(g)
    ginv[g] = np.arange(T, dtype=g.dtype)
    # a gather along the token axis, then one transpose (bench/results/codec_choices.md)
    return np.ascontiguousarray(np.take(_rows(a), ginv, axis=1).T).view(a.dtype).reshape(
        T, L, C)


def _planes(ids: np.ndarray, w: int) -> bytes:
    if w == 1:
        return np.ascontiguousarray(ids).tobytes()
    b = np.ascontiguousarray(ids).astype(f"<u{w}", copy=False).view(np.uint8).reshape(-1, w)
    return np.ascontiguousarray(b.T).tobytes()


def _planes_bytes(b: np.ndarray) -> bytes:
    """[..., w] uint8 -> w planes."""
    w = b.shape[-1]
    b = b.reshape(-1, w)
    return np.ascontiguousarray(b.T).tobytes() if w > 1 else np.ascontiguousarray(b).tobytes()


def _unsort_np(srt: np.ndarray, pc, K: int, fmt: Format) -> np.ndarray:
    """[N, K] sorted ids + permutation code bytes (of format `fmt`) -> the ids in their
    original slots."""
    N = srt.shape[0]
    if pc is None or K <= 1 or not pc.shape[1]:
        return np.ascontiguousarray(srt)
    p = np.stack(_perm_decode(pc, K), axis=1)
    if p.size and p.max() >= K:
        raise CodecError("corrupt permutation (slot out of range)")
    if fmt.inverse_code(K):  # q[s]: the rank of slot s's id
        return np.take_along_axis(srt, p.astype(np.intp), axis=1)
    out = np.empty((N, K), srt.dtype)
    np.put_along_axis(out, p.astype(np.intp), srt, axis=1)
    return out


def _unplanes(b: np.ndarray, w: int, n: int) -> np.ndarray:
    if w == 1:
        return b
    return np.ascontiguousarray(b.reshape(w, n).T).view(f"<u{w}").reshape(n).astype(_NARROW[w])


