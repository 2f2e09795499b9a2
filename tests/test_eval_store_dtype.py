"""One model's weights in two dtypes on one --store folder: each dtype has its base store (the KV dtype is in the
store key beside the weights digest), populated once and reused by later runs of its own dtype."""

import numpy as np
import pytest

import specjax
from specjax.checkpoint import save_model_dir
from specjax.config import from_hf_config
from specjax.configs.models import MODEL_SHAPES
from specjax.eval import registry, runner, systems, tasks, workload
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.models.params import init_params


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A converted float32 checkpoint (its weights digest is the manifest's, whatever dtype it is loaded in)."""
    out = tmp_path_factory.mktemp("dtype") / "tiny"
    cfg = from_hf_config(MODEL_SHAPES["tiny-llama"])
    save_model_dir(out, cfg, init_params(cfg, seed=0, dtype=np.float32), tokenizer_json=None, source="test")
    return out


def _evaluate(model, store):
    wl = workload.build_workload(tasks.load_task("needle"), tokenizer_for(model)[0],
                                 workload.WorkloadSpec(limit=2, prefix_tokens=64))
    (run,) = runner.run_all(model, wl, runner.plan(["as_full"], [0.25]), systems.SystemSettings(chunk_tokens=16),
                            store)
    return run.store


def test_a_bfloat16_run_on_a_float32_store_folder_gets_its_own_base_store(converted, tmp_path):
    f32, bf16 = (specjax.load_model(str(converted), dtype=d) for d in ("float32", "bfloat16"))
    assert f32.weights_digest == bf16.weights_digest
    short = f32.weights_digest[:12]
    store = tmp_path / "store"
    first = {d: _evaluate(m, store) for d, m in (("float32", f32), ("bfloat16", bf16))}
    for dtype, record in first.items():
        assert record["base"] == f"base-prefixes-chunk16-weights-{short}-{dtype}" and record["prefixes_written"] == 1
    assert sorted(p.name for p in store.iterdir() if p.is_dir() and p.name.startswith("base-")) == sorted(
        r["base"] for r in first.values())
    again = {d: _evaluate(m, store) for d, m in (("float32", f32), ("bfloat16", bf16))}
    for dtype, record in again.items():
        assert record["base"] == first[dtype]["base"]
        assert record["prefixes_written"] == 0 and record["prefixes_reused"] == 1
    blend = registry.make_system("full_reuse", bf16, systems.SystemSettings(chunk_tokens=16))
    assert blend.store_key == f"text_chunks-sink-chunk16-weights-{short}-bfloat16"
