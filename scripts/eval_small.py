#!/usr/bin/env python
"""Held-out figures of a model written by scripts/train_small.py: trunk next-token top-1 accuracy, the MTP
layer's agreement with the trunk's greedy next-next token (the speculative acceptance rate) and its top-1
accuracy against the real token.

    python scripts/eval_small.py --model models/small --json-out models/small/eval.json

It prints a table, then the figures as JSON; --json-out also writes the JSON to a file (for scripts/model_card.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train/ is not installed

from train.evaluate import eval_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(eval_main())
