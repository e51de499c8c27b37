"""THD packing and the context-parallel split of replay routing (pure torch; the
multi-rank SP/CP collectives and the comparison with Megatron-Core's own CP split are in
test_megatron_dist.py)."""
from __future__ import annotations

import math

import pytest
import torch

from replay_ops.integrations.megatron import data as md
from replay_ops.router_replay import adapters

E, K, L = 16, 2, 3


def seq_routing(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)])
                        for _ in range(n)]).to(torch.int32)


def test_pack_thd_rollout_rows_placeholder_and_alignment():
    lens = [5, 3, 8]
    routes = [seq_routing(n - 1, i) for i, n in enumerate(lens)]  # vLLM/SGLang: len-1 rows
    p = md.pack_megatron_thd(routes, lens, align=4, num_experts=E)
    # independent construction: each sequence padded to a multiple of 4
    padded = [8, 4, 8]
    assert p.cu_seqlens.tolist() == [0, 5, 8, 16]
    assert p.cu_seqlens_padded.tolist() == [0, 8, 12, 20]
    assert p.indices.dtype == torch.int16 and p.indices.shape == (20, L, K)
    start = 0
    for r, n, pad in zip(routes, lens, padded):
        assert torch.equal(p.indices[start:start + n - 1], r.to(torch.int16))
        assert (p.indices[start + n - 1:start + pad] == -1).all()  # placeholder + padding
        assert p.replay_mask[start:start + n - 1].all()
        assert not p.replay_mask[start + n - 1:start + pad].any()
        start += pad
    back = md.unpack_thd(p, with_placeholder=False)
    assert all(torch.equal(b, r.to(torch.int16)) for b, r in zip(back, routes))


def test_pack_thd_from_adapter_sequences_matches_vllm_layout():
    layout = adapters.ModelShape(E, K, (0, 1, 2), 3)
    lens = [(4, 3), (2, 5)]  # (prompt, response)
    routed = [seq_routing(p + r - 1, 10 + i) for i, (p, r) in enumerate(lens)]
    seqs = adapters.vllm_sequences(routed, [p for p, _ in lens], [r for _, r in lens], layout)
    p = md.pack_megatron_thd(seqs, align=2)
    ref = adapters.pack_thd(seqs)  # the adapters' unpadded THD
    assert p.cu_seqlens.tolist() == ref.cu_seqlens.tolist() == [0, 7, 14]
    assert p.cu_seqlens_padded.tolist() == [0, 8, 16]
    assert torch.equal(p.indices[0:7], ref.indices[0:7])
    assert torch.equal(p.indices[8:15], ref.indices[7:14])
    assert torch.equal(p.replay_mask[8:15], ref.replay_mask[7:14])
    assert not p.replay_mask[7] and not p.replay_mask[15]


@pytest.mark.parametrize("tp,cp,fp8", [(1, 1, False), (2, 1, False), (2, 2, False), (1, 3, False),
                                       (2, 2, True), (1, 1, True)])
def test_megatron_alignment_and_fp8_total(tp, cp, fp8):
    align, total = md.megatron_thd_alignment(tp, cp, fp8=fp8)
    base = tp * cp * 2 if cp > 1 else tp
    assert align == (math.lcm(16, base) if fp8 else base)
    assert total == (base * 128 if fp8 else 1)
    lens = [7, 13, 2]
    p = md.pack_megatron_thd([seq_routing(n, n) for n in lens], lens, align=align, total_align=total)
    pl = p.padded_lens()
    assert all(x % align == 0 for x in pl[:-1])
    assert int(p.cu_seqlens_padded[-1]) % total == 0
    assert all(x >= n for x, n in zip(pl, lens))


def test_pack_thd_uses_token_cu_seqlens_padded():
    lens = [3, 5]
    p = md.pack_megatron_thd([seq_routing(n - 1, n) for n in lens], lens, cu_seqlens_padded=[0, 4, 12])
    assert p.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert (p.indices[3:4] == -1).all() and (p.indices[9:12] == -1).all()


def test_pack_thd_wrong_layout_is_detected():
    r = [seq_routing(4, 0), seq_routing(6, 1)]
    with pytest.raises(md.LayoutError, match=r"sequence 1 has 6 routing rows but 9 tokens"):
        md.pack_megatron_thd(r, [5, 9])
    with pytest.raises(md.LayoutError, match=r"2 routings but 3 sequence lengths"):
        md.pack_megatron_thd(r, [5, 7, 3])
    with pytest.raises(md.LayoutError, match=r"sequence 1 has 7 tokens but cu_seqlens_padded gives it 5"):
        md.pack_megatron_thd(r, [5, 7], cu_seqlens_padded=[0, 6, 11])
    with pytest.raises(md.LayoutError, match=r"not a multiple of align=4"):
        md.pack_megatron_thd(r, [5, 7], cu_seqlens_padded=[0, 6, 14], align=4)
    bad = seq_routing(4, 0)
    bad[2, 1, 0] = E + 3  # a physical (EPLB replica) id, not a logical one
    with pytest.raises(md.LayoutError, match=r"sequence 0: token 2, layer column 1 .* expert id 19, "
                                             r"outside 0..15 .*logical expert ids"):
        md.pack_megatron_thd([bad], [5], num_experts=E)
    # uint8 is an integer type like any other: its 255 (record files' stand-in for an
    # empty slot) is expert 255, out of range here, never an empty slot
    u8 = seq_routing(4, 0).to(torch.uint8)
    u8[1, 0, 1] = 255
    with pytest.raises(md.LayoutError, match=r"token 1, layer column 0 .* slot 1 holds expert id "
                                             r"255, .*torch.uint8, which cannot hold -1"):
        md.pack_megatron_thd([u8], [5], num_experts=E)


def zigzag_by_definition(total_lens, cp, r):
    """Rows rank r holds, from the definition: chunk r and chunk 2cp-1-r of every sequence."""
    rows, s = [], 0
    for n in total_lens:
        c = n // (2 * cp)
        chunks = [list(range(s + j * c, s + (j + 1) * c)) for j in range(2 * cp)]
        rows += chunks[r] + chunks[2 * cp - 1 - r]
        s += n
    return rows


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_cp_split_round_trip(cp, layout):
    lens = [9, 4, 15]
    align, _ = md.megatron_thd_alignment(1, cp)
    p = md.pack_megatron_thd([seq_routing(n - 1, 20 + n) for n in lens], lens, align=align)
    parts = [md.cp_split(p, cp, r, layout) for r in range(cp)]
    for r, part in enumerate(parts):
        want = (zigzag_by_definition(p.padded_lens(), cp, r) if layout == "zigzag" else
                [i for s, n in zip(p.cu_seqlens_padded[:-1].tolist(), p.padded_lens())
                 for i in range(s + r * n // cp, s + (r + 1) * n // cp)])
        assert torch.equal(part.indices, p.indices[want])
        assert torch.equal(part.replay_mask, p.replay_mask[want])
        assert part.num_tokens * cp == p.num_tokens
    whole = md.cp_gather(parts)
    assert torch.equal(whole.indices, p.indices) and torch.equal(whole.replay_mask, p.replay_mask)
    assert whole.cp_size == 1


def test_cp_wrong_layout_is_detected():
    lens = [8, 8]
    p = md.pack_megatron_thd([seq_routing(n, n) for n in lens], lens, align=4)
    zig = [md.cp_split(p, 2, r, "zigzag") for r in range(2)]
    with pytest.raises(md.LayoutError, match=r"split with scheme='zigzag' but the gather is for "
                                             r"scheme='contiguous'"):
        md.cp_gather(zig, scheme="contiguous")
    with pytest.raises(md.LayoutError, match=r"part 0 is .*cp_rank=1.*rank order"):
        md.cp_gather(zig[::-1])
    with pytest.raises(md.LayoutError, match="already split"):
        md.cp_split(zig[0], 2, 0)
    odd = md.pack_megatron_thd([seq_routing(5, 1)], [6], align=2)  # not padded for zigzag CP=2
    with pytest.raises(md.LayoutError, match=r"sequence 0 is padded to 6 rows, not a multiple of 4"):
        md.cp_split(odd, 2, 0, "zigzag")
    with pytest.raises(md.LayoutError, match="gather it first"):
        md.unpack_thd(zig[0])


def test_sp_scatter_single_rank_and_bad_split():
    x = torch.arange(12)
    assert md.sp_scatter(x, None) is x
    assert md.sp_gather(x, None) is x


def test_import_is_lazy():
    """`import replay_ops` and the data-path helpers never import megatron-core."""
    import subprocess
    import sys

    code = ("import sys, replay_ops; from replay_ops.integrations.megatron import pack_megatron_thd, "
            "cp_split, sp_scatter; assert not any(m.split('.')[0] == 'megatron' for m in "
            "sys.modules), sorted(m for m in sys.modules if m.startswith('megatron'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_megatron_padding_is_a_step_on_the_adapters_batch():
    """One type for routing in a training format: Megatron's padding (`pad_thd`) and CP
    split take the adapters' THD batch and return the same type."""
    shape = adapters.ModelShape(E, K, (0, 1, 2), 3)
    lens = [(3, 2), (1, 4)]
    routed = [seq_routing(p + r - 1, 30 + i) for i, (p, r) in enumerate(lens)]
    seqs = adapters.vllm_sequences(routed, [p for p, _ in lens], [r for _, r in lens], shape)
    thd = adapters.pack_thd(seqs)
    padded = md.pad_thd(thd, align=4)
    assert isinstance(padded, adapters.ReplayBatch)
    assert padded.cu_seqlens.tolist() == [0, 5, 10] and padded.cu_seqlens_padded.tolist() == [0, 8, 16]
    assert padded.mappings == thd.mappings == ["moe", "moe"]
    want = md.pack_megatron_thd(seqs, align=4)
    assert torch.equal(padded.indices, want.indices)
    assert torch.equal(padded.replay_mask, want.replay_mask)
    assert torch.equal(padded.indices[0:5], thd.indices[0:5])
    assert (padded.indices[5:8] == -1).all() and not padded.replay_mask[5:8].any()
    # the unpadded batch's rows come back from either
    for b in (thd, padded):
        back = md.unpack_thd(b)
        assert [t.shape[0] for t in back] == [5, 5]
        assert torch.equal(back[1], thd.indices[5:10])
    with pytest.raises(md.LayoutError, match="padded or split already"):
        md.pad_thd(padded, align=4)
    # a Megatron stage does not travel as bytes (its fields would be lost), but pickles whole
    with pytest.raises(adapters.RoutingMismatchError, match="padded for Megatron"):
        padded.to_bytes()
    import pickle

    share = md.cp_split(padded, 2, 1, "zigzag")
    again = pickle.loads(pickle.dumps(share))
    assert (again.cp_size, again.cp_rank, again.cp_scheme) == (2, 1, "zigzag")
    assert torch.equal(again.indices, share.indices)
    assert torch.equal(again.cu_seqlens_padded, padded.cu_seqlens_padded)


def test_deprecated_names_warn_and_still_work():
    from replay_ops.integrations import megatron as rom

    lens = [8, 8]
    routes = [seq_routing(n, n) for n in lens]
    with pytest.warns(DeprecationWarning, match="use ReplayBatch"):
        assert md.PackedRouting is adapters.ReplayBatch
    with pytest.warns(DeprecationWarning, match="use ReplayBatch"):
        assert rom.PackedRouting is adapters.ReplayBatch
    with pytest.warns(DeprecationWarning, match="use CP_SCHEMES"):
        assert rom.CP_LAYOUTS == md.CP_SCHEMES == ("zigzag", "contiguous")
    with pytest.warns(DeprecationWarning, match="use pack_megatron_thd"):
        old = rom.pack_thd(routes, lens, align=4)
    new = md.pack_megatron_thd(routes, lens, align=4)
    assert torch.equal(old.indices, new.indices) and torch.equal(old.replay_mask, new.replay_mask)
    with pytest.warns(DeprecationWarning, match=r"cp_split\(layout=...\) is deprecated; use scheme="):
        a = md.cp_split(new, 2, 0, layout="contiguous")
    assert a.cp_scheme == "contiguous"
    assert torch.equal(a.indices, md.cp_split(new, 2, 0, "contiguous").indices)
    with pytest.warns(DeprecationWarning, match="use ReplayBatch.cp_scheme"):
        assert a.cp_layout == "contiguous"
    with pytest.warns(DeprecationWarning, match=r"cp_gather\(layout=...\) is deprecated"):
        whole = md.cp_gather([md.cp_split(new, 2, r, "contiguous") for r in range(2)],
                             layout="contiguous")
    assert torch.equal(whole.indices, new.indices)
    with pytest.warns(DeprecationWarning, match=r"cp_partition_index\(layout=...\)"):
        idx = md.cp_partition_index([0, 8], 2, 1, layout="zigzag")
    assert idx.tolist() == [2, 3, 4, 5]
