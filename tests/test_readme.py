"""The README is a user's manual that stays true: its Python snippets run as written (on a CPU
machine too), its test command is the one CI runs, its signatures and argument table are the
code's, its architecture lists every module, and its performance table is the committed GPU
run's (``python -m bench.readme_table``)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tests.helpers import jnp_where_jax_runs_on_the_cpu

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
# A JAX snippet without torch runs on JAX's default device: the jnp path where that is the CPU.
PARAMS = [pytest.param(i, marks=jnp_where_jax_runs_on_the_cpu()
                       if "fp8kv_jax" in code and "torch" not in code else [])
          for i, code in enumerate(SNIPPETS)]
TEST_COMMAND = "python -m pytest tests fp8kv_torch fp8kv_jax --doctest-modules -q -n auto"
FUNCTIONS = ("write_kv", "write_kv_combined", "dequantize_pages", "dequantize_pages_combined",
             "rope_write_kv", "rope_write_kv_combined", "paged_attention",
             "paged_attention_combined")
# Where the frontends' signatures differ, as the README says under each function.
TORCH_ONLY = {"dequantize_pages": {"out"}, "dequantize_pages_combined": {"out"},
              "rope_write_kv": {"key_out"}, "rope_write_kv_combined": {"key_out"},
              "paged_attention": {"out"}, "paged_attention_combined": {"out"}}
JAX_ONLY = {"rope_write_kv": {"return_key"}, "rope_write_kv_combined": {"return_key"}}


def _section(title: str) -> str:
    """The text of ``## title`` up to the next ``## ``."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def test_readme_is_a_manual_not_a_log():
    lines = README.splitlines()
    assert len(lines) <= 300, len(lines)
    first_screen = "\n".join(lines[:40])
    assert "bash scripts/test.sh" in first_screen and "bash scripts/bench.sh" in first_screen
    # No run-by-run history: the only results it names are the committed GPU run's.
    assert set(re.findall(r"bench/results/[\w./-]*", README)) == {"bench/results/gpu/"}
    assert not re.search(r"session|item \d|NOTES\.md,? item|previous run|goal", README, re.I)


def test_readme_test_command_is_what_ci_runs():
    """The command the README gives is the one .ci/run runs in every leg (and the GPU script)."""
    assert f"```bash\n{TEST_COMMAND}\n```" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'{TEST_COMMAND} "${{LEG_ARGS[@]}}" "${{LEG_MUST_RUN[@]}}" "$@"' in ci
    gpu = (ROOT / "scripts" / "gpu.sh").read_text()
    assert "python -m pytest tests fp8kv_torch fp8kv_jax --doctest-modules" in gpu.replace(
        '"$PY"', "python")


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", PARAMS)
def test_readme_snippet_runs(index):
    code = SNIPPETS[index]
    for module in re.findall(r"import ([\w, .]+)", code.splitlines()[0]):
        for name in module.split(","):
            pytest.importorskip(name.strip().split(".")[0])
    exec(compile(code, f"README.md snippet {index}", "exec"), {})


def _readme_signature(name: str) -> list[tuple[str, str | None]]:
    """``[(parameter, default or None)]`` of the README's line ``name(...)``; ``("*", None)``
    marks the keyword-only ones."""
    line = re.search(rf"^{name}\((.*)\)$", _section("API"), re.M)
    assert line, f"README: no signature of {name}"
    params = []
    for part in line.group(1).split(", "):
        param, _, default = part.partition("=")
        params.append((param, default or None))
    return params


def _code_signature(function, leave_out=()) -> list[tuple[str, str | None]]:
    params, star = [], False
    for p in inspect.signature(function).parameters.values():
        if p.name in leave_out:
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append(("*", None))
            star = True
        default = None
        if p.default is not p.empty:
            default = getattr(p.default, "__name__", None) or str(p.default).split(".")[-1]
            default = f'"{p.default}"' if isinstance(p.default, str) else default
        params.append((p.name, default))
    return params


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("frontend", ["fp8kv_torch", "fp8kv_jax"])
def test_readme_signatures_are_the_code(frontend, name):
    """torch's signature is the README's; JAX's the same less ``out=`` / ``key_out=`` plus
    ``return_key=`` (which the README's notes say)."""
    module = pytest.importorskip(frontend)
    readme = _readme_signature(name)
    if frontend == "fp8kv_torch":
        assert _code_signature(getattr(module, name)) == readme
        return
    jax_only = JAX_ONLY.get(name, set())
    want = [p for p in readme if p[0] not in TORCH_ONLY.get(name, set())]
    assert _code_signature(getattr(module, name), leave_out=jax_only) == want
    api = _section("API")
    for param in TORCH_ONLY.get(name, set()) | jax_only:
        assert re.search(rf"JAX [^.]*`{param}=", api), param   # "JAX has no `out=`" ...


def test_readme_argument_table_names_every_argument():
    table = _section("API").split("### Arguments", 1)[1]
    listed = {name for row in re.findall(r"^\| (`.*?`) \|", table, re.M)
              for name in re.findall(r"`(\w+)`", row)}
    for name in FUNCTIONS:
        params = {p for p, _ in _readme_signature(name) if p != "*"}
        params |= JAX_ONLY.get(name, set())
        assert params <= listed, (name, params - listed)


def test_readme_architecture_lists_every_module():
    section = _section("Architecture")
    modules = sorted(str(p.relative_to(ROOT)) for pkg in ("fp8kv", "fp8kv_torch", "fp8kv_jax")
                     for p in (ROOT / pkg).rglob("*.py"))
    missing = [m for m in modules if not re.search(rf"^{re.escape(m)}\s", section, re.M)]
    assert not missing, missing


def test_readme_performance_table_is_the_committed_gpu_run():
    """``python -m bench.readme_table`` on ``bench/results/gpu/``, verbatim: replace the run,
    print the table again, paste it."""
    from bench.readme_table import table

    assert table() in _section("Performance")
