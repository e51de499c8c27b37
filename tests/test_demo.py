"""The end-to-end demo at a tiny size: its JSON summary and its command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from replay_ops import demo  # noqa: E402

NUMBERS = ("no_replay", "r3_replay", "r2_round_trip", "kl_reduction", "workload", "model")


def run_tiny(out, **kw):
    cfg = demo.DemoConfig.from_size("tiny", out=str(out), **kw)
    cfg.progress = False
    return demo.run(cfg)


def test_tiny_demo_summary(tmp_path):
    s = run_tiny(tmp_path)
    with open(tmp_path / "summary.json") as f:
        on_disk = json.load(f)
    assert on_disk["r3_replay"] == s["r3_replay"]
    n, r = on_disk["no_replay"], on_disk["r3_replay"]
    # Without replay bf16 inference and fp32 training route some tokens differently...
    assert n["routing_mismatch"] > 0 and n["tokens_with_any_mismatch"] > 0
    # ... with R3 every (token, layer) decision is the inference engine's, exactly.
    assert r["routing_mismatch"] == 0.0
    assert r["tokens_with_any_mismatch"] == 0.0
    assert r["routing_mismatch_per_layer"] == [0.0] * len(on_disk["model"]["moe_layer_ids"])
    assert r["kl_k3_mean"] < n["kl_k3_mean"]
    assert on_disk["kl_reduction"] > 1
    assert r["abs_dlogprob_max"] > 0  # precision still differs: the gap shrinks, not vanishes
    q = on_disk["r2_round_trip"]
    assert q["file_routing_equals_recorded"] is True
    assert q["replay_logprobs_bitwise_equal_before_update"] is True
    assert q["after_update_routing_mismatch_r2"] == 0.0
    assert q["routing_source"].startswith("file:")
    assert os.path.getsize(q["record_file"]) == q["record_file_bytes"] > 0
    assert on_disk["workload"]["response_tokens"] > 0
    png = tmp_path / "demo_chart.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # atomic writes
    text = demo.format_report(on_disk)
    assert "R3 replay: routing difference 0.00% (exactly zero)" in text


def test_demo_is_deterministic_and_other_arch(tmp_path):
    a = run_tiny(tmp_path / "a", arch="deepseek_v3", chart=False)
    b = run_tiny(tmp_path / "b", arch="deepseek_v3", chart=False)
    for key in NUMBERS:
        if key == "r2_round_trip":
            for s in (a, b):  # paths differ by folder
                s[key].pop("record_file"), s[key].pop("routing_source")
        assert a[key] == b[key], key
    assert a["model"]["score_func"] == "sigmoid"
    assert a["r3_replay"]["routing_mismatch"] == 0.0
    assert a["r2_round_trip"]["after_update_routing_mismatch_r2"] == 0.0
    assert "chart" not in a


def test_cli_help_and_errors(tmp_path, capsys):
    """The command line: its parsing and refusals in process (`replay_ops.__main__.main`),
    then one real `python -m replay_ops demo` run of the tiny model."""
    from replay_ops.__main__ import main as cli

    with pytest.raises(SystemExit) as e:
        cli(["demo", "--help"])
    h = capsys.readouterr().out
    assert e.value.code == 0 and "--device" in h and "--arch" in h
    assert "--engine" in h and "vllm" in h and "sglang" in h
    with pytest.raises(SystemExit) as e:
        cli(["demo", "--arch", "llama"])
    assert e.value.code != 0 and "invalid choice: 'llama'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="head_dim=8"):  # before any install
        cli(["demo", "--engine", "vllm", "--size", "tiny", "--out", str(tmp_path / "v")])
    assert cli(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown size='huge'"):
        demo.DemoConfig.from_size("huge")
    ok = subprocess.run(
        [sys.executable, "-m", "replay_ops", "demo", "--size", "tiny", "--out",
         str(tmp_path / "cli"), "--no-progress", "--no-chart", "--seed", "1"],
        capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "routing difference 0.00% (exactly zero)" in ok.stdout
    assert "tokens with >= 1 differing layer" in ok.stdout
    with open(tmp_path / "cli" / "summary.json") as f:
        assert json.load(f)["config"]["seed"] == 1


def test_report_prints_the_per_layer_agreement(tmp_path):
    """The training engine's RouterReplay counts the gate's agreement over the R3 passes.
    The first MoE layer sees the same inputs in the own-routing and the R3 pass, so there
    its agreement is exactly 1 - the no-replay mismatch; the report prints every layer's."""
    s = run_tiny(tmp_path)
    agree = s["r3_replay"]["agreement_per_layer"]
    layers = s["model"]["moe_layer_ids"]
    assert len(agree) == len(layers) and all(0.0 <= a <= 1.0 for a in agree)
    first = s["no_replay"]["routing_mismatch_per_layer"][0]
    assert agree[0] == pytest.approx(1.0 - first, abs=1e-6)  # (the mismatch is an fp32 mean)
    text = demo.format_report(s)
    assert "R3 agreement" in text
    for lid, a in zip(layers, agree):
        assert any(line.split("|")[0].strip() == str(lid) and f"{100 * a:.2f}%" in line
                   for line in text.splitlines())
