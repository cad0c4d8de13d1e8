/* The run page's "Layer RMS" chart: one uPlot series per captured layer id, from the page's run-data
   (progress milestones' layer_rms) and, live, from the ew:milestone events app.js dispatches. */
(function () {
  "use strict";
  if (typeof uPlot === "undefined") return;
  let box = null, empty = null;
  let points = [];  // [{at, rms: {id: value}}]
  let t0 = 0;  // the run's start: the x axis reads time since it, "+2m 05s"
  function since(v) {
    if (v < 10) return "+" + Math.max(0, v).toFixed(1) + "s";  // a short run's ticks stay apart
    const s = Math.max(0, Math.round(v));
    const pad = function (x) { return (x < 10 ? "0" : "") + x; };
    if (s < 60) return "+" + s + "s";
    if (s < 3600) return "+" + Math.floor(s / 60) + "m " + pad(s % 60) + "s";
    return "+" + Math.floor(s / 3600) + "h " + pad(Math.floor((s % 3600) / 60)) + "m";
  }
  const COLORS = ["#2458d6", "#d2691e", "#2e8b57", "#b22222", "#6a5acd", "#008b8b", "#8b008b", "#556b2f"];
  let plot = null;
  let shown = "";
  let pending = 0;

  function ids() {
    const set = new Set();
    points.forEach(function (p) { Object.keys(p.rms).forEach(function (k) { set.add(k); }); });
    return Array.from(set).sort(function (a, b) { return Number(a) - Number(b); });
  }
  // (Re)start on the page's section: the first render, or the one app.js swapped in (ew:parts).
  function start(data) {
    if (plot) plot.destroy();
    plot = null;
    shown = "";
    box = document.getElementById("chart-layers");
    empty = document.getElementById("chart-layers-empty");
    points = (data.layer_rms || []).slice();
    t0 = data.t0 || 0;
    draw();
  }
  function draw() {
    if (!box || !points.length) return;
    empty.hidden = true;
    const layers = ids();
    const cols = [points.map(function (p) { return p.at - t0; })];
    layers.forEach(function (id) {
      cols.push(points.map(function (p) { return typeof p.rms[id] === "number" ? p.rms[id] : null; }));
    });
    box.dataset.points = String(points.length);  // how many progress lines the chart holds
    if (plot && shown === layers.join(",")) { plot.setData(cols); return; }
    if (plot) plot.destroy();
    shown = layers.join(",");
    plot = new uPlot({
      width: Math.max(300, box.clientWidth || 600), height: 220,
      scales: { x: { time: false } },
      axes: [{ values: function (u, vals) { return vals.map(since); } }, { label: "RMS" }],
      series: [{ label: "since start", value: function (u, v) { return v == null ? "--" : since(v); } }].concat(layers.map(function (id, i) {
        return { label: "layer " + id, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true };
      })),
    }, cols, box);
  }
  document.addEventListener("ew:milestone", function (ev) {
    const m = ev.detail;
    const rms = m && m.kind === "progress" && m.fields ? m.fields.layer_rms : null;
    if (!rms || typeof rms !== "object" || !Object.keys(rms).length) return;
    points.push({ at: m.at, rms: rms });
    // one redraw per frame, not per milestone: the milestone's own <li> must not wait for the chart
    if (document.hidden) draw();
    else if (!pending) pending = requestAnimationFrame(function () { pending = 0; draw(); });
  });
  document.addEventListener("ew:parts", function (ev) { start(ev.detail); });
  window.addEventListener("resize", function () { if (plot) plot.setSize({ width: Math.max(300, box.clientWidth), height: 220 }); });
  start(JSON.parse(document.getElementById("run-data").textContent));
})();
