// gemma-ane's chat page: talks only to this origin's /v1 endpoints. Model and user text become DOM text nodes
// through a small Markdown subset (render below), never HTML; conversations live in this browser's localStorage,
// an API key only in sessionStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = { conversations: "gemma-ane.conversations", current: "gemma-ane.current", settings: "gemma-ane.settings",
  presets: "gemma-ane.presets", key: "gemma-ane.key" };
const SAMPLING = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed"];
const AUDIO_FORMATS = { "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/mpeg": "mp3",
  "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac", "audio/ogg": "ogg" };

const state = {
  model: null,          // /v1/models' card: id, context_length, capabilities
  conversations: [],    // [{id, title, messages: [...]}]
  current: null,        // the open conversation's id
  pending: [],          // attachments for the next message: {kind, name, url, format}
  abort: null,          // the running request's AbortController
};

// -- storage ------------------------------------------------------------------------------------------------------

function load(key, fallback) {
  try { const v = JSON.parse(localStorage.getItem(key)); return v === null ? fallback : v; } catch { return fallback; }
}

const KEPT_ATTACHMENT = 1 << 20;  // characters of an attachment's data URL kept in localStorage (its quota is ~5 MB)

function save() {
  // an attachment past KEPT_ATTACHMENT is kept by name only: it was sent, but a reload cannot show or resend it
  const keep = (key, value) => (key === "url" && typeof value === "string" && value.length > KEPT_ATTACHMENT ? undefined : value);
  try {
    localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations, keep));
    localStorage.setItem(STORE.current, JSON.stringify(state.current));
  } catch (e) {
    notice(`could not keep the conversations in this browser (${e.name}): export them to keep them`);
  }
}

function conversation() {
  let c = state.conversations.find((c) => c.id === state.current);
  if (!c) {
    c = { id: crypto.randomUUID(), title: "New chat", messages: [] };
    state.conversations.unshift(c);
    state.current = c.id;
  }
  return c;
}

// -- settings and presets -----------------------------------------------------------------------------------------

function settings() {
  const s = { system: $("system").value, thinking: $("thinking").checked };
  for (const name of SAMPLING) s[name] = $(name).value;
  return s;
}

function applySettings(s) {
  $("system").value = s.system || "";
  $("thinking").checked = !!s.thinking;
  for (const name of SAMPLING) $(name).value = s[name] ?? "";
}

function storeSettings() { localStorage.setItem(STORE.settings, JSON.stringify(settings())); }

function renderPresets() {
  const presets = load(STORE.presets, {});
  const select = $("presets");
  select.replaceChildren(new Option("Presets…", ""));
  for (const name of Object.keys(presets).sort()) select.add(new Option(name, name));
}

// -- Markdown subset, as DOM: paragraphs, emphasis, inline code, code blocks, lists, links with their address -------

function inline(parent, text) {
  const pattern = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)|(\[[^\]]+\]\((https?:\/\/[^\s)]+)\))/g;
  let last = 0, m;
  while ((m = pattern.exec(text)) !== null) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    const token = m[0];
    let node;
    if (m[1]) { node = document.createElement("code"); node.textContent = token.slice(1, -1); }
    else if (m[2]) { node = document.createElement("strong"); node.textContent = token.slice(2, -2); }
    else if (m[3]) { node = document.createElement("em"); node.textContent = token.slice(1, -1); }
    else {
      node = document.createElement("a");
      node.href = m[5];
      node.rel = "noopener noreferrer";
      node.target = "_blank";
      node.textContent = `${token.slice(1, token.indexOf("]"))} (${m[5]})`;
    }
    parent.append(node);
    last = m.index + token.length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function render(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.startsWith("```")) {
      const code = [];
      for (i++; i < lines.length && !lines[i].startsWith("```"); i++) code.push(lines[i]);
      i++;
      const pre = document.createElement("pre"), c = document.createElement("code");
      c.textContent = code.join("\n");
      pre.append(c);
      out.append(pre);
    } else if (/^\s*([-*]|\d+\.)\s+/.test(line)) {
      const ordered = /^\s*\d+\./.test(line);
      const list = document.createElement(ordered ? "ol" : "ul");
      for (; i < lines.length && /^\s*([-*]|\d+\.)\s+/.test(lines[i]); i++) {
        const li = document.createElement("li");
        inline(li, lines[i].replace(/^\s*([-*]|\d+\.)\s+/, ""));
        list.append(li);
      }
      out.append(list);
    } else if (line.trim() === "") {
      i++;
    } else {
      const p = document.createElement("p"), para = [];
      for (; i < lines.length && lines[i].trim() !== "" && !lines[i].startsWith("```")
        && !/^\s*([-*]|\d+\.)\s+/.test(lines[i]); i++) para.push(lines[i]);
      para.forEach((l, k) => { if (k) p.append(document.createElement("br")); inline(p, l); });
      out.append(p);
    }
  }
  return out;
}

// -- the page ------------------------------------------------------------------------------------------------------

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function button(label, onclick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", onclick);
  return b;
}

function figures(f) {
  const parts = [`prompt ${f.prompt_tokens} tokens (${f.cached_tokens} reused)`];
  if (f.prompt_per_second) parts.push(`${f.prompt_per_second.toFixed(1)} tok/s`);
  parts.push(`generation ${f.completion_tokens} tokens`);
  if (f.predicted_per_second) parts.push(`${f.predicted_per_second.toFixed(1)} tok/s`);
  if (state.model) parts.push(`context ${f.prompt_tokens + f.completion_tokens}/${state.model.context_length}`);
  parts.push(`finish ${f.finish_reason}`);
  return parts.join(" · ");
}

function messageView(m, index, c) {
  const li = document.createElement("li");
  li.className = `message ${m.role}`;
  li.dataset.index = index;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "tool" ? `tool result (${m.name || m.tool_call_id})` : m.role;
  li.append(role);
  if (m.reasoning) {
    const d = document.createElement("details"), s = document.createElement("summary"), t = document.createElement("div");
    d.className = "reasoning";
    s.textContent = "Reasoning";
    t.className = "text";
    t.textContent = m.reasoning;
    d.append(s, t);
    li.append(d);
  }
  for (const a of m.attachments || []) {
    if (a.kind === "image" && a.url) {
      const img = document.createElement("img");
      img.className = "attachment";
      img.alt = a.name;
      img.src = a.url;
      li.append(img);
    } else {
      const s = document.createElement("div");
      s.textContent = a.url ? `[audio: ${a.name}]` : `[${a.kind}: ${a.name}, too large to keep in this browser]`;
      li.append(s);
    }
  }
  const body = document.createElement("div");
  body.className = "body";
  body.append(render(m.content || ""));
  li.append(body);
  for (const call of m.tool_calls || []) li.append(callView(call, c));
  if (m.figures) {
    const f = document.createElement("div");
    f.className = "figures";
    f.textContent = figures(m.figures);
    li.append(f);
  }
  const actions = document.createElement("div");
  actions.className = "actions";
  if (m.role === "user") actions.append(button("Edit", () => edit(index)));
  if (m.role === "assistant" && index === c.messages.length - 1) actions.append(button("Regenerate", regenerate));
  actions.append(button("Delete", () => { c.messages.splice(index, 1); save(); show(); }));
  li.append(actions);
  return li;
}

function callView(call, c) {
  const wrap = document.createElement("div"), pre = document.createElement("div");
  pre.className = "call";
  let args = call.function.arguments;
  try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* shown as it came */ }
  pre.textContent = `call ${call.function.name}(${args})`;
  wrap.append(pre);
  if (!c.messages.some((m) => m.role === "tool" && m.tool_call_id === call.id)) {
    const form = document.createElement("div"), text = document.createElement("textarea");
    form.className = "answer-tool";
    text.rows = 2;
    text.placeholder = `the result of ${call.function.name}, by hand`;
    form.append(text, button("Send result", () => {
      c.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name, content: text.value });
      save();
      show();
      if (c.messages.filter((m) => m.role === "tool").length >= pendingCalls(c)) complete(c);
    }));
    wrap.append(form);
  }
  return wrap;
}

function pendingCalls(c) {
  const last = [...c.messages].reverse().find((m) => m.role === "assistant");
  return last && last.tool_calls ? last.tool_calls.length : 0;
}

function show() {
  const c = conversation();
  $("messages").replaceChildren(...c.messages.map((m, i) => messageView(m, i, c)));
  $("messages").scrollTop = $("messages").scrollHeight;
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((x) => {
    const li = document.createElement("li");
    li.className = x.id === state.current ? "current" : "";
    const open = button(x.title, () => { state.current = x.id; save(); show(); });
    open.className = "title";
    const rename = button("Rename", () => {
      const title = prompt("Rename the conversation", x.title);
      if (title) { x.title = title; save(); show(); }
    });
    const remove = button("Delete", () => {
      state.conversations = state.conversations.filter((y) => y.id !== x.id);
      if (state.current === x.id) state.current = null;
      save();
      show();
    });
    rename.className = remove.className = "small";
    li.append(open, rename, remove);
    return li;
  }));
  const used = [...c.messages].reverse().find((m) => m.figures);
  const n = used ? used.figures.prompt_tokens + used.figures.completion_tokens : 0;
  const context = state.model ? state.model.context_length : 0;
  $("context-bar").style.width = context ? `${Math.min(100, (100 * n) / context)}%` : "0";
  $("context-figure").textContent = context ? `${n} / ${context} tokens` : "";
}

// -- requests ------------------------------------------------------------------------------------------------------

async function api(path, body, signal) {
  for (;;) {
    const headers = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(STORE.key);
    if (key) headers.Authorization = `Bearer ${key}`;
    const r = await fetch(path, body === undefined ? { headers } : { method: "POST", headers, body: JSON.stringify(body), signal });
    if (r.status !== 401) return r;
    await askKey();
  }
}

function askKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key").value = "";
    dialog.addEventListener("close", () => { sessionStorage.setItem(STORE.key, $("key").value); resolve(); }, { once: true });
    dialog.showModal();
  });
}

async function errorOf(r) {
  try { const body = await r.json(); return `${r.status}: ${body.error.message}`; } catch { return `${r.status} ${r.statusText}`; }
}

function wire(m) {
  // a message as the API takes it
  const out = { role: m.role, content: m.content || "" };
  if (m.attachments && m.attachments.length) {
    out.content = m.attachments.map((a) => a.kind === "image"
      ? { type: "image_url", image_url: { url: a.url } }
      : { type: "input_audio", input_audio: { data: a.url.slice(a.url.indexOf(",") + 1), format: a.format } });
    out.content.push({ type: "text", text: m.content || "" });
  }
  if (m.tool_calls) out.tool_calls = m.tool_calls;
  if (m.tool_call_id) { out.tool_call_id = m.tool_call_id; out.name = m.name; }
  if (m.reasoning) out.reasoning_content = m.reasoning;
  return out;
}

function requestBody(c) {
  const s = settings();
  const messages = c.messages.map(wire);
  if (s.system.trim()) messages.unshift({ role: "system", content: s.system });
  const body = { model: state.model ? state.model.id : undefined, messages, stream: true,
    stream_options: { include_usage: true } };
  if (state.model && state.model.capabilities.thinking) body.chat_template_kwargs = { enable_thinking: s.thinking };
  for (const name of SAMPLING) if (s[name] !== "") body[name] = Number(s[name]);
  return body;
}

async function complete(c) {
  notice("");
  const body = requestBody(c);  // the conversation so far, before the answer's place is added
  const answer = { role: "assistant", content: "", reasoning: "" };
  c.messages.push(answer);
  show();
  const view = $("messages").lastElementChild;
  state.abort = new AbortController();
  busy(true);
  let finish = null, usage = null, timings = null;
  try {
    const r = await api("/v1/chat/completions", body, state.abort.signal);
    if (!r.ok) throw new Error(await errorOf(r));
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        if (chunk.timings) timings = chunk.timings;
        for (const choice of chunk.choices || []) {
          const d = choice.delta || {};
          if (d.content) answer.content += d.content;
          if (d.reasoning_content) answer.reasoning += d.reasoning_content;
          for (const t of d.tool_calls || []) {
            answer.tool_calls = answer.tool_calls || [];
            const call = answer.tool_calls[t.index] || (answer.tool_calls[t.index] =
              { id: t.id, type: "function", function: { name: "", arguments: "" } });
            if (t.id) call.id = t.id;
            if (t.function && t.function.name) call.function.name += t.function.name;
            if (t.function && t.function.arguments) call.function.arguments += t.function.arguments;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        view.replaceWith(messageView(answer, c.messages.length - 1, c));
      }
      show();
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else notice(`the answer failed: ${e.message} (the conversation is kept)`);
  } finally {
    busy(false);
    state.abort = null;
  }
  if (!answer.content && !answer.reasoning && !answer.tool_calls && finish !== "stopped") {
    c.messages.pop();  // nothing came: the conversation is as it was
  } else {
    if (!answer.reasoning) delete answer.reasoning;
    if (usage) {
      answer.figures = { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens,
        cached_tokens: (usage.prompt_tokens_details || {}).cached_tokens || 0, finish_reason: finish || "stopped",
        prompt_per_second: timings ? timings.prompt_per_second : null,
        predicted_per_second: timings ? timings.predicted_per_second : null };
    }
    if (c.title === "New chat") {
      const first = c.messages.find((m) => m.role === "user");
      if (first) c.title = (first.content || "(attachment)").slice(0, 40);
    }
  }
  save();
  show();
}

function busy(on) {
  $("send").disabled = on;
  $("stop").hidden = !on;
}

function send() {
  const text = $("input").value;
  if (!text.trim() && !state.pending.length) return;
  if (state.abort) return;
  const c = conversation();
  c.messages.push({ role: "user", content: text, attachments: state.pending });
  state.pending = [];
  $("input").value = "";
  showAttachments();
  save();
  complete(c);
}

function regenerate() {
  const c = conversation();
  if (state.abort) return;
  if (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  complete(c);
}

function edit(index) {
  const c = conversation();
  const m = c.messages[index];
  const text = prompt("Edit the message and send it again from here", m.content);
  if (text === null || state.abort) return;
  c.messages.splice(index);  // what followed the edited message goes: the answer is asked again
  c.messages.push({ ...m, content: text });
  complete(c);
}

// -- attachments ---------------------------------------------------------------------------------------------------

function attach(files) {
  const caps = state.model ? state.model.capabilities : {};
  for (const file of files) {
    const kind = file.type.startsWith("image/") ? "image" : file.type.startsWith("audio/") ? "audio" : null;
    if (kind === "image" && !caps.vision) { notice(`${file.name}: this bundle has no vision model: it cannot take a picture`); continue; }
    if (kind === "audio" && !(caps.audio && AUDIO_FORMATS[file.type])) {
      notice(`${file.name}: ${caps.audio ? `${file.type} is not WAV, MP3, FLAC or OGG` : "this bundle has no audio model"}`);
      continue;
    }
    if (!kind) { notice(`${file.name}: not a picture or a sound (${file.type || "unknown type"})`); continue; }
    const reader = new FileReader();
    reader.onload = () => {
      state.pending.push({ kind, name: file.name, url: reader.result, format: AUDIO_FORMATS[file.type] });
      showAttachments();
    };
    reader.readAsDataURL(file);
  }
}

function showAttachments() {
  $("attachments").replaceChildren(...state.pending.map((a, i) => {
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.textContent = `${a.kind}: ${a.name} `;
    chip.append(button("×", () => { state.pending.splice(i, 1); showAttachments(); }));
    return chip;
  }));
}

// -- export and import ---------------------------------------------------------------------------------------------

function exportAll() {
  const blob = new Blob([JSON.stringify({ format: "gemma-ane.conversations", version: 1,
    conversations: state.conversations }, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = "gemma-ane-conversations.json";
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importAll(file) {
  try {
    const data = JSON.parse(await file.text());
    if (data.format !== "gemma-ane.conversations" || !Array.isArray(data.conversations)) {
      throw new Error("not an export of this page");
    }
    const known = new Set(state.conversations.map((c) => c.id));
    for (const c of data.conversations) {
      if (typeof c.id !== "string" || !Array.isArray(c.messages)) throw new Error("a conversation without id or messages");
      if (!known.has(c.id)) state.conversations.push(c);
    }
    save();
    show();
  } catch (e) {
    notice(`${file.name}: cannot import (${e.message})`);
  }
}

// -- start ---------------------------------------------------------------------------------------------------------

async function start() {
  state.conversations = load(STORE.conversations, []);
  state.current = load(STORE.current, null);
  applySettings(load(STORE.settings, {}));
  renderPresets();
  try {
    const r = await api("/v1/models");
    if (!r.ok) throw new Error(await errorOf(r));
    state.model = (await r.json()).data[0];
    $("model-name").textContent = state.model.id;
    const caps = state.model.capabilities;
    $("thinking-row").hidden = !caps.thinking;
    const accept = [caps.vision ? "image/*" : null, caps.audio ? Object.keys(AUDIO_FORMATS).join(",") : null].filter(Boolean);
    $("attach").accept = accept.join(",");
    $("attach-label").hidden = !accept.length;
  } catch (e) {
    notice(`cannot reach the server's /v1/models: ${e.message}`);
  }
  show();

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("new-chat").addEventListener("click", () => { state.current = null; conversation(); save(); show(); });
  $("toggle-settings").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  $("settings").addEventListener("input", storeSettings);
  $("save-preset").addEventListener("click", () => {
    const name = $("preset-name").value.trim();
    if (!name) { notice("name the preset first"); return; }
    const presets = load(STORE.presets, {});
    presets[name] = settings();
    localStorage.setItem(STORE.presets, JSON.stringify(presets));
    renderPresets();
    $("presets").value = name;
  });
  $("delete-preset").addEventListener("click", () => {
    const presets = load(STORE.presets, {});
    delete presets[$("presets").value];
    localStorage.setItem(STORE.presets, JSON.stringify(presets));
    renderPresets();
  });
  $("presets").addEventListener("change", () => {
    const preset = load(STORE.presets, {})[$("presets").value];
    if (preset) { applySettings(preset); storeSettings(); $("preset-name").value = $("presets").value; }
  });
  $("attach").addEventListener("change", () => { attach($("attach").files); $("attach").value = ""; });
  $("input").addEventListener("paste", (e) => { if (e.clipboardData.files.length) { e.preventDefault(); attach(e.clipboardData.files); } });
  const composer = $("composer");
  composer.addEventListener("dragover", (e) => { e.preventDefault(); composer.classList.add("dragging"); });
  composer.addEventListener("dragleave", () => composer.classList.remove("dragging"));
  composer.addEventListener("drop", (e) => { e.preventDefault(); composer.classList.remove("dragging"); attach(e.dataTransfer.files); });
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("change", () => { if ($("import").files[0]) importAll($("import").files[0]); $("import").value = ""; });
}

start();
