"""Keep Python's full garbage collections off the display: `freeze_heap`.

CPython's generation-2 collection walks every tracked container object in the process. A device
app's heap after start-up (tokenizer vocabulary, a loaded dataset, a cloud model in the same
process) is large and long-lived: ~190,000 objects after loading chitchat-dataset, whose full
collection took 56-115 ms here (2-core AMD EPYC, CPython 3.11). Such a collection runs on whichever
thread allocated last, often the event loop that shows the tokens, and holds the GIL throughout:
in the hand-off bench one 117 ms collection arrived as a 190 ms gap on the display.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect once, then move every object still alive to the permanent generation
    (`gc.freeze`, Python 3.7+; the practice of pre-fork servers), so that later collections walk
    only what was allocated since. Call it once after start-up (models, tokenizer and data loaded),
    before the first request; objects frozen are still freed by reference counting when dropped,
    only cycles among them stay. Returns the number of objects frozen (`gc.get_freeze_count`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
