// The live view: fetch the server-rendered fragment again every few seconds and swap it in.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var source = live.getAttribute("data-fragment");
  var stamp = document.getElementById("live-stamp");
  function refresh() {
    fetch(source, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.text(); })
      .then(function (html) {
        live.innerHTML = html;
        if (stamp) stamp.textContent = "updated " + new Date().toLocaleTimeString();
      })
      .catch(function (e) { if (stamp) stamp.textContent = "not updated: " + e.message; })
      .finally(function () { setTimeout(refresh, 2000); });
  }
  setTimeout(refresh, 2000);
})();
