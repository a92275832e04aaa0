// Set-up for the ipywidgets embed manager on the book's pages (loaded after require.js,
// before html-manager/embed-amd.js).
(function () {
  // The manager resolves its own files (icon fonts) relative to its AMD module path: point that
  // path at the copy served from _static instead of a folder beside the page.
  var root = document.documentElement.dataset.content_root || "./";
  require.config({ paths: { "@jupyter-widgets/html-manager/dist": root + "_static/html-manager" } });

  // The manager typesets widget labels with MathJax 2's MathJax.Hub.Queue; the book loads
  // MathJax 3. Registered before the manager's own DOMContentLoaded handler, so it is in place
  // when the widgets render (deferred MathJax has run by then).
  document.addEventListener("DOMContentLoaded", function () {
    var mj = window.MathJax;
    if (mj && mj.startup && !mj.Hub) {
      mj.Hub = {
        Queue: function (command) {
          var element = command[2];
          mj.startup.promise.then(function () { return mj.typesetPromise([element]); });
        },
      };
    }
  });
})();
