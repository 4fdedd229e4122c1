#!/usr/bin/env python
"""Train leanserve's small default model (DeepSeek-V4 architecture + MTP layer) on the Python standard library.

    python scripts/train_small.py --out models/small --minutes 60 --threads 2

See `--help` and leanserve/train/trainer.py.
"""

import sys

from leanserve.train.trainer import train_main

if __name__ == "__main__":
    sys.exit(train_main())
