"""The protocol's published artefacts stay true to the code: docs/protocol.schema.json is what the
generator writes now, and every golden frame in docs/golden/ encodes and decodes exactly (so any change
of the wire format, field order or defaults fails here first). Fast: no network, no model."""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import msgspec
import pytest

from relayinfer.protocol.errors import ErrorCode
from relayinfer.protocol.framing import HEADER_BYTES, FrameBuffer
from relayinfer.protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, Tensor, decode, encode
from relayinfer.protocol.requests import Role, markdown
from relayinfer.protocol.schema import SCHEMA_COMMAND, schema, schema_json

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GOLDEN = DOCS / "golden"
GOLDEN_COMMAND = ".venv/bin/python docs/make_golden.py"


def _index() -> list[dict]:
    return json.loads((GOLDEN / "index.json").read_text())["examples"]


def _from_json(data) -> Message:
    """A message from its golden JSON, through msgspec's JSON decoder (base64 strings -> bytes)."""
    return msgspec.json.decode(json.dumps(data).encode(), type=Message)


def _to_json(msg: Message):
    return json.loads(msgspec.json.encode(msg))


# -- JSON Schema ------------------------------------------------------------------------------------

def test_schema_file_is_current():
    committed = (DOCS / "protocol.schema.json").read_text(encoding="utf-8")
    assert committed == schema_json(), f"docs/protocol.schema.json is stale: run `{SCHEMA_COMMAND}` and commit it"


def test_schema_covers_every_message_type():
    s = schema()
    assert s["x-protocol-version"] == PROTOCOL_VERSION
    assert set(s["discriminator"]["mapping"]) == set(MESSAGE_TYPES)
    for tag, cls in MESSAGE_TYPES.items():
        d = s["$defs"][cls.__name__]
        assert d["properties"]["type"] == {"enum": [tag]}
        assert "type" in d["required"]
        assert set(d["properties"]) == {"type", *cls.__struct_fields__}
    codes = s["$defs"]["Error"]["properties"]["code"]["examples"]
    assert set(codes) == {c.value for c in ErrorCode} - {"connection_closed"}


def test_schema_command_writes_the_file(tmp_path):
    from relayinfer.protocol.schema import main

    out = tmp_path / "s.json"
    assert main(["--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == schema_json()


def test_golden_json_validates_against_the_schema():
    """Where jsonschema is installed: every golden message is valid under the committed schema."""
    jsonschema = pytest.importorskip("jsonschema")
    s = json.loads((DOCS / "protocol.schema.json").read_text())
    cls = jsonschema.validators.validator_for(s)
    cls.check_schema(s)
    validator = cls(s)
    for ex in _index():
        data = json.loads((GOLDEN / ex["json"]).read_text())
        for m in data if ex["framing"] == "stream" else [data]:
            validator.validate(m)
    with pytest.raises(jsonschema.ValidationError):  # the schema does constrain: a tensor dtype not allowed
        validator.validate({"type": "scores", "request_id": "r", "prefix_source": "hbm",
                            "scores": {"dtype": "float64", "shape": [1], "data": "AAAAAAAAAAA="}})


# -- golden frames ----------------------------------------------------------------------------------

def _generator():
    spec = importlib.util.spec_from_file_location("make_golden", DOCS / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_golden_files_are_current():
    files = _generator().render()
    committed = {p.name for p in GOLDEN.iterdir() if p.suffix in (".msgpack", ".frames", ".json")}
    assert committed == set(files), f"docs/golden/ differs from the generator: run `{GOLDEN_COMMAND}`"
    stale = [name for name, content in files.items() if (GOLDEN / name).read_bytes() != content]
    assert not stale, f"golden files {stale} are stale: run `{GOLDEN_COMMAND}` (and check the wire change is meant)"


def test_every_message_type_has_a_golden_frame():
    covered = {t for ex in _index() for t in ex["types"]}
    assert covered == set(MESSAGE_TYPES), f"no golden frame for {sorted(set(MESSAGE_TYPES) - covered)}"
    kinds = {ex["framing"] for ex in _index()}
    assert kinds == {"body", "stream"}


@pytest.mark.parametrize("ex", _index(), ids=lambda ex: ex["name"])
def test_golden_frame_round_trips(ex):
    raw = (GOLDEN / ex["bytes"]).read_bytes()
    data = json.loads((GOLDEN / ex["json"]).read_text())
    if ex["framing"] == "stream":
        buf = FrameBuffer()
        bodies = buf.feed(raw)
        assert buf.pending == 0
        assert HEADER_BYTES * len(bodies) + sum(map(len, bodies)) == len(raw)
        for i, body in enumerate(bodies):  # the prefix is the body length as a 4-byte big-endian integer
            start = sum(HEADER_BYTES + len(b) for b in bodies[:i])
            assert int.from_bytes(raw[start:start + HEADER_BYTES], "big") == len(body)
    else:
        bodies, data = [raw], [data]
    assert len(bodies) == len(data)
    assert [type(decode(b)).__struct_config__.tag for b in bodies] == ex["types"]
    for body, expected in zip(bodies, data):
        assert encode(_from_json(expected)) == body, "encoding the golden JSON does not give the golden bytes"
        msg = decode(body)
        assert _to_json(msg) == expected, "decoding the golden bytes does not give the golden JSON"
        # Key order on the wire: "type" first, then the fields in declaration order (defaults left out).
        assert list(msgspec.msgpack.decode(body)) == list(expected)
        assert list(expected)[0] == "type"


def test_golden_tensors_are_consistent():
    """Tensors in the JSON are {dtype, shape, data (base64)} with len(data) = prod(shape) x itemsize."""
    seen = 0
    for ex in _index():
        data = json.loads((GOLDEN / ex["json"]).read_text())
        for m in data if ex["framing"] == "stream" else [data]:
            for v in m.values():
                if isinstance(v, dict) and set(v) == {"dtype", "shape", "data"}:
                    Tensor(v["dtype"], v["shape"], base64.b64decode(v["data"]))  # validates the size
                    seen += 1
    assert seen >= 6


def test_golden_errors_show_both_levels():
    errors = {ex["name"]: json.loads((GOLDEN / ex["json"]).read_text()) for ex in _index() if ex["types"] == ["error"]}
    conn = [e for e in errors.values() if "request_id" not in e]
    req = [e for e in errors.values() if "request_id" in e]
    assert any(e.get("retry_after_ms") for e in conn) and any(e.get("retry_after_ms") for e in req)
    assert {e["code"] for e in errors.values()} <= {c.value for c in ErrorCode}


def test_protocol_doc_names_every_message_field_and_code():
    """docs/PROTOCOL.md documents every message, every field and every error code (by name)."""
    text = (DOCS / "PROTOCOL.md").read_text(encoding="utf-8")
    sections = {s.split("`", 1)[0]: s for s in text.split("\n#### `")[1:]}
    for tag, cls in MESSAGE_TYPES.items():
        assert tag in sections, f"PROTOCOL.md has no section '#### `{tag}` — {cls.__name__}'"
        section = sections[tag].split("\n#")[0]
        rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `")]
        assert rows == [f"`{f}`" for f in cls.__struct_fields__], \
            f"PROTOCOL.md's table of {tag!r} lists {rows}, the message has {list(cls.__struct_fields__)}"
    for code in ErrorCode:
        assert f"`{code.value}`" in text, f"PROTOCOL.md does not document error code {code.value!r}"
    assert f"PROTOCOL_VERSION` = {PROTOCOL_VERSION}" in text


@pytest.mark.parametrize("role", list(Role))
def test_protocol_doc_request_tables_equal_the_code(role):
    """docs/PROTOCOL.md's per-request diagram and transition table of each end are exactly what
    `protocol.requests.markdown` makes of `TRANSITIONS` (regenerate: python -m relayinfer.protocol.requests)."""
    text = (DOCS / "PROTOCOL.md").read_text(encoding="utf-8")
    start = f"<!-- requests:{role.value} (generated by python -m relayinfer.protocol.requests) -->\n"
    assert start in text, f"PROTOCOL.md has no generated block for the {role.value} side"
    block = text.split(start, 1)[1].split("<!-- /requests -->", 1)[0]
    assert block == markdown(role), f"PROTOCOL.md's {role.value} request table differs from protocol/requests.py"
