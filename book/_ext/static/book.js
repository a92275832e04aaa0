// The book's own behaviour on every page (added by book/_ext/book_html.py).
(function () {
  "use strict";

  // Menu and page-contents buttons. Each page has two `.primary-toggle` buttons (and two
  // `.secondary-toggle`): one in pydata-sphinx-theme's header, which sphinx-book-theme hides,
  // and one in the article's header, the one a reader sees. Both themes bind their handlers
  // with `document.querySelector(selector)`, that is to the first, hidden button only
  // (pydata-sphinx-theme's setupMobileSidebarKeyboardHandlers opens the sidebar as a dialog
  // on a narrow screen; sphinx-book-theme's fixSidebarToggle hides or shows the sidebar on a
  // wide one). A click on any other copy is forwarded to the bound one, so the themes'
  // behaviour is kept as it is, only reachable.
  const LABELS = { ".primary-toggle": "Site navigation", ".secondary-toggle": "On this page" };

  function forwardToggleClicks() {
    for (const [selector, label] of Object.entries(LABELS)) {
      const [bound, ...others] = document.querySelectorAll(selector);
      for (const button of others) {
        if (!button.hasAttribute("aria-label")) button.setAttribute("aria-label", label);
        button.addEventListener("click", function (event) {
          event.preventDefault();
          event.stopPropagation();
          button.blur(); // closes the button's tooltip
          bound.click();
        });
      }
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", forwardToggleClicks);
  } else {
    forwardToggleClicks();
  }

  // A link to a solution (the chapters' "Solution NN.k" links go to `#sol-NN-k`) shows that
  // solution open. sphinx-togglebutton collapses every dropdown when the page loads, so the
  // reader would otherwise land on a column of closed boxes. Whatever collapsed box holds the
  // link's target is opened with its own toggle button (the theme's behaviour, only clicked),
  // on load and whenever the address's #fragment changes.
  function openLinkedTarget() {
    const id = decodeURIComponent(window.location.hash.slice(1));
    const target = id && document.getElementById(id);
    if (!target) return;
    for (let node = target; node; node = node.parentElement) {
      if (node.classList && node.classList.contains("toggle-hidden") && node.id) {
        const button = document.querySelector(`button.toggle-button[data-target="${CSS.escape(node.id)}"]`);
        if (button) button.click();
      }
      if (node.tagName === "DETAILS") node.open = true;
    }
    target.scrollIntoView();
  }

  // The attention explorer (chapter 12) draws its heatmaps as ipywidgets images, which have no
  // alt text of their own: say what each one shows, for images there now and added later.
  const HEATMAP_ALT =
    "Heatmap of attention weights for the chosen text, layer and head: queries down, keys across.";
  function describeWidgetImages(root) {
    for (const img of root.querySelectorAll(".jupyter-widgets img:not([alt])")) img.alt = HEATMAP_ALT;
  }
  function watchWidgetImages() {
    describeWidgetImages(document);
    new MutationObserver(() => describeWidgetImages(document)).observe(document.body, {
      childList: true,
      subtree: true,
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", watchWidgetImages);
  } else {
    watchWidgetImages();
  }

  window.addEventListener("hashchange", openLinkedTarget);
  if (document.readyState === "complete") {
    openLinkedTarget();
  } else {
    window.addEventListener("load", openLinkedTarget);
  }
})();
