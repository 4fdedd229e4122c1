"""What one decode token reads of each weight: the measure by which the pipeline's default split balances the
stages (engine/topology.py) and `bench formats` states a step's bytes.

At decode a step is bound by reading weights, so a token's cost in a part of the model is the bytes of that part
it reads: every dense tensor of a block (attention, indexer, compressors, norms, mHC, router, shared expert),
the top-k of its routed experts (k / E of the layer's expert bytes, scales included), one embedding row (and one
hash-routing row), the final norm, hc_head and the whole head. Bytes are as the checkpoint stores them: FP8 /
FP4 with their scales when the config says so, float32 for mHC, sinks, compressor position biases and router
biases, bfloat16 for every other float.
"""

from __future__ import annotations

import torch

from leanserve.model.config import ModelConfig


def token_read_bytes(cfg: ModelConfig, tokens: int = 1, with_mtp: bool = False) -> dict[str, float]:
    """Parameter / buffer name -> the bytes a decode step of `tokens` tokens reads of it, from the model's tensors
    built on the meta device (every layer; the MTP layer's `mtp.0.*` too with `with_mtp`). One token reads k / E
    of a layer's routed experts; `tokens` tokens (a token and its drafts, or a batch) the share of them that some
    token picks, 1 - (1 - k / E)^tokens, as if each token picked its k uniformly (what router balancing aims at);
    an embedding row (and a hash-routing row) per token; every other tensor once."""
    k, experts = cfg.num_experts_per_tok, cfg.n_routed_experts
    out = {}
    for name, t in model_tensors(cfg, with_mtp).items():
        nbytes = t.numel() * stored_dtype(name, t).itemsize
        if ".experts." in name:
            nbytes = nbytes * k // experts if tokens == 1 else nbytes * (1 - (1 - k / experts) ** tokens)
        elif name == "embed.weight" or name.endswith("tid2eid"):  # one row per token
            nbytes = nbytes // t.shape[0] * tokens
        out[name] = nbytes
    return out


def model_tensors(cfg: ModelConfig, with_mtp: bool = False) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name, every layer's (the MTP layer's too with `with_mtp`), built on
    the meta device: their shapes and dtypes, no memory."""
    from leanserve.model.deepseek_v4 import DeepseekV4, StageLayout

    layout = StageLayout(first_layer=0, end_layer=cfg.num_hidden_layers, is_first=True, is_last=True, index=0)
    with torch.device("meta"):
        return DeepseekV4(cfg, 1, layout, with_mtp=with_mtp).state_dict()


def stored_dtype(name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype tensor `name` of model_tensors has in a checkpoint: its own where it is one byte an element (FP8
    values, packed FP4 pairs, scales) or not a float, else the float dtype the checkpoint stores it in (float32
    for mHC, sinks, compressor position biases and router biases, bfloat16 for the rest)."""
    from leanserve.quantize import _float_dtype

    return t.dtype if t.element_size() == 1 or not t.is_floating_point() else _float_dtype(name)


def stage_costs(cfg: ModelConfig) -> tuple[list[int], int]:
    """(each layer's bytes per decode token, what the last stage reads besides its layers: final norm, hc_head
    and head). The embedding row, on the first stage, is left out: a lookup, not a pass over a matrix."""
    layers = [0] * cfg.num_hidden_layers
    tail = 0
    for name, nbytes in token_read_bytes(cfg).items():
        if name.startswith("layers."):
            layers[int(name.split(".")[1])] += nbytes
        elif not name.startswith("embed."):
            tail += nbytes
    return layers, tail
