"""Routing codec benchmark: size and CPU throughput of replay_ops.router_replay.codec
against the formats peers ship routing in, on the dev routing corpus (bench/data).

    python bench/bench_codec.py [--repeats 5] [--quick]

* Sizes: bytes of each encoding; ratios against int16 (verl's dtype) and uint8 (vLLM's
  host buffer up to 256 experts) of the same routing.
* Throughput: MB of int16-equivalent input (T*L*K*2 bytes) per CPU-second of one thread
  (`time.thread_time` around one call; torch and the codec run on the calling thread:
  torch.set_num_threads(1)). The machine is shared with other jobs, so every figure is the
  best of `--repeats` runs (CPU time, not wall time, so waiting for a core is not counted).
* Peers: SGLang's base64 of int32; int16 and uint8 raw bytes (verl, vLLM); uint8 + zstd-3
  without our transform; each row's ids sorted + zstd (the transform alone, no grouping).
* Targets (trained routing): `set` >= 9x smaller than int16 (stretch 12x), encode >= 200
  MB/s, decode >= 1 GB/s; `keep` >= 4x; uniform random routing never more than 1% larger
  than uint8. Each is marked met or missed at the default level and at the best level.

Writes bench/results/codec_<machine>.md and .json (atomically).

    python bench/bench_codec.py --hardening [--baseline REF] [--repeats 9]

* The cost of the hardening: encode and decode throughput of this codec against the codec
  at a git ref (default 641b54d, format 2: the cost of format 3's chunks bound to their
  blob and position, bounds, zstd frame checks and the one content check), loaded from
  `git show REF:...` into a temporary folder at run time (the one-module codec of early
  refs, or the `codec/` package of later ones), in the same process, interleaved call by
  call. Target: >= 0.90x on every row. Writes bench/results/codec_hardening_<machine>.md
  and .json (`codec_hardening_<REF>_<machine>` for another ref).
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from harness import env_info, to_markdown, write_atomic  # noqa: E402

from replay_ops.router_replay import codec  # noqa: E402

DATA = ROOT / "bench" / "data" / "dev_qwen3moe_e128_k8_l8.npz"

NOTES = """## Reading the results

* The machine is shared with other jobs (2 cores): CPU times are the best of the repeats,
  and the throughputs still move by 10-20% between runs.
* The general compressor is zstd (`zstandard`); no entropy coder was written by hand, so
  none is compared here. The per-row transform (sorting network, Lehmer-coded order,
  per-layer relabelling for `keep`, token regrouping, layer-major layout) is what the codec
  adds; zstd's level trades encode speed for size (levels 6-9: 8.6-8.7x at 100-150 MB/s;
  19: 9.9x at 10 MB/s).
* `set` at the default level misses 9x: 7.9x with token ids (8.2x with one 32768-token
  chunk), 7.0x without. "Transforms tried" measures coding each row against an earlier
  occurrence of the same token (a kept-mask + the added ids): 9.3x on one 32768-token
  chunk against the previous occurrence, but its decode follows each token's chain of
  occurrences, one vectorised step per occurrence index (761 here); capping the chain
  keeps most of it (restarted every 32 occurrences: 9.1x in 32 steps; every 8: 8.8x) and
  against the first occurrence (one gather) 8.5x. Each decode step is a ragged gather and
  the rows must be sorted again (a sorting network), a few ms per 16384-token chunk in
  numpy on top of the 2 ms that 1 GB/s allows: none of them is in the codec. A native
  or GPU decoder would make them usable.
* zstd settings ("zstd settings"): long-distance matching and bigger tables change
  nothing on this stream; the lazy strategies gain 3-9% but take 1.9-3x the compress
  time of level 3, which the 200 MB/s encode target does not leave.
* Decode with token ids pays for regrouping (sorting the token ids again, one gather per
  chunk): about 1 GB/s, at the target's edge (0.9-1.03 GB/s over runs on this shared
  machine); without token ids the decode is 1.2-1.5 GB/s.
* `keep` (format 2) codes each row's order as the Lehmer code of its slot order, most
  significant byte (the top slot's rank) first, and relabels the ids per layer by their
  mean slot over the chunk (a 1 KB table per chunk here): the top-scoring experts of a
  layer get the small labels, so a row's slot order is close to its ascending order and
  the code is small ("How `keep` codes each row's order": 4.02x against format 1's 3.80x
  without token ids, 4.26x against 4.09x with them). The relabelling costs encode time
  (about 150 MB/s against format 1's 230-260). Rows of 8 ids still take log2(8!) = 15.3
  bits of order at most; the experts' score order is close to random against their ids.
* Uniform random routing does not compress; such chunks are stored raw, at most the
  uint8 size plus the headers (a few dozen bytes per chunk).
* A chunk is what `decode_sequence` decompresses. The chunk-size table shows what
  sequence-by-sequence independence costs (5.1x at one 512-token sequence per chunk).
"""


def best_cpu(fn, repeats):
    """(best thread CPU seconds of one call, the last result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.thread_time()
        out = fn()
        best = min(best, time.thread_time() - t)
    return best, out


def peers(r: np.ndarray, repeats: int):
    import zstandard

    z3 = zstandard.ZstdCompressor(level=3)
    zd = zstandard.ZstdDecompressor()
    T, L, K = r.shape
    shape = r.shape
    rows = []

    def add(name, enc, dec, check):
        te, blob = best_cpu(enc, repeats)
        td, back = best_cpu(lambda: dec(blob), repeats)
        assert np.array_equal(np.asarray(back).reshape(shape).astype(np.int64), check), name
        rows.append((name, len(blob), te, td))

    i64 = r.astype(np.int64)
    add("int32 base64 (SGLang)", lambda: base64.b64encode(r.astype(np.int32).tobytes()),
        lambda b: torch.from_numpy(np.frombuffer(base64.b64decode(b), np.int32).reshape(shape)),
        i64)
    add("int16 (verl)", lambda: r.astype(np.int16).tobytes(),
        lambda b: torch.from_numpy(np.frombuffer(b, np.int16).reshape(shape).copy()), i64)
    add("uint8 (vLLM, E <= 256)", lambda: r.astype(np.uint8).tobytes(),
        lambda b: torch.from_numpy(np.frombuffer(b, np.uint8).reshape(shape).astype(np.int16)),
        i64)
    add("uint8 + zstd-3", lambda: z3.compress(r.astype(np.uint8).tobytes()),
        lambda b: torch.from_numpy(np.frombuffer(zd.decompress(b), np.uint8).reshape(shape)
                                   .astype(np.int16)), i64)
    srt = np.sort(r, axis=-1)
    add("rows sorted (np.sort) + uint8 + zstd-3",
        lambda: z3.compress(np.sort(r, axis=-1).astype(np.uint8).tobytes()),
        lambda b: torch.from_numpy(np.frombuffer(zd.decompress(b), np.uint8).reshape(shape)
                                   .astype(np.int16)), srt.astype(np.int64))
    return rows


def ours(r, tok, lens, order, level, chunk, use_tok, repeats):
    kw = dict(num_experts=128, order=order, level=level, seq_lens=lens, chunk_tokens=chunk,
              token_ids=tok if use_tok else None)
    te, blob = best_cpu(lambda: codec.encode(r, **kw), repeats)
    dt = torch.int16
    out = torch.empty(r.shape, dtype=dt)
    td, back = best_cpu(lambda: codec.decode(blob, token_ids=kw["token_ids"], out=out), repeats)
    want = np.sort(r, axis=-1) if order == "set" else r
    assert np.array_equal(back.numpy(), want.astype(np.int16)), (order, level)
    return len(blob), te, td


def transforms_tried(r: np.ndarray, tok: np.ndarray) -> list[dict]:
    """Per-row transforms measured while designing the codec (sizes only)."""
    import zstandard

    z3 = zstandard.ZstdCompressor(level=3)
    T, L, K = r.shape
    n16 = r.size * 2
    srt = np.sort(r, axis=-1)
    g = np.argsort(tok, kind="stable")
    G = srt[g]
    first = np.ones(T, bool)
    first[1:] = tok[g][1:] != tok[g][:-1]
    rows = []

    def add(name, *streams):
        nb = len(z3.compress(b"".join(np.ascontiguousarray(x).tobytes() for x in streams)))
        rows.append({"transform": name, "bytes": nb, "x_vs_int16": n16 / nb})

    add("sorted ids, token-major (no token ids)", srt)
    add("sorted ids, grouped by token, layer-major (the codec's layout)", G.transpose(1, 0, 2))
    add("sorted ids, grouped by token, token-major", G)
    gaps = G.copy()
    gaps[..., 1:] -= G[..., :-1]
    add("gaps between sorted ids, grouped, layer-major", gaps.transpose(1, 0, 2))
    diff = G.copy()
    diff[1:] -= G[:-1]
    diff[first] = G[first]
    add("slot-wise difference to the token's previous occurrence, layer-major",
        diff.transpose(1, 0, 2))
    m = np.zeros((T, L, 128), bool)
    np.put_along_axis(m, G.astype(np.int64), True, axis=-1)
    bm = np.packbits(m, axis=-1, bitorder="little")
    x = bm.copy()
    x[1:] ^= bm[:-1]
    x[first] = bm[first]
    add("bitmask of E, XOR with the token's previous occurrence, layer-major",
        x.transpose(1, 0, 2))
    idx = np.arange(T)
    head = np.maximum.accumulate(np.where(first, idx, 0))  # the token's first occurrence
    rank = idx - head                                        # occurrence index

    def kept_mask(name, ref, absolute):
        """Rows not `absolute` as the kept-mask of row `ref` + the added ids."""
        has = ~absolute
        C, P = G[has], G[ref[has]]
        in_p = (C[..., :, None] == P[..., None, :]).any(-1)
        kept = (P[..., :, None] == C[..., None, :]).any(-1)
        mask = np.packbits(kept, axis=-1, bitorder="little")[..., 0]
        added = C.transpose(1, 0, 2)[~in_p.transpose(1, 0, 2)]
        add(name, mask.T, added, G[absolute].transpose(1, 0, 2))

    kept_mask("kept-mask of the token's previous occurrence + added ids (+ first "
              f"occurrences; decode: one step per occurrence index, here {rank.max() + 1})",
              idx - 1, first)
    kept_mask("kept-mask of the token's first occurrence + added ids (decode: one gather)",
              head, first)
    for m in (8, 32):
        kept_mask(f"kept-mask of the previous occurrence, chain restarted every {m} "
                  f"occurrences (decode: {m} steps)", idx - 1, rank % m == 0)
    kept_mask("kept-mask of the previous occurrence, every 32nd occurrence against the "
              f"32nd before it (decode: {32 + rank.max() // 32} steps)",
              np.where(rank % 32 == 0, idx - 32, idx - 1), first)
    return rows


def zstd_parameters(r: np.ndarray, tok: np.ndarray, repeats: int) -> list[dict]:
    """zstd settings on the codec's `set` stream (sorted ids grouped by token, layer-major)
    of each 16384-token chunk: bytes and CPU ms for the whole corpus."""
    import zstandard

    P = zstandard.ZstdCompressionParameters.from_level
    streams = []
    for a in range(0, r.shape[0], codec.DEFAULT_CHUNK_TOKENS):
        rr, tt = r[a:a + codec.DEFAULT_CHUNK_TOKENS], tok[a:a + codec.DEFAULT_CHUNK_TOKENS]
        g = np.argsort(tt, kind="stable")
        streams.append(np.ascontiguousarray(np.sort(rr, axis=-1)[g].transpose(1, 0, 2))
                       .tobytes())
    n16 = r.size * 2
    rows = []
    for name, params in [
            ("level 3 (the default: dfast)", P(3)),
            ("level 3, 20-bit hash and chain tables", P(3, hash_log=20, chain_log=20)),
            ("level 3, min_match 6", P(3, min_match=6)),
            ("level 3 with lazy, search_log 2, min_match 5", P(3, strategy=3, search_log=2,
                                                               min_match=5)),
            ("level 3 with lazy2, search_log 2, min_match 5", P(3, strategy=4, search_log=2,
                                                                min_match=5)),
            ("level 3 with lazy2, search_log 3, min_match 5", P(3, strategy=4, search_log=3,
                                                                min_match=5)),
            ("level 3 with long-distance matching", P(3, enable_ldm=True))]:
        c = zstandard.ZstdCompressor(compression_params=params)
        te, zs = best_cpu(lambda: [c.compress(b) for b in streams], repeats)
        dz = zstandard.ZstdDecompressor()
        td, _ = best_cpu(lambda: [dz.decompress(z) for z in zs], repeats)
        nb = sum(len(z) for z in zs)
        rows.append({"zstd": name, "bytes": nb, "x_vs_int16": n16 / nb,
                     "compress_ms": te * 1e3, "decompress_ms": td * 1e3})
    return rows


def keep_orders(r: np.ndarray, tok: np.ndarray) -> list[dict]:
    """How each "keep" row's order is coded (16384-token chunks, zstd-3, the ids' stream
    included): format 1's code, format 2's, and relabelling choices."""
    import zstandard

    z3 = zstandard.ZstdCompressor(level=3)
    n16 = r.size * 2
    out = {}
    for use_tok in (True, False):
        for a in range(0, r.shape[0], codec.DEFAULT_CHUNK_TOKENS):
            x = r[a:a + codec.DEFAULT_CHUNK_TOKENS]
            T, L, K = x.shape
            g = (np.argsort(tok[a:a + T], kind="stable") if use_tok else np.arange(T))
            lab_mean = codec.transform._relabel_table(x, 128)
            cnt = np.stack([np.bincount(x[:, l].reshape(-1), minlength=128) for l in range(L)])
            lab_freq = np.argsort(np.argsort(-cnt, axis=1, kind="stable"), axis=1)
            for name, version, lab in [
                    ("format 1: Lehmer code of the sorted order p, low byte first", 1, None),
                    ("Lehmer code of the slot order q, high byte first", 2, None),
                    ("format 2: ids relabelled per layer by mean slot + q code (+ table)", 2,
                     lab_mean),
                    ("ids relabelled per layer by frequency + q code (+ table)", 2,
                     lab_freq)]:
                y = x if lab is None else codec.transform._apply_labels(x, lab, 128)
                srt, pc = codec.sort_rows(y.reshape(T * L, K), "keep", 128, version)
                pc = pc.reshape(T, L, -1)[g].transpose(1, 0, 2) if use_tok else pc
                ids = srt.reshape(T, L, K)[g].transpose(1, 0, 2) if use_tok else srt
                planes = np.ascontiguousarray(pc.reshape(-1, pc.shape[-1]).T)
                if version == 2:
                    planes = planes[::-1]
                tab = b"" if lab is None else lab.astype(np.uint8).tobytes()
                nb = len(z3.compress(np.ascontiguousarray(ids).tobytes() + tab
                                     + np.ascontiguousarray(planes).tobytes()))
                key = (name, use_tok)
                out[key] = out.get(key, 0) + nb
    return [{"order code": n, "token ids": "yes" if t else "no", "bytes": nb,
             "x_vs_int16": n16 / nb} for (n, t), nb in out.items()]


def uniform_sets(T, L, K, E, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.random((T * L, E))
    return np.argpartition(keys, K, axis=1)[:, :K].reshape(T, L, K).astype(np.uint8)


BASELINE = "641b54d"


def _git(*args: str) -> str:
    import subprocess

    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def _baseline_codec(tmp: str, ref: str = BASELINE):
    """The codec at `ref`, from git, imported from a temporary folder: the one module
    `replay_ops/router_replay/codec.py` of early refs, or the package
    `replay_ops/router_replay/codec/` of later ones (with the `_bounds.py` it imports from
    its parent, laid out as a package of its own)."""
    import importlib.util

    name = "codec_" + "".join(c if c.isalnum() else "_" for c in ref)
    tree = _git("ls-tree", "--name-only", ref, "replay_ops/router_replay/").split()
    if "replay_ops/router_replay/codec.py" in tree:
        path = Path(tmp) / f"{name}.py"
        path.write_text(_git("show", f"{ref}:replay_ops/router_replay/codec.py"))
        spec = importlib.util.spec_from_file_location(name, path)
    else:
        root = Path(tmp) / name
        (root / "codec").mkdir(parents=True)
        (root / "__init__.py").write_text("")
        for rel in _git("ls-tree", "--name-only", ref,
                        "replay_ops/router_replay/codec/").split():
            if rel.endswith(".py"):
                (root / "codec" / Path(rel).name).write_text(_git("show", f"{ref}:{rel}"))
        (root / "_bounds.py").write_text(
            _git("show", f"{ref}:replay_ops/router_replay/_bounds.py"))
        parent = importlib.util.spec_from_file_location(name, root / "__init__.py",
                                                        submodule_search_locations=[str(root)])
        sys.modules[name] = importlib.util.module_from_spec(parent)
        parent.loader.exec_module(sys.modules[name])
        spec = importlib.util.spec_from_file_location(
            f"{name}.codec", root / "codec" / "__init__.py",
            submodule_search_locations=[str(root / "codec")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def hardening(args) -> None:
    """Throughput of this codec against the codec at `args.baseline`, same data, same
    process."""
    import tempfile

    ref = args.baseline
    sha = _git("rev-parse", "--short=12", ref).strip()
    d = np.load(DATA)
    tok, lens = d["token_ids"], d["seq_lens"]
    env = env_info("cpu")
    rows, targets = [], []
    with tempfile.TemporaryDirectory(prefix="codec_baseline_") as tmp:
        old = _baseline_codec(tmp, ref)
        old_version = old.FORMAT_VERSION
        for corpus in ("routing_trained", "routing_random"):
            r = d[corpus]
            n16 = r.size * 2
            for order in codec.ORDERS:
                for use_tok in (True, False):
                    kw = dict(num_experts=128, order=order, level=codec.DEFAULT_LEVEL,
                              seq_lens=lens, token_ids=tok if use_tok else None)
                    ids = kw["token_ids"]
                    out = torch.empty(r.shape, dtype=torch.int16)
                    best = {}
                    blobs = {"old": old.encode(r, **kw), "new": codec.encode(r, **kw)}
                    mods = {"old": old, "new": codec}
                    for _ in range(args.repeats):  # interleaved: both see the same noise
                        for name, m in mods.items():
                            t = time.thread_time()
                            m.encode(r, **kw)
                            te = time.thread_time() - t
                            t = time.thread_time()
                            m.decode(blobs[name], token_ids=ids, out=out)
                            td = time.thread_time() - t
                            want = np.sort(r, axis=-1) if order == "set" else r
                            assert np.array_equal(out.numpy(), want.astype(np.int16))
                            be, bd = best.get(name, (float("inf"), float("inf")))
                            best[name] = (min(be, te), min(bd, td))
                    assert codec.info(blobs["new"]).version == 3
                    row = {"corpus": corpus, "order": order, "token ids": use_tok,
                           f"bytes {ref}": len(blobs["old"]), "bytes now": len(blobs["new"])}
                    for i, what in enumerate(("encode", "decode")):
                        o, n = n16 / best["old"][i] / 1e6, n16 / best["new"][i] / 1e6
                        row[f"{what} MB/s {ref}"] = o
                        row[f"{what} MB/s now"] = n
                        row[f"{what} now/{ref}"] = n / o
                    rows.append(row)
                    print(row, flush=True)
    for what in ("encode", "decode"):
        worst = min(r[f"{what} now/{ref}"] for r in rows)
        geo = float(np.exp(np.mean([np.log(r[f"{what} now/{ref}"]) for r in rows])))
        targets.append({"target": f"{what} throughput >= 0.90x of {ref} (every row)",
                        "measured": f"worst {worst:.3f}x, geometric mean {geo:.3f}x",
                        "status": "met" if worst >= 0.90 else "missed"})
    cols = list(rows[0])
    md = [f"# Routing codec hardening cost against {ref} ({args.out})", "",
          f"Command: `{env['command']}`", "",
          f"Machine: {env['device_name']}; shared with other jobs, noisy. torch "
          f"{env['torch']}; numpy {np.__version__}; zstandard "
          f"{__import__('zstandard').__version__}; git {env['git_sha']}; {env['utc']}", "",
          f"This codec (format {codec.FORMAT_VERSION}) against the codec at {ref} ({sha}, "
          f"format {old_version}, loaded from git into a temporary folder), in one process, "
          "calls interleaved; MB of int16 input "
          "per CPU-second of one thread (time.thread_time, torch threads 1), best of "
          f"{args.repeats}; level {codec.DEFAULT_LEVEL}, chunk_tokens "
          f"{codec.DEFAULT_CHUNK_TOKENS}; decode into a preallocated int16 tensor. Corpus: "
          "bench/data/dev_qwen3moe_e128_k8_l8.npz (T=32768, L=8, K=8, E=128).", "",
          "## Targets", "", to_markdown(targets, ["target", "measured", "status"]), "",
          "## Measurements", "", to_markdown(rows, cols), ""]
    out = ROOT / "bench" / "results"
    write_atomic(out / f"{args.out}.md", "\n".join(md))
    write_atomic(out / f"{args.out}.json", json.dumps(
        {"env": env, "baseline": ref, "baseline_sha": sha, "targets": targets, "rows": rows},
        indent=1)
        + "\n")
    print("\n".join(md))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer levels and chunk sizes")
    ap.add_argument("--hardening", action="store_true",
                    help="only the cost of the checks against the codec at --baseline")
    ap.add_argument("--baseline", default=BASELINE,
                    help=f"the git ref --hardening compares against (default {BASELINE})")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.hardening:
        args.out = args.out or ("codec_hardening_cpu_2core" if args.baseline == BASELINE
                                else f"codec_hardening_{args.baseline}_cpu_2core")
        return hardening(args)
    args.out = args.out or "codec_cpu_2core"
    d = np.load(DATA)
    tok, lens = d["token_ids"], d["seq_lens"]
    env = env_info("cpu")
    levels = [1, 3, 9] if args.quick else [1, 3, 6, 9, 19]
    rows, sizes = [], {}

    def mk(corpus, scheme, nbytes, te, td, n16):
        return {"corpus": corpus, "scheme": scheme, "bytes": nbytes,
                "x_vs_int16": n16 / nbytes, "x_vs_uint8": n16 / 2 / nbytes,
                "encode_MBps": n16 / te / 1e6 if te else None,
                "decode_MBps": n16 / td / 1e6 if td else None}

    for corpus in ("routing_trained", "routing_random", "uniform_random"):
        r = d[corpus] if corpus != "uniform_random" else uniform_sets(*d["routing_trained"].shape,
                                                                      128)
        n16 = r.size * 2
        for name, nb, te, td in peers(r, args.repeats):
            rows.append(mk(corpus, name, nb, te, td, n16))
        for use_tok in (True, False):
            for order in codec.ORDERS:
                for level in levels:
                    if order == "keep" and level not in (1, 3, 9):
                        continue
                    if corpus != "routing_trained" and level not in (3, 19 if not args.quick
                                                                     else 9):
                        continue
                    nb, te, td = ours(r, tok, lens, order, level, codec.DEFAULT_CHUNK_TOKENS,
                                      use_tok, args.repeats)
                    scheme = (f"codec {order} zstd-{level}"
                              f"{' + token ids' if use_tok else ''}")
                    rows.append(mk(corpus, scheme, nb, te, td, n16))
                    sizes[(corpus, order, level, use_tok)] = rows[-1]
        print(f"{corpus}: done", flush=True)

    # chunk size: what decoding one sequence alone costs in size
    chunk_rows = []
    r = d["routing_trained"]
    for chunk in ([512, 16384] if args.quick else [512, 2048, 8192, 16384, 32768]):
        for use_tok in (True, False):
            nb, te, td = ours(r, tok, lens, "set", 3, chunk, use_tok, max(2, args.repeats // 2))
            row = mk("routing_trained", f"set zstd-3, chunk_tokens={chunk}"
                     f"{' + token ids' if use_tok else ''}", nb, te, td, r.size * 2)
            chunk_rows.append(row)

    # transforms tried: sizes only (zstd-3 over the whole corpus as one chunk)
    tried = transforms_tried(d["routing_trained"], tok)
    zparams = zstd_parameters(d["routing_trained"], tok, args.repeats)
    orders = keep_orders(d["routing_trained"], tok)

    # targets
    def status(ok):
        return "met" if ok else "missed"

    targets = []
    default = codec.DEFAULT_LEVEL
    for use_tok in (True, False):
        tag = "with token ids" if use_tok else "without token ids"
        s = sizes[("routing_trained", "set", default, use_tok)]
        targets.append({"target": f"set >= 9x vs int16 (zstd-{default}, {tag})",
                        "measured": f"{s['x_vs_int16']:.2f}x",
                        "status": status(s["x_vs_int16"] >= 9)})
        fast = [v for (c, o, lv, t), v in sizes.items()
                if c == "routing_trained" and o == "set" and t == use_tok]
        best9 = [v for v in fast if v["x_vs_int16"] >= 9]
        if best9:
            b = max(best9, key=lambda v: v["encode_MBps"])
            targets.append({"target": f"set >= 9x ({tag}): fastest level reaching it",
                            "measured": f"{b['scheme']}: {b['x_vs_int16']:.2f}x, encode "
                                        f"{b['encode_MBps']:.0f} MB/s, decode "
                                        f"{b['decode_MBps']:.0f} MB/s",
                            "status": status(b["encode_MBps"] >= 200
                                             and b["decode_MBps"] >= 1000)})
        else:
            targets.append({"target": f"set >= 9x ({tag}) at any level",
                            "measured": f"best {max(v['x_vs_int16'] for v in fast):.2f}x",
                            "status": "missed"})
        top = max(fast, key=lambda v: v["x_vs_int16"])
        targets.append({"target": f"set stretch >= 12x ({tag}), best level",
                        "measured": f"{top['scheme']}: {top['x_vs_int16']:.2f}x",
                        "status": status(top["x_vs_int16"] >= 12)})
        targets.append({"target": f"set encode >= 200 MB/s (zstd-{default}, {tag})",
                        "measured": f"{s['encode_MBps']:.0f} MB/s",
                        "status": status(s["encode_MBps"] >= 200)})
        targets.append({"target": f"set decode >= 1000 MB/s (zstd-{default}, {tag})",
                        "measured": f"{s['decode_MBps']:.0f} MB/s",
                        "status": status(s["decode_MBps"] >= 1000)})
        k = sizes[("routing_trained", "keep", default, use_tok)]
        targets.append({"target": f"keep >= 4x vs int16 (zstd-{default}, {tag})",
                        "measured": f"{k['x_vs_int16']:.2f}x",
                        "status": status(k["x_vs_int16"] >= 4)})
    for order in codec.ORDERS:
        worst = max(v["bytes"] for (c, o, lv, t), v in sizes.items()
                    if c == "uniform_random" and o == order)
        u8 = d["routing_trained"].size
        targets.append({"target": f"uniform random, {order}: <= 1.01 x uint8 bytes (every "
                                  f"level, with and without token ids)",
                        "measured": f"worst {worst / u8:.4f} x uint8",
                        "status": status(worst <= 1.01 * u8)})

    cols = ["corpus", "scheme", "bytes", "x_vs_int16", "x_vs_uint8", "encode_MBps",
            "decode_MBps"]
    tcols = ["target", "measured", "status"]
    md = [f"# Routing codec on the dev corpus ({args.out})", "",
          f"Command: `{env['command']}`", "",
          f"Machine: {env['device_name']}; shared with other jobs, noisy. torch "
          f"{env['torch']}; numpy {np.__version__}; zstandard "
          f"{__import__('zstandard').__version__}; git {env['git_sha']}; {env['utc']}", "",
          "Corpus: bench/data/dev_qwen3moe_e128_k8_l8.npz (T=32768 tokens in 64 sequences of "
          "512, L=8, K=8, E=128; `routing_trained` in score order, `routing_random` from the "
          "untrained model, `uniform_random`: uniform random sets generated here). int16 "
          f"size {d['routing_trained'].size * 2} bytes.", "",
          "Throughput: MB of int16-equivalent input per CPU-second of one thread "
          f"(time.thread_time, torch threads 1), best of {args.repeats}. Our decode writes "
          "into a preallocated int16 tensor (`out=`). Default chunk_tokens="
          f"{codec.DEFAULT_CHUNK_TOKENS}, default level {codec.DEFAULT_LEVEL}.", "",
          "## Targets", "", to_markdown(targets, tcols), "", NOTES, "",
          "## All measurements", "", to_markdown(rows, cols), "",
          "## Chunk size (what a sequence that decodes alone costs)", "",
          to_markdown(chunk_rows, cols), "",
          "## Transforms tried (trained routing, token ids given, one 32768-token chunk, "
          "zstd-3; sizes only)", "",
          "The codec ships the first two; the others were measured and not adopted.", "",
          to_markdown(tried, ["transform", "bytes", "x_vs_int16"]), "",
          "## zstd settings (the `set` stream with token ids, 16384-token chunks; CPU ms "
          f"for the corpus, best of {args.repeats})", "",
          to_markdown(zparams, ["zstd", "bytes", "x_vs_int16", "compress_ms",
                                "decompress_ms"]), "",
          "## How `keep` codes each row's order (16384-token chunks, zstd-3, sizes only)",
          "", to_markdown(orders, ["order code", "token ids", "bytes", "x_vs_int16"]), ""]
    out = ROOT / "bench" / "results"
    write_atomic(out / f"{args.out}.md", "\n".join(md))
    write_atomic(out / f"{args.out}.json", json.dumps(
        {"env": env, "targets": targets, "rows": rows, "chunk_rows": chunk_rows,
         "transforms_tried": tried, "zstd_settings": zparams, "keep_orders": orders},
        indent=1)
        + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
