// A virtual list (only the rows in view are in the DOM) and the token view built on it.
"use strict";
(function () {
  const LINE = 24;
  const TOKENS_PER_LINE = 24;

  // container: a scrolling element; count rows of `height` px; render(i) returns the row's element.
  function virtualList(container, count, render, height) {
    const rowHeight = height || LINE;
    container.replaceChildren();
    const space = document.createElement("div");
    space.className = "vspace";
    space.style.height = `${count * rowHeight}px`;
    const win = document.createElement("div");
    win.className = "vwindow";
    space.appendChild(win);
    container.appendChild(space);
    let shown = [-1, -1];
    function draw() {
      const first = Math.max(0, Math.floor(container.scrollTop / rowHeight) - 10);
      const last = Math.min(count, Math.ceil((container.scrollTop + container.clientHeight) / rowHeight) + 10);
      if (first === shown[0] && last === shown[1]) return;
      shown = [first, last];
      win.style.top = `${first * rowHeight}px`;
      const rows = [];
      for (let i = first; i < last; i++) rows.push(render(i));
      win.replaceChildren(...rows);
    }
    let pending = false;
    container.onscroll = () => {
      if (!pending) { pending = true; requestAnimationFrame(() => { pending = false; draw(); }); }
    };
    draw();
    return { redraw() { shown = [-1, -1]; draw(); }, scrollToRow(i) { container.scrollTop = i * rowHeight; draw(); } };
  }

  // Rows of a rollout: a header before each request's new tokens, then lines of at most TOKENS_PER_LINE tokens
  // that also end after a newline.
  function layout(detail) {
    const cols = detail.columns;
    const starts = new Map();
    detail.turns.forEach((t, k) => starts.set(k === 0 ? 0 : detail.turns[k - 1].completion_end, t));
    const rows = [];
    let line = null;
    for (let i = 0; i < cols.text.length; i++) {
      if (starts.has(i)) { rows.push({ turn: starts.get(i) }); line = null; }
      if (!line) { line = { start: i, end: i }; rows.push(line); }
      line.end = i + 1;
      if (line.end - line.start >= TOKENS_PER_LINE || cols.text[i].includes("↵")) line = null;
    }
    return rows;
  }

  function bucket(value, edges) {
    let k = 0;
    while (k < edges.length && value < edges[k]) k++;
    return k;
  }

  // The class of token i under a colouring mode.
  function tokenClass(detail, mode, i) {
    const c = detail.columns;
    const model = c.source[i] === 2;
    if (mode === "source") return `src-${c.source[i]}`;
    if (mode === "cache") {
      if (c.prefills[i] > 1) return "recomputed";
      return detail.block_size ? `blk-${Math.floor(i / detail.block_size) % 2}` : "blk-0";
    }
    if (mode === "routing") {  // any token the engine routed, prompt tokens too
      const flips = detail.trainer && detail.trainer.flips ? detail.trainer.flips[i] : 0;
      return flips > 0 ? `flip-${Math.min(flips, 3)}` : "plain";
    }
    if (!model) return "plain";
    if (mode === "logprob") return c.logprob[i] === null ? "plain" : `lp-${bucket(c.logprob[i], [-0.1, -0.7, -1.6, -3])}`;
    if (mode === "version") return `ver-${((c.version[i] % 6) + 6) % 6}${c.hybrid[i] ? " hybrid" : ""}`;
    const t = detail.trainer;
    if (!t || t.log_ratio[i] === null) return "plain";
    if (mode === "ratio") return `ratio-${4 - bucket(t.log_ratio[i], [0.2, 0.02, -0.02, -0.2])}`;
    if (mode === "mask") return t.keep[i] ? "keep" : "masked";
    return "plain";
  }

  function tokenCell(detail, mode, i, pins) {
    const c = detail.columns;
    const cell = document.createElement("span");
    cell.className = `tok ${tokenClass(detail, mode, i)}${c.special[i] ? " special" : ""}${pins.has(i) ? " pinned" : ""}`;
    cell.textContent = c.text[i];
    cell.dataset.pos = String(i);
    const lp = c.logprob[i] === null ? "" : ` logprob ${c.logprob[i].toFixed(3)} version ${c.version[i]}`;
    const ratio = detail.trainer && detail.trainer.log_ratio[i] !== null
      ? ` log π − log μ ${detail.trainer.log_ratio[i].toFixed(4)}` : "";
    const flips = detail.trainer && detail.trainer.flips && detail.trainer.flips[i] > 0
      ? ` experts flipped in ${detail.trainer.flips[i]} MoE layer(s)` : "";
    const pinned = pins.has(i) ? `\n${pins.get(i).join("\n")}` : "";
    cell.title = `#${i} id ${c.id[i]} ${["prompt", "env", "model"][c.source[i]]} turn ${c.turn[i]}${lp}${ratio}${flips}${pinned}`;
    return cell;
  }

  function turnRow(turn, problems) {
    const row = document.createElement("div");
    const opens = Boolean(turn.opens_segment);  // the first request after the agent rewrote its history
    row.className = `turn${turn.miss ? " miss" : ""}${opens ? " break" : ""}`;
    row.dataset.turn = String(turn.index);
    const cached = `cached ${turn.cached} · prefilled ${turn.prefilled}`;
    const said = problems.filter((p) => p.turn === turn.index).map((p) => `${p.kind}: ${p.detail}`);
    const prompt = turn.prompt_end - (turn.prompt_start || 0);
    row.textContent = (opens ? `HISTORY BREAK · segment ${turn.segment} · ` : "") +
      `request ${turn.index}: prompt ${prompt} tokens (${cached}) · ` +
      `completion ${turn.completion_end - turn.prompt_end} tokens, ${turn.finish_reason}` +
      (turn.replica ? ` · replica ${turn.replica}` : "") + (turn.miss ? " · CACHE MISS" : "") +
      (said.length ? ` · ${said.join(" | ")}` : "");
    row.title = row.textContent;
    return row;
  }

  function render(container, detail, mode) {
    const rows = layout(detail);
    const pins = new Map();
    for (const p of detail.problems) {
      if (p.position === null) continue;
      if (!pins.has(p.position)) pins.set(p.position, []);
      pins.get(p.position).push(`${p.kind}: ${p.detail}`);
    }
    const list = virtualList(container, rows.length, (r) => {
      const row = rows[r];
      if (row.turn) return turnRow(row.turn, detail.problems);
      const line = document.createElement("div");
      line.className = "tline";
      for (let i = row.start; i < row.end; i++) line.appendChild(tokenCell(detail, mode, i, pins));
      return line;
    });
    return {
      showPosition(pos) {
        const r = rows.findIndex((row) => !row.turn && row.start <= pos && pos < row.end);
        if (r >= 0) list.scrollToRow(Math.max(0, r - 2));
      },
    };
  }

  window.VerbatimTokens = { virtualList, render, tokenClass, LINE };
})();
