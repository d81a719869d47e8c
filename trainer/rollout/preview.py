"""`python -m trainer.preview` for task=grpo: the first prompts of the training split, each
with its G completions as the initial policy samples them, their rewards (weighted, and each
function's) and their advantages, then one JSON line over them. Builds the run's model (one
process, no layout) and its rollouts as training does; writes nothing but the token cache."""

from __future__ import annotations

from typing import Any

from engine.distributed import DistInfo
from engine.rl.rollouts import weighted_rewards
from trainer.config.schema import Config
from trainer.data.loader import SeededSamples, sample_seed
from trainer.rollout.generate import generate_rollouts
from trainer.rollout.task import GRPORunTask


def rollout_preview(cfg: Config, samples: int) -> tuple[str, dict[str, Any]]:
    """The text of the first `samples` prompts' groups and the numbers over them."""
    from trainer.run.assemble import assemble

    built = assemble(cfg, DistInfo())
    task, data = built.task, built.data
    assert isinstance(task, GRPORunTask) and task.rollouts is not None
    r = task.rollouts
    n = max(1, min(samples, len(data.train)))
    # Each prompt's stream as the loader draws it at position p of step 1's global batch.
    keys = [(i, sample_seed(cfg.seed, 0, i)) for i in range(n)]
    batch = data.collate_fn(SeededSamples(data.train).__getitems__(keys))
    out = generate_rollouts(
        built.model, r.engine, [batch], r.train_row, r.decode, r.rewards, r.plan, cfg.seed, 0
    )
    totals = weighted_rewards(out.groups, r.rewards.weights)  # (P, G)
    lines = []
    for k, group in enumerate(out.groups):
        prompt = data.decode([int(t) for t in group.prompt]) if data.decode else ""
        lines.append(f"--- prompt {k} (row {int(batch['index'][k])}) ---\n{prompt}")
        for i, text in enumerate(out.texts[k]):
            scores = ", ".join(
                f"{name} {float(group.rewards[i, f]):g}" for f, name in enumerate(r.rewards.names)
            )
            lines.append(
                f"  [{i}] reward {float(totals[k, i]):.3f} ({scores}) | advantage "
                f"{float(out.advantages.values[k, i]):+.3f} | {len(text)} chars"
                f"{' (truncated)' if bool(group.truncated[i]) else ''}: {text!r}"
            )
    stats = {
        "prompts": n,
        "completions": int(totals.numel()),
        "reward": float(totals.nan_to_num(0.0).mean()),
        "zero_std_groups": int(out.advantages.zero_std.sum()),
        "completion_len": float(sum(float(g.lengths.double().mean()) for g in out.groups) / n),
    }
    return "\n".join(lines), stats
