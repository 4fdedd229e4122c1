"""`make-random --preset small` keeps DeepSeek-V4's real per-head shapes, and transformers agrees with it."""

import pytest
import torch

from leanserve.make_random import make_random
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.build import build_model
from leanserve.model.cache import CacheGeometry
from leanserve.model.config import CSA, HCA, ModelConfig
from leanserve.model.loader import load_weights


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return make_random(tmp_path_factory.mktemp("small"), "small", seed=5)


def test_small_preset_has_the_real_per_head_shapes(small_dir):
    cfg = ModelConfig.from_hf(small_dir)
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim) == (512, 64, 128)
    assert (cfg.compress_rate(CSA), cfg.compress_rate(HCA)) == (4, 128)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (64, 6)
    assert {CSA, HCA} <= set(cfg.layer_types) and cfg.has_mtp


def test_small_preset_logits_match_transformers(small_dir):
    from transformers import DeepseekV4ForCausalLM

    cfg = ModelConfig.from_hf(small_dir)
    ids = torch.randint(3, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    model = build_model(cfg, max_positions=256)
    load_weights(model, small_dir, progress=False)
    geo = CacheGeometry.build(cfg, num_slots=1, max_model_len=256)
    with torch.inference_mode():
        ours = model(build_forward_batch([Chunk(0, 0, ids)], geo), model.allocate_cache(geo, torch.float32))
        hf = DeepseekV4ForCausalLM.from_pretrained(small_dir, dtype=torch.float32).eval()
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
