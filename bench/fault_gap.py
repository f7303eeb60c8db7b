"""Fault gap: the longest wait between shown tokens when the cloud process dies (`kill -9`) or
freezes (`SIGSTOP`) at each phase of a split request.

Set-up: a real `relayinfer cloud serve` subprocess (torch, 1 thread) on two free loopback ports
with a random token, started afresh for every `kill -9` (the `SIGSTOP` trials share one, resumed
with SIGCONT after each). The device is the real `OnnxEngine` (1 thread) behind `sdk.Client`
(`PacedEngine`: every call lasts at least the profile's time for it) with the settings algorithm
(`cloud_budget='auto'`, the calibrated fit); greedy, one ~400-token chitchat prompt. Two profiles,
because on a shared 2-core machine the cloud's TTFT is seconds: the phases of the cloud-to-the-end
plan use an idle profile (50 ms a prefill token, 20 ms a decoded token: prefill per token >= the
50 ms display interval, so the settings plan the cloud to the end whatever the cloud's speed; the
prompt takes 20 s), the split phases the phone profile (`device/profiles/phone.json`).

Phases (the fault is injected from inside the request, on state, not on time):

* before-first-token (idle profile): right after the Generate went out;
* device-idle (idle profile): the settings planned the cloud to the end; fault when `--idle-at`
  cloud tokens have arrived;
* catching-up (phone profile, a split plan): fault on the first cloud token that arrives after
  the device's prompt prefill ended and before its hand-off;
* after-handoff (phone profile): fault on the first device token.

Per trial: `gap_after_fault_ms`, the longest gap between consecutive shown tokens among those shown
after the fault (the freeze the user sees), `max_gap_ms` over the whole answer, the fault the
result names, whether the answer equals the device-only greedy answer, and `prefill_left_at_fault`
(tokens the device still had to prefill; absent before the background prefill existed).

Run: `python -m bench.fault_gap --label after` (writes bench/results/fault-gap.json, merging the
labels it already holds, and fault-gap.md). Every wait is bounded (cloud start 300 s, request 180 s).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("before-first-token", "device-idle", "catching-up", "after-handoff")
SIGNALS = {"kill-9": signal.SIGKILL, "sigstop": signal.SIGSTOP}
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cloud:
    """A `relayinfer cloud serve` subprocess on free loopback ports; stops by itself after
    `duration_s` and is killed (after SIGCONT) on exit."""

    def __init__(self, token: str, duration_s: float = 900.0):
        self.token, self.duration_s = token, duration_s

    def __enter__(self) -> "Cloud":
        exe = Path(sys.executable).with_name("relayinfer")
        self.ws, self.http = free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fault-gap-cloud-", suffix=".log", delete=False)
        env = {**os.environ, "RELAYINFER_TOKEN": self.token, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([str(exe), "cloud", "serve", "--host", "127.0.0.1", "--port", str(self.ws),
                                      "--http-port", str(self.http), "--threads", "1", "--kv-cache-mb", "64",
                                      "--duration-s", str(self.duration_s)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        t = time.monotonic()
        while time.monotonic() - t < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the cloud exited ({self.proc.returncode}): {Path(self.log.name).read_text()[-2000:]}")
            if any(ln.startswith("cloud service:") for ln in Path(self.log.name).read_text().splitlines()):
                return self
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the cloud was not up within {START_TIMEOUT_S:.0f} s")

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.ws}"

    def signal(self, sig) -> None:
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        self.signal(signal.SIGCONT)
        self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        os.unlink(self.log.name)


class Trigger:
    """Injects the fault once, from inside the request, when its phase is reached: wraps
    `split._Run.connect` (the Generate went out) and `split._Run.append` (a token arrived)."""

    def __init__(self, split_mod):
        self.split, self.phase, self.fire, self.fired_at_ms = split_mod, None, None, None
        self._connect, self._append = split_mod._Run.connect, split_mod._Run.append
        trig = self

        async def connect(run):
            await trig._connect(run)
            if trig.phase == "before-first-token" and run.cloud.channel is not None:
                trig.now(run)

        def append(run, tok, source, reason=None):
            trig._append(run, tok, source, reason)
            cloud = sum(1 for s in run.answer.source if s == "cloud")
            if trig.phase == "device-idle" and source == "cloud" and cloud == trig.idle_at:
                trig.now(run)
            elif (trig.phase == "catching-up" and source == "cloud" and run.dev.prompt_ms > 0
                  and run.phases.handoff is None):
                trig.now(run)
            elif trig.phase == "after-handoff" and source == "device":
                trig.now(run)
        split_mod._Run.connect, split_mod._Run.append = connect, append

    def arm(self, phase: str, fire, idle_at: int) -> None:
        self.phase, self.fire, self.fired_at_ms, self.idle_at = phase, fire, None, idle_at

    def now(self, run) -> None:
        if self.fire is not None:
            self.fire()
            self.fire, self.fired_at_ms = None, run.now()
            self.plan = run.plan.planned


def trial(client, ids, ref, max_new: int, cloud: Cloud, trig: Trigger, phase: str, sig, idle_at: int) -> dict:
    trig.arm(phase, lambda: cloud.signal(sig), idle_at)
    events, t0 = [], time.monotonic()
    stream = client.generate(ids, max_new_tokens=max_new)
    for ev in stream:
        events.append(ev.shown_at_ms)
        if time.monotonic() - t0 > REQUEST_TIMEOUT_S:
            raise RuntimeError(f"{phase}: no end within {REQUEST_TIMEOUT_S:.0f} s")
    r = stream.result
    fault_at = trig.fired_at_ms
    gaps = [(b - a, b) for a, b in zip(events, events[1:])]
    after = [g for g, shown in gaps if fault_at is not None and shown >= fault_at]
    if fault_at is not None and events and events[0] >= fault_at:  # nothing shown before: the wait for token 0
        after.append(events[0] - fault_at)
    return {"phase": phase, "fault_injected_at_ms": None if fault_at is None else round(fault_at, 1),
            "gap_after_fault_ms": round(max(after), 1) if after else None,
            "max_gap_ms": round(max((g for g, _ in gaps), default=0.0), 1),
            "plan": r.plan, "plan_reason": r.plan_reason, "mode": r.mode, "fault": r.fault, "handoff_index": r.handoff_index,
            "cloud_tokens": r.cloud_tokens, "device_tokens": r.device_tokens, "tokens": len(r.token_ids),
            "prompt_tokens": len(ids), "equals_device_only": r.token_ids == ref,
            "prefill_left_at_fault": getattr(r, "prefill_left_at_fault", None), "wall_s": round(time.monotonic() - t0, 1)}


IDLE_PHASES = ("before-first-token", "device-idle")


def run(label: str, out: Path, prompt_tokens: int, max_new: int, idle_at: int, signals: list[str],
        phases: list[str], idle_profile: tuple[float, float] = (50.0, 20.0)) -> dict:
    from relayinfer.device import split as split_mod
    from relayinfer.device.profiles import DeviceProfile, load_profile
    from relayinfer.device.onnx_engine import OnnxEngine
    from relayinfer.protocol.model.decoding import SamplingParams
    from relayinfer.sdk import Client
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    engine = OnnxEngine.for_model(threads=1)
    engine.warmup()
    tok = engine.tokenizer()
    ids, warm = chitchat_prompts_by_length(tok, [prompt_tokens, 64])
    ref = engine.generate(ids, SamplingParams(max_new_tokens=max_new)).token_ids
    trig, token, rows, est = Trigger(split_mod), secrets.token_hex(16), [], None
    profiles = {"idle": DeviceProfile("idle", prefill_ms_per_token=idle_profile[0], decode_ms_per_token=idle_profile[1]),
                "phone": load_profile("phone")}

    def clients_for(cloud):
        nonlocal est
        cs = {k: Client(cloud_url=cloud.url, token=token, engine=engine, profile=p, cloud_budget="auto")
              for k, p in profiles.items()}
        if est is None:  # one estimate of the cloud for every client, learnt from every request
            cs["idle"].complete(warm, max_new_tokens=4, mode="cloud-only")  # warm the cloud; learn its speed
            est = cs["idle"].cloud
        else:
            cs["idle"].complete(warm, max_new_tokens=4, mode="cloud-only")
        for c in cs.values():
            c.cloud = est
        return cs

    def one(cloud, clients, phase, sname):
        client = clients["idle" if phase in IDLE_PHASES else "phone"]
        row = {"label": label, "signal": sname, **trial(client, ids, ref, max_new, cloud, trig, phase,
                                                          SIGNALS[sname], idle_at)}
        print(json.dumps(row), flush=True)
        rows.append(row)

    if "sigstop" in signals:
        with Cloud(token) as cloud:
            clients = clients_for(cloud)
            for phase in phases:
                try:
                    one(cloud, clients, phase, "sigstop")
                finally:
                    cloud.signal(signal.SIGCONT)
                time.sleep(1.0)  # the resumed cloud notices the closed connection and frees the request
    if "kill-9" in signals:
        for phase in phases:
            with Cloud(token) as cloud:
                one(cloud, clients_for(cloud), phase, "kill-9")
    cmd = "python -m bench.fault_gap " + " ".join(sys.argv[1:])
    old = json.loads(out.read_text()) if out.is_file() else {}
    runs = {k: v for k, v in old.get("runs", {}).items() if k != label}
    runs[label] = {"command": cmd, "commit": _git_commit(), "rows": rows,
                   "settings": {"prompt_tokens": len(ids), "max_new_tokens": max_new, "idle_at_cloud_tokens": idle_at,
                                "idle_profile_ms": {"prefill_per_token": idle_profile[0], "decode_per_token": idle_profile[1]},
                                "split_profile": "phone"}}
    res = {"what": __doc__.split("\n\n")[0], "machine": f"{os.cpu_count()} CPUs, shared", "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    return res


def markdown(res: dict) -> str:
    labels = list(res["runs"])
    lines = ["# Fault gap: longest wait between shown tokens after the cloud dies (ms)", "",
             "Idle profile (cloud-to-the-end phases) / phone profile (split phases), `cloud_budget='auto'`, real `relayinfer cloud serve` subprocess; "
             "`bench/fault_gap.py`. Commands:", ""]
    lines += [f"* {k}: `{v['command']}` (commit {v['commit']})" for k, v in res["runs"].items()]
    lines += ["", "| signal | phase | " + " | ".join(f"{k}: gap ms (fault, left to prefill)" for k in labels) + " |",
              "|---|---|" + "---|" * len(labels)]
    keys = []
    for v in res["runs"].values():
        keys += [(r["signal"], r["phase"]) for r in v["rows"] if (r["signal"], r["phase"]) not in keys]
    for sg, ph in keys:
        cells = []
        for k in labels:
            r = next((r for r in res["runs"][k]["rows"] if (r["signal"], r["phase"]) == (sg, ph)), None)
            cells.append("-" if r is None else
                         f"{r['gap_after_fault_ms']} ({r['fault']}, {r['prefill_left_at_fault']})"
                         f"{'' if r['equals_device_only'] else ' WRONG ANSWER'}")
        lines.append(f"| {sg} | {ph} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="name of this run in the results (e.g. before, after)")
    p.add_argument("--out", type=Path, default=Path("bench/results/fault-gap.json"))
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--idle-at", type=int, default=64, help="device-idle phase: fault after this many cloud tokens")
    p.add_argument("--idle-profile", default="50,20", help="prefill ms per token, decode ms per token")
    p.add_argument("--signals", default="kill-9,sigstop")
    p.add_argument("--phases", default=",".join(PHASES))
    a = p.parse_args(argv)
    run(a.label, a.out, a.prompt_tokens, a.max_new_tokens, a.idle_at, a.signals.split(","), a.phases.split(","),
        tuple(float(x) for x in a.idle_profile.split(",")))


if __name__ == "__main__":
    main()
