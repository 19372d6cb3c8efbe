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


def _scale_input(side: str, scale: SideScale, placeholder: str) -> Operand:
    """The scale parameter of one side: its side array (read, and written by a write), its
    static device scale, or the placeholder (nothing read)."""
    if scale.stored is not None:
        return Operand(f"{side}_scale_ptr", f"{side}_scale_cache")
    if scale.kind.on_device:
        return Operand(f"{side}_scale_ptr", f"{side}_scale")
    return Operand(f"{side}_scale_ptr", placeholder, used=False)


def layer_input(args, placeholder: str) -> Operand:
    """The ``layer_ptr`` parameter: the ``layer`` argument where a device array names the
    layer of stacked caches (docs/SPEC.md section 14), else the placeholder (nothing read). Every
    kernel that takes stacked caches takes it last of its inputs."""
    if args.layers is not None and args.layers.on_device:
        return Operand("layer_ptr", "layer")
    return Operand("layer_ptr", placeholder, used=False)


def _caches(combined: bool) -> tuple[str, str]:
    return ("kv_cache", "kv_cache") if combined else ("key_cache", "value_cache")


WRITE_PLACEHOLDER = "slots"
DEQUANTIZE_PLACEHOLDER = "block_table"


def _static_input(side: str, scale: SideScale, placeholder: str) -> Operand:
    """The global (static) scale parameter of an nvfp4 side."""
    if scale.kind.on_device:
        return Operand(f"{side}_scale_ptr", f"{side}_scale")
    return Operand(f"{side}_scale_ptr", placeholder, used=False)


def _block_operands() -> tuple[tuple[Operand, ...], tuple[Operand, ...]]:
    """Both sides' block-scale arrays: ``(inputs, outputs written in place)``."""
    return ((Operand("key_block_ptr", "key_scale_cache"),
             Operand("value_block_ptr", "value_scale_cache")),
            (Operand("key_block_out_ptr", "key_scale_cache", aliases="key_block_ptr"),
             Operand("value_block_out_ptr", "value_scale_cache", aliases="value_block_ptr")))


def write_nvfp4_operands(args) -> OperandMap:
    """``_write_nvfp4_kernel``'s arrays: the FP8 write's, with a global scale and a block-scale
    array per side."""
    kc, vc = _caches(args.combined)
    blocks_in, blocks_out = _block_operands()
    inputs = (Operand("key_ptr", "key"), Operand("value_ptr", "value"),
              Operand("key_cache_ptr", kc), Operand("value_cache_ptr", vc),
              Operand("slot_ptr", "slots"),
              _static_input("key", args.key_scale, WRITE_PLACEHOLDER),
              _static_input("value", args.value_scale, WRITE_PLACEHOLDER)) + blocks_in
    caches = (Operand("key_cache_out_ptr", kc, aliases="key_cache_ptr"),
              Operand("value_cache_out_ptr", None, used=False) if args.combined else
              Operand("value_cache_out_ptr", vc, aliases="value_cache_ptr"))
    return OperandMap(inputs, caches + blocks_out)


def dequantize_nvfp4_operands(args) -> OperandMap:
    """``_dequantize_nvfp4_kernel``'s arrays: global scales, block scales, the FP8 output's
    scale."""
    kc, vc = _caches(args.combined)
    blocks_in, _ = _block_operands()
    out_scale = (Operand("out_scale_ptr", "out_scale") if args.out_scale.kind.on_device
                 else Operand("out_scale_ptr", DEQUANTIZE_PLACEHOLDER, used=False))
    inputs = (Operand("key_cache_ptr", kc), Operand("value_cache_ptr", vc),
              Operand("table_ptr", "block_table"),
              _static_input("key", args.key_scale, DEQUANTIZE_PLACEHOLDER),
              _static_input("value", args.value_scale, DEQUANTIZE_PLACEHOLDER)) + blocks_in + (
              out_scale,)
    if args.combined:
        pages = (Operand("key_out_ptr", "kv_out"), Operand("value_out_ptr", None, used=False))
    else:
        pages = (Operand("key_out_ptr", "key_out"), Operand("value_out_ptr", "value_out"))
    return OperandMap(inputs, pages + (Operand("new_table_ptr", "table_out"),))


def write_operands(args) -> OperandMap:
    """``_write_kv_kernel``'s arrays for a validated :class:`fp8kv.validate.WriteArgs`
    (``_write_nvfp4_kernel``'s for a packed format)."""
    if args.fmt.packed:
        return write_nvfp4_operands(args)
    kc, vc = _caches(args.combined)
    inputs = (Operand("key_ptr", "key"), Operand("value_ptr", "value"),
              Operand("key_cache_ptr", kc), Operand("value_cache_ptr", vc),
              Operand("slot_ptr", "slots"),
              _scale_input("key", args.key_scale, WRITE_PLACEHOLDER),
              _scale_input("value", args.value_scale, WRITE_PLACEHOLDER),
              layer_input(args, WRITE_PLACEHOLDER))
    outputs = [Operand("key_cache_out_ptr", kc, aliases="key_cache_ptr"),
               # A combined cache is one buffer: V goes through the K output (SHARED_OUT).
               Operand("value_cache_out_ptr", None, used=False) if args.combined else
               Operand("value_cache_out_ptr", vc, aliases="value_cache_ptr")]
    for side, scale in (("key", args.key_scale), ("value", args.value_scale)):
        outputs.append(Operand(f"{side}_scale_out_ptr", f"{side}_scale_cache",
                               aliases=f"{side}_scale_ptr") if scale.stored is not None
                       else Operand(f"{side}_scale_out_ptr", None, used=False))
    return OperandMap(inputs, tuple(outputs))


def dequantize_operands(args) -> OperandMap:
    """``_dequantize_pages_kernel``'s arrays for a validated
    :class:`fp8kv.validate.DequantArgs` (a combined cache gives a combined output;
    ``_dequantize_nvfp4_kernel``'s for a packed format)."""
    if args.fmt.packed:
        return dequantize_nvfp4_operands(args)
    kc, vc = _caches(args.combined)
    inputs = (Operand("key_cache_ptr", kc), Operand("value_cache_ptr", vc),
              Operand("table_ptr", "block_table"),
              _scale_input("key", args.key_scale, DEQUANTIZE_PLACEHOLDER),
              _scale_input("value", args.value_scale, DEQUANTIZE_PLACEHOLDER),
              layer_input(args, DEQUANTIZE_PLACEHOLDER))
    if args.combined:
        pages = (Operand("key_out_ptr", "kv_out"), Operand("value_out_ptr", None, used=False))
    else:
        pages = (Operand("key_out_ptr", "key_out"), Operand("value_out_ptr", "value_out"))
    return OperandMap(inputs, pages + (Operand("new_table_ptr", "table_out"),))


def rope_write_operands(args) -> OperandMap:
    """``_rope_write_kv_kernel``'s arrays for a validated
    :class:`fp8kv.validate_rope.RopeWriteArgs`: the K/V write's, plus the query, positions,
    cos/sin cache and query scale, and the outputs ``query_out`` and ``key_out``.

    ``query_out_in_ptr`` / ``key_out_in_ptr`` are never read: they hold a given output's buffer
    as an input, so that the output can alias it (jax-triton's donation; torch passes the same
    tensor). An output the frontend makes (torch's allocated ``query_out``, JAX's new arrays) is
    a new output instead.
    """
    w = args.write
    kc, vc = _caches(w.combined)

    def given_output(name: str, given: bool, used: bool = True):
        if not used:
            return (Operand(f"{name}_in_ptr", WRITE_PLACEHOLDER, used=False),
                    Operand(f"{name}_ptr", None, used=False))
        if given:
            return (Operand(f"{name}_in_ptr", name, used=False),
                    Operand(f"{name}_ptr", name, aliases=f"{name}_in_ptr"))
        return (Operand(f"{name}_in_ptr", WRITE_PLACEHOLDER, used=False),
                Operand(f"{name}_ptr", name))

    q_in, q_out = given_output("query_out", args.query_out_given)
    k_in, k_out = given_output("key_out", args.key_out_given, args.key_out is not None)
    qs = args.query_scale
    inputs = (Operand("query_ptr", "query"), Operand("key_ptr", "key"),
              Operand("value_ptr", "value"), Operand("key_cache_ptr", kc),
              Operand("value_cache_ptr", vc), Operand("slot_ptr", "slots"),
              Operand("position_ptr", "positions"), Operand("cos_sin_ptr", "cos_sin_cache"),
              Operand("query_scale_ptr", "query_scale") if qs.kind.on_device
              else Operand("query_scale_ptr", WRITE_PLACEHOLDER, used=False),
              _scale_input("key", w.key_scale, WRITE_PLACEHOLDER),
              _scale_input("value", w.value_scale, WRITE_PLACEHOLDER), q_in, k_in)
    write_outputs = write_operands(w).outputs
    return OperandMap(inputs, (q_out,) + write_outputs + (k_out,))
