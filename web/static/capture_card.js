/* The run page's capture card, kept current from the milestones app.js dispatches (ew:milestone):
   tokens from batch_captured (totals from completed), files, bytes, free space and ETA from progress. */
(function () {
  "use strict";
  const card = document.getElementById("capture-card");
  if (!card) return;
  function field(key) { return card.querySelector('[data-card="' + key + '"]'); }
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
  const tokensEl = field("tokens");
  let tokens = tokensEl && /^[\d,]+$/.test(tokensEl.textContent) ? Number(tokensEl.textContent.replace(/,/g, "")) : 0;
  let final = field("so-far") ? field("so-far").hidden : false;
  document.addEventListener("ew:milestone", function (ev) {
    const m = ev.detail;
    const f = (m && m.fields) || {};
    if (final) return;
    if (m.kind === "batch_captured" && typeof f.tokens === "number") {
      tokens += f.tokens;
      set("tokens", num(tokens));
    } else if (m.kind === "progress") {
      if (typeof f.files_written === "number") set("files", num(f.files_written));
      if (typeof f.bytes_written === "number") set("bytes", size(f.bytes_written));
      if (typeof f.free_bytes === "number") set("free", size(f.free_bytes));
      if (typeof f.eta_s === "number") set("eta", duration(f.eta_s));
    } else if (m.kind === "completed") {
      final = true;
      if (typeof f.tokens === "number") set("tokens", num(f.tokens));
      if (typeof f.files === "number") set("files", num(f.files));
      set("eta", "—");
      const sofar = field("so-far");
      if (sofar) sofar.hidden = true;
    }
  });
})();
