/* The run page's "Layer RMS" chart: one uPlot series per captured layer id, from the page's run-data
   (progress milestones' layer_rms) and, live, from the ew:milestone events app.js dispatches. */
(function () {
  "use strict";
  const box = document.getElementById("chart-layers");
  if (!box || typeof uPlot === "undefined") return;
  const data = JSON.parse(document.getElementById("run-data").textContent);
  const points = (data.layer_rms || []).slice();  // [{at, rms: {id: value}}]
  const empty = document.getElementById("chart-layers-empty");
  const COLORS = ["#2458d6", "#d2691e", "#2e8b57", "#b22222", "#6a5acd", "#008b8b", "#8b008b", "#556b2f"];
  let plot = null;
  let shown = "";
  let pending = 0;

  function ids() {
    const set = new Set();
    points.forEach(function (p) { Object.keys(p.rms).forEach(function (k) { set.add(k); }); });
    return Array.from(set).sort(function (a, b) { return Number(a) - Number(b); });
  }
  function draw() {
    if (!points.length) return;
    empty.hidden = true;
    const layers = ids();
    const cols = [points.map(function (p) { return p.at; })];
    layers.forEach(function (id) {
      cols.push(points.map(function (p) { return typeof p.rms[id] === "number" ? p.rms[id] : null; }));
    });
    box.dataset.points = String(points.length);  // how many progress lines the chart holds
    if (plot && shown === layers.join(",")) { plot.setData(cols); return; }
    if (plot) plot.destroy();
    shown = layers.join(",");
    plot = new uPlot({
      width: Math.max(300, box.clientWidth || 600), height: 220,
      scales: { x: { time: true } },
      axes: [{}, { label: "RMS" }],
      series: [{}].concat(layers.map(function (id, i) {
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
  window.addEventListener("resize", function () { if (plot) plot.setSize({ width: Math.max(300, box.clientWidth), height: 220 }); });
  draw();
})();
