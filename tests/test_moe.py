"""Mixture of experts with the load-balancing loss of the whole step (model.moe.*, moe.*).

One SGD step over a data set of exactly one global batch (24 samples of 64 tokens): the
gradient the optimizer applies (no clipping: the update is -lr times it) must equal the
float64 gradient of

    mean CE + aux_coef * aux + z_coef * z      over the whole batch at once

computed here on the same weights, whatever the split (micro x accum 24x1, 4x6, 2 ranks x 3 x
4 under DDP and FSDP2, with activation checkpointing). aux = E * sum_i f_i * P_i per MoE layer,
averaged over the layers (f: the share of the top-k assignments, P: the mean router
probability); z = the mean of logsumexp(router logits)^2. Both are computed here from the
router's logits, captured by a hook on its gate, with their own softmax and top-k. The data
set is the whole batch, so the reference needs no knowledge of the sampler's order. The same
for model=hf_qwen3_moe at every split (hf_mixtral at 4x6), against transformers' own model in
float64 and transformers' own objective: `load_balancing_loss_func` over the whole batch's
router logits at once (every layer pooled, f summing to top_k), weighted by the model
config's `router_aux_loss_coef` (moe.aux_coef left null: `hf_reference`). After the backward
passes no router holds a routing (a block recomputed in backward would keep its activations
alive through it).

`moe.balance=micro` (the peers' per-micro-batch balancing) misses the same gradient by a
measured amount: the negative control, and the README's number. On hf_qwen3_moe it is what
transformers' own model gives (its `aux_loss` per micro-batch, averaged). `moe.balance=bias`
moves each router's bias by the whole step's assignments, on one rank or two, and resumes
exactly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import TINY, in_tree_model, stdlib_text, train_in_process, train_records
from tests.ranks import explain, launch_all, torchrun
from trainer.data.text import TextCfg, load_splits
from trainer.models.gpt import GPT
from trainer.models.moe import MoE, MoEConfig

E, K, HIDDEN = 8, 2, 48
AUX, Z = 1.0, 0.1  # large enough that the balancing terms weigh on the routers' gradients
# transformers' runs leave moe.aux_coef null: their config's router_aux_loss_coef weighs.
HF_AUX = 0.5
MOE = [f"+model.moe.experts={E}", f"+model.moe.top_k={K}", f"+model.moe.hidden={HIDDEN}"]
SPLITS = {"24x1": (24, 1), "4x6": (4, 6)}
REL = 1e-5
RATE = 0.25  # moe.bias_rate: a step that shows (the default 0.001 would too)
TEXT_BYTES = 1750  # 24 training samples of 65 tokens (block 64), 2 for validation


def common(text: Path, balance: str = "global", aux_coef: float | None = AUX) -> list[str]:
    """The runs' arguments; `aux_coef` None: moe.aux_coef as configured (null, the model's)."""
    return [
        *TINY,
        *MOE,
        f"moe={balance}",
        *([] if aux_coef is None else [f"moe.aux_coef={aux_coef}"]),
        f"moe.z_coef={Z}",
        f"data.path={text}",
        "data.block_size=64",  # (a transformers model's default: its longest sequence)
        "optim=sgd",
        "optim.lr=0.1",
        "scheduler=constant",
        "scheduler.warmup_steps=0",
        "train.clip_grad_norm=null",
        "train.max_steps=1",
    ]


def load_dump(run_dir: Path) -> dict[str, Any]:
    """DumpFirstStep's weights and gradients of step 1, and the buffers after it."""
    dumped = torch.load(run_dir / "step1.pt")
    dumped["buffers"] = torch.load(run_dir / "step1.pt.buffers")
    if (run_dir / "step1.pt.batches").exists():
        dumped["batches"] = torch.load(run_dir / "step1.pt.batches")
    return dumped


def hf_model(family: str) -> list[str]:
    """model=hf_<family> in place of the in-tree GPT (its `model.moe` removed), with its
    config's router_aux_loss_coef set to HF_AUX."""
    return [f"model=hf_{family}", "~model.moe", f"+model.config.router_aux_loss_coef={HF_AUX}"]


def own_coef(args: Any) -> float | None:
    """moe.aux_coef for a run of `args`: transformers' runs take their model's (None)."""
    return None if any(a.startswith("model=hf_") for a in args) else AUX


def dump(run_dir: Path, target: str = "DumpFirstStep") -> str:
    return f"+callbacks.dump={{_target_: tests.moe_support.{target}, path: {run_dir}/step1.pt}}"


class Runs:
    """The runs, each made once, on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.text = stdlib_text(root / "text.txt", TEXT_BYTES)
        self.made: dict[Any, Any] = {}

    def once(self, key: Any, make: Any) -> Any:
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    def split(self, micro: int, accum: int, *extra: str) -> list[str]:
        return [f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}", *extra]

    def one(self, name: str, balance: str = "global", *extra: str) -> tuple[dict, dict]:
        """One in-process run: (its step-1 dump, its training record)."""
        return self.once((name, balance, extra), lambda: self._one(name, balance, *extra))

    def _one(self, name: str, balance: str, *extra: str) -> tuple[dict, dict]:
        run_dir = self.root / f"{name}-{balance}-{len(self.made)}"
        micro, accum = SPLITS[name.split("-")[0]]
        args = [*common(self.text, balance, own_coef(extra)), *self.split(micro, accum, *extra)]
        dumps = dump(run_dir, "DumpFirstStepBatches")
        records = train_in_process([*args, dumps, f"hydra.run.dir={run_dir}"], run_dir)
        return load_dump(run_dir), train_records(records)[-1]

    def two_ranks(self) -> dict[str, tuple[dict, dict]]:
        """DDP and FSDP2, 2 ranks x micro 3 x accum 4, the in-tree GPT and hf_qwen3_moe,
        launched together."""
        return self.once("two ranks", self._two_ranks)

    def _two_ranks(self) -> dict[str, Any]:
        from tests.conftest import read_metrics

        layouts = {
            "ddp": ["dist.strategy=ddp"],
            "fsdp": ["dist.strategy=fsdp"],
            "ddp-bias": ["dist.strategy=ddp", "moe=bias", f"moe.bias_rate={RATE}"],
            "ddp-seq_aux": ["dist.strategy=ddp", "moe=seq_aux"],
        }
        if importlib.util.find_spec("transformers") is not None:  # the `hf` extra
            layouts["hf-ddp"] = ["dist.strategy=ddp", *hf_model("qwen3_moe")]
            layouts["hf-fsdp"] = ["dist.strategy=fsdp", *hf_model("qwen3_moe")]
        cmds, dirs = {}, {}
        for name, extra in layouts.items():
            run_dir = dirs[name] = self.root / name
            args = [*common(self.text, aux_coef=own_coef(extra)), *self.split(3, 4), *extra]
            cmds[name] = torchrun(2, [*args, dump(run_dir), f"hydra.run.dir={run_dir}"])
        refused = [*TINY, *MOE, f"data.path={self.text}", "dist.tp=2"]
        cmds["tp"] = torchrun(2, [*refused, f"hydra.run.dir={self.root / 'tp'}"])
        restless = [
            *common(self.text),
            *self.split(3, 4),
            "dist.strategy=ddp",
            "model._target_=tests.moe_support.RestlessOnRank1",
            "train.max_steps=3",
            "train.log_every=1",
            "task.check_sum=false",  # (rank 1's check would route its halves unlike the whole)
        ]
        cmds["restless"] = torchrun(2, [*restless, f"hydra.run.dir={self.root / 'restless'}"])
        procs = launch_all(cmds, timeout=300)
        out: dict[str, Any] = {name: procs.pop(name) for name in ("tp", "restless")}
        for name, proc in procs.items():
            assert proc.returncode == 0, explain(proc)
            out[name] = (load_dump(dirs[name]), train_records(read_metrics(dirs[name]))[-1])
        return out

    def hf(self, family: str, name: str) -> tuple[dict, dict]:
        """An in-process run of model=hf_<family> (`name`: a split, `-ckpt` with activation
        checkpointing)."""
        extra = ["model.activation_checkpointing=true"] if name.endswith("-ckpt") else []
        return self.one(name, "global", *hf_model(family), *extra)

    def hf_reference(self, family: str) -> tuple[dict[str, torch.Tensor], float, float]:
        """`hf_reference` on the 4x6 run's first weights (every run starts from them)."""
        return self.once(("hf reference", family), lambda: self._hf_reference(family))

    def _hf_reference(self, family: str) -> tuple[dict[str, torch.Tensor], float, float]:
        weights = self.hf(family, "4x6")[0]["weights"]
        samples = load_splits(TextCfg(path=str(self.text), block_size=64)).train
        return hf_reference(family, weights, torch.stack(list(samples)))

    def reference(self) -> tuple[dict[str, torch.Tensor], float, float, torch.Tensor]:
        """The float64 gradient of the whole batch's loss on the runs' first weights, and the
        whole batch's aux and z (from the 24x1 run's weights: every run starts from them)."""
        return self.once("reference", self._reference)

    def _reference(
        self, per_sequence: bool = False
    ) -> tuple[dict[str, torch.Tensor], float, float, torch.Tensor]:
        weights = self.one("24x1")[0]["weights"]
        samples = load_splits(TextCfg(path=str(self.text), block_size=64)).train
        batch = torch.stack(list(samples))  # (24, 65)
        return whole_batch_gradient(weights, batch, per_sequence)

    def seq_reference(self) -> tuple[dict[str, torch.Tensor], float, float, torch.Tensor]:
        """`reference` with Megatron's sequence-level aux (moe.balance=seq_aux)."""
        return self.once("seq reference", lambda: self._reference(per_sequence=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("moe"))


def tiny_moe() -> GPT:
    return GPT(
        vocab_size=256,
        block_size=64,
        n_layer=2,
        n_head=2,
        n_embd=32,
        moe=dict(experts=E, top_k=K, hidden=HIDDEN),
    )


def whole_batch_gradient(
    weights: dict[str, torch.Tensor], batch: torch.Tensor, per_sequence: bool = False
) -> tuple[dict[str, torch.Tensor], float, float, torch.Tensor]:
    """The gradient of mean CE + AUX * aux + Z * z over `batch` at once (float64), aux, z,
    and each layer's assignments per expert (L, E). `per_sequence`: aux is Megatron's
    sequence-level loss instead, each layer's E * sum_i f_i * P_i of every sequence (row) on
    its own, averaged over the sequences (moe.balance=seq_aux)."""
    model = tiny_moe().double()
    model.load_state_dict({n: w.double() for n, w in weights.items()}, strict=False)
    logits: list[torch.Tensor] = []
    for router in model.routers():
        router.gate.register_forward_hook(lambda m, a, out: logits.append(out))
    x, y = batch[:, :-1], batch[:, 1:]
    out = model(x)
    ce = F.cross_entropy(out.flatten(0, 1), y.flatten())
    aux, z, counts = [], [], []
    for lg in logits:  # (N, E) each
        probs = lg.softmax(-1)
        chosen = probs.topk(K, dim=-1).indices
        f = (
            torch.zeros(E, dtype=torch.float64).index_add_(
                0, chosen.flatten(), torch.ones(chosen.numel(), dtype=torch.float64)
            )
            / chosen.numel()
        )
        counts.append(f * chosen.numel())
        if per_sequence:
            rows, T = batch.shape[0], batch.shape[1] - 1
            f_rows = F.one_hot(chosen.view(rows, T, K), E).double().sum((1, 2)) / (T * K)
            p_rows = probs.view(rows, T, E).mean(1)  # (B, E) each
            aux.append((E * (f_rows * p_rows).sum(-1)).mean())
        else:
            aux.append(E * (f * probs.mean(0)).sum())
        z.append(torch.logsumexp(lg, -1).pow(2).mean())
    aux_loss, z_loss = torch.stack(aux).mean(), torch.stack(z).mean()
    (ce + AUX * aux_loss + Z * z_loss).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads, aux_loss.item(), z_loss.item(), torch.stack(counts).detach()


def rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: max |got - want| / max |want|."""
    assert set(got) == set(want), set(got) ^ set(want)
    return {n: ((got[n].double() - want[n]).abs().max() / want[n].abs().max()).item() for n in want}


def assert_exact(dumped: dict, runs: Runs) -> None:
    """The whole batch's gradient to 1e-5; no router holds a routing after the backward
    passes (a block recomputed in backward keeps nothing)."""
    assert dumped["held"] == [], dumped["held"]
    want = runs.reference()[0]
    errs = rel_error(dumped["grads"], want)
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= REL, f"{worst}: relative error {errs[worst]:.2e} > {REL:.0e}"


# ---------------------------------------------------------------- the model's mixture


def test_mixture_equals_every_expert_on_every_token() -> None:
    """The sorted dispatch gives what a dense reference does: every expert on every token,
    weighted by the renormalized top-k softmax (0 for experts not chosen), float64."""
    torch.manual_seed(0)
    moe = MoE(16, MoEConfig(experts=4, top_k=2, hidden=24, shared_experts=1), True, 0.0)
    moe.init_weights(2)
    moe = moe.double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    flat = x.reshape(15, 16)
    probs = moe.router.gate(flat).softmax(-1)
    top = probs.topk(2, dim=-1)
    gates = torch.zeros_like(probs).scatter(1, top.indices, top.values)
    gates = gates / gates.sum(-1, keepdim=True)
    ex = moe.experts
    every = torch.stack(
        [F.gelu(flat @ ex.fc[i] + ex.fc_bias[i]) @ ex.proj[i] + ex.proj_bias[i] for i in range(4)]
    )  # (E, N, C)
    want = (gates.T[:, :, None] * every).sum(0) + moe.shared(flat)
    torch.testing.assert_close(moe(x).reshape(15, 16), want, rtol=1e-12, atol=1e-12)


def test_flops_and_export_count_a_mixture_as_it_runs() -> None:
    """FLOPs per token count the top-k experts a token goes through, not all of them; the
    dense GPT-2 export refuses a mixture (one sentence) and takes the dense model."""
    from trainer.models.export import export_support

    moe, dense = tiny_moe(), GPT(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
    experts = sum(p.numel() for b in moe.blocks for p in b.mlp.experts.parameters())
    active = moe.num_params() - moe.pos_emb.weight.numel() - experts * (E - K) // E
    assert moe.flops_per_token(64) == 6 * active + 12 * 2 * 64 * 32
    assert export_support(dense) is None
    assert "model.moe.experts=0" in (export_support(moe) or "")


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("split", list(SPLITS))
def test_one_step_is_the_whole_batch_gradient(runs: Runs, split: str) -> None:
    """micro x accum 24x1 and 4x6: the whole batch's CE + aux + z gradient to 1e-5."""
    assert_exact(runs.one(split)[0], runs)


def test_activation_checkpointing_counts_once(runs: Runs) -> None:
    """Recomputing each block in backward routes again; nothing is counted twice, nor kept
    (a routing kept would hold the recomputed block's activations: assert_exact)."""
    dumped, record = runs.one("4x6-ckpt", "global", "model.activation_checkpointing=true")
    assert_exact(dumped, runs)
    assert record["train/moe_aux_loss"] == pytest.approx(runs.reference()[1], rel=1e-6)


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_are_the_whole_batch_gradient(runs: Runs, strategy: str) -> None:
    """2 ranks x micro 3 x accum 4, under DDP and FSDP2 (experts sharded like any weight)."""
    dumped, record = runs.two_ranks()[strategy]
    assert_exact(dumped, runs)
    assert record["train/moe_aux_loss"] == pytest.approx(runs.reference()[1], rel=1e-6)
    assert record["train/moe_routing_digest"] == routing_digest(runs.reference()[3])


def routing_digest(counts: torch.Tensor) -> int:
    """The routing digest of whole-batch assignments (L, E), by its definition (README, MoE
    records): sum(count x weight) mod the prime, the weights drawn once from seed 0."""
    prime = 16_777_213
    weights = torch.randint(1, prime, counts.shape, generator=torch.Generator().manual_seed(0))
    return (
        sum(int(c) * int(w) for c, w in zip(counts.flatten().tolist(), weights.flatten())) % prime
    )


def test_records_are_the_whole_batch_values(runs: Runs) -> None:
    """`train/moe_aux_loss` and `train/moe_z_loss` are the whole batch's, the same for every
    split to 1e-6; `train/moe_load_max` is at least 1 (the mean); `train/moe_routing_digest`
    is the digest of the whole batch's assignments, exactly."""
    _, want_aux, want_z, counts = runs.reference()
    for split in SPLITS:
        record = runs.one(split)[1]
        assert record["train/moe_aux_loss"] == pytest.approx(want_aux, rel=1e-6), split
        assert record["train/moe_z_loss"] == pytest.approx(want_z, rel=1e-6), split
        assert record["train/moe_load_max"] >= 1.0
        assert record["train/moe_routing_digest"] == routing_digest(counts), split


def test_micro_balancing_is_not_the_whole_batch_gradient(runs: Runs) -> None:
    """moe.balance=micro at 4x6 (each micro-batch's own f and P) misses the router's gradient
    by a measured amount; at 24x1 (one micro-batch) it is the global loss."""
    want = runs.reference()[0]
    errs = rel_error(runs.one("4x6", "micro")[0]["grads"], want)
    gates = {n: e for n, e in errs.items() if n.endswith("router.gate.weight")}
    print(f"moe.balance=micro at 4x6: router gate relative error {max(gates.values()):.3e}")
    assert max(gates.values()) > 1e-3, gates  # measured: see the README's MoE section
    assert_exact(runs.one("24x1", "micro")[0], runs)


def test_the_report_charts_the_expert_load(runs: Runs) -> None:
    """report.html charts `train/moe_load_max` (with the balanced line at 1) and the
    balancing losses, one step long (constant) as they are."""
    runs.one("24x1")
    (run_dir,) = runs.root.glob("24x1-global-*")
    page = (run_dir / "report.html").read_text()
    assert 'aria-label="Expert load: the most-loaded expert&#x27;s share' in page
    for metric in ("train/moe_load_max", "train/moe_aux_loss", "train/moe_z_loss"):
        assert f'data-metric="{metric}"' in page, metric
    assert ">balanced</text>" in page


def test_dropout_routes_alike_in_both_passes(runs: Runs) -> None:
    """With dropout the routing pass replays each micro-batch's random state: the backward
    pass routes every token as counted (the step checks the counts and would raise)."""
    _, record = runs.one("4x6-dropout", "global", "model.dropout=0.2")
    assert 0 < record["train/moe_aux_loss"] < E and record["train/moe_load_max"] >= 1.0


@pytest.mark.parametrize("before", ["checkpoint", "stop request"])
def test_a_backward_pass_routed_unlike_its_count_is_caught(
    runs: Runs, tmp_path: Path, before: str
) -> None:
    """A model whose routing changes between the routing pass and the backward pass (here:
    with each forward) would get the gradient of another f: the step compares each
    micro-batch's counts on the device, the gradient of one routed unlike its count is NaN, so
    the update is skipped (no host read), and the run stops at the next record or before the
    next checkpoint, whichever comes first: a checkpoint of the skipped steps would hide them
    from the resumed run. Records every 10 steps, a checkpoint after step 1 (every step, or a
    stop request's): step 1's gradient is NaN, and the run stops there with one paragraph,
    no checkpoint written."""
    from trainer.config.errors import UserError

    restless = ["model._target_=tests.moe_support.RestlessGPT", *runs.split(4, 6)]
    every = ["train.max_steps=5", "train.log_every=10"]
    if before == "checkpoint":
        every.append("checkpoint.every_steps=1")
    else:  # the stop request saves step 1 (checkpoint.every_steps=0 saves nothing else)
        every.append("+callbacks.stop={_target_: tests.moe_support.StopAfter, step: 1}")
    args = [*common(runs.text), *restless, *every, dump(tmp_path), f"hydra.run.dir={tmp_path}"]
    with pytest.raises(UserError) as err:
        train_in_process(args, tmp_path)
    message = str(err.value)
    assert message.startswith("moe.balance=global: a micro-batch routed differently"), message
    assert "\n" not in message and err.value.all_ranks
    assert not list(tmp_path.glob("checkpoints/step_*"))
    grads = torch.load(tmp_path / "step1.pt")["grads"]
    assert grads and all(bool(g.isnan().all()) for g in grads.values())


@pytest.mark.multiproc
def test_ranks_agree_on_a_routing_check_failed_on_one(runs: Runs) -> None:
    """2 DDP ranks, rank 1's backward passes routed unlike their counts, rank 0's as counted:
    at step 1's record both ranks stop with one paragraph, said by rank 0 (which routed as it
    counted), and rank 0's summary; no rank's traceback, no rank left in the record's
    collectives for the other to die (before: rank 1's RuntimeError traceback, rank 0 "stopped:
    another rank failed")."""
    proc = runs.two_ranks()["restless"]
    assert proc.returncode != 0, explain(proc)
    said = "error: moe.balance=global: a micro-batch routed differently in its backward pass"
    assert said in proc.stderr, explain(proc)
    assert "run stopped: routing not repeated: step 1/3" in proc.stdout, explain(proc)
    for crash in ("training failed", "another rank failed", "RuntimeError"):
        assert crash not in proc.stderr, explain(proc)


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's values on the host (a GPU would stall on each)."""

    READS = (
        torch.ops.aten.equal.default,
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.nonzero.default,
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_the_routing_check_reads_the_device_with_the_records(runs: Runs, tmp_path: Path) -> None:
    """The backward pass's routing is compared with the routing pass's on the device, and
    read with the records: a step of 6 micro-batches reads values on the host as often as one
    of a single micro-batch (the expert split's own counts aside, which do not dispatch), and
    a step without a record reads as often as one of moe.balance=none (SGD's non-finite
    flag: one read per step in both)."""
    reads = {}
    for micro, accum, balance, steps in (
        (24, 1, "global", 1),
        (4, 6, "global", 1),
        (4, 6, "global", 2),
        (4, 6, "none", 1),
        (4, 6, "none", 2),
    ):
        run_dir = tmp_path / f"{micro}x{accum}-{balance}-{steps}"
        split = runs.split(micro, accum, f"train.max_steps={steps}", "train.log_every=100")
        args = [*common(runs.text, balance), *split, f"hydra.run.dir={run_dir}"]
        with HostReads() as counted:
            train_in_process(args, run_dir)
        reads[accum, balance, steps] = counted.count
    assert reads[6, "global", 1] == reads[1, "global", 1], reads
    per_step = {b: reads[6, b, 2] - reads[6, b, 1] for b in ("global", "none")}
    assert per_step["global"] == per_step["none"] == 1, reads


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        ([f"+model.moe.experts={E}", f"+model.moe.top_k={E + 1}"], "model.moe.top_k", "between 1"),
        (["+model.moe.top_k=2"], "model.moe.experts", "dense"),
        ([f"+model.moe.experts={E}", "+model.moe.width=3"], "model.moe.width", "valid"),
        (["moe.balance=batch"], "moe.balance", "global, micro, bias, none"),
        ([*MOE, "step=sam"], "moe.balance", "step=accumulate"),
        ([*MOE, "moe=seq_aux", "step=sam"], "moe.balance", "seq_aux counts the whole step's"),
    ],
    ids=["top_k>experts", "zero-experts", "unknown-key", "balance", "step", "seq_aux-step"],
)
def test_bad_input_is_one_paragraph(
    runs: Runs, overrides: list[str], key: str, says: str, tmp_path: Path
) -> None:
    from trainer.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        train_in_process(
            [*TINY, f"data.path={runs.text}", *overrides, f"hydra.run.dir={tmp_path}"], tmp_path
        )
    assert err.value.key == key and says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.multiproc
def test_tensor_parallel_is_refused(runs: Runs) -> None:
    """dist.tp with a mixture: one paragraph naming the key (not built yet), and nothing
    before it: the config says it is a mixture (model.moe.experts), so it is refused before
    the model is built and laid out (before: 4 UserWarnings of torch's tensor-parallel plan,
    ~40 lines of module repr, then the refusal)."""
    proc = runs.two_ranks()["tp"]
    assert proc.returncode != 0
    assert "invalid config `dist.tp`: must be 1 with a mixture-of-experts model" in (
        proc.stderr + proc.stdout
    ), explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert "UserWarning" not in proc.stderr and "Router(" not in proc.stderr, explain(proc)


# ---------------------------------------------------------------- moe.balance=bias


def assert_bias_step(buffers: dict[str, torch.Tensor], runs: Runs) -> None:
    """Each router's bias after step 1 is RATE * sign(mean load - load), the loads being the
    whole batch's assignments at the first weights (the bias starts at 0)."""
    counts = runs.reference()[3]  # (L, E)
    for layer, c in enumerate(counts):
        want = RATE * torch.sign(c.mean() - c)
        got = buffers[f"blocks.{layer}.mlp.router.bias"].double()
        assert torch.equal(got, want), (layer, got, want, c)
    assert any(bool(b.any()) for n, b in buffers.items() if n.endswith("router.bias"))


@pytest.mark.parametrize("split", list(SPLITS))
def test_bias_moves_by_the_whole_step_counts(runs: Runs, split: str) -> None:
    """moe.balance=bias: the update after step 1 is the whole step's, at 24x1 and 4x6."""
    dumped, _ = runs.one(split, "bias", f"moe.bias_rate={RATE}")
    assert_bias_step(dumped["buffers"], runs)


@pytest.mark.multiproc
def test_bias_counts_every_rank(runs: Runs) -> None:
    """DDP 2 ranks x 3 x 4: the counts are summed over the ranks before the update."""
    assert_bias_step(runs.two_ranks()["ddp-bias"][0]["buffers"], runs)


def test_bias_resumes_exactly(runs: Runs, tmp_path: Path) -> None:
    """The biases travel in the checkpoint with the model: steps 3-4 resumed from step 2
    repeat the uninterrupted run's records bit for bit (routing depends on the biases)."""
    import shutil

    args = [
        *common(runs.text, "bias"),
        *runs.split(24, 1),
        f"moe.bias_rate={RATE}",
        "train.max_steps=4",
        "checkpoint.every_steps=2",
    ]
    whole = train_records(
        train_in_process([*args, f"hydra.run.dir={tmp_path / 'a'}"], tmp_path / "a")
    )
    step2 = "checkpoints/step_00000002"
    shutil.copytree(tmp_path / "a" / step2, tmp_path / "b" / step2)
    resumed = train_records(
        train_in_process([*args, f"hydra.run.dir={tmp_path / 'b'}"], tmp_path / "b")
    )
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("train/loss", "train/grad_norm", "train/moe_aux_loss", "train/moe_load_max"):
        assert [r[key] for r in resumed] == [r[key] for r in whole[2:]], key


# ---------------------------------------------------------------- the modes as strategies


def test_the_config_knows_every_strategy() -> None:
    """The names the config layer validates moe.balance against (engine/moe/modes.py, without
    torch) are the strategies' (engine/moe/strategies.py), in order."""
    from engine.moe.modes import BALANCE_MODES
    from engine.moe.strategies import STRATEGIES

    assert tuple(STRATEGIES) == BALANCE_MODES
    assert all(cls.name == name for name, cls in STRATEGIES.items())


def assert_seq_aux(dumped: dict, record: dict, runs: Runs) -> None:
    """The gradient of the whole batch's CE + AUX x Megatron's sequence-level aux + Z x z to
    1e-5; `train/moe_seq_aux_loss` its value and `train/moe_aux_loss` the whole batch's
    (per-layer) aux, both to 1e-6."""
    want, want_seq_aux, _, _ = runs.seq_reference()
    errs = rel_error(dumped["grads"], want)
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= REL, f"{worst}: relative error {errs[worst]:.2e} > {REL:.0e}"
    assert record["train/moe_seq_aux_loss"] == pytest.approx(want_seq_aux, rel=1e-6)
    assert record["train/moe_aux_loss"] == pytest.approx(runs.reference()[1], rel=1e-6)


@pytest.mark.parametrize("split", list(SPLITS))
def test_seq_aux_is_the_whole_batch_gradient(runs: Runs, split: str) -> None:
    """moe.balance=seq_aux (f and P of each sequence, averaged over the step's 24 sequences)
    at 24x1 and 4x6: the float64 whole batch's gradient (`assert_seq_aux`)."""
    assert_seq_aux(*runs.one(split, "seq_aux"), runs)


@pytest.mark.multiproc
def test_seq_aux_on_two_ranks_is_the_whole_batch_gradient(runs: Runs) -> None:
    """moe.balance=seq_aux on 2 DDP ranks x micro 3 x accum 4: the sequences counted over
    both ranks, the whole batch's gradient as on one process."""
    assert_seq_aux(*runs.two_ranks()["ddp-seq_aux"], runs)


# ---------------------------------------------------------------- transformers MoE models


def hf_float64(family: str, weights: dict[str, torch.Tensor]) -> Any:
    """transformers' model of `family` (configs/model/hf_<family>.yaml, router_aux_loss_coef
    HF_AUX) in float64 with the run's first weights."""
    from trainer.models.hf import causal_lm

    node = in_tree_model(f"hf_{family}")
    config = {**node["config"], "router_aux_loss_coef": HF_AUX}
    model = causal_lm(node["family"], config).double()
    model.load_state_dict({n: w.double() for n, w in weights.items()})
    return model


def mean_z(router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """z: the mean over the layers of the mean of logsumexp(router logits)^2."""
    return torch.stack([torch.logsumexp(lg, -1).pow(2).mean() for lg in router_logits]).mean()


def hf_reference(
    family: str, weights: dict[str, torch.Tensor], batch: torch.Tensor
) -> tuple[dict[str, torch.Tensor], float, float]:
    """The float64 gradient of mean CE + router_aux_loss_coef * aux + Z * z over `batch`, on
    transformers' model of `family` with the run's first weights, and the whole batch's aux
    and z. aux is transformers' own `load_balancing_loss_func` called here on the router
    logits of the whole batch at once (its model returns them: output_router_logits)."""
    import importlib

    model = hf_float64(family, weights)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    x, y = batch[:, :-1], batch[:, 1:]
    out = model(x, output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    assert isinstance(out.router_logits, tuple) and len(out.router_logits) == 2
    aux = modeling.load_balancing_loss_func(out.router_logits, E, K)
    z = mean_z(out.router_logits)
    (ce + model.config.router_aux_loss_coef * aux + Z * z).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads, aux.item(), z.item()


def hf_micro_reference(
    family: str, weights: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, ...]]
) -> dict[str, torch.Tensor]:
    """The float64 gradient of mean CE over `batches` + the mean over them of each one's
    router_aux_loss_coef * aux + Z * z, aux being what transformers' own model returns for
    that micro-batch (`aux_loss`, output_router_logits=True): its balancing under
    accumulation, averaged over the micro-batches."""
    model = hf_float64(family, weights)
    total = sum(y.numel() for _, y in batches)
    loss = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        out = model(x, output_router_logits=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="sum") / total
        balancing = model.config.router_aux_loss_coef * out.aux_loss + Z * mean_z(out.router_logits)
        loss = loss + ce + balancing / len(batches)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_hf_exact(family: str, dumped: dict, record: dict, runs: Runs) -> None:
    """The run's step-1 gradient is the whole batch's to 1e-5, from the reference's weights;
    its records are the whole batch's aux and z to 1e-6; no router holds a routing after the
    backward passes."""
    assert dumped["held"] == [], dumped["held"]
    want, want_aux, want_z = runs.hf_reference(family)
    first = runs.hf(family, "4x6")[0]["weights"]
    assert all(torch.equal(w, first[n]) for n, w in dumped["weights"].items())
    errs = rel_error(dumped["grads"], want)
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= REL, f"{worst}: relative error {errs[worst]:.2e} > {REL:.0e}"
    assert record["train/moe_aux_loss"] == pytest.approx(want_aux, rel=1e-6)
    same = runs.hf(family, "4x6")[1]["train/moe_aux_loss"]
    assert record["train/moe_aux_loss"] == pytest.approx(same, rel=1e-6)
    assert record["train/moe_z_loss"] == pytest.approx(want_z, rel=1e-6)
    assert record["train/moe_load_max"] >= 1.0


@pytest.mark.parametrize(
    ("family", "split"),
    [("qwen3_moe", "24x1"), ("qwen3_moe", "4x6"), ("qwen3_moe", "4x6-ckpt"), ("mixtral", "4x6")],
)
def test_transformers_moe_is_the_whole_batch_gradient(runs: Runs, family: str, split: str) -> None:
    """model=hf_qwen3_moe at micro x accum 24x1, 4x6 and 4x6 with activation checkpointing
    (each decoder layer recomputed in backward, its router's hook firing again), hf_mixtral at
    4x6: the gradient of the whole batch's CE + router_aux_loss_coef x transformers'
    load_balancing_loss_func to 1e-5, and `train/moe_aux_loss` transformers' value to 1e-6;
    their own auxiliary loss off, cumulus's (the same objective) from their routers' logits.
    Before (cumulus's per-layer objective, weight 0.01): the routers' gradients were off."""
    pytest.importorskip("transformers")
    dumped, record = runs.hf(family, split)
    assert_hf_exact(family, dumped, record, runs)


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_transformers_moe_on_two_ranks_is_the_whole_batch_gradient(
    runs: Runs, strategy: str
) -> None:
    """model=hf_qwen3_moe on 2 ranks x micro 3 x accum 4 under DDP and FSDP2 (each decoder
    layer sharded, its experts with it): as one process, whole batch to 1e-5, aux to 1e-6."""
    pytest.importorskip("transformers")
    dumped, record = runs.two_ranks()[f"hf-{strategy}"]
    assert_hf_exact("qwen3_moe", dumped, record, runs)


def test_transformers_micro_is_their_own_loss_per_micro_batch(runs: Runs) -> None:
    """moe.balance=micro on hf_qwen3_moe at 4x6 gives what transformers' own model gives under
    accumulation: the gradient of mean CE + the mean over the 6 micro-batches of
    router_aux_loss_coef x its own `aux_loss` (+ Z x z), to 1e-5; the split is the run's
    (its micro-batches, dumped)."""
    pytest.importorskip("transformers")
    dumped, _ = runs.one("4x6", "micro", *hf_model("qwen3_moe"))
    assert len(dumped["batches"]) == 6
    want = hf_micro_reference("qwen3_moe", dumped["weights"], dumped["batches"])
    errs = rel_error(dumped["grads"], want)
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= REL, f"{worst}: relative error {errs[worst]:.2e} > {REL:.0e}"


def test_transformers_moe_without_observable_routers_is_refused() -> None:
    """A transformers mixture whose routers are not top-k router modules returning their
    logits (DeepSeek-V3's sigmoid router) is refused in one sentence naming model.family
    (the trainer names the key from the message's first word), not trained unbalanced."""
    pytest.importorskip("transformers")
    from trainer.models.hf import causal_lm

    tiny = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    }
    with pytest.raises(ValueError, match=r"^family: deepseek_v3 is a mixture of experts"):
        causal_lm("deepseek_v3", tiny)
