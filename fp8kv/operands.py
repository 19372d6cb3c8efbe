"""The operand map: which argument each kernel array parameter reads or writes, declared once.

Both frontends launch a kernel from a validated call and its :class:`OperandMap`: every input
parameter (``X_ptr``) names the call argument whose array it reads, every output parameter
(``X_out_ptr``, ``key_out_ptr`` ...) the argument it writes and, when it writes in place, the
input parameter whose buffer it shares (torch passes the same tensor; jax-triton aliases the
input to the output, so that a donated cache is updated in place). An output the plan never writes
has no source (jax-triton gets no buffer for it where it can, torch any pointer). An input the
plan never reads (no device scale) takes the op's placeholder argument, an array the call always
has.

Argument names are the public ones (``key``, ``value``, ``key_cache``, ``value_cache``,
``kv_cache``, ``slots``, ``key_scale``, ``value_scale``, ``key_scale_cache``,
``value_scale_cache``, ``block_table``, ``out_scale``, ``layer``) plus the dequantize outputs
``key_out``, ``value_out``, ``kv_out`` and ``table_out``. An nvfp4 side reads its global scale
(``key_scale``) and its block scales (``key_scale_cache``) through two parameters. A combined
cache is one argument, ``kv_cache``, read through both cache parameters (the plan's offset finds
V) and written through the K output alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from .modes import SideScale


@dataclass(frozen=True)
class Operand:
    """One array parameter of a kernel.

    ``source``: the argument it takes (None: an output that is never written). ``used``: whether
    the kernel reads it (an input) or writes it (an output) under this plan. ``aliases``: for an
    output written in place, the input parameter holding the same buffer.
    """

    param: str
    source: str | None
    used: bool = True
    aliases: str | None = None


@dataclass(frozen=True)
class OperandMap:
    """A kernel's array parameters in its own order, inputs then outputs."""

    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]

    @property
    def params(self) -> tuple[Operand, ...]:
        return self.inputs + self.outputs

    @property
    def updated(self) -> tuple[str, ...]:
        """The arguments written in place (each once, in output order)."""
        return tuple(dict.fromkeys(o.source for o in self.outputs if o.aliases))

    @property
    def new_outputs(self) -> tuple[str, ...]:
        """The arguments that are new outputs (written, not aliased): dequantize's pages."""
        return tuple(o.source for o in self.outputs if o.used and not o.aliases)

    def arrays(self, given: dict, unused=None) -> dict:
        """``{parameter: array}`` from ``given`` (``{argument: array}``); an unused output gets
        ``unused`` (or, where that is None, the placeholder of the first unused input, or the
        first input's array)."""
        out = {o.param: given[o.source] for o in self.inputs}
        for o in self.outputs:
            if o.source is not None:
                out[o.param] = given[o.source]
            else:
                out[o.param] = unused if unused is not None else given[self.inputs[0].source]
        return out


def scale_input(side: str, scale: SideScale, placeholder: str) -> Operand:
    """The scale parameter of one side: its side array (read, and written by a write), its
    static device scale, or the placeholder (nothing read)."""
    if scale.stored is not None:
        return Operand(f"{side}_scale_ptr", f"{side}_scale_cache")
    return static_input(side, scale, placeholder)


def layer_input(args, placeholder: str) -> Operand:
    """The ``layer_ptr`` parameter: the ``layer`` argument where a device array names the
    layer of stacked caches (docs/SPEC.md section 14), else the placeholder (nothing read). Every
    kernel that takes stacked caches takes it last of its inputs."""
    if args.layers is not None and args.layers.on_device:
        return Operand("layer_ptr", "layer")
    return Operand("layer_ptr", placeholder, used=False)


def caches_of(combined: bool) -> tuple[str, str]:
    return ("kv_cache", "kv_cache") if combined else ("key_cache", "value_cache")


def static_input(side: str, scale: SideScale, placeholder: str) -> Operand:
    """The global (static) scale parameter of an nvfp4 side."""
    if scale.kind.on_device:
        return Operand(f"{side}_scale_ptr", f"{side}_scale")
    return Operand(f"{side}_scale_ptr", placeholder, used=False)


def block_operands() -> tuple[tuple[Operand, ...], tuple[Operand, ...]]:
    """Both sides' block-scale arrays: ``(inputs, outputs written in place)``."""
    return ((Operand("key_block_ptr", "key_scale_cache"),
             Operand("value_block_ptr", "value_scale_cache")),
            (Operand("key_block_out_ptr", "key_scale_cache", aliases="key_block_ptr"),
             Operand("value_block_out_ptr", "value_scale_cache", aliases="value_block_ptr")))
