"""The training tests run their tiny models on one torch thread, like the evaluation tests."""

import torch

torch.set_num_threads(1)
