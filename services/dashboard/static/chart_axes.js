// The curves' axes: steps and model versions are integers, so their ticks are integers, each once,
// and a panel with no points says so. Plain functions: curves.js uses them, node tests them.
var FulmenAxes = (function () {
  "use strict";
  var STEPS = [1, 2, 5];  // tick spacings 1, 2, 5, 10, 20, 50, ...

  // Integer ticks between min and max, at most maxTicks, spaced 1, 2 or 5 times a power of ten.
  function integerSplits(min, max, maxTicks) {
    if (min === null || max === null || !isFinite(min) || !isFinite(max)) return [];
    var lo = Math.ceil(min), hi = Math.floor(max), limit = Math.max(1, maxTicks || 1), step = 1;
    if (hi < lo) return [];
    for (var scale = 1, found = false; !found; scale *= 10) {
      for (var i = 0; i < STEPS.length && !found; i++) {
        step = STEPS[i] * scale;
        found = Math.floor(hi / step) - Math.ceil(lo / step) + 1 <= limit;
      }
    }
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi; v += step) out.push(v);
    return out;
  }

  // The x range of integer steps: one point gets a step on each side (uPlot would spread it over
  // fractions), none gets 0 to 1.
  function integerRange(min, max) {
    if (min === null || max === null || !isFinite(min) || !isFinite(max)) return [0, 1];
    return min === max ? [min - 1, max + 1] : [min, max];
  }

  // The "no data" note of a panel: shown while it has no point, hidden once it has one.
  function showNoData(el, points) {
    var note = el.querySelector(".no-data");
    if (note) note.hidden = points > 0;
    el.setAttribute("data-points", String(points));
  }

  // uPlot's options for an integer axis (x: steps or model versions) drawn ``width`` pixels wide.
  function integerAxis(label, width) {
    return {
      label: label,
      splits: function (u, axis, min, max) { return integerSplits(min, max, Math.floor(width / 60)); },
      values: function (u, splits) { return splits.map(String); },
    };
  }

  return { integerSplits: integerSplits, integerRange: integerRange, showNoData: showNoData,
           integerAxis: integerAxis };
})();
if (typeof module !== "undefined") module.exports = FulmenAxes;
