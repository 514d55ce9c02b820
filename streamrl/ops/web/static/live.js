// The live page: the panel and the chart follow the server-sent events of /events.
// The panel arrives as HTML the server rendered (autoescaped); the chart as numbers.
(function () {
  const panel = document.getElementById("panel");
  const problem = document.getElementById("problem");
  const table = document.querySelector("#versions tbody");
  const box = document.getElementById("chart");
  let plot = null;

  function draw(chart) {
    const data = [chart.versions, chart.mean];
    if (plot === null) {
      plot = new uPlot({
        width: Math.min(box.clientWidth || 800, 900), height: 260,
        legend: { show: false },
        scales: { x: { time: false, auto: false }, y: { range: [0, 1] } },
        axes: [{ label: "policy version", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] },
               { label: "mean reward" }],
        series: [{ label: "version" },
                 { label: "mean reward", stroke: "#2f6fde", width: 2,
                   points: { show: true, size: 7, fill: "#2f6fde" } }],
      }, data, box);
    } else {
      plot.setData(data, false);
    }
    if (chart.versions.length) {  // half a version of margin: one version is a visible point
      const lo = chart.versions[0], hi = chart.versions[chart.versions.length - 1];
      plot.setScale("x", { min: lo - 0.5, max: hi + 0.5 });
    }
    table.replaceChildren(...chart.versions.map((v, i) => {
      const row = document.createElement("tr");
      for (const value of [v, chart.samples[i], chart.mean[i]]) {
        const cell = document.createElement("td");
        cell.textContent = String(value);
        row.appendChild(cell);
      }
      return row;
    }));
    box.dataset.samples = String(chart.samples.reduce((a, b) => a + b, 0));
  }

  function showProblem(text) { problem.textContent = text; problem.hidden = false; }

  draw(JSON.parse(document.getElementById("initial-chart").textContent));
  const events = new EventSource("/events");
  events.addEventListener("live", (event) => {
    const data = JSON.parse(event.data);
    panel.innerHTML = data.panel;
    draw(data.chart);
    problem.hidden = true;
    document.body.dataset.updated = String(data.at);
  });
  events.addEventListener("problem", (event) => {
    showProblem(JSON.parse(event.data).error + " (retrying)");
  });
  events.onerror = () => showProblem("lost the connection to streamrl view (retrying)");
})();
