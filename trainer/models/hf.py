"""Hugging Face `transformers` causal language models as cumulus models (`model=hf_gpt2`,
`model=hf_llama`, or `model.family=` any `model_type` transformers knows).

Built from a config with random initialization (no download), or loaded from a local
`save_pretrained` directory with `model.pretrained=DIR`. The model is the transformers class
itself, subclassed only to add what the trainer may ask beyond `forward` (engine/model.py):
its blocks come from transformers' own `_no_split_modules`, `flops_per_token` from the
config's shapes, and `generate(ids, max_new_tokens, generator=)` samples reproducibly with
transformers' generation. Families whose logits are exactly the output layer applied to the
last hidden state (`HEAD_FAMILIES`) also declare engine/numerics/chunked_ce.py's `OutputHead`, so a
large vocabulary's loss runs chunked, never holding the logits of the whole micro-batch.
Parameter names are transformers' own, so a checkpoint's weights are a `state_dict` that
`from_pretrained` reads (scripts/export_hf.py writes the directory). transformers' own loss
is never used: `task=causal_lm` sums the loss over `.logits` (or has it summed chunk by
chunk) and divides by the global count of targets, exact for every model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from engine.moe.objective import SWITCH_COEF, Pooled
from engine.moe.routing import HookedRouter
from engine.numerics.chunked_ce import HeadLoss
from engine.parallel.expert import ExpertLayer  # (a runtime name: transformers reads the hints)
from engine.parallel.pipeline import NotSplittable
from trainer.config.errors import UserError
from trainer.config.pretrained import dropout_note, refuse_architecture
from trainer.models.hf_experts import EXPERTS, register_experts_forward, transformers_experts

if TYPE_CHECKING:
    from engine.parallel.context import SequenceShard

EXTRA = "hf"
CONTEXT_PARALLEL = "cumulus_context_parallel"  # an attention function registered for dist.cp
# model_types whose causal LM computes `logits = lm_head(last_hidden_state)` and nothing more
# (no logit scaling or soft-capping): the chunked loss equals theirs (tests/test_chunked_ce.py).
HEAD_FAMILIES = frozenset({"gpt2", "llama", "mistral", "qwen2"})


def is_transformers_model(model: object) -> bool:
    """A transformers `PreTrainedModel` (model=hf_*, hf_encoder, or what merging its adapters
    gives): `save_pretrained` writes it as a Hugging Face directory. Imports nothing: where
    transformers' modeling module was never imported, no such model exists."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def origin_note(model: nn.Module, node: Mapping[str, Any]) -> str:
    """The start-up line's words after a transformers model's name (`node`: its `model`
    config): ' (from DIR, dropout 0.0: the directory's)', ' (random init, dropout 0.1)'; ''
    for any other model."""
    if not is_transformers_model(model):
        return ""
    fields = cast(Any, model).config.to_dict()
    given = node.get("config") if isinstance(node.get("config"), Mapping) else {}
    return " " + dropout_note(fields, list(given or {}), node.get("pretrained"))


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError(
            "model=hf_*: Hugging Face transformers is not installed; install the extra: "
            f"pip install 'cumulus[{EXTRA}]'"
        ) from None
    return transformers


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off: "Loading weights" while `from_pretrained` reads a
    directory (every rank, evaluation and export would print one; the start-up line names the
    model), "Writing model shards" while an export saves (its last line says what it wrote).
    Restored after, for a caller's own use of transformers."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # nothing to quiet
        yield
        return
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


class PipelineStage(nn.Module):
    """One pipeline stage (engine/parallel/pipeline/) of a transformers causal LM whose config
    declares `base_model_pp_plan` as embedding -> layers -> norm (Llama and its kin): the base
    model's own forward on a shallow copy holding only this stage's layers, fed `input_ids`
    on the first stage and the previous stage's hidden states as `inputs_embeds` after it;
    the norm and the output layer on the last stage only. Shares the model's parameters."""

    def __init__(self, model: nn.Module, blocks: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        embedding, layers, norm = model.config.base_model_pp_plan
        base = model.base_model
        stage = copy.copy(base)
        stage._modules = dict(base._modules)
        setattr(stage, layers, nn.ModuleList(getattr(base, layers)[i] for i in blocks))
        if not first:
            setattr(stage, embedding, None)  # the input arrives as `inputs_embeds`
        if not last:
            setattr(stage, norm, nn.Identity())
        self.base, self.first, self.last = stage, first, last
        self.head = model.get_output_embeddings() if last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        head_loss: HeadLoss | None = None,
        head_targets: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        key = "input_ids" if self.first else "inputs_embeds"
        kwargs.setdefault("use_cache", False)  # a cache would join packed documents' attention
        hidden = self.base(**{key: input_ids}, attention_mask=attention_mask, **kwargs)[0]
        if not self.last:
            return hidden
        if head_loss is not None:
            return head_loss(hidden, self.head, head_targets)
        return self.head(hidden)  # the logits


class GPT2Stage(nn.Module):
    """One pipeline stage of a transformers GPT-2 (`model_type` gpt2). Its base model adds the
    position embedding to whatever enters as `inputs_embeds`, so a later stage cannot enter
    through the base forward: this stage runs that forward's steps itself (transformers 5's
    `GPT2Model.forward`, training only: no cache, no cross-attention). First stage: `wte` +
    `wpe` (+ `token_type_ids` through `wte`), dropout; every stage: the causal mask and the
    position ids as the base model builds them (positions 0..T-1 whatever the padding, the
    mask from the batch's `attention_mask`), then its blocks `h[i]`; last stage: `ln_f` and
    the output layer. Shares the model's parameters."""

    def __init__(self, model: nn.Module, blocks: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        base = model.base_model
        self.config = base.config
        self.first, self.last = first, last
        self.head = model.get_output_embeddings() if last else None
        # The last stage holds `wte` too when the output layer's weight is its weight (GPT-2
        # ties them): FSDP2 then swaps the sharded parameter into both modules, and the
        # pipeline sums the tied weight's gradients of the first and last stages by its name.
        tied = self.head is not None and self.head.weight is base.wte.weight
        self.wte = base.wte if first or tied else None
        self.wpe, self.drop = (base.wpe, base.drop) if first else (None, None)
        self.h = nn.ModuleList(base.h[i] for i in blocks)
        self.ln_f = base.ln_f if last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        head_loss: HeadLoss | None = None,
        head_targets: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        # `input_ids` (B, T) on the first stage, the previous stage's hidden states (B, T, C)
        # after it.
        hidden = self.wte(input_ids) if self.first else input_ids  # (B, T, C)
        batch_size, seq_len = hidden.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)  # (1, T)
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        # From the token embeddings on the first stage, as the base model does; after it from
        # the hidden states, which have their dtype (the residual stream keeps it).
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        if self.first:
            hidden = hidden + self.wpe(position_ids)
            if token_type_ids is not None:
                hidden = hidden + self.wte(token_type_ids.view(-1, seq_len))
            hidden = self.drop(hidden)
        for block in self.h:
            hidden = block(hidden, attention_mask=causal_mask, position_ids=position_ids, **kwargs)
        if not self.last:
            return hidden
        hidden = self.ln_f(hidden)
        if head_loss is not None:
            return head_loss(hidden, self.head, head_targets)
        return self.head(hidden)  # the logits


# Families whose base model needs a stage of its own; the others split by their config's
# `base_model_pp_plan` (`PipelineStage`).
STAGES: dict[str, type[nn.Module]] = {"gpt2": GPT2Stage}


class CumulusHooks:
    """What cumulus asks of a model beyond `forward`, for any transformers causal LM."""

    config: Any
    context_shard: Any  # dist.cp: the SequenceShard `context_parallel` was given
    transformers_class: type  # the transformers class this one extends (`_with_hooks`)

    moe_routers: list[HookedRouter]  # set by `causal_lm`
    moe_experts: list[ExpertLayer]  # set by `causal_lm`

    def routers(self) -> list[HookedRouter]:
        """The routers of a mixture-of-experts family (transformers' `*TopKRouter` modules,
        Qwen3-MoE's and Mixtral's), observed by hooks (engine/moe/routing.py's `HasRouters`);
        none in a dense model. The model's own per-micro-batch auxiliary loss stays off
        (`output_router_logits` false): cumulus balances the whole step (moe.balance) by
        the same objective (`balance_objective`)."""
        return self.moe_routers

    def expert_layers(self) -> list[ExpertLayer]:
        """The experts of a mixture-of-experts family, found by what transformers declares of
        them (trainer/models/hf_experts.py), as dist.ep splits them (engine/parallel/
        expert.py's `HasExperts`); none in a dense model."""
        return self.moe_experts

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """Whether transformers may choose this model's experts implementation: the answer
        of the class this one extends. transformers reads it from the source of the class's
        module (`@use_experts_implementation` in it), which for this subclass is this file:
        its own answer would leave a mixture on the eager experts under torch.compile too."""
        return cls.transformers_class._can_set_experts_implementation()

    def balance_objective(self) -> Pooled:
        """transformers' own load-balancing loss (`load_balancing_loss_func`: every layer's
        tokens pooled, f summing to top_k), weighted by the config's `router_aux_loss_coef`
        unless moe.aux_coef is given (engine/moe/objective.py's `DeclaresBalanceObjective`)."""
        coef = self.config.to_dict().get("router_aux_loss_coef")
        return Pooled(SWITCH_COEF if coef is None else float(coef))

    def pipeline_stage(self, blocks: Sequence[int], first: bool, last: bool) -> nn.Module:
        """`dist.pp`: a stage sharing this model's parameters: `GPT2Stage` for GPT-2, else
        `PipelineStage`, for families whose config declares the base model as embedding ->
        layers -> norm."""
        if self.context_shard is not None:  # set by `context_parallel`
            raise NotSplittable(
                "dist.cp with dist.pp is not built for transformers models yet (their stages "
                "compute position ids themselves); use dist.cp or dist.pp, or the in-tree GPT"
            )
        own = STAGES.get(self.config.model_type)
        if own is not None:
            return own(self, blocks, first, last)  # type: ignore[call-arg]
        plan = getattr(self.config, "base_model_pp_plan", None) or {}
        if len(plan) != 3 or next(iter(plan.values()))[1] != ["inputs_embeds"]:
            raise NotSplittable(
                f"transformers model_type {self.config.model_type!r} does not declare its base "
                "model as embedding -> layers -> norm (config.base_model_pp_plan), which "
                "dist.pp splits; Llama-style families do (model=hf_llama), and GPT-2 has a "
                "stage of its own (model=hf_gpt2)"
            )
        return PipelineStage(self, blocks, first, last)  # type: ignore[arg-type]

    def context_parallel(self, shard: SequenceShard) -> None:
        """`dist.cp` (engine/parallel/context.py): attention through transformers' own
        attention-function registry, over the whole sequence (`shard.attend`; transformers
        builds no mask for it), and the position ids (rotary or learned) of this rank's tokens,
        given to every forward."""
        from transformers import AttentionInterface

        def attention(
            module: nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            dropout: float = 0.0,
            scaling: float | None = None,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, None]:
            del module, attention_mask, kwargs  # causal over global positions; right padding
            documents = self.context_documents  # packed rows: set by the forward pre-hook
            out = shard.attend(query, key, value, dropout, scaling, documents)
            return out.transpose(1, 2).contiguous(), None  # (B, T, heads, head_dim)

        AttentionInterface.register(CONTEXT_PARALLEL, attention)
        self.set_attn_implementation(CONTEXT_PARALLEL)  # type: ignore[attr-defined]
        self.context_shard = shard
        self.context_documents = None
        limit = self.max_seq_len
        self.register_forward_pre_hook(  # type: ignore[attr-defined]
            functools.partial(_shard_positions, shard, limit), with_kwargs=True
        )

    @property
    def max_seq_len(self) -> int | None:
        for name in ("n_positions", "max_position_embeddings"):
            value = getattr(self.config, name, None)
            if isinstance(value, int):
                return value
        return None

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' `save_pretrained`, with the transformers class this one extends as
        the architecture (it records `type(self).__name__`, a class transformers lacks)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)  # type: ignore[misc]
        if kwargs.get("is_main_process", True):
            self.config.architectures = [type(self).transformers_class.__name__]
            self.config.save_pretrained(save_directory)
        return out

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the parameters that do matrix products + attention's 12 x layers x width x
        sequence (the PaLM / nanoGPT count), from the config's shapes. Embedding lookups cost
        nothing, except a token embedding tied to the output layer (GPT-2), which does."""
        c = self.config
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 0)
        width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 0)
        output = self.get_output_embeddings()  # type: ignore[attr-defined]
        tied = None if output is None else output.weight
        lookups = sum(
            m.weight.numel()
            for m in self.modules()  # type: ignore[attr-defined]
            if isinstance(m, nn.Embedding) and m.weight is not tied
        )
        params = sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]
        return 6.0 * (params - lookups) + 12.0 * layers * width * seq_len

    def generate(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """transformers' `generate`; with `generator`, sampled from a seed drawn from it,
        with the global RNG forked so training's random streams are untouched. Stops at the
        model's context (GPT-2's position table ends there)."""
        parent = super().generate  # type: ignore[misc]
        limit = self.max_seq_len
        if limit is not None and max_new_tokens is not None:
            max_new_tokens = min(max_new_tokens, limit - input_ids.shape[1])
            if max_new_tokens <= 0:
                return input_ids
        if generator is None:
            return parent(input_ids, max_new_tokens=max_new_tokens, **kwargs)
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        devices = [input_ids.device] if input_ids.device.type == "cuda" else []
        kwargs.setdefault("do_sample", True)
        kwargs.setdefault("top_k", 50)
        kwargs.setdefault("pad_token_id", 0)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return parent(input_ids, max_new_tokens=max_new_tokens, **kwargs)


def _shard_positions(
    shard: SequenceShard, limit: int | None, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """A forward pre-hook: the position ids of this rank's tokens in their sequences (past a
    learned table's end, its last row: only padding sits there). A batch of packed documents
    brings its own (split with it), and the documents of the whole sequence are found once
    per forward for the attention."""
    given = kwargs.get("position_ids")
    module.context_documents = None if given is None else shard.documents(given)
    if given is not None:
        return args, kwargs
    ref = kwargs.get("input_ids", args[0] if args else None)
    if ref is None:
        ref = kwargs["inputs_embeds"]
    pos = shard.positions(ref.shape[1], ref.device)
    if limit is not None:
        pos = pos.clamp(max=limit - 1)
    return args, {**kwargs, "position_ids": pos.unsqueeze(0).expand(ref.shape[0], -1)}


def _no_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    del module
    return args, {"use_cache": False, **kwargs}


def load_config(family: str, config: dict[str, Any], pretrained: str | None) -> Any:
    """The transformers config of `family` with `config`'s fields, or of a local
    `save_pretrained` directory (its own code refused; `config`'s runtime fields applied over
    its values). One paragraph for a directory that is not one and a family transformers
    lacks."""
    transformers = require_transformers()
    if pretrained is None:
        try:
            return transformers.AutoConfig.for_model(family, **config)
        except ValueError as exc:
            raise ValueError(f"family: {exc}".splitlines()[0]) from None
    path = Path(pretrained).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"pretrained: {path} is not a local save_pretrained directory (no config.json "
            f"{'in it' if path.is_dir() else 'there: it does not exist'}); cumulus never "
            "downloads from the hub. Save one with model.save_pretrained(DIR) or "
            "scripts/export_hf.py, or leave model.pretrained=null for random init"
        )
    refuse_custom_code(path)
    return transformers.AutoConfig.from_pretrained(path, trust_remote_code=False, **config)


def refuse_custom_code(path: Path) -> None:
    """A pretrained directory is data: one whose config.json asks for its own Python code
    (`auto_map`, transformers' `trust_remote_code` models) is refused, never run. transformers
    itself would ask on an interactive terminal; cumulus never offers to run it."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"pretrained: {path / 'config.json'} is not readable JSON: {exc}"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"pretrained: {path / 'config.json'} is not a JSON object")
    if "auto_map" in raw:
        classes = (
            ", ".join(sorted(map(str, raw["auto_map"])))
            if isinstance(raw["auto_map"], dict)
            else ""
        )
        raise ValueError(
            f"pretrained: {path} asks to run its own Python code (config.json has an auto_map"
            f"{': ' + classes if classes else ''}); cumulus never runs code from a model "
            "directory (trust_remote_code stays off). Use a directory of an architecture "
            "transformers itself implements (model_type gpt2, llama, ...), or bring the model "
            "as your own class with model._target_=yourpkg.YourModel"
        )


class OutputHeadHooks:
    """engine/numerics/chunked_ce.py's `OutputHead` for a causal LM of `HEAD_FAMILIES`: with
    `head_loss=`, forward runs the base model and hands its last hidden state to the loss
    instead of computing the logits."""

    base_model: nn.Module

    def output_head(self) -> nn.Linear:
        return self.get_output_embeddings()  # type: ignore[attr-defined]

    def forward(
        self,
        *args: Any,
        head_loss: HeadLoss | None = None,
        head_targets: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if head_loss is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        hidden = self.base_model(*args, **kwargs)[0]  # (B, T, C): last_hidden_state
        return head_loss(hidden, self.output_head(), head_targets)


@functools.cache
def _with_hooks(cls: type) -> type:
    """`cls` with cumulus's hooks; a module-level name so pickling and FSDP see a real class."""
    model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    extra = (OutputHeadHooks,) if model_type in HEAD_FAMILIES else ()
    body = {"__module__": __name__, "transformers_class": cls}
    sub = type(f"Cumulus{cls.__name__}", (*extra, CumulusHooks, cls), body)
    globals()[sub.__name__] = sub
    return sub


def causal_lm(
    family: str = "gpt2",
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
) -> nn.Module:
    """A transformers causal LM: `family` is a `model_type` (gpt2, llama, ...) and `config`
    its config fields (random init), or `pretrained` a local `save_pretrained` directory
    (its architecture and its values; of `config`, runtime fields such as dropout and
    use_cache apply over the directory's, and an architectural one is refused)."""
    require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = dict(config or {})
    if pretrained is not None:  # the architecture is the directory's
        refuse_architecture(config, pretrained)
    hf_config = load_config(family, config, pretrained)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        raise ValueError(
            f"family: transformers has no causal LM for model_type {hf_config.model_type!r}"
        ) from None
    model_cls = _with_hooks(cls)
    if pretrained is not None:
        # float32 parameters whatever the directory was saved in (transformers 5 would keep a
        # bf16 save in bf16): precision is train.precision's autocast, on fp32 master weights.
        with no_progress_bars():
            model = model_cls.from_pretrained(
                Path(pretrained).expanduser(),
                config=hf_config,
                dtype=torch.float32,
                trust_remote_code=False,
            ).train()  # from_pretrained returns it in eval mode: dropout off
    else:
        model = model_cls(hf_config)
    model.config.architectures = [cls.__name__]  # what save_pretrained records
    model.context_shard = None  # dist.cp: `context_parallel` sets it
    model.moe_routers = transformers_routers(model)
    # The fields as given name the expert count first (Qwen3-MoE's num_experts is an alias of
    # its num_local_experts).
    model.moe_experts = transformers_experts(model, {**hf_config.to_dict(), **config})
    if model.moe_experts:  # eager: the class's own experts; compiled: grouped_mm
        register_experts_forward()
        model.set_experts_implementation(EXPERTS)
    # Training builds no cache, whatever the saved config says: with one, transformers no
    # longer keeps packed documents (position ids restarting at 0) from attending to each
    # other. generate() passes use_cache itself.
    model.register_forward_pre_hook(_no_cache, with_kwargs=True)
    if not isinstance(getattr(model, "vocab_size", None), int):  # Llama sets it, GPT-2 not
        model.vocab_size = int(hf_config.vocab_size)  # what the trainer checks the data against
    return model


def transformers_routers(model: nn.Module) -> list[HookedRouter]:
    """Hooks on a transformers model's top-k routers, in forward order (module order)."""
    routers = [
        HookedRouter(m, int(m.num_experts), int(m.top_k))
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter")
    ]
    if routers:  # its own loss would be added per micro-batch to the whole step's
        model.config.output_router_logits = False
        return routers
    fields = model.config.to_dict()
    experts = [k for k in MOE_FIELDS if isinstance(fields.get(k), int) and fields[k] > 0]
    if experts:
        raise ValueError(
            f"family: {model.config.model_type} is a mixture of experts ({experts[0]}="
            f"{fields[experts[0]]}) whose routers cumulus cannot observe: it balances "
            "transformers' top-k router modules (`*TopKRouter`, which return the router "
            "logits), as model=hf_qwen3_moe and model=hf_mixtral have"
        )
    return routers


# Config fields that make a transformers model a mixture of experts.
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
