// The strata-jax web UI: a chat over /v1/chat/completions (streamed) and a live monitor over
// /v1/monitor/events. Plain browser JavaScript, no build step and nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "strata-jax-ui";
const DEFAULTS = { system: "", temperature: 0.7, top_p: 0.95, max_tokens: 512, api_key: "" };
const SPARK_POINTS = 60;  // 30 s of events at the page's 0.5 s interval

// -- settings (localStorage) ---------------------------------------------------------------------------
function loadSettings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(STORE) || "{}") };
  } catch (e) {
    return { ...DEFAULTS };
  }
}
const settings = loadSettings();

function bindSettings() {
  for (const key of Object.keys(DEFAULTS)) {
    const el = $(key);
    el.value = settings[key];
    el.addEventListener("change", () => {
      settings[key] = el.type === "number" ? (el.value === "" ? DEFAULTS[key] : Number(el.value)) : el.value;
      localStorage.setItem(STORE, JSON.stringify(settings));
      if (key === "api_key") restartMonitor();
    });
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (settings.api_key) h["Authorization"] = "Bearer " + settings.api_key;
  return h;
}

// -- a small markdown renderer: the text is HTML-escaped first, then only our own tags are added --------
function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function inline(s) {  // s is escaped; code spans are left as they are, the rest gets bold and italics
  return s.split(/(`[^`\n]+`)/g).map((part, i) => i % 2
    ? "<code>" + part.slice(1, -1) + "</code>"
    : part.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\s][^*\n]*)\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_([^_\s][^_\n]*)_(?!\w)/g, "$1<em>$2</em>")).join("");
}

const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;

function renderMarkdown(src) {
  const lines = escapeHtml(src).split("\n");
  const out = [];
  let para = [];
  const flush = () => {
    if (para.length) out.push("<p>" + inline(para.join("\n")).replace(/\n/g, "<br>") + "</p>");
    para = [];
  };
  for (let i = 0; i < lines.length;) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (fence) {  // an unclosed fence (still streaming) runs to the end
      flush();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const closed = i < lines.length;
      i++;
      // a fence just opened while streaming has no code yet: no empty box until its first line arrives
      if (!closed && !code.join("").trim()) continue;
      const cls = fence[1] ? ` class="language-${fence[1]}"` : "";
      out.push(`<div class="code"><button type="button" class="copy" title="Copy the code">Copy</button>` +
               `<pre><code${cls}>${code.join("\n")}</code></pre></div>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      flush();
      const n = heading[1].length;
      out.push(`<h${n}>${inline(heading[2])}</h${n}>`);
      i++;
      continue;
    }
    const item = line.match(LIST_ITEM);
    if (item) {
      flush();
      const ordered = /\d/.test(item[1]);
      const items = [];
      for (let m; i < lines.length && (m = lines[i].match(LIST_ITEM)) && /\d/.test(m[1]) === ordered; i++) {
        items.push("<li>" + inline(m[2]) + "</li>");
      }
      out.push((ordered ? "<ol>" : "<ul>") + items.join("") + (ordered ? "</ol>" : "</ul>"));
      continue;
    }
    if (!line.trim()) flush(); else para.push(line);
    i++;
  }
  flush();
  return out.join("");
}

// -- server-sent events over fetch (EventSource cannot send the API key header) -----------------------------
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || `HTTP ${r.status}`;
  } catch (e) {
    return `HTTP ${r.status}`;
  }
}

// -- chat ----------------------------------------------------------------------------------------------
let history = [];
let controller = null;

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.dataset.role = role;
  const body = document.createElement("div");
  body.className = "body";
  if (role === "user") body.textContent = text; else body.innerHTML = renderMarkdown(text);
  const meta = document.createElement("div");
  meta.className = "meta";
  el.append(body, meta);
  $("messages").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant", "");
  const bodyEl = el.querySelector(".body");
  el.classList.add("streaming");
  const messages = settings.system.trim() ? [{ role: "system", content: settings.system }, ...history] : [...history];
  const request = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: Number(settings.temperature), top_p: Number(settings.top_p), max_tokens: Number(settings.max_tokens),
  };
  controller = new AbortController();
  setBusy(true);
  let reply = "", finish = null, timings = null, usage = null, scheduled = false;
  const paint = () => {
    scheduled = false;
    bodyEl.innerHTML = renderMarkdown(reply);
    el.scrollIntoView({ block: "end" });
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const data of sseData(r.body)) {
      if (data === "[DONE]") break;
      const ev = JSON.parse(data);
      if (ev.error) throw new Error(ev.error.message);
      const choice = ev.choices && ev.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        if (!scheduled) { scheduled = true; requestAnimationFrame(paint); }
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (ev.timings) timings = ev.timings;
      if (ev.usage) usage = ev.usage;
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else {
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = e.message;
      el.append(err);
      finish = "error";
    }
  } finally {
    controller = null;
    setBusy(false);
    paint();
    el.classList.remove("streaming");
    el.dataset.finish = finish || "";
    if (reply) history.push({ role: "assistant", content: reply });
    else if (finish === "error") history.pop();  // the failed turn is not part of the conversation
    const parts = [finish === "stopped" ? "stopped" : finish && `finish: ${finish}`];
    if (usage) parts.push(`${usage.completion_tokens} tokens`);
    if (timings && timings.predicted_per_second) parts.push(`${timings.predicted_per_second.toFixed(1)} tok/s`);
    el.querySelector(".meta").textContent = parts.filter(Boolean).join(" \u00b7 ");
  }
}

function stop() {
  if (controller) controller.abort();
}

// the clipboard API needs a secure context (http://127.0.0.1 is one, another host over http is not):
// there the older selection + execCommand("copy") still works
async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = document.createElement("textarea");
  area.value = text;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("the browser refused to copy");
}

async function copyCode(button) {
  const code = button.parentElement.querySelector("code").textContent;
  try {
    await copyText(code);
    button.textContent = "Copied";
  } catch (e) {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// -- monitor ---------------------------------------------------------------------------------------------
const spark = [];
let monitorController = null;

function fmtRate(x, digits = 1) {
  return x === null || x === undefined ? "-" : x.toFixed(digits);
}

function fmtPct(x) {
  return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%";
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [u, s] of units) if (n >= s) return (n / s).toFixed(n >= 10 * s ? 0 : 1) + " " + u;
  return n + " B";
}

function setPill(el, text, cls) {
  el.textContent = text;
  el.className = "pill" + (cls ? " " + cls : "");
}

function drawSpark() {
  const c = $("m-spark");
  const dpr = window.devicePixelRatio || 1;
  const w = c.clientWidth, h = c.clientHeight;
  if (c.width !== Math.round(w * dpr)) { c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); }
  const g = c.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  if (spark.length < 2) return;
  const max = Math.max(1, ...spark);
  const x = (i) => (i / (SPARK_POINTS - 1)) * w;
  const y = (v) => h - 2 - (v / max) * (h - 4);
  const off = SPARK_POINTS - spark.length;
  const color = getComputedStyle(document.documentElement).getPropertyValue("--accent").trim();
  g.beginPath();
  spark.forEach((v, i) => (i ? g.lineTo(x(off + i), y(v)) : g.moveTo(x(off + i), y(v))));
  g.strokeStyle = color;
  g.lineWidth = 1.5;
  g.stroke();
  g.lineTo(x(off + spark.length - 1), h);
  g.lineTo(x(off), h);
  g.closePath();
  g.globalAlpha = 0.18;
  g.fillStyle = color;
  g.fill();
  g.globalAlpha = 1;
}

function updateMonitor(ev) {
  $("model").textContent = ev.model || "-";
  setPill($("status"), ev.status, ev.status === "ok" ? "ok" : ev.status === "loading" ? "" : "bad");
  const tps = ev.decode_tokens_per_second;
  $("m-decode").textContent = fmtRate(tps);
  if (tps !== null && tps !== undefined) {
    spark.push(tps);
    if (spark.length > SPARK_POINTS) spark.shift();
    drawSpark();
  }
  const last = ev.last_request || {};
  $("m-prompt-last").textContent = fmtRate(last.prompt_per_second);
  $("m-decode-last").textContent = fmtRate(last.predicted_per_second);
  $("m-generated").textContent = ev.tokens_generated ?? 0;
  $("m-finished").textContent = ev.requests_finished ?? 0;
  $("m-queue").textContent = ev.queue_depth ?? "-";
  $("m-processing").textContent = ev.processing ?? "-";
  $("m-parallel").textContent = ev.parallel ?? "-";
  if (ev.ctx) {
    $("m-kv-usage").textContent = fmtPct(ev.kv_usage);
    $("m-kv-bar").style.width = (100 * Math.min(ev.kv_usage, 1)).toFixed(1) + "%";
    $("m-kv").textContent = `${ev.kv_tokens} of ${ev.ctx} tokens`;
  }
  const conv = ev.conversation;  // --conversation-cache-mib / -dir: restores, and each tier's fill
  $("m-conv-card").hidden = !conv;
  if (conv) {
    $("m-conv-hits").textContent = `${(conv.ram_hits || 0) + (conv.disk_hits || 0)} restored`;
    $("m-conv").textContent = ["ram", "disk"].filter((t) => (t + "_entries") in conv)
      .map((t) => `${t.toUpperCase()} ${conv[t + "_entries"]}: ${fmtBytes(conv[t + "_bytes"])} of ${fmtBytes(conv[t + "_capacity"])}`)
      .join(" · ");
  }
  const mem = ev.memory;
  if (mem && mem.total) {
    for (const use of ["experts", "kv", "dense"]) {
      $("m-mem-" + use).textContent = fmtBytes(mem[use]);
      $("m-mem-bar").querySelector("." + use).style.width = (100 * mem[use] / mem.total).toFixed(2) + "%";
    }
    $("m-mem-total").textContent = fmtBytes(mem.total);
  }
  const ex = ev.expert;
  $("m-dense").hidden = ex !== null;
  $("m-expert-figures").hidden = ex === null;
  if (ex === undefined) return;  // still loading
  if (ex === null) {
    $("m-expert-kind").textContent = "";
    return;
  }
  const cards = ex.cards || [];  // --devices: the cache split over several cards
  $("m-expert-kind").textContent = (ex.resident ? `all ${ex.total_experts} experts resident`
    : `${ex.expert_slots} slots for ${ex.total_experts} experts, ${ex.policy}`)
    + cards.map((c) => ` · ${c.device}: ${c.slots} slots, ${c.misses} misses`).join("");
  $("m-hit").textContent = ex.lookups ? fmtPct(ex.hit_rate) : "-";
  $("m-hit-recent").textContent = fmtPct(ex.hit_rate_recent);
  $("m-h2d").textContent = ex.h2d_MB_per_s === null ? "-" : fmtRate(ex.h2d_MB_per_s) + " MB/s";
  $("m-lookups").textContent = ex.lookups ?? 0;
  $("m-misses").textContent = ex.misses ?? 0;
  $("m-bytes").textContent = fmtBytes(ex.bytes_h2d || 0);
  const rates = ex.per_layer_hit_rate || [], lookups = ex.per_layer_lookups || [];
  const strip = $("m-layers");
  while (strip.children.length < rates.length) strip.append(document.createElement("span"));
  while (strip.children.length > rates.length) strip.lastChild.remove();
  rates.forEach((r, i) => {
    const bar = strip.children[i];
    const seen = lookups[i] > 0;
    bar.className = seen ? "" : "none";
    bar.style.height = seen ? Math.max(2, 100 * r).toFixed(1) + "%" : "2px";
    bar.title = seen ? `MoE layer ${i}: ${fmtPct(r)} of ${lookups[i]} lookups` : `MoE layer ${i}: no lookups yet`;
  });
}

async function monitorLoop() {
  for (;;) {
    monitorController = new AbortController();
    try {
      const r = await fetch("/v1/monitor/events?interval=0.5", { headers: headers(), signal: monitorController.signal });
      if (r.status === 401) {
        setPill($("m-live"), "API key needed: see Settings", "bad");
      } else if (!r.ok) {
        setPill($("m-live"), await errorText(r), "bad");
      } else {
        setPill($("m-live"), "live", "ok");
        for await (const data of sseData(r.body)) updateMonitor(JSON.parse(data));
        setPill($("m-live"), "ended");
      }
    } catch (e) {
      if (e.name !== "AbortError") setPill($("m-live"), "offline", "bad");
    }
    await new Promise((done) => setTimeout(done, monitorController.signal.aborted ? 0 : 2000));
  }
}

function restartMonitor() {
  if (monitorController) monitorController.abort();
}

// -- start -------------------------------------------------------------------------------------------------
function start() {
  bindSettings();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => { history = []; $("messages").replaceChildren($("hint")); });
  // one listener for every code block's Copy button, present and future (a streamed answer is re-rendered)
  $("messages").addEventListener("click", (e) => {
    const button = e.target.closest("button.copy");
    if (button) copyCode(button);
  });
  fetch("/health").then((r) => r.json()).then((h) => {
    $("model").textContent = h.model || "-";
    $("model").title = h.model || "";  // the header cuts a long name short
    if (h.api_key && !settings.api_key) $("settings").open = true;
  }).catch(() => {});
  monitorLoop();
}

window.strataUI = { renderMarkdown, escapeHtml, addMessage };
start();
