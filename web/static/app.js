// eaglewatch live updates. Pages are server-rendered and readable without this file; it adds live
// updates over Server-Sent Events. Data is only ever inserted with textContent / createElement, never
// innerHTML, so log text and spec values stay inert.
"use strict";
(function () {
  const csrfMeta = document.querySelector('meta[name="csrf-token"]');
  const CSRF = csrfMeta ? csrfMeta.getAttribute("content") : "";
  const page = document.body.dataset.page || "";
  const liveEl = document.getElementById("live-status");
  const PERIODIC = new Set(["progress", "throughput", "batch_captured"]);
  const FOLDED = new Set(["engine_config", "shape_check_passed"]);  // one row each: web/timeline.py
  const ERR_RE = /error|traceback|exception|fatal|killed|out of memory/i;  // same rule as the controller's errors_only
  window.__ew = { milestones: 0, lastMilestoneAt: 0 };

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function setLive(state) {
    if (!liveEl) return;
    liveEl.textContent = state;
    liveEl.dataset.state = state;
    liveEl.hidden = false;  // shown only on pages that open a live connection
  }
  function num(v) {
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    return Math.abs(v) < 100 ? v.toFixed(2) : v.toFixed(1);
  }
  function since(ts, t0) {
    if (ts == null || t0 == null) return "";
    const d = Math.max(0, ts - t0);
    if (d < 60) return "+" + d.toFixed(1) + "s";
    const m = Math.floor(d / 60), s = d - m * 60;
    if (m < 60) return "+" + m + "m " + s.toFixed(1).padStart(4, "0") + "s";
    return "+" + Math.floor(m / 60) + "h " + String(m % 60).padStart(2, "0") + "m";
  }
  const LABELS = {
    gib: "GiB", memory_gib: "GiB", weights_gib: "GiB loaded", kv_tokens: "KV tokens", tokens: "tokens", ranks: "ranks",
    seconds: "s", samples_done: "samples", samples_total: "of", tokens_per_s: "tok/s", samples_per_s: "samples/s",
    files_written: "files", bytes_written: "bytes", root_cause: "root cause",
  };
  function gib(mib) { return typeof mib === "number" ? (mib / 1024).toFixed(1) : "?"; }

  // ---- browser notifications (opt-in), only while the tab is in the background
  const notifyBtn = document.getElementById("notify-btn");
  if (notifyBtn && "Notification" in window && Notification.permission === "default") {
    notifyBtn.hidden = false;
    notifyBtn.addEventListener("click", function () {
      Notification.requestPermission().then(function () { notifyBtn.hidden = true; });
    });
  }
  const notified = new Set();
  function notify(alert) {
    if (!alert || alert.acked || alert.muted || notified.has(alert.id)) return;
    notified.add(alert.id);
    if (document.hidden && "Notification" in window && Notification.permission === "granted") {
      new Notification("eaglewatch: " + String(alert.rule), { body: String(alert.message), tag: "ew-" + alert.id });
    }
  }

  // ---- a log block from the events stream: its lines, each with its offset.  Offsets not sent are the
  // natural ones: each line takes its UTF-8 length plus a newline (agent/protocol.py natural_offsets).
  function utf8Length(s) {
    let n = s.length;
    for (let i = 0; i < s.length; i++) {
      const c = s.charCodeAt(i);
      if (c >= 0x80) n += c < 0x800 || (c >= 0xd800 && c < 0xe000) ? 1 : 2;  // a surrogate pair: 4 bytes
    }
    return n;
  }
  function blockLines(d) {
    if (typeof d.text !== "string" || typeof d.offset !== "number") return [];
    const texts = d.text.split("\n");
    const given = Array.isArray(d.offsets) && d.offsets.length === texts.length ? d.offsets : null;
    const out = new Array(texts.length);
    let o = d.offset;
    for (let i = 0; i < texts.length; i++) {
      out[i] = { offset: given ? given[i] : o, text: texts[i] };
      o += utf8Length(texts[i]) + 1;
    }
    return out;
  }

  // ---- SSE connection: the browser resends Last-Event-ID itself on reconnect
  function connect(url, handlers) {
    const es = new EventSource(url);
    es.addEventListener("open", function () { setLive("live"); if (handlers.open) handlers.open(); });
    es.addEventListener("error", function () { setLive(es.readyState === 2 ? "offline" : "reconnecting"); });
    Object.keys(handlers).forEach(function (kind) {
      if (kind === "open") return;
      es.addEventListener(kind, function (ev) {
        let data;
        try { data = JSON.parse(ev.data); } catch (e) { return; }
        handlers[kind](data);
      });
    });
    es.addEventListener("end", function () {
      es.close();
      setLive("finished");
      // the last lines of a finished job may be committed just after its state: look once more, twice
      if (handlers.open) { handlers.open(); setTimeout(handlers.open, 1500); }
    });
    return es;
  }

  function setState(container, state, verdict) {
    const b = container.querySelector('[data-field="state"]');
    if (!b) return;
    b.textContent = state;
    b.className = "state state-" + state + (verdict === "problems" ? " verdict-problems" : "");
  }
  // The verdict beside the state badge, as web/templates/_state.html verdict_badge renders it.
  function setVerdictBadge(container, state, verdict, text) {
    let v = container.querySelector('[data-field="verdict-badge"]');
    if (!v) {
      v = el("span");
      v.dataset.field = "verdict-badge";
      container.querySelector('[data-field="state"]').after(" ", v);
    }
    v.className = "state verdict-" + (verdict || "none");
    v.title = text || "";
    v.textContent = verdict === "ok" ? "files ok" : verdict || "";
    v.hidden = !verdict || verdict === state;
  }
  // vLLM's JSON log records shown as the text line they stand for: web/filters.py log_text, and the agent's
  // agent/milestones/records.py json_record_lines.
  function logText(text) {
    if (text.charAt(0) !== "{") return text;
    let r;
    try { r = JSON.parse(text); } catch (e) { return text; }
    if (!r || typeof r !== "object" || typeof r.message !== "string" || typeof r.levelname !== "string" || !/^[A-Za-z]+$/.test(r.levelname)) return text;
    const proc = r.processName, pid = r.process;
    const prefix = typeof proc === "string" && proc !== "MainProcess" && /^[A-Za-z][\w.-]*$/.test(proc) && Number.isInteger(pid) ? "(" + proc + " pid=" + pid + ") " : "";
    const when = /^(?:\d{4}-)?(\d\d-\d\d)[ T](\d\d:\d\d:\d\d)/.exec(String(r.asctime || ""));
    const where = String(r.filename || r.name || "?").replace(/ /g, "_");
    const head = prefix + r.levelname.toUpperCase() + " " + (when ? when[1] + " " + when[2] : "00-00 00:00:00") + " [" + where + ":" + (Number.isInteger(r.lineno) ? r.lineno : 0) + "] ";
    let body = r.message.split(/\r\n|\r|\n/);
    if (typeof r.exc_info === "string") body = body.concat(r.exc_info.split(/\r\n|\r|\n/));
    return body.map(function (b) { return head + b; }).join(" ⏎ ");
  }
  function progressNodes(p) {
    const span = el("span");
    span.dataset.field = "progress";
    if (p && typeof p.samples_done === "number") {
      if (typeof p.samples_total === "number" && p.samples_total > 0) {
        const bar = el("progress");
        bar.max = 100;
        bar.value = Math.min(100, (100 * p.samples_done) / p.samples_total);
        span.append(bar, " ", el("span", "muted", num(p.samples_done) + "/" + num(p.samples_total)));
      } else {
        span.append(num(p.samples_done) + " samples");
      }
      if (typeof p.tokens_per_s === "number") span.append(" ", el("span", "muted", "· " + num(p.tokens_per_s) + " tok/s"));
    } else {
      span.append(el("span", "muted", "—"));
    }
    return span;
  }
  function gpuList(ul, gpus) {
    ul.replaceChildren();
    if (!gpus || !gpus.length) { ul.append(el("li", "muted", "no GPUs reported")); return; }
    gpus.forEach(function (g) {
      const li = el("li");
      const m = el("meter");
      m.min = 0; m.max = g.memory_total_mib || 1; m.value = g.memory_used_mib || 0;
      li.append(el("span", null, "GPU " + g.index + " " + (g.name || "")), m,
        el("span", "muted", gib(g.memory_used_mib) + "/" + gib(g.memory_total_mib) + " GiB · " + g.utilization_pct + "%"));
      ul.append(li);
    });
  }

  // ---- dashboard
  function dashboard() {
    const tbody = document.querySelector("#runs tbody");
    // a run not shown yet is new: it belongs on the first page only (older pages show older runs)
    const firstPage = (new URLSearchParams(location.search).get("page") || "1") === "1";
    function runRow(r) {
      let tr = tbody.querySelector('tr[data-run="' + CSS.escape(r.id) + '"]');
      if (!tr && !firstPage) return;
      if (!tr) {
        const empty = tbody.querySelector("tr.empty");
        if (empty) empty.remove();
        tr = el("tr");
        tr.dataset.run = r.id;
        const a = el("a", null, r.name);
        a.href = "/runs/" + encodeURIComponent(r.id);
        const c0 = el("td"); c0.append(a, el("div", "muted small", r.id));
        const st = el("td"); const b = el("span", "state", r.state); b.dataset.field = "state"; st.append(b);
        const model = el("td", "path"); model.dataset.field = "model";
        const prog = el("td"); prog.append(progressNodes(null));
        const last = el("td"); last.dataset.field = "last_milestone";
        const al = el("td"); al.dataset.field = "open_alerts";
        const created = el("td", "small", new Date(r.created_at * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC");
        tr.append(c0, st, el("td", null, r.host), model, prog, last, al, created);
        tbody.prepend(tr);
      }
      setState(tr, r.state, r.verdict);
      setVerdictBadge(tr, r.state, r.verdict, r.verdict_text);
      let note = tr.querySelector('[data-field="verdict"]');
      if (!note) {
        note = el("div", "small verdict-note");
        note.dataset.field = "verdict";
        tr.querySelector('[data-field="verdict-badge"]').after(note);
      }
      note.textContent = r.verdict === "problems" ? r.verdict_text || "" : "";
      note.hidden = r.verdict !== "problems";
      tr.querySelector('[data-field="model"]').textContent = r.model || r.backend || "";
      const pc = tr.querySelector('[data-field="progress"]');
      if (pc) pc.replaceWith(progressNodes(r.progress));
      tr.querySelector('[data-field="last_milestone"]').textContent = r.last_milestone || "—";
      const al = tr.querySelector('[data-field="open_alerts"]');
      al.textContent = String(r.open_alerts || 0);
      al.className = r.open_alerts ? "alerting" : "";
    }
    function hostCard(h) {
      const card = document.querySelector('article[data-host="' + CSS.escape(h.name) + '"]');
      if (!card) return;
      const r = card.querySelector('[data-field="reachable"]');
      const key = h.reachable == null ? "unknown" : h.reachable ? "yes" : "no";
      r.className = "reach reach-" + key;
      r.textContent = h.reachable == null ? "unknown" : h.reachable ? "reachable" : "unreachable";
      gpuList(card.querySelector('[data-field="gpus"]'), h.gpus);
      // host events from the store carry no route (it is per controller process): only the API's do
      const route = card.querySelector('[data-field="link_route"]');
      if (route && h.link_route) {
        route.textContent = "link: " + h.link_route + (h.link_route_reason ? " (" + h.link_route_reason + ")" : "");
        route.hidden = false;
      }
    }
    function catchUp() {
      // changes between rendering and the stream's start: re-read the lists once the stream is open
      fetch("/api/runs", { credentials: "same-origin" }).then(function (r) { return r.ok ? r.json() : []; })
        .then(function (runs) { runs.slice().reverse().forEach(runRow); }).catch(function () {});
      fetch("/api/hosts", { credentials: "same-origin" }).then(function (r) { return r.ok ? r.json() : []; })
        .then(function (hosts) { hosts.forEach(hostCard); }).catch(function () {});
    }
    connect("/api/events?after=now", { open: catchUp, run: runRow, host: hostCard, alert: notify });
  }

  // ---- charts: inline SVG polylines, no library
  const SVGNS = "http://www.w3.org/2000/svg";
  function drawChart(svg, series, unit, t0) {
    if (!svg) return;
    const W = 600, H = 160, L = 44, B = 18, T = 8, R = 8;
    svg.replaceChildren();
    series = series.filter(function (s) { return s.points.length > 0; });
    const pts = series.flatMap(function (s) { return s.points; });
    if (pts.length < 1) {
      const t = document.createElementNS(SVGNS, "text");
      t.setAttribute("x", "50%"); t.setAttribute("y", "50%"); t.setAttribute("text-anchor", "middle");
      t.textContent = "no data yet";
      svg.append(t);
      return;
    }
    // loops, not Math.min.apply: a live page can gather more samples than a call may take arguments
    let x0 = Infinity, x1 = -Infinity;
    pts.forEach(function (p) { if (p[0] < x0) x0 = p[0]; if (p[0] > x1) x1 = p[0]; });
    series.forEach(function (s) {
      let ymax = 1e-9;
      s.points.forEach(function (p) { if (p[1] > ymax) ymax = p[1]; });
      const sx = function (x) { return L + ((x - x0) / Math.max(1e-9, x1 - x0)) * (W - L - R); };
      const sy = function (y) { return H - B - (y / ymax) * (H - B - T); };
      const pl = document.createElementNS(SVGNS, "polyline");
      pl.setAttribute("class", s.cls);
      pl.setAttribute("points", s.points.map(function (p) { return sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1); }).join(" "));
      svg.append(pl);
      const lab = document.createElementNS(SVGNS, "text");
      lab.setAttribute("x", "2"); lab.setAttribute("y", String(T + 8 + 12 * series.indexOf(s)));
      lab.setAttribute("class", s.cls + "-label");
      lab.textContent = s.label + " max " + num(ymax) + (unit || "");
      svg.append(lab);
    });
    const axis = document.createElementNS(SVGNS, "line");
    axis.setAttribute("class", "axis");
    axis.setAttribute("x1", String(L)); axis.setAttribute("x2", String(W - R));
    axis.setAttribute("y1", String(H - B)); axis.setAttribute("y2", String(H - B));
    svg.append(axis);
    // the time axis: where it starts and ends, as time since the run started
    [[L, "start", x0], [W - R, "end", x1]].forEach(function (t) {
      const tl = document.createElementNS(SVGNS, "text");
      tl.setAttribute("x", String(t[0])); tl.setAttribute("y", String(H - 4)); tl.setAttribute("text-anchor", t[1]);
      tl.textContent = since(t[2], t0);
      svg.append(tl);
    });
  }

  // ---- virtualised log viewer: only the rows in view exist in the DOM
  function LogView(box, inner, info) {
    const ROW = 18, MAX = 200000;
    let all = [], view = all, filter = null, paused = false, frozen = 0, follow = true, raf = 0;
    const seen = new Set();
    box.classList.add("virtual");
    inner.querySelectorAll(".ln").forEach(function (d) {
      const o = Number(d.dataset.offset);
      all.push({ o: o, t: d.textContent });
      seen.add(o);
    });
    function matches(line) {
      if (!filter) return true;
      if (filter.errors && !ERR_RE.test(line.t)) return false;
      return !filter.q || line.t.toLowerCase().indexOf(filter.q) >= 0;
    }
    // The rows on screen are view[shownFirst, shownLast), in order: a frame adds and drops only the rows
    // that enter and leave the window (a followed log gains a row or two), not all of them.
    let shownFirst = 0, shownLast = 0, rebuild = true;
    function row(i) {
      const line = view[i];
      const d = el("div", ERR_RE.test(line.t) ? "ln err" : "ln", line.t);
      d.style.top = i * ROW + "px";
      d.dataset.offset = String(line.o);
      if (line.t.length > 120) d.title = line.t;  // a row is cut at the box's edge: the whole line on hover
      return d;
    }
    function render() {
      raf = 0;
      const n = paused ? Math.min(frozen, view.length) : view.length;  // paused: the view stays as it was
      inner.style.height = n * ROW + "px";
      if (follow && !paused) box.scrollTop = box.scrollHeight;
      const first = Math.max(0, Math.floor(box.scrollTop / ROW) - 20);
      const last = Math.min(n, first + Math.ceil(box.clientHeight / ROW) + 40);
      if (rebuild || first >= shownLast || last <= shownFirst || inner.childElementCount !== shownLast - shownFirst) {
        rebuild = false;
        const frag = document.createDocumentFragment();
        for (let i = first; i < last; i++) frag.append(row(i));
        inner.replaceChildren(frag);
      } else {
        for (; shownFirst < first; shownFirst++) inner.firstElementChild.remove();
        for (; shownLast > last; shownLast--) inner.lastElementChild.remove();
        const head = document.createDocumentFragment(), tail = document.createDocumentFragment();
        for (let i = first; i < shownFirst; i++) head.append(row(i));
        for (let i = shownLast; i < last; i++) tail.append(row(i));
        inner.prepend(head);
        inner.append(tail);
      }
      shownFirst = first;
      shownLast = last;
      const pending = view.length - n;
      info.textContent = n.toLocaleString("en-US") + " lines" + (filter ? " (filtered)" : "") +
        (paused ? " · paused" + (pending ? ", " + pending + " new" : "") : "");
    }
    function schedule() { if (!raf) raf = requestAnimationFrame(render); }
    box.addEventListener("scroll", function () {
      follow = box.scrollTop + box.clientHeight >= box.scrollHeight - ROW * 2;
      schedule();
    });
    return {
      add: function (lines) {
        let added = 0;
        lines.forEach(function (l) {
          if (seen.has(l.offset)) return;
          seen.add(l.offset);
          const line = { o: l.offset, t: logText(String(l.text)) };
          all.push(line);
          if (view !== all && matches(line)) view.push(line);
          added++;
        });
        if (added && all.length > added && all[all.length - added - 1].o > all[all.length - added].o) {
          all.sort(function (a, b) { return a.o - b.o; });  // a catch-up page raced the live stream
          if (view !== all) view.sort(function (a, b) { return a.o - b.o; });
          rebuild = true;
        }
        if (all.length > MAX) { all.splice(0, all.length - MAX); rebuild = true; }
        if (added) schedule();
      },
      lastOffset: function () { return all.length ? all[all.length - 1].o : -1; },
      setPaused: function (p) { paused = p; frozen = view.length; if (!p) follow = true; schedule(); },
      setFilter: function (f, serverLines) {
        filter = f && (f.q || f.errors) ? f : null;
        if (!filter) { view = all; }
        else {
          const merged = new Map();
          (serverLines || []).forEach(function (l) { merged.set(l.offset, { o: l.offset, t: logText(String(l.text)) }); });
          all.forEach(function (l) { if (matches(l)) merged.set(l.o, l); });
          view = Array.from(merged.values()).sort(function (a, b) { return a.o - b.o; });
        }
        follow = true;
        frozen = view.length;
        rebuild = true;
        schedule();
      },
      render: schedule,
    };
  }

  // ---- run page
  function runPage() {
    const dataEl = document.getElementById("run-data");
    const data = JSON.parse(dataEl.textContent);
    const runId = data.run_id;
    const base = "/api/runs/" + encodeURIComponent(runId);
    let timeline = document.getElementById("timeline");
    const seqs = new Set();  // shown live in the timeline since the page (or its parts) was rendered
    const charted = new Set();  // progress samples added to the chart live
    const recent = [];  // milestones received live: those newer than a swapped-in render go back in
    const progress = data.progress.slice();
    const gpuSeries = new Map();
    const now = Date.now() / 1000;
    (data.gpus || []).forEach(function (g) { gpuSeries.set(g.index, [[now, g.memory_used_mib || 0]]); });

    function drawProgress() {
      const sps = [], tps = [];
      for (let i = 0; i < progress.length; i++) {
        const p = progress[i];
        if (typeof p.samples_per_s === "number") sps.push([p.at, p.samples_per_s]);
        else if (i > 0 && typeof p.samples_done === "number" && typeof progress[i - 1].samples_done === "number" && p.at - progress[i - 1].at >= 0.05) {
          sps.push([p.at, (p.samples_done - progress[i - 1].samples_done) / (p.at - progress[i - 1].at)]);
        }
        if (typeof p.tokens_per_s === "number") tps.push([p.at, p.tokens_per_s]);
      }
      drawChart(document.getElementById("chart-progress"), [
        { points: sps, cls: "s1", label: "samples/s" }, { points: tps, cls: "s2", label: "tokens/s" },
      ], "", data.t0);
    }
    function drawGpu() {
      const series = [];
      let i = 0;
      gpuSeries.forEach(function (pts, idx) {
        series.push({ points: pts.map(function (p) { return [p[0], p[1] / 1024]; }), cls: "s" + ((i++ % 4) + 1), label: "GPU " + idx });
      });
      drawChart(document.getElementById("chart-gpu"), series, " GiB", data.t0);
    }
    drawProgress();
    drawGpu();

    // A milestone's <li> goes in at once; what costs a layout or a redraw (trimming old progress entries,
    // scrolling, the chart) waits for the next frame, once for however many milestones came before it.
    let tidyPending = 0, progressChanged = false, trim = false;
    // The progress chart is rebuilt from every sample: at most once a second (the newest sample always
    // drawn within it), so that a milestone arriving meanwhile does not wait behind a redraw.
    const CHART_EVERY_MS = 1000;
    let chartTimer = 0, chartDrawnAt = -Infinity;
    function scheduleChart() {
      if (chartTimer) return;
      chartTimer = setTimeout(function () {
        chartTimer = 0;
        chartDrawnAt = performance.now();
        drawProgress();
      }, Math.max(0, chartDrawnAt + CHART_EVERY_MS - performance.now()));
    }
    function tidyTimeline() {
      tidyPending = 0;
      if (trim) {
        // keep the DOM small through a long night: old progress entries live on in the chart
        trim = false;
        const periodic = timeline.querySelectorAll("li.ms-progress, li.ms-throughput, li.ms-batch_captured");
        // as many as the server renders (web/pages.py timeline_window), so a reload shows the same list
        for (let k = 0; k < periodic.length - 20; k++) periodic[k].remove();
      }
      timeline.scrollTop = timeline.scrollHeight;
      if (progressChanged) { progressChanged = false; scheduleChart(); }
    }
    const firstSeq = data.milestone_seq;
    function milestoneSeen() {
      const count = data.milestone_count + seqs.size;
      document.getElementById("milestone-count").textContent = String(count);
      window.__ew.milestones = count;
      window.__ew.lastMilestoneAt = performance.now();
    }
    function addMilestone(m) {
      if (m.seq <= data.milestone_seq || seqs.has(m.seq)) return;  // known when the page was rendered
      seqs.add(m.seq);
      if (recent.push(m) > 2000) recent.shift();
      if (!PERIODIC.has(m.kind)) refreshSoon();
      if (FOLDED.has(m.kind)) { milestoneSeen(); return; }  // its folded row comes with the server's parts
      const empty = timeline.querySelector("li.empty");
      if (empty) empty.remove();
      const li = el("li", "ms ms-" + m.kind);
      li.dataset.seq = String(m.seq);
      li.append(el("span", "t", since(m.at, data.t0)), " ", el("span", "kind", m.kind));
      if (m.rank !== null && m.rank !== undefined) li.append(" ", el("span", "rank", "rank " + m.rank));
      const fields = el("span", "fields");
      Object.keys(m.fields || {}).sort(function (a, b) {
        return (LABELS[a] ? 0 : 1) - (LABELS[b] ? 0 : 1) || (a < b ? -1 : a > b ? 1 : 0);
      }).forEach(function (k) {
        if (k === "rule" || k === "processes") return;
        const v = m.fields[k];
        const f = el("span", "f");
        f.append(el("b", null, LABELS[k] || k.replace(/_/g, " ")), " ",
          Array.isArray(v) ? v.join(", ") : v !== null && typeof v === "object" ? JSON.stringify(v) : num(v));
        fields.append(f, " ");
      });
      li.append(" ", fields);
      if (m.text && m.text.indexOf("EAGLEWATCH ") !== 0) li.append(el("div", "text", m.text));
      timeline.append(li);
      if (PERIODIC.has(m.kind)) trim = true;
      milestoneSeen();
      if ((m.kind === "progress" || m.kind === "throughput") && m.fields && m.seq > firstSeq && !charted.has(m.seq)) {
        charted.add(m.seq);
        const p = { at: m.at };
        Object.keys(m.fields).forEach(function (k) { if (typeof m.fields[k] === "number") p[k] = m.fields[k]; });
        progress.push(p);
        progressChanged = true;
      }
      if (document.hidden) tidyTimeline();  // no frames come to a background tab
      else if (!tidyPending) tidyPending = requestAnimationFrame(tidyTimeline);
      document.dispatchEvent(new CustomEvent("ew:milestone", { detail: m }));  // for layer_chart.js
    }
    const shardTable = document.getElementById("shards");
    function refreshShards() {
      // a sharded run's "run" event carries the aggregate only: its shard rows come from GET /api/runs/{id}
      fetch(base, { credentials: "same-origin" }).then(function (res) { return res.ok ? res.json() : null; }).then(function (d) {
        (d && d.shards || []).forEach(function (s) {
          const row = shardTable.querySelector('tr[data-shard="' + s.index + '"]');
          if (!row) return;
          setState(row, s.state, null);
          const pc = row.querySelector('[data-field="progress"]');
          if (pc) pc.replaceWith(progressNodes(s.progress));
          row.querySelector('[data-cell="milestone"]').textContent = s.last_milestone || "—";
        });
      }).catch(function () { /* the next event tries again */ });
    }
    let runKey = "";
    function onRun(r) {
      if (shardTable) refreshShards();
      const pc = document.querySelector('#progress [data-field="progress"]');
      if (pc) pc.replaceWith(progressNodes(r.progress));
      const key = [r.state, r.verdict, r.verdict_text, r.failure_reason].join("|");  // not its progress
      if (key === runKey) return;
      const first = !runKey;
      runKey = key;
      if (!(first && data.terminal)) refreshSoon();  // a page rendered after the end is already the last word
    }
    function onAlert(a) {
      notify(a);
      refreshSoon();
    }

    // What a reload shows is what the server renders: the parts of the page that a run's state, checks,
    // alerts and milestones change are fetched whole from the page's own URL and swapped in, so the page
    // watched live and the page reloaded come from one renderer.  At most one fetch at a time, and one
    // more after it when something changed meanwhile.
    const PARTS = ["run-head", "run-facts", "run-capture", "verdict", "alert-banner", "milestones-card", "checks-card"];
    let refreshTimer = 0, refreshing = false, refreshAgain = false;
    function refreshSoon() {
      if (refreshing) { refreshAgain = true; return; }
      if (!refreshTimer) refreshTimer = setTimeout(refreshNow, 250);
    }
    function refreshNow() {
      refreshTimer = 0;
      refreshing = true;
      fetch(location.pathname + location.search, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) { if (html) swapParts(new DOMParser().parseFromString(html, "text/html")); })
        .catch(function () { /* the next event tries again */ })
        .finally(function () {
          refreshing = false;
          if (refreshAgain) { refreshAgain = false; refreshSoon(); }
        });
    }
    function openKeys(node) {
      // which <details> the reader opened, by the row or section they belong to
      return new Set(Array.from(node.querySelectorAll("details[open]")).map(function (d) {
        const k = d.closest("[data-code],[data-seq],[id]");
        return k ? k.dataset.code || k.dataset.seq || k.id : "";
      }));
    }
    function swapParts(doc) {
      const fresh = JSON.parse(doc.getElementById("run-data").textContent);
      PARTS.forEach(function (id) {
        const now = document.getElementById(id), next = doc.getElementById(id);
        if (!now || !next) return;
        const open = openKeys(now);
        next.querySelectorAll("details").forEach(function (d) {
          const k = d.closest("[data-code],[data-seq],[id]");
          if (k && open.has(k.dataset.code || k.dataset.seq || k.id)) d.open = true;
        });
        now.replaceWith(document.adoptNode(next));
      });
      timeline = document.getElementById("timeline");
      timeline.scrollTop = timeline.scrollHeight;
      data.milestone_seq = fresh.milestone_seq;
      data.milestone_count = fresh.milestone_count;
      seqs.clear();
      document.dispatchEvent(new CustomEvent("ew:parts", { detail: fresh }));  // for layer_chart.js
      const newer = recent.filter(function (m) { return m.seq > fresh.milestone_seq; });
      recent.length = 0;
      newer.forEach(addMilestone);
      window.__ew.milestones = data.milestone_count + seqs.size;
      window.__ew.swaps = (window.__ew.swaps || 0) + 1;
    }
    function onHost(h) {
      const now = document.getElementById("gpu-now");
      if (!now) return;  // a host without GPUs has no GPU panel
      gpuList(now, h.gpus);
      const t = Date.now() / 1000;
      (h.gpus || []).forEach(function (g) {
        if (!gpuSeries.has(g.index)) gpuSeries.set(g.index, []);
        const pts = gpuSeries.get(g.index);
        pts.push([t, g.memory_used_mib || 0]);
        if (pts.length > 2000) pts.shift();
      });
      drawGpu();
    }

    // log viewer
    const log = LogView(document.getElementById("log"), document.getElementById("log-inner"), document.getElementById("log-info"));
    const pauseBtn = document.getElementById("log-pause");
    pauseBtn.hidden = false;
    let paused = false;
    pauseBtn.addEventListener("click", function () {
      paused = !paused;
      pauseBtn.textContent = paused ? "Resume" : "Pause";
      log.setPaused(paused);
    });
    const form = document.getElementById("log-controls");
    const qIn = document.getElementById("log-q");
    const errIn = document.getElementById("log-errors");
    function applyFilter() {
      const f = { q: qIn.value.trim().toLowerCase(), errors: errIn.checked };
      if (!f.q && !f.errors) { log.setFilter(null); return; }
      const params = new URLSearchParams({ limit: "2000" });
      if (f.q) params.set("q", qIn.value.trim());
      if (f.errors) params.set("errors_only", "true");
      fetch(base + "/log?" + params.toString(), { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : []; })
        .then(function (lines) { log.setFilter(f, lines); })
        .catch(function () { log.setFilter(f, []); });
    }
    form.addEventListener("submit", function (ev) { ev.preventDefault(); applyFilter(); });
    errIn.addEventListener("change", applyFilter);
    let qTimer = 0;
    qIn.addEventListener("input", function () { clearTimeout(qTimer); qTimer = setTimeout(applyFilter, 250); });
    if (qIn.value || errIn.checked) applyFilter();
    else log.render();

    // catch up what happened between rendering and the stream's start, then live
    function catchUp() {
      const after = Math.max(data.log_last, log.lastOffset());
      fetch(base + "/log?after=" + encodeURIComponent(String(after)) + "&limit=5000", { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : []; }).then(function (lines) { log.add(lines); }).catch(function () {});
      fetch(base, { credentials: "same-origin" }).then(function (r) { return r.ok ? r.json() : null; }).then(function (run) {
        if (!run) return;
        run.milestones.forEach(addMilestone);
        run.alerts.forEach(notify);
        onRun(run);
      }).catch(function () {});
    }
    connect(base + "/events?after=now", {
      open: catchUp, milestone: addMilestone, run: onRun, check: refreshSoon, alert: onAlert, host: onHost,
      log: function (d) { log.add(blockLines(d)); },
    });
  }

  if (page === "dashboard") dashboard();
  else if (page === "run") runPage();
  else if (page === "alerts") connect("/api/events?after=now", { alert: alertRow });

  // ---- alerts page: new alerts appear on top, with their buttons
  function alertRow(a) {
    notify(a);
    const tbody = document.querySelector("#alerts tbody");
    if (!tbody || tbody.querySelector('tr[data-alert="' + CSS.escape(String(a.id)) + '"]')) return;
    const empty = tbody.querySelector("tr.empty");
    if (empty) empty.remove();
    const tr = el("tr", "sev-" + a.severity);
    tr.dataset.alert = String(a.id);
    const runCell = el("td");
    if (a.run_id) {
      const link = el("a", null, a.run_id);
      link.href = "/runs/" + encodeURIComponent(a.run_id);
      runCell.append(link, " ");
    }
    runCell.append(a.host || "");
    const what = el("td");
    what.append(el("strong", null, a.rule), " — " + String(a.message));
    const buttons = el("td", "buttons");
    ["ack", "mute"].forEach(function (action) {
      const f = el("form", "inline");
      f.method = "post";
      f.action = "/alerts/" + encodeURIComponent(String(a.id)) + "/" + action;
      const hidden = el("input");
      hidden.type = "hidden"; hidden.name = "csrf_token"; hidden.value = CSRF;
      f.append(hidden, el("button", "small", action === "ack" ? "Acknowledge" : "Mute"));
      buttons.append(f, " ");
    });
    const when = new Date(a.created_at * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
    tr.append(el("td", "small", when), el("td", null, null), runCell, what, el("td", null, "open"), buttons);
    tr.children[1].append(el("span", "sev", a.severity));
    tbody.prepend(tr);
  }
  window.__ew.csrf = CSRF;
})();
