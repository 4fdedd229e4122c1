#!/usr/bin/env python
"""Fine-tune a trained model's trunk against greedy repetition: sequence-level unlikelihood on its own greedy
continuations of training prefixes, beside the next-token loss (see train/unlikelihood.py).

    python scripts/unlikelihood.py --model models/small --out models/small --steps 300 --threads 2

The MTP layer is frozen: distil it afterwards (scripts/distill_mtp.py), then rewrite the model card
(scripts/model_card.py). Held-out figures before and after go into OUT/train_summary.json ("unlikelihood");
the per-step log is OUT/unlikelihood_log.jsonl.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train/ is not installed

from train.unlikelihood import unlikelihood_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(unlikelihood_main())
