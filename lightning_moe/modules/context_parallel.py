"""Context parallelism (CP) for causal attention: zig-zag sequence sharding, K/V exchanged by one all-gather.

The sequence (length S) is cut into 2*cp equal chunks; CP rank r holds chunk r followed by chunk 2*cp-1-r. Under a
causal mask an early chunk sees few keys and a late one many, so pairing them gives every rank the same work.

Why all-gather rather than ring p2p: with GQA/MLA the K/V are much smaller than Q, so gathering the whole K/V once
per layer costs little memory and bandwidth; it is one collective (K and V travel together) that can overlap with
the Q projection, backward is a single reduce-scatter, and it is what Llama 3 used for long-context training.

Shapes: B batch, H query heads, G kv heads, s local sequence (S/cp), S full sequence, E qk head dim, F v head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_moe.modules.document_mask import Mask, document_attention
from lightning_moe.strategy import comm


def check_cp_seq_len(seq_len: int, cp: int) -> None:
    if cp > 1 and seq_len % (2 * cp) != 0:
        raise ValueError(f"context parallelism needs the sequence length divisible by 2*cp (zig-zag chunks): "
                         f"seq_len={seq_len}, cp={cp}")


def _chunks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64, ``seq_len // cp``) of ``rank``'s tokens, e.g. for RoPE."""
    check_cp_seq_len(seq_len, cp)
    if cp == 1:
        return torch.arange(seq_len, device=device)
    L = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in _chunks(cp, rank)])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    if cp == 1:
        return x
    check_cp_seq_len(x.shape[dim], cp)
    parts = x.chunk(2 * cp, dim)
    return torch.cat([parts[c] for c in _chunks(cp, rank)], dim)


def zigzag_unshard(parts: list[torch.Tensor] | torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: every rank's local tensor in rank order along ``dim`` -> natural order."""
    x = torch.cat(list(parts), dim) if isinstance(parts, (list, tuple)) else parts
    if cp == 1:
        return x
    check_cp_seq_len(x.shape[dim], cp)
    slots = x.chunk(2 * cp, dim)  # slot 2r holds chunk r, slot 2r+1 holds chunk 2cp-1-r
    return torch.cat([slots[2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1] for c in range(2 * cp)], dim)


# --- backends: fwd(q, k, v, causal, scale) -> (o, lse); bwd(do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv).
# A causal block is square and top-left aligned (the diagonal block of the zig-zag layout).

def _math_fwd(q, k, v, causal, scale):
    acc = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    return torch.exp(s - lse[..., None]) @ v.to(acc), lse


def _math_bwd(do, q, k, v, o, lse, causal, scale):
    acc = lse.dtype
    q, k, v, do, o = (t.to(acc) for t in (q, k, v, do, o))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.exp(s - lse[..., None])  # the merged lse makes this the global probability
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do


def _cpu_flash_fwd(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_bwd(do, q, k, v, o, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, causal, scale=scale)


def _flash_fwd(q, k, v, causal, scale):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _flash_bwd(do, q, k, v, o, lse, causal, scale):
    # schema identical in torch 2.11 and 2.13. Non-varlen: cum_seq_q/k undefined (None), as the forward returns
    # them; the philox state is read only with dropout
    rng = torch.empty((), dtype=torch.long)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng, scale=scale)[:3]


# name -> (fwd, bwd, needs one head dim for q/k and v)
_BACKENDS = {"math": (_math_fwd, _math_bwd, False), "cpu_flash": (_cpu_flash_fwd, _cpu_flash_bwd, True),
             "flash": (_flash_fwd, _flash_bwd, True)}


def _pick_backend(q: torch.Tensor, v: torch.Tensor, backend: str | None) -> str:
    E, Fv = q.shape[-1], v.shape[-1]
    flash_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and Fv <= E <= 256 and E % 8 == 0
    if backend is None:
        return "flash" if flash_ok else "cpu_flash" if q.device.type == "cpu" and E == Fv else "math"
    if backend not in _BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {sorted(_BACKENDS)}")
    if (backend == "flash" and not flash_ok) or (backend == "cpu_flash" and (q.device.type != "cpu" or Fv > E)):
        raise ValueError(f"backend {backend!r} does not support {q.dtype} on {q.device} with E={E}, F={Fv}")
    return backend


def _pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[-1] == n else F.pad(x, (0, n - x.shape[-1]))


def _merge(parts):
    """Combine partial attentions over disjoint key sets: weights exp(lse_i - lse), in the lse dtype (>= fp32)."""
    o, lse = parts[0][0].to(parts[0][1].dtype), parts[0][1]
    for o_i, lse_i in parts[1:]:
        new = torch.logaddexp(lse, lse_i)
        o = torch.exp(lse - new)[..., None] * o + torch.exp(lse_i - new)[..., None] * o_i.to(new.dtype)
        lse = new
    return o, lse


class _ZigzagAttention(torch.autograd.Function):
    # K/V arrive with their G (kv) heads and are saved that way: the H-head expansion (GQA) and the padding of v
    # (MLA) are rebuilt in backward, so a CP rank keeps no more K/V than the gathered G heads
    @staticmethod
    def _expand(q, k, v, same_dims):
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if same_dims:  # MLA (F < E): zero columns of v give zero output columns, sliced off below
            v = _pad_last(v, q.shape[-1])
        return k, v

    @staticmethod
    def forward(ctx, q, k_G, v_G, cp, rank, scale, backend):
        fwd, _, same_dims = _BACKENDS[backend]
        Fv = v_G.shape[-1]
        k, v = _ZigzagAttention._expand(q, k_G, v_G, same_dims)
        L = q.shape[2] // 2
        outs, lses = [], []
        for i, c in enumerate(_chunks(cp, rank)):
            q_c = q[:, :, i * L:(i + 1) * L]
            parts = [fwd(q_c, k[:, :, c * L:(c + 1) * L], v[:, :, c * L:(c + 1) * L], True, scale)]
            if c > 0:  # the whole prefix is visible: no mask
                parts.append(fwd(q_c, k[:, :, :c * L], v[:, :, :c * L], False, scale))
            o_c, lse_c = _merge(parts)
            outs.append(o_c)
            lses.append(lse_c)
        o = torch.cat(outs, 2).to(q.dtype)
        ctx.save_for_backward(q, k_G, v_G, o, torch.stack(lses))  # lse stacked: each chunk's slice contiguous
        ctx.cfg = (cp, rank, scale, backend, Fv)
        return o if Fv == o.shape[-1] else o[..., :Fv].contiguous()

    @staticmethod
    def backward(ctx, do):
        q, k_G, v_G, o, lse_2BHL = ctx.saved_tensors
        cp, rank, scale, backend, Fv = ctx.cfg
        bwd, same_dims = _BACKENDS[backend][1], _BACKENDS[backend][2]
        k, v = _ZigzagAttention._expand(q, k_G, v_G, same_dims)
        do = _pad_last(do.to(q.dtype).contiguous(), v.shape[-1])  # e.g. sum() gives a 0-stride grad
        acc, L = lse_2BHL.dtype, q.shape[2] // 2
        dq = torch.empty_like(q, dtype=acc)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        for i, c in enumerate(_chunks(cp, rank)):
            rows, diag = slice(i * L, (i + 1) * L), slice(c * L, (c + 1) * L)
            # every part uses the MERGED out and lse: P = exp(s - lse) is then the global probability and
            # D = rowsum(dO * O) the one of the final output, so the parts' gradients simply add up
            chunk = (do[:, :, rows], q[:, :, rows])
            o_c, lse_c = o[:, :, rows], lse_2BHL[i]
            dq_c, dk_c, dv_c = bwd(*chunk, k[:, :, diag], v[:, :, diag], o_c, lse_c, True, scale)
            dq[:, :, rows] = dq_c
            dk[:, :, diag] += dk_c
            dv[:, :, diag] += dv_c
            if c > 0:
                dq_c, dk_c, dv_c = bwd(*chunk, k[:, :, :c * L], v[:, :, :c * L], o_c, lse_c, False, scale)
                dq[:, :, rows] += dq_c
                dk[:, :, :c * L] += dk_c
                dv[:, :, :c * L] += dv_c
        B, G, S = k_G.shape[:3]
        dk = dk.view(B, G, -1, S, dk.shape[-1]).sum(2)  # repeat_interleave: head h belongs to group h // rep
        dv = dv[..., :Fv].reshape(B, G, -1, S, Fv).sum(2)
        return dq.to(q.dtype), dk.to(k_G.dtype), dv.to(v_G.dtype), None, None, None, None


def zigzag_attention_local(q_BHsE, k_BHSE, v_BHSF, cp_size: int, cp_rank: int, scale: float | None = None,
                           backend: str | None = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag queries over the full, natural-order K/V (H or G heads, G | H)."""
    S = k_BHSE.shape[2]
    check_cp_seq_len(S, max(cp_size, 1))
    if q_BHsE.shape[2] * cp_size != S or S % 2:
        raise ValueError(f"local queries ({q_BHsE.shape[2]}) x cp ({cp_size}) must equal the even key length {S}")
    scale = q_BHsE.shape[-1] ** -0.5 if scale is None else scale
    backend = _pick_backend(q_BHsE, v_BHSF, backend)
    return _ZigzagAttention.apply(q_BHsE, k_BHSE, v_BHSF, cp_size, cp_rank, scale, backend)


def context_parallel_attention(q_BHsE, k_BGsE, v_BGsF, group, cp_rank: int, cp_size: int,
                               scale: float | None = None, backend: str | None = None,
                               mask: Mask | None = None) -> torch.Tensor:
    """Causal attention for this rank's zig-zag tokens (q/k already rotated with their global positions).
    ``mask``: packed documents' (``document_mask.py``), over every CP rank's keys: a (B, 1, s, S) boolean tensor,
    True where a query may attend, or a FlexAttention BlockMask of the same pairs."""
    E = k_BGsE.shape[-1]
    if mask is not None:  # packed documents: keys of every rank in rank-major order (packed_context_parallel.py)
        if group is not None and cp_size > 1:
            kv_sBGD = torch.cat([k_BGsE, v_BGsF], -1).movedim(2, 0)
            k_BGsE, v_BGsF = comm.all_gather(kv_sBGD, group).movedim(0, 2).split([E, v_BGsF.shape[-1]], -1)
        return document_attention(q_BHsE, k_BGsE, v_BGsF, mask, scale)
    H, G = q_BHsE.shape[1], k_BGsE.shape[1]
    if group is None or cp_size == 1:
        return F.scaled_dot_product_attention(q_BHsE, k_BGsE, v_BGsF, is_causal=True, scale=scale,
                                              enable_gqa=G != H)
    # one collective for K and V, sequence-major; its backward reduce-scatters every rank's dK/dV to the owner
    kv_sBGD = torch.cat([k_BGsE, v_BGsF], -1).movedim(2, 0)
    kv_BGSD = zigzag_unshard(comm.all_gather(kv_sBGD, group), cp_size, dim=0).movedim(0, 2)
    k_BGSE, v_BGSF = kv_BGSD.split([E, v_BGsF.shape[-1]], -1)
    # only G heads travel and are kept for backward; the kernels see them expanded to H inside the Function
    return zigzag_attention_local(q_BHsE, k_BGSE, v_BGSF, cp_size, cp_rank, scale, backend)
