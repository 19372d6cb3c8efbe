"""The declared dependency ranges admit every version that is tested (CI's legs and the GPU
suite), the README's version table says the same, the license file matches the metadata, and
the package description (the wheel's) stands alone."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What scripts/gpu.sh runs on the H200 image (it installs jax-triton 0.3.1 itself).
GPU_SUITE = {"torch": "2.11.0", "triton": "3.6.0", "jax": "0.11.2", "jax-triton": "0.3.1"}


def _ranges() -> dict:
    """name -> SpecifierSet, from the dependencies and every extra."""
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    ranges = {}
    for r in reqs:
        assert ranges.setdefault(r.name, r.specifier) == r.specifier, f"{r.name}: two ranges"
    return ranges


def _leg_pins() -> dict:
    """leg -> {package: version} from scripts/ci_leg.sh's case table."""
    text = (ROOT / "scripts" / "ci_leg.sh").read_text()
    legs = {}
    for leg, jax, pins in re.findall(
            r"^\s+(\w+)\)\s+PY_VERSION=[\d.]+; JAX_PIN=(\S+);\s+PINS=\(([^)]*)\)", text, re.M):
        jax = {"$OLDEST_JAX": re.search(r"OLDEST_JAX=(\S+)", text).group(1)}.get(jax, jax)
        legs[leg] = dict(p.strip('"').split("==") for p in pins.split())
        legs[leg]["jax"] = jax
    return legs


def test_every_leg_is_read():
    assert set(_leg_pins()) == {"oldest", "newest", "torch214", "jax"}


@pytest.mark.parametrize("where", ["oldest", "newest", "torch214", "jax", "gpu-suite"])
def test_tested_versions_inside_the_ranges(where):
    pins = GPU_SUITE if where == "gpu-suite" else _leg_pins()[where]
    ranges = _ranges()
    for name, version in pins.items():
        assert Version(version) in ranges[name], f"{where}: {name} {version} not in {ranges[name]}"


def test_range_bounds_are_tested():
    """The torch extra's lower bound is the GPU suite's torch, its upper bound admits no release
    newer than the newest tested one's minor version."""
    torch = _ranges()["torch"]
    tested = [Version(p["torch"]) for p in [*_leg_pins().values(), GPU_SUITE] if "torch" in p]
    assert min(tested) == Version("2.11.0") and Version("2.11.0") in torch
    newest = max(tested)
    assert Version(f"{newest.major}.{newest.minor + 1}") not in torch


def test_readme_version_table_matches():
    readme = (ROOT / "README.md").read_text()
    below, at_least = sorted(str(_ranges()["torch"]).split(","))   # "<2.15", ">=2.11"
    assert f"| {at_least.replace('>=', '>= ')}, {below.replace('<', '< ')} |" in readme
    for leg, pins in _leg_pins().items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| CI leg `{leg}` |"))
        for version in pins.values():
            assert version in row, (leg, version, row)
    gpu = next(line for line in readme.splitlines() if line.startswith("| GPU suite"))
    assert all(v in gpu for v in GPU_SUITE.values()), gpu


def test_license_matches_metadata():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Copyright 2026 The fp8kv authors" in text


DESCRIPTION = ROOT / PYPROJECT["project"]["readme"]


def test_package_description_stands_alone():
    """The wheel's description is a short file of its own, not the README: it names no file of
    the repository (the wheel has none of them) and links nowhere."""
    assert PYPROJECT["project"]["readme"] == "DESCRIPTION.md"
    text = DESCRIPTION.read_text()
    assert len(text.splitlines()) <= 60
    assert not re.search(r"\]\(", text), "a link"
    named = re.findall(r"[\w./-]+\.(?:md|py|sh|toml|csv)\b|\b(?:docs|bench|scripts|tests|examples)/",
                       text)
    assert named == [], named


def test_package_description_says_how_to_install():
    text = DESCRIPTION.read_text()
    for extra in ("torch", "jax", "jax-gpu"):
        assert extra in PYPROJECT["project"]["optional-dependencies"]
        assert f'pip install "fp8kv[{extra}]"' in text, extra
    cpu_torch = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_torch in text and cpu_torch in (ROOT / "README.md").read_text()


def test_package_description_example_runs():
    (code,) = re.findall(r"```python\n(.*?)```", DESCRIPTION.read_text(), flags=re.S)
    assert len(code.strip().splitlines()) <= 12
    pytest.importorskip("torch")
    exec(compile(code, "DESCRIPTION.md example", "exec"), {})
