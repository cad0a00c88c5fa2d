"""One thread per process, as on the 2-core CI machine where several ranks share the cores."""

import torch

torch.set_num_threads(1)
