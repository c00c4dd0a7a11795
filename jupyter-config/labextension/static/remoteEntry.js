/* gpulab's JupyterLab extension, written by hand (no build step): a launcher card
 * "Train a model" that opens the ready notebook gpulab copies into every person's folder
 * (examples/Train a model.ipynb, see gpulab.extensions.serverext.offer_examples). The server
 * extension puts its path below the server's root in the page config (gpulabTrainNotebook);
 * without it (no such notebook there) there is no card.
 *
 * It is a module-federation container as JupyterLab 4 loads them (its bootstrap calls
 * init(shareScope), then get("./extension")): the launcher's token (ILauncher) and PageConfig
 * are taken from JupyterLab's own shared @jupyterlab/launcher and @jupyterlab/coreutils, so
 * the card lands in the real launcher. */
var _JUPYTERLAB;
(function () {
  "use strict";
  var PAGE_CONFIG_KEY = "gpulabTrainNotebook";
  var COMMAND = "gpulab:train-a-model";
  var ICON = "data:image/svg+xml," + encodeURIComponent(
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24">' +
    '<rect x="1" y="1" width="22" height="22" rx="4" fill="#f37524"/>' +
    '<path d="M5 17l4-5 3 3 5-8 2 2" stroke="#fff" stroke-width="2" fill="none" ' +
    'stroke-linecap="round" stroke-linejoin="round"/></svg>');
  var scope = null;

  function shared(name) {
    // the highest version JupyterLab shares of `name`
    var versions = (scope && scope[name]) || {};
    var keys = Object.keys(versions).sort(function (a, b) {
      var x = a.split(/[.-]/).map(Number), y = b.split(/[.-]/).map(Number);
      for (var i = 0; i < Math.max(x.length, y.length); i++) {
        var d = (x[i] || 0) - (y[i] || 0);
        if (d) return d;
      }
      return 0;
    });
    if (!keys.length) return Promise.reject(new Error("JupyterLab shares no " + name));
    return Promise.resolve(versions[keys[keys.length - 1]].get()).then(function (f) { return f(); });
  }

  function plugin(launcherModule, coreutils) {
    return {
      id: "gpulab-launcher:train-a-model",
      description: "A launcher card that opens gpulab's ready notebook, Train a model.ipynb",
      autoStart: true,
      requires: [launcherModule.ILauncher],
      activate: function (app, launcher) {
        var NOTEBOOK = coreutils.PageConfig.getOption(PAGE_CONFIG_KEY);
        if (!NOTEBOOK) return;
        app.commands.addCommand(COMMAND, {
          label: "Train a model",
          caption: "Open " + NOTEBOOK + ": distributed TensorFlow training on the hub's GPUs",
          execute: function () {
            return app.commands.execute("docmanager:open", { path: NOTEBOOK });
          }
        });
        launcher.add({ command: COMMAND, category: "Notebook", rank: 50, kernelIconUrl: ICON });
      }
    };
  }

  _JUPYTERLAB = window._JUPYTERLAB = window._JUPYTERLAB || {};
  _JUPYTERLAB["gpulab-launcher"] = {
    init: function (shareScope) { scope = shareScope; },
    get: function (module) {
      if (module !== "./extension" && module !== "./index") {
        return Promise.reject(new Error("gpulab-launcher has no module " + module));
      }
      return Promise.all([shared("@jupyterlab/launcher"), shared("@jupyterlab/coreutils")])
        .then(function (modules) {
          var found = plugin(modules[0], modules[1]);
          return function () { return { __esModule: true, default: [found] }; };
        });
    }
  };
})();
