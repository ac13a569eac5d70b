"""The library runs without its test and plot tooling: hypothesis and matplotlib are optional
extras (``test``, ``plot``), imported only where they are used, with a message saying how to
install them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a subprocess in which importing hypothesis or matplotlib fails, as on a plain install
_BLOCK = textwrap.dedent("""
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("hypothesis", "matplotlib"):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None
    sys.meta_path.insert(0, _Block())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_library_and_cli_import_without_hypothesis_or_matplotlib():
    r = _run("""
        import nvfp4_jax, nvfp4_jax.cli, nvfp4_jax.audit, nvfp4_jax.crosscheck, nvfp4_jax.explain
        import nvfp4_jax.checkpoint, nvfp4_jax.testing.assertions
        from nvfp4_jax.testing import assert_moe_close
        assert "hypothesis" not in sys.modules and "matplotlib" not in sys.modules
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_strategies_and_plot_say_which_extra_to_install():
    r = _run("""
        try:
            import nvfp4_jax.testing.strategies
        except ImportError as e:
            print("strategies:", e)
        from nvfp4_jax import audit
        try:
            audit.plot([], "x.png")
        except ImportError as e:
            print("plot:", e)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("strategies:") and "nvfp4-jax[test]" in ln for ln in lines), r.stdout
    assert any(ln.startswith("plot:") and "nvfp4-jax[plot]" in ln for ln in lines), r.stdout
