"""Record files: format, round trip, append, atomicity under a killed writer, bad files."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from replay_ops.router_replay import RouterReplay, RouterReplayConfig
from replay_ops.router_replay import files
from replay_ops.router_replay.files import (
    RecordMeta,
    RoutingFileError,
    RoutingShapeError,
    append_routing,
    open_routing,
    write_routing,
)

MOE_IDS = [1, 2, 4]


def meta(E=8, K=2, layer_index="moe", name="tiny") -> RecordMeta:
    return RecordMeta(num_experts=E, top_k=K, moe_layer_ids=list(MOE_IDS), num_hidden_layers=5,
                      layer_index=layer_index, model_name=name)


def routing(N, L=3, K=2, E=8, seed=0) -> torch.Tensor:
    """[N, L, K] int32 with K distinct experts per (token, layer), in 0..E-1."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, E, (N, L, 1), generator=g)
    if E > K:
        step = torch.randint(1, E // K + 1, (N, L, 1), generator=g)
    else:
        step = torch.ones(N, L, 1, dtype=torch.int64)
    return ((first + step * torch.arange(K)) % E).to(torch.int32)


# ------------------------------------------------------------------ format and round trip
@pytest.mark.parametrize("encoding", files.ENCODINGS)
@pytest.mark.parametrize("E, dtype", [(8, np.uint8), (255, np.uint8), (256, np.int16),
                                      (32767, np.int16)])
def test_smallest_dtype_and_round_trip(tmp_path, E, dtype, encoding):
    p = tmp_path / "r.safetensors"
    idx = routing(7, E=E, seed=E)
    idx[3] = -1  # a token with no route
    idx[5, 1, 1] = -1  # one empty slot
    write_routing(p, idx, meta(E=E), cu_seqlens=[0, 3, 3, 7], encoding=encoding)
    rf = open_routing(p)
    assert rf.encoding == encoding
    # the stored type and empty value of the model's ids, whichever encoding stored them
    assert rf.dtype == np.dtype(dtype)
    assert rf.empty_value == (255 if dtype == np.uint8 else -1)
    assert rf.raw().dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
    out = rf.indices()
    assert out.dtype == torch.int16 and torch.equal(out.to(torch.int32), idx)
    assert rf.cu_seqlens.tolist() == [0, 3, 3, 7] and rf.num_sequences == 3
    assert torch.equal(rf.sequence(2).to(torch.int32), idx[3:7])
    assert rf.sequence(1).shape == (0, 3, 2)
    assert rf.replay_mask().tolist() == [True, True, True, False, True, True, True]
    if dtype == np.uint8:  # the stored sentinel for an empty slot is 255
        assert int(rf.raw()[5, 1, 1]) == 255
    m = rf.meta
    assert (m.num_experts, m.top_k, m.moe_layer_ids, m.num_hidden_layers, m.layer_index,
            m.model_name) == (E, 2, MOE_IDS, 5, "moe", "tiny")


def test_too_many_experts():
    with pytest.raises(ValueError, match="at most 32767 experts, got num_experts=32768"):
        files.index_dtype(32768)


def test_readable_by_safetensors_and_documented_layout(tmp_path):
    p = tmp_path / "r.safetensors"
    idx = routing(5, seed=1)
    write_routing(p, idx, meta(), cu_seqlens=[0, 2, 5], encoding="raw")
    with safe_open(str(p), framework="pt") as f:
        md = f.metadata()
        assert sorted(f.keys()) == ["cu_seqlens", "indices"]
        assert f.get_tensor("indices").dtype == torch.uint8
        assert torch.equal(f.get_tensor("indices").to(torch.int32), idx)
        assert f.get_tensor("cu_seqlens").tolist() == [0, 2, 5]
    assert md["format"] == "replay_ops.router_replay" and md["format_version"] == "3"
    assert md["indices_encoding"] == "raw" and json.loads(md["indices_shape"]) == [5, 3, 2]
    assert json.loads(md["moe_layer_ids"]) == MOE_IDS
    assert (md["num_experts"], md["top_k"], md["layer_index"], md["empty_value"]) == (
        "8", "2", "moe", "255")
    # the checksum is the sha256 of every byte after the header
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    import hashlib

    assert md["checksum"] == "sha256:" + hashlib.sha256(raw[8 + n:]).hexdigest()
    # the header checksum is the sha256 of the header's JSON (sorted keys, no spaces)
    # without the header_checksum entry itself
    header = json.loads(raw[8:8 + n])
    del header["__metadata__"]["header_checksum"]
    canon = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert md["header_checksum"] == "sha256:" + hashlib.sha256(canon).hexdigest()


@pytest.mark.parametrize("mmap", [False, True])
def test_int16_read_is_a_view_of_the_data_read(tmp_path, mmap):
    """A raw int16 file's indices view the bytes read (private memory, or with mmap=True
    the map): no copy."""
    p = tmp_path / "r.safetensors"
    write_routing(p, routing(64, E=300, seed=2), meta(E=300), encoding="raw")
    rf = open_routing(p, verify=not mmap, mmap=mmap)
    assert isinstance(rf.raw_np, np.memmap) == mmap and rf.mapped == mmap
    t = rf.indices(10, 20)
    base_ptr = rf.raw_np.ctypes.data
    assert t.data_ptr() == base_ptr + 10 * 3 * 2 * 2  # no copy: it points into the data
    with pytest.raises(ValueError, match="mmap=True .* pass verify=False"):
        open_routing(p, mmap=True)


def test_absolute_layer_index_and_replay_load(tmp_path):
    p = tmp_path / "abs.safetensors"
    idx = torch.full((4, 5, 2), -1, dtype=torch.int32)
    moe = routing(4, seed=3)
    idx[:, MOE_IDS] = moe
    write_routing(p, idx, meta(layer_index="absolute"))
    rr = RouterReplay(RouterReplayConfig(mode="R2"), num_experts=8, top_k=2,
                      moe_layer_ids=MOE_IDS, num_hidden_layers=5)
    rr.load(p)
    assert rr.layer_mapping == "absolute"
    for n, lid in enumerate(MOE_IDS):
        assert torch.equal(rr.routing_for(lid).to(torch.int32), moe[:, n])


def test_write_rejects_bad_routing(tmp_path):
    p = tmp_path / "r.safetensors"
    bad = routing(4, seed=4)
    bad[2, 1, 0] = 8
    with pytest.raises(ValueError, match=r"indices\[2, 1, 0\] \(token 2\) = 8 is out of range"):
        write_routing(p, bad, meta())
    dup = routing(4, seed=4)
    dup[3, 0] = torch.tensor([0, 0])  # a zero-filled row is not a route
    with pytest.raises(ValueError, match=r"token 3, layer 0 repeats an expert: \[0, 0\]"):
        write_routing(p, dup, meta())
    with pytest.raises(ValueError, match="L=3"):
        write_routing(p, routing(4, L=5), meta())
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, end at the token count N=4"):
        write_routing(p, routing(4), meta(), cu_seqlens=[0, 5])
    assert not p.exists()


# ------------------------------------------------------------------ append
def test_append_concatenates_batches(tmp_path):
    p = tmp_path / "r.safetensors"
    a, b, c = routing(5, seed=5), routing(3, seed=6), routing(4, seed=7)
    append_routing(p, a, meta(), cu_seqlens=[0, 2, 5])
    append_routing(p, b, meta())
    append_routing(p, c, meta(), cu_seqlens=[0, 1, 4])
    rf = open_routing(p)
    assert torch.equal(rf.indices().to(torch.int32), torch.cat([a, b, c]))
    assert rf.cu_seqlens.tolist() == [0, 2, 5, 8, 9, 12]
    assert sorted(os.listdir(tmp_path)) == [".r.safetensors.lock", "r.safetensors"]


def test_append_refuses_other_model_and_corrupt_file_without_touching_it(tmp_path):
    p = tmp_path / "r.safetensors"
    write_routing(p, routing(5, seed=8), meta())
    before = p.read_bytes()
    with pytest.raises(RoutingShapeError, match=r"num_experts: file 8, model 16"):
        append_routing(p, routing(2, E=16), meta(E=16))
    assert p.read_bytes() == before
    corrupt = bytearray(before)
    corrupt[-1] ^= 0xFF
    p.write_bytes(bytes(corrupt))
    with pytest.raises(RoutingFileError, match="checksum mismatch"):
        append_routing(p, routing(2), meta())
    assert p.read_bytes() == bytes(corrupt)


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from replay_ops.router_replay import files
    path, n = sys.argv[1], int(sys.argv[2])
    files._CHUNK_BYTES = 1 << 16
    state = {"chunks": 0}
    def hook():
        state["chunks"] += 1
        if state["chunks"] == 4:
            print("MIDWRITE", flush=True)
            time.sleep(120)  # the parent kills us here, mid-write
    files._chunk_hook = hook
    t = torch.arange(n)
    idx = torch.stack([t % 8, (t + 1) % 8], -1)[:, None, :].expand(n, 3, 2).to(torch.int32)
    meta = files.RecordMeta(num_experts=8, top_k=2, moe_layer_ids=[1, 2, 4],
                            num_hidden_layers=5, model_name="tiny")
    files.append_routing(path, idx, meta, encoding="raw")
    print("DONE", flush=True)
    """
)


def test_killed_writer_leaves_previous_file_intact(tmp_path):
    p = tmp_path / "r.safetensors"
    old = routing(50, seed=9)
    write_routing(p, old, meta(), cu_seqlens=[0, 20, 50], encoding="raw")
    before = p.read_bytes()
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(p), "200000"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "MIDWRITE", line
        temps = [f for f in os.listdir(tmp_path) if f.startswith(".r.safetensors.tmp-")]
        full_size = 8 + 1000 + (200000 + 50) * 3 * 2  # more than the header + data of the new file
        assert len(temps) == 1 and 0 < os.path.getsize(tmp_path / temps[0]) < full_size - 10**5
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=300)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    # the previous file is untouched and loads; the partial temporary is not the file
    assert p.read_bytes() == before
    rf = open_routing(p)
    assert torch.equal(rf.indices().to(torch.int32), old)
    assert rf.cu_seqlens.tolist() == [0, 20, 50]
    with pytest.raises(RoutingFileError):  # the partial temporary is recognisably broken
        open_routing(tmp_path / temps[0])
    # the next append works and removes the dead writer's temporary
    new = routing(3, seed=10)
    append_routing(p, new, meta())
    assert torch.equal(open_routing(p).indices().to(torch.int32), torch.cat([old, new]))
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


# ------------------------------------------------------------------ bad files
@pytest.fixture
def good(tmp_path):
    p = tmp_path / "good.safetensors"
    write_routing(p, routing(40, seed=11), meta(), cu_seqlens=[0, 15, 40], encoding="raw")
    return p


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def test_truncated_files(good, tmp_path):
    data = good.read_bytes()
    for cut, what in ((4, "shorter than the 8-byte header length field"),
                      (8 + _header_len(data) // 2, "the header needs"),
                      (len(data) - 7, "the header describes 264 data bytes but only 257")):
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(data[:cut])
        with pytest.raises(RoutingFileError, match=what) as ei:
            open_routing(p)
        assert str(p) in str(ei.value) and "truncated" in str(ei.value)


def test_corrupt_header(good, tmp_path):
    data = bytearray(good.read_bytes())
    p = tmp_path / "badjson.safetensors"
    data[10:20] = b"\x00" * 10
    p.write_bytes(bytes(data))
    with pytest.raises(RoutingFileError, match=r"badjson.safetensors.*corrupt header") as ei:
        open_routing(p)
    assert "not valid JSON" in str(ei.value)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(RoutingFileError, match="corrupt: header length field says"):
        open_routing(huge)
    trailing = tmp_path / "trailing.safetensors"
    trailing.write_bytes(good.read_bytes() + b"xx")
    with pytest.raises(RoutingFileError, match="2 unexpected bytes after the data"):
        open_routing(trailing)


def test_wrong_checksum(good, tmp_path):
    data = bytearray(good.read_bytes())
    data[-3] ^= 0x01  # one bit of one expert id
    p = tmp_path / "flipped.safetensors"
    p.write_bytes(bytes(data))
    with pytest.raises(RoutingFileError, match=r"flipped.safetensors.*checksum mismatch"):
        open_routing(p)
    rf = open_routing(p, verify=False)  # explicitly unverified: opens, and verify() still fails
    with pytest.raises(RoutingFileError, match="checksum mismatch"):
        rf.verify()


def test_version_mismatch(good, tmp_path):
    data = good.read_bytes()
    assert data.count(b'"format_version":"3"') == 1
    p = tmp_path / "v4.safetensors"
    p.write_bytes(data.replace(b'"format_version":"3"', b'"format_version":"4"'))
    with pytest.raises(RoutingFileError, match=r"v4.safetensors.*format_version '4' is not "
                                               r"supported; this reader reads versions 1, 2, 3"):
        open_routing(p)


def test_not_a_record_file(tmp_path):
    p = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(3)}, str(p))
    with pytest.raises(RoutingFileError, match="not a router replay record file"):
        open_routing(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_routing(tmp_path / "missing.safetensors")


def test_shape_mismatch_names_file_and_both_values(good):
    rf = open_routing(good)
    with pytest.raises(RoutingShapeError, match=r"good.safetensors.*num_experts: file 8, model "
                                                r"16.*top_k: file 2, model 4"):
        rf.check_model(num_experts=16, top_k=4, moe_layer_ids=MOE_IDS)
    with pytest.raises(RoutingShapeError,
                       match=r"moe_layer_ids: file \[1, 2, 4\], model \[0, 1, 2\]"):
        rf.check_model(num_experts=8, top_k=2, moe_layer_ids=[0, 1, 2])
    rr = RouterReplay(RouterReplayConfig(mode="R2", model_name="other"), num_experts=8, top_k=2,
                      moe_layer_ids=MOE_IDS, num_hidden_layers=5)
    with pytest.raises(RoutingShapeError, match="model_name: file 'tiny', model 'other'"):
        rr.load(good)


def test_router_replay_load_selects_sequences_and_views_the_data(tmp_path):
    p = tmp_path / "r.safetensors"
    idx = routing(9, E=300, seed=12)
    write_routing(p, idx, meta(E=300), cu_seqlens=[0, 4, 6, 9], encoding="raw")
    rr = RouterReplay(RouterReplayConfig(mode="R2"), num_experts=300, top_k=2,
                      moe_layer_ids=MOE_IDS, num_hidden_layers=5)
    rf = rr.load(p, sequences=(1, 3))
    view = rr.routing_for(4)
    assert torch.equal(view.to(torch.int32), idx[4:9, 2])
    assert view.data_ptr() == rf.raw_np.ctypes.data + (4 * 3 + 2) * 2 * 2  # into the data
    with pytest.raises(IndexError, match=r"sequences=\(2, 4\) is outside the file's 3 sequences"):
        rr.load(p, sequences=(2, 4))


def test_command_line_info_and_verify(tmp_path, good):
    bad = tmp_path / "bad.safetensors"
    data = bytearray(good.read_bytes())
    data[-1] ^= 0x10
    bad.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", "replay_ops.router_replay"]
    out = subprocess.run(cmd + ["info", str(good)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["num_tokens"], info["num_sequences"], info["moe_layer_ids"], info["dtype"]) == (
        40, 2, MOE_IDS, "uint8")
    out = subprocess.run(cmd + ["verify", str(good), str(bad)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1 and f"OK   {good}" in out.stdout
    assert "bad.safetensors" in out.stderr and "checksum mismatch" in out.stderr


def _checksummed(path, blob: bytes | None = None, raw: np.ndarray | None = None,
                 cu=(0, 8, 20), E=8):
    """A record file of `blob` (codec) or `raw` ids written with every checksum right, as a
    sender who means harm (or a writer with a bug) would: the data is whatever it is."""
    m = meta(E=E)
    cu = np.asarray(cu, dtype=np.int64)
    if blob is not None:
        files._write(path, m, cu, [], m.num_layers, codec_blob=blob)
    else:
        files._write(path, m, cu, [raw], m.num_layers)


def test_command_line_decodes_what_it_verifies(tmp_path):
    """`verify` once said OK for a codec file whose checksums are right but whose data does
    not decode, and `info` died on it with a traceback; both now decode the whole file and
    check every route, and end in the package's error with exit status 1 (a FIFO too)."""
    import sys as _sys

    _sys.path.insert(0, os.path.dirname(__file__))
    from _codec_forge import reseal, split

    good = tmp_path / "good.safetensors"
    write_routing(good, routing(20, seed=50), meta(), cu_seqlens=[0, 8, 20])
    v, head, ext, ch = split(bytes(open_routing(good).raw_np))
    ch[-1].fields[10] ^= 1  # the content checksum of the last chunk
    undecodable = tmp_path / "undecodable.safetensors"
    _checksummed(undecodable, blob=reseal(v, head, ext, ch))
    out_of_range = tmp_path / "range.safetensors"
    raw = routing(20, seed=51).numpy().astype(np.uint8)
    raw[13, 1, 0] = 9  # E = 8
    _checksummed(out_of_range, raw=raw)
    repeated = tmp_path / "repeat.safetensors"
    raw = routing(20, seed=52).numpy().astype(np.uint8)
    raw[4, 2] = 3
    _checksummed(repeated, raw=raw)
    fifo = tmp_path / "routing.fifo"
    os.mkfifo(fifo)
    want = {undecodable: "decoded content checksum mismatch",
            out_of_range: "token 13, layer 2 (slot 0) routes to expert 9, out of range",
            repeated: "token 4, layer 4 (slot 1) repeats an expert: [3, 3]",
            fifo: "not a regular file (a FIFO)"}
    cmd = [sys.executable, "-m", "replay_ops.router_replay"]
    for command in ("verify", "info"):
        out = subprocess.run(cmd + [command, str(good)] + [str(p) for p in want],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 1, (command, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
        bad = out.stderr.splitlines()
        assert len(bad) == len(want), out.stderr
        for line, (path, msg) in zip(bad, want.items()):
            assert line.startswith(f"BAD  router replay file '{path}'") and msg in line, \
                (msg, line)
            assert str(path) not in out.stdout
        assert str(good) in out.stdout


@pytest.mark.parametrize("first, then", [("codec", "codec"), ("raw", "raw"), ("raw", "codec"),
                                         ("codec", "raw")])
def test_append_keeps_the_metadata_keys_it_does_not_own(tmp_path, first, then):
    """The keys a writer added (`RecordMeta.extra`) are read back (`meta.extra`) and kept by
    every append, which adds its own over them; the keys the writer owns are its own."""
    p = tmp_path / "r.safetensors"
    m = meta()
    m.extra = {"run": "exp-7", "step": "1", "note": "é ünïcode"}
    write_routing(p, routing(5, seed=53), m, cu_seqlens=[0, 5], encoding=first)
    assert open_routing(p).meta.extra == m.extra
    m2 = meta()
    m2.extra = {"step": "2", "host": "n1", "num_tokens": "999"}
    append_routing(p, routing(3, seed=54), m2, encoding=then)
    rf = open_routing(p)
    assert rf.meta.extra == {"run": "exp-7", "step": "2", "note": "é ünïcode", "host": "n1"}
    assert rf.metadata["run"] == "exp-7" and rf.metadata["num_tokens"] == "8"
    append_routing(p, routing(1, seed=55), meta())  # no extra keys of its own
    assert open_routing(p).meta.extra == rf.meta.extra


def test_a_free_metadata_value_that_is_not_a_string_is_refused(tmp_path):
    """safetensors metadata maps strings to strings: a header (its checksum recomputed) with
    another value under a free key is refused naming the key, before an append could carry
    it on."""
    p = tmp_path / "r.safetensors"
    write_routing(p, routing(5, seed=56), meta())
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["run"] = {"nested": 1}
    header["__metadata__"]["header_checksum"] = files.header_digest(header)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(len(hb) + 8) % 8)
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])
    with pytest.raises(RoutingFileError, match=r"metadata run is \{'nested': 1\}, not a string"):
        open_routing(p)


def test_written_file_gets_the_umask_mode_not_0600(tmp_path):
    """A record file is shared between processes and users like any output file: the
    atomic write must not leave the temporary file's private 0600 mode on it."""
    import os
    import stat

    from replay_ops._atomic import atomic_target

    target = tmp_path / "routing.bin"
    old = os.umask(0o022)
    try:
        with atomic_target(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644
    os.chmod(target, 0o640)  # a replaced file keeps the mode it had
    with atomic_target(target) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"y")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640


# ------------------------------------------------------------------ readers racing writers
def _two_files(tmp_path):
    """Two valid record files of different sizes (A: 30 tokens in 2 sequences, B: 57 tokens
    in 3), as bytes, and their contents."""
    a_idx, b_idx = routing(30, seed=40), routing(57, seed=41)
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_routing(pa, a_idx, meta(), cu_seqlens=[0, 12, 30])
    write_routing(pb, b_idx, meta(), cu_seqlens=[0, 5, 20, 57])
    return {"A": (pa.read_bytes(), a_idx, [0, 12, 30]), "B": (pb.read_bytes(), b_idx,
                                                            [0, 5, 20, 57])}


def _which(rf, files_):
    """The one file whose indices and boundaries the read returned (never a mix)."""
    got = (rf.indices().to(torch.int32), rf.cu_seqlens.tolist())
    hits = [k for k, (_, idx, cu) in files_.items()
            if got[1] == cu and got[0].shape == idx.shape and torch.equal(got[0], idx)]
    assert len(hits) == 1, f"a read mixed two files: cu_seqlens={got[1]}"
    return hits[0]


READ_STEPS = ["_read_header", "_check_header", "_check_layout", "_Snapshot.load",
              "_Snapshot.map", "RoutingFile.verify", "RoutingFile.check_consistency"]


# (step, verify, mmap): the data is read by _Snapshot.load, or mapped by _Snapshot.map
READ_CASES = [(step, verify, mmap) for verify, mmap in [(True, False), (False, False),
                                                        (False, True)]
              for step in READ_STEPS if step != ("_Snapshot.load" if mmap else "_Snapshot.map")]


@pytest.mark.parametrize("step, verify, mmap", READ_CASES)
def test_a_file_replaced_during_a_read_is_never_mixed_in(tmp_path, monkeypatch, step, verify,
                                                         mmap):
    """A writer's atomic replace lands between two steps of a read (read into memory, or
    mapped): the read still returns the file it opened, whole and verified, with no false
    error."""
    files_ = _two_files(tmp_path)
    p = tmp_path / "r.safetensors"
    p.write_bytes(files_["A"][0])
    owner, name = (files, step) if "." not in step else (getattr(files, step.split(".")[0]),
                                                         step.split(".")[1])
    original = getattr(owner, name)

    def replace_then(*args, **kwargs):
        tmp = tmp_path / ".incoming"
        tmp.write_bytes(files_["B"][0])
        os.replace(tmp, p)  # what write_routing does
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, replace_then)
    rf = open_routing(p, verify=verify, mmap=mmap)
    assert _which(rf, files_) == "A"
    rf.verify()
    monkeypatch.setattr(owner, name, original)
    assert _which(open_routing(p), files_) == "B"  # the next read sees the new file


RACING_WRITER = textwrap.dedent(
    """
    import os, sys, time
    path, a, b, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    data = [open(a, "rb").read(), open(b, "rb").read()]
    end, n = time.time() + seconds, 0
    while time.time() < end:
        tmp = path + f".incoming-{n % 2}"
        with open(tmp, "wb") as f:
            f.write(data[n % 2])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        n += 1
    print(n, flush=True)
    """
)


def test_readers_racing_a_real_writer_process(tmp_path):
    """A separate process replaces the file back and forth as fast as it can; every read in
    this process, verified or not, read into memory or mapped, returns one whole file, and
    none fails."""
    files_ = _two_files(tmp_path)
    p = tmp_path / "r.safetensors"
    p.write_bytes(files_["A"][0])
    (tmp_path / "A").write_bytes(files_["A"][0])
    (tmp_path / "B").write_bytes(files_["B"][0])
    script = tmp_path / "writer.py"
    script.write_text(RACING_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(p), str(tmp_path / "A"),
                             str(tmp_path / "B"), "6"], stdout=subprocess.PIPE, text=True)
    seen = {"A": 0, "B": 0}
    try:
        reads = 0
        while proc.poll() is None and reads < 3000:
            seen[_which(open_routing(p, verify=reads % 3 == 0, mmap=reads % 3 == 2),
                        files_)] += 1
            reads += 1
    finally:
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and int(out.strip()) > 10, out
    assert seen["A"] + seen["B"] == reads and reads > 20, seen


# ------------------------------------------------------------------ the header's checksum
def test_a_flipped_bit_in_the_header_is_refused(good, tmp_path):
    """One bit of the header can turn "model_name" into another key; the model check would
    then be skipped. The header carries its own checksum (format_version 2)."""
    data = good.read_bytes()
    i = data.index(b'"model_name"') + 1
    bad = bytearray(data)
    bad[i] ^= 0x01  # "model_name" -> "lodel_name"
    p = tmp_path / "flipped_header.safetensors"
    p.write_bytes(bytes(bad))
    with pytest.raises(RoutingFileError, match=r"flipped_header.safetensors.*header checksum "
                                               r"mismatch"):
        open_routing(p, verify=False)  # checked even without the data checksum
    out = subprocess.run([sys.executable, "-m", "replay_ops.router_replay", "verify", str(p)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "header checksum mismatch" in out.stderr


def _as_version_1(data: bytes) -> bytes:
    """The same file as a format_version 1 writer wrote it (no header_checksum)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    md = header["__metadata__"]
    del md["header_checksum"]
    md["format_version"] = "1"
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def test_version_1_files_stay_readable_and_a_damaged_key_is_refused(good, tmp_path):
    v1 = tmp_path / "v1.safetensors"
    v1.write_bytes(_as_version_1(good.read_bytes()))
    rf = open_routing(v1)
    assert rf.format_version == 1 and rf.meta.model_name == "tiny"
    assert torch.equal(rf.indices(), open_routing(good).indices())
    bad = bytearray(v1.read_bytes())
    i = bytes(bad).index(b'"model_name"') + 1
    bad[i] ^= 0x01
    p = tmp_path / "v1_flipped.safetensors"
    p.write_bytes(bytes(bad))
    with pytest.raises(RoutingFileError, match=r"format_version 1 metadata keys \['model_name'\] "
                                               r"are missing"):
        open_routing(p)


# ------------------------------------------------------------------ version 3: codec files
DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.mark.parametrize("name", ["u8", "i16"])
def test_version_2_files_written_by_the_version_2_writer_stay_readable(name, tmp_path):
    """tests/data/record_v2_*.safetensors were written by the version 2 writer (before the
    codec); they read, their checksums are still checked."""
    path = os.path.join(DATA, f"record_v2_{name}.safetensors")
    want = torch.from_numpy(np.load(os.path.join(DATA, f"record_v2_{name}_indices.npy")))
    rf = open_routing(path)
    assert rf.format_version == 2 and rf.encoding == "raw" and rf.meta.model_name == "fixture"
    assert rf.dtype == (np.uint8 if name == "u8" else np.int16)
    assert torch.equal(rf.indices(), want)
    assert rf.cu_seqlens.tolist() == [0, 7, 7, 23]
    assert torch.equal(rf.sequence(2), want[7:23])
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x01
    bad = tmp_path / "v2_flipped.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(RoutingFileError, match="checksum mismatch"):
        open_routing(bad)
    # appending to a version 2 file writes a version 3 file holding both
    p = tmp_path / "grown.safetensors"
    p.write_bytes(open(path, "rb").read())
    E = rf.meta.num_experts
    more = routing(4, L=3, K=4, E=E, seed=40)
    append_routing(p, more, rf.meta)
    grown = open_routing(p)
    assert grown.format_version == 3 and grown.encoding == "codec"
    assert torch.equal(grown.indices(), torch.cat([want, more.to(torch.int16)]))


@pytest.fixture
def good_codec(tmp_path):
    p = tmp_path / "good_codec.safetensors"
    write_routing(p, routing(40, seed=11), meta(), cu_seqlens=[0, 15, 40])
    return p


def test_codec_file_layout_and_sequences(good_codec):
    from replay_ops.router_replay import codec

    idx = routing(40, seed=11)
    with safe_open(str(good_codec), framework="pt") as f:
        md = f.metadata()
        assert sorted(f.keys()) == ["cu_seqlens", "indices_codec"]
        blob = f.get_tensor("indices_codec").numpy().tobytes()
    assert md["format_version"] == "3" and md["indices_encoding"] == "codec"
    assert md["empty_value"] == "-1"
    assert torch.equal(codec.decode(blob).to(torch.int32), idx)
    rf = open_routing(good_codec)
    assert torch.equal(rf.sequence(1).to(torch.int32), idx[15:40])  # its chunks alone
    assert torch.equal(rf.indices(3, 9).to(torch.int32), idx[3:9])
    assert torch.equal(rf.replay_mask(), torch.ones(40, dtype=torch.bool))


@pytest.mark.parametrize("more", [False, True])
def test_sequences_of_a_codec_file_agree_with_its_indices(tmp_path, more):
    """`sequence(b)` (only that sequence's chunks) equals `indices()` (the whole blob) for
    every sequence of a codec file whose blob an older writer left an empty chunk in (an
    append of nothing) before a continued turn: such a file once returned, for the
    continued sequence, rows its chunks never wrote."""
    import sys as _sys

    from replay_ops.router_replay import codec

    _sys.path.insert(0, os.path.dirname(__file__))
    from _codec_forge import empty_chunk, reseal, split

    x = routing(13, seed=57).numpy()
    b = codec.encode(x[:5], num_experts=8, order="keep", seq_lens=[2, 3])
    b = codec.append(b, x[5:9], continue_last=True)  # the next turn of sequence 1
    lens, cu = (2, 7), np.array([0, 2, 9])
    if more:
        b = codec.append(b, x[9:], seq_lens=[1, 3])
        lens, cu = (2, 7, 1, 3), np.array([0, 2, 9, 10, 13])
    v, head, ext, chunks = split(b)
    chunks.insert(1, empty_chunk(1))
    legacy = reseal(v, head, ext, chunks)
    assert codec.info(legacy).seq_lens == lens
    p = tmp_path / "legacy.safetensors"
    _checksummed(p, blob=legacy, cu=cu)
    rf = open_routing(p, verify=True)
    for i in range(rf.num_sequences):
        got = open_routing(p).sequence(i)  # a fresh file: decode_sequence, no cache
        assert torch.equal(got, rf.indices(int(cu[i]), int(cu[i + 1]))), i
        assert torch.equal(got.to(torch.int32), torch.from_numpy(x[cu[i]:cu[i + 1]])), i


def test_codec_file_corruption_is_refused(good_codec, tmp_path):
    data = good_codec.read_bytes()
    for i in (len(data) - 1, len(data) - 30):
        bad = bytearray(data)
        bad[i] ^= 0x04
        p = tmp_path / f"flip{i}.safetensors"
        p.write_bytes(bytes(bad))
        with pytest.raises(RoutingFileError, match="checksum mismatch"):
            open_routing(p)
        # without the file's sha256, the codec's own checksums still refuse it
        with pytest.raises(RoutingFileError, match=r"corrupt indices_codec data: .*offset \d+"):
            open_routing(p, verify=False).indices()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-3])
    with pytest.raises(RoutingFileError, match="truncated"):
        open_routing(cut)


def test_codec_append_copies_the_earlier_chunks(tmp_path):
    from replay_ops.router_replay import codec

    p = tmp_path / "r.safetensors"
    a, b = routing(30, seed=20), routing(12, seed=21)
    append_routing(p, a, meta(), cu_seqlens=[0, 10, 30])
    with safe_open(str(p), framework="pt") as f:
        first = f.get_tensor("indices_codec").numpy().tobytes()
    append_routing(p, b, meta())
    with safe_open(str(p), framework="pt") as f:
        both = f.get_tensor("indices_codec").numpy().tobytes()
    # the chunks are copied unchanged (a format-3 blob header is rewritten: its counts)
    hs = codec.header_size(codec.info(first).version)
    assert both[hs:].startswith(first[hs:]) and len(codec.info(both).chunks) == 2
    rf = open_routing(p)
    assert torch.equal(rf.indices().to(torch.int32), torch.cat([a, b]))
    assert rf.cu_seqlens.tolist() == [0, 10, 30, 42]
    # and to a raw file: the raw file's ids and the new ones, raw
    append_routing(p, b, meta(), encoding="raw")
    rf = open_routing(p)
    assert rf.encoding == "raw" and torch.equal(rf.indices().to(torch.int32),
                                                torch.cat([a, b, b]))


def test_codec_file_is_smaller_on_real_routing(tmp_path):
    d = np.load(os.path.join(os.path.dirname(__file__), "..", "bench", "data",
                             "dev_qwen3moe_e128_k8_l8.npz"))
    r = torch.from_numpy(d["routing_trained"][:2048].astype(np.int16))
    m = RecordMeta(num_experts=128, top_k=8, moe_layer_ids=list(range(8)))
    raw, cod = tmp_path / "raw.safetensors", tmp_path / "codec.safetensors"
    write_routing(raw, r, m, encoding="raw")
    write_routing(cod, r, m)
    assert os.path.getsize(cod) * 1.5 < os.path.getsize(raw)  # order kept, no token ids
    assert torch.equal(open_routing(cod).indices(), r)
