#!/usr/bin/env python
"""Distil a trained model's MTP layer towards its own trunk, for a higher speculative acceptance; the trunk's
weights stay byte-identical (see train/distill.py).

    python scripts/distill_mtp.py --model models/small --out models/small --steps 300 --threads 2

Held-out figures before and after go into OUT/train_summary.json ("mtp_distill"); the per-step log is
OUT/distill_log.jsonl. Rewrite the model card afterwards with scripts/model_card.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train/ is not installed

from train.distill import distill_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(distill_main())
