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

  var COLORS = ["#6a1b9a", "#2e7d32", "#c62828", "#1565c0", "#ef6c00", "#00838f", "#6d4c41"];

  function validationColumns(v) {
    // accuracy, then each pass@j / maj@k a pass of k samples per task recorded (in the server's order)
    var names = Object.keys(v).filter(function (k) { return /^(pass|maj)@\d+$/.test(k); });
    var data = [v.version, v.accuracy].concat(names.map(function (k) { return v[k]; }));
    return { data: data, names: names.length ? ["accuracy"].concat(names) : null };
  }

  function draw(el, label, data, xLabel, names) {
    var width = Math.max(300, el.clientWidth - 16);
    names = names || [label];
    if (plots[label] && plots[label].series.length === names.length + 1) { plots[label].setData(data); return; }
    if (plots[label]) { plots[label].destroy(); }  // a pass with new scores (pass@k) adds curves
    plots[label] = new uPlot({
      width: width, height: 220,
      scales: { x: { time: false, range: function (u, min, max) { return FulmenAxes.integerRange(min, max); } } },
      axes: [FulmenAxes.integerAxis(xLabel, width), {}],
      series: [{ label: xLabel }].concat(names.map(function (name, i) {
        return { label: name, stroke: COLORS[i % COLORS.length], width: 2, points: { show: true, size: 4 } };
      })),
    }, data, el);
  }

  function refresh() {
    fetch(source, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (c) {
        var charts = root.querySelectorAll(".chart");
        for (var i = 0; i < charts.length; i++) {
          var el = charts[i], label = el.getAttribute("data-label");
          var validation = label === "validation accuracy" ? validationColumns(c.validation) : null;
          var data = validation ? validation.data : columns(c.steps, c.series[label] || []);
          draw(el, label, data, validation ? "model version" : "step", validation && validation.names);
          FulmenAxes.showNoData(el, data[0].length);
        }
        if (stamp) stamp.textContent = "updated " + new Date().toLocaleTimeString() + ", " + c.steps.length + " steps";
      })
      .catch(function (e) { if (stamp) stamp.textContent = "not updated: " + e.message; })
      .finally(function () { setTimeout(refresh, 5000); });
  }
  refresh();
})();
