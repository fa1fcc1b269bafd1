"""Rank 0's last word on a run, for the other ranks: whether the end of the run refused it.

After the export, rank 0 alone may still refuse the run: its benchmark gate (run/scoring.py) or its Hub push
(reporting/hub.py). The other ranks wait for that outcome in the launcher's store, not in a collective (no collective
timeout bounds an evaluation or an upload), so that a refusal is one `error:` line and exit 2 on every rank, after
the export, its summary and its card are written: the export is never lost.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

OUTCOME_KEY = "sft_recipes/run_end_outcome"
# rank 0 scoring a large model on full tasks, or uploading a large export; a crashed rank 0 ends the launch
OUTCOME_WAIT = timedelta(days=1)


def rank_0_may_refuse_at_the_end(training, hub_push) -> bool:
    """Whether the run ends with a step of rank 0's that may refuse it: benchmark scoring or a Hub push."""
    return bool(training.eval_tasks) or hub_push is not None


def _launch_store():
    """The launcher's TCPStore (torchrun's agent, or the tests' warm launcher); None for one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=OUTCOME_WAIT)


def _outcome_key() -> str:
    return f"{OUTCOME_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def publish_outcome(refusal: str | None) -> None:
    """Rank 0: tell the waiting ranks whether the run is refused."""
    store = _launch_store()
    if store is not None:
        store.set(_outcome_key(), json.dumps({"refusal": refusal}))


def wait_for_outcome() -> str | None:
    """A rank other than 0: rank 0's refusal (None: the run passed), once rank 0 has ended the run."""
    store = _launch_store()
    if store is None:
        return None
    store.wait([_outcome_key()], OUTCOME_WAIT)
    return json.loads(store.get(_outcome_key()))["refusal"]
