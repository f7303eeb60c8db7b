"""`sdk.freeze_heap`: start-up's objects leave the generations a full collection walks."""

import json
import subprocess
import sys

SCRIPT = """
import gc, json
from relayinfer.sdk.datasets import chitchat_conversations
from relayinfer.sdk import freeze_heap
n_conv = chitchat_conversations()  # loads and keeps the real dataset (7,168 conversations)
before = len(gc.get_objects())
frozen = freeze_heap()
after = len(gc.get_objects())
garbage = [[] for _ in range(1000)]  # allocated after the freeze: walked as usual
print(json.dumps({"conversations": n_conv, "before": before, "frozen": frozen, "after": after,
                  "after_new": len(gc.get_objects())}))
"""


def test_freeze_heap_moves_a_loaded_dataset_out_of_the_collected_generations():
    # a process of its own: freezing pytest's heap would keep the other tests' cycles alive
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    assert r["conversations"] == 7168
    assert r["before"] > 100_000  # what a full collection walked before (measured ~190,000)
    assert r["frozen"] >= r["before"] - 1_000  # all of it frozen, but what the collection freed
    assert r["after"] < 1_000  # walked by a full collection now
    assert r["after_new"] - r["after"] >= 1_000  # objects made after the freeze are tracked as before
