"""Training tooling for leanserve's small default model:

data          corpus (by-file held-out split), byte-level BPE tokenizer, packed token stream
architecture  the default model config, layer pattern and trainable init
forward       the batched training forward (checked against the inference forward) and the losses
trainer       the run's config, LR schedule, optimizer, the loop and scripts/train_small.py
evaluate      held-out figures through leanserve's inference path and scripts/eval_small.py
"""
