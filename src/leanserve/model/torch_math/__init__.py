"""The torch statement of the model's math, as functions of typed weights (model/weights.py) and activations:
what TorchBackend runs, what the CPU backend falls back to, and what training calls. Read bottom-up: `ops` (small
ops), `mhc`, `compressor`, `attention`, `moe`, `blocks` (the wiring of a stage and of the MTP layer)."""
