"""Where `make install-test` puts SkyRL and ms-swift, and how their replay modules are
imported on this CPU-only Python 3.11 machine. Nothing here is part of replay_ops, and no
client code is copied or changed: their own files from the package index are loaded.

* SkyRL 0.4.0 (`build/clients/skyrl-0.4.0`, installed --no-deps --ignore-requires-python):
  its pydantic models use `typing.TypedDict`, which pydantic accepts on Python >= 3.12 only;
  on 3.11 `typing.TypedDict` is aliased to `typing_extensions.TypedDict` (the same class
  pydantic asks for) before SkyRL is imported. `skyrl.train.dataset`'s `__init__` imports the
  dataset stack (`datasets`, for its prompt dataset); the package is registered with its
  folder as its path and its `__init__` not run, so `skyrl.train.dataset.preprocess` (the
  collate function) imports from its own file.
* ms-swift 4.6.0 and mcore-bridge 1.6.5 (`build/clients/ms-swift-4.6.0`, --no-deps):
  importing the package `mcore_bridge` patches TransformerEngine at import (no CPU build of
  TransformerEngine exists), and `swift.megatron` imports it, so neither package's
  `__init__` can run here. `swift/megatron/utils/router_replay_utils.py` and
  `mcore_bridge/utils/megatron_utils.py` (`split_cp_inputs`) are loaded from their files,
  unchanged, with their parent packages registered but not run. The two names the replay
  module takes from `swift.utils` come from elsewhere: `get_logger` is mcore-bridge's
  (`mcore_bridge/utils/logger.py`, the logger mcore-bridge took from ms-swift), and
  `get_current_device` returns "cpu", what ms-swift's own returns on a machine without an
  accelerator (`swift/utils/torch_utils.py` imports `datasets` and `modelscope`).
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKYRL_DIR = ROOT / "build" / "clients" / "skyrl-0.4.0"
MSSWIFT_DIR = ROOT / "build" / "clients" / "ms-swift-4.6.0"


def _on_path(folder: Path) -> None:
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def register_package(name: str, folder: Path) -> types.ModuleType:
    """`name` as a package whose submodules are found in `folder`, its __init__ not run."""
    if name in sys.modules:
        return sys.modules[name]
    mod = types.ModuleType(name)
    mod.__path__ = [str(folder)]
    mod.__package__ = name
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)
    return mod


def load_file(name: str, path: Path) -> types.ModuleType:
    """The module `name` executed from `path` (unchanged), registered in sys.modules."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


def skyrl() -> types.SimpleNamespace:
    """SkyRL's replay modules: replay_utils, preprocess, routed_experts, token_metadata,
    packed_tensor."""
    _on_path(SKYRL_DIR)
    if sys.version_info < (3, 12):
        import typing

        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict
    import skyrl.train  # noqa: F401

    register_package("skyrl.train.dataset", Path(sys.modules["skyrl.train"].__path__[0]) / "dataset")
    import skyrl.backends.skyrl_train.distributed.megatron.token_metadata as token_metadata
    import skyrl.backends.skyrl_train.utils.packed_tensor as packed_tensor
    import skyrl.backends.skyrl_train.utils.replay_utils as replay_utils
    import skyrl.backends.skyrl_train.utils.routed_experts as routed_experts
    import skyrl.train.dataset.preprocess as preprocess

    return types.SimpleNamespace(replay_utils=replay_utils, preprocess=preprocess,
                                 routed_experts=routed_experts, token_metadata=token_metadata,
                                 packed_tensor=packed_tensor)


def msswift() -> types.SimpleNamespace:
    """ms-swift's `router_replay_utils` and mcore-bridge's `split_cp_inputs`."""
    d = MSSWIFT_DIR
    if not (d / "swift" / "megatron" / "utils" / "router_replay_utils.py").is_file():
        raise ImportError(f"ms-swift 4.6.0 is not installed in {d} (`make install-test`)")
    import megatron.core  # noqa: F401  (their modules import it at the top)

    register_package("mcore_bridge", d / "mcore_bridge")
    register_package("mcore_bridge.utils", d / "mcore_bridge" / "utils")
    logger = load_file("mcore_bridge.utils.logger", d / "mcore_bridge" / "utils" / "logger.py")
    mu = load_file("mcore_bridge.utils.megatron_utils",
                   d / "mcore_bridge" / "utils" / "megatron_utils.py")
    sys.modules["mcore_bridge"].split_cp_inputs = mu.split_cp_inputs

    register_package("swift", d / "swift")
    su = register_package("swift.utils", d / "swift" / "utils")
    su.get_logger = logger.get_logger
    if not hasattr(su, "torch_utils"):
        tu = types.ModuleType("swift.utils.torch_utils")
        tu.get_current_device = lambda: "cpu"
        sys.modules["swift.utils.torch_utils"] = tu
        su.torch_utils = tu
    su.get_current_device = sys.modules["swift.utils.torch_utils"].get_current_device
    register_package("swift.megatron", d / "swift" / "megatron")
    register_package("swift.megatron.utils", d / "swift" / "megatron" / "utils")
    rr = load_file("swift.megatron.utils.router_replay_utils",
                   d / "swift" / "megatron" / "utils" / "router_replay_utils.py")
    return types.SimpleNamespace(rr=rr, split_cp_inputs=mu.split_cp_inputs)
