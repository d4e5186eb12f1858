"""Suite-wide setup.

Triton reads TRITON_INTERPRET when it is first imported, so it must be set
before any test module imports runtime.kernels: without a GPU, kernels run
under the interpreter on CPU tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
