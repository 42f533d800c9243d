"""FP8 quantization with Megatron's recipes, and FP8 GEMMs (torch's ``_scaled_mm`` where it runs, emulated otherwise).

A GEMM ``a_MK @ b_NK^T`` quantizes both operands along its reduction dimension K, each in scale blocks (``Tiling``):

  recipe       activations / gradients      weights          formats
  tensorwise   one scale (current amax)      one scale        E4M3 forward, E5M2 gradients (Megatron's "hybrid")
  delayed      one scale from the max of the last ``history`` amaxes (``AmaxHistory``)    as tensorwise
  rowwise      one per row (1 x K)           one per row      E4M3 everywhere (torchao's rowwise)
  blockwise    1 x 128 tiles                 128 x 128        E4M3 everywhere (DeepSeek-V3)

A scale maps a block's amax to the format's largest value (``fmt_max / amax``); values are saturated, then rounded to
nearest. Emulation dequantizes and multiplies in fp32: the same quantized inputs as the kernels, fp32 accumulation.

Shapes: R rows of an operand, K its reduction dimension (columns), M/N the GEMM's output rows/columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
# Which GEMMs accumulate with Hopper's fast FP8 accumulation (fewer accumulator bits, about 2x the speed of the
# precise mode at fine-grained MoE shapes): "fprop" the forward GEMMs only, as Transformer Engine does (dgrad and wgrad
# use its split accumulator); "all" the backward ones too, as torchao's MoE training does; "none" no GEMM.
FAST_ACCUM = ("fprop", "all", "none")
BLOCK = 128  # blockwise tiles
_TINY = 1e-12  # an all-zero block gets scale fmt_max / _TINY: any value maps to zero anyway


@dataclass(frozen=True)
class Tiling:
    """Scale blocks of a (rows x K) operand: ``rows`` x ``cols`` elements each; None spans the whole dimension."""
    rows: Optional[int]
    cols: Optional[int]


def tiling(recipe: str, role: str) -> Tiling:
    """The scale blocks a recipe gives an operand of ``role`` (``input``, ``weight`` or ``grad``)."""
    if recipe in ("tensorwise", "delayed"):
        return Tiling(None, None)
    if recipe == "rowwise":
        return Tiling(1, None)
    if recipe == "blockwise":
        return Tiling(BLOCK, BLOCK) if role == "weight" else Tiling(1, BLOCK)
    raise ValueError(f"unknown FP8 recipe {recipe!r}; valid: {', '.join(RECIPES)}")


def formats(recipe: str) -> tuple[str, str]:
    """(format of inputs and weights, format of gradients)."""
    return ("e4m3", "e5m2") if recipe in ("tensorwise", "delayed") else ("e4m3", "e4m3")


def _blocks(x_RK: torch.Tensor, t: Tiling) -> tuple[int, int]:
    R, K = x_RK.shape
    rb, cb = t.rows or R, t.cols or K
    if R % rb or K % cb:
        raise ValueError(f"FP8: a {R} x {K} operand does not split into {rb} x {cb} scale blocks (dimensions must be "
                         f"multiples of {cb if K % cb else rb})")
    return rb, cb


def block_amax(x_RK: torch.Tensor, t: Tiling) -> torch.Tensor:
    """The amax of each scale block: shape (R / rows, K / cols), fp32."""
    R, K = x_RK.shape
    rb, cb = _blocks(x_RK, t)
    if t == Tiling(1, None):
        return abs_amax(x_RK.detach(), 1)
    return x_RK.detach().abs().float().reshape(R // rb, rb, K // cb, cb).amax(dim=(1, 3))


def _expand(s: torch.Tensor, x_RK: torch.Tensor, t: Tiling) -> torch.Tensor:
    rb, cb = _blocks(x_RK, t)
    if t.cols is None:  # one scale per row or per tensor: broadcasting does it without a copy
        return s if t.rows is None or t.rows == 1 else s.repeat_interleave(rb, 0)
    return s.repeat_interleave(rb, 0).repeat_interleave(cb, 1)


def _saturate(x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def _abs_amax(x: torch.Tensor, dim) -> torch.Tensor:
    return x.abs().amax(dim, keepdim=True).float()


_FUSED: dict = {}


def fused(fn):
    """``fn`` compiled by inductor into one kernel on CUDA (scale-multiply, saturate and cast read the input once
    instead of four times); the eager function elsewhere. Same arithmetic either way."""
    def call(x: torch.Tensor, *args):
        if not x.is_cuda:
            return fn(x, *args)
        if fn not in _FUSED:
            # one graph per operand layout, format and input dtype (about 20 in a model): more than dynamo's
            # default of 8 recompilations per function
            cfg = torch._dynamo.config
            if getattr(cfg, "recompile_limit", 64) < 64:
                cfg.recompile_limit = 64
            _FUSED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
        return _FUSED[fn](x, *args)
    return call


saturate = fused(_saturate)
abs_amax = fused(_abs_amax)


def scale_of(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The quantization scale of a block: ``fmt_max / amax`` (fp32)."""
    return FORMATS[fmt][1] / amax.float().clamp_min(_TINY)


def quantize(x_RK: torch.Tensor, fmt: str, t: Tiling,
             amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_RK in FP8, scale)``: ``q = saturate(x * scale)`` per block, ``scale = fmt_max / amax`` (``amax`` given:
    delayed scaling, or reduced over ranks). ``scale`` has one entry per block."""
    dtype, fmax = FORMATS[fmt]
    amax = block_amax(x_RK, t) if amax is None else amax.float().reshape(block_amax_shape(x_RK, t))
    scale = scale_of(amax, fmt)
    return saturate(x_RK, _expand(scale, x_RK, t), fmax, dtype), scale


def block_amax_shape(x_RK: torch.Tensor, t: Tiling) -> tuple[int, int]:
    R, K = x_RK.shape
    rb, cb = _blocks(x_RK, t)
    return R // rb, K // cb


def dequantize(q_RK: torch.Tensor, scale: torch.Tensor, t: Tiling) -> torch.Tensor:
    return q_RK.float() / _expand(scale, q_RK, t)


def _kernel_scales(t: Tiling, scale: torch.Tensor, lhs: bool, inv: Optional[torch.Tensor] = None
                   ) -> Optional[torch.Tensor]:
    """``_scaled_mm``'s dequantization scales for tensorwise ((1, 1)) and rowwise tilings ((M, 1) / (1, N)): ``inv``
    where the quantizer gave them, else ``scale``'s reciprocals."""
    if t == Tiling(None, None):
        return (scale.reciprocal() if inv is None else inv).reshape(())
    if t == Tiling(1, None):
        inv = scale.reciprocal() if inv is None else inv
        return inv.reshape(-1, 1) if lhs else inv.reshape(1, -1)
    return None  # blockwise: emulated


def fp8_mm(a_MK: torch.Tensor, b_NK: Optional[torch.Tensor], ta: Tiling, tb: Tiling, fmt_a: str, fmt_b: str,
           out_dtype: torch.dtype, emulate: bool = False, amax_a: Optional[torch.Tensor] = None,
           amax_b: Optional[torch.Tensor] = None, fast_accum: bool = False,
           b_q: Optional[tuple] = None, a_q: Optional[tuple] = None) -> torch.Tensor:
    """``a @ b^T`` with both operands quantized to FP8 along K. ``torch._scaled_mm`` for tensorwise and rowwise
    tilings (CUDA and CPU), DeepGEMM for blockwise tilings where it runs (``fp8_deepgemm.dense_mm``), emulated
    otherwise or when ``emulate``. ``fast_accum``: the kernel's fast accumulation
    (Hopper keeps fewer bits in its tensor-core accumulators; see ``FAST_ACCUM``). ``b_q``: ``b`` already quantized,
    ``quantize``'s (values, scales) with ``fmt_b`` and ``tb`` (a cached weight), in place of ``b_NK``; ``a_q``
    likewise for ``a`` (``a_MK`` still given). Either may carry a third entry, the kernel's dequantization scales
    (the scales' reciprocals, from the quantizer or cached with a weight), so that none is computed here; its scales
    may then be None where only the kernel reads them (rowwise E4M3, not emulated)."""
    qa, sa, *inv_a = a_q if a_q is not None else quantize(a_MK, fmt_a, ta, amax_a)
    qb, sb, *inv_b = b_q if b_q is not None else quantize(b_NK, fmt_b, tb, amax_b)
    if not emulate and ta.cols is not None:  # blockwise tiles: DeepGEMM, where it runs
        from lightning_moe.modules import fp8_deepgemm
        if fp8_deepgemm.dense_runs(a_MK, ta, tb, (fmt_a, fmt_b), out_dtype):
            return fp8_deepgemm.dense_mm(qa, sa, qb, sb, tb, out_dtype)
    scale_a = _kernel_scales(ta, sa, True, inv_a[0] if inv_a else None)
    scale_b = _kernel_scales(tb, sb, False, inv_b[0] if inv_b else None)
    kernel = not emulate and scale_a is not None and scale_b is not None and (fmt_a, fmt_b) != ("e5m2", "e5m2")
    if kernel and scale_a.ndim == scale_b.ndim:
        return torch._scaled_mm(qa, qb.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return (dequantize(qa, sa, ta) @ dequantize(qb, sb, tb).t()).to(out_dtype)


class Recomputed:
    """Delayed scaling under recomputation (``modules/replay.py``): what a history gave the first pass of a region
    that will be replayed, in order, so that the replay scales by the same amaxes and pushes nothing (Transformer
    Engine restores its scales for a recomputation likewise). Without it the replay scaled by a history its own first
    pass had advanced, and pushed again. Entries ("ring", a copy of the ring the one-pass kernels read; "used", the
    amax the others scaled by) live in the region invocation's store, freed with it."""

    def _ring_of(self, ring: Optional[torch.Tensor]) -> Optional[tuple]:
        """``(ring, push)`` for the one-pass kernels (they scale by the ring's max and record the amax they find,
        ``push`` after where true), or None on the history's first use (then the amax comes first: ``_used_of``)."""
        from lightning_moe.modules import replay
        entries = replay.entries(self)
        if replay.replaying() and replay.store() is not None:
            if entries and entries[0][0] == "used":
                return None  # its first pass was the history's first use: so is the replay
            return _replayed(entries, "ring"), False
        if ring is None:
            return None
        if replay.recorded():
            entries.append(("ring", ring.clone()))  # the ring as the kernel reads it: later pushes write it in place
        return ring, True

    def _used_of(self, compute) -> torch.Tensor:
        """The amax to scale by, ``compute()`` (which pushes the current one) unless this is a replay."""
        from lightning_moe.modules import replay
        entries = replay.entries(self)
        if replay.replaying() and replay.store() is not None:
            return _replayed(entries, "used")
        used = compute()
        if replay.recorded():
            entries.append(("used", used))
        return used


def _replayed(entries: list, kind: str):
    """The first pass's next entry, of this kind: a replay that reads the histories otherwise than its first pass did
    would scale by the wrong amaxes, so it is an error."""
    if not entries or entries[0][0] != kind:
        raise RuntimeError("FP8 delayed scaling under recomputation: a recomputed region read an amax history "
                           f"otherwise than its first pass did (wanted {kind!r}, found "
                           f"{entries[0][0] if entries else 'nothing'!r}): its forward took another path when "
                           "replayed; recompute less of the model (Recompute's modules) or use another FP8 recipe")
    return entries.pop(0)[1]


class AmaxHistory(Recomputed):
    """Delayed scaling's memory of one operand: the last ``length`` amaxes; the scale of a step comes from their
    max (the current amax enters the history after use, as in Transformer Engine). Kept on the device: no sync. A ring
    written in place (``push``: one copy), which the one-pass kernels read whole (``ring``, ``fp8_linear_both``)."""

    def __init__(self, length: int = 16):
        if length < 1:
            raise ValueError(f"FP8 delayed scaling: amax history length must be >= 1, got {length}")
        self.length, self.history, self.pushed = length, None, 0

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """The amax to scale ``x`` with (its own the first time), recording its current one."""
        return self._used_of(lambda: self._amax(x))

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        current = x.detach().abs().amax().float().reshape(1)
        if self.history is None:  # never an inference tensor: later pushes write it in place, maybe outside
            with torch.inference_mode(False), torch.no_grad():
                self.history = current.repeat(self.length)
        used = self.history.amax()
        self.push(current)
        return used

    def ring(self) -> Optional[tuple]:
        """``(the ring, push)`` for the one-pass kernels, or None on first use (``Recomputed._ring_of``)."""
        return self._ring_of(self.history)

    def push(self, current: torch.Tensor) -> None:
        self.history[self.pushed % self.length].copy_(current.reshape(()))
        self.pushed += 1
