"""One data-parallel rank of a pretend trainer, as a process: fetch a plan, "train" it, commit.

``python plane_trainer.py URL RANK RECORD_FILE [PAUSE_STEP]`` loops over steps until the plane
says the mixture is exhausted. Before committing a step it appends what it trained -- one JSON line
per
step: step, rank, the dp the plan was made for, and every row's (source, shard, key, role,
sp_index, item_kind, item_index) -- so the test can check that the samples of the epoch were
trained exactly once. After each commit it prints ``committed STEP`` (the test's progress
signal). With ``PAUSE_STEP`` it stops once, holding the plan of that step trained but not
committed: it prints ``paused STEP`` and waits for a line on stdin (so a test can crash the
plane at a known point).

Faults it rides through, as a real trainer would:
- the plane restarting (kill -9): PlaneClient retries with backoff; a commit whose reply was
  lost arrives twice and the second is refused as already committed (Reason.COMMITTED or
  RANK_COMMITTED), which means done;
- a resize (the plane restarted with fewer ranks): the plans of uncommitted steps changed, so a
  commit of an old plan is refused (Reason.REPLANNED), and a fetched plan for a different
  number of ranks than the last one means the same. Either way the rank goes back to the
  plane's next step to train and fetches again;
- running ahead of slower ranks (Reason.TOO_FAR_AHEAD): backs off and asks again (flow
  control).
"""

from __future__ import annotations

import json
import sys
import time

from omniscale.dataplane.actions import Reason
from omniscale.dataplane.client import PlaneClient, PlaneError
from omniscale.plan import fingerprint, plan_metadata

COLUMNS = ("source", "shard", "key", "role", "sp_index", "item_kind", "item_index")


def train(url: str, rank: int, record_path: str, pause: int | None = None) -> None:
    client = PlaneClient(url, timeout=10, retry_for=60)
    step, dp, backoff = 0, None, 0.01
    with open(record_path, "a") as record:
        while True:
            try:
                table = client.get_plan(step, rank)
            except PlaneError as e:
                if e.reason == Reason.EXHAUSTED:
                    return
                if e.reason == Reason.TOO_FAR_AHEAD:  # slower ranks hold the plane back: wait
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)
                    continue
                raise
            backoff = 0.01
            meta = plan_metadata(table)
            if dp is not None and meta["dp"] != dp:  # resized: what we committed was re-planned
                dp, step = meta["dp"], client.status()["next_step"]
                continue
            dp = meta["dp"]
            rows = [[row[c] for c in COLUMNS] for row in table.select(COLUMNS).to_pylist()]
            record.write(json.dumps({"step": step, "rank": rank, "dp": dp, "rows": rows}) + "\n")
            record.flush()
            if step == pause:
                print(f"paused {step}", flush=True)
                sys.stdin.readline()
                pause = None
            try:
                client.commit(step, rank, plan_fp=fingerprint(table))
            except PlaneError as e:
                if e.reason == Reason.REPLANNED:
                    dp, step = None, client.status()["next_step"]
                    continue
                if e.reason not in (Reason.COMMITTED, Reason.RANK_COMMITTED):
                    raise
            print(f"committed {step}", flush=True)
            step += 1


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]), sys.argv[3],
          int(sys.argv[4]) if len(sys.argv) > 4 else None)
