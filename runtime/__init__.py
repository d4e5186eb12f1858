"""kvq's embedded inference engine.

Imports none of kvq's other packages: it must run on a GPU machine that has
only torch, safetensors, numpy and triton.
"""
