"""The device probe (``nvfp4_jax.device``): every backend choice reads the device through it."""

from __future__ import annotations

import types

import jax
import pytest

from nvfp4_jax import device


def _fake(monkeypatch, platform: str, cc: str | None, platform_version: str = "cuda 12.8"):
    dev = types.SimpleNamespace(platform=platform, compute_capability=cc,
                                client=types.SimpleNamespace(platform_version=platform_version))
    monkeypatch.setattr(jax, "devices", lambda *a: [dev])
    monkeypatch.setattr(jax, "default_backend", lambda: platform)


@pytest.mark.parametrize("platform,cc,version,want,sm90,sm12x", [
    ("cpu", None, "", None, False, False),
    ("gpu", "9.0", "cuda 12.8", 90, True, False),
    ("gpu", "12.0", "cuda 12.8", 120, False, True),
    ("gpu", "12.1", "cuda 13.0", 121, False, True),
    ("gpu", "8.9", "cuda 12.8", 89, False, False),
    ("gpu", "9.4.2", "rocm 6.3", None, False, False),  # not NVIDIA
])
def test_compute_capability_and_families(monkeypatch, platform, cc, version, want, sm90, sm12x):
    _fake(monkeypatch, platform, cc, version)
    assert device.gpu_compute_capability() == want
    assert device.is_sm90() is sm90 and device.is_sm12x() is sm12x
    assert device.on_gpu() is (platform == "gpu")
    assert device.pallas_interpret() is (platform != "gpu")


def test_xla_division_flag(monkeypatch):
    _fake(monkeypatch, "cpu", None)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert device.xla_divides_ieee()  # XLA:CPU divides IEEE
    _fake(monkeypatch, "gpu", "9.0")
    assert not device.xla_divides_ieee()
    monkeypatch.setenv("XLA_FLAGS", device.IEEE_DIV_FLAG)
    assert device.xla_divides_ieee()


def test_backend_choices_read_the_probe(monkeypatch):
    """matmul's and moe's "auto" follow the probe: an sm_90 GPU gets the kernels, CPU gets XLA."""
    from nvfp4_jax.gemm import api as gemm_api
    from nvfp4_jax.moe import api as moe_api

    _fake(monkeypatch, "cpu", None)
    assert gemm_api.resolve_backend("auto") == "xla"
    assert moe_api.choose_backend("auto", None, routes=8, hidden=1024, experts=128) == "xla"
    _fake(monkeypatch, "gpu", "9.0")
    monkeypatch.setattr(gemm_api, "register_sm12x_device_kinds", lambda: False)
    assert gemm_api.resolve_backend("auto") == "pallas"
    assert moe_api.choose_backend("auto", None, routes=8, hidden=1024, experts=128) == "mosaic"
    _fake(monkeypatch, "gpu", "12.0")
    from nvfp4_jax.gemm.mosaic import has_mma_sync  # the Mosaic MoE's SM 12.x form: JAX >= 0.11

    want = "mosaic" if has_mma_sync() else "pallas"
    assert moe_api.choose_backend("auto", None, routes=8, hidden=1024, experts=128) == want
    assert moe_api.choose_backend("auto", None, routes=4096, hidden=1024, experts=128) == "pallas"
