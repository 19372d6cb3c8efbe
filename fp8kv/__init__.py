"""fp8kv: exact FP8 paged KV-cache kernels (Triton) for PyTorch and JAX.

This core package holds the NumPy reference (:mod:`fp8kv.reference`), the Triton kernels
(:mod:`fp8kv.ops`), argument validation (:mod:`fp8kv.validate`) and launch plans
(:mod:`fp8kv.plan`). It imports neither torch nor jax; use :mod:`fp8kv_torch` or :mod:`fp8kv_jax`.
"""
from .arrays import ArrayInfo
from .formats import E4M3, E5M2, FORMATS, NVFP4, Format

__version__ = "0.1.0"
__all__ = ["ArrayInfo", "E4M3", "E5M2", "FORMATS", "Format", "NVFP4", "__version__"]
