/* The run page's capture card, its running counts kept current between the server renders app.js swaps in:
   tokens from batch_captured, files, bytes, free space and ETA from progress (ew:milestone events). */
(function () {
  "use strict";
  // The card is looked up on each milestone: app.js swaps in the server's card when the run changes.
  function field(key) { return document.querySelector('#capture-card [data-card="' + key + '"]'); }
  function set(key, text) { const el = field(key); if (el) el.textContent = text; }
  function num(v) { return Math.round(v).toLocaleString("en-US"); }
  function size(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let v = n, i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return i === 0 ? num(n) + " B" : v.toFixed(1) + " " + units[i];
  }
  function duration(sec) {
    const s = Math.max(0, Math.round(sec));
    const pad = function (x) { return (x < 10 ? "0" : "") + x; };
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + pad(s % 60) + "s";
    return Math.floor(s / 3600) + "h " + pad(Math.floor((s % 3600) / 60)) + "m";
  }
  document.addEventListener("ew:milestone", function (ev) {
    const m = ev.detail;
    const f = (m && m.fields) || {};
    const sofar = field("so-far");
    if (!sofar || sofar.hidden) return;  // no card yet, or its totals are final
    if (m.kind === "batch_captured" && typeof f.tokens === "number") {
      const shown = field("tokens").textContent;
      set("tokens", num((/^[\d,]+$/.test(shown) ? Number(shown.replace(/,/g, "")) : 0) + f.tokens));
    } else if (m.kind === "progress") {
      if (typeof f.files_written === "number") set("files", num(f.files_written));
      if (typeof f.bytes_written === "number") set("bytes", size(f.bytes_written));
      if (typeof f.free_bytes === "number") set("free", size(f.free_bytes));
      if (typeof f.eta_s === "number") set("eta", duration(f.eta_s));
    }
  });
})();
