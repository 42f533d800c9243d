"""Decoder-only MoE transformer: embedding, pre-norm blocks (attention + MoE or dense SwiGLU), final norm, head.

Parallel pieces swapped in: a vocab-parallel embedding and head (the loss never gathers the logits), TP attention
and MLPs, and context parallelism, which keeps this rank's zig-zag chunks of every sequence (tokens and labels).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.documents import IGNORE
from lightning_moe.modules.attention import build_attention, check_attention_tp
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.context_parallel import zigzag_positions, zigzag_shard
from lightning_moe.modules.document_mask import Mask, build_document_mask, use_flex
from lightning_moe.modules.document_mask import document_mask  # noqa: F401  (re-exported from its former home)
from lightning_moe.modules.packed_context_parallel import check_document_lengths, packed_zigzag_index
from lightning_moe.modules.experts import SwiGLU
from lightning_moe.modules.init import init_weights
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.modules.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding, enter_tp_region,
                                                   mark_grad_sum_over_tp, vocab_parallel_cross_entropy)
from lightning_moe.strategy.parallel_context import ParallelContext
from lightning_moe.strategy.pipeline.partition import local_stages, partition_layers


def _norm(cfg: ModelConfig, ctx: ParallelContext) -> nn.RMSNorm:
    norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    if ctx.sequence_parallel:  # each TP rank normalises its own sequence shard
        mark_grad_sum_over_tp(norm, ctx)
    return norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_idx: int):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # Megatron's scaled init for output projections
        self.layer_idx, self.is_moe = layer_idx, cfg.is_moe_layer(layer_idx)
        self.attn_norm = _norm(cfg, ctx)
        self.attn = build_attention(cfg, ctx, out_std)
        self.ffn_norm = _norm(cfg, ctx)
        self.ffn = MoELayer(cfg, ctx, out_std) if self.is_moe else SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size,
                                                                          cfg.init_std, out_std, ctx,
                                                                          fused=cfg.swiglu_fusion)

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor,
                mask: Optional[Mask] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions_S``: shared positions (S) or each row's (B, S); ``mask``: packed documents' mask, a (B, 1, S, S)
        tensor or a FlexAttention BlockMask (``document_mask.py``)."""
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_S, mask)
        if self.is_moe:
            y_BSD, aux = self.ffn(self.ffn_norm(x_BSD))
        else:
            y_BSD, aux = self.ffn(self.ffn_norm(x_BSD)), x_BSD.new_zeros((), dtype=torch.float32)
        return x_BSD + y_BSD, aux

    def steps(self, x_BSD: torch.Tensor, positions_S: torch.Tensor, mask: Optional[Mask] = None):
        """``forward`` as a generator cut at the MoE layer's two token exchanges (``overlap_moe_comm``). Before each
        step it yields the kind of step that comes next (``"comm"`` or ``"comp"``) and every tensor still needed, and
        goes on with what it is sent back (the same tensors, cut from the graph: strategy/pipeline/moe_overlap.py).
        Returns what ``forward`` returns. A dense block is one local step."""
        if not self.is_moe:
            return self(x_BSD, positions_S) if mask is None else self(x_BSD, positions_S, mask)
        step = self._step_context()
        with step():
            x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_S, mask)
            moe = self.ffn
            s = moe.begin(self.ffn_norm(x_BSD))
        x_BSD, s = yield "comm", (x_BSD, s)
        with step():
            moe.send(s)
        x_BSD, s = yield "comp", (x_BSD, s)
        with step():
            moe.compute(s)
        x_BSD, s = yield "comm", (x_BSD, s)
        with step():
            moe.receive(s)
        x_BSD, s = yield "comp", (x_BSD, s)
        with step():
            y_BSD, aux = moe.finish(s)
        return x_BSD + y_BSD, aux

    def _step_context(self):
        """What each step of ``steps`` runs in: the saved-tensor hooks of ``Recompute``'s fine-grained modules when
        they wrap this block (``step_context``). A wrapper that needs the whole block or MoE layer in one call
        (``Recompute(["full"])`` / ``["moe"]`` checkpoints, ``ActivationOffload``) cannot run in steps."""
        f, contexts = self.forward, []
        while hasattr(f, "inner"):
            if not hasattr(f, "step_context"):
                break
            contexts.append(f.step_context)
            f = f.inner
        if hasattr(f, "inner") or "forward" in self.ffn.__dict__:
            raise ValueError("MoEFoldStrategy(overlap_moe_comm=True) runs each MoE block in steps and cannot "
                             "recompute a whole block or MoE layer (Recompute 'full' or 'moe'); use the "
                             "fine-grained modules (moe_act, layernorm, core_attn, mla_up_proj, shared_experts)")
        return contexts[0] if contexts else nullcontext


class Layers(nn.ModuleDict):
    """This rank's blocks keyed by their global layer index, so that parameter names (``layers.7.attn...``) are those
    of the unsplit model on every pipeline layout. Iterates over the blocks and indexes by layer number."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, idx) -> Block:
        return super().__getitem__(str(idx))


class MoETransformer(nn.Module):
    """The model, or under pipeline parallelism this rank's model chunks (virtual stages ``stages``; see
    ``strategy/pipeline/partition.py``). The embedding sits on virtual stage 0, the final norm and head on the last.
    With tied embeddings and PP > 1 the last stage holds its own copy of the embedding (``embed.weight``, the same
    name and initial value), whose gradient the strategy sums with the first stage's (Megatron's approach)."""

    def __init__(self, cfg: ModelConfig, ctx: Optional[ParallelContext] = None):
        super().__init__()
        ctx = ctx or ParallelContext.single()
        check_model_layout(cfg, ctx, ctx.pipeline_first_layers, ctx.pipeline_last_layers)
        self.cfg, self.ctx = cfg, ctx
        ranges = partition_layers(cfg.num_layers, ctx.pp, ctx.virtual_pipeline_size, ctx.pipeline_first_layers,
                                  ctx.pipeline_last_layers)
        self.num_stages = len(ranges)
        self.stages = local_stages(ctx.pp, ctx.rank("pp"), ctx.virtual_pipeline_size)
        self.chunk_layers = [list(ranges[v]) for v in self.stages]
        self.has_first, self.has_last = self.stages[0] == 0, self.stages[-1] == self.num_stages - 1
        self.embed = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, cfg.init_std)
                      if self.has_first or (self.has_last and cfg.tie_embeddings) else None)
        if self.embed is not None and cfg.tie_embeddings and ctx.pp > 1:
            self.embed.weight.pp_tied = True  # gradient summed over the first and last stage
            self.embed.weight.pp_tied_copy = not self.has_first  # counted once in the gradient norm
        self.layers = Layers({str(i): Block(cfg, ctx, i) for layers in self.chunk_layers for i in layers})
        self.norm = _norm(cfg, ctx) if self.has_last else None
        self.head = (ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, ctx, cfg.init_std)
                     if self.has_last and not cfg.tie_embeddings else None)

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        for m in self.modules():
            if isinstance(m, nn.RMSNorm):
                m.reset_parameters()

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed)

    def is_first_chunk(self, chunk: int) -> bool:
        return self.stages[chunk] == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return self.stages[chunk] == self.num_stages - 1

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters a model chunk's backward produces gradients for."""
        mods = [self.layers[i] for i in self.chunk_layers[chunk]]
        if self.is_first_chunk(chunk):
            mods.insert(0, self.embed)
        if self.is_last_chunk(chunk):
            mods += [m for m in (self.norm, self.head, self.embed) if m is not None and m not in mods]
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def chunk_input_shape(self, tokens_shape) -> tuple[int, int, int]:
        """(B, S, D) of the residual stream between stages: this rank's CP tokens, sequence-sharded under SP."""
        B, S = tokens_shape
        S //= self.ctx.cp
        if self.ctx.sequence_parallel:
            S //= self.ctx.tp
        return B, S, self.cfg.hidden_size

    def forward_chunk(self, chunk: int, tokens_BS: torch.Tensor, x_BSD: Optional[torch.Tensor] = None,
                      position_ids_BS: Optional[torch.Tensor] = None,
                      document_ids_BS: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return run_steps(self.forward_chunk_steps(chunk, tokens_BS, x_BSD, position_ids_BS, document_ids_BS))

    def forward_chunk_steps(self, chunk: int, tokens_BS: torch.Tensor, x_BSD: Optional[torch.Tensor] = None,
                            position_ids_BS: Optional[torch.Tensor] = None,
                            document_ids_BS: Optional[torch.Tensor] = None, steps: bool = False):
        """One model chunk: the embedding on the first stage (``x_BSD`` is then ignored), its blocks, and on the last
        stage the final norm and head. Returns (hidden states or logits, the chunk's summed auxiliary loss).
        Packed documents (``TokenDataModule(pack_documents=True)``) give each row's positions and document ids:
        attention then stays within each document, under a mask built once here for all blocks."""
        S, cp, cp_rank = tokens_BS.shape[1], self.ctx.cp, self.ctx.rank("cp")
        mask, local = None, lambda t_BS: zigzag_shard(t_BS, cp, cp_rank)
        if document_ids_BS is not None:  # under CP every document in 2·cp chunks (packed_context_parallel.py)
            if cp > 1:
                check_document_lengths(document_ids_BS, cp)
            # dense (B, 1, s, S) on CPU; a BlockMask on CUDA, O(S²/128²) instead of O(S²) (document_mask.py)
            mine_Bs, mask = build_document_mask(document_ids_BS, cp, cp_rank,
                                                use_flex(self.cfg.document_attention, tokens_BS.device))
            if mine_Bs is not None:
                local = lambda t_BS: t_BS.gather(1, mine_Bs)  # noqa: E731
                positions = local(position_ids_BS if position_ids_BS is not None else
                                  torch.arange(S, device=tokens_BS.device).expand_as(tokens_BS))
            else:
                positions = position_ids_BS if position_ids_BS is not None else \
                    torch.arange(S, device=tokens_BS.device)
        else:
            positions = zigzag_positions(S, cp, cp_rank, tokens_BS.device) if position_ids_BS is None \
                else local(position_ids_BS)
        if self.is_first_chunk(chunk):
            x_BSD = self.embed(local(tokens_BS))
        head_weight = self.embed.weight if self.head is None and self.is_last_chunk(chunk) else None
        if steps and head_weight is not None and self.is_first_chunk(chunk):
            # the tied head's own leaf of the weight: its gradient joins the embedding's in the first step's
            # backward, summed before it is accumulated, as in one backward
            head_weight = yield "leaf", head_weight
        aux = x_BSD.new_zeros((), dtype=torch.float32)
        for i in self.chunk_layers[chunk]:
            if steps:
                x_BSD, layer_aux = yield from self.layers[i].steps(x_BSD, positions, mask)
                if layer_aux.requires_grad:
                    yield "loss", layer_aux
                aux = aux + layer_aux.detach()
                continue
            # the mask only when there is one: CUDA-graphed blocks take (x, positions)
            x_BSD, layer_aux = self.layers[i](x_BSD, positions) if mask is None else \
                self.layers[i](x_BSD, positions, mask)
            aux = aux + layer_aux
        if not self.is_last_chunk(chunk):
            return x_BSD, aux
        h_BSD = self.norm(x_BSD)
        if self.head is not None:
            return self.head(h_BSD), aux
        return F.linear(enter_tp_region(h_BSD, self.ctx), head_weight), aux

    def forward(self, tokens_BS: torch.Tensor, position_ids_BS: Optional[torch.Tensor] = None,
                document_ids_BS: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the summed auxiliary loss of all MoE layers. On one process the logits are (B, S, V); under
        CP they cover this rank's zig-zag positions and under TP this rank's vocabulary shard. Under PP the strategy
        runs the chunks through its pipeline schedule instead."""
        if self.ctx.pp > 1:
            raise RuntimeError("MoETransformer.forward runs the whole model; under pipeline parallelism each rank "
                               "holds only some stages and MoEFoldStrategy runs them with forward_chunk")
        return self.forward_chunk(0, tokens_BS, None, position_ids_BS, document_ids_BS)

    def lm_loss(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                document_ids_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross-entropy over this rank's tokens (fp32, vocab-parallel). Packed documents: the mean over
        the targets of the global batch (their counts differ by rank), scaled by dp x cp as the ranks' losses and
        gradients are averaged, so that every layout gives one process's number."""
        cp, rank = self.ctx.cp, self.ctx.rank("cp")
        if document_ids_BS is None:
            labels_BS = zigzag_shard(labels_BS, cp, rank)
            return vocab_parallel_cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), self.ctx,
                                                fused=self.cfg.cross_entropy_fusion)
        if cp > 1:
            labels_BS = labels_BS.gather(1, packed_zigzag_index(document_ids_BS, cp, rank))
        ranks = self.ctx.size("dp_cp")
        if ranks == 1:
            return vocab_parallel_cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), self.ctx,
                                                fused=self.cfg.cross_entropy_fusion)
        total = vocab_parallel_cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), self.ctx, reduction="sum",
                                             fused=self.cfg.cross_entropy_fusion)
        count = (labels_BS != IGNORE).sum().to(total.dtype)
        self.ctx.all_reduce_(count, "dp_cp")  # a count: no gradient to carry
        return total * ranks / count

    def loss(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor, position_ids_BS: Optional[torch.Tensor] = None,
             document_ids_BS: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM loss of this rank's tokens (targets of -100 count for nothing) and the auxiliary loss."""
        logits_BSV, aux = self(tokens_BS, position_ids_BS, document_ids_BS)
        return self.lm_loss(logits_BSV, labels_BS, document_ids_BS), aux

    def block_inputs(self, tokens_BS: torch.Tensor) -> tuple[tuple[int, int, int], torch.dtype, torch.Tensor]:
        """What every block receives for these tokens: the residual stream's (B, S, D) and dtype, and the
        positions (the blocks' inputs that CUDA graphs capture)."""
        S, cp = tokens_BS.shape[1], self.ctx.cp
        first = self.embed if self.embed is not None else self.layers[self.chunk_layers[0][0]].attn_norm
        dtype = first.weight.dtype  # the residual stream's: the embedding's output, or a block's norm
        return (self.chunk_input_shape(tuple(tokens_BS.shape)), dtype,
                zigzag_positions(S, cp, self.ctx.rank("cp"), tokens_BS.device))

    def moe_layers(self) -> list[MoELayer]:
        return [blk.ffn for blk in self.layers if blk.is_moe]


def run_steps(gen):
    """Run a steps generator (``forward_chunk_steps``) without cutting anything; its return value."""
    try:
        kind, value = next(gen)
        while True:
            kind, value = gen.send(value if kind != "loss" else None)  # "leaf": the tensor itself
    except StopIteration as done:
        return done.value


def check_model_layout(cfg: ModelConfig, ctx_or_layout, pipeline_first_layers: Optional[int] = None,
                       pipeline_last_layers: Optional[int] = None) -> None:
    """Raise ValueError when the model cannot be split over the layout (heads, kv heads, FFN sizes, vocab, experts,
    sequence length, layers over pipeline stages). Takes a ParallelContext or a strategy Layout, so it can run before
    any process group."""
    tp, cp, ep, etp, pp = (getattr(ctx_or_layout, n) for n in ("tp", "cp", "ep", "etp", "pp"))
    vpp = (ctx_or_layout.virtual_pipeline_size if isinstance(ctx_or_layout, ParallelContext)
           else ctx_or_layout.vpp)
    partition_layers(cfg.num_layers, pp, vpp, pipeline_first_layers, pipeline_last_layers)

    def need(what: str, n: int, by: int, name: str) -> None:
        if n % by:
            long, short = name.split()
            raise ValueError(f"{what}={n} is not divisible by {long} ({short}={by})")

    check_attention_tp(cfg, tp)
    need("vocab_size", cfg.vocab_size, tp, "tensor_parallel_size tp")
    if cfg.num_layers > cfg.num_moe_layers:
        need("ffn_hidden_size", cfg.ffn_hidden_size, tp, "tensor_parallel_size tp")
    if cfg.shared_expert_ffn_size:
        need("shared_expert_ffn_size", cfg.shared_expert_ffn_size, tp, "tensor_parallel_size tp")
    if cfg.num_moe_layers:
        need("num_experts", cfg.num_experts, ep, "expert_parallel_size ep")
        need("moe_ffn_hidden_size", cfg.moe_ffn_hidden_size, etp, "expert_tensor_parallel_size etp")
    if cp > 1 and cfg.seq_length % (2 * cp):
        raise ValueError(f"seq_length={cfg.seq_length} is not divisible by 2 x context_parallel_size = {2 * cp} "
                         "(zig-zag sharding gives every CP rank two equal chunks)")
    if tp > 1 and (cfg.seq_length // cp) % tp:
        raise ValueError(f"seq_length / context_parallel_size = {cfg.seq_length // cp} is not divisible by "
                         f"tensor_parallel_size={tp} (sequence parallelism and the MoE token split shard it)")
