"""`bench/hostile.py`: the input generator is deterministic and covers every request field, and
`--quick` against the two servers that start fastest (relay, patho; no language model) sends its
inputs, checks the servers and writes the JSON and Markdown reports. Zero findings is not asserted
here: the driver reports what the servers do, it does not judge the run."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import msgspec
import pytest

from relayinfer.protocol.errors import ErrorCode, ProtocolError
from relayinfer.protocol.messages import decode

ROOT = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("hostile_bench", ROOT / "bench" / "hostile.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_generator_is_deterministic_and_covers_every_field():
    h = _driver()
    a, b = h.Generator("cloud", seed=3), h.Generator("cloud", seed=3)
    for i in (0, 1, 17, a.grid - 1, a.grid + 5, a.grid + 999):
        assert json.dumps(a.case(i).repro(), default=str) == json.dumps(b.case(i).repro(), default=str)
    assert json.dumps(a.case(5).repro(), default=str) != json.dumps(h.Generator("cloud", 4).case(5).repro(), default=str)
    fields = {m[0] for m in a.makers}
    for name in ("messages", "prompt", "stop", "logit_bias", "seed", "temperature", "top_p", "top_k", "n", "max_tokens",
                 "logprobs", "top_logprobs", "stream", "stream_options", "presence_penalty", "frequency_penalty",
                 "response_format", "tools", "<body>", "<frame>", "<hello>"):
        assert name in fields, name
    for name in ("request_id", "prompt_ids", "max_new_tokens", "cloud_budget", "refine", "stop_ids", "kv_from"):
        assert f"generate.{name}" in fields
    assert {"stop.handoff_index", "cancel.request_id", "extend_budget.cloud_budget", "kv_transfer.kv"} <= fields
    relay = {m[0] for m in h.Generator("relay", 0).makers}
    assert {f"rank.{f}" for f in ("request_id", "user_id", "item_ids", "timestamps", "candidate_ids", "request_ts")} <= relay
    patho = {m[0] for m in h.Generator("patho", 0).makers}
    assert {f"tile_batch.{f}" for f in ("coords", "tiles", "jpeg", "features", "device_scores", "last")} <= patho


def test_hostile_values_reach_the_wire_as_built():
    h = _driver()
    frame = h._frame({"type": "cancel", "request_id": h._SURR_MARK})
    assert b"\xed\xa0\x80" in frame  # a lone surrogate's CESU-8 bytes: invalid UTF-8
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.code is ErrorCode.BAD_FRAME
    body = h._set({"a": [1, {"b": 2}]}, ["a", 1, "b"], h.MISSING)
    assert body == {"a": [1, {}]}
    assert msgspec.msgpack.decode(h._frame({"x": 2**64 - 1, "y": -2**63})) == {"x": 2**64 - 1, "y": -2**63}
    assert h.abbreviate({"s": "A" * 10**6, "l": [7] * 10**5}) == {"s": "<'A' * 1000000>", "l": "<[7] * 100000>"}


@pytest.mark.timeout(900)
def test_quick_run_against_relay_and_patho_writes_the_report(tmp_path):
    h = _driver()
    out = tmp_path / "hostile.json"
    # bounded by count (24 inputs per server); the wall bound (240 s per server) is only a backstop,
    # so that a slow machine sends the same inputs as a fast one (at load ~4 patho needs ~75 s for 24:
    # a 60 s backstop cut it to 19)
    rc = h.main(["--quick", "--servers", "relay", "patho", "--inputs", "48", "--max-wall-s", "480",
                 "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["command"].startswith("python -m bench.hostile --quick") and rep["code"].get("commit")
    assert rep["date"] and set(rep["servers"]) == {"relay", "patho"}
    for kind, s in rep["servers"].items():
        assert s["started"], (kind, s.get("error"))
        assert s["inputs_sent"] == 24, (kind, s["inputs_sent"])
        assert sum(s["status_histogram"].values()) >= s["inputs_sent"]
        assert s["fields_covered"] >= 10
        assert s["rss_mib"]["warm"] > 0 and s["rss_mib"]["end"] > 0
        assert s["end_probe"]["alive"] is True
        for f in s["findings"]:
            assert f["kind"] and f["severity"] in ("high", "medium", "low") and f["count"] >= 1
            assert f["input"] is None or isinstance(f["input"]["index"], int)
    assert rep["total_inputs"] == sum(s["inputs_sent"] for s in rep["servers"].values())
    md = out.with_suffix(".md").read_text()
    assert "| relay |" in md and "| patho |" in md
