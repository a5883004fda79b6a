// The curves page: uPlot charts from /curves.json, drawn again every few seconds as the run goes on.
(function () {
  "use strict";
  var root = document.getElementById("curves");
  if (!root || typeof uPlot === "undefined") return;
  var source = root.getAttribute("data-source");
  var stamp = document.getElementById("curves-stamp");
  var plots = {};

  function columns(xs, ys) {
    // uPlot wants numbers or null; drop the steps where this curve has no value at all
    var x = [], y = [];
    for (var i = 0; i < xs.length; i++) {
      if (ys[i] !== null && ys[i] !== undefined) { x.push(xs[i]); y.push(ys[i]); }
    }
    return [x, y];
  }

  function draw(el, label, data, xLabel) {
    var width = Math.max(300, el.clientWidth - 16);
    if (plots[label]) { plots[label].setData(data); return; }
    plots[label] = new uPlot({
      width: width, height: 220,
      scales: { x: { time: false, range: function (u, min, max) { return FulmenAxes.integerRange(min, max); } } },
      axes: [FulmenAxes.integerAxis(xLabel, width), {}],
      series: [{ label: xLabel }, { label: label, stroke: "#6a1b9a", width: 2, points: { show: true, size: 4 } }],
    }, data, el);
  }

  function refresh() {
    fetch(source, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (c) {
        var charts = root.querySelectorAll(".chart");
        for (var i = 0; i < charts.length; i++) {
          var el = charts[i], label = el.getAttribute("data-label");
          var data = label === "validation accuracy"
            ? [c.validation.version, c.validation.accuracy]
            : columns(c.steps, c.series[label] || []);
          draw(el, label, data, label === "validation accuracy" ? "model version" : "step");
          FulmenAxes.showNoData(el, data[0].length);
        }
        if (stamp) stamp.textContent = "updated " + new Date().toLocaleTimeString() + ", " + c.steps.length + " steps";
      })
      .catch(function (e) { if (stamp) stamp.textContent = "not updated: " + e.message; })
      .finally(function () { setTimeout(refresh, 5000); });
  }
  refresh();
})();
