// Drive the demo page in headless Chromium (puppeteer-core, no browser download): load it, wait for
// the device model, send one prompt through the chat box, print the answer as one JSON line.
//   node web/drive.mjs --url http://127.0.0.1:PORT/web/?mode=split --prompt TEXT [--screenshot FILE]
//     [--chromium /usr/bin/chromium] [--timeout-ms 90000] [--bench TOKENS]
import puppeteer from "puppeteer-core";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const a = {};
for (let i = 2; i < process.argv.length; i += 2) a[process.argv[i].replace(/^--/, "")] = process.argv[i + 1];
const timeout = Number(a["timeout-ms"] ?? 90000);
const deadline = Date.now() + timeout;
const left = () => Math.max(1000, deadline - Date.now());
const profile = fs.mkdtempSync(path.join(os.tmpdir(), "relayinfer-chromium-"));
const console_ = [];
const browser = await puppeteer.launch({
  executablePath: a.chromium ?? "/usr/bin/chromium", headless: true, userDataDir: profile, protocolTimeout: timeout,
  args: ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run", "--disable-extensions"],
});
let code = 0;
try {
  const page = await browser.newPage();
  page.on("console", (m) => console_.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => console_.push(`pageerror: ${e.message}`));
  await page.setViewport({ width: 1000, height: 760 });
  await page.goto(a.url, { waitUntil: "load", timeout: left() });
  const t0 = Date.now();
  await page.waitForFunction(() => globalThis.relayinfer && (globalThis.relayinfer.ready || globalThis.relayinfer.error), { timeout: left(), polling: 100 });
  const boot = await page.evaluate(() => ({ error: relayinfer.error, threads: relayinfer.threads, load_ms: relayinfer.loadMs, fingerprint: relayinfer.fingerprint, onnx: relayinfer.onnx, ws_url: relayinfer.wsUrl, status: document.getElementById("status").textContent }));
  boot.ready_ms = Date.now() - t0;
  if (boot.error) throw new Error(`the page failed: ${boot.error}`);
  await page.type("#prompt", a.prompt);
  await page.click("#send");
  await page.waitForFunction(() => relayinfer.results.length > 0 || relayinfer.error, { timeout: left(), polling: 100 });
  const out = await page.evaluate(() => ({ error: relayinfer.error, result: relayinfer.last, token_ids_attr: JSON.parse(document.getElementById("log").dataset.tokenIds ?? "null"),
    spans: { cloud: document.querySelectorAll("#log span.cloud").length, device: document.querySelectorAll("#log span.device").length } }));
  if (a.screenshot) await page.screenshot({ path: a.screenshot, fullPage: true });
  if (a.bench) out.bench = await page.evaluate((n) => relayinfer.bench(n, 3), Number(a.bench));
  process.stdout.write(JSON.stringify({ boot, ...out, console: console_.slice(-20) }) + "\n");
} catch (e) {
  process.stdout.write(JSON.stringify({ error: String(e), console: console_.slice(-40) }) + "\n");
  code = 1;
} finally {
  await Promise.race([browser.close(), new Promise((r) => setTimeout(r, 5000))]);
  try { browser.process()?.kill("SIGKILL"); } catch { /* gone */ }
  fs.rmSync(profile, { recursive: true, force: true });
}
process.exit(code);
