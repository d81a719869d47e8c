"""A small GPT (nanoGPT-shaped): `model=gpt_small|gpt_tiny` (`_target_: trainer.models.gpt.GPT`)."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe.routing import Routed
from engine.numerics.chunked_ce import HeadLoss
from trainer.models.moe import MoE, MoEConfig

if TYPE_CHECKING:
    from engine.parallel.context import SequenceShard
    from engine.parallel.expert import ExpertLayer
from engine.numerics.functional import fake_quantize


@dataclass
class GPTConfig:
    """Shapes of a byte-level (or token-level) GPT; validated on construction."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    # Train the blocks' linear layers with STE fake-quantized weights of this many bits.
    fake_quant_bits: int | None = None
    # model.moe.*: mixture-of-experts blocks (trainer/models/moe.py); experts=0 is dense.
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        # Messages start with the field's name: the trainer names the config key from it.
        sizes = {
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
        }
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be divisible by n_head={self.n_head}, got {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.fake_quant_bits is not None and not 2 <= self.fake_quant_bits <= 16:
            raise ValueError(
                f"fake_quant_bits must be null or in [2, 16], got {self.fake_quant_bits}"
            )


class FakeQuantLinear(nn.Linear):
    """A linear layer that trains with fake-quantized weights (straight-through estimator):
    the forward sees `bits`-bit weights, the gradient reaches the full-precision ones."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quantize(self.weight, self.bits), self.bias)


def linear(cfg: GPTConfig, n_in: int, n_out: int) -> nn.Linear:
    if cfg.fake_quant_bits is None:
        return nn.Linear(n_in, n_out, bias=cfg.bias)
    return FakeQuantLinear(n_in, n_out, cfg.bias, cfg.fake_quant_bits)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = linear(cfg, cfg.n_embd, 3 * cfg.n_embd)
        self.proj = linear(cfg, cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.sequence: SequenceShard | None = None  # dist.cp: this rank's share of it

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` (B, T): which document of a packed row each token belongs to (under
        dist.cp, of the whole sequence); a token attends only to earlier tokens of its own."""
        hs = x.shape[-1] // self.n_head
        # Thirds and -1 heads, not C and n_head: under dist.tp this rank holds its heads only;
        # B and T from qkv's output: with sequence parallelism x is this rank's token shard.
        qkv = self.qkv(x)
        B, T = qkv.shape[:2]
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        dropout = self.dropout if self.training else 0.0
        if self.sequence is not None:  # over the whole sequence, every rank's keys and values
            y = self.sequence.attend(q, k, v, dropout_p=dropout, documents=documents)
        elif documents is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            mask = document_mask(documents)  # (B, 1, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C)
        return self.resid_drop(self.proj(y))


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the index of the document each token belongs to in its row; a new
    document starts wherever the position does not follow the previous one (at a 0), as
    transformers reads packed rows."""
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    return (step != 1).cumsum(-1)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool: query t may attend key s <= t of its document."""
    T = documents.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = linear(cfg, cfg.n_embd, 4 * cfg.n_embd)
        self.proj = linear(cfg, 4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        # A mixture of experts in place of the MLP (model.moe.*), or the dense MLP.
        self.mlp = MoE(cfg.n_embd, cfg.moe, cfg.bias, cfg.dropout) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), documents)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer with tied input/output embeddings.

    Takes `GPTConfig`'s fields as keyword arguments (what `model._target_` passes).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        fake_quant_bits: int | None = None,
        moe: dict | MoEConfig | None = None,
    ) -> None:
        super().__init__()
        cfg = GPTConfig(
            vocab_size,
            block_size,
            n_layer,
            n_head,
            n_embd,
            dropout,
            bias,
            fake_quant_bits,
            MoEConfig.of(moe),
        )
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, cfg.moe.is_moe_block(i)) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.sequence: SequenceShard | None = None  # dist.cp: this rank's share of it
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        for block in self.blocks:
            if isinstance(block.mlp, MoE):
                block.mlp.init_weights(cfg.n_layer)

    @classmethod
    def from_config(cls, cfg: GPTConfig) -> GPT:
        return cls(**{**asdict(cfg), "moe": cfg.moe})

    def routers(self) -> list[Routed]:
        """The mixture blocks' routers in forward order (engine/moe/routing.py's
        `HasRouters`); none in a dense model."""
        # (Under dist.pp a rank's pruned model holds None for other stages' blocks.)
        return [b.mlp.router for b in self.blocks if b is not None and isinstance(b.mlp, MoE)]

    def expert_layers(self) -> list[ExpertLayer]:
        """The mixture blocks' experts as dist.ep splits them (engine/parallel/expert.py's
        `HasExperts`); none in a dense model."""
        blocks = [b for b in self.blocks if b is not None and isinstance(b.mlp, MoE)]
        return [b.mlp.experts.expert_layer() for b in blocks]

    # What the trainer reads besides forward (engine/model.py): blocks, sizes, FLOPs, sampling.
    def block_modules(self) -> Sequence[nn.Module]:
        return list(self.blocks)

    def pipeline_stage(self, blocks: Sequence[int], first: bool, last: bool) -> GPT:
        """A pipeline stage sharing this model's parameters (engine/parallel/pipeline/): blocks
        `blocks`, from token ids when `first` (else from hidden states), to the logits when
        `last` (else hidden states). A shallow copy with its own table of submodules."""
        stage = copy.copy(self)
        stage._modules = dict(self._modules)
        stage._parameters, stage._buffers = dict(self._parameters), dict(self._buffers)
        stage.blocks = nn.ModuleList(self.blocks[i] for i in blocks)
        if not first:
            stage.pos_emb = None
        if not last:
            stage.ln_f = stage.lm_head = None
        if not (first or last):
            stage.tok_emb = None  # kept by the last stage too: it holds the tied weight
        stage.stage_ends = (first, last)
        return stage

    def tensor_parallel_plan(self) -> dict[str, str]:
        """`dist.tp` (engine/parallel/tensor.py): heads and MLP units split over the ranks.
        The fused q/k/v projection is laid out [q | k | v]: `colwise_qkv` splits each third,
        so a rank holds q, k and v of the same heads."""
        return {
            "blocks.*.attn.qkv": "colwise_qkv",
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise",
        }

    def sequence_parallel_plan(self) -> dict[str, str]:
        """`dist.tp_sequence_parallel` (engine/parallel/tensor.py): the residual stream is
        split along the sequence after the embeddings (so their dropout, the blocks' norms,
        dropout and residual adds hold this rank's tokens) and gathered after `ln_f`."""
        return {
            "drop": "sequence_split",
            "blocks.*.ln1": "sequence",
            "blocks.*.ln2": "sequence",
            "ln_f": "sequence_gather",
        }

    def context_parallel(self, shard: SequenceShard) -> None:
        """`dist.cp` (engine/parallel/context.py): every attention attends over the whole
        sequence (`shard.attend`), positions are those of this rank's tokens in it."""
        self.sequence = shard
        for block in self.blocks:
            block.attn.sequence = shard

    def output_head(self) -> nn.Linear:
        """The output layer (engine/numerics/chunked_ce.py's `OutputHead`): its weight is
        `tok_emb`'s."""
        return self.lm_head

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.block_size

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        head_loss: HeadLoss | None = None,
        head_targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids `input_ids` (B, T); with `head_loss`, instead
        its value on the final hidden states, the output layer and `head_targets` (B, T).

        `position_ids` (B, T): packed documents (data=chat), each restarting at 0 where a
        document starts; each token then attends only to its own document."""
        first, last = getattr(self, "stage_ends", (True, True))  # a pipeline stage: either end
        x = input_ids  # on a stage after the first: the previous stage's hidden states
        documents = None
        if position_ids is not None:
            documents = (
                document_ids(position_ids)
                if self.sequence is None
                else self.sequence.documents(position_ids)
            )
        if first:
            pos = self.positions(input_ids) if position_ids is None else position_ids
            x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x, documents)
        if not last:
            return x
        x = self.ln_f(x)  # (B, T, C)
        if head_loss is not None:  # e.g. a chunked cross-entropy that never holds all logits
            return head_loss(x, self.lm_head, head_targets)
        return self.lm_head(x)  # (B, T, vocab)

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """The positions of the tokens `idx` (B, T) hold in their sequences: 0..T-1, or under
        `dist.cp` those of this rank's chunks (padding past the table shares its last row:
        nothing before it attends to it)."""
        if self.sequence is None:
            return torch.arange(idx.size(1), device=idx.device)
        pos = self.sequence.positions(idx.size(1), idx.device)
        return pos.clamp(max=self.cfg.block_size - 1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token (PaLM appendix B): 6N + 12 L T C, N counting
        the parameters a token goes through (of a mixture, its top-k experts only)."""
        n = self.num_params() - self.pos_emb.weight.numel()
        for block in self.blocks:
            if block is not None and isinstance(block.mlp, MoE):
                experts = sum(p.numel() for p in block.mlp.experts.parameters())
                moe = self.cfg.moe
                n -= experts * (moe.experts - moe.top_k) // moe.experts
        return 6 * n + 12 * self.cfg.n_layer * seq_len * self.cfg.n_embd

    @torch.inference_mode()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample continuations of `idx` (B, T); uses its own generator, never the global RNG."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :].float() / temperature
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
