"""Suite-wide setup.

Triton reads TRITON_INTERPRET when it is first imported, so it must be set
before any test module imports runtime.kernels: without a GPU, kernels run
under the interpreter on CPU tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The real Triton deployment, started once per test session for every module that uses it.
from helpers_triton import triton_engine_dir, triton_reference, triton_repo_dir, triton_served  # noqa: E402, F401
