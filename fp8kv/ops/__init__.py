"""Triton kernels, one op per module; see :func:`fp8kv.ops._dual.kernel_for` for the CPU twin.

Which kernel a call launches is its plan's ``kernel`` (:class:`fp8kv.plan.LaunchPlan`).
"""
from ._dual import interpreted, kernel_for
from .dequantize_nvfp4 import _dequantize_nvfp4_kernel
from .dequantize_pages import _dequantize_pages_kernel
from .paged_attention import _attention_merge_kernel, _paged_attention_kernel
from .rope_write_kv import _rope_write_kv_kernel
from .write_kv import _write_kv_kernel
from .write_nvfp4 import _write_nvfp4_kernel

__all__ = ["kernel_for", "interpreted", "_write_kv_kernel", "_dequantize_pages_kernel",
           "_rope_write_kv_kernel", "_write_nvfp4_kernel", "_dequantize_nvfp4_kernel",
           "_paged_attention_kernel", "_attention_merge_kernel"]
