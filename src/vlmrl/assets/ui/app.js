// vlmrl reward lab. Every number comes from the server (the project's own reward code);
// this file only collects input, calls the JSON endpoints and writes results with textContent.
"use strict";

const DEBOUNCE_MS = 250;
const CHANGE_LABELS = {
  wrong_to_right: "wrong → right", right_to_wrong: "right → wrong",
  still_right: "still right", still_wrong: "still wrong",
  only_in_baseline: "only in baseline", only_in_post: "only in post",
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function formatNumber(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  return Number.isInteger(value) ? String(value) : String(Number(value.toFixed(4)));
}

function signed(value) {
  if (typeof value !== "number") return "–";
  return (value > 0 ? "+" : "") + formatNumber(value);
}

function yesNo(flag) {
  return el("span", { class: flag ? "yes" : "no", text: flag ? "yes" : "no" });
}

async function fetchJson(url, options = {}) {
  let response;
  try {
    response = await fetch(url, options);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new Error("cannot reach the vlmrl ui server (is `vlmrl ui` still running?)");
  }
  let body = null;
  try { body = await response.json(); } catch { /* not JSON: handled below */ }
  if (!response.ok) {
    const message = body && body.error ? body.error : `HTTP ${response.status}`;
    throw Object.assign(new Error(message), { status: response.status, body });
  }
  return body;
}

function showError(box, message) {
  box.textContent = message || "";
  box.hidden = !message;
}

// ------------------------------------------------------------------ tabs

function showTab(name) {
  for (const button of document.querySelectorAll(".tab")) {
    button.classList.toggle("active", button.dataset.tab === name);
  }
  $("calculator").hidden = name !== "calculator";
  $("eval").hidden = name !== "eval";
  if (name === "eval") loadEval();  // re-read: a `dvc repro` may have run since
}

// ------------------------------------------------------------ calculator

// touched: the user has typed or picked something, so the worked example must not replace it.
const calc = { timer: null, controller: null, sequence: 0, records: [], touched: false };

function precisionValue(text) {
  const trimmed = text.trim();
  if (!trimmed) return null;
  // Anything that is not a plain number goes to the server as typed: it names the problem.
  return /^-?\d+(\.\d+)?$/.test(trimmed) ? Number(trimmed) : trimmed;
}

function goldRecord() {
  const choices = $("gold-choices").value.split("\n").map((c) => c.trim()).filter(Boolean);
  const unit = $("gold-unit").value.trim();
  return {
    answer: $("gold-answer").value,
    question_type: $("gold-question-type").value,
    answer_type: $("gold-answer-type").value,
    choices: choices.length ? choices : null,
    precision: precisionValue($("gold-precision").value),
    unit: unit || null,
  };
}

function fillRecord(record) {
  $("gold-answer").value = record.answer ?? "";
  $("gold-question-type").value = record.question_type || "free_form";
  $("gold-answer-type").value = record.answer_type || "text";
  $("gold-choices").value = (record.choices || []).join("\n");
  $("gold-precision").value = record.precision ?? "";
  $("gold-unit").value = record.unit ?? "";
  $("record-question").textContent = record.question || "";
}

function scheduleScore() {
  calc.touched = true;
  clearTimeout(calc.timer);
  $("completion-size").textContent = `${$("completion").value.length} characters`;
  setStatus("typing…", true);
  calc.timer = setTimeout(score, DEBOUNCE_MS);
}

function setStatus(text, busy) {
  const status = $("score-status");
  status.textContent = text;
  status.classList.toggle("busy", busy);
}

async function score() {
  if (calc.controller) calc.controller.abort();
  calc.controller = new AbortController();
  const sequence = ++calc.sequence;
  const completion = $("completion").value;
  setStatus("scoring…", true);
  try {
    const result = await fetchJson("/api/score", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ completion, record: goldRecord() }),
      signal: calc.controller.signal,
    });
    if (sequence !== calc.sequence) return;
    showError($("score-error"), "");
    renderScore(result);
    setStatus("up to date", false);
  } catch (error) {
    if (error.name === "AbortError" || sequence !== calc.sequence) return;
    showError($("score-error"), error.message);
    clearScore();
    setStatus("not scored", false);
  }
}

function clearScore() {
  $("reward-table").querySelector("tbody").replaceChildren();
  const total = $("reward-total");
  total.textContent = "–";
  delete total.dataset.value;
  delete total.dataset.chars;
  for (const id of ["v-extracted", "v-normalized", "v-gold", "v-correct", "v-format"]) {
    $(id).textContent = "–";
  }
}

function rewardRow(name, value, weight) {
  const none = value === null;
  const weighted = none ? 0 : weight * value;
  const valueCell = el("td", {
    class: "num value", text: none ? "none" : formatNumber(value),
    title: none ? "gold answer unreadable: no signal (counts 0 in the total)" : "",
  });
  valueCell.dataset.value = JSON.stringify(value);
  return el("tr", { "data-reward": name },
    el("td", { text: name }), valueCell,
    el("td", { class: "num weight", text: formatNumber(weight) }),
    el("td", { class: "num", text: formatNumber(weighted) }));
}

// A row before any score: the reward and its weight from params.yaml.
function weightRow(name, weight) {
  return el("tr", { "data-reward": name }, el("td", { text: name }),
    el("td", { class: "num value", text: "–" }),
    el("td", { class: "num weight", text: formatNumber(weight) }),
    el("td", { class: "num", text: "–" }));
}

function describeWeights(weights) {
  const parts = Object.entries(weights || {}).map(([name, w]) => `${name} ${formatNumber(w)}`);
  return parts.length ? parts.join(", ") : "no weighted rewards";
}

function showWeights(weights) {
  $("weights").textContent = describeWeights(weights);
  const body = $("reward-table").querySelector("tbody");
  if (!body.children.length) {
    body.replaceChildren(...Object.entries(weights).map(([name, w]) => weightRow(name, w)));
  }
}

function openExample(example) {
  fillRecord({ ...example.record, question: `Worked example: ${example.record.question}` });
  $("completion").value = example.completion;
  $("completion-size").textContent = `${example.completion.length} characters`;
  score();
}

function renderScore(result) {
  const rows = Object.entries(result.rewards).map(
    ([name, value]) => rewardRow(name, value, result.weights[name]));
  $("reward-table").querySelector("tbody").replaceChildren(...rows);
  const total = $("reward-total");
  total.textContent = formatNumber(result.total);
  total.dataset.value = JSON.stringify(result.total);
  total.dataset.chars = String(result.completion_chars);
  const tag = (result.tags && result.tags.solution_open) || "<SOLUTION>";
  $("v-extracted").textContent = result.extracted ?? `(no ${tag} block)`;
  $("v-normalized").textContent = result.normalized ?? "(cannot be read as the answer type)";
  $("v-gold").textContent = result.gold ?? "(gold answer unreadable)";
  $("v-correct").replaceChildren(yesNo(result.correct));
  $("v-format").replaceChildren(yesNo(result.format_ok));
  $("weights").textContent = describeWeights(result.weights);
  $("options").textContent = describeOptions(result.options);
}

function describeOptions(options) {
  const parts = Object.entries(options || {}).map(([name, opts]) =>
    `${name}: ` + Object.entries(opts || {}).map(([k, v]) => `${k} ${v}`).join(", "));
  return parts.length ? parts.join("; ") : "no reward options";
}

async function loadConfig() {
  try {
    const config = await fetchJson("/api/config");
    $("repo").textContent = config.repo;
    if (config.options && config.options.error) {
      showError($("score-error"), config.options.error);
      $("weights").textContent = "unavailable (see the error above)";
    } else {
      showWeights(config.weights);
      $("options").textContent = describeOptions(config.options);
    }
    if (!calc.touched && config.example) openExample(config.example);
  } catch (error) {
    showError($("score-error"), error.message);
  }
}

async function loadRecords() {
  const pick = $("record-pick");
  try {
    const { records } = await fetchJson("/api/records");
    calc.records = records;
    for (const [index, record] of records.entries()) {
      const question = (record.question || "").split("\n")[0].slice(0, 70);
      pick.append(el("option", { value: String(index),
        text: `${record.pid} · ${record.answer} · ${question}` }));
    }
    $("records-note").textContent = `${records.length} records from data/prepared/eval`;
  } catch (error) {
    pick.disabled = true;
    $("records-note").textContent = `Eval set not available: ${error.message}. Type a record below.`;
  }
}

function pickRecord() {
  calc.touched = true;
  const index = $("record-pick").value;
  if (index === "") { $("record-question").textContent = ""; return; }
  fillRecord(calc.records[Number(index)]);
  scheduleScore();
}

function openInCalculator(row, side) {
  const known = calc.records.findIndex((r) => r.pid === row.pid);
  if (known >= 0) {
    $("record-pick").value = String(known);
    fillRecord(calc.records[known]);
  } else {
    $("record-pick").value = "";
    fillRecord({ answer: row.gold, question_type: row.question_type,
      answer_type: row.answer_type, question: row.question });
  }
  $("completion").value = row[side].response || "";
  location.hash = "calculator";
  showTab("calculator");
  scheduleScore();
}

// ------------------------------------------------------------ eval browser

const evalState = { controller: null };

function evalQuery() {
  const params = new URLSearchParams({ change: $("filter-change").value });
  if ($("filter-question-type").value) params.set("question_type", $("filter-question-type").value);
  if ($("filter-category").value) params.set("category", $("filter-category").value);
  return params.toString();
}

async function loadEval() {
  if (evalState.controller) evalState.controller.abort();
  evalState.controller = new AbortController();
  try {
    const view = await fetchJson(`/api/eval?${evalQuery()}`, { signal: evalState.controller.signal });
    showError($("eval-error"), "");
    renderEval(view);
    $("eval-body").hidden = false;
  } catch (error) {
    if (error.name === "AbortError") return;
    showError($("eval-error"), error.message);
    $("eval-body").hidden = true;
  }
}

function fillFacet(select, values) {
  const current = select.value;
  select.replaceChildren(el("option", { value: "", text: "all" }),
    ...values.map((v) => el("option", { value: v, text: v })));
  select.value = values.includes(current) ? current : "";
}

function renderEval(view) {
  $("headline").querySelector("tbody").replaceChildren(...view.headline.map((row) =>
    el("tr", { "data-metric": row.key },
      el("td", { text: row.label }),
      el("td", { class: "num", text: formatNumber(row.baseline) }),
      el("td", { class: "num", text: formatNumber(row.post) }),
      el("td", { class: "num", text: signed(row.delta) }))));
  fillFacet($("filter-question-type"), view.question_types);
  fillFacet($("filter-category"), view.categories);
  for (const option of $("filter-change").options) {
    const count = view.counts[option.value];
    const base = option.textContent.replace(/ \(\d+\)$/, "");
    option.textContent = count === undefined ? base : `${base} (${count})`;
  }
  $("eval-count").textContent = `showing ${view.rows.length} of ${view.total}`;
  $("eval-rows").replaceChildren(...view.rows.map(evalCard));
  if (!view.rows.length) $("eval-rows").append(el("p", { class: "muted", text: "No record matches these filters." }));
}

function imageCell(pid) {
  const url = `/api/image/${encodeURIComponent(pid)}`;
  const image = el("img", { src: url, alt: `image for ${pid}`, loading: "lazy" });
  image.addEventListener("error", async () => {
    let message = "image unavailable";
    try { await fetchJson(url); } catch (error) { message = error.message; }
    image.replaceWith(el("div", { class: "note", text: message }));
  });
  return el("div", {}, image);
}

function rewardsLine(record) {
  const parts = Object.keys(record).filter((k) => k.startsWith("reward_") && k !== "reward_total")
    .map((k) => `${k.slice(7)} ${formatNumber(record[k])}`);
  return `${parts.join(" · ")} → total ${formatNumber(record.reward_total)}`;
}

function sideCell(row, side, title) {
  const record = row[side];
  if (!record) return el("div", { class: "side" }, el("h3", { text: title }),
    el("p", { class: "muted", text: `not evaluated in the ${title.toLowerCase()} run` }));
  const button = el("button", { type: "button", class: "link small", text: "score in calculator" });
  button.addEventListener("click", () => openInCalculator(row, side));
  return el("div", { class: "side", "data-side": side },
    el("h3", { text: `${title} ` }, yesNo(record.correct), " ", button),
    el("pre", { text: record.response ?? "" }),
    el("div", { class: "small" }, "extracted: ",
      el("span", { class: "mono", text: record.extracted ?? "–" }),
      " · normalized: ", el("span", { class: "mono", text: record.normalized ?? "–" }),
      " · format ok: ", yesNo(record.format_ok)),
    el("div", { class: "small muted", text: rewardsLine(record) +
      (record.generated_tokens != null ? ` · ${record.generated_tokens} tokens` : "") }),
    record.score_error ? el("div", { class: "small no", text: `scorer error: ${record.score_error}` }) : null);
}

function evalCard(row) {
  const meta = el("div", { class: "meta" },
    el("div", {}, el("strong", { text: row.pid }), " ",
      el("span", { class: `badge ${row.change}`, text: CHANGE_LABELS[row.change] || row.change })),
    el("div", { class: "small", text: [row.question_type ?? "?", row.answer_type ?? "?", row.category].filter((part) => part != null).join(" · ") }),
    el("div", { class: "small" }, "gold: ", el("span", { class: "mono", text: String(row.gold ?? "–") })),
    el("div", { class: "question small", text: row.question || "" }));
  return el("div", { class: "card", "data-pid": row.pid, "data-change": row.change },
    el("div", {}, imageCell(row.pid), meta),
    sideCell(row, "baseline", "Baseline"), sideCell(row, "post", "Post"));
}

// ------------------------------------------------------------------ start

document.addEventListener("DOMContentLoaded", () => {
  for (const button of document.querySelectorAll(".tab")) {
    button.addEventListener("click", () => { location.hash = button.dataset.tab; showTab(button.dataset.tab); });
  }
  $("completion").addEventListener("input", scheduleScore);
  for (const id of ["gold-answer", "gold-choices", "gold-precision", "gold-unit"]) {
    $(id).addEventListener("input", scheduleScore);
  }
  for (const id of ["gold-question-type", "gold-answer-type"]) {
    $(id).addEventListener("change", scheduleScore);
  }
  $("record-pick").addEventListener("change", pickRecord);
  for (const id of ["filter-change", "filter-question-type", "filter-category"]) {
    $(id).addEventListener("change", loadEval);
  }
  loadConfig();
  loadRecords();
  showTab(location.hash === "#eval" ? "eval" : "calculator");
});
