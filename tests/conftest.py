"""One thread per process, as on the 2-core CI machine where several ranks share the cores."""

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))  # the multi-process harness, tests/distributed.py
