"""Bytes per parameter of the weights, gradients and optimizer state under MoEFoldStrategy's optimizer options: the
memory model of the distributed optimizer, precision-aware state and CPU offload (Megatron's table: 18 bytes for bf16
weights with fp32 main grads, main weights and Adam moments; 6 + 12/d with the distributed optimizer over d ranks).
Pure arithmetic, used by the benchmarks and the tests that check it against ``torch.cuda.memory_allocated``."""

from __future__ import annotations

from typing import Optional

from lightning_moe.strategy.optimizer_options import parse_dtype, parse_fraction

def _nbytes(option: str, value, default: int) -> int:
    d = parse_dtype(option, value)
    return default if d is None else d.itemsize


def optimizer_bytes_per_param(weight_bytes: int = 2, fp32_main_params: Optional[bool] = None,
                              main_params_dtype: Optional[str] = None, exp_avg_dtype: Optional[str] = None,
                              exp_avg_sq_dtype: Optional[str] = None, distributed_optimizer: bool = False,
                              optimizer_cpu_offload: float = 0.0, shard: int = 1, moments: int = 2,
                              **_other_strategy_options) -> dict[str, float]:
    """Per parameter: ``device`` and ``host`` bytes and their parts, for a weight of ``weight_bytes`` (2: bf16) stepped
    by an optimizer with ``moments`` state tensors shaped like it (2: Adam). ``shard``: the ranks the distributed
    optimizer splits this parameter's bucket over (dp x cp for dense, edp for experts; ignored without it). Takes
    MoEFoldStrategy's keyword arguments (others are ignored)."""
    if main_params_dtype is not None:
        fp32_main_params = parse_dtype("main_params_dtype", main_params_dtype).itemsize == 4
    low = weight_bytes < 4
    main_fp32 = low and (fp32_main_params is None or bool(fp32_main_params))
    stepped = 4 if main_fp32 or not low else weight_bytes  # the dtype the optimizer steps
    grad = stepped  # gradients accumulate in the stepped dtype (fp32 main grads with main params)
    main = 4 if main_fp32 else 0  # a separate main copy (fp32 weights are their own)
    state = _nbytes("exp_avg_dtype", exp_avg_dtype, stepped) + (moments - 1) * _nbytes(
        "exp_avg_sq_dtype", exp_avg_sq_dtype, stepped) if moments else 0
    d = shard if distributed_optimizer else 1
    off = parse_fraction("optimizer_cpu_offload", optimizer_cpu_offload)
    owned = (main + state) / d
    parts = {"weights": float(weight_bytes), "grads": float(grad), "main_params": main / d * (1 - off),
             "optimizer_state": state / d * (1 - off)}
    host = {"host_main_params": (main or stepped) / d * off, "host_optimizer_state": state / d * off,
            "host_grads": grad / d * off, "host_staging": (weight_bytes / d * off) if main_fp32 else 0.0}
    return {"device": parts["weights"] + parts["grads"] + owned * (1 - off), "host": sum(host.values()),
            **parts, **host}
