"""`python -m trainer.preview [training overrides] [preview.samples=N]`: what data=chat (or
data=preference: pairs, each its prompt and both answers' scored tokens, with a JSON line of
pair counts) trains on, before training (trainer/data/preview.py).

Builds the run's data as training would (tokenizing it once, or reusing the token cache),
prints the first N training samples (3 by default) as text with the supervised tokens between
`{+` and `+}` and a line where a packed row moves from one conversation to the next, then one
JSON line over the whole training split: `{"rows", "samples", "supervised_tokens", "tokens",
"padding_fraction", "dropped"}`. Builds no model and writes nothing but the token cache.

With task=grpo (data=prompts): the first N prompts, each with its task.num_generations
completions as the initial policy samples them, their rewards and advantages, then
`{"prompts", "completions", "reward", "zero_std_groups", "completion_len"}`
(trainer/rollout/preview.py: builds the model).
"""

from __future__ import annotations

import sys

from trainer.config.errors import ConfigError, UserError
from trainer.run.compatibility import GRPO_TASK
from trainer.version import answer_version

USAGE = "usage: python -m trainer.preview [training overrides] [preview.samples=N]"


def parse(argv: list[str]) -> tuple[int, list[str]]:
    """`preview.samples=N` and the training overrides."""
    samples, rest = 3, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("preview."):
            if key != "preview.samples" or not value.isdigit():
                raise ConfigError(
                    key, f"trainer.preview takes preview.samples=N (N >= 0), got {arg!r}"
                )
            samples = int(value)
        else:
            rest.append(arg)
    return samples, rest


def main(argv: list[str] | None = None) -> None:
    from trainer.config.cli import compose_train, exit_with, to_config
    from trainer.data.preview import json_line, preview
    from trainer.run.assemble import build_data

    argv = sys.argv[1:] if argv is None else argv
    answer_version(argv, "trainer.preview")
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\n" + USAGE, flush=True)
        return
    try:
        samples, overrides = parse(argv)
        cfg, _ = to_config(compose_train(overrides))
        if cfg.task.get("_target_") == GRPO_TASK:  # prompts: the policy's completions
            from trainer.rollout.preview import rollout_preview

            text, stats = rollout_preview(cfg, samples)
        else:
            data, _ = build_data(cfg.data)
            text, stats = preview(data, cfg.seed, samples, cfg.data["_target_"])
    except (UserError, ConfigError) as exc:
        exit_with(exc)
        return
    print(text, flush=True)
    print(json_line(stats), flush=True)


if __name__ == "__main__":
    main()
