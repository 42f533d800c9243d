"""What of a Lightning checkpoint goes where: every tensor of the model and of the optimizer state into the
layout-independent DCP directory (``reshard.py``), everything else (progress, loops, callbacks, LR schedulers, RNG,
param-group hyperparameters) into the per-rank shard file. Nothing is stored twice, and a checkpoint written under
one TP/EP/ETP/PP/DP layout resumes under any other with its optimizer moments.

Optimizer state is keyed by the *parameter's name* (``optim/<optimizer>/<state key>/<param name>``), not by its
index in the optimizer, which depends on the layout (a PP stage holds only its layers). A state tensor shaped like its
parameter is sharded like it (Adam's moments, momentum buffers); a 0-d one (Adam's ``step``) is stored whole. An
optimizer with state of another shape stays in the shard file and restarts under another layout (with a warning).

Under the distributed optimizer (``sharded_optimizer.py``) the optimizer steps flat slices of the parameters: each
slice's state, and the fp32 main weights, are written as the rectangular blocks of the logical tensors they cover
(``reshard.range_pieces``), so the checkpoint looks the same as without it and loads either way.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Optional, Sequence

import torch
from torch import nn

from lightning_moe.strategy.reshard import Piece, model_pieces, range_pieces, read_tensor_metadata

FORMAT_KEY = "moe_fold_dcp"  # in the shard: what was moved into the DCP directory


def _optimizer_tensor_names(module: nn.Module, main_params) -> dict[int, tuple[str, Optional[int], Optional[int]]]:
    """id(tensor the optimizer steps) -> (the model parameter's name, and the flat range ``lo, hi`` of it that the
    tensor holds, or None, None for the whole parameter; fp32 main copies stand in for bf16 weights)."""
    if hasattr(main_params, "slots"):  # the distributed optimizer's slices
        return {id(s.tensor): (s.name, s.lo, s.hi) for s in main_params.slots}
    names = {}
    for name, p in module.named_parameters():
        t = p
        if main_params is not None:
            try:
                t = main_params.main_of(p)
            except KeyError:
                pass
        names[id(t)] = (name, None, None)
    return names


def _params(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters())


def _order(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    # the index torch's Optimizer.state_dict gives each parameter: its position over the param groups
    return [p for g in opt.param_groups for p in g["params"]]


def _key(i: int, k: str, name: str = "") -> str:
    return f"optim/{i}/{k}/{name}"


def _state_pieces(module, ctx, i: int, entries: list[tuple[str, Optional[tuple], torch.Tensor, torch.Tensor]]
                  ) -> Optional[list[Piece]]:
    """The DCP pieces of optimizer ``i``'s state tensors ``(state key, (param name, lo, hi), tensor, the tensor the
    optimizer steps)``; None when one cannot be resharded (no parameter name, or shaped neither like what the
    optimizer steps nor 0-d, e.g. factored moments)."""
    pieces, shaped = [], defaultdict(dict)
    params = None
    for k, info, v, p in entries:
        if info is None:
            return None
        name, lo, hi = info
        if v.ndim == 0:
            pieces.append(Piece(_key(i, k, name), (), (), v.detach()))
        elif tuple(v.shape) != tuple(p.shape):
            return None
        elif lo is not None:  # a distributed-optimizer slice of the parameter
            params = params or _params(module)
            pieces += range_pieces(module, ctx, name, params[name].shape, lo, hi, v.detach(), prefix=_key(i, k),
                                   params=params)
        else:
            shaped[k][name] = v
    for k, tensors in shaped.items():  # sharded like their parameters
        pieces += model_pieces(module, ctx, prefix=_key(i, k), tensors=tensors)
    return pieces


def split_checkpoint(checkpoint: dict, module: nn.Module, ctx, optimizers: Sequence[torch.optim.Optimizer],
                     main_params=None) -> tuple[list[Piece], dict]:
    """``(pieces for DCP, the checkpoint without them)``; ``checkpoint`` itself is left as it was."""
    out = dict(checkpoint)
    sd = checkpoint.get("state_dict", {})
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    from_mains = main_params.main_weight_names(module) if hasattr(main_params, "slots") else set()
    pieces = model_pieces(module, ctx, tensors={k: v for k, v in tensors.items() if k not in from_mains})
    if from_mains:  # fp32 main weights held in slices by the distributed optimizer: each rank writes its own
        params = _params(module)
        for slot in main_params.main_weight_slots():
            pieces += range_pieces(module, ctx, slot.name, params[slot.name].shape, slot.lo, slot.hi,
                                   slot.tensor.detach(), params=params)
    out["state_dict"] = {k: v for k, v in sd.items() if k not in tensors}
    info = {"state_dict_keys": sorted(tensors), "optimizer_in_dcp": []}
    states = checkpoint.get("optimizer_states")
    if states is not None:
        names = _optimizer_tensor_names(module, main_params)
        out["optimizer_states"] = []
        for i, (opt, saved) in enumerate(zip(optimizers, states)):
            order = _order(opt)
            mine = _state_pieces(module, ctx, i, [(k, names.get(id(order[idx])), v, order[idx])
                                                  for idx, st in saved["state"].items() for k, v in st.items()
                                                  if isinstance(v, torch.Tensor)])
            ok = mine is not None
            if ok:  # tensors go to DCP; the shard keeps the structure, hyperparameters and non-tensor state
                pieces += mine
                stripped = {idx: {k: (None if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                            for idx, st in saved["state"].items()}
                out["optimizer_states"].append({"state": stripped, "param_groups": saved["param_groups"]})
            else:
                out["optimizer_states"].append(saved)
            info["optimizer_in_dcp"].append(ok)
    out[FORMAT_KEY] = info
    return pieces, out


def fill_checkpoint(checkpoint: dict, dcp_dir: str, module: nn.Module, ctx,
                    optimizers: Sequence[torch.optim.Optimizer], main_params, same_layout: bool,
                    load_pieces) -> tuple[dict, bool]:
    """Put this rank's tensors back into a shard's ``checkpoint`` from ``dcp_dir`` (collective: ``load_pieces``).
    Returns ``(checkpoint, optimizer_restored)``; when the optimizer state could not be restored on this layout,
    ``optimizer_states`` is None."""
    info = checkpoint.get(FORMAT_KEY)
    if info is None:  # written before the split: the shard holds everything
        return checkpoint, True
    checkpoint = dict(checkpoint)
    tensors = {n: t.detach().clone().cpu() for n, t in module.state_dict().items()}
    if main_params is not None:  # checkpoints hold the fp32 main weights
        templates = (main_params.load_templates(module) if hasattr(main_params, "load_templates")
                     else main_params.state_dict_overrides(module))
        tensors.update({n: t.detach().clone().cpu() for n, t in templates.items()})
    if same_layout and set(info["state_dict_keys"]) != set(tensors):
        saved = set(info["state_dict_keys"])
        raise ValueError(f"checkpoint and model differ in their tensors: only in the checkpoint "
                         f"{sorted(saved - set(tensors))[:5]}, only in the model {sorted(set(tensors) - saved)[:5]}")
    pieces = model_pieces(module, ctx, tensors=tensors)
    states = checkpoint.get("optimizer_states")
    new_states = []
    if states is not None and optimizers:
        saved_md = read_tensor_metadata(dcp_dir)
        names = _optimizer_tensor_names(module, main_params)
        for i, opt in enumerate(optimizers):
            in_dcp = i < len(info["optimizer_in_dcp"]) and info["optimizer_in_dcp"][i]
            saved = states[i] if i < len(states) else None
            if not in_dcp:  # kept in the shard: only this layout can use it
                new_states.append(saved if same_layout else None)
                continue
            by_name: dict[str, dict] = defaultdict(dict)
            for key, md in saved_md.items():
                if key.startswith(f"optim/{i}/"):
                    k, name = key[len(f"optim/{i}/"):].split("/", 1)
                    by_name[name][k] = md
            state: dict[int, dict] = {}
            entries = []
            for idx, p in enumerate(_order(opt)):
                info = names.get(id(p))
                for k, md in by_name.get(info[0] if info else None, {}).items():
                    buf = torch.zeros(() if len(md.size) == 0 else tuple(p.shape), dtype=md.properties.dtype)
                    entries.append((k, info, buf, p))
                    state.setdefault(idx, {})[k] = buf
            pieces += _state_pieces(module, ctx, i, entries)
            if same_layout:
                if set(state) != set(saved["state"]):
                    raise ValueError(f"checkpoint optimizer {i} has state for {len(saved['state'])} parameters, "
                                     f"{len(state)} of this model's parameters found theirs")
                for idx, st in saved["state"].items():  # non-tensor state entries
                    state[idx].update({k: v for k, v in st.items() if v is not None})
            groups = opt.state_dict()["param_groups"]
            if saved is not None and len(saved["param_groups"]) == len(groups):
                # hyperparameters (the LR the scheduler set) from the checkpoint, parameter indices of this layout
                groups = [{**copy.deepcopy({k: v for k, v in sg.items() if k != "params"}), "params": g["params"]}
                          for sg, g in zip(saved["param_groups"], groups)]
            new_states.append({"state": state, "param_groups": groups})
    load_pieces(pieces, dcp_dir)
    checkpoint["state_dict"] = {**checkpoint.get("state_dict", {}), **tensors}
    restored = not any(s is None for s in new_states)
    if states is not None and optimizers:  # (without optimizers, e.g. validate(ckpt_path=...), none is loaded)
        checkpoint["optimizer_states"] = new_states if restored else None
    checkpoint.pop(FORMAT_KEY, None)
    return checkpoint, restored
