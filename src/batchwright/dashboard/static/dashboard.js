// Live pages re-fetch themselves every 2 s and swap in the new <main>: no build step.
(function () {
  const main = document.querySelector("main");
  if (!main || main.dataset.live !== "true") return;
  async function refresh() {
    try {
      const resp = await fetch(location.href, { credentials: "same-origin" });
      if (resp.ok && resp.url === location.href) {
        const doc = new DOMParser().parseFromString(await resp.text(), "text/html");
        const next = doc.querySelector("main");
        if (next) {
          main.innerHTML = next.innerHTML;
          main.dataset.live = next.dataset.live;
        }
      }
    } catch (e) { /* the next tick retries */ }
    if (main.dataset.live === "true") setTimeout(refresh, 2000);
  }
  setTimeout(refresh, 2000);
})();
