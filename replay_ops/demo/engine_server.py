"""What the real rollout engines (`vllm_engine`, `sglang_engine`) share: finding the engine
(an environment variable's Python, the one installed beside replay_ops on a GPU machine, or
its own virtual environment under build/ on a CPU machine, never the project's), a
checkpoint both the engine and transformers load offline, and an HTTP server process on
127.0.0.1 that is started, waited for, asked and stopped.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Sequence

READY_MARK = ".replay_ops_ready"
HOST = "127.0.0.1"


class EngineUnavailable(RuntimeError):
    """No engine could be found or installed, or its server did not start."""


def repo_root() -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return here if os.path.exists(os.path.join(here, "setup.py")) else None


def build_venv(env_var: str, name: str) -> str:
    """`$env_var`, else build/`name` in the checkout (or the current folder)."""
    env = os.environ.get(env_var)
    if env:
        return os.path.abspath(env)
    return os.path.join(repo_root() or os.getcwd(), "build", name)


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def venv_ready(venv: str) -> bool:
    """A finished environment: its Python and the mark written after its import check."""
    return os.path.exists(os.path.join(venv, READY_MARK)) and os.path.exists(venv_python(venv))


def install_venv(venv: str, *, label: str, specs: Sequence[str], check_code: str,
                 remove: Sequence[str] = (), size_note: str = "",
                 unavailable: type[EngineUnavailable] = EngineUnavailable,
                 log: Callable = print) -> str:
    """Install `specs` into the virtual environment `venv` unless it is finished already
    (`venv_ready`); returns its Python. A half-made environment (no ready mark) is removed
    and made again. `remove`: packages uninstalled afterwards; `check_code`: Python run in
    the new environment whose success (and output, kept in the mark) makes it finished."""
    if venv_ready(venv):
        return venv_python(venv)
    if os.path.exists(venv):
        log(f"{label}: removing the unfinished environment {venv}")
        shutil.rmtree(venv)
    note = f"; {size_note}" if size_note else ""
    log(f"{label}: installing {' '.join(specs)} into {venv} (once{note})")
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    py = venv_python(venv)
    pip = [py, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run(pip + ["install", *specs], check=True)
    if remove:
        subprocess.run(pip + ["uninstall", "--yes", *remove], check=True)
    return mark_ready(venv, label=label, check_code=check_code, unavailable=unavailable, log=log)


def mark_ready(venv: str, *, label: str, check_code: str,
               unavailable: type[EngineUnavailable] = EngineUnavailable,
               log: Callable = print) -> str:
    """Run `check_code` in `venv`; on success write the ready mark (its output) and return
    the environment's Python, else raise `unavailable` with the end of its error output."""
    py = venv_python(venv)
    check = subprocess.run([py, "-c", check_code], capture_output=True, text=True)
    if check.returncode != 0:
        raise unavailable(f"{label}: the new environment {venv} fails its import check:\n"
                          f"{check.stderr[-3000:]}")
    with open(os.path.join(venv, READY_MARK), "w") as f:
        f.write(check.stdout)
    log(f"{label}: installed ({check.stdout.strip()})")
    return py


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


@dataclass
class EngineRuntime:
    """The Python that runs an engine, and how: `cpu` means the engine's CPU hook folder
    (`shim_dir`) goes on its processes' PYTHONPATH, alone."""

    python: str
    cpu: bool
    source: str
    shim_dir = ""  # the subclass's hook folder

    def cpu_env(self, env: dict) -> None:
        """The engine's own settings for its CPU processes (the subclass's)."""

    def env(self) -> dict:
        env = dict(os.environ)
        if self.cpu:
            for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
                env.pop(k, None)  # the engine's environment is its own
            env["PYTHONPATH"] = os.pathsep.join([self.shim_dir, engine_path()])
            self.cpu_env(env)
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env


ENGINE_PLUGINS = (
    # (entry point group, entry point): replay_ops' engine plugins, inert until turned on
    ("vllm.general_plugins", "replay_ops_inject = replay_ops.integrations.vllm:register"),
    ("sglang.srt.plugins", "replay_ops_inject = replay_ops.integrations.sglang:register"),
)


def engine_path(root: str | None = None) -> str:
    """A folder for a CPU engine's PYTHONPATH that makes replay_ops importable in the
    engine's own environment (a link to this replay_ops package) and declares replay_ops'
    engine plugins as an installed replay_ops would (a `replay_ops-<version>.dist-info`
    with its entry points), without installing anything into that environment. The plugins
    do nothing until their environment variable turns them on. Made (again, atomically)
    under build/engine-path in the checkout (or the current folder) when it is missing or
    points elsewhere."""
    import replay_ops

    pkg = os.path.dirname(os.path.abspath(replay_ops.__file__))
    folder = os.path.join(root or repo_root() or os.getcwd(), "build", "engine-path")
    version = getattr(replay_ops, "__version__", "0")
    info = f"replay_ops-{version}.dist-info"
    link = os.path.join(folder, "replay_ops")
    entry = "".join(f"[{g}]\n{e}\n" for g, e in ENGINE_PLUGINS)
    try:
        with open(os.path.join(folder, info, "entry_points.txt")) as f:
            current = f.read() == entry and os.path.realpath(link) == os.path.realpath(pkg)
    except OSError:
        current = False
    if current:
        return folder
    import tempfile

    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".engine-path-", dir=os.path.dirname(folder))
    os.symlink(pkg, os.path.join(tmp, "replay_ops"))
    os.makedirs(os.path.join(tmp, info))
    with open(os.path.join(tmp, info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: replay_ops\nVersion: {version}\n")
    with open(os.path.join(tmp, info, "entry_points.txt"), "w") as f:
        f.write(entry)
    old = folder + f".old-{os.getpid()}"
    if os.path.lexists(folder):
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def ensure_module(runtime: "EngineRuntime", module: str, spec: str, *, label: str,
                  unavailable: type = EngineUnavailable, log: Callable = print) -> None:
    """Make `module` importable in the engine's Python: installed there with pip (`spec`)
    when the engine runs from its own build environment (a CPU machine), else a clear error
    saying what to install."""
    check = [runtime.python, "-c", f"import {module}"]
    if subprocess.run(check, capture_output=True, env=runtime.env()).returncode == 0:
        return
    if not runtime.cpu:
        raise unavailable(f"{label}: {module} is not importable in the engine's Python "
                          f"({runtime.python}); pip install {spec} there")
    log(f"{label}: installing {spec} into the engine's environment ({runtime.python})")
    subprocess.run([runtime.python, "-m", "pip", "--disable-pip-version-check", "--quiet",
                    "install", spec], check=True)


def find_engine(runtime: type, *, name: str, label: str, python_var: str, venv: str,
                install: bool, install_fn: Callable, spec: str, unavailable: type,
                gpu_hint: str = "", log=print):
    """The engine to run: `python_var`'s Python when set; on a machine with a CUDA device the
    `name` package installed beside replay_ops; otherwise (a CPU machine) its own virtual
    environment `venv`, installed by `install_fn(venv, log=log)` when `install`, else a
    missing one raises `unavailable`. Returns `runtime(python, cpu=..., source=...)`."""
    env_py = os.environ.get(python_var)
    if env_py:
        return runtime(env_py, cpu=not cuda_available(), source=python_var)
    if cuda_available():
        import importlib.util

        if importlib.util.find_spec(name) is None:
            raise unavailable(f"{name}: this machine has a CUDA device but {name} is not "
                              f"installed beside replay_ops (pip install {name}){gpu_hint}; "
                              f"or set {python_var}")
        return runtime(sys.executable, cpu=False, source=f"installed {name} (GPU)")
    if not venv_ready(venv):
        if not install:
            raise unavailable(f"{name}: no {label} for this CPU machine in {venv}; run `make "
                              f"install-{name}` (or `python -m replay_ops.demo.{name}_engine "
                              f"install`)")
        install_fn(venv, log=log)
    return runtime(venv_python(venv), cpu=True, source=f"{spec} in {venv}")


def install_main(argv: list, *, name: str, install_fn: Callable, gpu_note: str) -> int:
    """`python -m replay_ops.demo.<name>_engine install [VENV]`: installs the engine for a
    CPU machine with `install_fn(venv)`; on a machine with a CUDA device nothing is installed
    (`gpu_note` says what is used instead)."""
    if not argv or argv[0] != "install" or len(argv) > 2:
        print(f"usage: python -m replay_ops.demo.{name}_engine install [VENV]", file=sys.stderr)
        return 2
    if cuda_available():
        print(f"{name}: this machine has a CUDA device; nothing installed ({gpu_note})",
              file=sys.stderr)
        return 0
    print(install_fn(argv[1] if len(argv) > 1 else None))
    return 0


# ----------------------------------------------------------------------------- checkpoint
def save_checkpoint(model, path: str) -> str:
    """Save a transformers model (fp32 weights) and a word-level tokenizer over its vocabulary
    ("t0", "t1", ...) to `path`, a folder the engines and transformers all load offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    V = model.config.vocab_size
    vocab = {f"t{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1",
                                   unk_token="t2", pad_token=f"t{V - 1}")
    fast.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class EngineServer:
    """An engine's HTTP server process on 127.0.0.1, answering `health_path` when ready. A
    context manager: the server process (and every process it started, one session) ends on
    exit. Subclasses set `label`, `unavailable` and the command line `self.args`."""

    label = "engine"
    unavailable: type[EngineUnavailable] = EngineUnavailable
    health_path = "/health"

    def __init__(self, args: list, env: dict, *, port: int, log_path: str,
                 start_timeout: float = 600.0) -> None:
        self.args = list(args)
        self.env = env
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and wait until it answers (`launch` + `wait_ready`)."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the server process without waiting (several servers can start at once)."""
        self._t0 = time.perf_counter()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)

    def wait_ready(self) -> None:
        """Wait for the health path; a server that exits or does not answer in time raises
        `self.unavailable` with the end of its log."""
        t0 = self._t0
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                self._close_log()
                raise self.unavailable(f"{self.label} server exited with code "
                                       f"{self.proc.returncode} while starting; its log "
                                       f"({self.log_path}) ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise self.unavailable(f"{self.label} server did not answer "
                                       f"{self.health_path} within {self.start_timeout:.0f} s; "
                                       f"its log ends:\n{self.log_tail()}")
            time.sleep(1.0)
        self.start_s = time.perf_counter() - t0

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return "(no log)"

    def _close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)  # the server and the processes it started
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        if p is not None:  # processes of the session that outlived the server
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        self._close_log()

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """POST `body` as JSON; an HTTP error raises `HttpError` with the server's answer."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                data = r.read()
                return json.loads(data) if data.strip() else {}
        except urllib.error.HTTPError as e:
            raise HttpError(f"{self.label} server: {path} answered {e.code}: "
                            f"{e.read().decode(errors='replace')[:2000]}", e.code) from None


class HttpError(RuntimeError):
    """An engine server answered a request with an HTTP error (`status`)."""

    def __init__(self, msg: str, status: int) -> None:
        super().__init__(msg)
        self.status = status
