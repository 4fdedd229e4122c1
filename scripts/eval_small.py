#!/usr/bin/env python
"""Held-out figures of a model written by scripts/train_small.py: trunk next-token top-1 accuracy, the MTP
layer's agreement with the trunk's greedy next-next token (the speculative acceptance rate) and its top-1
accuracy against the real token.

    python scripts/eval_small.py --model models/small
"""

import sys

from leanserve.train.trainer import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
