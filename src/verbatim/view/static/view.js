// verbatim view: the run, its rollouts, one rollout token by token, a group side by side.
// Every piece of trace text reaches the page through textContent (never innerHTML).
"use strict";
(function () {
  const embeddedNode = document.getElementById("embedded");
  const embedded = embeddedNode ? JSON.parse(embeddedNode.textContent) : null;
  const state = { summary: null, rows: null, filters: { group: "", status: "", minReward: "", lint: "" },
    sort: { key: "id", desc: false }, mode: "source" };

  async function api(path) {
    if (embedded) {
      if (!(path in embedded)) throw new Error(`not in this file: ${path}`);
      return embedded[path];
    }
    const response = await fetch(`/api/${path}`);
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    return body;
  }

  function h(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else if (key === "on") for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
      else if (key === "data") Object.assign(node.dataset, value);
      else node[key] = value;
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }
  const num = (v, digits) => (v === null || v === undefined ? "–" : typeof v === "number" ? +v.toFixed(digits ?? 3) : v);
  const main = () => document.getElementById("main");
  const q = encodeURIComponent;

  function crumbs(...items) {
    document.getElementById("crumbs").replaceChildren(...items.map(([label, href]) =>
      h("span", { class: "crumb" }, href ? h("a", { href, text: label }) : label)));
  }

  function showHeader(s) {
    document.getElementById("title").textContent = `${s.run_id} · ${s.status}${s.training ? " · training run" : ""}`;
    const banner = document.getElementById("partial");
    banner.hidden = !s.partial;
    banner.textContent = s.partial
      ? `partial run: status ${s.status}, ${s.rollouts} rollouts so far` + (embedded ? "" : "; this page updates as it grows")
      : "";
    document.getElementById("problems").replaceChildren(...s.problems.map((p) => h("li", { text: p })));
  }

  function kv(pairs) {
    return h("table", { class: "kv" }, ...pairs.map(([k, v]) => h("tr", {}, h("td", { text: k }), h("td", { text: String(v) }))));
  }

  function summaryTable(s) {
    const t = s.totals || {};
    const statuses = Object.entries(t.statuses || {}).map(([k, v]) => `${k} ${v}`).join(", ") || "–";
    return kv([["model", s.model || "–"], ["renderer", s.renderer || "–"], ["rollouts", `${s.rollouts} in ${s.groups} groups`],
      ["statuses", statuses], ["mean reward", num(t.mean_reward)], ["turns", num(t.turns)],
      ["prompt tokens", num(t.prompt_tokens)], ["cached / prefill", `${num(t.cached_tokens)} / ${num(t.prefill_tokens)}`],
      ["minimum prefill", num(t.min_prefill_tokens)], ["cache hit rate", t.cache_hit_rate === undefined ? "–" : `${(100 * t.cache_hit_rate).toFixed(1)}%`],
      ["generated tokens", num(t.generated_tokens)], ["lint problems", s.lint_problems ?? "checking…"],
      ["trainer logprobs", s.trainer_logprobs.length ? s.trainer_logprobs.join(", ") : "–"]]);
  }

  function charts(metrics) {
    const box = h("div", { class: "charts", id: "charts" });
    const series = (name, key) => ({ name, points: metrics.map((m) => [m.step, m[key] ?? null]) });
    const chart = VerbatimChart.line;
    const rewards = [series("reward", "reward_mean")];
    if (metrics.some((m) => m.eval)) {  // --eval-every: held-out pass@1 (avg@K where the env never says solved)
      const held = (m) => (m.eval ? (m.eval.pass_at_k ? m.eval.pass_at_k["1"] : m.eval.mean_reward) : null);
      rewards.push({ name: "held-out", points: metrics.map((m) => [m.step, held(m)]) });
    }
    chart(box, "reward", rewards);
    chart(box, "mismatch |log π − log μ|", [series("mismatch", "mismatch_mean_abs")]);
    chart(box, "cache hit rate", [series("hit rate", "cache_hit_rate")]);
    if (metrics.some((m) => m.entropy != null)) {  // runs trained before the metric have none
      chart(box, "policy entropy (nats)", [series("entropy", "entropy")]);
    }
    chart(box, "time split (s)", [series("rollout", "rollout_s"), series("train", "train_s"),
      series("sync", "weight_sync_s"), series("checkpoint", "checkpoint_s")]);
    return box;
  }

  function select(id, options, value, onchange) {
    const node = h("select", { id, on: { change: (e) => onchange(e.target.value) } },
      ...options.map(([v, label]) => h("option", { value: v, text: label })));
    node.value = value;
    return node;
  }

  function filtered() {
    const f = state.filters;
    const min = f.minReward === "" ? null : Number(f.minReward);
    const rows = state.rows.filter((r) => (!f.group || r.group === f.group) && (!f.status || r.status === f.status) &&
      (min === null || (r.reward !== null && r.reward >= min)) &&
      (!f.lint || (r.problems !== null && (f.lint === "problems" ? r.problems > 0 : f.lint === "misses" ? r.misses > 0 : r.problems === 0))));
    const { key, desc } = state.sort;
    const value = (r) => (r[key] === null ? -Infinity : r[key]);
    rows.sort((a, b) => (value(a) < value(b) ? -1 : value(a) > value(b) ? 1 : 0) * (desc ? -1 : 1));
    return rows;
  }

  function rowNode(r) {
    return h("div", { class: "row", data: { id: r.id }, on: { click: () => { location.hash = `#/rollout/${q(r.id)}`; } } },
      h("span", { class: "c-id", text: r.id, title: r.id }),
      h("span", { class: "c-group" }, h("button", { class: "link", text: r.group, title: "open the group",
        on: { click: (e) => { e.stopPropagation(); location.hash = `#/group/${q(r.group)}`; } } })),
      h("span", { class: `c-status status-${r.status}`, text: r.status }),
      h("span", { class: "c-num", text: String(num(r.reward)) }), h("span", { class: "c-num", text: String(r.turns) }),
      h("span", { class: "c-num", text: String(r.tokens) }), h("span", { class: "c-num", text: String(r.misses ?? "…") }),
      h("span", { class: "c-num", text: String(r.problems ?? "…") }), h("span", { class: "c-error", text: r.error || "" }));
  }

  function rolloutList(box) {
    const rows = filtered();
    const head = h("div", { class: "row head" }, ...["id", "group", "status", "reward", "turns", "tokens", "misses", "lint"]
      .map((label, k) => h("span", { class: ["c-id", "c-group", "c-status"][k] || "c-num", text: label })), h("span", { class: "c-error", text: "error" }));
    const list = h("div", { class: "list", id: "rollout-list" });
    const pending = state.summary.lint_pending ? " (lint trace is still checking: problem counts follow)" : "";
    box.replaceChildren(h("p", { class: "muted", id: "list-count", text: `${rows.length} of ${state.rows.length} rollouts${pending}` }), head, list);
    VerbatimTokens.virtualList(list, rows.length, (i) => rowNode(rows[i]));
  }

  function filters(box) {
    const redraw = () => rolloutList(box);
    const set = (key) => (v) => { state.filters[key] = v; redraw(); };
    const groups = [...new Set(state.rows.map((r) => r.group))].sort();
    const statuses = [...new Set(state.rows.map((r) => r.status))].sort();
    const reward = h("input", { id: "f-reward", type: "number", step: "any", placeholder: "min reward", value: state.filters.minReward,
      on: { input: (e) => set("minReward")(e.target.value) } });
    return h("div", { class: "filters" },
      h("label", { text: "group" }), select("f-group", [["", "all"], ...groups.map((g) => [g, g])], state.filters.group, set("group")),
      h("label", { text: "status" }), select("f-status", [["", "all"], ...statuses.map((s) => [s, s])], state.filters.status, set("status")),
      h("label", { text: "reward ≥" }), reward,
      h("label", { text: "lint" }), select("f-lint", [["", "all"], ["problems", "with problems"], ["misses", "with cache misses"], ["clean", "clean"]], state.filters.lint, set("lint")),
      h("label", { text: "sort by" }), select("f-sort", [["id", "id"], ["reward", "reward"], ["turns", "turns"], ["misses", "cache misses"], ["tokens", "tokens"]],
        state.sort.key, (v) => { state.sort.key = v; redraw(); }),
      select("f-order", [["asc", "ascending"], ["desc", "descending"]], state.sort.desc ? "desc" : "asc", (v) => { state.sort.desc = v === "desc"; redraw(); }));
  }

  async function showRun() {
    crumbs();
    const [s, list] = [state.summary, await api("rollouts")];
    state.rows = list.rows;
    const listBox = h("div", { id: "list-box" });
    main().replaceChildren(h("div", { class: "overview" }, h("section", { id: "summary" }, summaryTable(s)),
      s.training ? charts(s.metrics) : null), h("h2", { text: "rollouts" }), filters(listBox), listBox);
    rolloutList(listBox);
  }

  const LEGENDS = {
    source: [["src-0", "prompt"], ["src-1", "environment"], ["src-2", "model"]],
    logprob: [["lp-0", "> −0.1"], ["lp-1", "> −0.7"], ["lp-2", "> −1.6"], ["lp-3", "> −3"], ["lp-4", "≤ −3"]],
    version: [["ver-0", "version 0 (mod 6)"], ["ver-1", "1"], ["ver-2", "2"], ["ver-3", "3"], ["ver-4 hybrid", "hybrid: after a mid-sequence update"]],
    cache: [["blk-0", "KV block"], ["blk-1", "next block"], ["recomputed", "prefilled again (a cache miss)"]],
    ratio: [["ratio-0", "< −0.2"], ["ratio-1", "< −0.02"], ["ratio-2", "±0.02"], ["ratio-3", "> 0.02"], ["ratio-4", "> 0.2"]],
    mask: [["keep", "kept by the correction"], ["masked", "masked"]],
    routing: [["flip-1", "experts flipped in 1 MoE layer"], ["flip-2", "2"], ["flip-3", "3 or more"]],
  };

  function trainerSource(t) {
    const by = t.writer === "train" ? `training step ${t.step}` : "verbatim mismatch --save";
    return `log π from ${t.source} (${by}, trainer version ${t.trainer_version ?? "–"}${t.model ? `, ${t.model}` : ""})`;
  }

  async function showRollout(id) {
    const d = await api(`rollout?id=${q(id)}`);
    const r = d.row;
    crumbs([`group ${r.group}`, `#/group/${q(r.group)}`], [`rollout ${r.id}`]);
    const hasTrainer = d.trainer !== null;
    const hasFlips = hasTrainer && d.trainer.flips !== null;
    if (!hasTrainer && (state.mode === "ratio" || state.mode === "mask")) state.mode = "source";
    if (!hasFlips && state.mode === "routing") state.mode = "source";
    const modes = [["source", "source"], ["logprob", "sampler logprob"], ["version", "policy version"], ["cache", "cache blocks"],
      ...(hasTrainer ? [["ratio", "log π − log μ"], ["mask", "correction mask"]] : []),
      ...(hasFlips ? [["routing", "routing flips"]] : [])];
    const legend = h("div", { class: "legend", id: "legend" });
    const tokens = h("div", { class: "tokens", id: "tokens" });
    let view = null;
    const draw = () => {
      legend.replaceChildren(...LEGENDS[state.mode].map(([cls, label]) => h("span", { class: `tok ${cls}`, text: label })));
      view = VerbatimTokens.render(tokens, d, state.mode);
    };
    const pins = h("ul", { class: "pinlist", id: "pins" }, ...d.problems.map((p) => h("li", {
      text: `${p.turn === null ? "rollout" : `turn ${p.turn}`} · ${p.kind}${p.cause ? ` (${p.cause})` : ""}: ${p.detail}`,
      on: { click: () => p.position !== null && view.showPosition(p.position) } })));
    main().replaceChildren(
      kv([["rollout", r.id], ["group", r.group], ["status", r.status], ["reward", num(r.reward)], ["turns", r.turns],
        ["tokens", r.tokens], ["error", r.error || "–"], ["task", JSON.stringify(d.task)]]),
      h("div", { class: "controls" }, h("label", { text: "colour" }),
        select("mode", modes, state.mode, (v) => { state.mode = v; draw(); }), legend,
        h("span", { class: "muted", id: "trainer-source", text: hasTrainer ? trainerSource(d.trainer)
          : "no trainer logprobs for this rollout (verbatim mismatch RUN_DIR --save, or a training step, writes them)" })),
      pins, tokens);
    draw();
  }

  function cells(texts, specials, sources, limit) {
    const shown = Math.min(texts.length, limit);
    const out = [];
    for (let i = 0; i < shown; i++) {
      out.push(h("span", { class: `tok ${sources ? `src-${sources[i]}` : "src-0"}${specials[i] ? " special" : ""}`, text: texts[i] }));
    }
    if (texts.length > shown) out.push(h("span", { class: "muted", text: ` … ${texts.length - shown} more tokens` }));
    return out;
  }

  async function showGroup(id) {
    const g = await api(`group?id=${q(id)}`);
    crumbs([`group ${g.group}`]);
    const tail = 200;
    const start = Math.max(0, g.prefix_text.length - tail);
    const prefix = h("div", { class: "prefix", id: "prefix" },
      h("div", { class: "muted", text: `${g.shared} tokens shared by all ${g.members.length} members` + (start ? `; the last ${tail}:` : ":") }),
      ...cells(g.prefix_text.slice(start), g.prefix_special.slice(start), null, tail));
    const members = g.members.map((m) => h("div", { class: "member", data: { id: m.row.id } },
      h("h3", {}, h("a", { href: `#/rollout/${q(m.row.id)}`, text: m.row.id })),
      h("div", { class: "muted", text: `reward ${num(m.row.reward)} · ${m.row.status} · turns ${m.row.turns} · ` +
        `first request cached ${m.first_cached} of ${m.first_prompt}` }),
      h("div", { class: "muted", text: `diverges after token ${g.shared}` }),
      ...cells(m.text, m.special, m.source, 2000)));
    main().replaceChildren(prefix, h("div", { class: "group", id: "members" }, ...members));
  }

  async function route() {
    const [, kind, arg] = (location.hash.match(/^#\/(rollout|group)\/(.*)$/) || []);
    try {
      if (kind === "rollout") await showRollout(decodeURIComponent(arg));
      else if (kind === "group") await showGroup(decodeURIComponent(arg));
      else await showRun();
    } catch (err) {
      main().replaceChildren(h("p", { class: "problems", id: "error", text: String(err.message || err) }));
    }
  }

  async function poll() {
    if (embedded) return;
    try {
      const s = await api("summary");
      if (s.generation !== state.summary.generation) {
        state.summary = s;
        showHeader(s);
        if (!location.hash || location.hash === "#/") await showRun();
      }
      if (s.status === "completed" && !s.partial && !s.lint_pending) return;
    } catch (err) { /* the server went away: keep the page as it is */ return; }
    setTimeout(poll, 1000);
  }

  async function start() {
    state.summary = await api("summary");
    showHeader(state.summary);
    window.addEventListener("hashchange", route);
    await route();
    document.body.dataset.ready = "1";
    setTimeout(poll, 1000);
  }
  start().catch((err) => main().replaceChildren(h("p", { class: "problems", text: String(err.message || err) })));
})();
