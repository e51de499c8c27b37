"""pytest plugin of the GPU run's test step (tools/gpu_check.py loads it with
`-p gpu_pytest_plugin`, tools/ on PYTHONPATH). Works with and without pytest-xdist.

  --gpu-log FILE          write the per-test log (tools/gpu_test_plan.py): the plan, then one
                          line per test start, per report (a setup or teardown only when it
                          did not pass; the durations are the reports') and per module that
                          did not collect, each flushed as it is written, so a run killed at
                          its time limit still leaves its counts
  --gpu-order             run in the plan's order: the registry guards, one case per test
                          function, backend and float dtype, then the rest; fastest first
                          within each pass (the slowest cases last)
  --gpu-include NAME      also select the tests of this function name when `-m gpu` would
                          deselect them (they get the gpu mark): the registry guard of the
                          CPU suite runs in the GPU run too (repeatable)
  --gpu-durations FILE    order by the durations of an earlier run (its log or summary.json)
  --gpu-skip-passed FILE  leave out the tests that passed in an earlier run (its log or
                          summary.json); the guards always run

Under pytest-xdist the workers collect and order (the same order on each), and the
controller, which receives every report, writes the log.
"""
from __future__ import annotations

import json
import os
import time

import pytest

import gpu_test_plan as plan


def pytest_addoption(parser):
    g = parser.getgroup("gpu run", "the GPU run's test step (tools/gpu_check.py)")
    g.addoption("--gpu-log", default=None, metavar="FILE", help="per-test log, JSON Lines")
    g.addoption("--gpu-order", action="store_true", help="guards, a first pass, then the rest")
    g.addoption("--gpu-include", action="append", default=[], metavar="NAME",
                help="also select the tests of this function name under -m gpu")
    g.addoption("--gpu-durations", default=None, metavar="FILE",
                help="order by the durations of an earlier run")
    g.addoption("--gpu-skip-passed", default=None, metavar="FILE",
                help="leave out the tests that passed in an earlier run")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


class _Log:
    def __init__(self, path: str):
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self.f = open(path, "w", buffering=1)

    def write(self, **ev) -> None:
        self.f.write(json.dumps(ev) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


_log: _Log | None = None
_planned = False


def pytest_configure(config):
    global _log, _planned
    _planned = False
    config.pluginmanager.register(_Order(), "gpu_pytest_plugin_order")
    path = config.getoption("--gpu-log")
    if path and not _is_worker(config):
        _log = _Log(path)
        _log.write(event="session", pid=os.getpid(), time=time.time())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Before the mark and keyword selection (tryfirst): the included tests get the gpu
    mark, so `-m gpu` keeps them."""
    names = set(config.getoption("--gpu-include") or ())
    for item in items:
        if getattr(item, "originalname", None) in names or item.name in names:
            item.add_marker(pytest.mark.gpu)


class _Order:
    """Registered by pytest_configure: a module holds one implementation per hook, and the
    order must come after the selection (trylast) where the gpu mark came before it."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        """The plan's order, and the tests that passed in an earlier run left out."""
        if config.getoption("--gpu-order"):
            durations = plan.load_durations(config.getoption("--gpu-durations"))
            tests = [(it.nodeid, tuple(m.name for m in it.iter_markers())) for it in items]
            items[:] = [items[i] for i, _ in plan.plan_order(tests, durations)]
        passed = plan.load_passed(config.getoption("--gpu-skip-passed"))
        if passed:
            keep = [it for it in items if it.nodeid not in passed or plan.is_guard(it.nodeid)]
            if len(keep) < len(items):
                kept = {id(it) for it in keep}
                config.hook.pytest_deselected(items=[it for it in items if id(it) not in kept])
                items[:] = keep


def _write_plan(config, nodeids) -> None:
    global _planned
    if _log is None or _planned:
        return
    _planned = True
    seen: set = set()
    order = []
    for n in nodeids:  # the run order: pass 1 is the first case of each key
        if plan.is_guard(n):
            p = 0
        else:
            key = plan.first_pass_key(n)
            p = 2 if key in seen else 1
            seen.add(key)
        order.append([n, p])
    if not config.getoption("--gpu-order"):
        order = [[n, 1] for n, _ in order]
    passed = len(plan.load_passed(config.getoption("--gpu-skip-passed")) - set(nodeids))
    _log.write(event="collected", n=len(order), order=order, passed_earlier=passed)


def pytest_collection_finish(session):
    if not _is_worker(session.config) and not _xdist_controller(session.config):
        _write_plan(session.config, [it.nodeid for it in session.items])


def _xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) or \
        bool(getattr(config.option, "dist", "no") not in (None, "no"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _write_plan(node.config, list(ids))


def pytest_collectreport(report):
    """A module that fails to collect, or skips itself at import (a missing package): its
    tests, gpu-marked ones included, are not in the plan."""
    if _log is None or report.passed:
        return
    lr = report.longrepr
    reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    _log.write(event="collect", nodeid=report.nodeid, outcome=report.outcome,
               reason=str(reason)[-500:])


def pytest_runtest_logstart(nodeid, location):
    if _log is not None:
        _log.write(event="start", nodeid=nodeid)


def pytest_runtest_logreport(report):
    if _log is None:
        return
    if report.when != "call" and report.outcome == "passed":
        return  # a setup or teardown that passed says nothing new
    ev = {"event": "report", "nodeid": report.nodeid, "when": report.when,
          "outcome": report.outcome, "duration": round(report.duration, 4)}
    if report.outcome == "skipped":
        lr = report.longrepr
        ev["reason"] = str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)
    _log.write(**ev)


def pytest_sessionfinish(session, exitstatus):
    global _log
    if _log is not None:
        _log.write(event="finish", exitstatus=int(exitstatus))
        _log.close()
        _log = None
