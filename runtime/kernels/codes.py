"""The compile-time codes a KV format becomes in the kernels (`formats.KernelFormat`), one name each, used alike by
the host code (`kf.kind == codes.INT4`) and inside @triton.jit / @gluon.jit functions (`KIND == codes.INT4`:
a kernel reads a module's attributes as constants, so the branches of other formats compile away)."""

# Storage kinds (KernelFormat.kind, the kernels' KIND): how a stored element becomes a number.
FLOAT = 0  # fp32/fp16/bf16/fp8: the stored value is the number (times a scale for fp8)
INT8 = 1  # int8 (symmetric) or uint8 (asymmetric)
INT4 = 2  # two 4-bit values per byte, even element in the low nibble

# Where the dequantization scale comes from (KernelFormat.scale_mode, the kernels' SCALE_MODE).
NO_SCALE = 0  # unquantized fp16/bf16/fp32
PER_TENSOR = 1  # one fp32 scalar per layer (k and v each)
PER_HEAD = 2  # one fp32 per KV head
PER_TOKEN = 3  # one per (block, head, slot), in the format's scale dtype

# Storage dtype of per-token scales (KernelFormat.scale_dtype, the write kernel's SCALE_DT: it rounds to it).
SCALE_FP16 = 0
SCALE_BF16 = 1
SCALE_FP32 = 2
SCALE_E8M0 = 3  # a power of two stored as its biased exponent byte (fp32's exponent field)

# fp8 encodings (KernelFormat.fp8, the write kernel's FP8): the bit-exact integer encoder, or (the _HW codes) the
# GPU's saturating conversion instruction for the same encoding.
FP8_NONE = 0
FP8_E4M3 = 1
FP8_E5M2 = 2
FP8_E4M3_HW = 3
FP8_E5M2_HW = 4

# How tl.dot runs (the Triton kernels' DOT): native fp16/bf16 tensor cores; fp32 in IEEE precision (q in fp32,
# parity runs); or fp32 operands in place of bf16 ones, because the Triton 3.6 interpreter's bf16 tl.dot and
# int8->bf16 casts return garbage.
DOT_NATIVE = 0
DOT_IEEE = 1
DOT_UPCAST = 2
