"""The supported JAX range (``nvfp4_jax.versions``) and the import-time refusal of others."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from nvfp4_jax import versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_installed_jax_is_supported():
    assert versions.unsupported_reason(jax.__version__) is None


@pytest.mark.parametrize("v, ok", [("0.10.2", True), ("0.11.2", True), ("0.11.9.dev20261001", True),
                                   ("0.10.1", False), ("0.9.2", False), ("0.12.0", False),
                                   ("0.12.0.dev20261101", False), ("1.0", False)])
def test_range(v, ok):
    assert (versions.unsupported_reason(v) is None) == ok


def test_parse_version_names_the_argument():
    assert versions.parse_version("0.11.2rc1") == (0, 11, 2)
    with pytest.raises(ValueError, match="version: expected"):
        versions.parse_version("nightly")


def _import_with_jax_version(v: str, allow: bool = False) -> subprocess.CompletedProcess:
    code = ("import jax; jax.__version__ = %r\n"
            "import nvfp4_jax\n"
            "print('imported', nvfp4_jax.versions.SUPPORTED_JAX)\n") % v
    env = {k: val for k, val in os.environ.items() if k != versions.ALLOW_UNTESTED_ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    if allow:
        env[versions.ALLOW_UNTESTED_ENV] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_import_under_an_unsupported_jax_fails_saying_why_and_what_works():
    p = _import_with_jax_version("0.12.1")
    assert p.returncode != 0 and "imported" not in p.stdout
    assert "ImportError" in p.stderr
    assert "jax 0.12.1" in p.stderr and versions.SUPPORTED_JAX in p.stderr
    assert "Pallas-Triton" in p.stderr and "0.10.2" in p.stderr and "0.11.2" in p.stderr
    old = _import_with_jax_version("0.9.0")
    assert old.returncode != 0 and "jax 0.9.0" in old.stderr


def test_import_under_a_supported_or_allowed_jax_works():
    p = _import_with_jax_version("0.11.2")
    assert p.returncode == 0 and "imported" in p.stdout, p.stderr[-2000:]
    p = _import_with_jax_version("0.12.1", allow=True)
    assert p.returncode == 0 and "imported" in p.stdout, p.stderr[-2000:]
    assert "continuing" in p.stderr


def test_pyproject_declares_the_supported_jax_range():
    """pip resolves only the JAX versions the import accepts (pyproject == versions.py)."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    specs = {r.name: r.specifier for r in deps}
    assert specs["jax"] == SpecifierSet(versions.SUPPORTED_JAX)
    assert specs["jaxlib"] == SpecifierSet(versions.SUPPORTED_JAX)
