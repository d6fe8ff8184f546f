// The dashboard's only script: while a training job runs, poll its status, step, latest
// metrics and log tail every 2 s. Everything is written with textContent (never as HTML).
"use strict";
(function () {
  const box = document.getElementById("job");
  if (!box || box.dataset.live !== "1") return;
  const set = (id, text) => { const el = document.getElementById(id); if (el) el.textContent = text; };
  async function tick() {
    let data;
    try {
      const r = await fetch(box.dataset.url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!r.ok) return setTimeout(tick, 5000);
      data = await r.json();
    } catch (e) { return setTimeout(tick, 5000); }
    set("job-status", data.status);
    set("job-step", data.step === null ? "—" : String(data.step));
    set("job-log", data.log);
    const body = document.getElementById("job-metrics");
    if (body) {
      body.replaceChildren(...Object.keys(data.metrics).sort().map((k) => {
        const tr = document.createElement("tr");
        // the value as the server prints it (significant digits, app/ui/render.py fmt)
        for (const [text, cls] of [[k, ""], [data.shown[k], "num"]]) {
          const td = document.createElement("td"); td.textContent = text; td.className = cls; tr.appendChild(td);
        }
        return tr;
      }));
    }
    if (data.status === "queued" || data.status === "running") setTimeout(tick, 2000);
  }
  setTimeout(tick, 2000);
})();
