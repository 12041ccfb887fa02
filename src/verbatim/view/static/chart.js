// Line charts drawn as SVG: one <circle class="point"> per value, text only through textContent.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (parent) parent.appendChild(node);
    return node;
  }
  function text(parent, x, y, value, anchor) {
    const node = el("text", { x, y, class: "label", "text-anchor": anchor || "start" }, parent);
    node.textContent = value;
    return node;
  }
  function fmt(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a >= 1000 || a < 0.01 ? v.toExponential(1) : String(+v.toFixed(a >= 10 ? 1 : 3));
  }
  // series: [{name, points: [[x, y], ...]}]; points with a null y are left out.
  function line(parent, title, series, opts) {
    const o = Object.assign({ width: 300, height: 150 }, opts || {});
    const box = document.createElement("div");
    box.className = "chart";
    box.dataset.chart = title;
    const h = document.createElement("h3");
    h.textContent = title;
    box.appendChild(h);
    const svg = el("svg", { width: o.width, height: o.height, viewBox: `0 0 ${o.width} ${o.height}` }, box);
    const pad = { l: 44, r: 8, t: 8, b: 34 };
    const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && Number.isFinite(p[1])));
    if (!all.length) {
      text(svg, o.width / 2, o.height / 2, "no values", "middle");
      parent.appendChild(box);
      return box;
    }
    let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * (o.width - pad.l - pad.r);
    const sy = (y) => o.height - pad.b - ((y - y0) / (y1 - y0)) * (o.height - pad.t - pad.b);
    for (const f of [0, 0.5, 1]) {
      const y = y0 + f * (y1 - y0);
      el("line", { x1: pad.l, x2: o.width - pad.r, y1: sy(y), y2: sy(y), class: "grid" }, svg);
      text(svg, pad.l - 4, sy(y) + 3, fmt(y), "end");
    }
    el("line", { x1: pad.l, x2: o.width - pad.r, y1: o.height - pad.b, y2: o.height - pad.b, class: "axis" }, svg);
    text(svg, pad.l, o.height - pad.b + 12, fmt(x0), "start");
    text(svg, o.width - pad.r, o.height - pad.b + 12, fmt(x1), "end");
    text(svg, (o.width + pad.l) / 2, o.height - pad.b + 12, o.xLabel || "step", "middle");
    series.forEach((s, k) => {
      const pts = s.points.filter((p) => p[1] !== null && Number.isFinite(p[1]));
      const group = el("g", { class: `s${k % 4}`, "data-series": s.name }, svg);
      if (pts.length > 1) {
        el("polyline", { class: `series s${k % 4}`, points: pts.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" ") }, group);
      }
      for (const p of pts) {
        const dot = el("circle", { class: "point", cx: sx(p[0]), cy: sy(p[1]), r: 2.8 }, group);
        el("title", {}, dot).textContent = `${s.name} step ${p[0]}: ${fmt(p[1])}`;
      }
      if (series.length > 1) {
        const lx = pad.l + k * 62;
        el("rect", { x: lx, y: o.height - 14, width: 8, height: 8, class: `s${k % 4}` }, svg);
        text(svg, lx + 11, o.height - 6, s.name).setAttribute("class", "label legend");
      }
    });
    parent.appendChild(box);
    return box;
  }
  window.VerbatimChart = { line };
})();
