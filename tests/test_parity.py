"""leanserve vs transformers (the numerical reference) on random-weight checkpoints, float32 on CPU.

Together the configs cover every attention kind (sliding, CSA, HCA), both MoE kinds, hc_mult 2 and 4, the
sqrtsoftplus and sigmoid router scores, YaRN and plain compress rope, and a Lightning Indexer whose
index_topk is smaller than the number of compressed rows (so its top-k really selects). Prompts are longer
than the sliding window and cross many compression boundaries. Indexer ties (transformers' top-k breaks
them by tensor shape, leanserve by row index) are made improbable with many indexer heads, or avoided with
an index_topk larger than the number of compressed rows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from leanserve.model.batch import Chunk
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, RopeConfig

TOL = 1e-4
NEW_TOKENS = 40

CONFIGS = {
    # The tiny preset: window 16, CSA rate 4 (index_topk 4 < rows), HCA rate 16, YaRN, hc_mult 4, sqrtsoftplus.
    "tiny-yarn-hc4-sqrtsoftplus": dict(seed=0, prompt_len=80, overrides=dict(index_n_heads=16)),
    # hc_mult 2, sigmoid router, plain compress rope, HCA first, hash MoE in the middle, window 12 and HCA rate
    # 8 (not multiples of each other); index_topk > compressed rows, so every row is kept.
    "hc2-sigmoid-plainrope": dict(
        seed=1,
        prompt_len=100,
        overrides=dict(
            hc_mult=2,
            scoring_func="sigmoid",
            num_hidden_layers=3,
            layer_types=(HCA, CSA, SLIDING),
            mlp_layer_types=(MOE, HASH_MOE, MOE),
            sliding_window=12,
            compress_rate_hca=8,
            index_topk=64,
            num_experts_per_tok=3,
            compress_rope=RopeConfig(theta=160000.0),
        ),
    ),
    # Two CSA layers in a row with a very sparse indexer (top-3), window 8, HCA rate 12, odd prompt length,
    # other rope thetas and YaRN parameters, two hash layers.
    "sparse-csa-yarn2-hc4": dict(
        seed=2,
        prompt_len=61,
        overrides=dict(
            num_hidden_layers=5,
            layer_types=(CSA, CSA, HCA, SLIDING, HCA),
            mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE, MOE),
            sliding_window=8,
            compress_rate_hca=12,
            index_topk=3,
            index_n_heads=32,
            routed_scaling_factor=2.5,
            max_position_embeddings=512,
            rope_theta=20000.0,
            main_rope=RopeConfig(theta=20000.0),
            compress_rope=RopeConfig(
                theta=50000.0,
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=64,
                beta_fast=16.0,
                beta_slow=2.0,
            ),
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, make_ckpt, lean_loader):
    spec = CONFIGS[request.param]
    path = make_ckpt(f"parity-{request.param}", seed=spec["seed"], **spec["overrides"])
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # always generate NEW_TOKENS tokens
    return spec, lean_loader(path, with_mtp=False), hf


def test_config_exercises_what_it_claims(pair):
    spec, lean, hf = pair
    cfg = lean.cfg
    assert list(cfg.layer_types) == list(hf.config.layer_types)
    assert list(cfg.mlp_layer_types) == list(hf.config.mlp_layer_types)
    n = spec["prompt_len"]
    assert n > cfg.sliding_window
    assert n // cfg.compress_rate_hca >= 3 or HCA not in cfg.layer_types
    if CSA in cfg.layer_types and cfg.index_topk < 64:
        assert n // cfg.compress_rate_csa > cfg.index_topk  # the indexer's top-k really selects


def test_prefill_logits_match_transformers(pair, lean_runner_cls, ids_of):
    spec, lean, hf = pair
    ids = ids_of(spec["prompt_len"], spec["seed"] + 100)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = lean_runner_cls(lean, num_slots=1, max_len=256).prefill(ids)
    assert ours.shape == ref.shape == (len(ids), lean.cfg.vocab_size)
    assert ours.dtype == torch.float32
    err = (ours - ref).abs().max().item()
    assert err <= TOL, f"max |dlogit| {err:.3g} over {len(ids)} positions"
    assert ref.abs().max() > 0.5  # not a degenerate model


def test_greedy_incremental_matches_transformers_generate(pair, lean_runner_cls, ids_of):
    spec, lean, hf = pair
    ids = ids_of(spec["prompt_len"], spec["seed"] + 200)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    ref = out[0, len(ids) :].tolist()
    assert len(ref) == NEW_TOKENS
    ours = lean_runner_cls(lean, num_slots=1, max_len=256).greedy(ids, NEW_TOKENS)
    assert ours == ref, (
        f"first divergence at generated token {next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)}"
    )


def test_decode_logits_match_transformers_full_forward(pair, lean_runner_cls, ids_of):
    # Every incremental step's logits (not just its argmax) against transformers' full forward, over a
    # sequence that keeps crossing window and compression boundaries while decoding.
    spec, lean, hf = pair
    ids = ids_of(spec["prompt_len"] + 24, spec["seed"] + 300)
    prompt = spec["prompt_len"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    run = lean_runner_cls(lean, num_slots=1, max_len=256)
    rows = [run.prefill(ids[:prompt])]
    for t in range(prompt, len(ids)):
        rows.append(run.step([Chunk(slot=0, start=t, token_ids=ids[t : t + 1])]))
    err = (torch.cat(rows) - ref).abs().max().item()
    assert err <= TOL, f"max |dlogit| {err:.3g}"
