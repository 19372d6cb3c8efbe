"""Shared fixtures (helpers: :mod:`tests.helpers`)."""
from __future__ import annotations

import pytest

from tests.helpers import DEVICES


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _jnp_launches_no_kernel(request, monkeypatch):
    """A test marked ``jnp`` runs fp8kv_jax's jnp path only: what it checks does not depend on
    the installed Triton (nor torch), which is why the CI legs whose JAX is the oldest leg's do
    not run it again (scripts/ci_leg.sh). It fails if it launches a Triton kernel, compiled or
    interpreted."""
    if request.node.get_closest_marker("jnp") is None:
        return
    import triton.runtime.interpreter
    import triton.runtime.jit

    def refuse(*args, **kwargs):
        raise AssertionError("a test marked jnp launched a Triton kernel")

    monkeypatch.setattr(triton.runtime.interpreter.GridExecutor, "__call__", refuse)
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", refuse)


# ---------------------------------------------------------------------------------------------
# --must-run: the test files a CI leg must run (scripts/ci_leg.sh declares them per leg). A file
# whose tests all skip -- a module-level importorskip on a broken install -- or that is not
# collected at all fails the session, naming it: a missing framework is never a silent skip.

def pytest_addoption(parser):
    parser.addoption(
        "--must-run", action="append", default=[], metavar="GLOB",
        help="test files (a glob relative to the rootdir; '!GLOB' takes files out again) of "
             "which at least one test must run, else the session fails naming them")


def pytest_configure(config):
    patterns = config.getoption("must_run")
    if patterns and not hasattr(config, "workerinput"):   # the controller (or a plain run)
        config.pluginmanager.register(MustRun(config.rootpath, patterns), "fp8kv-must-run")


class MustRun:
    """Which of the declared files ran a test; checked when the session ends."""

    def __init__(self, root, patterns):
        self.root = root
        self.files, self.stale = must_run_files(root, patterns)
        self.ran: set = set()
        self.skipped: dict = {}   # file -> why it was skipped whole
        self.missing: list = []

    def pytest_collectreport(self, report):
        if report.skipped and "::" not in report.nodeid:
            longrepr = report.longrepr
            why = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.skipped[report.nodeid] = why.removeprefix("Skipped: ")

    def pytest_runtest_logreport(self, report):
        ran = report.when == "call" and (not report.skipped or hasattr(report, "wasxfail"))
        if ran or (report.when == "setup" and report.failed):
            self.ran.add(report.nodeid.split("::")[0])

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        self.missing = [f for f in self.files if f not in self.ran]
        if self.missing or self.stale:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not (self.missing or self.stale):
            return
        terminalreporter.section("files this run must run (--must-run)", red=True)
        for pattern in self.stale:
            terminalreporter.line(f"--must-run {pattern}: matches no test file")
        for f in self.missing:
            why = self.skipped.get(f)
            terminalreporter.line(f"{f}: none of its tests ran ("
                                  + (f"skipped: {why}" if why else "not collected, or every "
                                     "test skipped or deselected") + ")")


def must_run_files(root, patterns) -> tuple[list, list]:
    """``(files, stale patterns)``: the rootdir-relative files the patterns name, in order, and
    the patterns that name no file (a renamed file must not drop out of the check unseen)."""
    files: dict = {}
    stale = []
    for pattern in patterns:
        drop = pattern.startswith("!")
        matched = sorted(p.relative_to(root).as_posix() for p in root.glob(pattern.lstrip("!"))
                         if p.is_file())
        if not matched:
            stale.append(pattern)
        for f in matched:
            if drop:
                files.pop(f, None)
            else:
                files[f] = None
    return list(files), stale
