#!/usr/bin/env python
"""Write the model card (README.md) and the loss curve (loss_curve.png) of a model trained by
scripts/train_small.py, from its train_summary.json / train_log.jsonl, optional eval_small.py figures and a
greedy example completion.

    python scripts/eval_small.py --model models/small --json-out models/small/eval.json
    python scripts/model_card.py --model models/small --eval-json models/small/eval.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train/ is not installed

from card import card_main  # noqa: E402 - scripts/card.py, beside this script

if __name__ == "__main__":
    sys.exit(card_main())
