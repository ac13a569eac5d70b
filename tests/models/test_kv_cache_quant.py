"""A checkpoint with a quantized KV cache: the loader keeps K and V in bf16 and says so.

ModelOpt (0.47.0, constraints.txt) exports ``NVFP4_DEFAULT_CFG`` + ``FP8_KV_CFG`` with
``kv_cache_quant_algo: "FP8"`` in hf_quant_config.json, ``kv_cache_scheme`` in config.json's
``quantization_config``, and each attention layer's ``k_proj.k_scale`` / ``v_proj.v_scale``
(amax / 448). TensorRT-LLM and vLLM store K and V in FP8 with those scales; nvfp4_jax does not
apply them: ``load_model`` logs ``loader.KV_CACHE_NOTICE`` (a WARNING on
``nvfp4_jax.models``), the model is the one the same export loads without its KV-cache
tensors and declaration, and ``nvfp4 generate --json`` records it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("modelopt", reason="nvidia-modelopt (the `peers` extra) makes the export")
pytest.importorskip("transformers", reason="transformers builds the model ModelOpt exports")

import jax.numpy as jnp
from hf_reference import make_checkpoint

from nvfp4_jax import checkpoint as C
from nvfp4_jax import models
from nvfp4_jax.cli import main

ST = "model.safetensors"
PROMPT = [[3, 141, 59, 26, 5, 35, 89, 79]]


@pytest.fixture(scope="module")
def fp8_kv(tmp_path_factory):
    return make_checkpoint("dense", str(tmp_path_factory.mktemp("kv") / "fp8"), kv_cache="fp8")


def _without_kv(src: str, dst: str) -> str:
    """``src`` with its KV-cache tensors and both declarations removed."""
    shutil.copytree(src, dst)
    f = C.SafetensorsFile(os.path.join(dst, ST))
    t = {n: (f.get(n).view(np.uint16) if f.dtype(n) == "BF16" else f.get(n), f.dtype(n))
         for n in f.names() if n.rpartition(".")[2] not in ("k_scale", "v_scale")}
    del f
    C.write_safetensors(os.path.join(dst, ST), t, {"format": "pt"})
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json", None)):
        with open(os.path.join(dst, name)) as fh:
            c = json.load(fh)
        q = c[key] if key else c["quantization_config"]
        q.pop("kv_cache_quant_algo", None)
        q.pop("kv_cache_scheme", None)
        with open(os.path.join(dst, name), "w") as fh:
            json.dump(c, fh)
    return dst


def _logits(path: str) -> np.ndarray:
    model = models.load_model(path)
    cache = models.init_cache(model.config, 1, 16)
    logits, _ = models.forward(model, jnp.asarray(PROMPT, jnp.int32), cache, backend="xla")
    return np.asarray(logits)


def test_modelopt_writes_what_the_loader_recognises(fp8_kv):
    """The export declares FP8 in both places and holds k_proj.k_scale / v_proj.v_scale of
    both layers: the names ``checks.KV_CACHE_TENSORS`` and ``Checkpoint.kv_cache_quant`` read."""
    ck = C.load(fp8_kv)
    assert ck.config["quantization_config"]["kv_cache_scheme"] == {
        "dynamic": False, "num_bits": 8, "type": "float"}
    assert ck.kv_cache_quant == "FP8"
    kv = [n for n in ck.names() if n.endswith(("k_scale", "v_scale"))]
    assert kv == [f"model.layers.{i}.self_attn.{p}_proj.{p}_scale" for i in (0, 1)
                  for p in ("k", "v")]
    # config.json's kv_cache_scheme alone (no hf_quant_config.json) reads the same
    only_cfg = fp8_kv + "-config-json"
    shutil.copytree(fp8_kv, only_cfg)
    os.remove(os.path.join(only_cfg, "hf_quant_config.json"))
    assert C.load(only_cfg).kv_cache_quant == "FP8"


def test_load_says_the_fp8_cache_is_not_applied_and_the_model_ignores_it(fp8_kv, tmp_path,
                                                                          caplog):
    with caplog.at_level(logging.WARNING, logger="nvfp4_jax.models"):
        got = _logits(fp8_kv)
    notes = [r for r in caplog.records if r.name == "nvfp4_jax.models"
             and r.levelno == logging.WARNING]
    assert len(notes) == 1, caplog.text
    msg = notes[0].getMessage()
    for want in ("KV cache is quantized (FP8; k_scale / v_scale of 2 attention layers)",
                 "does not apply", "K and V stay bf16", fp8_kv):
        assert want in msg, msg
    bare = _without_kv(fp8_kv, str(tmp_path / "bare"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nvfp4_jax.models"):
        want = _logits(bare)
    assert not [r for r in caplog.records if r.name == "nvfp4_jax.models"], caplog.text
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_declared_cache_without_scales_is_said_too(fp8_kv, tmp_path, caplog):
    """config.json declaring an FP8 cache with no k_scale / v_scale tensors (a known export
    fault): the notice says there are none."""
    d = _without_kv(fp8_kv, str(tmp_path / "undeclared"))
    with open(os.path.join(d, "hf_quant_config.json")) as fh:
        c = json.load(fh)
    c["quantization"]["kv_cache_quant_algo"] = "FP8"
    with open(os.path.join(d, "hf_quant_config.json"), "w") as fh:
        json.dump(c, fh)
    with caplog.at_level(logging.WARNING, logger="nvfp4_jax.models"):
        models.load_model(d, stack=False)
    assert "(FP8; no k_scale / v_scale tensors)" in caplog.text, caplog.text


def test_generate_json_records_the_cache(fp8_kv, tmp_path, capsys):
    out = tmp_path / "gen.json"
    rc = main(["generate", "--checkpoint", fp8_kv, "--prompt-ids", "3,141,59",
               "--max-new-tokens", "2", "--backend", "xla", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rec = json.loads(out.read_text())
    assert rec["kv_cache"] == "bf16" and rec["checkpoint_kv_cache_quant"] == "FP8"
