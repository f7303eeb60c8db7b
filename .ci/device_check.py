"""Run inside the device-only venv by .ci/device_install.sh: a split generation whose device model is
fetched from the cloud, and one under a JSON schema (structured output on the device), then check that neither torch nor relayinfer.cloud was imported.

usage: python device_check.py WS_URL HTTP_URL   (token in $RELAYINFER_TOKEN; cache in $RELAYINFER_CACHE)
Exit 0 on success, 1 with a one-line reason otherwise.
"""
import json
import os
import sys
import time

t0 = time.perf_counter()
import relayinfer.sdk  # noqa: E402
import relayinfer.sdk.cli  # noqa: E402,F401
from relayinfer.device.profiles import DeviceProfile  # noqa: E402
from relayinfer.sdk import Client  # noqa: E402

import_s = time.perf_counter() - t0
cloud_url, http_url = sys.argv[1:3]
t0 = time.perf_counter()
client = Client(cloud_url=cloud_url, cloud_http_url=http_url, token=os.environ.get("RELAYINFER_TOKEN"),
                profile=DeviceProfile("ci-slow", prefill_ms_per_token=40.0),  # the cloud answers first
                cloud_budget=4, target_tpot_ms=30.0)
load_s = time.perf_counter() - t0
res = client.complete("Write a haiku about the sea.", max_new_tokens=16)
# structured output on the device side too (llguidance, torch-free): the split answer follows the schema
schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}
js = client.complete("Name a city, as JSON.", max_new_tokens=24, json_schema=schema)
try:
    js_ok = js.finish_reason == "stop" and isinstance(json.loads(js.text).get("city"), str)
except ValueError:
    js_ok = False
leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "relayinfer.cloud")))
report = {"import_s": round(import_s, 3), "fetch_and_load_s": round(load_s, 1), "model_dir": str(client.engine.model_dir),
          "mode": res.mode, "fault": res.fault, "cloud_tokens": res.cloud_tokens, "device_tokens": res.device_tokens,
          "text": res.text, "json_schema": {"mode": js.mode, "device_tokens": js.device_tokens, "text": js.text},
          "leaked_modules": leaked}
print(json.dumps(report))
problems = []
if leaked:
    problems.append(f"imported on the device: {', '.join(leaked[:5])}")
if res.mode != "split" or res.fault is not None or res.cloud_tokens < 1 or res.device_tokens < 1:
    problems.append(f"no split generation (mode {res.mode}, fault {res.fault}, cloud {res.cloud_tokens}, "
                    f"device {res.device_tokens})")
if not js_ok or js.fault is not None:
    problems.append(f"structured output on the device failed (finish {js.finish_reason}, fault {js.fault}, "
                    f"text {js.text!r})")
if problems:
    print("device check FAILED: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)
print("device check passed", file=sys.stderr)
