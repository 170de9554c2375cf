"""The process apart that traces an FSDP2 rank for a process that has a process group already.

A rank of FSDP2 is traced on torch's fake process group (:func:`bigbatch.memory.fsdp.fake_ranks`),
which needs a process without one. Under ``torchrun``, a script that plans after Trainer's arguments
have started the process group (``TrainingArguments`` and TRL's ``SFTConfig`` start it as they are
made) has one: :func:`bigbatch.memory.lm.plan_lm` then runs ``python -m bigbatch.memory.lm_apart
FOLDER`` with the request in ``FOLDER`` (the model's ``config.json`` and ``plan_lm``'s arguments,
what only the training process can measure resolved there; a trusted model's own code beside its
config), in a process that sees no GPU and no torchrun (a plan needs neither), and reads the plan
back: the plan ``bigbatch plan --hf`` makes on a machine without a GPU, the same on every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bigbatch.memory.lm import LMSetup, _dataclass_from, load_lm_config, plan_lm
from bigbatch.memory.plan import DoesNotFitError

__all__: list[str] = []


def main(folder: str) -> int:
    """The plan of ``folder``'s request to ``folder/plan.json`` or, where even micro-batch 1
    does not fit, what that error says to ``does_not_fit.json``."""
    where = Path(folder)
    request = json.loads((where / "request.json").read_text())
    trusted = bool(request.pop("trust_remote_code", False))  # trusted by the process that asked
    config = load_lm_config(where / "config", trust_remote_code=trusted)
    setup = _dataclass_from(LMSetup, request.pop("setup"))
    global_batch, budget = request.pop("global_batch"), request.pop("budget")
    try:
        plan = plan_lm(config, setup, global_batch, budget, **request)
    except DoesNotFitError as exc:
        said = {"message": str(exc), "floor": exc.floor.to_dict()}
        (where / "does_not_fit.json").write_text(json.dumps(said))
        return 0
    plan.save(where / "plan.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
