"""`python -m trainer.certify [training overrides] [certify.layouts=[...]]`: does *your*
configuration train the same under every layout you may launch it with?

cumulus promises that a run's trajectory depends on the global batch, not on how it is cut
into micro-batches and spread over ranks. This command checks it on the user's own model,
task and data: it runs the real trainer (`python -m trainer.train`, or `torchrun
--standalone --nproc_per_node=N -m trainer.train`) for `certify.steps` steps under each
layout, with the same overrides plus the layout's own and the same global batch, each in a
run directory under `certify.dir` (as many at once as the machine's GPUs, or CPU cores,
hold), and compares every run's `train/loss` and
`train/grad_norm` with the one-process reference (`trainer.compare`); a mixture of experts
over the steps before its routing first differs from the reference's
(`train/moe_routing_digest`): each step is exact for the same weights, but rounding grows
until a token's k-th and (k+1)-th experts trade places, and the runs part from there (the
table says from which step). It prints a table,
writes it with the overlaid curves into `certify.html` (and `certify.json`), and exits 0
when every layout agrees within the tolerance, 1 when one does not (named), 2 on bad input,
when the reference itself fails, or when no layout could be compared.

Layouts (N: number of processes, 2 if left out of the name):

| name | what |
| --- | --- |
| `single` | the reference: 1 process, micro-batch m (the configured one; G with `auto`) |
| `accum` | 1 process, the same batch in more micro-batches (the largest divisor of G below m) |
| `auto` | 1 process, `train.micro_batch_size=auto` |
| `ddpN`, `fsdpN` | N ranks, `dist.strategy=ddp` / `fsdp` (FSDP2) |
| `ppN` | N pipeline stages (`dist.pp=N`): the model must declare `pipeline_stage` |
| `tpN`, `tpspN` | tensor parallelism (`dist.tp=N`), with sequence parallelism for `tpsp` |
| `cpN` | context parallelism (`dist.cp=N`) |
| `epN` | N ranks, `dist.ep=N`: each holds 1/N of a mixture's experts, tokens sent all-to-all |

Without `certify.layouts`: accum, ddp2, fsdp2, pp2, tp2, tpsp2, cp2 and auto, and ep2 for a
model with mixture-of-experts layers that `dist.ep` splits (the in-tree GPT's `model.moe`).

A layout this machine cannot host (more processes than GPUs, or than CPU cores without a
GPU), or one the trainer refuses for this configuration (a model that declares no pipeline
stages, no tensor-parallel plan...), is skipped with a line saying why.
"""

from __future__ import annotations

import os
import sys

from trainer.checks.certify import EXIT_BAD_INPUT, certify, parse
from trainer.config.errors import UserError
from trainer.version import answer_version


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    answer_version(argv, "trainer.certify")
    if any(a in ("-h", "--help") for a in argv):
        try:
            print(__doc__, flush=True)
        except BrokenPipeError:  # `| head`: the reader left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        settings, overrides = parse(argv)
        return certify(settings, overrides)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
