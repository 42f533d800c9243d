"""Triton kernels of the fused router: one kernel forward, one backward (``fused_router.py`` decides when they run;
``router.py`` is the reference they mirror).

forward   one program per BLOCK_T tokens, each token's whole row of E logits in registers:
          scores (softmax or sigmoid) -> selection scores (+ expert bias) -> group limit -> top-k -> gates
          (softmax over the top-k, or normalised sigmoid, times the scaling factor), and from the same registers
          - tokens per expert: atomic adds of integer-valued floats, so exact and order-independent
          - per block: sum of logsumexp^2 (z-loss), column sums of the aux-loss scores and the aux-loss routing-map
            counts. Written per block and reduced by torch, so the losses are deterministic (float atomics are not).
backward  the same blocking: the gradient of the gates, of the per-block score sums and of the per-block z sum,
          in one pass that recomputes the scores from the logits instead of keeping T x E of them.

Modes (constexpr): SCORE 0 softmax after top-k, 1 softmax before top-k (pre_softmax), 2 sigmoid. AUX 0 none,
1 softmax scores, 2 sigmoid scores normalised over all experts (Megatron's ``compute_routing_scores_for_aux_loss``).
Top-k is K rounds of argmax, lowest index on ties (torch.topk may break exact ties differently).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch

NEG = tl.constexpr(float("-inf"))  # a constexpr: jit code reads no other globals


@triton.jit
def _softmax_lse(l):
    mx = tl.max(l, axis=1)
    ex = tl.exp(l - mx[:, None])
    den = tl.sum(ex, axis=1)
    return ex / den[:, None], mx + tl.log(den)


@triton.jit
def _block_ranges(pid, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """This program's token rows, the expert columns and the top-k slots."""
    return pid * BLOCK_T + tl.arange(0, BLOCK_T), tl.arange(0, E_PAD), tl.arange(0, K_PAD)


@triton.jit
def _row_scores(logits_ptr, rows, cols, T, E, NEED_S: tl.constexpr, NEED_SM: tl.constexpr,
                BLOCK_T: tl.constexpr):
    """(logits, sigmoid, softmax, logsumexp) of a block of rows; a score the mode does not need is a placeholder
    that the caller never reads (and the compiler drops)."""
    rmask, cmask = rows < T, cols < E
    l = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=0.0)
    l = tl.where(cmask[None, :], l, NEG)  # padding columns never win and weigh 0 in every softmax
    s, sm, lse = l, l, tl.zeros((BLOCK_T,), tl.float32)
    if NEED_S:
        s = tl.where(cmask[None, :], tl.sigmoid(l), 0.0)
    if NEED_SM:
        sm, lse = _softmax_lse(l)
    return l, s, sm, lse


@triton.jit
def _knock_out_top(v, cols, ROUNDS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """ROUNDS rounds of argmax: (the sum of the winners' values, the winners' mask, v with them at -inf)."""
    won = tl.zeros((BLOCK_T, E_PAD), tl.int32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for _ in tl.static_range(ROUNDS):
        best, at = tl.max(v, axis=1, return_indices=True)
        hit = cols[None, :] == at[:, None]
        total += best
        won = won | hit.to(tl.int32)
        v = tl.where(hit, NEG, v)
    return total, won, v


@triton.jit
def _router_fwd_kernel(logits_ptr, bias_ptr, probs_ptr, experts_ptr, tpe_ptr, zpart_ptr, spart_ptr, cpart_ptr,
                       T, E, scale, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr,
                       G_PAD: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUP_TOPK: tl.constexpr,
                       HAS_SCALE: tl.constexpr, COUNT: tl.constexpr, HAS_Z: tl.constexpr, AUX: tl.constexpr,
                       AUX_TOPK: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, kcols = _block_ranges(pid, BLOCK_T, E_PAD, K_PAD)
    rmask, cmask, kmask = rows < T, cols < E, kcols < K
    l, s, sm, lse = _row_scores(logits_ptr, rows, cols, T, E, SCORE == 2 or AUX == 2,
                                SCORE == 1 or AUX == 1 or HAS_Z, BLOCK_T)

    # selection scores: what top-k ranks (post-softmax ranks logits: the softmax is monotonic)
    if SCORE == 0:
        sel = l
    elif SCORE == 1:
        sel = tl.where(cmask[None, :], sm, NEG)
    else:
        sel = s
        if HAS_BIAS:  # the bias steers selection only; the gates below read the unbiased s
            sel = sel + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
        sel = tl.where(cmask[None, :], sel, NEG)

    if GROUPS > 0:  # group-limited: a group's score is the sum of its best K / GROUP_TOPK selection scores
        gid = cols // GROUP_SIZE
        gcols = tl.arange(0, G_PAD)
        gscore = tl.full((BLOCK_T, G_PAD), NEG, tl.float32)
        for g in tl.static_range(GROUPS):
            total, _w, _v = _knock_out_top(tl.where(gid[None, :] == g, sel, NEG), cols, K // GROUP_TOPK, E_PAD,
                                           BLOCK_T)
            gscore = tl.where(gcols[None, :] == g, total[:, None], gscore)
        allowed = tl.zeros((BLOCK_T, E_PAD), tl.int32)
        for _ in tl.static_range(GROUP_TOPK):
            _b, at = tl.max(gscore, axis=1, return_indices=True)
            allowed = allowed | (gid[None, :] == at[:, None]).to(tl.int32)
            gscore = tl.where(gcols[None, :] == at[:, None], NEG, gscore)
        sel = tl.where(allowed != 0, sel, NEG)

    # top-k, in descending order as torch.topk returns it; gate_src is the value each gate is made from
    routed = tl.zeros((BLOCK_T, E_PAD), tl.int32)
    e_tk = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    src_tk = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    v = sel
    for k in tl.static_range(K):
        best, at = tl.max(v, axis=1, return_indices=True)
        hit = cols[None, :] == at[:, None]
        if SCORE == 2:
            best = tl.sum(tl.where(hit, s, 0.0), axis=1)
        e_tk = tl.where(kcols[None, :] == k, at[:, None], e_tk)
        src_tk = tl.where(kcols[None, :] == k, best[:, None], src_tk)
        routed = routed | hit.to(tl.int32)
        v = tl.where(hit, NEG, v)

    if SCORE == 0:
        top = tl.where(kmask[None, :], src_tk, NEG)
        ex = tl.exp(top - tl.max(top, axis=1)[:, None])
        p = ex / tl.sum(ex, axis=1)[:, None]
    elif SCORE == 1:
        p = src_tk
    else:
        p = src_tk
        if K > 1:
            p = p / (tl.sum(p, axis=1)[:, None] + 1e-20)
    if HAS_SCALE:
        p = p * scale
    out = rows[:, None].to(tl.int64) * K + kcols[None, :]
    omask = rmask[:, None] & kmask[None, :]
    tl.store(probs_ptr + out, p, mask=omask)
    tl.store(experts_ptr + out, e_tk.to(tl.int64), mask=omask)

    valid = rmask[:, None]
    if COUNT:
        cnt = tl.sum(tl.where(valid, routed, 0), axis=0)
        tl.atomic_add(tpe_ptr + cols, cnt.to(tl.float32), mask=cmask & (cnt > 0))
    if HAS_Z:
        tl.store(zpart_ptr + pid, tl.sum(tl.where(rmask, lse * lse, 0.0), axis=0))
    if AUX > 0:
        if AUX == 1:
            a = sm
        else:
            a = s / (tl.sum(s, axis=1)[:, None] + 1e-20)
        tl.store(spart_ptr + pid * E + cols, tl.sum(tl.where(valid, a, 0.0), axis=0), mask=cmask)
        if AUX_TOPK:  # groups or a bias changed the selection: the aux loss counts a plain top-k of its scores
            _t, amap, _v = _knock_out_top(tl.where(cmask[None, :], a, NEG), cols, K, E_PAD, BLOCK_T)
        else:
            amap = routed
        tl.store(cpart_ptr + pid * E + cols, tl.sum(tl.where(valid, amap, 0), axis=0).to(tl.float32), mask=cmask)


@triton.jit
def _router_bwd_kernel(logits_ptr, experts_ptr, gprobs_ptr, gz_ptr, gs_ptr, glogits_ptr, T, E, scale,
                       K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                       SCORE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_GP: tl.constexpr, HAS_GZ: tl.constexpr,
                       AUX: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, kcols = _block_ranges(pid, BLOCK_T, E_PAD, K_PAD)
    rmask, cmask, kmask = rows < T, cols < E, kcols < K
    l, s, sm, lse = _row_scores(logits_ptr, rows, cols, T, E, SCORE == 2 or AUX == 2,
                                SCORE == 1 or AUX == 1 or HAS_GZ, BLOCK_T)
    # gradients with respect to the logits (g_l), the softmax scores (g_sm) and the sigmoid scores (g_s): the
    # softmax and sigmoid backward run once at the end for every term that reaches them
    g_l = tl.zeros((BLOCK_T, E_PAD), tl.float32)
    g_sm = tl.zeros((BLOCK_T, E_PAD), tl.float32)
    g_s = tl.zeros((BLOCK_T, E_PAD), tl.float32)

    if HAS_GP:
        tk = rows[:, None].to(tl.int64) * K + kcols[None, :]
        tkmask = rmask[:, None] & kmask[None, :]
        gp = tl.load(gprobs_ptr + tk, mask=tkmask, other=0.0)
        if HAS_SCALE:
            gp = gp * scale
        e_tk = tl.load(experts_ptr + tk, mask=tkmask, other=-1).to(tl.int32)
        if SCORE == 0:  # softmax over the selected logits
            top = tl.full((BLOCK_T, K_PAD), NEG, tl.float32)
            for k in tl.static_range(K):
                ek = tl.sum(tl.where(kcols[None, :] == k, e_tk, 0), axis=1)
                lk = tl.sum(tl.where(cols[None, :] == ek[:, None], l, 0.0), axis=1)
                top = tl.where(kcols[None, :] == k, lk[:, None], top)
            ex = tl.exp(top - tl.max(top, axis=1)[:, None])
            pt = ex / tl.sum(ex, axis=1)[:, None]
            dtop = pt * (gp - tl.sum(gp * pt, axis=1)[:, None])
        elif SCORE == 2 and K > 1:  # normalised sigmoid gates: p = q / (sum(q) + 1e-20)
            q = tl.zeros((BLOCK_T, K_PAD), tl.float32)
            for k in tl.static_range(K):
                ek = tl.sum(tl.where(kcols[None, :] == k, e_tk, 0), axis=1)
                qk = tl.sum(tl.where(cols[None, :] == ek[:, None], s, 0.0), axis=1)
                q = tl.where(kcols[None, :] == k, qk[:, None], q)
            z = tl.sum(q, axis=1) + 1e-20
            dtop = (gp - (tl.sum(gp * q, axis=1) / z)[:, None]) / z[:, None]
        else:  # the gates are the scores themselves
            dtop = gp
        for k in tl.static_range(K):
            ek = tl.sum(tl.where(kcols[None, :] == k, e_tk, 0), axis=1)
            dk = tl.sum(tl.where(kcols[None, :] == k, dtop, 0.0), axis=1)
            d = tl.where(cols[None, :] == ek[:, None], dk[:, None], 0.0)
            if SCORE == 0:
                g_l += d
            elif SCORE == 1:
                g_sm += d
            else:
                g_s += d

    if AUX > 0:
        gs = tl.load(gs_ptr + pid * E + cols, mask=cmask, other=0.0)[None, :]
        if AUX == 1:
            g_sm += gs
        else:  # a = s / (sum(s) + 1e-20) over all experts
            z = tl.sum(s, axis=1)[:, None] + 1e-20
            g_s += (gs - tl.sum(gs * s, axis=1)[:, None] / z) / z
    if HAS_GZ:  # d(lse^2)/dl = 2 lse softmax
        g_l += (2.0 * tl.load(gz_ptr + pid) * lse)[:, None] * sm

    grad = g_l
    if SCORE == 1 or AUX == 1 or HAS_GZ:
        grad += sm * (g_sm - tl.sum(g_sm * sm, axis=1)[:, None])
    if SCORE == 2 or AUX == 2:
        grad += g_s * s * (1.0 - s)
    tl.store(glogits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], grad,
             mask=rmask[:, None] & cmask[None, :])


# ---------------------------------------------------------------------------------------------------- launchers
MAX_EXPERTS = 1024  # one row of logits lives in registers; wider rows would spill (the reference runs instead)


def block_tokens(E: int, seq_len: int = 0) -> int:
    """Tokens per program: 1K logits, 8 a thread at 4 warps (compiled for sm_90: 2K spill registers at E=256);
    a divisor of the sequence length when the aux loss is per sequence, so that no block straddles two sequences
    (its partial sums are one sequence's)."""
    bt = max(1, min(64, 1024 // triton.next_power_of_2(E)))
    if seq_len:
        while seq_len % bt:
            bt //= 2
    return bt


def router_fwd(logits_TE: torch.Tensor, bias_E: Optional[torch.Tensor], *, topk: int, score: int, groups: int,
               group_topk: int, scale: Optional[float], count: bool, z: bool, aux: int, aux_topk: bool,
               block_t: int):
    """(probs_TK fp32, experts_TK int64, tokens_per_expert_E fp32 | empty, z_NB | empty, score sums NB x E | empty,
    routing-map counts NB x E | empty), NB = number of token blocks."""
    T, E = logits_TE.shape
    dev = logits_TE.device
    nb = triton.cdiv(T, block_t)
    empty = torch.empty(0, device=dev, dtype=torch.float32)
    probs = torch.empty(T, topk, device=dev, dtype=torch.float32)
    experts = torch.empty(T, topk, device=dev, dtype=torch.int64)
    tpe = torch.zeros(E, device=dev, dtype=torch.float32) if count else empty
    zpart = torch.empty(nb, device=dev, dtype=torch.float32) if z else empty
    spart = torch.empty(nb, E, device=dev, dtype=torch.float32) if aux else empty
    cpart = torch.empty(nb, E, device=dev, dtype=torch.float32) if aux else empty
    launch(_router_fwd_kernel, (nb,), logits_TE, bias_E if bias_E is not None else logits_TE, probs, experts, tpe,
           zpart, spart, cpart, T, E, float(scale or 1.0), K=topk, K_PAD=triton.next_power_of_2(topk),
           E_PAD=triton.next_power_of_2(E), BLOCK_T=block_t, SCORE=score, HAS_BIAS=bias_E is not None, GROUPS=groups,
           G_PAD=triton.next_power_of_2(max(groups, 1)), GROUP_SIZE=E // max(groups, 1), GROUP_TOPK=group_topk,
           HAS_SCALE=bool(scale), COUNT=count, HAS_Z=z, AUX=aux, AUX_TOPK=aux_topk, num_warps=4)
    return probs, experts, tpe, zpart, spart, cpart


def router_bwd(logits_TE: torch.Tensor, experts_TK: torch.Tensor, g_probs: Optional[torch.Tensor],
               g_z: Optional[torch.Tensor], g_s: Optional[torch.Tensor], *, score: int, scale: Optional[float],
               aux: int, block_t: int) -> torch.Tensor:
    T, E = logits_TE.shape
    K = experts_TK.shape[1]
    grad = torch.empty_like(logits_TE)
    launch(_router_bwd_kernel, (triton.cdiv(T, block_t),), logits_TE, experts_TK,
           g_probs.contiguous() if g_probs is not None else logits_TE,
           g_z.contiguous() if g_z is not None else logits_TE, g_s.contiguous() if g_s is not None else logits_TE, grad,
           T, E, float(scale or 1.0), K=K, K_PAD=triton.next_power_of_2(K), E_PAD=triton.next_power_of_2(E),
           BLOCK_T=block_t, SCORE=score, HAS_SCALE=bool(scale), HAS_GP=g_probs is not None, HAS_GZ=g_z is not None,
           AUX=aux if g_s is not None else 0, num_warps=4)
    return grad
