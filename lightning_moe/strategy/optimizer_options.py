"""MoEFoldStrategy's optimizer options (distributed optimizer, precision-aware state, CPU offload): parsing and the
checks that refuse what cannot work, each naming the option. Pure: no process groups, no devices."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

# torch optimizers whose update of each element depends on that element alone (and on scalars): stepping flat slices
# of the parameters gives the same result as stepping whole tensors
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                                                      "Adadelta", "RMSprop", "Rprop", "ASGD") if hasattr(torch.optim, n))
# the state keys that exp_avg_dtype / exp_avg_sq_dtype set, and the optimizers that keep them
STATE_KEYS = {"exp_avg_dtype": ("exp_avg",), "exp_avg_sq_dtype": ("exp_avg_sq", "max_exp_avg_sq")}
HAS_KEYS = {"exp_avg_dtype": tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam")),
            "exp_avg_sq_dtype": tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "NAdam", "RAdam"))}
# torch has fused CPU kernels for these (the host part of an offloaded optimizer steps with them)
CPU_FUSED = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "SGD", "Adagrad"))


def parse_dtype(option: str, value: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ValueError(f"MoEFoldStrategy({option}={value!r}): unknown dtype; use one of 'fp32', 'bf16'")


def parse_fraction(option: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"MoEFoldStrategy({option}={value!r}): must be a fraction of the optimizer state in [0, 1]")
    return float(value)


@dataclass(frozen=True)
class OptimizerOptions:
    distributed: bool = False
    overlap_param_gather: bool = True
    main_params_fp32: Optional[bool] = None  # None: fp32 main params whenever the optimizer holds bf16/fp16 weights
    exp_avg_dtype: Optional[torch.dtype] = None  # None: the dtype the optimizer steps (the main params')
    exp_avg_sq_dtype: Optional[torch.dtype] = None
    cpu_offload: float = 0.0
    bf16_main_params_asked: bool = False  # main_params_dtype='bf16' given (refused for fp32 weights: it would do nothing)
    # the dense linears' wgrad GEMMs write into the main grads (modules/wgrad_fusion.py); None: wherever it can
    gradient_accumulation_fusion: Optional[bool] = None
    # Adam(W) and the bf16 write-back of the weights in one kernel (fused_adam.py); None: wherever it can
    fused_optimizer_writeback: Optional[bool] = None
    # the experts' bf16 wgrad held until the step's last backward (True) or over windows of N micro-batches (an int)
    defer_expert_wgrad: Union[bool, int] = False

    @classmethod
    def parse(cls, distributed_optimizer, overlap_param_gather, fp32_main_params, main_params_dtype, exp_avg_dtype,
              exp_avg_sq_dtype, optimizer_cpu_offload, gradient_accumulation_fusion=None,
              fused_optimizer_writeback=None, defer_expert_wgrad=False) -> "OptimizerOptions":
        for name, v in (("distributed_optimizer", distributed_optimizer),
                        ("overlap_param_gather", overlap_param_gather)):
            if not isinstance(v, bool):
                raise ValueError(f"MoEFoldStrategy({name}={v!r}): must be True or False")
        for name, v in (("gradient_accumulation_fusion", gradient_accumulation_fusion),
                        ("fused_optimizer_writeback", fused_optimizer_writeback)):
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"MoEFoldStrategy({name}={v!r}): must be True, False or None (on wherever it "
                                 "applies)")
        if not isinstance(defer_expert_wgrad, (bool, int)) or (
                not isinstance(defer_expert_wgrad, bool) and defer_expert_wgrad < 2):
            raise ValueError(f"MoEFoldStrategy(defer_expert_wgrad={defer_expert_wgrad!r}): want True (once per "
                             "optimizer step), False, or an int N >= 2 (at most N micro-batches held)")
        main = parse_dtype("main_params_dtype", main_params_dtype)
        if main is not None:
            want = main == torch.float32
            if fp32_main_params is not None and bool(fp32_main_params) != want:
                raise ValueError(f"MoEFoldStrategy(main_params_dtype={main_params_dtype!r}) contradicts "
                                 f"fp32_main_params={fp32_main_params!r}; give one of them")
            fp32_main_params = want
        avg, avg_sq = parse_dtype("exp_avg_dtype", exp_avg_dtype), parse_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype)
        return cls(distributed_optimizer, overlap_param_gather, fp32_main_params, avg, avg_sq,
                   parse_fraction("optimizer_cpu_offload", optimizer_cpu_offload), main == torch.bfloat16,
                   gradient_accumulation_fusion, fused_optimizer_writeback, defer_expert_wgrad)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer steps flat slices (the distributed optimizer, or bf16 or offloaded state, which use
        the same machinery over whole buckets without it). fp32 moments are what fp32 main params step anyway."""
        return self.distributed or self.cpu_offload > 0 or torch.bfloat16 in (self.exp_avg_dtype, self.exp_avg_sq_dtype)

    def state_dtypes(self) -> dict[str, torch.dtype]:
        """State key -> the dtype it is stored in, where that differs from fp32 (keys absent: the dtype the
        optimizer steps)."""
        out = {}
        for option, keys in STATE_KEYS.items():
            d = getattr(self, option)
            if d is not None and d != torch.float32:
                out.update({k: d for k in keys})
        return out

    def fuse_wgrad(self, main_grads: bool) -> bool:
        """Whether the dense wgrad GEMMs accumulate into the main grads: asked (True) or by default wherever main grads
        exist; refused, naming the option, where it cannot apply. Under CUDA graphs the captured GEMMs add into main
        grads zeroed once per step (``GradSync.accumulate_wgrad``)."""
        asked = self.gradient_accumulation_fusion
        if asked and not main_grads:
            raise ValueError("MoEFoldStrategy(gradient_accumulation_fusion=True) needs main grads, i.e. bf16 weights "
                             "(precision='bf16-true'): with fp32 weights autograd's gradient is already the fp32 one")
        return main_grads if asked is None else asked

    def expert_deferral(self, fuse_wgrad: bool) -> tuple[bool, Optional[int]]:
        """``(defer, window)`` for ``GradSync.expert_deferral``; refused, naming the option, without the fusion whose
        main grads the deferred wgrad writes into."""
        defer = self.defer_expert_wgrad
        if defer and not fuse_wgrad:
            raise ValueError(f"MoEFoldStrategy(defer_expert_wgrad={defer!r}) needs gradient-accumulation fusion (the "
                             "experts' wgrad written into the main grads): bf16 weights (precision='bf16-true'), "
                             "gradient_accumulation_fusion not False")
        return bool(defer), None if isinstance(defer, bool) else int(defer)

    def check_state_dtypes(self, bf16_main_params: bool) -> None:
        """fp32 moments cannot be had where the optimizer steps bf16 main params."""
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if bf16_main_params and getattr(self, name) == torch.float32:
                raise ValueError(f"MoEFoldStrategy({name}='fp32') needs fp32 main params: with bf16 main params "
                                 "(fp32_main_params=False or main_params_dtype='bf16') the optimizer steps in bf16")

    def check_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Refuse an optimizer these options cannot drive, naming the option."""
        cls = type(opt)
        if self.sharded and not (isinstance(opt, ELEMENTWISE) or getattr(opt, "elementwise_step", False)):
            what = ("distributed_optimizer=True" if self.distributed else
                    f"optimizer_cpu_offload={self.cpu_offload}" if self.cpu_offload else "exp_avg_dtype/exp_avg_sq_dtype")
            raise ValueError(f"MoEFoldStrategy({what}) steps flat slices of the parameters, which needs an optimizer that "
                             f"updates each element on its own (torch.optim SGD, Adam, AdamW, ...); {cls.__name__} is "
                             "not known to be one (e.g. factored or matrix-wise updates need whole tensors). If it is, "
                             "set its attribute elementwise_step = True.")
        for option, classes in HAS_KEYS.items():
            if getattr(self, option) not in (None, torch.float32) and not isinstance(opt, classes):
                raise ValueError(f"MoEFoldStrategy({option}=...) sets the dtype of the optimizer state "
                                 f"{'/'.join(STATE_KEYS[option])}, which {cls.__name__} does not keep (Adam-style "
                                 "optimizers do)")
