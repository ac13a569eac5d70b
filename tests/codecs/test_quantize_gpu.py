"""GPU: JAX quantization recipes byte for byte against the oracle on the device.

XLA:GPU lowers its own fp32 division to ``div.full.f32`` (<= 2 ulp) unless
``XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2`` is set; the recipes divide with
``division.divide`` (integer long division on GPUs), so they are bit-exact either way
(test_exact_without_flags_gpu.py runs them in a process without the flag).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
import oracle

pytestmark = pytest.mark.gpu


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


def _skip_reason():
    if _gpu() is None:
        return "needs an NVIDIA GPU (jax has no gpu device here)"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
@pytest.mark.parametrize("recipe", ["trtllm", "modelopt", "jax", "b12x"])
def test_gpu_quantize_bit_exact(recipe):
    rng = np.random.default_rng(7)
    f = jax.jit(lambda v, d: nj.quantize(v, recipe, decode_scale=d))
    for it in range(20):
        # block maxima log-uniform over ~2^-40..2^10 relative to the global scale:
        # many block scales land in E4M3 subnormals, some underflow, some saturate
        x = rng.standard_normal((256, 512)) * np.exp2(rng.uniform(-40, 10, (256, 32, 1))).repeat(16, -1).reshape(256, 512)
        x = x.astype(jnp.bfloat16).astype(np.float32)
        d = np.float32(np.abs(x).max() / 2688 * np.exp2(rng.uniform(-3, 3)))
        got = nj.to_oracle(f(jnp.asarray(x), jnp.float32(d)))
        want = oracle.quantize(x.astype(np.float64), recipe, decode_scale=float(d))
        assert np.array_equal(got.scales, want.scales), (recipe, it, "scale bytes")
        assert np.array_equal(got.codes, want.codes), (recipe, it, "codes")
