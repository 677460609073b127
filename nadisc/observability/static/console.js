// nadisc console: follows the owner over a WebSocket and renders the state.
// Plain DOM code, no framework; every value is written with textContent.
//
// The server sends the parts that changed (per service, per route, the
// overview) with their versions; a card is rebuilt only when its version
// moved, so selection and scroll survive updates elsewhere. Between
// messages only the age texts move. One message is in flight at a time
// (?ack=1): the page acks each one once it is applied.
"use strict";

(function () {
  const COLLAPSE_OVER = 20; // instances: larger cards start collapsed
  const BLOCK = 25; // instance rows per block of an open card
  const state = {
    now: 0, sampled: 0, receivedAt: 0, interval: 0.1, staleAfter: 3, seq: 0,
    overview: null, services: new Map(), routes: new Map(), connected: false,
  };
  const cards = new Map(); // service key -> {node, version, marks}
  const routeCards = new Map(); // route key -> {node, version}
  const expanded = new Set(); // service keys the user opened
  const recent = new Map(); // route key -> [{t, sent: Map}]
  const RECENT_SECONDS = 10;
  let filter = "";

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else if (key === "title") node.title = String(value);
      else if (key === "type") node.type = String(value);
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function pill(text, kind) { return el("span", { class: "pill " + (kind || "") }, text); }

  function bar(fraction, kind, title) {
    const width = Math.max(0, Math.min(1, fraction)) * 100;
    const fill = el("i", {});
    fill.style.width = width.toFixed(1) + "%"; // CSSOM: allowed by the page's CSP
    return el("span", { class: "bar " + (kind || ""), title: title }, fill);
  }

  function serverNow() { return state.now + (Date.now() - state.receivedAt) / 1000; }
  function dataAge() { return Math.max(0, serverNow() - state.sampled); }

  function seconds(value) {
    if (value === null || value === undefined) return "–";
    if (value < 1) return (value * 1000).toFixed(0) + " ms";
    if (value < 120) return value.toFixed(1) + " s";
    return (value / 60).toFixed(1) + " min";
  }

  const STATE_KIND = {
    active: "ok", published: "ok", prepared: "ok", frozen: "ok",
    pending: "info", preparing: "info", built: "info", quiescing: "warn", closing: "warn",
    unhealthy: "bad", outcome_unknown: "bad", residual: "bad", failed: "bad",
    deregistered: "", closed: "",
  };

  // ------------------------------------------------------------------ overview

  function renderOwner(o) {
    const box = document.getElementById("owner");
    const cap = o.capacity;
    const served = o.connections.reduce((sum, c) => sum + c.instances, 0);
    box.replaceChildren(
      el("span", {}, "phase ", pill(o.phase, STATE_KIND[o.phase])),
      el("span", {}, "prepared ", el("b", {}, o.prepared ? "yes" : "no")),
      el("span", {}, "tasks ", el("b", { class: "num" }, o.live_tasks)),
      el("span", { title: "instances in usable listings (held in admitted listings / limit)" },
        "instances served ", el("b", { class: "num", "data-served": served }, served),
        el("span", { class: "dim" }, " (held " + cap.instances[0] + " / " + cap.instances[1] + ")")),
      el("span", {}, "watch streams ", el("b", { class: "num" }, cap.watch_streams[0] + " / " + cap.watch_streams[1])),
      el("span", {}, "transport tasks ", el("b", { class: "num" }, cap.transport_tasks[0] + " / " + cap.transport_tasks[1])),
    );
  }

  function renderConnections(list) {
    const body = document.querySelector("#connections tbody");
    body.replaceChildren(...list.map((c) => {
      const failures = Object.entries(c.failures).map(([k, v]) => k + " " + v).join(", ") || "0";
      const prepared = c.prepared === null ? pill("pending", "info")
        : c.prepared ? pill("prepared", "ok") : pill("failed", "bad");
      const reason = c.prepare_error
        ? el("div", { class: "dim reason", "data-prepare-error": c.prepare_error_kind || "" },
          c.prepare_error)
        : null;
      return el("tr", { "data-connection": c.name },
        el("td", {}, el("b", {}, c.name)), el("td", {}, prepared, reason),
        el("td", { class: "num" }, c.services), el("td", { class: "num" }, c.instances),
        el("td", { class: "num" }, c.unavailable), el("td", { class: "num" }, c.queries),
        el("td", {}, failures), el("td", { class: "num" }, seconds(c.latency_avg)));
    }));
  }

  function renderRegistrations(list) {
    const body = document.querySelector("#registrations tbody");
    if (!list.length) {
      body.replaceChildren(el("tr", {}, el("td", { class: "dim" }, "no registrations")));
      return;
    }
    body.replaceChildren(...list.map((r) => el("tr", { "data-registration": r.name },
      el("td", {}, el("b", {}, r.name)), el("td", {}, r.connection),
      el("td", {}, pill(r.state, STATE_KIND[r.state]), r.residual_risk ? pill("residual risk", "bad") : null),
      el("td", {}, r.write), el("td", {}, r.health),
      el("td", { class: "num" }, r.renewals + (r.renewal_failures ? " (" + r.renewal_failures + " failed)" : "")),
      el("td", {}, r.last_error || "–"),
      el("td", {}, el("span", { class: "history" }, ...r.history.map(([t, s]) =>
        el("span", { class: "pill " + (STATE_KIND[s] || ""), title: "at " + seconds(t) }, s)))))));
  }

  function renderGrpc(list) {
    const body = document.querySelector("#grpc tbody");
    if (!list || !list.length) {
      body.replaceChildren(el("tr", {}, el("td", { class: "dim" }, "no gRPC discovery calls")));
      return;
    }
    body.replaceChildren(...list.map((g) => {
      const codes = g.codes.map(([k, v]) => k + " " + v).join(", ") || "0";
      return el("tr", { "data-grpc": g.connection },
        el("td", {}, el("b", {}, g.connection)), el("td", { class: "num" }, g.calls),
        el("td", {}, codes),
        el("td", { class: "num" }, g.p99 === null ? (g.calls ? "> 30 s" : "–") : "≤ " + seconds(g.p99)));
    }));
  }

  // ------------------------------------------------------------------ services

  function marks(endpoint) {
    const out = [];
    if (!endpoint) return out;
    if (endpoint.draining) out.push(pill("draining", "warn"));
    if (!endpoint.eligible) out.push(pill("ineligible", "warn"));
    if (endpoint.readiness === "failed") out.push(pill("quarantined", "bad"));
    return out;
  }

  function marksSignature(key) {
    const route = state.routes.get(key);
    if (!route) return "";
    return route.endpoints.map((e) => e.identity + ":" + (e.draining ? "d" : "") +
      (e.eligible ? "" : "i") + (e.readiness === "failed" ? "q" : "")).join(",");
  }

  function ageText(s, now) {
    if (s.confirmed_at === null) return { text: "never confirmed", fraction: 1, kind: "bad" };
    const age = Math.max(0, now - s.confirmed_at);
    const fraction = age / s.max_age;
    return {
      text: seconds(age) + " of " + seconds(s.max_age),
      fraction, kind: fraction >= 1 ? "bad" : fraction >= 0.75 ? "warn" : "",
    };
  }

  function matches(text) { return !filter || String(text).toLowerCase().includes(filter); }

  function serviceMatches(key, s) {
    if (!filter || matches(key)) return true;
    return s.instances.some((i) => matches(i.identity) || matches(i.address));
  }

  function cardHead(key, s) {
    const status = s.unavailable ? pill("unavailable: " + s.unavailable, "bad")
      : s.degraded ? pill("degraded", "warn") : pill("usable", "ok");
    const age = ageText(s, serverNow());
    const head = el("h3", {}, el("span", { class: "name" }, s.service),
      el("span", { class: "meta" }, "on " + s.connection), status,
      el("span", { class: "meta" }, "revision " + s.revision),
      el("span", { class: "meta" }, "evidence " + (s.evidence || "–")),
      el("span", { class: "meta", "data-count": s.instances.length }, s.instances.length + " instances"),
      el("span", { class: "age" }, bar(age.fraction, age.kind, "evidence age of max_age"), " ",
        el("span", { class: "num dim", "data-age": "" }, age.text)),
      s.last_failure ? pill("last failure: " + s.last_failure, "warn") : null,
      s.failure_reason ? el("span", { class: "dim reason", "data-failure-reason": "" },
        s.failure_reason) : null);
    if (s.instances.length > COLLAPSE_OVER) {
      const open = expanded.has(key);
      const toggle = el("button", { type: "button", class: "toggle" },
        open ? "collapse" : "show " + s.instances.length + " instances");
      toggle.addEventListener("click", () => {
        if (expanded.has(key)) expanded.delete(key); else expanded.add(key);
        rebuildService(key, true);
      });
      head.append(toggle);
    }
    return head;
  }

  function endpointSig(e) {
    return e ? (e.draining ? "d" : "") + (e.eligible ? "" : "i") + (e.readiness === "failed" ? "q" : "") : "";
  }

  // The rows of an open card, kept in step with the listing: a row whose
  // instance and marks did not change is the same DOM node as before (so a
  // selection inside it survives), a changed one is replaced where it stands.
  function syncRows(card, key, s) {
    const route = state.routes.get(key);
    const endpoints = new Map((route ? route.endpoints : []).map((e) => [e.identity, e]));
    const keyMatches = !filter || matches(key);
    const want = [];
    const next = new Map();
    const keep = (id, sig, build) => {
      let slot = id;
      for (let n = 1; next.has(slot); n++) slot = id + "\u0000" + n; // repeated identities
      const old = card.rows.get(slot);
      const tr = old && old.sig === sig ? old.tr : build();
      next.set(slot, { tr, sig });
      want.push(tr);
    };
    for (const i of s.instances) {
      if (!keyMatches && !(matches(i.identity) || matches(i.address))) continue;
      const e = endpoints.get(i.identity);
      keep(i.identity, "l" + i.address + "\u0000" + i.weight + "\u0000" + endpointSig(e), () =>
        el("tr", { "data-instance": i.identity },
          el("td", { class: "id" }, i.identity), el("td", { class: "num id" }, i.address),
          el("td", { class: "num" }, i.weight), el("td", {}, ...marks(e))));
    }
    if (endpoints.size) {
      const listed = new Set(s.instances.map((i) => i.identity));
      for (const e of endpoints.values()) {
        if (listed.has(e.identity)) continue;
        keep(e.identity, "e" + endpointSig(e), () =>
          el("tr", { "data-instance": e.identity, class: "dim" },
            el("td", { class: "id" }, e.identity), el("td", {}, "–"), el("td", {}, "–"),
            el("td", {}, ...marks(e))));
      }
    }
    // Rows that went away first, then insert the new ones in order: rows
    // kept are never moved (unless rows before them came or went).
    for (const [slot, old] of card.rows) {
      const now = next.get(slot);
      if (!now || now.tr !== old.tr) old.tr.remove();
    }
    // The rows sit in blocks of BLOCK, each a table of its own that the
    // browser lays out and paints only when it is on screen and changed
    // (content-visibility): one row changing in a 1,000-row card costs a
    // block, not the card.
    const blocks = Math.max(1, Math.ceil(want.length / BLOCK));
    while (card.blocks.length < blocks) {
      const tbody = el("tbody", {});
      const table = el("table", { class: "grid fixed instances" });
      if (!card.blocks.length) {
        table.append(el("thead", {}, el("tr", {}, ...["instance", "address", "weight", "marks"]
          .map((h) => el("th", {}, h)))));
      }
      table.append(tbody);
      card.node.append(el("div", { class: "block" }, table));
      card.blocks.push(tbody);
    }
    while (card.blocks.length > blocks) card.blocks.pop().closest(".block").remove();
    for (let b = 0; b < blocks; b++) {
      const body = card.blocks[b];
      let cursor = body.firstChild;
      for (let n = b * BLOCK; n < Math.min(want.length, (b + 1) * BLOCK); n++) {
        const tr = want[n];
        if (cursor === tr) { cursor = cursor.nextSibling; continue; }
        body.insertBefore(tr, cursor);
      }
      // What is left belongs to the blocks after this one (the rest was removed).
      const spill = [];
      while (cursor) { spill.push(cursor); cursor = cursor.nextSibling; }
      if (spill.length) card.blocks[b + 1].prepend(...spill);
    }
    card.rows = next;
  }

  function newCard(key) {
    const node = el("div", { class: "card", "data-service": key, "data-version": "" });
    return { node, head: null, blocks: [], rows: new Map(), version: -1, marks: "" };
  }

  // Bring one card up to its service: the head is rebuilt (a few elements),
  // the rows are reconciled one by one.
  function fillCard(card, key, s) {
    const head = cardHead(key, s);
    if (card.head) card.head.replaceWith(head); else card.node.prepend(head);
    card.head = head; card.age = null; card.fill = null; card.width = null;
    const open = s.instances.length <= COLLAPSE_OVER || expanded.has(key);
    if (open) syncRows(card, key, s);
    else if (card.blocks.length) {
      for (const body of card.blocks) body.closest(".block").remove();
      card.blocks = []; card.rows = new Map();
    }
    card.node.classList.toggle("large", s.instances.length > BLOCK);
    const hidden = !serviceMatches(key, s);
    if (card.node.hidden !== hidden) card.node.hidden = hidden;
    card.node.setAttribute("data-version", String(state.versions.get(key)));
  }

  function rebuildService(key, force) {
    const s = state.services.get(key);
    if (!s) { removeService(key); return; }
    let known = cards.get(key);
    const version = state.versions.get(key);
    const sig = marksSignature(key);
    if (!force && known && known.version === version && known.marks === sig) return;
    counts.rebuilt += 1;
    document.body.dataset.rebuilt = String(counts.rebuilt);
    if (!known) {
      known = newCard(key);
      cards.set(key, known);
      placeService(key, known.node);
      watcher.observe(known.node);
    }
    fillCard(known, key, s);
    known.version = version;
    known.marks = sig;
  }

  const order = []; // service keys of the cards, sorted

  function position(key) {
    let lo = 0, hi = order.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (order[mid] < key) lo = mid + 1; else hi = mid; }
    return lo;
  }

  function placeService(key, node) {
    const box = document.getElementById("services");
    const empty = box.querySelector("p.dim");
    if (empty) empty.remove();
    const at = position(key);
    const next = at < order.length ? cards.get(order[at]) : null;
    order.splice(at, 0, key);
    box.insertBefore(node, next ? next.node : null);
  }

  function removeService(key) {
    const known = cards.get(key);
    if (known) { watcher.unobserve(known.node); known.node.remove(); }
    onScreen.delete(key);
    cards.delete(key);
    const at = position(key);
    if (order[at] === key) order.splice(at, 1);
    if (!cards.size) {
      document.getElementById("services").replaceChildren(el("p", { class: "dim" }, "nothing observed yet"));
    }
  }

  function tickAge(key, now) {
    const card = cards.get(key);
    const s = state.services.get(key);
    if (!card || !s || card.node.hidden) return;
    if (!card.age) {
      card.age = card.node.querySelector("[data-age]");
      card.fill = card.node.querySelector(".age .bar");
    }
    const age = ageText(s, now === undefined ? serverNow() : now);
    if (card.age && card.age.textContent !== age.text) card.age.textContent = age.text;
    const width = (Math.max(0, Math.min(1, age.fraction)) * 100).toFixed(0) + "%";
    if (card.fill && card.width !== width) {
      card.width = width;
      card.fill.className = "bar " + age.kind;
      card.fill.firstChild.style.width = width;
    }
  }

  function tickAges() {
    const now = serverNow();
    for (const key of onScreen) tickAge(key, now);
  }

  // ------------------------------------------------------------------ routes

  function shares(key, route) {
    const now = serverNow();
    const sent = new Map(route.endpoints.map((e) => [e.identity, e.sent]));
    let list = recent.get(key) || [];
    list.push({ t: now, sent });
    list = list.filter((x) => now - x.t <= RECENT_SECONDS);
    recent.set(key, list);
    const base = list[0].sent;
    const delta = new Map();
    let total = 0;
    for (const [id, count] of sent) {
      const d = Math.max(0, count - (list.length > 1 ? (base.get(id) || 0) : 0));
      delta.set(id, d); total += d;
    }
    return { delta, total };
  }

  function failedCalls(failures) {
    // "3 failed (transport 2, status 1)": only the kinds that happened.
    const parts = Object.entries(failures || {}).filter(([, n]) => n > 0);
    if (!parts.length) return null;
    const total = parts.reduce((sum, [, n]) => sum + n, 0);
    return el("span", { class: "meta", "data-failures": String(total) },
      total + " failed (" + parts.map(([kind, n]) => kind.replace("_", " ") + " " + n).join(", ") + ")");
  }

  function routeCard(key, r) {
    const { delta, total } = shares(key, r);
    return el("div", { class: "card", "data-route": key },
      el("h3", {}, el("span", { class: "name" }, r.service), el("span", { class: "meta" }, "on " + r.connection),
        r.protocol === "grpc" ? pill("gRPC", "") : null,
        el("span", { class: "meta" }, r.calls + " calls"),
        el("span", { class: "meta" }, r.in_flight + " in flight"),
        failedCalls(r.failures),
        r.failed_endpoints ? pill(r.failed_endpoints + " quarantined", "bad") : null),
      el("table", { class: "grid fixed" },
        el("thead", {}, el("tr", {}, ...["endpoint", "in flight", "EWMA", "sent", "failed", "share of recent calls", "marks"]
          .map((h) => el("th", {}, h)))),
        el("tbody", {}, ...r.endpoints.slice(0, 200).map((e) => {
          const share = total ? (delta.get(e.identity) || 0) / total : 0;
          return el("tr", { "data-endpoint": e.identity },
            el("td", { class: "id" }, e.identity), el("td", { class: "num" }, e.in_flight),
            el("td", { class: "num" }, e.rtt === null ? "–" : seconds(e.rtt)),
            el("td", { class: "num" }, e.sent),
            el("td", { class: "num" }, e.failed || 0),
            el("td", {}, bar(share, "share"), " ", el("span", { class: "num dim" }, (share * 100).toFixed(0) + "%")),
            el("td", {}, ...marks(e)));
        }))));
  }

  function rebuildRoute(key) {
    const box = document.getElementById("routes");
    const empty = box.querySelector("p.dim");
    if (empty) empty.remove();
    const node = routeCard(key, state.routes.get(key));
    const known = routeCards.get(key);
    if (known) known.node.replaceWith(node); else box.append(node);
    routeCards.set(key, { node });
  }

  function removeRoute(key) {
    const known = routeCards.get(key);
    if (known) known.node.remove();
    routeCards.delete(key);
    if (!routeCards.size) {
      document.getElementById("routes").replaceChildren(el("p", { class: "dim" }, "no calls routed yet"));
    }
  }

  // ------------------------------------------------------------------ messages

  // Ages move every second: only the cards on screen follow them (a card
  // coming into view is brought up to date at once).
  const onScreen = new Set();
  const watcher = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      const key = entry.target.getAttribute("data-service");
      if (entry.isIntersecting) { onScreen.add(key); tickAge(key); } else onScreen.delete(key);
    }
  });

  const counts = { messages: 0, rebuilt: 0 }; // diagnostics, on the body's data-* attributes
  // Benchmarks set window.nadiscProfile = [] to get a timing per message and per frame
  // (and an entry per age timer, so tests can tell what each layout answered).
  let profile = null;
  Object.defineProperty(window, "nadiscProfile", {
    configurable: true, get: () => profile, set: (value) => { profile = Array.isArray(value) ? value : null; },
  });

  // What the next frame has to draw: messages only change the state and
  // mark what moved; one requestAnimationFrame writes the DOM for all of
  // them (a timer stands in when frames are not running, e.g. a hidden tab).
  const dirty = { services: new Set(), routes: new Set(), overview: false, stamped: false };
  let flushPending = false;
  let firstRenderPending = false;

  function scheduleFlush() {
    if (flushPending) return;
    flushPending = true;
    const timer = setTimeout(flush, 250);
    requestAnimationFrame(() => { clearTimeout(timer); flush(); });
  }

  function flush() {
    if (!flushPending) return;
    flushPending = false;
    const started = performance.now();
    if (dirty.overview && state.overview) {
      renderOwner(state.overview);
      renderConnections(state.overview.connections);
      renderRegistrations(state.overview.registrations);
      renderGrpc(state.overview.grpc);
    }
    const keys = [...dirty.services].sort();
    if (!cards.size && keys.length) {
      // First render: every card into one fragment, in order, one insertion.
      const fragment = document.createDocumentFragment();
      for (const key of keys) {
        const s = state.services.get(key);
        if (!s) continue;
        const card = newCard(key);
        fillCard(card, key, s);
        card.version = state.versions.get(key);
        card.marks = marksSignature(key);
        cards.set(key, card);
        order.push(key);
        fragment.append(card.node);
        watcher.observe(card.node);
      }
      if (cards.size) document.getElementById("services").replaceChildren(fragment);
    } else {
      for (const key of keys) rebuildService(key, false);
    }
    for (const key of dirty.routes) {
      if (state.routes.has(key)) rebuildRoute(key); else removeRoute(key);
    }
    if (dirty.stamped && cards.size) tickAges();
    dirty.services.clear(); dirty.routes.clear(); dirty.overview = false; dirty.stamped = false;
    document.body.setAttribute("data-seq", String(state.seq));
    document.body.dataset.messages = String(counts.messages);
    document.body.dataset.rebuilt = String(counts.rebuilt);
    freshness();
    if (profile) profile.push(["render", started, performance.now()]);
    if (firstRenderPending) {
      firstRenderPending = false;
      performance.mark("nadisc:applied");
      void document.body.offsetHeight; // include the layout in the measure
      // Milliseconds from the navigation to the first full render (for tests and benchmarks).
      document.body.dataset.firstRenderMs = performance.now().toFixed(1);
    }
  }

  function apply(message) {
    counts.messages += 1;
    state.now = message.now; state.sampled = message.sampled; state.receivedAt = Date.now();
    state.interval = message.interval; state.staleAfter = message.stale_after; state.seq = message.seq;
    if (message.type === "tick") { freshness(); return; }
    if (message.type === "full") {
      for (const key of [...state.services.keys()]) if (!(key in message.services)) { state.services.delete(key); dirty.services.add(key); }
      for (const key of [...state.routes.keys()]) if (!(key in message.routes)) { state.routes.delete(key); dirty.routes.add(key); }
      if (!document.body.dataset.firstRenderMs) firstRenderPending = true;
    }
    if (message.overview) { state.overview = message.overview; dirty.overview = true; }
    for (const [key, value] of Object.entries(message.routes || {})) {
      state.routes.set(key, value);
      dirty.routes.add(key);
      dirty.services.add(key); // the route's marks show on the service's rows
    }
    for (const key of message.removed_routes || []) { state.routes.delete(key); dirty.routes.add(key); dirty.services.add(key); }
    const changedCards = new Set(Object.keys(message.services));
    for (const [key, value] of Object.entries(message.services)) {
      const old = state.services.get(key);
      if (!("confirmed_at" in value)) value.confirmed_at = old ? old.confirmed_at : null;
      value.pieces = old ? old.pieces : new Map();
      state.services.set(key, value);
    }
    // Instances come in chunks: only the chunks that changed are sent.
    for (const [mark, chunk] of Object.entries(message.instances || {})) {
      const at = mark.lastIndexOf("#");
      const s = state.services.get(mark.slice(0, at));
      if (!s) continue;
      s.pieces.set(Number(mark.slice(at + 1)), chunk);
      changedCards.add(mark.slice(0, at));
    }
    for (const key of changedCards) {
      const s = state.services.get(key);
      if (!s) continue;
      for (const n of [...s.pieces.keys()]) if (n >= s.chunks) s.pieces.delete(n);
      const all = [];
      for (let n = 0; n < s.chunks; n++) for (const i of s.pieces.get(n) || []) all.push(i);
      s.instances = all;
      state.versions.set(key, (state.versions.get(key) || 0) + 1); // the card's own version
      dirty.services.add(key);
    }
    // Confirmed-at times move with every poll: only the age texts follow them.
    for (const [key, stamp] of Object.entries(message.confirmed || {})) {
      const s = state.services.get(key);
      if (s) { s.confirmed_at = stamp; dirty.stamped = true; }
    }
    for (const key of message.removed) { state.services.delete(key); state.versions.delete(key); dirty.services.add(key); }
    scheduleFlush();
  }
  state.versions = new Map();

  function setLink(text, kind) {
    const link = document.getElementById("link");
    if (link.textContent !== text) link.textContent = text;
    link.setAttribute("data-state", kind);
  }

  function freshness() {
    const age = state.receivedAt ? dataAge() : null;
    const stale = !state.connected || age === null || age > state.staleAfter;
    const label = age === null ? "no data yet" : "data " + seconds(age) + " old";
    const box = document.getElementById("age");
    if (box.textContent !== label) box.textContent = label;
    if (document.body.classList.contains("stale") !== stale) document.body.classList.toggle("stale", stale);
    const fresh = stale ? "no" : "yes";
    if (document.body.dataset.fresh !== fresh) document.body.dataset.fresh = fresh;
    if (state.connected) setLink(stale ? "stale" : "live", stale ? "stale" : "live");
  }

  function connect() {
    const url = new URL("ws", window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    url.hash = "";
    url.search = "?ack=1";
    const token = new URLSearchParams(window.location.hash.slice(1)).get("token");
    const socket = new WebSocket(url.href);
    socket.onopen = () => {
      if (token) socket.send(JSON.stringify({ token }));
      state.connected = true;
      performance.mark("nadisc:open");
      setLink("live", "live");
    };
    socket.onmessage = (event) => {
      if (!document.body.dataset.firstRenderMs) performance.mark("nadisc:first-message");
      const started = performance.now();
      const message = JSON.parse(event.data);
      const parsed = performance.now();
      apply(message);
      socket.send(JSON.stringify({ ack: message.seq }));
      if (profile) profile.push(["message", started, parsed, performance.now(), event.data.length]);
    };
    socket.onclose = () => {
      state.connected = false;
      setLink("disconnected · retrying", "closed");
      freshness();
      setTimeout(connect, 1000);
    };
  }

  document.getElementById("filter").addEventListener("input", (event) => {
    filter = event.target.value.trim().toLowerCase();
    for (const key of cards.keys()) rebuildService(key, true);
    tickAges();
  });

  setInterval(() => { // ages move between updates
    tickAges(); freshness();
    if (profile) profile.push(["timer", performance.now()]);
  }, 1000);
  connect();
})();
