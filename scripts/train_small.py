#!/usr/bin/env python
"""Train leanserve's small default model (DeepSeek-V4 architecture + MTP layer) on the Python standard library.

    python scripts/train_small.py --out models/small --minutes 60 --threads 2

See `--help` and train/trainer.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train/ is not installed

from train.trainer import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())
