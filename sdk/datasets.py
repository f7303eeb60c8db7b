"""Real prompts: human conversations from the `chitchat-dataset` wheel (MIT), read by path.

Each conversation is a list of turns; a turn is one or more messages of one sender. The first sender
becomes the `user`, the other the `assistant`, and the conversation is cut after a user turn so the
model answers it.
"""
from __future__ import annotations

import importlib.metadata
import json
import random
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def _chitchat() -> list:
    try:
        dist = importlib.metadata.distribution("chitchat-dataset")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("chitchat-dataset is not installed (pip install --no-deps chitchat-dataset)") from None
    path = next(Path(dist.locate_file(f)) for f in dist.files if str(f).endswith("dataset.json"))
    return list(json.loads(path.read_text()).values())


def chitchat_messages(conv: dict, max_turns: int | None = None) -> list[dict]:
    """Chat messages ({role, content}) of one raw conversation, ending on a user turn."""
    turns = conv["messages"]
    if not turns:
        return []
    first = turns[0][0]["sender"]
    msgs = [{"role": "user" if t[0]["sender"] == first else "assistant",
             "content": " ".join(m["text"].strip() for m in t)} for t in turns]
    if max_turns:
        msgs = msgs[:max_turns]
    while msgs and msgs[-1]["role"] != "user":
        msgs.pop()
    return msgs


def chitchat_conversations() -> int:
    """Number of conversations in the dataset (7,168 in chitchat-dataset 0.9.0)."""
    return len(_chitchat())


def chitchat_prompt(index: int | None = None, max_turns: int = 6, seed: int = 0) -> list[dict]:
    """One conversation as chat messages (the `index`-th, or a seeded random one)."""
    convs = _chitchat()
    i = random.Random(seed).randrange(len(convs)) if index is None else index % len(convs)
    for k in range(len(convs)):
        msgs = chitchat_messages(convs[(i + k) % len(convs)], max_turns)
        if msgs:
            return msgs
    raise ValueError("no usable conversation")


def chitchat_prompts_by_length(tokenizer, lengths: list[int], per_length: int = 1, seed: int = 0) -> list[list[int]]:
    """Chat-templated prompt ids close to each target length (tokens): for each target, whole
    conversations are taken turn by turn until the templated prompt reaches the target."""
    convs, rng, out = _chitchat(), random.Random(seed), []
    for target in lengths:
        for _ in range(per_length):
            best = None
            for _ in range(200):
                msgs = chitchat_messages(convs[rng.randrange(len(convs))])
                for t in range(len(msgs), 0, -1):
                    cut = msgs[:t]
                    if cut[-1]["role"] != "user":
                        continue
                    ids = tokenizer.encode_chat(cut)
                    if len(ids) <= target * 1.1 and (best is None or abs(len(ids) - target) < abs(len(best) - target)):
                        best = ids
                    if len(ids) <= target:
                        break
                if best is not None and abs(len(best) - target) <= 0.1 * target:
                    break
            out.append(best)
    return out
