// speclanes' web page (served by the gateway at /, pipeline/api/web.py): a chat that streams
// /v1/chat/completions and colours each token by how speculation decided it, beside live numbers
// from /metrics and /health. Plain JavaScript with no build step and no outside fetch.
//
// How a token's colour is found: each streamed chunk asks for `logprobs` (every token's bytes, in
// order) and the `speclanes.decided` extension (one letter per token, in the same order). The text
// of a chunk may lag its tokens (text that might start a stop string is held back), so the page
// queues the tokens with their byte lengths and gives each character of text, as it arrives, the
// letter of the token its first byte came from.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "speclanes.apiKey";
const POLL_MS = 2000;
const SPARK_POINTS = 60; // two minutes of scrapes
const RATE_WINDOW_MS = 10000; // the pipeline's tokens/s: output tokens over the last ten seconds
const STEP_COLUMNS = 28; // the step strip keeps the latest forward passes
const MEANING = Object.fromEntries(
  (document.body.dataset.decided || "").split(";").filter(Boolean).map((pair) => pair.split(":")),
);

const state = {
  history: [], // the conversation sent with each turn: {role, content}
  running: null, // the AbortController of the answer being streamed
  scrapes: [], // {time, output}: the output token counter at each recent /metrics scrape
  rates: [], // output tokens per second between scrapes, one point each
};

// --- the API key --------------------------------------------------------------------------

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function authHeaders(json) {
  const headers = json ? { "Content-Type": "application/json" } : {};
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function wantKey(message) {
  const input = $("api-key");
  input.classList.add("wanted");
  $("key-hint").classList.add("wanted");
  $("key-hint").textContent = message;
}

function setUpKey() {
  const input = $("api-key");
  input.value = apiKey();
  $("key-form").addEventListener("submit", (event) => event.preventDefault());
  input.addEventListener("input", () => {
    const key = input.value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
    input.classList.remove("wanted");
    $("key-hint").classList.remove("wanted");
    $("key-hint").textContent = "Kept in this browser (localStorage) and sent as a Bearer token with every call.";
    poll();
  });
}

// A response that is not 2xx, as an Error carrying the server's own message (OpenAI's error shape).
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: the status line says enough */ }
  if (response.status === 401) wantKey("This gateway needs an API key: paste it here.");
  return new Error(message);
}

// --- painting tokens ------------------------------------------------------------------------

// Turns the stream's tokens (bytes and letters) and its text into coloured spans, and keeps the
// counts the side panel shows.
class Painter {
  constructor(textElement, stepsElement) {
    this.text = textElement;
    this.steps = stepsElement;
    this.queue = []; // tokens whose text has not fully arrived: {left: bytes, letter, title}
    this.current = null; // the token the last span belongs to
    this.span = null;
    this.letters = "";
    this.column = null; // the open column of the step strip
    this.stepCount = 0;
    this.steps.replaceChildren();
  }

  addTokens(entries, letters) {
    for (let i = 0; i < letters.length; i++) {
      const letter = letters[i];
      const entry = entries && entries[i];
      const bytes = entry ? entry.bytes.length : 0;
      if (bytes > 0) {
        const title = `${MEANING[letter] || letter} · ${JSON.stringify(entry.token)} · logprob ${entry.logprob.toFixed(3)}`;
        this.queue.push({ left: bytes, letter, title });
      }
      this.letters += letter;
      this.addToStrip(letter);
    }
  }

  addToStrip(letter) {
    if (this.column === null) {
      this.column = document.createElement("div");
      this.column.className = "step";
      this.steps.append(this.column);
      this.stepCount += 1;
      while (this.steps.childElementCount > STEP_COLUMNS) this.steps.firstElementChild.remove();
    }
    const cell = document.createElement("i");
    cell.className = letter;
    this.column.append(cell);
    if (letter !== "a") this.column = null; // a correction, a bonus or a plain token ends its step
  }

  addText(text) {
    for (const character of text) {
      const token = this.queue[0] || null;
      if (token !== this.current || this.span === null) {
        this.span = document.createElement("span");
        this.span.className = token ? `t ${token.letter}` : "t";
        if (token) this.span.title = token.title;
        this.text.append(this.span);
        this.current = token;
      }
      this.span.textContent += character;
      this.consume(utf8Length(character.codePointAt(0)));
    }
  }

  consume(bytes) {
    while (bytes > 0 && this.queue.length > 0) {
      const token = this.queue[0];
      const taken = Math.min(bytes, token.left);
      token.left -= taken;
      bytes -= taken;
      if (token.left === 0) this.queue.shift();
    }
  }

  count(letter) {
    return this.letters.split(letter).length - 1;
  }
}

function utf8Length(codePoint) {
  return codePoint < 0x80 ? 1 : codePoint < 0x800 ? 2 : codePoint < 0x10000 ? 3 : 4;
}

// --- one answer -----------------------------------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function requestOptions() {
  const body = {
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 256),
    temperature: Math.min(2, Math.max(0, parseFloat($("temperature").value) || 0)),
  };
  const speculation = {};
  if ($("drafter").value) speculation.drafter = $("drafter").value;
  const k = $("k").value;
  if (k) speculation.k = k === "auto" ? "auto" : parseInt(k, 10);
  if (Object.keys(speculation).length) body.speculation = speculation;
  return body;
}

function showLive(painter, started, firstAt) {
  const tokens = painter.letters.length;
  const seconds = (performance.now() - started) / 1000;
  $("live-tokens").textContent = tokens;
  $("live-steps").textContent = painter.stepCount;
  $("live-per-step").textContent = painter.stepCount ? (tokens / painter.stepCount).toFixed(2) : "–";
  const drafted = painter.count("a");
  $("live-acceptance").textContent = tokens ? `${drafted} of ${tokens} (${Math.round((100 * drafted) / tokens)}%)` : "–";
  $("live-ttft").textContent = firstAt ? `${Math.round(firstAt - started)} ms` : "–";
  $("live-tps").textContent = tokens && seconds > 0 ? (tokens / seconds).toFixed(1) : "–";
}

// Streams one answer into `message`; resolves with {text, stats, finish}.
async function stream(body, painter, onUpdate, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: authHeaders(true), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const answer = { text: "", stats: null, finish: null };
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return answer;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return answer;
        take(JSON.parse(data), answer, painter);
        onUpdate();
      }
    }
  }
}

function take(chunk, answer, painter) {
  if (chunk.error) throw new Error(chunk.error.message);
  if (chunk.speculation) answer.stats = chunk.speculation;
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;
  const letters = (chunk.speclanes && chunk.speclanes.decided) || "";
  painter.addTokens(choice.logprobs && choice.logprobs.content, letters);
  const text = choice.delta && choice.delta.content;
  if (text) {
    painter.addText(text);
    answer.text += text;
  }
  if (choice.finish_reason) answer.finish = choice.finish_reason;
}

function summary(meta, answer, painter, request) {
  const stats = answer.stats;
  meta.replaceChildren();
  const add = (label, value) => {
    const item = element("span", "", `${label} `);
    item.append(element("b", "", value));
    meta.append(item);
  };
  add("tokens", String(painter.letters.length));
  if (stats) {
    $("live-drafter").textContent = stats.drafter || "none";
    add("drafts accepted", `${Math.round(100 * stats.acceptance_rate)}% (${stats.accepted} of ${stats.drafted})`);
    add("speed", `${stats.tokens_per_second.toFixed(1)} tok/s`);
    add("drafter", stats.drafter || "none");
    add("seed", String(stats.seed));
  }
  if (answer.finish) add("finish", answer.finish);
  if (stats && answer.finish) {
    const check = element("button", "quiet check", "Check exactness");
    check.type = "button";
    const verdict = element("span", "verdict");
    check.addEventListener("click", () => checkExactness(check, verdict, answer, request));
    meta.append(verdict, check);
  }
}

// Decodes the same turn again with no drafter (same seed, same settings) and compares the text:
// speculation must change the speed only.
async function checkExactness(button, verdict, answer, request) {
  button.disabled = true;
  verdict.className = "verdict";
  verdict.textContent = "decoding again without drafts…";
  const body = { ...request, stream: false, seed: answer.stats.seed, speculation: { drafter: "none" } };
  delete body.logprobs;
  delete body.speclanes;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders(true), body: JSON.stringify(body),
    });
    if (!response.ok) throw await failure(response);
    const plain = await response.json();
    const same = plain.choices[0].message.content === answer.text;
    const speedup = answer.stats.tokens_per_second / plain.speculation.tokens_per_second;
    verdict.className = `verdict ${same ? "same" : "differs"}`;
    verdict.textContent = same
      ? `✓ identical to plain decoding · plain ${plain.speculation.tokens_per_second.toFixed(1)} tok/s (${speedup.toFixed(2)}× with speculation)`
      : "✗ differs from plain decoding";
  } catch (error) {
    verdict.className = "verdict differs";
    verdict.textContent = error.message;
    button.disabled = false;
  }
}

async function send(prompt) {
  if (state.running || !prompt.trim()) return;
  $("intro")?.remove();
  const transcript = $("transcript");
  transcript.append(element("div", "msg user", prompt));
  const message = element("article", "msg assistant streaming");
  const text = element("div", "text");
  const meta = element("footer", "meta", "…");
  message.append(text, meta);
  transcript.append(message);
  transcript.scrollTop = transcript.scrollHeight;

  const request = {
    ...requestOptions(), messages: [...state.history, { role: "user", content: prompt }],
    stream: true, logprobs: true, speclanes: { decided: true },
  };
  const painter = new Painter(text, $("steps"));
  const started = performance.now();
  let firstAt = 0;
  const onUpdate = () => {
    if (!firstAt && painter.letters.length) firstAt = performance.now();
    showLive(painter, started, firstAt);
    transcript.scrollTop = transcript.scrollHeight;
  };
  setRunning(new AbortController());
  try {
    const answer = await stream(request, painter, onUpdate, state.running.signal);
    state.history.push({ role: "user", content: prompt }, { role: "assistant", content: answer.text });
    message.dataset.decided = painter.letters;
    message.dataset.finish = answer.finish || "";
    summary(meta, answer, painter, request);
    message.classList.add("done");
  } catch (error) {
    message.classList.add("failed");
    meta.replaceChildren(element("span", "error", error.name === "AbortError" ? "stopped" : error.message));
  } finally {
    message.classList.remove("streaming");
    setRunning(null);
  }
}

function setRunning(controller) {
  state.running = controller;
  const button = $("send");
  button.textContent = controller ? "Stop" : "Send";
  button.classList.toggle("stop", Boolean(controller));
}

// --- the live panel -------------------------------------------------------------------------

// The Prometheus text format's samples: [{name, labels, value}] (comments and blank lines skipped).
function parseMetrics(text) {
  const samples = [];
  const sample = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /(\w+)="((?:[^"\\]|\\.)*)"/g;
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = sample.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(label)) labels[key] = value;
    samples.push({ name: match[1], labels, value: parseFloat(match[3]) });
  }
  return samples;
}

function total(samples, name, where = () => true) {
  return samples.filter((s) => s.name === name && where(s.labels)).reduce((sum, s) => sum + s.value, 0);
}

function showMetrics(samples) {
  const now = performance.now();
  const output = total(samples, "speclanes_tokens_usage_total", (l) => l.gen_ai_token_type === "output");
  const previous = state.scrapes[state.scrapes.length - 1];
  if (previous) {
    const rate = Math.max(0, output - previous.output) / ((now - previous.time) / 1000);
    state.rates = [...state.rates, rate].slice(-SPARK_POINTS);
    drawSpark($("spark"), state.rates);
  }
  state.scrapes = [...state.scrapes.filter((s) => now - s.time <= RATE_WINDOW_MS), { time: now, output }];
  const oldest = state.scrapes[0];
  if (oldest.time < now) {
    $("pipe-tps").textContent = (Math.max(0, output - oldest.output) / ((now - oldest.time) / 1000)).toFixed(1);
  }
  const drafted = total(samples, "speclanes_tokens_drafted_total");
  const accepted = total(samples, "speclanes_tokens_accepted_total");
  $("pipe-acceptance").textContent = drafted ? `${Math.round((100 * accepted) / drafted)}%` : "–";
  const active = total(samples, "speclanes_requests_active");
  const queued = total(samples, "speclanes_requests_queued");
  $("pipe-requests").textContent = `${active} / ${queued}`;
  $("pipe-tokens").textContent = output.toLocaleString();
  showLanes(samples);
}

function showLanes(samples) {
  const lanes = $("lanes");
  lanes.replaceChildren();
  for (const up of samples.filter((s) => s.name === "speclanes_lane_up")) {
    const name = up.labels.speclanes_lane;
    const restarts = total(samples, "speclanes_lane_restarts_total", (l) => l.speclanes_lane === name);
    const item = element("li", up.value >= 1 ? "up" : "down", name);
    item.title = `${name}: ${up.value >= 1 ? "up" : "not up"}, restarted ${restarts} times`;
    if (restarts) item.append(element("small", "", `↻${restarts}`));
    lanes.append(item);
  }
}

function drawSpark(canvas, points) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const context = canvas.getContext("2d");
  context.scale(ratio, ratio);
  context.clearRect(0, 0, width, height);
  context.fillStyle = "#e3e6eb"; // the baseline: zero tokens per second
  context.fillRect(0, height - 3, width, 1);
  if (points.length < 2) return;
  const top = Math.max(1, ...points);
  const x = (i) => (i / (SPARK_POINTS - 1)) * width + (width - ((points.length - 1) / (SPARK_POINTS - 1)) * width);
  const y = (v) => height - 3 - (v / top) * (height - 8);
  context.beginPath();
  points.forEach((v, i) => (i ? context.lineTo(x(i), y(v)) : context.moveTo(x(i), y(v))));
  context.strokeStyle = "#3b5bdb";
  context.lineWidth = 1.5;
  context.stroke();
  context.lineTo(x(points.length - 1), height);
  context.lineTo(x(0), height);
  context.fillStyle = "rgba(59, 91, 219, 0.10)";
  context.fill();
}

async function pollHealth() {
  const health = $("health");
  try {
    const response = await fetch("/health", { cache: "no-store" });
    const body = await response.json();
    health.dataset.state = body.status === "ok" ? "ok" : "bad";
    health.textContent = body.status === "ok" ? "serving" : "unavailable";
    health.title = body.reason || "every lane is up";
    if (body.model) $("model").textContent = body.model;
  } catch (error) {
    health.dataset.state = "bad";
    health.textContent = "no answer";
    health.title = String(error);
  }
}

async function pollMetrics() {
  try {
    const response = await fetch("/metrics", { headers: authHeaders(false), cache: "no-store" });
    if (!response.ok) throw await failure(response);
    showMetrics(parseMetrics(await response.text()));
    document.body.dataset.metrics = "ok";
  } catch (error) {
    $("lanes").replaceChildren(element("li", "down", error.message));
    document.body.dataset.metrics = "failed";
  }
}

async function loadVersion() {
  const response = await fetch("/version", { headers: authHeaders(false) });
  if (!response.ok) return;
  const version = await response.json();
  $("pipe-backend").textContent = version.backend || version.configured_backend || "–";
  $("pipe-backend").title = `speclanes ${version.version}`;
}

function poll() {
  pollHealth();
  pollMetrics();
  loadVersion();
}

// --- start ----------------------------------------------------------------------------------

function setUpComposer() {
  const drafter = $("drafter");
  for (const name of (document.body.dataset.drafters || "").split(" ").filter(Boolean)) {
    drafter.append(new Option(name, name));
  }
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.running) {
      state.running.abort();
      return;
    }
    const text = prompt.value;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  for (const example of document.querySelectorAll("#examples button")) {
    example.addEventListener("click", () => send(example.textContent));
  }
  $("new-chat").addEventListener("click", () => {
    if (state.running) state.running.abort();
    state.history = [];
    $("transcript").replaceChildren();
    prompt.focus();
  });
}

setUpKey();
setUpComposer();
poll();
setInterval(() => {
  if (!document.hidden) {
    pollHealth();
    pollMetrics();
  }
}, POLL_MS);
