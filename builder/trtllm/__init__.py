"""TensorRT-LLM backend: checkpoint writer, HF-layout KV scales, trtllm-build driver."""

from .build_cmd import parse_kv_pool_log, run_trtllm_build, trtllm_build_available, trtllm_build_command
from .checkpoint import write_trtllm_checkpoint
from .hf_scales import export_hf_kv_scales

__all__ = ["export_hf_kv_scales", "parse_kv_pool_log", "run_trtllm_build", "trtllm_build_available",
           "trtllm_build_command", "write_trtllm_checkpoint"]
