"""A real SGLang as the rollout engine: find or install it, run its HTTP server on 127.0.0.1
for a checkpoint (`engine_server.save_checkpoint`), and send it generation requests that
return the routing (`routed_experts`) and the sampled tokens' log-probabilities.

Which SGLang runs:

* `REPLAY_OPS_SGLANG_PYTHON` (a Python executable that imports sglang), when set;
* on a machine with a CUDA device, the sglang installed beside replay_ops (the user's own);
* otherwise (a CPU machine) sglang in its own virtual environment, `build/sglang-venv` in the
  checkout (or `REPLAY_OPS_SGLANG_VENV`), installed on first use by `install_cpu_sglang`
  (or `make install-sglang`). The project's environment and its torch are never touched.

On a CPU the SGLang processes run SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`; `--device
cpu` alone is not it), with `sglang_cpu/` on their PYTHONPATH (only theirs): a stand-in
`sgl_kernel` (every kernel wheel on the package index is a CUDA build) and a start-up hook
that keeps `--enable-return-routed-experts`' host buffer out of pinned memory (see
`sglang_cpu/`), and with `--attention-backend torch_native --disable-cuda-graph
--max-total-tokens 16384 --sleep-on-idle` (without the token cap it reserves 14 GB of KV
cache; without sleep-on-idle its scheduler spins on the CPU while idle). A GPU's SGLang runs
as it is.

Run as a script, `python -m replay_ops.demo.sglang_engine install [VENV]` installs sglang.
"""
from __future__ import annotations

import concurrent.futures
import os
import sys
from dataclasses import dataclass, field

from .engine_server import (
    HOST,
    EngineRuntime,
    EngineServer,
    EngineUnavailable,
    build_venv,
    ensure_module,
    find_engine,
    free_port,
    install_main,
    install_venv,
    save_checkpoint as _save_checkpoint,
)

SGLANG_SPEC = "sglang==0.5.23"
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_cpu")
SIZE_NOTE = "about 11 GB and 200 packages; 8-22 minutes"
# CPU flags: the attention backend that runs on a CPU, no CUDA graphs, a KV cache of this
# many tokens (the default reserves 14 GB), and a scheduler that sleeps while idle
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--sleep-on-idle")
CPU_MAX_TOTAL_TOKENS = 16384


class SglangUnavailable(EngineUnavailable):
    """No SGLang could be found or installed, or its server did not start."""


def default_venv() -> str:
    """`REPLAY_OPS_SGLANG_VENV`, else build/sglang-venv in the checkout (or the current folder)."""
    return build_venv("REPLAY_OPS_SGLANG_VENV", "sglang-venv")


CHECK = ("import importlib.metadata as m, torch, transformers; "
         "import sglang.srt.server_args; "
         "print('sglang', m.version('sglang'), 'torch', torch.__version__)")


def install_cpu_sglang(venv: str | None = None, *, log=print) -> str:
    """Install sglang into its own virtual environment `venv` (default `default_venv()`)
    unless it is there already; returns its Python. A half-made environment (no ready mark)
    is removed and made again."""
    return install_venv(venv or default_venv(), label="sglang", specs=[SGLANG_SPEC],
                        check_code=CHECK, size_note=SIZE_NOTE, unavailable=SglangUnavailable,
                        log=log)


class SglangRuntime(EngineRuntime):
    """The Python that runs SGLang, and how: `cpu` means SGLang's CPU engine and the hook."""

    shim_dir = SHIM_DIR

    def cpu_env(self, env: dict) -> None:
        env["SGLANG_USE_CPU_ENGINE"] = "1"


def find_sglang(*, install: bool = False, venv: str | None = None, log=print) -> SglangRuntime:
    """The SGLang to run (see the module docstring); `install` lets a CPU machine install
    sglang when it is missing, else a missing one raises `SglangUnavailable`."""
    return find_engine(SglangRuntime, name="sglang", label="SGLang",
                       python_var="REPLAY_OPS_SGLANG_PYTHON", venv=venv or default_venv(),
                       install=install, install_fn=install_cpu_sglang, spec=SGLANG_SPEC,
                       unavailable=SglangUnavailable, log=log)


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(model, path: str) -> str:
    """`engine_server.save_checkpoint` with the config fields SGLang needs from a DeepSeek-V3
    checkpoint (`sglang_config`)."""
    sglang_config(model.config)
    return _save_checkpoint(model, path)


def sglang_config(config) -> None:
    """Add, in place, what SGLang's DeepSeek-V2/V3 model reads from a real checkpoint's
    config.json and transformers' `DeepseekV3Config` lacks: `moe_layer_freq` 1, `topk_method`
    "noaux_tc" (the expert bias), `scoring_func` "sigmoid" (the values of DeepSeek-V3's own
    config); and the YaRN rope that SGLang's CPU engine requires for it (`get_rope_cpu`:
    "Only deepseek_yarn is supported for CPU"), with factor 1, which is the default rope's
    rotation (transformers gives bitwise the same logits). Other models are left as they are."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        return
    config.moe_layer_freq = 1
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") == "default":
        rope.update(rope_type="yarn", factor=1.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=1.0,
                    original_max_position_embeddings=config.max_position_embeddings)
        config.rope_parameters = rope


# ----------------------------------------------------------------------------- the server
@dataclass
class Generation:
    """One request's result: the prompt and generated token ids, the generated tokens'
    log-probs under SGLang, its `meta_info` as it came (holding `routed_experts`, base64),
    and the request body that was sent (the adapter takes the start from it)."""

    prompt_ids: list
    token_ids: list
    logprobs: list
    meta_info: dict
    request: dict = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


class SglangServer(EngineServer):
    """SGLang's HTTP server (`/generate`, and the OpenAI-compatible `/v1/...`) for a
    checkpoint folder, on 127.0.0.1, with `--enable-return-routed-experts` unless
    `routed_experts=False`. A context manager: the server and its processes end on exit."""

    label = "sglang"
    unavailable = SglangUnavailable

    def __init__(self, model_dir: str, runtime: SglangRuntime, *, dtype: str = "bfloat16",
                 routed_experts: bool = True, context_length: int | None = None,
                 max_total_tokens: int = CPU_MAX_TOTAL_TOKENS, log_path: str | None = None,
                 start_timeout: float = 600.0, extra_args: tuple = (), inject: bool = False,
                 env: dict | None = None) -> None:
        self.model_dir = os.path.abspath(model_dir)
        self.runtime = runtime
        self.dtype = dtype
        port = free_port()
        args = [
            runtime.python, "-m", "sglang.launch_server",
            "--model-path", self.model_dir, "--served-model-name", "replay-demo",
            "--host", HOST, "--port", str(port), "--dtype", dtype, "--random-seed", "0",
            "--skip-server-warmup", *extra_args,
        ]
        if context_length:
            args += ["--context-length", str(context_length)]
        if routed_experts:
            args.append("--enable-return-routed-experts")
        if runtime.cpu:
            args += [*CPU_ARGS, "--max-total-tokens", str(max_total_tokens)]
        server_env = runtime.env()
        self.inject = inject
        if inject:
            # replay_ops' route-injection plugin (replay_ops.integrations.sglang), on for this
            # engine; the codec payloads it decodes need zstandard in the engine's Python
            from ..integrations.sglang import ENV as INJECT_ENV

            ensure_module(runtime, "zstandard", "zstandard", label="sglang",
                          unavailable=SglangUnavailable)
            server_env[INJECT_ENV] = "1"
        server_env.update(env or {})
        super().__init__(args, server_env, port=port,
                         log_path=log_path or os.path.join(self.model_dir, "sglang_server.log"),
                         start_timeout=start_timeout)

    # ------------------------------------------------------------------ requests
    @staticmethod
    def sampling(max_new_tokens: int, temperature: float, seed: int | None) -> dict:
        """Exactly `max_new_tokens` tokens (EOS ignored)."""
        sp = {"max_new_tokens": int(max_new_tokens), "min_new_tokens": int(max_new_tokens),
              "ignore_eos": True, "temperature": float(temperature)}
        if seed is not None:
            sp["sampling_seed"] = int(seed)
        return sp

    def generate(self, input_ids: list, max_new_tokens: int, *, seed: int | None = None,
                 temperature: float = 1.0, start: int = 0,
                 return_routed_experts: bool = True,
                 custom_params: dict | None = None) -> Generation:
        """One `/generate` request with the routing of tokens `[start, seq_len - 1)` and the
        sampled tokens' log-probabilities. `custom_params`: the sampling params' custom
        parameters (e.g. injected routes, `replay_ops.router_replay.inject.request_args`)."""
        sp = self.sampling(max_new_tokens, temperature, seed)
        if custom_params:
            sp["custom_params"] = dict(custom_params)
        body = {"input_ids": [int(t) for t in input_ids], "sampling_params": sp,
                "return_logprob": True, "return_routed_experts": bool(return_routed_experts),
                "routed_experts_start_len": int(start)}
        return _generation(body["input_ids"], self.post("/generate", body), body)

    def generate_batch(self, prompts: list, max_new_tokens: list, *, seeds: list | None = None,
                       temperature: float = 1.0, starts: list | int = 0,
                       custom_params: list | None = None) -> list[Generation]:
        """A batched `/generate` (`input_ids` a list of requests) per distinct start: SGLang
        takes one int `routed_experts_start_len` for a whole batch (a list is answered with
        HTTP 400), so requests with different starts go in different batches, sent at once.
        Returns the generations in the order of `prompts`; each carries the body it went in."""
        B = len(prompts)
        starts = [int(starts)] * B if isinstance(starts, int) else [int(s) for s in starts]
        seeds = [None] * B if seeds is None else list(seeds)
        if not (len(max_new_tokens) == len(starts) == len(seeds) == B):
            raise ValueError(f"generate_batch: {B} prompts, {len(max_new_tokens)} lengths, "
                             f"{len(seeds)} seeds, {len(starts)} starts")
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(starts):
            groups.setdefault(s, []).append(i)

        def send(start: int, idx: list[int]):
            sps = [self.sampling(max_new_tokens[i], temperature, seeds[i]) for i in idx]
            for j, i in enumerate(idx):
                if custom_params is not None and custom_params[i]:
                    sps[j]["custom_params"] = dict(custom_params[i])
            body = {"input_ids": [[int(t) for t in prompts[i]] for i in idx],
                    "sampling_params": sps,
                    "return_logprob": True, "return_routed_experts": True,
                    "routed_experts_start_len": start}
            outs = self.post("/generate", body)
            if not isinstance(outs, list) or len(outs) != len(idx):
                raise RuntimeError(f"sglang server: a batch of {len(idx)} requests came back "
                                   f"with {len(outs) if isinstance(outs, list) else outs!r}")
            return [(i, _generation(body["input_ids"][j], o, body)) for j, (i, o) in
                    enumerate(zip(idx, outs))]

        out: list = [None] * B
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(groups))) as ex:
            for fut in [ex.submit(send, s, idx) for s, idx in groups.items()]:
                for i, g in fut.result():
                    out[i] = g
        return out

    def completions(self, prompt, max_tokens: int, *, n: int = 1, temperature: float = 1.0,
                    seed: int | None = None, start: int = 0, **extra) -> dict:
        """`/v1/completions` (prompt: token ids, or a list of them) with the routing
        (`sglext.routed_experts`) and the token ids; the response as it came."""
        body = {"model": "replay-demo", "prompt": prompt, "max_tokens": int(max_tokens),
                "min_tokens": int(max_tokens), "ignore_eos": True, "n": int(n),
                "temperature": float(temperature), "logprobs": 0, "return_token_ids": True,
                "return_routed_experts": True, "routed_experts_start_len": int(start), **extra}
        if seed is not None:
            body["seed"] = int(seed)
        return self.post("/v1/completions", body)

    def chat_completions(self, messages: list, max_tokens: int, *, n: int = 1,
                         temperature: float = 1.0, seed: int | None = None, start: int = 0,
                         **extra) -> dict:
        """`/v1/chat/completions` with the routing (`sglext.routed_experts`, the first
        choice's) and the token ids; the response as it came. The prompt is the server's
        chat template applied to `messages`."""
        body = {"model": "replay-demo", "messages": messages, "max_tokens": int(max_tokens),
                "min_tokens": int(max_tokens), "ignore_eos": True, "n": int(n),
                "temperature": float(temperature), "logprobs": True,
                "return_token_ids": True, "return_routed_experts": True,
                "routed_experts_start_len": int(start), **extra}
        if seed is not None:
            body["seed"] = int(seed)
        return self.post("/v1/chat/completions", body)


def _generation(prompt_ids: list, out: dict, body: dict) -> Generation:
    meta = out["meta_info"]
    lps = meta.get("output_token_logprobs") or []
    return Generation(list(prompt_ids), list(out["output_ids"]),
                      [float(v[0]) for v in lps], meta, body)


def sglang_version(runtime: SglangRuntime) -> str:
    import subprocess

    code = "import importlib.metadata as m; print('sglang', m.version('sglang'))"
    r = subprocess.run([runtime.python, "-c", code], capture_output=True, text=True,
                       env=runtime.env(), timeout=120)
    return r.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    return install_main(sys.argv[1:] if argv is None else argv, name="sglang",
                        install_fn=install_cpu_sglang, gpu_note="the sglang installed beside replay_ops is used")


if __name__ == "__main__":
    sys.exit(main())
