// nadisc console: follows the owner over a WebSocket and renders the state.
// Plain DOM code, no framework; every value is written with textContent.
"use strict";

(function () {
  const state = { now: 0, receivedAt: 0, overview: null, services: new Map() };
  const recent = new Map(); // route key -> [{t, sent: Map}]
  const RECENT_SECONDS = 10;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else if (key === "title") node.title = String(value);
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

  function renderOwner(o) {
    const box = document.getElementById("owner");
    const cap = o.capacity;
    box.replaceChildren(
      el("span", {}, "phase ", pill(o.phase, STATE_KIND[o.phase])),
      el("span", {}, "prepared ", el("b", {}, o.prepared ? "yes" : "no")),
      el("span", {}, "tasks ", el("b", { class: "num" }, o.live_tasks)),
      el("span", {}, "instances ", el("b", { class: "num" }, cap.instances[0] + " / " + cap.instances[1])),
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
      return el("tr", { "data-connection": c.name },
        el("td", {}, el("b", {}, c.name)), el("td", {}, prepared),
        el("td", { class: "num" }, c.services), el("td", { class: "num" }, c.instances),
        el("td", { class: "num" }, c.unavailable), el("td", { class: "num" }, c.queries),
        el("td", {}, failures), el("td", { class: "num" }, seconds(c.latency_avg)));
    }));
  }

  function routeFor(connection, service) {
    for (const r of state.overview ? state.overview.routes : []) {
      if (r.connection === connection && r.service === service) return r;
    }
    return null;
  }

  function marks(endpoint) {
    const out = [];
    if (!endpoint) return out;
    if (endpoint.draining) out.push(pill("draining", "warn"));
    if (!endpoint.eligible) out.push(pill("ineligible", "warn"));
    if (endpoint.readiness === "failed") out.push(pill("quarantined", "bad"));
    return out;
  }

  function renderServices() {
    const box = document.getElementById("services");
    const keys = [...state.services.keys()].sort();
    if (!keys.length) { box.replaceChildren(el("p", { class: "dim" }, "nothing observed yet")); return; }
    const now = serverNow();
    box.replaceChildren(...keys.map((key) => {
      const s = state.services.get(key);
      const age = s.confirmed_at === null ? null : Math.max(0, now - s.confirmed_at);
      const fraction = age === null ? 0 : age / s.max_age;
      const ageKind = fraction >= 1 ? "bad" : fraction >= 0.75 ? "warn" : "";
      const route = routeFor(s.connection, s.service);
      const endpoints = new Map((route ? route.endpoints : []).map((e) => [e.identity, e]));
      const status = s.unavailable ? pill("unavailable: " + s.unavailable, "bad")
        : s.degraded ? pill("degraded", "warn") : pill("usable", "ok");
      const rows = s.instances.map((i) => el("tr", { "data-instance": i.identity },
        el("td", {}, i.identity), el("td", { class: "num" }, i.address),
        el("td", { class: "num" }, i.weight), el("td", {}, s.evidence || "–"),
        el("td", {}, bar(fraction, ageKind, seconds(age) + " of " + seconds(s.max_age)), " ",
          el("span", { class: "num dim" }, seconds(age))),
        el("td", { class: "num" }, s.revision), el("td", {}, ...marks(endpoints.get(i.identity)))));
      const listed = new Set(s.instances.map((i) => i.identity));
      for (const e of endpoints.values()) {
        if (!listed.has(e.identity)) {
          rows.push(el("tr", { "data-instance": e.identity, class: "dim" }, el("td", {}, e.identity),
            el("td", {}, "–"), el("td", {}, "–"), el("td", {}, "–"), el("td", {}, "–"),
            el("td", {}, "–"), el("td", {}, ...marks(e))));
        }
      }
      return el("div", { class: "card", "data-service": key },
        el("h3", {}, el("span", {}, s.service), el("span", { class: "meta" }, "on " + s.connection),
          status, el("span", { class: "meta" }, "revision " + s.revision),
          el("span", { class: "meta", "data-count": s.instances.length }, s.instances.length + " instances"),
          s.last_failure ? pill("last failure: " + s.last_failure, "warn") : null),
        el("table", { class: "grid" },
          el("thead", {}, el("tr", {}, ...["instance", "address", "weight", "evidence",
            "age / max_age", "revision", "marks"].map((h) => el("th", {}, h)))),
          el("tbody", {}, ...rows)));
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

  function renderRoutes(list) {
    const box = document.getElementById("routes");
    if (!list.length) { box.replaceChildren(el("p", { class: "dim" }, "no calls routed yet")); return; }
    box.replaceChildren(...list.map((r) => {
      const key = r.connection + "/" + r.service;
      const { delta, total } = shares(key, r);
      return el("div", { class: "card", "data-route": key },
        el("h3", {}, el("span", {}, r.service), el("span", { class: "meta" }, "on " + r.connection),
          el("span", { class: "meta" }, r.calls + " calls"),
          el("span", { class: "meta" }, r.in_flight + " in flight"),
          failedCalls(r.failures),
          r.failed_endpoints ? pill(r.failed_endpoints + " quarantined", "bad") : null),
        el("table", { class: "grid" },
          el("thead", {}, el("tr", {}, ...["endpoint", "in flight", "EWMA", "sent", "failed", "share of recent calls", "marks"]
            .map((h) => el("th", {}, h)))),
          el("tbody", {}, ...r.endpoints.map((e) => {
            const share = total ? (delta.get(e.identity) || 0) / total : 0;
            return el("tr", { "data-endpoint": e.identity },
              el("td", {}, e.identity), el("td", { class: "num" }, e.in_flight),
              el("td", { class: "num" }, e.rtt === null ? "–" : seconds(e.rtt)),
              el("td", { class: "num" }, e.sent),
              el("td", { class: "num" }, e.failed || 0),
              el("td", {}, bar(share, "share"), " ", el("span", { class: "num dim" }, (share * 100).toFixed(0) + "%")),
              el("td", {}, ...marks(e)));
          }))));
    }));
  }

  function render() {
    if (!state.overview) return;
    renderOwner(state.overview);
    renderConnections(state.overview.connections);
    renderServices();
    renderRegistrations(state.overview.registrations);
    renderRoutes(state.overview.routes);
    document.body.setAttribute("data-seq", String(state.seq));
  }

  function apply(message) {
    if (message.type === "full") state.services.clear();
    state.now = message.now; state.receivedAt = Date.now(); state.seq = message.seq;
    state.overview = message.overview;
    for (const [key, value] of Object.entries(message.services)) state.services.set(key, value);
    for (const key of message.removed) state.services.delete(key);
    render();
  }

  function setLink(text, kind) {
    const link = document.getElementById("link");
    link.textContent = text; link.setAttribute("data-state", kind);
  }

  function connect() {
    const url = new URL("ws", window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    url.hash = "";
    const token = new URLSearchParams(window.location.hash.slice(1)).get("token");
    const socket = new WebSocket(url.href);
    socket.onopen = () => {
      if (token) socket.send(JSON.stringify({ token }));
      setLink("live", "live");
    };
    socket.onmessage = (event) => apply(JSON.parse(event.data));
    socket.onclose = () => { setLink("disconnected · retrying", "closed"); setTimeout(connect, 1000); };
  }

  setInterval(renderServices, 1000); // ages move between updates
  connect();
})();
